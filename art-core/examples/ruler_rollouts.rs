//! RULER next to a hand-written reward: SmolLM2-135M-Instruct answers a few sums several times,
//! the program scores each answer, and RULER ranks each group with a judge. The judge is any
//! OpenAI-compatible endpoint: by default our own backend's base model (offline), or set
//! ART_JUDGE_URL, ART_JUDGE_MODEL and ART_JUDGE_API_KEY for a stronger one.
//!
//! cargo build -p art-core --features server --bin art --example ruler_rollouts &&
//!   target/debug/examples/ruler_rollouts

use art_core::{
    gather_trajectory_groups, ruler_score_group, ChatEndpoint, GatherOptions, LocalBackend,
    LocalBackendOptions, Message, RulerOptions, TrainableModel, TrajectoryGroup,
};

#[path = "common/arithmetic.rs"]
mod arithmetic;
use arithmetic::{rollout, scenarios};

const RUBRIC: &str = "The user asked for the sum of two numbers as a bare number.
- A reply that is exactly the right number is best.
- The right number inside more text is worse; a wrong number is worse still.
- A reply with no number at all is worst.";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut options = LocalBackendOptions::default_model()?;
    options.art_dir = ".art".into();
    let backend = LocalBackend::start(options).await?;
    let model = TrainableModel::register(&backend, "ruler-demo", "examples").await?;

    let judge = match std::env::var("ART_JUDGE_URL") {
        Ok(url) => {
            let judge = ChatEndpoint::new(url, std::env::var("ART_JUDGE_MODEL")?);
            match std::env::var("ART_JUDGE_API_KEY") {
                Ok(key) => judge.with_api_key(key),
                Err(_) => judge,
            }
        }
        Err(_) => model.endpoint().with_model(&model.base_model),
    };
    println!("judge: {} at {}", judge.model(), judge.base_url());
    let mut ruler = RulerOptions::new(judge).rubric(RUBRIC);
    // A small judge rambles at temperature 1; a little randomness is enough.
    ruler.temperature = Some(0.3);

    let model = &model;
    let groups = scenarios(7, 3, 20).into_iter().map(|sum| {
        TrajectoryGroup::from_rollouts((0..6).map(move |i| rollout(model, sum, 1.0, i)))
    });
    let groups =
        gather_trajectory_groups(groups, GatherOptions::new().description("rollouts")).await?;

    let (mut hand, mut judged) = (Vec::new(), Vec::new());
    for group in groups {
        let question = group.trajectories[0]
            .messages()
            .iter()
            .rev()
            .find(|m| matches!(m, Message::User(_)))
            .map(Message::text);
        let group = ruler_score_group(group, &ruler)
            .await?
            .expect("errors are not swallowed");
        println!("\n{}", question.unwrap_or_default());
        println!(
            "{:>5}  {:>5}  {:<24}  judge's explanation",
            "hand", "RULER", "reply"
        );
        for trajectory in &group.trajectories {
            let independent = trajectory.metrics["independent_reward"].as_f64();
            let reply = trajectory.last_assistant_text().unwrap_or_default();
            let explanation = trajectory
                .logs
                .iter()
                .find_map(|l| l.strip_prefix("RULER explanation: "))
                .unwrap_or_default();
            println!(
                "{independent:>5.2}  {:>5.2}  {:<24}  {explanation}",
                trajectory.reward,
                format!("{reply:?}")
            );
            hand.push(independent);
            judged.push(trajectory.reward);
        }
        println!(
            "judge: {:.1} s, {} completion tokens",
            group.metrics["ruler_judge_seconds"].as_f64(),
            group.metrics["ruler_completion_tokens"].as_f64()
        );
    }
    println!(
        "\ncorrelation between the hand reward and RULER over {} replies: {:.2}",
        hand.len(),
        pearson(&hand, &judged)
    );
    Ok(())
}

/// Pearson's correlation (0 when either side is constant).
fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let cov: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let (vx, vy): (f64, f64) = (
        x.iter().map(|a| (a - mx).powi(2)).sum(),
        y.iter().map(|b| (b - my).powi(2)).sum(),
    );
    if vx == 0.0 || vy == 0.0 {
        0.0
    } else {
        cov / (vx * vy).sqrt()
    }
}
