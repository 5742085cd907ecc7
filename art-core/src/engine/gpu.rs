//! The GPU device and its memory: how the engine opens a CUDA device, and how much of the
//! card's memory is in use (for benchmarks and logs).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{DType, Device, Tensor};

use super::error::Result;

/// Opens CUDA device `ordinal` the way the engine runs best on it: one stream that every thread
/// shares (so work from the server's threads and the trainer is ordered by the stream itself),
/// without cudarc's per-buffer event tracking, which only matters across streams and costs
/// host time on every kernel launch. `ART_CUDA_EVENTS=1` keeps the tracking on.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    #[cfg(feature = "cuda")]
    if !super::switches::CUDA_EVENTS.on() {
        // SAFETY: every tensor of this device is made and used on its one stream (above), and
        // nothing has been allocated on it yet.
        unsafe { device.as_cuda_device()?.disable_event_tracking() };
    }
    #[cfg(feature = "cuda")]
    if !super::switches::CUDA_POOL_TRIM.on() {
        keep_freed_memory(&device)?;
    }
    Ok(device)
}

/// Makes the device's memory pool keep the memory freed into it instead of returning it to the
/// driver at every synchronization (CUDA's default release threshold is 0). A training step
/// synchronizes several times (the host reads the loss and the ratios) and allocates gigabytes
/// between; with the default, every step's allocations mapped fresh memory again, which held
/// the host at each kernel launch and left the GPU waiting. `ART_CUDA_POOL_TRIM=1` keeps
/// CUDA's default.
#[cfg(feature = "cuda")]
fn keep_freed_memory(device: &Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut threshold = u64::MAX;
    // SAFETY: a plain driver call on the device's own pool, with a valid pointer to the value.
    let status = unsafe {
        match default_pool(device)? {
            Ok(pool) => sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            ),
            Err(failed) => failed,
        }
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(candle_core::Error::Msg(format!(
            "could not set the CUDA memory pool's release threshold: {status:?}"
        ))
        .into());
    }
    Ok(())
}

/// The device's default memory pool (the one candle's stream-ordered allocations come from).
#[cfg(feature = "cuda")]
fn default_pool(
    device: &Device,
) -> Result<
    std::result::Result<
        candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool,
        candle_core::cuda_backend::cudarc::driver::sys::CUresult,
    >,
> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = device.as_cuda_device()?.cuda_stream();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a plain driver call on the context's own device, with a valid out-pointer.
    let status = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, stream.context().cu_device()) };
    Ok(match status {
        sys::CUresult::CUDA_SUCCESS => Ok(pool),
        failed => Err(failed),
    })
}

/// Bytes the device's memory pool holds without using them (freed memory it keeps, see
/// [`keep_freed_memory`]): free for this process's next allocations, though the driver counts
/// them as used.
#[cfg(feature = "cuda")]
fn pool_spare_bytes(device: &Device) -> Option<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(device).ok()?.ok()?;
    let read = |attribute| {
        let mut value = 0u64;
        // SAFETY: a plain driver call on a valid pool, with a valid pointer to a u64, the
        // type of the reserved and used attributes.
        let status =
            unsafe { sys::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) };
        (status == sys::CUresult::CUDA_SUCCESS).then_some(value as usize)
    };
    let reserved = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
    let used = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
    Some(reserved.saturating_sub(used))
}

/// The memory a training step may spend keeping layers' activations instead of recomputing
/// them: a quarter of what the device has available now (on a GPU, the driver's free memory
/// and what the allocator's pool holds unused, and at most a quarter of the card, so that the
/// choice does not swing with what earlier steps left in the pool; on the CPU, of the host's
/// available memory). The serving side's caches have their own budget, taken at start-up.
pub fn activation_budget(device: &Device) -> usize {
    const GIB: usize = 1 << 30;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let Some((free, total)) = gpu_memory(device) else {
            return 0;
        };
        let available = free + pool_spare_bytes(device).unwrap_or(0);
        return (available / 4).min(total / 4);
    }
    let _ = device;
    available_host_memory().map_or(GIB, |bytes| bytes / 4)
}

/// How many CUDA devices the machine has (an error in a build without CUDA, or without a driver).
pub fn cuda_device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let count = CudaContext::device_count().map_err(|e| {
            candle_core::Error::Msg(format!("could not count the CUDA devices: {e:?}"))
        })?;
        Ok(count.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    Err(candle_core::Error::Msg("this build has no CUDA support (feature `cuda`)".into()).into())
}

/// `(free, total)` bytes of the GPU's memory, or `None` for a CPU device.
pub fn gpu_memory(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}

/// Writes `named` tensors as `dtype` to a safetensors file at `path`, brought to the host first
/// in one transfer (see [`to_host`]).
pub fn save_safetensors(named: Vec<(String, Tensor)>, dtype: DType, path: &Path) -> Result<()> {
    let (names, values): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    let tensors: HashMap<String, Tensor> =
        names.into_iter().zip(to_host(&values, dtype)?).collect();
    candle_core::safetensors::save(&tensors, path)?;
    Ok(())
}

/// `tensors` on the host as `dtype`. From a GPU in one transfer: copied one by one, each
/// would wait for the device on its own (a checkpoint's adapter and optimizer state are ~1,300
/// tensors, and the waits took most of a GPU training step's checkpoint).
fn to_host(tensors: &[Tensor], dtype: DType) -> Result<Vec<Tensor>> {
    if tensors.iter().all(|t| t.device().is_cpu()) {
        return Ok(tensors
            .iter()
            .map(|t| t.to_dtype(dtype))
            .collect::<candle_core::Result<_>>()?);
    }
    let flat = tensors
        .iter()
        .map(|t| t.to_dtype(dtype)?.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let all = Tensor::cat(&flat, 0)?.to_device(&Device::Cpu)?;
    let mut offset = 0;
    let mut host = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t.elem_count();
        host.push(all.narrow(0, offset, n)?.reshape(t.shape())?);
        offset += n;
    }
    Ok(host)
}

/// Bytes of memory the machine has available (Linux's `MemAvailable`), if it says.
pub fn available_host_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Samples the GPU's memory in use on a background thread (every millisecond) and keeps the
/// highest reading: the whole card's use, this process's context and allocator pools included,
/// as `nvidia-smi` counts it.
pub struct PeakMemory {
    peak: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PeakMemory {
    /// Starts sampling; `None` for a CPU device.
    pub fn start(device: &Device) -> Option<Self> {
        let (free, total) = gpu_memory(device)?;
        let peak = Arc::new(AtomicUsize::new(total - free));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s, d) = (peak.clone(), stop.clone(), device.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some((free, total)) = gpu_memory(&d) {
                    p.fetch_max(total - free, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        });
        Some(PeakMemory {
            peak,
            stop,
            thread: Some(thread),
        })
    }

    /// The highest use seen so far, in bytes.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new measurement from the current use.
    pub fn reset(&self, device: &Device) {
        if let Some((free, total)) = gpu_memory(device) {
            self.peak.store(total - free, Ordering::Relaxed);
        }
    }
}

impl Drop for PeakMemory {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
