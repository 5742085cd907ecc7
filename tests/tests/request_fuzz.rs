//! Property test of request validation: chat completion requests with fields set to random JSON
//! (wrong types, out-of-range numbers, unknown fields, broken messages), sent to a server on a
//! tiny random model. Every answer is a completion (200) or an OpenAI-style client error (4xx)
//! within seconds, never a server error, and the server still answers afterwards.
//! Cost: ~15 s (300 requests; the valid ones generate a few tokens).

use std::sync::OnceLock;
use std::time::Duration;

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use serde_json::{json, Value};

use art_e2e::TestServer;

/// The fields a chat request may carry, and a few it may not.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "ignore_eos",
    "return_token_ids",
    "chat_template_kwargs",
    "frequency_penalty",
    "no_such_field",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3i64..70).prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::from)),
        "[a-z_{}<|>\"\\\\ ]{0,12}".prop_map(Value::from),
        Just(json!("user")),
        Just(json!("json_schema")),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::from),
            btree_map(
                prop_oneof![
                    Just("role".to_string()),
                    Just("content".to_string()),
                    Just("type".to_string()),
                    Just("name".to_string()),
                    Just("json_schema".to_string()),
                    Just("function".to_string()),
                    "[a-z]{1,6}",
                ],
                inner,
                0..4
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// A valid request with one to three fields set to random values (or removed).
fn request() -> impl Strategy<Value = Value> {
    let change = (0..FIELDS.len(), proptest::option::of(json_value()));
    vec(change, 1..4).prop_map(|changes| {
        let mut body = json!({"model": "tiny", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "Say hi"}]});
        let object = body.as_object_mut().unwrap();
        for (field, value) in changes {
            match value {
                Some(value) => object.insert(FIELDS[field].to_string(), value),
                None => object.remove(FIELDS[field]),
            };
        }
        body
    })
}

/// One server (and the runtime it runs on) for all cases.
fn server() -> &'static (tokio::runtime::Runtime, TestServer) {
    static SERVER: OnceLock<(tokio::runtime::Runtime, TestServer)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let server = runtime.block_on(TestServer::tiny(|_| {}));
        (runtime, server)
    })
}

/// Sends `body`; returns the status and the body text.
fn send(body: &Value) -> Result<(u16, String), String> {
    let (runtime, server) = server();
    runtime.block_on(async {
        let response = reqwest::Client::new()
            .post(format!("{}/chat/completions", server.base_url))
            .timeout(Duration::from_secs(30))
            .json(body)
            .send()
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(|e| e.to_string())?;
        Ok((status, text))
    })
}

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

/// What a request must get back: a completion, or an OpenAI error saying what is wrong.
fn check(body: Value) -> Result<(), TestCaseError> {
    let (status, text) = send(&body).map_err(TestCaseError::fail)?;
    let streamed = body["stream"] == json!(true);
    match status {
        200 if streamed => prop_assert!(text.trim_end().ends_with("data: [DONE]"), "{text}"),
        200 => {
            let answer: Value = serde_json::from_str(&text).unwrap();
            prop_assert!(answer["choices"].is_array(), "{text}");
        }
        400..=499 => {
            let error: Value = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
            prop_assert!(
                error["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{text}"
            );
            prop_assert!(error["error"]["type"].is_string(), "{text}");
        }
        _ => prop_assert!(false, "HTTP {status} for {body}: {text}"),
    }
    Ok(())
}

#[test]
fn every_request_gets_a_completion_or_a_client_error() {
    let mut runner = proptest::test_runner::TestRunner::new(config(300));
    if let Err(failure) = runner.run(&request(), check) {
        panic!("{failure}");
    }
    // And the server is still well afterwards.
    let body = json!({"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "Say hi"}]});
    let (status, text) = send(&body).unwrap();
    assert_eq!(status, 200, "{text}");
}
