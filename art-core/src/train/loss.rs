//! The GRPO loss of one micro-batch: PPO-style clipped importance ratios (or CISPO's clipped
//! weights) against the sampler's logprobs (per token, per sequence as a geometric mean, or a mix
//! of the two), ART's advantage shaping, an optional k3 KL penalty to a reference policy, and
//! each token weighted so that summing micro-batches gives the step's loss.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, D};

use crate::engine::{ops, Forward, LayerInputs, LoraAdapter, Model, PackedBlock, PackedRows};
use crate::types::{ImportanceSamplingLevel, KlPenaltySource, LossFn, TrainConfig};

use super::batch::{row_positions, RowBlock, TrainSequence};
use super::error::Result;

/// How token losses are averaged over a step (all its micro-batches together).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Normalization {
    /// Every trainable token of the step counts the same: weight `1 / total_tokens`.
    Tokens { total_tokens: usize },
    /// Each sequence's loss is its token mean, and sequences count the same:
    /// weight `1 / (sequence_tokens * sequences)`.
    Sequences { sequences: usize },
}

impl Normalization {
    /// The normalization of a step over `sequences`, as `config` asks for.
    pub fn for_step(sequences: &[TrainSequence], config: &TrainConfig) -> Self {
        if config.normalize_by_sequence_length {
            Normalization::Sequences {
                sequences: sequences.iter().filter(|s| s.num_trainable() > 0).count(),
            }
        } else {
            Normalization::Tokens {
                total_tokens: sequences.iter().map(TrainSequence::num_trainable).sum(),
            }
        }
    }

    fn weight(&self, sequence_tokens: usize) -> f64 {
        match *self {
            Normalization::Tokens { total_tokens } => 1.0 / total_tokens.max(1) as f64,
            Normalization::Sequences { sequences } => {
                1.0 / (sequence_tokens.max(1) * sequences.max(1)) as f64
            }
        }
    }
}

/// The loss of one micro-batch and what was measured on the way.
pub struct MicroBatchLoss {
    /// Scalar: `policy_loss + beta * kl`, this micro-batch's share of the step's loss. Its
    /// gradients with respect to the adapter's variables (when computed with `train`) come from
    /// [`MicroBatchLoss::backward`]: part of the backward is not candle's.
    pub loss: Tensor,
    /// This micro-batch's share of the step's policy loss (weighted sum).
    pub policy_loss: f64,
    /// This micro-batch's share of the step's KL to the reference (weighted sum), if `beta > 0`.
    pub kl: Option<f64>,
    /// With a KL penalty: the mean over this micro-batch's tokens of `source - reference`
    /// logprobs (ART's `kl_policy_ref`).
    pub kl_policy_ref: Option<f64>,
    /// Sum over trainable tokens of the policy's entropy at that position.
    pub entropy_sum: f64,
    /// Trainable tokens whose ratio was clipped.
    pub clipped_tokens: usize,
    /// Per trainable token, in sequence order: the trainer's logprob and the sampler's (NaN
    /// where unknown).
    pub trainer_logprobs: Vec<f32>,
    pub sampler_logprobs: Vec<f32>,
    /// The language-model head, when its backward is ours rather than candle's.
    head: Option<Head>,
    /// With the layers run one by one: where the layers' graph ends (the last layer's output)
    /// and what the layers' backward needs.
    recompute: Option<(Var, LayerInputs)>,
    /// With the layers run one by one: how many kept their activations for the backward.
    pub kept_layers: Option<KeptLayers>,
}

/// How many layers of a micro-batch's forward kept their activations for the backward (the
/// others are recomputed in it), and what one layer's take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeptLayers {
    pub kept: usize,
    pub layers: usize,
    /// Bytes of one layer's activations (0 when none was kept).
    pub layer_bytes: usize,
}

impl MicroBatchLoss {
    pub fn num_tokens(&self) -> usize {
        self.trainer_logprobs.len()
    }

    /// The gradients of [`MicroBatchLoss::loss`]: candle's backward through the loss, the
    /// head's backward, candle's through the graph below it and, with gradient checkpointing,
    /// the layers' backward after that (one layer's graph at a time).
    /// `model` and `adapter` are the ones the loss was computed with.
    pub fn backward(&mut self, model: &Model, adapter: &LoraAdapter) -> Result<GradStore> {
        let mut grads = self.loss.backward()?;
        if let Some(head) = self.head.take() {
            let Some(grad) = grads.remove(head.stats.as_tensor()) else {
                return Ok(grads); // no trainable token
            };
            let grad_logits = ops::target_logprob_entropy_grad(
                &head.logits,
                head.stats.as_tensor(),
                &grad,
                &head.targets,
            )?;
            drop(head.logits);
            let grad_hidden = model.logits_input_grad(&grad_logits)?;
            drop(grad_logits);
            // A scalar whose gradient with respect to `hidden` is `grad_hidden`: candle's
            // backward carries it through the rest of the graph.
            grads = (head.hidden * grad_hidden.detach())?
                .sum_all()?
                .backward()?;
        }
        if let Some((top, inputs)) = self.recompute.take() {
            let Some(grad) = grads.remove(top.as_tensor()) else {
                // The loss does not depend on the layers (no trainable token): nothing to add.
                return Ok(grads);
            };
            model.backward_layers(inputs, grad, adapter, &mut grads)?;
        }
        Ok(grads)
    }
}

/// A block's layout for the model: the shared prefix, then each sequence's own positions.
fn packed_block(block: &RowBlock<'_>) -> PackedBlock {
    PackedBlock {
        prefix: block.prefix,
        continuations: block
            .sequences
            .iter()
            .map(|&s| row_positions(s) - block.prefix)
            .collect(),
    }
}

/// ART's `advantage_balance` in [-1, 1]: above 0 negative advantages shrink by `1 - balance`,
/// below 0 positive ones by `1 + balance`.
fn balanced(advantage: f64, balance: f64) -> f64 {
    if balance > 0.0 && advantage < 0.0 {
        advantage * (1.0 - balance)
    } else if balance < 0.0 && advantage > 0.0 {
        advantage * (1.0 + balance)
    } else {
        advantage
    }
}

/// How a training forward keeps what its backward reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum LayerMemory {
    /// candle's graph over the whole forward, every activation kept.
    WholeGraph,
    /// The layers run without a graph, each one's input kept, and the activations of as many
    /// of the last layers as `keep_bytes` holds; the backward recomputes the others.
    Layered { keep_bytes: usize },
}

/// [`TrainConfig::gradient_checkpointing`] for a training forward on `model`: `Some(true)`
/// recomputes every layer, `Some(false)` keeps candle's whole graph, `None` keeps the
/// activations of as many layers as [`activation_budget`](crate::engine::activation_budget)
/// allows and recomputes the rest, where the hand-written layer backward runs (elsewhere it
/// recomputes every layer on a GPU, where memory runs out first, and keeps the whole graph on
/// the CPU).
fn layer_memory(model: &Model, adapter: Option<&LoraAdapter>, config: &TrainConfig) -> LayerMemory {
    let dropout = adapter.map_or(0.0, |a| a.config().dropout);
    // LoRA dropout would draw other masks in a recomputed pass: the whole graph, always.
    if adapter.is_none() || dropout != 0.0 {
        return LayerMemory::WholeGraph;
    }
    match config.gradient_checkpointing {
        Some(true) => LayerMemory::Layered { keep_bytes: 0 },
        Some(false) => LayerMemory::WholeGraph,
        None if model.has_layer_backward() => LayerMemory::Layered {
            keep_bytes: crate::engine::activation_budget(model.device()),
        },
        None if model.device().is_cpu() => LayerMemory::WholeGraph,
        None => LayerMemory::Layered { keep_bytes: 0 },
    }
}

/// The language-model head's backward, run by [`MicroBatchLoss::backward`] rather than by
/// candle: the loss's graph starts at the head's `[N, 2]` statistics, so that candle's backward
/// never fills, adds and keeps vocabulary-sized gradients (one pass of each over `[N, vocab]` per
/// graph node: a tenth of a GPU step at Qwen's 152k vocabulary).
struct Head {
    /// The head's input, `[N, hidden]`, with its graph.
    hidden: Tensor,
    /// The head's output, without a graph.
    logits: Tensor,
    /// [`ops::target_logprob_entropy`] of the logits: where the loss's graph starts.
    stats: Var,
    targets: Arc<Vec<u32>>,
}

/// Logprobs of `targets` (`[N]`) under the head's logits of `hidden` (`[N, hidden]`),
/// differentiable, plus the (detached) entropy of each row; and, when `hidden` has a graph and
/// the fused kernels run, the head whose backward is left to [`MicroBatchLoss::backward`].
/// `target_ids` are `targets`' values, on the host.
fn target_logprobs(
    model: &Model,
    hidden: &Tensor,
    fwd: Forward,
    targets: &Tensor,
    target_ids: &[u32],
) -> Result<(Tensor, Tensor, Option<Head>)> {
    if ops::supported(hidden) {
        // One fused pass over the vocabulary forward and one backward, instead of a
        // materialized log-softmax and its gradient.
        let logits = model.logits(&hidden.detach(), fwd)?;
        let stats = ops::target_logprob_entropy(&logits, target_ids)?;
        let entropy = stats.narrow(1, 1, 1)?.squeeze(1)?;
        if !hidden.track_op() {
            return Ok((stats.narrow(1, 0, 1)?.squeeze(1)?, entropy, None));
        }
        let stats = Var::from_tensor(&stats)?;
        let logprobs = stats.narrow(1, 0, 1)?.squeeze(1)?;
        let head = Head {
            hidden: hidden.clone(),
            logits,
            stats,
            targets: Arc::new(target_ids.to_vec()),
        };
        return Ok((logprobs, entropy, Some(head)));
    }
    // Composite ops, through candle's backward; half-precision logits in f32.
    let logits = model.logits(hidden, fwd)?;
    let logits = match logits.dtype() {
        DType::F64 | DType::F32 => logits,
        _ => logits.to_dtype(DType::F32)?,
    };
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    let logprobs = picked.broadcast_sub(&lse)?.squeeze(1)?;
    let all = shifted.detach().broadcast_sub(&lse.detach())?;
    let entropy = (all.exp()? * &all)?.sum(D::Minus1)?.neg()?;
    Ok((logprobs, entropy, None))
}

/// The GRPO loss of one micro-batch: `rows[r]` are the blocks laid out one after another in row
/// `r` of one forward (each sequence attending only to its block's shared prefix and itself),
/// every row right-padded to the fullest. With `train`, the graph reaches the adapter's
/// variables; without it, the same numbers are computed without a graph. `adapter: None`
/// computes the base model's loss (its ratio is still taken against the sampler's logprobs).
/// `reference` is the adapter of the KL terms' reference policy (`None`: the base model).
pub fn micro_batch_loss(
    model: &Model,
    adapter: Option<&LoraAdapter>,
    reference: Option<&LoraAdapter>,
    rows: &[Vec<RowBlock<'_>>],
    normalization: Normalization,
    config: &TrainConfig,
    train: bool,
) -> Result<MicroBatchLoss> {
    let device = model.device();
    let packing = PackedRows {
        rows: rows
            .iter()
            .map(|row| row.iter().map(packed_block).collect())
            .collect(),
    };
    // Rows padded to a multiple of 8 positions: cuBLAS falls back to slow unaligned kernels for
    // attention products whose rows are, say, 511 elements long (8% of a step's GPU time).
    let used = |row: &Vec<PackedBlock>| row.iter().map(PackedBlock::len).sum::<usize>();
    let width = packing
        .rows
        .iter()
        .map(used)
        .max()
        .unwrap_or(1)
        .max(1)
        .next_multiple_of(8);
    // A sequence's inputs are tokens[..len - 1]: the position of its token i - 1 predicts token
    // i. In a block, input position p < prefix is the block's shared one.
    let mut input = vec![0u32; rows.len() * width];
    let mut positions = Vec::new();
    let mut targets = Vec::new();
    let mut sampler = Vec::new();
    let mut advantages = Vec::new();
    let mut weights = Vec::new();
    // The sequence (numbered across rows) of each trained token, and each sequence's count.
    let mut seq_of = Vec::new();
    let mut seq_tokens = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let mut start = r * width;
        for block in row {
            let prefix_start = start;
            let prefix = block.prefix;
            input[start..start + prefix].copy_from_slice(&block.sequences[0].tokens[..prefix]);
            start += prefix;
            for seq in &block.sequences {
                let own_start = start;
                let own = row_positions(seq) - prefix;
                let known = (prefix + own).min(seq.len());
                input[own_start..own_start + known - prefix]
                    .copy_from_slice(&seq.tokens[prefix..known]);
                start += own;
                let count = seq.num_trainable();
                let weight = normalization.weight(count);
                for i in 1..seq.len() {
                    if seq.trainable[i] {
                        let p = i - 1;
                        let at = if p < prefix {
                            prefix_start + p
                        } else {
                            own_start + p - prefix
                        };
                        positions.push(at as u32);
                        targets.push(seq.tokens[i]);
                        sampler.push(seq.sampler_logprobs[i]);
                        advantages.push(seq.advantage);
                        weights.push(weight);
                        seq_of.push(seq_tokens.len() as u32);
                    }
                }
                seq_tokens.push(count);
            }
        }
    }
    let num_sequences = seq_tokens.len();
    let packing = packing.is_packed().then_some(&packing);
    let n = positions.len();
    let fwd = Forward {
        adapter,
        train,
        quantized: false,
    };
    let input = Tensor::from_vec(input, (rows.len(), width), device)?;
    let positions = Tensor::from_vec(positions, n, device)?;
    let target_ids = targets;
    let targets = Tensor::from_slice(&target_ids, n, device)?;

    let select = |hidden: Tensor| -> Result<Tensor> {
        let h = hidden.dim(D::Minus1)?;
        Ok(hidden
            .reshape((rows.len() * width, h))?
            .index_select(&positions, 0)?)
    };
    let memory = match train {
        true => layer_memory(model, adapter, config),
        false => LayerMemory::WholeGraph,
    };
    let (hidden, recompute) = match memory {
        LayerMemory::Layered { keep_bytes } => {
            let (top, inputs) =
                model.forward_layers_checkpointed(&input, packing, adapter, keep_bytes)?;
            let hidden = model.final_norm(top.as_tensor())?;
            (hidden, Some((top, inputs)))
        }
        LayerMemory::WholeGraph => (model.forward_hidden(&input, packing, fwd)?, None),
    };
    let kept_layers = recompute.as_ref().map(|(_, inputs)| {
        let (kept, layers) = inputs.kept_layers();
        KeptLayers {
            kept,
            layers,
            layer_bytes: inputs.layer_bytes(),
        }
    });
    let hidden = select(hidden)?;
    let (new_lp, entropy, head) = target_logprobs(model, &hidden, fwd, &targets, &target_ids)?;
    let dtype = new_lp.dtype();
    let vector =
        |v: Vec<f64>| -> Result<Tensor> { Ok(Tensor::from_vec(v, n, device)?.to_dtype(dtype)?) };

    let new_values: Vec<f64> = new_lp.to_dtype(DType::F64)?.to_vec1()?;
    // The reference policy's logprobs (the base model, or `reference`), for the k3 KL term
    // (`beta`) and for ART's KL-penalised advantages (`kl_penalty_coef`).
    let ref_values = if config.beta > 0.0 || config.kl_penalty_coef > 0.0 {
        let fwd = Forward {
            adapter: reference,
            train: false,
            quantized: false,
        };
        let ref_hidden = select(model.forward_hidden(&input, packing, fwd)?)?;
        let (ref_lp, _, _) = target_logprobs(model, &ref_hidden, fwd, &targets, &target_ids)?;
        Some(ref_lp.detach())
    } else {
        None
    };
    // The sampler's logprobs ("original"); where unknown, the trainer's own: a ratio of 1. The
    // ratio is taken against them, or with `precalculate_logprobs` against the trainer's own at
    // the start of the step ("old": a ratio of 1 that still has a gradient).
    let original: Vec<f64> = sampler
        .iter()
        .zip(&new_values)
        .map(|(&s, &own)| if s.is_finite() { f64::from(s) } else { own })
        .collect();
    let old_values = if config.precalculate_logprobs {
        new_values.clone()
    } else {
        original.clone()
    };
    let token_log_ratio = (&new_lp - vector(old_values.clone())?)?;
    // Mean log-ratio of each sequence (the log of the geometric mean of its token ratios),
    // given back to each of its tokens.
    let sequence_log_ratio = || -> Result<Tensor> {
        let mut membership = vec![0f64; num_sequences * n];
        for (j, &q) in seq_of.iter().enumerate() {
            membership[q as usize * n + j] = 1.0 / seq_tokens[q as usize] as f64;
        }
        let membership =
            Tensor::from_vec(membership, (num_sequences, n), device)?.to_dtype(dtype)?;
        let per_seq = membership
            .matmul(&token_log_ratio.unsqueeze(1)?)?
            .squeeze(1)?;
        let seq_of = Tensor::from_vec(seq_of.clone(), n, device)?;
        Ok(per_seq.index_select(&seq_of, 0)?)
    };
    let ratio = match config.importance_sampling_level {
        ImportanceSamplingLevel::Token => token_log_ratio.exp()?,
        ImportanceSamplingLevel::Sequence => sequence_log_ratio()?.exp()?,
        ImportanceSamplingLevel::Average => {
            ((token_log_ratio.exp()? + sequence_log_ratio()?.exp()?)? * 0.5)?
        }
        ImportanceSamplingLevel::GeometricAverage => {
            ((&token_log_ratio + sequence_log_ratio()?)? * 0.5)?.exp()?
        }
    };

    // Per-token advantages, reshaped as ART does: `advantage_balance` scales one sign down,
    // Kimi K2's tau subtracts the token's log-ratio, the KL penalty adds how much less than
    // average the token departs from the reference.
    let mut advantages: Vec<f64> = advantages
        .iter()
        .map(|&a| balanced(a, config.advantage_balance))
        .collect();
    if let Some(tau) = config.kimi_k2_tau {
        for (j, a) in advantages.iter_mut().enumerate() {
            *a -= tau * (new_values[j] - old_values[j]);
        }
    }
    let mut kl_policy_ref = None;
    if config.kl_penalty_coef > 0.0 && n > 0 {
        let reference: Vec<f64> = ref_values
            .as_ref()
            .expect("computed for a KL penalty")
            .to_dtype(DType::F64)?
            .to_vec1()?;
        let source = match config.kl_penalty_source {
            KlPenaltySource::Sample => &old_values,
            KlPenaltySource::CurrentLearner => &new_values,
        };
        let kl: Vec<f64> = source.iter().zip(&reference).map(|(s, r)| s - r).collect();
        let mean = kl.iter().sum::<f64>() / n as f64;
        for (a, kl) in advantages.iter_mut().zip(&kl) {
            *a += config.kl_penalty_coef * (mean - kl);
        }
        kl_policy_ref = Some(mean);
    }

    // Each token's term is `coef * x + constant`, decided on detached values, with `x` the
    // ratio (PPO) or the log-probability (CISPO).
    // PPO, -min(r A, clip(r) A): where the clipped term is the smaller one it is a constant (no
    // gradient), elsewhere it is r A.
    // CISPO, -sg(clip(r)) A log p: the clipped ratio is a constant weight, never a cut-off.
    // Before either, a ratio above `max_negative_advantage_importance_sampling_weight` becomes
    // that constant, and with `mask_prob_ratio` one outside the clip range becomes 0 (ART's
    // order); after, truncated importance sampling weighs the token by min(old / original, cap).
    let ratio_values: Vec<f64> = ratio.to_dtype(DType::F64)?.to_vec1()?;
    let (low, high) = (1.0 - config.epsilon, 1.0 + config.epsilon_high());
    let mut coef = Vec::with_capacity(n);
    let mut constant = Vec::with_capacity(n);
    let mut clipped_tokens = 0;
    for (j, (&ratio, &a)) in ratio_values.iter().zip(&advantages).enumerate() {
        let mut r = ratio;
        let mut fixed = false;
        if let Some(cap) = config.max_negative_advantage_importance_sampling_weight {
            if r > cap {
                (r, fixed) = (cap, true);
            }
        }
        if config.mask_prob_ratio && !(r > low && r < high) {
            (r, fixed) = (0.0, true);
        }
        let truncation = config
            .truncated_importance_sampling
            .map_or(1.0, |cap| (old_values[j] - original[j]).exp().min(cap));
        let (c, k, clipped) = match config.loss_fn {
            LossFn::Ppo if fixed => (0.0, -(r * a).min(r.clamp(low, high) * a), true),
            LossFn::Ppo if a > 0.0 && r > high => (0.0, -a * high, true),
            LossFn::Ppo if a < 0.0 && r < low => (0.0, -a * low, true),
            LossFn::Ppo => (-a, 0.0, false),
            LossFn::Cispo => (-a * r.clamp(low, high), 0.0, fixed || r < low || r > high),
        };
        clipped_tokens += usize::from(clipped);
        coef.push(c * truncation);
        constant.push(k * truncation);
    }
    let weights = vector(weights)?;
    let x = match config.loss_fn {
        LossFn::Ppo => &ratio,
        LossFn::Cispo => &new_lp,
    };
    let token_pg = ((x * vector(coef)?)? + vector(constant)?)?;
    let policy = (token_pg * &weights)?.sum_all()?;
    let policy_loss = policy.to_dtype(DType::F64)?.to_scalar::<f64>()?;

    let (loss, kl) = match ref_values.as_ref().filter(|_| config.beta > 0.0) {
        Some(ref_lp) => {
            // k3 estimator of KL(policy || reference): exp(ref - new) - (ref - new) - 1.
            let d = (ref_lp - &new_lp)?;
            let kl_tok = ((d.exp()? - &d)? - 1.0)?;
            let kl = (kl_tok * &weights)?.sum_all()?;
            let kl_value = kl.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            ((policy + (kl * config.beta)?)?, Some(kl_value))
        }
        None => (policy, None),
    };

    let entropy_sum = entropy
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    // Read from the device once, above.
    let trainer_logprobs: Vec<f32> = new_values.iter().map(|&x| x as f32).collect();
    Ok(MicroBatchLoss {
        loss,
        policy_loss,
        kl,
        kl_policy_ref,
        entropy_sum,
        clipped_tokens,
        trainer_logprobs,
        sampler_logprobs: sampler,
        head,
        recompute,
        kept_layers,
    })
}
