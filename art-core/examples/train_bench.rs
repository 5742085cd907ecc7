//! Training throughput: forward + backward (+ AdamW) of the GRPO loss with LoRA, in tokens/s.
//!
//! ```text
//! # CPU, SmolLM2-135M-Instruct (dense f32 weights), 8 x 256 tokens:
//! cargo run --release -p art-core --features train --example train_bench -- \
//!     --model models/SmolLM2-135M-Instruct.Q4_1.gguf --batch 8 --seq 256
//! # GPU, random weights of Qwen2.5-0.5B's shape, 8 x 512 tokens (bf16):
//! cargo run --release -p art-core --features train,cuda --example train_bench -- \
//!     --random qwen2.5-0.5b --device cuda --batch 8 --seq 512
//! ```
//!
//! `--compare` alternates iterations with candle's composite ops (the reference) and with the
//! engine's fused kernels, and prints the speed-up measured under the same load;
//! `--checkpointing on|off|auto` picks how the backward gets the layers' activations: every
//! layer recomputed (on), candle's whole graph kept (off), or the trainer's default (auto: the
//! hand-written layer backward, keeping as many layers' activations as memory allows).
//! `--compare-checkpointing` alternates the whole graph (the reference) with that choice.
//!
//! Prints tokens/s and the ratio to a reference (`--reference`, default: PyTorch with transformers
//! and peft measured on the same CPU for SmolLM2, 262 tok/s; for `--random`, the HF+peft figure for
//! that shape measured on an H200: 23,779 / 19,883 / 6,866 tok/s for Qwen2.5-0.5B / 1.5B / 7B).
//! `gpu_bench` runs the GPU figures for all three shapes in one command.

use std::sync::Arc;
use std::time::Instant;

use art_core::engine::random::RandomModelSpec;
use art_core::engine::{DType, Device, Engine, LoadOptions, LoraAdapter, ModelSource};
use art_core::train::{
    micro_batch_loss, AdamW, AdamWParams, Normalization, SequenceSource, TrainSequence,
};
use art_core::types::{LoraConfig, TrainConfig};

struct Args {
    model: Option<String>,
    random: Option<String>,
    device: String,
    batch: usize,
    seq: usize,
    iters: usize,
    micro_batch_tokens: usize,
    reference: Option<f64>,
    compare: bool,
    compare_checkpointing: bool,
    checkpointing: Option<bool>,
}

fn parse_args() -> Args {
    let mut args = Args {
        model: None,
        random: None,
        device: "cpu".into(),
        batch: 8,
        seq: 256,
        iters: 3,
        micro_batch_tokens: 0,
        reference: None,
        compare: false,
        compare_checkpointing: false,
        checkpointing: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = Some(value()),
            "--random" => args.random = Some(value()),
            "--device" => args.device = value(),
            "--batch" => args.batch = value().parse().expect("--batch N"),
            "--seq" => args.seq = value().parse().expect("--seq N"),
            "--iters" => args.iters = value().parse().expect("--iters N"),
            "--micro-batch-tokens" => {
                args.micro_batch_tokens = value().parse().expect("--micro-batch-tokens N")
            }
            "--compare" => args.compare = true,
            "--compare-checkpointing" => args.compare_checkpointing = true,
            "--checkpointing" => {
                args.checkpointing = match value().as_str() {
                    "on" => Some(true),
                    "off" => Some(false),
                    "auto" => None,
                    other => panic!("--checkpointing on|off|auto, not {other}"),
                }
            }
            "--reference" => args.reference = Some(value().parse().expect("--reference TOK/S")),
            other => panic!("unknown flag {other}; see the example's docs"),
        }
    }
    args
}

fn main() {
    // SAFETY: first thing in main: no other thread exists yet.
    unsafe { art_core::engine::process::set_cpu_thread_defaults() };
    art_core::engine::process::tune_allocator();
    let args = parse_args();
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => {
            art_core::engine::cuda_device(0).expect("a CUDA device (build with --features cuda)")
        }
        other => panic!("--device cpu|cuda, not {other}"),
    };
    let options = LoadOptions {
        device: device.clone(),
        dtype: None,
        keep_quantized: false,
    };
    let (engine, label, default_ref) = match (&args.model, &args.random) {
        (Some(path), _) => {
            let engine = Engine::load(&ModelSource::parse(path), &options).expect("load model");
            (engine, path.clone(), 262.0)
        }
        (None, Some(shape)) => {
            // Random weights drawn on the device itself (no files): see RandomModelSpec::named.
            let spec = RandomModelSpec::named(shape).unwrap_or_else(|| {
                panic!("unknown --random shape {shape}: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or tiny")
            });
            let dtype = if device.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            };
            let weights = spec
                .weights_on_device(0, &device, dtype)
                .expect("random weights");
            let loaded = spec.load(weights, &device, dtype).expect("build model");
            let reference = match shape.as_str() {
                "qwen2.5-1.5b" => 19_883.0,
                "qwen2.5-7b" => 6_866.0,
                _ => 23_779.0,
            };
            (
                Engine::from_loaded(loaded),
                format!("random {shape}"),
                reference,
            )
        }
        (None, None) => panic!("pass --model PATH or --random SHAPE"),
    };
    let engine = Arc::new(engine);
    let reference = args.reference.unwrap_or(default_ref);
    let config = engine.config().clone();
    let lora = LoraConfig::default(); // r = 8, alpha = 16, all seven linear layers
    let adapter = LoraAdapter::new(&config, &lora, engine.device(), 0).expect("adapter");
    let mut optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();

    // Synthetic sequences: the first quarter is prompt, the rest sampled (trainable), with
    // made-up sampler logprobs and alternating advantages.
    let vocab = config.vocab_size.min(32_000) as u64;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let sequences: Vec<TrainSequence> = (0..args.batch)
        .map(|r| {
            let tokens: Vec<u32> = (0..args.seq).map(|_| (next() % vocab) as u32).collect();
            let trainable: Vec<bool> = (0..args.seq).map(|i| i >= args.seq / 4).collect();
            let sampler_logprobs = trainable
                .iter()
                .map(|&t| if t { -3.0 } else { f32::NAN })
                .collect();
            TrainSequence {
                tokens,
                trainable,
                sampler_logprobs,
                advantage: if r % 2 == 0 { 1.0 } else { -1.0 },
                source: SequenceSource {
                    group: Some(0),
                    trajectory: r,
                    history: None,
                },
            }
        })
        .collect();
    let mut train_config = TrainConfig {
        learning_rate: 1e-5,
        gradient_checkpointing: args.checkpointing,
        micro_batch_tokens: if args.micro_batch_tokens > 0 {
            args.micro_batch_tokens
        } else {
            args.batch * args.seq
        },
        ..Default::default()
    };
    let norm = Normalization::for_step(&sequences, &train_config);
    let batches = art_core::train::plan_micro_batches(&sequences, &train_config, &device);
    let named = adapter.named_vars();
    let tokens = args.batch * args.seq;
    println!(
        "model: {label} ({} layers, hidden {}), device {:?}, dtype {:?}; LoRA r={} on {} modules; \
         {} x {} tokens in {} micro-batch(es)",
        config.num_hidden_layers,
        config.hidden_size,
        args.device,
        engine.model().dtype(),
        lora.rank,
        lora.target_modules.len(),
        args.batch,
        args.seq,
        batches.len()
    );
    let mut rates = Vec::new();
    let mut composite_rates = Vec::new();
    // With --compare, iterations alternate between candle's composite ops (the reference, odd
    // iterations) and the fused kernels (even ones), so that both see the same machine load;
    // likewise the whole graph and checkpointing with --compare-checkpointing.
    let comparing = args.compare || args.compare_checkpointing;
    let total_iters = if comparing {
        2 * args.iters + 1
    } else {
        args.iters
    };
    for iter in 0..=total_iters {
        let composite = comparing && iter % 2 == 1;
        art_core::engine::set_fused_ops(!(composite && args.compare));
        if args.compare_checkpointing {
            train_config.gradient_checkpointing = match composite {
                true => Some(false),
                false => args.checkpointing,
            };
        }
        let t0 = Instant::now();
        let mut grads: Vec<Option<art_core::engine::Tensor>> = vec![None; named.len()];
        for mb in &batches {
            let mut out = micro_batch_loss(
                engine.model(),
                Some(&adapter),
                None,
                &mb.gather(&sequences),
                norm,
                &train_config,
                true,
            )
            .expect("loss");
            let store = out.backward(engine.model(), &adapter).expect("backward");
            for (slot, (_, var)) in grads.iter_mut().zip(&named) {
                if let Some(g) = store.get(var.as_tensor()) {
                    *slot = Some(match slot.take() {
                        Some(acc) => acc.add(g).unwrap(),
                        None => g.clone(),
                    });
                }
            }
        }
        optimizer.step(&grads, 1e-5, 0.0).unwrap();
        device.synchronize().unwrap();
        let dt = t0.elapsed().as_secs_f64();
        let rate = tokens as f64 / dt;
        println!(
            "iter {iter}{}: {dt:.2} s, {rate:.0} tok/s",
            if iter == 0 {
                " (warm-up)"
            } else if composite && args.compare {
                " (composite ops)"
            } else if composite {
                " (whole graph)"
            } else {
                ""
            }
        );
        if composite {
            composite_rates.push(rate);
        } else if iter > 0 {
            rates.push(rate);
        }
    }
    if comparing {
        let composite = composite_rates.iter().sum::<f64>() / composite_rates.len() as f64;
        let fused = rates.iter().sum::<f64>() / rates.len() as f64;
        let (new, old) = if args.compare {
            ("fused kernels", "candle's composite ops")
        } else {
            ("the layer-by-layer backward", "the whole graph")
        };
        println!(
            "{new} {fused:.1} tok/s vs {old} {composite:.1} tok/s: speed-up {:.2}x",
            fused / composite
        );
    }
    let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    println!(
        "fwd+bwd+AdamW with LoRA: {mean:.0} tok/s; reference {reference:.0} tok/s; ratio {:.2}",
        mean / reference
    );
}
