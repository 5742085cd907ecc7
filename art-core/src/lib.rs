//! ART for Rust: agent reinforcement training.
//!
//! The light client side (types, rollouts, judging, storage, display) is always built; the engine,
//! trainer and server sit behind the `engine`, `train` and `server` features so that notebook cells
//! link only what they need.

pub mod gather;
pub mod types;

pub use gather::{
    gather_trajectory_groups, GatherError, GatherOptions, GatherProgress, MaxExceptions,
    PendingGroup,
};
pub use types::*;
