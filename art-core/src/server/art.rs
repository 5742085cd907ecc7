//! The training and control API under `/v1/art`: trainable models registered by clients
//! (`TrainableModel::register`), each with its own directory under the server's art dir.

use axum::extract::{Path, State};

use crate::store::ModelStore;
use crate::train::Trainer;
use crate::types::{check_name, ModelInfo, RegisterRequest};

use super::error::{ApiError, ApiJson};
use super::registry::RegisteredModel;
use super::state::AppState;

pub async fn register(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<RegisterRequest>,
) -> Result<ApiJson<ModelInfo>, ApiError> {
    if let Some(base) = &request.base_model {
        if state.resolve_model(base)?.is_some() || state.is_trainable(base) {
            return Err(ApiError::invalid_param(
                "base_model",
                format!("`{base}` is not a base model"),
            ));
        }
    }
    Ok(ApiJson(register_model(&state, &request).await?))
}

/// Registers `request.name`, or reconnects to it when it is registered already (see
/// [`reconnect`]). A model trained before resumes from its latest checkpoint.
pub(super) async fn register_model(
    state: &AppState,
    request: &RegisterRequest,
) -> Result<ModelInfo, ApiError> {
    check_name("name", &request.name)?;
    check_name("project", &request.project)?;
    if request.name == state.base_model {
        return Err(ApiError::invalid_param(
            "name",
            "a trainable model cannot take the base model's name",
        ));
    }
    if let Some(existing) = state.registered(&request.name) {
        return reconnect(&existing.info(), request);
    }
    let store = ModelStore::open(&state.art_dir, &request.project, &request.name)?;
    let dir = store.dir().to_path_buf();
    std::fs::create_dir_all(dir.join("checkpoints"))
        .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", dir.display())))?;
    // Loading the latest checkpoint (if any) and serving it takes a moment: off the async threads.
    let trainer = {
        let (engine, ranks, dir, name, lora) = (
            state.engine.clone(),
            state.train_engines.clone(),
            dir.clone(),
            request.name.clone(),
            request.lora.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let mut trainer = Trainer::new(engine, dir, &name, &lora)?;
            trainer.add_training_devices(ranks)?;
            Ok::<_, crate::train::TrainError>(trainer)
        })
        .await
        .map_err(|e| ApiError::internal(format!("the trainer could not start: {e}")))?
        .map_err(|e| ApiError::internal(format!("the trainer could not start: {e}")))?
    };
    let info = ModelInfo {
        name: request.name.clone(),
        project: request.project.clone(),
        base_model: state.base_model.clone(),
        step: trainer.step(),
        // A resumed checkpoint's LoRA shape wins over the request's.
        lora: trainer.lora_config().clone(),
    };
    store.set_model_info(serde_json::to_value(&info).expect("model info serializes"))?;
    let mut registry = state.registry.lock().expect("registry lock");
    // Another request may have registered the same name meanwhile.
    if let Some(existing) = registry.models.get(&request.name) {
        return reconnect(&existing.info(), request);
    }
    registry.models.insert(
        request.name.clone(),
        RegisteredModel::new(info.clone(), dir, store, trainer),
    );
    Ok(info)
}

/// Registering again is how a client reconnects; a different project or LoRA shape is a mistake.
/// (A model resumed from its checkpoints takes their LoRA shape, whatever the first request said.)
fn reconnect(existing: &ModelInfo, request: &RegisterRequest) -> Result<ModelInfo, ApiError> {
    if existing.project != request.project || existing.lora != request.lora {
        return Err(ApiError::conflict(format!(
            "a model named `{}` is already registered in project `{}` with another configuration",
            request.name, existing.project
        )));
    }
    Ok(existing.clone())
}

pub async fn get_model(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<ApiJson<ModelInfo>, ApiError> {
    Ok(ApiJson(state.registered_or_404(&name)?.info()))
}
