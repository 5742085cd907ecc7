//! The engine on a GPU, in one command: decode speed, LoRA training speed, and CUDA-vs-CPU
//! parity, on random weights of real shapes built in the process (no weight files).
//!
//! ```text
//! eval "$(scripts/cuda-toolkit.sh)"
//! cargo build --release -p art-core --features train,cuda --example gpu_bench
//! # on the GPU machine:
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 gpu_bench all
//! gpu_bench decode --shapes qwen2.5-0.5b --batches 1,16,64 --prompt 128 --tokens 256
//! gpu_bench decode --compare-hf     # and compiled HF (scripts/hf_decode_reference.py), ratios
//! gpu_bench grpo --shapes qwen2.5-1.5b   # 16 prompts x 8 rollouts: n = 8, prefix cache on, off
//! gpu_bench train --shapes qwen2.5-7b --batch 8 --seq 512 --iters 3
//! gpu_bench train --compare-hf      # and HF + peft (scripts/hf_train_reference.py), ratios
//! gpu_bench packed --shapes qwen2.5-1.5b   # 64 sequences of 64-1024 tokens, packed or not
//! gpu_bench parity
//! gpu_bench profile --shapes qwen2.5-0.5b   # where a training step's time goes
//! gpu_bench dp --devices cuda:0,cuda:1 --shapes qwen2.5-1.5b   # data-parallel training: 1 vs N
//! gpu_bench nccl --devices cuda:0,cuda:1   # NCCL's all-reduce: exact sums, bus bandwidth
//! ```
//!
//! Decode: each batch size runs `batch` requests of `--prompt` random token ids, sampling
//! `--tokens` tokens each (temperature 1, ignore_eos), and reports generated tokens over the whole
//! time (prefill included, as Hugging Face's `generate` is timed) next to the decode-only rate,
//! with the GPU's peak memory in use during the run, the milliseconds per decode step and the
//! rate the weights are read at as a fraction of the card's memory bandwidth (`--hbm-gbs`).
//! `--compare-hf` then runs the compiled Hugging Face reference for the same shape and batches
//! in the same process call and prints ours against it. Train: forward + backward of the GRPO loss
//! with LoRA r=8 on all seven linear layers and an AdamW step, `--batch` x `--seq` tokens, with
//! the model FLOP/s (6 x params x tok/s) against `--peak-tflops`; with `--compare-hf`, then HF
//! transformers + peft (and Liger's kernels, when installed) on the same shape and tokens in the
//! same process call (`scripts/hf_train_reference.py`), ours against each; without it, the
//! ratio to HF + peft as measured on an H200 on 2026-12-04. Packed: a training
//! step (forward and backward of every micro-batch, as the trainer plans them) over `--count`
//! sequences of uneven lengths (`--lengths MIN-MAX`), with sequences packed into shared rows and
//! with one padded row each, same call, same sequences. Parity: logits,
//! greedy decoding and LoRA gradients of the same random weights on CUDA and on the CPU.
//! `--device cpu` runs everything on the CPU (a smoke test with `--shapes tiny`).

use std::time::Instant;

use art_core::engine::random::RandomModelSpec;
use art_core::engine::{
    check_device_sampling, set_device_sampling, switches::CUDA_GRAPHS, DType, Device, Engine,
    Forward, GenerationOutput, GenerationRequest, LoraAdapter, PackedBlock, PackedRows, PeakMemory,
    SamplingParams, Tensor,
};
use art_core::train::{
    micro_batch_loss, one_per_row, plan_micro_batches, AdamW, AdamWParams, DataParallel,
    Normalization, SequenceSource, TrainSequence,
};
use art_core::types::{LoraConfig, TrainConfig};

/// HF transformers 5.17 + peft 0.21, bf16, one H200: LoRA training tok/s (2026-12-04).
fn reference(shape: &str) -> Option<f64> {
    match shape {
        "qwen2.5-0.5b" => Some(23_779.0),
        "qwen2.5-1.5b" => Some(19_883.0),
        "qwen2.5-7b" => Some(6_866.0),
        _ => None,
    }
}

struct Args {
    command: String,
    device: String,
    shapes: Vec<String>,
    batches: Vec<usize>,
    prompt: usize,
    tokens: usize,
    /// `--grpo-prompt N`: the GRPO batch's prompt length (default 512).
    grpo_prompt: usize,
    train_batch: usize,
    seq: usize,
    iters: usize,
    /// `--checkpointing on|off|auto`: every layer recomputed, candle's whole graph, or the
    /// trainer's own choice (the default: as many layers' activations kept as memory allows).
    checkpointing: Option<bool>,
    /// `--compare-hf [SCRIPT]`: after each shape, run the Hugging Face reference (default
    /// `scripts/hf_decode_reference.py` for decode, `scripts/hf_train_reference.py` for train;
    /// empty here until the command picks it) with `--python` (default `python3`) and print
    /// ratios.
    compare_hf: Option<String>,
    /// `--peak-tflops N`: the card's dense bf16 peak, for the model FLOP utilisation train
    /// prints (default 989, an H100 or H200 SXM).
    peak_tflops: f64,
    python: String,
    /// `--hbm-gbs N`: the card's memory bandwidth for the fraction printed (default: 4,800 for
    /// a card with more than 100 GiB, an H200; else 3,350, an H100 SXM).
    hbm_gbs: Option<f64>,
    /// `packed`: `--count` sequences of lengths drawn uniformly from `--lengths MIN-MAX`, in
    /// micro-batches of `--micro-batch-tokens` positions.
    count: usize,
    lengths: (usize, usize),
    micro_batch_tokens: usize,
    /// `dp` and `nccl`: `--devices cuda:0,cuda:1` (default: `--device` alone).
    devices: Vec<String>,
}

fn parse_args() -> Args {
    let mut it = std::env::args().skip(1);
    let command = it.next().unwrap_or_else(|| "all".into());
    let mut args = Args {
        command,
        device: "cuda".into(),
        shapes: vec![
            "qwen2.5-0.5b".into(),
            "qwen2.5-1.5b".into(),
            "qwen2.5-7b".into(),
        ],
        batches: vec![1, 16, 64],
        prompt: 128,
        tokens: 256,
        grpo_prompt: 512,
        train_batch: 8,
        seq: 512,
        iters: 3,
        checkpointing: None,
        compare_hf: None,
        peak_tflops: 989.0,
        python: "python3".into(),
        hbm_gbs: None,
        count: 64,
        lengths: (64, 1024),
        micro_batch_tokens: TrainConfig::default().micro_batch_tokens,
        devices: Vec::new(),
    };
    let list = |s: String| -> Vec<String> { s.split(',').map(String::from).collect() };
    let mut it = it.peekable();
    while let Some(flag) = it.next() {
        if flag == "--compare-hf" {
            args.compare_hf = Some(match it.peek() {
                Some(next) if !next.starts_with("--") => it.next().unwrap(),
                _ => String::new(),
            });
            continue;
        }
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--device" => args.device = value(),
            "--devices" => args.devices = list(value()),
            "--shapes" => args.shapes = list(value()),
            "--batches" => {
                args.batches = list(value())
                    .iter()
                    .map(|b| b.parse().expect("--batches 1,16,64"))
                    .collect()
            }
            "--prompt" => args.prompt = value().parse().expect("--prompt N"),
            "--grpo-prompt" => args.grpo_prompt = value().parse().expect("--grpo-prompt N"),
            "--tokens" => args.tokens = value().parse().expect("--tokens N"),
            "--batch" => args.train_batch = value().parse().expect("--batch N"),
            "--seq" => args.seq = value().parse().expect("--seq N"),
            "--iters" => args.iters = value().parse().expect("--iters N"),
            "--python" => args.python = value(),
            "--peak-tflops" => args.peak_tflops = value().parse().expect("--peak-tflops N"),
            "--hbm-gbs" => args.hbm_gbs = Some(value().parse().expect("--hbm-gbs N")),
            "--count" => args.count = value().parse().expect("--count N"),
            "--lengths" => {
                let v = value();
                let (min, max) = v.split_once('-').expect("--lengths MIN-MAX");
                args.lengths = (
                    min.parse().expect("--lengths MIN-MAX"),
                    max.parse().expect("--lengths MIN-MAX"),
                );
                assert!(
                    2 <= args.lengths.0 && args.lengths.0 <= args.lengths.1,
                    "--lengths MIN-MAX with 2 <= MIN <= MAX"
                );
            }
            "--micro-batch-tokens" => {
                args.micro_batch_tokens = value().parse().expect("--micro-batch-tokens N")
            }
            "--checkpointing" => {
                args.checkpointing = match value().as_str() {
                    "on" => Some(true),
                    "off" => Some(false),
                    "auto" => None,
                    other => panic!("--checkpointing on|off|auto, not {other}"),
                }
            }
            other => panic!("unknown flag {other}; see the example's docs"),
        }
    }
    args
}

fn open_device(name: &str) -> Device {
    match name {
        "cpu" => Device::Cpu,
        "cuda" => open_device("cuda:0"),
        cuda if cuda.starts_with("cuda:") => {
            let ordinal = cuda[5..].parse().expect("cuda:N");
            art_core::engine::cuda_device(ordinal).unwrap_or_else(|e| {
                panic!("no CUDA device {cuda} (build with --features cuda): {e}")
            })
        }
        other => panic!("--device cpu|cuda|cuda:N, not {other}"),
    }
}

fn spec(shape: &str) -> RandomModelSpec {
    RandomModelSpec::named(shape).unwrap_or_else(|| {
        panic!("unknown shape {shape}: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, tiny")
    })
}

/// A model of `shape` with random weights drawn on `device`, in the device's default dtype
/// (bf16 on CUDA, f32 on the CPU).
fn random_engine(shape: &str, device: &Device) -> Engine {
    let spec = spec(shape);
    let dtype = if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let t = Instant::now();
    let weights = spec
        .weights_on_device(0, device, dtype)
        .expect("random weights");
    let loaded = spec.load(weights, device, dtype).expect("build model");
    device.synchronize().unwrap();
    println!(
        "built random {shape} ({:.2}B parameters, {dtype:?}) in {:.1}s",
        spec.num_parameters() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Engine::from_loaded(loaded)
}

fn gb(bytes: usize) -> f64 {
    bytes as f64 / 1e9
}

/// A xorshift stream for token ids.
struct Ids(u64);

impl Ids {
    fn next(&mut self, below: usize) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below as u64) as u32
    }
}

fn decode(args: &Args, device: &Device) {
    let baseline = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
    let hbm_gbs = args
        .hbm_gbs
        .unwrap_or_else(|| match art_core::engine::gpu_memory(device) {
            Some((_, total)) if total > 100 << 30 => 4_800.0,
            _ => 3_350.0,
        });
    for shape in &args.shapes {
        let engine = random_engine(shape, device);
        let vocab = engine.config().vocab_size;
        let step_bytes = weight_bytes_per_step(&engine);
        let weights_mem = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
        let monitor = PeakMemory::start(device);
        let mut ids = Ids(0x9e37_79b9_7f4a_7c15);
        // One scheduler for every run, as a server keeps one: its CUDA graphs, captured in the
        // warm-up below, are replayed by the measured runs.
        let mut scheduler = engine.scheduler();
        scheduler.max_prefill_tokens_per_step = usize::MAX;
        let mut run = |batch: usize, prompt: usize, tokens: usize, ids: &mut Ids| {
            for i in 0..batch {
                let prompt: Vec<u32> = (0..prompt).map(|_| ids.next(vocab)).collect();
                scheduler
                    .add(GenerationRequest {
                        prompt,
                        params: SamplingParams {
                            temperature: 1.0,
                            seed: Some(i as u64),
                            max_tokens: tokens,
                            ignore_eos: true,
                            ..Default::default()
                        },
                        adapter: None,
                    })
                    .unwrap();
            }
            let t0 = Instant::now();
            let mut generated = scheduler.step().unwrap().len();
            let prefill = t0.elapsed().as_secs_f64();
            while !scheduler.is_idle() {
                generated += scheduler.step().unwrap().len();
            }
            let total = t0.elapsed().as_secs_f64();
            (generated, prefill, total)
        };
        // Warm-up: loads every kernel (and compiles the decode kernels) once, and captures the
        // decode graphs of the batch sizes measured.
        for &batch in &args.batches {
            run(batch, 16, 8, &mut ids);
        }
        let mut ours = Vec::new();
        for &batch in &args.batches {
            if let Some(m) = &monitor {
                m.reset(device);
            }
            let (generated, prefill, total) = run(batch, args.prompt, args.tokens, &mut ids);
            let rate = generated as f64 / total;
            let decode_rate = (generated - batch) as f64 / (total - prefill);
            // Every decode step reads every weight once, whatever the batch.
            let steps_per_s = decode_rate / batch as f64;
            let gbs = steps_per_s * step_bytes / 1e9;
            let peak = monitor.as_ref().map_or("-".to_string(), |m| {
                format!("{:.1} GB", gb(m.peak() - baseline.unwrap_or(0)))
            });
            println!(
                "DECODE {shape} batch {batch:>2}: {rate:8.1} tok/s ({generated} tokens in {total:.2}s; \
                 prefill {prefill:.2}s, decode-only {decode_rate:.1} tok/s, {:.2} ms per step, \
                 weights read at {gbs:.0} GB/s = {:.0}% of {hbm_gbs:.0}) | peak {peak} (weights {})",
                1e3 / steps_per_s,
                100.0 * gbs / hbm_gbs,
                weights_mem.map_or("-".to_string(), |w| format!(
                    "{:.1} GB",
                    gb(w - baseline.unwrap_or(0))
                )),
            );
            ours.push((batch, rate));
        }
        drop(scheduler);
        drop(engine);
        if let Some(script) = hf_script(args, "scripts/hf_decode_reference.py") {
            compare_hf(args, script, shape, &ours);
        }
    }
}

/// A GRPO-shaped rollout batch: 16 prompts of 512 tokens, 8 rollouts of 256 tokens each, sent
/// three ways: one request per prompt with `n = 8` (the prompt prefilled once, its cache copied
/// for each rollout); 128 independent requests, as ART's clients send a group, with the prefix
/// cache finding each group's prompt; and the same 128 requests with the cache off (every rollout
/// prefills its prompt). Fresh prompts for every run, as every GRPO step brings new ones.
fn grpo(args: &Args, device: &Device) {
    let baseline = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
    for shape in &args.shapes {
        let engine = random_engine(shape, device);
        let vocab = engine.config().vocab_size;
        let monitor = PeakMemory::start(device);
        let weights = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
        let mut ids = Ids(0x5eed);
        // `--grpo-prompt` tokens (512), fewer where the model's context could not hold them and
        // 256 more (a smoke test on the tiny shape).
        let context = engine.config().max_position_embeddings;
        let prompt_len = args.grpo_prompt.min(context.saturating_sub(257)).max(1);
        // A scheduler with the prefix cache and one without (each keeps the CUDA graphs its
        // warm-up captured).
        let mut schedulers = [engine.scheduler(), engine.scheduler()];
        schedulers[1].set_prefix_cache_budget(0);
        let mut run = |scheduler: &mut art_core::engine::Scheduler<'_>, n: usize, tokens: usize| {
            let params = |n: usize, seed: u64| SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                max_tokens: tokens,
                ignore_eos: true,
                n,
                ..Default::default()
            };
            for p in 0..16u64 {
                let prompt: Vec<u32> = (0..prompt_len).map(|_| ids.next(vocab)).collect();
                for k in 0..(8 / n) as u64 {
                    scheduler
                        .add(GenerationRequest {
                            prompt: prompt.clone(),
                            params: params(n, 8 * p + k),
                            adapter: None,
                        })
                        .unwrap();
                }
            }
            let t0 = Instant::now();
            let mut generated = 0;
            let mut cached = 0;
            // The running sequences' caches at their largest (their buffers' whole capacity).
            let mut most_kv = 0;
            while !scheduler.is_idle() {
                generated += scheduler.step().unwrap().len();
                most_kv = most_kv.max(scheduler.kv_bytes_in_use());
                cached += scheduler
                    .take_finished()
                    .iter()
                    .map(|(_, o)| o.cached_prompt_tokens)
                    .sum::<usize>();
            }
            (generated, cached, most_kv, t0.elapsed().as_secs_f64())
        };
        // (what, n, which scheduler)
        let ways = [
            ("one request per group (n = 8)", 8, 0),
            ("128 requests, prefix cache on", 1, 0),
            ("128 requests, prefix cache off", 1, 1),
        ];
        // Warm-up (kernels, graphs of the batch sizes this shape of work meets).
        for &(_, n, s) in &ways {
            run(&mut schedulers[s], n, 8);
        }
        for &(way, n, s) in &ways {
            if let Some(m) = &monitor {
                m.reset(device);
            }
            let (generated, cached, most_kv, seconds) = run(&mut schedulers[s], n, 256);
            let peak = monitor.as_ref().map_or("-".to_string(), |m| {
                format!(
                    "{:.2} GB above the weights",
                    gb(m.peak() - weights.or(baseline).unwrap_or(0))
                )
            });
            println!(
                "GRPO {shape} 16 prompts x {prompt_len} tokens, 8 rollouts x 256 tokens, {way}: \
                 {seconds:.2} s, {:.0} sampled tok/s, {cached} of {} prompt tokens not prefilled; \
                 running caches at most {:.3} GB ({} positions); peak {peak}, prefix cache \
                 {:.2} GB after",
                generated as f64 / seconds,
                16 * prompt_len * 8 / n,
                gb(most_kv),
                most_kv / engine.model().kv_bytes_per_position(),
                gb(schedulers[s].prefix_cache_bytes()),
            );
        }
    }
}

/// The weights of every layer's projections and of the head (the embedding lookup reads one
/// row per token): what a decode step reads, and the `params` of a step's 6 x params FLOP per
/// trained token.
fn matmul_params(engine: &Engine) -> usize {
    let c = engine.config();
    let (h, q, kv) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let per_layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size;
    c.num_hidden_layers * per_layer + c.vocab_size * h
}

/// Bytes of weights one decode step reads, in the model's dtype.
fn weight_bytes_per_step(engine: &Engine) -> f64 {
    (matmul_params(engine) * engine.model().dtype().size_in_bytes()) as f64
}

/// The `--compare-hf` script for this command (`default` when none was named), if asked for.
fn hf_script<'a>(args: &'a Args, default: &'a str) -> Option<&'a str> {
    let script = args.compare_hf.as_deref()?;
    Some(if script.is_empty() { default } else { script })
}

/// Runs a Hugging Face reference `script` with `script_args` in this process's call and returns
/// the JSON objects it printed, one a line (`None`, said, when it failed).
fn run_reference(
    args: &Args,
    script: &str,
    script_args: &[String],
) -> Option<Vec<serde_json::Value>> {
    let output = std::process::Command::new(&args.python)
        .arg(script)
        .args(script_args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("could not run {} {script}: {e}", args.python));
    if !output.status.success() {
        println!(
            "COMPARE: the HF reference {script} failed ({})",
            output.status
        );
        return None;
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Some(
        text.lines()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
    )
}

/// Runs the compiled-HF reference for `shape` in this process's call and prints ours against
/// it batch by batch.
fn compare_hf(args: &Args, script: &str, shape: &str, ours: &[(usize, f64)]) {
    let batches: Vec<String> = ours.iter().map(|(b, _)| b.to_string()).collect();
    let script_args = [
        shape.to_string(),
        batches.join(","),
        args.prompt.to_string(),
        args.tokens.to_string(),
    ];
    let Some(lines) = run_reference(args, script, &script_args) else {
        return;
    };
    for v in lines {
        let (Some(batch), Some(hf)) = (v["batch"].as_u64(), v["tok_s"].as_f64()) else {
            continue;
        };
        let Some(&(_, rate)) = ours.iter().find(|(b, _)| *b as u64 == batch) else {
            continue;
        };
        println!(
            "COMPARE {shape} batch {batch:>2}: ours {rate:9.1} tok/s | compiled HF {hf:9.1} tok/s \
             (compile {}s) | ours / HF {:.2}x",
            v["compile_s"],
            rate / hf
        );
    }
}

/// Synthetic GRPO sequences: the first quarter prompt, the rest sampled (trainable), sampler
/// logprobs `lp` (or -3), advantages alternating +1/-1 (or all `advantage`).
fn sequences(
    batch: usize,
    seq: usize,
    vocab: usize,
    advantage: Option<f64>,
    lp: Option<&[f32]>,
) -> Vec<TrainSequence> {
    let mut ids = Ids(0x2545_f491_4f6c_dd1d);
    let mut used = 0;
    (0..batch)
        .map(|r| {
            let tokens: Vec<u32> = (0..seq).map(|_| ids.next(vocab.min(32_000))).collect();
            let trainable: Vec<bool> = (0..seq).map(|i| i >= seq / 4).collect();
            let sampler_logprobs = trainable
                .iter()
                .map(|&t| {
                    if !t {
                        return f32::NAN;
                    }
                    used += 1;
                    lp.map_or(-3.0, |lp| lp[used - 1])
                })
                .collect();
            TrainSequence {
                tokens,
                trainable,
                sampler_logprobs,
                advantage: advantage.unwrap_or(if r % 2 == 0 { 1.0 } else { -1.0 }),
                source: SequenceSource {
                    group: Some(0),
                    trajectory: r,
                    history: None,
                },
            }
        })
        .collect()
}

/// One optimizer step over `seqs` (one micro-batch): loss value, trainer logprobs, gradients.
fn train_step(
    engine: &Engine,
    adapter: &LoraAdapter,
    optimizer: Option<&mut AdamW>,
    seqs: &[TrainSequence],
    lr: f64,
    checkpointing: Option<bool>,
) -> (f64, Vec<f32>, Vec<Option<Tensor>>) {
    let config = TrainConfig {
        learning_rate: lr,
        micro_batch_tokens: seqs.iter().map(|s| s.len()).sum(),
        gradient_checkpointing: checkpointing,
        ..Default::default()
    };
    let norm = Normalization::for_step(seqs, &config);
    let members: Vec<&TrainSequence> = seqs.iter().collect();
    let mut out = micro_batch_loss(
        engine.model(),
        Some(adapter),
        None,
        &one_per_row(&members),
        norm,
        &config,
        true,
    )
    .expect("loss");
    let loss = out
        .loss
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let store = out.backward(engine.model(), adapter).expect("backward");
    let grads: Vec<Option<Tensor>> = adapter
        .named_vars()
        .iter()
        .map(|(_, v)| store.get(v.as_tensor()).cloned())
        .collect();
    if let Some(opt) = optimizer {
        opt.step(&grads, lr, 0.0).unwrap();
    }
    (loss, out.trainer_logprobs, grads)
}

fn train(args: &Args, device: &Device) {
    let baseline = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
    for shape in &args.shapes {
        let engine = random_engine(shape, device);
        let config = engine.config().clone();
        let lora = LoraConfig::default();
        let adapter = LoraAdapter::new(&config, &lora, device, 0).expect("adapter");
        let mut optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();
        let seqs = sequences(args.train_batch, args.seq, config.vocab_size, None, None);
        let monitor = PeakMemory::start(device);
        let tokens = args.train_batch * args.seq;
        let mut rates = Vec::new();
        for iter in 0..=args.iters {
            let t0 = Instant::now();
            let (loss, _, _) = train_step(
                &engine,
                &adapter,
                Some(&mut optimizer),
                &seqs,
                1e-5,
                args.checkpointing,
            );
            device.synchronize().unwrap();
            let dt = t0.elapsed().as_secs_f64();
            println!(
                "  iter {iter}{}: {dt:.3}s, {:.0} tok/s, loss {loss:.4}",
                if iter == 0 { " (warm-up)" } else { "" },
                tokens as f64 / dt
            );
            if iter > 0 {
                rates.push(tokens as f64 / dt);
            }
        }
        let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
        let peak = monitor.as_ref().map_or("-".to_string(), |m| {
            format!("{:.1} GB", gb(m.peak() - baseline.unwrap_or(0)))
        });
        // Forward, the input gradients and the adapters' own: about 6 x params FLOP a token
        // (more when layers are recomputed; counted as model FLOP, as MFU is).
        let tflops = 6.0 * matmul_params(&engine) as f64 * mean / 1e12;
        let utilisation = match device.is_cuda() {
            true => format!(
                ", {:.0}% of {} peak",
                100.0 * tflops / args.peak_tflops,
                args.peak_tflops
            ),
            false => String::new(),
        };
        let script = hf_script(args, "scripts/hf_train_reference.py");
        // Without --compare-hf: against HF+peft as measured on an H200 on 2026-12-04.
        let hf = reference(shape).filter(|_| script.is_none());
        println!(
            "TRAIN {shape}: {} x {} tokens, LoRA r={} on {} modules: {mean:.0} tok/s | model FLOP/s \
             {tflops:.2} T{utilisation} | HF+peft (H200, 2026-12-04) {} | ratio {} | peak {peak}",
            args.train_batch,
            args.seq,
            lora.rank,
            lora.target_modules.len(),
            hf.map_or("-".to_string(), |h| format!("{h}")),
            hf.map_or("-".to_string(), |h| format!("{:.2}x", mean / h)),
        );
        drop(optimizer);
        drop(adapter);
        drop(engine);
        if let Some(script) = script {
            compare_train(args, script, shape, mean, &peak, device);
        }
    }
}

/// Runs the HF + peft training reference for `shape` (same batch and length) in this process's
/// call and prints ours against each variant it measured.
fn compare_train(args: &Args, script: &str, shape: &str, ours: f64, peak: &str, device: &Device) {
    let mut script_args = vec![
        shape.to_string(),
        args.train_batch.to_string(),
        args.seq.to_string(),
    ];
    if !device.is_cuda() {
        script_args.push("cpu".into());
    }
    let Some(lines) = run_reference(args, script, &script_args) else {
        return;
    };
    for v in lines {
        let (Some(variant), Some(hf)) = (v["train"].as_str(), v["tok_s"].as_f64()) else {
            continue;
        };
        let hf_peak = v["peak_gb"]
            .as_f64()
            .map_or("-".to_string(), |p| format!("{p:.1} GB"));
        println!(
            "COMPARE {shape} train: ours {ours:9.0} tok/s (peak {peak}) | {variant} {hf:9.0} tok/s \
             (peak {hf_peak}) | ours / {variant} {:.2}x",
            ours / hf
        );
    }
}

/// `count` sequences of lengths drawn uniformly from `min..=max`, as [`sequences`] makes them.
fn uneven_sequences(count: usize, (min, max): (usize, usize), vocab: usize) -> Vec<TrainSequence> {
    let mut lengths = Ids(0x9e37_79b9_7f4a_7c15);
    let mut all = sequences(count, max, vocab, None, None);
    for seq in &mut all {
        let len = min + lengths.next(max - min + 1) as usize;
        seq.tokens.truncate(len);
        seq.trainable.truncate(len);
        seq.sampler_logprobs.truncate(len);
        // A quarter prompt, the rest sampled, as for the even sequences.
        for (i, t) in seq.trainable.iter_mut().enumerate() {
            *t = i >= len / 4;
        }
        for (lp, &t) in seq.sampler_logprobs.iter_mut().zip(&seq.trainable) {
            *lp = if t { -3.0 } else { f32::NAN };
        }
    }
    all
}

/// Training on sequences of uneven lengths, packed into shared rows and one padded row each:
/// the same sequences, micro-batches as the trainer plans them, forward and backward of every
/// micro-batch (the adapter is not updated, so both see the same weights and give the same loss).
fn packed(args: &Args, device: &Device) {
    let baseline = art_core::engine::gpu_memory(device).map(|(f, t)| t - f);
    for shape in &args.shapes {
        let engine = random_engine(shape, device);
        let config = engine.config().clone();
        let lora = LoraConfig::default();
        let adapter = LoraAdapter::new(&config, &lora, device, 0).expect("adapter");
        let seqs = uneven_sequences(args.count, args.lengths, config.vocab_size);
        let tokens: usize = seqs.iter().map(|s| s.len()).sum();
        let mut rates = Vec::new();
        for pack in [false, true] {
            let train_config = TrainConfig {
                pack_sequences: Some(pack),
                micro_batch_tokens: args.micro_batch_tokens,
                gradient_checkpointing: args.checkpointing,
                ..Default::default()
            };
            let plan = plan_micro_batches(&seqs, &train_config, device);
            let computed: usize = plan.iter().map(|mb| mb.rows.len() * mb.width).sum();
            let norm = Normalization::for_step(&seqs, &train_config);
            let monitor = PeakMemory::start(device);
            let (mut best, mut loss) = (f64::INFINITY, 0.0);
            for iter in 0..=args.iters {
                let t0 = Instant::now();
                loss = 0.0;
                for mb in &plan {
                    let mut out = micro_batch_loss(
                        engine.model(),
                        Some(&adapter),
                        None,
                        &mb.gather(&seqs),
                        norm,
                        &train_config,
                        true,
                    )
                    .expect("loss");
                    loss += out
                        .loss
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap();
                    drop(out.backward(engine.model(), &adapter).expect("backward"));
                }
                device.synchronize().unwrap();
                let dt = t0.elapsed().as_secs_f64();
                if iter > 0 {
                    best = best.min(dt);
                }
            }
            let peak = monitor.as_ref().map_or("-".to_string(), |m| {
                format!("{:.1} GB", gb(m.peak() - baseline.unwrap_or(0)))
            });
            let rate = tokens as f64 / best;
            rates.push(rate);
            println!(
                "PACKED {shape} {}: {} sequences of {}-{} tokens ({tokens} in all) in {} \
                 micro-batch(es) of {} rows; {computed} positions computed ({:.0}% padding); \
                 {rate:.0} tok/s (best of {}); loss {loss:.6}; peak {peak}",
                if pack { "packed" } else { "one row each" },
                args.count,
                args.lengths.0,
                args.lengths.1,
                plan.len(),
                plan.iter().map(|mb| mb.rows.len()).sum::<usize>(),
                100.0 * (1.0 - (tokens - seqs.len()) as f64 / computed as f64),
                args.iters,
            );
        }
        println!(
            "PACKED {shape}: packed / one row each = {:.2}x",
            rates[1] / rates[0]
        );
    }
}

/// Where a training step's time goes: the loss's forward (with its host reads), the backward
/// as enqueued by the host and as finished on the device, the optimizer; the graph's node
/// count; and what one small candle op costs the host (the floor under every kernel).
fn profile(args: &Args, device: &Device) {
    let x = Tensor::zeros(16, DType::BF16, device).unwrap();
    let mut y = x.clone();
    let ops = 5_000;
    device.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..ops {
        y = (&y + &x).unwrap();
    }
    let enqueued = t.elapsed().as_secs_f64();
    device.synchronize().unwrap();
    println!(
        "PROFILE host cost of a small op: {:.1} us enqueued, {:.1} us finished",
        enqueued * 1e6 / ops as f64,
        t.elapsed().as_secs_f64() * 1e6 / ops as f64
    );
    for shape in &args.shapes {
        let engine = random_engine(shape, device);
        let config = engine.config().clone();
        let adapter =
            LoraAdapter::new(&config, &LoraConfig::default(), device, 0).expect("adapter");
        let mut optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();
        let seqs = sequences(args.train_batch, args.seq, config.vocab_size, None, None);
        let members: Vec<&TrainSequence> = seqs.iter().collect();
        let train_config = TrainConfig {
            micro_batch_tokens: seqs.iter().map(|s| s.len()).sum(),
            gradient_checkpointing: args.checkpointing,
            ..Default::default()
        };
        let norm = Normalization::for_step(&seqs, &train_config);
        for iter in 0..=args.iters {
            device.synchronize().unwrap();
            let t0 = Instant::now();
            let no_grad = micro_batch_loss(
                engine.model(),
                Some(&adapter),
                None,
                &one_per_row(&members),
                norm,
                &train_config,
                false,
            )
            .expect("loss");
            drop(no_grad);
            device.synchronize().unwrap();
            let t1 = Instant::now();
            let mut out = micro_batch_loss(
                engine.model(),
                Some(&adapter),
                None,
                &one_per_row(&members),
                norm,
                &train_config,
                true,
            )
            .expect("loss");
            device.synchronize().unwrap();
            let t2 = Instant::now();
            let nodes = out.loss.sorted_nodes().len();
            let t3 = Instant::now();
            let store = out.backward(engine.model(), &adapter).expect("backward");
            let t4 = Instant::now();
            device.synchronize().unwrap();
            let t5 = Instant::now();
            let grads: Vec<Option<Tensor>> = adapter
                .named_vars()
                .iter()
                .map(|(_, v)| store.get(v.as_tensor()).cloned())
                .collect();
            drop(store);
            optimizer.step(&grads, 1e-5, 0.0).unwrap();
            device.synchronize().unwrap();
            let t6 = Instant::now();
            let s = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            println!(
                "PROFILE {shape} iter {iter}: forward without graph {:.0} ms | forward with graph \
                 {:.0} ms ({nodes} graph nodes, {:.0} ms to sort them) | backward enqueued in \
                 {:.0} ms, done after {:.0} ms | optimizer {:.0} ms",
                s(t0, t1),
                s(t1, t2),
                s(t2, t3),
                s(t3, t4),
                s(t3, t5),
                s(t5, t6)
            );
        }
    }
}

/// `max |t|` over every element of an f64 tensor.
fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// `max |a - b|` and `max |b|` over two tensors of one shape (any devices, any float dtype).
fn diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    (max_abs(&(&a - &b).unwrap()), max_abs(&b))
}

fn check(label: &str, d: f64, scale: f64, tol: f64, failures: &mut usize) {
    let rel = d / scale.max(1e-30);
    let ok = rel <= tol;
    if !ok {
        *failures += 1;
    }
    println!(
        "PARITY {label}: max |diff| {d:.3e} (max |ref| {scale:.3e}, relative {rel:.2e}, bound {tol:.0e}) {}",
        if ok { "ok" } else { "FAIL" }
    );
}

/// CUDA against the CPU on the same weights and tokens.
fn parity(device: &Device) {
    let mut failures = 0;
    let moderate = RandomModelSpec {
        vocab_size: 8192,
        hidden_size: 512,
        intermediate_size: 1408,
        num_hidden_layers: 8,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: 64,
        ..spec("tiny")
    };
    for (name, spec) in [("tiny", spec("tiny")), ("moderate", moderate)] {
        let weights = spec.weights(7, &Device::Cpu).expect("weights");
        let cpu = Engine::from_loaded(
            spec.load(weights.clone(), &Device::Cpu, DType::F32)
                .unwrap(),
        );
        let vocab = spec.vocab_size;
        let mut ids = Ids(42);
        let tokens: Vec<u32> = (0..2 * 48).map(|_| ids.next(vocab)).collect();
        let input = |d: &Device| Tensor::from_vec(tokens.clone(), (2, 48), d).unwrap();
        let fwd = Forward::default();
        let ref_logits = cpu.model().forward_full(&input(&Device::Cpu), fwd).unwrap();
        let prompt: Vec<u32> = tokens[..20].to_vec();
        let greedy = |e: &Engine| greedy_outputs(e, (0..3).map(|i| prompt[..20 - 3 * i].to_vec()));
        let ref_out = greedy(&cpu);
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 5e-2)] {
            let gpu = Engine::from_loaded(spec.load(weights.clone(), device, dtype).unwrap());
            let logits = gpu.model().forward_full(&input(device), fwd).unwrap();
            let (d, m) = diff(&logits, &ref_logits);
            check(
                &format!("{name} forward_full logits {dtype:?} vs CPU f32"),
                d,
                m,
                tol,
                &mut failures,
            );
            // Greedy decoding through the KV caches (the batched decode kernels on CUDA), three
            // prompts of different lengths at once: tokens compared up to the first difference.
            let (same, total, worst) = agreement(&greedy(&gpu), &ref_out);
            println!(
                "PARITY {name} greedy decode {dtype:?}: {same}/{total} tokens equal to the CPU's \
                 before the first difference; max logprob diff on them {worst:.2e}"
            );
            if dtype == DType::F32 && same != total {
                failures += 1;
                println!("PARITY {name} greedy decode f32: FAIL");
            }
            // Seeded sampling with the draws made on the GPU (the sampling kernel) against the
            // same draws made on the host, from the same GPU logits: the same tokens.
            let sampled = |e: &Engine| {
                let reqs = (0..4)
                    .map(|i| GenerationRequest {
                        prompt: prompt[..20 - 2 * i].to_vec(),
                        params: SamplingParams {
                            temperature: [1.0, 0.7, 1.3, 0.0][i],
                            seed: Some(i as u64),
                            max_tokens: 32,
                            ignore_eos: true,
                            ..Default::default()
                        },
                        adapter: None,
                    })
                    .collect();
                e.generate(reqs).unwrap()
            };
            set_device_sampling(false);
            let on_host = sampled(&gpu);
            set_device_sampling(true);
            let on_device = sampled(&gpu);
            let (same, total, worst) = agreement(&on_device, &on_host);
            println!(
                "PARITY {name} seeded sampling {dtype:?}, draws on the GPU vs on the host: \
                 {same}/{total} tokens equal before the first difference; max logprob diff {worst:.2e}"
            );
            if dtype == DType::F32 && same != total {
                failures += 1;
                println!("PARITY {name} seeded sampling f32: FAIL");
            }
            // A training forward with two sequences as one shared-prefix block (20 positions
            // shared, 28 each after them) against each sequence in a row of its own, on the GPU:
            // the packed rows' mask and positions through the fused softmax.
            {
                let a = &tokens[..48];
                let b: Vec<u32> = tokens[..20].iter().chain(&tokens[68..]).copied().collect();
                let row: Vec<u32> = a.iter().chain(&tokens[68..]).copied().collect();
                let packing = PackedRows {
                    rows: vec![vec![PackedBlock {
                        prefix: 20,
                        continuations: vec![28, 28],
                    }]],
                };
                let model = gpu.model();
                let row = Tensor::from_vec(row, (1, 76), device).unwrap();
                let packed = model.forward_hidden(&row, Some(&packing), fwd).unwrap();
                let packed = packed.squeeze(0).unwrap();
                let of_b = Tensor::cat(
                    &[
                        packed.narrow(0, 0, 20).unwrap(),
                        packed.narrow(0, 48, 28).unwrap(),
                    ],
                    0,
                )
                .unwrap();
                let alone = |seq: &[u32]| {
                    let t = Tensor::new(seq, device).unwrap().unsqueeze(0).unwrap();
                    model
                        .forward_hidden(&t, None, fwd)
                        .unwrap()
                        .squeeze(0)
                        .unwrap()
                };
                let (da, ma) = diff(&packed.narrow(0, 0, 48).unwrap(), &alone(a));
                let (db, mb) = diff(&of_b, &alone(&b));
                check(
                    &format!(
                        "{name} shared-prefix training forward {dtype:?} vs rows of their own"
                    ),
                    da.max(db),
                    ma.min(mb),
                    tol,
                    &mut failures,
                );
            }
            // The decode step replayed from CUDA graphs against the same step launched kernel by
            // kernel: greedy and seeded sampling, on the base model and through a LoRA adapter
            // (random B, so that it changes the tokens).
            let noisy = |seed: u64| {
                let a =
                    LoraAdapter::new(gpu.config(), &LoraConfig::default(), device, seed).unwrap();
                for (name, var) in a.named_vars() {
                    if name.contains("lora_B") {
                        let noise = Tensor::randn(0f32, 0.05, var.shape(), device).unwrap();
                        var.set(&noise.to_dtype(var.dtype()).unwrap()).unwrap();
                    }
                }
                std::sync::Arc::new(a)
            };
            gpu.set_adapter("probe", noisy(5)).unwrap();
            let mixed = |e: &Engine| {
                let reqs = (0..6)
                    .map(|i| GenerationRequest {
                        prompt: prompt[..20 - 2 * (i % 3)].to_vec(),
                        params: SamplingParams {
                            temperature: [0.0, 1.0, 0.7][i % 3],
                            seed: Some((i % 3) as u64),
                            max_tokens: 40,
                            ignore_eos: true,
                            ..Default::default()
                        },
                        adapter: (i >= 3).then(|| "probe".to_string()),
                    })
                    .collect();
                e.generate(reqs).unwrap()
            };
            CUDA_GRAPHS.set(false);
            let launched = mixed(&gpu);
            CUDA_GRAPHS.set(true);
            let replayed = mixed(&gpu);
            let (same, total, worst) = agreement(&replayed, &launched);
            // Rows 3..6 repeat rows 0..3 through the adapter.
            let (adapter_same, adapter_total, _) = agreement(&launched[3..], &launched[..3]);
            println!(
                "PARITY {name} CUDA graphs {dtype:?} (3 rows base, 3 through an adapter; greedy and \
                 seeded): {same}/{total} tokens equal to the launched step's before the first \
                 difference; max logprob diff {worst:.2e} (through the adapter, {adapter_same}/{adapter_total} \
                 tokens as without it)"
            );
            if same != total {
                failures += 1;
                println!("PARITY {name} CUDA graphs {dtype:?}: FAIL");
            }
            // Adapter slots: on one scheduler (as a server keeps it), the graphs captured through
            // one adapter replay for the adapters that follow it (a GRPO step's new one), their
            // weights copied in, and sample what the launched step does through each.
            {
                let requests = || -> Vec<GenerationRequest> {
                    (0..4)
                        .map(|i| GenerationRequest {
                            prompt: prompt[..20 - 2 * i].to_vec(),
                            params: SamplingParams {
                                temperature: [0.0, 1.0][i % 2],
                                seed: Some(i as u64),
                                max_tokens: 24,
                                ignore_eos: true,
                                ..Default::default()
                            },
                            adapter: Some("slot-probe".to_string()),
                        })
                        .collect()
                };
                let mut scheduler = gpu.scheduler();
                let (mut same, mut total, mut worst) = (0, 0, 0f64);
                let mut captures = Vec::new();
                // Three adapters: the first two get a slot each, the third reuses the first's.
                for seed in [11, 12, 13] {
                    gpu.set_adapter("slot-probe", noisy(seed)).unwrap();
                    CUDA_GRAPHS.set(false);
                    let launched = gpu.generate(requests()).unwrap();
                    CUDA_GRAPHS.set(true);
                    let replayed = scheduler.generate(requests()).unwrap();
                    let (s, t, w) = agreement(&replayed, &launched);
                    (same, total, worst) = (same + s, total + t, worst.max(w));
                    captures.push(scheduler.graph_captures());
                }
                let reused = captures[2] == captures[1];
                println!(
                    "PARITY {name} CUDA graph adapter slots {dtype:?} (three adapters in turn on one \
                     scheduler): {same}/{total} tokens equal to the launched step's; max logprob \
                     diff {worst:.2e}; graphs captured after each adapter {captures:?} (the third \
                     captures none: {reused})"
                );
                if same != total || !reused {
                    failures += 1;
                    println!("PARITY {name} CUDA graph adapter slots {dtype:?}: FAIL");
                }
                gpu.remove_adapter("slot-probe");
            }
            // Cached decode logits against the full forward, on the GPU itself: the decode
            // step's kernels (our products for these few rows, the adapter's update inside
            // them) against the prefill path's (cuBLAS, the adapter apart), with and without
            // the adapter.
            let model = gpu.model();
            let probe = gpu.adapter("probe").expect("registered above");
            for (label, fwd) in [
                ("", fwd),
                (
                    " through the adapter",
                    Forward {
                        adapter: Some(&probe),
                        ..fwd
                    },
                ),
            ] {
                let mut caches: Vec<_> = (0..2).map(|_| model.new_cache()).collect();
                let full = model.forward_full(&input(device), fwd).unwrap();
                {
                    let mut refs: Vec<&mut _> = caches.iter_mut().collect();
                    let first = input(device).narrow(1, 0, 40).unwrap();
                    model.forward_cached(&first, &mut refs, fwd, true).unwrap();
                }
                let mut worst = (0f64, 0f64);
                for p in 40..48 {
                    let mut refs: Vec<&mut _> = caches.iter_mut().collect();
                    let step = input(device).narrow(1, p, 1).unwrap();
                    let got = model.forward_cached(&step, &mut refs, fwd, true).unwrap();
                    let want = full.narrow(1, p, 1).unwrap();
                    let (d, m) = diff(&got, &want);
                    worst = (worst.0.max(d), worst.1.max(m));
                }
                check(
                    &format!(
                        "{name} cached decode logits vs full forward{label}, {dtype:?} on the GPU"
                    ),
                    worst.0,
                    worst.1,
                    if dtype == DType::F32 { 1e-4 } else { 5e-2 },
                    &mut failures,
                );
            }
        }
    }

    failures += decode_attention_parity(device);

    // The sampling kernel on its own, against its host reference: 64 rows of Qwen2.5's
    // vocabulary, spread (std 3) and peaked (std 12) logits.
    // The decode step hands the kernels its bf16 logits as they are; f32 for the composite path.
    let noise = Tensor::randn(0f32, 1.0, (64, 151_936), device).unwrap();
    for (std, dtype) in [3.0, 12.0]
        .into_iter()
        .flat_map(|s| [(s, DType::F32), (s, DType::BF16)])
    {
        let logits = (&noise * std).unwrap().to_dtype(dtype).unwrap();
        let (same, rows, sum_rel, lp) = check_device_sampling(&logits, 11).unwrap();
        println!(
            "PARITY sampling kernel, 64 x 151936 {dtype:?} logits (std {std}): {same}/{rows} rows \
             with the host's token, weight sums within {sum_rel:.1e} (relative), logprobs within \
             {lp:.1e} {}",
            if same == rows { "ok" } else { "FAIL" }
        );
        if same != rows {
            failures += 1;
        }
    }

    // LoRA gradients: CUDA f32 against the CPU f32, after one AdamW step (so that B != 0 and
    // every gradient is non-zero).
    let spec = spec("tiny");
    let weights = spec.weights(3, &Device::Cpu).unwrap();
    let lora = LoraConfig::default();
    let grads_of = |d: &Device| {
        let engine = Engine::from_loaded(spec.load(weights.clone(), d, DType::F32).unwrap());
        let adapter = LoraAdapter::new(engine.config(), &lora, d, 1).unwrap();
        let mut opt = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();
        let seqs = sequences(4, 40, spec.vocab_size, None, None);
        let (l0, _, _) = train_step(&engine, &adapter, Some(&mut opt), &seqs, 1e-2, None);
        let (l1, _, g) = train_step(&engine, &adapter, None, &seqs, 1e-2, None);
        (l0, l1, g)
    };
    let (c0, c1, cpu_grads) = grads_of(&Device::Cpu);
    let (g0, g1, gpu_grads) = grads_of(device);
    println!("PARITY LoRA losses: CPU {c0:.6} then {c1:.6}; GPU {g0:.6} then {g1:.6}");
    let (mut d, mut m) = (0f64, 0f64);
    for (a, b) in gpu_grads.iter().zip(&cpu_grads) {
        if let (Some(a), Some(b)) = (a, b) {
            let (x, y) = diff(a, b);
            d = d.max(x);
            m = m.max(y);
        }
    }
    check(
        "LoRA gradients f32 GPU vs CPU (all 14 tensors x 2 layers)",
        d,
        m,
        1e-3,
        &mut failures,
    );

    // Training on the GPU in bf16: the loss falls on a fixed batch.
    let shape = if device.is_cpu() {
        "tiny"
    } else {
        "qwen2.5-0.5b"
    };
    let engine = random_engine(shape, device);
    let adapter = LoraAdapter::new(engine.config(), &lora, device, 0).unwrap();
    let mut opt = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();
    let vocab = engine.config().vocab_size;
    // Sampler logprobs = the model's own at the start (ratio 1), advantage +1 everywhere.
    let probe = sequences(4, 128, vocab, Some(1.0), None);
    let (_, lp0, _) = train_step(&engine, &adapter, None, &probe, 0.0, None);
    let seqs = sequences(4, 128, vocab, Some(1.0), Some(&lp0));
    let mut losses = Vec::new();
    let mut mean_lp = Vec::new();
    for _ in 0..6 {
        let (loss, lp, _) = train_step(&engine, &adapter, Some(&mut opt), &seqs, 1e-3, None);
        losses.push(loss);
        mean_lp.push(lp.iter().map(|&x| x as f64).sum::<f64>() / lp.len() as f64);
    }
    let falls = losses.last().unwrap() < &losses[0] && mean_lp.last().unwrap() > &mean_lp[0];
    if !falls {
        failures += 1;
    }
    println!(
        "PARITY training on a fixed batch ({shape} shape, {:?}, 4 x 128, lr 1e-3): loss {:?}, \
         mean logprob of the trained tokens {:?} {}",
        engine.model().dtype(),
        losses
            .iter()
            .map(|l| (l * 1e4).round() / 1e4)
            .collect::<Vec<_>>(),
        mean_lp
            .iter()
            .map(|l| (l * 1e4).round() / 1e4)
            .collect::<Vec<_>>(),
        if falls { "ok" } else { "FAIL" }
    );
    println!("PARITY failures: {failures}");
}

fn main() {
    // SAFETY: first thing in main: no other thread exists yet.
    unsafe {
        art_core::engine::process::set_cpu_thread_defaults();
        art_core::engine::process::set_nccl_defaults();
    }
    art_core::engine::process::tune_allocator();
    let args = parse_args();
    let device = open_device(&args.device);
    match args.command.as_str() {
        "decode" => decode(&args, &device),
        "train" => train(&args, &device),
        "parity" => parity(&device),
        "profile" => profile(&args, &device),
        "grpo" => grpo(&args, &device),
        "packed" => packed(&args, &device),
        "dp" => data_parallel(&args, &device),
        #[cfg(feature = "nccl")]
        "nccl" => nccl(&args, &device),
        "all" => {
            parity(&device);
            decode(&args, &device);
            train(&args, &device);
        }
        other => {
            panic!("unknown command {other}: decode, grpo, train, packed, profile, parity, dp, nccl or all")
        }
    }
}

/// The devices of `dp` and `nccl`: `--devices`, or `device` alone.
fn device_list(args: &Args, device: &Device) -> Vec<Device> {
    match args.devices.is_empty() {
        true => vec![device.clone()],
        false => args.devices.iter().map(|d| open_device(d)).collect(),
    }
}

/// A fingerprint of an adapter's weights (FNV-1a over their f32 bits) and their sum.
fn checksum(adapter: &LoraAdapter) -> (u64, f64) {
    let (mut hash, mut sum) = (0xcbf2_9ce4_8422_2325u64, 0.0);
    for (_, var) in adapter.named_vars() {
        let values: Vec<f32> = var
            .as_tensor()
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .expect("adapter weights");
        for v in values {
            hash = (hash ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
            sum += f64::from(v);
        }
    }
    (hash, sum)
}

/// Data-parallel LoRA training: the same steps (`--batch` x `--seq` tokens per device and
/// micro-batch, one micro-batch per device) on the first device alone and on all of `--devices`
/// (each a share of the micro-batches, the gradients all-reduced), tokens/s of each and their
/// ratio, the first step's loss on both, and every rank's adapter checksum after the steps.
fn data_parallel(args: &Args, device: &Device) {
    let devices = device_list(args, device);
    let world = devices.len();
    for shape in &args.shapes {
        let spec = spec(shape);
        let dtype = if devices[0].is_cpu() {
            DType::F32
        } else {
            DType::BF16
        };
        // One draw of the weights, copied to every device: the ranks hold the same model.
        let weights = spec
            .weights_on_device(0, &devices[0], dtype)
            .expect("random weights");
        let engines: Vec<std::sync::Arc<Engine>> = devices
            .iter()
            .map(|d| {
                let copy = weights
                    .iter()
                    .map(|(k, t)| (k.clone(), t.to_device(d).expect("copy weights")))
                    .collect();
                std::sync::Arc::new(Engine::from_loaded(
                    spec.load(copy, d, dtype).expect("model"),
                ))
            })
            .collect();
        drop(weights);
        let model = engines[0].config().clone();
        let config = TrainConfig {
            learning_rate: 1e-5,
            micro_batch_tokens: args.train_batch * args.seq,
            gradient_checkpointing: args.checkpointing,
            ..Default::default()
        };
        let seqs = sequences(
            args.train_batch * world,
            args.seq,
            model.vocab_size,
            None,
            None,
        );
        let normalization = Normalization::for_step(&seqs, &config);
        let micro_batches = plan_micro_batches(&seqs, &config, &devices[0]);
        let tokens = (seqs.len() * args.seq) as f64;
        let fresh = || {
            let adapter =
                LoraAdapter::new(&model, &LoraConfig::default(), &devices[0], 0).expect("adapter");
            let optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default()).unwrap();
            DataParallel::new(engines[0].clone(), adapter, optimizer)
        };
        // Tokens/s over `--iters` steps after a warm-up, and the first step's loss.
        let run = |ranks: &mut DataParallel| -> (f64, f64) {
            let (mut first_loss, mut seconds) = (f64::NAN, 0.0);
            for iter in 0..=args.iters {
                let u = ranks
                    .update(
                        &seqs,
                        &micro_batches,
                        normalization,
                        &config,
                        None,
                        |_, _, _| {},
                    )
                    .expect("update");
                if iter == 0 {
                    first_loss = u.loss;
                } else {
                    seconds += u.compute_s;
                }
            }
            (tokens * args.iters as f64 / seconds, first_loss)
        };
        let (one_rate, one_loss) = run(&mut fresh());
        let mut all = fresh();
        all.add_ranks(engines[1..].to_vec())
            .expect("data-parallel ranks");
        let (all_rate, all_loss) = run(&mut all);
        let sums: Vec<(u64, f64)> = all.adapters().map(checksum).collect();
        let identical = sums.iter().all(|s| s.0 == sums[0].0);
        println!(
            "DP {shape}: {} micro-batches of {} x {} tokens; 1 device {one_rate:.0} tok/s, {world} \
             devices {all_rate:.0} tok/s = {:.2}x; first step's loss {one_loss:.6} vs \
             {all_loss:.6} (difference {:.2e}); adapters after {} steps {} on every rank: {}",
            micro_batches.len(),
            args.train_batch,
            args.seq,
            all_rate / one_rate,
            (one_loss - all_loss).abs(),
            args.iters + 1,
            if identical { "identical" } else { "DIFFERENT" },
            sums.iter()
                .map(|(h, s)| format!("{h:016x} (sum {s:.6})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// NCCL's all-reduce over `--devices` (a world of one on a single GPU): rank r's vector
/// `(r + 1) * (i % 7)` must sum to the same on every rank, exactly; then the time of a 1 GiB f32
/// all-reduce and its bus bandwidth (`2 (n - 1) / n` x bytes / time, NCCL's measure).
#[cfg(feature = "nccl")]
fn nccl(args: &Args, device: &Device) {
    use art_core::train::nccl::Communicators;
    let devices = device_list(args, device);
    let world = devices.len();
    let comms = Communicators::new(&devices).expect("NCCL communicators");
    let n = 1 << 20;
    let pattern = |d: &Device, scale: f64| -> Tensor {
        let i: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        (Tensor::from_vec(i, n, d).unwrap() * scale).unwrap()
    };
    let flats: Vec<Tensor> = devices
        .iter()
        .enumerate()
        .map(|(r, d)| pattern(d, (r + 1) as f64))
        .collect();
    let expected: Vec<f32> = pattern(&Device::Cpu, (world * (world + 1) / 2) as f64)
        .to_vec1()
        .unwrap();
    let sums = comms.all_reduce_sum(&flats).expect("all-reduce");
    for (r, sum) in sums.iter().enumerate() {
        let got: Vec<f32> = sum.to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
        let wrong = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
        println!("NCCL rank {r} of {world}: {wrong} of {n} sums wrong");
    }
    let big = 1 << 28;
    let flats: Vec<Tensor> = devices
        .iter()
        .map(|d| Tensor::ones(big, DType::F32, d).unwrap())
        .collect();
    let sync = || devices.iter().for_each(|d| d.synchronize().unwrap());
    comms.all_reduce_sum(&flats).expect("all-reduce");
    sync();
    let reps = 5;
    let t0 = Instant::now();
    for _ in 0..reps {
        comms.all_reduce_sum(&flats).expect("all-reduce");
    }
    sync();
    let dt = t0.elapsed().as_secs_f64() / reps as f64;
    let bytes = (big * 4) as f64;
    println!(
        "NCCL all-reduce of 1 GiB f32 over {world} device(s): {:.2} ms, algorithm bandwidth \
         {:.0} GB/s, bus bandwidth {:.0} GB/s",
        dt * 1e3,
        bytes / dt / 1e9,
        2.0 * (world - 1) as f64 / world as f64 * bytes / dt / 1e9
    );
}

/// The decode attention kernel against the CPU, in f32: heads of 64 and of 128 dimensions
/// (Qwen2.5 0.5B's and 1.5B's), 1, 8 and 64 rows at once (a kernel that splits each row's cache
/// by the batch takes every path), over caches of 40 to 379 positions. The failures.
fn decode_attention_parity(device: &Device) -> usize {
    let mut failures = 0;
    for head_dim in [64, 128] {
        let spec = RandomModelSpec {
            vocab_size: 8192,
            hidden_size: 8 * head_dim,
            intermediate_size: 1408,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim,
            ..spec("tiny")
        };
        let weights = spec.weights(11, &Device::Cpu).expect("weights");
        let load =
            |d: &Device| Engine::from_loaded(spec.load(weights.clone(), d, DType::F32).unwrap());
        let (cpu, gpu) = (load(&Device::Cpu), load(device));
        let mut ids = Ids(5);
        let prompts: Vec<Vec<u32>> = (0..64)
            .map(|i| (0..40 + 5 * i).map(|_| ids.next(spec.vocab_size)).collect())
            .collect();
        for batch in [1, 8, 64] {
            let greedy = |e: &Engine| greedy_outputs(e, prompts[..batch].iter().cloned());
            let (same, total, worst) = agreement(&greedy(&gpu), &greedy(&cpu));
            let ok = same == total && worst < 1e-3;
            println!(
                "PARITY decode attention, head_dim {head_dim}, {batch} rows, f32 vs CPU: \
                 {same}/{total} tokens equal; max logprob diff {worst:.2e} {}",
                if ok { "ok" } else { "FAIL" }
            );
            failures += usize::from(!ok);
        }
    }
    failures
}

/// 24 greedy tokens (EOS ignored) after each of `prompts`, all generated at once on `engine`.
fn greedy_outputs(
    engine: &Engine,
    prompts: impl Iterator<Item = Vec<u32>>,
) -> Vec<GenerationOutput> {
    let requests = prompts
        .map(|prompt| GenerationRequest {
            prompt,
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(24)
            },
            adapter: None,
        })
        .collect();
    engine.generate(requests).unwrap()
}

/// How far two runs of the same requests agree: tokens equal before each request's first
/// difference, tokens compared, and the largest logprob difference on the equal ones.
fn agreement(a: &[GenerationOutput], b: &[GenerationOutput]) -> (usize, usize, f64) {
    let (mut same, mut total, mut worst) = (0, 0, 0f64);
    for (a, b) in a.iter().zip(b) {
        let (a, b) = (&a.completions[0], &b.completions[0]);
        for (x, y) in a.tokens.iter().zip(&b.tokens) {
            total += 1;
            if x.id != y.id {
                break;
            }
            same += 1;
            worst = worst.max((x.logprob - y.logprob).abs() as f64);
        }
    }
    (same, total, worst)
}
