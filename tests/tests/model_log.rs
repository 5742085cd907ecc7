//! `TrainableModel::log` against a real `art serve` (LocalBackend): rollouts logged at the step the
//! backend reports, into the same `.art` tree the server keeps its checkpoints in. One GRPO step is
//! taken in between by the library's trainer on that model directory (as the server's training
//! endpoint will), so the second log happens at step 1, after the server resumed from it.

use std::path::Path;
use std::sync::Arc;

use art_core::engine::{Engine, LoadOptions, ModelSource};
use art_core::store::metrics;
use art_core::train::Trainer;
use art_core::{
    gather_trajectory_groups, ChatCompletionRequest, GatherOptions, LocalBackend,
    LocalBackendOptions, LoraConfig, Message, ModelStore, TrainConfig, TrainableModel, Trajectory,
    TrajectoryGroup,
};
use art_e2e::{tiny_model, TempDir};

/// A rollout on the served model; its reward and metrics depend only on `seed`. Seed 3 fails,
/// as a rollout whose tool call broke would.
async fn rollout(model: &TrainableModel, seed: u64) -> anyhow::Result<Trajectory> {
    if seed % 10 == 3 {
        anyhow::bail!("rollout {seed} failed on purpose");
    }
    let mut trajectory = Trajectory::new([Message::user("Count to three.")]);
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.max_tokens = Some(6);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let completion = model.endpoint().complete(request).await?;
    let choice = completion.choices.into_iter().next().expect("one choice");
    trajectory.push_choice(choice);
    trajectory.reward = (seed % 10) as f64 / 4.0;
    trajectory.set_metric("even", seed % 2 == 0);
    trajectory.set_metric("seed", seed as i64);
    Ok(trajectory)
}

/// Two groups of four rollouts (seeds g*10 + 0..4); one rollout of each group fails.
async fn gather(model: &TrainableModel, first_group: u64) -> Vec<TrajectoryGroup> {
    let groups = (first_group..first_group + 2)
        .map(|g| TrajectoryGroup::from_rollouts((0..4).map(move |i| rollout(model, g * 10 + i))));
    gather_trajectory_groups(
        groups,
        GatherOptions::new().progress_bar(false).max_exceptions(2),
    )
    .await
    .unwrap()
}

async fn start(model_path: &Path, art_dir: &Path) -> LocalBackend {
    let mut options = LocalBackendOptions::new(model_path.display().to_string());
    options.art_dir = art_dir.to_path_buf();
    LocalBackend::start(options)
        .await
        .expect("art serve starts (cargo test --workspace builds it)")
}

fn close(value: Option<f64>, expected: f64) {
    let value = value.expect("metric present");
    assert!((value - expected).abs() < 1e-9, "{value} != {expected}");
}

#[tokio::test(flavor = "multi_thread")]
async fn model_log_writes_history_and_trajectories_at_the_backend_step() {
    let dir = TempDir::new("model-log");
    let model_path = tiny_model(dir.path());
    let art = dir.path().join(".art");
    let model_dir = art.join("e2e/models/agent");

    // Step 0: a fresh model.
    let backend = start(&model_path, &art).await;
    let model = TrainableModel::register(&backend, "agent", "e2e")
        .await
        .unwrap();
    assert_eq!(model.art_dir(), art, "a local backend's art dir is the model's");
    let train_groups = gather(&model, 0).await;
    let logged = model.log(&train_groups, "train").await.unwrap();
    assert_eq!(logged.entry.step, 0);
    assert_eq!(
        logged.trajectories_path,
        model_dir.join("trajectories/train/0000.parquet")
    );
    // Rewards 0, 0.25, 0.5 per group (seed 3 failed): mean 0.25, std sqrt(1/24) overall and
    // within each group; 2 failures in 8 rollouts; `even` is true for seeds 0 and 2 (2 of 3).
    let m = &logged.entry;
    close(m.get(metrics::REWARD), 0.25);
    close(m.get(metrics::REWARD_STD), (1.0f64 / 24.0).sqrt());
    close(m.get(metrics::REWARD_STD_DEV), (1.0f64 / 24.0).sqrt());
    close(m.get(metrics::EXCEPTION_RATE), 0.25);
    close(m.get(metrics::NUM_TRAJECTORIES), 6.0);
    close(m.get("even"), 2.0 / 3.0);
    close(m.get("seed"), (0 + 1 + 2 + 10 + 11 + 12) as f64 / 6.0);
    let tokens: Vec<usize> = train_groups
        .iter()
        .flat_map(|g| &g.trajectories)
        .map(|t| t.choices().next().unwrap().sampled_token_ids().unwrap().len())
        .collect();
    assert!(tokens.iter().all(|&n| (1..=6).contains(&n)), "{tokens:?}");
    close(
        m.get(metrics::COMPLETION_TOKENS),
        tokens.iter().sum::<usize>() as f64 / 6.0,
    );
    drop(model);
    drop(backend);

    // One GRPO step on the same model directory: checkpoints/0001.
    let engine = Arc::new(
        Engine::load(
            &ModelSource::HfDir(model_path.clone()),
            &LoadOptions::default(),
        )
        .unwrap(),
    );
    let mut trainer =
        Trainer::new(engine, model_dir.clone(), "agent", &LoraConfig::default()).unwrap();
    let step = trainer
        .train(&train_groups, &TrainConfig::default(), |_| {})
        .unwrap();
    assert_eq!(step.step, 1);
    assert!(step.trained);
    // What the training API will do after a step: the step's metrics go to the same history.
    let store = ModelStore::open(&art, "e2e", "agent").unwrap();
    store
        .append_history(step.step, "train", step.metrics.to_map())
        .unwrap();
    drop(trainer);

    // Step 1: the server resumes from the checkpoint; rollouts are logged at step 1.
    let backend = start(&model_path, &art).await;
    let model = TrainableModel::register(&backend, "agent", "e2e")
        .await
        .unwrap();
    assert_eq!(model.get_step().await.unwrap(), 1);
    let val_groups = gather(&model, 5).await;
    let logged = model.log(&val_groups, "val").await.unwrap();
    assert_eq!(logged.entry.step, 1);
    assert_eq!(
        logged.trajectories_path,
        model_dir.join("trajectories/val/0001.parquet")
    );

    // Everything reads back: history in order, trajectories exactly as logged.
    let history = store.history().unwrap();
    let keys: Vec<(u64, &str)> = history.iter().map(|e| (e.step, e.split.as_str())).collect();
    assert_eq!(keys, [(0, "train"), (1, "train"), (1, "val")]);
    assert!(history[1].get("loss").is_some_and(f64::is_finite));
    assert!(history[1].get("grad_norm").is_some_and(|g| g > 0.0));
    close(history[2].get(metrics::REWARD), 0.25);
    assert_eq!(
        store.read_trajectory_groups("train", 0).unwrap(),
        train_groups
    );
    assert_eq!(store.read_trajectory_groups("val", 1).unwrap(), val_groups);
    let frame = store.history_frame().unwrap();
    assert_eq!(frame.height(), 3);
    assert!(frame.column("loss").is_ok() && frame.column("reward").is_ok());
    // The server's model.json and checkpoints live in the same tree.
    assert!(model_dir.join("model.json").is_file());
    assert_eq!(store.checkpoints().unwrap(), vec![1]);
}
