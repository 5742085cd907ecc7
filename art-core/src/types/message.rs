//! Chat messages and tools, serde-compatible with OpenAI's chat completions API (and so with the
//! message dicts that OpenPipe ART stores in its trajectories).

use serde::{Deserialize, Serialize};

/// One chat message. The JSON form is OpenAI's: an object tagged by `role`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    System(SystemMessage),
    /// OpenAI's newer name for a system message; kept distinct so it round-trips unchanged.
    Developer(SystemMessage),
    User(UserMessage),
    Assistant(AssistantMessage),
    Tool(ToolMessage),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SystemMessage {
    pub content: Content,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserMessage {
    pub content: Content,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// `None` when the assistant only called tools (OpenAI sends `"content": null` then).
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Fields this crate does not model (`annotations`, `audio`, ...), kept so nothing is lost
    /// when a response passes through.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolMessage {
    pub content: Content,
    pub tool_call_id: String,
}

/// Message content: plain text, or a list of typed parts (text, images, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    ImageUrl {
        image_url: ImageUrl,
    },
    Refusal {
        refusal: String,
    },
    /// Any part type this crate does not model (audio, files, ...), kept as it came.
    #[serde(untagged)]
    Other(serde_json::Value),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageUrl {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// A call of a function tool made by the assistant. `arguments` is a JSON string, as in OpenAI's API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A tool the model may call: a function with a JSON-schema for its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

fn function_type() -> String {
    "function".to_string()
}

/// Accepts `null` where a list is expected (OpenAI sends `"tool_calls": null`).
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

impl Content {
    /// The text of the content: the string itself, or the text parts joined (other parts skipped).
    pub fn text(&self) -> String {
        match self {
            Content::Text(text) => text.clone(),
            Content::Parts(parts) => parts
                .iter()
                .filter_map(|part| match part {
                    ContentPart::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

impl From<&str> for Content {
    fn from(text: &str) -> Self {
        Content::Text(text.to_string())
    }
}

impl From<String> for Content {
    fn from(text: String) -> Self {
        Content::Text(text)
    }
}

impl Message {
    pub fn system(content: impl Into<Content>) -> Self {
        Message::System(SystemMessage {
            content: content.into(),
            name: None,
        })
    }

    pub fn user(content: impl Into<Content>) -> Self {
        Message::User(UserMessage {
            content: content.into(),
            name: None,
        })
    }

    pub fn assistant(content: impl Into<Content>) -> Self {
        Message::Assistant(AssistantMessage {
            content: Some(content.into()),
            ..Default::default()
        })
    }

    /// The result of a tool call, answering the call with id `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<Content>) -> Self {
        Message::Tool(ToolMessage {
            content: content.into(),
            tool_call_id: tool_call_id.into(),
        })
    }

    /// The role as OpenAI names it.
    pub fn role(&self) -> &'static str {
        match self {
            Message::System(_) => "system",
            Message::Developer(_) => "developer",
            Message::User(_) => "user",
            Message::Assistant(_) => "assistant",
            Message::Tool(_) => "tool",
        }
    }

    /// The text of the message (empty for an assistant message that only calls tools).
    pub fn text(&self) -> String {
        match self {
            Message::System(m) | Message::Developer(m) => m.content.text(),
            Message::User(m) => m.content.text(),
            Message::Assistant(m) => m.content.as_ref().map(Content::text).unwrap_or_default(),
            Message::Tool(m) => m.content.text(),
        }
    }
}

impl ToolCall {
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }

    /// The arguments parsed as JSON.
    pub fn parsed_arguments(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_str(&self.function.arguments)
    }
}

impl Tool {
    pub fn function(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: serde_json::Value,
    ) -> Self {
        Tool {
            kind: function_type(),
            function: FunctionDefinition {
                name: name.into(),
                description: Some(description.into()),
                parameters: Some(parameters),
                strict: None,
            },
        }
    }
}
