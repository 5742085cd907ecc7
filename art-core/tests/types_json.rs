//! JSON compatibility with OpenPipe ART's trajectories and OpenAI's chat completions.

use art_core::{
    Choice, Content, ContentPart, Message, MessageOrChoice, MetadataValue, MetricValue, Trajectory,
    TrajectoryGroup,
};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Python writes `None` fields as explicit nulls where we leave them out; both mean the same.
fn without_nulls(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

#[test]
fn art_trajectory_group_round_trips() {
    let original = fixture("art_trajectory_group.json");
    let group: TrajectoryGroup = serde_json::from_value(original.clone()).unwrap();
    let written = serde_json::to_value(&group).unwrap();
    assert_eq!(without_nulls(written.clone()), without_nulls(original));
    // And what we write parses back to the same value.
    let reparsed: TrajectoryGroup = serde_json::from_value(written).unwrap();
    assert_eq!(reparsed, group);
}

#[test]
fn art_trajectory_fields_are_understood() {
    let group: TrajectoryGroup =
        serde_json::from_value(fixture("art_trajectory_group.json")).unwrap();
    assert_eq!(group.trajectories.len(), 2);
    assert_eq!(group.exceptions[0].kind, "TimeoutError");
    assert_eq!(group.metadata["step"], MetadataValue::Int(3));

    let t = &group.trajectories[0];
    let kinds: Vec<&str> = t
        .messages_and_choices
        .iter()
        .map(|item| match item {
            MessageOrChoice::Message(m) => m.role(),
            MessageOrChoice::Choice(_) => "choice",
        })
        .collect();
    assert_eq!(kinds, ["system", "user", "choice", "tool", "choice"]);
    assert_eq!(t.reward, 1.0);
    assert_eq!(t.metrics["correct_unit"], MetricValue::Bool(true));
    assert_eq!(t.metrics["num_turns"], MetricValue::Int(2));
    assert_eq!(t.metrics["duration"], MetricValue::Float(1.75));
    assert_eq!(t.metadata["notes"], MetadataValue::Null);
    assert_eq!(t.tools.as_ref().unwrap()[0].function.name, "get_weather");

    let choices: Vec<&Choice> = t.choices().collect();
    let call = &choices[0].message.tool_calls[0];
    assert_eq!(call.function.name, "get_weather");
    assert_eq!(call.parsed_arguments().unwrap()["unit"], "celsius");
    // ART's vLLM writes sampled tokens as "token_id:<id>"; we recover the ids.
    assert_eq!(
        choices[0].sampled_token_ids().unwrap(),
        [151657, 198, 4913, 151658]
    );
    assert_eq!(choices[1].sampled_logprobs().unwrap()[0], -0.31);
    assert_eq!(
        choices[1]
            .logprobs
            .as_ref()
            .unwrap()
            .content
            .as_ref()
            .unwrap()[0]
            .top_logprobs
            .len(),
        2
    );

    // The plain message list: choices become assistant messages, ready for the next request.
    let messages = t.messages();
    assert_eq!(messages.len(), 5);
    assert!(
        matches!(&messages[2], Message::Assistant(a) if a.content.is_none() && a.tool_calls.len() == 1)
    );
    assert_eq!(
        t.last_assistant_text().unwrap(),
        "It's 18°C and clear in Paris."
    );

    let history = &t.additional_histories[0];
    assert!(matches!(&history.messages()[0], Message::User(u)
        if u.content == Content::Parts(vec![ContentPart::Text { text: "Summarise: clear, 18C".into() }])));
    // Without logprobs there are no sampled ids to train on.
    assert_eq!(
        group.trajectories[1]
            .choices()
            .next()
            .unwrap()
            .sampled_token_ids(),
        Some(vec![])
    );
}

#[test]
fn openai_chat_completion_choices_round_trip() {
    let response = fixture("openai_chat_completion.json");
    let choices: Vec<Choice> = serde_json::from_value(response["choices"].clone()).unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[0].finish_reason.as_deref(), Some("stop"));
    assert_eq!(
        choices[0].message.content.as_ref().unwrap().text(),
        "The image shows a wooden boardwalk."
    );
    // Fields we do not model survive the trip.
    assert_eq!(
        choices[0].message.extra["annotations"],
        serde_json::json!([])
    );
    assert_eq!(choices[1].message.tool_calls[0].id, "call_abc123");
    assert_eq!(choices[1].sampled_token_ids(), None);
    assert_eq!(choices[0].sampled_logprobs().unwrap(), [-0.0001, -0.02]);
    let written = serde_json::to_value(&choices).unwrap();
    assert_eq!(
        without_nulls(written),
        without_nulls(response["choices"].clone())
    );
}

#[test]
fn a_choice_with_a_user_message_is_rejected_with_a_clear_error() {
    let bad = serde_json::json!({"index": 0, "finish_reason": "stop", "message": {"role": "user", "content": "hi"}});
    let error = serde_json::from_value::<Choice>(bad)
        .unwrap_err()
        .to_string();
    assert!(error.contains("must have role \"assistant\""), "{error}");
}

#[test]
fn messages_serialize_as_openai_expects() {
    let messages = vec![
        Message::system("be brief"),
        Message::user("hi"),
        Message::assistant("hello"),
        Message::tool("call_1", "42"),
    ];
    let json = serde_json::to_value(&messages).unwrap();
    assert_eq!(
        json,
        serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"}
        ])
    );
}

#[test]
fn trajectory_helpers_record_metrics_and_duration() {
    let mut t = Trajectory::new([Message::user("2+2?")]);
    t.set_metric("correct", true);
    t.set_metric("tokens", 12usize);
    t.set_metadata("scenario", "add");
    t.log("started");
    std::thread::sleep(std::time::Duration::from_millis(20));
    let t = t.finish();
    let duration = t.metrics["duration"].as_f64();
    assert!((0.02..5.0).contains(&duration), "duration {duration}");
    assert_eq!(t.metrics["correct"].as_f64(), 1.0);
    assert_eq!(t.metadata["scenario"], MetadataValue::Text("add".into()));
}

#[test]
fn group_reward_statistics() {
    let group = TrajectoryGroup::new([1.0, 0.0, 0.5, 0.5].map(|r| Trajectory {
        reward: r,
        ..Default::default()
    }));
    assert_eq!(group.mean_reward(), Some(0.5));
    assert!((group.reward_std().unwrap() - 0.353_553_390_6).abs() < 1e-9);
    assert_eq!(TrajectoryGroup::default().mean_reward(), None);
}
