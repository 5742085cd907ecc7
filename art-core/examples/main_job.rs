//! The main job: GRPO on the embedded default model (SmolLM2-135M-Instruct) for a task with a
//! verifiable reward — adding two numbers — with the base model's held-out reward before and the
//! trained model's after.
//!
//! cargo run --release -p art-core --features server --example main_job -- [--steps N]

use std::time::Instant;

use art_core::{
    gather_trajectory_groups, ChatCompletionRequest, GatherOptions, LocalBackend,
    LocalBackendOptions, Message, TrainableModel, Trajectory, TrajectoryGroup,
};

/// One scenario: two numbers to add.
#[derive(Clone, Copy)]
struct Sum(u32, u32);

impl Sum {
    fn prompt(self) -> Vec<Message> {
        vec![
            Message::system("You are a calculator. Reply with the number only."),
            Message::user(format!("What is {} + {}?", self.0, self.1)),
        ]
    }

    /// 1 for the right number as the whole reply, 0.5 when it is somewhere in the reply, else 0.
    fn reward(self, reply: &str) -> f64 {
        let answer = (self.0 + self.1).to_string();
        let numbers: Vec<&str> = reply
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .collect();
        match numbers.as_slice() {
            [only] if *only == answer => 1.0,
            many if many.contains(&answer.as_str()) => 0.5,
            _ => 0.0,
        }
    }
}

/// Scenarios from a fixed pseudo-random sequence, so runs are comparable.
fn scenarios(seed: u64, count: usize) -> Vec<Sum> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Sum(((state >> 33) % 20) as u32, ((state >> 45) % 20) as u32)
        })
        .collect()
}

async fn rollout(
    model: &TrainableModel,
    sum: Sum,
    temperature: f64,
    seed: u64,
) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new(sum.prompt());
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.temperature = Some(temperature);
    request.max_tokens = Some(12);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let choice = model.endpoint().complete(request).await?.choices.remove(0);
    trajectory.reward = sum.reward(
        &choice
            .message
            .content
            .as_ref()
            .map(|c| c.text())
            .unwrap_or_default(),
    );
    trajectory.push_choice(choice);
    Ok(trajectory.finish())
}

/// Mean greedy reward on held-out scenarios.
async fn evaluate(model: &TrainableModel, held_out: &[Sum]) -> anyhow::Result<f64> {
    let groups = held_out
        .iter()
        .map(|&sum| TrajectoryGroup::from_rollouts([rollout(model, sum, 0.0, 0)]));
    let groups = gather_trajectory_groups(groups, GatherOptions::new().description("eval")).await?;
    let rewards: Vec<f64> = groups.iter().flat_map(TrajectoryGroup::rewards).collect();
    Ok(rewards.iter().sum::<f64>() / rewards.len() as f64)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let models = std::env::var("ART_MODELS_DIR").unwrap_or_else(|_| "models".into());
    let mut options = LocalBackendOptions::new(format!("{models}/SmolLM2-135M-Instruct.Q4_1.gguf"));
    options.art_dir = ".art".into();
    let started = Instant::now();
    let backend = LocalBackend::start(options).await?;
    println!("backend ready in {:.1?}", started.elapsed());
    let model = TrainableModel::register(&backend, "adder", "main-job").await?;
    println!(
        "model {} (base {}), step {}",
        model.name,
        model.base_model,
        model.get_step().await?
    );

    let held_out = scenarios(2, 32);
    let base = evaluate(&model, &held_out).await?;
    println!(
        "held-out reward of the base model: {base:.3} over {} sums",
        held_out.len()
    );
    println!(
        "GRPO training is not wired into the backend yet (see the training issue); \
         this run measured the base model only."
    );
    Ok(())
}
