//! Engine tests on tiny random-weight models built in code (no download needed).
#![cfg(feature = "engine")]

use std::collections::HashSet;
use std::path::Path;

use std::sync::Arc;
use tempfile::TempDir;

use art_core::engine::random::{RandomModelSpec, CHATML_END_ID};
use art_core::engine::{
    Architecture, Engine, FinishReason, Forward, GenerationRequest, KvCache, LoadOptions,
    LoraAdapter, ModelSource, SamplingParams, Tensor, Var,
};
use art_core::types::LoraConfig;

/// A fresh directory under the system temp dir, removed when dropped.
fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("art-engine-{tag}-"))
        .tempdir()
        .unwrap()
}

fn tiny(arch: Architecture) -> (TempDir, Engine) {
    let dir = temp_dir("tiny");
    RandomModelSpec::tiny(arch).write(dir.path(), 42).unwrap();
    let engine = Engine::load(
        &ModelSource::HfDir(dir.path().to_path_buf()),
        &LoadOptions::default(),
    )
    .unwrap();
    (dir, engine)
}

const ARCHS: [Architecture; 3] = [
    Architecture::Qwen2,
    Architecture::Llama,
    Architecture::Qwen3,
];

fn prompts(engine: &Engine) -> Vec<Vec<u32>> {
    [
        "the cat sat on the mat",
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
        "a",
        "in the beginning there was an answer, and another",
    ]
    .iter()
    .map(|t| engine.encode(t, false).unwrap())
    .collect()
}

fn request(prompt: Vec<u32>, params: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        prompt,
        params,
        adapter: None,
    }
}

fn greedy_ignoring_eos(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

#[test]
fn tiny_models_load_and_generate() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        assert_eq!(engine.config().architecture, arch);
        assert!(engine.chat_template().unwrap().contains("<|im_start|>"));
        assert_eq!(engine.eos_token_ids(), &[CHATML_END_ID]);
        assert_eq!(
            engine.encode("<|im_end|>", false).unwrap(),
            vec![CHATML_END_ID]
        );
        let out = engine
            .generate(vec![request(
                prompts(&engine)[0].clone(),
                greedy_ignoring_eos(10),
            )])
            .unwrap();
        let c = &out[0].completions[0];
        assert_eq!(c.tokens.len(), 10, "{arch:?}");
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(c.text, engine.decode(&c.token_ids(), true).unwrap());
    }
}

#[test]
fn batched_generation_equals_one_by_one() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        let prompts = prompts(&engine);
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                engine
                    .generate(vec![request(p.clone(), greedy_ignoring_eos(24))])
                    .unwrap()[0]
                    .completions[0]
                    .token_ids()
            })
            .collect();
        let batched: Vec<Vec<u32>> = engine
            .generate(
                prompts
                    .iter()
                    .map(|p| request(p.clone(), greedy_ignoring_eos(24)))
                    .collect(),
            )
            .unwrap()
            .into_iter()
            .map(|o| o.completions[0].token_ids())
            .collect();
        assert_eq!(alone, batched, "{arch:?}");
        // The runs are not all the same sequence (the test would be weak otherwise).
        assert!(alone.iter().collect::<HashSet<_>>().len() > 1);
    }
}

/// Prompts of different lengths prefilled in one forward, right-padded to the longest: the same
/// tokens and logprobs as each prompt alone, for every architecture. ~0.1 s.
#[test]
fn prompts_of_different_lengths_prefill_together_as_alone() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        let requests: Vec<GenerationRequest> = [
            "the cat sat on the mat and then",
            "the cat sat on the mat and then it",
            "the cat sat on the mat, and then it slept",
            "a dog sat on the log and then it ran",
        ]
        .iter()
        .map(|text| {
            let params = SamplingParams {
                logprobs: true,
                ..greedy_ignoring_eos(6)
            };
            request(engine.encode(text, false).unwrap(), params)
        })
        .collect();
        let lens: HashSet<usize> = requests.iter().map(|r| r.prompt.len()).collect();
        assert!(lens.len() > 1, "{arch:?}: the prompts differ in length");
        let together = engine.generate(requests.clone()).unwrap();
        for (request, output) in requests.into_iter().zip(&together) {
            assert_same_completion(output, &engine.generate(vec![request]).unwrap()[0], 1e-4);
        }
    }
}

#[test]
fn sequences_join_and_leave_a_running_batch() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let prompts = prompts(&engine);
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            engine
                .generate(vec![request(p.clone(), greedy_ignoring_eos(8 + 4 * i))])
                .unwrap()[0]
                .completions[0]
                .token_ids()
        })
        .collect();
    let mut scheduler = engine.scheduler();
    let mut ids = Vec::new();
    let mut results = std::collections::HashMap::new();
    let mut step = 0;
    // Requests arrive every third step; each has a different length, so they also leave at
    // different steps.
    while ids.len() < prompts.len() || !scheduler.is_idle() {
        if step % 3 == 0 && ids.len() < prompts.len() {
            let i = ids.len();
            ids.push(
                scheduler
                    .add(request(prompts[i].clone(), greedy_ignoring_eos(8 + 4 * i)))
                    .unwrap(),
            );
        }
        let events = scheduler.step().unwrap();
        assert!(events.len() <= prompts.len());
        results.extend(scheduler.take_finished());
        step += 1;
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            results[id].completions[0].token_ids(),
            expected[i],
            "request {i}"
        );
    }
}

#[test]
fn kv_cache_decode_logits_equal_full_forward() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        let model = engine.model();
        let tokens = prompts(&engine)[3].clone();
        let n = tokens.len();
        let full = model
            .forward_full(
                &Tensor::new(tokens.as_slice(), model.device())
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap(),
                Forward::default(),
            )
            .unwrap()
            .squeeze(0)
            .unwrap();
        // Prefill 5 tokens, then decode the rest one at a time, batched with another sequence
        // that is at a different position.
        let mut cache = model.new_cache();
        let mut other = model.new_cache();
        let prefix = Tensor::new(&tokens[..5], model.device())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let first = model
            .forward_cached(&prefix, &mut [&mut cache], Forward::default(), false)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let mut got = vec![first];
        let other_prompt = Tensor::new(&[5u32, 6, 7][..], model.device())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        model
            .forward_cached(&other_prompt, &mut [&mut other], Forward::default(), true)
            .unwrap();
        for &t in &tokens[5..] {
            let input = Tensor::new(&[[t], [9u32]], model.device()).unwrap();
            let logits = model
                .forward_cached(
                    &input,
                    &mut [&mut cache, &mut other],
                    Forward::default(),
                    true,
                )
                .unwrap();
            got.push(logits.narrow(0, 0, 1).unwrap().squeeze(0).unwrap());
        }
        let got = Tensor::cat(&got, 0).unwrap();
        assert_eq!(got.dims(), &[n, engine.config().vocab_size]);
        let diff = (got - &full)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-4, "{arch:?}: max |cached - full| = {diff}");
    }
}

/// Rows continuing caches of one length run their attention as one batch (fresh prompts, or
/// prompts after a shared prefix): the logits, and the caches they leave for the next token,
/// equal each row's run alone. (~0.1 s)
#[test]
fn batched_prefill_from_equal_positions_equals_row_by_row() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        let model = engine.model();
        // One forward of `rows` (one token list per cache), the logits of every position or
        // only of the last.
        let run = |rows: &[&[u32]], caches: &mut [&mut KvCache], last_only: bool| {
            let data: Vec<u32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
            let ids = Tensor::from_vec(data, (rows.len(), rows[0].len()), model.device()).unwrap();
            model
                .forward_cached(&ids, caches, Forward::default(), last_only)
                .unwrap()
        };
        let heads: [&[u32]; 2] = [&[3, 4, 5, 6], &[7, 8, 9, 10]];
        let tails: [&[u32]; 2] = [&[11, 12, 13], &[14, 15, 16]];
        for start_after_prefix in [false, true] {
            // Batched: both rows from position 0, or both after their own 4-token prefix.
            let mut batched = [model.new_cache(), model.new_cache()];
            if start_after_prefix {
                for (cache, head) in batched.iter_mut().zip(heads) {
                    run(&[head], &mut [cache], true);
                }
            }
            let [c0, c1] = &mut batched;
            let together = run(&tails, &mut [c0, c1], false);
            let next = run(&[&[17], &[18]], &mut [c0, c1], true);
            for row in 0..2 {
                let mut alone = model.new_cache();
                if start_after_prefix {
                    run(&[heads[row]], &mut [&mut alone], true);
                }
                let own = run(&[tails[row]], &mut [&mut alone], false);
                let own_next = run(&[&[17 + row as u32]], &mut [&mut alone], true);
                let diff = max_diff(&together.narrow(0, row, 1).unwrap(), &own);
                assert!(
                    diff < 1e-4,
                    "{arch:?}, after prefix {start_after_prefix}, row {row}: {diff}"
                );
                let diff = max_diff(&next.narrow(0, row, 1).unwrap(), &own_next);
                assert!(diff < 1e-4, "{arch:?}, next token, row {row}: {diff}");
            }
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let (_dir, engine) = tiny(Architecture::Llama);
    let prompt = prompts(&engine)[0].clone();
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        top_k: 50,
        seed: Some(seed),
        max_tokens: 20,
        ignore_eos: true,
        n: 3,
        ..Default::default()
    };
    let run = |seed| -> Vec<Vec<u32>> {
        engine
            .generate(vec![request(prompt.clone(), params(seed))])
            .unwrap()[0]
            .completions
            .iter()
            .map(|c| c.token_ids())
            .collect()
    };
    let a = run(7);
    assert_eq!(a, run(7));
    assert_eq!(a.len(), 3);
    // The n completions differ from each other, and another seed gives other samples.
    assert!(a.iter().collect::<HashSet<_>>().len() > 1);
    assert_ne!(a, run(8));
    // Batched with other requests, a seeded request still gives the same tokens.
    let mixed = engine
        .generate(vec![
            request(prompts(&engine)[1].clone(), params(1)),
            request(prompt.clone(), params(7)),
        ])
        .unwrap();
    let b: Vec<Vec<u32>> = mixed[1].completions.iter().map(|c| c.token_ids()).collect();
    assert_eq!(a, b);
}

#[test]
fn stop_strings_and_stop_tokens_end_generation() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let prompt = prompts(&engine)[0].clone();
    let free = engine
        .generate(vec![request(prompt.clone(), greedy_ignoring_eos(30))])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    let text = free.text.clone();
    assert!(text.chars().count() > 6, "too short to cut: {text:?}");
    // Stop at a substring that starts a few characters in.
    let start = text.char_indices().nth(4).unwrap().0;
    let end = text.char_indices().nth(6).unwrap().0;
    let stop = text[start..end].to_string();
    let first = text.find(&stop).unwrap();
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy_ignoring_eos(30)
    };
    let cut = engine
        .generate(vec![request(prompt.clone(), params)])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    assert_eq!(cut.finish_reason, FinishReason::Stop);
    assert_eq!(cut.text, text[..first]);
    assert!(cut.tokens.len() < free.tokens.len());
    assert_eq!(cut.token_ids(), free.token_ids()[..cut.tokens.len()]);

    // A stop token id: generation ends on it, it is the last token, and the text excludes it.
    let stop_id = free.tokens[3].id;
    let params = SamplingParams {
        stop_token_ids: vec![stop_id],
        ..greedy_ignoring_eos(30)
    };
    let c = engine
        .generate(vec![request(prompt, params)])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    assert_eq!(c.finish_reason, FinishReason::Stop);
    let ids = c.token_ids();
    assert_eq!(*ids.last().unwrap(), stop_id);
    assert_eq!(ids.iter().filter(|&&t| t == stop_id).count(), 1);
    assert_eq!(c.text, engine.decode(&ids[..ids.len() - 1], true).unwrap());
}

#[test]
fn logprobs_are_valid_and_match_a_full_forward() {
    for arch in ARCHS {
        let (_dir, engine) = tiny(arch);
        let prompt = prompts(&engine)[1].clone();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            max_tokens: 16,
            top_logprobs: 5,
            logprobs: true,
            ignore_eos: true,
            ..Default::default()
        };
        let c = engine
            .generate(vec![request(prompt.clone(), params)])
            .unwrap()
            .remove(0)
            .completions
            .remove(0);
        for t in &c.tokens {
            assert!(t.logprob <= 0.0 && t.logprob.is_finite());
            assert_eq!(t.top_logprobs.len(), 5);
            assert!(t.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(t.top_logprobs[0].1 >= t.logprob);
            if let Some(&(_, lp)) = t.top_logprobs.iter().find(|(id, _)| *id == t.id) {
                assert!((lp - t.logprob).abs() < 1e-6);
            }
        }
        // At temperature 1 the reported logprobs are those of a full forward over prompt + output.
        let mut all = prompt.clone();
        all.extend(c.token_ids());
        let reference = engine.token_logprobs(&all, None).unwrap();
        let reference = &reference[prompt.len() - 1..];
        for (t, r) in c.tokens.iter().zip(reference) {
            assert!(
                (t.logprob - r).abs() < 1e-4,
                "{arch:?}: {} vs {r}",
                t.logprob
            );
        }
    }
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    }
}

/// Gives every B a random value so that the adapter changes the model.
fn perturb(adapter: &LoraAdapter) {
    for (i, (_, var)) in adapter.named_vars().into_iter().enumerate() {
        let t = var.as_tensor();
        let noise = Tensor::randn(0f32, 0.2, t.dims(), t.device()).unwrap();
        if i % 2 == 1 {
            var.set(&noise).unwrap();
        }
    }
}

fn logits(engine: &Engine, tokens: &[u32], adapter: Option<&LoraAdapter>) -> Tensor {
    let input = Tensor::new(tokens, engine.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    engine
        .model()
        .forward_full(
            &input,
            Forward {
                adapter,
                ..Default::default()
            },
        )
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn lora_adapters_apply_save_load_and_swap() {
    let (dir, engine) = tiny(Architecture::Qwen2);
    let tokens = prompts(&engine)[0].clone();
    let base = logits(&engine, &tokens, None);
    let adapter = LoraAdapter::new(engine.config(), &lora_config(), engine.device(), 1).unwrap();
    // B = 0: the fresh adapter leaves the model unchanged.
    assert!(max_diff(&base, &logits(&engine, &tokens, Some(&adapter))) < 1e-6);
    perturb(&adapter);
    let adapted = logits(&engine, &tokens, Some(&adapter));
    assert!(max_diff(&base, &adapted) > 1e-2);

    // PEFT format round trip.
    let out = dir.path().join("adapter");
    adapter.save_peft(&out, Some("tiny")).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(config["peft_type"], "LORA");
    let names = candle_core_names(&out.join("adapter_model.safetensors"));
    assert!(names.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    assert!(names.contains("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
    assert_eq!(names.len(), 2 * 7 * 2);
    let loaded = LoraAdapter::load_peft(&out, engine.config(), engine.device()).unwrap();
    assert!(max_diff(&adapted, &logits(&engine, &tokens, Some(&loaded))) < 1e-6);

    // Served by name, swappable without reloading the base; running requests keep theirs.
    let greedy = |adapter: Option<&str>| {
        engine
            .generate(vec![GenerationRequest {
                prompt: tokens.clone(),
                params: greedy_ignoring_eos(12),
                adapter: adapter.map(String::from),
            }])
            .unwrap()[0]
            .completions[0]
            .token_ids()
    };
    let base_tokens = greedy(None);
    engine.set_adapter("tiny@1", Arc::new(loaded)).unwrap();
    let with_adapter = greedy(Some("tiny@1"));
    assert_ne!(base_tokens, with_adapter);
    let fresh = LoraAdapter::new(engine.config(), &lora_config(), engine.device(), 9).unwrap();
    engine.set_adapter("tiny@1", Arc::new(fresh)).unwrap();
    assert_eq!(greedy(Some("tiny@1")), base_tokens);
    assert_eq!(engine.adapter_names(), vec!["tiny@1".to_string()]);
    let err = engine
        .generate(vec![GenerationRequest {
            prompt: tokens.clone(),
            params: SamplingParams::greedy(2),
            adapter: Some("missing".into()),
        }])
        .unwrap_err();
    assert!(err.to_string().contains("no LoRA adapter named `missing`"));
}

fn candle_core_names(path: &Path) -> HashSet<String> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

#[test]
fn gradients_flow_into_lora_only() {
    let (_dir, engine) = tiny(Architecture::Qwen3);
    let tokens = prompts(&engine)[0].clone();
    let adapter = LoraAdapter::new(engine.config(), &lora_config(), engine.device(), 1).unwrap();
    perturb(&adapter);
    let input = Tensor::new(tokens.as_slice(), engine.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let fwd = Forward {
        adapter: Some(&adapter),
        train: true,
        quantized: false,
    };
    let logits = engine.model().forward_full(&input, fwd).unwrap();
    // The differentiable path gives the same values as the inference path.
    let inference = engine
        .model()
        .forward_full(
            &input,
            Forward {
                adapter: Some(&adapter),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(max_diff(&logits, &inference) < 1e-4);
    let loss = art_core::engine::log_softmax(&logits)
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap();
    let grads = loss.backward().unwrap();
    let vars: Vec<Var> = adapter.vars();
    let with_grad = vars
        .iter()
        .filter(|v| {
            grads.get(v.as_tensor()).is_some_and(|g| {
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0
            })
        })
        .count();
    assert_eq!(with_grad, vars.len());
}

#[test]
fn loads_sharded_safetensors_and_the_hub_cache_layout() {
    let dir = temp_dir("src");
    let spec = RandomModelSpec::tiny(Architecture::Qwen2);
    spec.write(dir.path(), 5).unwrap();
    let single = Engine::load(
        &ModelSource::HfDir(dir.path().to_path_buf()),
        &LoadOptions::default(),
    )
    .unwrap();
    let tokens = prompts(&single)[0].clone();
    let expected = logits(&single, &tokens, None);

    // Split the weights into two shards with an index, as large checkpoints come.
    let sharded = temp_dir("sharded");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir.path().join(f), sharded.path().join(f)).unwrap();
    }
    let weights = spec.weights(5, &candle_core_cpu()).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let shard: std::collections::HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), weights[*n].clone()))
            .collect();
        art_core::engine::candle::safetensors::save(&shard, sharded.path().join(file)).unwrap();
        for n in part.iter() {
            map.insert((*n).clone(), serde_json::Value::String(file.into()));
        }
    }
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let engine = Engine::load(
        &ModelSource::HfDir(sharded.path().to_path_buf()),
        &LoadOptions::default(),
    )
    .unwrap();
    assert!(max_diff(&expected, &logits(&engine, &tokens, None)) < 1e-6);

    // The hub cache: blobs, a snapshot of symlinks, refs/main naming the commit.
    let cache = temp_dir("hub");
    let repo = cache.path().join("models--tiny-org--tiny-qwen2");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        let blob = repo
            .join("blobs")
            .join(format!("blob-{}", name.to_string_lossy()));
        std::fs::copy(&path, &blob).unwrap();
        std::os::unix::fs::symlink(
            Path::new("../../blobs").join(blob.file_name().unwrap()),
            snapshot.join(&name),
        )
        .unwrap();
    }
    for revision in ["main", commit] {
        let source = ModelSource::HfCache {
            repo_id: "tiny-org/tiny-qwen2".into(),
            revision: revision.into(),
            cache_dir: Some(cache.path().to_path_buf()),
        };
        let engine = Engine::load(&source, &LoadOptions::default()).unwrap();
        assert_eq!(engine.name(), "tiny-org/tiny-qwen2");
        assert!(max_diff(&expected, &logits(&engine, &tokens, None)) < 1e-6);
    }
    let missing = ModelSource::HfCache {
        repo_id: "tiny-org/absent".into(),
        revision: "main".into(),
        cache_dir: Some(cache.path().to_path_buf()),
    };
    let err = Engine::load(&missing, &LoadOptions::default())
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("not in the Hugging Face cache"),
        "{err}"
    );
}

fn candle_core_cpu() -> art_core::engine::Device {
    art_core::engine::Device::Cpu
}

#[test]
fn invalid_requests_are_errors_not_panics() {
    let (_dir, engine) = tiny(Architecture::Llama);
    let bad = |prompt: Vec<u32>, params: SamplingParams| {
        engine
            .generate(vec![request(prompt, params)])
            .unwrap_err()
            .to_string()
    };
    assert!(bad(vec![], SamplingParams::greedy(1)).contains("prompt is empty"));
    assert!(bad(vec![100_000], SamplingParams::greedy(1)).contains("outside the vocabulary"));
    let hot = SamplingParams {
        temperature: -1.0,
        ..Default::default()
    };
    assert!(bad(vec![1], hot).contains("temperature"));
    let n0 = SamplingParams {
        n: 0,
        ..Default::default()
    };
    assert!(bad(vec![1], n0).contains("n must be"));
}

/// Runs `requests` added together on `scheduler` to their end; outputs in request order.
fn run_all(
    scheduler: &mut art_core::engine::Scheduler<'_>,
    requests: Vec<GenerationRequest>,
) -> Vec<art_core::engine::GenerationOutput> {
    scheduler.generate(requests).unwrap()
}

fn assert_same_completion(
    a: &art_core::engine::GenerationOutput,
    b: &art_core::engine::GenerationOutput,
    tolerance: f32,
) {
    for (a, b) in a.completions.iter().zip(&b.completions) {
        assert_eq!(a.token_ids(), b.token_ids());
        for (x, y) in a.logprobs().iter().zip(b.logprobs()) {
            assert!((x - y).abs() <= tolerance, "logprob {x} vs {y}");
        }
    }
}

/// The prefix cache: a repeated prompt (a GRPO group's rollouts sent as separate requests) is not
/// prefilled again and samples what a fresh prefill does; an agent's next turn (the
/// conversation so far, then more) prefills only what is new; an adapter's entries serve only it.
/// ~1 s.
#[test]
fn repeated_and_extended_prompts_reuse_the_prefix_cache() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let fresh = |r: GenerationRequest| engine.generate(vec![r]).unwrap().remove(0);
    let prompt = engine
        .encode(
            "<|im_start|>user\nthe cat sat on the mat, and the dog sat on the log, and then \
             they both went to sleep in the sun<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    assert!(prompt.len() > 40, "{} tokens", prompt.len());
    let sampled = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: 12,
        ignore_eos: true,
        logprobs: true,
        ..Default::default()
    };
    let mut scheduler = engine.scheduler();

    // A group of three rollouts in one step: the prompt is prefilled once.
    let group: Vec<_> = (0..3)
        .map(|s| request(prompt.clone(), sampled(s)))
        .collect();
    let outputs = run_all(&mut scheduler, group.clone());
    let cached: Vec<usize> = outputs.iter().map(|o| o.cached_prompt_tokens).collect();
    assert_eq!(cached, vec![0, prompt.len(), prompt.len()]);
    for (output, request) in outputs.iter().zip(&group) {
        assert_same_completion(output, &fresh(request.clone()), 1e-5);
    }

    // The same prompt later: found whole, nothing prefilled, the same samples exactly.
    let again = run_all(&mut scheduler, vec![group[1].clone()]).remove(0);
    assert_eq!(again.cached_prompt_tokens, prompt.len());
    assert_same_completion(&again, &outputs[1], 1e-5);

    // The next turn: the conversation so far (prompt and answer), then a new user message.
    let mut next_turn = prompt.clone();
    next_turn.extend(outputs[2].completions[0].token_ids());
    next_turn.extend(
        engine
            .encode("<|im_end|>\n<|im_start|>user\nand then?", false)
            .unwrap(),
    );
    let next = request(next_turn.clone(), greedy_ignoring_eos(12));
    let reused = run_all(&mut scheduler, vec![next.clone()]).remove(0);
    // What the answer's cache holds (the prompt and all but the last sampled token), in whole
    // blocks of 16 positions.
    assert_eq!(reused.cached_prompt_tokens, (prompt.len() + 11) / 16 * 16);
    assert_same_completion(&reused, &fresh(next), 1e-4);

    // An adapter's requests do not use the base model's entries, nor a replaced adapter's.
    let adapter = LoraAdapter::new(engine.config(), &lora_config(), engine.device(), 1).unwrap();
    perturb(&adapter);
    engine.set_adapter("tiny@1", Arc::new(adapter)).unwrap();
    let adapted = GenerationRequest {
        adapter: Some("tiny@1".into()),
        ..group[0].clone()
    };
    let first = run_all(&mut scheduler, vec![adapted.clone()]).remove(0);
    assert_eq!(first.cached_prompt_tokens, 0);
    assert_ne!(
        first.completions[0].token_ids(),
        outputs[0].completions[0].token_ids()
    );
    let repeat = run_all(&mut scheduler, vec![adapted.clone()]).remove(0);
    assert_eq!(repeat.cached_prompt_tokens, prompt.len());
    assert_same_completion(&repeat, &first, 1e-5);
    let other = LoraAdapter::new(engine.config(), &lora_config(), engine.device(), 2).unwrap();
    engine.set_adapter("tiny@1", Arc::new(other)).unwrap();
    let replaced = run_all(&mut scheduler, vec![adapted.clone()]).remove(0);
    assert_eq!(replaced.cached_prompt_tokens, 0);

    // A budget of 0 turns sharing off: every request is prefilled, with the same results.
    scheduler.set_prefix_cache_budget(0);
    run_all(&mut scheduler, vec![group[0].clone()]);
    let off = run_all(&mut scheduler, group.clone());
    for (off, shared) in off.iter().zip(&outputs) {
        assert_eq!(off.cached_prompt_tokens, 0);
        assert_same_completion(off, shared, 1e-5);
    }
}

/// Chunked prefill: a prompt longer than the step's prefill budget, arriving while another
/// sequence decodes, is prefilled a chunk per step (kept in the prefix cache between steps), so
/// the running sequence gets a token at every one of those steps; its completion is the one the
/// prompt gets prefilled whole, and none of its own chunks count as cached tokens. ~0.1 s.
#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_others_decode() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let text = "the cat sat on the mat, and the dog sat on the log. ".repeat(8);
    let long_prompt = engine.encode(&text, false).unwrap();
    assert!(long_prompt.len() > 120, "{} tokens", long_prompt.len());
    let sampled = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        max_tokens: 6,
        ignore_eos: true,
        logprobs: true,
        ..Default::default()
    };
    let long = request(long_prompt.clone(), sampled);
    let whole = engine.generate(vec![long.clone()]).unwrap().remove(0);

    let mut scheduler = engine.scheduler();
    scheduler.max_prefill_tokens_per_step = 32;
    let short = scheduler
        .add(request(
            prompts(&engine)[0].clone(),
            greedy_ignoring_eos(40),
        ))
        .unwrap();
    scheduler.step().unwrap();
    let long_id = scheduler.add(long).unwrap();
    let mut steps_before_first_token = 0;
    loop {
        let events = scheduler.step().unwrap();
        if events.iter().any(|e| e.request == long_id) {
            break;
        }
        steps_before_first_token += 1;
        assert!(
            events.iter().any(|e| e.request == short),
            "the running sequence got no token at step {steps_before_first_token}"
        );
    }
    // 32 tokens a step, the last token with the request's start.
    assert_eq!(steps_before_first_token, (long_prompt.len() - 1) / 32);
    while !scheduler.is_idle() {
        scheduler.step().unwrap();
    }
    let finished = scheduler.take_finished();
    let chunked = &finished.iter().find(|(id, _)| *id == long_id).unwrap().1;
    assert_same_completion(chunked, &whole, 1e-4);
    assert_eq!(chunked.cached_prompt_tokens, 0);
}

/// A sequence's cache grows by doubling, but never past its prompt and `max_tokens`: a group of
/// four rollouts of a ~100-token prompt with `max_tokens` 8 holds at most 4 x (prompt + 8)
/// positions, prefilled (first round) and taken from the prefix cache (second round); doubling
/// alone would give each twice its prompt. ~0.1 s.
#[test]
fn caches_never_grow_past_the_prompt_and_max_tokens() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let per_position = engine.model().kv_bytes_per_position();
    let prompt = engine
        .encode(&"the cat sat on the mat. ".repeat(14), false)
        .unwrap();
    assert!(prompt.len() > 64, "{} tokens", prompt.len());
    let params = SamplingParams {
        n: 4,
        temperature: 1.0,
        seed: Some(3),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let mut scheduler = engine.scheduler();
    for round in 0..2 {
        scheduler
            .add(request(prompt.clone(), params.clone()))
            .unwrap();
        let mut most = 0;
        while !scheduler.is_idle() {
            scheduler.step().unwrap();
            most = most.max(scheduler.kv_bytes_in_use());
        }
        let finished = scheduler.take_finished();
        assert_eq!(finished[0].1.completions.len(), 4);
        assert!(
            finished[0]
                .1
                .completions
                .iter()
                .all(|c| c.tokens.len() == 8),
            "round {round}"
        );
        let positions = most / per_position;
        assert!(
            positions <= 4 * (prompt.len() + 8),
            "round {round}: the caches held {positions} positions for 4 x ({} + 8)",
            prompt.len()
        );
    }
}

/// A cache budget that holds a few sequences: requests start as memory allows, the newest
/// sequences are preempted when the others' caches grow, and resume later with their caches
/// rebuilt; every completion is what an unbounded budget gives (greedy and seeded sampling),
/// and the running caches never pass the budget. A request that could never fit is refused.
/// ~1 s.
#[test]
fn a_small_cache_budget_preempts_and_resumes_without_changing_completions() {
    let (_dir, engine) = tiny(Architecture::Qwen2);
    let per_position = engine.model().kv_bytes_per_position();
    let sampled = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: 90,
        ignore_eos: true,
        logprobs: true,
        n: 2,
        ..Default::default()
    };
    let mut requests: Vec<GenerationRequest> = prompts(&engine)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| request(prompt, sampled(i as u64)))
        .collect();
    requests.push(request(
        prompts(&engine)[1].clone(),
        greedy_ignoring_eos(90),
    ));
    let unbounded = run_all(&mut engine.scheduler(), requests.clone());

    // Room for five caches of 64 positions: nine sequences start as it allows, and each one's
    // cache doubles to 128 positions on the way to ~100 tokens.
    let budget = 5 * 64 * per_position;
    let mut scheduler = engine.scheduler();
    scheduler.set_kv_budget(budget);
    let ids: Vec<_> = requests
        .iter()
        .map(|r| scheduler.add(r.clone()).unwrap())
        .collect();
    let mut done = std::collections::HashMap::new();
    let mut most_running = 0;
    while !scheduler.is_idle() {
        scheduler.step().unwrap();
        assert!(
            scheduler.kv_bytes_in_use() <= budget,
            "{} bytes in use, budget {budget}",
            scheduler.kv_bytes_in_use()
        );
        most_running = most_running.max(scheduler.kv_bytes_in_use() / (64 * per_position));
        done.extend(scheduler.take_finished());
        assert!(scheduler.take_failed().is_empty());
    }
    assert!(scheduler.preemptions() > 0, "the budget never bound");
    assert!(most_running >= 2, "sequences still ran side by side");
    for (id, expected) in ids.iter().zip(&unbounded) {
        let output = done.remove(id).expect("every request finishes");
        assert_same_completion(&output, expected, 1e-4);
        assert_eq!(output.completions.len(), expected.completions.len());
    }

    // Too long for the budget even alone: refused when added, naming the limit.
    let error = scheduler
        .add(request(
            prompts(&engine)[0].clone(),
            greedy_ignoring_eos(500),
        ))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("key/value cache") && error.contains("max_tokens"),
        "{error}"
    );
    assert!(scheduler.is_idle());
}
