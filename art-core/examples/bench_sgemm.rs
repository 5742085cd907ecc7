//! Our packed CPU product kernel (`engine/sgemm.rs`) against candle's gemm, on the products of a
//! SmolLM2-135M training step (1,024 token rows times each layer's weights and the 49k-row
//! language-model head), through `Linear::forward`. Rounds alternate the two so that both see the
//! same machine load; prints GFLOP/s, the ratio, and the largest difference between their results.
//!
//! cargo run --release -p art-core --features engine --example bench_sgemm
use std::time::Instant;

use art_core::engine::candle::{Device, Tensor};
use art_core::engine::{set_cpu_sgemm, Linear};

const ROUNDS: usize = 3;
const CALLS: usize = 4;

fn main() -> anyhow::Result<()> {
    let device = Device::Cpu;
    // (rows, in, out): q/o, k/v, gate/up, down, head.
    let shapes = [
        (1024, 576, 576),
        (1024, 576, 192),
        (1024, 576, 1536),
        (1024, 1536, 576),
        (1024, 576, 49152),
    ];
    for (rows, inputs, outputs) in shapes {
        let x = Tensor::randn(0f32, 1.0, (rows, inputs), &device)?;
        let layer = Linear::new(Tensor::randn(0f32, 0.05, (outputs, inputs), &device)?, None);
        let mut seconds = [0.0f64; 2];
        let mut results = Vec::new();
        for round in 0..=ROUNDS {
            for (slot, ours) in [false, true].into_iter().enumerate() {
                set_cpu_sgemm(ours);
                let started = Instant::now();
                for _ in 0..CALLS {
                    let y = layer.forward(&x, false, None, 0.0)?;
                    if round == 0 && results.len() == slot {
                        results.push(y);
                    }
                }
                // Round 0 warms both up.
                if round > 0 {
                    seconds[slot] += started.elapsed().as_secs_f64();
                }
            }
        }
        let flops = 2.0 * (rows * inputs * outputs) as f64 * (ROUNDS * CALLS) as f64;
        let difference = (&results[0] - &results[1])?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        println!(
            "{rows} x {inputs} -> {outputs}: candle's gemm {:.1} GFLOP/s, ours {:.1} GFLOP/s, \
             ratio {:.2}x, largest difference {difference:.1e}",
            flops / seconds[0] / 1e9,
            flops / seconds[1] / 1e9,
            seconds[0] / seconds[1]
        );
    }
    Ok(())
}
