//! Addition: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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

pub(super) struct Add;

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
