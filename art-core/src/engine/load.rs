//! Where models come from: a GGUF file, a Hugging Face model directory (config.json,
//! tokenizer.json, safetensors, possibly sharded), or the hub's cache laid out on disk.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use tokenizers::Tokenizer;

use super::config::{Architecture, ModelConfig};
use super::error::{EngineError, Result};
use super::hub;
use super::linear::Linear;
use super::model::{Model, WeightSource};
use super::tokenizer::{self, TokenizerInfo};

/// Where to load a model from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A `.gguf` file (weights, tokenizer and chat template in one).
    Gguf(PathBuf),
    /// A Hugging Face model directory: config.json, tokenizer.json, *.safetensors.
    HfDir(PathBuf),
    /// A repository in the Hugging Face hub cache (offline). `cache_dir: None` means the
    /// default cache ([`hub::default_cache_dir`]).
    HfCache {
        repo_id: String,
        revision: String,
        cache_dir: Option<PathBuf>,
    },
}

impl ModelSource {
    /// Reads a model spec as a user types it: a path to a `.gguf` file or a model directory,
    /// else a hub repository id `org/name`, optionally `org/name@revision`.
    pub fn parse(spec: &str) -> Self {
        let path = Path::new(spec);
        if path.is_file() {
            return ModelSource::Gguf(path.to_path_buf());
        }
        if path.is_dir() {
            return ModelSource::HfDir(path.to_path_buf());
        }
        let (repo_id, revision) = spec.split_once('@').unwrap_or((spec, "main"));
        ModelSource::HfCache {
            repo_id: repo_id.to_string(),
            revision: revision.to_string(),
            cache_dir: None,
        }
    }
}

/// How to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Compute dtype; `None` picks f32 on CPU and bf16 on CUDA.
    pub dtype: Option<DType>,
    /// For GGUF files, keep the quantized weights next to the dense ones for fast inference.
    pub keep_quantized: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            device: Device::Cpu,
            dtype: None,
            keep_quantized: true,
        }
    }
}

/// A model with its tokenizer, as loaded.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub info: TokenizerInfo,
    /// A display name (the file or directory name, or the repository id).
    pub name: String,
}

/// Loads a model from `source`.
pub fn load(source: &ModelSource, options: &LoadOptions) -> Result<LoadedModel> {
    let dtype = options.dtype.unwrap_or(if options.device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    });
    match source {
        ModelSource::Gguf(path) => load_gguf(path, options, dtype),
        ModelSource::HfDir(dir) => load_dir(dir, options, dtype),
        ModelSource::HfCache {
            repo_id,
            revision,
            cache_dir,
        } => {
            let cache = cache_dir.clone().unwrap_or_else(hub::default_cache_dir);
            let snapshot = hub::snapshot_dir(&cache, repo_id, revision)?;
            let mut loaded = load_dir(&snapshot, options, dtype)?;
            loaded.name = repo_id.clone();
            Ok(loaded)
        }
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// A directory with config.json is a Hugging Face model; one without it but with exactly one
/// `.gguf` file is that file.
fn load_dir(dir: &Path, options: &LoadOptions, dtype: DType) -> Result<LoadedModel> {
    if !dir.join("config.json").exists() {
        let ggufs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| EngineError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        return match ggufs.as_slice() {
            [one] => load_gguf(one, options, dtype),
            [] => Err(EngineError::NotFound {
                path: dir.join("config.json"),
                hint: "a model directory needs config.json, tokenizer.json and *.safetensors, \
                       or a single .gguf file"
                    .into(),
            }),
            _ => Err(EngineError::invalid(
                dir,
                format!(
                    "{} .gguf files; pass the path of the one to load",
                    ggufs.len()
                ),
            )),
        };
    }
    let config_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| EngineError::io(&config_path, e))?;
    let config = ModelConfig::from_hf_json(&config_path, &text)?;
    let (tokenizer, info) = tokenizer::from_hf_dir(dir)?;
    let mut weights = SafetensorsWeights::open(dir, &options.device, dtype)?;
    let model = Model::load(&config, &mut weights, &options.device)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        info,
        name: file_name(dir),
    })
}

/// The safetensors files of a model directory: those named in `model.safetensors.index.json`
/// when it exists (sharded checkpoints), else `model.safetensors`, else every `*.safetensors`.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| EngineError::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| EngineError::invalid(&index, e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| EngineError::invalid(&index, "no weight_map object"))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    all.sort();
    if all.is_empty() {
        return Err(EngineError::NotFound {
            path: single,
            hint: "the directory has no *.safetensors weights".into(),
        });
    }
    Ok(all)
}

/// Named dense tensors in memory, cast to the compute dtype as the model takes them.
pub(crate) struct MapWeights {
    tensors: HashMap<String, Tensor>,
    dtype: DType,
}

type SafetensorsWeights = MapWeights;

impl MapWeights {
    pub(crate) fn new(tensors: HashMap<String, Tensor>, dtype: DType) -> Self {
        MapWeights { tensors, dtype }
    }

    fn open(dir: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in safetensors_files(dir)? {
            if !file.exists() {
                return Err(EngineError::NotFound {
                    path: file,
                    hint: "a shard named in model.safetensors.index.json is missing".into(),
                });
            }
            let loaded = candle_core::safetensors::load(&file, device)
                .map_err(|e| EngineError::invalid(&file, e.to_string()))?;
            tensors.extend(loaded);
        }
        Ok(SafetensorsWeights { tensors, dtype })
    }
}

impl WeightSource for MapWeights {
    fn tensor(&mut self, name: &str) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            EngineError::Weights(format!("the safetensors files have no tensor `{name}`"))
        })?;
        Ok(t.to_dtype(self.dtype)?)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn linear(&mut self, prefix: &str, bias: bool) -> Result<Linear> {
        let w = self.tensor(&format!("{prefix}.weight"))?;
        let b = if bias {
            Some(self.tensor(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        Ok(Linear::new(w, b))
    }
}

fn load_gguf(path: &Path, options: &LoadOptions, dtype: DType) -> Result<LoadedModel> {
    if !path.exists() {
        return Err(EngineError::NotFound {
            path: path.to_path_buf(),
            hint: "for the default model run scripts/fetch-models.sh".into(),
        });
    }
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| EngineError::invalid(path, format!("not a readable GGUF file: {e}")))?;
    let config = ModelConfig::from_gguf(path, &content)?;
    let (tokenizer, info) = tokenizer::from_gguf(path, &content)?;
    let mut weights = GgufWeights {
        path: path.to_path_buf(),
        content,
        reader,
        device: options.device.clone(),
        dtype,
        keep_quantized: options.keep_quantized,
        config: config.clone(),
    };
    let model = Model::load(&config, &mut weights, &options.device)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        info,
        name: file_name(path),
    })
}

struct GgufWeights {
    path: PathBuf,
    content: gguf_file::Content,
    reader: BufReader<File>,
    device: Device,
    dtype: DType,
    keep_quantized: bool,
    config: ModelConfig,
}

/// Hugging Face tensor name -> llama.cpp's GGUF name.
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// llama.cpp's converter reorders the rows of attn_q / attn_k of llama-architecture models so
/// that RoPE can rotate interleaved pairs. For row `r = head*d + j*(d/2) + i` of the original
/// (Hugging Face) weight this returns the GGUF row it was moved to, `head*d + 2i + j`.
fn unpermute_rows(rows: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..rows)
        .map(|r| {
            let (head, rem) = (r / head_dim, r % head_dim);
            let (j, i) = (rem / half, rem % half);
            head * head_dim + 2 * i + j
        })
        .collect()
}

impl GgufWeights {
    fn qtensor(&mut self, hf: &str) -> Result<QTensor> {
        let name = gguf_name(hf)
            .ok_or_else(|| EngineError::Weights(format!("no GGUF name for tensor `{hf}`")))?;
        if !self.content.tensor_infos.contains_key(&name) {
            return Err(EngineError::Weights(format!(
                "{} has no tensor `{name}` (for `{hf}`)",
                self.path.display()
            )));
        }
        let q = self
            .content
            .tensor(&mut self.reader, &name, &self.device)
            .map_err(|e| EngineError::invalid(&self.path, format!("tensor `{name}`: {e}")))?;
        if self.needs_unpermute(hf) {
            return self.unpermute(q);
        }
        Ok(q)
    }

    fn needs_unpermute(&self, hf: &str) -> bool {
        self.config.architecture == Architecture::Llama
            && (hf.contains("self_attn.q_proj") || hf.contains("self_attn.k_proj"))
    }

    /// Undoes llama.cpp's q/k row permutation on the quantized data itself (rows are quantized
    /// independently, so moving whole rows of blocks is exact).
    fn unpermute(&self, q: QTensor) -> Result<QTensor> {
        let dims = q.shape().dims().to_vec();
        let rows = dims[0];
        let perm = unpermute_rows(rows, self.config.head_dim);
        let dtype = q.dtype();
        let data = q.data()?;
        let row_bytes = data.len() / rows;
        let mut out = Vec::with_capacity(data.len());
        for &src in &perm {
            out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
        }
        let storage = QStorage::from_data(Cow::Owned(out), &self.device, dtype)?;
        Ok(QTensor::new(storage, dims)?)
    }
}

impl WeightSource for GgufWeights {
    fn tensor(&mut self, name: &str) -> Result<Tensor> {
        let q = self.qtensor(name)?;
        Ok(q.dequantize(&self.device)?.to_dtype(self.dtype)?)
    }

    fn has(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.content.tensor_infos.contains_key(&g))
    }

    fn linear(&mut self, prefix: &str, bias: bool) -> Result<Linear> {
        let q = Arc::new(self.qtensor(&format!("{prefix}.weight"))?);
        let b = if bias {
            Some(self.tensor(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        Linear::from_qtensor(q, b, &self.device, self.dtype, self.keep_quantized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2): gguf row (h, i, j) holds
        // original row (h, j, i).
        let (heads, d) = (2, 8);
        let original: Vec<usize> = (0..heads * d).collect();
        let mut gguf = vec![0; heads * d];
        for h in 0..heads {
            for i in 0..d / 2 {
                for j in 0..2 {
                    gguf[h * d + i * 2 + j] = original[h * d + j * (d / 2) + i];
                }
            }
        }
        let perm = unpermute_rows(heads * d, d);
        let restored: Vec<usize> = perm.iter().map(|&src| gguf[src]).collect();
        assert_eq!(restored, original);
    }
}
