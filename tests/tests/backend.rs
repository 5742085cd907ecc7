//! LocalBackend and RemoteBackend across processes: `art serve` runs as its own process, the test
//! registers a trainable model, rolls out through the served endpoint, and reads its step back.

use std::process::Stdio;

use art_core::{
    gather_trajectory_groups, Backend, BackendError, ChatCompletionRequest, GatherOptions,
    LocalBackend, LocalBackendOptions, Message, RemoteBackend, TrainableModel, Trajectory,
    TrajectoryGroup,
};
use art_e2e::{tiny_model, TempDir};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn rollout(model: &TrainableModel, seed: u64) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new([Message::user("Count to three.")]);
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.max_tokens = Some(8);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let completion = model.endpoint().complete(request).await?;
    let choice = completion.choices.into_iter().next().expect("one choice");
    trajectory.reward = choice
        .token_ids
        .as_ref()
        .map_or(0.0, |ids| ids.len() as f64 / 8.0);
    trajectory.push_choice(choice);
    Ok(trajectory)
}

#[tokio::test(flavor = "multi_thread")]
async fn local_backend_serves_a_registered_model() {
    let dir = TempDir::new("local-backend");
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

    let groups =
        (0..3).map(|g| TrajectoryGroup::from_rollouts((0..4).map(|i| rollout(&model, g * 10 + i))));
    let groups = gather_trajectory_groups(groups, GatherOptions::new().progress_bar(false))
        .await
        .unwrap();
    assert_eq!(groups.len(), 3);
    for group in &groups {
        for trajectory in &group.trajectories {
            let choice = trajectory.choices().next().unwrap();
            let ids = choice.sampled_token_ids().unwrap();
            assert_eq!(choice.sampled_logprobs().unwrap().len(), ids.len());
        }
    }

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
async fn remote_backend_needs_its_api_key() {
    let dir = TempDir::new("remote-backend");
    let art = std::env::var_os("ART_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::current_exe()
                .unwrap()
                .parent()
                .unwrap()
                .parent()
                .unwrap()
                .join("art")
        });
    let model_dir = tiny_model(dir.path());
    let mut child = tokio::process::Command::new(&art)
        .args(["serve", "--port", "0", "--api-key", "sk-remote", "--model"])
        .arg(&model_dir)
        .arg("--art-dir")
        .arg(dir.path().join(".art"))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e} (cargo test --workspace builds it)", art.display()));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the server prints its address");
        if let Some(url) = line.split("listening on ").nth(1) {
            break url.to_string();
        }
    };

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
    let trajectory = rollout(&model, 1).await.unwrap();
    assert_eq!(trajectory.choices().count(), 1);
    assert_eq!(model.get_step().await.unwrap(), 0);
    child.kill().await.unwrap();
}
