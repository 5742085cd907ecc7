//! SwiGLU: silu(gate) * up: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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

/// `[2, dims...]`.
fn stacked(shape: &Shape) -> Vec<usize> {
    std::iter::once(2)
        .chain(shape.dims().iter().copied())
        .collect()
}
