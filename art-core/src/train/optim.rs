//! AdamW (PyTorch's formulation, decoupled weight decay) over named variables, with a state
//! that can be saved and restored so that resumed training continues exactly.

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::error::{Result, TrainError};

/// The optimizer's hyperparameters besides the learning rate and weight decay (which come with
/// each step's config).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

struct Slot {
    name: String,
    var: Var,
    /// First and second moments, f32 like the variables.
    m: Tensor,
    v: Tensor,
}

/// AdamW over a fixed list of named variables.
pub struct AdamW {
    slots: Vec<Slot>,
    /// Steps taken (for bias correction).
    t: u64,
    params: AdamWParams,
    /// Every slot's `m` and `v`, flattened and concatenated, when the slots' moments are views
    /// of these (after an update of all variables at once).
    flat: Option<(Tensor, Tensor)>,
}

/// One step's constants.
struct Update {
    params: AdamWParams,
    bias1: f64,
    bias2: f64,
    lr: f64,
    weight_decay: f64,
}

impl Update {
    /// The new `(m, v, theta)` for gradient `g` (all f32, any shape).
    fn apply(
        &self,
        m: &Tensor,
        v: &Tensor,
        g: &Tensor,
        theta: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let AdamWParams { beta1, beta2, eps } = self.params;
        let m = ((m * beta1)? + (g * (1.0 - beta1))?)?;
        let v = ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
        let denom = ((&v / self.bias2)?.sqrt()? + eps)?;
        let update = ((&m / self.bias1)? / denom)?;
        let decayed = (theta * (1.0 - self.lr * self.weight_decay))?;
        let next = (decayed - (update * self.lr)?)?;
        Ok((m, v, next))
    }
}

/// The small JSON part of a saved optimizer state.
#[derive(Debug, Serialize, Deserialize)]
struct SavedState {
    t: u64,
    params: AdamWParams,
}

pub const STATE_TENSORS: &str = "optimizer.safetensors";
pub const STATE_JSON: &str = "optimizer.json";

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                let m = Tensor::zeros(var.shape(), DType::F32, var.device())?;
                let v = m.clone();
                Ok(Slot { name, var, m, v })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            slots,
            t: 0,
            params,
            flat: None,
        })
    }

    /// This optimizer's state (moments, step count, settings) on `device`, for `vars`: another
    /// copy of the same adapter (the same names, in the same order), a data-parallel rank's.
    pub fn copy_for(&self, vars: Vec<(String, Var)>, device: &Device) -> Result<Self> {
        if vars.len() != self.slots.len()
            || vars
                .iter()
                .zip(&self.slots)
                .any(|((n, v), s)| *n != s.name || v.dims() != s.var.dims())
        {
            return Err(TrainError::DataParallel(
                "the optimizer's copy follows other variables than the original".into(),
            ));
        }
        let slots = vars
            .into_iter()
            .zip(&self.slots)
            .map(|((name, var), slot)| {
                Ok(Slot {
                    name,
                    var,
                    m: slot.m.to_device(device)?,
                    v: slot.v.to_device(device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            slots,
            t: self.t,
            params: self.params,
            flat: None,
        })
    }

    pub fn steps_taken(&self) -> u64 {
        self.t
    }

    /// One update with `grads[i]` the gradient of the i-th variable (in `new`'s order); a `None`
    /// gradient leaves the variable (and its moments) unchanged.
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64, weight_decay: f64) -> Result<()> {
        self.t += 1;
        let t = self.t as i32;
        let hyper = Update {
            params: self.params,
            bias1: 1.0 - self.params.beta1.powi(t),
            bias2: 1.0 - self.params.beta2.powi(t),
            lr,
            weight_decay,
        };
        let all: Option<Vec<&Tensor>> = grads.iter().map(Option::as_ref).collect();
        match all {
            // Every variable at once, as one flat vector: a dozen ops in all instead of a dozen
            // per variable (a model of 24 layers has 336 adapter matrices; on a GPU each op
            // costs the host ~10 us whatever its size).
            Some(grads) if !self.slots.is_empty() && grads.len() == self.slots.len() => {
                self.step_flat(&grads, &hyper)
            }
            _ => {
                self.flat = None;
                for (slot, grad) in self.slots.iter_mut().zip(grads) {
                    let Some(g) = grad else { continue };
                    let theta = slot.var.as_tensor().to_dtype(DType::F32)?;
                    let (m, v, next) =
                        hyper.apply(&slot.m, &slot.v, &g.to_dtype(DType::F32)?, &theta)?;
                    (slot.m, slot.v) = (m, v);
                    slot.var.set(&next.to_dtype(slot.var.dtype())?)?;
                }
                Ok(())
            }
        }
    }

    fn step_flat(&mut self, grads: &[&Tensor], hyper: &Update) -> Result<()> {
        let flat = |ts: Vec<Tensor>| -> Result<Tensor> {
            let ts = ts
                .iter()
                .map(|t| t.to_dtype(DType::F32)?.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&ts, 0)?)
        };
        let (m, v) = match self.flat.take() {
            Some(mv) => mv,
            None => (
                flat(self.slots.iter().map(|s| s.m.clone()).collect())?,
                flat(self.slots.iter().map(|s| s.v.clone()).collect())?,
            ),
        };
        let g = flat(grads.iter().map(|&g| g.clone()).collect())?;
        let theta = flat(
            self.slots
                .iter()
                .map(|s| s.var.as_tensor().clone())
                .collect(),
        )?;
        let (m, v, next) = hyper.apply(&m, &v, &g, &theta)?;
        let mut offset = 0;
        for slot in &mut self.slots {
            let n = slot.var.elem_count();
            let part = |t: &Tensor| t.narrow(0, offset, n)?.reshape(slot.var.shape());
            slot.m = part(&m)?;
            slot.v = part(&v)?;
            slot.var.set(&part(&next)?.to_dtype(slot.var.dtype())?)?;
            offset += n;
        }
        self.flat = Some((m, v));
        Ok(())
    }

    /// Writes `optimizer.safetensors` (moments, named `<variable>.exp_avg` / `.exp_avg_sq`) and
    /// `optimizer.json` (step count, betas, eps) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut named = Vec::with_capacity(2 * self.slots.len());
        for slot in &self.slots {
            named.push((format!("{}.exp_avg", slot.name), slot.m.clone()));
            named.push((format!("{}.exp_avg_sq", slot.name), slot.v.clone()));
        }
        let dtype = named.first().map_or(DType::F32, |(_, t)| t.dtype());
        crate::engine::save_safetensors(named, dtype, &dir.join(STATE_TENSORS))?;
        let json = serde_json::to_string_pretty(&SavedState {
            t: self.t,
            params: self.params,
        })
        .expect("optimizer state serializes");
        let path = dir.join(STATE_JSON);
        std::fs::write(&path, json).map_err(|e| TrainError::io(&path, e))
    }

    /// Restores what [`AdamW::save`] wrote. Every variable must have its moments there.
    pub fn load(&mut self, dir: &Path, device: &Device) -> Result<()> {
        let json_path = dir.join(STATE_JSON);
        let bad = |detail: String| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            detail,
        };
        let text =
            std::fs::read_to_string(&json_path).map_err(|e| TrainError::io(&json_path, e))?;
        let state: SavedState = serde_json::from_str(&text)
            .map_err(|e| bad(format!("{STATE_JSON} does not parse: {e}")))?;
        let mut tensors = candle_core::safetensors::load(dir.join(STATE_TENSORS), device)?;
        for slot in &mut self.slots {
            for (suffix, target) in [("exp_avg", &mut slot.m), ("exp_avg_sq", &mut slot.v)] {
                let name = format!("{}.{suffix}", slot.name);
                let t = tensors
                    .remove(&name)
                    .ok_or_else(|| bad(format!("{STATE_TENSORS} has no tensor `{name}`")))?;
                if t.dims() != slot.var.dims() {
                    return Err(bad(format!(
                        "`{name}` is {:?}, the variable {:?}",
                        t.dims(),
                        slot.var.dims()
                    )));
                }
                *target = t.to_dtype(DType::F32)?;
            }
        }
        self.t = state.t;
        self.params = state.params;
        self.flat = None;
        Ok(())
    }
}
