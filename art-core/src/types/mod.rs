//! The core data types, serde-compatible with OpenAI's chat API and OpenPipe ART's JSON.

mod choice;
mod config;
mod message;
mod openai;
mod training;
mod trajectory;

pub use choice::{Choice, ChoiceLogprobs, TokenLogprob, TopLogprob};
pub use config::{ImportanceSamplingLevel, InvalidConfig, LoraConfig, TrainConfig};
pub use message::{
    AssistantMessage, Content, ContentPart, FunctionCall, FunctionDefinition, ImageUrl, Message,
    SystemMessage, Tool, ToolCall, ToolMessage, UserMessage,
};
pub use openai::{
    ChatCompletion, ChatCompletionRequest, JsonSchemaFormat, ResponseFormat, Stop, Usage,
};
pub use training::{
    CheckpointInfo, CheckpointList, DeleteCheckpointsRequest, DeleteCheckpointsResponse,
    StepMetrics, StepResult, TrainEvent, TrainProgress, TrainRequest,
};
pub use trajectory::{
    History, MessageOrChoice, MetadataValue, MetricValue, RolloutException, Trajectory,
    TrajectoryGroup,
};
