//! RULER: relative judging. An LLM judge sees a group of trajectories for the same task side by
//! side and scores each in [0, 1]; because the scores are relative within the group, GRPO can use
//! them as rewards without any hand-written reward function.

use std::time::Instant;

use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::client::ChatEndpoint;
use crate::telemetry;
use crate::types::{
    ChatCompletionRequest, JsonSchemaFormat, Message, ResponseFormat, Tool, Trajectory,
    TrajectoryGroup,
};

/// The rubric used when none is given.
pub const DEFAULT_RUBRIC: &str = "\
- A trajectory that achieves its goal should always score significantly higher than one that does not.
- Among trajectories that achieve the goal, a more efficient one (fewer steps, fewer wasted tool calls, \
more direct answer) should score higher.
- Give partial credit for progress towards the goal.
- Keep score gaps proportional to quality gaps: near-equal trajectories get near-equal scores.
- Use the whole range from 0 to 1 when the trajectories differ a lot.";

/// How RULER asks its judge.
#[derive(Debug, Clone)]
pub struct RulerOptions {
    pub judge: ChatEndpoint,
    /// Replaces [`DEFAULT_RUBRIC`].
    pub rubric: Option<String>,
    /// Extra attempts after a malformed answer (wrong count, bad JSON, score out of range, HTTP error).
    pub max_retries: usize,
    /// On final failure, drop the group (`Ok(None)`) instead of returning the error.
    pub swallow_errors: bool,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    /// Judge prices in dollars per million tokens (prompt, completion), to record `ruler_cost_usd`.
    pub price_per_million_tokens: Option<(f64, f64)>,
}

impl RulerOptions {
    pub fn new(judge: ChatEndpoint) -> Self {
        RulerOptions {
            judge,
            rubric: None,
            max_retries: 2,
            swallow_errors: false,
            temperature: None,
            max_tokens: Some(1024),
            price_per_million_tokens: None,
        }
    }

    pub fn rubric(mut self, rubric: impl Into<String>) -> Self {
        self.rubric = Some(rubric.into());
        self
    }

    pub fn max_retries(mut self, retries: usize) -> Self {
        self.max_retries = retries;
        self
    }

    pub fn swallow_errors(mut self, swallow: bool) -> Self {
        self.swallow_errors = swallow;
        self
    }

    /// [`RulerOptions::swallow_errors`] under ART's name for it.
    pub fn swallow_exceptions(self, swallow: bool) -> Self {
        self.swallow_errors(swallow)
    }
}

/// The judge's verdict on one trajectory.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RulerScore {
    pub trajectory_id: String,
    pub explanation: String,
    pub score: f64,
}

/// The judge's verdicts on a list of trajectories, in their order.
#[derive(Debug, Clone, PartialEq)]
pub struct RulerVerdict {
    pub scores: Vec<RulerScore>,
    pub usage: JudgeUsage,
    /// All trajectories were the same conversation: one was judged and its score copied.
    pub identical: bool,
}

/// What one judging cost.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct JudgeUsage {
    pub attempts: usize,
    pub seconds: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RulerError {
    #[error("RULER needs at least one trajectory to judge")]
    Empty,
    #[error(
        "the judge gave no usable answer in {attempts} attempts; last problem: {problem}. \
         Try a stronger judge model, more retries, or swallow_errors to drop such groups"
    )]
    InvalidAnswer { attempts: usize, problem: String },
}

/// Scores trajectories relative to each other. Returns one score per trajectory, in order.
pub async fn ruler(
    trajectories: &[Trajectory],
    options: &RulerOptions,
) -> Result<RulerVerdict, RulerError> {
    // A `ruler` span (inside the group's span when called from after_each), with the judge's
    // `chat` spans under it.
    let span = telemetry::start(
        "ruler",
        SpanKind::Internal,
        vec![
            KeyValue::new("art.ruler.judge", options.judge.model().to_string()),
            KeyValue::new("art.trajectories", trajectories.len() as i64),
        ],
    );
    telemetry::in_span(span, ruler_in(trajectories, options), |verdict| {
        let scores: Vec<f64> = verdict.scores.iter().map(|s| s.score).collect();
        vec![
            KeyValue::new(
                "art.ruler.scores",
                opentelemetry::Value::Array(scores.into()),
            ),
            KeyValue::new("art.ruler.attempts", verdict.usage.attempts as i64),
        ]
    })
    .await
}

async fn ruler_in(
    trajectories: &[Trajectory],
    options: &RulerOptions,
) -> Result<RulerVerdict, RulerError> {
    if trajectories.is_empty() {
        return Err(RulerError::Empty);
    }
    let conversations: Vec<Vec<Message>> = trajectories.iter().map(Trajectory::messages).collect();
    // Identical trajectories cannot be ranked against each other: judge one, copy its score.
    if conversations.len() > 1 && conversations.iter().all(|c| *c == conversations[0]) {
        let (scores, usage) = judge(&conversations[..1], tools_of(trajectories), options).await?;
        let scores = (1..=conversations.len())
            .map(|i| RulerScore {
                trajectory_id: i.to_string(),
                ..scores[0].clone()
            })
            .collect();
        return Ok(RulerVerdict {
            scores,
            usage,
            identical: true,
        });
    }
    let (scores, usage) = judge(&conversations, tools_of(trajectories), options).await?;
    Ok(RulerVerdict {
        scores,
        usage,
        identical: false,
    })
}

/// Judges a group with RULER and writes the result back: `reward` becomes the RULER score, the
/// previous reward is kept as the metric `independent_reward`, the score as `ruler_score`, the
/// judge's explanation goes to the trajectory's logs, and the judge's cost to the group's metrics.
/// `Ok(None)` when the judge failed and `swallow_errors` is set. Fits `GatherOptions::after_each`.
pub async fn ruler_score_group(
    mut group: TrajectoryGroup,
    options: &RulerOptions,
) -> Result<Option<TrajectoryGroup>, RulerError> {
    let RulerVerdict {
        scores,
        usage,
        identical,
    } = match ruler(&group.trajectories, options).await {
        Ok(verdict) => verdict,
        Err(error) if options.swallow_errors => {
            eprintln!("RULER: dropping a group: {error}");
            return Ok(None);
        }
        Err(error) => return Err(error),
    };
    if identical {
        group.logs.push(format!(
            "RULER: all {} trajectories are identical; judged one and copied its score",
            group.trajectories.len()
        ));
    }
    for (trajectory, score) in group.trajectories.iter_mut().zip(&scores) {
        trajectory.set_metric("independent_reward", trajectory.reward);
        trajectory.set_metric("ruler_score", score.score);
        trajectory.reward = score.score;
        trajectory.log(format!("RULER explanation: {}", score.explanation));
    }
    group
        .metrics
        .insert("ruler_judge_seconds".into(), usage.seconds.into());
    group
        .metrics
        .insert("ruler_judge_attempts".into(), usage.attempts.into());
    group.metrics.insert(
        "ruler_prompt_tokens".into(),
        (usage.prompt_tokens as i64).into(),
    );
    group.metrics.insert(
        "ruler_completion_tokens".into(),
        (usage.completion_tokens as i64).into(),
    );
    if let Some((prompt_price, completion_price)) = options.price_per_million_tokens {
        let cost = (usage.prompt_tokens as f64 * prompt_price
            + usage.completion_tokens as f64 * completion_price)
            / 1e6;
        group.metrics.insert("ruler_cost_usd".into(), cost.into());
    }
    Ok(Some(group))
}

fn tools_of(trajectories: &[Trajectory]) -> Option<&[Tool]> {
    trajectories
        .iter()
        .find_map(|t| t.tools.as_deref())
        .filter(|tools| !tools.is_empty())
}

async fn judge(
    conversations: &[Vec<Message>],
    tools: Option<&[Tool]>,
    options: &RulerOptions,
) -> Result<(Vec<RulerScore>, JudgeUsage), RulerError> {
    let rubric = options.rubric.as_deref().unwrap_or(DEFAULT_RUBRIC);
    let messages = vec![
        Message::system(system_prompt(rubric)),
        Message::user(judge_prompt(conversations, tools)),
    ];
    let mut request = ChatCompletionRequest::new(options.judge.model(), messages);
    request.response_format = Some(response_format(conversations.len()));
    request.temperature = options.temperature;
    request.max_tokens = options.max_tokens;

    let started = Instant::now();
    let mut usage = JudgeUsage::default();
    let mut problem = String::new();
    for attempt in 1..=options.max_retries + 1 {
        usage.attempts = attempt;
        match options.judge.complete(request.clone()).await {
            Ok(completion) => {
                if let Some(u) = completion.usage {
                    usage.prompt_tokens += u.prompt_tokens;
                    usage.completion_tokens += u.completion_tokens;
                }
                let choice = completion.choices.first();
                let text = choice.map(|c| c.to_message().text()).unwrap_or_default();
                let cut_off = choice.and_then(|c| c.finish_reason.as_deref()) == Some("length");
                match parse_scores(&text, conversations.len()) {
                    Ok(scores) => {
                        usage.seconds = started.elapsed().as_secs_f64();
                        return Ok((scores, usage));
                    }
                    // A judge that rambles runs out of tokens before its JSON ends: say so, or the
                    // parse error reads like a broken judge.
                    Err(why) if cut_off => {
                        problem = format!(
                            "the answer was cut off at max_tokens ({}) before its JSON ended \
                             (raise RulerOptions::max_tokens, or use a judge that writes shorter \
                             explanations): {why}",
                            request
                                .max_tokens
                                .map_or("the server's limit".into(), |n| n.to_string())
                        )
                    }
                    Err(why) => problem = why,
                }
            }
            Err(error) => problem = error.to_string(),
        }
    }
    Err(RulerError::InvalidAnswer {
        attempts: usage.attempts,
        problem,
    })
}

fn system_prompt(rubric: &str) -> String {
    format!(
        "You are a fair, careful judge. You will see several trajectories: attempts by an AI agent at the \
same task, each a conversation between the agent, its user and its tools. Compare them with each other and \
give each a score from 0 to 1 that reflects how well it did, following this rubric:\n\n{rubric}\n\n\
Answer with JSON only, in the form \
{{\"scores\": [{{\"trajectory_id\": \"1\", \"explanation\": \"...\", \"score\": 0.7}}, ...]}}, \
with exactly one entry per trajectory, in the order shown, each explanation one or two sentences."
    )
}

/// The judge's user message: the shared beginning once, then what differs, trajectory by trajectory.
pub fn judge_prompt(conversations: &[Vec<Message>], tools: Option<&[Tool]>) -> String {
    let prefix_len = common_prefix_len(conversations);
    let mut prompt = String::new();
    if let Some(tools) = tools {
        prompt.push_str("The agent could call these tools:\n<tools>\n");
        for tool in tools {
            prompt.push_str(&serde_json::to_string(tool).expect("tools serialize"));
            prompt.push('\n');
        }
        prompt.push_str("</tools>\n\n");
    }
    if prefix_len > 0 {
        prompt.push_str("All trajectories begin with this context:\n<context>\n");
        push_messages(&mut prompt, &conversations[0][..prefix_len]);
        prompt.push_str("</context>\n\n");
    }
    prompt.push_str(&format!(
        "There are {} trajectories to score:\n\n",
        conversations.len()
    ));
    for (i, conversation) in conversations.iter().enumerate() {
        prompt.push_str(&format!("<trajectory id=\"{}\">\n", i + 1));
        push_messages(&mut prompt, &conversation[prefix_len..]);
        prompt.push_str("</trajectory>\n\n");
    }
    prompt.push_str("Score every trajectory now.");
    prompt
}

/// The length of the message prefix that every conversation shares (none for a single one: its
/// whole text is what is judged).
pub fn common_prefix_len(conversations: &[Vec<Message>]) -> usize {
    let Some(first) = conversations.first() else {
        return 0;
    };
    if conversations.len() < 2 {
        return 0;
    }
    let shared = (0..first.len())
        .take_while(|&i| conversations.iter().all(|c| c.get(i) == Some(&first[i])))
        .count();
    // Keep at least one message of each trajectory to judge, even when one is a prefix of another.
    let shortest = conversations.iter().map(Vec::len).min().unwrap_or(0);
    shared.min(shortest.saturating_sub(1))
}

fn push_messages(prompt: &mut String, messages: &[Message]) {
    for message in messages {
        prompt.push_str(&serde_json::to_string(message).expect("messages serialize"));
        prompt.push('\n');
    }
}

fn response_format(count: usize) -> ResponseFormat {
    // One schema per position, its id a constant: a constrained judge (our own backend) can then
    // neither skip, repeat nor invent a trajectory, however small it is.
    let entries: Vec<Value> = (1..=count)
        .map(|id| {
            json!({
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "string", "const": id.to_string()},
                    "explanation": {"type": "string", "maxLength": 400},
                    "score": {"type": "number", "minimum": 0, "maximum": 1}
                },
                "required": ["trajectory_id", "explanation", "score"],
                "additionalProperties": false
            })
        })
        .collect();
    let schema = json!({
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "prefixItems": entries,
                "minItems": count,
                "maxItems": count
            }
        },
        "required": ["scores"],
        "additionalProperties": false
    });
    ResponseFormat::JsonSchema {
        json_schema: JsonSchemaFormat {
            name: "ruler_scores".into(),
            description: None,
            schema: Some(schema),
            strict: Some(true),
        },
    }
}

/// Parses and checks the judge's answer: one score in [0, 1] per trajectory, ids "1".."n" each once.
/// Returns the scores in trajectory order, or what was wrong.
pub fn parse_scores(text: &str, count: usize) -> Result<Vec<RulerScore>, String> {
    #[derive(Deserialize)]
    struct Answer {
        scores: Vec<RulerScore>,
    }
    // Some judges wrap JSON in a Markdown fence; look at the outermost object.
    let body = match (text.find('{'), text.rfind('}')) {
        (Some(start), Some(end)) if start < end => &text[start..=end],
        _ => {
            return Err(format!(
                "the answer holds no JSON object: {:?}",
                excerpt(text)
            ))
        }
    };
    let answer: Answer = serde_json::from_str(body).map_err(|e| {
        format!(
            "the answer is not the expected JSON ({e}): {:?}",
            excerpt(text)
        )
    })?;
    if answer.scores.len() != count {
        return Err(format!(
            "expected {count} scores, the judge gave {}",
            answer.scores.len()
        ));
    }
    let mut ordered: Vec<Option<RulerScore>> = vec![None; count];
    for score in answer.scores {
        if !(score.score.is_finite() && (0.0..=1.0).contains(&score.score)) {
            return Err(format!(
                "score {} for trajectory {} is outside [0, 1]",
                score.score, score.trajectory_id
            ));
        }
        let index = score
            .trajectory_id
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|id| (1..=count).contains(id))
            .ok_or_else(|| {
                format!(
                    "unknown trajectory id {:?} (expected 1 to {count})",
                    score.trajectory_id
                )
            })?;
        if ordered[index - 1].replace(score).is_some() {
            return Err(format!("trajectory {index} was scored twice"));
        }
    }
    Ok(ordered.into_iter().flatten().collect())
}

fn excerpt(text: &str) -> String {
    text.chars().take(200).collect()
}
