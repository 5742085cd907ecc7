//! Continuous batching across HTTP requests. One thread owns the engine's scheduler: between two
//! decode steps it admits newly arrived requests (up to `max_batch` sequences in flight), so 64
//! concurrent rollouts share each forward pass instead of queueing behind each other. Requests
//! wait in a bounded queue; past it the server answers 429 rather than dropping anything.
//! Within the batch, the scheduler starts requests as its key/value cache budget allows and
//! preempts (then resumes) sequences rather than running out of memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::engine::{Engine, GenerationOutput, GenerationRequest, RequestId, TokenEvent};

use super::error::ApiError;

/// What the batcher tells a request's handler.
#[derive(Debug)]
pub enum BatchEvent {
    Token(TokenEvent),
    Done(GenerationOutput),
    /// The engine refused the request (bad parameters) or failed while running it.
    Failed {
        message: String,
        invalid_request: bool,
    },
}

struct Submission {
    request: GenerationRequest,
    events: mpsc::UnboundedSender<BatchEvent>,
}

/// The scheduler's limits (`None`: its default, for the device where it depends on it).
#[derive(Debug, Clone, Copy, Default)]
pub struct SchedulerLimits {
    /// Bytes of keys and values kept for prompts seen before.
    pub prefix_cache_bytes: Option<usize>,
    /// Bytes of the running sequences' keys and values.
    pub kv_cache_bytes: Option<usize>,
    /// Prompt tokens prefilled in one step (a longer prompt is prefilled in chunks while
    /// others decode).
    pub max_prefill_tokens: Option<usize>,
}

/// What the batching thread reports after each step (for `/health`).
#[derive(Debug, Default)]
pub struct BatcherStats {
    /// Sequences started and not finished (preempted ones included), and requests not started.
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// The running sequences' key/value caches, and the budget they share.
    pub kv_cache_bytes: AtomicU64,
    pub kv_cache_budget_bytes: AtomicU64,
    /// Sequences preempted for memory since the server started.
    pub preemptions: AtomicU64,
    /// Requests admitted since the server started.
    pub requests: AtomicU64,
}

impl BatcherStats {
    pub fn to_json(&self) -> serde_json::Value {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mib = |a: &AtomicU64| get(a) as f64 / (1u64 << 20) as f64;
        serde_json::json!({
            "running_sequences": get(&self.running),
            "waiting_requests": get(&self.waiting),
            "kv_cache_mib": (mib(&self.kv_cache_bytes) * 100.0).round() / 100.0,
            "kv_cache_budget_mib": (mib(&self.kv_cache_budget_bytes) * 100.0).round() / 100.0,
            "preemptions": get(&self.preemptions),
            "requests": get(&self.requests),
        })
    }

    /// Sequences running and requests waiting in the scheduler, as of the last step.
    pub fn sequences(&self) -> u64 {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    fn update(&self, scheduler: &crate::engine::Scheduler<'_>, new_preemptions: u64) {
        let set = |a: &AtomicU64, v: usize| a.store(v as u64, Ordering::Relaxed);
        set(&self.running, scheduler.num_running());
        set(&self.waiting, scheduler.num_waiting());
        set(&self.kv_cache_bytes, scheduler.kv_bytes_in_use());
        set(&self.kv_cache_budget_bytes, scheduler.kv_budget());
        self.preemptions
            .fetch_add(new_preemptions, Ordering::Relaxed);
    }
}

/// A handle to the batching thread; cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Submission>,
    capacity: usize,
    stats: Arc<BatcherStats>,
}

impl Batcher {
    /// Starts the batching thread. `max_batch` bounds the sequences decoded together;
    /// `max_queue` the requests waiting for a place.
    pub fn start(
        engine: Arc<Engine>,
        max_batch: usize,
        max_queue: usize,
        limits: SchedulerLimits,
    ) -> Self {
        let (queue, receiver) = mpsc::channel(max_queue.max(1));
        let stats = Arc::new(BatcherStats::default());
        let shared = stats.clone();
        std::thread::Builder::new()
            .name("art-batcher".into())
            .spawn(move || run(&engine, receiver, max_batch.max(1), limits, &shared))
            .expect("the batching thread starts");
        Batcher {
            queue,
            capacity: max_queue.max(1),
            stats,
        }
    }

    /// The batch and its memory as of the last step.
    pub fn stats(&self) -> &BatcherStats {
        &self.stats
    }

    /// Requests submitted and not yet taken by the batching thread.
    pub fn queued(&self) -> usize {
        self.capacity - self.queue.capacity()
    }

    /// Whether the batching thread still takes requests (it stops only by failing).
    pub fn is_running(&self) -> bool {
        !self.queue.is_closed()
    }

    /// Queues a request; its tokens and its result arrive on the returned receiver. Dropping the
    /// receiver (the client went away) cancels the request.
    pub fn submit(
        &self,
        request: GenerationRequest,
    ) -> Result<mpsc::UnboundedReceiver<BatchEvent>, ApiError> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.queue
            .try_send(Submission { request, events })
            .map_err(|error| match error {
                mpsc::error::TrySendError::Full(_) => ApiError::overloaded(self.capacity),
                mpsc::error::TrySendError::Closed(_) => {
                    ApiError::internal("the batching thread has stopped")
                }
            })?;
        Ok(receiver)
    }
}

fn run(
    engine: &Engine,
    mut queue: mpsc::Receiver<Submission>,
    max_batch: usize,
    limits: SchedulerLimits,
    stats: &BatcherStats,
) {
    let new_scheduler = || {
        let mut scheduler = engine.scheduler();
        if let Some(bytes) = limits.prefix_cache_bytes {
            scheduler.set_prefix_cache_budget(bytes);
        }
        if let Some(bytes) = limits.kv_cache_bytes {
            scheduler.set_kv_budget(bytes);
        }
        if let Some(tokens) = limits.max_prefill_tokens {
            scheduler.max_prefill_tokens_per_step = tokens.max(1);
        }
        scheduler
    };
    let mut scheduler = new_scheduler();
    stats.update(&scheduler, 0);
    // Preemptions of the current scheduler already counted in `stats`.
    let mut preemptions_seen = 0;
    let mut clients: HashMap<RequestId, mpsc::UnboundedSender<BatchEvent>> = HashMap::new();
    loop {
        if scheduler.is_idle() {
            // Nothing to do: sleep until a request arrives (or every sender is gone).
            match queue.blocking_recv() {
                Some(submission) => admit(&mut scheduler, &mut clients, submission, stats),
                None => return,
            }
        }
        // Admit what arrived during the last step, while there is room in the batch.
        while scheduler.num_running() + scheduler.num_waiting() < max_batch {
            match queue.try_recv() {
                Ok(submission) => admit(&mut scheduler, &mut clients, submission, stats),
                Err(_) => break,
            }
        }
        // Clients that went away free their place.
        clients.retain(|id, events| {
            let open = !events.is_closed();
            if !open {
                scheduler.cancel(*id);
            }
            open
        });
        if scheduler.is_idle() {
            continue;
        }
        match scheduler.step() {
            Ok(tokens) => {
                for event in tokens {
                    if let Some(client) = clients.get(&event.request) {
                        let _ = client.send(BatchEvent::Token(event));
                    }
                }
            }
            Err(error) => {
                // A failed forward pass leaves the batch's caches unusable: fail what was running.
                let message = format!("generation failed: {error}");
                for (_, client) in clients.drain() {
                    let _ = client.send(BatchEvent::Failed {
                        message: message.clone(),
                        invalid_request: false,
                    });
                }
                scheduler = new_scheduler();
                preemptions_seen = 0;
                stats.update(&scheduler, 0);
                continue;
            }
        }
        for (id, output) in scheduler.take_finished() {
            if let Some(client) = clients.remove(&id) {
                let _ = client.send(BatchEvent::Done(output));
            }
        }
        let preemptions = scheduler.preemptions();
        stats.update(&scheduler, preemptions - preemptions_seen);
        preemptions_seen = preemptions;
        // A sequence too long for the cache budget: the client can ask for fewer tokens.
        for (id, message) in scheduler.take_failed() {
            if let Some(client) = clients.remove(&id) {
                let _ = client.send(BatchEvent::Failed {
                    message,
                    invalid_request: true,
                });
            }
        }
    }
}

fn admit(
    scheduler: &mut crate::engine::Scheduler<'_>,
    clients: &mut HashMap<RequestId, mpsc::UnboundedSender<BatchEvent>>,
    submission: Submission,
    stats: &BatcherStats,
) {
    match scheduler.add(submission.request) {
        Ok(id) => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            clients.insert(id, submission.events);
        }
        Err(error) => {
            let _ = submission.events.send(BatchEvent::Failed {
                message: error.to_string(),
                invalid_request: true,
            });
        }
    }
}
