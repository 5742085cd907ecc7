//! Rotary embedding: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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
