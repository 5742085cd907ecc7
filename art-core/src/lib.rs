//! ART for Rust: agent reinforcement training.
//!
//! The light client side (types, rollouts, judging, storage, display) is always built; the engine,
//! trainer and server sit behind the `engine`, `train` and `server` features so that notebook cells
//! link only what they need.

#[cfg(feature = "engine")]
pub mod engine;
pub mod types;

pub use types::*;
