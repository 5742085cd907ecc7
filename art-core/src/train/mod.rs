//! GRPO training with LoRA (feature `train`).
//!
//! A [`Trainer`] owns one model's LoRA adapter and AdamW state on an [`Engine`](crate::engine::Engine).
//! Each [`Trainer::train`] call is one optimizer step over a batch of
//! [`TrajectoryGroup`](crate::types::TrajectoryGroup)s:
//!
//! 1. **Tokens.** Every trajectory (and each of its `additional_histories`, which share its
//!    advantage) is rendered with the model's chat template, tools included. Each assistant turn
//!    that is a sampled [`Choice`](crate::types::Choice) is replaced by the choice's own token
//!    ids, and exactly those tokens are trainable; everything else (system, user, tool messages,
//!    written assistant messages, template glue) is context. The sampler's logprobs are aligned
//!    with the sampled tokens.
//! 2. **Advantages.** Per group: reward minus the group mean, divided by the group std (+1e-6)
//!    when `scale_rewards`. Groups whose rewards are all equal teach nothing and are skipped.
//! 3. **Loss.** PPO-style clipped importance ratio against the sampler's logprobs, per token or
//!    per sequence (geometric mean), plus `beta` times a k3 KL estimate to the base model;
//!    normalised by sequence length or by the step's trainable tokens.
//! 4. **Update.** The sequences of a group that share their prompt run as one block, the prompt
//!    computed once (`share_prefixes`); blocks are packed into rows (several per row, each
//!    sequence attending only to its own, with `pack_sequences`; one per row, right-padded,
//!    without) and rows into micro-batches of at most `micro_batch_tokens` positions; gradients
//!    accumulate over them; the global norm is clipped to `max_grad_norm`; one AdamW
//!    step.
//! 5. **Checkpoint.** `model_dir/checkpoints/<step>/` (PEFT `adapter_config.json` +
//!    `adapter_model.safetensors`, optimizer state, `trainer_state.json`) is written atomically,
//!    and the new adapter is served at once as `name@<step>` and `name`.
//!
//! Training runs on the dense (dequantized) weights; inference may keep using quantized ones.

mod batch;
mod error;
mod loss;
#[cfg(feature = "nccl")]
pub mod nccl;
mod optim;
mod parallel;
mod trainer;

pub use batch::{
    chat_template_for, group_advantages, one_per_row, pack_micro_batches, plan_micro_batches,
    prepare_batch, row_positions, shared_prefix_blocks, Block, MicroBatch, PreparedBatch, RowBlock,
    Tokenization, TrainSequence,
};
pub use error::{Result, SequenceSource, TrainError};
pub use loss::{micro_batch_loss, KeptLayers, MicroBatchLoss, Normalization};
pub use optim::{AdamW, AdamWParams};
pub use parallel::{check_training_devices, DataParallel, Update};
pub use trainer::{
    checkpoint_dir, checkpoint_metrics, list_checkpoints, StepMetrics, StepResult, TrainProgress,
    Trainer,
};
