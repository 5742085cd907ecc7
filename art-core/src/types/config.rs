//! Training configuration: ART's knobs, with ART's defaults unless noted.

use serde::{Deserialize, Serialize};

/// How importance ratios between the trainer's and the sampler's probabilities are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// One ratio per token (PPO/GRPO).
    #[default]
    Token,
    /// One ratio per sequence: the geometric mean of its token ratios (GSPO).
    Sequence,
    /// The arithmetic mean of the token's ratio and its sequence's (ART's `average`).
    Average,
    /// The geometric mean of the token's ratio and its sequence's (ART's `geometric_average`).
    GeometricAverage,
}

/// The policy-gradient objective (ART's `loss_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossFn {
    /// PPO's clipped surrogate `-min(r A, clip(r) A)`: a token whose ratio left the trust region
    /// in the direction its advantage pushes gives no gradient.
    #[default]
    Ppo,
    /// CISPO: `-sg(clip(r)) A log p`. The clipped ratio only weighs the token's log-probability,
    /// so every token keeps a gradient. ART's epsilons for it are wider (1.0 and 4.0).
    Cispo,
}

/// Whose logprobs ART's KL penalty compares with the reference's (`kl_penalty_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KlPenaltySource {
    /// The policy being trained, as it is at the start of the step.
    #[default]
    CurrentLearner,
    /// The sampler's (the logprobs the rollouts came with).
    Sample,
}

/// The LoRA adapter trained on top of the frozen base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoraConfig {
    pub rank: usize,
    /// Scale of the update is `alpha / rank`.
    pub alpha: f64,
    pub dropout: f64,
    /// Linear layers that get an adapter, by their PEFT names.
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

/// One GRPO step's settings. Every field has a default, so
/// `TrainConfig { learning_rate: 1e-5, ..Default::default() }` is the usual way to write one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// AdamW learning rate. ART's default 5e-6 suits large models; tiny models learn faster with more.
    pub learning_rate: f64,
    /// PPO clipping (our default) or CISPO (ART's default since 0.5).
    pub loss_fn: LossFn,
    /// Weight of the k3 KL penalty to the reference policy (0 = none).
    pub beta: f64,
    /// ART's KL-penalised advantages: each token's advantage gains
    /// `kl_penalty_coef * (mean_kl - kl)`, with `kl` its `source - reference` logprob (0 = off).
    pub kl_penalty_coef: f64,
    pub kl_penalty_source: KlPenaltySource,
    /// The reference policy of both KL terms: this step's checkpoint of the model being trained;
    /// `None` (or 0) for the base model.
    pub kl_penalty_reference_step: Option<u64>,
    /// ART's: in [-1, 1]; above 0 negative advantages are scaled by `1 - balance`, below 0
    /// positive ones by `1 + balance`.
    pub advantage_balance: f64,
    /// Take the ratio against the trainer's own logprobs at the start of the step instead of the
    /// sampler's (which then only serve truncated importance sampling).
    pub precalculate_logprobs: bool,
    /// Truncated importance sampling: weigh each token by `min(trainer / sampler probability,
    /// cap)` at the start of the step, for rollouts sampled off-policy. Needs
    /// `precalculate_logprobs`.
    pub truncated_importance_sampling: Option<f64>,
    /// With PPO, a ratio outside the clip range gives nothing (its ratio taken as 0); with CISPO
    /// its weight becomes `1 - epsilon`.
    pub mask_prob_ratio: bool,
    /// A cap on every importance ratio (ART's name, which applies it whatever the advantage's
    /// sign): a larger ratio becomes this constant.
    pub max_negative_advantage_importance_sampling_weight: Option<f64>,
    /// Kimi K2's tau: each token's advantage loses `tau * (log p - log p_old)`.
    pub kimi_k2_tau: Option<f64>,
    /// Lower clip of the importance ratio: ratios below `1 - epsilon` stop giving gradient.
    pub epsilon: f64,
    /// Upper clip (`1 + epsilon_high`); `None` means the same as `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Divide advantages by the group's reward std (GRPO); when false only the mean is removed (Dr. GRPO).
    pub scale_rewards: bool,
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Clip the global gradient norm to this value; `None` disables clipping.
    pub max_grad_norm: Option<f64>,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Normalise each sequence's loss by its own number of trainable tokens (true), or every token
    /// by the batch's total (false, "token-level" as in DAPO).
    pub normalize_by_sequence_length: bool,
    /// Upper bound on the tokens in one forward/backward micro-batch, padding included; larger
    /// steps accumulate gradients over several.
    pub micro_batch_tokens: usize,
    /// Pack several sequences into one row of a forward pass, one after another, each attending
    /// only to itself and counting its positions from 0, so that sequences of uneven lengths
    /// compute little padding (ART always packs). Off: one right-padded row per sequence. The
    /// numbers are the same either way, up to rounding. `None`: on the CPU, off on GPUs, where a
    /// packed row's attention (every query against the whole row, masked) cost more than the
    /// padding it saves (0.60x / 0.74x the tokens/s of one row each for 0.5B / 1.5B shapes and
    /// lengths of 64-1024 on an H100).
    pub pack_sequences: Option<bool>,
    /// The positions of a packed row (ART's name). `None`: those of the step's longest
    /// sequence (or shared-prefix block). A longer one gets a row of its own.
    pub packed_sequence_length: Option<usize>,
    /// Compute the prompt the rollouts of a group share once for all of them: the group's
    /// sequences run as one block, their common prefix followed by each one's continuation,
    /// which attends to the prefix and to itself. The numbers are the same as without, up to
    /// rounding; a group of rollouts with short answers trains several times faster.
    pub share_prefixes: bool,
    pub lora: LoraConfig,
    /// Train on choices that came without logprobs (the ratio is then taken as 1).
    pub allow_training_without_logprobs: bool,
    /// `Some(true)`: recompute each layer's activations during the backward pass instead of
    /// keeping them (a micro-batch then holds one layer's activations at a time, for a second
    /// forward pass of every layer). `Some(false)`: keep every activation (candle's graph of
    /// the whole forward). `None`: keep the activations of as many layers as a quarter of the
    /// device's available memory holds and recompute only the others (all kept for small
    /// models; the step's profile, `ART_PROFILE_TRAIN=1`, says how many). Not with LoRA dropout
    /// (the recomputed pass would draw other masks): the whole graph then.
    pub gradient_checkpointing: Option<bool>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            learning_rate: 5e-6,
            loss_fn: LossFn::Ppo,
            beta: 0.0,
            kl_penalty_coef: 0.0,
            kl_penalty_source: KlPenaltySource::CurrentLearner,
            kl_penalty_reference_step: None,
            advantage_balance: 0.0,
            precalculate_logprobs: false,
            truncated_importance_sampling: None,
            mask_prob_ratio: false,
            max_negative_advantage_importance_sampling_weight: None,
            kimi_k2_tau: None,
            epsilon: 0.2,
            epsilon_high: None,
            scale_rewards: true,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            max_grad_norm: Some(1.0),
            weight_decay: 0.0,
            normalize_by_sequence_length: false,
            micro_batch_tokens: 4096,
            pack_sequences: None,
            packed_sequence_length: None,
            share_prefixes: true,
            lora: LoraConfig::default(),
            allow_training_without_logprobs: false,
            gradient_checkpointing: None,
        }
    }
}

/// A setting outside its allowed range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid training config: {field} = {value} ({expected})")]
pub struct InvalidConfig {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl TrainConfig {
    /// The upper clip actually used.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// Checks every setting, so that a bad value fails before any work is done.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        fn check(
            ok: bool,
            field: &'static str,
            value: impl ToString,
            expected: &'static str,
        ) -> Result<(), InvalidConfig> {
            if ok {
                Ok(())
            } else {
                Err(InvalidConfig {
                    field,
                    value: value.to_string(),
                    expected,
                })
            }
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        check(
            positive(self.learning_rate),
            "learning_rate",
            self.learning_rate,
            "a finite number > 0",
        )?;
        check(
            non_negative(self.beta),
            "beta",
            self.beta,
            "a finite number >= 0",
        )?;
        check(
            non_negative(self.kl_penalty_coef),
            "kl_penalty_coef",
            self.kl_penalty_coef,
            "a finite number >= 0",
        )?;
        check(
            (-1.0..=1.0).contains(&self.advantage_balance),
            "advantage_balance",
            self.advantage_balance,
            "in [-1, 1]",
        )?;
        for (field, value) in [
            (
                "truncated_importance_sampling",
                self.truncated_importance_sampling,
            ),
            (
                "max_negative_advantage_importance_sampling_weight",
                self.max_negative_advantage_importance_sampling_weight,
            ),
        ] {
            if let Some(x) = value {
                check(positive(x), field, x, "a finite number > 0, or null")?;
            }
        }
        check(
            self.truncated_importance_sampling.is_none() || self.precalculate_logprobs,
            "truncated_importance_sampling",
            self.truncated_importance_sampling.unwrap_or_default(),
            "set with precalculate_logprobs (it weighs the trainer's start-of-step logprobs \
             against the sampler's)",
        )?;
        if let Some(tau) = self.kimi_k2_tau {
            check(
                tau.is_finite(),
                "kimi_k2_tau",
                tau,
                "a finite number, or null",
            )?;
        }
        check(
            non_negative(self.epsilon),
            "epsilon",
            self.epsilon,
            "a finite number >= 0",
        )?;
        check(
            non_negative(self.epsilon_high()),
            "epsilon_high",
            self.epsilon_high(),
            "a finite number >= 0",
        )?;
        if let Some(norm) = self.max_grad_norm {
            check(
                positive(norm),
                "max_grad_norm",
                norm,
                "a finite number > 0, or null",
            )?;
        }
        check(
            non_negative(self.weight_decay),
            "weight_decay",
            self.weight_decay,
            "a finite number >= 0",
        )?;
        check(
            self.micro_batch_tokens > 0,
            "micro_batch_tokens",
            self.micro_batch_tokens,
            "at least 1",
        )?;
        if let Some(width) = self.packed_sequence_length {
            check(
                width > 0,
                "packed_sequence_length",
                width,
                "at least 1, or null",
            )?;
        }
        check(
            self.lora.rank > 0,
            "lora.rank",
            self.lora.rank,
            "at least 1",
        )?;
        check(
            positive(self.lora.alpha),
            "lora.alpha",
            self.lora.alpha,
            "a finite number > 0",
        )?;
        check(
            (0.0..1.0).contains(&self.lora.dropout),
            "lora.dropout",
            self.lora.dropout,
            "in [0, 1)",
        )?;
        check(
            !self.lora.target_modules.is_empty(),
            "lora.target_modules",
            "[]",
            "at least one module",
        )?;
        Ok(())
    }
}

/// Which assistant turns of a conversation supervised fine-tuning learns (ART's
/// `assistant_turns`); everything else is context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AssistantTurns {
    #[default]
    All,
    /// Only the final assistant turn; earlier ones are context.
    Last,
}

/// The learning rate of supervised fine-tuning: one for every batch, or one per batch in order
/// (a schedule, as ART's `learning_rate: list[float]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LearningRate {
    Constant(f64),
    PerBatch(Vec<f64>),
}

impl LearningRate {
    /// The rate of batch `index` (a schedule too short is refused by [`SftConfig::validate`]).
    pub fn of_batch(&self, index: usize) -> f64 {
        match self {
            LearningRate::Constant(lr) => *lr,
            LearningRate::PerBatch(lrs) => lrs[index],
        }
    }
}

/// Supervised fine-tuning of the model's LoRA adapter on conversations (ART's `train_sft`):
/// the trajectories are cut into batches of `batch_size`, each batch is one optimizer step on
/// the mean cross-entropy of its assistant tokens, and the whole call ends in one checkpoint
/// (`name@step+1`), served at once as a GRPO step's is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SftConfig {
    /// ART's default 5e-5 suits large models; tiny ones learn faster with more.
    pub learning_rate: LearningRate,
    /// Trajectories per optimizer step (ART's default for its serverless and local backends: 2).
    pub batch_size: usize,
    pub assistant_turns: AssistantTurns,
    /// Clip the global gradient norm of each batch (ART: 1.0); `None` disables clipping.
    pub max_grad_norm: Option<f64>,
    pub weight_decay: f64,
    /// As in [`TrainConfig`]: the most tokens of one forward/backward.
    pub micro_batch_tokens: usize,
    /// As in [`TrainConfig`].
    pub gradient_checkpointing: Option<bool>,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            learning_rate: LearningRate::Constant(5e-5),
            batch_size: 2,
            assistant_turns: AssistantTurns::All,
            max_grad_norm: Some(1.0),
            weight_decay: 0.0,
            micro_batch_tokens: TrainConfig::default().micro_batch_tokens,
            gradient_checkpointing: None,
        }
    }
}

impl SftConfig {
    /// How many optimizer steps `trajectories` trajectories make.
    pub fn num_batches(&self, trajectories: usize) -> usize {
        trajectories.div_ceil(self.batch_size.max(1))
    }

    /// Checks every setting against a run over `trajectories` trajectories, before any work.
    pub fn validate(&self, trajectories: usize) -> Result<(), InvalidConfig> {
        let invalid = |field, value: String, expected| {
            Err(InvalidConfig {
                field,
                value,
                expected,
            })
        };
        let rates = match &self.learning_rate {
            LearningRate::Constant(lr) => vec![*lr],
            LearningRate::PerBatch(lrs) => lrs.clone(),
        };
        if let Some(bad) = rates.iter().find(|lr| !(lr.is_finite() && **lr >= 0.0)) {
            return invalid("learning_rate", bad.to_string(), "finite numbers >= 0");
        }
        if self.batch_size == 0 {
            return invalid("batch_size", "0".into(), "at least 1");
        }
        let batches = self.num_batches(trajectories);
        if let LearningRate::PerBatch(lrs) = &self.learning_rate {
            if lrs.len() < batches {
                return invalid(
                    "learning_rate",
                    format!("a list of {}", lrs.len()),
                    "one rate per batch (ceil(trajectories / batch_size)), or one number",
                );
            }
        }
        if let Some(norm) = self.max_grad_norm {
            if !(norm.is_finite() && norm > 0.0) {
                return invalid(
                    "max_grad_norm",
                    norm.to_string(),
                    "a finite number > 0, or null",
                );
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return invalid(
                "weight_decay",
                self.weight_decay.to_string(),
                "a finite number >= 0",
            );
        }
        if self.micro_batch_tokens == 0 {
            return invalid("micro_batch_tokens", "0".into(), "at least 1");
        }
        Ok(())
    }
}
