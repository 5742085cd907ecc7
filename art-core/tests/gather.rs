//! gather_trajectory_groups: concurrency, failure tolerance, hooks, order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use art_core::{
    gather_trajectory_groups, GatherError, GatherOptions, Message, MetadataValue, Trajectory,
    TrajectoryGroup,
};
use rand::{Rng, SeedableRng};

async fn rollout(reward: f64, delay_ms: u64) -> anyhow::Result<Trajectory> {
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    let mut t = Trajectory::new([Message::user("hi")]);
    t.reward = reward;
    Ok(t)
}

/// On tokio's paused clock: the rollouts' sleeps take no real time and the wall time is exact,
/// whatever else the machine does.
#[tokio::test(start_paused = true)]
async fn hundred_groups_of_eight_run_concurrently() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let delays: Vec<Vec<u64>> = (0..100)
        .map(|_| (0..8).map(|_| rng.random_range(10..300)).collect())
        .collect();
    let longest = *delays.iter().flatten().max().unwrap();
    let sum: u64 = delays.iter().flatten().sum();
    let groups = delays.iter().enumerate().map(|(g, ds)| {
        TrajectoryGroup::from_rollouts(ds.iter().map(move |&d| rollout(g as f64, d)))
            .with_metadata("group", g)
    });
    let started = tokio::time::Instant::now();
    let result = gather_trajectory_groups(groups, GatherOptions::new().progress_bar(false))
        .await
        .unwrap();
    let wall = started.elapsed();
    assert_eq!(result.len(), 100);
    assert!(result
        .iter()
        .all(|g| g.trajectories.len() == 8 && g.exceptions.is_empty()));
    // Groups come back in the order given, whatever order they finished in.
    for (g, group) in result.iter().enumerate() {
        assert_eq!(group.metadata["group"], MetadataValue::Int(g as i64));
        assert!(group.trajectories.iter().all(|t| t.reward == g as f64));
    }
    // Concurrent: the longest rollout, nowhere near the sum (~120 s).
    assert!(
        wall >= Duration::from_millis(longest) && wall < Duration::from_millis(longest + 50),
        "wall {wall:?}, longest {longest} ms, sum {sum} ms"
    );
}

#[tokio::test]
async fn failed_rollouts_within_max_exceptions_are_dropped_and_kept_as_exceptions() {
    let groups = (0..4).map(|g| {
        TrajectoryGroup::from_rollouts((0..4).map(move |i| async move {
            match (g, i) {
                (0, 1) => Err(anyhow::anyhow!("tool server unreachable")),
                (2, 3) => panic!("index out of range in my rollout"),
                _ => rollout(1.0, 5).await,
            }
        }))
    });
    let result = gather_trajectory_groups(
        groups,
        GatherOptions::new().max_exceptions(2).progress_bar(false),
    )
    .await
    .unwrap();
    let sizes: Vec<usize> = result.iter().map(|g| g.trajectories.len()).collect();
    assert_eq!(sizes, [3, 4, 3, 4]);
    assert_eq!(result[0].exceptions[0].kind, "RolloutError");
    assert!(result[0].exceptions[0]
        .message
        .contains("tool server unreachable"));
    assert_eq!(result[2].exceptions[0].kind, "Panic");
    assert!(result[2].exceptions[0]
        .message
        .contains("index out of range in my rollout"));
}

#[tokio::test]
async fn more_failures_than_allowed_fail_the_gather() {
    let failing = |n: usize| {
        TrajectoryGroup::from_rollouts((0..10).map(move |i| async move {
            if i < n {
                Err(anyhow::anyhow!("boom {i}"))
            } else {
                rollout(0.0, 1).await
            }
        }))
    };
    let error = gather_trajectory_groups(
        [failing(3)],
        GatherOptions::new().max_exceptions(2).progress_bar(false),
    )
    .await
    .unwrap_err();
    match &error {
        GatherError::TooManyExceptions {
            count,
            allowed,
            first,
        } => {
            assert_eq!((*count, *allowed), (3, 2));
            assert!(first.starts_with("boom"));
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(error.to_string().contains("raise max_exceptions"));
    // The default tolerates none.
    assert!(
        gather_trajectory_groups([failing(1)], GatherOptions::new().progress_bar(false))
            .await
            .is_err()
    );
    // A fraction is of all rollouts: 0.3 of 10 allows 3.
    let ok = gather_trajectory_groups(
        [failing(3)],
        GatherOptions::new().max_exceptions(0.3).progress_bar(false),
    )
    .await
    .unwrap();
    assert_eq!(ok[0].trajectories.len(), 7);
    assert!(gather_trajectory_groups(
        [failing(4)],
        GatherOptions::new().max_exceptions(0.3).progress_bar(false)
    )
    .await
    .is_err());
}

#[tokio::test]
async fn after_each_runs_once_per_group_and_can_rescore_or_drop() {
    let calls = AtomicUsize::new(0);
    let groups = (0..10).map(|g| {
        TrajectoryGroup::from_rollouts((0..3).map(move |i| rollout(i as f64, 5 + 7 * i as u64)))
            .with_metadata("group", g)
    });
    let options = GatherOptions::new()
        .progress_bar(false)
        .after_each(|mut group| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                assert_eq!(group.trajectories.len(), 3, "the hook sees the whole group");
                if group.metadata["group"] == MetadataValue::Int(4) {
                    return Ok(None);
                }
                for t in &mut group.trajectories {
                    t.reward *= 10.0;
                }
                Ok(Some(group))
            }
        });
    let result = gather_trajectory_groups(groups, options).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 10);
    assert_eq!(result.len(), 9);
    assert!(result.iter().all(|g| g.rewards() == [0.0, 10.0, 20.0]));
    assert!(result
        .iter()
        .all(|g| g.metadata["group"] != MetadataValue::Int(4)));
}

#[tokio::test]
async fn an_after_each_error_names_the_group() {
    let groups = (0..2).map(|_| TrajectoryGroup::from_rollouts([rollout(1.0, 1)]));
    let options = GatherOptions::new()
        .progress_bar(false)
        .after_each(|_group| async {
            Err::<Option<TrajectoryGroup>, _>(anyhow::anyhow!("judge unreachable"))
        });
    let error = gather_trajectory_groups(groups, options)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("after_each hook failed") && error.contains("judge unreachable"),
        "{error}"
    );
}

#[tokio::test]
async fn concurrency_limit_is_respected_and_progress_is_reported() {
    let in_flight = AtomicUsize::new(0);
    let peak = AtomicUsize::new(0);
    let reports = Mutex::new(Vec::new());
    let groups = (0..6).map(|_| {
        TrajectoryGroup::from_rollouts((0..5).map(|_| async {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            let result = rollout(0.5, 10).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            result
        }))
    });
    let options = GatherOptions::new()
        .progress_bar(false)
        .concurrency(4)
        .on_progress(|p| reports.lock().unwrap().push(p.clone()));
    let result = gather_trajectory_groups(groups, options).await.unwrap();
    assert_eq!(result.len(), 6);
    assert_eq!(peak.load(Ordering::SeqCst), 4);
    let reports = reports.into_inner().unwrap();
    let last = reports.last().unwrap();
    assert_eq!(
        (last.done, last.total, last.groups_done, last.groups_total),
        (30, 30, 6, 6)
    );
    assert_eq!(last.reward_mean, Some(0.5));
    assert!(reports.windows(2).all(|w| w[0].done <= w[1].done));
}

#[tokio::test]
async fn one_group_and_empty_groups() {
    let group = TrajectoryGroup::from_rollouts((0..3).map(|i| rollout(i as f64, 1)))
        .gather(GatherOptions::new().progress_bar(false))
        .await
        .unwrap();
    assert_eq!(group.rewards(), [0.0, 1.0, 2.0]);
    let empty = TrajectoryGroup::from_rollouts(
        Vec::<std::future::Ready<anyhow::Result<Trajectory>>>::new(),
    );
    let result = gather_trajectory_groups([empty], GatherOptions::new().progress_bar(false))
        .await
        .unwrap();
    assert_eq!(result.len(), 1);
    assert!(result[0].trajectories.is_empty());
}

/// Paused time: the retries' back-off sleeps pass at once.
#[tokio::test(start_paused = true)]
async fn transient_failures_are_retried_and_others_are_not() {
    let attempts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
    let failure = |status: u16| art_core::ClientError::Api {
        url: "http://judge/v1".into(),
        status,
        message: "try later".into(),
    };
    // Rollout 0 meets two 503s then succeeds; rollout 1 keeps getting 429s (more than the
    // retries); rollout 2 is refused (400), which no retry can fix.
    let group = TrajectoryGroup::from_retried_rollouts(3, 2, |i| {
        let attempt = attempts[i].fetch_add(1, Ordering::SeqCst);
        let outcome = match (i, attempt) {
            (0, 0 | 1) => Err(failure(503)),
            (0, _) => Ok(Trajectory::new([Message::user("hi")])),
            (1, _) => Err(failure(429)),
            _ => Err(failure(400)),
        };
        async move { outcome }
    })
    .gather(GatherOptions::new().max_exceptions(2).progress_bar(false))
    .await
    .unwrap();
    assert_eq!(group.trajectories.len(), 1);
    assert_eq!(group.exceptions.len(), 2);
    let counts: Vec<usize> = attempts.iter().map(|a| a.load(Ordering::SeqCst)).collect();
    assert_eq!(counts, [3, 3, 1]);
}
