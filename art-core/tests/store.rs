//! ModelStore: layout, logged metrics, parquet round trip, history, atomic writes under injected
//! failures, checkpoint pruning.

#![cfg(feature = "frames")]

mod common;

use std::fs;

use art_core::frames::{groups_frame, history_frame};
use art_core::store::metrics;
use art_core::{MetricGoal, ModelStore, StoreError, TrajectoryGroup};
use common::{groups, scratch, trajectory};

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-12)
}

#[test]
fn open_lays_out_the_model_dir_and_model_json() {
    let art = scratch("store-open");
    let store = ModelStore::open(&art, "tutorial", "agent-001").unwrap();
    assert_eq!(store.dir(), art.join("tutorial/models/agent-001"));
    let info = store.model_info().unwrap();
    assert_eq!(info["name"], "agent-001");
    assert_eq!(info["project"], "tutorial");
    // Reopening keeps what the trainer added.
    store
        .set_model_info(
            serde_json::json!({"base_model": "SmolLM2-135M-Instruct", "trainable": true}),
        )
        .unwrap();
    let again = ModelStore::open(&art, "tutorial", "agent-001").unwrap();
    assert_eq!(
        again.model_info().unwrap()["base_model"],
        "SmolLM2-135M-Instruct"
    );
    assert!(again.history().unwrap().is_empty());
    assert_eq!(again.latest_step().unwrap(), None);
    assert_eq!(again.get_step().unwrap(), 0);
}

#[test]
fn names_that_are_not_one_path_component_are_refused() {
    let art = scratch("store-names");
    for (project, name) in [("", "m"), ("p", "../m"), ("p", "a/b"), (".hidden", "m")] {
        let err = ModelStore::open(&art, project, name).unwrap_err();
        assert!(matches!(err, StoreError::InvalidName { .. }), "{err}");
    }
    let store = ModelStore::open(&art, "p", "m").unwrap();
    assert!(matches!(
        store.log(&groups(), "../train", 0),
        Err(StoreError::InvalidName { .. })
    ));
}

#[test]
fn log_computes_the_metrics() {
    let art = scratch("store-metrics");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    let logged = store.log(&groups(), "train", 0).unwrap();
    assert_eq!(logged.entry.split, "train");
    assert_eq!(logged.entry.step, 0);
    assert!(close(logged.get(metrics::REWARD), 0.5));
    assert!(close(logged.get(metrics::REWARD_STD), 0.125f64.sqrt()));
    assert!(close(logged.get(metrics::REWARD_STD_DEV), 0.25));
    assert!(close(logged.get(metrics::EXCEPTION_RATE), 0.2));
    assert!(close(logged.get(metrics::NUM_TRAJECTORIES), 4.0));
    assert!(close(logged.get(metrics::NUM_GROUPS), 2.0));
    assert!(close(logged.get(metrics::COMPLETION_TOKENS), 3.5));
    assert!(close(logged.get("correct"), 0.75));
    assert!(close(logged.get("turns"), 1.0));
    // Averaged over the trajectories that have it.
    assert!(close(logged.get("difficulty"), 0.75));
    // The band a reward chart draws is clamped to these.
    assert!(close(logged.get(metrics::REWARD_MIN), 0.0));
    assert!(close(logged.get(metrics::REWARD_MAX), 1.0));
    assert_eq!(logged.entry.metrics.len(), 12, "{:?}", logged.entry.metrics);
    assert_eq!(
        logged.trajectories_path,
        store.dir().join("trajectories/train/0000.parquet")
    );
}

#[test]
fn log_round_trips_through_parquet_and_history() {
    let art = scratch("store-round-trip");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    let batch = groups();
    store.log(&batch, "train", 0).unwrap();
    store.log(&batch[..1], "val", 0).unwrap();
    store.log(&batch[1..], "train", 1).unwrap();

    // The parquet holds the reward table exactly as built in memory...
    let table = store.read_trajectories("train", 0).unwrap();
    let expected = groups_frame(&batch).unwrap();
    let names: Vec<String> = expected
        .get_column_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    let read = table.select(names.iter().map(String::as_str)).unwrap();
    assert!(read.equals_missing(&expected), "{read}\n!=\n{expected}");
    assert_eq!(read.height(), 4);
    // ...and the groups themselves, messages, choices, tools and logs included.
    let back = store.read_trajectory_groups("train", 0).unwrap();
    assert_eq!(back, batch);
    assert_eq!(
        store.read_trajectory_groups("train", 1).unwrap(),
        batch[1..].to_vec()
    );
    assert_eq!(store.trajectory_steps("train").unwrap(), vec![0, 1]);
    assert_eq!(store.trajectory_steps("val").unwrap(), vec![0]);

    // history.jsonl: one JSON object per line, ART's namespaced keys plus ours.
    let text = fs::read_to_string(store.history_path()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1]["step"], 0);
    assert_eq!(lines[1]["split"], "val");
    assert_eq!(lines[1]["val/reward"], 0.5);
    assert_eq!(lines[1]["val/exception_rate"], 0.0);
    assert!(lines[2]["recorded_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(lines[2]["train/reward"], 0.5);

    let history = store.history().unwrap();
    assert_eq!(history.len(), 3);
    assert_eq!((history[2].step, history[2].split.as_str()), (1, "train"));
    assert!(close(history[2].get("reward_std_dev"), 0.0));
    let frame = history_frame(&history).unwrap();
    assert_eq!(frame.height(), 3);
    let reward = frame.column("reward").unwrap().f64().unwrap();
    assert_eq!(reward.get(0), Some(0.5));
    // Rows sorted by step then split: (0, train), (0, val), (1, train).
    let split = frame.column("split").unwrap().str().unwrap();
    assert_eq!(split.get(1), Some("val"));
}

#[test]
fn frames_type_their_columns_from_the_values() {
    let frame = groups_frame(&groups()).unwrap();
    let dtype = |name: &str| frame.column(name).unwrap().dtype().to_string();
    assert_eq!(dtype("group_index"), "i64");
    assert_eq!(dtype("reward"), "f64");
    assert_eq!(dtype("metric/correct"), "bool");
    assert_eq!(dtype("metric/turns"), "i64");
    assert_eq!(dtype("metric/difficulty"), "f64");
    // Text mixed with a number becomes text.
    assert_eq!(dtype("metadata/question"), "str");
    assert_eq!(dtype("group_metadata/scenario"), "str");
    let difficulty = frame.column("metric/difficulty").unwrap().f64().unwrap();
    assert_eq!(difficulty.get(0), None);
    assert_eq!(difficulty.get(3), Some(1.0));
    let question = frame.column("metadata/question").unwrap().str().unwrap();
    assert_eq!(question.get(3), Some("7"));
    let tokens = frame.column("completion_tokens").unwrap().i64().unwrap();
    assert_eq!(tokens.get(3), Some(5));
    let messages = frame.column("num_messages").unwrap().i64().unwrap();
    assert_eq!(messages.get(3), Some(5));
    let last = frame.column("last_assistant").unwrap().str().unwrap();
    assert_eq!(last.get(1), Some("5"));
    assert_eq!(last.get(3), Some("Paris"));

    let summary = art_core::frames::group_summary(&groups()).unwrap();
    assert_eq!(summary.height(), 2);
    let std = summary.column("reward_std").unwrap().f64().unwrap();
    assert_eq!(std.get(0), Some(0.5));
    let exceptions = summary.column("exceptions").unwrap().i64().unwrap();
    assert_eq!(exceptions.get(1), Some(1));

    // An empty batch still has the fixed columns, typed.
    let empty = groups_frame(&[]).unwrap();
    assert_eq!(empty.height(), 0);
    assert_eq!(empty.column("reward").unwrap().dtype().to_string(), "f64");
}

#[test]
fn a_failure_between_temp_and_rename_leaves_the_previous_state_readable() {
    let art = scratch("store-crash");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    let batch = groups();
    store.log(&batch, "train", 0).unwrap();
    let history_before = fs::read(store.history_path()).unwrap();
    let parquet_before = fs::read(store.trajectories_path("train", 0)).unwrap();

    // The history append fails: the new parquet may land, the history stays as it was.
    store.inject_failure_before_rename("history.jsonl");
    let err = store.log(&batch[1..], "train", 1).unwrap_err();
    assert!(err.to_string().contains("history.jsonl"), "{err}");
    assert_eq!(fs::read(store.history_path()).unwrap(), history_before);
    assert_eq!(store.history().unwrap().len(), 1);

    // Re-logging step 0 fails at the parquet: the old file is intact, nothing new in history.
    store.inject_failure_before_rename("0000.parquet");
    let mut other = batch.clone();
    other[0].trajectories[0].reward = 0.25;
    assert!(store.log(&other, "train", 0).is_err());
    assert_eq!(
        fs::read(store.trajectories_path("train", 0)).unwrap(),
        parquet_before
    );
    assert_eq!(store.read_trajectory_groups("train", 0).unwrap(), batch);
    assert_eq!(fs::read(store.history_path()).unwrap(), history_before);

    // The temp files of the failed writes are there, as after a crash, and are ignored (the
    // model dir also holds `.history.lock`, which stays)...
    let temps = |dir: &std::path::Path| {
        fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".tmp-")
            })
            .count()
    };
    let split_dir = store.dir().join("trajectories/train");
    assert_eq!(temps(store.dir()), 1);
    assert_eq!(temps(&split_dir), 1);
    assert_eq!(store.trajectory_steps("train").unwrap(), vec![0, 1]);
    // ...and reopening cleans the model dir; the next write works.
    let reopened = ModelStore::open(&art, "p", "m").unwrap();
    assert_eq!(temps(reopened.dir()), 0);
    assert_eq!(temps(&split_dir), 0);
    reopened.log(&other, "train", 0).unwrap();
    assert_eq!(reopened.history().unwrap().len(), 2);
    assert_eq!(reopened.read_trajectory_groups("train", 0).unwrap(), other);
}

fn make_checkpoints(store: &ModelStore, steps: &[u64]) {
    for &step in steps {
        let dir = store.checkpoint_dir(step);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("adapter_model.safetensors"), b"weights").unwrap();
    }
}

#[test]
fn checkpoints_are_listed_and_pruned_to_latest_and_best() {
    let art = scratch("store-checkpoints");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    make_checkpoints(&store, &[0, 1, 2, 3, 4, 5]);
    fs::create_dir_all(store.dir().join("checkpoints/not-a-step")).unwrap();
    assert_eq!(store.checkpoints().unwrap(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(store.latest_step().unwrap(), Some(5));
    assert_eq!(
        store.checkpoint_dir(3),
        store.dir().join("checkpoints/0003")
    );

    for (step, reward) in [(0, 0.1), (1, 0.9), (2, 0.3), (3, 0.9), (4, 0.2)] {
        store
            .append_history(step, "val", [("reward", reward)])
            .unwrap();
        // Train rewards point elsewhere; val wins when both exist.
        store
            .append_history(step, "train", [("reward", 1.0 - reward), ("loss", reward)])
            .unwrap();
    }
    // A misspelt metric deletes nothing.
    let err = store
        .delete_checkpoints("rewrad", MetricGoal::Maximize)
        .unwrap_err();
    assert!(matches!(err, StoreError::MetricNotFound { .. }), "{err}");
    assert!(err.to_string().contains("val/reward"), "{err}");
    assert_eq!(store.checkpoints().unwrap().len(), 6);

    // Best val reward: steps 1 and 3 tie at 0.9, the later is kept; 5 is the latest.
    let deleted = store
        .delete_checkpoints("reward", MetricGoal::Maximize)
        .unwrap();
    assert_eq!(deleted, vec![0, 1, 2, 4]);
    assert_eq!(store.checkpoints().unwrap(), vec![3, 5]);
    assert!(store.dir().join("checkpoints/not-a-step").exists());

    // Lowest train loss among what is left: 3 (0.9) vs 5 (not logged): keep 3 and 5.
    assert!(store
        .delete_checkpoints("train/loss", MetricGoal::Minimize)
        .unwrap()
        .is_empty());
}

#[test]
fn best_checkpoint_falls_back_to_train_and_can_minimize() {
    let art = scratch("store-checkpoints-train");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    make_checkpoints(&store, &[1, 2, 3, 4]);
    for (step, loss) in [(1, 0.5), (2, 0.2), (3, 0.4), (4, 0.6)] {
        store
            .append_history(step, "train", [("loss", loss)])
            .unwrap();
    }
    // Two entries at step 3 are averaged: (0.4 + 0.0) / 2 = 0.2 ties step 2; the later wins.
    store.append_history(3, "train", [("loss", 0.0)]).unwrap();
    let deleted = store
        .delete_checkpoints("loss", MetricGoal::Minimize)
        .unwrap();
    assert_eq!(deleted, vec![1, 2]);
    assert_eq!(store.checkpoints().unwrap(), vec![3, 4]);
}

#[test]
fn history_written_by_art_is_read() {
    let art = scratch("store-art-history");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    fs::write(
        store.history_path(),
        concat!(
            r#"{"step": 0, "val/reward": 0.25, "val/exception_rate": 0.0, "recorded_at": "2025-06-14T18:08:45.123456"}"#,
            "\n",
            r#"{"step": 1, "train/loss": 1.5, "train/grad_norm": 3.0, "recorded_at": "2025-06-14T18:09:00"}"#,
        ),
    )
    .unwrap();
    // Appending to a file without a final newline keeps lines apart.
    store
        .log(
            &[TrajectoryGroup::new([trajectory("q", "a", 1.0, true)])],
            "val",
            1,
        )
        .unwrap();
    let history = store.history().unwrap();
    assert_eq!(history.len(), 3);
    assert_eq!(history[0].split, "val");
    assert_eq!(history[0].get("reward"), Some(0.25));
    assert_eq!(history[1].get("grad_norm"), Some(3.0));
    assert_eq!(history[2].get("reward"), Some(1.0));

    fs::write(store.history_path(), "{\"step\": 0}\nnot json\n").unwrap();
    let err = store.history().unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
}
