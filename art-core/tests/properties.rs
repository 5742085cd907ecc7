//! Property tests (proptest) for the parsers and renderers that see untrusted text: the chat
//! template renderer and its turn locator, the tool-call parser, and JSON-schema constrained
//! decoding. Each property runs a fixed number of generated cases (a failing case is shrunk to a
//! minimal one and printed). Cost: ~10 s in all (the constrained decoding samples from a tiny
//! random model).
#![cfg(feature = "engine")]

use std::path::Path;
use std::sync::OnceLock;

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use serde_json::{json, Map, Value as Json};

use art_core::engine::chat_template::{ChatTemplate, RenderOptions};
use art_core::engine::random::RandomModelSpec;
use art_core::engine::tool_calls::ToolCallFormat;
use art_core::engine::{
    Architecture, Constraint, Engine, FinishReason, GenerationRequest, LoadOptions, ModelSource,
    SamplingParams,
};
use art_core::{AssistantMessage, Content, FunctionCall, Message, ToolCall};

/// `cases` generated cases from a fixed seed, so that every run checks the same inputs (and CI
/// passes or fails the same way); proptest's own `PROPTEST_RNG_SEED` and `PROPTEST_CASES` explore
/// others. Failures are printed, shrunk, not saved beside the sources.
fn config(cases: u32) -> ProptestConfig {
    let default = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            default.cases
        } else {
            cases
        },
        rng_seed: match default.rng_seed {
            RngSeed::Random => RngSeed::Fixed(0x5eed),
            chosen => chosen,
        },
        failure_persistence: None,
        ..default
    }
}

fn template(fixture: &str) -> ChatTemplate {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat_templates")
        .join(format!("{fixture}.json"));
    let fixture: Json = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut template = ChatTemplate::new(fixture["template"].as_str().unwrap()).unwrap();
    for (name, token) in fixture["special_tokens"].as_object().unwrap() {
        template = template.with_special_token(name, token.as_str().unwrap());
    }
    template
}

/// Message text: any characters (Jinja syntax, quotes, newlines, emoji), but not the templates'
/// own special-token markup, which a user's text cannot contain once tokenized either.
fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 \n\t{}%#<>|/\\\\\"'_.,:;!?é漢🙂-]{0,40}"
        .prop_filter("no special-token markup", |s| !s.contains("<|"))
}

fn call() -> impl Strategy<Value = (String, Json)> {
    let value = prop_oneof![
        any::<i32>().prop_map(Json::from),
        any::<bool>().prop_map(Json::from),
        text().prop_map(Json::from),
        vec(any::<i16>(), 0..3).prop_map(Json::from),
    ];
    (
        "[a-z_][a-z0-9_]{0,11}",
        btree_map("[a-z_]{1,8}", value, 0..4)
            .prop_map(|args| Json::Object(args.into_iter().collect::<Map<_, _>>())),
    )
}

fn tool_call((name, arguments): (String, Json)) -> ToolCall {
    ToolCall {
        id: "call_0".into(),
        kind: "function".into(),
        function: FunctionCall {
            name,
            arguments: arguments.to_string(),
        },
    }
}

/// A conversation: an optional system message, then user/assistant turns (assistants with text,
/// and with tool calls when `calls` is true).
fn conversation(calls: bool) -> impl Strategy<Value = Vec<Message>> {
    let turn = (text(), text(), vec(call(), if calls { 0..3 } else { 0..1 }));
    (proptest::option::of(text()), vec(turn, 1..4)).prop_map(|(system, turns)| {
        let mut messages: Vec<Message> = system.into_iter().map(Message::system).collect();
        for (user, answer, calls) in turns {
            messages.push(Message::user(user));
            messages.push(Message::Assistant(AssistantMessage {
                content: Some(Content::Text(answer)),
                tool_calls: calls.into_iter().map(tool_call).collect(),
                ..Default::default()
            }));
        }
        messages
    })
}

fn arguments(call: &ToolCall) -> Json {
    serde_json::from_str(&call.function.arguments).unwrap()
}

proptest! {
    #![proptest_config(config(200))]

    /// SmolLM2's ChatML: every turn is located, each assistant turn is exactly its text and the
    /// end-of-turn token, and the segments put together are the whole rendering.
    #[test]
    fn chatml_turns_are_exactly_the_assistant_texts(messages in conversation(false)) {
        let rendered = template("smollm2_135m_instruct")
            .render_with_turns(&messages, None, &RenderOptions::default())
            .unwrap();
        let assistants: Vec<&Message> =
            messages.iter().filter(|m| matches!(m, Message::Assistant(_))).collect();
        prop_assert_eq!(rendered.assistant_turns.len(), assistants.len());
        for (turn, message) in rendered.assistant_turns.iter().zip(assistants) {
            prop_assert_eq!(
                &rendered.text[turn.start..turn.end],
                format!("{}<|im_end|>", message.text())
            );
        }
        let joined: String = rendered.segments().iter().map(|s| s.text).collect();
        prop_assert_eq!(joined, rendered.text);
    }

    /// Qwen2.5's template writes each tool call as a `<tool_call>` block; the parser reads back
    /// from the located turn the same calls (names and arguments) and the same text.
    #[test]
    fn hermes_tool_calls_round_trip_through_template_and_parser(messages in conversation(true)) {
        let template = template("qwen2_5_coder_0_5b_instruct");
        let rendered = template
            .render_with_turns(&messages, None, &RenderOptions::default())
            .unwrap();
        let assistants = messages.iter().filter_map(|m| match m {
            Message::Assistant(a) => Some(a),
            _ => None,
        });
        for (turn, message) in rendered.assistant_turns.iter().zip(assistants) {
            let written = rendered.text[turn.start..turn.end].trim_end_matches("<|im_end|>");
            let parsed = ToolCallFormat::Hermes.parse(written);
            prop_assert_eq!(parsed.tool_calls.len(), message.tool_calls.len());
            for (got, sent) in parsed.tool_calls.iter().zip(&message.tool_calls) {
                prop_assert_eq!(&got.function.name, &sent.function.name);
                prop_assert_eq!(arguments(got), arguments(sent));
            }
        }
    }

    /// Any text: the parsers never panic, and text without a call stays text, unchanged.
    #[test]
    fn the_tool_call_parsers_take_any_text(text in any::<String>()) {
        for format in [ToolCallFormat::Hermes, ToolCallFormat::JsonObject] {
            let parsed = format.parse(&text);
            if parsed.tool_calls.is_empty() {
                prop_assert_eq!(parsed.content.as_deref().unwrap_or(""), text.as_str());
            }
        }
    }

    /// Calls written as the JSON-object format expects (one object, or a list) parse back.
    #[test]
    fn json_object_calls_round_trip(calls in vec(call(), 1..4), as_list in any::<bool>()) {
        let objects: Vec<Json> = calls
            .iter()
            .map(|(name, args)| json!({"name": name, "arguments": args}))
            .collect();
        let text = if as_list || calls.len() > 1 {
            Json::from(objects).to_string()
        } else {
            objects[0].to_string()
        };
        let parsed = ToolCallFormat::JsonObject.parse(&text);
        prop_assert_eq!(parsed.content, None);
        prop_assert_eq!(parsed.tool_calls.len(), calls.len());
        for (got, (name, args)) in parsed.tool_calls.iter().zip(&calls) {
            prop_assert_eq!(&got.function.name, name);
            prop_assert_eq!(&arguments(got), args);
        }
    }
}

/// A tiny random model: its text is nonsense, so every structure comes from the constraint.
fn engine() -> &'static Engine {
    static ENGINE: OnceLock<(tempfile::TempDir, Engine)> = OnceLock::new();
    &ENGINE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let model = dir.path().join("tiny");
            RandomModelSpec::tiny(Architecture::Qwen2)
                .write(&model, 3)
                .unwrap();
            let engine = Engine::load(
                &ModelSource::parse(model.to_str().unwrap()),
                &LoadOptions::default(),
            )
            .unwrap();
            (dir, engine)
        })
        .1
}

/// A JSON schema of the kinds agents ask for: objects with required properties of scalar,
/// enum, array and nested object types (strings and arrays bounded, so that a completion ends).
fn schema() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(json!({"type": "string", "maxLength": 6})),
        Just(json!({"type": "integer"})),
        Just(json!({"type": "number"})),
        Just(json!({"type": "boolean"})),
        vec("[a-z]{1,5}", 1..4).prop_map(|choices| json!({"enum": choices})),
    ];
    let value = leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            inner
                .clone()
                .prop_map(|items| json!({"type": "array", "items": items, "maxItems": 3})),
            btree_map("[a-z]{1,6}", inner, 1..3).prop_map(object_schema),
        ]
    });
    btree_map("[a-z]{1,6}", value, 1..4).prop_map(object_schema)
}

fn object_schema(properties: std::collections::BTreeMap<String, Json>) -> Json {
    let required: Vec<&String> = properties.keys().collect();
    json!({"type": "object", "properties": properties, "required": required,
           "additionalProperties": false})
}

/// Parses JSON text. JSON numbers have no range, and the grammar allows any exponent: a random
/// model writes `1E+725584248848`, valid JSON (RFC 8259) that serde_json cannot hold in an f64.
/// So the numbers' syntax is checked here, and the structure is read with exponents dropped.
fn parse_json(text: &str) -> Result<Json, String> {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            plain.push(c);
            match c {
                '\\' => plain.extend(chars.next()),
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        if c == '"' {
            in_string = true;
        }
        if c == '-' || c.is_ascii_digit() {
            // RFC 8259: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
            let mut number = String::from(c);
            while let Some(&d) = chars.peek().filter(|d| "0123456789.eE+-".contains(**d)) {
                number.push(d);
                chars.next();
            }
            let (mantissa, exponent) = match number.find(['e', 'E']) {
                Some(at) => (&number[..at], Some(&number[at + 1..])),
                None => (number.as_str(), None),
            };
            let digits = |s: &str| !s.is_empty() && s.chars().all(|d| d.is_ascii_digit());
            let unsigned = mantissa.strip_prefix('-').unwrap_or(mantissa);
            let (int, frac) = unsigned.split_once('.').unwrap_or((unsigned, "0"));
            let ok = digits(int)
                && (int == "0" || !int.starts_with('0'))
                && digits(frac)
                && exponent.is_none_or(|e| digits(e.trim_start_matches(['+', '-'])));
            if !ok {
                return Err(format!("not a JSON number: {number}"));
            }
            plain.push_str(mantissa);
            continue;
        }
        plain.push(c);
    }
    serde_json::from_str(&plain).map_err(|e| e.to_string())
}

/// Whether `value` satisfies `schema` (the subset [`schema`] generates).
fn valid(value: &Json, schema: &Json) -> bool {
    if let Some(choices) = schema["enum"].as_array() {
        return choices.contains(value);
    }
    match schema["type"].as_str().unwrap() {
        "string" => value
            .as_str()
            .is_some_and(|s| s.chars().count() <= schema["maxLength"].as_u64().unwrap() as usize),
        // Any integer: JSON's have no range (a long one reads as an f64 without a fraction).
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "array" => value.as_array().is_some_and(|items| {
            items.len() <= 3 && items.iter().all(|item| valid(item, &schema["items"]))
        }),
        "object" => value.as_object().is_some_and(|object| {
            let properties = schema["properties"].as_object().unwrap();
            object.len() == properties.len()
                && properties
                    .iter()
                    .all(|(name, schema)| object.get(name).is_some_and(|v| valid(v, schema)))
        }),
        other => panic!("the generator makes no {other}"),
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Whatever the (random) model would write, the constrained completion is JSON valid against
    /// the schema, and ends by the grammar (finish reason `stop`), not by running out of tokens.
    #[test]
    fn schema_constrained_output_is_valid_json(schema in schema(), seed in any::<u64>()) {
        let engine = engine();
        let mut params = SamplingParams::greedy(600);
        params.temperature = 1.0;
        params.seed = Some(seed);
        params.constraint = Some(Constraint::JsonSchema(schema.clone()));
        let out = engine
            .generate(vec![GenerationRequest {
                prompt: engine.encode("Answer in JSON.", false).unwrap(),
                params,
                adapter: None,
            }])
            .unwrap();
        let completion = &out[0].completions[0];
        prop_assert_eq!(completion.finish_reason, FinishReason::Stop, "{}", completion.text);
        let value = parse_json(&completion.text)
            .map_err(|e| TestCaseError::fail(format!("{e}: {:?}", completion.text)))?;
        prop_assert!(valid(&value, &schema), "{value} is not valid against {schema}");
    }
}
