//! `Choice`: one completion returned by an OpenAI-compatible endpoint, the unit of trainable output.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::message::{AssistantMessage, Message};

/// One completion. Its JSON is OpenAI's `choices[i]`; `token_ids` is the extension vLLM and our
/// backend add so that a trainer knows exactly which tokens were sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(serialize_with = "as_assistant", deserialize_with = "from_assistant")]
    pub message: AssistantMessage,
    /// "stop", "length", "tool_calls", ... (`null` while a stream is still running).
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// The sampled token ids, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Fields this crate does not model (provider extensions), kept so nothing is lost.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChoiceLogprobs {
    #[serde(default)]
    pub content: Option<Vec<TokenLogprob>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Vec<TokenLogprob>>,
}

/// A sampled token with its log-probability and, on request, the most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
}

/// vLLM (as ART runs it) writes each sampled token as `token_id:<id>` instead of its text.
const TOKEN_ID_PREFIX: &str = "token_id:";

impl Choice {
    /// The message as a plain chat message (what the next turn's request sends back).
    pub fn to_message(&self) -> Message {
        Message::Assistant(self.message.clone())
    }

    /// The ids of the sampled tokens: `token_ids` when present, otherwise recovered from
    /// `token_id:<id>` logprob tokens (ART/vLLM's form). `None` when neither is there.
    pub fn sampled_token_ids(&self) -> Option<Vec<u32>> {
        if let Some(ids) = &self.token_ids {
            return Some(ids.clone());
        }
        let content = self.logprobs.as_ref()?.content.as_ref()?;
        content
            .iter()
            .map(|t| t.token.strip_prefix(TOKEN_ID_PREFIX)?.parse().ok())
            .collect()
    }

    /// The log-probabilities of the sampled tokens under the sampling policy, if returned.
    pub fn sampled_logprobs(&self) -> Option<Vec<f64>> {
        let content = self.logprobs.as_ref()?.content.as_ref()?;
        Some(content.iter().map(|t| t.logprob).collect())
    }
}

/// The message of a choice is an assistant message; its JSON carries `"role": "assistant"`.
fn as_assistant<S: Serializer>(
    message: &AssistantMessage,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    // Serializing through `Message` adds the role tag; the clone is of one small message.
    Message::Assistant(message.clone()).serialize(serializer)
}

fn from_assistant<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<AssistantMessage, D::Error> {
    match Message::deserialize(deserializer)? {
        Message::Assistant(message) => Ok(message),
        other => Err(serde::de::Error::custom(format!(
            "a choice's message must have role \"assistant\", found \"{}\"",
            other.role()
        ))),
    }
}
