//! The [`Trainer`]: owns one model's LoRA adapter and optimizer, takes a GRPO step per call,
//! checkpoints after each step, and serves every checkpoint from the engine at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use crate::types::{StepMetrics, StepResult, TrainProgress};

use crate::engine::chat_template::ChatTemplate;
use crate::engine::{Engine, LoraAdapter};
use crate::fsutil;
use crate::types::{
    LoraConfig, LossFn, SftBatchMetrics, SftConfig, SftEvent, SftResult, TrainConfig, Trajectory,
    TrajectoryGroup,
};

use super::batch::{
    chat_template_for, plan_micro_batches, prepare_batch, Tokenization, TrainSequence,
};
use super::error::{Result, SequenceSource, TrainError};
use super::loss::Normalization;
use super::optim::{AdamW, AdamWParams};
use super::parallel::{DataParallel, Update};

/// What a checkpoint records besides the adapter and the optimizer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    step: u64,
    name: String,
    base_model: String,
    #[serde(default)]
    metrics: Option<StepMetrics>,
}

const STATE_FILE: &str = "trainer_state.json";

/// The directory of a step's checkpoint: `<model_dir>/checkpoints/<step>` with the step written
/// as ART writes it (at least four digits: `0001`).
pub fn checkpoint_dir(model_dir: &Path, step: u64) -> PathBuf {
    model_dir.join("checkpoints").join(format!("{step:04}"))
}

/// The steps that have a complete checkpoint under `model_dir`, ascending.
pub fn list_checkpoints(model_dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(model_dir.join("checkpoints")) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("adapter_model.safetensors").is_file())
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    steps.sort_unstable();
    steps
}

/// What the checkpoint of `step` recorded about its training step, if anything.
pub fn checkpoint_metrics(model_dir: &Path, step: u64) -> Option<StepMetrics> {
    let text = std::fs::read_to_string(checkpoint_dir(model_dir, step).join(STATE_FILE)).ok()?;
    serde_json::from_str::<TrainerState>(&text).ok()?.metrics
}

/// Trains one LoRA adapter on one engine with GRPO. See the module docs of [`crate::train`].
pub struct Trainer {
    engine: Arc<Engine>,
    model_dir: PathBuf,
    name: String,
    template: ChatTemplate,
    /// The adapter and optimizer state: on `engine`'s device, and on the other devices of
    /// data-parallel training.
    ranks: DataParallel,
    step: u64,
    /// `name@step` adapters kept registered on the engine (older ones are unregistered).
    served: Vec<String>,
    max_served: usize,
    /// Set by [`Trainer::retire`]: the model was deleted, nothing more is trained or written.
    retired: bool,
}

impl Trainer {
    /// A trainer for the model `name`, whose checkpoints live in `model_dir/checkpoints/`. When a
    /// checkpoint is there, training resumes from the latest one (step count, adapter weights and
    /// optimizer state; its LoRA config wins over `lora`); otherwise a fresh adapter is made from
    /// `lora` (PEFT's initialisation with a fixed seed, so it equals the base model) at step 0.
    /// Either way the adapter is registered on the engine as `name@<step>` and as `name`.
    pub fn new(
        engine: Arc<Engine>,
        model_dir: PathBuf,
        name: &str,
        lora: &LoraConfig,
    ) -> Result<Self> {
        // No decode graph may be captured while this enqueues work on the device.
        let gate = Arc::clone(&engine);
        let _device = gate.hold_device();
        let template = chat_template_for(&engine)?;
        let device = engine.device().clone();
        // A checkpoint half-written when the process died is a temp directory: remove it.
        let checkpoints = model_dir.join("checkpoints");
        fsutil::remove_stale_temps(&checkpoints).map_err(|e| TrainError::io(&checkpoints, e))?;
        let latest = list_checkpoints(&model_dir).last().copied();
        let (adapter, step, dir) = match latest {
            Some(step) => {
                let dir = checkpoint_dir(&model_dir, step);
                let adapter = LoraAdapter::load_peft(&dir, engine.config(), &device)?;
                (adapter, step, Some(dir))
            }
            None => (
                LoraAdapter::new(engine.config(), lora, &device, 0)?,
                0,
                None,
            ),
        };
        let mut optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default())?;
        if let Some(dir) = &dir {
            if dir.join(super::optim::STATE_JSON).exists() {
                optimizer.load(dir, &device)?;
            }
        }
        let mut trainer = Trainer {
            ranks: DataParallel::new(Arc::clone(&engine), adapter, optimizer),
            engine,
            model_dir,
            name: name.to_string(),
            template,
            step,
            served: Vec::new(),
            max_served: 8,
            retired: false,
        };
        trainer.register()?;
        Ok(trainer)
    }

    /// The number of optimizer steps taken (0 for a fresh adapter).
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn model_dir(&self) -> &Path {
        &self.model_dir
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The adapter being trained (its variables change with every step; the engine serves
    /// snapshots).
    pub fn adapter(&self) -> &LoraAdapter {
        self.ranks.adapter()
    }

    pub fn lora_config(&self) -> &LoraConfig {
        self.ranks.adapter().config()
    }

    /// Trains data-parallel on `engines` as well: the same model loaded on other devices (CUDA
    /// devices through NCCL, with the `nccl` feature; or more CPU engines). Each gets a copy of
    /// the adapter and optimizer state and a share of every step's micro-batches; after a step
    /// all copies are equal. The adapters are still served from this trainer's engine.
    pub fn add_training_devices(&mut self, engines: Vec<Arc<Engine>>) -> Result<()> {
        self.ranks.add_ranks(engines)
    }

    /// How many devices train (1 unless [`Trainer::add_training_devices`] added some).
    pub fn world_size(&self) -> usize {
        self.ranks.world_size()
    }

    /// Every training device's copy of the adapter, this trainer's engine's first.
    pub fn rank_adapters(&self) -> impl Iterator<Item = &LoraAdapter> {
        self.ranks.adapters()
    }

    /// The chat template conversations are rendered with.
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.template
    }

    /// How many `name@step` adapters stay registered on the engine (the latest ones; default 8).
    /// Older checkpoints remain on disk.
    pub fn set_max_served_checkpoints(&mut self, n: usize) {
        self.max_served = n.max(1);
    }

    /// The adapter name the engine serves step `step` under.
    pub fn adapter_name(&self, step: u64) -> String {
        format!("{}@{step}", self.name)
    }

    /// The `name@step` adapters the engine currently serves for this model, oldest first.
    pub fn served_adapters(&self) -> &[String] {
        &self.served
    }

    /// Deletes the checkpoint of every step not in `keep`, except the latest (training resumes
    /// from it), and stops serving them. Returns the steps deleted and the steps left.
    pub fn delete_checkpoints(&mut self, keep: &[u64]) -> Result<(Vec<u64>, Vec<u64>)> {
        let engine = Arc::clone(&self.engine);
        let _device = engine.hold_device();
        let steps = list_checkpoints(&self.model_dir);
        let latest = steps.last().copied();
        let (mut deleted, mut kept) = (Vec::new(), Vec::new());
        for step in steps {
            if keep.contains(&step) || Some(step) == latest {
                kept.push(step);
                continue;
            }
            let dir = checkpoint_dir(&self.model_dir, step);
            std::fs::remove_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
            let name = self.adapter_name(step);
            self.engine.remove_adapter(&name);
            self.served.retain(|n| n != &name);
            deleted.push(step);
        }
        Ok((deleted, kept))
    }

    /// The adapter of the KL reference policy: `None` for the base model (no step, or step 0),
    /// else that step's checkpoint (served, or read back from disk).
    fn reference_adapter(&self, step: Option<u64>) -> Result<Option<Arc<LoraAdapter>>> {
        let Some(step) = step.filter(|&s| s > 0) else {
            return Ok(None);
        };
        if let Some(served) = self.engine.adapter(&self.adapter_name(step)) {
            return Ok(Some(served));
        }
        let steps = list_checkpoints(&self.model_dir);
        if !steps.contains(&step) {
            return Err(TrainError::UnknownReference { step, steps });
        }
        let dir = checkpoint_dir(&self.model_dir, step);
        let adapter = LoraAdapter::load_peft(&dir, self.engine.config(), self.engine.device())?;
        Ok(Some(Arc::new(adapter)))
    }

    /// Stops serving every adapter of this model and refuses any later step (one queued behind
    /// the deletion of its model would otherwise write its directory again). The caller deletes
    /// the files.
    pub fn retire(&mut self) {
        let engine = Arc::clone(&self.engine);
        let _device = engine.hold_device();
        for name in self.served.drain(..) {
            self.engine.remove_adapter(&name);
        }
        self.engine.remove_adapter(&self.name);
        self.retired = true;
    }

    /// Registers a snapshot of the current adapter as `name@step` and `name`.
    fn register(&mut self) -> Result<()> {
        let snapshot = Arc::new(self.ranks.adapter().snapshot()?);
        let versioned = self.adapter_name(self.step);
        self.engine
            .set_adapter(versioned.clone(), snapshot.clone())?;
        self.engine.set_adapter(self.name.clone(), snapshot)?;
        self.served.retain(|n| n != &versioned);
        self.served.push(versioned);
        while self.served.len() > self.max_served {
            let old = self.served.remove(0);
            self.engine.remove_adapter(&old);
        }
        Ok(())
    }

    /// Writes the current state as the checkpoint of `self.step`, atomically and durably:
    /// everything goes into a temporary directory that is synced and renamed into place
    /// ([`fsutil::publish_dir`]); one left by a crash is removed when the trainer next starts.
    /// Returns its directory and the seconds spent syncing it.
    fn save_checkpoint(&self, metrics: &StepMetrics) -> Result<(PathBuf, f64)> {
        let final_dir = checkpoint_dir(&self.model_dir, self.step);
        let parent = final_dir.parent().expect("checkpoint dir has a parent");
        std::fs::create_dir_all(parent).map_err(|e| TrainError::io(parent, e))?;
        let tmp = fsutil::temp_path_for(&final_dir);
        self.ranks
            .adapter()
            .save_peft(&tmp, Some(self.engine.name()))?;
        self.ranks.optimizer().save(&tmp)?;
        let state = TrainerState {
            step: self.step,
            name: self.name.clone(),
            base_model: self.engine.name().to_string(),
            metrics: Some(metrics.clone()),
        };
        let path = tmp.join(STATE_FILE);
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&state).expect("state serializes"),
        )
        .map_err(|e| TrainError::io(&path, e))?;
        let publishing = Instant::now();
        fsutil::publish_dir(&tmp, &final_dir).map_err(|e| TrainError::io(&final_dir, e))?;
        Ok((final_dir, publishing.elapsed().as_secs_f64()))
    }

    /// One GRPO step over all `groups`: tokenize, compute advantages, forward/backward every
    /// micro-batch (accumulating gradients), clip, one AdamW update; then checkpoint and serve
    /// the new adapter as `name@<step>` and `name`. Groups whose rewards are all equal are
    /// skipped; when every group is, the step still advances (with unchanged weights) and the
    /// result says `trained: false`. Fails without changing anything on a malformed batch.
    pub fn train(
        &mut self,
        groups: &[TrajectoryGroup],
        config: &TrainConfig,
        mut on_progress: impl FnMut(TrainProgress),
    ) -> Result<StepResult> {
        if self.retired {
            return Err(TrainError::Retired(self.name.clone()));
        }
        config.validate()?;
        let engine = Arc::clone(&self.engine);
        let _device = engine.hold_device();
        let started = Instant::now();
        let mut tokenization = Tokenization::new(&self.engine, self.template.clone());
        tokenization.allow_missing_logprobs = config.allow_training_without_logprobs;
        let batch = prepare_batch(&tokenization, groups, config.scale_rewards)?;
        if batch.groups_used > 0 && batch.sequences.is_empty() {
            return Err(TrainError::EmptyBatch(
                "the groups with differing rewards contain no sampled choices".into(),
            ));
        }
        let sequences = &batch.sequences;
        let normalization = Normalization::for_step(sequences, config);
        let micro_batches = plan_micro_batches(sequences, config, self.engine.device());
        let total_trainable: usize = sequences.iter().map(|s| s.num_trainable()).sum();
        let num_tokens: usize = sequences.iter().map(TrainSequence::len).sum();
        let next_step = self.step + 1;
        // The batch is valid: say so before the (long) compute starts.
        on_progress(TrainProgress {
            step: next_step,
            micro_batch: 0,
            micro_batches: micro_batches.len(),
            trainable_tokens: 0,
            total_trainable_tokens: total_trainable,
            loss: 0.0,
            elapsed_s: started.elapsed().as_secs_f64(),
        });

        let reference = self.reference_adapter(config.kl_penalty_reference_step)?;
        let prepared_s = started.elapsed().as_secs_f64();
        let update = self.ranks.update(
            sequences,
            &micro_batches,
            normalization,
            config,
            reference.as_deref(),
            |k, done_tokens, loss| {
                on_progress(TrainProgress {
                    step: next_step,
                    micro_batch: k,
                    micro_batches: micro_batches.len(),
                    trainable_tokens: done_tokens,
                    total_trainable_tokens: total_trainable,
                    loss,
                    elapsed_s: started.elapsed().as_secs_f64(),
                })
            },
        )?;
        let trained = !sequences.is_empty();
        let (logprob_corr, logprob_abs_diff) = agreement(&update.sampler_lp, &update.trainer_lp);
        self.step = next_step;
        let metrics = StepMetrics {
            loss: update.loss,
            policy_loss: update.policy_loss,
            kl: update.kl,
            kl_policy_ref: update
                .kl_policy_ref
                .map(|sum| sum / update.tokens.max(1) as f64),
            entropy: update.mean_entropy(),
            grad_norm: update.grad_norm,
            learning_rate: config.learning_rate,
            reward: batch.reward_mean,
            reward_std: batch.reward_std,
            num_trajectories: batch.num_trajectories,
            num_sequences: sequences.len(),
            num_trainable_tokens: total_trainable,
            num_tokens,
            num_micro_batches: micro_batches.len(),
            tokens_per_second: per_second(num_tokens, update.compute_s),
            num_groups_trained: batch.groups_used,
            num_groups_skipped: batch.groups_skipped,
            clip_fraction: if update.tokens > 0 {
                update.clipped as f64 / update.tokens as f64
            } else {
                0.0
            },
            logprob_corr,
            logprob_abs_diff,
            duration_s: started.elapsed().as_secs_f64(),
        };
        let saving = Instant::now();
        let (checkpoint, synced_s) = self.save_checkpoint(&metrics)?;
        let serving = Instant::now();
        self.register()?;
        if crate::engine::switches::PROFILE_TRAIN.on() {
            eprintln!(
                "PROFILE train step {}: batch {:.3} s, update {:.3} s (compute {:.3} s; {}), \
                 checkpoint {:.3} s (syncing it to disk {:.3} s), serving {:.3} s",
                self.step,
                prepared_s,
                metrics.duration_s - prepared_s,
                update.compute_s,
                update.layer_memory(),
                (serving - saving).as_secs_f64(),
                synced_s,
                serving.elapsed().as_secs_f64(),
            );
        }
        Ok(StepResult {
            step: self.step,
            trained,
            metrics,
            checkpoint,
            adapter_name: self.adapter_name(self.step),
        })
    }

    /// Supervised fine-tuning (ART's `train_sft`): the trajectories' assistant turns (those
    /// `config.assistant_turns` names) are learnt by cross-entropy, everything else is context.
    /// Each batch of `config.batch_size` trajectories is one AdamW update at its learning rate;
    /// after the last, one checkpoint (`step + 1`) is written and served as `name@<step>` and
    /// `name`. Every conversation is rendered and checked before the first update; a failure
    /// after it puts the adapter and optimizer back as the latest checkpoint has them, so a
    /// failed call changes nothing.
    pub fn train_sft(
        &mut self,
        trajectories: &[Trajectory],
        config: &SftConfig,
        mut on_event: impl FnMut(SftEvent),
    ) -> Result<SftResult> {
        if self.retired {
            return Err(TrainError::Retired(self.name.clone()));
        }
        if trajectories.is_empty() {
            return Err(TrainError::EmptyBatch(
                "no trajectories to learn from".into(),
            ));
        }
        config.validate(trajectories.len())?;
        let engine = Arc::clone(&self.engine);
        let _device = engine.hold_device();
        let started = Instant::now();
        let tokenization = Tokenization::for_sft(&self.engine, self.template.clone(), config);
        let mut batches = Vec::new();
        for (b, chunk) in trajectories.chunks(config.batch_size).enumerate() {
            let mut sequences = Vec::new();
            for (t, trajectory) in chunk.iter().enumerate() {
                let source = SequenceSource {
                    group: None,
                    trajectory: b * config.batch_size + t,
                    history: None,
                };
                // Advantage 1: see `cross_entropy_config`.
                let learnt = tokenization.trajectory_sequences(trajectory, 1.0, source)?;
                if learnt.iter().all(|s| s.num_trainable() == 0) {
                    return Err(TrainError::NothingToLearn { at: source });
                }
                sequences.extend(learnt.into_iter().filter(|s| s.num_trainable() > 0));
            }
            batches.push(sequences);
        }
        let next_step = self.step + 1;
        let count =
            |f: fn(&TrainSequence) -> usize| -> usize { batches.iter().flatten().map(f).sum() };
        let (total_trainable, num_tokens) = (
            count(TrainSequence::num_trainable),
            count(TrainSequence::len),
        );
        on_event(SftEvent::Started {
            step: next_step,
            batches: batches.len(),
            num_trajectories: trajectories.len(),
            num_trainable_tokens: total_trainable,
        });
        let outcome = self.sft_updates(
            &batches,
            trajectories.len(),
            config,
            next_step,
            &mut on_event,
        );
        let updates = match outcome {
            Ok(updates) => updates,
            Err(e) => {
                self.reload()?;
                return Err(e);
            }
        };
        let compute_s: f64 = updates.iter().map(|(u, _)| u.compute_s).sum();
        let trained_tokens: usize = updates.iter().map(|(u, _)| u.tokens).sum();
        let batch_metrics: Vec<SftBatchMetrics> = updates.iter().map(|(_, m)| m.clone()).collect();
        // Token-weighted over the batches: the mean cross-entropy of every trained token. All of
        // it is policy loss (there is no KL term).
        let loss = updates
            .iter()
            .map(|(u, m)| u.loss * m.num_trainable_tokens as f64)
            .sum::<f64>()
            / trained_tokens.max(1) as f64;
        self.step = next_step;
        let metrics = StepMetrics {
            loss,
            policy_loss: loss,
            entropy: updates.iter().map(|(u, _)| u.entropy_sum).sum::<f64>()
                / trained_tokens.max(1) as f64,
            grad_norm: updates.iter().map(|(u, _)| u.grad_norm).sum::<f64>() / updates.len() as f64,
            learning_rate: batch_metrics.last().map_or(0.0, |m| m.learning_rate),
            num_trajectories: trajectories.len(),
            num_sequences: batches.iter().map(Vec::len).sum(),
            num_trainable_tokens: total_trainable,
            num_tokens,
            num_micro_batches: updates.iter().map(|(u, _)| u.micro_batches).sum(),
            tokens_per_second: per_second(num_tokens, compute_s),
            duration_s: started.elapsed().as_secs_f64(),
            ..Default::default()
        };
        let checkpoint = match self.save_checkpoint(&metrics) {
            Ok((dir, _)) => dir,
            Err(e) => {
                self.step -= 1;
                self.reload()?;
                return Err(e);
            }
        };
        self.register()?;
        Ok(SftResult {
            step: self.step,
            metrics,
            batches: batch_metrics,
            checkpoint,
            adapter_name: self.adapter_name(self.step),
        })
    }

    /// The updates of [`Trainer::train_sft`], one per batch, with what each measured.
    fn sft_updates(
        &mut self,
        batches: &[Vec<TrainSequence>],
        num_trajectories: usize,
        config: &SftConfig,
        step: u64,
        on_event: &mut impl FnMut(SftEvent),
    ) -> Result<Vec<(Update, SftBatchMetrics)>> {
        let mut out = Vec::with_capacity(batches.len());
        for (b, sequences) in batches.iter().enumerate() {
            let batch_started = Instant::now();
            let learning_rate = config.learning_rate.of_batch(b);
            let loss_config = cross_entropy_config(config, learning_rate);
            let normalization = Normalization::for_step(sequences, &loss_config);
            let micro_batches = plan_micro_batches(sequences, &loss_config, self.engine.device());
            let update = self.ranks.update(
                sequences,
                &micro_batches,
                normalization,
                &loss_config,
                None,
                |_, _, _| {},
            )?;
            let first = b * config.batch_size;
            let metrics = SftBatchMetrics {
                step,
                batch: b + 1,
                batches: batches.len(),
                loss: update.loss,
                grad_norm: update.grad_norm,
                learning_rate,
                num_trajectories: config.batch_size.min(num_trajectories - first),
                num_trainable_tokens: sequences.iter().map(TrainSequence::num_trainable).sum(),
                num_tokens: sequences.iter().map(TrainSequence::len).sum(),
                duration_s: batch_started.elapsed().as_secs_f64(),
            };
            on_event(SftEvent::Batch(metrics.clone()));
            out.push((update, metrics));
        }
        Ok(out)
    }

    /// Puts the adapter and the optimizer back as the latest checkpoint has them (a fresh
    /// adapter at step 0: PEFT's initialisation is seeded), and serves that.
    fn reload(&mut self) -> Result<()> {
        let device = self.engine.device().clone();
        let dir = checkpoint_dir(&self.model_dir, self.step);
        let adapter = if self.step > 0 {
            LoraAdapter::load_peft(&dir, self.engine.config(), &device)?
        } else {
            LoraAdapter::new(self.engine.config(), self.lora_config(), &device, 0)?
        };
        let mut optimizer = AdamW::new(adapter.named_vars(), AdamWParams::default())?;
        if dir.join(super::optim::STATE_JSON).exists() {
            optimizer.load(&dir, &device)?;
        }
        self.ranks.reset(adapter, optimizer)
    }
}

/// The loss settings under which [`micro_batch_loss`] is the mean cross-entropy of the trained
/// tokens: CISPO's term `-sg(clip(r)) A log p` with every advantage A = 1 and the ratio taken
/// against the trainer's own logprobs (`precalculate_logprobs`: r = 1) is `-log p`, and token
/// normalisation makes it the batch's mean. One loss path serves both kinds of training (its
/// fused head, checkpointing and micro-batching included).
fn cross_entropy_config(config: &SftConfig, learning_rate: f64) -> TrainConfig {
    TrainConfig {
        learning_rate,
        loss_fn: LossFn::Cispo,
        precalculate_logprobs: true,
        normalize_by_sequence_length: false,
        max_grad_norm: config.max_grad_norm,
        weight_decay: config.weight_decay,
        micro_batch_tokens: config.micro_batch_tokens,
        gradient_checkpointing: config.gradient_checkpointing,
        allow_training_without_logprobs: true,
        ..TrainConfig::default()
    }
}

/// `count` per second of `seconds` (0 when no time was measured).
fn per_second(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

/// Pearson correlation and mean absolute difference of two equally long series.
fn agreement(a: &[f64], b: &[f64]) -> (Option<f64>, Option<f64>) {
    if a.is_empty() {
        return (None, None);
    }
    let n = a.len() as f64;
    let abs_diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / n;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut cov, mut va, mut vb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        cov += (x - ma) * (y - mb);
        va += (x - ma).powi(2);
        vb += (y - mb).powi(2);
    }
    let corr = (va > 0.0 && vb > 0.0).then(|| cov / (va.sqrt() * vb.sqrt()));
    (corr, Some(abs_diff))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}

    #[test]
    fn trainer_is_send() {
        assert_send::<Trainer>();
    }

    #[test]
    fn agreement_of_identical_and_shifted_series() {
        let a = [-1.0, -2.0, -0.5, -3.0];
        let (c, d) = agreement(&a, &a);
        assert!((c.unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(d, Some(0.0));
        let b: Vec<f64> = a.iter().map(|x| x + 0.25).collect();
        let (c, d) = agreement(&a, &b);
        assert!((c.unwrap() - 1.0).abs() < 1e-12);
        assert!((d.unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(agreement(&[], &[]), (None, None));
    }
}
