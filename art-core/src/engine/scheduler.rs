//! Continuous batching: requests join and leave a running batch between steps.
//!
//! A [`Scheduler`] owns the sequences in flight. Each [`Scheduler::step`] prefills the requests
//! that arrived since the last step (each gets its first token), then runs one batched decode
//! forward for every other running sequence (one forward per LoRA adapter in use), samples one
//! token for each, and retires the sequences that finished. The server calls `add` as requests
//! come in, `step` in a loop, and `take_finished` to answer them; [`Engine::generate`] is that
//! loop for a fixed set of requests.
//!
//! A step prefills at most `max_prefill_tokens_per_step` new prompt tokens (at least one request
//! always starts). A longer prompt that arrives while others decode is prefilled in chunks, one
//! per step, kept in the prefix cache between steps, so the running sequences are not stalled
//! for it.
//!
//! The sequences' caches share a memory budget ([`Scheduler::set_kv_budget`]). A request starts
//! only when its prompt's caches fit beside the running ones; when the running sequences' next
//! tokens would not fit, the newest are preempted: their caches are dropped, and they resume, before
//! any new request starts, once memory allows, their caches rebuilt from their tokens (the prompt
//! usually from the prefix cache). A preempted sequence keeps its sampler, so it continues exactly
//! as it would have. A request whose one sequence could never fit is refused when it is added.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::constraint::{CompiledConstraint, Guide};
use super::cuda_sample;
use super::error::{EngineError, Result};
use super::lora::LoraAdapter;
use super::model::{grown_capacity, DecodeGraphs, Forward, KvCache};
use super::prefix_cache::{PrefixCache, Reuse, MIN_SHARED_PREFIX, SHARED_PREFIX_BLOCK};
use super::sampler::{DeviceDraw, SampledToken, Sampler, SamplingParams};
use super::text::TextStream;
use super::Engine;

/// One generation request: a tokenized prompt and how to continue it.
#[derive(Debug, Clone, Default)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The name of a registered LoRA adapter ([`Engine::set_adapter`]); `None` = the base model.
    pub adapter: Option<String>,
}

/// Why a completion ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence / stop token, or a stop string.
    Stop,
    /// `max_tokens`, or the model's context length, was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Which of the request's `n` completions this is.
    pub index: usize,
    /// Every generated token with its log-probability, in order. A final end-of-sequence or
    /// stop token is included (a trainer must see it), though not in `text`.
    pub tokens: Vec<SampledToken>,
    /// The decoded text, special tokens skipped, cut before a matched stop string.
    pub text: String,
    pub finish_reason: FinishReason,
}

impl Completion {
    pub fn token_ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.id).collect()
    }

    pub fn logprobs(&self) -> Vec<f32> {
        self.tokens.iter().map(|t| t.logprob).collect()
    }
}

/// The answer to one request: its `n` completions in index order.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOutput {
    pub prompt_tokens: usize,
    /// Prompt tokens not prefilled: found in the prefix cache, or shared with another request.
    pub cached_prompt_tokens: usize,
    pub completions: Vec<Completion>,
}

/// Identifies a request inside one scheduler.
pub type RequestId = u64;

/// A token produced by a step (for streaming).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub request: RequestId,
    pub index: usize,
    pub token: SampledToken,
    /// The completion's text this token released: complete characters, never part of a stop
    /// string (text that may start one waits, and comes with a later token). The deltas of a
    /// completion's events add up to its [`Completion::text`].
    pub text: String,
    /// Set when this token ended the completion.
    pub finished: Option<FinishReason>,
}

struct Sequence {
    request: RequestId,
    index: usize,
    /// The request's prompt (what `cache` holds before the generated tokens).
    prompt: Arc<[u32]>,
    /// The last token, not yet fed to the model.
    next_input: u32,
    /// The most positions its cache will hold: the prompt and `max_tokens`, within the
    /// model's context.
    max_len: usize,
    generated: Vec<SampledToken>,
    cache: KvCache,
    sampler: Sampler,
    adapter: Option<Arc<LoraAdapter>>,
    /// The text of `generated`, decoded once per token.
    text: TextStream,
    finish: Option<(FinishReason, String)>,
    /// The matcher of the request's constraint, if it has one.
    guide: Option<Guide>,
}

impl Sequence {
    /// How many tokens its cache holds while it runs: the prompt and every generated token but
    /// the last (`next_input`, not yet fed to the model).
    fn cached_len(&self) -> usize {
        self.prompt.len() + self.generated.len() - 1
    }

    /// Those tokens.
    fn cached_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        let generated = self.generated.iter().map(|t| t.id);
        self.prompt
            .iter()
            .copied()
            .chain(generated)
            .take(self.cached_len())
    }
}

/// A sequence's sampler, the logits row it samples from, and where its token goes.
type HostDraw<'a> = (&'a mut Sampler, &'a [f32], &'a mut Option<SampledToken>);

/// Samples on the host: in parallel when `parallel` (on a GPU machine, whose host is otherwise
/// idle while it waits; each sequence has its own random stream, so the tokens do not change),
/// else one by one (on the CPU the cores are the model's: with rayon's pool the 256-request load
/// test, tests/server.rs, took 20.9 s instead of 4.6 s on 2 cores).
fn sample_on_host(draws: Vec<HostDraw<'_>>, parallel: bool) {
    if parallel && draws.len() > 1 {
        draws
            .into_par_iter()
            .for_each(|(sampler, row, slot)| *slot = Some(sampler.sample(row)));
    } else {
        for (sampler, row, slot) in draws {
            *slot = Some(sampler.sample(row));
        }
    }
}

/// A request waiting to start, with its adapter.
type Waiting = (RequestId, GenerationRequest, Option<Arc<LoraAdapter>>);

/// Which adapter (by identity; `None`: the base model) a batched forward runs with.
type AdapterKey = Option<*const LoraAdapter>;

fn adapter_key(adapter: Option<&Arc<LoraAdapter>>) -> AdapterKey {
    adapter.map(Arc::as_ptr)
}

/// Where an admitted request's prompt starts (see [`Scheduler::start`]).
enum Start {
    /// Its cache and the logits after its last token: nothing left to prefill.
    Ready(KvCache, Vec<f32>),
    /// A cache (empty, or holding a prefix of the prompt) that the rest of the prompt continues.
    Run(KvCache),
    /// The same prompt and adapter as the admitted request at this index.
    Repeat(usize),
}

struct Pending {
    prompt_tokens: usize,
    cached_prompt_tokens: usize,
    /// Prompt tokens this request prefilled in chunks ahead of its start (they come back from
    /// the prefix cache, but are not cached tokens to the client).
    prefilled_in_chunks: usize,
    completions: Vec<Option<Completion>>,
    /// The compiled constraint, until the request starts.
    constraint: Option<CompiledConstraint>,
}

/// Sequences in flight on one engine. See the module docs.
pub struct Scheduler<'e> {
    engine: &'e Engine,
    waiting: VecDeque<Waiting>,
    running: Vec<Sequence>,
    pending: HashMap<RequestId, Pending>,
    finished: Vec<(RequestId, GenerationOutput)>,
    next_id: RequestId,
    /// Upper bound on prompt tokens prefilled in one step (at least one request always is).
    pub max_prefill_tokens_per_step: usize,
    /// Where the steps spend their time (`ART_PROFILE_DECODE=1`), printed as the work runs out.
    profile: Option<Box<DecodeProfile>>,
    /// The decode step's CUDA graphs, captured as batch sizes and adapters come.
    graphs: DecodeGraphs,
    /// Prompts and finished sequences recently seen, with their keys and values.
    prefix: PrefixCache,
    /// Bytes the running sequences' caches may take together.
    kv_budget: usize,
    /// Sequences put aside for memory, oldest first: their caches dropped, the rest kept.
    preempted: VecDeque<Sequence>,
    /// Sequences preempted so far.
    preemptions: u64,
    /// Requests that failed after they were added, with why, since the last `take_failed`.
    failed: Vec<(RequestId, String)>,
}

/// Time per phase of the scheduler's steps (`ART_PROFILE_DECODE=1`), summed over a busy period
/// (from a first request to running out of work) and printed at its end: with a GRPO client, one
/// line per step's rollouts. The forward is timed to a device synchronisation, which the profile
/// adds.
struct DecodeProfile {
    mark: Instant,
    /// When the busy period began (its first step).
    since: Option<Instant>,
    /// Steps, requests added, and decode forwards (one per adapter group and step) and the rows
    /// they carried.
    steps: usize,
    requests: usize,
    forwards: usize,
    rows: usize,
    /// Seconds: building the batch and the forward, to the device's synchronisation.
    forward: f64,
    /// Device sampling and copying logits (or results) to the host.
    to_host: f64,
    /// Sampling on the host.
    sample: f64,
    /// Recording tokens, stop checks.
    accept: f64,
    /// Prefilling and retiring sequences.
    prefill: f64,
    retire: f64,
    /// Of the prefill: its forwards (one per adapter and prompt length to compute) and their
    /// rows, their time to the logits on the host, copying caches (from and to the prefix cache,
    /// and for each of a prompt's sequences), and sampling the new sequences' first tokens.
    prefill_forwards: usize,
    prefill_rows: usize,
    prefill_forward: f64,
    cache_copies: f64,
    first_tokens: f64,
    /// Sequences preempted for memory, and resumed.
    preempted: usize,
    resumed: usize,
}

impl DecodeProfile {
    fn from_env() -> Option<Box<Self>> {
        super::switches::PROFILE_DECODE
            .on()
            .then(|| Box::new(DecodeProfile::new()))
    }

    fn new() -> Self {
        DecodeProfile {
            mark: Instant::now(),
            since: None,
            steps: 0,
            requests: 0,
            forwards: 0,
            rows: 0,
            forward: 0.0,
            to_host: 0.0,
            sample: 0.0,
            accept: 0.0,
            prefill: 0.0,
            retire: 0.0,
            prefill_forwards: 0,
            prefill_rows: 0,
            prefill_forward: 0.0,
            cache_copies: 0.0,
            first_tokens: 0.0,
            preempted: 0,
            resumed: 0,
        }
    }

    /// Seconds since the last lap.
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let dt = (now - self.mark).as_secs_f64();
        self.mark = now;
        dt
    }

    /// Prints the busy period's totals and starts afresh. The time outside the phases is the
    /// batcher's between steps (admitting requests, sending tokens) and the steps' own glue.
    fn report(&mut self) {
        let Some(since) = self.since else { return };
        let wall = since.elapsed().as_secs_f64();
        let n = self.forwards.max(1) as f64;
        let ms = |s: f64| s * 1e3 / n;
        let phases =
            self.forward + self.to_host + self.sample + self.accept + self.prefill + self.retire;
        eprintln!(
            "PROFILE scheduler: {} requests in {:.3} s, {} steps; {} decode forwards of {:.1} rows, \
             ms each: forward {:.2}, device sampling + copy to host {:.2}, host sampling {:.2}, \
             bookkeeping {:.2}; prefill {:.3} s ({} forwards of {:.1} rows {:.3} s, cache copies \
             {:.3} s, first tokens {:.3} s), retire {:.3} s, outside the phases {:.3} s; \
             preempted {}, resumed {}",
            self.requests,
            wall,
            self.steps,
            self.forwards,
            self.rows as f64 / n,
            ms(self.forward),
            ms(self.to_host),
            ms(self.sample),
            ms(self.accept),
            self.prefill,
            self.prefill_forwards,
            self.prefill_rows as f64 / self.prefill_forwards.max(1) as f64,
            self.prefill_forward,
            self.cache_copies,
            self.first_tokens,
            self.retire,
            (wall - phases).max(0.0),
            self.preempted,
            self.resumed,
        );
        *self = DecodeProfile::new();
    }
}

impl Drop for Scheduler<'_> {
    fn drop(&mut self) {
        if let Some(p) = &mut self.profile {
            p.report();
        }
    }
}

impl<'e> Scheduler<'e> {
    pub fn new(engine: &'e Engine) -> Self {
        Scheduler {
            engine,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: HashMap::new(),
            finished: Vec::new(),
            next_id: 0,
            max_prefill_tokens_per_step: 4096,
            profile: DecodeProfile::from_env(),
            graphs: DecodeGraphs::default(),
            prefix: PrefixCache::new(default_prefix_cache_bytes(engine)),
            kv_budget: default_kv_budget(engine),
            preempted: VecDeque::new(),
            preemptions: 0,
            failed: Vec::new(),
        }
    }

    /// How many bytes the running sequences' caches may take together (see the module docs).
    /// The default is half the GPU's free memory when the scheduler is made, or a quarter of
    /// the machine's available memory on the CPU.
    pub fn set_kv_budget(&mut self, bytes: usize) {
        self.kv_budget = bytes;
    }

    pub fn kv_budget(&self) -> usize {
        self.kv_budget
    }

    /// Bytes the running sequences' caches take now.
    pub fn kv_bytes_in_use(&self) -> usize {
        self.running.iter().map(|s| s.cache.bytes()).sum()
    }

    /// CUDA graphs of the decode step captured so far (see [`DecodeGraphs`]).
    pub fn graph_captures(&self) -> u64 {
        self.graphs.captures()
    }

    /// Sequences preempted for memory since the scheduler was made.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Bytes a sequence's cache takes when it holds `len` tokens after a prefill of `prompt`,
    /// its growth capped at `max_len` positions.
    fn kv_bytes_for(&self, prompt: usize, len: usize, max_len: usize) -> usize {
        let max_len = Some(max_len);
        let mut capacity = grown_capacity(0, prompt, max_len);
        while capacity < len {
            capacity = grown_capacity(capacity, capacity + 1, max_len);
        }
        capacity * self.engine.model().kv_bytes_per_position()
    }

    /// The most positions a sequence of `request` can reach: its prompt and `max_tokens`,
    /// within the model's context.
    fn max_len(&self, request: &GenerationRequest) -> usize {
        let context = self.engine.config().max_position_embeddings;
        (request.prompt.len() + request.params.max_tokens).min(context)
    }

    /// Bytes the prefix cache holds now.
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefix.used_bytes()
    }

    /// How many bytes of keys, values and logits the prefix cache keeps (0 turns prompt sharing
    /// off, even between the requests of one step).
    pub fn set_prefix_cache_budget(&mut self, bytes: usize) {
        self.prefix = PrefixCache::new(bytes);
    }

    /// Queues a request; it starts on the next step. Fails at once on an invalid request
    /// (empty or too long prompt, bad sampling parameters, unknown adapter, bad token id, a
    /// constraint that does not compile).
    pub fn add(&mut self, request: GenerationRequest) -> Result<RequestId> {
        let config = self.engine.config();
        if request.prompt.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the prompt is empty; it needs at least one token".into(),
            ));
        }
        if request.prompt.len() >= config.max_position_embeddings {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; the model's context is {} tokens",
                request.prompt.len(),
                config.max_position_embeddings
            )));
        }
        if let Some(bad) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token id {bad} is outside the vocabulary of {} tokens",
                config.vocab_size
            )));
        }
        request
            .params
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        let prompt = request.prompt.len();
        let longest = self.max_len(&request);
        let needed = self.kv_bytes_for(prompt, longest, longest);
        if needed > self.kv_budget {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt's {prompt} tokens and max_tokens {} need {} MiB of key/value cache, \
                 more than the server's budget of {} MiB (lower max_tokens, or raise the budget: \
                 `art serve --kv-cache-mib`)",
                request.params.max_tokens,
                needed.div_ceil(1 << 20),
                self.kv_budget >> 20
            )));
        }
        let adapter = match &request.adapter {
            None => None,
            Some(name) => Some(self.engine.adapter(name).ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "no LoRA adapter named `{name}` is loaded; loaded: [{}]",
                    self.engine.adapter_names().join(", ")
                ))
            })?),
        };
        let constraint = match &request.params.constraint {
            None => None,
            Some(c) => Some(self.engine.constraint_compiler()?.compile(c)?),
        };
        let id = self.next_id;
        self.next_id += 1;
        self.pending.insert(
            id,
            Pending {
                prompt_tokens: request.prompt.len(),
                cached_prompt_tokens: 0,
                prefilled_in_chunks: 0,
                completions: vec![None; request.params.n],
                constraint,
            },
        );
        self.waiting.push_back((id, request, adapter));
        if let Some(p) = &mut self.profile {
            p.requests += 1;
        }
        Ok(id)
    }

    /// Runs `requests`, added together, until every one is done (with whatever else is queued
    /// here); their outputs in order. A request that fails while running fails the call.
    pub fn generate(&mut self, requests: Vec<GenerationRequest>) -> Result<Vec<GenerationOutput>> {
        let ids = requests
            .into_iter()
            .map(|r| self.add(r))
            .collect::<Result<Vec<_>>>()?;
        let mut done: HashMap<RequestId, GenerationOutput> = HashMap::new();
        while !self.is_idle() {
            self.step()?;
            done.extend(self.take_finished());
            if let Some((_, why)) = self.take_failed().into_iter().next() {
                return Err(EngineError::InvalidRequest(why));
            }
        }
        Ok(ids
            .into_iter()
            .map(|id| done.remove(&id).expect("every request finishes"))
            .collect())
    }

    /// Drops a request, queued or running. Returns whether it was there.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let in_flight = |s: &Self| s.waiting.len() + s.running.len() + s.preempted.len();
        let before = in_flight(self);
        self.waiting.retain(|(r, _, _)| *r != id);
        self.running.retain(|s| s.request != id);
        self.preempted.retain(|s| s.request != id);
        let was_pending = self.pending.remove(&id).is_some();
        was_pending || before != in_flight(self)
    }

    /// Sequences started and not finished (completions, not requests), preempted ones included.
    pub fn num_running(&self) -> usize {
        self.running.len() + self.preempted.len()
    }

    /// Requests not started yet.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Nothing queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.preempted.is_empty()
    }

    /// Requests whose completions have all finished, since the last call.
    pub fn take_finished(&mut self) -> Vec<(RequestId, GenerationOutput)> {
        std::mem::take(&mut self.finished)
    }

    /// Requests that failed while running, with why, since the last call. (Only a sequence that
    /// outgrows the memory budget alone does: [`Scheduler::add`] refuses one that would.)
    pub fn take_failed(&mut self) -> Vec<(RequestId, String)> {
        std::mem::take(&mut self.failed)
    }

    /// Advances every sequence by one token (see the module docs). Returns the new tokens.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        let mut events = Vec::new();
        if let Some(p) = &mut self.profile {
            p.lap();
            p.since.get_or_insert(p.mark);
            p.steps += 1;
        }
        self.make_room_to_decode();
        // Decode the sequences that were already running before this step's prefills.
        let decode_count = self.running.len();
        self.decode(decode_count, &mut events)?;
        if let Some(p) = &mut self.profile {
            p.lap();
        }
        self.prefill(&mut events)?;
        if let Some(p) = &mut self.profile {
            p.prefill += p.lap();
        }
        self.retire();
        if let Some(p) = &mut self.profile {
            p.retire += p.lap();
            if self.waiting.is_empty() && self.running.is_empty() && self.preempted.is_empty() {
                p.report();
            }
        }
        Ok(events)
    }

    fn forward_options<'a>(&self, adapter: Option<&'a LoraAdapter>) -> Forward<'a> {
        Forward {
            adapter,
            train: false,
            quantized: self.engine.use_quantized(),
        }
    }

    /// Starts waiting requests, up to the step's prefill budget (at least one request); a
    /// prompt's tokens found in the prefix cache, or repeating a request admitted before it in
    /// this step, do not count against it.
    /// Preempted sequences resume first, oldest first, as memory allows; a new request starts
    /// only when none waits to resume and its sequences' caches fit beside the running ones (or
    /// nothing runs: its sequences beyond the budget then start preempted).
    fn prefill(&mut self, events: &mut Vec<TokenEvent>) -> Result<()> {
        self.resume_preempted()?;
        if !self.preempted.is_empty() {
            return Ok(());
        }
        let mut budget = self.max_prefill_tokens_per_step;
        let mut memory = self.kv_budget.saturating_sub(self.kv_bytes_in_use());
        let mut admitted = Vec::new();
        let mut seen: HashSet<(AdapterKey, Vec<u32>)> = HashSet::new();
        while let Some((_, request, adapter)) = self.waiting.front() {
            let key = (adapter_key(adapter.as_ref()), request.prompt.clone());
            let new_tokens = if self.prefix.enabled() && seen.contains(&key) {
                0
            } else {
                request.prompt.len() - self.prefix.reusable(adapter.as_ref(), &request.prompt)
            };
            if !admitted.is_empty() && new_tokens > budget {
                break;
            }
            // A prompt longer than the step's budget while others decode: a chunk of it now,
            // the rest in later steps, so that the running sequences are not stalled for it.
            let reused = request.prompt.len() - new_tokens;
            if admitted.is_empty()
                && new_tokens > budget
                && !self.running.is_empty()
                && self.prefill_chunk(reused, budget)?
            {
                return Ok(());
            }
            let (_, request, _) = self.waiting.front().expect("checked above");
            let prompt = request.prompt.len();
            let caches =
                request.params.n * self.kv_bytes_for(prompt, prompt + 1, self.max_len(request));
            let idle = admitted.is_empty() && self.running.is_empty();
            if caches > memory && !idle {
                break;
            }
            memory = memory.saturating_sub(caches);
            budget = budget.saturating_sub(new_tokens);
            seen.insert(key);
            admitted.push(self.waiting.pop_front().expect("checked above"));
        }
        if admitted.is_empty() {
            return Ok(());
        }
        self.start(admitted, events)
    }

    /// Chunked prefill: computes the `budget` tokens (in whole blocks) after the first `start`
    /// of the first waiting request's prompt (`start`: what the prefix cache holds of it, its
    /// [`PrefixCache::reusable`] length) and keeps them there too, where the request, still
    /// first in line, finds them at the next step. False (nothing done) when there is no whole block to
    /// compute before the prompt's last token, or the prefix cache could not keep the chunk: the
    /// prompt is then prefilled whole.
    fn prefill_chunk(&mut self, start: usize, budget: usize) -> Result<bool> {
        let (id, request, adapter) = self.waiting.front().expect("called with a waiting request");
        let (id, adapter) = (*id, adapter.clone());
        let prompt = request.prompt.clone();
        let model = self.engine.model();
        // Whole blocks, so that the next step reuses all of it; the last token is left to the
        // request's start, which needs its logits.
        let end = (start + budget).min(prompt.len() - 1);
        let end = end - end % SHARED_PREFIX_BLOCK;
        // (A chunk shorter than the prefix cache's shortest reuse would never be found again.)
        let kept_bytes = end * model.kv_bytes_per_position();
        if end <= start || end < MIN_SHARED_PREFIX || kept_bytes > self.prefix.budget_bytes() {
            return Ok(false);
        }
        let timer = Instant::now();
        // (Copied tight into the prefix cache below: no room to grow past the prompt.)
        let mut cache = match self.prefix.reuse(adapter.as_ref(), &prompt, prompt.len())? {
            Some(reuse) => reuse.cache,
            None => model.new_cache(),
        };
        debug_assert_eq!(cache.len(), start);
        let input = Tensor::new(&prompt[start..end], model.device())?.unsqueeze(0)?;
        let fwd = self.forward_options(adapter.as_deref());
        model.forward_cached(&input, &mut [&mut cache], fwd, true)?;
        let kept = cache.copy_prefix(end, end)?;
        let engine = self.engine;
        self.prefix
            .insert(adapter.as_ref(), prompt[..end].to_vec(), kept, None, |a| {
                engine.is_loaded(a)
            });
        if let Some(pending) = self.pending.get_mut(&id) {
            pending.prefilled_in_chunks += end - start;
        }
        if let Some(p) = &mut self.profile {
            p.prefill_forwards += 1;
            p.prefill_rows += 1;
            p.prefill_forward += timer.elapsed().as_secs_f64();
        }
        Ok(true)
    }

    /// Prefills the admitted requests and starts their sequences, each with its first token.
    /// A request finds where to start in the prefix cache, or repeats an earlier request of this
    /// step; the rest run in one batched forward per adapter and number of tokens to prefill.
    fn start(&mut self, admitted: Vec<Waiting>, events: &mut Vec<TokenEvent>) -> Result<()> {
        let model = self.engine.model();
        // Seconds spent copying caches (for the profile).
        let mut copies = 0.0;
        let timer = Instant::now();
        let mut starts: Vec<Start> = Vec::with_capacity(admitted.len());
        let mut first_of: HashMap<(AdapterKey, &[u32]), usize> = HashMap::new();
        for (i, (_, request, adapter)) in admitted.iter().enumerate() {
            let key = (adapter_key(adapter.as_ref()), request.prompt.as_slice());
            if let Some(&first) = first_of.get(&key) {
                starts.push(Start::Repeat(first));
                continue;
            }
            if self.prefix.enabled() {
                first_of.insert(key, i);
            }
            let max_len = self.max_len(request);
            starts.push(
                match self
                    .prefix
                    .reuse(adapter.as_ref(), &request.prompt, max_len)?
                {
                    Some(Reuse {
                        cache,
                        logits: Some(logits),
                    }) => Start::Ready(cache, logits),
                    Some(Reuse {
                        cache,
                        logits: None,
                    }) => Start::Run(cache),
                    None => {
                        let mut cache = model.new_cache();
                        cache.set_max_len(max_len);
                        Start::Run(cache)
                    }
                },
            );
        }
        copies += timer.elapsed().as_secs_f64();
        let cached_tokens: Vec<usize> = starts
            .iter()
            .zip(&admitted)
            .map(|(start, (_, request, _))| match start {
                Start::Run(cache) => cache.len(),
                Start::Ready(..) | Start::Repeat(_) => request.prompt.len(),
            })
            .collect();

        // One forward per adapter and cache length (each row continues its own cache), the
        // rows right-padded to the longest (see `padded_batches`).
        // `(index, new tokens)` of the rows of each adapter and cache length.
        type Rows = Vec<(usize, usize)>;
        let mut groups: Vec<((AdapterKey, usize), Rows)> = Vec::new();
        for (i, start) in starts.iter().enumerate() {
            if let Start::Run(cache) = start {
                let (_, request, adapter) = &admitted[i];
                let key = (adapter_key(adapter.as_ref()), cache.len());
                let row = (i, request.prompt.len() - cache.len());
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, rows)) => rows.push(row),
                    None => groups.push((key, vec![row])),
                }
            }
        }
        let engine = self.engine;
        for (members, lens) in groups
            .into_iter()
            .flat_map(|(_, rows)| padded_batches(rows))
        {
            let width = lens.iter().copied().max().expect("batches are not empty");
            // (Each member's place holds a placeholder until its prefill is done, below.)
            let mut caches: Vec<KvCache> = members
                .iter()
                .map(
                    |&i| match std::mem::replace(&mut starts[i], Start::Repeat(i)) {
                        Start::Run(cache) => cache,
                        _ => unreachable!("batches hold requests to run"),
                    },
                )
                .collect();
            let mut ids: Vec<u32> = Vec::with_capacity(members.len() * width);
            for (&i, cache) in members.iter().zip(&caches) {
                let new = &admitted[i].1.prompt[cache.len()..];
                ids.extend_from_slice(new);
                ids.resize(ids.len() + width - new.len(), 0);
            }
            let input = Tensor::from_vec(ids, (members.len(), width), model.device())?;
            let adapter = admitted[members[0]].2.as_ref();
            let timer = Instant::now();
            let logits = {
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let fwd = self.forward_options(adapter.map(Arc::as_ref));
                model.forward_prefill(&input, &lens, &mut refs, fwd)?
            };
            let rows: Vec<Vec<f32>> = logits.squeeze(1)?.to_vec2()?;
            if let Some(p) = &mut self.profile {
                p.prefill_forwards += 1;
                p.prefill_rows += members.len();
                p.prefill_forward += timer.elapsed().as_secs_f64();
            }
            let timer = Instant::now();
            for ((&i, cache), row) in members.iter().zip(caches).zip(rows) {
                let prompt = &admitted[i].1.prompt;
                let kept = cache.copy_prefix(prompt.len(), prompt.len())?;
                self.prefix
                    .insert(adapter, prompt.clone(), kept, Some(row.clone()), |a| {
                        engine.is_loaded(a)
                    });
                starts[i] = Start::Ready(cache, row);
            }
            copies += timer.elapsed().as_secs_f64();
        }

        // Every request's `n` sequences, each with its own copy of the prompt's cache (the last
        // user of a cache takes it).
        let mut uses = vec![0usize; admitted.len()];
        // The new sequences with their first logits (and whether they start preempted), and the
        // bytes the batch's caches take with theirs.
        let mut new: Vec<(Sequence, Vec<f32>, bool)> = Vec::new();
        let mut in_use = self.kv_bytes_in_use();
        let timer = Instant::now();
        for (i, start) in starts.iter().enumerate() {
            let source = match start {
                Start::Repeat(first) => *first,
                _ => i,
            };
            uses[source] += admitted[i].1.params.n;
        }
        for (i, ((id, request, adapter), cached)) in
            admitted.into_iter().zip(cached_tokens).enumerate()
        {
            let source = match starts[i] {
                Start::Repeat(first) => first,
                _ => i,
            };
            let constraint = self.pending.get_mut(&id).and_then(|pending| {
                pending.cached_prompt_tokens = cached.saturating_sub(pending.prefilled_in_chunks);
                pending.constraint.take()
            });
            let max_len = self.max_len(&request);
            let prompt: Arc<[u32]> = request.prompt.into();
            for index in 0..request.params.n {
                let Start::Ready(cache, row) = &mut starts[source] else {
                    unreachable!("every request to run was run");
                };
                let row = row.clone();
                uses[source] -= 1;
                // A copy has room for its first decoded token already (no second copy to grow
                // it), within what this request can reach (a repeated prompt's request may
                // stop sooner than the first's).
                let len = cache.len();
                let copy_capacity =
                    grown_capacity(cache.capacity().min(max_len), len + 1, Some(max_len));
                let copy_bytes = copy_capacity * model.kv_bytes_per_position();
                // A copy that would pass the budget is not made: the sequence starts preempted
                // (its first token sampled), and its cache is rebuilt when memory allows.
                let fits = in_use == 0 || in_use + copy_bytes <= self.kv_budget;
                let (mut cache, preempted) = if uses[source] == 0 {
                    (std::mem::take(cache), false)
                } else if fits {
                    (cache.copy_prefix(len, copy_capacity)?, false)
                } else {
                    (model.new_cache(), true)
                };
                cache.set_max_len(max_len);
                in_use += cache.bytes();
                let seq = Sequence {
                    request: id,
                    index,
                    prompt: prompt.clone(),
                    next_input: 0,
                    max_len,
                    generated: Vec::new(),
                    cache,
                    sampler: Sampler::new(request.params.clone(), index),
                    adapter: adapter.clone(),
                    text: TextStream::new(&request.params.stop),
                    finish: None,
                    guide: constraint.as_ref().map(CompiledConstraint::start),
                };
                new.push((seq, row, preempted));
            }
        }
        copies += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        // The unconstrained first tokens together; constrained ones are masked first, below.
        let mut first: Vec<Option<SampledToken>> = vec![None; new.len()];
        let draws: Vec<HostDraw> = new
            .iter_mut()
            .zip(first.iter_mut())
            .filter(|((seq, _, _), _)| seq.guide.is_none())
            .map(|((seq, row, _), slot)| (&mut seq.sampler, row.as_slice(), slot))
            .collect();
        sample_on_host(draws, model.device().is_cuda());
        for ((mut seq, mut row, preempted), token) in new.into_iter().zip(first) {
            match token {
                Some(token) => self.engine.accept_sampled(&mut seq, token, events),
                None => self.engine.sample_and_accept(&mut seq, &mut row, events),
            }
            if preempted && seq.finish.is_none() {
                self.count_preemption();
                self.preempted.push_back(seq);
            } else {
                self.running.push(seq);
            }
        }
        if let Some(p) = &mut self.profile {
            p.first_tokens += timer.elapsed().as_secs_f64();
            p.cache_copies += copies;
        }
        Ok(())
    }

    fn count_preemption(&mut self) {
        self.preemptions += 1;
        if let Some(p) = &mut self.profile {
            p.preempted += 1;
        }
    }

    /// Preempts the newest running sequences until every other one's cache can take its next
    /// token within the budget. A sequence that cannot even alone fails its request (`add`
    /// refuses requests that could get there, so this is a last resort).
    fn make_room_to_decode(&mut self) {
        let per_position = self.engine.model().kv_bytes_per_position();
        let next = |s: &Sequence| per_position * s.cache.grown_for(s.cache.len() + 1);
        let mut needed: usize = self.running.iter().map(next).sum();
        while needed > self.kv_budget {
            // `running` is in arrival order (see `retire`): the last is the newest.
            let Some(mut seq) = self.running.pop() else {
                return;
            };
            needed -= next(&seq);
            if self.running.is_empty() {
                let message = format!(
                    "the completion needs {} MiB of key/value cache for its {} tokens, more than \
                     the server's budget of {} MiB",
                    next(&seq).div_ceil(1 << 20),
                    seq.cache.len() + 1,
                    self.kv_budget >> 20
                );
                self.fail_request(seq.request, message);
                return;
            }
            seq.cache = self.engine.model().new_cache();
            self.count_preemption();
            // Before the ones preempted earlier in this step: they are older, and resume first.
            let at = self
                .preempted
                .iter()
                .position(|p| (p.request, p.index) > (seq.request, seq.index))
                .unwrap_or(self.preempted.len());
            self.preempted.insert(at, seq);
        }
    }

    /// Drops a request's sequences and reports it failed.
    fn fail_request(&mut self, id: RequestId, message: String) {
        self.cancel(id);
        self.failed.push((id, message));
    }

    /// Rebuilds the caches of preempted sequences, oldest first, while they fit beside the
    /// running ones (the first always does when nothing runs), and returns them to the batch.
    fn resume_preempted(&mut self) -> Result<()> {
        let model = self.engine.model();
        while let Some(seq) = self.preempted.front() {
            let len = seq.cached_len();
            let needed = self.kv_bytes_for(len, len + 1, seq.max_len);
            if !self.running.is_empty() && self.kv_bytes_in_use() + needed > self.kv_budget {
                break;
            }
            let mut seq = self.preempted.pop_front().expect("checked above");
            let tokens: Vec<u32> = seq.cached_tokens().collect();
            let mut cache = match self
                .prefix
                .reuse(seq.adapter.as_ref(), &tokens, seq.max_len)?
            {
                Some(reuse) => reuse.cache,
                None => model.new_cache(),
            };
            cache.set_max_len(seq.max_len);
            if cache.len() < tokens.len() {
                let rest = &tokens[cache.len()..];
                let input = Tensor::new(rest, model.device())?.unsqueeze(0)?;
                let fwd = self.forward_options(seq.adapter.as_deref());
                // Only the cache is wanted: the logits after the last token were sampled before.
                model.forward_cached(&input, &mut [&mut cache], fwd, true)?;
            }
            seq.cache = cache;
            self.running.push(seq);
            if let Some(p) = &mut self.profile {
                p.resumed += 1;
            }
        }
        Ok(())
    }

    /// One batched forward per adapter over the first `count` running sequences.
    fn decode(&mut self, count: usize, events: &mut Vec<TokenEvent>) -> Result<()> {
        let mut groups: Vec<(AdapterKey, Vec<usize>)> = Vec::new();
        for (i, seq) in self.running[..count].iter().enumerate() {
            if seq.finish.is_some() {
                continue;
            }
            let key = adapter_key(seq.adapter.as_ref());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        let model = self.engine.model();
        for (_, members) in groups {
            if let Some(p) = &mut self.profile {
                p.forwards += 1;
            }
            let adapter = self.running[members[0]].adapter.clone();
            let inputs: Vec<u32> = members
                .iter()
                .map(|&i| self.running[i].next_input)
                .collect();
            let logits = {
                let mut caches: Vec<&mut KvCache> = Vec::with_capacity(members.len());
                // Borrow the member sequences' caches mutably, in `members` order.
                let mut rest: &mut [Sequence] = &mut self.running[..];
                let mut offset = 0;
                for &i in &members {
                    let (_, tail) = rest.split_at_mut(i - offset);
                    let (seq, tail) = tail.split_first_mut().unwrap();
                    caches.push(&mut seq.cache);
                    rest = tail;
                    offset = i + 1;
                }
                let quantized = self.engine.use_quantized();
                let replayed = model.forward_decode_graph(
                    &mut self.graphs,
                    self.engine.device_gate(),
                    &inputs,
                    &mut caches,
                    adapter.as_ref(),
                    quantized,
                )?;
                match replayed {
                    Some(logits) => logits,
                    None => {
                        let input = Tensor::new(inputs.as_slice(), model.device())?.unsqueeze(1)?;
                        let fwd = Forward {
                            adapter: adapter.as_deref(),
                            train: false,
                            quantized,
                        };
                        model.forward_cached(&input, &mut caches, fwd, true)?
                    }
                }
            };
            if let Some(p) = &mut self.profile {
                model.device().synchronize()?;
                p.forward += p.lap();
                p.rows += members.len();
            }
            let logits = logits.squeeze(1)?;
            let mut drawn: Vec<Option<SampledToken>> = vec![None; members.len()];
            // On the GPU, rows with neither a constraint nor truncation are sampled where their
            // logits are (`cuda_sample`): a few numbers per row come back, not the vocabulary.
            if model.device().is_cuda() && cuda_sample::enabled() {
                let draws: Vec<Option<DeviceDraw>> = members
                    .iter()
                    .map(|&i| {
                        let seq = &mut self.running[i];
                        match seq.guide {
                            None => seq.sampler.device_draw(),
                            Some(_) => None,
                        }
                    })
                    .collect();
                if draws.iter().any(Option::is_some) {
                    let results = cuda_sample::sample(&logits, &draws)?;
                    for ((slot, draw), result) in drawn.iter_mut().zip(&draws).zip(results) {
                        if let (Some(draw), Some(result)) = (draw, result) {
                            *slot = Some(draw.token(result));
                        }
                    }
                }
            }
            // The other rows are sampled on the host: copy just those.
            let host: Vec<usize> = (0..members.len()).filter(|&r| drawn[r].is_none()).collect();
            let mut rows: Vec<Vec<f32>> = if host.is_empty() {
                Vec::new()
            } else if host.len() == members.len() {
                logits.to_dtype(DType::F32)?.to_vec2()?
            } else {
                let picked: Vec<u32> = host.iter().map(|&r| r as u32).collect();
                let picked = Tensor::new(picked.as_slice(), model.device())?;
                logits
                    .index_select(&picked, 0)?
                    .to_dtype(DType::F32)?
                    .to_vec2()?
            };
            if let Some(p) = &mut self.profile {
                p.to_host += p.lap();
            }
            // Sampling reads a whole vocabulary row a few times per sequence: for a large batch
            // and vocabulary that is milliseconds per row, so the unconstrained rows left to the
            // host (top-k, top-p, top log-probabilities, or `ART_GPU_SAMPLE=0`) are sampled
            // together, in parallel on a GPU machine (`sample_on_host`).
            let mut host_row = vec![None; members.len()];
            for (j, &r) in host.iter().enumerate() {
                host_row[r] = Some(j);
            }
            {
                let mut is_member = vec![None; self.running.len()];
                for (r, &i) in members.iter().enumerate() {
                    is_member[i] = Some(r);
                }
                let mut draws: Vec<HostDraw> = Vec::new();
                let mut slots: Vec<Option<&mut Option<SampledToken>>> =
                    drawn.iter_mut().map(Some).collect();
                for (seq, r) in self.running.iter_mut().zip(&is_member) {
                    let Some(r) = *r else { continue };
                    if let (Some(j), None) = (host_row[r], &seq.guide) {
                        let slot = slots[r].take().expect("one slot per row");
                        draws.push((&mut seq.sampler, rows[j].as_slice(), slot));
                    }
                }
                sample_on_host(draws, model.device().is_cuda());
            }
            if let Some(p) = &mut self.profile {
                p.sample += p.lap();
            }
            for ((&i, token), j) in members.iter().zip(drawn).zip(host_row) {
                match token {
                    Some(token) => self
                        .engine
                        .accept_sampled(&mut self.running[i], token, events),
                    None => {
                        let row = &mut rows[j.expect("a host row for every row not drawn")];
                        self.engine
                            .sample_and_accept(&mut self.running[i], row, events)
                    }
                }
            }
            if let Some(p) = &mut self.profile {
                p.accept += p.lap();
            }
        }
        Ok(())
    }

    /// Moves a finished sequence's keys and values to the prefix cache: an agent's next turn
    /// sends this conversation again, with more after it.
    fn keep_for_next_turn(&mut self, seq: &mut Sequence) {
        let len = seq.cache.len();
        if len <= MIN_SHARED_PREFIX {
            return;
        }
        let generated = seq.generated.iter().map(|t| t.id);
        let tokens: Vec<u32> = seq
            .prompt
            .iter()
            .copied()
            .chain(generated)
            .take(len)
            .collect();
        let engine = self.engine;
        let cache = std::mem::take(&mut seq.cache);
        self.prefix
            .insert(seq.adapter.as_ref(), tokens, cache, None, |a| {
                engine.is_loaded(a)
            });
    }

    /// Moves finished sequences out of the batch, and finished requests to `finished`.
    fn retire(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_none() {
                i += 1;
                continue;
            }
            let mut seq = self.running.swap_remove(i);
            self.keep_for_next_turn(&mut seq);
            let (finish_reason, text) = seq.finish.expect("checked above");
            let Some(pending) = self.pending.get_mut(&seq.request) else {
                continue;
            };
            pending.completions[seq.index] = Some(Completion {
                index: seq.index,
                tokens: seq.generated,
                text,
                finish_reason,
            });
            if pending.completions.iter().all(Option::is_some) {
                let pending = self.pending.remove(&seq.request).unwrap();
                self.finished.push((
                    seq.request,
                    GenerationOutput {
                        prompt_tokens: pending.prompt_tokens,
                        cached_prompt_tokens: pending.cached_prompt_tokens,
                        completions: pending.completions.into_iter().flatten().collect(),
                    },
                ));
            }
        }
        // Keep the batch in arrival order (swap_remove shuffles it); decode order does not affect
        // results, but a stable order keeps runs easy to follow.
        self.running.sort_by_key(|s| (s.request, s.index));
    }
}

/// Splits a prefill's rows (`(index, new tokens)`, all continuing caches of one length) into
/// batches of one forward each, `(indices, lengths)`: rows of similar lengths together, so that
/// right-padding them to the longest adds at most a fifth to the positions they hold. Prompts
/// arrive with a few tokens' difference (one forward instead of one per length: each prefill
/// forward of a small model on a GPU is launch-bound, ~35 ms), rarely with ten times as many.
fn padded_batches(mut rows: Vec<(usize, usize)>) -> Vec<(Vec<usize>, Vec<usize>)> {
    rows.sort_by_key(|&(_, len)| len);
    let mut batches: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    let mut tokens = 0;
    for (i, len) in rows {
        // Sorted, so `len` is the batch's longest row if it joins.
        let fits = batches
            .last()
            .is_some_and(|(members, _)| 5 * len * (members.len() + 1) <= 6 * (tokens + len));
        if !fits {
            batches.push((Vec::new(), Vec::new()));
            tokens = 0;
        }
        let (members, lens) = batches.last_mut().expect("pushed above");
        members.push(i);
        lens.push(len);
        tokens += len;
    }
    batches
}

/// The prefix cache's default budget: a small share of a CPU machine's memory, more on a GPU
/// (its memory is the card's, and GRPO groups of long prompts are what it serves).
fn default_prefix_cache_bytes(engine: &Engine) -> usize {
    const MIB: usize = 1 << 20;
    if engine.model().device().is_cuda() {
        2048 * MIB
    } else {
        256 * MIB
    }
}

/// The running caches' default budget: half the GPU's free memory (the trainer and the prefix
/// cache need the rest), or a quarter of the memory the machine has available.
fn default_kv_budget(engine: &Engine) -> usize {
    const GIB: usize = 1 << 30;
    match super::gpu_memory(engine.model().device()) {
        Some((free, _)) => free / 2,
        None => super::gpu::available_host_memory().map_or(4 * GIB, |bytes| bytes / 4),
    }
}

impl Engine {
    /// Samples `seq`'s next token from its logits `row` (masked first by its constraint, if any)
    /// and records it. A constrained sequence whose grammar admits nothing more also gets an
    /// end-of-sequence token (logprob 0: it was the only allowed token), room permitting.
    fn sample_and_accept(&self, seq: &mut Sequence, row: &mut [f32], events: &mut Vec<TokenEvent>) {
        if let Some(guide) = &mut seq.guide {
            guide.mask(row);
        }
        let token = seq.sampler.sample(row);
        self.accept_sampled(seq, token, events);
    }

    /// Records `token`, just sampled for `seq` from its (masked) logits; see
    /// [`Engine::sample_and_accept`].
    fn accept_sampled(
        &self,
        seq: &mut Sequence,
        token: SampledToken,
        events: &mut Vec<TokenEvent>,
    ) {
        if let Some(guide) = &mut seq.guide {
            guide.advance(token.id);
        }
        events.push(self.accept(seq, token));
        if seq.finish.is_some() {
            return;
        }
        if let Some(eos) = seq.guide.as_ref().and_then(Guide::end_token) {
            let top_logprobs = if seq.sampler.params().top_logprobs > 0 {
                vec![(eos, 0.0)]
            } else {
                Vec::new()
            };
            let token = SampledToken {
                id: eos,
                logprob: 0.0,
                top_logprobs,
            };
            events.push(self.accept(seq, token));
        }
    }

    /// Records a sampled token on `seq` and decides whether the sequence is done.
    fn accept(&self, seq: &mut Sequence, token: SampledToken) -> TokenEvent {
        let params = seq.sampler.params();
        let id = token.id;
        seq.generated.push(token.clone());
        seq.next_input = id;
        // A constraint decides where the completion ends, so `ignore_eos` does not apply to it.
        let eos_stops = !params.ignore_eos || seq.guide.is_some();
        let is_stop_id = (eos_stops && self.eos_token_ids().contains(&id))
            || params.stop_token_ids.contains(&id);
        // A stop token is not text; any other token may complete a stop string.
        let stopped = is_stop_id || seq.text.push(self.tokenizer(), id);
        let mut finish = stopped.then_some(FinishReason::Stop);
        let context_full = seq.cache.len() + 1 >= self.config().max_position_embeddings;
        if finish.is_none() && (seq.generated.len() >= params.max_tokens || context_full) {
            // A grammar completed on the last allowed token is a stop, not a cut.
            let complete = seq.guide.as_ref().is_some_and(Guide::is_complete);
            finish = Some(if complete {
                FinishReason::Stop
            } else {
                seq.text.flush(self.tokenizer());
                FinishReason::Length
            });
        }
        let text = seq.text.take_delta(finish.is_some());
        if let Some(reason) = finish {
            seq.finish = Some((reason, seq.text.text().to_string()));
        }
        TokenEvent {
            request: seq.request,
            index: seq.index,
            token,
            text,
            finished: finish,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::padded_batches;

    #[test]
    fn rows_of_similar_lengths_share_a_padded_batch() {
        let batches = padded_batches(vec![(0, 50), (1, 48), (2, 500), (3, 52), (4, 1), (5, 49)]);
        let lens: Vec<Vec<usize>> = batches.iter().map(|(_, lens)| lens.clone()).collect();
        assert_eq!(lens, vec![vec![1], vec![48, 49, 50, 52], vec![500]]);
        assert_eq!(batches[1].0, vec![1, 5, 0, 3]);
        for (_, lens) in &batches {
            let real: usize = lens.iter().sum();
            assert!(5 * lens.len() * lens.iter().max().unwrap() <= 6 * real);
        }
    }
}
