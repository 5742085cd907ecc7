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

mod add;
mod rms_norm;
mod rope;
mod softmax;
mod swiglu;
mod target_logprob;
#[cfg(test)]
mod tests;
mod transpose;

pub(crate) use add::add;
pub(crate) use rms_norm::{rms_norm, rms_norm_grad};
pub(crate) use rope::{rope, rope_grad};
pub(crate) use softmax::{causal_softmax, softmax_grad};
pub(crate) use swiglu::{silu_mul, silu_mul_grad};
pub(crate) use target_logprob::{target_logprob_entropy, target_logprob_entropy_grad};
pub(crate) use transpose::transpose12;

/// Whether the fused kernels run for tensors like `t` (CPU f32 or f64, CUDA f32 or bf16, and not
/// switched off with [`set_fused_ops`] or `ART_FUSED_OPS=0`).
pub(crate) fn supported(t: &Tensor) -> bool {
    supported_for(t.device(), t.dtype())
}

/// [`supported`] for tensors of `device` and `dtype`.
pub(crate) fn supported_for(device: &candle_core::Device, dtype: DType) -> bool {
    fused_ops()
        && match device {
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
