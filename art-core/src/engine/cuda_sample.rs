//! Sampling on the GPU: three kernels draw every row's token of a decode step where the logits
//! already are, so a step copies a few numbers per row to the host instead of the whole
//! vocabulary (at batch 64 and Qwen2.5's 152k tokens, 39 MB of f32 per step, then a few passes
//! of `exp` over every row on the host).
//!
//! The kernels (three passes over chunks of each row, so that a small batch still spreads over
//! the card) do what [`super::sampler::Sampler::sample`] does for plain temperature sampling
//! or greedy decoding, with the random number the host sampler would have used
//! ([`super::sampler::Sampler::device_draw`]): the row's max, the sum of
//! `exp((l - max) / T)` in f64, and the first token at which the running sum of those weights
//! reaches `u` times the total (inverse CDF) or the argmax (lowest index among ties). A seeded
//! request therefore draws the same tokens as on the host, up to the order in which the f64 sums
//! are added (a token differs only where `u` falls within rounding of a boundary between two
//! tokens). Top-k, top-p, top log-probabilities and constraints stay on the host.
//! `ART_GPU_SAMPLE=0` turns it off.

use candle_core::{DType, Tensor};

use super::error::Result;
use super::sampler::{DeviceDraw, DeviceResult};
use super::switches::GPU_SAMPLE;

/// Whether decode steps sample on the GPU (`ART_GPU_SAMPLE=0` turns it off).
pub(crate) fn enabled() -> bool {
    GPU_SAMPLE.on()
}

/// Turns sampling on the GPU on (the default) or off (every row is copied to the host and
/// sampled there, as on the CPU). For benchmarks and checks that compare the two in one
/// process; `ART_GPU_SAMPLE=0` sets the default.
pub fn set_device_sampling(on: bool) {
    GPU_SAMPLE.set(on);
}

/// Checks the sampling kernel against its host reference ([`DeviceDraw::reference`]) on
/// `logits` (`[B, vocab]`, on the device to check): row `b` is drawn at temperature
/// `[1, 0.7, greedy][b % 3]` with a uniform number from `seed`. Returns the rows whose tokens
/// agree, the rows, the largest relative difference of the weight sums and the largest
/// difference of the log-probabilities.
#[doc(hidden)]
pub fn check_device_sampling(logits: &Tensor, seed: u64) -> Result<(usize, usize, f64, f64)> {
    use rand::{Rng, SeedableRng};
    let (b, v) = logits.dims2()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let draws: Vec<Option<DeviceDraw>> = (0..b)
        .map(|row| {
            let greedy = row % 3 == 2;
            Some(DeviceDraw {
                greedy,
                inv_t: [1.0, 1.0 / 0.7, 1.0][row % 3],
                u: if greedy { 0.0 } else { rng.random::<f64>() },
            })
        })
        .collect();
    let got = sample(logits, &draws)?;
    let host: Vec<f32> = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let (mut same, mut sum_rel, mut lp_diff) = (0, 0f64, 0f64);
    for row in 0..b {
        let draw = draws[row].expect("a draw per row");
        let want = draw.reference(&host[row * v..(row + 1) * v]);
        let got = got[row].expect("a result per row");
        if got.id == want.id && got.max == want.max && got.logit == want.logit {
            same += 1;
        }
        sum_rel = sum_rel.max((got.sum - want.sum).abs() / want.sum);
        let lp = |r| draw.token(r).logprob as f64;
        lp_diff = lp_diff.max((lp(got) - lp(want)).abs());
    }
    Ok((same, b, sum_rel, lp_diff))
}

/// Draws a token for every row `b` of `logits` (`[B, vocab]`, f32 or bf16) that has `draws[b]`, on the
/// logits' device (the CPU runs the host reference, for tests). Rows without a draw get `None`.
pub(crate) fn sample(
    logits: &Tensor,
    draws: &[Option<DeviceDraw>],
) -> Result<Vec<Option<DeviceResult>>> {
    let (b, _) = logits.dims2()?;
    if draws.len() != b {
        return Err(candle_core::Error::Msg(format!(
            "device sampling: {b} rows of logits but {} draws",
            draws.len()
        ))
        .into());
    }
    // Per row: u, 1 / T, greedy (rows without a draw run greedy and are ignored).
    let mut params = Vec::with_capacity(3 * b);
    for d in draws {
        let d = d.unwrap_or(DeviceDraw {
            greedy: true,
            inv_t: 1.0,
            u: 0.0,
        });
        params.extend([d.u, d.inv_t as f64, if d.greedy { 1.0 } else { 0.0 }]);
    }
    let params = Tensor::from_vec(params, (b, 3), logits.device())?;
    // The GPU kernels read bf16 logits as they are (a cast of a decode step's 64 x 152k logits
    // took 0.1 ms); the host reference takes f32.
    let logits = match logits.dtype() {
        DType::BF16 if logits.device().is_cuda() => logits.contiguous()?,
        _ => logits.to_dtype(DType::F32)?.contiguous()?,
    };
    let out: Vec<f64> = logits
        .apply_op2_no_bwd(&params, &SampleOp)?
        .flatten_all()?
        .to_vec1()?;
    Ok(draws
        .iter()
        .zip(out.chunks_exact(4))
        .map(|(d, r)| {
            d.as_ref().map(|_| DeviceResult {
                id: r[0] as u32,
                max: r[1] as f32,
                sum: r[2],
                logit: r[3] as f32,
            })
        })
        .collect())
}

/// `(logits [B, V] f32 (bf16 on CUDA), params [B, 3] f64) -> [B, 4] f64`: id, max, sum of
/// weights, logit at id.
struct SampleOp;

impl candle_core::CustomOp2 for SampleOp {
    fn name(&self) -> &'static str {
        "art-sample"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage as C;
        let (C::F32(logits), C::F64(params)) = (s1, s2) else {
            candle_core::bail!("art-sample: f32 logits and f64 parameters")
        };
        let (Some((a, _)), Some((p, _))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("art-sample: inputs must be contiguous")
        };
        let (b, v) = l1.shape().dims2()?;
        let mut out = Vec::with_capacity(4 * b);
        for row in 0..b {
            let x = &logits[a + row * v..a + (row + 1) * v];
            let q = &params[p + 3 * row..p + 3 * row + 3];
            let draw = DeviceDraw {
                u: q[0],
                inv_t: q[1] as f32,
                greedy: q[2] != 0.0,
            };
            let r = draw.reference(x);
            out.extend([r.id as f64, r.max as f64, r.sum, r.logit as f64]);
        }
        Ok((C::F64(out), candle_core::Shape::from((b, 4))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CudaStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::cuda_backend::CudaStorageSlice as S;

        let (Some((a0, a1)), Some((p0, p1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("art-sample: inputs must be contiguous")
        };
        let S::F64(params) = &s2.slice else {
            candle_core::bail!("art-sample: f64 parameters")
        };
        let (b, v) = l1.shape().dims2()?;
        let params = params.slice(p0..p1);
        let dev = s1.device.clone();
        let out = match &s1.slice {
            S::F32(logits) => draw_rows(&dev, &logits.slice(a0..a1), "f32", &params, b, v)?,
            S::BF16(logits) => draw_rows(&dev, &logits.slice(a0..a1), "bf16", &params, b, v)?,
            _ => candle_core::bail!("art-sample: f32 or bf16 logits"),
        };
        Ok((
            candle_core::CudaStorage {
                slice: S::F64(out),
                device: dev,
            },
            candle_core::Shape::from((b, 4)),
        ))
    }
}

/// The three sampling passes over `logits` (`b` rows of `v`, element type `suffix`):
/// `[B, 4]` f64 results.
#[cfg(feature = "cuda")]
fn draw_rows<T: candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    dev: &candle_core::CudaDevice,
    logits: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
    suffix: &str,
    params: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, f64>,
    b: usize,
    v: usize,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>> {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;

    let chunks = v.div_ceil(CHUNK);
    // The four buffers are uninitialised, and each is written in full before it is read.
    // SAFETY: pass 1 writes every chunk's max before pass 2 reads them.
    let chunk_max = unsafe { dev.alloc::<f32>(b * chunks)? };
    // SAFETY: pass 1 writes every chunk's index before pass 3 reads them.
    let chunk_idx = unsafe { dev.alloc::<i32>(b * chunks)? };
    // SAFETY: pass 2 writes every chunk's sum before pass 3 reads them.
    let chunk_sum = unsafe { dev.alloc::<f64>(b * chunks)? };
    // SAFETY: pass 3 writes every row's four values; nothing reads them before.
    let out = unsafe { dev.alloc::<f64>(4 * b)? };
    let (v, n_chunks) = (v as i32, chunks as i32);
    let chunk_grid = LaunchConfig {
        grid_dim: (chunks as u32, b as u32, 1),
        block_dim: (CHUNK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = dev.get_or_load_custom_func(&format!("art_sample_max_{suffix}"), MODULE, ptx()?)?;
    let mut builder = func.builder();
    builder.arg(logits);
    builder.arg(&chunk_max);
    builder.arg(&chunk_idx);
    candle_core::builder_arg!(builder, v, n_chunks);
    // SAFETY: `logits` holds B rows of V values; the chunk buffers B x chunks each.
    unsafe { builder.launch(chunk_grid) }.w()?;
    let func = dev.get_or_load_custom_func(&format!("art_sample_sum_{suffix}"), MODULE, ptx()?)?;
    let mut builder = func.builder();
    builder.arg(logits);
    builder.arg(params);
    builder.arg(&chunk_max);
    builder.arg(&chunk_sum);
    candle_core::builder_arg!(builder, v, n_chunks);
    // SAFETY: as above; `params` holds B x 3 doubles.
    unsafe { builder.launch(chunk_grid) }.w()?;
    let func = dev.get_or_load_custom_func(&format!("art_sample_pick_{suffix}"), MODULE, ptx()?)?;
    let mut builder = func.builder();
    builder.arg(logits);
    builder.arg(params);
    builder.arg(&chunk_max);
    builder.arg(&chunk_idx);
    builder.arg(&chunk_sum);
    builder.arg(&out);
    candle_core::builder_arg!(builder, v, n_chunks);
    let cfg = LaunchConfig {
        grid_dim: (b as u32, 1, 1),
        block_dim: (PICK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; `out` holds B x 4 doubles.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(out)
}

#[cfg(feature = "cuda")]
const MODULE: &str = "art_sample";

/// Logits per chunk: a row is drawn by `ceil(V / CHUNK)` blocks at once (38 for Qwen2.5's
/// vocabulary), where one block per row kept most of the card idle at small batches (89 µs a
/// step on an H100 for one row).
#[cfg(feature = "cuda")]
const CHUNK: usize = 4096;
#[cfg(feature = "cuda")]
const CHUNK_THREADS: u32 = 256;
#[cfg(feature = "cuda")]
const PICK_THREADS: u32 = 1024;

/// Three passes. 1 (a block per chunk): the chunk's max and argmax. 2 (a block per chunk): the
/// row's max from the chunks' and the chunk's f64 weight sum. 3 (a block per row): the total
/// (chunk sums added in order); the chunk that holds the target `u * total`, then within it the
/// warp segment that holds it, which that warp walks 32 tokens at a time with a prefix sum until
/// the running sum reaches the target.
#[cfg(feature = "cuda")]
const SOURCE: &str = r#"
#define FULL 0xffffffffu
#define CHUNK 4096
#define NEG_INF __int_as_float(0xff800000)

// The better of two (max, index) pairs: the larger value, the lower index among ties; NaN never
// wins, as on the host.
__device__ __forceinline__ void better(float& m, int& mi, float om, int oi) {
  if (om > m || (om == m && oi < mi)) { m = om; mi = oi; }
}

// A logit as f32 (bf16 widened exactly).
__device__ __forceinline__ float lg(const float* x, int i) { return x[i]; }
__device__ __forceinline__ float lg(const unsigned short* x, int i) {
  return __uint_as_float(((unsigned)x[i]) << 16);
}

__device__ __forceinline__ double warp_sum_f64(double x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
  return x;
}

template <typename T>
__device__ void sample_max(const T* logits, float* cmax, int* cidx, int V, int chunks) {
  __shared__ float sm[32];
  __shared__ int si[32];
  const int c = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* x = logits + (unsigned long long)b * V;
  const int i0 = c * CHUNK, i1 = min(V, i0 + CHUNK);
  float m = NEG_INF;
  int mi = 0x7fffffff;
  for (int i = i0 + tid; i < i1; i += blockDim.x) better(m, mi, lg(x, i), i);
  for (int o = 16; o > 0; o >>= 1)
    better(m, mi, __shfl_xor_sync(FULL, m, o), __shfl_xor_sync(FULL, mi, o));
  if (lane == 0) { sm[warp] = m; si[warp] = mi; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) better(m, mi, sm[w], si[w]);
    cmax[b * chunks + c] = m;
    cidx[b * chunks + c] = mi;
  }
}

// The row's max, from its chunks' maxima.
__device__ __forceinline__ float row_max(const float* cmax, int b, int chunks) {
  float m = NEG_INF;
  for (int c = 0; c < chunks; ++c) m = fmaxf(m, cmax[b * chunks + c]);
  return m;
}

template <typename T>
__device__ void sample_sum(const T* logits, const double* params, const float* cmax, double* csum,
                           int V, int chunks) {
  __shared__ double ss[32];
  const int c = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* x = logits + (unsigned long long)b * V;
  const float inv_t = (float)params[3 * b + 1];
  const float m = row_max(cmax, b, chunks);
  const int i0 = c * CHUNK, i1 = min(V, i0 + CHUNK);
  double acc = 0.0;
  for (int i = i0 + tid; i < i1; i += blockDim.x) acc += exp((double)((lg(x, i) - m) * inv_t));
  acc = warp_sum_f64(acc);
  if (lane == 0) ss[warp] = acc;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) acc += ss[w];
    csum[b * chunks + c] = acc;
  }
}

template <typename T>
__device__ void sample_pick(const T* logits, const double* params, const float* cmax,
                            const int* cidx, const double* csum, double* out, int V, int chunks) {
  __shared__ double seg_sum[32];
  __shared__ int chosen;
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nw = blockDim.x >> 5;
  const T* x = logits + (unsigned long long)b * V;
  const double u = params[3 * b];
  const float inv_t = (float)params[3 * b + 1];
  const bool greedy = params[3 * b + 2] != 0.0;
  float m = NEG_INF;
  int mi = 0x7fffffff;
  double total = 0.0;
  for (int c = 0; c < chunks; ++c) {
    better(m, mi, cmax[b * chunks + c], cidx[b * chunks + c]);
    total += csum[b * chunks + c];
  }
  if (mi == 0x7fffffff) mi = 0;
  if (tid == 0) chosen = mi;

  if (!greedy && total > 0.0 && total <= 1.7976931348623157e308) {
    const double target = u * total;
    // The chunk that holds the target (every thread finds the same one).
    double before = 0.0;
    int c = 0;
    for (; c < chunks - 1; ++c) {
      if (before + csum[b * chunks + c] >= target) break;
      before += csum[b * chunks + c];
    }
    // Its warp segments' sums, then the segment that holds the target.
    const int i0 = c * CHUNK, i1 = min(V, i0 + CHUNK);
    const int seg = (i1 - i0 + nw - 1) / nw;
    const int s0 = min(i1, i0 + warp * seg), s1 = min(i1, s0 + seg);
    double acc = 0.0;
    for (int i = s0 + lane; i < s1; i += 32) acc += exp((double)((lg(x, i) - m) * inv_t));
    acc = warp_sum_f64(acc);
    if (lane == 0) seg_sum[warp] = acc;
    __syncthreads();
    int w = 0;
    for (; w < nw - 1; ++w) {
      if (before + seg_sum[w] >= target) break;
      before += seg_sum[w];
    }
    if (warp == w) {
      double run = before;
      int last = -1, found = -1;
      for (int base = s0; base < s1; base += 32) {
        int i = base + lane;
        double wt = i < s1 ? exp((double)((lg(x, i) - m) * inv_t)) : 0.0;
        double s = wt;
        for (int o = 1; o < 32; o <<= 1) {
          double t = __shfl_up_sync(FULL, s, o);
          if (lane >= o) s += t;
        }
        unsigned hit = __ballot_sync(FULL, i < s1 && run + s >= target);
        unsigned pos = __ballot_sync(FULL, wt > 0.0);
        if (hit) { found = base + __ffs(hit) - 1; break; }
        if (pos) last = base + 31 - __clz(pos);
        run += __shfl_sync(FULL, s, 31);
      }
      // Rounding can leave the target just past this segment's last weight: take that token.
      if (lane == 0) chosen = found >= 0 ? found : (last >= 0 ? last : mi);
    }
  }
  __syncthreads();
  if (tid == 0) {
    out[4 * b] = (double)chosen;
    out[4 * b + 1] = (double)m;
    out[4 * b + 2] = total;
    out[4 * b + 3] = (double)lg(x, chosen);
  }
}

#define SAMPLE_EXPORTS(suffix, T)                                                              \
  extern "C" __global__ void art_sample_max_##suffix(const T* logits, float* cmax, int* cidx,  \
                                                     int V, int chunks) {                      \
    sample_max<T>(logits, cmax, cidx, V, chunks);                                              \
  }                                                                                            \
  extern "C" __global__ void art_sample_sum_##suffix(const T* logits, const double* params,    \
                                                     const float* cmax, double* csum, int V,   \
                                                     int chunks) {                             \
    sample_sum<T>(logits, params, cmax, csum, V, chunks);                                      \
  }                                                                                            \
  extern "C" __global__ void art_sample_pick_##suffix(                                         \
      const T* logits, const double* params, const float* cmax, const int* cidx,               \
      const double* csum, double* out, int V, int chunks) {                                    \
    sample_pick<T>(logits, params, cmax, cidx, csum, out, V, chunks);                          \
  }
SAMPLE_EXPORTS(f32, float)
SAMPLE_EXPORTS(bf16, unsigned short)
"#;

/// The kernel's PTX, compiled once per process.
#[cfg(feature = "cuda")]
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: super::cuda_decode::PtxCell = super::cuda_decode::PtxCell::new();
    super::cuda_decode::nvrtc_ptx(&PTX, SOURCE, "the sampling kernel")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::{Sampler, SamplingParams};
    use candle_core::Device;

    /// Rows of different shapes: spread, peaked, with masked (-inf) tokens.
    fn rows(b: usize, v: usize) -> Vec<f32> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut x = Vec::with_capacity(b * v);
        for row in 0..b {
            for i in 0..v {
                let l = match row % 3 {
                    0 => (next() * 8.0 - 4.0) as f32,
                    1 if i == 17 => 12.0,
                    1 => (next() * 2.0) as f32,
                    _ if i % 5 == 0 => f32::NEG_INFINITY,
                    _ => (next() * 4.0) as f32,
                };
                x.push(l);
            }
        }
        x
    }

    /// Device draws (the op's host reference here) give the very tokens and log-probabilities
    /// that `Sampler::sample` gives with the same seeds, step after step.
    #[test]
    fn device_draws_match_the_host_sampler() {
        let (b, v) = (6, 1000);
        let params = |i: usize| SamplingParams {
            temperature: [1.0, 0.7, 0.0][i % 3],
            seed: Some(i as u64),
            ..Default::default()
        };
        let mut host: Vec<Sampler> = (0..b).map(|i| Sampler::new(params(i), 0)).collect();
        let mut device: Vec<Sampler> = (0..b).map(|i| Sampler::new(params(i), 0)).collect();
        for step in 0..5 {
            let x = rows(b + step, v)[step * v..].to_vec();
            let logits = Tensor::from_vec(x.clone(), (b, v), &Device::Cpu).unwrap();
            let draws: Vec<_> = device.iter_mut().map(|s| s.device_draw()).collect();
            let out = sample(&logits, &draws).unwrap();
            for r in 0..b {
                let want = host[r].sample(&x[r * v..(r + 1) * v]);
                let got = draws[r].unwrap().token(out[r].unwrap());
                assert_eq!(got, want, "step {step} row {r}");
            }
        }
    }

    #[test]
    fn rows_without_a_draw_are_skipped_and_truncation_stays_on_the_host() {
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 0.9,
                ..Default::default()
            },
            0,
        );
        assert!(s.device_draw().is_none());
        let logits = Tensor::from_vec(rows(2, 50), (2, 50), &Device::Cpu).unwrap();
        let draw = Sampler::new(SamplingParams::greedy(1), 0).device_draw();
        let out = sample(&logits, &[None, draw]).unwrap();
        assert!(out[0].is_none());
        assert_eq!(out[1].unwrap().id, 17);
    }
}
