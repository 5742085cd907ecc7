//! The engine's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in the engine. Each message says what was wrong and, where there
/// is one, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model not found at {path}: {hint}")]
    NotFound { path: PathBuf, hint: String },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid model file {path}: {detail}")]
    InvalidModel { path: PathBuf, detail: String },

    #[error(
        "unsupported model architecture `{0}`: this engine runs llama, qwen2 and qwen3 decoders"
    )]
    UnsupportedArchitecture(String),

    #[error("model weights: {0}")]
    Weights(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("LoRA adapter: {0}")]
    Adapter(String),

    #[error("invalid generation request: {0}")]
    InvalidRequest(String),

    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        EngineError::InvalidModel {
            path: path.into(),
            detail: detail.into(),
        }
    }
}
