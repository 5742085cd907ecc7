//! RMS norm: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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
