//! Random-weight models of any shape, written as Hugging Face model directories.
//!
//! Tests use tiny ones (a few hundred KB) so that most of the engine is exercised without a
//! download; benchmarks can use real shapes (e.g. Qwen2.5-0.5B's) where shipping real weights is
//! impractical. The tokenizer is a small byte-level BPE with ChatML special tokens.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::config::Architecture;
use super::error::{EngineError, Result};

/// The shape of a random model.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomModelSpec {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

impl RandomModelSpec {
    /// A tiny model (two layers, hidden 64, GQA 4:2) of the given family, ~0.5 MB of f32.
    pub fn tiny(architecture: Architecture) -> Self {
        RandomModelSpec {
            architecture,
            vocab_size: 272,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rope_theta: 10_000.0,
            max_position_embeddings: 512,
            tie_word_embeddings: architecture == Architecture::Llama,
        }
    }

    fn model_type(&self) -> &'static str {
        match self.architecture {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    fn config_json(&self) -> serde_json::Value {
        let arch = match self.architecture {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        };
        serde_json::json!({
            "architectures": [arch],
            "model_type": self.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "bos_token_id": null,
            "eos_token_id": CHATML_END_ID,
            "torch_dtype": "float32",
        })
    }

    /// Random weights, Hugging Face-named, reproducible from `seed`.
    pub fn weights(&self, seed: u64, device: &Device) -> Result<HashMap<String, Tensor>> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = HashMap::new();
        let mut put = |name: String, shape: &[usize], lo: f32, hi: f32, rng: &mut StdRng| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
            Tensor::from_vec(data, shape, device).map(|t| out.insert(name, t))
        };
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        put(
            "model.embed_tokens.weight".into(),
            &[v, h],
            -1.0,
            1.0,
            &mut rng,
        )?;
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            put(
                format!("{p}.input_layernorm.weight"),
                &[h],
                0.8,
                1.2,
                &mut rng,
            )?;
            put(
                format!("{p}.post_attention_layernorm.weight"),
                &[h],
                0.8,
                1.2,
                &mut rng,
            )?;
            put(
                format!("{p}.self_attn.q_proj.weight"),
                &[q, h],
                -lin(h),
                lin(h),
                &mut rng,
            )?;
            put(
                format!("{p}.self_attn.k_proj.weight"),
                &[kv, h],
                -lin(h),
                lin(h),
                &mut rng,
            )?;
            put(
                format!("{p}.self_attn.v_proj.weight"),
                &[kv, h],
                -lin(h),
                lin(h),
                &mut rng,
            )?;
            put(
                format!("{p}.self_attn.o_proj.weight"),
                &[h, q],
                -lin(q),
                lin(q),
                &mut rng,
            )?;
            if self.architecture == Architecture::Qwen2 {
                put(
                    format!("{p}.self_attn.q_proj.bias"),
                    &[q],
                    -0.5,
                    0.5,
                    &mut rng,
                )?;
                put(
                    format!("{p}.self_attn.k_proj.bias"),
                    &[kv],
                    -0.5,
                    0.5,
                    &mut rng,
                )?;
                put(
                    format!("{p}.self_attn.v_proj.bias"),
                    &[kv],
                    -0.5,
                    0.5,
                    &mut rng,
                )?;
            }
            if self.architecture == Architecture::Qwen3 {
                let d = self.head_dim;
                put(
                    format!("{p}.self_attn.q_norm.weight"),
                    &[d],
                    0.8,
                    1.2,
                    &mut rng,
                )?;
                put(
                    format!("{p}.self_attn.k_norm.weight"),
                    &[d],
                    0.8,
                    1.2,
                    &mut rng,
                )?;
            }
            put(
                format!("{p}.mlp.gate_proj.weight"),
                &[i, h],
                -lin(h),
                lin(h),
                &mut rng,
            )?;
            put(
                format!("{p}.mlp.up_proj.weight"),
                &[i, h],
                -lin(h),
                lin(h),
                &mut rng,
            )?;
            put(
                format!("{p}.mlp.down_proj.weight"),
                &[h, i],
                -lin(i),
                lin(i),
                &mut rng,
            )?;
        }
        put("model.norm.weight".into(), &[h], 0.8, 1.2, &mut rng)?;
        if !self.tie_word_embeddings {
            put("lm_head.weight".into(), &[v, h], -lin(h), lin(h), &mut rng)?;
        }
        Ok(out)
    }

    /// Writes `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`
    /// into `dir` (created if missing).
    pub fn write(&self, dir: &Path, seed: u64) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| EngineError::io(&path, e))
        };
        write(
            "config.json",
            serde_json::to_string_pretty(&self.config_json()).expect("json"),
        )?;
        let weights = self.weights(seed, &Device::Cpu)?;
        candle_core::safetensors::save(&weights, dir.join("model.safetensors"))?;
        let tokenizer = test_tokenizer()?;
        if tokenizer.get_vocab_size(true) > self.vocab_size {
            return Err(EngineError::InvalidRequest(format!(
                "vocab_size {} is smaller than the test tokenizer's {} tokens",
                self.vocab_size,
                tokenizer.get_vocab_size(true)
            )));
        }
        tokenizer
            .save(dir.join("tokenizer.json"), true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        write(
            "tokenizer_config.json",
            serde_json::to_string_pretty(&serde_json::json!({
                "chat_template": CHATML_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": null,
                "model_max_length": self.max_position_embeddings,
            }))
            .expect("json"),
        )?;
        Ok(())
    }
}

/// ChatML, as SmolLM2 and Qwen use it.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("Ġ", "s"),
    ("r", "e"),
];

/// Id of `<|im_end|>` in [`test_tokenizer`].
pub const CHATML_END_ID: u32 = 256 + MERGES.len() as u32 + 2;

/// A small byte-level BPE: the 256 byte symbols, a few merges, then `<|endoftext|>`,
/// `<|im_start|>`, `<|im_end|>` as special tokens. Any text encodes (bytes are the fallback).
pub fn test_tokenizer() -> Result<Tokenizer> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let mut vocab: Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    for (a, b) in MERGES {
        let id = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), id);
    }
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    for s in specials {
        let id = vocab.len() as u32;
        vocab.insert(s.to_string(), id);
    }
    let merges = MERGES
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    let specials: Vec<AddedToken> = specials
        .iter()
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tokenizer
        .add_special_tokens(specials)
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    Ok(tokenizer)
}
