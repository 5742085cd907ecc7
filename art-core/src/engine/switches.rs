//! Every runtime switch of the engine, in one table ([`ALL`]; the README lists the same). Each
//! turns an optional path on or off: the variable set to `1` turns it on, `0` off, and unset
//! leaves the default. A switch reads its variable once, the first time it is asked; after that,
//! [`Switch::set`] changes it in-process (for benchmarks and checks that compare both paths in
//! one run). Nothing here writes the environment.

use std::sync::atomic::{AtomicU8, Ordering};

/// One on/off switch read from an `ART_*` environment variable.
pub struct Switch {
    /// The environment variable.
    pub var: &'static str,
    /// On or off when the variable is unset.
    pub default: bool,
    /// What "on" means, for the README's table and `art serve`'s start-up line.
    pub what: &'static str,
    /// 0: not read yet, 1: off, 2: on.
    state: AtomicU8,
}

impl Switch {
    const fn new(var: &'static str, default: bool, what: &'static str) -> Self {
        Switch {
            var,
            default,
            what,
            state: AtomicU8::new(0),
        }
    }

    pub fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = match std::env::var(self.var).as_deref() {
                    Ok("1") => true,
                    Ok("0") => false,
                    _ => self.default,
                };
                self.set(on);
                on
            }
            state => state == 2,
        }
    }

    pub fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }
}

pub static FUSED_OPS: Switch = Switch::new(
    "ART_FUSED_OPS",
    true,
    "fused CPU kernels (RMSNorm, RoPE, SiLU-gate, softmax) with their backward; off: candle's composite ops",
);
pub static QGEMM: Switch = Switch::new(
    "ART_QGEMM",
    true,
    "repacked AVX-512 VNNI kernels for quantized (GGUF) weights; off: candle's",
);
pub static SKINNY_MATMUL: Switch = Switch::new(
    "ART_SKINNY_MATMUL",
    true,
    "our kernel for dense products of a few rows (decoding); off: candle's gemm",
);
pub static MANUAL_BACKWARD: Switch = Switch::new(
    "ART_MANUAL_BACKWARD",
    true,
    "the hand-written layer backward of checkpointed training; off: candle's autograd",
);
pub static DECODE_KERNEL: Switch = Switch::new(
    "ART_DECODE_KERNEL",
    true,
    "CUDA: the fused decode-attention kernel; off: the composite path",
);
pub static CUDA_GRAPHS: Switch = Switch::new(
    "ART_CUDA_GRAPHS",
    true,
    "CUDA: replay each decode step from a graph captured per batch size and adapter; off: launch its kernels one by one",
);
pub static DECODE_GEMV: Switch = Switch::new(
    "ART_DECODE_GEMV",
    false,
    "CUDA: our products for decode steps of up to 8 sequences (each weight read once for all rows, the LoRA update inside); off: cuBLAS",
);
pub static GPU_SAMPLE: Switch = Switch::new(
    "ART_GPU_SAMPLE",
    true,
    "CUDA: sample unconstrained rows on the GPU; off: copy logits to the host",
);
pub static CUDA_EVENTS: Switch = Switch::new(
    "ART_CUDA_EVENTS",
    false,
    "CUDA: cudarc's per-buffer event tracking (only needed across streams; costs host time per launch)",
);
pub static CUDA_POOL_TRIM: Switch = Switch::new(
    "ART_CUDA_POOL_TRIM",
    false,
    "CUDA: return freed memory to the driver at each synchronization (CUDA's default); off: keep it pooled",
);
pub static PROFILE_DECODE: Switch = Switch::new(
    "ART_PROFILE_DECODE",
    false,
    "time each phase of the scheduler's steps and print the totals whenever it runs out of work",
);
pub static PROFILE_TRAIN: Switch = Switch::new(
    "ART_PROFILE_TRAIN",
    false,
    "print each training step's split: preparing the batch, the update, writing the checkpoint, serving it",
);

/// All of the engine's switches.
pub static ALL: [&Switch; 12] = [
    &FUSED_OPS,
    &QGEMM,
    &SKINNY_MATMUL,
    &MANUAL_BACKWARD,
    &DECODE_KERNEL,
    &CUDA_GRAPHS,
    &DECODE_GEMV,
    &GPU_SAMPLE,
    &CUDA_EVENTS,
    &CUDA_POOL_TRIM,
    &PROFILE_DECODE,
    &PROFILE_TRAIN,
];

/// The switches that differ from their defaults, as `VAR=0/1` (empty when none do).
pub fn changed() -> Vec<String> {
    ALL.iter()
        .filter(|s| s.on() != s.default)
        .map(|s| format!("{}={}", s.var, u8::from(s.on())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_documents_every_switch() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
            .expect("README.md");
        for switch in ALL {
            let default = if switch.default { "1" } else { "0" };
            let row = format!("| `{}` | {default} |", switch.var);
            assert!(
                readme.contains(&row),
                "README.md has no row starting `{row}` for {}",
                switch.what
            );
        }
    }

    #[test]
    fn a_switch_reads_one_and_zero_and_can_be_set() {
        static PROBE: Switch = Switch::new("ART_TEST_SWITCH_NEVER_SET", true, "probe");
        assert!(PROBE.on());
        PROBE.set(false);
        assert!(!PROBE.on());
    }
}
