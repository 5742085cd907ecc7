//! The inference engine (feature `engine`): load a model (GGUF, Hugging Face directory, or the
//! hub cache), tokenize, run the decoder with LoRA adapters and KV caches, sample with
//! log-probabilities, and batch requests continuously.
//!
//! ```no_run
//! use art_core::engine::{Engine, GenerationRequest, LoadOptions, ModelSource, SamplingParams};
//! let engine = Engine::load(
//!     &ModelSource::parse("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
//!     &LoadOptions::default(),
//! )?;
//! let prompt = engine.encode("The capital of France is", false)?;
//! let out = engine.generate(vec![GenerationRequest {
//!     prompt,
//!     params: SamplingParams::greedy(8),
//!     adapter: None,
//! }])?;
//! println!("{}", out[0].completions[0].text);
//! # Ok::<(), art_core::engine::EngineError>(())
//! ```

pub mod chat_template;
mod config;
mod constraint;
mod cpu_attention;
mod cuda_decode;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_ops;
mod cuda_sample;
mod error;
mod gpu;
pub mod hub;
mod linear;
mod load;
mod lora;
mod model;
pub(crate) mod ops;
mod prefix_cache;
pub mod process;
#[cfg(target_arch = "x86_64")]
mod qgemm;
pub mod random;
mod sampler;
mod scheduler;
#[cfg(target_arch = "x86_64")]
mod skinny;
pub mod switches;
mod text;
mod tokenizer;
pub mod tool_calls;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

/// The tensor library the engine is built on, for callers that need more of it (the trainer).
pub use candle_core as candle;
pub use candle_core::{DType, Device, Tensor, Var};
pub use candle_nn;
pub use config::{Architecture, ModelConfig};
pub use constraint::Constraint;
pub use cuda_sample::{check_device_sampling, set_device_sampling};
pub use error::{EngineError, Result};
pub use gpu::{
    activation_budget, cuda_device, cuda_device_count, gpu_memory, save_safetensors, PeakMemory,
};
pub use linear::Linear;
pub use load::{load, LoadOptions, LoadedModel, ModelSource};
pub use lora::{LoraAdapter, LoraPair, Proj};
pub use model::{log_softmax, Forward, KvCache, LayerInputs, Model, PackedBlock, PackedRows};
pub use ops::set_fused_ops;
pub use sampler::{SampledToken, Sampler, SamplingParams};
pub use scheduler::{
    Completion, FinishReason, GenerationOutput, GenerationRequest, RequestId, Scheduler, TokenEvent,
};
pub use tokenizer::TokenizerInfo;
pub use tokenizers::Tokenizer;

/// A loaded model ready to generate: the decoder, its tokenizer, and the LoRA adapters that
/// requests may name. Shareable across threads (`Arc<Engine>`); adapters can be added and
/// replaced while it serves.
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    info: TokenizerInfo,
    name: String,
    adapters: RwLock<HashMap<String, Arc<LoraAdapter>>>,
    use_quantized: AtomicBool,
    /// Built on the first constrained request (see [`Engine::prepare_constraints`]).
    constraints: OnceLock<std::result::Result<constraint::ConstraintCompiler, String>>,
    /// Held shared by whoever enqueues GPU work besides the scheduler (the trainer), and
    /// exclusively while a decode step is captured into a CUDA graph: a capture records
    /// everything enqueued on the device's stream, whichever thread enqueues it.
    device_gate: RwLock<()>,
}

/// Which kernels multiply by quantized weights on this machine's CPU: our AVX-512 VNNI ones
/// (Q4_0/Q4_1/Q8_0 as they are, other formats re-quantized to Q8_0), or candle's.
pub fn quantized_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if qgemm::available() {
        return "AVX-512 VNNI packed kernels";
    }
    "candle's kernels (Q4_1 and Q5 formats re-quantized to Q8_0)"
}

impl Engine {
    /// Loads a model. Inference uses the dense weights by default (the trainer's own numbers);
    /// GGUF models can switch to their quantized copies with [`Engine::set_use_quantized`]:
    /// on a CPU with AVX-512 VNNI that decodes SmolLM2 3-5x faster (see [`quantized_kernels`]).
    pub fn load(source: &ModelSource, options: &LoadOptions) -> Result<Self> {
        Ok(Self::from_loaded(load::load(source, options)?))
    }

    pub fn from_loaded(loaded: LoadedModel) -> Self {
        Engine {
            model: loaded.model,
            tokenizer: loaded.tokenizer,
            info: loaded.info,
            name: loaded.name,
            adapters: RwLock::new(HashMap::new()),
            use_quantized: AtomicBool::new(false),
            constraints: OnceLock::new(),
            device_gate: RwLock::new(()),
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The gate between the scheduler's CUDA graph captures and other GPU work: hold it
    /// shared (`read()`) while enqueuing work on this engine's device from another thread than
    /// the scheduler's. Uncontended on the CPU (nothing is ever captured there).
    pub fn device_gate(&self) -> &RwLock<()> {
        &self.device_gate
    }

    /// [`Engine::device_gate`] held shared until the guard drops.
    pub fn hold_device(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.device_gate
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The file, directory or repository name the model was loaded from.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn tokenizer_info(&self) -> &TokenizerInfo {
        &self.info
    }

    /// The model's Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.info.chat_template.as_deref()
    }

    /// The model's chat template compiled with the special tokens it renders with, if it ships
    /// one: what the server renders prompts with and the trainer renders conversations with (the
    /// same, so that the context trained on is the context sampled from). `eos_token` is the
    /// end-of-turn marker when the template has one (`<|im_end|>` for ChatML, whatever the
    /// tokenizer's end of text), so that an assistant turn ends where the model stops generating.
    pub fn compiled_chat_template(
        &self,
    ) -> std::result::Result<Option<chat_template::ChatTemplate>, chat_template::ChatTemplateError>
    {
        let Some(source) = self.chat_template() else {
            return Ok(None);
        };
        let mut template = chat_template::ChatTemplate::new(source)?;
        if let Some(bos) = &self.info.bos_token {
            template = template.with_bos_token(bos.clone());
        }
        let end_of_turn = ["<|im_end|>", "<|eot_id|>", "<|end|>"]
            .into_iter()
            .find(|marker| source.contains(marker))
            .map(String::from)
            .or_else(|| self.info.eos_token.clone());
        if let Some(eos) = end_of_turn {
            template = template.with_eos_token(eos);
        }
        Ok(Some(template))
    }

    /// Token ids that end a generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.info.eos_token_ids
    }

    /// Text to token ids. `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (e.g. a bos token); special tokens written in the text (`<|im_start|>`) always encode as
    /// their single ids.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Whether inference uses the quantized weights (GGUF models only).
    pub fn use_quantized(&self) -> bool {
        self.use_quantized.load(Ordering::Relaxed)
    }

    /// Switches inference between quantized and dense (dequantized) weights. Has no effect on
    /// models without quantized weights.
    pub fn set_use_quantized(&self, on: bool) {
        self.use_quantized
            .store(on && self.model.has_quantized(), Ordering::Relaxed);
    }

    /// Registers (or replaces) a LoRA adapter under `name`; requests naming it use it from
    /// their next start. Sequences already running keep the adapter they started with. Its
    /// weights must not change in place afterwards: the GPU's decode graphs read a copy.
    pub fn set_adapter(&self, name: impl Into<String>, adapter: Arc<LoraAdapter>) -> Result<()> {
        if adapter.num_layers() != self.config().num_hidden_layers {
            return Err(EngineError::Adapter(format!(
                "the adapter has {} layers, the model {}",
                adapter.num_layers(),
                self.config().num_hidden_layers
            )));
        }
        self.adapters
            .write()
            .expect("adapter registry poisoned")
            .insert(name.into(), adapter);
        Ok(())
    }

    pub fn remove_adapter(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        self.adapters
            .write()
            .expect("adapter registry poisoned")
            .remove(name)
    }

    pub fn adapter(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        self.adapters
            .read()
            .expect("adapter registry poisoned")
            .get(name)
            .cloned()
    }

    /// Whether `adapter` is still registered (under any name).
    pub(crate) fn is_loaded(&self, adapter: &Arc<LoraAdapter>) -> bool {
        self.adapters
            .read()
            .expect("adapter registry poisoned")
            .values()
            .any(|a| Arc::ptr_eq(a, adapter))
    }

    pub fn adapter_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .adapters
            .read()
            .expect("adapter registry poisoned")
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Builds the token trie that constrained decoding needs (done once, on the first constrained
    /// request otherwise; ~0.1-1 s for a large vocabulary). Fails when the tokenizer cannot
    /// support it (neither byte-level BPE nor byte-fallback).
    pub fn prepare_constraints(&self) -> Result<()> {
        self.constraint_compiler().map(|_| ())
    }

    fn constraint_compiler(&self) -> Result<&constraint::ConstraintCompiler> {
        self.constraints
            .get_or_init(|| {
                constraint::ConstraintCompiler::new(
                    &self.tokenizer,
                    self.config().vocab_size,
                    self.eos_token_ids(),
                )
            })
            .as_ref()
            .map_err(|e| {
                EngineError::InvalidRequest(format!(
                    "constrained decoding is unavailable for this model: {e}"
                ))
            })
    }

    /// A scheduler for step-wise, continuously batched generation on this engine.
    pub fn scheduler(&self) -> Scheduler<'_> {
        Scheduler::new(self)
    }

    /// Generates for all `requests` together (batched) and returns their outputs in order.
    pub fn generate(&self, requests: Vec<GenerationRequest>) -> Result<Vec<GenerationOutput>> {
        self.scheduler().generate(requests)
    }

    /// Log-probabilities of `tokens[1..]` given their prefixes (one full forward with the dense
    /// weights, as the trainer computes them). `result[i]` is the logprob of `tokens[i + 1]`.
    pub fn token_logprobs(
        &self,
        tokens: &[u32],
        adapter: Option<&LoraAdapter>,
    ) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Ok(Vec::new());
        }
        let input = Tensor::new(tokens, self.device())?.unsqueeze(0)?;
        let fwd = Forward {
            adapter,
            train: false,
            quantized: false,
        };
        let logits = self.model.forward_full(&input, fwd)?.squeeze(0)?;
        let lp = log_softmax(&logits)?;
        let targets = Tensor::new(&tokens[1..], self.device())?.unsqueeze(1)?;
        let picked = lp
            .narrow(0, 0, tokens.len() - 1)?
            .gather(&targets, 1)?
            .squeeze(1)?;
        Ok(picked.to_vec1()?)
    }
}
