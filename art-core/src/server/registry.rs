//! The trainable models a server holds: registered by clients (`POST /v1/art/models`), each with
//! its directory, store and trainer. Below both the app state and the handlers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::store::ModelStore;
use crate::train::Trainer;
use crate::types::ModelInfo;

use super::error::ApiError;

/// The server's registry of trainable models, by name.
#[derive(Default)]
pub struct Registry {
    pub models: BTreeMap<String, RegisteredModel>,
}

#[derive(Clone)]
pub struct RegisteredModel {
    pub info: ModelInfo,
    pub dir: PathBuf,
    /// The model's directory as ART lays it out: history.jsonl, trajectories, model.json.
    pub store: ModelStore,
    /// Held for a whole training step (or a checkpoint deletion): steps of one model queue here.
    pub trainer: Arc<Mutex<Trainer>>,
    /// The trainer's step, readable while a step is running.
    pub step: Arc<AtomicU64>,
}

impl RegisteredModel {
    pub fn new(info: ModelInfo, dir: PathBuf, store: ModelStore, trainer: Trainer) -> Self {
        RegisteredModel {
            step: Arc::new(AtomicU64::new(info.step)),
            info,
            dir,
            store,
            trainer: Arc::new(Mutex::new(trainer)),
        }
    }

    /// Runs `work` with this model's trainer held (so that no step runs meanwhile), on a
    /// blocking thread: it touches files and may wait for a running step. `what` names the work
    /// in the error a crash of that thread becomes.
    pub async fn with_trainer<T: Send + 'static>(
        &self,
        what: &str,
        work: impl FnOnce(&mut Trainer, &RegisteredModel) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let model = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut trainer = model
                .trainer
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            work(&mut trainer, &model)
        })
        .await
        .map_err(|e| ApiError::internal(format!("{what} stopped: {e}")))?
    }

    pub fn info(&self) -> ModelInfo {
        ModelInfo {
            step: self.step.load(Ordering::SeqCst),
            ..self.info.clone()
        }
    }
}
