//! polars DataFrames of trajectory groups and training history: reward tables for notebooks, and
//! the columns of the trajectories parquet files that [`crate::store::ModelStore`] writes.
//!
//! One row per trajectory. Fixed columns first (`group_index`, `trajectory_index`, `reward`), then
//! one column per trajectory metric (`metric/<name>`), per trajectory metadata key
//! (`metadata/<name>`) and per group metadata key (`group_metadata/<name>`), then
//! `num_messages`, `completion_tokens` and `last_assistant`. The prefixes keep user-chosen names
//! from colliding with the fixed columns. A column's type follows its values: all booleans stay
//! booleans, all integers stay integers, mixed numbers become floats (true = 1), and anything
//! mixed with text becomes text.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Cursor;
use std::path::Path;

use polars_core::prelude::*;
use polars_io::prelude::*;

use crate::types::{
    mean_std, History, HistoryEntry, MessageOrChoice, MetadataValue, MetricValue, RolloutException,
    Tool, Trajectory, TrajectoryGroup,
};

pub use polars_core::frame::DataFrame;

/// Prefix of the columns holding trajectory metrics.
pub const METRIC_PREFIX: &str = "metric/";
/// Prefix of the columns holding trajectory metadata.
pub const METADATA_PREFIX: &str = "metadata/";
/// Prefix of the columns holding group metadata.
pub const GROUP_METADATA_PREFIX: &str = "group_metadata/";

/// What went wrong building or reading a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("polars failed: {0}")]
    Polars(#[from] PolarsError),
    #[error("could not read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a trajectories file written by art-core ({problem}); read it with \
         `read_trajectories` to see its columns"
    )]
    NotTrajectories { path: String, problem: String },
}

/// A cell of a dynamic (metric or metadata) column before its type is chosen.
#[derive(Clone)]
enum Cell {
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

impl From<&MetricValue> for Cell {
    fn from(value: &MetricValue) -> Self {
        match *value {
            MetricValue::Bool(b) => Cell::Bool(b),
            MetricValue::Int(i) => Cell::Int(i),
            MetricValue::Float(f) => Cell::Float(f),
        }
    }
}

fn metadata_cell(value: &MetadataValue) -> Option<Cell> {
    match value {
        MetadataValue::Null => None,
        MetadataValue::Bool(b) => Some(Cell::Bool(*b)),
        MetadataValue::Int(i) => Some(Cell::Int(*i)),
        MetadataValue::Float(f) => Some(Cell::Float(*f)),
        MetadataValue::Text(s) => Some(Cell::Text(s.clone())),
    }
}

impl Cell {
    fn as_f64(&self) -> f64 {
        match self {
            Cell::Bool(b) => f64::from(u8::from(*b)),
            Cell::Int(i) => *i as f64,
            Cell::Float(f) => *f,
            Cell::Text(_) => f64::NAN,
        }
    }

    fn as_text(&self) -> String {
        match self {
            Cell::Bool(b) => b.to_string(),
            Cell::Int(i) => i.to_string(),
            Cell::Float(f) => f.to_string(),
            Cell::Text(s) => s.clone(),
        }
    }
}

/// Builds one column from optional cells, choosing its type from the values (see the module doc).
fn dynamic_column(name: &str, cells: &[Option<Cell>]) -> Column {
    let present = || cells.iter().flatten();
    let name: PlSmallStr = name.into();
    if present().any(|c| matches!(c, Cell::Text(_))) || present().next().is_none() {
        let values: Vec<Option<String>> = cells
            .iter()
            .map(|c| c.as_ref().map(Cell::as_text))
            .collect();
        Column::new(name, values)
    } else if present().all(|c| matches!(c, Cell::Bool(_))) {
        let values: Vec<Option<bool>> = cells
            .iter()
            .map(|c| c.as_ref().map(|c| matches!(c, Cell::Bool(true))))
            .collect();
        Column::new(name, values)
    } else if present().all(|c| matches!(c, Cell::Int(_))) {
        let values: Vec<Option<i64>> = cells
            .iter()
            .map(|c| match c {
                Some(Cell::Int(i)) => Some(*i),
                _ => None,
            })
            .collect();
        Column::new(name, values)
    } else {
        let values: Vec<Option<f64>> = cells.iter().map(|c| c.as_ref().map(Cell::as_f64)).collect();
        Column::new(name, values)
    }
}

/// Columns named `prefix + key`, one per key any row has, in key order.
fn keyed_columns<'a>(
    prefix: &str,
    rows: impl Iterator<Item = BTreeMap<&'a str, Cell>>,
) -> Vec<Column> {
    let rows: Vec<BTreeMap<&str, Cell>> = rows.collect();
    let keys: BTreeSet<&str> = rows.iter().flat_map(|r| r.keys().copied()).collect();
    keys.into_iter()
        .map(|key| {
            let cells: Vec<Option<Cell>> = rows.iter().map(|r| r.get(key).cloned()).collect();
            dynamic_column(&format!("{prefix}{key}"), &cells)
        })
        .collect()
}

/// Every trajectory of every group with its group's index, in order.
fn rows(groups: &[TrajectoryGroup]) -> Vec<(usize, usize, &TrajectoryGroup, &Trajectory)> {
    groups
        .iter()
        .enumerate()
        .flat_map(|(g, group)| {
            group
                .trajectories
                .iter()
                .enumerate()
                .map(move |(t, trajectory)| (g, t, group, trajectory))
        })
        .collect()
}

/// Sampled tokens of a trajectory, when every choice knows them.
fn completion_tokens(trajectory: &Trajectory) -> Option<i64> {
    let counts: Option<Vec<usize>> = trajectory
        .choices()
        .map(|c| c.sampled_token_ids().map(|ids| ids.len()))
        .collect();
    counts
        .filter(|c| !c.is_empty())
        .map(|c| c.iter().sum::<usize>() as i64)
}

/// The reward table of a batch of groups: one row per trajectory (see the module doc).
pub fn groups_frame(groups: &[TrajectoryGroup]) -> Result<DataFrame, FrameError> {
    let rows = rows(groups);
    let height = rows.len();
    let mut columns = vec![
        Column::new(
            "group_index".into(),
            rows.iter().map(|r| r.0 as i64).collect::<Vec<_>>(),
        ),
        Column::new(
            "trajectory_index".into(),
            rows.iter().map(|r| r.1 as i64).collect::<Vec<_>>(),
        ),
        Column::new(
            "reward".into(),
            rows.iter().map(|r| r.3.reward).collect::<Vec<_>>(),
        ),
    ];
    columns.extend(keyed_columns(
        METRIC_PREFIX,
        rows.iter().map(|r| {
            r.3.metrics
                .iter()
                .map(|(k, v)| (k.as_str(), v.into()))
                .collect()
        }),
    ));
    columns.extend(keyed_columns(
        METADATA_PREFIX,
        rows.iter().map(|r| {
            r.3.metadata
                .iter()
                .filter_map(|(k, v)| Some((k.as_str(), metadata_cell(v)?)))
                .collect()
        }),
    ));
    columns.extend(keyed_columns(
        GROUP_METADATA_PREFIX,
        rows.iter().map(|r| {
            r.2.metadata
                .iter()
                .filter_map(|(k, v)| Some((k.as_str(), metadata_cell(v)?)))
                .collect()
        }),
    ));
    columns.push(Column::new(
        "num_messages".into(),
        rows.iter()
            .map(|r| r.3.messages_and_choices.len() as i64)
            .collect::<Vec<_>>(),
    ));
    columns.push(Column::new(
        "completion_tokens".into(),
        rows.iter()
            .map(|r| completion_tokens(r.3))
            .collect::<Vec<_>>(),
    ));
    columns.push(Column::new(
        "last_assistant".into(),
        rows.iter()
            .map(|r| r.3.last_assistant_text())
            .collect::<Vec<_>>(),
    ));
    Ok(DataFrame::new(height, columns)?)
}

impl TrajectoryGroup {
    /// This group's reward table: one row per trajectory (see [`groups_frame`]).
    pub fn to_frame(&self) -> Result<DataFrame, FrameError> {
        groups_frame(std::slice::from_ref(self))
    }
}

/// One row per group: size, failed rollouts, reward mean/std/min/max and the mean of each metric.
/// What to look at first when a step's rewards look wrong.
pub fn group_summary(groups: &[TrajectoryGroup]) -> Result<DataFrame, FrameError> {
    let height = groups.len();
    let stat = |f: &dyn Fn(&TrajectoryGroup) -> Option<f64>| -> Vec<Option<f64>> {
        groups.iter().map(f).collect()
    };
    let mut columns = vec![
        Column::new("group_index".into(), (0..height as i64).collect::<Vec<_>>()),
        Column::new(
            "trajectories".into(),
            groups
                .iter()
                .map(|g| g.trajectories.len() as i64)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "exceptions".into(),
            groups
                .iter()
                .map(|g| g.exceptions.len() as i64)
                .collect::<Vec<_>>(),
        ),
        Column::new("reward_mean".into(), stat(&|g| g.mean_reward())),
        Column::new("reward_std".into(), stat(&|g| g.reward_std())),
        Column::new(
            "reward_min".into(),
            stat(&|g| g.rewards().into_iter().reduce(f64::min)),
        ),
        Column::new(
            "reward_max".into(),
            stat(&|g| g.rewards().into_iter().reduce(f64::max)),
        ),
    ];
    let names: BTreeSet<&str> = groups
        .iter()
        .flat_map(|g| &g.trajectories)
        .flat_map(|t| t.metrics.keys().map(String::as_str))
        .collect();
    for name in names {
        let means: Vec<Option<f64>> = groups
            .iter()
            .map(|g| {
                let values: Vec<f64> = g
                    .trajectories
                    .iter()
                    .filter_map(|t| t.metrics.get(name).map(MetricValue::as_f64))
                    .collect();
                mean_std(&values).map(|(mean, _)| mean)
            })
            .collect();
        columns.push(Column::new(format!("{METRIC_PREFIX}{name}").into(), means));
    }
    Ok(DataFrame::new(height, columns)?)
}

/// The training history as a table: one row per (step, split), one float column per metric
/// (null where that split did not log it), sorted by step then split.
pub fn history_frame(entries: &[HistoryEntry]) -> Result<DataFrame, FrameError> {
    let mut entries: Vec<&HistoryEntry> = entries.iter().collect();
    entries.sort_by(|a, b| (a.step, &a.split).cmp(&(b.step, &b.split)));
    let names: BTreeSet<&str> = entries
        .iter()
        .flat_map(|e| e.metrics.keys().map(String::as_str))
        .collect();
    let mut columns = vec![
        Column::new(
            "step".into(),
            entries.iter().map(|e| e.step as i64).collect::<Vec<_>>(),
        ),
        Column::new(
            "split".into(),
            entries.iter().map(|e| e.split.as_str()).collect::<Vec<_>>(),
        ),
    ];
    for name in names {
        columns.push(Column::new(
            name.into(),
            entries.iter().map(|e| e.get(name)).collect::<Vec<_>>(),
        ));
    }
    columns.push(Column::new(
        "recorded_at".into(),
        entries
            .iter()
            .map(|e| e.recorded_at.as_deref())
            .collect::<Vec<_>>(),
    ));
    Ok(DataFrame::new(entries.len(), columns)?)
}

// ---- parquet ---------------------------------------------------------------------------------

/// JSON text of a value, or null for an empty one (as ART writes its JSON columns).
fn json_or_null<T: serde::Serialize>(value: &T, empty: bool) -> Option<String> {
    // Serializing our own types to a string cannot fail (no non-string map keys, no I/O).
    (!empty).then(|| serde_json::to_string(value).expect("serializable"))
}

fn string_list_column(name: &str, lists: Vec<&[String]>) -> Column {
    if lists.is_empty() {
        return Column::new_empty(name.into(), &DataType::List(Box::new(DataType::String)));
    }
    let series: Vec<Series> = lists
        .iter()
        .map(|lines| {
            Series::new(
                "".into(),
                lines.iter().map(String::as_str).collect::<Vec<_>>(),
            )
        })
        .collect();
    Column::from(Series::new(name.into(), series))
}

/// The full trajectories table written to `trajectories/<split>/<step>.parquet`: the columns of
/// [`groups_frame`], then what is needed to rebuild the groups exactly (JSON text columns
/// `messages_and_choices`, `tools`, `additional_histories`, `metrics`, `metadata`,
/// `group_metadata`, `group_metrics`, `group_exceptions`, list columns `logs` and `group_logs`,
/// and the policy versions).
pub fn trajectories_frame(groups: &[TrajectoryGroup]) -> Result<DataFrame, FrameError> {
    let mut frame = groups_frame(groups)?;
    let rows = rows(groups);
    let text = |name: &str, f: &dyn Fn(&TrajectoryGroup, &Trajectory) -> Option<String>| {
        Column::new(
            name.into(),
            rows.iter().map(|r| f(r.2, r.3)).collect::<Vec<_>>(),
        )
    };
    let extra = vec![
        text("messages_and_choices", &|_, t| {
            json_or_null(&t.messages_and_choices, false)
        }),
        text("tools", &|_, t| {
            t.tools
                .as_ref()
                .and_then(|tools| json_or_null(tools, false))
        }),
        text("additional_histories", &|_, t| {
            json_or_null(&t.additional_histories, t.additional_histories.is_empty())
        }),
        text("metrics", &|_, t| {
            json_or_null(&t.metrics, t.metrics.is_empty())
        }),
        text("metadata", &|_, t| {
            json_or_null(&t.metadata, t.metadata.is_empty())
        }),
        string_list_column("logs", rows.iter().map(|r| r.3.logs.as_slice()).collect()),
        Column::new(
            "initial_policy_version".into(),
            rows.iter()
                .map(|r| r.3.initial_policy_version)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "final_policy_version".into(),
            rows.iter()
                .map(|r| r.3.final_policy_version)
                .collect::<Vec<_>>(),
        ),
        text("group_metadata", &|g, _| {
            json_or_null(&g.metadata, g.metadata.is_empty())
        }),
        text("group_metrics", &|g, _| {
            json_or_null(&g.metrics, g.metrics.is_empty())
        }),
        text("group_exceptions", &|g, _| {
            json_or_null(&g.exceptions, g.exceptions.is_empty())
        }),
        string_list_column(
            "group_logs",
            rows.iter().map(|r| r.2.logs.as_slice()).collect(),
        ),
    ];
    for column in extra {
        frame.with_column(column)?;
    }
    Ok(frame)
}

/// Parquet bytes (zstd) of [`trajectories_frame`].
pub(crate) fn trajectories_parquet(groups: &[TrajectoryGroup]) -> Result<Vec<u8>, FrameError> {
    let mut frame = trajectories_frame(groups)?;
    let mut bytes = Cursor::new(Vec::new());
    ParquetWriter::new(&mut bytes)
        .with_compression(ParquetCompression::Zstd(None))
        .finish(&mut frame)?;
    Ok(bytes.into_inner())
}

/// Reads a parquet file (a trajectories file, or any other) into a DataFrame.
pub fn read_parquet(path: impl AsRef<Path>) -> Result<DataFrame, FrameError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| FrameError::Read {
        path: path.display().to_string(),
        source,
    })?;
    Ok(ParquetReader::new(file).finish()?)
}

/// Rebuilds the groups stored in a trajectories parquet file. Groups come back as they were logged,
/// except for groups whose every rollout failed (a file has rows only for trajectories).
pub fn read_trajectory_groups(path: impl AsRef<Path>) -> Result<Vec<TrajectoryGroup>, FrameError> {
    let path = path.as_ref();
    let frame = read_parquet(path)?;
    let bad = |problem: String| FrameError::NotTrajectories {
        path: path.display().to_string(),
        problem,
    };
    let column = |name: &str| {
        frame
            .column(name)
            .map_err(|_| bad(format!("no `{name}` column")))
    };
    let group_index = column("group_index")?.i64()?;
    let reward = column("reward")?.f64()?;
    let messages = column("messages_and_choices")?.str()?;
    let tools = column("tools")?.str()?;
    let histories = column("additional_histories")?.str()?;
    let metrics = column("metrics")?.str()?;
    let metadata = column("metadata")?.str()?;
    let logs = column("logs")?.list()?;
    let initial_version = column("initial_policy_version")?.i64()?;
    let final_version = column("final_policy_version")?.i64()?;
    let group_metadata = column("group_metadata")?.str()?;
    let group_metrics = column("group_metrics")?.str()?;
    let group_exceptions = column("group_exceptions")?.str()?;
    let group_logs = column("group_logs")?.list()?;

    fn parse<T: serde::de::DeserializeOwned + Default>(
        text: Option<&str>,
        what: &str,
        row: usize,
    ) -> Result<T, String> {
        match text {
            None => Ok(T::default()),
            Some(text) => {
                serde_json::from_str(text).map_err(|e| format!("row {row}: bad `{what}` JSON: {e}"))
            }
        }
    }
    let strings = |list: &ListChunked, row: usize| -> Result<Vec<String>, FrameError> {
        let Some(series) = list.get_as_series(row) else {
            return Ok(Vec::new());
        };
        let lines = series.str()?;
        Ok((0..lines.len())
            .map(|i| lines.get(i).unwrap_or_default().to_string())
            .collect())
    };

    let mut groups: Vec<(i64, TrajectoryGroup)> = Vec::new();
    for row in 0..frame.height() {
        let index = group_index
            .get(row)
            .ok_or_else(|| bad(format!("row {row} has no group_index")))?;
        if groups.last().map(|(i, _)| *i) != Some(index) {
            let group = TrajectoryGroup {
                trajectories: Vec::new(),
                exceptions: parse::<Vec<RolloutException>>(
                    group_exceptions.get(row),
                    "group_exceptions",
                    row,
                )
                .map_err(bad)?,
                metadata: parse(group_metadata.get(row), "group_metadata", row).map_err(bad)?,
                metrics: parse(group_metrics.get(row), "group_metrics", row).map_err(bad)?,
                logs: strings(group_logs, row)?,
            };
            groups.push((index, group));
        }
        let trajectory = Trajectory {
            exchanges: Default::default(),
            messages_and_choices: parse::<Vec<MessageOrChoice>>(
                messages.get(row),
                "messages_and_choices",
                row,
            )
            .map_err(bad)?,
            tools: match tools.get(row) {
                None => None,
                Some(_) => Some(parse::<Vec<Tool>>(tools.get(row), "tools", row).map_err(bad)?),
            },
            additional_histories: parse::<Vec<History>>(
                histories.get(row),
                "additional_histories",
                row,
            )
            .map_err(bad)?,
            reward: reward.get(row).unwrap_or_default(),
            initial_policy_version: initial_version.get(row),
            final_policy_version: final_version.get(row),
            metrics: parse(metrics.get(row), "metrics", row).map_err(bad)?,
            metadata: parse(metadata.get(row), "metadata", row).map_err(bad)?,
            logs: strings(logs, row)?,
            ..Default::default()
        };
        if let Some((_, group)) = groups.last_mut() {
            group.trajectories.push(trajectory);
        }
    }
    Ok(groups.into_iter().map(|(_, g)| g).collect())
}
