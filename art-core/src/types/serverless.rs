//! The wire format of OpenPipe ART's `ServerlessBackend` (openpipe-art 0.5.23, `art/serverless/`),
//! which `art serve` answers under `/v1/preview/...` so that unmodified Python ART code can train
//! on this backend. Field names and defaults are the Python client's.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{
    AssistantTurns, ImportanceSamplingLevel, KlPenaltySource, LearningRate, LossFn, SftConfig,
    TrainConfig, TrajectoryGroup,
};

/// `POST /v1/preview/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviewModelRequest {
    /// W&B's team or user; the server answers with a default when the client sends none.
    #[serde(default)]
    pub entity: Option<String>,
    pub project: Option<String>,
    /// The model's storage name (ART's `run_name` of a `TrainableModel`).
    pub name: Option<String>,
    pub base_model: String,
    /// Return the model when it is registered already (otherwise that is a 409).
    #[serde(default)]
    pub return_existing: bool,
}

/// A registered model as the client sees it. `id` is what later calls name it by.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviewModel {
    pub id: String,
    pub entity: String,
    pub project: String,
    pub name: String,
    pub base_model: String,
    /// A W&B run; there is none here.
    pub run_id: Option<String>,
}

/// One checkpoint in `GET /v1/preview/models/{id}/checkpoints`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviewCheckpoint {
    pub id: String,
    pub step: u64,
    pub metrics: std::collections::BTreeMap<String, f64>,
}

/// A page of a list, as OpenAI's `AsyncCursorPage` reads it: the next page starts `after` the
/// last item's id while `has_more`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CursorPage<T> {
    pub data: Vec<T>,
    pub has_more: bool,
}

impl<T: Clone> CursorPage<T> {
    /// The first `limit` of `rest` (the items after the cursor).
    pub fn of(rest: &[T], limit: usize) -> Self {
        CursorPage {
            data: rest.iter().take(limit).cloned().collect(),
            has_more: rest.len() > limit,
        }
    }
}

/// `DELETE /v1/preview/models/{id}/checkpoints`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeleteStepsRequest {
    pub steps: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeleteStepsResponse {
    pub deleted_count: usize,
    pub not_found_steps: Vec<u64>,
}

/// `POST /v1/preview/training-jobs`: one training step, run as a job whose events are polled.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingJobRequest {
    pub model_id: String,
    pub trajectory_groups: Vec<TrajectoryGroup>,
    #[serde(default)]
    pub experimental_config: Option<ExperimentalConfig>,
}

/// `POST /v1/preview/sft-training-jobs`: supervised fine-tuning on a JSONL file of
/// conversations (one `{"messages": [...], "tools": [...]}` per line, as ART writes it), run as
/// a job whose events are polled at `/v1/preview/training-jobs/{id}/events`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SftTrainingJobRequest {
    pub model_id: String,
    /// `file:///abs/path.jsonl` (a file on the server's machine) or `http(s)://...`. W&B's
    /// `wandb-artifact://` URLs, which ART uploads to, cannot be read by this server.
    pub training_data_url: String,
    #[serde(default)]
    pub config: Option<SftTrainingConfig>,
}

/// ART's `SFTTrainingConfig`; null fields take [`SftConfig`]'s defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SftTrainingConfig {
    pub batch_size: Option<usize>,
    pub learning_rate: Option<LearningRate>,
    pub assistant_turns: Option<AssistantTurns>,
    /// Where W&B would log the metrics; accepted and left to the client (the job's
    /// `gradient_step` events carry them).
    pub metric_logging: Option<Value>,
}

impl SftTrainingConfig {
    pub fn sft_config(&self) -> SftConfig {
        let default = SftConfig::default();
        SftConfig {
            batch_size: self.batch_size.unwrap_or(default.batch_size),
            learning_rate: self.learning_rate.clone().unwrap_or(default.learning_rate),
            assistant_turns: self.assistant_turns.unwrap_or(default.assistant_turns),
            ..default
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingJob {
    pub id: String,
}

/// What happened in a training job, in order: `training_started` (`num_sequences`: the gradient
/// steps the job takes), `gradient_step` (the step's metrics, all numbers), then
/// `training_ended`, or `training_failed` (`error_message`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingJobEvent {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: JobEventKind,
    pub data: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobEventKind {
    TrainingStarted,
    GradientStep,
    TrainingEnded,
    TrainingFailed,
}

impl JobEventKind {
    /// Whether the job is over after this event.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobEventKind::TrainingEnded | JobEventKind::TrainingFailed
        )
    }
}

/// ART's loss settings as `ServerlessBackend.train` sends them (every field, null when unset).
/// [`ExperimentalConfig::train_config`] maps them onto a [`TrainConfig`]; a setting this server
/// does not implement is refused when it asks for anything but ART's default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExperimentalConfig {
    pub learning_rate: Option<f64>,
    pub loss_fn: Option<LossFn>,
    /// The older spelling of `loss_fn: "ppo"`.
    pub ppo: Option<bool>,
    pub epsilon: Option<f64>,
    pub epsilon_high: Option<f64>,
    pub importance_sampling_level: Option<ImportanceSamplingLevel>,
    pub scale_rewards: Option<bool>,
    /// The older spelling of `scale_rewards`.
    pub normalize_advantages: Option<bool>,
    pub allow_training_without_logprobs: Option<bool>,
    pub packed_sequence_length: Option<usize>,
    pub logprob_calculation_chunk_size: Option<usize>,
    pub kl_penalty_coef: Option<f64>,
    pub kl_penalty_source: Option<String>,
    pub kl_penalty_reference_step: Option<u64>,
    pub kl_penalty_step_lag: Option<u64>,
    pub kl_ref_adapter_path: Option<String>,
    pub advantage_balance: Option<f64>,
    pub mask_prob_ratio: Option<bool>,
    pub max_negative_advantage_importance_sampling_weight: Option<f64>,
    pub kimi_k2_tau: Option<f64>,
    pub num_trajectories_learning_rate_multiplier_power: Option<f64>,
    pub plot_tensors: Option<bool>,
    pub precalculate_logprobs: Option<bool>,
    pub scale_learning_rate_by_reward_std_dev: Option<bool>,
    pub truncated_importance_sampling: Option<f64>,
    /// Fields of newer clients: refused unless null.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// An `experimental_config` field set to something this server does not do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("experimental_config.{field} = {value}: {reason}")]
pub struct UnsupportedSetting {
    pub field: String,
    pub value: String,
    pub reason: String,
}

impl ExperimentalConfig {
    /// The training settings these fields ask for, starting from `base` (the server's defaults
    /// for everything ART does not set), for a model now at `step` (a KL reference given as a
    /// lag is a step before it). Null means ART's default.
    pub fn train_config(
        &self,
        base: &TrainConfig,
        step: u64,
    ) -> Result<TrainConfig, UnsupportedSetting> {
        let refuse = |field: &str, value: &dyn std::fmt::Display, reason: &str| {
            Err(UnsupportedSetting {
                field: field.to_string(),
                value: value.to_string(),
                reason: reason.to_string(),
            })
        };
        let not_yet = "not supported by this server yet; leave it at ART's default";
        // Settings without an implementation here, accepted at ART's default only.
        let zero = |x: Option<f64>| x.is_none_or(|x| x == 0.0);
        let off = |x: Option<bool>| x.is_none_or(|x| !x);
        for (field, default) in [
            (
                "num_trajectories_learning_rate_multiplier_power",
                zero(self.num_trajectories_learning_rate_multiplier_power),
            ),
            ("plot_tensors", off(self.plot_tensors)),
            (
                "scale_learning_rate_by_reward_std_dev",
                off(self.scale_learning_rate_by_reward_std_dev),
            ),
        ] {
            if !default {
                let value = serde_json::to_value(self).expect("config serializes")[field].clone();
                return refuse(field, &value, not_yet);
            }
        }
        if let Some(path) = &self.kl_ref_adapter_path {
            return refuse(
                "kl_ref_adapter_path",
                path,
                "name the reference by its step (kl_penalty_reference_step) instead: this \
                 server keeps every checkpoint of the model",
            );
        }
        if let Some((field, value)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            return refuse(field, value, "unknown to this server");
        }

        let mut config = base.clone();
        let loss_fn = match (self.loss_fn, self.ppo) {
            (Some(loss_fn), Some(ppo)) if ppo != (loss_fn == LossFn::Ppo) => {
                return refuse(
                    "ppo",
                    &ppo,
                    "contradicts loss_fn; set one of them (loss_fn is the current name)",
                );
            }
            (Some(loss_fn), _) => loss_fn,
            (None, Some(true)) => LossFn::Ppo,
            // ART's default since 0.5.
            (None, _) => LossFn::Cispo,
        };
        config.loss_fn = loss_fn;
        // ART's epsilons: PPO's trust region is 0.2 wide on both sides, CISPO's weights are
        // clipped to [0, 5].
        let (epsilon, epsilon_high) = match loss_fn {
            LossFn::Ppo => (0.2, None),
            LossFn::Cispo => (1.0, Some(4.0)),
        };
        config.epsilon = self.epsilon.unwrap_or(epsilon);
        // As ART's loss reads them: PPO's upper clip defaults to `epsilon`, CISPO's to 4.0.
        config.epsilon_high = self.epsilon_high.or(epsilon_high);
        if let Some(rate) = self.learning_rate {
            config.learning_rate = rate;
        }
        if let Some(level) = self.importance_sampling_level {
            config.importance_sampling_level = level;
        }
        config.scale_rewards = match (self.scale_rewards, self.normalize_advantages) {
            (Some(a), Some(b)) if a != b => {
                return refuse(
                    "normalize_advantages",
                    &b,
                    "contradicts scale_rewards; they are two names of one setting",
                );
            }
            (Some(scale), _) | (None, Some(scale)) => scale,
            (None, None) => true,
        };
        if let Some(allow) = self.allow_training_without_logprobs {
            config.allow_training_without_logprobs = allow;
        }
        if let Some(balance) = self.advantage_balance {
            config.advantage_balance = balance;
        }
        if let Some(coef) = self.kl_penalty_coef {
            config.kl_penalty_coef = coef;
        }
        config.kl_penalty_source = match self.kl_penalty_source.as_deref() {
            None | Some("current_learner") => KlPenaltySource::CurrentLearner,
            Some("sample") => KlPenaltySource::Sample,
            Some(other) => {
                return refuse(
                    "kl_penalty_source",
                    &other,
                    "is `current_learner` or `sample`",
                )
            }
        };
        config.kl_penalty_reference_step =
            match (self.kl_penalty_reference_step, self.kl_penalty_step_lag) {
                (Some(_), Some(lag)) => {
                    return refuse(
                        "kl_penalty_step_lag",
                        &lag,
                        "set only one of kl_penalty_reference_step and kl_penalty_step_lag",
                    )
                }
                (Some(step), None) => Some(step),
                // ART: a moving reference, `lag` steps behind (the base model before that).
                (None, Some(lag)) => Some(step.saturating_sub(lag)),
                (None, None) => None,
            };
        if let Some(mask) = self.mask_prob_ratio {
            config.mask_prob_ratio = mask;
        }
        config.max_negative_advantage_importance_sampling_weight =
            self.max_negative_advantage_importance_sampling_weight;
        config.kimi_k2_tau = self.kimi_k2_tau;
        if let Some(precalculate) = self.precalculate_logprobs {
            config.precalculate_logprobs = precalculate;
        }
        config.truncated_importance_sampling = self.truncated_importance_sampling;
        // ART packs sequences into rows of this many tokens and runs one row per forward pass:
        // the same here.
        if let Some(tokens) = self.packed_sequence_length {
            config.pack_sequences = Some(true);
            config.packed_sequence_length = Some(tokens);
            config.micro_batch_tokens = tokens;
        }
        // `logprob_calculation_chunk_size` bounds the memory of ART's logprob computation and
        // changes no number; the fused head here never holds whole-vocabulary logits anyway.
        Ok(config)
    }
}
