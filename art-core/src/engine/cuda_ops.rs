//! CUDA versions of [`super::ops`]'s fused kernels (RMS norm, rotary embedding, causal softmax,
//! target log-probability, SwiGLU, and each one's backward), so that LoRA training on the GPU runs one
//! kernel where candle's composite ops run five to fifteen, each reading and writing a whole
//! tensor (and, in backward, a zero-filled gradient buffer per op besides).
//!
//! Every kernel has the same signature, `(a, b, c, out, i0, i1, i2, i3, f0)`: up to three
//! contiguous inputs of one dtype (unused ones repeat `a`), an output of the inputs' dtype, four integers and a float whose meaning each kernel documents.
//! One launcher ([`Launch`]) then serves them all. The target log-probability's two kernels are
//! the exception: their per-row statistics are f32 whatever the logits' dtype
//! ([`target_logprob`], [`target_logprob_grad`]). Each block computes in f32 and works on one
//! row, one warp per row, or 16 bytes per thread (element-wise kernels). CUDA C compiled at
//! first use with NVRTC, as the decode kernels are; bf16 is handled as its bits.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

use super::cuda_decode::{cuda_prelude, nvrtc_ptx, PtxCell};

const MODULE: &str = "art_train_ops";

/// Threads per block of the row kernels.
pub(crate) const ROW_THREADS: u32 = 256;
/// Threads per block for rows as long as a vocabulary.
const WIDE_THREADS: u32 = 1024;

const SOURCE: &str = concat!(
    cuda_prelude!(),
    r#"

#define ARGS(T) const T* a, const T* b, const T* c, T* out, \
                int i0, int i1, int i2, int i3, float f0

// RMS norm of row blockIdx.x: a = x [rows, i0], b = weight [i0], f0 = eps.
template <typename T> __device__ void rms_norm(ARGS(T)) {
  __shared__ float red[32];
  const int d = i0;
  const T* x = a + (size_t)blockIdx.x * d;
  T* y = out + (size_t)blockIdx.x * d;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = ld(x + i); ss += v * v; }
  float r = rsqrtf(block_sum(ss, red) / d + f0);
  for (int i = threadIdx.x; i < d; i += blockDim.x) st(y + i, ld(x + i) * r * ld(b + i));
}

// Its backward: a = x, b = weight, c = grad of y; dx = r w g - x r^3 sum(w g x) / d.
template <typename T> __device__ void rms_norm_grad(ARGS(T)) {
  __shared__ float red[32];
  const int d = i0;
  const size_t row = (size_t)blockIdx.x * d;
  const T *x = a + row, *g = c + row;
  float ss = 0.f, wgx = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = ld(x + i);
    ss += v * v;
    wgx += ld(b + i) * ld(g + i) * v;
  }
  ss = block_sum(ss, red);
  wgx = block_sum(wgx, red);
  float r = rsqrtf(ss / d + f0);
  float k = r * r * r * wgx / d;
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    st(out + row + i, r * ld(b + i) * ld(g + i) - ld(x + i) * k);
}

// Non-interleaved rotary embedding, one thread per (row, i < half): a = x [B, H, L, hd],
// b = cos, c = sin [B, L, hd/2]; i0 = H, i1 = L, i2 = hd, i3 = element pairs in all,
// f0 = +1 (rotate) or -1 (rotate back: the backward).
template <typename T> __device__ void rope(ARGS(T)) {
  size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)i3) return;
  const int half = i2 / 2;
  const int i = idx % half;
  const size_t pos = idx / half;            // (b, h, p) flattened
  const int p = pos % i1;
  const size_t bh = pos / i1;
  const size_t batch = bh / i0;
  const size_t t = (batch * i1 + p) * half + i;
  const size_t base = pos * i2;
  float co = ld(b + t), si = ld(c + t) * f0;
  float x1 = ld(a + base + i), x2 = ld(a + base + i + half);
  st(out + base + i, x1 * co - x2 * si);
  st(out + base + i + half, x2 * co + x1 * si);
}

// Rows of a few hundred elements take one warp each (no block-wide synchronization): row
// `warp_row()` of `rows`, lane `threadIdx.x % 32`.
__device__ __forceinline__ int warp_row() { return blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; }

// Causal softmax of scores [.., R, T], one warp per row: i0 = T, i1 = rows, i2 = queries,
// i3 = offset; row r (R a multiple of queries) sees keys 0..=offset + r % queries, the rest
// get exactly 0.
template <typename T> __device__ void causal_softmax(ARGS(T)) {
  const int t = i0, row = warp_row(), lane = threadIdx.x % 32;
  if (row >= i1) return;
  const int seen = min(i3 + row % i2 + 1, t);
  const T* x = a + (size_t)row * t;
  T* y = out + (size_t)row * t;
  float m = __int_as_float(0xff800000);  // -inf (NVRTC has no math headers)
#pragma unroll 4
  for (int j = lane; j < seen; j += 32) m = fmaxf(m, ld(x + j));
  m = warp_max(m);
  float s = 0.f;
#pragma unroll 4
  for (int j = lane; j < seen; j += 32) s += __expf(ld(x + j) - m);
  const float inv = 1.f / warp_sum(s);
#pragma unroll 4
  for (int j = lane; j < t; j += 32) st(y + j, j < seen ? __expf(ld(x + j) - m) * inv : 0.f);
}

// Softmax backward, one warp per row: a = probabilities, b = grad; i0 = T, i1 = rows.
// dx = p (g - sum p g).
template <typename T> __device__ void softmax_grad(ARGS(T)) {
  const int row = warp_row(), lane = threadIdx.x % 32;
  if (row >= i1) return;
  const size_t base = (size_t)row * i0;
  float s = 0.f;
#pragma unroll 4
  for (int j = lane; j < i0; j += 32) s += ld(a + base + j) * ld(b + base + j);
  s = warp_sum(s);
#pragma unroll 4
  for (int j = lane; j < i0; j += 32) {
    float p = ld(a + base + j);
    st(out + base + j, p * (ld(b + base + j) - s));
  }
}

// Row blockIdx.x of logits x [N, v] and its target tg[row]: out[2 row] = log softmax at the
// target, out[2 row + 1] = entropy of the softmax. The statistics are f32 for bf16 logits too:
// a bf16 logprob would be off by up to 1% in the importance ratio.
template <typename T> __device__ void target_logprob(const T* logits, const unsigned* tg, float* out, int v) {
  __shared__ float red[32];
  const size_t row = blockIdx.x;
  const T* x = logits + row * v;
  float m = __int_as_float(0xff800000);  // -inf (NVRTC has no math headers)
  for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ld(x + j));
  m = block_max(m, red);
  float s = 0.f, sx = 0.f;
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    float xv = ld(x + j);
    float e = __expf(xv - m);
    s += e;
    sx += e * xv;
  }
  s = block_sum(s, red);
  sx = block_sum(sx, red);
  if (threadIdx.x == 0) {
    float lse = m + logf(s);
    out[2 * row] = ld(x + tg[row]) - lse;
    out[2 * row + 1] = lse - sx / s;
  }
}

// Its backward, for the forward's f32 statistics `res` [N, 2] and their grads `g` [N, 2]:
// d logprob / dx_j = [j = target] - p_j; d entropy / dx_j = -p_j (x_j - E).
template <typename T> __device__ void target_logprob_grad(const T* logits, const float* res, const float* g,
                                                          const unsigned* tg, T* out, int v) {
  const size_t row = blockIdx.x;
  const unsigned target = tg[row];
  const T* x = logits + row * v;
  const float lse = ld(x + target) - res[2 * row];
  const float mean = lse - res[2 * row + 1];
  const float g0 = g[2 * row], g1 = g[2 * row + 1];
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    float xv = ld(x + j);
    float d = -__expf(xv - lse) * (g0 + g1 * (xv - mean));
    if (j == (int)target) d += g0;
    st(out + row * v + j, d);
  }
}

#define EXPORT_LOGPROB(suffix, T) \
  extern "C" __global__ void art_target_logprob_##suffix(const T* x, const unsigned* tg, float* out, int v) { \
    target_logprob<T>(x, tg, out, v); } \
  extern "C" __global__ void art_target_logprob_grad_##suffix(const T* x, const float* res, const float* g, \
                                                              const unsigned* tg, T* out, int v) { \
    target_logprob_grad<T>(x, res, g, tg, out, v); }
EXPORT_LOGPROB(f32, float)
EXPORT_LOGPROB(bf16, bf16_t)

// Element-wise kernels take 16 bytes of each operand per thread (8 bf16 or 4 f32): one load
// instruction each, where one element per thread left the memory system mostly idle. Threads
// cover elements [CHUNK * thread, CHUNK * (thread + 1)); where that range or an address is not
// 16-byte aligned, the same range goes element by element.
#define CHUNK (16 / (int)sizeof(T))
__device__ __forceinline__ bool aligned16(const void* p) { return ((size_t)p & 15) == 0; }
template <typename T> struct __align__(16) Chunk { T v[16 / sizeof(T)]; };
template <typename T> __device__ __forceinline__ Chunk<T> ld_chunk(const T* p) {
  Chunk<T> c;
  *(uint4*)c.v = *(const uint4*)p;
  return c;
}
template <typename T> __device__ __forceinline__ void st_chunk(T* p, const Chunk<T>& c) {
  *(uint4*)p = *(const uint4*)c.v;
}

// silu(a) * b element-wise; i3 = elements.
template <typename T> __device__ void silu_mul(ARGS(T)) {
  const size_t first = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (first >= (size_t)i3) return;
  if (first + CHUNK <= (size_t)i3 && aligned16(a + first) && aligned16(b + first) && aligned16(out + first)) {
    Chunk<T> g = ld_chunk(a + first), u = ld_chunk(b + first), y;
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) {
      float gv = ld(g.v + k);
      st(y.v + k, gv / (1.f + __expf(-gv)) * ld(u.v + k));
    }
    st_chunk(out + first, y);
    return;
  }
  for (size_t i = first; i < first + CHUNK && i < (size_t)i3; ++i) {
    float g = ld(a + i);
    st(out + i, g / (1.f + __expf(-g)) * ld(b + i));
  }
}

// Its backward: a = gate, b = up, c = grad; out = [d gate (i3 elements), d up (i3 elements)].
template <typename T> __device__ void silu_mul_grad_at(const T* a, const T* b, const T* c, T* dg, T* du, size_t i) {
  float g = ld(a + i), u = ld(b + i), d = ld(c + i);
  float s = 1.f / (1.f + __expf(-g));
  st(dg + i, d * u * s * (1.f + g * (1.f - s)));
  st(du + i, d * g * s);
}
template <typename T> __device__ void silu_mul_grad(ARGS(T)) {
  const size_t first = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (first >= (size_t)i3) return;
  T* dg = out;
  T* du = out + (size_t)i3;
  if (first + CHUNK <= (size_t)i3 && aligned16(a + first) && aligned16(b + first) &&
      aligned16(c + first) && aligned16(dg + first) && aligned16(du + first)) {
    Chunk<T> g = ld_chunk(a + first), u = ld_chunk(b + first), d = ld_chunk(c + first), rg, ru;
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) silu_mul_grad_at(g.v, u.v, d.v, rg.v, ru.v, k);
    st_chunk(dg + first, rg);
    st_chunk(du + first, ru);
    return;
  }
  for (size_t i = first; i < first + CHUNK && i < (size_t)i3; ++i) silu_mul_grad_at(a, b, c, dg, du, i);
}

// a + b, b repeating every i0 elements (a bias over rows; i0 = i3 for two tensors of one
// shape); i3 = elements.
template <typename T> __device__ void add(ARGS(T)) {
  const size_t first = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (first >= (size_t)i3) return;
  const T* bias = b + first % i0;
  if (first + CHUNK <= (size_t)i3 && i0 % CHUNK == 0 && aligned16(a + first) && aligned16(bias) &&
      aligned16(out + first)) {
    Chunk<T> x = ld_chunk(a + first), y = ld_chunk(bias), z;
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) st(z.v + k, ld(x.v + k) + ld(y.v + k));
    st_chunk(out + first, z);
    return;
  }
  for (size_t i = first; i < first + CHUNK && i < (size_t)i3; ++i) st(out + i, ld(a + i) + ld(b + i % i0));
}

// a [B, A, C, D] -> out [B, C, A, D] (the attention's head/position swap): i0 = A, i1 = C,
// i2 = D, i3 = elements (below 2^31, so 32-bit index arithmetic).
template <typename T> __device__ void transpose12(ARGS(T)) {
  const unsigned first = (blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (first >= (unsigned)i3) return;
  const bool whole = i2 % CHUNK == 0 && aligned16(a) && aligned16(out);
  for (unsigned o = first; o < first + (whole ? 1 : CHUNK) && o < (unsigned)i3; ++o) {
    unsigned d = o % i2, r = o / i2;
    unsigned x = r % i0;
    r /= i0;
    unsigned src = ((r / i1 * i0 + x) * i1 + r % i1) * i2 + d;
    if (whole) st_chunk(out + o, ld_chunk(a + src));
    else out[o] = a[src];
  }
}

#define EXPORT(name) \
  extern "C" __global__ void art_##name##_f32(ARGS(float)) { name<float>(a, b, c, out, i0, i1, i2, i3, f0); } \
  extern "C" __global__ void art_##name##_bf16(ARGS(bf16_t)) { name<bf16_t>(a, b, c, out, i0, i1, i2, i3, f0); }
EXPORT(rms_norm)
EXPORT(rms_norm_grad)
EXPORT(rope)
EXPORT(causal_softmax)
EXPORT(softmax_grad)
EXPORT(silu_mul)
EXPORT(silu_mul_grad)
EXPORT(transpose12)
EXPORT(add)
"#
);

fn ptx() -> Result<&'static str> {
    static PTX: PtxCell = PtxCell::new();
    nvrtc_ptx(&PTX, SOURCE, "the training kernels")
}

/// `n` as a kernel's `int`, or an error naming what is too large.
pub(crate) fn int(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).or_else(|_| bail!("{what}: {n} is too large for the CUDA kernel"))
}

/// One launch of kernel `art_{name}_{dtype}`.
pub(crate) struct Launch<'a> {
    pub name: &'static str,
    /// One to three inputs of one dtype (f32 or bf16), contiguous.
    pub inputs: &'a [(&'a CudaStorage, &'a Layout)],
    /// Elements of the output (same dtype as the inputs).
    pub out_len: usize,
    pub ints: [i32; 4],
    pub float: f32,
    /// Enough blocks (of `threads`) for the kernel to write all `out_len` elements; 0 only when
    /// there is nothing to compute (the output is then never read).
    pub blocks: u32,
    pub threads: u32,
}

impl Launch<'_> {
    pub(crate) fn run(&self) -> Result<CudaStorage> {
        let Some(&(first, _)) = self.inputs.first() else {
            bail!("{}: no inputs", self.name)
        };
        let dev = first.device.clone();
        macro_rules! typed {
            ($variant:ident, $suffix:literal) => {{
                let mut slices = Vec::with_capacity(self.inputs.len());
                for (storage, layout) in self.inputs {
                    match &storage.slice {
                        S::$variant(s) => slices.push((s, *layout)),
                        _ => bail!("{}: inputs of different dtypes", self.name),
                    }
                }
                S::$variant(self.typed(&dev, $suffix, &slices)?)
            }};
        }
        let slice = match &first.slice {
            S::F32(_) => typed!(F32, "f32"),
            S::BF16(_) => typed!(BF16, "bf16"),
            _ => bail!("{}: f32 or bf16 inputs only", self.name),
        };
        Ok(CudaStorage { slice, device: dev })
    }

    fn typed<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        suffix: &str,
        inputs: &[(&CudaSlice<T>, &Layout)],
    ) -> Result<CudaSlice<T>> {
        let views = inputs
            .iter()
            .map(|(slice, layout)| view(slice, layout, self.name))
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: uninitialised; as `blocks` promises, the kernel writes every element, or there
        // is nothing to compute and the output is never read.
        let out = unsafe { dev.alloc::<T>(self.out_len.max(1))? };
        if self.blocks == 0 {
            return Ok(out);
        }
        let func =
            dev.get_or_load_custom_func(&format!("art_{}_{suffix}", self.name), MODULE, ptx()?)?;
        let mut builder = func.builder();
        for i in 0..3 {
            builder.arg(&views[i.min(views.len() - 1)]);
        }
        builder.arg(&out);
        let [i0, i1, i2, i3] = self.ints;
        let f0 = self.float;
        candle_core::builder_arg!(builder, i0, i1, i2, i3, f0);
        let cfg = LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each kernel reads within the extents its integers describe, which the caller
        // checked against the inputs' shapes, and writes `out_len` elements at most.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(out)
    }
}

/// The contiguous extent of `storage` as `T` elements, or an error naming `what`.
fn view<'a, T>(slice: &'a CudaSlice<T>, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => bail!("{what}: inputs must be contiguous"),
    }
}

fn f32_view<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> Result<CudaView<'a, f32>> {
    match &storage.slice {
        S::F32(s) => view(s, layout, what),
        _ => bail!("{what}: the statistics must be f32"),
    }
}

/// `[n, 2]` f32 statistics (log-probability of each row's target, entropy) of contiguous logits
/// `[n, v]` (f32 or bf16), one block per row.
pub(crate) fn target_logprob(
    logits: &CudaStorage,
    layout: &Layout,
    targets: &[u32],
    v: usize,
) -> Result<CudaStorage> {
    let what = "target logprob";
    let dev = logits.device.clone();
    let n = targets.len();
    let tg = dev.clone_htod(targets)?;
    // SAFETY: uninitialised, and never read before the kernel below writes both statistics of
    // every row (or, with no row, not at all).
    let out = unsafe { dev.alloc::<f32>(2 * n) }?;
    if n == 0 {
        return Ok(CudaStorage {
            slice: S::F32(out),
            device: dev,
        });
    }
    let v_int = int(v, what)?;
    let cfg = row_blocks(n, what)?;
    macro_rules! launch {
        ($s:expr, $suffix:literal) => {{
            let x = view($s, layout, what)?;
            let func = dev.get_or_load_custom_func(
                concat!("art_target_logprob_", $suffix),
                MODULE,
                ptx()?,
            )?;
            let mut builder = func.builder();
            builder.arg(&x).arg(&tg).arg(&out).arg(&v_int);
            // SAFETY: each block reads its row of `v` logits and writes two statistics; the
            // caller checked `n * v` logits and the targets against `v`.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    match &logits.slice {
        S::F32(s) => launch!(s, "f32"),
        S::BF16(s) => launch!(s, "bf16"),
        _ => bail!("{what}: f32 or bf16 logits only"),
    }
    Ok(CudaStorage {
        slice: S::F32(out),
        device: dev,
    })
}

/// The gradient of the logits (their dtype, `[n, v]`) from the forward's f32 statistics and
/// their f32 gradients (both `[n, 2]`).
pub(crate) fn target_logprob_grad(
    logits: (&CudaStorage, &Layout),
    stats: (&CudaStorage, &Layout),
    grad: (&CudaStorage, &Layout),
    targets: &[u32],
    v: usize,
) -> Result<CudaStorage> {
    let what = "target logprob backward";
    let dev = logits.0.device.clone();
    let n = targets.len();
    let tg = dev.clone_htod(targets)?;
    let res = f32_view(stats.0, stats.1, what)?;
    let g = f32_view(grad.0, grad.1, what)?;
    let v_int = int(v, what)?;
    let cfg = row_blocks(n.max(1), what)?;
    macro_rules! launch {
        ($s:expr, $ty:ty, $suffix:literal) => {{
            let x = view($s, logits.1, what)?;
            // SAFETY: uninitialised, and never read before the kernel below writes every row's
            // `v` gradients.
            let out = unsafe { dev.alloc::<$ty>(n * v) }?;
            let func = dev.get_or_load_custom_func(
                concat!("art_target_logprob_grad_", $suffix),
                MODULE,
                ptx()?,
            )?;
            let mut builder = func.builder();
            builder
                .arg(&x)
                .arg(&res)
                .arg(&g)
                .arg(&tg)
                .arg(&out)
                .arg(&v_int);
            if n > 0 {
                // SAFETY: each block reads its row of logits and two statistics and gradients,
                // and writes its row of `v` gradients; the caller checked the shapes.
                unsafe { builder.launch(cfg) }.w()?;
            }
            out
        }};
    }
    let slice = match &logits.0.slice {
        S::F32(s) => S::F32(launch!(s, f32, "f32")),
        S::BF16(s) => S::BF16(launch!(s, half::bf16, "bf16")),
        _ => bail!("{what}: f32 or bf16 logits only"),
    };
    Ok(CudaStorage { slice, device: dev })
}

/// One block of [`WIDE_THREADS`] per row.
fn row_blocks(rows: usize, what: &str) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (int(rows, what)? as u32, 1, 1),
        block_dim: (WIDE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `c += a b` in place, for row-major 2-D `a` (`[m, k]`) and `b` (`[k, n]`), each contiguous or
/// the transposed view of a contiguous matrix, and a contiguous `c` (`[m, n]`): one cuBLAS call
/// with `beta = 1`, so that adding a product to a tensor is not a pass of its own (candle's
/// element-wise add was a quarter of a training step's GPU time).
pub(crate) struct AddMatmul;

/// cuBLAS's view of a row-major matrix of `rows x cols` with this layout: the operation that
/// turns the stored column-major matrix into its transpose, and the leading dimension.
fn blas_operand(
    layout: &Layout,
    rows: usize,
    cols: usize,
) -> Result<(
    candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t,
    i32,
)> {
    use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t as Op;
    match layout.stride() {
        [s, 1] if *s == cols || rows == 1 => Ok((Op::CUBLAS_OP_N, int(cols.max(1), "add matmul")?)),
        [1, s] if *s == rows || cols == 1 => Ok((Op::CUBLAS_OP_T, int(rows.max(1), "add matmul")?)),
        _ => bail!("add matmul: operands must be contiguous or transposed, not {layout:?}"),
    }
}

impl candle_core::InplaceOp3 for AddMatmul {
    fn name(&self) -> &'static str {
        "art-add-matmul"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        bail!("art-add-matmul runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        cs: &mut CudaStorage,
        cl: &Layout,
        as_: &CudaStorage,
        al: &Layout,
        bs: &CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        use candle_core::cuda_backend::cudarc::cublas::{Gemm, GemmConfig};
        let (m, k) = al.shape().dims2()?;
        let (k2, n) = bl.shape().dims2()?;
        if k != k2 || cl.shape().dims() != [m, n] || !cl.is_contiguous() {
            bail!(
                "add matmul: {:?} += {:?} x {:?} does not fit (or the sum is not contiguous)",
                cl.shape(),
                al.shape(),
                bl.shape()
            )
        }
        // Row-major C = A B is column-major C^T = B^T A^T: B comes first.
        let (op_b, ld_b) = blas_operand(bl, k, n)?;
        let (op_a, ld_a) = blas_operand(al, m, k)?;
        let blas = cs.device.cublas_handle();
        let what = "add matmul";
        macro_rules! gemm {
            ($c:expr, $a:expr, $b:expr, $t:ty) => {{
                let one = <$t as candle_core::WithDType>::from_f64(1.0);
                let cfg = GemmConfig {
                    transa: op_b,
                    transb: op_a,
                    m: int(n, what)?,
                    n: int(m, what)?,
                    k: int(k, what)?,
                    alpha: one,
                    lda: ld_b,
                    ldb: ld_a,
                    beta: one,
                    ldc: int(n.max(1), what)?,
                };
                let b = $b.slice(bl.start_offset()..);
                let a = $a.slice(al.start_offset()..);
                let mut c = $c.slice_mut(cl.start_offset()..);
                // SAFETY: the shapes, strides and offsets above describe memory inside each
                // buffer; `c` is written only within its m x n elements.
                unsafe { blas.gemm(cfg, &b, &a, &mut c) }
                    .map_err(|e| candle_core::Error::Msg(format!("add matmul: {e:?}")))?;
            }};
        }
        match (&mut cs.slice, &as_.slice, &bs.slice) {
            (S::BF16(c), S::BF16(a), S::BF16(b)) => gemm!(c, a, b, half::bf16),
            (S::F32(c), S::F32(a), S::F32(b)) => gemm!(c, a, b, f32),
            _ => bail!("add matmul: bf16 or f32 operands of one dtype only"),
        }
        Ok(())
    }
}
