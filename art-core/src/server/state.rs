//! What every handler shares: the engine, its chat template, the inference replicas, and the
//! served names.

use std::ops::Deref;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::engine::chat_template::ChatTemplate;
use crate::engine::Engine;

use super::error::ApiError;
use super::jobs::Jobs;
use super::registry::{RegisteredModel, Registry};
use super::replicas::Replicas;

/// How ART's ServerlessBackend names trained models for inference.
const ARTIFACT_SCHEME: &str = "wandb-artifact:///";

#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    /// The trainer's engine (the first replica's): adapters are trained and registered here.
    pub engine: Arc<Engine>,
    /// The other devices' engines that train data-parallel with `engine`.
    pub train_engines: Vec<Arc<Engine>>,
    pub template: Option<ChatTemplate>,
    /// The model once per device, each with its batching thread; the first is `engine`.
    pub replicas: Replicas,
    /// The name the base model is served under.
    pub base_model: String,
    /// Other names that mean the base model (e.g. the path it was loaded from).
    pub aliases: Vec<String>,
    pub api_key: Option<String>,
    pub default_max_tokens: usize,
    pub art_dir: PathBuf,
    pub registry: Mutex<Registry>,
    /// Training jobs of the ServerlessBackend API.
    pub jobs: Jobs,
}

impl Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl AppState {
    pub fn new(shared: Shared) -> Self {
        AppState(Arc::new(shared))
    }

    /// The LoRA adapter a request's `model` names: `None` for the base model, `Some(name)` for
    /// `name@step` or `name` (a trained model's latest step). Unknown names are a 404.
    /// ART's ServerlessBackend names a trained model `wandb-artifact:///{entity}/{project}/{name}`,
    /// with `:step{N}` for a checkpoint: that is `name` (or `name@N`) of the model registered in
    /// that project.
    pub fn resolve_model(&self, requested: &str) -> Result<Option<String>, ApiError> {
        if requested.is_empty() || self.is_base_model(requested) {
            return Ok(None);
        }
        if let Some(path) = requested.strip_prefix(ARTIFACT_SCHEME) {
            return self.resolve_artifact(requested, path);
        }
        if self.engine.adapter(requested).is_some() {
            return Ok(Some(requested.to_string()));
        }
        if self.is_trainable(requested) {
            // Registered but not trained yet: its policy is the base model.
            return Ok(None);
        }
        Err(ApiError::model_not_found(requested, &self.model_ids()))
    }

    fn resolve_artifact(&self, requested: &str, path: &str) -> Result<Option<String>, ApiError> {
        let (path, version) = path.split_once(':').unwrap_or((path, "latest"));
        let not_found = || ApiError::model_not_found(requested, &self.model_ids());
        let mut parts = path.split('/');
        let (Some(_entity), Some(project), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(ApiError::invalid_param(
                "model",
                format!(
                    "`{requested}` is not `{ARTIFACT_SCHEME}<entity>/<project>/<name>[:step<N>]`"
                ),
            ));
        };
        let model = self.registered(name).ok_or_else(not_found)?;
        if model.info.project != project {
            return Err(not_found());
        }
        if version == "latest" {
            return self.resolve_model(name);
        }
        match version
            .strip_prefix("step")
            .and_then(|n| n.parse::<u64>().ok())
        {
            // Step 0 is the base model, before any training.
            Some(0) => Ok(None),
            Some(step) => self.resolve_model(&format!("{name}@{step}")).map_err(|_| {
                ApiError::model_not_found(
                    requested,
                    &crate::train::list_checkpoints(&model.dir)
                        .iter()
                        .map(|s| format!("{ARTIFACT_SCHEME}{path}:step{s}"))
                        .collect::<Vec<_>>(),
                )
            }),
            None => Err(ApiError::invalid_param(
                "model",
                format!("`{version}` in `{requested}` is neither `latest` nor `step<N>`"),
            )),
        }
    }

    /// Whether `name` means the served base model: its served name or one of its aliases.
    pub fn is_base_model(&self, name: &str) -> bool {
        name == self.base_model || self.aliases.iter().any(|a| a == name)
    }

    /// The base model's names, the served one first.
    pub fn base_model_names(&self) -> Vec<String> {
        std::iter::once(&self.base_model)
            .chain(&self.aliases)
            .map(|n| format!("`{n}`"))
            .collect()
    }

    /// A registered trainable model (a cheap handle: its trainer is shared).
    pub fn registered(&self, name: &str) -> Option<RegisteredModel> {
        self.registry
            .lock()
            .expect("registry lock")
            .models
            .get(name)
            .cloned()
    }

    pub fn registered_or_404(&self, name: &str) -> Result<RegisteredModel, ApiError> {
        self.registered(name).ok_or_else(|| {
            ApiError::not_found(format!(
                "no trainable model named `{name}`; register it first (POST /v1/art/models)"
            ))
        })
    }

    pub fn is_trainable(&self, name: &str) -> bool {
        self.registry
            .lock()
            .expect("registry lock")
            .models
            .contains_key(name)
    }

    /// Every name a request may use: the base model, trainable models, and their checkpoints.
    pub fn model_ids(&self) -> Vec<String> {
        let mut ids = vec![self.base_model.clone()];
        ids.extend(
            self.registry
                .lock()
                .expect("registry lock")
                .models
                .keys()
                .cloned(),
        );
        for adapter in self.engine.adapter_names() {
            if !ids.contains(&adapter) {
                ids.push(adapter);
            }
        }
        ids
    }

    pub fn context_length(&self) -> usize {
        self.engine.config().max_position_embeddings
    }

    /// One token's text as OpenAI's logprobs show it (special tokens included).
    pub fn token_text(&self, id: u32) -> String {
        self.engine.decode(&[id], false).unwrap_or_default()
    }
}
