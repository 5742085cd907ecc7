//! A line of a model's history (history.jsonl): the metrics of one split at one step, as the
//! store records them and the history API returns them. The file format itself (ART's flat
//! `"train/reward"` keys) is the store's business (`store/history.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The metrics of one split at one step. On the wire (`GET /v1/art/models/{name}/history`) it is
/// this struct as JSON; in history.jsonl it is ART's flat line (see [`HistoryEntry::to_json_line`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub step: u64,
    /// "train", "val", ... (empty for un-namespaced keys of a line without a `"split"` field).
    pub split: String,
    /// Metric name (without the split prefix) -> value. Only finite values: the store leaves
    /// NaN and infinities out (JSON has no such numbers).
    pub metrics: BTreeMap<String, f64>,
    /// RFC 3339 UTC time the entry was written, when known.
    #[serde(default)]
    pub recorded_at: Option<String>,
}

impl HistoryEntry {
    pub fn new(step: u64, split: impl Into<String>) -> Self {
        HistoryEntry {
            step,
            split: split.into(),
            metrics: BTreeMap::new(),
            recorded_at: None,
        }
    }

    pub fn get(&self, metric: &str) -> Option<f64> {
        self.metrics.get(metric).copied()
    }
}

/// Which way is better for the metric that picks the best checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricGoal {
    /// Higher is better (rewards, accuracy).
    #[default]
    Maximize,
    /// Lower is better (losses, error rates).
    Minimize,
}

/// Mean and (population) standard deviation; `None` for no values.
pub(crate) fn mean_std(values: &[f64]) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    Some((mean, var.sqrt()))
}
