//! `model.log`, `history`, `trajectories` and `delete_checkpoints(best_metric)` across processes:
//! `art serve` runs as its own process (LocalBackend), the client logs rollouts and trains through
//! HTTP, and the model's directory (history.jsonl, trajectories parquet, checkpoints) lives with
//! the server. The history read back builds a frame and a PNG chart on the client side.

use art_core::plots::{reward_chart, training_chart};
use art_core::store::metrics;
use art_core::{
    gather_trajectory_groups, history_frame, BackendError, ChatCompletionRequest, GatherOptions,
    LocalBackend, LocalBackendOptions, Message, MetricGoal, ModelStore, Split, TrainConfig,
    TrainableModel, Trajectory, TrajectoryGroup,
};
use art_e2e::{temp_dir, tiny_model};

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
    trajectory.set_metric("even", seed.is_multiple_of(2));
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

/// The groups with every reward set to `reward` (a val score of our choosing).
fn scored(groups: &[TrajectoryGroup], reward: f64) -> Vec<TrajectoryGroup> {
    let mut groups = groups.to_vec();
    for t in groups.iter_mut().flat_map(|g| &mut g.trajectories) {
        t.reward = reward;
    }
    groups
}

fn close(value: Option<f64>, expected: f64) {
    let value = value.expect("metric present");
    assert!((value - expected).abs() < 1e-9, "{value} != {expected}");
}

/// Pixels of a PNG that are not white, and whether some are close to `colour`.
fn png_pixels(bytes: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    let pixels = buf[..info.buffer_size()]
        .chunks(3)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    (info.width as usize, info.height as usize, pixels)
}

fn near(pixels: &[[u8; 3]], colour: [u8; 3]) -> usize {
    pixels
        .iter()
        .filter(|p| (0..3).all(|i| (i32::from(p[i]) - i32::from(colour[i])).abs() <= 30))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn model_log_history_plots_and_best_checkpoints_through_the_backend() {
    let dir = temp_dir("model-log");
    let mut options = LocalBackendOptions::new(tiny_model(dir.path()).display().to_string());
    options.art_dir = dir.path().join(".art");
    let backend = LocalBackend::start(options)
        .await
        .expect("art serve starts (cargo test --workspace builds it)");
    let model = TrainableModel::register(&backend, "agent", "e2e")
        .await
        .unwrap();
    let model_dir = backend.art_dir().join("e2e/models/agent");

    // Step 0: rollouts logged as train.
    let train_groups = gather(&model, 0).await;
    let logged = model.log(&train_groups, Split::Train).await.unwrap();
    assert_eq!(
        (logged.entry.step, logged.entry.split.as_str()),
        (0, "train")
    );
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
    close(m.get("seed"), (1 + 2 + 10 + 11 + 12) as f64 / 6.0);
    let tokens: Vec<usize> = train_groups
        .iter()
        .flat_map(|g| &g.trajectories)
        .map(|t| {
            t.choices()
                .next()
                .unwrap()
                .sampled_token_ids()
                .unwrap()
                .len()
        })
        .collect();
    assert!(tokens.iter().all(|&n| (1..=6).contains(&n)), "{tokens:?}");
    close(
        m.get(metrics::COMPLETION_TOKENS),
        tokens.iter().sum::<usize>() as f64 / 6.0,
    );

    // Three GRPO steps; after each, a val batch scored 0.9, 0.1, 0.5 is logged at the new step.
    let val_groups = gather(&model, 5).await;
    for (step, val_reward) in [(1u64, 0.9), (2, 0.1), (3, 0.5)] {
        let result = model
            .train(&train_groups, &TrainConfig::default())
            .await
            .unwrap();
        assert_eq!(result.step, step);
        let logged = model
            .log(&scored(&val_groups, val_reward), "val")
            .await
            .unwrap();
        assert_eq!(
            (logged.entry.step, logged.entry.split.as_str()),
            (step, "val")
        );
        close(logged.get(metrics::REWARD), val_reward);
    }

    // The history as the server wrote it: rollouts and training steps, in order.
    let history = model.history().await.unwrap();
    let keys: Vec<(u64, &str)> = history.iter().map(|e| (e.step, e.split.as_str())).collect();
    assert_eq!(
        keys,
        [
            (0, "train"),
            (1, "train"),
            (1, "val"),
            (2, "train"),
            (2, "val"),
            (3, "train"),
            (3, "val")
        ]
    );
    assert_eq!(history[0], logged.entry);
    for step_entry in [&history[1], &history[3], &history[5]] {
        assert!(step_entry.get("loss").is_some_and(f64::is_finite));
        assert!(step_entry.get("grad_norm").is_some_and(|g| g > 0.0));
        assert!(step_entry
            .get("num_trainable_tokens")
            .is_some_and(|n| n > 0.0));
        // The batch's reward was logged with its rollouts, not again by the step.
        assert_eq!(step_entry.get(metrics::REWARD), None);
    }
    // The same lines parse from the file on disk.
    let store = ModelStore::open(backend.art_dir(), "e2e", "agent").unwrap();
    assert_eq!(store.history().unwrap(), history);

    // Trajectories read back exactly, over HTTP and from the parquet.
    assert_eq!(
        model.trajectories(Split::Train, 0).await.unwrap(),
        train_groups
    );
    assert_eq!(
        store.read_trajectory_groups("val", 2).unwrap(),
        scored(&val_groups, 0.1)
    );
    let missing = model.trajectories("val", 0).await.unwrap_err();
    assert!(
        matches!(missing, BackendError::Api { status: 404, .. }),
        "{missing}"
    );
    let bad_split = model.log(&val_groups, "../x").await.unwrap_err();
    assert!(
        matches!(bad_split, BackendError::Api { status: 400, .. }),
        "{bad_split}"
    );

    // A frame and charts on the client side, from the history alone.
    let frame = history_frame(&history).unwrap();
    assert_eq!(frame.height(), 7);
    let reward = frame.column("reward").unwrap().f64().unwrap();
    assert_eq!(reward.get(0), Some(0.25));
    assert_eq!(reward.get(2), Some(0.9));
    assert!(frame
        .column("loss")
        .unwrap()
        .f64()
        .unwrap()
        .get(1)
        .is_some());
    let chart = reward_chart(&history);
    assert_eq!(chart.series().len(), 2, "train and val");
    let (width, height, pixels) = png_pixels(&chart.to_png().unwrap());
    assert_eq!((width, height), (720, 400));
    let non_white = pixels.iter().filter(|p| **p != [255, 255, 255]).count();
    assert!(
        non_white * 100 > pixels.len(),
        "{non_white} of {}",
        pixels.len()
    );
    assert!(near(&pixels, [31, 119, 180]) > 50, "no train line (blue)");
    assert!(near(&pixels, [255, 127, 14]) > 50, "no val line (orange)");
    let (_, _, pixels) = png_pixels(&training_chart(&history).to_png().unwrap());
    assert!(near(&pixels, [31, 119, 180]) > 50, "no loss line");

    // Keep the latest (3) and the best by val reward (1); a misspelt metric deletes nothing.
    let typo = model.delete_checkpoints("val/rewrad").await.unwrap_err();
    assert!(
        matches!(&typo, BackendError::Api { status: 400, message, .. } if message.contains("val/reward")),
        "{typo}"
    );
    let steps =
        |list: art_core::CheckpointList| list.data.iter().map(|c| c.step).collect::<Vec<_>>();
    assert_eq!(steps(model.checkpoints().await.unwrap()), [1, 2, 3]);
    let pruned = model.delete_checkpoints("val/reward").await.unwrap();
    assert_eq!(pruned.deleted, [2]);
    assert_eq!(pruned.kept, [1, 3]);
    assert_eq!(pruned.best_step, Some(1));
    assert_eq!(steps(model.checkpoints().await.unwrap()), [1, 3]);
    // By training loss, lower is better: one of 1 and 3 goes, the latest stays.
    let by_loss = model
        .delete_checkpoints_by("train/loss", MetricGoal::Minimize, &[])
        .await
        .unwrap();
    assert!(by_loss.kept.contains(&3) && by_loss.kept.len() + by_loss.deleted.len() == 2);
    assert_eq!(model.get_step().await.unwrap(), 3);
}
