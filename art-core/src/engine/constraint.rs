//! Structured output: constrained decoding with [llguidance](https://github.com/guidance-ai/llguidance).
//!
//! A [`Constraint`] in a request's [`SamplingParams`](super::SamplingParams) limits every sampled
//! token to those that keep the completion a prefix of the constraint's language: a JSON schema,
//! any JSON object, a Lark grammar or a regex. Each completion (each of the `n`) has its own
//! matcher. Before a token is sampled, the matcher computes the set of allowed tokens and the
//! logits of all others become -inf; after it, the matcher advances by the sampled token. When
//! the grammar admits nothing more, the completion ends with the model's end-of-sequence token
//! (finish reason `stop`); while the grammar *may* end (e.g. after a number), end-of-sequence is
//! one of the allowed tokens and the model decides.
//!
//! **Log-probabilities of constrained tokens.** A constrained token's `logprob` (and its
//! `top_logprobs`) come from the distribution it was actually drawn from: the log-softmax of
//! `logits / temperature` over the *allowed* tokens only (disallowed tokens have probability 0).
//! It is therefore >= the model's unconstrained log-probability of that token. The
//! end-of-sequence token appended when the grammar is complete was the only allowed token: its
//! logprob is 0. A trainer that recomputes log-probabilities with a plain forward gets the
//! unconstrained values, which differ wherever the mask removed probability mass.
//!
//! JSON is generated in one fixed layout unless the schema says otherwise through llguidance's
//! `x-guidance` key: no free whitespace, `", "` between items and `": "` after keys (as Python's
//! `json.dumps` writes it, and as models usually do). Only local `$ref`s (`#/...`) are supported.
//!
//! The token trie the matchers need is built from the tokenizer once per [`Engine`](super::Engine),
//! on first use (or by [`Engine::prepare_constraints`](super::Engine::prepare_constraints)).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value as Json};
use tokenizers::Tokenizer;

use super::error::{EngineError, Result};
use super::tool_calls::ToolCallFormat;
use crate::types::{ResponseFormat, Tool};

/// What a completion must look like.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value valid against this JSON schema (OpenAI's `response_format: json_schema`).
    JsonSchema(Json),
    /// Any JSON object (OpenAI's `response_format: json_object`).
    JsonObject,
    /// A grammar in llguidance's Lark dialect (`start: ...`; `%json { schema }` embeds JSON).
    Lark(String),
    /// A regular expression the whole completion must match (Rust `regex` syntax).
    Regex(String),
}

/// How JSON is laid out unless a schema's own `x-guidance` says otherwise.
fn json_layout() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with the default JSON layout added (when the schema sets none).
fn with_layout(schema: &Json) -> Json {
    let mut schema = schema.clone();
    if let Json::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(json_layout);
    }
    schema
}

fn invalid(message: impl Into<String>) -> EngineError {
    EngineError::InvalidRequest(message.into())
}

impl Constraint {
    /// The constraint an OpenAI `response_format` asks for (`None` for `text`). A `json_schema`
    /// format without a schema means any JSON object.
    pub fn from_response_format(format: &ResponseFormat) -> Option<Constraint> {
        match format {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(Constraint::JsonObject),
            ResponseFormat::JsonSchema { json_schema } => Some(match &json_schema.schema {
                Some(schema) => Constraint::JsonSchema(schema.clone()),
                None => Constraint::JsonObject,
            }),
        }
    }

    /// A constraint that forces exactly one call of one of `tools` (of the tool named `only`, when
    /// given), written the way `format` parses it: for [`ToolCallFormat::JsonObject`] the whole
    /// reply is `{"name": <tool name>, "arguments": <arguments valid against that tool's
    /// parameters schema>}`; for [`ToolCallFormat::Hermes`] that object sits in
    /// `<tool_call>\n...\n</tool_call>`.
    ///
    /// Objects in a parameters schema that list `properties` but say nothing of
    /// `additionalProperties` are closed (no other keys), as OpenAI's strict mode does: a forced
    /// call should use the declared arguments. A tool without a parameters schema takes `{}`.
    pub fn tool_call(
        tools: &[Tool],
        format: ToolCallFormat,
        only: Option<&str>,
    ) -> Result<Constraint> {
        let chosen: Vec<&Tool> = match only {
            None => tools.iter().collect(),
            Some(name) => {
                let tool = tools
                    .iter()
                    .find(|t| t.function.name == name)
                    .ok_or_else(|| {
                        invalid(format!(
                            "tool_choice names the function `{name}`, which is not in `tools` ([{}])",
                            tools
                                .iter()
                                .map(|t| t.function.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                vec![tool]
            }
        };
        if chosen.is_empty() {
            return Err(invalid(
                "a tool call was required but `tools` is empty; give at least one tool",
            ));
        }
        let variants: Vec<Json> = chosen
            .iter()
            .map(|tool| {
                let mut arguments = tool
                    .function
                    .parameters
                    .clone()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                close_objects(&mut arguments);
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": arguments,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = if variants.len() == 1 {
            variants.into_iter().next().unwrap()
        } else {
            json!({ "anyOf": variants })
        };
        // Definitions that a tool's parameters reference as `#/$defs/...` (or `#/definitions/...`)
        // must stay reachable from the root: hoist them (the first tool's win on a name clash).
        for key in ["$defs", "definitions"] {
            let mut defs = serde_json::Map::new();
            for tool in &chosen {
                let params = tool.function.parameters.as_ref();
                if let Some(Json::Object(d)) = params.and_then(|p| p.get(key)) {
                    for (name, def) in d {
                        let mut def = def.clone();
                        close_objects(&mut def);
                        defs.entry(name.clone()).or_insert(def);
                    }
                }
            }
            if !defs.is_empty() {
                schema[key] = Json::Object(defs);
            }
        }
        Ok(match format {
            ToolCallFormat::JsonObject => Constraint::JsonSchema(schema),
            ToolCallFormat::Hermes => Constraint::Lark(format!(
                "start: \"<tool_call>\\n\" %json {} \"\\n</tool_call>\"\n",
                with_layout(&schema)
            )),
        })
    }

    /// The constraint an OpenAI `tool_choice` asks for: `"required"` forces a call of one of
    /// `tools`, `{"type": "function", "function": {"name": ...}}` a call of that one; `"auto"`,
    /// `"none"` and no `tool_choice` constrain nothing (`None`).
    pub fn from_tool_choice(
        tools: &[Tool],
        format: ToolCallFormat,
        tool_choice: Option<&Json>,
    ) -> Result<Option<Constraint>> {
        match tool_choice {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) if s == "auto" || s == "none" => Ok(None),
            Some(Json::String(s)) if s == "required" => {
                Self::tool_call(tools, format, None).map(Some)
            }
            Some(choice @ Json::Object(_)) => {
                let name = choice
                    .pointer("/function/name")
                    .and_then(Json::as_str)
                    .ok_or_else(|| {
                        invalid(format!(
                            "tool_choice {choice} should be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                        ))
                    })?;
                Self::tool_call(tools, format, Some(name)).map(Some)
            }
            Some(other) => Err(invalid(format!(
                "tool_choice {other} is not \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            ))),
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_layout(schema))
            }
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"})))
            }
            Constraint::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
            Constraint::Regex(regex) => TopLevelGrammar::from_regex(regex),
        }
    }
}

/// Sets `additionalProperties: false` on every object schema in `schema` that lists `properties`
/// and does not say whether other keys are allowed.
fn close_objects(schema: &mut Json) {
    let Json::Object(map) = schema else { return };
    if map.get("properties").is_some_and(Json::is_object)
        && !map.contains_key("additionalProperties")
        && !map.contains_key("patternProperties")
    {
        map.insert("additionalProperties".into(), Json::Bool(false));
    }
    for (key, value) in map.iter_mut() {
        match key.as_str() {
            "properties" | "$defs" | "definitions" => {
                if let Json::Object(children) = value {
                    children.values_mut().for_each(close_objects);
                }
            }
            "items" | "additionalItems" | "not" => close_objects(value),
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Json::Array(children) = value {
                    children.iter_mut().for_each(close_objects);
                }
            }
            _ => {}
        }
    }
}

/// The token trie over the engine's tokenizer, as llguidance sees it.
struct EngineTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for EngineTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// Compiles constraints for one engine: the token trie and llguidance's parser factory, built
/// once.
pub(crate) struct ConstraintCompiler {
    factory: ParserFactory,
    /// The end-of-sequence ids; the first is the one appended when a grammar completes.
    eos_ids: Arc<[TokenId]>,
}

impl ConstraintCompiler {
    /// Builds the token trie: each token's bytes (byte-level BPE symbols map back to bytes;
    /// special tokens are marked special so that grammars never produce them as text), padded
    /// with special placeholders up to the model's `vocab_size` (the logits' width).
    pub(crate) fn new(
        tokenizer: &Tokenizer,
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> std::result::Result<Self, String> {
        let json: Json = serde_json::from_str(
            &tokenizer
                .to_string(false)
                .map_err(|e| format!("cannot serialize the tokenizer: {e}"))?,
        )
        .map_err(|e| format!("cannot read the serialized tokenizer: {e}"))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| {
            format!("the tokenizer is neither byte-level BPE nor byte-fallback ({e})")
        })?;
        if words.len() > vocab_size {
            return Err(format!(
                "the tokenizer has {} tokens, more than the model's vocabulary of {vocab_size}",
                words.len()
            ));
        }
        while words.len() < vocab_size {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let &eos = eos_token_ids
            .first()
            .ok_or("the model declares no end-of-sequence token; a grammar could not end")?;
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos_token_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_token_ids);
        }
        let env: TokEnv = Arc::new(EngineTokEnv {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(ConstraintCompiler {
            factory,
            eos_ids: eos_token_ids.into(),
        })
    }

    /// Compiles `constraint`; the error says what is wrong with it.
    pub(crate) fn compile(&self, constraint: &Constraint) -> Result<CompiledConstraint> {
        let parser = self
            .factory
            .create_parser(constraint.grammar())
            .map_err(|e| invalid(format!("invalid constraint: {e}")))?;
        Ok(CompiledConstraint {
            parser,
            eos_ids: self.eos_ids.clone(),
        })
    }
}

/// A compiled constraint, ready to start a matcher for each completion.
#[derive(Clone)]
pub(crate) struct CompiledConstraint {
    parser: TokenParser,
    eos_ids: Arc<[TokenId]>,
}

impl CompiledConstraint {
    pub(crate) fn start(&self) -> Guide {
        Guide {
            matcher: Matcher::new(Ok(self.parser.clone())),
            eos_ids: self.eos_ids.clone(),
            last: None,
        }
    }
}

/// One completion's matcher.
pub(crate) struct Guide {
    matcher: Matcher,
    eos_ids: Arc<[TokenId]>,
    last: Option<TokenId>,
}

impl Guide {
    /// Sets the logits of the tokens the grammar does not allow next to -inf. When the matcher
    /// has failed (it should not) or allows nothing, only end-of-sequence stays.
    pub(crate) fn mask(&mut self, logits: &mut [f32]) {
        let mask = match self.matcher.compute_mask_or_eos() {
            Ok(mask) if !mask.is_zero() => mask,
            _ => {
                let mut eos_only = SimpleVob::alloc(logits.len());
                eos_only.allow_token(self.eos_ids[0]);
                eos_only
            }
        };
        apply_mask(&mask, logits);
    }

    /// Moves the matcher past the sampled token.
    pub(crate) fn advance(&mut self, token: TokenId) {
        self.last = Some(token);
        // An error leaves the matcher stopped; the next mask then allows only end-of-sequence.
        let _ = self.matcher.consume_token(token);
    }

    /// The end-of-sequence token to append when the grammar admits nothing more after the last
    /// token (and that token was not already an end-of-sequence).
    pub(crate) fn end_token(&self) -> Option<TokenId> {
        let ended_by_eos = self.last.is_some_and(|t| self.eos_ids.contains(&t));
        (self.matcher.is_stopped() && !ended_by_eos).then_some(self.eos_ids[0])
    }

    /// Whether the grammar admits nothing more.
    pub(crate) fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Sets `logits[i] = -inf` wherever `mask` does not allow token `i` (tokens past the mask's end
/// are not allowed).
fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        if bits == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_keeps_allowed_logits_only() {
        let mut mask = SimpleVob::alloc(70);
        for t in [0, 31, 32, 65] {
            mask.allow_token(t);
        }
        let mut logits: Vec<f32> = (0..72).map(|i| i as f32).collect();
        apply_mask(&mask, &mut logits);
        for (i, &l) in logits.iter().enumerate() {
            if [0, 31, 32, 65].contains(&i) {
                assert_eq!(l, i as f32);
            } else {
                assert_eq!(l, f32::NEG_INFINITY, "{i}");
            }
        }
    }

    #[test]
    fn closes_objects_with_properties_only() {
        let mut schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "b": {"type": "object"},
                "c": {"type": "array", "items": {"type": "object", "properties": {}}},
                "d": {"type": "object", "properties": {}, "additionalProperties": true},
            }
        });
        close_objects(&mut schema);
        assert_eq!(schema["additionalProperties"], json!(false));
        assert_eq!(
            schema["properties"]["a"]["additionalProperties"],
            json!(false)
        );
        assert!(schema["properties"]["b"]
            .get("additionalProperties")
            .is_none());
        assert_eq!(
            schema["properties"]["c"]["items"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(
            schema["properties"]["d"]["additionalProperties"],
            json!(true)
        );
    }

    #[test]
    fn tool_choice_parsing() {
        let tools = [
            Tool::function("a", "A", json!({"type": "object", "properties": {}})),
            Tool::function("b", "B", json!({"type": "object", "properties": {}})),
        ];
        let f = ToolCallFormat::JsonObject;
        assert_eq!(Constraint::from_tool_choice(&tools, f, None).unwrap(), None);
        assert_eq!(
            Constraint::from_tool_choice(&tools, f, Some(&json!("auto"))).unwrap(),
            None
        );
        let Some(Constraint::JsonSchema(any)) =
            Constraint::from_tool_choice(&tools, f, Some(&json!("required"))).unwrap()
        else {
            panic!("expected a schema")
        };
        assert_eq!(any["anyOf"].as_array().unwrap().len(), 2);
        let named = json!({"type": "function", "function": {"name": "b"}});
        let Some(Constraint::JsonSchema(one)) =
            Constraint::from_tool_choice(&tools, f, Some(&named)).unwrap()
        else {
            panic!("expected a schema")
        };
        assert_eq!(one["properties"]["name"]["const"], json!("b"));
        let unknown = json!({"type": "function", "function": {"name": "zzz"}});
        let err = Constraint::from_tool_choice(&tools, f, Some(&unknown)).unwrap_err();
        assert!(err.to_string().contains("zzz"), "{err}");
        assert!(Constraint::from_tool_choice(&tools, f, Some(&json!(3))).is_err());
        assert!(Constraint::from_tool_choice(&[], f, Some(&json!("required"))).is_err());
        let Some(Constraint::Lark(lark)) =
            Constraint::from_tool_choice(&tools, ToolCallFormat::Hermes, Some(&named)).unwrap()
        else {
            panic!("expected a grammar")
        };
        assert!(
            lark.starts_with("start: \"<tool_call>\\n\" %json {"),
            "{lark}"
        );
    }
}
