//! The trainer's one error type.

use std::fmt;
use std::path::PathBuf;

use crate::engine::chat_template::ChatTemplateError;
use crate::engine::EngineError;
use crate::types::InvalidConfig;

/// Which conversation of a batch something refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceSource {
    /// Index of the group in the batch (`None` for supervised fine-tuning, which takes a flat
    /// list of trajectories).
    pub group: Option<usize>,
    /// Index of the trajectory in its group.
    pub trajectory: usize,
    /// `Some(i)` for the trajectory's `additional_histories[i]`.
    pub history: Option<usize>,
}

impl fmt::Display for SequenceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(g) = self.group {
            write!(f, "group {g}, ")?;
        }
        write!(f, "trajectory {}", self.trajectory)?;
        if let Some(h) = self.history {
            write!(f, ", additional history {h}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong in a training step. Each message says what was wrong and what to
/// do about it. Errors about the batch are raised before any weight changes.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] InvalidConfig),

    #[error(
        "empty batch: {0}. Pass at least one trajectory group with trajectories that contain \
         sampled choices"
    )]
    EmptyBatch(String),

    #[error(
        "{at}, message {message}: the choice has no token ids. Train only on choices returned \
         by this backend (they carry `token_ids`), or by a server that returns `token_id:<id>` \
         logprob tokens"
    )]
    MissingTokenIds { at: SequenceSource, message: usize },

    #[error(
        "{at}, message {message}: the choice has no logprobs. Request completions with \
         `logprobs: true`, or set `allow_training_without_logprobs` to train with an importance \
         ratio of 1 for such choices"
    )]
    MissingLogprobs { at: SequenceSource, message: usize },

    #[error(
        "{at}, message {message}: the choice has {tokens} token ids but {logprobs} logprobs; \
         they must describe the same sampled tokens"
    )]
    LogprobCountMismatch {
        at: SequenceSource,
        message: usize,
        tokens: usize,
        logprobs: usize,
    },

    #[error(
        "{at}: token id {token} is outside the model's vocabulary of {vocab} tokens; was the \
         trajectory sampled from another model?"
    )]
    TokenOutOfVocabulary {
        at: SequenceSource,
        token: u32,
        vocab: usize,
    },

    #[error(
        "{at}: the conversation is {tokens} tokens long, longer than the model's context of \
         {context} tokens; shorten the rollout or drop this trajectory"
    )]
    SequenceTooLong {
        at: SequenceSource,
        tokens: usize,
        context: usize,
    },

    #[error("{at}, captured exchange {exchange}: {reason}")]
    BadExchange {
        at: SequenceSource,
        exchange: usize,
        reason: String,
    },

    #[error("{at}: cannot render the conversation with the model's chat template: {error}")]
    ChatTemplate {
        at: SequenceSource,
        #[source]
        error: ChatTemplateError,
    },

    #[error(
        "the model has no chat template, so conversations cannot be turned into tokens; load a \
         model whose tokenizer config (or GGUF metadata) includes one"
    )]
    NoChatTemplate,

    #[error("the chat template does not compile: {0}")]
    BadChatTemplate(#[source] ChatTemplateError),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("checkpoint {path}: {detail}")]
    Checkpoint { path: PathBuf, detail: String },

    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("the training step produced a non-finite {what}; lower the learning rate or check the rewards")]
    NonFinite { what: &'static str },

    #[error(
        "kl_penalty_reference_step = {step}: the model has no checkpoint of that step (it has \
         {steps:?}); name one of those, or 0 for the base model"
    )]
    UnknownReference { step: u64, steps: Vec<u64> },

    #[error(
        "{at}: there is nothing to learn: the conversation has no assistant turn. Supervised \
         fine-tuning learns the assistant's messages; drop this trajectory or add the answer it \
         should learn"
    )]
    NothingToLearn { at: SequenceSource },

    #[error("the model `{0}` was deleted; register it again to train it")]
    Retired(String),

    #[error("data-parallel training: {0}")]
    DataParallel(String),

    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        TrainError::Engine(EngineError::Tensor(e))
    }
}

impl TrainError {
    /// Whether the request was at fault (a bad config or batch), as opposed to the backend.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            TrainError::Config(_)
                | TrainError::EmptyBatch(_)
                | TrainError::MissingTokenIds { .. }
                | TrainError::MissingLogprobs { .. }
                | TrainError::LogprobCountMismatch { .. }
                | TrainError::TokenOutOfVocabulary { .. }
                | TrainError::SequenceTooLong { .. }
                | TrainError::ChatTemplate { .. }
                | TrainError::BadExchange { .. }
                | TrainError::NothingToLearn { .. }
                | TrainError::Retired(_)
                | TrainError::UnknownReference { .. }
                | TrainError::NonFinite { .. }
        )
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;
