//! The API of OpenPipe ART's `ServerlessBackend` under `/v1/preview`, so that Python ART code
//! trains on this server by passing `base_url`: models are registered, trained by polled jobs,
//! and their checkpoints listed and deleted. Everything goes through the same registry, store
//! and trainers as `/v1/art`; a model's id is its name.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::json;

use crate::train::{checkpoint_metrics, list_checkpoints, TrainError, Trainer};
use crate::types::RegisterRequest;
use crate::types::{
    CursorPage, DeleteStepsRequest, DeleteStepsResponse, ExperimentalConfig, JobEventKind,
    LogRequest, Message, PreviewCheckpoint, PreviewModel, PreviewModelRequest, SftEvent,
    SftRequest, SftTrainingJobRequest, Tool, TrainConfig, TrainingJob, TrainingJobEvent,
    TrainingJobRequest, Trajectory,
};

use super::art::register_model;
use super::error::{ApiError, ApiJson};
use super::jobs::{object, Job};
use super::registry::RegisteredModel;
use super::state::AppState;
use super::training::{check_sft_request, mirror_adapters, run_sft, run_step, sft_span, step_span};

/// The entity a model gets when the client names none (W&B would use the user's default team).
const DEFAULT_ENTITY: &str = "local";

/// Pages are this long unless the client asks for fewer items.
const PAGE_LIMIT: usize = 100;

pub async fn create_model(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<PreviewModelRequest>,
) -> Result<ApiJson<PreviewModel>, ApiError> {
    let required = |field: &str, value: &Option<String>| {
        value
            .clone()
            .ok_or_else(|| ApiError::invalid_param(field, format!("`{field}` is required")))
    };
    let (project, name) = (
        required("project", &request.project)?,
        required("name", &request.name)?,
    );
    if !state.is_base_model(&request.base_model) {
        return Err(ApiError::invalid_param(
            "base_model",
            format!(
                "this server does not serve `{}`: it serves {}. Name one of these, or start \
                 `art serve --alias {}` when that name means the same model",
                request.base_model,
                state.base_model_names().join(", "),
                request.base_model
            ),
        ));
    }
    if state.is_trainable(&name) && !request.return_existing {
        return Err(ApiError::conflict(format!(
            "a model named `{name}` is registered already; pass return_existing to use it"
        )));
    }
    let info = register_model(
        &state,
        &RegisterRequest {
            name,
            project,
            base_model: None,
            lora: Default::default(),
        },
    )
    .await?;
    Ok(ApiJson(PreviewModel {
        id: info.name.clone(),
        entity: request.entity.unwrap_or_else(|| DEFAULT_ENTITY.to_string()),
        project: info.project,
        name: info.name,
        base_model: request.base_model,
        run_id: None,
    }))
}

/// Forgets the model and deletes its directory (checkpoints, history, logged trajectories),
/// after any step it is running; steps queued behind the deletion fail.
pub async fn delete_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let model = state.registered_or_404(&id)?;
    let work = move |trainer: &mut Trainer, model: &RegisteredModel| {
        trainer.retire();
        state
            .registry
            .lock()
            .expect("registry lock")
            .models
            .remove(trainer.name());
        std::fs::remove_dir_all(&model.dir)
            .map_err(|e| ApiError::internal(format!("cannot delete {}: {e}", model.dir.display())))
    };
    model.with_trainer("deleting the model", work).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// ART's `model.log` through the backend: the groups are recorded like `/v1/art/.../log`, with
/// captured calls shown as the conversation they make up.
pub async fn log(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiJson(mut request): ApiJson<LogRequest>,
) -> Result<StatusCode, ApiError> {
    for trajectory in request
        .trajectory_groups
        .iter_mut()
        .flat_map(|g| &mut g.trajectories)
    {
        trajectory.show_exchanges_as_conversation();
    }
    super::logging::log(State(state), Path(id), ApiJson(request)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
}

/// A page of `items` (with their ids) after the item `after`, at most `limit` long.
fn page<T: Clone>(
    items: &[(String, T)],
    after: Option<&str>,
    limit: Option<usize>,
) -> Result<CursorPage<T>, ApiError> {
    let start = match after {
        None => 0,
        Some(after) => {
            items
                .iter()
                .position(|(id, _)| id == after)
                .ok_or_else(|| {
                    ApiError::invalid_param("after", format!("no item has the id `{after}`"))
                })?
                + 1
        }
    };
    let rest: Vec<T> = items[start..].iter().map(|(_, t)| t.clone()).collect();
    Ok(CursorPage::of(&rest, limit.unwrap_or(PAGE_LIMIT).max(1)))
}

pub async fn checkpoints(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<ListQuery>,
) -> Result<ApiJson<CursorPage<PreviewCheckpoint>>, ApiError> {
    let model = state.registered_or_404(&id)?;
    let mut steps = list_checkpoints(&model.dir);
    match query.order.as_deref() {
        None | Some("asc") => {}
        Some("desc") => steps.reverse(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "order",
                format!("order must be `asc` or `desc`, not `{other}`"),
            ))
        }
    }
    let items: Vec<(String, PreviewCheckpoint)> = steps
        .into_iter()
        .map(|step| {
            let checkpoint = PreviewCheckpoint {
                id: format!("{id}:step{step}"),
                step,
                metrics: checkpoint_metrics(&model.dir, step)
                    .map(|m| m.history_metrics())
                    .unwrap_or_default(),
            };
            (checkpoint.id.clone(), checkpoint)
        })
        .collect();
    Ok(ApiJson(page(&items, query.after.as_deref(), query.limit)?))
}

/// Deletes the listed steps' checkpoints. The latest is what the model resumes from: asking
/// for it deletes nothing and says so.
pub async fn delete_checkpoints(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiJson(request): ApiJson<DeleteStepsRequest>,
) -> Result<ApiJson<DeleteStepsResponse>, ApiError> {
    let model = state.registered_or_404(&id)?;
    // With the trainer held no step can add a checkpoint meanwhile.
    let work = move |trainer: &mut Trainer, model: &RegisteredModel| {
        let steps = list_checkpoints(&model.dir);
        if let Some(latest) = steps.last().filter(|s| request.steps.contains(s)) {
            return Err(ApiError::invalid_param(
                "steps",
                format!(
                    "step {latest} is the latest checkpoint of `{id}`, which training resumes \
                     from; it cannot be deleted (nothing was)"
                ),
            ));
        }
        let keep: Vec<u64> = steps
            .iter()
            .copied()
            .filter(|s| !request.steps.contains(s))
            .collect();
        let (deleted, _) = trainer.delete_checkpoints(&keep)?;
        let mut not_found_steps: Vec<u64> = request
            .steps
            .iter()
            .copied()
            .filter(|s| !steps.contains(s))
            .collect();
        not_found_steps.sort_unstable();
        not_found_steps.dedup();
        Ok(DeleteStepsResponse {
            deleted_count: deleted.len(),
            not_found_steps,
        })
    };
    Ok(ApiJson(
        model.with_trainer("deleting checkpoints", work).await?,
    ))
}

/// Starts a training step and answers at once with the job's id; the step's progress is read
/// from the job's events. Settings and the model are checked first (a 400 or 404 starts
/// nothing); a batch the trainer refuses ends the job with `training_failed`.
pub async fn create_training_job(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<TrainingJobRequest>,
) -> Result<ApiJson<TrainingJob>, ApiError> {
    let model = state.registered_or_404(&request.model_id)?;
    let config = train_config_of(
        &request.experimental_config.unwrap_or_default(),
        model.step.load(std::sync::atomic::Ordering::SeqCst),
    )?;
    config
        .validate()
        .map_err(|e| ApiError::invalid_param("experimental_config", e.to_string()))?;
    if request.trajectory_groups.is_empty() {
        return Err(ApiError::invalid_param(
            "trajectory_groups",
            "no trajectory groups to train on",
        ));
    }
    let (id, job) = state
        .jobs
        .create(&request.model_id, &model.dir)
        .map_err(|e| ApiError::internal(format!("cannot record the training job: {e}")))?;
    let span = step_span(&request.model_id, request.trajectory_groups.len());
    tokio::task::spawn_blocking(move || {
        // One optimizer step per job: ART counts `num_sequences` gradient steps. `step` is the
        // step it computes (what a restarted server checks for).
        let mut announced = false;
        let outcome = run_step(&model, &request.trajectory_groups, &config, span, |p| {
            if !announced {
                let data = json!({"num_sequences": 1, "step": p.step});
                job.push(JobEventKind::TrainingStarted, object(data));
                announced = true;
            }
        });
        match outcome {
            Ok(result) => {
                mirror_adapters(&state);
                let metrics = result
                    .metrics
                    .history_metrics()
                    .into_iter()
                    .map(|(name, value)| (name, json!(value)))
                    .collect();
                job.push(JobEventKind::GradientStep, metrics);
                end_job(&job, Ok(result.step));
            }
            Err(e) => end_job(&job, Err(e)),
        }
    });
    Ok(ApiJson(TrainingJob { id }))
}

/// Starts supervised fine-tuning on the conversations of `training_data_url` and answers at
/// once with the job's id. The data is read and the settings checked first (a 400 starts
/// nothing); the job's `training_started` counts its batches (`num_sequences`, as ART reads it),
/// each batch is a `gradient_step`, and one checkpoint ends it.
pub async fn create_sft_training_job(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<SftTrainingJobRequest>,
) -> Result<ApiJson<TrainingJob>, ApiError> {
    let model = state.registered_or_404(&request.model_id)?;
    let trajectories = read_sft_data(&request.training_data_url)
        .await
        .map_err(|e| ApiError::invalid_param("training_data_url", e))?;
    let sft = SftRequest {
        trajectories,
        config: request.config.unwrap_or_default().sft_config(),
    };
    check_sft_request(&sft)?;
    let (id, job) = state
        .jobs
        .create(&request.model_id, &model.dir)
        .map_err(|e| ApiError::internal(format!("cannot record the training job: {e}")))?;
    let span = sft_span(&request.model_id, sft.trajectories.len());
    tokio::task::spawn_blocking(move || {
        let outcome = run_sft(
            &model,
            &sft.trajectories,
            &sft.config,
            span,
            |event| match event {
                SftEvent::Started { step, batches, .. } => {
                    let data = json!({"num_sequences": batches, "step": step});
                    job.push(JobEventKind::TrainingStarted, object(data));
                }
                SftEvent::Batch(m) => {
                    let data = json!({
                        "loss": m.loss,
                        "grad_norm": m.grad_norm,
                        "learning_rate": m.learning_rate,
                        "num_trajectories": m.num_trajectories,
                        "num_trainable_tokens": m.num_trainable_tokens,
                    });
                    job.push(JobEventKind::GradientStep, object(data));
                }
                SftEvent::Result(_) | SftEvent::Error { .. } => {}
            },
        );
        if outcome.is_ok() {
            mirror_adapters(&state);
        }
        end_job(&job, outcome.map(|result| result.step));
    });
    Ok(ApiJson(TrainingJob { id }))
}

/// A job's last event: `training_ended` at the step it made, or `training_failed` saying why.
fn end_job(job: &Job, outcome: Result<u64, TrainError>) {
    match outcome {
        Ok(step) => job.push(JobEventKind::TrainingEnded, object(json!({"step": step}))),
        Err(e) => job.push(
            JobEventKind::TrainingFailed,
            object(json!({"error_message": e.to_string()})),
        ),
    }
}

/// One line of an SFT data file, as ART writes it.
#[derive(Deserialize)]
struct SftLine {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
}

/// The conversations of an SFT data file: `file://` (or a bare absolute path) on this machine,
/// or `http(s)://`. The error says what to fix; it never quotes the file (which could be any
/// file the server can read).
async fn read_sft_data(url: &str) -> Result<Vec<Trajectory>, String> {
    let text = if url.starts_with("http://") || url.starts_with("https://") {
        let response = reqwest::get(url)
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("cannot download `{url}`: {e}"))?;
        response
            .text()
            .await
            .map_err(|e| format!("cannot download `{url}`: {e}"))?
    } else if let Some(path) = url
        .strip_prefix("file://")
        .or(Some(url).filter(|u| u.starts_with('/')))
    {
        if !path.ends_with(".jsonl") {
            return Err(format!(
                "`{path}` is not a .jsonl file: the data is one JSON conversation per line"
            ));
        }
        tokio::fs::read_to_string(path)
            .await
            .map_err(|e| format!("cannot read `{path}`: {e}"))?
    } else {
        return Err(format!(
            "`{url}` cannot be read by this server: give a file:///absolute/path.jsonl on the \
             server's machine or an http(s):// URL (W&B artifacts are not reachable from here)"
        ));
    };
    let mut trajectories = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: SftLine = serde_json::from_str(line).map_err(|e| {
            format!(
                "line {} is not a conversation ({:?} error at column {}): each line must be \
                 {{\"messages\": [...], \"tools\": [...]}}",
                n + 1,
                e.classify(),
                e.column()
            )
        })?;
        let mut trajectory = Trajectory::new(parsed.messages);
        trajectory.tools = parsed.tools;
        trajectories.push(trajectory);
    }
    Ok(trajectories)
}

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    after: Option<String>,
    limit: Option<usize>,
}

pub async fn job_events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<ApiJson<CursorPage<TrainingJobEvent>>, ApiError> {
    let job = state
        .jobs
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("no training job `{id}`")))?;
    let after = match query.after.as_deref() {
        None | Some("") => None,
        Some(after) => Some(after.parse::<usize>().map_err(|_| {
            ApiError::invalid_param("after", format!("`{after}` is not an event id of this job"))
        })?),
    };
    Ok(ApiJson(
        job.events(after, query.limit.unwrap_or(PAGE_LIMIT).max(1)),
    ))
}

/// The training settings an `experimental_config` asks for, over the server's defaults; a
/// setting this server does not implement is a 400 naming it.
fn train_config_of(config: &ExperimentalConfig, step: u64) -> Result<TrainConfig, ApiError> {
    config
        .train_config(&TrainConfig::default(), step)
        .map_err(|e| {
            ApiError::invalid_param(&format!("experimental_config.{}", e.field), e.to_string())
        })
}
