//! Random-weight models of any shape, written as Hugging Face model directories.
//!
//! Tests use tiny ones (a few hundred KB) so that most of the engine is exercised without a
//! download; benchmarks can use real shapes (e.g. Qwen2.5-0.5B's) where shipping real weights is
//! impractical. The tokenizer is a small byte-level BPE with ChatML special tokens.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::config::{Architecture, ModelConfig};
use super::error::{EngineError, Result};
use super::load::{LoadedModel, MapWeights};
use super::model::Model;
use super::tokenizer::TokenizerInfo;

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

    /// Every weight tensor: its Hugging Face name, shape, and the uniform range its values are
    /// drawn from, in drawing order.
    fn tensor_specs(&self) -> Vec<(String, Vec<usize>, f32, f32)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let mut specs = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![v, h],
            -1.0,
            1.0,
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut put = |name: &str, shape: Vec<usize>, lo: f32, hi: f32| {
                specs.push((format!("{p}.{name}"), shape, lo, hi))
            };
            put("input_layernorm.weight", vec![h], 0.8, 1.2);
            put("post_attention_layernorm.weight", vec![h], 0.8, 1.2);
            put("self_attn.q_proj.weight", vec![q, h], -lin(h), lin(h));
            put("self_attn.k_proj.weight", vec![kv, h], -lin(h), lin(h));
            put("self_attn.v_proj.weight", vec![kv, h], -lin(h), lin(h));
            put("self_attn.o_proj.weight", vec![h, q], -lin(q), lin(q));
            if self.architecture == Architecture::Qwen2 {
                put("self_attn.q_proj.bias", vec![q], -0.5, 0.5);
                put("self_attn.k_proj.bias", vec![kv], -0.5, 0.5);
                put("self_attn.v_proj.bias", vec![kv], -0.5, 0.5);
            }
            if self.architecture == Architecture::Qwen3 {
                let d = self.head_dim;
                put("self_attn.q_norm.weight", vec![d], 0.8, 1.2);
                put("self_attn.k_norm.weight", vec![d], 0.8, 1.2);
            }
            put("mlp.gate_proj.weight", vec![i, h], -lin(h), lin(h));
            put("mlp.up_proj.weight", vec![i, h], -lin(h), lin(h));
            put("mlp.down_proj.weight", vec![h, i], -lin(i), lin(i));
        }
        specs.push(("model.norm.weight".into(), vec![h], 0.8, 1.2));
        if !self.tie_word_embeddings {
            specs.push(("lm_head.weight".into(), vec![v, h], -lin(h), lin(h)));
        }
        specs
    }

    /// Random weights, Hugging Face-named, reproducible from `seed`.
    pub fn weights(&self, seed: u64, device: &Device) -> Result<HashMap<String, Tensor>> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = HashMap::new();
        for (name, shape, lo, hi) in self.tensor_specs() {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
            out.insert(name, Tensor::from_vec(data, shape, device)?);
        }
        Ok(out)
    }

    /// Random weights drawn on `device` itself (CUDA's generator on a GPU), in `dtype`: seconds
    /// for billions of parameters, where [`RandomModelSpec::weights`] draws on the CPU. Same
    /// ranges, different values (and not reproducible across devices).
    pub fn weights_on_device(
        &self,
        seed: u64,
        device: &Device,
        dtype: DType,
    ) -> Result<HashMap<String, Tensor>> {
        if !device.is_cpu() {
            // candle's CPU generator cannot be seeded: CPU draws differ from run to run.
            device.set_seed(seed)?;
        }
        let mut out = HashMap::new();
        for (name, shape, lo, hi) in self.tensor_specs() {
            let t = Tensor::rand(lo, hi, shape, device)?.to_dtype(dtype)?;
            out.insert(name, t);
        }
        Ok(out)
    }

    /// The Qwen2.5 shapes by name (`qwen2.5-0.5b`, `qwen2.5-1.5b`, `qwen2.5-7b`), or `tiny`
    /// (Qwen2).
    pub fn named(name: &str) -> Option<Self> {
        let mut spec = RandomModelSpec::tiny(Architecture::Qwen2);
        let (hidden, inter, layers, heads, kv, vocab, tied) = match name {
            "tiny" => return Some(spec),
            "qwen2.5-0.5b" => (896, 4864, 24, 14, 2, 151_936, true),
            "qwen2.5-1.5b" => (1536, 8960, 28, 12, 2, 151_936, true),
            "qwen2.5-7b" => (3584, 18_944, 28, 28, 4, 152_064, false),
            _ => return None,
        };
        spec.vocab_size = vocab;
        spec.hidden_size = hidden;
        spec.intermediate_size = inter;
        spec.num_hidden_layers = layers;
        spec.num_attention_heads = heads;
        spec.num_key_value_heads = kv;
        spec.head_dim = hidden / heads;
        spec.rope_theta = 1_000_000.0;
        spec.max_position_embeddings = 32_768;
        spec.tie_word_embeddings = tied;
        Some(spec)
    }

    /// Parameters in the model (embedding included once when tied).
    pub fn num_parameters(&self) -> usize {
        self.tensor_specs()
            .iter()
            .map(|(_, shape, _, _)| shape.iter().product::<usize>())
            .sum()
    }

    /// The model built in memory from `weights` (e.g. [`RandomModelSpec::weights`] or
    /// [`RandomModelSpec::weights_on_device`]), with the test tokenizer and ChatML template: no
    /// files are written. Weights move to `device` and `dtype`.
    pub fn load(
        &self,
        weights: HashMap<String, Tensor>,
        device: &Device,
        dtype: DType,
    ) -> Result<LoadedModel> {
        let text = serde_json::to_string(&self.config_json()).expect("json");
        let config = ModelConfig::from_hf_json(Path::new("config.json"), &text)?;
        let tokenizer = test_tokenizer()?;
        let info = TokenizerInfo {
            eos_token_ids: vec![CHATML_END_ID],
            eos_token: Some("<|im_end|>".into()),
            chat_template: Some(CHATML_TEMPLATE.into()),
            ..Default::default()
        };
        let weights = weights
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(device)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let mut source = MapWeights::new(weights, dtype);
        let model = Model::load(&config, &mut source, device)?;
        Ok(LoadedModel {
            model,
            tokenizer,
            info,
            name: format!("random {}", self.model_type()),
        })
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
