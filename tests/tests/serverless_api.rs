//! The API of OpenPipe ART's ServerlessBackend (`/v1/preview/...`) over HTTP, with the tiny random
//! model: registration, `wandb-artifact:///` inference names with vLLM's token fields, a training
//! job polled to its end, checkpoint pages and deletion, and the bad paths. The real Python client
//! runs against the real model in python_art.rs. About 3 s.

use std::time::Duration;

use art_e2e::TestServer;
use serde_json::{json, Value};

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None).await
    }

    /// A completion as ART's Python client asks for it.
    async fn sample(&self, model: &str) -> (u16, Value) {
        self.post(
            "/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": "Say hi"}],
                   "max_tokens": 6, "logprobs": true, "return_token_ids": true,
                   "return_tokens_as_token_ids": true, "nvext": {"extra_fields": ["engine_data"]},
                   "chat_template_kwargs": {"preserve_thinking": true}}),
        )
        .await
    }

    /// Polls a job's events (as the client does, `after` the last one seen) until it ends.
    async fn events_until_done(&self, job: &str) -> Vec<Value> {
        let mut events: Vec<Value> = Vec::new();
        for _ in 0..600 {
            let after = events
                .last()
                .map(|e| format!("?after={}", e["id"].as_str().unwrap()))
                .unwrap_or_default();
            let (status, page) = self
                .get(&format!("/preview/training-jobs/{job}/events{after}"))
                .await;
            assert_eq!(status, 200, "{page}");
            events.extend(page["data"].as_array().unwrap().iter().cloned());
            let last = events.last().map(|e| e["type"].clone());
            if last == Some(json!("training_ended")) || last == Some(json!("training_failed")) {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the job did not end: {events:?}");
    }
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn python_arts_serverless_api_registers_trains_and_lists() {
    let server = TestServer::tiny(|o| o.aliases = vec!["org/tiny".into()]).await;
    let client = Client {
        http: reqwest::Client::new(),
        base: server.base_url.clone(),
    };
    let register = |base: &str, existing: bool| {
        json!({"entity": null, "project": "proj", "name": "run", "base_model": base,
               "return_existing": existing})
    };

    let (status, error) = client
        .post("/preview/models", register("org/other", true))
        .await;
    assert_eq!(status, 400, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`tiny`") && message.contains("--alias"),
        "{message}"
    );

    let (status, model) = client
        .post("/preview/models", register("org/tiny", false))
        .await;
    assert_eq!(status, 200, "{model}");
    assert_eq!(
        model,
        json!({"id": "run", "entity": "local", "project": "proj", "name": "run",
               "base_model": "org/tiny", "run_id": null})
    );
    let (status, _) = client
        .post("/preview/models", register("org/tiny", false))
        .await;
    assert_eq!(status, 409);
    let (status, again) = client
        .post("/preview/models", register("org/tiny", true))
        .await;
    assert_eq!((status, &again["id"]), (200, &json!("run")));

    // Inference under the artifact name, with vLLM's token fields.
    let name = "wandb-artifact:///local/proj/run";
    let (status, completion) = client.sample(name).await;
    assert_eq!(status, 200, "{completion}");
    assert!(!completion["prompt_token_ids"]
        .as_array()
        .unwrap()
        .is_empty());
    let choice = &completion["choices"][0];
    let ids = choice["token_ids"].as_array().unwrap();
    assert_eq!(json!(ids.len()), completion["usage"]["completion_tokens"]);
    let tokens: Vec<Value> = ids
        .iter()
        .map(|id| json!(format!("token_id:{id}")))
        .collect();
    let logprob_tokens: Vec<Value> = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].clone())
        .collect();
    assert_eq!(logprob_tokens, tokens);
    for missing in [
        format!("{name}:step3"),
        "wandb-artifact:///local/other/run".into(),
    ] {
        let (status, error) = client.sample(&missing).await;
        assert_eq!(status, 404, "{missing}: {error}");
    }

    // A group of two rollouts with different rewards, as ART's legacy trajectories.
    let mut trajectories = Vec::new();
    for reward in [1.0, 0.0] {
        let (_, completion) = client.sample(name).await;
        trajectories.push(json!({
            "messages_and_choices": [{"role": "user", "content": "Say hi"}, completion["choices"][0]],
            "reward": reward
        }));
    }
    let groups = json!([{"trajectories": trajectories}]);
    let (status, error) = client
        .post(
            "/preview/training-jobs",
            json!({"model_id": "run", "trajectory_groups": groups,
                   "experimental_config": {"plot_tensors": true}}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        error["error"]["param"],
        json!("experimental_config.plot_tensors")
    );
    let (status, job) = client
        .post(
            "/preview/training-jobs",
            json!({"model_id": "run", "trajectory_groups": groups,
                   "experimental_config": {"loss_fn": "cispo", "learning_rate": 1e-3}}),
        )
        .await;
    assert_eq!(status, 200, "{job}");
    let events = client.events_until_done(job["id"].as_str().unwrap()).await;
    assert_eq!(
        kinds(&events),
        ["training_started", "gradient_step", "training_ended"]
    );
    assert_eq!(events[0]["data"], json!({"num_sequences": 1, "step": 1}));
    assert!(events[1]["data"]
        .as_object()
        .unwrap()
        .values()
        .all(Value::is_number));
    let (_, page) = client
        .get("/preview/models/run/checkpoints?limit=1&order=desc")
        .await;
    assert_eq!(page["data"][0]["step"], json!(1), "{page}");
    assert_eq!(page["has_more"], json!(false));
    assert!(page["data"][0]["metrics"]["grad_norm"].is_number());
    let (status, _) = client.sample(&format!("{name}:step1")).await;
    assert_eq!(status, 200);

    // The step's PEFT adapter, downloadable through our own API (W&B's artifacts are not here).
    let files = "/art/models/run/checkpoints/1/files";
    let (status, config) = client.get(&format!("{files}/adapter_config.json")).await;
    assert_eq!(
        (status, &config["peft_type"]),
        (200, &json!("LORA")),
        "{config}"
    );
    let weights = client
        .http
        .get(format!("{}{files}/adapter_model.safetensors", client.base))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
    assert!(
        header
            .as_object()
            .unwrap()
            .keys()
            .any(|k| k.contains("lora_A")),
        "{header}"
    );
    for missing in [
        format!("{files}/trainer_state.json"),
        "/art/models/run/checkpoints/9/files/adapter_config.json".into(),
    ] {
        assert_eq!(client.get(&missing).await.0, 404, "{missing}");
    }

    // A batch the trainer refuses (a choice without logprobs) ends its job as failed.
    let mut broken = groups.clone();
    broken[0]["trajectories"][0]["messages_and_choices"][1]["logprobs"] = Value::Null;
    let (_, job) = client
        .post(
            "/preview/training-jobs",
            json!({"model_id": "run", "trajectory_groups": broken}),
        )
        .await;
    let events = client.events_until_done(job["id"].as_str().unwrap()).await;
    assert_eq!(kinds(&events), ["training_failed"]);
    let message = events[0]["data"]["error_message"].as_str().unwrap();
    assert!(message.contains("no logprobs"), "{message}");

    // Checkpoints: the latest cannot be deleted, unknown steps are reported.
    let delete = |steps: Value| {
        client.send(
            reqwest::Method::DELETE,
            "/preview/models/run/checkpoints",
            Some(json!({"steps": steps})),
        )
    };
    let (status, error) = delete(json!([1])).await;
    assert_eq!(status, 400, "{error}");
    let (status, answer) = delete(json!([7])).await;
    assert_eq!(
        (status, answer),
        (200, json!({"deleted_count": 0, "not_found_steps": [7]}))
    );

    let (status, _) = client
        .send(reqwest::Method::DELETE, "/preview/models/run", None)
        .await;
    assert_eq!(status, 204);
    let (status, _) = client.get("/preview/models/run/checkpoints").await;
    assert_eq!(status, 404);
    let (status, _) = client.sample(name).await;
    assert_eq!(status, 404);
    let (status, _) = client.get("/preview/training-jobs/job-0-0/events").await;
    assert_eq!(status, 404);
}

/// ART's `sft_training_jobs` on a JSONL file: batches as gradient steps, one checkpoint, and the
/// data errors a client can make. About 1 s.
#[tokio::test(flavor = "multi_thread")]
async fn sft_jobs_learn_a_jsonl_file() {
    let server = TestServer::tiny(|_| {}).await;
    let client = Client {
        http: reqwest::Client::new(),
        base: server.base_url.clone(),
    };
    let (status, model) = client
        .post(
            "/preview/models",
            json!({"project": "proj", "name": "sft", "base_model": "tiny"}),
        )
        .await;
    assert_eq!(status, 200, "{model}");

    // As ART's ServerlessBackend writes it: `messages` and (optional) `tools` per line.
    let data = art_e2e::temp_dir("sft-data");
    let lines: Vec<String> = ["2+2", "3+3", "4+4"]
        .iter()
        .map(|q| {
            json!({"messages": [{"role": "user", "content": q},
                                {"role": "assistant", "content": "a number"}]})
            .to_string()
        })
        .collect();
    let file = data.path().join("train.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let job = |url: String, config: Value| {
        client.post(
            "/preview/sft-training-jobs",
            json!({"model_id": "sft", "training_data_url": url, "config": config}),
        )
    };
    let (status, created) = job(
        format!("file://{}", file.display()),
        json!({"batch_size": 2, "learning_rate": [1e-3, 5e-4], "assistant_turns": "all"}),
    )
    .await;
    assert_eq!(status, 200, "{created}");
    let events = client
        .events_until_done(created["id"].as_str().unwrap())
        .await;
    assert_eq!(
        kinds(&events),
        [
            "training_started",
            "gradient_step",
            "gradient_step",
            "training_ended"
        ]
    );
    assert_eq!(events[0]["data"], json!({"num_sequences": 2, "step": 1}));
    assert_eq!(events[2]["data"]["learning_rate"], json!(5e-4));
    assert!(events[1]["data"]["loss"].as_f64().unwrap() > 0.0);
    let (_, page) = client.get("/preview/models/sft/checkpoints").await;
    assert_eq!(page["data"][0]["step"], json!(1), "{page}");
    let (status, _) = client
        .sample("wandb-artifact:///local/proj/sft:step1")
        .await;
    assert_eq!(status, 200);

    // Bad data is refused before a job starts, saying what to fix (never quoting the file).
    let bad_line = data.path().join("bad.jsonl");
    std::fs::write(&bad_line, format!("{}\n{{\"messages\": 7}}\n", lines[0])).unwrap();
    let not_jsonl = data.path().join("train.txt");
    std::fs::write(&not_jsonl, "secret").unwrap();
    for (url, config, expected) in [
        (
            "wandb-artifact:///e/p/data:v0".to_string(),
            json!({}),
            "file:///",
        ),
        (
            format!("file://{}", data.path().join("missing.jsonl").display()),
            json!({}),
            "cannot read",
        ),
        (not_jsonl.display().to_string(), json!({}), "not a .jsonl"),
        (
            format!("file://{}", bad_line.display()),
            json!({}),
            "line 2",
        ),
        (
            format!("file://{}", file.display()),
            json!({"learning_rate": [1e-3]}),
            "one rate per batch",
        ),
    ] {
        let (status, error) = job(url.clone(), config).await;
        assert_eq!(status, 400, "{url}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{url}: {message}");
        assert!(!message.contains("secret"), "{message}");
    }
    let (_, page) = client.get("/preview/models/sft/checkpoints").await;
    assert_eq!(page["data"].as_array().unwrap().len(), 1);
}
