//! Target log-probability and entropy: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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
        let out = crate::engine::cuda_ops::target_logprob(s, l, &self.targets, v)?;
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
        let out = crate::engine::cuda_ops::target_logprob_grad(
            (xs, xl),
            (rs, rl),
            (gs, gl),
            &self.targets,
            v,
        )?;
        Ok((out, xl.shape().clone()))
    }
}
