//! Inference replicas: the model loaded once per device, each copy with its own scheduler (its own
//! key/value caches and batch), behind one endpoint. A request goes to the replica its prompt
//! hashes to, so that the rollouts of a group (one prompt, many requests) share one prefix cache,
//! unless that replica is busier than the least busy by more than a batch's worth; a replica
//! whose batching thread has stopped gets nothing. The first replica is the trainer's: LoRA
//! adapters are registered there, and every other replica mirrors its adapters. Other replicas
//! may train with it (data-parallel ranks: `train::DataParallel`); training replicas may be kept
//! out of serving (dedicated training devices), so that sampling on the others goes on while
//! they train.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::engine::{Engine, GenerationRequest};

use super::batcher::Batcher;
use super::error::ApiError;

/// How many more sequences than the least busy replica a prompt's own replica may have before a
/// request goes to the least busy instead: about one decode batch of a GRPO step's group.
const AFFINITY_SLACK: u64 = 64;

/// One copy of the model on one device, with its batching thread.
pub struct Replica {
    /// The device, as the command line named it (`cpu`, `cuda:1`).
    pub device: String,
    pub engine: Arc<Engine>,
    pub batcher: Batcher,
    /// Whether requests are routed here (a training replica may only train).
    pub serves: bool,
    /// Whether this copy of the model trains (the first replica always; others as ranks of
    /// data-parallel training).
    pub trains: bool,
    /// The primary's adapter each mirrored name was copied from (its address: a name such as a
    /// model's latest step is set to a new adapter every step).
    mirrored: Mutex<HashMap<String, usize>>,
}

impl Replica {
    pub fn new(
        device: String,
        engine: Arc<Engine>,
        batcher: Batcher,
        serves: bool,
        trains: bool,
    ) -> Self {
        Replica {
            device,
            engine,
            batcher,
            serves,
            trains,
            mirrored: Mutex::new(HashMap::new()),
        }
    }

    /// Whether requests can be routed here now.
    fn takes_requests(&self) -> bool {
        self.serves && self.batcher.is_running()
    }

    /// Sequences running or queued here, requests not yet admitted included.
    fn load(&self) -> u64 {
        self.batcher.stats().sequences() + self.batcher.queued() as u64
    }
}

/// The replicas; the first is the trainer's.
pub struct Replicas {
    all: Vec<Replica>,
}

impl Replicas {
    pub fn new(all: Vec<Replica>) -> Self {
        assert!(
            all.iter().any(|r| r.serves),
            "at least one replica serves requests"
        );
        Replicas { all }
    }

    /// The trainer's replica (where adapters are trained and registered).
    pub fn primary(&self) -> &Replica {
        &self.all[0]
    }

    /// Where `request` runs: its prompt's replica (by a hash of its adapter and prompt), or the
    /// least busy one when that one is busier by more than [`AFFINITY_SLACK`] sequences or has
    /// stopped. The replica has the request's adapter when this returns. A 503 when no replica
    /// runs.
    pub fn route(&self, request: &GenerationRequest) -> Result<&Replica, ApiError> {
        let Some(least) = self
            .all
            .iter()
            .filter(|r| r.takes_requests())
            .min_by_key(|r| r.load())
        else {
            return Err(ApiError::unavailable(
                "no inference replica is running (see /health)",
            ));
        };
        let serving: Vec<&Replica> = self.all.iter().filter(|r| r.serves).collect();
        let mut hasher = DefaultHasher::new();
        (&request.adapter, &request.prompt).hash(&mut hasher);
        let own = serving[(hasher.finish() % serving.len() as u64) as usize];
        let replica = if own.takes_requests() && own.load() <= least.load() + AFFINITY_SLACK {
            own
        } else {
            least
        };
        self.mirror_adapters(replica).map_err(|e| {
            ApiError::internal(format!("copying adapters to {}: {e}", replica.device))
        })?;
        Ok(replica)
    }

    /// Makes every replica's adapters the primary's (copied to its device); the trainer calls
    /// this before it answers, so that a new `name@step` is on every replica when the client
    /// learns of it.
    pub fn mirror_all(&self) -> crate::engine::Result<()> {
        self.all.iter().try_for_each(|r| self.mirror_adapters(r))
    }

    /// Makes `replica`'s adapters the primary's: copies what is new or changed there, drops what
    /// the primary no longer has.
    fn mirror_adapters(&self, replica: &Replica) -> crate::engine::Result<()> {
        let primary = &self.primary().engine;
        if Arc::ptr_eq(primary, &replica.engine) {
            return Ok(());
        }
        let mut mirrored = replica.mirrored.lock().expect("mirror map poisoned");
        let names = primary.adapter_names();
        for name in &names {
            let Some(adapter) = primary.adapter(name) else {
                continue; // removed meanwhile
            };
            let source = Arc::as_ptr(&adapter) as usize;
            if mirrored.get(name) == Some(&source) {
                continue;
            }
            let copy = adapter.to_device(replica.engine.device())?;
            replica.engine.set_adapter(name.clone(), Arc::new(copy))?;
            mirrored.insert(name.clone(), source);
        }
        mirrored.retain(|name, _| {
            let keep = names.contains(name);
            if !keep {
                replica.engine.remove_adapter(name);
            }
            keep
        });
        Ok(())
    }

    /// What `/health` says of the replicas.
    pub fn health(&self) -> Health {
        let serving = self.all.iter().filter(|r| r.serves).count();
        let running = self.all.iter().filter(|r| r.takes_requests()).count();
        let batches: Vec<Value> = self
            .all
            .iter()
            .map(|r| r.batcher.stats().to_json())
            .collect();
        Health {
            status: match running {
                0 => "unavailable",
                n if n < serving => "degraded",
                _ => "ok",
            },
            batch: summed(&batches),
            replicas: self
                .all
                .iter()
                .zip(batches)
                .map(|(r, batch)| {
                    let role = match (r.trains, r.serves) {
                        (true, true) => "train+inference",
                        (true, false) => "train",
                        _ => "inference",
                    };
                    json!({
                        "device": r.device,
                        "role": role,
                        "status": if r.batcher.is_running() { "ok" } else { "stopped" },
                        "batch": batch,
                    })
                })
                .collect(),
        }
    }
}

/// The replicas' state for `/health`.
pub struct Health {
    /// `ok`, `degraded` (some replica stopped, the others serve) or `unavailable`.
    pub status: &'static str,
    /// Every replica's batch figures added up.
    pub batch: Value,
    /// Each replica's device, role (`train+inference`, `train`, `inference`), status (`ok` or
    /// `stopped`) and batch.
    pub replicas: Vec<Value>,
}

/// The objects' numeric fields added up (whole numbers stay whole).
fn summed(objects: &[Value]) -> Value {
    let mut sum = serde_json::Map::new();
    for object in objects.iter().filter_map(Value::as_object) {
        for (key, value) in object {
            let total = match (sum.get(key), value) {
                (None, v) => v.clone(),
                (Some(Value::Number(a)), Value::Number(b)) => match (a.as_u64(), b.as_u64()) {
                    (Some(a), Some(b)) => json!(a + b),
                    _ => {
                        let total = a.as_f64().unwrap_or(0.0) + b.as_f64().unwrap_or(0.0);
                        json!((total * 100.0).round() / 100.0)
                    }
                },
                (Some(other), _) => other.clone(),
            };
            sum.insert(key.clone(), total);
        }
    }
    Value::Object(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::random::RandomModelSpec;
    use crate::engine::{
        Architecture, LoadOptions, LoraAdapter, ModelSource, SamplingParams, Tensor,
    };
    use crate::server::SchedulerLimits;
    use crate::types::LoraConfig;

    fn replica(engine: &Arc<Engine>) -> Replica {
        let batcher = Batcher::start(engine.clone(), 8, 8, SchedulerLimits::default());
        Replica::new("cpu".into(), engine.clone(), batcher, true, false)
    }

    /// An adapter whose `B`s are not zero (so that it changes the model's output).
    fn adapter(engine: &Engine, seed: u64) -> Arc<LoraAdapter> {
        let adapter = LoraAdapter::new(
            engine.config(),
            &LoraConfig::default(),
            engine.device(),
            seed,
        )
        .unwrap();
        for (name, var) in adapter.named_vars() {
            if name.contains("lora_B") {
                let n = var.elem_count();
                let values: Vec<f32> = (0..n)
                    .map(|i| ((i * 7 + seed as usize) % 13) as f32 / 40.0 - 0.15)
                    .collect();
                var.set(&Tensor::from_vec(values, var.shape(), var.device()).unwrap())
                    .unwrap();
            }
        }
        Arc::new(adapter)
    }

    fn weights(adapter: &LoraAdapter) -> Vec<Vec<f32>> {
        adapter
            .named_vars()
            .iter()
            .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    }

    fn request(prompt: Vec<u32>, adapter: Option<&str>) -> GenerationRequest {
        GenerationRequest {
            prompt,
            params: SamplingParams::greedy(6),
            adapter: adapter.map(String::from),
        }
    }

    /// Two replicas of the tiny model on the CPU: the second mirrors the first's adapters (the
    /// same weights to the bit, the same greedy tokens), follows a step's changes (a new
    /// `name@step`, the latest name moved to it, the old step removed), and requests route by
    /// prompt (one prompt always to one replica; several prompts reach both). ~0.2 s.
    #[test]
    fn replicas_mirror_the_trainers_adapters_and_route_by_prompt() {
        let dir = tempfile::tempdir().unwrap();
        RandomModelSpec::tiny(Architecture::Qwen2)
            .write(dir.path(), 42)
            .unwrap();
        let load = || {
            let source = ModelSource::HfDir(dir.path().to_path_buf());
            Arc::new(Engine::load(&source, &LoadOptions::default()).unwrap())
        };
        let (primary, other) = (load(), load());
        let replicas = Replicas::new(vec![replica(&primary), replica(&other)]);

        let first = adapter(&primary, 1);
        primary.set_adapter("m@1", first.clone()).unwrap();
        primary.set_adapter("m", first.clone()).unwrap();
        replicas.mirror_all().unwrap();
        for name in ["m@1", "m"] {
            let copy = other.adapter(name).expect("mirrored");
            assert!(!Arc::ptr_eq(&copy, &first), "a copy, not the trainer's own");
            assert_eq!(weights(&copy), weights(&first), "{name}");
        }
        let prompt = vec![3u32, 14, 15, 92, 65];
        let tokens = |engine: &Engine, adapter| {
            engine
                .generate(vec![request(prompt.clone(), adapter)])
                .unwrap()[0]
                .completions[0]
                .token_ids()
        };
        assert_eq!(tokens(&other, Some("m@1")), tokens(&primary, Some("m@1")));
        assert_ne!(
            tokens(&primary, Some("m@1")),
            tokens(&primary, None),
            "the adapter matters"
        );

        let second = adapter(&primary, 2);
        primary.set_adapter("m@2", second.clone()).unwrap();
        primary.set_adapter("m", second.clone()).unwrap();
        primary.remove_adapter("m@1");
        replicas.mirror_all().unwrap();
        assert!(other.adapter("m@1").is_none(), "a removed step is dropped");
        assert_eq!(weights(&other.adapter("m@2").unwrap()), weights(&second));
        assert_eq!(
            weights(&other.adapter("m").unwrap()),
            weights(&second),
            "the latest moved"
        );

        let routed = |prompt: Vec<u32>| {
            let replica = replicas.route(&request(prompt, Some("m"))).unwrap();
            Arc::as_ptr(&replica.engine)
        };
        let own = routed(prompt.clone());
        assert!(
            (0..8).all(|_| routed(prompt.clone()) == own),
            "one prompt, one replica"
        );
        let reached: std::collections::HashSet<_> =
            (0..32u32).map(|k| routed(vec![k, k + 1, k + 2])).collect();
        assert_eq!(reached.len(), 2, "prompts spread over both replicas");
        assert_eq!(replicas.health().status, "ok");
    }
}
