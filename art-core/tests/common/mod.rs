//! Groups with every kind of content a store must keep: messages and choices (with token ids),
//! tools, metrics of each type, metadata, group metadata, logs, failed rollouts.
#![allow(dead_code)]

use std::path::PathBuf;

use art_core::{
    AssistantMessage, Choice, Message, RolloutException, Tool, ToolCall, Trajectory,
    TrajectoryGroup,
};

/// A fresh, empty directory under the test target dir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn choice(text: &str, token_ids: Option<Vec<u32>>) -> Choice {
    Choice {
        index: 0,
        message: AssistantMessage {
            content: Some(text.into()),
            ..Default::default()
        },
        finish_reason: Some("stop".into()),
        logprobs: None,
        token_ids,
        extra: Default::default(),
    }
}

pub fn trajectory(question: &str, answer: &str, reward: f64, correct: bool) -> Trajectory {
    let mut t = Trajectory::new([Message::system("Answer briefly."), Message::user(question)]);
    t.push_choice(choice(answer, Some(vec![11, 12, 13])));
    t.reward = reward;
    t.set_metric("correct", correct);
    t.set_metric("turns", 1);
    t.set_metadata("question", question);
    t
}

/// Two groups: [1.0, 0.0] and [0.5, 0.5] plus one failed rollout.
///
/// reward mean 0.5, reward std sqrt(0.125), within-group std mean 0.25, exception rate 1/5,
/// `correct` mean 0.75, `turns` mean 1, `difficulty` (float in group 2 only) mean 0.75,
/// completion tokens: 3, 3, 3, and 3 + 2 = 5 for the tool-using one -> mean 3.5.
pub fn groups() -> Vec<TrajectoryGroup> {
    let mut a0 = trajectory("2+2?", "4", 1.0, true);
    a0.log("checked arithmetic");
    a0.initial_policy_version = Some(0);
    a0.final_policy_version = Some(1);
    let a1 = trajectory("2+2?", "5", 0.0, false);
    let mut a = TrajectoryGroup::new([a0, a1]);
    a.metadata.insert("scenario".into(), "arith-1".into());
    a.logs.push("group a judged".into());

    let mut b0 = trajectory("Capital of France?", "Paris", 0.5, true);
    b0.set_metric("difficulty", 0.5);
    let mut b1 = trajectory("Capital of France?", "", 0.5, true).with_tools(vec![Tool::function(
        "search",
        "Search the web",
        serde_json::json!({"type": "object", "properties": {"q": {"type": "string"}}}),
    )]);
    // A tool call, its result, and the final answer.
    b1.messages_and_choices.pop();
    let mut call = choice("", Some(vec![21, 22]));
    call.message.content = None;
    call.message.tool_calls = vec![ToolCall::new(
        "call_1",
        "search",
        r#"{"q":"capital of France"}"#,
    )];
    call.finish_reason = Some("tool_calls".into());
    b1.push_choice(call);
    b1.push_message(Message::tool("call_1", "Paris is the capital of France."));
    b1.push_choice(choice("Paris", Some(vec![31, 32, 33])));
    b1.set_metric("difficulty", 1.0);
    b1.set_metadata("question", 7);
    let mut b = TrajectoryGroup::new([b0, b1]);
    b.metadata.insert("scenario".into(), "geo-1".into());
    b.exceptions.push(RolloutException {
        kind: "TimeoutError".into(),
        message: "judge took too long".into(),
        traceback: String::new(),
    });
    vec![a, b]
}
