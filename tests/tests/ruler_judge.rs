//! RULER with our own backend as the judge (the offline default): `art serve` with the embedded
//! SmolLM2-135M-Instruct ranks a group, and constrained decoding makes even this small judge answer
//! with schema-valid scores on the first attempt.

use art_core::server::ServeOptions;
use art_core::{
    ruler_score_group, ChatEndpoint, Message, RulerOptions, Trajectory, TrajectoryGroup,
};
use art_e2e::{smollm2, temp_dir, TestServer};

fn answered(answer: &str, reward: f64) -> Trajectory {
    let mut trajectory = Trajectory::new([
        Message::system("Answer the question."),
        Message::user("What is 12 + 7?"),
        Message::assistant(answer),
    ]);
    trajectory.reward = reward;
    trajectory
}

#[tokio::test(flavor = "multi_thread")]
async fn our_own_server_judges_a_group_with_valid_scores() {
    let model = smollm2();
    let dir = temp_dir("ruler-judge");
    let options = ServeOptions {
        model: model.display().to_string(),
        served_model_name: Some("judge".into()),
        art_dir: dir.path().join(".art"),
        ..ServeOptions::default()
    };
    let server = TestServer::start(options, dir).await;
    let judge = ChatEndpoint::new(&server.base_url, &server.model);
    // Greedy, so that the run is the same on every machine: at temperature 1 this small judge
    // now and then writes an explanation that runs past max_tokens (the answer is then cut, not
    // invalid; RULER's error says so).
    let mut rulers = RulerOptions::new(judge).max_retries(0);
    rulers.temperature = Some(0.0);

    let group = TrajectoryGroup::new(vec![
        answered("19", 1.0),
        answered("12 + 7 = 19.", 1.0),
        answered("21", 0.0),
        answered("I like turtles.", 0.0),
    ]);
    let judged = ruler_score_group(group, &rulers)
        .await
        .expect("a schema-constrained judge answers on the first attempt")
        .expect("not swallowed");

    for trajectory in &judged.trajectories {
        let score = trajectory.metrics["ruler_score"].as_f64();
        assert!((0.0..=1.0).contains(&score), "{score}");
        assert_eq!(trajectory.reward, score);
        assert!(trajectory.metrics.contains_key("independent_reward"));
        assert!(trajectory
            .logs
            .iter()
            .any(|l| l.starts_with("RULER explanation: ")));
        eprintln!(
            "{:>5.2}  {:?}  {}",
            score,
            trajectory.last_assistant_text().unwrap_or_default(),
            trajectory.logs.last().unwrap()
        );
    }
    assert_eq!(judged.metrics["ruler_judge_attempts"].as_f64(), 1.0);
    assert!(judged.metrics["ruler_completion_tokens"].as_f64() > 0.0);
}
