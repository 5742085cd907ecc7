//! Parity with Python `transformers`: each fixture in tests/fixtures/chat_templates/ holds a model's
//! chat template, conversations in OpenAI form, and what `tokenizer.apply_chat_template(...,
//! tokenize=False)` rendered for them (scripts/chat_template_fixtures.py writes them). We render the
//! same inputs through the typed API and must match byte for byte, or fail where Python failed.
#![cfg(feature = "engine")]

use std::path::{Path, PathBuf};

use art_core::engine::chat_template::{ChatTemplate, ChatTemplateError, RenderOptions};
use art_core::engine::tool_calls::ToolCallFormat;
use art_core::{Message, Tool};
use serde::Deserialize;
use serde_json::{Map, Value as Json};

#[derive(Deserialize)]
struct Fixture {
    template_name: String,
    template: String,
    special_tokens: Map<String, Json>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<Message>,
    tools: Option<Vec<Tool>>,
    add_generation_prompt: bool,
    #[serde(default)]
    kwargs: Map<String, Json>,
    expected: Option<String>,
    expected_error: Option<String>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates")
}

fn load(name: &str) -> Fixture {
    let path = fixtures_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("bad fixture {}: {err}", path.display()))
}

fn template_of(fixture: &Fixture) -> ChatTemplate {
    let mut template = ChatTemplate::new(fixture.template.clone()).unwrap_or_else(|err| {
        panic!(
            "{}: template does not compile: {err}",
            fixture.template_name
        )
    });
    for (name, token) in &fixture.special_tokens {
        template = template.with_special_token(name, token.as_str().expect("string token"));
    }
    template
}

fn options(case: &Case) -> RenderOptions {
    RenderOptions {
        add_generation_prompt: case.add_generation_prompt,
        kwargs: case.kwargs.clone(),
    }
}

/// Renders every case and returns the names of those that differ from transformers.
fn check_parity(fixture: &Fixture) -> Vec<String> {
    let template = template_of(fixture);
    let mut failures = Vec::new();
    for case in &fixture.cases {
        let rendered =
            template.render_with_options(&case.messages, case.tools.as_deref(), &options(case));
        match (&case.expected, &case.expected_error, rendered) {
            (Some(expected), _, Ok(text)) if &text == expected => {}
            (Some(expected), _, Ok(text)) => failures.push(format!(
                "{}: differs from transformers\n--- expected\n{expected}\n--- got\n{text}",
                case.name
            )),
            (Some(_), _, Err(err)) => failures.push(format!(
                "{}: transformers rendered, we failed: {err}",
                case.name
            )),
            (None, Some(_), Err(_)) => {}
            (None, Some(python), Ok(text)) => failures.push(format!(
                "{}: transformers failed ({python}), we rendered\n{text}",
                case.name
            )),
            (None, None, _) => failures.push(format!("{}: fixture has no expectation", case.name)),
        }
    }
    failures
}

fn assert_parity(name: &str) {
    let fixture = load(name);
    assert!(
        fixture.cases.len() >= 10,
        "{name}: too few cases to mean much"
    );
    let failures = check_parity(&fixture);
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ:\n\n{}",
        failures.len(),
        fixture.cases.len(),
        failures.join("\n\n")
    );
}

#[test]
fn smollm2_matches_transformers() {
    assert_parity("smollm2_135m_instruct");
}

#[test]
fn qwen2_5_matches_transformers() {
    assert_parity("qwen2_5_coder_0_5b_instruct");
}

#[test]
fn qwen3_matches_transformers() {
    assert_parity("qwen3_0_6b");
}

#[test]
fn smollm2_fails_where_transformers_fails() {
    // SmolLM2's template concatenates `content`, which a tool-call-only message lacks; Python
    // raises and so must we (rather than render a prompt the model never saw).
    let fixture = load("smollm2_135m_instruct");
    assert!(fixture.cases.iter().any(|c| c.expected_error.is_some()));
    let template = template_of(&fixture);
    for case in fixture.cases.iter().filter(|c| c.expected_error.is_some()) {
        let err = template
            .render_with_options(&case.messages, case.tools.as_deref(), &options(case))
            .unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::Render { .. }),
            "{}: {err:?}",
            case.name
        );
        assert!(err.to_string().contains("content"), "{}: {err}", case.name);
    }
}

#[test]
fn tool_call_format_follows_the_template() {
    assert_eq!(
        template_of(&load("smollm2_135m_instruct")).tool_call_format(),
        ToolCallFormat::JsonObject
    );
    assert_eq!(
        template_of(&load("qwen2_5_coder_0_5b_instruct")).tool_call_format(),
        ToolCallFormat::Hermes
    );
    assert_eq!(
        template_of(&load("qwen3_0_6b")).tool_call_format(),
        ToolCallFormat::Hermes
    );
}

/// For each rendered conversation without a generation prompt, the located assistant turns must
/// be exactly the text the model generated: the message's rendering up to and including `<|im_end|>`.
#[test]
fn assistant_turns_are_located_in_real_templates() {
    for name in ["smollm2_135m_instruct", "qwen2_5_coder_0_5b_instruct"] {
        let fixture = load(name);
        let template = template_of(&fixture);
        let mut checked = 0;
        for case in &fixture.cases {
            let Some(expected) = &case.expected else {
                continue;
            };
            if case.add_generation_prompt {
                continue;
            }
            let rendered = template
                .render_with_turns(&case.messages, case.tools.as_deref(), &options(case))
                .unwrap_or_else(|err| panic!("{name} {}: {err}", case.name));
            assert_eq!(&rendered.text, expected, "{name} {}", case.name);
            let assistants: Vec<usize> = case
                .messages
                .iter()
                .enumerate()
                .filter(|(_, m)| matches!(m, Message::Assistant(_)))
                .map(|(i, _)| i)
                .collect();
            let located: Vec<usize> = rendered
                .assistant_turns
                .iter()
                .map(|t| t.message_index)
                .collect();
            assert_eq!(located, assistants, "{name} {}", case.name);
            for segment in rendered.segments() {
                let Some(index) = segment.assistant_message else {
                    continue;
                };
                assert!(
                    segment.text.ends_with("<|im_end|>"),
                    "{name} {}: {:?}",
                    case.name,
                    segment.text
                );
                let message = &case.messages[index];
                match message {
                    Message::Assistant(m) if m.tool_calls.is_empty() => assert_eq!(
                        segment.text,
                        format!("{}<|im_end|>", message.text()),
                        "{name} {}",
                        case.name
                    ),
                    Message::Assistant(m) => {
                        assert!(
                            segment.text.starts_with(&message.text()),
                            "{name} {}",
                            case.name
                        );
                        // SmolLM2's template drops tool calls; Qwen's writes one tag per call.
                        let expected_calls = match template.tool_call_format() {
                            ToolCallFormat::Hermes => m.tool_calls.len(),
                            ToolCallFormat::JsonObject => 0,
                        };
                        assert_eq!(
                            segment.text.matches("<tool_call>").count(),
                            expected_calls,
                            "{name} {}",
                            case.name
                        );
                    }
                    _ => unreachable!(),
                }
                checked += 1;
            }
            assert_eq!(
                rendered
                    .segments()
                    .iter()
                    .map(|s| s.text)
                    .collect::<String>(),
                rendered.text
            );
        }
        assert!(checked >= 8, "{name}: only {checked} turns checked");
    }
}

/// What the model writes back in a Hermes template round-trips: parse a completion into tool
/// calls, put it in the conversation, and the template renders the same call text again.
#[test]
fn parsed_tool_calls_render_back_to_the_same_text() {
    let template = template_of(&load("qwen2_5_coder_0_5b_instruct"));
    let completion = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
    let parsed = template.tool_call_format().parse(completion);
    assert_eq!(parsed.tool_calls.len(), 1);
    let messages = [
        Message::user("Weather in Paris?"),
        Message::Assistant(parsed.into_assistant_message()),
    ];
    let rendered = template
        .render_with_turns(&messages, None, &RenderOptions::default())
        .unwrap();
    let turn = rendered.assistant_turns[0];
    assert_eq!(
        &rendered.text[turn.start..turn.end],
        format!("{completion}<|im_end|>")
    );
}

/// A broad check over many public templates, rendered by transformers into a file outside the repo:
/// `python scripts/chat_template_fixtures.py --corpus DIR --corpus-out FILE`, then
/// `ART_CHAT_TEMPLATE_CORPUS=FILE cargo test -p art-core --features engine --test chat_template -- --ignored`.
#[test]
#[ignore = "needs a corpus file made by scripts/chat_template_fixtures.py --corpus"]
fn corpus_parity() {
    let path = std::env::var("ART_CHAT_TEMPLATE_CORPUS")
        .expect("set ART_CHAT_TEMPLATE_CORPUS to the corpus JSON file");
    let fixtures: Vec<Fixture> =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("readable corpus")).unwrap();
    let (mut cases, mut failed, mut uncompiled) = (0, 0, Vec::new());
    let mut report = Vec::new();
    for fixture in &fixtures {
        if ChatTemplate::new(fixture.template.clone()).is_err() {
            uncompiled.push(fixture.template_name.clone());
            failed += fixture.cases.len();
            cases += fixture.cases.len();
            continue;
        }
        let failures = check_parity(fixture);
        cases += fixture.cases.len();
        failed += failures.len();
        if !failures.is_empty() {
            report.push(format!(
                "== {} ({} of {})\n{}",
                fixture.template_name,
                failures.len(),
                fixture.cases.len(),
                failures[0]
            ));
        }
    }
    let summary = format!(
        "{} templates, {cases} cases, {failed} differ; {} templates do not compile: {:?}",
        fixtures.len(),
        uncompiled.len(),
        uncompiled
    );
    if let Ok(out) = std::env::var("ART_CHAT_TEMPLATE_CORPUS_REPORT") {
        std::fs::write(out, format!("{summary}\n\n{}", report.join("\n\n"))).unwrap();
    }
    assert_eq!(failed, 0, "{summary}");
}
