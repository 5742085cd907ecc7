//! From trajectory groups to token sequences: render each conversation with the model's chat
//! template, splice in the sampled tokens of every choice, mark those (and only those) as
//! trainable, attach the sampler's logprobs and the group-relative advantage, and pack the
//! sequences into micro-batches.

use crate::engine::chat_template::{ChatTemplate, RenderOptions};
use crate::engine::tool_calls::conversation_for_template;
use crate::engine::{Device, Engine};
use crate::types::{
    AssistantTurns, ChatCompletionsExchange, Choice, Message, MessageOrChoice, SftConfig, Tool,
    TrainConfig, Trajectory, TrajectoryGroup,
};

use super::error::{Result, SequenceSource, TrainError};

/// One conversation as the trainer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSequence {
    /// The conversation: rendered prompt tokens with each choice's sampled tokens spliced in,
    /// up to the last sampled token (template text after it would train nothing).
    pub tokens: Vec<u32>,
    /// `trainable[i]`: `tokens[i]` was sampled by the model (part of a choice). Never true at 0.
    pub trainable: Vec<bool>,
    /// `sampler_logprobs[i]`: the sampler's logprob of `tokens[i]`, NaN where not trainable or
    /// where the choice came without logprobs.
    pub sampler_logprobs: Vec<f32>,
    /// The group-relative advantage of the trajectory this conversation belongs to.
    pub advantage: f64,
    pub source: SequenceSource,
}

impl TrainSequence {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn num_trainable(&self) -> usize {
        self.trainable.iter().filter(|&&t| t).count()
    }
}

/// The chat template a model's conversations are rendered with: the server's
/// ([`Engine::compiled_chat_template`]); a model without one cannot be trained.
pub fn chat_template_for(engine: &Engine) -> Result<ChatTemplate> {
    engine
        .compiled_chat_template()
        .map_err(TrainError::BadChatTemplate)?
        .ok_or(TrainError::NoChatTemplate)
}

/// A conversation's tokens as they are put together, before [`Tokenization::finish`].
#[derive(Default)]
struct Draft {
    tokens: Vec<u32>,
    trainable: Vec<bool>,
    logprobs: Vec<f32>,
}

impl Draft {
    /// Tokens the model did not sample (prompt, template text, written messages).
    fn push_context(&mut self, ids: &[u32]) {
        self.trainable.extend(std::iter::repeat_n(false, ids.len()));
        self.logprobs
            .extend(std::iter::repeat_n(f32::NAN, ids.len()));
        self.tokens.extend_from_slice(ids);
    }

    /// Tokens the model sampled, with the sampler's logprobs.
    fn push_sampled(&mut self, ids: Vec<u32>, logprobs: Vec<f32>) {
        self.trainable.extend(std::iter::repeat_n(true, ids.len()));
        self.logprobs.extend(logprobs);
        self.tokens.extend(ids);
    }
}

/// Renders conversations and tokenizes them for training.
pub struct Tokenization<'e> {
    engine: &'e Engine,
    template: ChatTemplate,
    pub allow_missing_logprobs: bool,
    /// Supervised fine-tuning: these assistant turns are learnt whether written or sampled (a
    /// sampled choice keeps its exact token ids). `None` (GRPO): only sampled choices are.
    learn_written: Option<AssistantTurns>,
}

impl<'e> Tokenization<'e> {
    pub fn new(engine: &'e Engine, template: ChatTemplate) -> Self {
        Tokenization {
            engine,
            template,
            allow_missing_logprobs: false,
            learn_written: None,
        }
    }

    /// The tokenization of supervised fine-tuning: the assistant turns `config` names are
    /// trained, no logprobs are needed.
    pub fn for_sft(engine: &'e Engine, template: ChatTemplate, config: &SftConfig) -> Self {
        Tokenization {
            allow_missing_logprobs: true,
            learn_written: Some(config.assistant_turns),
            ..Tokenization::new(engine, template)
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.engine
            .encode(text, false)
            .map_err(|e| TrainError::Tokenizer(e.to_string()))
    }

    /// One conversation (a trajectory's `messages_and_choices`, or one of its additional
    /// histories) as tokens. `advantage` is attached as is.
    pub fn sequence(
        &self,
        items: &[MessageOrChoice],
        tools: Option<&[Tool]>,
        advantage: f64,
        source: SequenceSource,
    ) -> Result<TrainSequence> {
        let messages: Vec<Message> = items
            .iter()
            .map(|item| match item {
                MessageOrChoice::Message(m) => m.clone(),
                MessageOrChoice::Choice(c) => c.to_message(),
            })
            .collect();
        // Rendered exactly as the server renders prompts (tools in the system prompt for
        // templates without tool syntax), so training sees the context that was sampled from.
        let conversation =
            conversation_for_template(&messages, tools, self.template.tool_call_format());
        let rendered = if messages.is_empty() {
            None
        } else {
            Some(
                self.template
                    .render_with_turns(
                        &conversation.messages,
                        conversation.tools,
                        &RenderOptions::default(),
                    )
                    .map_err(|error| TrainError::ChatTemplate { at: source, error })?,
            )
        };
        let segments = rendered.as_ref().map(|r| r.segments()).unwrap_or_default();
        let last_turn = segments.iter().rev().find_map(|s| s.assistant_message);
        let mut draft = Draft::default();
        for segment in segments {
            let original = segment
                .assistant_message
                .and_then(|i| i.checked_sub(conversation.inserted));
            let learnt = original.is_some()
                && match self.learn_written {
                    None => false,
                    Some(AssistantTurns::All) => true,
                    Some(AssistantTurns::Last) => segment.assistant_message == last_turn,
                };
            let choice = original.and_then(|i| match &items[i] {
                MessageOrChoice::Choice(c) => Some((i, c)),
                MessageOrChoice::Message(_) => None,
            });
            let sampled_ids = choice.and_then(|(_, c)| c.sampled_token_ids());
            let written = sampled_ids.is_none();
            match (choice, sampled_ids) {
                // Supervised: the turn's exact tokens when it was sampled, else its text.
                _ if learnt && written => {
                    let ids = self.encode(segment.text)?;
                    let unknown = vec![f32::NAN; ids.len()];
                    draft.push_sampled(ids, unknown);
                }
                // Supervised, a sampled turn: its logprobs play no part in cross-entropy.
                (Some(_), Some(ids)) if learnt => {
                    self.check_vocabulary(&ids, source)?;
                    let unknown = vec![f32::NAN; ids.len()];
                    draft.push_sampled(ids, unknown);
                }
                (Some((message, choice)), Some(ids)) if self.learn_written.is_none() => {
                    let lps = self.sampled(choice, &ids, source, message)?;
                    draft.push_sampled(ids, lps);
                }
                (Some((message, _)), None) if self.learn_written.is_none() => {
                    return Err(TrainError::MissingTokenIds {
                        at: source,
                        message,
                    })
                }
                // Prompt text, an assistant message written rather than sampled (GRPO), or a
                // turn supervised fine-tuning does not learn: context only.
                _ => draft.push_context(&self.encode(segment.text)?),
            }
        }
        self.finish(draft, advantage, source)
    }

    /// Every sequence of a trajectory: its conversation (or its captured calls) and its
    /// additional histories, all with the trajectory's advantage.
    pub fn trajectory_sequences(
        &self,
        trajectory: &Trajectory,
        advantage: f64,
        source: SequenceSource,
    ) -> Result<Vec<TrainSequence>> {
        let exchanges = &trajectory.exchanges;
        if !exchanges.is_empty() {
            let unsupported = [
                ("legacy completions", exchanges.completions.len()),
                ("Responses API", exchanges.responses.len()),
                ("Anthropic Messages", exchanges.messages.len()),
            ];
            if let Some((api, _)) = unsupported.iter().find(|(_, count)| *count > 0) {
                return Err(TrainError::BadExchange {
                    at: source,
                    exchange: 0,
                    reason: format!(
                        "calls to the {api} API cannot be trained on: this server samples (and \
                         trains) chat completions only"
                    ),
                });
            }
            if !trajectory.messages_and_choices.is_empty()
                || !trajectory.additional_histories.is_empty()
            {
                return Err(TrainError::BadExchange {
                    at: source,
                    exchange: 0,
                    reason: "a trajectory holds either captured exchanges or \
                             messages_and_choices (and additional histories), not both"
                        .into(),
                });
            }
            if self.learn_written == Some(AssistantTurns::Last) {
                return Err(TrainError::BadExchange {
                    at: source,
                    exchange: 0,
                    reason: "`assistant_turns: last` needs the conversation as \
                             messages_and_choices; captured calls are learnt whole (`all`)"
                        .into(),
                });
            }
            return self.exchange_sequences(&exchanges.chat_completions, advantage, source);
        }
        let mut sequences = vec![self.sequence(
            &trajectory.messages_and_choices,
            trajectory.tools.as_deref(),
            advantage,
            source,
        )?];
        for (h, history) in trajectory.additional_histories.iter().enumerate() {
            let tools = history.tools.as_deref().or(trajectory.tools.as_deref());
            sequences.push(self.sequence(
                &history.messages_and_choices,
                tools,
                advantage,
                SequenceSource {
                    history: Some(h),
                    ..source
                },
            )?);
        }
        Ok(sequences)
    }

    /// The sampler's logprobs of a choice's sampled `ids` (checked against the vocabulary);
    /// `message` names the choice in errors.
    fn sampled(
        &self,
        choice: &Choice,
        ids: &[u32],
        source: SequenceSource,
        message: usize,
    ) -> Result<Vec<f32>> {
        self.check_vocabulary(ids, source)?;
        Ok(match choice.sampled_logprobs() {
            Some(lps) if lps.len() == ids.len() => lps.into_iter().map(|x| x as f32).collect(),
            // A server may leave the final end-of-turn token out of `logprobs.content`
            // (OpenAI does): that token is then trained with a ratio of 1.
            Some(lps)
                if lps.len() + 1 == ids.len()
                    && self.engine.eos_token_ids().contains(ids.last().unwrap()) =>
            {
                let mut v: Vec<f32> = lps.into_iter().map(|x| x as f32).collect();
                v.push(f32::NAN);
                v
            }
            Some(lps) => {
                return Err(TrainError::LogprobCountMismatch {
                    at: source,
                    message,
                    tokens: ids.len(),
                    logprobs: lps.len(),
                })
            }
            None if self.allow_missing_logprobs => vec![f32::NAN; ids.len()],
            None => {
                return Err(TrainError::MissingLogprobs {
                    at: source,
                    message,
                })
            }
        })
    }

    fn check_vocabulary(&self, ids: &[u32], source: SequenceSource) -> Result<()> {
        let vocab = self.engine.config().vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(TrainError::TokenOutOfVocabulary {
                at: source,
                token: bad,
                vocab,
            }),
            None => Ok(()),
        }
    }

    /// The sequences of a rollout captured as raw chat-completion calls, on the exact tokens the
    /// server reported: each choice is its prompt's `prompt_token_ids` followed by its sampled
    /// `token_ids`. A call whose prompt starts with an earlier sequence (the next turn of the
    /// same conversation) extends that sequence, so a multi-turn rollout trains as one.
    pub fn exchange_sequences(
        &self,
        exchanges: &[ChatCompletionsExchange],
        advantage: f64,
        source: SequenceSource,
    ) -> Result<Vec<TrainSequence>> {
        // Each conversation so far.
        let mut built: Vec<Draft> = Vec::new();
        for (k, exchange) in exchanges.iter().enumerate() {
            let bad = |reason: &str| TrainError::BadExchange {
                at: source,
                exchange: k,
                reason: reason.to_string(),
            };
            let prompt = exchange.prompt_token_ids().ok_or_else(|| {
                bad(
                    "the response has no `prompt_token_ids`; sample with `return_token_ids: \
                     true` (ART's model.openai_client() asks for it) so that training sees the \
                     exact tokens",
                )
            })?;
            if exchange.response.choices.is_empty() {
                return Err(bad("the response has no choices"));
            }
            for choice in &exchange.response.choices {
                let ids = choice.sampled_token_ids().ok_or_else(|| {
                    bad("a choice has no `token_ids`; sample with `return_token_ids: true`")
                })?;
                let lps = self.sampled(choice, &ids, source, k)?;
                let continued = built
                    .iter_mut()
                    .rev()
                    .find(|draft| prompt.starts_with(&draft.tokens));
                let draft = match continued {
                    Some(conversation) => conversation,
                    None => {
                        built.push(Draft::default());
                        built.last_mut().expect("just pushed")
                    }
                };
                draft.push_context(&prompt[draft.tokens.len()..]);
                draft.push_sampled(ids, lps);
            }
        }
        built
            .into_iter()
            .map(|draft| self.finish(draft, advantage, source))
            .collect()
    }

    /// A conversation's tokens as a training sequence: the first token is never trained (nothing
    /// predicts it), tokens after the last sampled one are dropped, the context length checked.
    fn finish(
        &self,
        draft: Draft,
        advantage: f64,
        source: SequenceSource,
    ) -> Result<TrainSequence> {
        let Draft {
            mut tokens,
            mut trainable,
            mut logprobs,
        } = draft;
        if let Some(first) = trainable.first_mut() {
            *first = false;
        }
        // Template glue after the last sampled token predicts nothing that is trained.
        let keep = trainable.iter().rposition(|&t| t).map_or(0, |i| i + 1);
        tokens.truncate(keep);
        trainable.truncate(keep);
        logprobs.truncate(keep);
        let context = self.engine.config().max_position_embeddings;
        if tokens.len() > context {
            return Err(TrainError::SequenceTooLong {
                at: source,
                tokens: tokens.len(),
                context,
            });
        }
        Ok(TrainSequence {
            tokens,
            trainable,
            sampler_logprobs: logprobs,
            advantage,
            source,
        })
    }
}

/// GRPO advantages of one group: reward minus the group's mean, divided by the group's
/// (population) standard deviation plus 1e-6 when `scale`. `None` when every reward is the same
/// (nothing to learn from the group; this includes a group of one).
pub fn group_advantages(rewards: &[f64], scale: bool) -> Option<Vec<f64>> {
    let first = *rewards.first()?;
    if rewards.iter().all(|&r| r == first) {
        return None;
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    Some(
        rewards
            .iter()
            .map(|r| {
                if scale {
                    (r - mean) / (std + 1e-6)
                } else {
                    r - mean
                }
            })
            .collect(),
    )
}

/// What a batch of groups turned into.
#[derive(Debug, Clone, Default)]
pub struct PreparedBatch {
    /// Sequences of the groups that have something to teach, in group order.
    pub sequences: Vec<TrainSequence>,
    pub groups_used: usize,
    /// Groups whose rewards were all equal (or that had one trajectory).
    pub groups_skipped: usize,
    /// Mean and (population) std of all trajectories' rewards, skipped groups included.
    pub reward_mean: f64,
    pub reward_std: f64,
    pub num_trajectories: usize,
}

/// Tokenizes every trajectory (and additional history) of `groups`, computes advantages, and
/// keeps the sequences of groups with an advantage signal. Every conversation is checked, also
/// those of skipped groups, so that a malformed batch fails the same way whatever its rewards.
pub fn prepare_batch(
    tokenization: &Tokenization<'_>,
    groups: &[TrajectoryGroup],
    scale_rewards: bool,
) -> Result<PreparedBatch> {
    let num_trajectories: usize = groups.iter().map(|g| g.trajectories.len()).sum();
    if num_trajectories == 0 {
        return Err(TrainError::EmptyBatch(format!(
            "{} group(s) with no trajectories",
            groups.len()
        )));
    }
    let rewards: Vec<f64> = groups.iter().flat_map(|g| g.rewards()).collect();
    let reward_mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    let reward_std = (rewards
        .iter()
        .map(|r| (r - reward_mean).powi(2))
        .sum::<f64>()
        / rewards.len() as f64)
        .sqrt();
    let mut out = PreparedBatch {
        reward_mean,
        reward_std,
        num_trajectories,
        ..Default::default()
    };
    for (g, group) in groups.iter().enumerate() {
        if group.trajectories.is_empty() {
            continue;
        }
        let advantages = group_advantages(&group.rewards(), scale_rewards);
        match advantages {
            Some(_) => out.groups_used += 1,
            None => out.groups_skipped += 1,
        }
        for (t, trajectory) in group.trajectories.iter().enumerate() {
            let advantage = advantages.as_ref().map_or(0.0, |a| a[t]);
            let source = SequenceSource {
                group: Some(g),
                trajectory: t,
                history: None,
            };
            let sequences = tokenization.trajectory_sequences(trajectory, advantage, source)?;
            if advantages.is_some() {
                out.sequences
                    .extend(sequences.into_iter().filter(|s| s.num_trainable() > 0));
            }
        }
    }
    Ok(out)
}

/// Sequences (by index into a step's list) laid out as one block of a row: their first `prefix`
/// input positions, the same tokens in all of them, computed once, then each one's remaining
/// inputs, each reading the prefix and itself. A lone sequence is a block of one.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub sequences: Vec<usize>,
    pub prefix: usize,
    /// The positions the block takes in its row.
    pub len: usize,
}

impl Block {
    fn alone(index: usize, positions: usize) -> Self {
        Block {
            sequences: vec![index],
            prefix: positions,
            len: positions,
        }
    }
}

/// The sequences of one block, for [`micro_batch_loss`].
///
/// [`micro_batch_loss`]: super::micro_batch_loss
#[derive(Debug, Clone)]
pub struct RowBlock<'a> {
    pub sequences: Vec<&'a TrainSequence>,
    /// Input positions shared by all of them (at most [`row_positions`] of each, and their
    /// tokens there equal).
    pub prefix: usize,
}

/// One forward/backward's worth of a step: `rows[r]` are the blocks laid out one after another
/// in row `r` (one lone sequence each without packing), every row right-padded to the fullest.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatch {
    pub rows: Vec<Vec<Block>>,
    /// Positions of the fullest row; the batch computes `rows.len() * width` positions.
    pub width: usize,
}

impl MicroBatch {
    /// The rows' blocks with their sequences taken from `sequences`, the step's list.
    pub fn gather<'a>(&self, sequences: &'a [TrainSequence]) -> Vec<Vec<RowBlock<'a>>> {
        self.rows
            .iter()
            .map(|row| {
                row.iter()
                    .map(|block| RowBlock {
                        sequences: block.sequences.iter().map(|&i| &sequences[i]).collect(),
                        prefix: block.prefix,
                    })
                    .collect()
            })
            .collect()
    }

    /// The step's sequences in this micro-batch.
    pub fn sequences(&self) -> impl Iterator<Item = usize> + '_ {
        self.rows
            .iter()
            .flatten()
            .flat_map(|block| block.sequences.iter().copied())
    }
}

/// `batch` as rows of one lone sequence each (no packing), for [`micro_batch_loss`].
///
/// [`micro_batch_loss`]: super::micro_batch_loss
pub fn one_per_row<'a>(batch: &[&'a TrainSequence]) -> Vec<Vec<RowBlock<'a>>> {
    batch
        .iter()
        .map(|&s| {
            vec![RowBlock {
                sequences: vec![s],
                prefix: row_positions(s),
            }]
        })
        .collect()
}

/// The positions a sequence takes in a row: its tokens but the last, which is only a target.
pub fn row_positions(sequence: &TrainSequence) -> usize {
    sequence.len().saturating_sub(1).max(1)
}

/// The micro-batches of a step's `sequences` under `config`'s token budget: with
/// `share_prefixes`, the sequences of a group that begin alike as blocks (see
/// [`shared_prefix_blocks`]); with `pack_sequences`, blocks sharing rows of
/// `packed_sequence_length` positions (by default the longest block's). `device` is where the
/// forward passes run (it decides `pack_sequences` when the config leaves it open).
pub fn plan_micro_batches(
    sequences: &[TrainSequence],
    config: &TrainConfig,
    device: &Device,
) -> Vec<MicroBatch> {
    let blocks = if config.share_prefixes {
        shared_prefix_blocks(sequences, config.micro_batch_tokens)
    } else {
        (0..sequences.len())
            .map(|i| Block::alone(i, row_positions(&sequences[i])))
            .collect()
    };
    let pack = config.pack_sequences.unwrap_or(device.is_cpu());
    let row_width = pack.then(|| {
        config
            .packed_sequence_length
            .unwrap_or_else(|| blocks.iter().map(|b| b.len).max().unwrap_or(1))
    });
    pack_blocks(blocks, config.micro_batch_tokens, row_width)
}

/// Prefixes shorter than this are not shared: the saving would not pay for the mask.
const MIN_SHARED_PREFIX: usize = 8;

/// The sequences of each group (by [`SequenceSource::group`]) as blocks over their common
/// prefix. A block takes another member while that costs no more attention than running it
/// apart (the block's squared length at most the sum of its members' squared lengths, since a
/// packed row computes every query against every key of the row) and fits `max_tokens`; the
/// projections, most of the work, always get cheaper. Members that begin differently, and
/// sequences of no group, are blocks of their own.
pub fn shared_prefix_blocks(sequences: &[TrainSequence], max_tokens: usize) -> Vec<Block> {
    let positions: Vec<usize> = sequences.iter().map(row_positions).collect();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut blocks = Vec::new();
    for (i, seq) in sequences.iter().enumerate() {
        let Some(g) = seq.source.group else {
            blocks.push(Block::alone(i, positions[i]));
            continue;
        };
        match groups
            .iter_mut()
            .find(|members| sequences[members[0]].source.group == Some(g))
        {
            Some(members) => members.push(i),
            None => groups.push(vec![i]),
        }
    }
    for members in groups {
        // The prefix each member shares with the group's first; a member that shares too little
        // stays alone, the others share the shortest of theirs.
        let first = &sequences[members[0]].tokens;
        let common = |i: usize| {
            let same = first
                .iter()
                .zip(&sequences[i].tokens)
                .take_while(|(a, b)| a == b)
                .count();
            same.min(positions[i])
        };
        let (members, apart): (Vec<usize>, Vec<usize>) = members
            .into_iter()
            .partition(|&i| common(i) >= MIN_SHARED_PREFIX);
        blocks.extend(apart.iter().map(|&i| Block::alone(i, positions[i])));
        let prefix = members.iter().map(|&i| common(i)).min().unwrap_or(0);
        if members.len() < 2 {
            blocks.extend(members.iter().map(|&i| Block::alone(i, positions[i])));
            continue;
        }
        // Longest continuations first, each into the first block where it is worth it.
        let mut order = members;
        order.sort_by_key(|&i| std::cmp::Reverse(positions[i]));
        // (block, sum of its members' squared lengths)
        let mut open: Vec<(Block, usize)> = Vec::new();
        for i in order {
            let own = positions[i] - prefix;
            let fits = |(block, apart): &&mut (Block, usize)| {
                let len = block.len + own;
                len <= max_tokens && len * len <= apart + positions[i] * positions[i]
            };
            match open.iter_mut().find(|b| fits(b)) {
                Some((block, apart)) => {
                    block.sequences.push(i);
                    block.len += own;
                    *apart += positions[i] * positions[i];
                }
                None => open.push((
                    Block {
                        sequences: vec![i],
                        prefix,
                        len: positions[i],
                    },
                    positions[i] * positions[i],
                )),
            }
        }
        blocks.extend(open.into_iter().map(|(block, _)| block));
    }
    blocks
}

/// Lone sequences of `lengths` positions into micro-batches (see [`pack_blocks`]).
pub fn pack_micro_batches(
    lengths: &[usize],
    max_tokens: usize,
    row_width: Option<usize>,
) -> Vec<MicroBatch> {
    let blocks = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| Block::alone(i, len))
        .collect();
    pack_blocks(blocks, max_tokens, row_width)
}

/// Puts blocks into rows, and rows into micro-batches of at most `max_tokens` positions, padding
/// included (a row longer than that gets a micro-batch of its own). With `row_width`, blocks
/// share rows of that many positions (first fit, longest first; a longer block has a row of its
/// own); without, each has a row of its own. Rows go fullest first, so that widths within a
/// micro-batch are close and little is padding.
fn pack_blocks(
    mut blocks: Vec<Block>,
    max_tokens: usize,
    row_width: Option<usize>,
) -> Vec<MicroBatch> {
    blocks.sort_by_key(|b| std::cmp::Reverse(b.len));
    // (blocks, positions used)
    let mut rows: Vec<(Vec<Block>, usize)> = Vec::new();
    for block in blocks {
        let free = |row: &&mut (Vec<Block>, usize)| {
            row_width.is_some_and(|width| row.1 + block.len <= width)
        };
        match rows.iter_mut().find(|row| free(row)) {
            Some(row) => {
                row.1 += block.len;
                row.0.push(block);
            }
            None => {
                let len = block.len;
                rows.push((vec![block], len));
            }
        }
    }
    rows.sort_by_key(|row| std::cmp::Reverse(row.1));
    let mut batches: Vec<MicroBatch> = Vec::new();
    for (row, used) in rows {
        match batches.last_mut() {
            Some(b) if (b.rows.len() + 1) * b.width <= max_tokens => b.rows.push(row),
            _ => batches.push(MicroBatch {
                rows: vec![row],
                width: used,
            }),
        }
    }
    batches
}
