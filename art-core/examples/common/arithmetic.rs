//! The arithmetic task shared by the examples: add two numbers, with a reward a program can check.

use art_core::{ChatCompletionRequest, Message, TrainableModel, Trajectory};

/// One scenario: two numbers to add.
#[derive(Clone, Copy, Debug)]
pub struct Sum(pub u32, pub u32);

impl Sum {
    /// The conversation up to the model's answer: one worked example, then the question. The
    /// example shows the format (a bare number), which the base model otherwise rarely uses.
    pub fn prompt(self) -> Vec<Message> {
        vec![
            Message::system("You are a calculator. Reply with the number only."),
            Message::user("What is 3 + 4?"),
            Message::assistant("7"),
            Message::user(format!("What is {} + {}?", self.0, self.1)),
        ]
    }

    /// 1 for the right number as the whole reply; 0.5 when the right number is in a longer reply;
    /// 0.2 for a bare wrong number (the format is right); else 0. The partial credits give GRPO a
    /// gradient long before the model gets sums right.
    pub fn reward(self, reply: &str) -> f64 {
        let answer = (self.0 + self.1).to_string();
        let numbers: Vec<&str> = reply
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .collect();
        let bare = reply.trim().chars().all(|c| c.is_ascii_digit()) && !reply.trim().is_empty();
        match numbers.as_slice() {
            [only] if *only == answer && bare => 1.0,
            many if many.contains(&answer.as_str()) => 0.5,
            _ if bare => 0.2,
            _ => 0.0,
        }
    }
}

/// Scenarios from a fixed pseudo-random sequence, so runs are comparable.
pub fn scenarios(seed: u64, count: usize, below: u32) -> Vec<Sum> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Sum(
                ((state >> 33) % u64::from(below)) as u32,
                ((state >> 45) % u64::from(below)) as u32,
            )
        })
        .collect()
}

/// One answer from `model`, scored.
pub async fn rollout(
    model: &TrainableModel,
    sum: Sum,
    temperature: f64,
    seed: u64,
) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new(sum.prompt());
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.temperature = Some(temperature);
    request.max_tokens = Some(10);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let choice = model.endpoint().complete(request).await?.choices.remove(0);
    let reply = choice.to_message().text();
    trajectory.reward = sum.reward(&reply);
    trajectory.push_choice(choice);
    Ok(trajectory.finish())
}
