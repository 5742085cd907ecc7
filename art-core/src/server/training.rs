//! Training and checkpoints of registered models. `POST /v1/art/models/{name}/train` runs one GRPO
//! step and streams its progress as NDJSON ([`TrainEvent`] per line); checkpoints are listed and
//! pruned under `/v1/art/models/{name}/checkpoints`.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use crate::store::best_step;
use crate::telemetry;
use crate::train::{checkpoint_metrics, list_checkpoints, TrainError, Trainer};
use crate::types::{
    CheckpointInfo, CheckpointList, DeleteCheckpointsRequest, DeleteCheckpointsResponse,
    StepResult, TrainConfig, TrainEvent, TrainProgress, TrainRequest, TrajectoryGroup,
};

use super::art::RegisteredModel;
use super::error::{ApiError, ApiJson};
use super::logging::store_error;
use super::state::AppState;

pub async fn train(
    State(state): State<AppState>,
    Path(name): Path<String>,
    ApiJson(request): ApiJson<TrainRequest>,
) -> Result<Response, ApiError> {
    let model = state.registered_or_404(&name)?;
    request
        .config
        .validate()
        .map_err(|e| ApiError::invalid_param("config", e.to_string()))?;
    if request.trajectory_groups.is_empty() {
        return Err(ApiError::invalid_param(
            "trajectory_groups",
            "no trajectory groups to train on",
        ));
    }

    // The step runs on a blocking thread; events come back over a channel. Steps of one model
    // queue on its trainer's lock. A client that goes away does not stop a step: its checkpoint
    // is still written, and the next get_step shows it.
    let (events, mut received) = mpsc::unbounded_channel::<Result<TrainEvent, TrainError>>();
    let span = step_span(&name, request.trajectory_groups.len());
    tokio::task::spawn_blocking(move || {
        let progress = events.clone();
        let outcome = run_step(
            &model,
            &request.trajectory_groups,
            &request.config,
            span,
            |p| {
                let _ = progress.send(Ok(TrainEvent::Progress(p)));
            },
        );
        let _ = events.send(outcome.map(|result| TrainEvent::Result(Box::new(result))));
    });

    // The trainer reports once the batch is prepared (or fails to be): a rejected batch is an
    // HTTP error, an accepted one starts the stream.
    let first = match received.recv().await {
        Some(Ok(event)) => event,
        Some(Err(e)) => return Err(train_error(e)),
        None => {
            return Err(ApiError::internal(
                "the training thread stopped unexpectedly",
            ))
        }
    };
    let lines = futures::stream::unfold(
        (Some(first), received),
        |(pending, mut received)| async move {
            let event = match pending {
                Some(event) => event,
                None => match received.recv().await? {
                    Ok(event) => event,
                    Err(e) => TrainEvent::Error {
                        message: e.to_string(),
                    },
                },
            };
            let mut line = serde_json::to_vec(&event).expect("train events serialize");
            line.push(b'\n');
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(line)),
                (None, received),
            ))
        },
    );
    Ok((
        [(CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// A step's `train_step` span, under the client's: it spans the wait for the trainer and the
/// step itself, and carries the step's metrics.
pub(super) fn step_span(model: &str, groups: usize) -> opentelemetry::Context {
    telemetry::start(
        "train_step",
        SpanKind::Server,
        vec![
            KeyValue::new("art.model", model.to_string()),
            KeyValue::new("art.groups", groups as i64),
        ],
    )
}

/// One training step of `model`, on the calling (blocking) thread: waits for the model's
/// trainer (steps of one model queue there), trains, publishes the new step and appends its
/// metrics to the model's history. A client that went away does not stop it.
pub(super) fn run_step(
    model: &RegisteredModel,
    groups: &[TrajectoryGroup],
    config: &TrainConfig,
    span: opentelemetry::Context,
    on_progress: impl FnMut(TrainProgress),
) -> Result<StepResult, TrainError> {
    let _in_span = span.clone().attach();
    let mut trainer = model
        .trainer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let outcome = trainer.train(groups, config, on_progress);
    if let Ok(result) = &outcome {
        model
            .step
            .store(result.step, std::sync::atomic::Ordering::SeqCst);
        // The step's metrics go to history.jsonl (split `train`, at the new step) for the
        // loss and gradient-norm curves. The checkpoint is already written: a history that
        // cannot be appended to is reported, not a failed step.
        if let Err(e) =
            model
                .store
                .append_history(result.step, "train", result.metrics.history_metrics())
        {
            eprintln!(
                "art serve: step {} of `{}`: {e}",
                result.step, model.info.name
            );
        }
    }
    telemetry::end_with(&span, &outcome, |result| {
        let metrics = result.metrics.history_metrics().into_iter();
        std::iter::once(KeyValue::new("art.step", result.step as i64))
            .chain(metrics.map(|(name, value)| KeyValue::new(format!("art.train.{name}"), value)))
            .collect()
    });
    outcome
}

pub(super) fn train_error(e: TrainError) -> ApiError {
    if e.is_client_error() {
        ApiError::bad_request(e.to_string())
    } else {
        ApiError::internal(e.to_string())
    }
}

pub async fn checkpoints(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<ApiJson<CheckpointList>, ApiError> {
    let model = state.registered_or_404(&name)?;
    let data = list_checkpoints(&model.dir)
        .into_iter()
        .map(|step| {
            let id = format!("{name}@{step}");
            CheckpointInfo {
                step,
                served_as: state.engine.adapter(&id).is_some().then_some(id),
                metrics: checkpoint_metrics(&model.dir, step),
            }
        })
        .collect();
    Ok(ApiJson(CheckpointList { data }))
}

/// The files of a checkpoint that make up its PEFT adapter (what `peft.PeftModel.from_pretrained`
/// loads); the trainer's own state beside them is not served.
const PEFT_FILES: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// `GET /v1/art/models/{name}/checkpoints/{step}/files/{file}`: one PEFT file of a checkpoint,
/// so that a trained adapter can be taken elsewhere (without W&B's artifact store).
pub async fn checkpoint_file(
    State(state): State<AppState>,
    Path((name, step, file)): Path<(String, u64, String)>,
) -> Result<Response, ApiError> {
    let model = state.registered_or_404(&name)?;
    if !PEFT_FILES.contains(&file.as_str()) {
        return Err(ApiError::not_found(format!(
            "a checkpoint serves {}, not `{file}`",
            PEFT_FILES.join(" and ")
        )));
    }
    let steps = list_checkpoints(&model.dir);
    if !steps.contains(&step) {
        return Err(ApiError::not_found(format!(
            "`{name}` has no checkpoint of step {step} (it has {steps:?})"
        )));
    }
    let path = crate::train::checkpoint_dir(&model.dir, step).join(&file);
    let bytes = tokio::fs::read(&path)
        .await
        .map_err(|e| ApiError::internal(format!("cannot read {}: {e}", path.display())))?;
    let kind = if file.ends_with(".json") {
        "application/json"
    } else {
        "application/octet-stream"
    };
    Ok(([(CONTENT_TYPE, kind)], bytes).into_response())
}

pub async fn delete_checkpoints(
    State(state): State<AppState>,
    Path(name): Path<String>,
    ApiJson(request): ApiJson<DeleteCheckpointsRequest>,
) -> Result<ApiJson<DeleteCheckpointsResponse>, ApiError> {
    let model = state.registered_or_404(&name)?;
    // With the trainer held no step can add a checkpoint between choosing and deleting.
    let work = move |trainer: &mut Trainer, model: &RegisteredModel| {
        let mut keep = request.keep.clone();
        let mut best = None;
        if let Some(metric) = &request.best_metric {
            let history = model.store.history().map_err(store_error)?;
            let steps = list_checkpoints(&model.dir);
            best = best_step(&history, metric, request.goal, &steps).map_err(store_error)?;
            keep.extend(best);
        }
        let (deleted, kept) = trainer.delete_checkpoints(&keep).map_err(train_error)?;
        Ok(DeleteCheckpointsResponse {
            deleted,
            kept,
            best_step: best,
        })
    };
    Ok(ApiJson(
        model.with_trainer("deleting checkpoints", work).await?,
    ))
}
