//! Decode throughput on SmolLM2-135M-Instruct (Q4_1 GGUF) on this machine.
//!
//! cargo run --release -p art-core --features engine --example bench_decode [-- MODEL.gguf] [--batches 1,8,32] [--quantized | --quantized-only]
//!
//! For each batch size: prompts of ~128 tokens, 128 sampled tokens each (ignore_eos), prints
//! prefill and decode tokens/s for the dense f32 weights (and the quantized ones with --quantized).
//!
//! `--llama-cpp DIR` (a llama.cpp build's `bin` directory) then runs llama.cpp on the same GGUF
//! file in the same invocation, `llama-batched-bench` with the same prompt length, generated
//! tokens and batch sizes (one sequence per batch slot), and prints our decode and prefill speed as
//! ratios to it.
use std::process::Command;
use std::time::Instant;

use art_core::engine::{Engine, GenerationRequest, LoadOptions, ModelSource, SamplingParams};

fn main() {
    // SAFETY: first thing in main: no other thread exists yet.
    unsafe { art_core::engine::process::set_cpu_thread_defaults() };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut model = String::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut batches = vec![1usize, 8, 32];
    let mut quantized_too = false;
    let mut dense_too = true;
    let mut gen_tokens = 128usize;
    let mut llama_cpp: Option<String> = None;
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
            "--quantized-only" => {
                quantized_too = true;
                dense_too = false
            }
            "--llama-cpp" => llama_cpp = Some(it.next().expect("--llama-cpp DIR").clone()),
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
    let mut modes = Vec::new();
    if dense_too {
        modes.push(false);
    }
    if quantized_too {
        modes.push(true);
    }
    let mut ours = Vec::new();
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
            let (prefill_rate, decode_rate) =
                (prompt_tokens as f64 / prefill, decoded as f64 / decode);
            println!(
                "{label:>9} batch {batch:>3}: prefill {prompt_tokens:>5} tok in {prefill:6.2}s = {prefill_rate:7.1} tok/s | decode {decoded:>5} tok in {decode:6.2}s = {decode_rate:7.1} tok/s",
            );
            ours.push((label, batch, prefill_rate, decode_rate));
        }
    }
    if let Some(dir) = llama_cpp {
        let reference = llama_cpp_rates(&dir, &model, &batches, gen_tokens);
        println!("\nratio to llama.cpp (same model file, prompt 128, {gen_tokens} generated tokens per sequence):");
        for (label, batch, prefill, decode) in ours {
            let Some((ref_prefill, ref_decode)) = reference.get(&batch) else {
                continue;
            };
            println!(
                "{label:>9} batch {batch:>3}: decode {decode:7.1} vs {ref_decode:7.1} tok/s = {:.2}x | prefill {prefill:7.1} vs {ref_prefill:7.1} tok/s = {:.2}x",
                decode / ref_decode,
                prefill / ref_prefill,
            );
        }
    }
}

/// llama.cpp's prefill and decode tokens/s per batch size, from `llama-batched-bench` (one
/// sequence per batch slot, the KV cache not shared, as many threads as the machine has cores).
fn llama_cpp_rates(
    dir: &str,
    model: &str,
    batches: &[usize],
    gen_tokens: usize,
) -> std::collections::HashMap<usize, (f64, f64)> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let slots: Vec<String> = batches.iter().map(ToString::to_string).collect();
    let largest = batches.iter().max().copied().unwrap_or(1);
    let context = largest * (128 + gen_tokens) + 16;
    let output = Command::new(format!("{dir}/llama-batched-bench"))
        .args(["-m", model, "-npp", "128", "-ntg", &gen_tokens.to_string()])
        .args([
            "-npl",
            &slots.join(","),
            "-c",
            &context.to_string(),
            "-b",
            "2048",
        ])
        .args(["-t", &threads.to_string(), "--output-format", "jsonl"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {dir}/llama-batched-bench: {e}"));
    assert!(
        output.status.success(),
        "llama-batched-bench failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The JSON lines go to llama.cpp's log (stdout or stderr, depending on the build).
    let log = [output.stdout, output.stderr].concat();
    String::from_utf8_lossy(&log)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|row| {
            let batch = row["pl"].as_u64()? as usize;
            Some((
                batch,
                (row["speed_pp"].as_f64()?, row["speed_tg"].as_f64()?),
            ))
        })
        .collect()
}
