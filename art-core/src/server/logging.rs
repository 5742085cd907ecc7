//! The model's record on the backend: `POST /v1/art/models/{name}/log` (ART's `model.log`),
//! `GET /v1/art/models/{name}/history` and `GET /v1/art/models/{name}/trajectories/{split}/{step}`.
//! Everything is written through [`crate::store::ModelStore`] into the model's directory under the
//! server's art dir, next to its checkpoints.

use std::sync::atomic::Ordering;

use axum::extract::{Path, State};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use crate::store::LoggedMetrics;
use crate::telemetry;
use crate::types::{check_name, HistoryList, LogRequest, TrajectoryGroupList};

use super::error::{ApiError, ApiJson};
use super::state::AppState;

/// Records the groups as the request's split at the model's current step: the trajectories
/// parquet, then one history line with the batch's metrics (returned).
pub async fn log(
    State(state): State<AppState>,
    Path(name): Path<String>,
    ApiJson(request): ApiJson<LogRequest>,
) -> Result<ApiJson<LoggedMetrics>, ApiError> {
    let model = state.registered_or_404(&name)?;
    let split = request.split.to_string();
    check_name("split", &split)?;
    let step = model.step.load(Ordering::SeqCst);
    let span = telemetry::start(
        "model.log",
        SpanKind::Server,
        vec![
            KeyValue::new("art.model", name.clone()),
            KeyValue::new("art.split", split.clone()),
            KeyValue::new("art.step", step as i64),
            KeyValue::new("art.groups", request.trajectory_groups.len() as i64),
        ],
    );
    let logged = tokio::task::spawn_blocking(move || {
        model.store.log(&request.trajectory_groups, &split, step)
    })
    .await
    .map_err(|e| ApiError::internal(format!("logging stopped: {e}")))
    .and_then(|logged| logged.map_err(ApiError::from));
    telemetry::end_with(&span, &logged, |logged| {
        logged
            .entry
            .metrics
            .iter()
            .map(|(name, value)| KeyValue::new(format!("art.log.{name}"), *value))
            .collect()
    });
    Ok(ApiJson(logged?))
}

pub async fn history(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<ApiJson<HistoryList>, ApiError> {
    let model = state.registered_or_404(&name)?;
    let data = tokio::task::spawn_blocking(move || model.store.history())
        .await
        .map_err(|e| ApiError::internal(format!("reading the history stopped: {e}")))??;
    Ok(ApiJson(HistoryList { data }))
}

pub async fn trajectories(
    State(state): State<AppState>,
    Path((name, split, step)): Path<(String, String, u64)>,
) -> Result<ApiJson<TrajectoryGroupList>, ApiError> {
    let model = state.registered_or_404(&name)?;
    check_name("split", &split)?;
    if !model.store.trajectories_path(&split, step).is_file() {
        return Err(ApiError::not_found(format!(
            "nothing was logged for `{name}` as `{split}` at step {step} (logged steps: {:?})",
            model.store.trajectory_steps(&split).unwrap_or_default()
        )));
    }
    let data =
        tokio::task::spawn_blocking(move || model.store.read_trajectory_groups(&split, step))
            .await
            .map_err(|e| ApiError::internal(format!("reading trajectories stopped: {e}")))??;
    Ok(ApiJson(TrajectoryGroupList { data }))
}
