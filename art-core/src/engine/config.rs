//! The decoder's hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::{Deserialize, Serialize};

use super::error::{EngineError, Result};

/// The decoder families this engine runs. They share one implementation and differ only in
/// the flags of [`ModelConfig`]: qwen2 adds q/k/v biases, qwen3 adds RMS norms on q and k.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Ok(Architecture::Llama),
            "qwen2" | "qwen2forcausallm" => Ok(Architecture::Qwen2),
            "qwen3" | "qwen3forcausallm" => Ok(Architecture::Qwen3),
            other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
        }
    }
}

/// Hyper-parameters of a decoder, in Hugging Face's names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (qwen2).
    pub qkv_bias: bool,
    /// Bias on the attention output projection (llama with `attention_bias`).
    pub o_bias: bool,
    /// RMS norms on each head of q and k before RoPE (qwen3).
    pub qk_norm: bool,
}

/// The fields of a Hugging Face `config.json` that matter here.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_max_positions() -> usize {
    4096
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(text)
            .map_err(|e| EngineError::invalid(path, format!("config.json: {e}")))?;
        let arch_name = hf
            .model_type
            .clone()
            .or_else(|| hf.architectures.first().cloned())
            .ok_or_else(|| {
                EngineError::invalid(path, "config.json has neither model_type nor architectures")
            })?;
        let architecture = Architecture::parse(&arch_name)?;
        if let Some(scaling) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(EngineError::invalid(
                path,
                format!(
                    "rope_scaling {scaling} is not supported; use a model without RoPE scaling"
                ),
            ));
        }
        let attention_bias = hf.attention_bias;
        let (qkv_bias, o_bias, qk_norm) = match architecture {
            Architecture::Llama => {
                let b = attention_bias.unwrap_or(false);
                (b, b, false)
            }
            Architecture::Qwen2 => (true, false, false),
            Architecture::Qwen3 => (attention_bias.unwrap_or(false), false, true),
        };
        let config = ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            qkv_bias,
            o_bias,
            qk_norm,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads the hyper-parameters from GGUF metadata (`<arch>.block_count`, ...). `vocab_size`
    /// comes from the embedding tensor, and the biases and tied embeddings from which tensors
    /// the file holds.
    pub fn from_gguf(path: &Path, content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let get = |key: &str| -> Result<&gguf_file::Value> {
            md.get(key)
                .ok_or_else(|| EngineError::invalid(path, format!("GGUF metadata lacks `{key}`")))
        };
        let arch_name = get("general.architecture")?.to_string()?.clone();
        let architecture = Architecture::parse(&arch_name)?;
        let usize_of = |key: &str| -> Result<usize> {
            let v = get(&format!("{arch_name}.{key}"))?;
            Ok(match v {
                gguf_file::Value::U64(x) => *x as usize,
                gguf_file::Value::I64(x) => *x as usize,
                gguf_file::Value::I32(x) => *x as usize,
                other => other.to_u32()? as usize,
            })
        };
        let f64_of = |key: &str| -> Option<f64> {
            md.get(&format!("{arch_name}.{key}"))
                .and_then(|v| v.to_f32().ok())
                .map(f64::from)
        };
        let hidden_size = usize_of("embedding_length")?;
        let num_attention_heads = usize_of("attention.head_count")?;
        let num_key_value_heads =
            usize_of("attention.head_count_kv").unwrap_or(num_attention_heads);
        let head_dim =
            usize_of("attention.key_length").unwrap_or(hidden_size / num_attention_heads.max(1));
        let embed = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| {
                EngineError::invalid(path, "GGUF file has no tensor `token_embd.weight`")
            })?;
        // candle reports GGUF shapes outermost first: token_embd is [vocab, hidden].
        let vocab_size = embed.shape.dims().first().copied().unwrap_or(0);
        let has = |name: &str| content.tensor_infos.contains_key(name);
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            num_hidden_layers: usize_of("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f64_of("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            rope_theta: f64_of("rope.freq_base").unwrap_or(10_000.0),
            max_position_embeddings: usize_of("context_length").unwrap_or(4096),
            tie_word_embeddings: !has("output.weight"),
            qkv_bias: has("blk.0.attn_q.bias"),
            o_bias: has("blk.0.attn_output.bias"),
            qk_norm: has("blk.0.attn_q_norm.weight"),
        };
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |what: String| Err(EngineError::invalid(path, what));
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return bad("head counts must be positive".into());
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} attention heads is not a multiple of {} key/value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        Ok(())
    }

    /// Query heads per key/value head (grouped-query attention).
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}
