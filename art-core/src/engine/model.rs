//! The decoder: llama, qwen2 and qwen3 in one implementation.
//!
//! Reads top to bottom like candle-transformers' `qwen2.rs`: RMS norm, rotary embedding,
//! attention (grouped-query, optional q/k/v biases and q/k norms), SwiGLU MLP, decoder layer,
//! model. Every forward takes a [`Forward`] that says which LoRA adapter to apply (if any),
//! whether gradients are wanted, and whether quantized weights may be used.
//!
//! Two ways in: [`Model::forward_full`] runs whole sequences from position 0 with a causal mask
//! and returns logits for every position (the trainer's path); [`Model::forward_cached`] runs new
//! tokens of several independent sequences, each against its own [`KvCache`] (prefill and
//! batched decode; sequences can join or leave between calls).

use std::sync::OnceLock;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};

use super::config::ModelConfig;
use super::cpu_attention;
use super::cuda_decode::{self, DecodePlan};
use super::error::{EngineError, Result};
use super::linear::Linear;
use super::lora::{LoraAdapter, Proj};
use super::ops;
use super::switches::MANUAL_BACKWARD;

mod backward;
mod decode_graph;
mod decode_step;
mod kv_cache;
mod packing;
mod training;

pub use decode_graph::DecodeGraphs;
pub use kv_cache::{grown_capacity, KvCache};
use packing::Segments;
pub use packing::{PackedBlock, PackedRows};

/// How to run one forward pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct Forward<'a> {
    /// The LoRA adapter to apply, if any.
    pub adapter: Option<&'a LoraAdapter>,
    /// Build the autograd graph through the adapter's variables (training). When false the
    /// adapter is applied through detached views and fused kernels without gradients are used.
    pub train: bool,
    /// Use the quantized copies of the weights where the model has them (inference only).
    pub quantized: bool,
}

impl<'a> Forward<'a> {
    fn lora(&self, layer: usize, proj: Proj) -> (Option<(&'a super::lora::LoraPair, bool)>, f64) {
        match self.adapter {
            Some(a) => (a.get(layer, proj).map(|p| (p, self.train)), a.scale()),
            None => (None, 0.0),
        }
    }

    fn linear(&self, lin: &Linear, x: &Tensor, layer: usize, proj: Proj) -> Result<Tensor> {
        let (lora, scale) = self.lora(layer, proj);
        let dropout = self.adapter.map_or(0.0, |a| a.config().dropout);
        match lora {
            // LoRA dropout (training only): the adapter branch sees a dropped-out input, the
            // frozen base the whole input, as in PEFT.
            Some((pair, true)) if dropout > 0.0 => {
                let y = lin.forward(x, self.quantized, None, 0.0)?;
                let dropped = candle_nn::ops::dropout(x, dropout as f32)?;
                let delta = Linear::lora_delta(&dropped, pair, true, scale)?;
                Ok((y + delta)?)
            }
            _ => lin.forward(x, self.quantized, lora, scale),
        }
    }

    /// [`Forward::linear`] without the layer's bias (no dropout: inference only).
    fn linear_unbiased(
        &self,
        lin: &Linear,
        x: &Tensor,
        layer: usize,
        proj: Proj,
    ) -> Result<Tensor> {
        let (lora, scale) = self.lora(layer, proj);
        lin.forward_unbiased(x, lora, scale)
    }
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm { weight, eps }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if (x.track_op() || x.dtype() == DType::F64) && ops::supported(x) {
            // One pass forward, one backward (candle's fused kernel has neither a backward
            // nor an f64 version).
            Ok(ops::rms_norm(x, &self.weight, self.eps)?)
        } else if x.track_op() || x.dtype() == DType::F64 {
            Ok(candle_nn::ops::rms_norm_slow(
                x,
                &self.weight,
                self.eps as f32,
            )?)
        } else {
            Ok(candle_nn::ops::rms_norm(
                &x.contiguous()?,
                &self.weight,
                self.eps as f32,
            )?)
        }
    }
}

/// Rotary position embedding, non-interleaved (the two halves of each head rotate together),
/// computed per position on demand so that every sequence of a batch can sit at its own offset.
#[derive(Debug, Clone)]
struct Rotary {
    /// `theta^(-2i/d)` for `i < d/2`, in f32 as Hugging Face computes it.
    inv_freq: Vec<f32>,
}

/// `cos` and `sin` for the positions of one forward: `[B, L, head_dim/2]`; for rows packed with
/// several sequences, also what each query may attend to.
#[derive(Debug, Clone)]
struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    segments: Option<Segments>,
}

impl Rotary {
    fn new(config: &ModelConfig) -> Self {
        let d = config.head_dim;
        let inv_freq = (0..d / 2)
            .map(|i| 1.0 / (config.rope_theta as f32).powf((2 * i) as f32 / d as f32))
            .collect();
        Rotary { inv_freq }
    }

    /// `starts[b]` is the first position of row `b`; each row has `len` positions.
    fn tables(
        &self,
        starts: &[usize],
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables> {
        let positions: Vec<usize> = starts.iter().flat_map(|&s| s..s + len).collect();
        self.tables_at(&positions, (starts.len(), len), dtype, device)
    }

    /// The tables of `positions`, one per position of rows `[B, L]`, row after row.
    fn tables_at(
        &self,
        positions: &[usize],
        shape: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(cos.capacity());
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let shape = (shape.0, shape.1, half);
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
            segments: None,
        })
    }
}

impl RopeTables {
    /// `x`: `[B, H, L, head_dim]`.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        if !x.track_op() {
            return Ok(candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)?);
        }
        if ops::supported(&x) {
            return Ok(ops::rope(&x, &self.cos, &self.sin)?);
        }
        // Differentiable form: x * cos + rotate_half(x) * sin.
        let cos = Tensor::cat(&[&self.cos, &self.cos], D::Minus1)?.unsqueeze(1)?;
        let sin = Tensor::cat(&[&self.sin, &self.sin], D::Minus1)?.unsqueeze(1)?;
        let half = x.dim(D::Minus1)? / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
    }
}

/// The most attention scores a batched prefill holds at once (64 Mi: 256 MiB in f32); a batch
/// whose scores would be more attends row by row.
const MAX_BATCHED_SCORES: usize = 1 << 26;

/// Additive causal mask `[1, 1, 1, L, offset + L]` (for [`add_mask`]): query `l` sees keys
/// `0..=offset + l`.
fn causal_mask(len: usize, offset: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let total = offset + len;
    let mask: Vec<f32> = (0..len)
        .flat_map(|l| {
            (0..total).map(move |t| {
                if t <= offset + l {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (1, 1, 1, len, total), device)?.to_dtype(dtype)?)
}

/// `scores` `[B, kv, rep * L, T]` (the `rep` query heads sharing a key head stacked) plus an
/// additive `mask` `[B or 1, 1, 1, L, T]`, the same for every head.
fn add_mask(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (b, kv, rows, t) = scores.dims4()?;
    let l = mask.dim(3)?;
    let masked = scores
        .reshape((b, kv, rows / l, l, t))?
        .broadcast_add(mask)?;
    Ok(masked.reshape((b, kv, rows, t))?)
}

/// The fused causal softmax of training scores `[B, kv, rep * L, L]` (rows from position 0),
/// within each packed sequence where `rope` says rows are packed.
fn causal_probs(scores: &Tensor, l: usize, rope: &RopeTables) -> Result<Tensor> {
    Ok(match &rope.segments {
        Some(segments) => ops::causal_softmax(&add_mask(scores, &segments.mask)?, l, 0)?,
        None => ops::causal_softmax(scores, l, 0)?,
    })
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    layer: usize,
}

impl Attention {
    /// `x`: `[B, L, hidden]`. With `caches`, row `b` continues sequence `caches[b]` from its
    /// current length; without, every row starts at position 0.
    fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        caches: Option<&mut [&mut KvCache]>,
        plan: Option<&DecodePlan>,
        fwd: &Forward,
    ) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let (h, kv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = fwd.linear(&self.q_proj, x, self.layer, Proj::Q)?;
        let k = fwd.linear(&self.k_proj, x, self.layer, Proj::K)?;
        let v = fwd.linear(&self.v_proj, x, self.layer, Proj::V)?;
        let mut q = q.reshape((b, l, h, hd))?;
        let mut k = k.reshape((b, l, kv, hd))?;
        if let Some(n) = &self.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(&k)?;
        }
        let q = rope.apply(&q.transpose(1, 2)?)?;
        let k = rope.apply(&k.transpose(1, 2)?)?;
        let v = v.reshape((b, l, kv, hd))?.transpose(1, 2)?.contiguous()?;
        // Fold the softmax scale into q once.
        let q = (q * (1.0 / (hd as f64).sqrt()))?;

        let out = match (caches, plan) {
            // One token per sequence, no gradient, on CUDA: two kernels for the whole batch.
            (_, Some(plan)) => cuda_decode::attend(plan, self.layer, &q, &k, &v)?,
            // Whole sequences from position 0 (training, reference passes): the fused causal
            // softmax, with its backward, and no mask to build.
            (None, _) if ops::supported(&q) => self.attend_causal(&q, &k, &v, rope)?,
            (None, _) => match &rope.segments {
                Some(segments) => self.attend(&q, &k, &v, Some(&segments.mask))?,
                None => {
                    let mask = (l > 1)
                        .then(|| causal_mask(l, 0, q.dtype(), q.device()))
                        .transpose()?;
                    self.attend(&q, &k, &v, mask.as_ref())?
                }
            },
            (Some(caches), None) => {
                // Each sequence's new keys and values go into its cache; then attention over
                // everything cached.
                let mut cached = Vec::with_capacity(b);
                for (i, cache) in caches.iter_mut().enumerate() {
                    let start = cache.len;
                    let (k_all, v_all) = cache.append(
                        self.layer,
                        start,
                        &k.narrow(0, i, 1)?,
                        &v.narrow(0, i, 1)?,
                    )?;
                    cached.push((start, k_all, v_all));
                }
                let start = cached[0].0;
                if l == 1 && q.device().is_cpu() && q.dtype() == DType::F32 {
                    // One token per sequence on the CPU: one pass over every cache.
                    let (keys, values): (Vec<_>, Vec<_>) =
                        cached.into_iter().map(|(_, k, v)| (k, v)).unzip();
                    cpu_attention::decode(&q, &keys, &values)?
                } else if b > 1
                    && cached.iter().all(|(s, _, _)| *s == start)
                    && b * q.dim(1)? * l * (start + l) <= MAX_BATCHED_SCORES
                {
                    // Rows continuing caches of one length (fresh prompts, or a group's prompts
                    // after their shared prefix) attend as one batch: a few launches per layer
                    // instead of a few per row and layer, which on a GPU cost more than the
                    // arithmetic. From position 0 the new keys and values are all there is.
                    // (Past a bound on the scores held at once, row by row keeps the peak low.)
                    let (keys, values) = if start == 0 {
                        (k.clone(), v.clone())
                    } else {
                        let (keys, values): (Vec<_>, Vec<_>) =
                            cached.into_iter().map(|(_, k, v)| (k, v)).unzip();
                        (Tensor::cat(&keys, 0)?, Tensor::cat(&values, 0)?)
                    };
                    let mask = (l > 1)
                        .then(|| causal_mask(l, start, q.dtype(), q.device()))
                        .transpose()?;
                    self.attend(&q, &keys, &values, mask.as_ref())?
                } else {
                    let mut rows = Vec::with_capacity(b);
                    for (i, (start, k_all, v_all)) in cached.iter().enumerate() {
                        let mask = (l > 1)
                            .then(|| causal_mask(l, *start, q.dtype(), q.device()))
                            .transpose()?;
                        rows.push(self.attend(&q.narrow(0, i, 1)?, k_all, v_all, mask.as_ref())?);
                    }
                    Tensor::cat(&rows, 0)?
                }
            }
        };
        // [B, H, L, hd] -> [B, L, H * hd]
        let out = out.transpose(1, 2)?.reshape((b, l, h * hd))?;
        fwd.linear(&self.o_proj, &out, self.layer, Proj::O)
    }

    /// [`Attention::attend`] for sequences that start at position 0, with the causal mask and
    /// the softmax in one fused kernel (and its backward): the training path.
    fn attend_causal(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let (b, h, l, hd) = q.dims4()?;
        let kv = self.num_kv_heads;
        let q = q.reshape((b, kv, (h / kv) * l, hd))?;
        let probs = causal_probs(&q.matmul(&k.t()?)?, l, rope)?;
        Ok(probs.matmul(&v.contiguous()?)?.reshape((b, h, l, hd))?)
    }

    /// Grouped-query attention without copying keys per head: the `n_rep` query heads sharing a
    /// key/value head are stacked along the query axis. `q`: `[B, H, L, hd]` (pre-scaled),
    /// `k`, `v`: `[B, kv, T, hd]`, `mask`: additive, as [`add_mask`] takes it.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, h, l, hd) = q.dims4()?;
        let kv = self.num_kv_heads;
        let q = q.reshape((b, kv, (h / kv) * l, hd))?;
        let mut scores = q.matmul(&k.t()?)?;
        if let Some(mask) = mask {
            scores = add_mask(&scores, mask)?;
        }
        let probs = if scores.track_op() {
            candle_nn::ops::softmax(&scores, D::Minus1)?
        } else {
            candle_nn::ops::softmax_last_dim(&scores)?
        };
        Ok(probs.matmul(&v.contiguous()?)?.reshape((b, h, l, hd))?)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    layer: usize,
}

impl Mlp {
    fn forward(&self, x: &Tensor, fwd: &Forward) -> Result<Tensor> {
        let gate = fwd.linear(&self.gate_proj, x, self.layer, Proj::Gate)?;
        let up = fwd.linear(&self.up_proj, x, self.layer, Proj::Up)?;
        let hidden = (gate.silu()? * up)?;
        fwd.linear(&self.down_proj, &hidden, self.layer, Proj::Down)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        caches: Option<&mut [&mut KvCache]>,
        plan: Option<&DecodePlan>,
        fwd: &Forward,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (x + self.self_attn.forward(&h, rope, caches, plan, fwd)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h, fwd)?)?)
    }
}

/// Named weights for building a [`Model`]: dense tensors, or linear layers already built (from
/// quantized GGUF tensors).
pub trait WeightSource {
    /// A dense tensor (norm weights, embeddings, biases).
    fn tensor(&mut self, name: &str) -> Result<Tensor>;
    fn has(&self, name: &str) -> bool;
    /// A linear layer `<prefix>.weight` (+ `<prefix>.bias` when `bias`).
    fn linear(&mut self, prefix: &str, bias: bool) -> Result<Linear>;
}

/// Every decoder layer's input from [`Model::forward_layers_checkpointed`], and the activations
/// it kept.
pub struct LayerInputs {
    inputs: Vec<Tensor>,
    /// By layer (where the hand-written backward runs): the activations kept from the forward,
    /// `None` for a layer the backward recomputes.
    kept: Vec<Option<backward::Activations>>,
    /// The memory one layer's activations take (0 when none was measured).
    layer_bytes: usize,
    /// The forward's rotary tables (computed on the host: not twice).
    rope: RopeTables,
    /// Each layer's adapter pairs cast for [`backward::layer_forward`] (empty where the layers
    /// ran the general forward instead).
    casts: Vec<backward::LayerCasts>,
}

impl LayerInputs {
    /// How many layers' activations were kept (not to be recomputed), and of how many layers.
    pub fn kept_layers(&self) -> (usize, usize) {
        let kept = self.kept.iter().filter(|a| a.is_some()).count();
        (kept, self.inputs.len())
    }

    /// The memory one layer's kept activations take (0 when none was measured).
    pub fn layer_bytes(&self) -> usize {
        self.layer_bytes
    }
}

/// A whole decoder with its embedding and language-model head.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    /// `cos` and `sin` of every position the decode kernels take, `[MAX_LEN, head_dim / 2]`, on
    /// the device: a decode step looks its positions up there (made at the first one).
    decode_rope: OnceLock<RopeTables>,
    device: Device,
    dtype: DType,
}

impl Model {
    /// Builds the model from Hugging Face-named weights (`model.layers.0.self_attn.q_proj.weight`).
    pub fn load(config: &ModelConfig, w: &mut dyn WeightSource, device: &Device) -> Result<Self> {
        let c = config;
        let eps = c.rms_norm_eps;
        let embed_tokens = w.tensor("model.embed_tokens.weight")?;
        let dtype = embed_tokens.dtype();
        if embed_tokens.dims() != [c.vocab_size, c.hidden_size] {
            return Err(EngineError::Weights(format!(
                "the embedding is {:?}, the config says vocab {} x hidden {}",
                embed_tokens.dims(),
                c.vocab_size,
                c.hidden_size
            )));
        }
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let norm = |w: &mut dyn WeightSource, name: &str| -> Result<Option<RmsNorm>> {
                let name = format!("{p}.{name}.weight");
                Ok(if w.has(&name) {
                    Some(RmsNorm::new(w.tensor(&name)?, eps))
                } else {
                    None
                })
            };
            let q_norm = if c.qk_norm {
                norm(w, "self_attn.q_norm")?
            } else {
                None
            };
            let k_norm = if c.qk_norm {
                norm(w, "self_attn.k_norm")?
            } else {
                None
            };
            let self_attn = Attention {
                q_proj: w.linear(&format!("{p}.self_attn.q_proj"), c.qkv_bias)?,
                k_proj: w.linear(&format!("{p}.self_attn.k_proj"), c.qkv_bias)?,
                v_proj: w.linear(&format!("{p}.self_attn.v_proj"), c.qkv_bias)?,
                o_proj: w.linear(&format!("{p}.self_attn.o_proj"), c.o_bias)?,
                q_norm,
                k_norm,
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                layer: i,
            };
            let mlp = Mlp {
                gate_proj: w.linear(&format!("{p}.mlp.gate_proj"), false)?,
                up_proj: w.linear(&format!("{p}.mlp.up_proj"), false)?,
                down_proj: w.linear(&format!("{p}.mlp.down_proj"), false)?,
                layer: i,
            };
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm::new(
                    w.tensor(&format!("{p}.input_layernorm.weight"))?,
                    eps,
                ),
                self_attn,
                post_attention_layernorm: RmsNorm::new(
                    w.tensor(&format!("{p}.post_attention_layernorm.weight"))?,
                    eps,
                ),
                mlp,
            });
        }
        let norm = RmsNorm::new(w.tensor("model.norm.weight")?, eps);
        let lm_head = if w.has("lm_head.weight") {
            w.linear("lm_head", false)?
        } else {
            // Tied embeddings (the source may still offer a quantized copy of the embedding).
            w.linear("model.embed_tokens", false)?
        };
        Ok(Model {
            config: c.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary: Rotary::new(c),
            decode_rope: OnceLock::new(),
            device: device.clone(),
            dtype,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype (f32 on CPU, bf16 on CUDA).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// True when the weights also have quantized copies ([`Forward::quantized`] has an effect).
    pub fn has_quantized(&self) -> bool {
        self.lm_head.has_quantized()
    }

    /// A new, empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// Bytes one position of a sequence's cache takes: every layer's key and value.
    pub fn kv_bytes_per_position(&self) -> usize {
        let c = &self.config;
        self.layers.len() * 2 * c.num_key_value_heads * c.head_dim * self.dtype.size_in_bytes()
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, l) = input_ids.dims2()?;
        let flat = input_ids.flatten_all()?;
        Ok(self
            .embed_tokens
            .index_select(&flat, 0)?
            .reshape((b, l, self.config.hidden_size))?)
    }

    fn check_ids(&self, input_ids: &Tensor) -> Result<()> {
        if input_ids.dtype() != DType::U32 {
            return Err(EngineError::InvalidRequest(format!(
                "token ids must be u32, got {:?}",
                input_ids.dtype()
            )));
        }
        let max = input_ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        self.check_id(max)
    }

    /// An error naming `id` if the vocabulary has no such token.
    fn check_id(&self, id: u32) -> Result<()> {
        if id as usize >= self.config.vocab_size {
            return Err(EngineError::InvalidRequest(format!(
                "token id {id} is outside the vocabulary of {} tokens",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    fn head(&self, x: &Tensor, fwd: &Forward) -> Result<Tensor> {
        let x = self.norm.forward(x)?;
        let logits = self.lm_head.forward(&x, fwd.quantized, None, 0.0)?;
        Ok(logits.to_dtype(DType::F32)?)
    }

    /// Logits `[B, L, vocab]` (f32) for sequences `input_ids` (`[B, L]`, u32) that all start at
    /// position 0. Rows may be right-padded: a causal model's outputs at real positions do not
    /// depend on later padding.
    pub fn forward_full(&self, input_ids: &Tensor, fwd: Forward) -> Result<Tensor> {
        let x = self.forward_layers(input_ids, None, &fwd)?;
        self.head(&x, &fwd)
    }

    /// The final hidden states `[B, L, hidden]` (after the last norm, in the model's dtype) for
    /// sequences that start at position 0, as [`Model::forward_full`] computes them before the
    /// language-model head, or for the sequences `packing` puts one after another in each row.
    /// A trainer applies [`Model::logits`] to the positions it needs only.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        packing: Option<&PackedRows>,
        fwd: Forward,
    ) -> Result<Tensor> {
        let x = self.forward_layers(input_ids, packing, &fwd)?;
        self.norm.forward(&x)
    }

    /// The language-model head on final hidden states `[..., hidden]` -> logits `[..., vocab]`,
    /// in the model's dtype.
    pub fn logits(&self, hidden: &Tensor, fwd: Forward) -> Result<Tensor> {
        self.lm_head.forward(hidden, fwd.quantized, None, 0.0)
    }

    fn forward_layers(
        &self,
        input_ids: &Tensor,
        packing: Option<&PackedRows>,
        fwd: &Forward,
    ) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let rope = self.row_tables(input_ids.dims2()?, packing)?;
        let mut x = self.embed(input_ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &rope, None, None, fwd)?;
        }
        Ok(x)
    }

    /// Runs `input_ids` (`[B, L]`) where row `b` continues the sequence cached in `caches[b]`,
    /// and appends the new keys/values to the caches. Returns logits `[B, L, vocab]`, or
    /// `[B, 1, vocab]` for the last position only when `last_only`.
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        caches: &mut [&mut KvCache],
        fwd: Forward,
        last_only: bool,
    ) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let (b, l) = input_ids.dims2()?;
        if caches.len() != b {
            return Err(EngineError::InvalidRequest(format!(
                "{b} rows of tokens but {} caches",
                caches.len()
            )));
        }
        let plan = if l == 1
            && !fwd.train
            && cuda_decode::available(&self.device, self.dtype, self.config.head_dim)
        {
            self.decode_plan(caches)?
        } else {
            None
        };
        if let Some(plan) = plan {
            let logits = self
                .decode_step(input_ids, &plan, &fwd)?
                .to_dtype(DType::F32)?;
            for cache in caches.iter_mut() {
                cache.len += 1;
            }
            return Ok(logits);
        }
        let x = self.layers_cached(input_ids, caches, &fwd)?;
        for cache in caches.iter_mut() {
            cache.len += l;
        }
        let x = if last_only && l > 1 {
            x.narrow(1, l - 1, 1)?
        } else {
            x
        };
        self.head(&x, &fwd)
    }

    /// A prefill of right-padded rows: row `b` of `input_ids` (`[B, L]`) is `lens[b]` tokens
    /// that continue `caches[b]`, then padding; every cache must hold as many positions. Returns
    /// the logits after each row's last token, `[B, 1, vocab]`; each cache keeps its row's
    /// `lens[b]` tokens. One forward for prompts of different lengths instead of one per length:
    /// attention is causal, so the padding after a row's tokens changes none of their keys,
    /// values or logits, and what it writes past them in the cache is overwritten by the
    /// sequence's next tokens.
    pub fn forward_prefill(
        &self,
        input_ids: &Tensor,
        lens: &[usize],
        caches: &mut [&mut KvCache],
        fwd: Forward,
    ) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let (b, l) = input_ids.dims2()?;
        if caches.len() != b || lens.len() != b {
            return Err(EngineError::InvalidRequest(format!(
                "{b} rows of tokens, {} lengths and {} caches",
                lens.len(),
                caches.len()
            )));
        }
        if lens.iter().any(|&n| n == 0 || n > l) || caches.iter().any(|c| c.len != caches[0].len) {
            return Err(EngineError::InvalidRequest(
                "a padded prefill needs rows of 1..=L tokens continuing caches of one length"
                    .into(),
            ));
        }
        let x = self.layers_cached(input_ids, caches, &fwd)?;
        let last: Vec<u32> = lens
            .iter()
            .enumerate()
            .map(|(r, &n)| (r * l + n - 1) as u32)
            .collect();
        let last = Tensor::from_vec(last, b, &self.device)?;
        let (_, _, hidden) = x.dims3()?;
        let x = x.reshape((b * l, hidden))?.index_select(&last, 0)?;
        for (cache, &n) in caches.iter_mut().zip(lens) {
            cache.len += n;
        }
        self.head(&x.unsqueeze(1)?, &fwd)
    }

    /// The layers over `input_ids` (`[B, L]`), row `b` continuing `caches[b]` (which receive the
    /// new keys and values; their lengths are the caller's to advance): the last hidden states.
    fn layers_cached(
        &self,
        input_ids: &Tensor,
        caches: &mut [&mut KvCache],
        fwd: &Forward,
    ) -> Result<Tensor> {
        let l = input_ids.dim(1)?;
        let starts: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let rope = self.rotary.tables(&starts, l, self.dtype, &self.device)?;
        let mut x = self.embed(input_ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &rope, Some(&mut *caches), None, fwd)?;
        }
        Ok(x)
    }
}

impl Model {
    /// Makes room for one more token in every cache and uploads the table of cache addresses
    /// that the CUDA decode kernels read ([`cuda_decode`]). `None` when a cache is too long for
    /// them (the composite path runs instead).
    fn decode_plan(&self, caches: &mut [&mut KvCache]) -> Result<Option<DecodePlan>> {
        let max_len = caches.iter().map(|c| c.len + 1).max().unwrap_or(1);
        if max_len > cuda_decode::MAX_LEN {
            return Ok(None);
        }
        let b = caches.len();
        let table = self.decode_table(caches, b, 0)?;
        let n = table.len();
        Ok(Some(DecodePlan {
            table: Tensor::from_vec(table, n, &self.device)?,
            layers: self.layers.len(),
            batch: b,
            max_len,
        }))
    }

    /// The decode kernels' table ([`cuda_decode::DecodePlan::table`]) for `rows` rows, after
    /// making room for one more token in every cache. Rows past the caches (padding up to a
    /// CUDA graph's batch size) point at `pad`, a cache of capacity 1 written at position 0.
    fn decode_table(&self, caches: &mut [&mut KvCache], rows: usize, pad: u64) -> Result<Vec<i64>> {
        let (kv, hd) = (self.config.num_key_value_heads, self.config.head_dim);
        let (b, layers) = (rows, self.layers.len());
        let mut table = vec![0i64; 2 * layers * b + 2 * b];
        for (row, cache) in caches.iter_mut().enumerate() {
            let len = cache.len;
            cache.reserve(len + 1, kv, hd, self.dtype, &self.device)?;
            let capacity = cache.capacity();
            let base = cuda_decode::device_address(cache.buffer().expect("reserved"))? as usize;
            let size = self.dtype.size_in_bytes();
            for l in 0..layers {
                let (k, v) = cache.layer_offsets(l);
                table[2 * l * b + row] = (base + k * size) as i64;
                table[(2 * l + 1) * b + row] = (base + v * size) as i64;
            }
            table[2 * layers * b + row] = len as i64;
            table[2 * layers * b + b + row] = capacity as i64;
        }
        for row in caches.len()..rows {
            for l in 0..layers {
                table[2 * l * b + row] = pad as i64;
                table[(2 * l + 1) * b + row] = pad as i64;
            }
            table[2 * layers * b + row] = 0;
            table[2 * layers * b + b + row] = 1;
        }
        Ok(table)
    }
}

/// Log-softmax over the last dimension, differentiable.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(logits, D::Minus1)?)
}
