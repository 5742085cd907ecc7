//! The [`Trainer`]: owns one model's LoRA adapter and optimizer, takes a GRPO step per call,
//! checkpoints after each step, and serves every checkpoint from the engine at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

pub use crate::types::{StepMetrics, StepResult, TrainProgress};

use crate::engine::chat_template::ChatTemplate;
use crate::engine::{Engine, LoraAdapter};
use crate::types::{LoraConfig, TrainConfig, TrajectoryGroup};

use super::batch::{chat_template_for, pack_micro_batches, prepare_batch, Tokenization};
use super::error::{Result, TrainError};
use super::loss::{micro_batch_loss, Normalization};
use super::optim::{AdamW, AdamWParams};

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
    adapter: LoraAdapter,
    optimizer: AdamW,
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
        let template = chat_template_for(&engine)?;
        let device = engine.device().clone();
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
            engine,
            model_dir,
            name: name.to_string(),
            template,
            adapter,
            optimizer,
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
        &self.adapter
    }

    pub fn lora_config(&self) -> &LoraConfig {
        self.adapter.config()
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
        for name in self.served.drain(..) {
            self.engine.remove_adapter(&name);
        }
        self.engine.remove_adapter(&self.name);
        self.retired = true;
    }

    /// Registers a snapshot of the current adapter as `name@step` and `name`.
    fn register(&mut self) -> Result<()> {
        let snapshot = Arc::new(self.adapter.snapshot()?);
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

    /// Writes the current state as the checkpoint of `self.step`, atomically: everything goes
    /// into a temporary directory that is renamed into place.
    fn save_checkpoint(&self, metrics: &StepMetrics) -> Result<PathBuf> {
        let final_dir = checkpoint_dir(&self.model_dir, self.step);
        let parent = final_dir.parent().expect("checkpoint dir has a parent");
        std::fs::create_dir_all(parent).map_err(|e| TrainError::io(parent, e))?;
        let tmp = parent.join(format!(".tmp-{:04}-{}", self.step, std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
        }
        self.adapter.save_peft(&tmp, Some(self.engine.name()))?;
        self.optimizer.save(&tmp)?;
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
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir).map_err(|e| TrainError::io(&final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir).map_err(|e| TrainError::io(&final_dir, e))?;
        Ok(final_dir)
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
        let lengths: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
        let micro_batches = pack_micro_batches(&lengths, config.micro_batch_tokens);
        let total_trainable: usize = sequences.iter().map(|s| s.num_trainable()).sum();
        let num_tokens: usize = lengths.iter().sum();
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
        let named = self.adapter.named_vars();
        let mut grads: Vec<Option<Tensor>> = vec![None; named.len()];
        let (mut loss, mut policy_loss, mut kl, mut entropy_sum) = (0.0, 0.0, None, 0.0);
        let mut kl_policy_ref: Option<f64> = None;
        let mut clipped = 0;
        let mut done_tokens = 0;
        let (mut sampler_lp, mut trainer_lp) = (Vec::new(), Vec::new());
        let compute_started = Instant::now();
        for (k, mb) in micro_batches.iter().enumerate() {
            let members: Vec<_> = mb.sequences.iter().map(|&i| &sequences[i]).collect();
            let mut out = micro_batch_loss(
                self.engine.model(),
                Some(&self.adapter),
                reference.as_deref(),
                &members,
                normalization,
                config,
                true,
            )?;
            let store = out.backward(self.engine.model(), &self.adapter)?;
            for (slot, (_, var)) in grads.iter_mut().zip(&named) {
                if let Some(g) = store.get(var.as_tensor()) {
                    *slot = Some(match slot.take() {
                        Some(acc) => (acc + g)?,
                        None => g.clone(),
                    });
                }
            }
            let mb_loss = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            loss += mb_loss;
            policy_loss += out.policy_loss;
            if let Some(x) = out.kl {
                kl = Some(kl.unwrap_or(0.0) + x);
            }
            if let Some(x) = out.kl_policy_ref {
                // Token-weighted over micro-batches: the step's mean.
                kl_policy_ref = Some(kl_policy_ref.unwrap_or(0.0) + x * out.num_tokens() as f64);
            }
            entropy_sum += out.entropy_sum;
            clipped += out.clipped_tokens;
            done_tokens += out.num_tokens();
            for (s, t) in out.sampler_logprobs.iter().zip(&out.trainer_logprobs) {
                if s.is_finite() {
                    sampler_lp.push(f64::from(*s));
                    trainer_lp.push(f64::from(*t));
                }
            }
            on_progress(TrainProgress {
                step: next_step,
                micro_batch: k + 1,
                micro_batches: micro_batches.len(),
                trainable_tokens: done_tokens,
                total_trainable_tokens: total_trainable,
                loss,
                elapsed_s: started.elapsed().as_secs_f64(),
            });
        }
        if !loss.is_finite() {
            return Err(TrainError::NonFinite { what: "loss" });
        }

        // Global gradient norm, clipping, update.
        let mut sq = 0.0;
        for g in grads.iter().flatten() {
            sq += g
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        let grad_norm = sq.sqrt();
        if !grad_norm.is_finite() {
            return Err(TrainError::NonFinite {
                what: "gradient norm",
            });
        }
        let trained = !sequences.is_empty();
        if trained {
            if let Some(max) = config.max_grad_norm {
                let factor = max / (grad_norm + 1e-6);
                if factor < 1.0 {
                    for g in grads.iter_mut().flatten() {
                        *g = (&*g * factor)?;
                    }
                }
            }
            self.optimizer
                .step(&grads, config.learning_rate, config.weight_decay)?;
        }
        let compute_s = compute_started.elapsed().as_secs_f64();
        let (logprob_corr, logprob_abs_diff) = agreement(&sampler_lp, &trainer_lp);
        self.step = next_step;
        let metrics = StepMetrics {
            loss,
            policy_loss,
            kl,
            kl_policy_ref: kl_policy_ref.map(|sum| sum / done_tokens.max(1) as f64),
            entropy: if done_tokens > 0 {
                entropy_sum / done_tokens as f64
            } else {
                0.0
            },
            grad_norm,
            learning_rate: config.learning_rate,
            reward: batch.reward_mean,
            reward_std: batch.reward_std,
            num_trajectories: batch.num_trajectories,
            num_sequences: sequences.len(),
            num_trainable_tokens: total_trainable,
            num_tokens,
            num_micro_batches: micro_batches.len(),
            tokens_per_second: if compute_s > 0.0 {
                num_tokens as f64 / compute_s
            } else {
                0.0
            },
            num_groups_trained: batch.groups_used,
            num_groups_skipped: batch.groups_skipped,
            clip_fraction: if done_tokens > 0 {
                clipped as f64 / done_tokens as f64
            } else {
                0.0
            },
            logprob_corr,
            logprob_abs_diff,
            duration_s: started.elapsed().as_secs_f64(),
        };
        let checkpoint = self.save_checkpoint(&metrics)?;
        self.register()?;
        Ok(StepResult {
            step: self.step,
            trained,
            metrics,
            checkpoint,
            adapter_name: self.adapter_name(self.step),
        })
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
