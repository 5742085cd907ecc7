//! LoRA adapters: trainable low-rank updates on the decoder's linear layers, in PEFT's format.
//!
//! An adapter is separate from the base model: the decoder takes it as an argument on each
//! forward, so adapters can be swapped (or several served side by side) without reloading the
//! base. `A` and `B` are candle [`Var`]s: the trainer backpropagates into them through the same
//! decoder while the base weights stay frozen.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::config::ModelConfig;
use super::error::{EngineError, Result};
use crate::types::LoraConfig;

/// The seven linear layers of a decoder layer, by their PEFT (Hugging Face) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The module's name, as in `target_modules`.
    pub fn name(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer (`self_attn.q_proj`, `mlp.up_proj`, ...).
    pub fn path(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::O => "self_attn.o_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    fn from_name(name: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.name() == name)
    }

    /// `(in, out)` features of this projection in a model of `config`.
    pub fn shape(self, c: &ModelConfig) -> (usize, usize) {
        let q = c.num_attention_heads * c.head_dim;
        let kv = c.num_key_value_heads * c.head_dim;
        match self {
            Proj::Q => (c.hidden_size, q),
            Proj::K | Proj::V => (c.hidden_size, kv),
            Proj::O => (q, c.hidden_size),
            Proj::Gate | Proj::Up => (c.hidden_size, c.intermediate_size),
            Proj::Down => (c.intermediate_size, c.hidden_size),
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// One adapted linear layer: `A` is `[rank, in]`, `B` is `[out, rank]`.
#[derive(Debug, Clone)]
pub struct LoraPair {
    pub a: Var,
    pub b: Var,
}

impl LoraPair {
    /// The tensors to compute with: the variables themselves when training (so gradients flow),
    /// detached views of the same storage otherwise (so inference builds no graph, yet sees
    /// every update the optimizer writes into the variables).
    pub(crate) fn tensors(&self, train: bool) -> (Tensor, Tensor) {
        if train {
            (self.a.as_tensor().clone(), self.b.as_tensor().clone())
        } else {
            (self.a.as_tensor().detach(), self.b.as_tensor().detach())
        }
    }
}

/// Whether two optional adapters are the same one (by identity: an adapter replaced under the same
/// name is another), `None` being the base model. What was computed through one adapter (cached
/// keys and values) serves only requests for that very adapter.
pub(crate) fn same_adapter(a: Option<&Arc<LoraAdapter>>, b: Option<&Arc<LoraAdapter>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// A LoRA adapter for every layer of one model.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    config: LoraConfig,
    /// `layers[i][proj]`.
    layers: Vec<[Option<LoraPair>; 7]>,
}

/// PEFT's `adapter_config.json`, the fields we read and write.
#[derive(Debug, Serialize, Deserialize)]
struct PeftConfig {
    #[serde(default = "lora_str")]
    peft_type: String,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    target_modules: TargetModules,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default = "none_str")]
    bias: String,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default = "causal_lm")]
    task_type: String,
    #[serde(default)]
    inference_mode: bool,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum TargetModules {
    List(Vec<String>),
    Pattern(String),
}

fn lora_str() -> String {
    "LORA".into()
}
fn none_str() -> String {
    "none".into()
}
fn causal_lm() -> String {
    "CAUSAL_LM".into()
}

const PEFT_PREFIX: &str = "base_model.model.model.layers.";

impl LoraAdapter {
    /// A fresh adapter as PEFT initialises one: `A` uniform in `±1/sqrt(in)` (Kaiming-uniform with
    /// a = sqrt(5)), `B` zero, so the adapted model starts equal to the base. `seed` makes `A`
    /// reproducible.
    pub fn new(
        model: &ModelConfig,
        config: &LoraConfig,
        device: &Device,
        seed: u64,
    ) -> Result<Self> {
        let targets = Self::targets(config)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut layers = Vec::with_capacity(model.num_hidden_layers);
        for _ in 0..model.num_hidden_layers {
            let mut slots: [Option<LoraPair>; 7] = Default::default();
            for &proj in &targets {
                let (fan_in, fan_out) = proj.shape(model);
                let bound = 1.0 / (fan_in as f64).sqrt();
                let a: Vec<f32> = (0..config.rank * fan_in)
                    .map(|_| rng.random_range(-bound..bound) as f32)
                    .collect();
                let a = Tensor::from_vec(a, (config.rank, fan_in), device)?;
                let b = Tensor::zeros((fan_out, config.rank), DType::F32, device)?;
                slots[proj.index()] = Some(LoraPair {
                    a: Var::from_tensor(&a)?,
                    b: Var::from_tensor(&b)?,
                });
            }
            layers.push(slots);
        }
        Ok(LoraAdapter {
            config: config.clone(),
            layers,
        })
    }

    fn targets(config: &LoraConfig) -> Result<Vec<Proj>> {
        if config.rank == 0 {
            return Err(EngineError::Adapter("rank must be at least 1".into()));
        }
        config
            .target_modules
            .iter()
            .map(|name| {
                Proj::from_name(name).ok_or_else(|| {
                    EngineError::Adapter(format!(
                        "unknown target module `{name}`; use some of q_proj, k_proj, v_proj, \
                         o_proj, gate_proj, up_proj, down_proj"
                    ))
                })
            })
            .collect()
    }

    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// `alpha / rank`, the factor on `B A x`.
    pub fn scale(&self) -> f64 {
        self.config.alpha / self.config.rank as f64
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn get(&self, layer: usize, proj: Proj) -> Option<&LoraPair> {
        self.layers.get(layer)?[proj.index()].as_ref()
    }

    /// Every trainable variable with its PEFT tensor name, in a stable order.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (i, slots) in self.layers.iter().enumerate() {
            for proj in Proj::ALL {
                if let Some(pair) = &slots[proj.index()] {
                    let base = format!("{PEFT_PREFIX}{i}.{}", proj.path());
                    out.push((format!("{base}.lora_A.weight"), pair.a.clone()));
                    out.push((format!("{base}.lora_B.weight"), pair.b.clone()));
                }
            }
        }
        out
    }

    /// The trainable variables (for an optimizer).
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// A deep copy whose variables no longer share storage with this one's (a checkpoint that
    /// later training steps do not change).
    pub fn snapshot(&self) -> Result<Self> {
        self.map_tensors(|t| t.copy())
    }

    /// A deep copy on `device` (an inference replica's).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        self.map_tensors(|t| match t.device().same_device(device) {
            true => t.copy(),
            false => t.to_device(device),
        })
    }

    /// This adapter with every matrix replaced by `f` of it.
    fn map_tensors(&self, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> Result<Self> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for slots in &self.layers {
            let mut copy: [Option<LoraPair>; 7] = Default::default();
            for (dst, src) in copy.iter_mut().zip(slots.iter()) {
                if let Some(p) = src {
                    *dst = Some(LoraPair {
                        a: Var::from_tensor(&f(p.a.as_tensor())?)?,
                        b: Var::from_tensor(&f(p.b.as_tensor())?)?,
                    });
                }
            }
            layers.push(copy);
        }
        Ok(LoraAdapter {
            config: self.config.clone(),
            layers,
        })
    }

    /// Whether `other` has this adapter's configuration and tensors of the same shapes and
    /// dtypes, so that [`LoraAdapter::copy_from`] applies.
    pub(crate) fn same_layout(&self, other: &LoraAdapter) -> bool {
        let (a, b) = (self.named_vars(), other.named_vars());
        self.config == other.config
            && a.len() == b.len()
            && a.iter()
                .zip(&b)
                .all(|((n, x), (m, y))| n == m && x.shape() == y.shape() && x.dtype() == y.dtype())
    }

    /// Overwrites this adapter's weights with `other`'s, in place (the buffers keep their
    /// addresses). `other` must have the same layout ([`LoraAdapter::same_layout`]).
    pub(crate) fn copy_from(&self, other: &LoraAdapter) -> Result<()> {
        for ((_, dst), (_, src)) in self.named_vars().iter().zip(other.named_vars()) {
            dst.set(src.as_tensor())?;
        }
        Ok(())
    }

    /// Writes `adapter_config.json` and `adapter_model.safetensors` into `dir` (created if
    /// missing), loadable by PEFT's `PeftModel.from_pretrained`.
    pub fn save_peft(&self, dir: &Path, base_model: Option<&str>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
        let config = PeftConfig {
            peft_type: lora_str(),
            r: self.config.rank,
            lora_alpha: self.config.alpha,
            lora_dropout: self.config.dropout,
            target_modules: TargetModules::List(self.config.target_modules.clone()),
            base_model_name_or_path: base_model.map(String::from),
            bias: none_str(),
            fan_in_fan_out: false,
            use_rslora: false,
            task_type: causal_lm(),
            inference_mode: true,
        };
        let json = serde_json::to_string_pretty(&config).expect("adapter config serializes");
        let path = dir.join("adapter_config.json");
        std::fs::write(&path, json).map_err(|e| EngineError::io(&path, e))?;
        let named = self
            .named_vars()
            .into_iter()
            .map(|(name, var)| (name, var.as_tensor().clone()))
            .collect();
        let path = dir.join("adapter_model.safetensors");
        super::gpu::save_safetensors(named, DType::F32, &path)
    }

    /// Reads an adapter saved by PEFT (or by [`LoraAdapter::save_peft`]) for a model of `model`'s
    /// shape. Tensor names may carry PEFT's `base_model.model.` prefix and an adapter name
    /// (`lora_A.default.weight`); both are accepted.
    pub fn load_peft(dir: &Path, model: &ModelConfig, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| EngineError::io(&cfg_path, e))?;
        let peft: PeftConfig = serde_json::from_str(&text).map_err(|e| {
            EngineError::Adapter(format!(
                "{}: not a PEFT adapter config: {e}",
                cfg_path.display()
            ))
        })?;
        if peft.peft_type.to_uppercase() != "LORA" {
            return Err(EngineError::Adapter(format!(
                "{}: peft_type is {}, only LORA adapters are supported",
                cfg_path.display(),
                peft.peft_type
            )));
        }
        if peft.use_rslora || peft.fan_in_fan_out {
            return Err(EngineError::Adapter(format!(
                "{}: use_rslora and fan_in_fan_out are not supported",
                cfg_path.display()
            )));
        }
        let weights_path = dir.join("adapter_model.safetensors");
        if !weights_path.exists() {
            return Err(EngineError::NotFound {
                path: weights_path,
                hint: "a PEFT adapter directory holds adapter_model.safetensors".into(),
            });
        }
        let tensors = candle_core::safetensors::load(&weights_path, device)?;
        let mut layers: Vec<[Option<LoraPair>; 7]> = (0..model.num_hidden_layers)
            .map(|_| Default::default())
            .collect();
        let mut halves: HashMap<(usize, Proj), (Option<Tensor>, Option<Tensor>)> = HashMap::new();
        let mut present = std::collections::BTreeSet::new();
        for (name, tensor) in tensors {
            let (layer, proj, is_a) = parse_peft_name(&name).ok_or_else(|| {
                EngineError::Adapter(format!(
                    "{}: unexpected tensor `{name}`; expected names like \
                     base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                    weights_path.display()
                ))
            })?;
            if layer >= model.num_hidden_layers {
                return Err(EngineError::Adapter(format!(
                    "tensor `{name}` is for layer {layer}, the model has {} layers",
                    model.num_hidden_layers
                )));
            }
            present.insert(proj.name().to_string());
            let entry = halves.entry((layer, proj)).or_default();
            let t = tensor.to_dtype(DType::F32)?;
            if is_a {
                entry.0 = Some(t)
            } else {
                entry.1 = Some(t)
            }
        }
        for ((layer, proj), (a, b)) in halves {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(EngineError::Adapter(format!(
                    "layer {layer} {} has only one of lora_A / lora_B",
                    proj.name()
                )));
            };
            let (fan_in, fan_out) = proj.shape(model);
            if a.dims() != [peft.r, fan_in] || b.dims() != [fan_out, peft.r] {
                return Err(EngineError::Adapter(format!(
                    "layer {layer} {}: lora_A {:?} / lora_B {:?} do not fit rank {} on a \
                     {fan_in}->{fan_out} layer; was the adapter trained on another model?",
                    proj.name(),
                    a.dims(),
                    b.dims(),
                    peft.r
                )));
            }
            layers[layer][proj.index()] = Some(LoraPair {
                a: Var::from_tensor(&a)?,
                b: Var::from_tensor(&b)?,
            });
        }
        let target_modules = match peft.target_modules {
            TargetModules::List(v) => v,
            TargetModules::Pattern(_) => present.into_iter().collect(),
        };
        Ok(LoraAdapter {
            config: LoraConfig {
                rank: peft.r,
                alpha: peft.lora_alpha,
                dropout: peft.lora_dropout,
                target_modules,
            },
            layers,
        })
    }
}

/// `...layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>[.<adapter>].weight` -> (i, proj, is_a).
fn parse_peft_name(name: &str) -> Option<(usize, Proj, bool)> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    let mut parts = rest.split('.');
    let layer: usize = parts.next()?.parse().ok()?;
    let _block = parts.next()?;
    let proj = Proj::from_name(parts.next()?)?;
    let is_a = match parts.next()? {
        "lora_A" => true,
        "lora_B" => false,
        _ => return None,
    };
    Some((layer, proj, is_a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_peft_names() {
        assert_eq!(
            parse_peft_name("base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"),
            Some((3, Proj::Down, false))
        );
        assert_eq!(
            parse_peft_name("model.layers.0.self_attn.q_proj.lora_A.default.weight"),
            Some((0, Proj::Q, true))
        );
        assert_eq!(parse_peft_name("model.norm.weight"), None);
    }
}
