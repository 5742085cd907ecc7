//! What a training step reports, and the training API's wire format (`/v1/art/models/{name}/...`).
//! Shared by the trainer, the server and the client, so these types build without the engine.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::MetricGoal;
use super::{LoraConfig, SftConfig, TrainConfig, Trajectory, TrajectoryGroup};

/// Progress of a step, reported after each micro-batch (for streaming as NDJSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainProgress {
    /// The step being computed (the trainer's step + 1).
    pub step: u64,
    /// Micro-batches done so far, and in all.
    pub micro_batch: usize,
    pub micro_batches: usize,
    /// Trainable tokens done so far, and in all.
    pub trainable_tokens: usize,
    pub total_trainable_tokens: usize,
    /// The step's loss accumulated so far (the full loss once all micro-batches are done).
    pub loss: f64,
    pub elapsed_s: f64,
}

/// What one step measured. Field names follow ART's metrics where it has them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepMetrics {
    /// `policy_loss + beta * kl`.
    pub loss: f64,
    pub policy_loss: f64,
    /// k3 estimate of KL(policy || reference), only computed when `beta > 0`.
    pub kl: Option<f64>,
    /// With ART's KL penalty: the mean `source - reference` logprob of the trained tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_policy_ref: Option<f64>,
    /// Mean entropy of the policy over trainable positions.
    pub entropy: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub learning_rate: f64,
    /// Mean and std of all trajectories' rewards (skipped groups included).
    pub reward: f64,
    pub reward_std: f64,
    pub num_trajectories: usize,
    /// Sequences trained on (trajectories and additional histories of the groups used).
    pub num_sequences: usize,
    pub num_trainable_tokens: usize,
    /// All tokens of the sequences trained on (prompts included, padding not).
    pub num_tokens: usize,
    pub num_micro_batches: usize,
    /// Forward + backward + optimizer throughput over all tokens.
    pub tokens_per_second: f64,
    pub num_groups_trained: usize,
    /// Groups whose rewards were all equal: they contribute nothing.
    pub num_groups_skipped: usize,
    /// Fraction of trainable tokens whose importance ratio was clipped.
    pub clip_fraction: f64,
    /// Pearson correlation and mean absolute difference between the sampler's and the trainer's
    /// logprobs of the sampled tokens (before the update); `None` without sampler logprobs.
    pub logprob_corr: Option<f64>,
    pub logprob_abs_diff: Option<f64>,
    pub duration_s: f64,
}

impl StepMetrics {
    /// The metrics as `name -> number` (absent values left out), e.g. for a history file.
    pub fn to_map(&self) -> std::collections::BTreeMap<String, f64> {
        let value = serde_json::to_value(self).expect("metrics serialize");
        value
            .as_object()
            .expect("metrics are an object")
            .iter()
            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect()
    }
}

impl StepMetrics {
    /// What a training step appends to the model's history.jsonl (split `train`, at the new
    /// step): [`StepMetrics::to_map`] without `reward`, `reward_std` and `num_trajectories`, which
    /// describe the batch trained on and were recorded by `model.log` when it was rolled out (the
    /// history's `train/reward` stays the rollouts' reward, not counted twice).
    pub fn history_metrics(&self) -> std::collections::BTreeMap<String, f64> {
        let mut map = self.to_map();
        for batch_metric in ["reward", "reward_std", "num_trajectories"] {
            map.remove(batch_metric);
        }
        map
    }
}

/// The outcome of [`Trainer::train`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    /// The step the model is at now (one more than before the call).
    pub step: u64,
    /// False when no group had differing rewards: the step advanced, the weights did not change.
    pub trained: bool,
    pub metrics: StepMetrics,
    /// Where the step's checkpoint was written.
    pub checkpoint: PathBuf,
    /// The adapter name the engine serves this step under (`name@step`).
    pub adapter_name: String,
}

/// `POST /v1/art/models/{name}/train`: one GRPO step over these groups.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainRequest {
    pub trajectory_groups: Vec<TrajectoryGroup>,
    #[serde(default)]
    pub config: TrainConfig,
}

/// One line of the train endpoint's NDJSON answer: progress lines, then one `result` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TrainEvent {
    Progress(TrainProgress),
    /// Boxed: a result is much larger than the progress lines that come before it.
    Result(Box<StepResult>),
    /// The step failed; nothing was changed (the model stays at its previous step).
    Error {
        message: String,
    },
}

/// `POST /v1/art/models/{name}/train_sft`: supervised fine-tuning on these conversations (see
/// [`SftConfig`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SftRequest {
    pub trajectories: Vec<Trajectory>,
    #[serde(default)]
    pub config: SftConfig,
}

/// One optimizer step of supervised fine-tuning: a batch of trajectories.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SftBatchMetrics {
    /// The step being computed (the trainer's step + 1): all batches of a call make one step.
    pub step: u64,
    /// This batch (from 1) and the call's number of batches.
    pub batch: usize,
    pub batches: usize,
    /// Mean cross-entropy of the batch's trained tokens (nats per token), before the update.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub num_trajectories: usize,
    pub num_trainable_tokens: usize,
    pub num_tokens: usize,
    pub duration_s: f64,
}

/// The outcome of supervised fine-tuning: one new checkpoint after all batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SftResult {
    pub step: u64,
    /// Over all batches: `loss` is the token-weighted mean cross-entropy, `grad_norm` the mean
    /// of the batches', `learning_rate` the last batch's. What the checkpoint and the history
    /// (split `sft`) record.
    pub metrics: StepMetrics,
    pub batches: Vec<SftBatchMetrics>,
    pub checkpoint: PathBuf,
    pub adapter_name: String,
}

/// One line of the `train_sft` endpoint's NDJSON answer: `started` once the data is accepted,
/// a `batch` line per optimizer step, then one `result` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SftEvent {
    Started {
        step: u64,
        batches: usize,
        num_trajectories: usize,
        num_trainable_tokens: usize,
    },
    Batch(SftBatchMetrics),
    Result(Box<SftResult>),
    /// Training failed; the model stays at its previous step (batches already taken are lost
    /// with the process's copy of the adapter, not written).
    Error {
        message: String,
    },
}

/// A checkpoint the backend keeps for a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub step: u64,
    /// The model id that serves it (`name@step`), while the backend keeps it loaded.
    pub served_as: Option<String>,
    /// What the step measured, when its checkpoint recorded it.
    pub metrics: Option<StepMetrics>,
}

/// `GET /v1/art/models/{name}/checkpoints`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointList {
    pub data: Vec<CheckpointInfo>,
}

/// `POST /v1/art/models/{name}/checkpoints/delete`: delete every checkpoint except these steps
/// (the latest is always kept, it is what the model resumes from) and, when `best_metric` is
/// set, the best step by that metric in the model's history.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DeleteCheckpointsRequest {
    #[serde(default)]
    pub keep: Vec<u64>,
    /// A history metric, ART-style: `"val/reward"`, or `"reward"` (the `val` split's, else
    /// `train`'s). Among the steps that have a checkpoint, the best one is kept. A metric the
    /// history never recorded is a 400 and deletes nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_metric: Option<String>,
    /// Whether higher (default) or lower values of `best_metric` are better.
    #[serde(default)]
    pub goal: MetricGoal,
}

/// What a delete removed and what is left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeleteCheckpointsResponse {
    pub deleted: Vec<u64>,
    pub kept: Vec<u64>,
    /// The step kept as the best by `best_metric` (none asked, or no checkpointed step has it).
    #[serde(default)]
    pub best_step: Option<u64>,
}

/// `POST /v1/art/models`: what a client registers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub name: String,
    pub project: String,
    /// The base model the client expects; must be the one the server serves (or left out).
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub lora: LoraConfig,
}

/// The server's view of a registered model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub project: String,
    pub base_model: String,
    /// Optimizer steps taken so far (0 = untrained: requests get the base model).
    pub step: u64,
    pub lora: LoraConfig,
}
