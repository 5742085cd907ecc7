//! The training and control API under `/v1/art`: trainable models registered by clients
//! (`TrainableModel::register`), each with its own directory under the server's art dir.

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use crate::backend::{ModelInfo, RegisterRequest};
use axum::extract::{Path, State};

use super::error::{ApiError, ApiJson};
use super::state::AppState;

/// The server's registry of trainable models, by name.
#[derive(Default)]
pub struct Registry {
    pub models: BTreeMap<String, RegisteredModel>,
}

pub struct RegisteredModel {
    pub info: ModelInfo,
    pub dir: PathBuf,
}

/// Names clients may use: letters, digits, `-`, `_`, `.` (they become directory names and model ids).
fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_param(
            what,
            format!("`{name}` is not a valid {what}: use 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'"),
        ))
    }
}

pub async fn register(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<RegisterRequest>,
) -> Result<ApiJson<ModelInfo>, ApiError> {
    check_name("name", &request.name)?;
    check_name("project", &request.project)?;
    if let Some(base) = &request.base_model {
        if state.resolve_model(base)?.is_some() || state.is_trainable(base) {
            return Err(ApiError::invalid_param(
                "base_model",
                format!("`{base}` is not a base model"),
            ));
        }
    }
    if request.name == state.base_model {
        return Err(ApiError::invalid_param(
            "name",
            "a trainable model cannot take the base model's name",
        ));
    }
    let mut registry = state.registry.lock().expect("registry lock");
    if let Some(existing) = registry.models.get(&request.name) {
        // Registering again is how a client reconnects; a different project or LoRA shape is a mistake.
        if existing.info.project != request.project || existing.info.lora != request.lora {
            return Err(ApiError::conflict(format!(
                "a model named `{}` is already registered in project `{}` with another configuration",
                request.name, existing.info.project
            )));
        }
        return Ok(ApiJson(existing.info.clone()));
    }
    let dir = state
        .art_dir
        .join(&request.project)
        .join("models")
        .join(&request.name);
    std::fs::create_dir_all(dir.join("checkpoints"))
        .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", dir.display())))?;
    let info = ModelInfo {
        name: request.name.clone(),
        project: request.project,
        base_model: state.base_model.clone(),
        step: latest_checkpoint(&dir),
        lora: request.lora,
    };
    let model_json = serde_json::to_vec_pretty(&info).expect("model info serializes");
    crate::fsutil::write_atomic(&dir.join("model.json"), &model_json)
        .map_err(|e| ApiError::internal(format!("cannot write model.json: {e}")))?;
    registry.models.insert(
        request.name,
        RegisteredModel {
            info: info.clone(),
            dir,
        },
    );
    Ok(ApiJson(info))
}

pub async fn get_model(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<ApiJson<ModelInfo>, ApiError> {
    let registry = state.registry.lock().expect("registry lock");
    registry
        .models
        .get(&name)
        .map(|m| ApiJson(m.info.clone()))
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no trainable model named `{name}`; register it first"
            ))
        })
}

/// The highest `checkpoints/<step>` in a model directory (0 when there is none).
pub fn latest_checkpoint(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}
