//! Decode throughput on SmolLM2-135M-Instruct (Q4_1 GGUF) on this machine.
//!
//! cargo run --release -p art-core --features engine --example bench_decode [-- MODEL.gguf] [--batches 1,8,32] [--quantized]
//!
//! For each batch size: prompts of ~128 tokens, 128 sampled tokens each (ignore_eos), prints
//! prefill and decode tokens/s for the dense f32 weights (and the quantized ones with --quantized).
use std::time::Instant;

use art_core::engine::{Engine, GenerationRequest, LoadOptions, ModelSource, SamplingParams};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut model = String::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut batches = vec![1usize, 8, 32];
    let mut quantized_too = false;
    let mut gen_tokens = 128usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--batches" => {
                batches = it
                    .next()
                    .expect("--batches 1,8,32")
                    .split(',')
                    .map(|b| b.parse().expect("batch size"))
                    .collect()
            }
            "--tokens" => gen_tokens = it.next().expect("--tokens N").parse().expect("N"),
            "--quantized" => quantized_too = true,
            other => model = other.to_string(),
        }
    }
    let t = Instant::now();
    let engine = Engine::load(&ModelSource::parse(&model), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "loaded {} in {:.2}s",
        engine.name(),
        t.elapsed().as_secs_f64()
    );
    let base = "The history of the city begins in antiquity, when a small settlement grew up on \
                the banks of the river. Over the centuries it became a center of trade, learning \
                and art. ";
    let mut modes = vec![false];
    if quantized_too {
        modes.push(true);
    }
    for quantized in modes {
        engine.set_use_quantized(quantized);
        let label = if engine.use_quantized() {
            "quantized"
        } else {
            "dense f32"
        };
        for &batch in &batches {
            let requests: Vec<GenerationRequest> = (0..batch)
                .map(|i| {
                    let mut prompt = engine
                        .encode(&format!("Story {i}. {}", base.repeat(4)), false)
                        .unwrap();
                    prompt.truncate(128);
                    GenerationRequest {
                        prompt,
                        params: SamplingParams {
                            temperature: 0.8,
                            top_p: 0.95,
                            seed: Some(i as u64),
                            max_tokens: gen_tokens,
                            ignore_eos: true,
                            ..Default::default()
                        },
                        adapter: None,
                    }
                })
                .collect();
            let prompt_tokens: usize = requests.iter().map(|r| r.prompt.len()).sum();
            let mut scheduler = engine.scheduler();
            for r in requests {
                scheduler.add(r).unwrap();
            }
            // The first step prefills every prompt (and samples each first token).
            let t0 = Instant::now();
            scheduler.max_prefill_tokens_per_step = usize::MAX;
            let mut generated = scheduler.step().unwrap().len();
            let prefill = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            while !scheduler.is_idle() {
                generated += scheduler.step().unwrap().len();
            }
            let decode = t1.elapsed().as_secs_f64();
            let decoded = generated - batch;
            println!(
                "{label:>9} batch {batch:>3}: prefill {prompt_tokens:>5} tok in {prefill:6.2}s = {:7.1} tok/s | decode {decoded:>5} tok in {decode:6.2}s = {:7.1} tok/s",
                prompt_tokens as f64 / prefill,
                decoded as f64 / decode,
            );
        }
    }
}
