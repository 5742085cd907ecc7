//! ART for Rust: agent reinforcement training.
//!
//! The light client side (types, rollouts, judging, storage, display) is always built; the engine,
//! trainer and server sit behind the `engine`, `train` and `server` features so that notebook cells
//! link only what they need.

pub mod backend;
pub mod client;
pub mod dataset;
pub mod display;
#[cfg(feature = "frames")]
pub mod frames;
pub mod fsutil;
pub mod gather;
#[cfg(feature = "plots")]
pub mod plots;
pub mod ruler;
pub mod store;
pub mod telemetry;
pub mod types;

pub use backend::{
    Backend, BackendError, LocalBackend, LocalBackendOptions, RemoteBackend, TrainableModel,
};
pub use client::{ChatEndpoint, ClientError};
pub use dataset::{iterate_dataset, DatasetBatch};
#[cfg(feature = "frames")]
pub use frames::{groups_frame, history_frame, DataFrame, FrameError};
pub use gather::{
    gather_trajectory_groups, GatherError, GatherOptions, GatherProgress, MaxExceptions,
    PendingGroup,
};
#[cfg(feature = "plots")]
pub use plots::{Chart, PlotError};
pub use ruler::{
    ruler, ruler_score_group, JudgeUsage, RulerError, RulerOptions, RulerScore, RulerVerdict,
};
pub use store::{default_art_dir, HistoryEntry, LoggedMetrics, MetricGoal, ModelStore, StoreError};
pub use types::*;

#[cfg(feature = "engine")]
pub mod engine;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "train")]
pub mod train;
