//! Batched decode attention on CUDA: one kernel appends every sequence's new key and value to
//! its own cache, one kernel attends every sequence's query over its own cache.
//!
//! The composite path ([`super::model`]) loops over the sequences of a decode step (each has
//! its own [`super::model::KvCache`] of its own length), about ten kernels per sequence and
//! layer: at batch 64 that is thousands of launches per token, and launches, not the GPU, set
//! the speed. Here a step uploads one table of cache pointers, positions and capacities, and
//! each layer runs two kernels whatever the batch size.
//!
//! Kernels are CUDA C compiled at first use with NVRTC (no build step, no header: bf16 is
//! handled as its bits). Only for the no-gradient decode of one token per sequence, bf16 or
//! f32, head_dim dividing 256, and caches short enough for the scores to fit in shared memory;
//! anything else keeps the composite path. `ART_DECODE_KERNEL=0` turns it off.

use candle_core::{DType, Device, Tensor};

use super::error::Result;
use super::switches;

/// The longest cache the attention kernel takes (its scores live in 48 KB of shared memory).
pub(crate) const MAX_LEN: usize = 11_000;

/// The device pointers and positions of one decode step's caches, for every layer.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DecodePlan {
    /// i64 on the device: for layer `l` and row `b`, the key cache at `(2l) * B + b`, the value
    /// cache at `(2l + 1) * B + b`; then each row's position (`layers * 2B + b`) and capacity
    /// (`layers * 2B + B + b`).
    pub table: Tensor,
    pub layers: usize,
    pub batch: usize,
    /// The longest sequence after this step's token.
    pub max_len: usize,
}

/// Whether the fused decode path runs for a model of this device, dtype and head size.
pub(crate) fn available(device: &Device, dtype: DType, head_dim: usize) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && matches!(dtype, DType::BF16 | DType::F32)
        && head_dim > 0
        && head_dim <= 256
        && 256 % head_dim == 0
        && enabled()
}

fn enabled() -> bool {
    switches::DECODE_KERNEL.on()
}

/// The raw device address of a contiguous CUDA tensor's first element.
#[cfg(feature = "cuda")]
pub(crate) fn device_address(t: &Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaStorageSlice as S;
    use candle_core::Storage;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(candle_core::Error::Msg("device_address: not a CUDA tensor".into()).into());
    };
    let stream = cs.device.cuda_stream();
    let (base, size) = match &cs.slice {
        S::BF16(s) => (s.device_ptr(&stream).0, 2),
        S::F32(s) => (s.device_ptr(&stream).0, 4),
        S::I64(s) => (s.device_ptr(&stream).0, 8),
        _ => {
            return Err(candle_core::Error::Msg(
                "device_address: bf16, f32 or i64 tensors only".into(),
            )
            .into())
        }
    };
    Ok(base + (layout.start_offset() * size) as u64)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn device_address(_: &Tensor) -> Result<u64> {
    Err(candle_core::Error::Msg("built without the cuda feature".into()).into())
}

/// Runs the decode step's attention for one layer: writes `k`, `v` (`[B, kv, 1, hd]`) into the
/// caches at each row's position and returns the attention output `[B, H, 1, hd]` for `q`
/// (`[B, H, 1, hd]`, already scaled).
#[cfg(feature = "cuda")]
pub(crate) fn attend(
    plan: &DecodePlan,
    layer: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let (b, h, _, hd) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    let op = DecodeAttention {
        table: plan.table.clone(),
        layer,
        layers: plan.layers,
        batch: plan.batch,
        max_len: plan.max_len,
        heads: h,
        kv_heads: kv,
        head_dim: hd,
    };
    let out = q
        .contiguous()?
        .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
    Ok(out.reshape((b, h, 1, hd))?)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn attend(
    _: &DecodePlan,
    _: usize,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
) -> Result<Tensor> {
    Err(candle_core::Error::Msg("built without the cuda feature".into()).into())
}

/// The decode step of one layer between its projections and the attention: adds the
/// projections' `biases` (q, k, v; none for models without), rotates `q` (`[B, H * hd]`) and `k`
/// (`[B, kv * hd]`) at each row's position with `cos`, `sin` (`[positions, hd / 2]`, every position
/// the kernel takes), writes k and `v` into the caches of `plan` and returns q scaled by `scale`,
/// `[B, H, hd]`: one kernel where the unfused path runs about ten. q, k and v may be column
/// ranges of one product's output (their rows then share a stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_append(
    plan: &DecodePlan,
    layer: usize,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    biases: [Option<&Tensor>; 3],
    (cos, sin): (&Tensor, &Tensor),
    (heads, kv_heads, head_dim): (usize, usize, usize),
    scale: f32,
) -> Result<Tensor> {
    let b = plan.batch;
    let (q, sq) = rows(q, b)?;
    let (k, sk) = rows(k, b)?;
    let (v, sv) = rows(v, b)?;
    if sk != sv {
        return Err(
            candle_core::Error::Msg("rope_append: k and v rows apart differently".into()).into(),
        );
    }
    let biases = biases
        .iter()
        .map(|t| t.map(Tensor::contiguous).transpose())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let address = |t: Option<&Tensor>| t.map_or(Ok(0), device_address);
    let addresses = [
        address(Some(&q))?,
        address(Some(&k))?,
        address(Some(&v))?,
        address(biases[0].as_ref())?,
        address(biases[1].as_ref())?,
        address(biases[2].as_ref())?,
        address(Some(cos))?,
        address(Some(sin))?,
        address(Some(&plan.table))?,
    ];
    let [l, ls, rows, h, kv, hd] = plan.kernel_ints(layer, (heads, kv_heads, head_dim))?;
    let ints = [l, ls, rows, h, kv, hd, int(sq)?, int(sk)?];
    Ok(q.apply_op1_no_bwd(&RawLaunch {
        kernel: "rope_append",
        addresses: &addresses,
        ints: &ints,
        float: scale,
        out_shape: (b, heads, head_dim).into(),
        out_f32: false,
        grid: ((heads + kv_heads) as u32, b as u32, 1),
        threads: (head_dim as u32 / 2).clamp(32, 128),
        shared_bytes: 0,
    })?)
}

/// `t` as `b` rows whose elements are contiguous, and how many elements apart the rows start.
fn rows(t: &Tensor, b: usize) -> Result<(Tensor, usize)> {
    // A column range of a product's output is 2-D already; reshaping it would copy it.
    let t = match t.dims2() {
        Ok((rows, _)) if rows == b => t.clone(),
        _ => t.reshape((b, ()))?,
    };
    let t = if t.stride()[1] == 1 {
        t
    } else {
        t.contiguous()?
    };
    let stride = t.stride()[0];
    Ok((t, stride))
}

/// Rows a decode product takes at most ([`gemv`], [`gemv_swiglu`]); beyond, cuBLAS.
pub(crate) const GEMV_ROWS: usize = 8;

/// Whether [`gemv`] takes `x` (`[M, K]`) times `weights`: at most [`GEMV_ROWS`] rows, one dtype,
/// rows of 16-byte multiples at 16-byte aligned addresses (its vector loads), contiguous.
pub(crate) fn gemv_applies(x: &Tensor, weights: &[&Tensor]) -> bool {
    let Ok((m, k)) = x.dims2() else { return false };
    let aligned = |t: &Tensor| {
        t.is_contiguous()
            && t.dtype() == x.dtype()
            && (k * t.dtype().size_in_bytes()).is_multiple_of(16)
            && device_address(t).is_ok_and(|a| a.is_multiple_of(16))
    };
    switches::DECODE_GEMV.on()
        && m <= GEMV_ROWS
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && aligned(x)
        && weights
            .iter()
            .all(|w| w.dims2().is_ok_and(|(_, kk)| kk == k) && aligned(w))
}

/// One LoRA pair for a decode product: `A` `[r, in]` and `B` `[out, r]`, f32.
pub(crate) type LoraF32 = (Tensor, Tensor);

/// `x` `[M, K]` times up to three weights `[N_s, K]`, side by side: `[M, sum N_s]`, one kernel
/// (plus one for the LoRA down-projections when `lora` is given: each weight's pair, if it has
/// one, and the scale). Check [`gemv_applies`] first.
pub(crate) fn gemv(
    x: &Tensor,
    weights: &[&Tensor],
    lora: Option<(&[Option<LoraF32>], f64)>,
) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    if weights.is_empty() || weights.len() > 3 {
        return Err(candle_core::Error::Msg("gemv: one to three weights".into()).into());
    }
    let n: Vec<usize> = weights
        .iter()
        .map(|w| w.dim(0))
        .collect::<candle_core::Result<_>>()?;
    let total: usize = n.iter().sum();
    let mut w = [0u64; 3];
    let mut widths = [0i32; 3];
    for (i, t) in weights.iter().enumerate() {
        w[i] = device_address(t)?;
        widths[i] = int(n[i])?;
    }
    let down = LoraDown::of(x, lora)?;
    let (xa, b) = (down.xa_address()?, down.b);
    let addresses = [device_address(x)?, w[0], w[1], w[2], xa, b[0], b[1], b[2]];
    let ints = [
        int(m)?,
        int(k)?,
        widths[0],
        widths[1],
        widths[2],
        int(down.rank)?,
    ];
    launch_gemv(x, "gemv", &addresses, &ints, down.scale, (m, total))
}

/// `silu(x gate^T) * (x up^T)` for `x` `[M, K]`, `gate`, `up` `[N, K]`: `[M, N]`, one kernel (plus
/// one for the LoRA down-projections: `lora` holds gate's and up's pairs and the scale).
pub(crate) fn gemv_swiglu(
    x: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    lora: Option<(&[Option<LoraF32>], f64)>,
) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = gate.dim(0)?;
    let down = LoraDown::of(x, lora)?;
    let (xa, b) = (down.xa_address()?, down.b);
    let addresses = [
        device_address(x)?,
        device_address(gate)?,
        device_address(up)?,
        xa,
        b[0],
        b[1],
    ];
    let ints = [int(m)?, int(k)?, int(n)?, int(down.rank)?];
    launch_gemv(x, "gemv_swiglu", &addresses, &ints, down.scale, (m, n))
}

/// Output columns per block of the decode products (one warp each).
const GEMV_WARPS: usize = 4;

/// One of the decode products' kernels: a warp per output column of the `[rows, cols]` output.
fn launch_gemv(
    x: &Tensor,
    kernel: &'static str,
    addresses: &[u64],
    ints: &[i32],
    lora_scale: f32,
    (rows, cols): (usize, usize),
) -> Result<Tensor> {
    Ok(x.apply_op1_no_bwd(&RawLaunch {
        kernel,
        addresses,
        ints,
        float: lora_scale,
        out_shape: (rows, cols).into(),
        out_f32: false,
        grid: (cols.div_ceil(GEMV_WARPS) as u32, 1, 1),
        threads: 32 * GEMV_WARPS as u32,
        shared_bytes: 0,
    })?)
}

/// The rows' products with the LoRA A matrices (`[M, 3r]`, f32), with the B matrices' addresses
/// (0 for a weight without an adapter pair); the tensors stay alive with it, until the product
/// that reads them is launched. Without an adapter: no product, zero addresses, rank 0.
struct LoraDown {
    xa: Option<Tensor>,
    b: [u64; 3],
    rank: usize,
    scale: f32,
    _keep: Vec<Tensor>,
}

impl LoraDown {
    fn of(x: &Tensor, lora: Option<(&[Option<LoraF32>], f64)>) -> Result<LoraDown> {
        match lora {
            Some((pairs, scale)) => lora_down(x, pairs, scale),
            None => Ok(LoraDown {
                xa: None,
                b: [0; 3],
                rank: 0,
                scale: 0.0,
                _keep: Vec::new(),
            }),
        }
    }

    fn xa_address(&self) -> Result<u64> {
        self.xa.as_ref().map_or(Ok(0), device_address)
    }
}

fn lora_down(x: &Tensor, pairs: &[Option<LoraF32>], scale: f64) -> Result<LoraDown> {
    let (m, k) = x.dims2()?;
    let mut a = [0u64; 3];
    let mut b = [0u64; 3];
    let mut rank = 0;
    let mut keep = Vec::new();
    for (i, pair) in pairs.iter().enumerate().take(3) {
        let Some((pa, pb)) = pair else { continue };
        let (pa, pb) = (pa.contiguous()?, pb.contiguous()?);
        if pa.dtype() != DType::F32 || pb.dtype() != DType::F32 {
            return Err(candle_core::Error::Msg("gemv: LoRA pairs must be f32".into()).into());
        }
        let r = pa.dim(0)?;
        if rank != 0 && r != rank {
            return Err(
                candle_core::Error::Msg("gemv: LoRA pairs of different ranks".into()).into(),
            );
        }
        rank = r;
        a[i] = device_address(&pa)?;
        b[i] = device_address(&pb)?;
        keep.extend([pa, pb]);
    }
    let addresses = [device_address(x)?, a[0], a[1], a[2]];
    let ints = [int(m)?, int(k)?, int(rank)?];
    let xa = x.apply_op1_no_bwd(&RawLaunch {
        kernel: "lora_down",
        addresses: &addresses,
        ints: &ints,
        float: 0.0,
        out_shape: (m, 3 * rank.max(1)).into(),
        out_f32: true,
        grid: ((3 * rank).div_ceil(GEMV_WARPS).max(1) as u32, 1, 1),
        threads: 32 * GEMV_WARPS as u32,
        shared_bytes: 0,
    })?;
    Ok(LoraDown {
        xa: Some(xa),
        b,
        rank,
        scale: scale as f32,
        _keep: keep,
    })
}

/// Attention of each row's query (`[B, H, hd]`, rotated and scaled) over its cache, the new
/// token already written: `[B, H * hd]`. Split along the cache in [`SPLITS`] parts (one block
/// each per head and row), then combined: two kernels.
pub(crate) fn attend_cached(
    plan: &DecodePlan,
    layer: usize,
    q: &Tensor,
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Result<Tensor> {
    let b = plan.batch;
    if !attend_cached_takes(head_dim) {
        return Err(candle_core::Error::Msg(format!(
            "decode attention: head size {head_dim} not supported"
        ))
        .into());
    }
    let q = q.contiguous()?;
    let addresses = [device_address(&q)?, device_address(&plan.table)?];
    let ints = plan.kernel_ints(layer, (heads, kv_heads, head_dim))?;
    let parts = q.apply_op1_no_bwd(&RawLaunch {
        kernel: "attend_split",
        addresses: &addresses,
        ints: &ints,
        float: 0.0,
        out_shape: (b, heads, SPLITS, head_dim + 2).into(),
        out_f32: true,
        grid: (heads as u32, b as u32, SPLITS as u32),
        threads: SPLIT_THREADS,
        shared_bytes: 0,
    })?;
    let addresses = [device_address(&parts)?];
    Ok(q.apply_op1_no_bwd(&RawLaunch {
        kernel: "attend_combine",
        addresses: &addresses,
        ints: &[int(heads)?, int(head_dim)?],
        float: 0.0,
        out_shape: (b, heads * head_dim).into(),
        out_f32: false,
        grid: (heads as u32, b as u32, 1),
        threads: (head_dim as u32).max(32),
        shared_bytes: 0,
    })?)
}

/// Whether [`attend_cached`] takes heads of `head_dim` (one thread per element).
pub(crate) fn attend_cached_takes(head_dim: usize) -> bool {
    head_dim > 0 && head_dim <= SPLIT_THREADS as usize && head_dim.is_multiple_of(2)
}

/// Parts of the cache the decode attention splits each row's into (`SPLITS` in the kernels).
const SPLITS: usize = 16;
/// Threads per block of the split attention (`SPLIT_THREADS` in the kernels).
const SPLIT_THREADS: u32 = 128;

/// `x + y` and the RMS norm of it with `weight`, for rows `[.., d]` of one dtype, in one pass:
/// `(sum, normed)`. The residual add of one block and the norm that starts the next.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (x, y, weight) = (x.contiguous()?, y.contiguous()?, weight.contiguous()?);
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    let addresses = [
        device_address(&x)?,
        device_address(&y)?,
        device_address(&weight)?,
    ];
    let both = x.apply_op1_no_bwd(&RawLaunch {
        kernel: "add_rms_norm",
        addresses: &addresses,
        ints: &[int(rows)?, int(d)?],
        float: eps as f32,
        out_shape: (2, rows, d).into(),
        out_f32: false,
        grid: (rows as u32, 1, 1),
        threads: 256,
        shared_bytes: 0,
    })?;
    let shape = x.shape().clone();
    Ok((both.get(0)?.reshape(&shape)?, both.get(1)?.reshape(shape)?))
}

fn int(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        candle_core::Error::Msg(format!("{n} is too large for a decode kernel")).into()
    })
}

impl DecodePlan {
    /// Each row's position (of the token being decoded), i64 `[B]`, on the device.
    pub(crate) fn positions(&self) -> Result<Tensor> {
        Ok(self
            .table
            .narrow(0, 2 * self.layers * self.batch, self.batch)?)
    }

    /// The arguments every decode kernel of one layer starts with: the layer, the layer
    /// count, the batch, and the query heads, key/value heads and head size.
    fn kernel_ints(
        &self,
        layer: usize,
        (heads, kv_heads, head_dim): (usize, usize, usize),
    ) -> Result<[i32; 6]> {
        if layer >= self.layers {
            return Err(candle_core::Error::Msg(format!(
                "decode plan: layer {layer} of {}",
                self.layers
            ))
            .into());
        }
        Ok([
            int(layer)?,
            int(self.layers)?,
            int(self.batch)?,
            int(heads)?,
            int(kv_heads)?,
            int(head_dim)?,
        ])
    }
}

/// One launch of `art_{kernel}_{bf16|f32}(out, addresses..., ints..., float)`, the dtype and
/// device those of the tensor it is applied to; `out` is allocated with `out_shape`. The
/// addresses are of contiguous tensors that the caller keeps alive across the launch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RawLaunch<'a> {
    kernel: &'static str,
    addresses: &'a [u64],
    ints: &'a [i32],
    float: f32,
    out_shape: candle_core::Shape,
    /// The output is f32 whatever the input's dtype.
    out_f32: bool,
    grid: (u32, u32, u32),
    threads: u32,
    shared_bytes: u32,
}

impl candle_core::CustomOp1 for RawLaunch<'_> {
    fn name(&self) -> &'static str {
        self.kernel
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("{} runs on CUDA only", self.kernel)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::cuda_backend::cudarc::driver::{
            CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};

        let dev = storage.device.clone();
        let suffix = match &storage.slice {
            S::BF16(_) => "bf16",
            S::F32(_) => "f32",
            _ => candle_core::bail!("{}: bf16 or f32 only", self.kernel),
        };
        let func = dev
            .get_or_load_custom_func(&format!("art_{}_{suffix}", self.kernel), MODULE, ptx()?)?
            .into_cuda_function();
        let n = self.out_shape.elem_count();
        fn run<T: DeviceRepr>(
            op: &RawLaunch<'_>,
            dev: &candle_core::CudaDevice,
            func: &CudaFunction,
            n: usize,
        ) -> candle_core::Result<CudaSlice<T>> {
            // SAFETY: uninitialised; every decode kernel writes all of its output.
            let out = unsafe { dev.alloc::<T>(n.max(1))? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(func);
            builder.arg(&out);
            for a in op.addresses {
                builder.arg(a);
            }
            for i in op.ints {
                builder.arg(i);
            }
            builder.arg(&op.float);
            let cfg = LaunchConfig {
                grid_dim: op.grid,
                block_dim: (op.threads, 1, 1),
                shared_mem_bytes: op.shared_bytes,
            };
            // SAFETY: the addresses are of live, contiguous tensors of this dtype whose extents
            // the wrapper derived the integers from, and the kernel writes within `out`.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(out)
        }
        let slice = match &storage.slice {
            S::BF16(_) if !self.out_f32 => S::BF16(run::<half::bf16>(self, &dev, &func, n)?),
            _ => S::F32(run::<f32>(self, &dev, &func, n)?),
        };
        Ok((
            candle_core::CudaStorage { slice, device: dev },
            self.out_shape.clone(),
        ))
    }
}

/// The CUDA C that every NVRTC module here starts with: bf16 as its bits, `ld` and `st`
/// converting f32 and bf16 to and from f32 (round to nearest even), and warp and block
/// reductions.
#[cfg(feature = "cuda")]
macro_rules! cuda_prelude {
    () => {
        r#"
typedef unsigned short bf16_t;
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16_t* p) { return __uint_as_float(((unsigned)*p) << 16); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16_t* p, float v) {
  unsigned u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (bf16_t)(u >> 16);
}

// Sum / max over the warp; every lane gets the result.
__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum / max over the block; every thread gets the result. `red` holds 32 floats.
__device__ float block_sum(float x, float* red) {
  x = warp_sum(x);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < nw; ++i) s += red[i];
  return s;
}
__device__ float block_max(float x, float* red) {
  x = warp_max(x);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float m = red[0];
  for (int i = 1; i < nw; ++i) m = fmaxf(m, red[i]);
  return m;
}
"#
    };
}
#[cfg(feature = "cuda")]
pub(crate) use cuda_prelude;

#[cfg(feature = "cuda")]
const SOURCE: &str = concat!(
    cuda_prelude!(),
    r#"

// grid (kv, B), block >= 32 threads.
template <typename T>
__device__ void append_impl(const T* k, const T* v, const long long* table, int layer,
                            int layers, int B, int kv, int hd) {
  int b = blockIdx.y, h = blockIdx.x;
  T* kc = (T*)table[(2 * layer) * B + b];
  T* vc = (T*)table[(2 * layer + 1) * B + b];
  long long pos = table[2 * layers * B + b];
  long long cap = table[2 * layers * B + B + b];
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    unsigned long long src = ((unsigned long long)b * kv + h) * hd + d;
    unsigned long long dst = ((unsigned long long)h * cap + pos) * hd + d;
    kc[dst] = k[src];
    vc[dst] = v[src];
  }
}

// grid (H, B), block 256 threads; dynamic shared memory (hd + 32 + 256 + max_len) floats.
template <typename T>
__device__ void attn_impl(const T* q, T* out, const long long* table, int layer, int layers,
                          int B, int H, int kv, int hd) {
  extern __shared__ float smem[];
  int b = blockIdx.y, h = blockIdx.x;
  int tid = threadIdx.x, nt = blockDim.x;
  int kvh = h / (H / kv);
  long long cap = table[2 * layers * B + B + b];
  int len = (int)table[2 * layers * B + b] + 1;
  const T* kb = (const T*)table[(2 * layer) * B + b] + (unsigned long long)kvh * cap * hd;
  const T* vb = (const T*)table[(2 * layer + 1) * B + b] + (unsigned long long)kvh * cap * hd;
  float* qs = smem;
  float* red = qs + hd;
  float* part = red + 32;
  float* sc = part + nt;
  const T* qp = q + ((unsigned long long)b * H + h) * hd;
  for (int d = tid; d < hd; d += nt) qs[d] = ld(qp + d);
  __syncthreads();
  int warp = tid / 32, lane = tid % 32, nw = nt / 32;
  for (int t = warp; t < len; t += nw) {
    const T* kr = kb + (unsigned long long)t * hd;
    float s = 0.f;
    for (int d = lane; d < hd; d += 32) s += qs[d] * ld(kr + d);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sc[t] = s;
  }
  __syncthreads();
  float m = __int_as_float(0xff800000);
  for (int t = tid; t < len; t += nt) m = fmaxf(m, sc[t]);
  m = block_max(m, red);
  float sum = 0.f;
  for (int t = tid; t < len; t += nt) {
    float e = __expf(sc[t] - m);
    sc[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  __syncthreads();
  int groups = nt / hd, g = tid / hd, d = tid % hd;
  float acc = 0.f;
  for (int t = g; t < len; t += groups) acc += sc[t] * ld(vb + (unsigned long long)t * hd + d);
  part[tid] = acc;
  __syncthreads();
  if (tid < hd) {
    float s = 0.f;
    for (int i = 0; i < groups; ++i) s += part[i * hd + tid];
    st(out + ((unsigned long long)b * H + h) * hd + tid, s / sum);
  }
}

template <typename T> __device__ __forceinline__ float rounded(float v) {
  T t;
  st(&t, v);
  return ld(&t);
}

// The attention block's step between its projections and the attention itself, for one token
// per sequence: the projections' biases added (null when none), the rotary embedding applied
// to q and k at each row's position (cos and sin tables [positions, hd/2]), q scaled into
// `qout` ([B, H, hd]), k and v written into the row's caches. Rows of q are `sq` apart, of k and v
// `skv` (one product's outputs side by side, or three of their own). Each intermediate is rounded to T
// as the unfused path stores it. Grid (H + kv, B): blocks < H do a query head, the rest a
// key/value head.
template <typename T>
__device__ void rope_append_impl(T* qout, const T* q, const T* k, const T* v, const T* bq,
                                 const T* bk, const T* bv, const T* cosb, const T* sinb,
                                 const long long* table, int layer, int layers, int B, int H,
                                 int kv, int hd, int sq, int skv, float scale) {
  int b = blockIdx.y, head = blockIdx.x, half = hd / 2;
  long long pos = table[2 * layers * B + b];
  long long cap = table[2 * layers * B + B + b];
  const T* cs = cosb + pos * half;
  const T* sn = sinb + pos * half;
  if (head < H) {
    const T* src = q + (size_t)b * sq + (size_t)head * hd;
    const T* bias = bq ? bq + (size_t)head * hd : 0;
    T* dst = qout + ((size_t)b * H + head) * hd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      float x1 = ld(src + i), x2 = ld(src + i + half);
      if (bias) {
        x1 = rounded<T>(x1 + ld(bias + i));
        x2 = rounded<T>(x2 + ld(bias + i + half));
      }
      float c = ld(cs + i), s = ld(sn + i);
      st(dst + i, rounded<T>(x1 * c - x2 * s) * scale);
      st(dst + i + half, rounded<T>(x2 * c + x1 * s) * scale);
    }
  } else {
    int h = head - H;
    const T* ks = k + (size_t)b * skv + (size_t)h * hd;
    const T* vs = v + (size_t)b * skv + (size_t)h * hd;
    T* kc = (T*)table[(2 * layer) * B + b] + ((size_t)h * cap + pos) * hd;
    T* vc = (T*)table[(2 * layer + 1) * B + b] + ((size_t)h * cap + pos) * hd;
    const T* kb = bk ? bk + (size_t)h * hd : 0;
    const T* vb = bv ? bv + (size_t)h * hd : 0;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      float x1 = ld(ks + i), x2 = ld(ks + i + half);
      if (kb) {
        x1 = rounded<T>(x1 + ld(kb + i));
        x2 = rounded<T>(x2 + ld(kb + i + half));
      }
      float c = ld(cs + i), s = ld(sn + i);
      st(kc + i, x1 * c - x2 * s);
      st(kc + i + half, x2 * c + x1 * s);
      float v1 = ld(vs + i), v2 = ld(vs + i + half);
      if (vb) {
        v1 += ld(vb + i);
        v2 += ld(vb + i + half);
      }
      st(vc + i, v1);
      st(vc + i + half, v2);
    }
  }
}

// A residual add and the next RMS norm in one pass over row blockIdx.x of [rows, d]:
// out[0] = x + y (rounded to T, the new residual stream), out[1] = rms_norm(out[0]) * w.
template <typename T>
__device__ void add_rms_norm_impl(T* out, const T* x, const T* y, const T* w, int rows, int d,
                                  float eps) {
  __shared__ float red[32];
  size_t row = (size_t)blockIdx.x * d;
  T* sum = out + row;
  T* normed = out + (size_t)rows * d + row;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float s = rounded<T>(ld(x + row + i) + ld(y + row + i));
    st(sum + i, s);
    ss += s * s;
  }
  float r = rsqrtf(block_sum(ss, red) / d + eps);
  // Each thread reads back only what it wrote above.
  for (int i = threadIdx.x; i < d; i += blockDim.x) st(normed + i, ld(sum + i) * r * ld(w + i));
}

// Products of a few rows (a decode step of up to GEMV_ROWS sequences) with weights [N, K]:
// one warp per output column reads the weight row once, 16 bytes per lane per load, for all the
// rows at once. cuBLAS's kernels for these shapes take 2-3x the time the bytes need.
#define GEMV_ROWS 8

__device__ __forceinline__ void load16(const bf16_t* p, float* f) {
  uint4 u = *(const uint4*)p;
  unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load16(const float* p, float* f) {
  float4 u = *(const float4*)p;
  f[0] = u.x; f[1] = u.y; f[2] = u.z; f[3] = u.w;
}

// acc[m] = x[m, :] . w[:] for m < M, summed over the warp (every lane gets it).
template <typename T>
__device__ __forceinline__ void warp_dots(const T* x, int K, const T* w, int M, float* acc) {
  const int V = 16 / sizeof(T);
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) acc[m] = 0.f;
  for (int k = lane * V; k < K; k += 32 * V) {
    float wf[V];
    load16(w + k, wf);
#pragma unroll
    for (int m = 0; m < GEMV_ROWS; ++m) {
      if (m < M) {
        float xf[V];
        load16(x + (size_t)m * K + k, xf);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[m] += wf[i] * xf[i];
      }
    }
  }
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) acc[m] = warp_sum(acc[m]);
}

// The LoRA update of output column n: scale * xa[m, off:off+r] . b[n, :] (f32), per row.
__device__ __forceinline__ void lora_up(const float* xa, int lda, int off, const float* b, int n,
                                        int r, int M, float scale, float* delta) {
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) {
    float t = 0.f;
    if (m < M)
      for (int j = lane; j < r; j += 32) t += xa[m * lda + off + j] * b[(size_t)n * r + j];
    delta[m] = scale * warp_sum(t);
  }
}

// y [M, n0 + n1 + n2] = x [M, K] times the weights w0 [n0, K], w1, w2 side by side, plus each
// one's LoRA update when xa (the rows' products with the A matrices, [M, 3r] f32) is given and
// the segment has its B (f32 [n_s, r]). As the unfused path, the product and the update are each
// rounded to T before they are added.
template <typename T>
__device__ void gemv_impl(T* y, const T* x, int M, int K, const T* w0, const T* w1, const T* w2,
                          int n0, int n1, int n2, const float* xa, const float* b0,
                          const float* b1, const float* b2, int r, float scale) {
  int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int ntot = n0 + n1 + n2;
  if (col >= ntot) return;  // whole warps: no block-wide synchronisation below
  int s = col < n0 ? 0 : (col < n0 + n1 ? 1 : 2);
  int n = col - (s > 0 ? n0 : 0) - (s > 1 ? n1 : 0);
  const T* w = (s == 0 ? w0 : (s == 1 ? w1 : w2)) + (size_t)n * K;
  float acc[GEMV_ROWS], delta[GEMV_ROWS];
  warp_dots(x, K, w, M, acc);
  const float* b = s == 0 ? b0 : (s == 1 ? b1 : b2);
  bool lora = xa && b;
  if (lora) lora_up(xa, 3 * r, s * r, b, n, r, M, scale, delta);
  if (threadIdx.x % 32 == 0)
    for (int m = 0; m < M; ++m) {
      float v = rounded<T>(acc[m]);
      if (lora) v += rounded<T>(delta[m]);
      st(y + (size_t)m * ntot + col, v);
    }
}

// hidden [M, n] = silu(x . gate) * (x . up) for gate and up [n, K], each with its LoRA update
// (segments 0 and 1 of xa); the two products rounded to T first, as the unfused path stores them.
template <typename T>
__device__ void gemv_swiglu_impl(T* y, const T* x, int M, int K, const T* wg, const T* wu, int n,
                                 const float* xa, const float* bg, const float* bu, int r,
                                 float scale) {
  int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (col >= n) return;
  float g[GEMV_ROWS], u[GEMV_ROWS], dg[GEMV_ROWS], du[GEMV_ROWS];
  warp_dots(x, K, wg + (size_t)col * K, M, g);
  warp_dots(x, K, wu + (size_t)col * K, M, u);
  bool lg = xa && bg, lu = xa && bu;
  if (lg) lora_up(xa, 3 * r, 0, bg, col, r, M, scale, dg);
  if (lu) lora_up(xa, 3 * r, r, bu, col, r, M, scale, du);
  if (threadIdx.x % 32 == 0)
    for (int m = 0; m < M; ++m) {
      float a = rounded<T>(g[m]), c = rounded<T>(u[m]);
      if (lg) a = rounded<T>(a + rounded<T>(dg[m]));
      if (lu) c = rounded<T>(c + rounded<T>(du[m]));
      st(y + (size_t)m * n + col, a / (1.f + __expf(-a)) * c);
    }
}

// xa [M, 3r] (f32) = x [M, K] times the LoRA A matrices a0, a1, a2 ([r, K] f32; null ones give
// zeros): one warp per column.
template <typename T>
__device__ void lora_down_impl(float* xa, const T* x, int M, int K, const float* a0,
                               const float* a1, const float* a2, int r) {
  int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (col >= 3 * r) return;
  const float* a = col < r ? a0 : (col < 2 * r ? a1 : a2);
  float acc[GEMV_ROWS];
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) acc[m] = 0.f;
  if (a) {
    a += (size_t)(col % r) * K;
    for (int k = lane; k < K; k += 32) {
      float av = a[k];
#pragma unroll
      for (int m = 0; m < GEMV_ROWS; ++m)
        if (m < M) acc[m] += ld(x + (size_t)m * K + k) * av;
    }
  }
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) acc[m] = warp_sum(acc[m]);
  if (lane == 0)
    for (int m = 0; m < M; ++m) xa[m * 3 * r + col] = acc[m];
}

// Attention of one token per sequence split along the cache (flash-decoding): block (h, b, c)
// takes the c-th of SPLITS equal parts of row b's cache for query head h and writes its part's
// maximum score, weight sum and weighted value sum (f32, [B, H, SPLITS, hd + 2]); the combine
// kernel rescales and adds the parts. At batch 1 the single-block kernel kept 14 of 132 SMs busy.
#define SPLITS 16
#define SPLIT_THREADS 128
template <typename T>
__device__ void attend_split_impl(float* part, const T* q, const long long* table, int layer,
                                  int layers, int B, int H, int kv, int hd) {
  __shared__ float qs[256];
  __shared__ float red[32];
  __shared__ float sc[(11000 + SPLITS - 1) / SPLITS];
  __shared__ float acc_part[SPLIT_THREADS];
  int h = blockIdx.x, b = blockIdx.y, c = blockIdx.z;
  int tid = threadIdx.x, nt = blockDim.x;
  int kvh = h / (H / kv);
  long long cap = table[2 * layers * B + B + b];
  int len = (int)table[2 * layers * B + b] + 1;
  int chunk = (len + SPLITS - 1) / SPLITS;
  int t0 = min(len, c * chunk), t1 = min(len, t0 + chunk);
  const T* kb = (const T*)table[(2 * layer) * B + b] + (size_t)kvh * cap * hd;
  const T* vb = (const T*)table[(2 * layer + 1) * B + b] + (size_t)kvh * cap * hd;
  const T* qp = q + ((size_t)b * H + h) * hd;
  for (int d = tid; d < hd; d += nt) qs[d] = ld(qp + d);
  __syncthreads();
  int warp = tid / 32, lane = tid % 32, nw = nt / 32;
  for (int t = t0 + warp; t < t1; t += nw) {
    const T* kr = kb + (size_t)t * hd;
    float s = 0.f;
    for (int d = lane; d < hd; d += 32) s += qs[d] * ld(kr + d);
    s = warp_sum(s);
    if (lane == 0) sc[t - t0] = s;
  }
  __syncthreads();
  float m = __int_as_float(0xff800000);
  for (int t = tid; t < t1 - t0; t += nt) m = fmaxf(m, sc[t]);
  m = block_max(m, red);
  float sum = 0.f;
  for (int t = tid; t < t1 - t0; t += nt) {
    float e = t1 > t0 ? __expf(sc[t] - m) : 0.f;
    sc[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  __syncthreads();
  int groups = nt / hd, g = tid / hd, d = tid % hd;
  float acc = 0.f;
  if (g < groups)
    for (int t = t0 + g; t < t1; t += groups) acc += sc[t - t0] * ld(vb + (size_t)t * hd + d);
  acc_part[tid] = acc;
  __syncthreads();
  float* out = part + (((size_t)b * H + h) * SPLITS + c) * (hd + 2);
  for (int e = tid; e < hd; e += nt) {
    float a = 0.f;
    for (int i = 0; i < groups; ++i) a += acc_part[i * hd + e];
    out[e] = a;
  }
  if (tid == 0) {
    out[hd] = m;
    out[hd + 1] = sum;
  }
}

// out [B, H, hd] from the parts: grid (H, B), hd threads.
template <typename T>
__device__ void attend_combine_impl(T* out, const float* part, int H, int hd) {
  int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const float* p = part + ((size_t)b * H + h) * SPLITS * (hd + 2);
  float m = __int_as_float(0xff800000);
  for (int c = 0; c < SPLITS; ++c)
    if (p[c * (hd + 2) + hd + 1] > 0.f) m = fmaxf(m, p[c * (hd + 2) + hd]);
  float l = 0.f, a = 0.f;
  for (int c = 0; c < SPLITS; ++c) {
    const float* q = p + c * (hd + 2);
    if (q[hd + 1] > 0.f) {
      float w = __expf(q[hd] - m);
      l += q[hd + 1] * w;
      if (d < hd) a += q[d] * w;
    }
  }
  if (d < hd) st(out + ((size_t)b * H + h) * hd + d, a / l);
}

#define PTR(T, p) ((const T*)(p))
#define DECODE_EXPORTS(suffix, T)                                                              \
  extern "C" __global__ void art_rope_append_##suffix(                                         \
      T* out, unsigned long long q, unsigned long long k, unsigned long long v,                \
      unsigned long long bq, unsigned long long bk, unsigned long long bv,                     \
      unsigned long long cs, unsigned long long sn, unsigned long long table, int layer,       \
      int layers, int B, int H, int kv, int hd, int sq, int skv, float scale) {                \
    rope_append_impl<T>(out, PTR(T, q), PTR(T, k), PTR(T, v), PTR(T, bq), PTR(T, bk),           \
                        PTR(T, bv), PTR(T, cs), PTR(T, sn), (const long long*)table, layer,    \
                        layers, B, H, kv, hd, sq, skv, scale);                                 \
  }                                                                                            \
  extern "C" __global__ void art_add_rms_norm_##suffix(                                        \
      T* out, unsigned long long x, unsigned long long y, unsigned long long w, int rows,      \
      int d, float eps) {                                                                      \
    add_rms_norm_impl<T>(out, PTR(T, x), PTR(T, y), PTR(T, w), rows, d, eps);                  \
  }                                                                                            \
  extern "C" __global__ void art_gemv_##suffix(                                                \
      T* out, unsigned long long x, unsigned long long w0, unsigned long long w1,              \
      unsigned long long w2, unsigned long long xa, unsigned long long b0,                     \
      unsigned long long b1, unsigned long long b2, int M, int K, int n0, int n1, int n2,      \
      int r, float scale) {                                                                    \
    gemv_impl<T>(out, PTR(T, x), M, K, PTR(T, w0), PTR(T, w1), PTR(T, w2), n0, n1, n2,          \
                 PTR(float, xa), PTR(float, b0), PTR(float, b1), PTR(float, b2), r, scale);     \
  }                                                                                            \
  extern "C" __global__ void art_gemv_swiglu_##suffix(                                         \
      T* out, unsigned long long x, unsigned long long wg, unsigned long long wu,              \
      unsigned long long xa, unsigned long long bg, unsigned long long bu, int M, int K,       \
      int n, int r, float scale) {                                                             \
    gemv_swiglu_impl<T>(out, PTR(T, x), M, K, PTR(T, wg), PTR(T, wu), n, PTR(float, xa),        \
                        PTR(float, bg), PTR(float, bu), r, scale);                             \
  }                                                                                            \
  extern "C" __global__ void art_lora_down_##suffix(                                           \
      float* out, unsigned long long x, unsigned long long a0, unsigned long long a1,          \
      unsigned long long a2, int M, int K, int r, float unused) {                              \
    lora_down_impl<T>(out, PTR(T, x), M, K, PTR(float, a0), PTR(float, a1), PTR(float, a2), r); \
  }                                                                                            \
  extern "C" __global__ void art_attend_split_##suffix(                                        \
      float* out, unsigned long long q, unsigned long long table, int layer, int layers,       \
      int B, int H, int kv, int hd, float unused) {                                            \
    attend_split_impl<T>(out, PTR(T, q), (const long long*)table, layer, layers, B, H, kv, hd); \
  }                                                                                            \
  extern "C" __global__ void art_attend_combine_##suffix(                                      \
      T* out, unsigned long long part, int H, int hd, float unused) {                          \
    attend_combine_impl<T>(out, PTR(float, part), H, hd);                                      \
  }
DECODE_EXPORTS(bf16, bf16_t)
DECODE_EXPORTS(f32, float)

extern "C" __global__ void art_kv_append_bf16(const bf16_t* k, const bf16_t* v,
    const long long* table, int layer, int layers, int B, int kv, int hd) {
  append_impl(k, v, table, layer, layers, B, kv, hd);
}
extern "C" __global__ void art_kv_append_f32(const float* k, const float* v,
    const long long* table, int layer, int layers, int B, int kv, int hd) {
  append_impl(k, v, table, layer, layers, B, kv, hd);
}
extern "C" __global__ void art_decode_attn_bf16(const bf16_t* q, bf16_t* out,
    const long long* table, int layer, int layers, int B, int H, int kv, int hd) {
  attn_impl(q, out, table, layer, layers, B, H, kv, hd);
}
extern "C" __global__ void art_decode_attn_f32(const float* q, float* out,
    const long long* table, int layer, int layers, int B, int H, int kv, int hd) {
  attn_impl(q, out, table, layer, layers, B, H, kv, hd);
}
"#
);

#[cfg(feature = "cuda")]
const MODULE: &str = "art_decode";
/// Threads per block of the attention kernel.
#[cfg(feature = "cuda")]
const THREADS: u32 = 256;

/// PTX compiled once per process.
#[cfg(feature = "cuda")]
pub(crate) type PtxCell = std::sync::OnceLock<std::result::Result<String, String>>;

/// `source`'s PTX, compiled by NVRTC the first time and kept in `cell` (an error too: it would
/// not compile the second time either). `what` names the kernels in the error.
#[cfg(feature = "cuda")]
pub(crate) fn nvrtc_ptx(
    cell: &'static PtxCell,
    source: &str,
    what: &str,
) -> candle_core::Result<&'static str> {
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    cell.get_or_init(|| {
        let opts = CompileOptions {
            arch: Some("compute_90"),
            ..Default::default()
        };
        compile_ptx_with_opts(source, opts)
            .map(|p| p.to_src())
            .map_err(|e| format!("NVRTC could not compile {what}: {e}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// The kernels' PTX, compiled once per process.
#[cfg(feature = "cuda")]
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: PtxCell = PtxCell::new();
    nvrtc_ptx(&PTX, SOURCE, "the decode kernels")
}

#[cfg(feature = "cuda")]
struct DecodeAttention {
    table: Tensor,
    layer: usize,
    layers: usize,
    batch: usize,
    max_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "art-decode-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("art-decode-attention runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
        ks: &candle_core::CudaStorage,
        kl: &candle_core::Layout,
        vs: &candle_core::CudaStorage,
        vl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::cuda_backend::cudarc::driver::{
            CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
        use candle_core::{CudaDevice, Storage};

        let (table_storage, table_layout) = self.table.storage_and_layout();
        let Storage::Cuda(ts) = &*table_storage else {
            candle_core::bail!("decode attention: the table is not on the GPU")
        };
        let S::I64(table) = &ts.slice else {
            candle_core::bail!("decode attention: the table must be i64")
        };
        let table = table.slice(table_layout.start_offset()..);
        let dev = qs.device.clone();
        let ptx = ptx()?;
        let (b, h, kv, hd) = (self.batch, self.heads, self.kv_heads, self.head_dim);
        let ints = [
            self.layer as i32,
            self.layers as i32,
            b as i32,
            h as i32,
            kv as i32,
            hd as i32,
        ];

        #[allow(clippy::too_many_arguments)]
        fn run<T: DeviceRepr>(
            dev: &CudaDevice,
            ptx: &str,
            suffix: &str,
            q: (&CudaSlice<T>, &candle_core::Layout),
            k: (&CudaSlice<T>, &candle_core::Layout),
            v: (&CudaSlice<T>, &candle_core::Layout),
            table: &CudaView<'_, i64>,
            ints: [i32; 6],
            max_len: usize,
        ) -> candle_core::Result<CudaSlice<T>> {
            fn view<'a, T>(
                (s, l): (&'a CudaSlice<T>, &candle_core::Layout),
            ) -> candle_core::Result<CudaView<'a, T>> {
                match l.contiguous_offsets() {
                    Some((a, z)) => Ok(s.slice(a..z)),
                    None => candle_core::bail!("decode attention: inputs must be contiguous"),
                }
            }
            let (q, k, v) = (view(q)?, view(k)?, view(v)?);
            let [layer, layers, b, h, kv, hd] = ints;
            let append =
                dev.get_or_load_custom_func(&format!("art_kv_append_{suffix}"), MODULE, ptx)?;
            let mut builder = append.builder();
            builder.arg(&k);
            builder.arg(&v);
            builder.arg(table);
            candle_core::builder_arg!(builder, layer, layers, b, kv, hd);
            let cfg = LaunchConfig {
                grid_dim: (kv as u32, b as u32, 1),
                block_dim: ((hd as u32).clamp(32, 256), 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the table holds live cache buffers with room for each row's position.
            unsafe { builder.launch(cfg) }.w()?;

            // SAFETY: uninitialised, and never read before the attention kernel below writes all
            // of it (one block per sequence and head, each writing its head's `hd` outputs).
            let out = unsafe { dev.alloc::<T>((b * h * hd) as usize)? };
            let attn =
                dev.get_or_load_custom_func(&format!("art_decode_attn_{suffix}"), MODULE, ptx)?;
            let mut builder = attn.builder();
            builder.arg(&q);
            builder.arg(&out);
            builder.arg(table);
            candle_core::builder_arg!(builder, layer, layers, b, h, kv, hd);
            let smem = (hd as usize + 32 + THREADS as usize + max_len) * 4;
            let cfg = LaunchConfig {
                grid_dim: (h as u32, b as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: as above; `out` has B * H * hd elements.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(out)
        }

        let slice = match (&qs.slice, &ks.slice, &vs.slice) {
            (S::BF16(q), S::BF16(k), S::BF16(v)) => S::BF16(run(
                &dev,
                ptx,
                "bf16",
                (q, ql),
                (k, kl),
                (v, vl),
                &table,
                ints,
                self.max_len,
            )?),
            (S::F32(q), S::F32(k), S::F32(v)) => S::F32(run(
                &dev,
                ptx,
                "f32",
                (q, ql),
                (k, kl),
                (v, vl),
                &table,
                ints,
                self.max_len,
            )?),
            _ => candle_core::bail!("decode attention: bf16 or f32 inputs only"),
        };
        Ok((
            candle_core::CudaStorage { slice, device: dev },
            candle_core::Shape::from((b, h, hd)),
        ))
    }
}
