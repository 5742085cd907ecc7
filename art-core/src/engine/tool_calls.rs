//! Tool calls in a model's raw completion text, turned into OpenAI `tool_calls`.
//!
//! Models write tool calls as text in the shape their chat template taught them. Two shapes are
//! understood:
//! - [`ToolCallFormat::Hermes`] (Qwen2.5, Qwen3, Hermes and others whose template mentions
//!   `<tool_call>`): one or more `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
//!   blocks, possibly after some text;
//! - [`ToolCallFormat::JsonObject`], the fallback for templates with no tool syntax (SmolLM2): the
//!   whole reply is `{"name": ..., "arguments": {...}}` (or a list of them), as the prompt from
//!   [`json_object_instructions`] asks.
//!
//! Parsing never fails: text that does not hold a well-formed call stays content, so a model that
//! writes a broken call gets its text back (and a reward function can see it) instead of an error.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value as Json;

use crate::types::{AssistantMessage, Content, Message, SystemMessage, Tool, ToolCall};

const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";

/// How a model writes tool calls in its completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>{json}</tool_call>` blocks (Qwen, Hermes).
    Hermes,
    /// The whole reply is one JSON object `{"name", "arguments"}` or a list of them.
    JsonObject,
}

/// A completion split into its text and its tool calls.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCompletion {
    /// `None` when the completion held tool calls and no other text (OpenAI's `"content": null`).
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedCompletion {
    pub fn into_assistant_message(self) -> AssistantMessage {
        AssistantMessage {
            content: self.content.map(Content::Text),
            tool_calls: self.tool_calls,
            ..Default::default()
        }
    }
}

impl ToolCallFormat {
    /// Picks the format a model was taught, from its chat template text.
    pub fn detect(chat_template: &str) -> Self {
        if chat_template.contains(OPEN_TAG) {
            ToolCallFormat::Hermes
        } else {
            ToolCallFormat::JsonObject
        }
    }

    /// Parses a completion, giving each call a fresh `call_...` id.
    pub fn parse(self, text: &str) -> ParsedCompletion {
        self.parse_with_ids(text, &mut new_tool_call_id)
    }

    /// Parses a completion, taking the ids of its calls from `next_id` (for deterministic ids).
    pub fn parse_with_ids(
        self,
        text: &str,
        next_id: &mut dyn FnMut() -> String,
    ) -> ParsedCompletion {
        match self {
            ToolCallFormat::Hermes => parse_hermes(text, next_id),
            ToolCallFormat::JsonObject => parse_json_object(text, next_id),
        }
    }
}

/// A fresh id in OpenAI's style: `call_` and 24 hex digits, unique within the process and
/// unpredictable across processes.
pub fn new_tool_call_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    // std's RandomState is seeded from the OS once per thread and varied per instance, which is
    // random enough for ids and saves a dependency on `rand`.
    let hash = |salt: u64| {
        let mut hasher = std::hash::RandomState::new().build_hasher();
        hasher.write_u64(count);
        hasher.write_u64(salt);
        hasher.finish()
    };
    format!("call_{:016x}{:08x}", hash(0), hash(1) as u32)
}

/// A conversation prepared for a chat template that writes tool calls in `format`.
pub struct TemplateConversation<'t> {
    pub messages: Vec<Message>,
    /// The tools to hand the template (only templates with their own tool syntax take them).
    pub tools: Option<&'t [Tool]>,
    /// Messages inserted before the conversation's own (0 or 1): message `i` of a rendering is
    /// message `i - inserted` of the original.
    pub inserted: usize,
}

/// The conversation as a template of `format` should see it; the server (for prompts) and the
/// trainer (for training sequences) both render through this, so a model trains on the context
/// it sampled from. Hermes templates render tools and tool calls themselves. Templates without
/// tool syntax (JSON-object format) get the tools described in the system prompt, and each past
/// assistant call is written as the JSON object the model itself produces.
pub fn conversation_for_template<'t>(
    messages: &[Message],
    tools: Option<&'t [Tool]>,
    format: ToolCallFormat,
) -> TemplateConversation<'t> {
    let tools = tools.filter(|t| !t.is_empty());
    if format == ToolCallFormat::Hermes {
        return TemplateConversation {
            messages: messages.to_vec(),
            tools,
            inserted: 0,
        };
    }
    let mut out: Vec<Message> = messages
        .iter()
        .map(|message| match message {
            Message::Assistant(a) if !a.tool_calls.is_empty() => {
                let mut text = a.content.as_ref().map(Content::text).unwrap_or_default();
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&json_object_calls(&a.tool_calls));
                Message::Assistant(AssistantMessage {
                    content: Some(Content::Text(text)),
                    tool_calls: Vec::new(),
                    ..a.clone()
                })
            }
            other => other.clone(),
        })
        .collect();
    let mut inserted = 0;
    if let Some(tools) = tools {
        let instructions = json_object_instructions(tools);
        match out.first_mut() {
            Some(Message::System(system)) => {
                system.content =
                    Content::Text(format!("{}\n\n{instructions}", system.content.text()));
            }
            _ => {
                out.insert(
                    0,
                    Message::System(SystemMessage {
                        content: Content::Text(instructions),
                        name: None,
                    }),
                );
                inserted = 1;
            }
        }
    }
    TemplateConversation {
        messages: out,
        tools: None,
        inserted,
    }
}

/// Calls as [`ToolCallFormat::JsonObject`] writes them: one object, or a list of several, laid
/// out as constrained decoding lays JSON out (`", "` and `": "`). The arguments are kept as the
/// model wrote them.
fn json_object_calls(calls: &[ToolCall]) -> String {
    let objects: Vec<String> = calls
        .iter()
        .map(|call| {
            let arguments = call.function.arguments.trim();
            format!(
                "{{\"name\": {}, \"arguments\": {}}}",
                Json::String(call.function.name.clone()),
                if arguments.is_empty() {
                    "{}"
                } else {
                    arguments
                }
            )
        })
        .collect();
    match objects.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    }
}

/// A system-prompt paragraph that teaches a model with no tool syntax in its template to call
/// `tools` the way [`ToolCallFormat::JsonObject`] parses.
pub fn json_object_instructions(tools: &[Tool]) -> String {
    let mut text = String::from(
        "You can call the following functions. To call one, reply with only a JSON object of the \
         form {\"name\": <function name>, \"arguments\": <arguments object>} and nothing else.\n\
         Functions:",
    );
    for tool in tools {
        text.push('\n');
        text.push_str(&serde_json::to_string(&tool.function).expect("a Tool always serializes"));
    }
    text
}

fn parse_hermes(text: &str, next_id: &mut dyn FnMut() -> String) -> ParsedCompletion {
    let mut content = String::new();
    let mut tool_calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(OPEN_TAG) {
        content.push_str(&rest[..open]);
        let after_open = &rest[open + OPEN_TAG.len()..];
        // A generation stopped by a stop token may lack the closing tag; the call is still whole.
        let (inner, block_len, after) = match after_open.find(CLOSE_TAG) {
            Some(close) => (
                &after_open[..close],
                OPEN_TAG.len() + close + CLOSE_TAG.len(),
                &after_open[close + CLOSE_TAG.len()..],
            ),
            None => (after_open, rest.len() - open, ""),
        };
        match call_from_json(inner.trim(), next_id) {
            Some(call) => tool_calls.push(call),
            None => content.push_str(&rest[open..open + block_len]),
        }
        rest = after;
    }
    content.push_str(rest);
    finish(text, content, tool_calls)
}

fn parse_json_object(text: &str, next_id: &mut dyn FnMut() -> String) -> ParsedCompletion {
    let body = strip_code_fence(text.trim());
    let calls = match serde_json::from_str::<Json>(body) {
        Ok(value @ Json::Object(_)) => call_from_value(&value, next_id).map(|call| vec![call]),
        Ok(Json::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|item| call_from_value(item, next_id))
            .collect(),
        _ => None,
    };
    match calls {
        Some(tool_calls) => ParsedCompletion {
            content: None,
            tool_calls,
        },
        None => ParsedCompletion {
            content: Some(text.to_string()),
            tool_calls: Vec::new(),
        },
    }
}

/// Small models often wrap JSON in a Markdown code fence; the call inside is still meant.
fn strip_code_fence(text: &str) -> &str {
    let Some(inner) = text.strip_prefix("```") else {
        return text;
    };
    let Some(inner) = inner.strip_suffix("```") else {
        return text;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.trim()
}

fn finish(original: &str, content: String, tool_calls: Vec<ToolCall>) -> ParsedCompletion {
    if tool_calls.is_empty() {
        return ParsedCompletion {
            content: Some(original.to_string()),
            tool_calls,
        };
    }
    let content = content.trim();
    ParsedCompletion {
        content: (!content.is_empty()).then(|| content.to_string()),
        tool_calls,
    }
}

fn call_from_json(text: &str, next_id: &mut dyn FnMut() -> String) -> Option<ToolCall> {
    let value: Json = serde_json::from_str(text).ok()?;
    call_from_value(&value, next_id)
}

/// `{"name": string, "arguments" | "parameters": object or JSON string}`; anything else is not a call.
fn call_from_value(value: &Json, next_id: &mut dyn FnMut() -> String) -> Option<ToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let arguments = object
        .get("arguments")
        .or_else(|| object.get("parameters"))?;
    let arguments = match arguments {
        Json::String(text) => text.clone(),
        Json::Null => "{}".to_string(),
        other => other.to_string(),
    };
    Some(ToolCall::new(next_id(), name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("call_{n}")
        }
    }

    fn hermes(text: &str) -> ParsedCompletion {
        ToolCallFormat::Hermes.parse_with_ids(text, &mut counter())
    }

    fn json_object(text: &str) -> ParsedCompletion {
        ToolCallFormat::JsonObject.parse_with_ids(text, &mut counter())
    }

    #[test]
    fn detects_format_from_template() {
        assert_eq!(
            ToolCallFormat::detect("... within <tool_call></tool_call> XML tags ..."),
            ToolCallFormat::Hermes
        );
        assert_eq!(
            ToolCallFormat::detect(
                "{% for message in messages %}{{ message.content }}{% endfor %}"
            ),
            ToolCallFormat::JsonObject
        );
    }

    #[test]
    fn parses_one_hermes_call() {
        let parsed = hermes(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
        );
        assert_eq!(parsed.content, None);
        assert_eq!(
            parsed.tool_calls,
            [ToolCall::new(
                "call_1",
                "get_weather",
                r#"{"city":"Paris","days":2}"#
            )]
        );
        assert_eq!(
            parsed.tool_calls[0].parsed_arguments().unwrap(),
            serde_json::json!({"city": "Paris", "days": 2})
        );
    }

    #[test]
    fn parses_several_calls_and_keeps_surrounding_text() {
        let parsed = hermes(
            "Let me look both up.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
        );
        assert_eq!(parsed.content.as_deref(), Some("Let me look both up."));
        assert_eq!(
            parsed.tool_calls,
            [
                ToolCall::new("call_1", "a", "{}"),
                ToolCall::new("call_2", "b", r#"{"x":[1,2]}"#),
            ]
        );
    }

    #[test]
    fn accepts_unclosed_last_call_string_arguments_and_parameters() {
        let parsed = hermes("<tool_call>\n{\"name\": \"a\", \"arguments\": \"{\\\"q\\\": 1}\"}\n");
        assert_eq!(
            parsed.tool_calls,
            [ToolCall::new("call_1", "a", r#"{"q": 1}"#)]
        );
        assert_eq!(parsed.content, None);
        let parsed = hermes("<tool_call>{\"name\": \"a\", \"parameters\": {\"q\": 1}}</tool_call>");
        assert_eq!(
            parsed.tool_calls,
            [ToolCall::new("call_1", "a", r#"{"q":1}"#)]
        );
    }

    #[test]
    fn malformed_calls_stay_content() {
        let text = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {oops}\n</tool_call>";
        let parsed = hermes(text);
        assert_eq!(parsed.content.as_deref(), Some(text));
        assert!(parsed.tool_calls.is_empty());

        // A broken call next to a good one: the good one is parsed, the broken one kept as text.
        let parsed = hermes(
            "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"ok\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(
            parsed.content.as_deref(),
            Some("<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>")
        );
        assert_eq!(parsed.tool_calls, [ToolCall::new("call_1", "ok", "{}")]);

        for text in [
            "<tool_call>",
            "<tool_call></tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"a\"}</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
            "no calls at all </tool_call>",
        ] {
            let parsed = hermes(text);
            assert_eq!(parsed.content.as_deref(), Some(text), "{text}");
            assert!(parsed.tool_calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn plain_text_is_untouched() {
        let parsed = hermes("  The answer is 4.\n");
        assert_eq!(parsed.content.as_deref(), Some("  The answer is 4.\n"));
        assert!(parsed.tool_calls.is_empty());
    }

    #[test]
    fn json_object_fallback() {
        let parsed = json_object(" {\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n");
        assert_eq!(parsed.content, None);
        assert_eq!(
            parsed.tool_calls,
            [ToolCall::new("call_1", "add", r#"{"a":1,"b":2}"#)]
        );

        let parsed = json_object("```json\n{\"name\": \"add\", \"parameters\": {}}\n```");
        assert_eq!(parsed.tool_calls, [ToolCall::new("call_1", "add", "{}")]);

        let parsed = json_object(
            "[{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"x\": 1}}]",
        );
        assert_eq!(
            parsed.tool_calls,
            [
                ToolCall::new("call_1", "a", "{}"),
                ToolCall::new("call_2", "b", r#"{"x":1}"#)
            ]
        );

        for text in [
            "The answer is {\"name\": \"a\", \"arguments\": {}}",
            "{\"name\": \"Bob\", \"age\": 3}",
            "{\"name\": \"a\", \"arguments\": {}",
            "[]",
            "[{\"name\": \"a\", \"arguments\": {}}, 3]",
            "42",
            "",
        ] {
            let parsed = json_object(text);
            assert_eq!(parsed.content.as_deref(), Some(text), "{text}");
            assert!(parsed.tool_calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn json_object_format_ignores_hermes_tags_and_vice_versa() {
        let tagged = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>";
        assert!(json_object(tagged).tool_calls.is_empty());
        let bare = "{\"name\": \"a\", \"arguments\": {}}";
        assert!(hermes(bare).tool_calls.is_empty());
    }

    #[test]
    fn generated_ids_are_openai_style_and_unique() {
        let ids: Vec<String> = (0..1000).map(|_| new_tool_call_id()).collect();
        for id in &ids {
            assert!(id.starts_with("call_") && id.len() == 29, "{id}");
            assert!(id[5..].chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        let unique: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(unique.len(), ids.len());
        let parsed = ToolCallFormat::Hermes
            .parse("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>");
        assert!(parsed.tool_calls[0].id.starts_with("call_"));
    }

    #[test]
    fn parsed_completion_becomes_an_assistant_message() {
        let message = hermes("Hi <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>")
            .into_assistant_message();
        assert_eq!(message.content, Some(Content::Text("Hi".into())));
        assert_eq!(message.tool_calls.len(), 1);
    }

    #[test]
    fn instructions_list_each_tool() {
        let tools = [Tool::function(
            "add",
            "Adds two numbers",
            serde_json::json!({"type": "object", "properties": {"a": {"type": "number"}}}),
        )];
        let text = json_object_instructions(&tools);
        assert!(text.contains(
            r#"{"name":"add","description":"Adds two numbers","parameters":{"type":"object","properties":{"a":{"type":"number"}}}}"#
        ), "{text}");
    }
}
