//! The core data types, serde-compatible with OpenAI's chat API and OpenPipe ART's JSON.

mod choice;
mod config;
mod history;
mod logging;
mod message;
mod names;
mod openai;
mod serverless;
mod training;
mod trajectory;

pub use choice::{Choice, ChoiceLogprobs, TokenLogprob, TopLogprob};
pub use config::{
    AssistantTurns, ImportanceSamplingLevel, InvalidConfig, KlPenaltySource, LearningRate,
    LoraConfig, LossFn, SftConfig, TrainConfig,
};
pub(crate) use history::mean_std;
pub use history::{HistoryEntry, MetricGoal};
pub use logging::{HistoryList, LogRequest, LoggedMetrics, Split, TrajectoryGroupList};
pub use message::{
    AssistantMessage, Content, ContentPart, FunctionCall, FunctionDefinition, ImageUrl, Message,
    SystemMessage, Tool, ToolCall, ToolMessage, UserMessage,
};
pub use names::{check_name, InvalidName, MAX_NAME_LEN};
pub use openai::{
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChunkChoice, ChunkDelta,
    JsonSchemaFormat, PromptTokensDetails, ResponseFormat, Stop, ToolCallDelta, Usage,
};
pub use serverless::{
    CursorPage, DeleteStepsRequest, DeleteStepsResponse, ExperimentalConfig, JobEventKind,
    PreviewCheckpoint, PreviewModel, PreviewModelRequest, SftTrainingConfig, SftTrainingJobRequest,
    TrainingJob, TrainingJobEvent, TrainingJobRequest, UnsupportedSetting,
};
pub use training::{
    CheckpointInfo, CheckpointList, DeleteCheckpointsRequest, DeleteCheckpointsResponse, ModelInfo,
    RegisterRequest, SftBatchMetrics, SftEvent, SftRequest, SftResult, StepMetrics, StepResult,
    TrainEvent, TrainProgress, TrainRequest,
};
pub use trajectory::{
    ChatCompletionsExchange, History, MessageOrChoice, MetadataValue, MetricValue,
    RolloutException, Trajectory, TrajectoryExchanges, TrajectoryGroup,
};
