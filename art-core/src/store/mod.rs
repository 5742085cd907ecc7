//! A model's directory, laid out as OpenPipe ART lays it out so that either can read the other's:
//!
//! ```text
//! <art_dir>/<project>/models/<name>/
//!   model.json                              name, project (and whatever the trainer adds)
//!   history.jsonl                           one line per logged step and split
//!   trajectories/<split>/<step:04>.parquet  one row per trajectory (see `frames`)
//!   checkpoints/<step:04>/                  written by the trainer; listed and pruned here
//! ```
//!
//! Every file is replaced atomically (temp file, fsync, rename), so a crash leaves the previous
//! state readable. Appends to history.jsonl hold an advisory lock (`.history.lock`), so a client
//! logging rollouts and a local `art serve` appending training metrics do not lose each other's
//! lines.
//!
//! In the split architecture this directory lives with the backend (`art serve --art-dir`, next
//! to the checkpoints): `TrainableModel::log` and `history` go through the backend's
//! `/v1/art/models/{name}/log` and `/history`, which use this module. A notebook with a local
//! backend may also open the directory itself ([`ModelStore::open`]) to read what was logged.
//!
//! The directory, model.json, history.jsonl and checkpoints need no extra dependency; writing and
//! reading the trajectories parquet needs the `frames` feature (polars), which `server` enables.

pub(crate) mod history;
pub mod metrics;
pub mod tensorboard;

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{json, Value};

#[cfg(feature = "frames")]
use crate::frames::{self, DataFrame, FrameError};
use crate::fsutil::{remove_stale_temps, write_atomic_with, FaultInjector, TEMP_PREFIX};
#[cfg(feature = "frames")]
use crate::types::TrajectoryGroup;
use crate::types::{check_name, InvalidName};
pub use crate::types::{HistoryEntry, LoggedMetrics, MetricGoal};
pub use metrics::batch_metrics;

/// The directory ART uses when none is given (relative to the working directory).
pub const DEFAULT_ART_DIR: &str = ".art";

/// The art directory to use when none is given: `$ART_DIR` when set, else [`DEFAULT_ART_DIR`].
pub fn default_art_dir() -> PathBuf {
    std::env::var_os("ART_DIR")
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_ART_DIR), PathBuf::from)
}

/// Serializes read-modify-write of history files within this process (the file lock does it
/// across processes).
static HISTORY_LOCK: Mutex<()> = Mutex::new(());

/// What went wrong with a model's directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    InvalidName(#[from] InvalidName),
    #[error("could not {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("line {line} of {path} is not a history entry ({problem}); fix or delete that line")]
    CorruptHistory {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("{path} is not valid JSON ({source}); fix or delete it")]
    CorruptModelJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(
        "no metric {metric:?} in the history (logged: {available}); log it first or name one of \
         those (with or without a `val/`/`train/` prefix)"
    )]
    MetricNotFound { metric: String, available: String },
    #[cfg(feature = "frames")]
    #[error(transparent)]
    Frame(#[from] FrameError),
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// A model's directory under an ART directory.
#[derive(Debug, Clone)]
pub struct ModelStore {
    dir: PathBuf,
    project: String,
    name: String,
    faults: FaultInjector,
}

impl ModelStore {
    /// Opens (creating as needed) `<art_dir>/<project>/models/<name>/` and its model.json.
    pub fn open(art_dir: impl AsRef<Path>, project: &str, name: &str) -> Result<Self, StoreError> {
        check_name("project", project)?;
        check_name("name", name)?;
        let dir = art_dir.as_ref().join(project).join("models").join(name);
        fs::create_dir_all(&dir).map_err(io_error("create", &dir))?;
        let store = ModelStore {
            dir,
            project: project.to_string(),
            name: name.to_string(),
            faults: FaultInjector::default(),
        };
        // Temp files of writes a crash interrupted are garbage: the old files are intact.
        store.remove_stale_temps()?;
        let model_json = store.model_json_path();
        if !model_json.exists() {
            store.set_model_info(json!({}))?;
        }
        Ok(store)
    }

    fn remove_stale_temps(&self) -> Result<(), StoreError> {
        remove_stale_temps(&self.dir).map_err(io_error("clean", &self.dir))?;
        let trajectories = self.dir.join("trajectories");
        let splits = match fs::read_dir(&trajectories) {
            Ok(splits) => splits,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error("list", &trajectories)(e)),
        };
        for split in splits.flatten() {
            let dir = split.path();
            if dir.is_dir() {
                remove_stale_temps(&dir).map_err(io_error("clean", &dir))?;
            }
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn project(&self) -> &str {
        &self.project
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn model_json_path(&self) -> PathBuf {
        self.dir.join("model.json")
    }

    pub fn history_path(&self) -> PathBuf {
        self.dir.join("history.jsonl")
    }

    /// `trajectories/<split>/<step:04>.parquet`.
    pub fn trajectories_path(&self, split: &str, step: u64) -> PathBuf {
        self.dir
            .join("trajectories")
            .join(split)
            .join(format!("{step:04}.parquet"))
    }

    /// `checkpoints/<step:04>/`, where the trainer writes the LoRA of that step.
    pub fn checkpoint_dir(&self, step: u64) -> PathBuf {
        self.dir.join("checkpoints").join(format!("{step:04}"))
    }

    /// The contents of model.json.
    pub fn model_info(&self) -> Result<Value, StoreError> {
        let path = self.model_json_path();
        let text = fs::read_to_string(&path).map_err(io_error("read", &path))?;
        serde_json::from_str(&text).map_err(|source| StoreError::CorruptModelJson { path, source })
    }

    /// Replaces model.json with `info` (an object; `name` and `project` are always set to this
    /// store's).
    pub fn set_model_info(&self, info: Value) -> Result<(), StoreError> {
        let mut object = match info {
            Value::Object(object) => object,
            other => {
                let mut object = serde_json::Map::new();
                object.insert("config".into(), other);
                object
            }
        };
        object.insert("name".into(), Value::from(self.name.clone()));
        object.insert("project".into(), Value::from(self.project.clone()));
        let path = self.model_json_path();
        let text = serde_json::to_string_pretty(&Value::Object(object)).expect("JSON value");
        write_atomic_with(&path, text.as_bytes(), &self.faults).map_err(io_error("write", &path))
    }

    /// Records a batch of groups as `split` at `step`: writes its trajectories parquet, then
    /// appends its metrics (see [`batch_metrics`]) to history.jsonl. Logging the same split and
    /// step again replaces the parquet and adds a second history line.
    #[cfg(feature = "frames")]
    pub fn log(
        &self,
        groups: &[TrajectoryGroup],
        split: &str,
        step: u64,
    ) -> Result<LoggedMetrics, StoreError> {
        check_name("split", split)?;
        let path = self.trajectories_path(split, step);
        let dir = path.parent().expect("a split directory");
        fs::create_dir_all(dir).map_err(io_error("create", dir))?;
        let bytes = frames::trajectories_parquet(groups)?;
        write_atomic_with(&path, &bytes, &self.faults).map_err(io_error("write", &path))?;
        let entry = self.append_history(step, split, batch_metrics(groups))?;
        Ok(LoggedMetrics {
            entry,
            trajectories_path: path,
        })
    }

    /// Appends one line to history.jsonl: `metrics` of `split` at `step`, written as ART writes
    /// them (`{"step": 3, "split": "train", "train/loss": 0.25, ..., "recorded_at": "..."}`).
    /// What a training step records (`loss`, `grad_norm`, ...) after `model.log` recorded its
    /// rollouts. Non-finite values are left out (JSON has no NaN).
    pub fn append_history<K: Into<String>>(
        &self,
        step: u64,
        split: &str,
        metrics: impl IntoIterator<Item = (K, f64)>,
    ) -> Result<HistoryEntry, StoreError> {
        check_name("split", split)?;
        let entry = HistoryEntry {
            step,
            split: split.to_string(),
            metrics: metrics
                .into_iter()
                .map(|(k, v)| (k.into(), v))
                .filter(|(_, v)| v.is_finite())
                .collect(),
            recorded_at: Some(history::now_rfc3339()),
        };
        let path = self.history_path();
        let _guard = HISTORY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let lock_path = self.dir.join(".history.lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_error("open", &lock_path))?;
        // Released when `lock` is dropped, after the rename.
        lock.lock().map_err(io_error("lock", &lock_path))?;
        let mut text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io_error("read", &path)(e)),
        };
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&entry.to_json_line());
        text.push('\n');
        write_atomic_with(&path, text.as_bytes(), &self.faults)
            .map_err(io_error("write", &path))?;
        if tensorboard::enabled() {
            // The curves are a view of the history: a failure to write them is reported (once
            // per process) and never fails the history append or the step that called it.
            let entries: Vec<HistoryEntry> = history::parse_lines(&text)
                .filter_map(|(_, parsed)| parsed.ok())
                .flatten()
                .collect();
            if let Err(e) = tensorboard::sync(&self.dir, &entries) {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    eprintln!(
                        "art: could not write the TensorBoard events of {}: {e} (history.jsonl is \
                         complete; set ART_TENSORBOARD=0 to stop writing them)",
                        self.dir.display()
                    )
                });
            }
        }
        Ok(entry)
    }

    /// Every entry of history.jsonl, in file order (empty when nothing was logged yet).
    pub fn history(&self) -> Result<Vec<HistoryEntry>, StoreError> {
        let path = self.history_path();
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("read", &path)(e)),
        };
        let mut entries = Vec::new();
        for (line, parsed) in history::parse_lines(&text) {
            entries.extend(parsed.map_err(|problem| StoreError::CorruptHistory {
                path: path.clone(),
                line,
                problem,
            })?);
        }
        Ok(entries)
    }

    /// The history as a DataFrame (see [`frames::history_frame`]).
    #[cfg(feature = "frames")]
    pub fn history_frame(&self) -> Result<DataFrame, StoreError> {
        Ok(frames::history_frame(&self.history()?)?)
    }

    /// The steps that have a trajectories file for `split`, ascending.
    pub fn trajectory_steps(&self, split: &str) -> Result<Vec<u64>, StoreError> {
        let dir = self.dir.join("trajectories").join(split);
        numbered_entries(&dir, ".parquet").map(|entries| entries.into_keys().collect())
    }

    /// The trajectories logged for `split` at `step`, as the full table.
    #[cfg(feature = "frames")]
    pub fn read_trajectories(&self, split: &str, step: u64) -> Result<DataFrame, StoreError> {
        Ok(frames::read_parquet(self.trajectories_path(split, step))?)
    }

    /// The groups logged for `split` at `step`, rebuilt from their parquet file.
    #[cfg(feature = "frames")]
    pub fn read_trajectory_groups(
        &self,
        split: &str,
        step: u64,
    ) -> Result<Vec<TrajectoryGroup>, StoreError> {
        Ok(frames::read_trajectory_groups(
            self.trajectories_path(split, step),
        )?)
    }

    /// The steps that have a checkpoint directory, ascending.
    pub fn checkpoints(&self) -> Result<Vec<u64>, StoreError> {
        numbered_entries(&self.dir.join("checkpoints"), "").map(|e| e.into_keys().collect())
    }

    /// The newest checkpoint's step, `None` before the first one.
    pub fn latest_step(&self) -> Result<Option<u64>, StoreError> {
        Ok(self.checkpoints()?.last().copied())
    }

    /// ART's `get_step`: the newest checkpoint's step, 0 before the first one.
    pub fn get_step(&self) -> Result<u64, StoreError> {
        Ok(self.latest_step()?.unwrap_or(0))
    }

    /// Deletes every checkpoint except the latest and the best by `best_metric` (see
    /// [`best_step`]), returning the deleted steps. Errors, deleting nothing, when no split ever
    /// logged the metric (a typo would otherwise delete the best checkpoint). A backend prunes
    /// through its trainer instead (which also stops serving what it deletes), with the same
    /// choice of best step.
    pub fn delete_checkpoints(
        &self,
        best_metric: &str,
        goal: MetricGoal,
    ) -> Result<Vec<u64>, StoreError> {
        let dirs = numbered_entries(&self.dir.join("checkpoints"), "")?;
        let Some(&latest) = dirs.keys().last() else {
            return Ok(Vec::new());
        };
        let steps: Vec<u64> = dirs.keys().copied().collect();
        let best = best_step(&self.history()?, best_metric, goal, &steps)?;
        let mut deleted = Vec::new();
        for (step, path) in dirs {
            if step == latest || Some(step) == best {
                continue;
            }
            fs::remove_dir_all(&path).map_err(io_error("delete", &path))?;
            deleted.push(step);
        }
        Ok(deleted)
    }

    /// Testing aid: the next write of the file named `file_name` (`history.jsonl`,
    /// `0003.parquet`, ...) fails after its temp file is written and synced but before the rename,
    /// as a crash at that moment would. Shared with clones of this store.
    #[doc(hidden)]
    pub fn inject_failure_before_rename(&self, file_name: &str) {
        self.faults.arm(file_name);
    }
}

/// The best of `steps` by `best_metric` in `history`: ART's `best_checkpoint_metric`. The metric
/// is looked up in the `val` split, else `train`; name a split explicitly as ART does
/// (`"val/reward"`). Several entries of the split at one step are averaged; among equally good
/// steps the later wins. `Ok(None)` when none of `steps` has the metric; an error when no entry
/// of the history has it at all (most likely a misspelt name).
pub fn best_step(
    history: &[HistoryEntry],
    best_metric: &str,
    goal: MetricGoal,
    steps: &[u64],
) -> Result<Option<u64>, StoreError> {
    let (splits, metric): (Vec<&str>, &str) = match best_metric.split_once('/') {
        Some((split, metric)) => (vec![split], metric),
        None => (vec!["val", "train"], best_metric),
    };
    let logged = |split: &str| {
        history
            .iter()
            .any(|e| e.split == split && e.get(metric).is_some())
    };
    let Some(split) = splits.into_iter().find(|s| logged(s)) else {
        let available: Vec<String> = history
            .iter()
            .flat_map(|e| e.metrics.keys().map(move |k| format!("{}/{k}", e.split)))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        return Err(StoreError::MetricNotFound {
            metric: best_metric.to_string(),
            available: if available.is_empty() {
                "nothing yet".into()
            } else {
                available.join(", ")
            },
        });
    };
    let mut by_step: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    for entry in history.iter().filter(|e| e.split == split) {
        if let (Some(value), true) = (entry.get(metric), steps.contains(&entry.step)) {
            let sum = by_step.entry(entry.step).or_default();
            sum.0 += value;
            sum.1 += 1;
        }
    }
    let score = |&(sum, n): &(f64, usize)| {
        let mean = sum / n as f64;
        match goal {
            MetricGoal::Maximize => mean,
            MetricGoal::Minimize => -mean,
        }
    };
    // Iterating ascending and keeping ties (>=) keeps the later of equally good steps.
    Ok(by_step
        .iter()
        .filter(|(_, s)| !score(s).is_nan())
        .fold(None::<(u64, f64)>, |best, (&step, s)| match best {
            Some((_, b)) if score(s) < b => best,
            _ => Some((step, score(s))),
        })
        .map(|(step, _)| step))
}

/// Entries of `dir` named `<digits><suffix>` (temp files skipped), by number.
fn numbered_entries(dir: &Path, suffix: &str) -> Result<BTreeMap<u64, PathBuf>, StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(io_error("list", dir)(e)),
    };
    let mut out = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(io_error("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(TEMP_PREFIX) {
            continue;
        }
        let Some(number) = name.strip_suffix(suffix) else {
            continue;
        };
        if !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(step) = number.parse() {
                out.insert(step, entry.path());
            }
        }
    }
    Ok(out)
}
