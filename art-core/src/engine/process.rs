//! Process-wide settings that make the engine run well on a CPU: candle's thread counts and
//! glibc's allocator. They belong to the program, not to a library that might be one part of it:
//! the `art` binary and the benchmarks apply them first thing in `main`; a program that embeds
//! the engine decides for itself (without them, results are the same, only slower).

/// Sets candle's thread counts, where the environment does not already set them:
/// - `CANDLE_NUM_THREADS=1`: candle's element-wise CPU ops run on the calling thread. candle
///   0.11 hands every large element-wise op to a pool whose caller spins until the other workers
///   report back; those ops are memory-bound (a second core gains little), and on a shared
///   machine the caller spins for as long as a descheduled worker sleeps: on a loaded 2-core
///   machine a fifth of a training step's CPU time went to that spin.
/// - `RAYON_NUM_THREADS=<physical cores>`: matrix products keep every core, and candle stops
///   counting the cores by reading /proc/cpuinfo on every matmul (14% of a decoding step at
///   batch 8) when the variable is unset.
///
/// # Safety
/// This writes environment variables: call it while the program has no other thread (first
/// thing in `main`, before a tokio runtime starts), as [`std::env::set_var`] requires.
pub unsafe fn set_cpu_thread_defaults() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cores = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", cores.to_string());
    }
}

/// Keeps NVLink multicast (NVLS) off in NCCL unless `NCCL_NVLS_ENABLE` is set: on hosts whose
/// GPUs others share, a program using it can take them out of service. Data-parallel training
/// sets the same when it starts NCCL; called first thing in `main`, the write races no thread.
///
/// # Safety
/// As [`set_cpu_thread_defaults`]: call it while the program has no other thread.
pub unsafe fn set_nccl_defaults() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// Keeps freed memory in the process for reuse instead of returning it to the kernel at once
/// (`art serve --malloc-tuning off` leaves glibc's defaults). A training step allocates and
/// frees hundreds of megabytes of activations and gradients; with glibc's defaults, every buffer
/// above its adaptive threshold is a fresh `mmap` whose pages fault in and are zeroed on first
/// touch: 17% of a CPU training step's time was system time. Here buffers up to 32 MiB (glibc's
/// largest threshold) come from the heap, and up to 1 GiB of freed heap is kept. Measured on
/// train_bench (SmolLM2, 8 x 128, three iterations, three alternating runs each way): system
/// time 9.2-10.8 -> 5.8-6.4 s, 72.5 -> 77.8 tok/s on average. The price is a process that keeps
/// its peak heap. glibc only (elsewhere it does nothing); best called before the model loads.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters (glibc serializes it with allocation); a
    // parameter it refuses stays at glibc's default.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}
