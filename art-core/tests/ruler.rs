//! RULER: the prompt it builds, how it reads answers, and its behaviour against a real HTTP judge
//! whose answers the test scripts (valid, wrong count, bad JSON, out of range, HTTP 500, slow).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use art_core::ruler::{common_prefix_len, judge_prompt, parse_scores};
use art_core::{
    gather_trajectory_groups, ruler_score_group, ChatEndpoint, GatherOptions, Message, MetricValue,
    RulerError, RulerOptions, Tool, Trajectory, TrajectoryGroup,
};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

fn conversation(answer: &str) -> Vec<Message> {
    vec![
        Message::system("You add numbers."),
        Message::user("2+2?"),
        Message::assistant(answer),
    ]
}

fn trajectory(answer: &str, reward: f64) -> Trajectory {
    Trajectory {
        reward,
        ..Trajectory::new(conversation(answer))
    }
}

#[test]
fn the_shared_prefix_is_sent_once_and_trajectories_in_order() {
    let conversations = vec![
        conversation("4"),
        conversation("five"),
        conversation("It is 4."),
    ];
    assert_eq!(common_prefix_len(&conversations), 2);
    let prompt = judge_prompt(&conversations, None);
    assert_eq!(prompt.matches("You add numbers.").count(), 1);
    assert_eq!(prompt.matches("2+2?").count(), 1);
    let positions: Vec<usize> = ["\"4\"", "\"five\"", "\"It is 4.\""]
        .iter()
        .map(|a| prompt.find(a).unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "trajectories keep their order"
    );
    assert!(prompt.find("<context>").unwrap() < prompt.find("<trajectory id=\"1\">").unwrap());
    assert!(prompt.contains("<trajectory id=\"3\">"));
    assert!(!prompt.contains("<tools>"));
}

#[test]
fn tools_are_shown_and_prefixes_never_swallow_a_whole_trajectory() {
    let tool = Tool::function("add", "Adds two numbers", json!({"type": "object"}));
    let short = vec![Message::user("hi")];
    let long = vec![Message::user("hi"), Message::assistant("hello")];
    assert_eq!(common_prefix_len(&[short.clone(), long.clone()]), 0);
    assert_eq!(common_prefix_len(std::slice::from_ref(&long)), 0);
    let prompt = judge_prompt(&[short, long], Some(&[tool]));
    assert!(prompt.contains("<tools>") && prompt.contains("Adds two numbers"));
}

#[test]
fn answers_are_checked() {
    let ok = r#"{"scores": [{"trajectory_id": "2", "explanation": "b", "score": 0.2},
                            {"trajectory_id": "1", "explanation": "a", "score": 1}]}"#;
    let scores = parse_scores(ok, 2).unwrap();
    assert_eq!(
        (scores[0].score, scores[1].score),
        (1.0, 0.2),
        "reordered by id"
    );
    let fenced = format!("```json\n{ok}\n```");
    assert_eq!(parse_scores(&fenced, 2).unwrap(), scores);
    assert!(parse_scores(ok, 3)
        .unwrap_err()
        .contains("expected 3 scores"));
    assert!(parse_scores("I think the first is best", 2)
        .unwrap_err()
        .contains("no JSON object"));
    assert!(
        parse_scores(r#"{"scores": [{"trajectory_id": "1", "score": 0.5}]}"#, 1)
            .unwrap_err()
            .contains("not the expected JSON")
    );
    let out_of_range = r#"{"scores": [{"trajectory_id": "1", "explanation": "", "score": 7}]}"#;
    assert!(parse_scores(out_of_range, 1)
        .unwrap_err()
        .contains("outside [0, 1]"));
    let twice = r#"{"scores": [{"trajectory_id": "1", "explanation": "", "score": 0.1},
                               {"trajectory_id": "1", "explanation": "", "score": 0.2}]}"#;
    assert!(parse_scores(twice, 2).unwrap_err().contains("scored twice"));
    let unknown = r#"{"scores": [{"trajectory_id": "9", "explanation": "", "score": 0.1}]}"#;
    assert!(parse_scores(unknown, 1)
        .unwrap_err()
        .contains("unknown trajectory id"));
}

/// One scripted judge reply.
enum Reply {
    Content(String),
    Status(u16),
    Slow(Duration, String),
    /// An answer that ran out of tokens (`finish_reason: "length"`).
    CutOff(String),
}

#[derive(Clone, Default)]
struct Judge {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    requests: Arc<Mutex<Vec<Value>>>,
}

async fn complete(State(judge): State<Judge>, Json(request): Json<Value>) -> Response {
    judge.requests.lock().unwrap().push(request);
    let reply = judge
        .replies
        .lock()
        .unwrap()
        .pop_front()
        .expect("the test scripted enough replies");
    let mut finish_reason = "stop";
    let content = match reply {
        Reply::Status(code) => {
            let body = json!({"error": {"message": "judge exploded", "type": "server_error", "param": null, "code": null}});
            return (StatusCode::from_u16(code).unwrap(), Json(body)).into_response();
        }
        Reply::Slow(delay, content) => {
            tokio::time::sleep(delay).await;
            content
        }
        Reply::Content(content) => content,
        Reply::CutOff(content) => {
            finish_reason = "length";
            content
        }
    };
    Json(json!({
        "id": "chatcmpl-judge", "object": "chat.completion", "created": 0, "model": "judge",
        "choices": [{"index": 0, "finish_reason": finish_reason, "logprobs": null,
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    }))
    .into_response()
}

async fn start_judge(replies: Vec<Reply>) -> (Judge, ChatEndpoint) {
    let judge = Judge {
        replies: Arc::new(Mutex::new(replies.into())),
        ..Default::default()
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(complete))
        .with_state(judge.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (
        judge,
        ChatEndpoint::new(url, "judge-model").with_api_key("sk-test"),
    )
}

fn scores(values: &[f64]) -> String {
    let entries: Vec<Value> = values
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"trajectory_id": (i + 1).to_string(), "explanation": format!("reason {}", i + 1), "score": s}))
        .collect();
    json!({ "scores": entries }).to_string()
}

fn group() -> TrajectoryGroup {
    TrajectoryGroup::new([
        trajectory("4", 1.0),
        trajectory("five", 0.0),
        trajectory("It is 4.", 1.0),
    ])
}

#[tokio::test]
async fn scores_are_written_back_as_rewards() {
    let (judge, endpoint) = start_judge(vec![Reply::Content(scores(&[0.9, 0.1, 0.8]))]).await;
    let options = RulerOptions {
        price_per_million_tokens: Some((1.0, 2.0)),
        ..RulerOptions::new(endpoint)
    };
    let scored = ruler_score_group(group(), &options).await.unwrap().unwrap();
    assert_eq!(scored.rewards(), [0.9, 0.1, 0.8]);
    let t = &scored.trajectories[1];
    assert_eq!(t.metrics["independent_reward"], MetricValue::Float(0.0));
    assert_eq!(t.metrics["ruler_score"], MetricValue::Float(0.1));
    assert_eq!(t.logs.last().unwrap(), "RULER explanation: reason 2");
    assert_eq!(scored.metrics["ruler_judge_attempts"], MetricValue::Int(1));
    assert_eq!(scored.metrics["ruler_prompt_tokens"], MetricValue::Int(100));
    assert!((scored.metrics["ruler_cost_usd"].as_f64() - 140e-6).abs() < 1e-12);

    let requests = judge.requests.lock().unwrap();
    let request = &requests[0];
    assert_eq!(request["model"], "judge-model");
    assert_eq!(request["response_format"]["type"], "json_schema");
    assert_eq!(
        request["response_format"]["json_schema"]["schema"]["properties"]["scores"]["minItems"],
        3
    );
    assert_eq!(request["messages"][0]["role"], "system");
    assert!(
        request["messages"][0]["content"]
            .as_str()
            .unwrap()
            .contains("goal"),
        "default rubric"
    );
}

#[tokio::test]
async fn malformed_answers_and_server_errors_are_retried() {
    let (judge, endpoint) = start_judge(vec![
        Reply::Content(scores(&[0.5, 0.5])),
        Reply::Content("not json at all".into()),
        Reply::Status(500),
        Reply::Content(scores(&[0.5, 2.0, 0.1])),
        Reply::Content(scores(&[0.3, 0.2, 0.1])),
    ])
    .await;
    let options = RulerOptions::new(endpoint)
        .max_retries(4)
        .rubric("Shorter is better.");
    let scored = ruler_score_group(group(), &options).await.unwrap().unwrap();
    assert_eq!(scored.rewards(), [0.3, 0.2, 0.1]);
    // async-openai's client retries the HTTP 500 by itself (with backoff), so five requests
    // were four RULER attempts.
    let requests = judge.requests.lock().unwrap();
    assert_eq!(requests.len(), 5);
    assert_eq!(scored.metrics["ruler_judge_attempts"], MetricValue::Int(4));
    assert!(requests[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .contains("Shorter is better."));
}

#[tokio::test]
async fn a_judge_that_never_answers_well_is_an_error_or_a_dropped_group() {
    let bad = || {
        (0..3)
            .map(|_| Reply::Content("{\"scores\": []}".into()))
            .collect::<Vec<_>>()
    };
    let (_, endpoint) = start_judge(bad()).await;
    let error = ruler_score_group(group(), &RulerOptions::new(endpoint))
        .await
        .unwrap_err();
    assert!(
        matches!(error, RulerError::InvalidAnswer { attempts: 3, .. }),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("expected 3 scores, the judge gave 0"),
        "{error}"
    );

    let (_, endpoint) = start_judge(bad()).await;
    let dropped = ruler_score_group(group(), &RulerOptions::new(endpoint).swallow_errors(true))
        .await
        .unwrap();
    assert!(dropped.is_none());
}

#[tokio::test]
async fn an_answer_cut_off_by_max_tokens_says_so() {
    let rambling = r#"{"scores": [{"trajectory_id": "1", "explanation": "It said 19} and then"#;
    let (_, endpoint) = start_judge(vec![Reply::CutOff(rambling.into())]).await;
    let options = RulerOptions::new(endpoint).max_retries(0);
    let error = ruler_score_group(group(), &options).await.unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("cut off at max_tokens (1024)")
            && message.contains("RulerOptions::max_tokens"),
        "{message}"
    );
}

#[tokio::test]
async fn a_slow_judge_times_out_and_the_retry_succeeds() {
    let (_, endpoint) = start_judge(vec![
        Reply::Slow(Duration::from_secs(3), scores(&[1.0, 1.0, 1.0])),
        Reply::Content(scores(&[0.7, 0.6, 0.5])),
    ])
    .await;
    let endpoint = endpoint.with_timeout(Duration::from_millis(500));
    let scored = ruler_score_group(group(), &RulerOptions::new(endpoint))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(scored.rewards(), [0.7, 0.6, 0.5]);
}

#[tokio::test]
async fn identical_trajectories_are_judged_once() {
    let (judge, endpoint) = start_judge(vec![Reply::Content(scores(&[0.4]))]).await;
    let same = TrajectoryGroup::new((0..4).map(|_| trajectory("4", 1.0)));
    let scored = ruler_score_group(same, &RulerOptions::new(endpoint))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(scored.rewards(), [0.4; 4]);
    assert!(scored.logs[0].contains("identical"));
    let requests = judge.requests.lock().unwrap();
    let prompt = requests[0]["messages"][1]["content"].as_str().unwrap();
    assert!(prompt.contains("<trajectory id=\"1\">") && !prompt.contains("<trajectory id=\"2\">"));
}

#[tokio::test]
async fn ruler_works_as_gathers_after_each_hook() {
    let replies = (0..5)
        .map(|_| Reply::Content(scores(&[0.25, 0.75])))
        .collect();
    let (_, endpoint) = start_judge(replies).await;
    let options = RulerOptions::new(endpoint);
    let groups = (0..5).map(|_| {
        TrajectoryGroup::from_rollouts(
            ["a", "b"].map(|answer| async move { Ok::<_, anyhow::Error>(trajectory(answer, 0.0)) }),
        )
    });
    let gather = GatherOptions::new()
        .progress_bar(false)
        .after_each(|group| async { Ok(ruler_score_group(group, &options).await?) });
    let scored = gather_trajectory_groups(groups, gather).await.unwrap();
    assert_eq!(scored.len(), 5);
    assert!(scored.iter().all(|g| g.rewards() == [0.25, 0.75]));
}

/// RULER as OpenPipe ART's own package runs it (recorded by scripts/ruler_art_shapes.py from
/// openpipe-art, unmodified; the python_art suite checks the recording still holds): the same
/// group and the same judge answer (ART's `Response` shape, ids out of order) give the same
/// rewards, metrics and logs here; and our request has ART's shape: a system and a user message,
/// the user message naming trajectories by the ids ART uses, and a response format whose entries
/// carry exactly ART's fields.
#[tokio::test]
async fn art_s_judge_answer_gives_art_s_result_and_our_request_has_art_s_shape() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ruler_art.json");
    let art: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let trajectories = art["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .zip(art["rewards"].as_array().unwrap())
        .map(|(messages, reward)| Trajectory {
            reward: reward.as_f64().unwrap(),
            ..Trajectory::new(serde_json::from_value::<Vec<Message>>(messages.clone()).unwrap())
        });
    let answer = art["judge_answer"].as_str().unwrap().to_string();
    let (judge, endpoint) = start_judge(vec![Reply::Content(answer)]).await;
    let scored = ruler_score_group(
        TrajectoryGroup::new(trajectories),
        &RulerOptions::new(endpoint),
    )
    .await
    .unwrap()
    .unwrap();
    for (ours, theirs) in scored
        .trajectories
        .iter()
        .zip(art["result"].as_array().unwrap())
    {
        assert_eq!(ours.reward, theirs["reward"].as_f64().unwrap());
        for metric in ["independent_reward", "ruler_score"] {
            assert_eq!(
                ours.metrics[metric].as_f64(),
                theirs["metrics"][metric].as_f64().unwrap(),
                "{metric}"
            );
        }
        assert_eq!(json!(ours.logs), theirs["logs"]);
    }

    let ours = judge.requests.lock().unwrap()[0].clone();
    let theirs = &art["request"];
    let roles = |messages: &Value| -> Vec<Value> {
        messages
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].clone())
            .collect()
    };
    assert_eq!(roles(&ours["messages"]), roles(&theirs["messages"]));
    for id in 1..=3 {
        let tag = format!("<trajectory id=\"{id}\">");
        for request in [&ours, theirs] {
            let user = request["messages"][1]["content"].as_str().unwrap();
            assert!(user.contains(&tag), "{tag} in {user}");
        }
    }
    let art_schema = &theirs["response_format_schema"];
    let art_entry = &art_schema["$defs"]["TrajectoryScore"];
    let our_schema = &ours["response_format"]["json_schema"]["schema"];
    assert_eq!(our_schema["required"], art_schema["required"]);
    for entry in our_schema["properties"]["scores"]["prefixItems"]
        .as_array()
        .unwrap()
    {
        assert_eq!(entry["required"], art_entry["required"]);
        for (field, spec) in art_entry["properties"].as_object().unwrap() {
            assert_eq!(entry["properties"][field]["type"], spec["type"], "{field}");
        }
    }
}
