//! Training and checkpoints of registered models. `POST /v1/art/models/{name}/train` runs one GRPO
//! step and streams its progress as NDJSON ([`TrainEvent`] per line); checkpoints are listed and
//! pruned under `/v1/art/models/{name}/checkpoints`.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::sync::mpsc;

use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use crate::store::best_step;
use crate::telemetry;
use crate::train::{checkpoint_metrics, list_checkpoints, TrainError, Trainer};
use crate::types::{
    CheckpointInfo, CheckpointList, DeleteCheckpointsRequest, DeleteCheckpointsResponse, SftConfig,
    SftEvent, SftRequest, SftResult, StepMetrics, StepResult, TrainConfig, TrainEvent,
    TrainProgress, TrainRequest, Trajectory, TrajectoryGroup,
};

use super::error::{ApiError, ApiJson};
use super::registry::RegisteredModel;
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

    let span = step_span(&name, request.trajectory_groups.len());
    ndjson_events(
        move |emit| {
            run_step(
                &model,
                &request.trajectory_groups,
                &request.config,
                span,
                |p| emit(TrainEvent::Progress(p)),
            )
            .inspect(|_| mirror_adapters(&state))
            .map(|result| TrainEvent::Result(Box::new(result)))
        },
        |message| TrainEvent::Error { message },
    )
    .await
}

/// `POST /v1/art/models/{name}/train_sft`: supervised fine-tuning, its progress streamed as
/// NDJSON ([`SftEvent`] per line) as a GRPO step's is.
pub async fn train_sft(
    State(state): State<AppState>,
    Path(name): Path<String>,
    ApiJson(request): ApiJson<SftRequest>,
) -> Result<Response, ApiError> {
    let model = state.registered_or_404(&name)?;
    check_sft_request(&request)?;
    let span = sft_span(&name, request.trajectories.len());
    ndjson_events(
        move |emit| {
            run_sft(&model, &request.trajectories, &request.config, span, emit)
                .inspect(|_| mirror_adapters(&state))
                .map(|result| SftEvent::Result(Box::new(result)))
        },
        |message| SftEvent::Error { message },
    )
    .await
}

/// Puts the adapters a training call just registered on every inference replica, before the
/// call's answer names them. A copy that fails is retried when a request for the adapter is
/// routed to that replica.
pub(super) fn mirror_adapters(state: &AppState) {
    if let Err(e) = state.replicas.mirror_all() {
        tracing::warn!(error = %e, "could not copy the new adapters to every replica");
    }
}

/// What can be said about an SFT request before it queues for the trainer.
pub(super) fn check_sft_request(request: &SftRequest) -> Result<(), ApiError> {
    if request.trajectories.is_empty() {
        return Err(ApiError::invalid_param(
            "trajectories",
            "no trajectories to learn from",
        ));
    }
    request
        .config
        .validate(request.trajectories.len())
        .map_err(|e| ApiError::invalid_param("config", e.to_string()))
}

/// Runs `work` on a blocking thread and answers with the events it emits, one JSON per line.
/// Work of one model queues on its trainer's lock; a client that goes away does not stop it
/// (its checkpoint is still written, and the next get_step shows it). The first event, sent once
/// the work has accepted its input, starts the stream: a failure before it is an HTTP error (a
/// 400 for a bad request), one after it an `error_line`.
async fn ndjson_events<E: Serialize + Send + 'static>(
    work: impl FnOnce(&mut dyn FnMut(E)) -> Result<E, TrainError> + Send + 'static,
    error_line: fn(String) -> E,
) -> Result<Response, ApiError> {
    let (events, mut received) = mpsc::unbounded_channel::<Result<E, TrainError>>();
    tokio::task::spawn_blocking(move || {
        let progress = events.clone();
        let outcome = work(&mut |event| {
            let _ = progress.send(Ok(event));
        });
        let _ = events.send(outcome);
    });
    let first = match received.recv().await {
        Some(Ok(event)) => event,
        Some(Err(e)) => return Err(e.into()),
        None => {
            return Err(ApiError::internal(
                "the training thread stopped unexpectedly",
            ))
        }
    };
    let lines = futures::stream::unfold(
        (Some(first), received),
        move |(pending, mut received)| async move {
            let event = match pending {
                Some(event) => event,
                None => match received.recv().await? {
                    Ok(event) => event,
                    Err(e) => error_line(e.to_string()),
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

/// A training call's span (`train_step` or `train_sft`), under the client's: it spans the wait
/// for the trainer and the call itself, and carries the new step's metrics.
pub(super) fn trainer_span(
    name: &'static str,
    model: &str,
    what: &'static str,
    count: usize,
) -> opentelemetry::Context {
    telemetry::start(
        name,
        SpanKind::Server,
        vec![
            KeyValue::new("art.model", model.to_string()),
            KeyValue::new(what, count as i64),
        ],
    )
}

/// A GRPO step's span.
pub(super) fn step_span(model: &str, groups: usize) -> opentelemetry::Context {
    trainer_span("train_step", model, "art.groups", groups)
}

/// A supervised fine-tuning call's span.
pub(super) fn sft_span(model: &str, trajectories: usize) -> opentelemetry::Context {
    trainer_span("train_sft", model, "art.trajectories", trajectories)
}

/// One training step of `model`, on the calling (blocking) thread (see [`on_trainer`]); its
/// metrics go to the history as split `train`.
pub(super) fn run_step(
    model: &RegisteredModel,
    groups: &[TrajectoryGroup],
    config: &TrainConfig,
    span: opentelemetry::Context,
    on_progress: impl FnMut(TrainProgress),
) -> Result<StepResult, TrainError> {
    let work = |trainer: &mut Trainer| trainer.train(groups, config, on_progress);
    on_trainer(model, span, "train", work, |r| (r.step, &r.metrics))
}

/// Supervised fine-tuning of `model`, on the calling (blocking) thread (see [`on_trainer`]); its
/// metrics go to the history as split `sft`.
pub(super) fn run_sft(
    model: &RegisteredModel,
    trajectories: &[Trajectory],
    config: &SftConfig,
    span: opentelemetry::Context,
    on_event: impl FnMut(SftEvent),
) -> Result<SftResult, TrainError> {
    let work = |trainer: &mut Trainer| trainer.train_sft(trajectories, config, on_event);
    on_trainer(model, span, "sft", work, |r| (r.step, &r.metrics))
}

/// Runs `work` on `model`'s trainer in `span`: waits for the trainer (training calls of one
/// model queue there), then publishes the new step and appends its metrics (`outcome` says
/// which) to the model's history under `split`. A client that went away does not stop it.
fn on_trainer<R>(
    model: &RegisteredModel,
    span: opentelemetry::Context,
    split: &str,
    work: impl FnOnce(&mut Trainer) -> Result<R, TrainError>,
    outcome_of: fn(&R) -> (u64, &StepMetrics),
) -> Result<R, TrainError> {
    let _in_span = span.clone().attach();
    let log_span = tracing::info_span!("train", model = %model.info.name, split);
    let _in_log_span = log_span.enter();
    let mut trainer = model
        .trainer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let started = std::time::Instant::now();
    let outcome = work(&mut trainer);
    let seconds = started.elapsed().as_secs_f64();
    match &outcome {
        Ok(result) => {
            let (step, metrics) = outcome_of(result);
            tracing::info!(step, loss = metrics.loss, seconds, "step done");
            publish_step(model, step, split, metrics);
        }
        Err(e) => tracing::warn!(error = %e, seconds, "step failed"),
    }
    telemetry::end_with(&span, &outcome, |result| {
        let (step, metrics) = outcome_of(result);
        step_attributes(step, split, metrics)
    });
    outcome
}

/// After a step: the model's new step, and its metrics appended to history.jsonl (under
/// `split`) for the curves. The checkpoint is already written: a history that cannot be
/// appended to is reported, not a failed step.
fn publish_step(model: &RegisteredModel, step: u64, split: &str, metrics: &StepMetrics) {
    model.step.store(step, std::sync::atomic::Ordering::SeqCst);
    if let Err(e) = model
        .store
        .append_history(step, split, metrics.history_metrics())
    {
        tracing::warn!(model = %model.info.name, step, error = %e, "cannot append the step to the history");
    }
}

/// A finished step's span attributes: its step and its metrics as `art.<split>.<name>`.
fn step_attributes(step: u64, split: &str, metrics: &StepMetrics) -> Vec<KeyValue> {
    let metrics = metrics.history_metrics().into_iter();
    std::iter::once(KeyValue::new("art.step", step as i64))
        .chain(metrics.map(|(name, value)| KeyValue::new(format!("art.{split}.{name}"), value)))
        .collect()
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
            let history = model.store.history()?;
            let steps = list_checkpoints(&model.dir);
            best = best_step(&history, metric, request.goal, &steps)?;
            keep.extend(best);
        }
        let (deleted, kept) = trainer.delete_checkpoints(&keep)?;
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
