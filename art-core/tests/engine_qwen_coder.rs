//! Tests on the optional Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF
//! (`scripts/fetch-models.sh --qwen-coder`); they pass with a notice when it is missing.
#![cfg(feature = "engine")]

use std::path::PathBuf;

use art_core::engine::{
    Architecture, Engine, GenerationRequest, LoadOptions, ModelSource, SamplingParams,
};

#[test]
#[ignore = "needs models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (400 MB, not fetched by default): \
            scripts/fetch-models.sh --qwen-coder, then run with --ignored"]
fn qwen_coder_loads_tokenizes_and_answers() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh --qwen-coder",
        path.display()
    );
    let engine = Engine::load(&ModelSource::Gguf(path), &LoadOptions::default()).unwrap();
    let c = engine.config();
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert!(c.qkv_bias);
    assert_eq!((c.num_hidden_layers, c.hidden_size), (24, 896));
    // ChatML ids; <tool_call> is one (non-special) token, kept by decode(skip_special = true).
    assert_eq!(engine.encode("<|im_start|>", false).unwrap(), vec![151644]);
    let tool = engine.encode("<tool_call>", false).unwrap();
    assert_eq!(tool, vec![151657]);
    assert_eq!(engine.decode(&tool, true).unwrap(), "<tool_call>");
    assert!(engine.eos_token_ids().contains(&151645));
    let text = "def add(a, b):\n    return a + b  # 123 ünïcode";
    assert_eq!(
        engine
            .decode(&engine.encode(text, false).unwrap(), false)
            .unwrap(),
        text
    );
    let prompt = engine
        .encode(
            "<|im_start|>user\nWhat is the capital of France? Answer with one word.<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let out = engine
        .generate(vec![GenerationRequest {
            prompt,
            params: SamplingParams::greedy(8),
            adapter: None,
        }])
        .unwrap();
    let answer = &out[0].completions[0];
    assert!(answer.text.contains("Paris"), "got {:?}", answer.text);
}
