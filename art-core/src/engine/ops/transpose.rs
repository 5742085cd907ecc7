//! Head/position swap: the forward and backward kernels (CPU here, CUDA in `cuda_ops`).

use super::*;

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
