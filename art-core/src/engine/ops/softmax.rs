//! Causal softmax: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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
