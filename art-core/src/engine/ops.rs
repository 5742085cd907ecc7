//! Fused CPU kernels, each with its backward pass, for the hot spots of LoRA training and of
//! prefill: RMS norm, rotary embedding, causal softmax, and the log-probability (with the
//! entropy) of a target token under a row of logits.
//!
//! candle builds these from many small ops (the differentiable softmax alone is five passes
//! over the attention scores forward and more backward, the log-softmax over a 49k vocabulary
//! ten passes over hundreds of megabytes), and its fused kernels have no backward. Here each
//! is one parallel pass over rows (rayon), written for f32 and f64 (the trainer's gradient check
//! runs in f64). On CUDA the same ops run as CUDA kernels ([`super::cuda_ops`], f32 and bf16).
//! Other devices and dtypes keep the composite candle paths; callers check [`supported`] first.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Error, Layout, Result, Shape, Storage,
    Tensor, WithDType,
};
use rayon::prelude::*;

use super::switches;

/// Whether the fused kernels run for tensors like `t` (CPU f32 or f64, CUDA f32 or bf16, and not
/// switched off with [`set_fused_ops`] or `ART_FUSED_OPS=0`).
pub(crate) fn supported(t: &Tensor) -> bool {
    let dtype = t.dtype();
    fused_ops()
        && match t.device() {
            candle_core::Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
            candle_core::Device::Cuda(_) => {
                cfg!(feature = "cuda") && matches!(dtype, DType::F32 | DType::BF16)
            }
            _ => false,
        }
}

#[cfg(feature = "cuda")]
use super::cuda_ops::{int, Launch, ROW_THREADS};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// Blocks of `ROW_THREADS` threads for `n` elements, one per thread.
#[cfg(feature = "cuda")]
fn blocks_for(n: usize, what: &str) -> Result<u32> {
    Ok(int(n.div_ceil(ROW_THREADS as usize), what)? as u32)
}

/// Blocks for `n` elements of `dtype` taken 16 bytes per thread (the element-wise kernels).
#[cfg(feature = "cuda")]
fn chunk_blocks(n: usize, dtype: DType, what: &str) -> Result<u32> {
    blocks_for(n.div_ceil(16 / dtype.size_in_bytes()), what)
}

/// Blocks for `rows` rows taken one warp each.
#[cfg(feature = "cuda")]
fn warp_row_blocks(rows: usize, what: &str) -> Result<u32> {
    Ok(int(rows.div_ceil(ROW_THREADS as usize / 32), what)? as u32)
}

fn fused_ops() -> bool {
    switches::FUSED_OPS.on()
}

/// Turns the fused CPU kernels on (the default) or off (candle's composite ops run instead,
/// with the same results up to rounding). For benchmarks that measure the difference in one
/// process, and for bisecting a numerical question; `ART_FUSED_OPS=0` sets the default.
pub fn set_fused_ops(on: bool) {
    switches::FUSED_OPS.set(on);
}

/// The float types the kernels are written for.
pub(crate) trait Real:
    WithDType + num_traits::Float + std::ops::AddAssign + std::ops::MulAssign + Send + Sync
{
    /// `xs[i] = exp(xs[i])`, vectorized where the type allows.
    fn exp_in_place(xs: &mut [Self]);
}

impl Real for f32 {
    // Inlined so a caller compiled for wider vectors (decode attention) vectorizes it too.
    #[inline(always)]
    fn exp_in_place(xs: &mut [f32]) {
        for x in xs {
            *x = exp_f32(*x);
        }
    }
}

impl Real for f64 {
    fn exp_in_place(xs: &mut [f64]) {
        for x in xs {
            *x = x.exp();
        }
    }
}

/// `e^x` in f32, within ~2 ulp of the correctly rounded value for `x` in `[-87, 88]` (0 below,
/// as far as a softmax is concerned: it returns the smallest normal number). Branch-free so that
/// a loop over a slice vectorizes (libm's `expf` is a scalar call, and exponentials over the
/// vocabulary are most of a log-softmax). Range reduction `x = n ln2 + r` with `|r| <= ln2/2`,
/// then a degree-7 Taylor polynomial for `e^r` (truncation error below 6e-9) scaled by `2^n`.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

const LANES: usize = 8;

// The three reductions below are inlined everywhere so that a caller compiled for wider
// vectors (decode attention's AVX-512 copy) vectorizes them too.

/// The widest vector instructions this CPU has, for the CPU kernels that are compiled once per
/// level (decode attention, skinny products).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Simd {
    Avx512,
    Avx2,
    Baseline,
}

impl Simd {
    pub(crate) fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Simd::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }
}

/// The maximum of `xs` (8 independent lanes, so that it vectorizes).
#[inline(always)]
pub(crate) fn max_of<T: Real>(xs: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = T::neg_infinity();
    for &x in acc.iter().chain(chunks.remainder()) {
        if x > m {
            m = x;
        }
    }
    m
}

#[inline(always)]
pub(crate) fn sum_of<T: Real>(xs: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] += c[i];
        }
    }
    let tail = chunks.remainder().iter().fold(T::zero(), |s, &x| s + x);
    acc.iter().fold(tail, |s, &x| s + x)
}

#[inline(always)]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(T::zero(), |s, (&x, &y)| s + x * y);
    acc.iter().fold(tail, |s, &x| s + x)
}

fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [T]> {
    let data = T::cpu_storage_as_slice(s)?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(Error::Msg(format!("{what}: the input must be contiguous"))),
    }
}

/// The f32 values of a CPU storage, all of them (callers index from their layout's offset);
/// `None` on another device or dtype.
pub(crate) fn cpu_f32(storage: &Storage) -> Option<&[f32]> {
    match storage {
        Storage::Cpu(CpuStorage::F32(data)) => Some(data),
        _ => None,
    }
}

/// Runs `f` for every index in `0..n`, on rayon's threads when `parallel`. Waking them costs
/// tens of microseconds, more than many of a decoding step's small jobs take, so those run on
/// the calling thread.
pub(crate) fn for_each_index(n: usize, parallel: bool, f: impl Fn(usize) + Send + Sync) {
    if parallel {
        (0..n).into_par_iter().for_each(f);
    } else {
        (0..n).for_each(f);
    }
}

fn unsupported(what: &str, dtype: DType) -> Error {
    Error::Msg(format!(
        "{what}: no CPU kernel for {dtype:?} (f32 and f64 only)"
    ))
}

/// Rows this small are not worth handing to another thread.
fn min_rows(row_len: usize) -> usize {
    (16 * 1024 / row_len.max(1)).max(1)
}

// ---------------------------------------------------------------------------------------------
// RMS norm

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension. `weight` (`[D]`) is frozen: it
/// gets no gradient.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    x.apply_op2(&weight, RmsNorm { eps })
}

/// The gradient of [`rms_norm`] with respect to `x`, given the gradient `grad` of its output
/// (for a hand-written backward; no graph).
pub(crate) fn rms_norm_grad(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?
        .apply_op3_no_bwd(&weight, &grad.contiguous()?, &RmsNormGrad { eps })
}

struct RmsNorm {
    eps: f64,
}

impl RmsNorm {
    fn run<T: Real>(&self, x: &[T], w: &[T]) -> Vec<T> {
        let d = w.len();
        let eps = T::from(self.eps).unwrap();
        let inv_d = T::one() / T::from(d).unwrap();
        let mut out = vec![T::zero(); x.len()];
        out.par_chunks_mut(d)
            .with_min_len(min_rows(d))
            .zip(x.par_chunks(d))
            .for_each(|(y, x)| {
                let r = T::one() / (dot(x, x) * inv_d + eps).sqrt();
                for i in 0..d {
                    y[i] = x[i] * r * w[i];
                }
            });
        out
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "art-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = xl.shape().clone();
        if wl.shape().dims() != [*shape.dims().last().unwrap_or(&0)] {
            return Err(Error::Msg("rms norm: weight must be [hidden]".into()));
        }
        let out = match xs.dtype() {
            DType::F32 => CpuStorage::F32(self.run::<f32>(
                contiguous(xs, xl, "rms norm")?,
                contiguous(ws, wl, "rms norm")?,
            )),
            DType::F64 => CpuStorage::F64(self.run::<f64>(
                contiguous(xs, xl, "rms norm")?,
                contiguous(ws, wl, "rms norm")?,
            )),
            d => return Err(unsupported("rms norm", d)),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let shape = xl.shape().clone();
        let d = *shape.dims().last().unwrap_or(&0);
        if wl.shape().dims() != [d] {
            return Err(Error::Msg("rms norm: weight must be [hidden]".into()));
        }
        let rows = shape.elem_count() / d.max(1);
        let out = Launch {
            name: "rms_norm",
            inputs: &[(xs, xl), (ws, wl)],
            out_len: shape.elem_count(),
            ints: [int(d, "rms norm")?, 0, 0, 0],
            float: self.eps as f32,
            blocks: int(rows, "rms norm")? as u32,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let gx = x.apply_op3_no_bwd(w, &grad, &RmsNormGrad { eps: self.eps })?;
        Ok((Some(gx), None))
    }
}

/// `dx = r (w g) - x r^3 sum(w g x) / D` with `r = 1 / sqrt(mean(x^2) + eps)`.
struct RmsNormGrad {
    eps: f64,
}

impl RmsNormGrad {
    fn run<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T> {
        let d = w.len();
        let eps = T::from(self.eps).unwrap();
        let inv_d = T::one() / T::from(d).unwrap();
        let mut out = vec![T::zero(); x.len()];
        out.par_chunks_mut(d)
            .with_min_len(min_rows(d))
            .zip(x.par_chunks(d).zip(g.par_chunks(d)))
            .for_each(|(dx, (x, g))| {
                let r = T::one() / (dot(x, x) * inv_d + eps).sqrt();
                let mut wgx = T::zero();
                for i in 0..d {
                    wgx += w[i] * g[i] * x[i];
                }
                let c = r * r * r * wgx * inv_d;
                for i in 0..d {
                    dx[i] = r * w[i] * g[i] - x[i] * c;
                }
            });
        out
    }
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "art-rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "rms norm backward";
        let out = match xs.dtype() {
            DType::F32 => CpuStorage::F32(self.run::<f32>(
                contiguous(xs, xl, what)?,
                contiguous(ws, wl, what)?,
                contiguous(gs, gl, what)?,
            )),
            DType::F64 => CpuStorage::F64(self.run::<f64>(
                contiguous(xs, xl, what)?,
                contiguous(ws, wl, what)?,
                contiguous(gs, gl, what)?,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let shape = xl.shape().clone();
        let d = wl.shape().elem_count();
        let rows = shape.elem_count() / d.max(1);
        let out = Launch {
            name: "rms_norm_grad",
            inputs: &[(xs, xl), (ws, wl), (gs, gl)],
            out_len: shape.elem_count(),
            ints: [int(d, "rms norm backward")?, 0, 0, 0],
            float: self.eps as f32,
            blocks: int(rows, "rms norm backward")? as u32,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, shape))
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding

/// Non-interleaved rotary embedding of `x` (`[B, H, L, hd]`) with `cos`, `sin` (`[B, L, hd/2]`):
/// the two halves of each head rotate together. The tables get no gradient.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    x.apply_op3(
        &cos.to_dtype(x.dtype())?.contiguous()?,
        &sin.to_dtype(x.dtype())?.contiguous()?,
        Rope { inverse: false },
    )
}

/// The backward of [`rope`]: `grad` rotated back by each position's angle (no graph).
pub(crate) fn rope_grad(grad: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    grad.contiguous()?.apply_op3_no_bwd(
        &cos.to_dtype(grad.dtype())?.contiguous()?,
        &sin.to_dtype(grad.dtype())?.contiguous()?,
        &Rope { inverse: true },
    )
}

/// Rotation by `+angle` (forward) or `-angle` (its transpose, the backward pass).
struct Rope {
    inverse: bool,
}

impl Rope {
    fn run<T: Real>(&self, x: &[T], dims: &[usize], cos: &[T], sin: &[T]) -> Result<Vec<T>> {
        let [b, h, l, hd] = dims else {
            return Err(Error::Msg("rope: x must be [B, H, L, head_dim]".into()));
        };
        let (b, h, l, hd) = (*b, *h, *l, *hd);
        let half = hd / 2;
        if hd % 2 != 0 || cos.len() != b * l * half || sin.len() != cos.len() {
            return Err(Error::Msg(format!(
                "rope: tables of {} values do not fit x {dims:?}",
                cos.len()
            )));
        }
        let mut out = vec![T::zero(); x.len()];
        let sign = if self.inverse { -T::one() } else { T::one() };
        // One chunk per (batch, head): L rows of hd.
        out.par_chunks_mut(l * hd)
            .zip(x.par_chunks(l * hd))
            .enumerate()
            .for_each(|(bh, (y, x))| {
                let batch = bh / h;
                for p in 0..l {
                    let t = (batch * l + p) * half;
                    let (c, s) = (&cos[t..t + half], &sin[t..t + half]);
                    let (x, y) = (&x[p * hd..(p + 1) * hd], &mut y[p * hd..(p + 1) * hd]);
                    for i in 0..half {
                        let (x1, x2) = (x[i], x[i + half]);
                        let s = s[i] * sign;
                        y[i] = x1 * c[i] - x2 * s;
                        y[i + half] = x2 * c[i] + x1 * s;
                    }
                }
            });
        Ok(out)
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "art-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = xl.shape().dims();
        let out = match xs.dtype() {
            DType::F32 => CpuStorage::F32(self.run::<f32>(
                contiguous(xs, xl, "rope")?,
                dims,
                contiguous(cs, cl, "rope")?,
                contiguous(ss, sl, "rope")?,
            )?),
            DType::F64 => CpuStorage::F64(self.run::<f64>(
                contiguous(xs, xl, "rope")?,
                dims,
                contiguous(cs, cl, "rope")?,
                contiguous(ss, sl, "rope")?,
            )?),
            d => return Err(unsupported("rope", d)),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let [b, h, l, hd] = *xl.shape().dims() else {
            return Err(Error::Msg("rope: x must be [B, H, L, head_dim]".into()));
        };
        let table = b * l * (hd / 2);
        if hd % 2 != 0 || cl.shape().elem_count() != table || sl.shape().elem_count() != table {
            return Err(Error::Msg(format!(
                "rope: tables of {} values do not fit x {:?}",
                cl.shape().elem_count(),
                xl.shape()
            )));
        }
        let pairs = b * h * l * (hd / 2);
        let out = Launch {
            name: "rope",
            inputs: &[(xs, xl), (cs, cl), (ss, sl)],
            out_len: xl.shape().elem_count(),
            ints: [
                int(h, "rope")?,
                int(l, "rope")?,
                int(hd, "rope")?,
                int(pairs, "rope")?,
            ],
            float: if self.inverse { -1.0 } else { 1.0 },
            blocks: blocks_for(pairs, "rope")?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = Rope {
            inverse: !self.inverse,
        };
        let gx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(gx), None, None))
    }
}

// ---------------------------------------------------------------------------------------------
// Causal softmax

/// Softmax over the last dimension of attention scores `[..., R, T]` with a causal mask: row `r`
/// holds query `r % queries` (grouped-query attention stacks `R / queries` heads' queries) at
/// position `offset + r % queries`, which sees keys `0..=offset + r % queries`. Masked
/// probabilities are exactly 0. Without a mask (one query per row that sees every key), pass
/// `queries = 1, offset = T - 1`.
pub(crate) fn causal_softmax(scores: &Tensor, queries: usize, offset: usize) -> Result<Tensor> {
    scores
        .contiguous()?
        .apply_op1(CausalSoftmax { queries, offset })
}

struct CausalSoftmax {
    queries: usize,
    offset: usize,
}

impl CausalSoftmax {
    fn run<T: Real>(&self, x: &[T], dims: &[usize]) -> Result<Vec<T>> {
        let (rows_per_block, t) = match dims {
            [.., r, t] => (*r, *t),
            _ => {
                return Err(Error::Msg(
                    "causal softmax: scores must be [..., R, T]".into(),
                ))
            }
        };
        if self.queries == 0 || rows_per_block % self.queries != 0 {
            return Err(Error::Msg(format!(
                "causal softmax: {rows_per_block} rows are not a multiple of {} queries",
                self.queries
            )));
        }
        let mut out = vec![T::zero(); x.len()];
        out.par_chunks_mut(t)
            .with_min_len(min_rows(t))
            .zip(x.par_chunks(t))
            .enumerate()
            .for_each(|(row, (y, x))| {
                let q = row % rows_per_block % self.queries;
                let seen = (self.offset + q + 1).min(t);
                let (y, x) = (&mut y[..seen], &x[..seen]);
                let m = max_of(x);
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = x - m;
                }
                T::exp_in_place(y);
                let inv = T::one() / sum_of(y);
                for y in y.iter_mut() {
                    *y *= inv;
                }
            });
        Ok(out)
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "art-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        let out = match s.dtype() {
            DType::F32 => {
                CpuStorage::F32(self.run::<f32>(contiguous(s, l, "causal softmax")?, dims)?)
            }
            DType::F64 => {
                CpuStorage::F64(self.run::<f64>(contiguous(s, l, "causal softmax")?, dims)?)
            }
            d => return Err(unsupported("causal softmax", d)),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows_per_block, t) = match l.shape().dims() {
            [.., r, t] => (*r, *t),
            _ => {
                return Err(Error::Msg(
                    "causal softmax: scores must be [..., R, T]".into(),
                ))
            }
        };
        if self.queries == 0 || rows_per_block % self.queries != 0 {
            return Err(Error::Msg(format!(
                "causal softmax: {rows_per_block} rows are not a multiple of {} queries",
                self.queries
            )));
        }
        let what = "causal softmax";
        let rows = l.shape().elem_count() / t.max(1);
        let out = Launch {
            name: "causal_softmax",
            inputs: &[(s, l)],
            out_len: l.shape().elem_count(),
            ints: [
                int(t, what)?,
                int(rows, what)?,
                int(self.queries, what)?,
                int(self.offset, what)?,
            ],
            float: 0.0,
            blocks: warp_row_blocks(rows, what)?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?,
        ))
    }
}

/// The backward of a softmax over the last dimension: `probs * (grad - sum(probs grad))` per
/// row (no graph).
pub(crate) fn softmax_grad(probs: &Tensor, grad: &Tensor) -> Result<Tensor> {
    probs
        .contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)
}

/// `dx = p * (g - sum(p g))` per row.
struct SoftmaxGrad;

impl SoftmaxGrad {
    fn run<T: Real>(p: &[T], g: &[T], t: usize) -> Vec<T> {
        let mut out = vec![T::zero(); p.len()];
        out.par_chunks_mut(t)
            .with_min_len(min_rows(t))
            .zip(p.par_chunks(t).zip(g.par_chunks(t)))
            .for_each(|(dx, (p, g))| {
                let s = dot(p, g);
                for i in 0..t {
                    dx[i] = p[i] * (g[i] - s);
                }
            });
        out
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "art-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        ps: &CpuStorage,
        pl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let t = *pl.shape().dims().last().unwrap_or(&1);
        let what = "softmax backward";
        let out = match ps.dtype() {
            DType::F32 => CpuStorage::F32(Self::run::<f32>(
                contiguous(ps, pl, what)?,
                contiguous(gs, gl, what)?,
                t,
            )),
            DType::F64 => CpuStorage::F64(Self::run::<f64>(
                contiguous(ps, pl, what)?,
                contiguous(gs, gl, what)?,
                t,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ps: &CudaStorage,
        pl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let t = *pl.shape().dims().last().unwrap_or(&1);
        let what = "softmax backward";
        let rows = pl.shape().elem_count() / t.max(1);
        let out = Launch {
            name: "softmax_grad",
            inputs: &[(ps, pl), (gs, gl)],
            out_len: pl.shape().elem_count(),
            ints: [int(t, what)?, int(rows, what)?, 0, 0],
            float: 0.0,
            blocks: warp_row_blocks(rows, what)?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, pl.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(gate) * up

/// `silu(gate) * up`, element-wise, in one pass (no graph: the hand-written backward's forward).
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &SiluMul)
}

/// The gradients of `silu(gate) * up` given `grad`, the gradient of its output:
/// `(d gate, d up)`, in one pass instead of candle's nine.
pub(crate) fn silu_mul_grad(gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = gate.contiguous()?.apply_op3_no_bwd(
        &up.contiguous()?,
        &grad.contiguous()?,
        &SiluMulGrad,
    )?;
    Ok((both.get(0)?, both.get(1)?))
}

struct SiluMul;

fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "art-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Real>(g: &[T], u: &[T]) -> Vec<T> {
            g.par_iter()
                .with_min_len(16 * 1024)
                .zip(u.par_iter())
                .map(|(&g, &u)| g * sigmoid(g) * u)
                .collect()
        }
        let what = "silu mul";
        let out = match gs.dtype() {
            DType::F32 => CpuStorage::F32(run::<f32>(
                contiguous(gs, gl, what)?,
                contiguous(us, ul, what)?,
            )),
            DType::F64 => CpuStorage::F64(run::<f64>(
                contiguous(gs, gl, what)?,
                contiguous(us, ul, what)?,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &CudaStorage,
        gl: &Layout,
        us: &CudaStorage,
        ul: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = gl.shape().elem_count();
        let out = Launch {
            name: "silu_mul",
            inputs: &[(gs, gl), (us, ul)],
            out_len: n,
            ints: [0, 0, 0, int(n, "silu mul")?],
            float: 0.0,
            blocks: chunk_blocks(n, gs.dtype(), "silu mul")?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, gl.shape().clone()))
    }
}

/// `[2, ...]`: `d gate = grad up silu'(gate)` with `silu'(g) = s (1 + g (1 - s))`, `s` the
/// sigmoid, then `d up = grad silu(gate)`.
struct SiluMulGrad;

impl CustomOp3 for SiluMulGrad {
    fn name(&self) -> &'static str {
        "art-silu-mul-grad"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
        ds: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Real>(g: &[T], u: &[T], d: &[T]) -> Vec<T> {
            let mut out = vec![T::zero(); 2 * g.len()];
            let (dg, du) = out.split_at_mut(g.len());
            dg.par_iter_mut()
                .with_min_len(16 * 1024)
                .zip(du.par_iter_mut())
                .zip(g.par_iter().zip(u.par_iter()).zip(d.par_iter()))
                .for_each(|((dg, du), ((&g, &u), &d))| {
                    let s = sigmoid(g);
                    *dg = d * u * s * (T::one() + g * (T::one() - s));
                    *du = d * g * s;
                });
            out
        }
        let what = "silu mul backward";
        let out = match gs.dtype() {
            DType::F32 => CpuStorage::F32(run::<f32>(
                contiguous(gs, gl, what)?,
                contiguous(us, ul, what)?,
                contiguous(ds, dl, what)?,
            )),
            DType::F64 => CpuStorage::F64(run::<f64>(
                contiguous(gs, gl, what)?,
                contiguous(us, ul, what)?,
                contiguous(ds, dl, what)?,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, Shape::from(stacked(gl.shape()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &CudaStorage,
        gl: &Layout,
        us: &CudaStorage,
        ul: &Layout,
        ds: &CudaStorage,
        dl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = gl.shape().elem_count();
        let what = "silu mul backward";
        let out = Launch {
            name: "silu_mul_grad",
            inputs: &[(gs, gl), (us, ul), (ds, dl)],
            out_len: 2 * n,
            ints: [0, 0, 0, int(n, what)?],
            float: 0.0,
            blocks: chunk_blocks(n, gs.dtype(), what)?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, Shape::from(stacked(gl.shape()))))
    }
}

// ---------------------------------------------------------------------------------------------
// Addition

/// `a + b`, where `b` has `a`'s shape or its trailing dimensions (a bias): one pass on CUDA
/// for tensors without a graph, where candle's broadcasting add takes a strided path at a
/// seventh of the card's bandwidth (and its plain add computes its strides per element);
/// candle's add elsewhere.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let fused = a.device().is_cuda()
        && supported(a)
        && !a.track_op()
        && !b.track_op()
        && a.dtype() == b.dtype()
        && b.elem_count() > 0
        && a.dims().ends_with(b.dims());
    if !fused {
        return a.broadcast_add(b);
    }
    a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &Add)
}

struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "art-add"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Real>(x: &[T], b: &[T]) -> Vec<T> {
            x.chunks(b.len())
                .flat_map(|row| row.iter().zip(b).map(|(&x, &b)| x + b))
                .collect()
        }
        let what = "add";
        let out = match xs.dtype() {
            DType::F32 => CpuStorage::F32(run::<f32>(
                contiguous(xs, xl, what)?,
                contiguous(bs, bl, what)?,
            )),
            DType::F64 => CpuStorage::F64(run::<f64>(
                contiguous(xs, xl, what)?,
                contiguous(bs, bl, what)?,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        bs: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, period) = (xl.shape().elem_count(), bl.shape().elem_count());
        let what = "add";
        if period == 0 || n % period != 0 {
            return Err(Error::Msg(format!(
                "{what}: {period} values do not repeat over {n}"
            )));
        }
        let out = Launch {
            name: "add",
            inputs: &[(xs, xl), (bs, bl)],
            out_len: n,
            ints: [int(period, what)?, 0, 0, int(n, what)?],
            float: 0.0,
            blocks: chunk_blocks(n, xs.dtype(), what)?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, xl.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Head/position swap

/// `x` `[B, A, C, D]` as `[B, C, A, D]`, contiguous, without a graph: `transpose(1, 2)` and
/// `contiguous()` in one pass (candle's strided copy computes 64-bit indices per element, at a
/// tenth of the card's bandwidth).
pub(crate) fn transpose12(x: &Tensor) -> Result<Tensor> {
    if !supported(x) {
        return x.transpose(1, 2)?.contiguous();
    }
    x.contiguous()?.apply_op1_no_bwd(&Transpose12)
}

struct Transpose12;

impl CustomOp1 for Transpose12 {
    fn name(&self) -> &'static str {
        "art-transpose12"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Copy + Send + Sync>(x: &[T], [_, a, c, d]: [usize; 4]) -> Vec<T> {
            let mut out = Vec::with_capacity(x.len());
            for batch in x.chunks(a * c * d) {
                for ci in 0..c {
                    for ai in 0..a {
                        let start = (ai * c + ci) * d;
                        out.extend_from_slice(&batch[start..start + d]);
                    }
                }
            }
            out
        }
        let dims = four_dims(l.shape())?;
        let what = "transpose";
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(run(contiguous(s, l, what)?, dims)),
            DType::F64 => CpuStorage::F64(run(contiguous(s, l, what)?, dims)),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, swapped(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dims @ [_, a, c, d] = four_dims(l.shape())?;
        let n = l.shape().elem_count();
        let what = "transpose";
        let out = Launch {
            name: "transpose12",
            inputs: &[(s, l)],
            out_len: n,
            ints: [int(a, what)?, int(c, what)?, int(d, what)?, int(n, what)?],
            float: 0.0,
            blocks: chunk_blocks(n, s.dtype(), what)?,
            threads: ROW_THREADS,
        }
        .run()?;
        Ok((out, swapped(dims)))
    }
}

fn four_dims(shape: &Shape) -> Result<[usize; 4]> {
    match *shape.dims() {
        [b, a, c, d] => Ok([b, a, c, d]),
        _ => Err(Error::Msg(format!("transpose: {shape:?} is not 4-D"))),
    }
}

fn swapped([b, a, c, d]: [usize; 4]) -> Shape {
    Shape::from((b, c, a, d))
}

/// `[2, dims...]`.
fn stacked(shape: &Shape) -> Vec<usize> {
    std::iter::once(2)
        .chain(shape.dims().iter().copied())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Target log-probability and entropy

/// For logits `[N, V]` and one target per row: `[N, 2]` holding `log softmax(logits)[target]`
/// and the entropy of `softmax(logits)`, both differentiable, without materializing the
/// log-softmax: a forward pass reads each row twice, the backward writes the gradient once.
/// The result is f32 for bf16 logits (on the GPU), the logits' dtype otherwise.
#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
pub(crate) fn target_logprob_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    logits.contiguous()?.apply_op1(TargetLogprob {
        targets: Arc::new(targets.to_vec()),
    })
}

/// The gradient of [`target_logprob_entropy`]'s logits, given its result `stats` and their
/// gradient `grad` (both `[N, 2]`), without a graph.
#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
pub(crate) fn target_logprob_entropy_grad(
    logits: &Tensor,
    stats: &Tensor,
    grad: &Tensor,
    targets: &Arc<Vec<u32>>,
) -> Result<Tensor> {
    let op = TargetLogprobGrad {
        targets: targets.clone(),
    };
    logits
        .contiguous()?
        .apply_op3_no_bwd(&stats.contiguous()?, &grad.contiguous()?, &op)
}

#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
struct TargetLogprob {
    targets: Arc<Vec<u32>>,
}

/// `(max, sum exp(x - max), sum exp(x - max) x)` of one row, using `buf` as scratch.
#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
fn row_stats<T: Real>(x: &[T], buf: &mut Vec<T>) -> (T, T, T) {
    let m = max_of(x);
    buf.clear();
    buf.extend(x.iter().map(|&x| x - m));
    T::exp_in_place(buf);
    (m, sum_of(buf), dot(buf, x))
}

#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
impl TargetLogprob {
    /// That `n` rows of a `v`-token vocabulary fit the targets.
    fn check(&self, n: usize, v: usize) -> Result<()> {
        if n != self.targets.len() {
            return Err(Error::Msg(format!(
                "target logprob: {n} rows of logits for {} targets",
                self.targets.len()
            )));
        }
        if let Some(&bad) = self.targets.iter().find(|&&t| t as usize >= v) {
            return Err(Error::Msg(format!(
                "target logprob: target {bad} outside a vocabulary of {v}"
            )));
        }
        Ok(())
    }

    fn run<T: Real>(&self, x: &[T], v: usize) -> Result<Vec<T>> {
        let n = self.targets.len();
        if x.len() != n * v {
            return Err(Error::Msg(format!(
                "target logprob: {} logits for {n} targets of a {v}-token vocabulary",
                x.len()
            )));
        }
        self.check(n, v)?;
        let mut out = vec![T::zero(); 2 * n];
        out.par_chunks_mut(2)
            .zip(x.par_chunks(v))
            .zip(self.targets.par_iter())
            .for_each_init(Vec::new, |buf, ((o, x), &target)| {
                let (m, s, sx) = row_stats(x, buf);
                let lse = m + s.ln();
                o[0] = x[target as usize] - lse;
                o[1] = lse - sx / s;
            });
        Ok(out)
    }
}

impl CustomOp1 for TargetLogprob {
    fn name(&self) -> &'static str {
        "art-target-logprob"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(self.run::<f32>(contiguous(s, l, "target logprob")?, v)?),
            DType::F64 => CpuStorage::F64(self.run::<f64>(contiguous(s, l, "target logprob")?, v)?),
            d => return Err(unsupported("target logprob", d)),
        };
        Ok((out, Shape::from((n, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        self.check(n, v)?;
        let out = super::cuda_ops::target_logprob(s, l, &self.targets, v)?;
        Ok((out, Shape::from((n, 2))))
    }

    fn bwd(&self, logits: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        target_logprob_entropy_grad(logits, res, grad, &self.targets).map(Some)
    }
}

/// With `p = softmax(x)`, `E = sum p x` and `lse` recovered from the forward's outputs:
/// `d logprob / dx_j = [j = target] - p_j` and `d entropy / dx_j = -p_j (x_j - E)`.
#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
struct TargetLogprobGrad {
    targets: Arc<Vec<u32>>,
}

#[cfg_attr(not(feature = "train"), allow(dead_code))] // only the trainer's loss uses it
impl TargetLogprobGrad {
    fn run<T: Real>(&self, x: &[T], res: &[T], g: &[T], v: usize) -> Vec<T> {
        let mut out = vec![T::zero(); x.len()];
        out.par_chunks_mut(v)
            .zip(x.par_chunks(v))
            .zip(res.par_chunks(2).zip(g.par_chunks(2)))
            .zip(self.targets.par_iter())
            .for_each(|(((dx, x), (r, g)), &target)| {
                let target = target as usize;
                let lse = x[target] - r[0];
                let mean = lse - r[1];
                for (d, &x) in dx.iter_mut().zip(x) {
                    *d = x - lse;
                }
                T::exp_in_place(dx);
                let (g0, g1) = (g[0], g[1]);
                if g1 == T::zero() {
                    for d in dx.iter_mut() {
                        *d = -g0 * *d;
                    }
                } else {
                    for (d, &x) in dx.iter_mut().zip(x) {
                        *d = -*d * (g0 + g1 * (x - mean));
                    }
                }
                dx[target] += g0;
            });
        out
    }
}

impl CustomOp3 for TargetLogprobGrad {
    fn name(&self) -> &'static str {
        "art-target-logprob-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, v) = xl.shape().dims2()?;
        let what = "target logprob backward";
        let out = match xs.dtype() {
            DType::F32 => CpuStorage::F32(self.run::<f32>(
                contiguous(xs, xl, what)?,
                contiguous(rs, rl, what)?,
                contiguous(gs, gl, what)?,
                v,
            )),
            DType::F64 => CpuStorage::F64(self.run::<f64>(
                contiguous(xs, xl, what)?,
                contiguous(rs, rl, what)?,
                contiguous(gs, gl, what)?,
                v,
            )),
            d => return Err(unsupported(what, d)),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        rs: &CudaStorage,
        rl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, v) = xl.shape().dims2()?;
        let what = "target logprob backward";
        if n != self.targets.len()
            || rl.shape().elem_count() != 2 * n
            || gl.shape().elem_count() != 2 * n
        {
            return Err(Error::Msg(format!(
                "{what}: {n} rows for {} targets",
                self.targets.len()
            )));
        }
        let out =
            super::cuda_ops::target_logprob_grad((xs, xl), (rs, rl), (gs, gl), &self.targets, v)?;
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let v: Vec<f64> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 10_000) as f64 / 2_500.0 - 2.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    #[test]
    fn fast_exp_is_within_a_few_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_f32(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_3;
        }
        assert!(
            worst < 4.0 * f64::from(f32::EPSILON),
            "worst relative error {worst}"
        );
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
    }

    /// Forward against candle's composite ops, backward against candle's autograd of them, for
    /// a scalar loss `sum(out * w)` with random `w`.
    fn check(
        fused: impl Fn(&Tensor) -> Tensor,
        reference: impl Fn(&Tensor) -> Tensor,
        shape: &[usize],
        tol: f64,
    ) {
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&randn(shape, 1, dtype)).unwrap();
            let (a, b) = (fused(x.as_tensor()), reference(x.as_tensor()));
            assert!(
                max_diff(&a, &b) < tol,
                "{dtype:?} forward: {}",
                max_diff(&a, &b)
            );
            let w = randn(a.dims(), 2, dtype);
            let ga = (a * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (b * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let (ga, gb) = (ga.get(&x).unwrap(), gb.get(&x).unwrap());
            assert!(
                max_diff(ga, gb) < tol,
                "{dtype:?} backward: {}",
                max_diff(ga, gb)
            );
        }
    }

    #[test]
    fn rms_norm_matches_the_composite_ops() {
        let w = randn(&[24], 3, DType::F64);
        check(
            |x| rms_norm(x, &w, 1e-5).unwrap(),
            |x| candle_nn::ops::rms_norm_slow(x, &w.to_dtype(x.dtype()).unwrap(), 1e-5).unwrap(),
            &[3, 5, 24],
            1e-5,
        );
    }

    #[test]
    fn rope_matches_the_composite_ops() {
        let (b, h, l, hd) = (2, 3, 5, 8);
        let cos = randn(&[b, l, hd / 2], 4, DType::F64);
        let sin = randn(&[b, l, hd / 2], 5, DType::F64);
        check(
            |x| rope(x, &cos, &sin).unwrap(),
            |x| {
                let cos = Tensor::cat(&[&cos, &cos], D::Minus1)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap();
                let sin = Tensor::cat(&[&sin, &sin], D::Minus1)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap();
                let (cos, sin) = (
                    cos.to_dtype(x.dtype()).unwrap(),
                    sin.to_dtype(x.dtype()).unwrap(),
                );
                let x1 = x.narrow(D::Minus1, 0, hd / 2).unwrap();
                let x2 = x.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
                let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
                (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
            },
            &[b, h, l, hd],
            1e-5,
        );
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        // 2 heads' queries stacked per row block, 3 queries at offset 2, 5 keys.
        let (rep, l, offset) = (2, 3, 2);
        let t = offset + l;
        let mask: Vec<f64> = (0..rep * l)
            .flat_map(|r| {
                (0..t).map(move |k| {
                    if k <= offset + r % l {
                        0.0
                    } else {
                        f64::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (rep * l, t), &Device::Cpu).unwrap();
        check(
            |x| causal_softmax(x, l, offset).unwrap(),
            |x| {
                let m = mask.to_dtype(x.dtype()).unwrap();
                candle_nn::ops::softmax(&x.broadcast_add(&m).unwrap(), D::Minus1).unwrap()
            },
            &[2, 2, rep * l, t],
            1e-5,
        );
    }

    #[test]
    fn add_repeats_a_bias_over_rows() {
        let x = randn(&[3, 4], 1, DType::F32);
        let bias = randn(&[4], 2, DType::F32);
        for b in [bias, randn(&[3, 4], 3, DType::F32)] {
            let ours = x.apply_op2_no_bwd(&b, &Add).unwrap();
            let reference = x.broadcast_add(&b).unwrap();
            let diff = (ours - reference)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0);
        }
    }

    #[test]
    fn transpose12_swaps_heads_and_positions() {
        for dtype in [DType::F32, DType::F64] {
            let x = randn(&[2, 3, 4, 5], 7, dtype);
            let ours = transpose12(&x).unwrap();
            let reference = x.transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(ours.dims(), reference.dims());
            let diff = (ours - reference)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert_eq!(diff, 0.0);
        }
        let err = transpose12(&randn(&[3, 4, 5], 8, DType::F32)).unwrap_err();
        assert!(err.to_string().contains("is not 4-D"), "{err}");
    }

    #[test]
    fn target_logprob_and_entropy_match_log_softmax() {
        let targets = [3u32, 0, 6, 2];
        let idx = Tensor::new(&targets, &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        check(
            |x| target_logprob_entropy(x, &targets).unwrap(),
            |x| {
                let lsm = candle_nn::ops::log_softmax(x, D::Minus1).unwrap();
                let lp = lsm.gather(&idx, 1).unwrap();
                let ent = (lsm.exp().unwrap() * &lsm)
                    .unwrap()
                    .sum_keepdim(1)
                    .unwrap()
                    .neg()
                    .unwrap();
                Tensor::cat(&[lp, ent], 1).unwrap()
            },
            &[4, 7],
            1e-5,
        );
    }

    #[test]
    fn silu_mul_and_its_backward_match_autograd() {
        for dtype in [DType::F64, DType::F32] {
            let gate = Var::from_tensor(&randn(&[3, 40], 5, dtype)).unwrap();
            let up = Var::from_tensor(&randn(&[3, 40], 6, dtype)).unwrap();
            let grad = randn(&[3, 40], 7, dtype);
            let composite = (gate.as_tensor().silu().unwrap() * up.as_tensor()).unwrap();
            let fused = silu_mul(gate.as_tensor(), up.as_tensor()).unwrap();
            assert!(max_diff(&fused, &composite) < 1e-5);
            let grads = (composite * &grad)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (d_gate, d_up) = silu_mul_grad(gate.as_tensor(), up.as_tensor(), &grad).unwrap();
            assert!(max_diff(&d_gate, grads.get(gate.as_tensor()).unwrap()) < 1e-5);
            assert!(max_diff(&d_up, grads.get(up.as_tensor()).unwrap()) < 1e-5);
        }
    }
}
