//! Data-parallel training: the model on several devices (an engine each), every device with its
//! own copy of the adapter and of the optimizer's moments (a *rank*). A step's micro-batches are
//! shared out by their positions, each rank accumulates the gradients of its share on a thread of
//! its own, the sums are all-reduced (NCCL between CUDA devices; added in memory between CPU
//! engines, which share one memory), and every rank takes the same AdamW step on the same
//! gradients: the copies stay equal without sending weights. One device is a world of size one,
//! which runs on the caller's thread and reduces nothing.

use std::sync::{mpsc, Arc};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::engine::{Engine, LoraAdapter};
use crate::types::TrainConfig;

use super::batch::{MicroBatch, TrainSequence};
use super::error::{Result, TrainError};
use super::loss::{micro_batch_loss, Normalization};
use super::optim::AdamW;

/// The adapter and optimizer of one model, on one device or several.
pub struct DataParallel {
    /// Rank 0 first: its adapter is the one checkpointed and served.
    ranks: Vec<Rank>,
    reduce: GradientReduce,
}

/// One device's engine with its copies of the adapter and of the optimizer state.
struct Rank {
    engine: Arc<Engine>,
    adapter: LoraAdapter,
    optimizer: AdamW,
}

/// How the ranks' gradient sums are added up.
enum GradientReduce {
    /// One rank: nothing to add.
    Single,
    /// CPU engines, which share the process's memory: added there.
    InMemory,
    /// CUDA devices: NCCL's all-reduce.
    #[cfg(feature = "nccl")]
    Nccl(super::nccl::Communicators),
}

impl DataParallel {
    /// One rank: `adapter` and `optimizer` on `engine`'s device.
    pub fn new(engine: Arc<Engine>, adapter: LoraAdapter, optimizer: AdamW) -> Self {
        DataParallel {
            ranks: vec![Rank {
                engine,
                adapter,
                optimizer,
            }],
            reduce: GradientReduce::Single,
        }
    }

    /// Trains on `engines` too (the same model loaded on other devices): each gets a copy of
    /// rank 0's adapter and optimizer state. CUDA devices need a build with the `nccl` feature;
    /// CPU engines and CUDA devices do not mix, and a device takes one rank.
    pub fn add_ranks(&mut self, engines: Vec<Arc<Engine>>) -> Result<()> {
        if engines.is_empty() {
            return Ok(());
        }
        let first = &self.ranks[0].engine;
        for engine in &engines {
            if engine.config() != first.config() {
                return Err(TrainError::DataParallel(format!(
                    "the model on {:?} is not the one on {:?}",
                    engine.device().location(),
                    first.device().location()
                )));
            }
        }
        let mut ranks = std::mem::take(&mut self.ranks);
        for engine in engines {
            let device = engine.device().clone();
            let adapter = ranks[0].adapter.to_device(&device)?;
            let optimizer = ranks[0].optimizer.copy_for(adapter.named_vars(), &device)?;
            ranks.push(Rank {
                engine,
                adapter,
                optimizer,
            });
        }
        let devices: Vec<Device> = ranks.iter().map(|r| r.engine.device().clone()).collect();
        self.reduce = GradientReduce::for_devices(&devices)?;
        self.ranks = ranks;
        Ok(())
    }

    /// How many devices train.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's adapter: the one checkpointed and served.
    pub fn adapter(&self) -> &LoraAdapter {
        &self.ranks[0].adapter
    }

    /// Every rank's adapter, rank 0 first (equal after every step).
    pub fn adapters(&self) -> impl Iterator<Item = &LoraAdapter> {
        self.ranks.iter().map(|r| &r.adapter)
    }

    pub fn optimizer(&self) -> &AdamW {
        &self.ranks[0].optimizer
    }

    /// Makes `adapter` and `optimizer` (on rank 0's device) every rank's state: a checkpoint
    /// read back.
    pub fn reset(&mut self, adapter: LoraAdapter, optimizer: AdamW) -> Result<()> {
        for rank in self.ranks.iter_mut().skip(1) {
            let device = rank.engine.device().clone();
            rank.adapter = adapter.to_device(&device)?;
            rank.optimizer = optimizer.copy_for(rank.adapter.named_vars(), &device)?;
        }
        self.ranks[0].adapter = adapter;
        self.ranks[0].optimizer = optimizer;
        Ok(())
    }

    /// One AdamW update on `sequences`: forward and backward of every micro-batch (gradients
    /// accumulate; with several ranks each takes a share), the sums all-reduced, the global
    /// gradient norm clipped to `config.max_grad_norm`, and the step at `config.learning_rate`
    /// on every rank (none when there is no sequence). `on_micro_batch(done, tokens, loss)`
    /// follows the micro-batches. The caller holds rank 0's device (see
    /// [`Engine::hold_device`]); the other ranks' are held here.
    pub fn update(
        &mut self,
        sequences: &[TrainSequence],
        micro_batches: &[MicroBatch],
        normalization: Normalization,
        config: &TrainConfig,
        reference: Option<&LoraAdapter>,
        mut on_micro_batch: impl FnMut(usize, usize, f64),
    ) -> Result<Update> {
        let started = Instant::now();
        let work = Work {
            sequences,
            normalization,
            config,
        };
        let (mut grads, mut u) = if self.ranks.len() == 1 {
            let rank = &self.ranks[0];
            let share: Vec<&MicroBatch> = micro_batches.iter().collect();
            let mut done = 0;
            let (grads, u) = work.accumulate(rank, reference, &share, |tokens, loss| {
                done += 1;
                on_micro_batch(done, tokens, loss)
            })?;
            (vec![grads], u)
        } else {
            self.accumulate_in_parallel(&work, micro_batches, reference, &mut on_micro_batch)?
        };
        u.micro_batches = micro_batches.len();
        if !u.loss.is_finite() {
            return Err(TrainError::NonFinite { what: "loss" });
        }
        let devices: Vec<Device> = self
            .ranks
            .iter()
            .map(|r| r.engine.device().clone())
            .collect();
        if let Some(sums) = self.reduce.all_reduce(&grads, &devices)? {
            grads = sums;
        }
        let mut sq = 0.0;
        for g in grads[0].iter().flatten() {
            sq += g
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        u.grad_norm = sq.sqrt();
        if !u.grad_norm.is_finite() {
            return Err(TrainError::NonFinite {
                what: "gradient norm",
            });
        }
        if !sequences.is_empty() {
            let factor = config
                .max_grad_norm
                .map_or(1.0, |max| max / (u.grad_norm + 1e-6));
            for (rank, grads) in self.ranks.iter_mut().zip(&mut grads) {
                if factor < 1.0 {
                    for g in grads.iter_mut().flatten() {
                        *g = (&*g * factor)?;
                    }
                }
                rank.optimizer
                    .step(grads, config.learning_rate, config.weight_decay)?;
            }
        }
        // The update's kernels are queued on a GPU: wait for them, so that the time (and the
        // step's tokens/s) is the compute's, not the checkpoint's that would wait after.
        for rank in &self.ranks {
            rank.engine.device().synchronize()?;
        }
        u.compute_s = started.elapsed().as_secs_f64();
        Ok(u)
    }

    /// [`Work::accumulate`] on every rank at once, each on a thread of its own with its share
    /// of `micro_batches`; the progress of all of them reported here as it comes.
    fn accumulate_in_parallel(
        &self,
        work: &Work<'_>,
        micro_batches: &[MicroBatch],
        reference: Option<&LoraAdapter>,
        on_micro_batch: &mut impl FnMut(usize, usize, f64),
    ) -> Result<(Vec<Vec<Option<Tensor>>>, Update)> {
        let shares = share_out(micro_batches, self.ranks.len());
        // No decode graph may be captured on a rank's device while it trains (rank 0's is the
        // caller's to hold).
        let _held: Vec<_> = self.ranks[1..]
            .iter()
            .map(|r| r.engine.hold_device())
            .collect();
        // The KL reference policy, copied to the other ranks' devices.
        let copies: Vec<Option<LoraAdapter>> = self.ranks[1..]
            .iter()
            .map(|r| {
                reference
                    .map(|a| a.to_device(r.engine.device()))
                    .transpose()
            })
            .collect::<crate::engine::Result<_>>()?;
        let (sender, progress) = mpsc::channel::<(usize, f64)>();
        let results = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .zip(&shares)
                .enumerate()
                .map(|(i, (rank, share))| {
                    let sender = sender.clone();
                    let reference = match i {
                        0 => reference,
                        i => copies[i - 1].as_ref(),
                    };
                    scope.spawn(move || {
                        let share: Vec<&MicroBatch> =
                            share.iter().map(|&k| &micro_batches[k]).collect();
                        let mut last = (0, 0.0);
                        work.accumulate(rank, reference, &share, |tokens, loss| {
                            // Each rank reports its own running sums; send the increments.
                            let _ = sender.send((tokens - last.0, loss - last.1));
                            last = (tokens, loss);
                        })
                    })
                })
                .collect();
            drop(sender);
            let (mut done, mut tokens, mut loss) = (0, 0, 0.0);
            for (t, l) in progress {
                done += 1;
                tokens += t;
                loss += l;
                on_micro_batch(done, tokens, loss);
            }
            handles
                .into_iter()
                .map(|h| h.join().expect("a training rank panicked"))
                .collect::<Vec<_>>()
        });
        let mut all = Update::default();
        let mut grads = Vec::with_capacity(results.len());
        for result in results {
            let (g, u) = result?;
            all.absorb(u);
            grads.push(g);
        }
        Ok((grads, all))
    }
}

/// Whether ranks on `devices` (the first training device first) can train together: all on the
/// CPU, or all on distinct CUDA devices in a build with NCCL.
pub fn check_training_devices(devices: &[Device]) -> Result<()> {
    if devices.len() < 2 || devices.iter().all(Device::is_cpu) {
        return Ok(());
    }
    if !devices.iter().all(Device::is_cuda) {
        return Err(TrainError::DataParallel(
            "every training device must be a CUDA device, or every one the CPU".into(),
        ));
    }
    for (i, a) in devices.iter().enumerate() {
        if devices[..i].iter().any(|b| b.same_device(a)) {
            return Err(TrainError::DataParallel(format!(
                "{:?} is named twice: a CUDA device takes one rank",
                a.location()
            )));
        }
    }
    if cfg!(feature = "nccl") {
        Ok(())
    } else {
        Err(TrainError::DataParallel(
            "the gradients of CUDA devices are all-reduced with NCCL: build with `--features nccl`"
                .into(),
        ))
    }
}

/// Micro-batch indices per rank: the largest first, each to the rank with the fewest positions
/// so far; each rank's in their original order.
fn share_out(micro_batches: &[MicroBatch], ranks: usize) -> Vec<Vec<usize>> {
    let cost = |k: usize| micro_batches[k].rows.len() * micro_batches[k].width;
    let mut order: Vec<usize> = (0..micro_batches.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(cost(k)));
    let mut shares = vec![Vec::new(); ranks];
    let mut load = vec![0usize; ranks];
    for k in order {
        let r = (0..ranks).min_by_key(|&r| (load[r], r)).expect("a rank");
        load[r] += cost(k);
        shares[r].push(k);
    }
    for share in &mut shares {
        share.sort_unstable();
    }
    shares
}

/// What every rank computes its share of.
struct Work<'a> {
    sequences: &'a [TrainSequence],
    normalization: Normalization,
    config: &'a TrainConfig,
}

impl Work<'_> {
    /// The gradients of `rank`'s adapter summed over `share` (`None` where no micro-batch
    /// reached a variable), with what the micro-batches measured. `progress(tokens, loss)`
    /// follows them with running sums.
    fn accumulate(
        &self,
        rank: &Rank,
        reference: Option<&LoraAdapter>,
        share: &[&MicroBatch],
        mut progress: impl FnMut(usize, f64),
    ) -> Result<(Vec<Option<Tensor>>, Update)> {
        let model = rank.engine.model();
        let named = rank.adapter.named_vars();
        let mut grads: Vec<Option<Tensor>> = vec![None; named.len()];
        let mut u = Update::default();
        for mb in share {
            let mut out = micro_batch_loss(
                model,
                Some(&rank.adapter),
                reference,
                &mb.gather(self.sequences),
                self.normalization,
                self.config,
                true,
            )?;
            let store = out.backward(model, &rank.adapter)?;
            for (slot, (_, var)) in grads.iter_mut().zip(&named) {
                if let Some(g) = store.get(var.as_tensor()) {
                    *slot = Some(match slot.take() {
                        Some(acc) => (acc + g)?,
                        None => g.clone(),
                    });
                }
            }
            u.loss += out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            u.policy_loss += out.policy_loss;
            if let Some(x) = out.kl {
                u.kl = Some(u.kl.unwrap_or(0.0) + x);
            }
            if let Some(x) = out.kl_policy_ref {
                // Token-weighted over micro-batches: divided by the tokens, the step's mean.
                u.kl_policy_ref =
                    Some(u.kl_policy_ref.unwrap_or(0.0) + x * out.num_tokens() as f64);
            }
            u.entropy_sum += out.entropy_sum;
            u.clipped += out.clipped_tokens;
            if let Some(k) = out.kept_layers {
                u.layers_kept += k.kept;
                u.layers_run += k.layers;
                u.kept_bytes = u.kept_bytes.max(k.kept * k.layer_bytes);
            }
            u.tokens += out.num_tokens();
            for (s, t) in out.sampler_logprobs.iter().zip(&out.trainer_logprobs) {
                if s.is_finite() {
                    u.sampler_lp.push(f64::from(*s));
                    u.trainer_lp.push(f64::from(*t));
                }
            }
            progress(u.tokens, u.loss);
        }
        Ok((grads, u))
    }
}

impl GradientReduce {
    /// The reduction for ranks on `devices` (rank 0 first).
    fn for_devices(devices: &[Device]) -> Result<Self> {
        check_training_devices(devices)?;
        Ok(match devices {
            [_] => GradientReduce::Single,
            [first, ..] if first.is_cpu() => GradientReduce::InMemory,
            #[cfg(feature = "nccl")]
            _ => GradientReduce::Nccl(super::nccl::Communicators::new(devices)?),
            #[cfg(not(feature = "nccl"))]
            _ => unreachable!("check_training_devices refuses CUDA ranks without NCCL"),
        })
    }

    /// Every rank's gradients replaced by their sum over the ranks (`None` where no rank has
    /// one), or `None` with a single rank. The sums are f32, the optimizer's arithmetic.
    fn all_reduce(
        &self,
        grads: &[Vec<Option<Tensor>>],
        devices: &[Device],
    ) -> Result<Option<Vec<Vec<Option<Tensor>>>>> {
        if matches!(self, GradientReduce::Single) {
            return Ok(None);
        }
        let vars = grads[0].len();
        let shapes: Vec<Option<candle_core::Shape>> = (0..vars)
            .map(|i| {
                grads
                    .iter()
                    .find_map(|g| g[i].as_ref())
                    .map(|t| t.shape().clone())
            })
            .collect();
        if shapes.iter().all(Option::is_none) {
            return Ok(Some(grads.to_vec()));
        }
        // Each rank's gradients as one flat f32 vector, zeros where it has none.
        let flats = grads
            .iter()
            .zip(devices)
            .map(|(rank, device)| {
                let mut parts = Vec::with_capacity(rank.len());
                for (g, shape) in rank.iter().zip(&shapes) {
                    let Some(shape) = shape else { continue };
                    parts.push(match g {
                        Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
                        None => Tensor::zeros(shape.elem_count(), DType::F32, device)?,
                    });
                }
                Ok(Tensor::cat(&parts, 0)?)
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let sums = match self {
            GradientReduce::Single => unreachable!("returned above"),
            GradientReduce::InMemory => {
                let mut sum = flats[0].clone();
                for flat in &flats[1..] {
                    sum = (sum + flat)?;
                }
                vec![sum; flats.len()]
            }
            #[cfg(feature = "nccl")]
            GradientReduce::Nccl(comms) => comms.all_reduce_sum(&flats)?,
        };
        // Back into one tensor per variable, on every rank.
        sums.iter()
            .map(|sum| {
                let mut offset = 0;
                shapes
                    .iter()
                    .map(|shape| {
                        let Some(shape) = shape else { return Ok(None) };
                        let n = shape.elem_count();
                        let part = sum.narrow(0, offset, n)?.reshape(shape)?;
                        offset += n;
                        Ok(Some(part))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// What one optimizer update ([`DataParallel::update`]) measured, summed over the ranks.
#[derive(Default)]
pub struct Update {
    /// The loss (weighted as the normalization says) and its policy part.
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: Option<f64>,
    /// Sum over micro-batches of their mean `kl_policy_ref` times their tokens.
    pub kl_policy_ref: Option<f64>,
    pub entropy_sum: f64,
    pub clipped: usize,
    /// Trainable tokens computed.
    pub tokens: usize,
    /// The sampler's and the trainer's logprobs of the tokens that came with the sampler's.
    pub sampler_lp: Vec<f64>,
    pub trainer_lp: Vec<f64>,
    pub grad_norm: f64,
    pub micro_batches: usize,
    pub compute_s: f64,
    /// Over the micro-batches run layer by layer: layers that kept their activations for the
    /// backward, layers run, and the most memory one micro-batch kept.
    pub layers_kept: usize,
    pub layers_run: usize,
    pub kept_bytes: usize,
}

impl Update {
    /// Adds another rank's figures to these.
    fn absorb(&mut self, other: Update) {
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
        self.loss += other.loss;
        self.policy_loss += other.policy_loss;
        self.kl = add(self.kl, other.kl);
        self.kl_policy_ref = add(self.kl_policy_ref, other.kl_policy_ref);
        self.entropy_sum += other.entropy_sum;
        self.clipped += other.clipped;
        self.tokens += other.tokens;
        self.sampler_lp.extend(other.sampler_lp);
        self.trainer_lp.extend(other.trainer_lp);
        self.layers_kept += other.layers_kept;
        self.layers_run += other.layers_run;
        self.kept_bytes = self.kept_bytes.max(other.kept_bytes);
    }

    /// How the backward got the layers' activations, for the step's profile.
    pub fn layer_memory(&self) -> String {
        if self.layers_run == 0 {
            return "candle's whole graph".into();
        }
        format!(
            "layer runs: {} with activations kept ({:.1} MiB at most), {} recomputed",
            self.layers_kept,
            self.kept_bytes as f64 / (1u64 << 20) as f64,
            self.layers_run - self.layers_kept,
        )
    }

    pub fn mean_entropy(&self) -> f64 {
        if self.tokens > 0 {
            self.entropy_sum / self.tokens as f64
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::batch::Block;

    fn micro_batch(rows: usize, width: usize) -> MicroBatch {
        MicroBatch {
            rows: vec![Vec::<Block>::new(); rows],
            width,
        }
    }

    #[test]
    fn micro_batches_are_shared_out_by_positions() {
        let mbs = [
            micro_batch(1, 512),
            micro_batch(4, 512),
            micro_batch(2, 512),
            micro_batch(1, 256),
        ];
        // 2,048 positions to one rank; 1,024 + 512 + 256 to the other.
        assert_eq!(share_out(&mbs, 2), vec![vec![1], vec![0, 2, 3]]);
        // More ranks than micro-batches: the last get nothing.
        assert_eq!(share_out(&mbs[..1], 3), vec![vec![0], vec![], vec![]]);
        assert_eq!(share_out(&mbs, 1), vec![vec![0, 1, 2, 3]]);
    }
}
