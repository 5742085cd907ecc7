//! One decoding step's attention on the CPU: every sequence of the batch has one new query
//! token and attends over its own key/value cache, in one pass over plain slices.
//!
//! Why not candle ops: per sequence and layer that was a cache append, a matmul, a softmax and a
//! second matmul, each a separate op with its own dispatch, and candle's CPU matmul asks the
//! operating system for the core count on every call. For SmolLM2 at batch 8 that overhead was
//! about 40% of a decode step, for a few hundred thousand multiply-adds of actual work.

use candle_core::{DType, Tensor};

use super::error::{EngineError, Result};
use rayon::prelude::*;

use super::ops::{self, dot, max_of, sum_of, Real, Simd};

/// Multiply-adds (of each half, scores and values) from which the batch is split across threads.
const PARALLEL_WORK: usize = 1 << 20;

/// `q`: `[B, H, 1, hd]` f32 (already scaled by `1/sqrt(hd)`); `keys[b]`, `values[b]`:
/// `[1, kv, T_b, hd]` f32 views of sequence `b`'s cache (contiguous rows of `hd`, any head
/// stride), `H` a multiple of `kv`. Returns the attention output `[B, H, 1, hd]`.
pub(crate) fn decode(q: &Tensor, keys: &[Tensor], values: &[Tensor]) -> Result<Tensor> {
    let (batch, heads, one, hd) = q.dims4()?;
    if one != 1 || keys.len() != batch || values.len() != batch || q.dtype() != DType::F32 {
        return Err(internal(format!(
            "decode attention: q {:?} {:?} with {} caches",
            q.dims(),
            q.dtype(),
            keys.len()
        )));
    }
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let q_data = cpu_f32(&q_storage)?;
    let q_data = &q_data[q_layout.start_offset()..][..batch * heads * hd];

    // Read views of every cache, held for the whole computation.
    let guards: Vec<_> = keys
        .iter()
        .chain(values)
        .map(|t| t.storage_and_layout())
        .collect();
    let mut caches = Vec::with_capacity(2 * batch);
    for (tensor, (storage, layout)) in keys.iter().chain(values).zip(&guards) {
        let (_, kv, len, d) = tensor.dims4()?;
        let stride = layout.stride();
        if d != hd || heads % kv != 0 || stride[3] != 1 || stride[2] != hd {
            return Err(internal(format!(
                "decode attention: cache {:?} (stride {stride:?}) for q {:?}",
                tensor.dims(),
                q.dims()
            )));
        }
        let data = cpu_f32(storage)?;
        caches.push(CacheView {
            data: &data[layout.start_offset()..],
            kv,
            len,
            head_stride: stride[1],
        });
    }
    let (keys, values) = caches.split_at(batch);

    let mut out = vec![0f32; batch * heads * hd];
    let job = Job {
        q: q_data,
        keys,
        values,
        heads,
        hd,
    };
    // Work items: (sequence, key/value head), in that order; each computes the query heads that
    // share the key/value head, whose outputs are the item's own chunk of `out`.
    let kv = keys.first().map_or(1, |c| c.kv);
    let chunk = (heads / kv) * hd;
    let simd = Simd::detect();
    // SAFETY: `detect` checked the CPU features `run` uses.
    let run =
        |(item, out): (usize, &mut [f32])| unsafe { job.run(item / kv, item % kv, simd, out) };
    let work: usize = keys.iter().map(|k| k.len).sum::<usize>() * heads * hd;
    if work >= PARALLEL_WORK {
        out.par_chunks_mut(chunk).enumerate().for_each(run);
    } else {
        out.chunks_mut(chunk).enumerate().for_each(run);
    }
    drop(guards);
    Ok(Tensor::from_vec(out, (batch, heads, 1, hd), q.device())?)
}

struct CacheView<'a> {
    data: &'a [f32],
    kv: usize,
    len: usize,
    head_stride: usize,
}

impl CacheView<'_> {
    /// Position `t` of head `g`.
    fn row(&self, g: usize, t: usize, hd: usize) -> &[f32] {
        &self.data[g * self.head_stride + t * hd..][..hd]
    }
}

struct Job<'a> {
    /// `[B, H, hd]`.
    q: &'a [f32],
    keys: &'a [CacheView<'a>],
    values: &'a [CacheView<'a>],
    heads: usize,
    hd: usize,
}

impl Job<'_> {
    /// The query heads of sequence `b` that share key/value head `g`, into `out` (their
    /// `[n_rep, hd]` outputs), compiled for `simd`.
    ///
    /// # Safety
    /// `simd` must be supported by this CPU (as [`Simd::detect`] says).
    unsafe fn run(&self, b: usize, g: usize, simd: Simd, out: &mut [f32]) {
        match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller's: the CPU has AVX-512.
            Simd::Avx512 => unsafe { self.run_avx512(b, g, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller's: the CPU has AVX2 and FMA.
            Simd::Avx2 => unsafe { self.run_avx2(b, g, out) },
            _ => self.run_any(b, g, out),
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, b: usize, g: usize, out: &mut [f32]) {
        self.run_any(b, g, out)
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, b: usize, g: usize, out: &mut [f32]) {
        self.run_any(b, g, out)
    }

    /// Inlined into the `target_feature` variants, so that the compiler vectorises it for them.
    #[inline(always)]
    fn run_any(&self, b: usize, g: usize, out: &mut [f32]) {
        let (keys, values, hd) = (&self.keys[b], &self.values[b], self.hd);
        let n_rep = self.heads / keys.kv;
        let mut scores = vec![0f32; keys.len];
        for (r, out) in out.chunks_mut(hd).enumerate() {
            let h = g * n_rep + r;
            let query = &self.q[(b * self.heads + h) * hd..][..hd];
            // softmax(q K^T) V for this head.
            for (t, s) in scores.iter_mut().enumerate() {
                *s = dot(query, keys.row(g, t, hd));
            }
            let max = max_of(&scores);
            for s in scores.iter_mut() {
                *s -= max;
            }
            <f32 as Real>::exp_in_place(&mut scores);
            let inverse = 1.0 / sum_of(&scores);
            out.fill(0.0);
            for (t, &p) in scores.iter().enumerate() {
                let p = p * inverse;
                for (o, &x) in out.iter_mut().zip(values.row(g, t, hd)) {
                    *o += p * x;
                }
            }
        }
    }
}

fn cpu_f32(storage: &impl std::ops::Deref<Target = candle_core::Storage>) -> Result<&[f32]> {
    ops::cpu_f32(storage)
        .ok_or_else(|| internal("decode attention: tensors are not f32 on the CPU".into()))
}

fn internal(message: String) -> EngineError {
    candle_core::Error::Msg(message).into()
}
