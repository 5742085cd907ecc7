//! Logits parity with an independent reference implementation (`scripts/reference_logits.py`,
//! numpy float64), on the tiny random Qwen2/Qwen3 fixtures and on SmolLM2 (dequantized GGUF).
#![cfg(feature = "engine")]

use std::path::{Path, PathBuf};

use art_core::engine::{Engine, Forward, LoadOptions, ModelSource, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    tokens: Vec<u32>,
    checks: Vec<Check>,
    #[serde(default)]
    tokenizer: Vec<TokenizerCase>,
}

#[derive(Deserialize)]
struct Check {
    position: usize,
    ids: Vec<usize>,
    logits: Vec<f64>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    text: String,
    ids: Vec<u32>,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_fixture(path: &Path) -> Fixture {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Compares the engine's dense full-forward logits with the fixture. Returns the largest
/// error relative to the largest reference logit magnitude at each position.
fn compare(engine: &Engine, fixture: &Fixture, quantized: bool) -> f64 {
    let input = Tensor::new(fixture.tokens.as_slice(), engine.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let fwd = Forward {
        quantized,
        ..Default::default()
    };
    let logits: Vec<Vec<f32>> = engine
        .model()
        .forward_full(&input, fwd)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut worst: f64 = 0.0;
    for check in &fixture.checks {
        let scale = check.logits.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (&id, &want) in check.ids.iter().zip(&check.logits) {
            let got = logits[check.position][id] as f64;
            worst = worst.max((got - want).abs() / scale);
        }
        // The reference's argmax (its first id at the last position) is ours too.
        if check.position == fixture.tokens.len() - 1 {
            let row = &logits[check.position];
            let argmax = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(argmax, check.ids[0], "argmax at the last position");
        }
    }
    worst
}

#[test]
fn tiny_qwen2_and_qwen3_match_the_reference() {
    for name in ["tiny-qwen2", "tiny-qwen3"] {
        let dir = fixtures().join(name);
        let engine =
            Engine::load(&ModelSource::HfDir(dir.clone()), &LoadOptions::default()).unwrap();
        let fixture = read_fixture(&dir.join("reference.json"));
        let err = compare(&engine, &fixture, false);
        println!("{name}: max relative logit error {err:.2e}");
        assert!(err < 1e-3, "{name}: max relative logit error {err}");
    }
}

#[test]
fn smollm2_matches_the_reference() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        path.display()
    );
    let engine = Engine::load(&ModelSource::Gguf(path), &LoadOptions::default()).unwrap();
    let fixture = read_fixture(&fixtures().join("smollm2-reference.json"));
    for case in &fixture.tokenizer {
        assert_eq!(
            engine.encode(&case.text, false).unwrap(),
            case.ids,
            "{:?}",
            case.text
        );
    }
    // Dense (dequantized) weights: the same numbers as the reference.
    let err = compare(&engine, &fixture, false);
    println!("smollm2 dense: max relative logit error {err:.2e}");
    assert!(err < 1e-3, "dense: max relative logit error {err}");
    // Quantized weights: llama.cpp-style Q8 activations make it approximate, but close. With
    // AVX-512 VNNI the Q4_1 weights are used as they are (2.4e-2 measured); with candle's
    // kernels they are re-quantized to Q8_0 first, a second rounding (5.7e-2). Argmax unchanged.
    let err = compare(&engine, &fixture, true);
    println!(
        "smollm2 quantized ({}): max relative logit error {err:.2e}",
        art_core::engine::quantized_kernels()
    );
    assert!(err < 7e-2, "quantized: max relative logit error {err}");
}
