//! The OpenAI-compatible endpoint, over HTTP on loopback, with the tiny random model: answers,
//! sampling options, streaming, batching, and every kind of bad input.

use std::time::{Duration, Instant};

use art_core::engine::random::RandomModelSpec;
use art_core::engine::Architecture;
use art_core::server::{build_state, ServeOptions};
use art_e2e::{temp_dir, tiny_model, TestServer};
use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::{json, Value};

async fn post(server: &TestServer, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn health(server: &TestServer) -> Value {
    reqwest::get(server.base_url.replace("/v1", "/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chat_completion_has_the_openai_shape_and_token_ids() {
    let server = TestServer::tiny(|_| {}).await;
    let (status, body) = post(&server, chat(json!({"seed": 1}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "tiny");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    let ids = choice["token_ids"].as_array().unwrap();
    assert!(!ids.is_empty() && ids.len() <= 8);
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    assert_eq!(
        body["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        ids.len()
    );
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 3);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same request again: its prompt comes from the prefix cache (OpenAI's `cached_tokens`),
    // and the seeded answer is the same.
    let (_, again) = post(&server, chat(json!({"seed": 1}))).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        body["usage"]["prompt_tokens"]
    );
    assert_eq!(again["choices"][0]["token_ids"], choice["token_ids"]);
    // Parses as our Choice, as a rollout would.
    let parsed: art_core::ChatCompletion = serde_json::from_value(body.clone()).unwrap();
    assert_eq!(
        parsed.choices[0].sampled_token_ids().unwrap().len(),
        ids.len()
    );

    let models: Value = reqwest::get(format!("{}/models", server.base_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    let health = health(&server).await;
    assert_eq!(health["status"], "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn n_logprobs_and_seeds() {
    let server = TestServer::tiny(|_| {}).await;
    let (status, body) = post(
        &server,
        chat(json!({"n": 4, "logprobs": true, "top_logprobs": 3, "seed": 5})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        let content = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), choice["token_ids"].as_array().unwrap().len());
        for token in content {
            let logprob = token["logprob"].as_f64().unwrap();
            assert!(logprob <= 0.0 && logprob.is_finite());
            let top: Vec<f64> = token["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["logprob"].as_f64().unwrap())
                .collect();
            assert_eq!(top.len(), 3);
            assert!(top.windows(2).all(|w| w[0] >= w[1]), "sorted");
        }
    }
    let (_, again) = post(
        &server,
        chat(json!({"n": 4, "logprobs": true, "top_logprobs": 3, "seed": 5})),
    )
    .await;
    assert_eq!(again["choices"], body["choices"], "same seed, same answer");
    let (_, other) = post(&server, chat(json!({"n": 4, "seed": 6}))).await;
    let ids = |b: &Value| {
        b["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["token_ids"].clone())
            .collect::<Vec<_>>()
    };
    assert_ne!(ids(&other), ids(&body), "another seed, another answer");
}

/// The whole body of the answer to `body` posted to `url` (a stream read to its end).
async fn post_for_text(url: String, body: &Value) -> String {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Reads a server-sent event stream into its JSON chunks (and checks it ends with [DONE]).
async fn stream_chunks(server: &TestServer, body: Value) -> Vec<Value> {
    let text = post_for_text(format!("{}/chat/completions", server.base_url), &body).await;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*data.last().unwrap(), "[DONE]", "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_sends_the_same_text_in_chunks() {
    let server = TestServer::tiny(|_| {}).await;
    let (_, whole) = post(&server, chat(json!({"seed": 3, "max_tokens": 12}))).await;
    let chunks = stream_chunks(
        &server,
        chat(json!({"seed": 3, "max_tokens": 12, "stream": true,
                                                    "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let last_choice = chunks
        .iter()
        .rev()
        .find(|c| c["choices"].get(0).is_some())
        .unwrap();
    assert_eq!(
        last_choice["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(
        last_choice["choices"][0]["token_ids"],
        whole["choices"][0]["token_ids"]
    );
    // The same counts, except that the streamed request found its prompt in the prefix cache.
    let mut usage = chunks.last().unwrap()["usage"].clone();
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"]
    );
    usage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    assert_eq!(usage, whole["usage"]);
}

/// A stop string is settled once, by the scheduler: the text ends before its first occurrence,
/// and the streamed deltas (which hold back what may start a stop string) add up to the same text.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_string_cuts_the_text_the_same_streamed_or_not() {
    let server = TestServer::tiny(|_| {}).await;
    let request = |extra: Value| {
        let mut body = chat(json!({"seed": 11, "max_tokens": 48, "ignore_eos": true}));
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let (_, free) = post(&server, request(json!({}))).await;
    let text = free["choices"][0]["message"]["content"].as_str().unwrap();
    // A three-character stop string from the middle of the free answer.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 12, "{text:?}");
    let middle = chars.len() / 2;
    let stop: String = chars[middle..middle + 3].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];

    let (_, cut) = post(&server, request(json!({"stop": [stop]}))).await;
    assert_eq!(cut["choices"][0]["message"]["content"], expected);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    let chunks = stream_chunks(&server, request(json!({"stop": [stop], "stream": true}))).await;
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, expected);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        last["choices"][0]["token_ids"],
        cut["choices"][0]["token_ids"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_openai_errors() {
    let server = TestServer::tiny(|_| {}).await;
    let client = reqwest::Client::new();
    let url = format!("{}/chat/completions", server.base_url);

    let malformed = client
        .post(&url)
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);
    let body: Value = malformed.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Invalid request body"),
        "{body}"
    );

    let (status, body) = post(&server, json!({"model": "tiny"})).await;
    assert_eq!(status, 422);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing field `messages`"),
        "{body}"
    );

    let (status, body) = post(&server, chat(json!({"model": "gpt-17"}))).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(body["error"]["message"].as_str().unwrap().contains("tiny"));

    let long = "word ".repeat(5000);
    let (status, body) = post(
        &server,
        json!({"model": "tiny", "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");

    for (param, value) in [
        ("temperature", json!(5)),
        ("top_p", json!(0)),
        ("n", json!(0)),
        ("max_tokens", json!(0)),
        ("top_logprobs", json!(3)),
        ("stop", json!([""])),
    ] {
        let (status, body) = post(&server, chat(json!({ param: value }))).await;
        assert_eq!(status, 400, "{param}: {body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    }
    let (status, body) = post(&server, chat(json!({"messages": []}))).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "messages");

    let unknown_route = client
        .get(server.base_url.replace("/v1", "/v2/nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown_route.status(), 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_is_required_when_set() {
    let server = TestServer::tiny(|o| o.api_key = Some("sk-secret".into())).await;
    let url = format!("{}/chat/completions", server.base_url);
    let client = reqwest::Client::new();
    let anonymous = client
        .post(&url)
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    let body: Value = anonymous.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    let wrong = client
        .post(&url)
        .bearer_auth("sk-wrong")
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let right = client
        .post(&url)
        .bearer_auth("sk-secret")
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    // Health stays open, for load balancers.
    let health = client
        .get(server.base_url.replace("/v1", "/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

#[test]
fn quantized_sampling_needs_a_gguf_model() {
    let dir = temp_dir("quantized");
    let options = ServeOptions {
        model: tiny_model(dir.path()).display().to_string(),
        art_dir: dir.path().join(".art"),
        quantized: true,
        ..ServeOptions::default()
    };
    let error = build_state(&options)
        .err()
        .expect("no quantized weights to sample with");
    assert!(
        error.to_string().contains("--quantized needs a GGUF model"),
        "{error}"
    );
}

/// Two long streamed completions fill the batch (their first chunks show they run), two more
/// requests fill the queue, and the rest must be refused with 429. The long ones (8,000 tokens
/// with `ignore_eos`, on a copy of the tiny model with a long context) last far longer than the
/// test, which hangs up on them at the end, so the outcome does not hang on timing.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_answers_429_and_loses_nothing() {
    let server = long_context_server("long-context", |o| {
        o.max_batch = 2;
        o.max_queue = 2;
    })
    .await;
    let client = reqwest::Client::new();
    let mut long_streams = Vec::new();
    for seed in 0..2 {
        let body =
            chat(json!({"seed": seed, "max_tokens": 8000, "ignore_eos": true, "stream": true}));
        let mut response = client
            .post(format!("{}/chat/completions", server.base_url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.chunk().await.unwrap().expect("a first chunk");
        long_streams.push(response);
    }
    // Of 22 more, two find a place in the queue and wait there; twenty are refused at once.
    let mut answers: FuturesUnordered<_> = (0..22)
        .map(|i| post(&server, chat(json!({"seed": i, "max_tokens": 32}))))
        .collect();
    for _ in 0..20 {
        let (status, body) = answers.next().await.unwrap();
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    }
    // A refusal says when to come back (clients such as the openai SDK honour it).
    let refused = client
        .post(format!("{}/chat/completions", server.base_url))
        .json(&chat(json!({"max_tokens": 4})))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    // The long completions are still streaming; hanging up cancels them, which frees the batch
    // for the two that waited: nothing queued is lost.
    for mut response in long_streams {
        let chunk = response.chunk().await.unwrap().expect("still streaming");
        assert!(!String::from_utf8_lossy(&chunk).contains("[DONE]"));
    }
    for _ in 0..2 {
        let (status, body) = answers.next().await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
}

/// 256 concurrent requests: none lost or failed. The timings are printed, not asserted (a shared
/// 2-core machine makes any speed threshold flaky; speed is measured in BENCHMARKS.md).
#[tokio::test(flavor = "multi_thread")]
async fn load_256_concurrent_requests() {
    let server = TestServer::tiny(|o| o.max_batch = 64).await;
    let body = |i: u64| chat(json!({"seed": i, "max_tokens": 16, "temperature": 1.0}));
    let timed = |i: u64| {
        let server = &server;
        async move {
            let started = Instant::now();
            let (status, answer) = post(server, body(i)).await;
            (status, answer, started.elapsed())
        }
    };
    let sequential_started = Instant::now();
    for i in 0..16 {
        assert_eq!(timed(i).await.0, 200);
    }
    let sequential_per_request = sequential_started.elapsed() / 16;

    let started = Instant::now();
    let results = futures::future::join_all((0..256).map(timed)).await;
    let wall = started.elapsed();
    assert!(
        results.iter().all(|(status, _, _)| *status == 200),
        "all succeed"
    );
    let mut latencies: Vec<Duration> = results.iter().map(|r| r.2).collect();
    latencies.sort();
    let p50 = latencies[128];
    let p99 = latencies[253];
    let per_request = wall / 256;
    let speedup = sequential_per_request.as_secs_f64() / per_request.as_secs_f64();
    println!(
        "load: 256 requests in {wall:.2?} = {:.1} req/s; p50 {p50:.2?}, p99 {p99:.2?}; sequential {sequential_per_request:.2?}/request; batching speed-up {speedup:.1}x",
        256.0 / wall.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn json_schema_output_parses_even_from_a_random_model() {
    let server = TestServer::tiny(|_| {}).await;
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                        "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["answer", "confidence"], "additionalProperties": false});
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}});
    for seed in 0..4 {
        let (status, body) = post(
            &server,
            chat(json!({"seed": seed, "max_tokens": 40, "response_format": format})),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        let value: Value =
            serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert!(
            ["yes", "no"].contains(&value["answer"].as_str().unwrap()),
            "{value}"
        );
        assert!(
            (0..=9).contains(&value["confidence"].as_i64().unwrap()),
            "{value}"
        );
    }
    let (status, body) = post(
        &server,
        chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "response_format");
}

/// Registers the trainable model `name` (project `p`).
async fn register(server: &TestServer, name: &str) {
    let registered = reqwest::Client::new()
        .post(format!("{}/art/models", server.base_url))
        .json(&json!({"name": name, "project": "p"}))
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status(), 200);
}

/// One training step of `name` on `body` (its trajectory groups and config): the `result` event
/// of the streamed answer.
async fn train(server: &TestServer, name: &str, body: Value) -> Value {
    let answer = post_for_text(
        format!("{}/art/models/{name}/train", server.base_url),
        &body,
    )
    .await;
    answer
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .find(|event| event["type"] == "result")
        .unwrap_or_else(|| panic!("no result in {answer}"))
}

/// The context the trainer renders for a conversation is the prompt the server sampled from
/// (one chat-template builder for both; the tools listed alike, also under `tool_choice: "none"`,
/// which the trainer does not know of): the trainer's logprobs of the sampled tokens then equal
/// the sampler's. Any difference in the rendered context (an end-of-turn token, the tool listing)
/// moves them far apart: 0.48 nats a token when the server left the tools out. About 1 s.
#[tokio::test(flavor = "multi_thread")]
async fn the_trainer_renders_the_prompt_the_server_sampled_from() {
    let server = TestServer::tiny(|_| {}).await;
    register(&server, "ctx").await;
    let tools = json!([{"type": "function", "function": {"name": "add", "description": "Adds.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]);
    let messages = json!([
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 2?"}
    ]);
    let mut trajectories = Vec::new();
    for seed in 0..4 {
        let (status, completion) = post(
            &server,
            json!({"model": "ctx", "messages": messages, "tools": tools, "tool_choice": "none",
                   "logprobs": true, "max_tokens": 6, "seed": seed}),
        )
        .await;
        assert_eq!(status, 200, "{completion}");
        let mut conversation = messages.as_array().unwrap().clone();
        conversation.push(completion["choices"][0].clone());
        trajectories.push(json!({"messages_and_choices": conversation, "tools": tools,
                                 "reward": seed % 2}));
    }
    let result = train(
        &server,
        "ctx",
        json!({"trajectory_groups": [{"trajectories": trajectories}],
               "config": {"learning_rate": 1e-3}}),
    )
    .await;
    let diff = result["metrics"]["logprob_abs_diff"].as_f64().unwrap();
    assert!(diff < 1e-4, "mean |sampler - trainer| logprob = {diff}");
}

/// The tiny model with an 8,192-token context (for sequences long enough to fill a batch or a
/// memory budget), served with the options `configure` sets.
async fn long_context_server(tag: &str, configure: impl FnOnce(&mut ServeOptions)) -> TestServer {
    let dir = temp_dir(tag);
    let model = dir.path().join("tiny-long-context");
    RandomModelSpec {
        max_position_embeddings: 8192,
        ..RandomModelSpec::tiny(Architecture::Qwen2)
    }
    .write(&model, 7)
    .unwrap();
    let mut options = ServeOptions {
        model: model.display().to_string(),
        served_model_name: Some("tiny".into()),
        art_dir: dir.path().join(".art"),
        ..ServeOptions::default()
    };
    configure(&mut options);
    TestServer::start(options, dir).await
}

/// A key/value cache budget of 1 MiB (four of these sequences at full length): 24 concurrent
/// requests of 400 tokens all succeed, the newest sequences preempted and resumed along the way,
/// and one that could never fit is refused with a 400 that names the limit, without disturbing
/// the others. ~3 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_kv_cache_budget_preempts_instead_of_failing() {
    let server = long_context_server("kv-budget", |o| o.kv_cache_mib = Some(1)).await;
    let body = |seed: u64| {
        chat(json!({"seed": seed, "max_tokens": 400, "ignore_eos": true, "temperature": 1.0}))
    };
    let answers = futures::future::join_all((0..24).map(|seed| post(&server, body(seed)))).await;
    for (status, answer) in &answers {
        assert_eq!(*status, 200, "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], 400, "{answer}");
    }
    let health = health(&server).await;
    let batch = &health["batch"];
    assert!(batch["preemptions"].as_u64().unwrap() > 0, "{health}");
    assert_eq!(batch["kv_cache_budget_mib"], 1.0, "{health}");
    assert_eq!(batch["running_sequences"], 0, "{health}");
    // The same seed alone (nothing preempted) samples the same tokens.
    let (_, alone) = post(&server, body(5)).await;
    assert_eq!(
        alone["choices"][0]["message"]["content"],
        answers[5].1["choices"][0]["message"]["content"]
    );

    let (status, refused) = post(&server, chat(json!({"max_tokens": 8000}))).await;
    assert_eq!(status, 400, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("key/value cache"), "{message}");
}

/// `count` requests, each with a prompt of its own, one after another; each must succeed.
async fn ask_questions(server: &TestServer, count: usize) {
    for k in 0..count {
        let body = json!({"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("Question {k}")}]});
        let (status, answer) = post(server, body).await;
        assert_eq!(status, 200, "{answer}");
    }
}

/// `--devices cpu,cpu`: two inference replicas behind one endpoint. A group's requests (one
/// prompt) all go to one replica, several prompts reach both, and /health lists each replica
/// with its batch and adds them up. ~1 s.
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_share_the_requests_by_prompt() {
    let server = TestServer::tiny(|o| o.extra_replicas = vec![art_core::engine::Device::Cpu]).await;
    let requests = |health: &Value| -> Vec<u64> {
        let replicas = health["replicas"].as_array().unwrap();
        replicas
            .iter()
            .map(|r| r["batch"]["requests"].as_u64().unwrap())
            .collect()
    };
    let before = health(&server).await;
    assert_eq!(before["status"], "ok", "{before}");
    assert_eq!(requests(&before), vec![0, 0]);
    assert_eq!(before["replicas"][1]["device"], "cpu");

    let group = (0..8).map(|seed| post(&server, chat(json!({"seed": seed, "temperature": 1.0}))));
    for (status, answer) in futures::future::join_all(group).await {
        assert_eq!(status, 200, "{answer}");
    }
    let after_group = health(&server).await;
    let mut counts = requests(&after_group);
    counts.sort();
    assert_eq!(counts, vec![0, 8], "one prompt, one replica: {after_group}");
    assert_eq!(after_group["batch"]["requests"], 8, "{after_group}");

    ask_questions(&server, 16).await;
    let after = health(&server).await;
    let counts = requests(&after);
    assert!(
        counts
            .iter()
            .zip(requests(&after_group))
            .all(|(now, then)| *now > then),
        "different prompts reach both replicas: {after}"
    );
    assert_eq!(after["batch"]["requests"], 24, "{after}");
}

/// A dedicated training device (`--train-devices` apart from `--inference-devices`): every
/// request goes to the inference replica, none to the trainer's copy, and /health gives each its
/// role. ~0.5 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_training_only_device_gets_no_requests() {
    let server = TestServer::tiny(|o| {
        o.extra_replicas = vec![art_core::engine::Device::Cpu];
        o.serve_on_train_device = false;
    })
    .await;
    ask_questions(&server, 6).await;
    let health = health(&server).await;
    assert_eq!(health["status"], "ok", "{health}");
    let replicas = health["replicas"].as_array().unwrap();
    assert_eq!(replicas[0]["role"], "train", "{health}");
    assert_eq!(replicas[0]["batch"]["requests"], 0, "{health}");
    assert_eq!(replicas[1]["role"], "inference", "{health}");
    assert_eq!(replicas[1]["batch"]["requests"], 6, "{health}");
}

/// Training data-parallel over three CPU copies of the model (`--train-devices cpu,cpu,cpu
/// --inference-devices cpu,cpu`): /health gives the two serving copies `train+inference` and the
/// third `train`; a step runs its micro-batches over all three and the trainer's logprobs still
/// equal the sampler's; the new `name@1` is then served by both inference replicas. ~1 s.
#[tokio::test(flavor = "multi_thread")]
async fn training_spreads_over_devices_and_every_replica_serves_the_step() {
    use art_core::engine::Device;
    let server = TestServer::tiny(|o| {
        o.extra_replicas = vec![Device::Cpu];
        o.extra_train_devices = vec![Device::Cpu, Device::Cpu];
    })
    .await;
    let roles = |health: &Value| -> Vec<String> {
        health["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["role"].as_str().unwrap().to_string())
            .collect()
    };
    let before = health(&server).await;
    assert_eq!(
        roles(&before),
        ["train+inference", "train+inference", "train"],
        "{before}"
    );
    register(&server, "dp").await;
    let mut groups = Vec::new();
    for prompt in ["Say hi", "Count", "Name a color"] {
        let messages = json!([{"role": "user", "content": prompt}]);
        let mut trajectories = Vec::new();
        for seed in 0..4 {
            let (status, completion) = post(
                &server,
                json!({"model": "dp", "messages": messages, "logprobs": true, "max_tokens": 6,
                       "seed": seed, "temperature": 1.0}),
            )
            .await;
            assert_eq!(status, 200, "{completion}");
            let mut conversation = messages.as_array().unwrap().clone();
            conversation.push(completion["choices"][0].clone());
            trajectories.push(json!({"messages_and_choices": conversation, "reward": seed}));
        }
        groups.push(json!({"trajectories": trajectories}));
    }
    let result = train(
        &server,
        "dp",
        json!({"trajectory_groups": groups,
               "config": {"learning_rate": 1e-2, "micro_batch_tokens": 32}}),
    )
    .await;
    let metrics = &result["metrics"];
    assert!(
        metrics["num_micro_batches"].as_u64().unwrap() >= 3,
        "{result}"
    );
    let diff = metrics["logprob_abs_diff"].as_f64().unwrap();
    assert!(diff < 1e-4, "mean |sampler - trainer| logprob = {diff}");

    let served = |health: &Value| -> Vec<u64> {
        health["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["batch"]["requests"].as_u64().unwrap())
            .collect()
    };
    let then = served(&health(&server).await);
    for k in 0..12 {
        let body = json!({"model": "dp@1", "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("Question {k}")}]});
        let (status, answer) = post(&server, body).await;
        assert_eq!(status, 200, "{answer}");
    }
    let now = served(&health(&server).await);
    assert!(
        now[0] > then[0] && now[1] > then[1],
        "both replicas serve dp@1: {then:?} -> {now:?}"
    );
    assert_eq!(now[2], 0, "the training-only copy serves nothing");
}
