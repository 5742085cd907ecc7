//! Tests on the real SmolLM2-135M-Instruct GGUF (`scripts/fetch-models.sh` puts it in models/).
//! A missing file fails the tests, saying how to fetch it.
#![cfg(feature = "engine")]

use std::path::PathBuf;
use std::sync::OnceLock;

use art_core::engine::{Engine, GenerationRequest, LoadOptions, ModelSource, SamplingParams};

fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The default model's path; a test fails, saying how to fetch it, when it is missing
/// (scripts/test.sh fetches it first).
fn existing_model_path() -> PathBuf {
    let path = model_path();
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        Engine::load(
            &ModelSource::Gguf(existing_model_path()),
            &LoadOptions::default(),
        )
        .unwrap()
    })
}

#[test]
fn gguf_config_and_template() {
    let engine = engine();
    let c = engine.config();
    assert_eq!(c.num_hidden_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_attention_heads, 9);
    assert_eq!(c.num_key_value_heads, 3);
    assert_eq!(c.vocab_size, 49152);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 100_000.0);
    let template = engine
        .chat_template()
        .expect("SmolLM2 ships a chat template");
    assert!(template.contains("<|im_start|>"));
    // <|im_end|> (id 2) ends a turn.
    assert!(engine.eos_token_ids().contains(&2));
}

#[test]
fn tokenizer_round_trips_and_chatml_tokens_are_single_ids() {
    let engine = engine();
    for text in [
        "The capital of France is Paris.",
        "  leading spaces, numbers 12345 and émojis 🎉\n\nnew lines\ttabs",
        "fn main() { println!(\"{}\", 1 + 2); }",
    ] {
        let ids = engine.encode(text, false).unwrap();
        assert_eq!(engine.decode(&ids, false).unwrap(), text);
    }
    assert_eq!(engine.encode("<|im_start|>", false).unwrap(), vec![1]);
    assert_eq!(engine.encode("<|im_end|>", false).unwrap(), vec![2]);
    let chat = engine
        .encode("<|im_start|>user\nHi<|im_end|>\n", false)
        .unwrap();
    assert_eq!(chat[0], 1);
    assert!(chat.contains(&2));
    // Digits are split one by one, as in SmolLM2's tokenizer.json.
    let digits = engine.encode("12345", false).unwrap();
    assert_eq!(digits.len(), 5);
    // Special tokens are dropped when asked.
    assert_eq!(engine.decode(&chat, true).unwrap(), "user\nHi\n");
}

fn greedy(engine: &Engine, prompt: &str, max_tokens: usize) -> String {
    let prompt = engine.encode(prompt, false).unwrap();
    let out = engine
        .generate(vec![GenerationRequest {
            prompt,
            params: SamplingParams::greedy(max_tokens),
            adapter: None,
        }])
        .unwrap();
    out[0].completions[0].text.clone()
}

#[test]
fn greedy_continuation_names_paris() {
    let engine = engine();
    let text = greedy(engine, "The capital of France is", 8);
    assert!(text.contains(" Paris"), "got {text:?}");
}

#[test]
fn chat_answer_names_paris() {
    let engine = engine();
    let prompt = "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n";
    let text = greedy(engine, prompt, 12);
    assert!(text.contains("Paris"), "got {text:?}");
}

#[test]
fn quantized_weights_answer_like_the_dense_ones() {
    let path = existing_model_path();
    // An engine of its own: switching the shared one would change the other tests' numbers.
    let engine = Engine::load(&ModelSource::Gguf(path), &LoadOptions::default()).unwrap();
    engine.set_use_quantized(true);
    assert!(engine.use_quantized());
    println!(
        "quantized kernels: {}",
        art_core::engine::quantized_kernels()
    );
    let text = greedy(&engine, "The capital of France is", 8);
    assert!(text.contains(" Paris"), "got {text:?}");
    let prompt = "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n";
    let text = greedy(&engine, prompt, 12);
    assert!(text.contains("Paris"), "got {text:?}");
}

/// The text is decoded once per token (a window, not the whole completion): sampled freely, with
/// whatever bytes and partial characters that brings, it must equal a decode of the whole
/// completion, and the per-token deltas must add up to it. Cost: ~2 s (4 x 160 tokens).
#[test]
fn text_decoded_token_by_token_equals_the_whole_decode() {
    let engine = engine();
    let prompt = "<|im_start|>user\nWrite a short poem with emoji and some French words.<|im_end|>\n<|im_start|>assistant\n";
    let mut params = SamplingParams::greedy(160);
    params.temperature = 1.3;
    params.seed = Some(17);
    params.n = 4;
    let mut scheduler = engine.scheduler();
    let id = scheduler
        .add(GenerationRequest {
            prompt: engine.encode(prompt, false).unwrap(),
            params,
            adapter: None,
        })
        .unwrap();
    let mut deltas = vec![String::new(); 4];
    let mut output = None;
    while output.is_none() {
        for event in scheduler.step().unwrap() {
            deltas[event.index].push_str(&event.text);
        }
        output = scheduler
            .take_finished()
            .into_iter()
            .find(|(r, _)| *r == id);
    }
    for completion in output.unwrap().1.completions {
        let mut ids = completion.token_ids();
        if engine.eos_token_ids().contains(ids.last().unwrap()) {
            ids.pop();
        }
        assert_eq!(completion.text, engine.decode(&ids, true).unwrap());
        assert_eq!(deltas[completion.index], completion.text);
    }
}
