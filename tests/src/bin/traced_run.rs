//! One training iteration run as a program of its own, so that tests/tests/observability.rs can
//! give it the `OTEL_*` variables a user would (they are read once per process): `art serve` as
//! a child (it inherits them), two groups of two rollouts judged by RULER (our own server as the
//! judge), `model.log`, one training step, then the backend stopped and the spans flushed.
//! Prints one JSON line: the model's directory and the step reached.
//!
//!     traced_run ART_DIR MODEL_FILE MODEL_NAME

use art_core::{
    gather_trajectory_groups, ruler_score_group, telemetry, ChatCompletionRequest, GatherOptions,
    LocalBackend, LocalBackendOptions, Message, RulerOptions, Split, TrainConfig, TrainableModel,
    Trajectory, TrajectoryGroup,
};

async fn rollout(model: &TrainableModel, a: u32, seed: u64) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new([
        Message::system("Answer with the number only."),
        Message::user(format!("What is {a} + 3?")),
    ]);
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.max_tokens = Some(6);
    request.temperature = Some(1.0);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let choice = model.endpoint().complete(request).await?.choices.remove(0);
    trajectory.reward = f64::from(choice.to_message().text().contains(&(a + 3).to_string()));
    trajectory.push_choice(choice);
    Ok(trajectory)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [art_dir, model_file, name] = args.as_slice() else {
        anyhow::bail!("usage: traced_run ART_DIR MODEL_FILE MODEL_NAME");
    };
    let mut options = LocalBackendOptions::new(model_file.clone());
    options.art_dir = art_dir.into();
    let backend = LocalBackend::start(options).await?;
    let model = TrainableModel::register(&backend, name.clone(), "observability").await?;
    let judge = RulerOptions::new(model.endpoint()).max_retries(1);
    let groups = (0..2u32).map(|g| {
        let model = &model;
        TrajectoryGroup::from_rollouts((0..2u64).map(move |i| rollout(model, g + 4, i)))
    });
    let options = GatherOptions::new()
        .progress_bar(false)
        .after_each(|group| async { Ok(ruler_score_group(group, &judge).await?) });
    let groups = gather_trajectory_groups(groups, options).await?;
    model.log(&groups, Split::Train).await?;
    let result = model.train(&groups, &TrainConfig::default()).await?;
    println!(
        "{}",
        serde_json::json!({
            "model_dir": std::path::Path::new(art_dir).join("observability/models").join(name),
            "step": result.step,
        })
    );
    // The server sends its last spans as it stops; then this process sends its own.
    drop(model);
    drop(backend);
    telemetry::shutdown();
    Ok(())
}
