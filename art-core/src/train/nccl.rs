//! NCCL between the CUDA devices of one process (feature `nccl`): one communicator per device
//! (`ncclCommInitAll`), and the sum of the ranks' gradient vectors as one grouped all-reduce.
//! NCCL picks its own transport (NVLink, PCIe, shared memory).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp1, Device, Error, Layout, Shape, Tensor};
use cudarc::nccl::{group_end, group_start, Comm, ReduceOp};

use super::error::{Result, TrainError};

/// One NCCL communicator per rank's device, rank 0 first.
pub struct Communicators(Vec<Comm>);

// SAFETY: a communicator is a handle NCCL lets any thread use, one call at a time; the trainer
// that owns these moves between threads but calls them from one thread at a time.
unsafe impl Send for Communicators {}

impl Communicators {
    /// A communicator for each of `devices` (distinct CUDA devices), on candle's stream of each,
    /// so that the reductions are ordered with the kernels that computed the gradients.
    pub fn new(devices: &[Device]) -> Result<Self> {
        // NVLink multicast stays off. `art` and gpu_bench set this first thing in `main`
        // (`process::set_nccl_defaults`); this is for a program that did not, where the write
        // may race another thread's read of the environment.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let streams = devices
            .iter()
            .map(|d| Ok(d.as_cuda_device()?.cuda_stream()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams)
            .map_err(|e| TrainError::DataParallel(format!("NCCL could not start: {e:?}")))?;
        Ok(Communicators(comms))
    }

    /// The element-wise sum of `flats` (one contiguous f32 vector per rank, on its device), on
    /// every rank.
    pub fn all_reduce_sum(&self, flats: &[Tensor]) -> Result<Vec<Tensor>> {
        // One group: NCCL starts the collective once every rank's part is queued (a single
        // thread calling the ranks one after the other would otherwise wait on itself).
        group_start().map_err(nccl_error)?;
        let sums: candle_core::Result<Vec<Tensor>> = self
            .0
            .iter()
            .zip(flats)
            .map(|(comm, flat)| flat.contiguous()?.apply_op1_no_bwd(&AllReduceSum(comm)))
            .collect();
        group_end().map_err(nccl_error)?;
        Ok(sums?)
    }
}

fn nccl_error(e: impl std::fmt::Debug) -> TrainError {
    TrainError::DataParallel(format!("NCCL: {e:?}"))
}

/// The all-reduce of one rank's vector into a new one, as a candle op (so that the result is a
/// tensor on the rank's device).
struct AllReduceSum<'a>(&'a Comm);

impl CustomOp1 for AllReduceSum<'_> {
    fn name(&self) -> &'static str {
        "art-nccl-all-reduce-sum"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        Err(Error::Msg("NCCL all-reduce of a CPU tensor".into()))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| Error::Msg("NCCL all-reduce of a strided tensor".into()))?;
        let src = s.as_cuda_slice::<f32>()?.slice(start..end);
        let device = s.device().clone();
        let mut dst = device.alloc_zeros::<f32>(end - start)?;
        self.0
            .all_reduce(&src, &mut dst, &ReduceOp::Sum)
            .map_err(|e| Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, device), l.shape().clone()))
    }
}
