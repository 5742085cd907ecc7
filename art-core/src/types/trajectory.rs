//! Trajectories and groups of them, with the JSON shape of OpenPipe ART's pydantic models.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::choice::Choice;
use super::message::{Message, Tool};
use super::openai::ChatCompletion;

/// An item of a conversation: a message written by someone, or a choice sampled from the model.
/// Only choices are trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageOrChoice {
    Message(Message),
    Choice(Choice),
}

/// A metric value: ART allows numbers and booleans.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetricValue {
    Bool(bool),
    Int(i64),
    Float(f64),
}

/// A metadata value: ART allows scalars (and null).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetadataValue {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

/// A conversation without its own reward, trained with its trajectory's advantage (for example
/// a sub-agent's history).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct History {
    pub messages_and_choices: Vec<MessageOrChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
}

/// The raw calls a rollout made, as ART (>= 0.5) captures them from its HTTP clients: a
/// trajectory holds either these or `messages_and_choices`, never both.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrajectoryExchanges {
    #[serde(default)]
    pub chat_completions: Vec<ChatCompletionsExchange>,
    /// Calls to the legacy completions, Responses and Anthropic Messages APIs, kept as sent
    /// (this server samples chat completions only, so it cannot train on them).
    #[serde(default)]
    pub completions: Vec<serde_json::Value>,
    #[serde(default)]
    pub responses: Vec<serde_json::Value>,
    #[serde(default)]
    pub messages: Vec<serde_json::Value>,
}

impl TrajectoryExchanges {
    pub fn is_empty(&self) -> bool {
        self.chat_completions.is_empty()
            && self.completions.is_empty()
            && self.responses.is_empty()
            && self.messages.is_empty()
    }
}

/// One `POST /chat/completions` of a rollout: the request as sent and the response as received
/// (with the sampled token ids when the request asked for them, `return_token_ids`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionsExchange {
    pub request: serde_json::Map<String, serde_json::Value>,
    pub response: ChatCompletion,
    /// Timestamps and ART's computed fields, kept as they came.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatCompletionsExchange {
    /// The prompt's token ids as the server reported them (vLLM's `prompt_token_ids`).
    pub fn prompt_token_ids(&self) -> Option<Vec<u32>> {
        serde_json::from_value(self.response.extra.get("prompt_token_ids")?.clone()).ok()
    }
}

/// One rollout: what was said, what the model chose, and how well it went.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Trajectory {
    /// The calls the rollout made, when its client captured them (ART's `exchanges`).
    #[serde(default, skip_serializing_if = "TrajectoryExchanges::is_empty")]
    pub exchanges: TrajectoryExchanges,
    #[serde(default)]
    pub messages_and_choices: Vec<MessageOrChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub additional_histories: Vec<History>,
    #[serde(default)]
    pub reward: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_policy_version: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_policy_version: Option<i64>,
    #[serde(default)]
    pub metrics: BTreeMap<String, MetricValue>,
    #[serde(default)]
    pub metadata: BTreeMap<String, MetadataValue>,
    #[serde(default)]
    pub logs: Vec<String>,
    /// When the rollout began; `finish` turns it into the `duration` metric. Not serialized (as in ART).
    #[serde(skip, default = "Instant::now")]
    pub start_time: Instant,
}

impl PartialEq for Trajectory {
    /// Equal when all serialized fields are; the in-memory start time is not compared.
    fn eq(&self, other: &Self) -> bool {
        self.messages_and_choices == other.messages_and_choices
            && self.exchanges == other.exchanges
            && self.tools == other.tools
            && self.additional_histories == other.additional_histories
            && self.reward == other.reward
            && self.initial_policy_version == other.initial_policy_version
            && self.final_policy_version == other.final_policy_version
            && self.metrics == other.metrics
            && self.metadata == other.metadata
            && self.logs == other.logs
    }
}

impl Default for Trajectory {
    fn default() -> Self {
        Trajectory {
            exchanges: TrajectoryExchanges::default(),
            messages_and_choices: Vec::new(),
            tools: None,
            additional_histories: Vec::new(),
            reward: 0.0,
            initial_policy_version: None,
            final_policy_version: None,
            metrics: BTreeMap::new(),
            metadata: BTreeMap::new(),
            logs: Vec::new(),
            start_time: Instant::now(),
        }
    }
}

impl Trajectory {
    /// A trajectory starting with these messages; its clock starts now.
    pub fn new(messages: impl IntoIterator<Item = Message>) -> Self {
        Trajectory {
            messages_and_choices: messages.into_iter().map(MessageOrChoice::Message).collect(),
            ..Default::default()
        }
    }

    pub fn with_tools(mut self, tools: Vec<Tool>) -> Self {
        self.tools = Some(tools);
        self
    }

    pub fn push_message(&mut self, message: Message) {
        self.messages_and_choices
            .push(MessageOrChoice::Message(message));
    }

    pub fn push_choice(&mut self, choice: Choice) {
        self.messages_and_choices
            .push(MessageOrChoice::Choice(choice));
    }

    /// The conversation as plain messages (choices become their assistant messages): what to send
    /// as the next request's `messages`.
    pub fn messages(&self) -> Vec<Message> {
        plain_messages(&self.messages_and_choices)
    }

    /// The sampled choices, in order.
    pub fn choices(&self) -> impl Iterator<Item = &Choice> {
        self.messages_and_choices
            .iter()
            .filter_map(|item| match item {
                MessageOrChoice::Choice(choice) => Some(choice),
                MessageOrChoice::Message(_) => None,
            })
    }

    /// The text of the last assistant turn (sampled or written), if any.
    pub fn last_assistant_text(&self) -> Option<String> {
        self.messages()
            .iter()
            .rev()
            .find(|m| matches!(m, Message::Assistant(_)))
            .map(Message::text)
    }

    pub fn set_metric(&mut self, name: impl Into<String>, value: impl Into<MetricValue>) {
        self.metrics.insert(name.into(), value.into());
    }

    pub fn set_metadata(&mut self, name: impl Into<String>, value: impl Into<MetadataValue>) {
        self.metadata.insert(name.into(), value.into());
    }

    pub fn log(&mut self, line: impl Into<String>) {
        self.logs.push(line.into());
    }

    /// Seconds since the rollout began.
    pub fn elapsed_seconds(&self) -> f64 {
        self.start_time.elapsed().as_secs_f64()
    }

    /// A rollout captured as raw calls, shown as the conversation they make up: the last call's
    /// messages and its (first) choice become `messages_and_choices`, for the logged
    /// trajectories and their tables. Does nothing to a trajectory with messages already.
    pub fn show_exchanges_as_conversation(&mut self) {
        if !self.messages_and_choices.is_empty() {
            return;
        }
        let Some(last) = self.exchanges.chat_completions.last() else {
            return;
        };
        let messages: Vec<Message> = last
            .request
            .get("messages")
            .and_then(|m| serde_json::from_value(m.clone()).ok())
            .unwrap_or_default();
        self.tools = last
            .request
            .get("tools")
            .and_then(|t| serde_json::from_value(t.clone()).ok());
        self.messages_and_choices = messages
            .into_iter()
            .map(MessageOrChoice::Message)
            .chain(
                last.response
                    .choices
                    .first()
                    .cloned()
                    .map(MessageOrChoice::Choice),
            )
            .collect();
        self.exchanges = TrajectoryExchanges::default();
    }

    /// Records the rollout's wall time as the `duration` metric (seconds), as ART's `finish()` does.
    pub fn finish(mut self) -> Self {
        let seconds = self.elapsed_seconds();
        self.set_metric("duration", seconds);
        self
    }
}

pub(crate) fn plain_messages(items: &[MessageOrChoice]) -> Vec<Message> {
    items
        .iter()
        .map(|item| match item {
            MessageOrChoice::Message(message) => message.clone(),
            MessageOrChoice::Choice(choice) => choice.to_message(),
        })
        .collect()
}

impl History {
    pub fn messages(&self) -> Vec<Message> {
        plain_messages(&self.messages_and_choices)
    }
}

/// A rollout that failed, kept with its group (ART's `PydanticException`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutException {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    #[serde(default)]
    pub traceback: String,
}

/// Rollouts of the same scenario, compared with each other: GRPO's advantages are relative within
/// a group.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrajectoryGroup {
    pub trajectories: Vec<Trajectory>,
    #[serde(default)]
    pub exceptions: Vec<RolloutException>,
    #[serde(default)]
    pub metadata: BTreeMap<String, MetadataValue>,
    #[serde(default)]
    pub metrics: BTreeMap<String, MetricValue>,
    #[serde(default)]
    pub logs: Vec<String>,
}

impl TrajectoryGroup {
    pub fn new(trajectories: impl IntoIterator<Item = Trajectory>) -> Self {
        TrajectoryGroup {
            trajectories: trajectories.into_iter().collect(),
            ..Default::default()
        }
    }

    pub fn rewards(&self) -> Vec<f64> {
        self.trajectories.iter().map(|t| t.reward).collect()
    }

    pub fn mean_reward(&self) -> Option<f64> {
        mean(&self.rewards())
    }

    /// Population standard deviation of the rewards (0 for a group whose rewards are all equal:
    /// such a group teaches GRPO nothing).
    pub fn reward_std(&self) -> Option<f64> {
        let rewards = self.rewards();
        let m = mean(&rewards)?;
        Some((rewards.iter().map(|r| (r - m).powi(2)).sum::<f64>() / rewards.len() as f64).sqrt())
    }
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

macro_rules! value_from {
    ($target:ident: $($source:ty => $variant:ident as $cast:ty),* $(,)?) => {
        $(impl From<$source> for $target {
            fn from(value: $source) -> Self {
                $target::$variant(value as $cast)
            }
        })*
    };
}

value_from!(MetricValue: bool => Bool as bool, i32 => Int as i64, i64 => Int as i64, u32 => Int as i64,
    usize => Int as i64, f32 => Float as f64, f64 => Float as f64);
value_from!(MetadataValue: bool => Bool as bool, i32 => Int as i64, i64 => Int as i64, u32 => Int as i64,
    usize => Int as i64, f32 => Float as f64, f64 => Float as f64);

impl From<&str> for MetadataValue {
    fn from(value: &str) -> Self {
        MetadataValue::Text(value.to_string())
    }
}

impl From<String> for MetadataValue {
    fn from(value: String) -> Self {
        MetadataValue::Text(value)
    }
}

impl MetricValue {
    /// The value as a number (true = 1, false = 0), for averaging.
    pub fn as_f64(&self) -> f64 {
        match *self {
            MetricValue::Bool(b) => f64::from(u8::from(b)),
            MetricValue::Int(i) => i as f64,
            MetricValue::Float(f) => f,
        }
    }
}
