//! The metrics of one logged batch of groups, named as OpenPipe ART names them where it has a name.

use std::collections::BTreeMap;

use crate::types::{mean_std, TrajectoryGroup};

/// Mean reward over all trajectories (ART: `reward`).
pub const REWARD: &str = "reward";
/// Standard deviation of the reward over all trajectories.
pub const REWARD_STD: &str = "reward_std";
/// Lowest and highest reward over all trajectories: the bounds a chart keeps the ±std band in.
pub const REWARD_MIN: &str = "reward_min";
pub const REWARD_MAX: &str = "reward_max";
/// Mean over groups of the within-group reward standard deviation (ART: `reward_std_dev`). Near 0
/// means the groups' rollouts all scored alike: GRPO has little to learn from.
pub const REWARD_STD_DEV: &str = "reward_std_dev";
/// Failed rollouts / all rollouts (ART: `exception_rate`).
pub const EXCEPTION_RATE: &str = "exception_rate";
pub const NUM_TRAJECTORIES: &str = "num_trajectories";
pub const NUM_GROUPS: &str = "num_groups";
/// Mean number of sampled tokens per trajectory, when choices carry token ids.
pub const COMPLETION_TOKENS: &str = "completion_tokens";

/// Built-in metrics win over trajectory metrics of the same name.
const BUILT_IN: [&str; 9] = [
    REWARD,
    REWARD_STD,
    REWARD_MIN,
    REWARD_MAX,
    REWARD_STD_DEV,
    EXCEPTION_RATE,
    NUM_TRAJECTORIES,
    NUM_GROUPS,
    COMPLETION_TOKENS,
];

/// The metrics `ModelStore::log` records for a batch of groups: the built-ins above, plus the mean
/// of every trajectory metric (booleans count as 0/1; a metric missing from some trajectories is
/// averaged over those that have it).
pub fn batch_metrics(groups: &[TrajectoryGroup]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let rewards: Vec<f64> = groups.iter().flat_map(TrajectoryGroup::rewards).collect();
    let exceptions: usize = groups.iter().map(|g| g.exceptions.len()).sum();
    let rollouts = rewards.len() + exceptions;

    out.insert(NUM_GROUPS.into(), groups.len() as f64);
    out.insert(NUM_TRAJECTORIES.into(), rewards.len() as f64);
    if rollouts > 0 {
        out.insert(EXCEPTION_RATE.into(), exceptions as f64 / rollouts as f64);
    }
    if let Some((mean, std)) = mean_std(&rewards) {
        out.insert(REWARD.into(), mean);
        out.insert(REWARD_STD.into(), std);
        let min = rewards.iter().copied().fold(f64::INFINITY, f64::min);
        let max = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        out.insert(REWARD_MIN.into(), min);
        out.insert(REWARD_MAX.into(), max);
    }
    let group_stds: Vec<f64> = groups
        .iter()
        .filter_map(TrajectoryGroup::reward_std)
        .collect();
    if let Some((mean, _)) = mean_std(&group_stds) {
        out.insert(REWARD_STD_DEV.into(), mean);
    }

    let tokens: Vec<f64> = groups
        .iter()
        .flat_map(|g| &g.trajectories)
        .filter_map(|t| {
            // Counted only for trajectories whose every choice knows its tokens: a partial count
            // would understate.
            let counts: Option<Vec<usize>> = t
                .choices()
                .map(|c| c.sampled_token_ids().map(|ids| ids.len()))
                .collect();
            counts
                .filter(|c| !c.is_empty())
                .map(|c| c.iter().sum::<usize>() as f64)
        })
        .collect();
    if let Some((mean, _)) = mean_std(&tokens) {
        out.insert(COMPLETION_TOKENS.into(), mean);
    }

    let mut custom: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for trajectory in groups.iter().flat_map(|g| &g.trajectories) {
        for (name, value) in &trajectory.metrics {
            custom.entry(name).or_default().push(value.as_f64());
        }
    }
    for (name, values) in custom {
        if BUILT_IN.contains(&name) {
            continue;
        }
        if let Some((mean, _)) = mean_std(&values) {
            out.insert(name.to_string(), mean);
        }
    }
    out
}
