//! ART for Rust: agent reinforcement training.
//!
//! The light client side (types, rollouts, judging, storage, display) is always built; the engine,
//! trainer and server sit behind the `engine`, `train` and `server` features so that notebook cells
//! link only what they need.

pub mod client;
#[cfg(feature = "frames")]
pub mod frames;
pub mod gather;
#[cfg(feature = "plots")]
pub mod plots;
pub mod ruler;
#[cfg(feature = "frames")]
pub mod store;
pub mod types;

pub use client::{ChatEndpoint, ClientError};
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
#[cfg(feature = "frames")]
pub use store::{HistoryEntry, LoggedMetrics, MetricGoal, ModelStore, StoreError};
pub use types::*;
