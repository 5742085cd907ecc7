//! candle's quantized CPU matmul against its dense f32 matmul, on one SmolLM2-sized layer
//! (1536 x 576), for the GGUF block formats that matter here. Shows why the engine infers with
//! dense weights by default on CPU: candle has no SIMD kernel for Q4_1 (SmolLM2's format).
//!
//! cargo run --release -p art-core --features engine --example bench_qmatmul
use art_core::engine::candle::quantized::{GgmlDType, QMatMul, QTensor};
use art_core::engine::candle::{Device, Module, Tensor};
use std::time::Instant;
fn main() {
    // SAFETY: first thing in main: no other thread exists yet.
    unsafe { art_core::engine::process::set_cpu_thread_defaults() };
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (1536, 576), &dev).unwrap();
    for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let q = QMatMul::from_qtensor(QTensor::quantize(&w, dt).unwrap()).unwrap();
        for rows in [1usize, 8, 32, 128] {
            let x = Tensor::randn(0f32, 1.0, (rows, 576), &dev).unwrap();
            let _ = q.forward(&x).unwrap();
            let t = Instant::now();
            for _ in 0..20 {
                let _ = q.forward(&x).unwrap();
            }
            let qt = t.elapsed().as_secs_f64() / 20.0;
            let t = Instant::now();
            for _ in 0..20 {
                let _ = x.matmul(&w.t().unwrap()).unwrap();
            }
            let dt_ = t.elapsed().as_secs_f64() / 20.0;
            let flops = 2.0 * rows as f64 * 1536.0 * 576.0;
            println!("{dt:?} rows {rows:>3}: quant {:.3} ms ({:.1} GFLOP/s) dense {:.3} ms ({:.1} GFLOP/s)", qt*1e3, flops/qt/1e9, dt_*1e3, flops/dt_/1e9);
        }
    }
}
