//! A server killed (SIGKILL) at a random point of a training step, 20 times over, and restarted
//! each time: every restart resumes at the last complete checkpoint, no checkpoint or history file
//! is torn, no half-written checkpoint is left behind, and every batch the server acknowledged
//! logging is still in the history with its trajectories.
//! Cost: ~40 s (20 starts of `art serve` on a tiny random model, a step each).

use std::path::Path;
use std::time::{Duration, Instant};

use art_core::train::list_checkpoints;
use art_core::{
    ChatCompletionRequest, Message, RemoteBackend, Split, TrainConfig, TrainableModel, Trajectory,
    TrajectoryGroup,
};
use art_e2e::{spawn_server, temp_dir, tiny_model};

const RESTARTS: usize = 20;

#[tokio::test(flavor = "multi_thread")]
async fn twenty_kills_mid_step_lose_nothing_acknowledged() {
    let dir = temp_dir("kill-restart");
    let model_dir = tiny_model(dir.path());
    let art_dir = dir.path().join(".art");
    let checkpoints = model_dir_of(&art_dir).join("checkpoints");

    // Kill points: after the step's first progress line, a delay from a fixed pseudo-random
    // sequence over [0, 1.5 x a full step], so that kills land in the forward/backward passes,
    // in the checkpoint write, and after the step.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next_fraction = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 1000) as f64 / 1000.0
    };
    let mut full_step: Option<Duration> = None;
    let mut acknowledged: Vec<(u64, usize)> = Vec::new(); // (step, groups) of every logged batch
    let mut expected_step = 0;
    let mut completed_steps = 0;
    let mut torn_checkpoints = 0;
    for restart in 0..RESTARTS {
        torn_checkpoints += temp_entries(&checkpoints);
        let (mut child, url) = spawn_server(&model_dir, &art_dir, None).await;
        let backend = RemoteBackend::new(&url, None);
        let model = TrainableModel::register(&backend, "agent", "kill")
            .await
            .unwrap();
        let on_disk = list_checkpoints(&model_dir_of(&art_dir));
        let step = model.get_step().await.unwrap();
        // The last complete checkpoint is where the model resumes; the killed step either
        // finished (and was kept) or left nothing.
        assert_eq!(
            step,
            on_disk.last().copied().unwrap_or(0),
            "restart {restart}"
        );
        assert!(
            step == expected_step || step == expected_step + 1,
            "restart {restart}: step {step}, expected {expected_step} or one more"
        );
        completed_steps += (step - expected_step) as usize;
        expected_step = step;
        assert_eq!(on_disk, (1..=step).collect::<Vec<_>>(), "restart {restart}");
        no_leftovers(&checkpoints);
        for step in &on_disk {
            checkpoint_is_whole(&checkpoints.join(format!("{step:04}")));
        }
        // Nothing acknowledged is lost: every logged batch is in the history and readable.
        let history = model.history().await.unwrap();
        for &(step, groups) in &acknowledged {
            assert!(
                history.iter().any(|e| e.step == step && e.split == "val"),
                "restart {restart}: the batch logged at step {step} is gone"
            );
            let read = model.trajectories(Split::Val, step).await.unwrap();
            assert_eq!(read.len(), groups, "restart {restart}, step {step}");
        }

        let groups = rollout_groups(&model, restart as u64).await;
        let logged = model.log(&groups, Split::Val).await.unwrap();
        acknowledged.retain(|&(s, _)| s != logged.entry.step);
        acknowledged.push((logged.entry.step, groups.len()));

        // A long step: many one-sequence micro-batches.
        let many: Vec<TrajectoryGroup> = groups.iter().cycle().take(24).cloned().collect();
        let config = TrainConfig {
            micro_batch_tokens: 8,
            ..Default::default()
        };
        let started = std::sync::Arc::new(tokio::sync::Notify::new());
        let began = Instant::now();
        let training = {
            let (model, started) = (model.clone(), started.clone());
            tokio::spawn(async move {
                model
                    .train_with_progress(&many, &config, |_| started.notify_one())
                    .await
            })
        };
        match full_step {
            // The first step runs to its end, to time a step.
            None => {
                training.await.unwrap().unwrap();
                full_step = Some(began.elapsed());
            }
            Some(full) => {
                started.notified().await;
                tokio::time::sleep(full.mul_f64(1.5 * next_fraction())).await;
            }
        }
        child.kill().await.unwrap();
        child.wait().await.unwrap();
    }
    eprintln!(
        "{RESTARTS} kills: {completed_steps} steps completed before their kill, \
         {torn_checkpoints} checkpoint writes cut (temp left, removed on restart), model at step \
         {expected_step}, {} batches logged and all found (a full step took {:?})",
        acknowledged.len(),
        full_step.unwrap()
    );
}

/// Half-written checkpoints (temp directories) in `dir`.
fn temp_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy()
                    .starts_with(art_core::fsutil::TEMP_PREFIX)
            })
            .count()
    })
}

/// A restarted trainer removes what a killed checkpoint write left.
fn no_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(name.parse::<u64>().is_ok(), "left in checkpoints/: {name}");
    }
}

/// Every file of a checkpoint is complete: the state JSON parses, and each safetensors file is
/// exactly as long as its header says.
fn checkpoint_is_whole(dir: &Path) {
    for name in ["trainer_state.json", "adapter_config.json"] {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        serde_json::from_str::<serde_json::Value>(&text)
            .unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()));
    }
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value =
                serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
            let end = header
                .as_object()
                .unwrap()
                .values()
                .filter_map(|t| t["data_offsets"][1].as_u64())
                .max()
                .unwrap_or(0) as usize;
            assert_eq!(bytes.len(), 8 + header_len + end, "{}", path.display());
        }
    }
}

async fn rollout_groups(model: &TrainableModel, round: u64) -> Vec<TrajectoryGroup> {
    let mut groups = Vec::new();
    for g in 0..2 {
        let mut trajectories = Vec::new();
        for i in 0..4 {
            let mut trajectory = Trajectory::new([Message::user("Count to three.")]);
            let mut request = ChatCompletionRequest::new("", trajectory.messages());
            request.max_tokens = Some(8);
            request.seed = Some(round * 100 + g * 10 + i);
            request.logprobs = Some(true);
            let completion = model.endpoint().complete(request).await.unwrap();
            let choice = completion.choices.into_iter().next().unwrap();
            trajectory.reward = f64::from(i as u8 % 2);
            trajectory.push_choice(choice);
            trajectories.push(trajectory);
        }
        groups.push(TrajectoryGroup::new(trajectories));
    }
    groups
}

/// The model's directory: `<art_dir>/<project>/models/<name>`.
fn model_dir_of(art_dir: &Path) -> std::path::PathBuf {
    art_dir.join("kill/models/agent")
}
