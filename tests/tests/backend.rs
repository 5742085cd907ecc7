//! LocalBackend and RemoteBackend across processes: `art serve` runs as its own process, the test
//! registers a trainable model, rolls out through the served endpoint, trains a GRPO step, and sees
//! the new step served.

use std::process::Stdio;

use art_core::{
    gather_trajectory_groups, Backend, BackendError, ChatCompletionRequest, GatherOptions,
    LocalBackend, LocalBackendOptions, Message, RemoteBackend, SftConfig, TrainConfig,
    TrainableModel, Trajectory, TrajectoryGroup,
};
use art_e2e::{spawn_server, temp_dir, tiny_model};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn rollout_groups(model: &TrainableModel, groups: u64, size: u64) -> Vec<TrajectoryGroup> {
    let pending = (0..groups).map(|g| {
        TrajectoryGroup::from_rollouts((0..size).map(move |i| rollout(model, g * 10 + i)))
    });
    gather_trajectory_groups(pending, GatherOptions::new().progress_bar(false))
        .await
        .unwrap()
}

/// Trains one step and checks that it is reported, checkpointed and served.
async fn train_one_step(model: &TrainableModel, groups: &[TrajectoryGroup]) {
    let before = model.get_step().await.unwrap();
    let mut progress = Vec::new();
    let result = model
        .train_with_progress(groups, &TrainConfig::default(), |p| {
            progress.push(p.clone())
        })
        .await
        .unwrap();
    assert_eq!(result.step, before + 1);
    assert!(result.trained, "the groups' rewards differ: {result:?}");
    assert_eq!(progress.first().map(|p| p.micro_batch), Some(0));
    assert_eq!(
        progress.last().map(|p| p.micro_batch),
        Some(result.metrics.num_micro_batches)
    );
    assert!(result.metrics.loss.is_finite() && result.metrics.grad_norm > 0.0);
    assert_eq!(model.get_step().await.unwrap(), before + 1);
    let served = format!("{}@{}", model.name, before + 1);
    assert_eq!(result.adapter_name, served);
    let checkpoints = model.checkpoints().await.unwrap();
    let last = checkpoints.data.last().expect("a checkpoint");
    assert_eq!(last.step, before + 1);
    assert_eq!(last.served_as.as_deref(), Some(served.as_str()));
    assert!(last.metrics.as_ref().unwrap().num_trainable_tokens > 0);
    // The next rollout samples from the new step, by its own name and by the model's.
    let trajectory = rollout(model, 99).await.unwrap();
    assert_eq!(trajectory.choices().count(), 1);
}

async fn rollout(model: &TrainableModel, seed: u64) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new([Message::user("Count to three.")]);
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.max_tokens = Some(8);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let completion = model.endpoint().complete(request).await?;
    let choice = completion.choices.into_iter().next().expect("one choice");
    // Any reward that differs within a group will do for the plumbing: the first token's parity.
    trajectory.reward = choice
        .token_ids
        .as_ref()
        .and_then(|ids| ids.first())
        .map_or(0.0, |id| f64::from(id % 2));
    trajectory.push_choice(choice);
    Ok(trajectory)
}

#[tokio::test(flavor = "multi_thread")]
async fn local_backend_serves_a_registered_model() {
    let dir = temp_dir("local-backend");
    let mut options = LocalBackendOptions::new(tiny_model(dir.path()).display().to_string());
    options.art_dir = dir.path().join(".art");
    let backend = LocalBackend::start(options)
        .await
        .expect("art serve starts (cargo test --workspace builds it)");
    let model = TrainableModel::register(&backend, "agent-001", "e2e")
        .await
        .unwrap();
    assert_eq!(model.get_step().await.unwrap(), 0);
    assert!(dir
        .path()
        .join(".art/e2e/models/agent-001/model.json")
        .is_file());

    let groups = rollout_groups(&model, 3, 4).await;
    assert_eq!(groups.len(), 3);
    for group in &groups {
        for trajectory in &group.trajectories {
            let choice = trajectory.choices().next().unwrap();
            let ids = choice.sampled_token_ids().unwrap();
            assert_eq!(choice.sampled_logprobs().unwrap().len(), ids.len());
        }
    }

    train_one_step(&model, &groups).await;
    train_one_step(&model, &rollout_groups(&model, 3, 4).await).await;
    let checkpoint = dir
        .path()
        .join(".art/e2e/models/agent-001/checkpoints/0002");
    assert!(checkpoint.join("adapter_model.safetensors").is_file());
    assert!(checkpoint.join("adapter_config.json").is_file());

    // A batch the trainer cannot use is refused up front and changes nothing.
    let written = |text: &str, reward: f64| {
        let mut trajectory = Trajectory::new([Message::user(text)]);
        trajectory.reward = reward;
        trajectory
    };
    let no_choices = TrajectoryGroup::new([written("a", 0.0), written("b", 1.0)]);
    let refused = model
        .train(&[no_choices], &TrainConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, BackendError::Api { status: 400, message, .. } if message.contains("empty batch")),
        "{refused}"
    );
    let bad_config = TrainConfig {
        learning_rate: -1.0,
        ..Default::default()
    };
    let refused = model.train(&groups, &bad_config).await.unwrap_err();
    assert!(
        matches!(refused, BackendError::Api { status: 400, .. }),
        "{refused}"
    );
    assert_eq!(model.get_step().await.unwrap(), 2);

    // Pruning keeps what is asked for and the latest.
    let pruned = model.delete_checkpoints_except(&[]).await.unwrap();
    assert_eq!((pruned.deleted, pruned.kept), (vec![1], vec![2]));
    assert!(!dir
        .path()
        .join(".art/e2e/models/agent-001/checkpoints/0001")
        .exists());

    // Supervised fine-tuning: three written conversations in batches of two make two updates
    // and one new step, served at once.
    let conversation = |question: &str, answer: &str| {
        Trajectory::new([Message::user(question), Message::assistant(answer)])
    };
    let data = [
        conversation("2+2?", "4"),
        conversation("3+3?", "6"),
        conversation("4+4?", "8"),
    ];
    let mut batches = Vec::new();
    let sft = model
        .train_sft_with_progress(&data, &SftConfig::default(), |b| batches.push(b.clone()))
        .await
        .unwrap();
    assert_eq!((sft.step, sft.batches.len()), (3, 2));
    assert_eq!(batches, sft.batches);
    assert_eq!(sft.adapter_name, "agent-001@3");
    assert_eq!(model.get_step().await.unwrap(), 3);
    let sft_history = model.history().await.unwrap();
    assert!(
        sft_history
            .iter()
            .any(|e| e.step == 3 && e.split == "sft" && e.metrics.contains_key("loss")),
        "{sft_history:?}"
    );
    // A conversation with nothing to learn is refused, and nothing changes.
    let refused = model
        .train_sft(&[written("no answer", 0.0)], &SftConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, BackendError::Api { status: 400, message, .. } if message.contains("nothing to learn")),
        "{refused}"
    );
    assert_eq!(model.get_step().await.unwrap(), 3);

    // Registering again reconnects; another LoRA shape under the same name is refused.
    let again = TrainableModel::register(&backend, "agent-001", "e2e")
        .await
        .unwrap();
    assert_eq!(again.name, "agent-001");
    let lora = art_core::LoraConfig {
        rank: 4,
        ..Default::default()
    };
    let conflict = TrainableModel::register_with(&backend, "agent-001", "e2e", lora)
        .await
        .unwrap_err();
    assert!(
        matches!(conflict, BackendError::Api { status: 409, .. }),
        "{conflict}"
    );
    let bad_name = TrainableModel::register(&backend, "../escape", "e2e")
        .await
        .unwrap_err();
    assert!(
        bad_name.to_string().contains("not a valid name"),
        "{bad_name}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn remote_backend_trains_and_survives_a_killed_server() {
    let dir = temp_dir("remote-backend");
    let model_dir = tiny_model(dir.path());
    let art_dir = dir.path().join(".art");
    let (mut child, url) = spawn_server(&model_dir, &art_dir, Some("sk-remote")).await;

    let wrong = RemoteBackend::new(&url, Some("sk-nope".into()));
    wrong.health().await.expect("health needs no key");
    let refused = TrainableModel::register(&wrong, "agent", "remote")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, BackendError::Api { status: 401, .. }),
        "{refused}"
    );

    let backend = RemoteBackend::new(url.trim_end_matches("/v1"), Some("sk-remote".into()));
    assert_eq!(backend.base_url(), url);
    let model = TrainableModel::register(&backend, "agent", "remote")
        .await
        .unwrap();
    assert_eq!(model.get_step().await.unwrap(), 0);
    let groups = rollout_groups(&model, 2, 4).await;
    train_one_step(&model, &groups).await;

    // Kill the server in the middle of a long step (many one-sequence micro-batches).
    let many: Vec<TrajectoryGroup> = groups.iter().cycle().take(64).cloned().collect();
    let config = TrainConfig {
        micro_batch_tokens: 8,
        ..Default::default()
    };
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let step = {
        let (model, started) = (model.clone(), started.clone());
        tokio::spawn(async move {
            model
                .train_with_progress(&many, &config, |_| started.notify_one())
                .await
        })
    };
    started.notified().await;
    child.kill().await.unwrap();
    child.wait().await.unwrap();
    let outcome = step.await.unwrap();
    // Almost always the kill lands mid-step; if the step won the race, it must have been kept.
    let expected_step = if outcome.is_ok() { 2 } else { 1 };

    // A restarted server resumes the model from its last complete checkpoint.
    let (mut child, url) = spawn_server(&model_dir, &art_dir, Some("sk-remote")).await;
    let backend = RemoteBackend::new(&url, Some("sk-remote".into()));
    let model = TrainableModel::register(&backend, "agent", "remote")
        .await
        .unwrap();
    assert_eq!(
        model.get_step().await.unwrap(),
        expected_step,
        "{outcome:?}"
    );
    let steps: Vec<u64> = model
        .checkpoints()
        .await
        .unwrap()
        .data
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(steps, (1..=expected_step).collect::<Vec<_>>());
    assert_eq!(rollout(&model, 5).await.unwrap().choices().count(), 1);
    child.kill().await.unwrap();
}

/// What a killed notebook kernel leaves behind: the server its LocalBackend started, whose stdin
/// pipe closes without the backend being dropped. The server must not outlive it.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_server_exits_when_its_stdin_closes() {
    let dir = temp_dir("exit-with-stdin");
    let model_dir = tiny_model(dir.path());
    let mut child = tokio::process::Command::new(art_e2e::art_binary())
        .args(["serve", "--port", "0", "--exit-with-stdin", "--model"])
        .arg(&model_dir)
        .arg("--art-dir")
        .arg(dir.path().join(".art"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("art serve starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next_line().await.unwrap() {
        if line.contains("listening on ") {
            break;
        }
    }
    drop(child.stdin.take());
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
        .await
        .expect("the server exits within 10 s of its stdin closing")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// Device lists that cannot work are refused when `art serve` starts, with what to do, before
/// any model is loaded: an empty name, `all` without a CUDA device, an unknown device, training
/// on the CPU and a GPU at once. ~0.1 s each.
#[test]
fn device_lists_that_cannot_work_are_refused_at_start() {
    let dir = temp_dir("device-lists");
    let model_dir = tiny_model(dir.path());
    // (This crate builds `art` without CUDA.)
    let cases: &[(&[&str], &str)] = &[
        (&["--devices", "cpu,,cpu"], "an empty device name"),
        (&["--devices", "tpu"], "unknown device `tpu`"),
        (&["--devices", "all"], "no CUDA device"),
        (&["--train-devices", "cpu,cuda:0"], "no CUDA support"),
    ];
    for &(args, expected) in cases {
        let out = std::process::Command::new(art_e2e::art_binary())
            .args(["serve", "--port", "0", "--model"])
            .arg(&model_dir)
            .arg("--art-dir")
            .arg(dir.path().join(".art"))
            .args(args)
            .output()
            .expect("art serve runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
