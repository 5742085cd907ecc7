//! A model's own chat template (Hugging Face Jinja), rendered the way Python's `transformers`
//! renders it, so that the prompt the engine tokenizes is byte for byte the prompt the model saw in
//! training, and the same one a Python stack (vLLM, Unsloth, ART) would build.
//!
//! What `transformers` does in `apply_chat_template(..., tokenize=False)`, and this module mirrors:
//! - jinja2 with `trim_blocks` and `lstrip_blocks`, `{% break %}`/`{% continue %}`, no autoescape;
//! - `tojson` is `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
//!   not Jinja's HTML-safe one (which would turn `<` into `\u003c` inside tool schemas);
//! - globals `raise_exception(message)` and `strftime_now(format)`;
//! - the `{% generation %}` block (used for assistant masks) renders its body unchanged;
//! - keys whose value is null are dropped from each message, and reasoning given as `thinking` or
//!   `reasoning` is also passed as `reasoning_content` (and the reverse);
//! - the tokenizer's special tokens (`bos_token`, `eos_token`, ...) are template variables, and
//!   caller kwargs override them;
//! - the template sees `messages`, `tools` (none when absent), `documents` (none) and
//!   `add_generation_prompt`.
//!
//! Converting our OpenAI-shaped [`Message`]s follows vLLM's conventions, because the OpenAI wire
//! form and the form templates expect differ in two places: tool-call `arguments` travel as a JSON
//! string but templates print them with `tojson` and expect an object; and content given as a list
//! of text parts is joined with newlines, since most templates concatenate `content` as a string.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::engine::tool_calls::ToolCallFormat;
use crate::types::{Content, ContentPart, Message, Tool};

const TEMPLATE_NAME: &str = "chat_template";

/// Why a chat template could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error(
        "the chat template does not parse: {message}. Check the template text (the `chat_template` \
         of tokenizer_config.json, or `tokenizer.chat_template` in a GGUF file)"
    )]
    Syntax { message: String },
    /// The template called `raise_exception`: `message` is the template's own text.
    #[error("the chat template rejected the conversation: {message}")]
    Raised { message: String },
    #[error(
        "the chat template failed while rendering: {message}. The conversation probably has a shape \
         this template does not handle (a role, content type or field it does not expect)"
    )]
    Render { message: String },
    #[error("cannot apply a chat template to an empty conversation: pass at least one message")]
    EmptyConversation,
    #[error(
        "message {index} is not a JSON object: pass OpenAI-style message objects with a `role`"
    )]
    InvalidMessage { index: usize },
    #[error(
        "cannot locate assistant message {message_index} in the rendered conversation: {reason}"
    )]
    TurnNotLocated {
        message_index: usize,
        reason: String,
    },
}

/// Per-call rendering options beyond the messages and tools.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Append the header that opens a new assistant turn (for generation).
    pub add_generation_prompt: bool,
    /// Extra template variables for this call, e.g. `enable_thinking` for Qwen3. They override
    /// the template's special tokens and its [`ChatTemplate::with_kwarg`] defaults.
    pub kwargs: Map<String, Json>,
}

impl RenderOptions {
    pub fn generation() -> Self {
        RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        }
    }

    pub fn with_kwarg(mut self, name: impl Into<String>, value: Json) -> Self {
        self.kwargs.insert(name.into(), value);
        self
    }
}

/// A rendered conversation with the place of each assistant turn in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    pub text: String,
    /// In message order; turns never overlap.
    pub assistant_turns: Vec<AssistantTurn>,
}

/// Where one assistant message sits in [`RenderedChat::text`], as byte offsets.
///
/// `text[start..end]` is what the model itself would have generated for that turn: everything after
/// the generation prompt (`<|im_start|>assistant\n` for ChatML) up to and including the
/// end-of-turn token (the template's `eos_token`, when it has one and emits it there). Template glue
/// after that token (the `\n` after `<|im_end|>`) belongs to the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AssistantTurn {
    /// Index of the assistant message in the conversation.
    pub message_index: usize,
    pub start: usize,
    pub end: usize,
}

/// A piece of a [`RenderedChat`]: prompt text, or the generated text of one assistant message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment<'a> {
    pub text: &'a str,
    /// `Some(index of the assistant message)` for a generated piece, `None` for prompt text.
    pub assistant_message: Option<usize>,
}

impl RenderedChat {
    /// The whole text cut into alternating prompt and assistant pieces, in order, with no gaps
    /// (concatenating the pieces gives back `text`). Empty prompt pieces are left out.
    pub fn segments(&self) -> Vec<Segment<'_>> {
        let mut segments = Vec::with_capacity(self.assistant_turns.len() * 2 + 1);
        let mut at = 0;
        for turn in &self.assistant_turns {
            if turn.start > at {
                segments.push(Segment {
                    text: &self.text[at..turn.start],
                    assistant_message: None,
                });
            }
            segments.push(Segment {
                text: &self.text[turn.start..turn.end],
                assistant_message: Some(turn.message_index),
            });
            at = turn.end;
        }
        if at < self.text.len() {
            segments.push(Segment {
                text: &self.text[at..],
                assistant_message: None,
            });
        }
        segments
    }
}

/// A compiled chat template with the special tokens and default kwargs it renders with.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: Map<String, Json>,
    kwargs: Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("special_tokens", &self.special_tokens)
            .field("kwargs", &self.kwargs)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a Hugging Face chat template (the Jinja text itself, not a file name).
    pub fn new(source: impl Into<String>) -> Result<Self, ChatTemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("default delimiters are valid"),
        );
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_test("iterable", is_iterable);
        env.add_test("sequence", is_sequence);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_blocks(&source))
            .map_err(|err| ChatTemplateError::Syntax {
                message: describe(&err),
            })?;
        Ok(ChatTemplate {
            env,
            source,
            special_tokens: Map::new(),
            kwargs: Map::new(),
        })
    }

    /// Sets a special token the template can read, e.g. `("bos_token", "<|im_start|>")`, as
    /// `tokenizer.special_tokens_map` provides them in transformers.
    pub fn with_special_token(mut self, name: impl Into<String>, token: impl Into<String>) -> Self {
        self.special_tokens
            .insert(name.into(), Json::String(token.into()));
        self
    }

    pub fn with_bos_token(self, token: impl Into<String>) -> Self {
        self.with_special_token("bos_token", token)
    }

    pub fn with_eos_token(self, token: impl Into<String>) -> Self {
        self.with_special_token("eos_token", token)
    }

    /// A template variable given on every render (per-call [`RenderOptions::kwargs`] override it).
    pub fn with_kwarg(mut self, name: impl Into<String>, value: Json) -> Self {
        self.kwargs.insert(name.into(), value);
        self
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).and_then(Json::as_str)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special_token("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special_token("eos_token")
    }

    /// How this model writes tool calls, judged from its template.
    pub fn tool_call_format(&self) -> ToolCallFormat {
        ToolCallFormat::detect(&self.source)
    }

    /// Renders a conversation, as `tokenizer.apply_chat_template(messages, tools=tools,
    /// add_generation_prompt=..., tokenize=False)` does.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[Tool]>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_options(
            messages,
            tools,
            &RenderOptions {
                add_generation_prompt,
                ..Default::default()
            },
        )
    }

    /// The prompt for generating the next assistant message: the conversation followed by the
    /// header of a new assistant turn.
    pub fn render_prefix_for_generation(
        &self,
        messages: &[Message],
        tools: Option<&[Tool]>,
    ) -> Result<String, ChatTemplateError> {
        self.render(messages, tools, true)
    }

    pub fn render_with_options(
        &self,
        messages: &[Message],
        tools: Option<&[Tool]>,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let messages = template_messages(messages);
        let tools = tools.map(template_tools);
        self.render_json(&messages, tools.as_deref(), options)
    }

    /// Renders messages and tools given as JSON in the form templates read (Hugging Face's:
    /// tool-call arguments as objects), with no conversion beyond what transformers itself does.
    pub fn render_json(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        if messages.is_empty() {
            return Err(ChatTemplateError::EmptyConversation);
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(index, message)| normalize_message(index, message))
            .collect::<Result<Vec<_>, _>>()?;
        self.render_normalized(&messages, tools, options)
    }

    /// Renders a conversation and finds where each assistant message's generated text lies in it,
    /// so that a trainer can tell prompt tokens from generated ones.
    ///
    /// Each turn is located by rendering the conversation up to it with a generation prompt (its
    /// start) and up to and including it (its end), which requires the template to render earlier
    /// turns the same whatever follows them. Templates that rewrite history (Qwen3 drops the
    /// reasoning of earlier turns) fail with [`ChatTemplateError::TurnNotLocated`]; train such
    /// turns one at a time from [`ChatTemplate::render_prefix_for_generation`] instead.
    pub fn render_with_turns(
        &self,
        messages: &[Message],
        tools: Option<&[Tool]>,
        options: &RenderOptions,
    ) -> Result<RenderedChat, ChatTemplateError> {
        let messages = template_messages(messages);
        let tools = tools.map(template_tools);
        self.render_json_with_turns(&messages, tools.as_deref(), options)
    }

    /// [`ChatTemplate::render_with_turns`] for messages given as template JSON.
    pub fn render_json_with_turns(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        options: &RenderOptions,
    ) -> Result<RenderedChat, ChatTemplateError> {
        let text = self.render_json(messages, tools, options)?;
        let not_located = |message_index: usize, reason: &str| ChatTemplateError::TurnNotLocated {
            message_index,
            reason: reason.to_string(),
        };
        let through = |end: usize, add_generation_prompt: bool| {
            let options = RenderOptions {
                add_generation_prompt,
                kwargs: options.kwargs.clone(),
            };
            self.render_json(&messages[..end], tools, &options)
        };
        let mut assistant_turns: Vec<AssistantTurn> = Vec::new();
        for (index, message) in messages.iter().enumerate() {
            if message.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            if index == 0 {
                return Err(not_located(
                    index,
                    "the conversation starts with an assistant message, so no prompt precedes it",
                ));
            }
            let prefix = through(index, true)?;
            if !text.starts_with(&prefix) {
                return Err(not_located(
                    index,
                    "the conversation rendered up to this turn (with a generation prompt) is not a \
                     prefix of the whole rendering; the template renders earlier turns differently \
                     depending on what follows them",
                ));
            }
            let start = prefix.len();
            if assistant_turns.last().is_some_and(|turn| turn.end > start) {
                return Err(not_located(
                    index,
                    "it would overlap the previous assistant turn",
                ));
            }
            let with_turn = through(index + 1, false)?;
            let eos_end = self
                .eos_token()
                .filter(|eos| !eos.is_empty())
                .and_then(|eos| {
                    text[start..]
                        .find(eos)
                        .map(|offset| start + offset + eos.len())
                });
            let end = if text.starts_with(&with_turn) && with_turn.len() >= start {
                // The end-of-turn token is what the model generates last; glue after it is prompt.
                match eos_end {
                    Some(eos_end) if eos_end <= with_turn.len() => eos_end,
                    _ => with_turn.len(),
                }
            } else {
                eos_end.ok_or_else(|| {
                    not_located(
                        index,
                        "the conversation rendered through this turn is not a prefix of the whole \
                         rendering, and the template has no eos_token to find the turn's end by",
                    )
                })?
            };
            assistant_turns.push(AssistantTurn {
                message_index: index,
                start,
                end,
            });
        }
        Ok(RenderedChat {
            text,
            assistant_turns,
        })
    }

    fn render_normalized(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        // Same precedence as transformers: special tokens < kwargs; the named arguments are passed
        // explicitly there, so they cannot be overridden.
        let mut context = self.special_tokens.clone();
        context.extend(self.kwargs.clone());
        context.extend(options.kwargs.clone());
        context.insert("messages".into(), Json::Array(messages.to_vec()));
        context.insert(
            "tools".into(),
            tools.map_or(Json::Null, |tools| Json::Array(tools.to_vec())),
        );
        context.insert("documents".into(), Json::Null);
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(options.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added in ChatTemplate::new");
        template
            .render(Value::from(minijinja::value::Serde(&context)))
            .map_err(render_error)
    }
}

/// Our messages in the JSON form chat templates read (see the module docs for the conversions).
pub fn template_messages(messages: &[Message]) -> Vec<Json> {
    messages.iter().map(template_message).collect()
}

/// Tools in the JSON form chat templates read: OpenAI's `{"type": "function", "function": {...}}`.
pub fn template_tools(tools: &[Tool]) -> Vec<Json> {
    tools
        .iter()
        .map(|tool| serde_json::to_value(tool).expect("a Tool always serializes"))
        .collect()
}

fn template_message(message: &Message) -> Json {
    let mut json = serde_json::to_value(message).expect("a Message always serializes");
    let Some(object) = json.as_object_mut() else {
        return json;
    };
    let content = match message {
        Message::System(m) | Message::Developer(m) => Some(&m.content),
        Message::User(m) => Some(&m.content),
        Message::Assistant(m) => m.content.as_ref(),
        Message::Tool(m) => Some(&m.content),
    };
    if let Some(Content::Parts(parts)) = content {
        let texts: Option<Vec<&str>> = parts
            .iter()
            .map(|part| match part {
                ContentPart::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        if let Some(texts) = texts {
            object.insert("content".into(), Json::String(texts.join("\n")));
        }
    }
    if let Some(Json::Array(calls)) = object.get_mut("tool_calls") {
        for call in calls {
            let Some(function) = call.get_mut("function").and_then(Json::as_object_mut) else {
                continue;
            };
            let parsed = function
                .get("arguments")
                .and_then(Json::as_str)
                .and_then(|text| serde_json::from_str::<Json>(text).ok());
            if let Some(arguments @ Json::Object(_)) = parsed {
                function.insert("arguments".into(), arguments);
            }
        }
    }
    json
}

const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers' `_normalize_chat_messages` and `_alias_reasoning_fields`.
fn normalize_message(index: usize, message: &Json) -> Result<Json, ChatTemplateError> {
    let object = message
        .as_object()
        .ok_or(ChatTemplateError::InvalidMessage { index })?;
    let mut object: Map<String, Json> = object
        .iter()
        .filter(|(_, value)| !value.is_null())
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|key| object.get(*key))
        .cloned();
    if let Some(reasoning) = reasoning {
        // Python builds {"thinking": r, **message, "reasoning_content": r}: `thinking` keeps its
        // place if present and goes first otherwise; `reasoning_content` keeps its place or goes last.
        let mut aliased = Map::new();
        if !object.contains_key("thinking") {
            aliased.insert("thinking".into(), reasoning.clone());
        }
        aliased.extend(object);
        aliased.insert("reasoning_content".into(), reasoning);
        object = aliased;
    }
    Ok(Json::Object(object))
}

/// Turns `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension, which
/// renders its body unchanged) into `{% if true %}` / `{% endif %}`, keeping whitespace-control
/// markers so that trimming around them is unchanged.
fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        let Some(close) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..close];
        let body = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+']);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(keyword) => {
                let lead = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let trail = &inner[inner.trim_end_matches(['-', '+']).len()..];
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(keyword);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

/// jinja2's `iterable` test is `iter(value)` succeeding: false for none (minijinja says true, and
/// templates such as Qwen3-Coder's `tools is iterable and tools | length > 0` then fail on none).
fn is_iterable(value: &Value) -> bool {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        // jinja2's Undefined iterates as empty.
        ValueKind::Undefined => true,
        ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map => true,
        _ => value.try_iter().is_ok(),
    }
}

/// jinja2's `sequence` test is "has a length and can be indexed": true for strings and dicts too,
/// which templates rely on (`args is sequence` to decide whether to `tojson` a value).
fn is_sequence(value: &Value) -> bool {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        ValueKind::Undefined => true,
        ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map => true,
        _ => value.len().is_some(),
    }
}

/// Marks an error as the template's own `raise_exception`, so it is reported as such.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return ChatTemplateError::Raised {
                message: raised.0.clone(),
            };
        }
        source = current.source();
    }
    match err.kind() {
        ErrorKind::SyntaxError => ChatTemplateError::Syntax {
            message: describe(&err),
        },
        _ => ChatTemplateError::Render {
            message: describe(&err),
        },
    }
}

fn describe(err: &Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(current) = source {
        message.push_str(": ");
        message.push_str(&current.to_string());
        source = current.source();
    }
    message
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// which is `json.dumps` with those arguments; positional or keyword.
fn tojson_filter(value: &Value, positional: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most ensure_ascii, indent, separators and sort_keys",
        ));
    }
    let mut options: [Option<Value>; 4] = Default::default();
    for (slot, value) in options.iter_mut().zip(positional) {
        *slot = Some(value.clone());
    }
    for (slot, name) in options.iter_mut().zip(NAMES) {
        if let Some(value) = kwargs.get::<Option<Value>>(name)? {
            *slot = Some(value);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = options;
    let indent = match indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => Some(" ".repeat(usize::try_from(v.clone()).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson indent must be a string or a number",
            )
        })?)),
    };
    let (item_separator, key_separator) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => (item.to_string(), key.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair (item_separator, key_separator)",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let dumper = JsonDumper {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps`, byte for byte, over template values.
struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl JsonDumper {
    fn dump(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: an undefined value is not JSON serializable",
                ))
            }
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let number = f64::try_from(value.clone())?;
                out.push_str(&python_float_json(number));
            }
            ValueKind::String => self.string(value.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|key| self.key_text(key));
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(&self.key_text(key), out);
                    out.push_str(&self.key_separator);
                    self.dump(&value.get_item(key)?, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.dump(item, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push(']');
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson: a value of type {} is not JSON serializable",
                        value.kind()
                    ),
                ))
            }
        }
        Ok(())
    }

    fn key_text(&self, key: &Value) -> String {
        match key.kind() {
            ValueKind::String => key.as_str().unwrap_or_default().to_string(),
            ValueKind::None => "null".into(),
            ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
            ValueKind::Number if !key.is_integer() => {
                python_float_json(f64::try_from(key.clone()).unwrap_or(f64::NAN))
            }
            _ => key.to_string(),
        }
    }

    fn separate(&self, index: usize, depth: usize, out: &mut String) {
        if index > 0 {
            out.push_str(&self.item_separator);
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn string(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `float.__repr__` as `json.dumps` writes it (`NaN`, `Infinity` for the non-finite).
fn python_float_json(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    python_float_repr(value)
}

/// Python's shortest round-trip `repr` of a finite float: positional notation for exponents in
/// -4..16 (always with a fractional part), scientific with a signed two-digit exponent otherwise.
fn python_float_repr(value: f64) -> String {
    let sci = format!("{value:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("`{:e}` always has an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let (int_part, frac_part) = if point <= 0 {
            (
                "0".to_string(),
                format!("{}{}", "0".repeat((-point) as usize), digits),
            )
        } else if point as usize >= digits.len() {
            (
                format!("{}{}", digits, "0".repeat(point as usize - digits.len())),
                String::new(),
            )
        } else {
            (
                digits[..point as usize].to_string(),
                digits[point as usize..].to_string(),
            )
        };
        let frac_part = if frac_part.is_empty() {
            "0".to_string()
        } else {
            frac_part
        };
        format!("{sign}{int_part}.{frac_part}")
    } else {
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.abs())
    }
}

/// transformers' `strftime_now(format)`. Python uses local time; a server here has no time zone
/// database, so this is UTC (which is what a server's local time usually is).
fn strftime_now(format: String) -> Result<Value, Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, seconds)))
}

fn strftime(format: &str, unix_seconds: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Howard Hinnant's days-to-civil conversion (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn chatml() -> ChatTemplate {
        ChatTemplate::new(CHATML)
            .unwrap()
            .with_eos_token("<|im_end|>")
    }

    fn render_str(template: &str, context: Json) -> Result<String, ChatTemplateError> {
        let template = ChatTemplate::new(template)?;
        let options = RenderOptions {
            add_generation_prompt: false,
            kwargs: context.as_object().unwrap().clone(),
        };
        template.render_json(&[json!({"role": "user", "content": "x"})], None, &options)
    }

    #[test]
    fn renders_chatml() {
        let text = chatml()
            .render_prefix_for_generation(&[Message::system("S"), Message::user("Hi")], None)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let value = json!({"b": [1, 2.5, 1e-5, 1e16, 100.0], "a": "é<\"\n\u{1}", "c": {}, "d": [], "e": null, "f": true});
        let out = render_str("{{ v | tojson }}", json!({"v": value})).unwrap();
        assert_eq!(
            out,
            r#"{"b": [1, 2.5, 1e-05, 1e+16, 100.0], "a": "é<\"\n\u0001", "c": {}, "d": [], "e": null, "f": true}"#
        );
        let out = render_str(
            "{{ v | tojson(indent=2, sort_keys=true) }}",
            json!({"v": {"b": [1], "a": {"x": "y"}}}),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": {\n    \"x\": \"y\"\n  },\n  \"b\": [\n    1\n  ]\n}"
        );
        let out = render_str("{{ v | tojson(ensure_ascii=true) }}", json!({"v": "é😀"})).unwrap();
        assert_eq!(out, r#""\u00e9\ud83d\ude00""#);
        let out = render_str(
            "{{ v | tojson(separators=(',', ':')) }}",
            json!({"v": {"a": [1, 2]}}),
        )
        .unwrap();
        assert_eq!(out, r#"{"a":[1,2]}"#);
    }

    #[test]
    fn float_repr_is_pythons() {
        for (value, expected) in [
            (0.1, "0.1"),
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456789012345.0, "123456789012345.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(python_float_repr(value), expected, "{value}");
        }
    }

    #[test]
    fn raise_exception_carries_the_templates_message() {
        let err = render_str(
            "{{ raise_exception('Only user and assistant roles!') }}",
            json!({}),
        )
        .unwrap_err();
        match err {
            ChatTemplateError::Raised { message } => {
                assert_eq!(message, "Only user and assistant roles!")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m }").unwrap_err();
        assert!(matches!(err, ChatTemplateError::Syntax { .. }), "{err:?}");
        assert!(err.to_string().contains("does not parse"), "{err}");
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}\n{%- generation -%}  !  {%- endgeneration %}{% endfor %}";
        assert_eq!(
            rewrite_generation_blocks(template),
            "{% for m in messages %}{% if true %}[{{ m.content }}]{% endif %}\n{%- if true -%}  !  {%- endif %}{% endfor %}"
        );
        assert_eq!(render_str(template, json!({})).unwrap(), "[x]!");
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let out = render_str(
            "{% for m in messages %}{% if m.content.startswith('x') %}{{ ' A '.strip() }}{% break %}{% endif %}{% endfor %}{{ 'a,b'.split(',') | length }}",
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "A2");
    }

    #[test]
    fn type_tests_follow_jinja2() {
        let out = render_str(
            "{{ [none is iterable, tools is iterable, 'ab' is iterable, {} is iterable, 1 is iterable, nope is iterable] }}\
             {{ [none is sequence, 'ab' is sequence, {'a': 1} is sequence, [1] is sequence, 2 is sequence] }}",
            json!({}),
        )
        .unwrap();
        assert_eq!(
            out,
            "[False, False, True, True, False, True][False, True, True, True, False]"
        );
    }

    #[test]
    fn kwargs_override_special_tokens() {
        let template = ChatTemplate::new("{{ bos_token }}|{{ flag }}|{{ tools }}")
            .unwrap()
            .with_bos_token("<s>")
            .with_kwarg("flag", json!(1));
        let options = RenderOptions::default().with_kwarg("flag", json!("two"));
        assert_eq!(
            template
                .render_with_options(&[Message::user("x")], None, &options)
                .unwrap(),
            "<s>|two|None"
        );
    }

    #[test]
    fn null_fields_are_dropped_and_arguments_become_objects() {
        let mut call = Message::Assistant(crate::types::AssistantMessage {
            content: None,
            tool_calls: vec![crate::types::ToolCall::new(
                "call_1",
                "f",
                r#"{"b": 1, "a": [true]}"#,
            )],
            ..Default::default()
        });
        let json = template_message(&call);
        assert_eq!(
            json,
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [true]}}}]})
        );
        // Key order is kept, as in Python dicts.
        assert_eq!(
            serde_json::to_string(&json["tool_calls"][0]["function"]["arguments"]).unwrap(),
            r#"{"b":1,"a":[true]}"#
        );
        let template =
            ChatTemplate::new("{{ messages[0] is mapping }}{{ 'content' in messages[0] }}")
                .unwrap();
        assert_eq!(
            template
                .render(std::slice::from_ref(&call), None, false)
                .unwrap(),
            "TrueFalse"
        );
        if let Message::Assistant(m) = &mut call {
            m.tool_calls[0].function.arguments = "not json".into();
        }
        assert_eq!(
            template_message(&call)["tool_calls"][0]["function"]["arguments"],
            json!("not json")
        );
    }

    #[test]
    fn text_parts_are_joined() {
        let message = Message::user(Content::Parts(vec![
            ContentPart::Text { text: "a".into() },
            ContentPart::Text { text: "b".into() },
        ]));
        assert_eq!(template_message(&message)["content"], json!("a\nb"));
    }

    #[test]
    fn reasoning_is_aliased_like_transformers() {
        let normalized = normalize_message(
            0,
            &json!({"role": "assistant", "content": "x", "reasoning": "r", "name": null}),
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&normalized).unwrap(),
            r#"{"thinking":"r","role":"assistant","content":"x","reasoning":"r","reasoning_content":"r"}"#
        );
    }

    #[test]
    fn turns_are_located_in_chatml() {
        let messages = [
            Message::system("S"),
            Message::user("Q1"),
            Message::assistant("A1"),
            Message::user("Q2"),
            Message::assistant("A2"),
        ];
        let rendered = chatml()
            .render_with_turns(&messages, None, &RenderOptions::default())
            .unwrap();
        let pieces: Vec<(&str, Option<usize>)> = rendered
            .segments()
            .iter()
            .map(|s| (s.text, s.assistant_message))
            .collect();
        assert_eq!(
            pieces,
            [
                (
                    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n",
                    None
                ),
                ("A1<|im_end|>", Some(2)),
                ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", None),
                ("A2<|im_end|>", Some(4)),
                ("\n", None),
            ]
        );
        assert_eq!(
            rendered
                .segments()
                .iter()
                .map(|s| s.text)
                .collect::<String>(),
            rendered.text
        );
    }

    #[test]
    fn history_rewriting_templates_are_refused_not_mislocated() {
        // Drops earlier assistant turns entirely unless they are last, like reasoning-stripping.
        let template = ChatTemplate::new(
            "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        )
        .unwrap();
        let messages = [
            Message::user("Q1"),
            Message::assistant("A1"),
            Message::user("Q2"),
        ];
        let err = template
            .render_with_turns(&messages, None, &RenderOptions::default())
            .unwrap_err();
        assert!(
            matches!(
                err,
                ChatTemplateError::TurnNotLocated {
                    message_index: 1,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn empty_conversations_are_refused() {
        assert!(matches!(
            chatml().render(&[], None, true),
            Err(ChatTemplateError::EmptyConversation)
        ));
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            strftime("%d %b %Y|%B %A %a|%H:%M:%S %I%p|%y-%m|%%|%Q", 1_709_211_909),
            "29 Feb 2024|February Thursday Thu|13:05:09 01PM|24-02|%|%Q"
        );
    }
}
