//! The logging API's wire format (`/v1/art/models/{name}/log`, `/history`, `/trajectories`): what
//! a client sends to record rollouts in the model's directory on the backend, and what it reads
//! back. Engine-free, like the rest of `types`.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::HistoryEntry;
use super::TrajectoryGroup;

/// Which set of rollouts a batch is: `train` (what the model trains on), `val` (held-out
/// evaluation, what the best checkpoint is usually chosen by), or any other name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Split {
    Train,
    Val,
    /// Any other split (`"test"`, `"eval-hard"`, ...); a single directory name.
    Other(String),
}

impl Split {
    pub fn as_str(&self) -> &str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
            Split::Other(name) => name,
        }
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<String> for Split {
    fn from(name: String) -> Self {
        match name.as_str() {
            "train" => Split::Train,
            "val" => Split::Val,
            _ => Split::Other(name),
        }
    }
}

impl From<&str> for Split {
    fn from(name: &str) -> Self {
        Split::from(name.to_string())
    }
}

impl From<Split> for String {
    fn from(split: Split) -> Self {
        match split {
            Split::Other(name) => name,
            known => known.as_str().to_string(),
        }
    }
}

/// `POST /v1/art/models/{name}/log`: record these groups as `split` at the model's current step.
/// The answer is the [`LoggedMetrics`] the backend appended to history.jsonl.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRequest {
    pub trajectory_groups: Vec<TrajectoryGroup>,
    pub split: Split,
}

/// `GET /v1/art/models/{name}/history`: every entry of the model's history.jsonl, in file order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryList {
    pub data: Vec<HistoryEntry>,
}

/// `GET /v1/art/models/{name}/trajectories/{split}/{step}`: the groups logged as `split` at
/// `step`, rebuilt from their trajectories file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrajectoryGroupList {
    pub data: Vec<TrajectoryGroup>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_plain_strings_on_the_wire() {
        assert_eq!(serde_json::to_string(&Split::Val).unwrap(), "\"val\"");
        assert_eq!(
            serde_json::from_str::<Split>("\"train\"").unwrap(),
            Split::Train
        );
        assert_eq!(
            serde_json::from_str::<Split>("\"test\"").unwrap(),
            Split::Other("test".into())
        );
        assert_eq!(Split::from("val"), Split::Val);
        assert_eq!(Split::Other("eval".into()).to_string(), "eval");
    }
}

/// What `ModelStore::log` (and `TrainableModel::log`, through the backend) recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedMetrics {
    /// The line appended to history.jsonl.
    pub entry: HistoryEntry,
    /// The parquet file the trajectories went to (on the backend's machine when logged through
    /// one).
    pub trajectories_path: PathBuf,
}

impl LoggedMetrics {
    pub fn get(&self, metric: &str) -> Option<f64> {
        self.entry.get(metric)
    }
}
