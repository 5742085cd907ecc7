//! Continuous batching across HTTP requests. One thread owns the engine's scheduler: between two
//! decode steps it admits newly arrived requests (up to `max_batch` sequences in flight), so 64
//! concurrent rollouts share each forward pass instead of queueing behind each other. Requests
//! wait in a bounded queue; past it the server answers 429 rather than dropping anything.

use std::collections::HashMap;
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

/// A handle to the batching thread; cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Submission>,
    capacity: usize,
}

impl Batcher {
    /// Starts the batching thread. `max_batch` bounds the sequences decoded together;
    /// `max_queue` the requests waiting for a place; `prefix_cache_bytes` the keys and values
    /// kept for prompts seen before (`None`: the scheduler's default).
    pub fn start(
        engine: Arc<Engine>,
        max_batch: usize,
        max_queue: usize,
        prefix_cache_bytes: Option<usize>,
    ) -> Self {
        let (queue, receiver) = mpsc::channel(max_queue.max(1));
        std::thread::Builder::new()
            .name("art-batcher".into())
            .spawn(move || run(&engine, receiver, max_batch.max(1), prefix_cache_bytes))
            .expect("the batching thread starts");
        Batcher {
            queue,
            capacity: max_queue.max(1),
        }
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
    prefix_cache_bytes: Option<usize>,
) {
    let new_scheduler = || {
        let mut scheduler = engine.scheduler();
        if let Some(bytes) = prefix_cache_bytes {
            scheduler.set_prefix_cache_budget(bytes);
        }
        scheduler
    };
    let mut scheduler = new_scheduler();
    let mut clients: HashMap<RequestId, mpsc::UnboundedSender<BatchEvent>> = HashMap::new();
    loop {
        if scheduler.is_idle() {
            // Nothing to do: sleep until a request arrives (or every sender is gone).
            match queue.blocking_recv() {
                Some(submission) => admit(&mut scheduler, &mut clients, submission),
                None => return,
            }
        }
        // Admit what arrived during the last step, while there is room in the batch.
        while scheduler.num_running() + scheduler.num_waiting() < max_batch {
            match queue.try_recv() {
                Ok(submission) => admit(&mut scheduler, &mut clients, submission),
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
                continue;
            }
        }
        for (id, output) in scheduler.take_finished() {
            if let Some(client) = clients.remove(&id) {
                let _ = client.send(BatchEvent::Done(output));
            }
        }
    }
}

fn admit(
    scheduler: &mut crate::engine::Scheduler<'_>,
    clients: &mut HashMap<RequestId, mpsc::UnboundedSender<BatchEvent>>,
    submission: Submission,
) {
    match scheduler.add(submission.request) {
        Ok(id) => {
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
