//! `art serve`: the backend as an HTTP server (feature `server`). OpenAI-compatible chat
//! completions for rollouts, with continuous batching across requests.

mod art;
mod batcher;
mod chat;
mod error;
mod jobs;
mod logging;
mod preview;
mod registry;
mod replicas;
mod state;
mod training;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use opentelemetry::trace::FutureExt as _;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tracing::Instrument as _;

use crate::engine::{Device, Engine, LoadOptions, ModelSource};

pub use crate::types::{ModelInfo, RegisterRequest};
pub use batcher::{BatchEvent, Batcher, SchedulerLimits};
pub use error::ApiError;
pub use replicas::{Replica, Replicas};
pub use state::{AppState, Shared};

/// The largest request body accepted (axum's default of 2 MB is too small for training batches).
const MAX_BODY_BYTES: usize = 512 << 20;

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// A GGUF file, a Hugging Face model directory, or a repository id in the local hub cache.
    pub model: String,
    /// The name clients use for the base model (default: the model file or directory name).
    pub served_model_name: Option<String>,
    /// Other names accepted for the base model (e.g. the Hugging Face repository id a Python ART
    /// program names as its `base_model`).
    pub aliases: Vec<String>,
    pub host: String,
    pub port: u16,
    /// Required from clients as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests waiting for a place in the batch before new ones get 429.
    pub max_queue: usize,
    /// Tokens generated when a request sets no max_tokens.
    pub default_max_tokens: usize,
    /// Where trained models and their checkpoints live.
    pub art_dir: PathBuf,
    /// Sample with the quantized weights of a GGUF model (see [`Engine::set_use_quantized`]).
    pub quantized: bool,
    /// MiB of keys and values kept for prompts seen before (0: none); `None`: the scheduler's
    /// default for the device (256 MiB on the CPU, 2 GiB on a GPU).
    pub prefix_cache_mib: Option<usize>,
    /// MiB the running sequences' keys and values may take together; past it the newest are
    /// preempted and resumed later. `None`: the scheduler's default (half the GPU's free memory,
    /// a quarter of the machine's available memory on the CPU).
    pub kv_cache_mib: Option<usize>,
    /// Prompt tokens prefilled in one step; a longer prompt arriving while others decode is
    /// prefilled in chunks of it. `None`: the scheduler's default (4,096).
    pub max_prefill_tokens: Option<usize>,
    /// The model loaded and trained on `load.device`.
    pub load: LoadOptions,
    /// More inference replicas: the model loaded again on each of these devices, each copy
    /// with its own scheduler and caches, behind the same endpoint (requests routed by prompt
    /// and load; trained adapters copied to each).
    pub extra_replicas: Vec<Device>,
    /// Whether `load.device`'s copy serves requests too; off, it only trains (a dedicated
    /// training device beside `extra_replicas`, which must then not be empty).
    pub serve_on_train_device: bool,
    /// More devices that train with `load.device`, data-parallel: each takes a share of every
    /// step's micro-batches and the gradients are all-reduced (NCCL between CUDA devices, which
    /// needs the `nccl` feature). A device that is also in `extra_replicas` trains on that
    /// replica's copy of the model; another gets a copy that only trains.
    pub extra_train_devices: Vec<Device>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            model: String::new(),
            served_model_name: None,
            aliases: Vec::new(),
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            max_batch: 256,
            max_queue: 1024,
            default_max_tokens: 1024,
            art_dir: PathBuf::from(".art"),
            quantized: false,
            prefix_cache_mib: None,
            kv_cache_mib: None,
            max_prefill_tokens: None,
            load: LoadOptions::default(),
            extra_replicas: Vec::new(),
            serve_on_train_device: true,
            extra_train_devices: Vec::new(),
        }
    }
}

/// Loads the model and builds the application state (no socket yet).
pub fn build_state(options: &ServeOptions) -> anyhow::Result<AppState> {
    let on_loopback =
        options.host == "127.0.0.1" || options.host == "localhost" || options.host == "::1";
    if !on_loopback && options.api_key.is_none() {
        anyhow::bail!(
            "refusing to listen on {} without an API key: pass --api-key (clients send it as a bearer token)",
            options.host
        );
    }
    if !options.serve_on_train_device && options.extra_replicas.is_empty() {
        anyhow::bail!("the training device does not serve, and no other device does");
    }
    let training: Vec<Device> = std::iter::once(options.load.device.clone())
        .chain(options.extra_train_devices.iter().cloned())
        .collect();
    crate::train::check_training_devices(&training)?;
    let engine = load_engine(options, &options.load.device)?;
    // The trainer renders conversations with the same template (one builder for both).
    let template = engine
        .compiled_chat_template()
        .map_err(|e| anyhow::anyhow!("the model's chat template: {e}"))?;
    let base_model = options
        .served_model_name
        .clone()
        .unwrap_or_else(|| engine.name().to_string());
    let limits = SchedulerLimits {
        prefix_cache_bytes: options.prefix_cache_mib.map(|mib| mib << 20),
        kv_cache_bytes: options.kv_cache_mib.map(|mib| mib << 20),
        max_prefill_tokens: options.max_prefill_tokens,
    };
    let replica = |engine: Arc<Engine>, serves: bool, trains: bool| {
        let batcher = Batcher::start(engine.clone(), options.max_batch, options.max_queue, limits);
        Replica::new(
            device_name(engine.device()),
            engine,
            batcher,
            serves,
            trains,
        )
    };
    let mut replicas = vec![replica(engine.clone(), options.serve_on_train_device, true)];
    for device in &options.extra_replicas {
        replicas.push(replica(load_engine(options, device)?, true, false));
    }
    // The data-parallel ranks besides the first: a serving replica's copy of the model where one
    // is on the device, else a copy of their own.
    let mut train_engines = Vec::new();
    for device in &options.extra_train_devices {
        let shared = replicas
            .iter_mut()
            .find(|r| !r.trains && r.engine.device().same_device(device));
        let engine = match shared {
            Some(r) => {
                r.trains = true;
                r.engine.clone()
            }
            None => {
                let engine = load_engine(options, device)?;
                replicas.push(replica(engine.clone(), false, true));
                engine
            }
        };
        train_engines.push(engine);
    }
    if replicas.len() > 1 {
        let devices: Vec<&str> = replicas.iter().map(|r| r.device.as_str()).collect();
        tracing::info!(
            devices = %devices.join(","),
            training = 1 + train_engines.len(),
            "replicas"
        );
    }
    Ok(AppState::new(Shared {
        replicas: Replicas::new(replicas),
        engine,
        train_engines,
        template,
        // The path it was loaded from, its hub id when it came from the hub cache, and --alias.
        aliases: std::iter::once(options.model.clone())
            .chain(crate::engine::hub::repo_id_of(std::path::Path::new(
                &options.model,
            )))
            .chain(options.aliases.iter().cloned())
            .collect(),
        base_model,
        api_key: options.api_key.clone(),
        default_max_tokens: options.default_max_tokens,
        art_dir: options.art_dir.clone(),
        registry: Default::default(),
        jobs: jobs::Jobs::new(&options.art_dir),
    }))
}

/// The model of `options` loaded on `device`, set to sample with its quantized weights when
/// asked.
fn load_engine(options: &ServeOptions, device: &Device) -> anyhow::Result<Arc<Engine>> {
    let load = LoadOptions {
        device: device.clone(),
        ..options.load.clone()
    };
    let engine = Arc::new(Engine::load(&ModelSource::parse(&options.model), &load)?);
    if options.quantized {
        engine.set_use_quantized(true);
        if !engine.use_quantized() {
            anyhow::bail!(
                "--quantized needs a GGUF model with quantized weights, and `{}` has none",
                options.model
            );
        }
        tracing::info!(
            kernels = crate::engine::quantized_kernels(),
            "sampling with the quantized weights"
        );
    }
    Ok(engine)
}

/// A device as the command line names it: `cpu`, `cuda:N`.
fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The HTTP routes. `/health` is open; everything under `/v1` needs the API key when one is set.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(chat::chat_completions))
        .route("/models", get(list_models))
        .route("/art/models", post(art::register))
        .route("/art/models/{name}", get(art::get_model))
        .route("/art/models/{name}/train", post(training::train))
        .route("/art/models/{name}/train_sft", post(training::train_sft))
        .route("/art/models/{name}/checkpoints", get(training::checkpoints))
        .route(
            "/art/models/{name}/checkpoints/{step}/files/{file}",
            get(training::checkpoint_file),
        )
        .route(
            "/art/models/{name}/checkpoints/delete",
            post(training::delete_checkpoints),
        )
        .route("/art/models/{name}/log", post(logging::log))
        // OpenPipe ART's ServerlessBackend (Python) speaks these.
        .route("/preview/models", post(preview::create_model))
        .route("/preview/models/{id}", delete(preview::delete_model))
        .route("/preview/models/{id}/log", post(preview::log))
        .route(
            "/preview/models/{id}/checkpoints",
            get(preview::checkpoints).delete(preview::delete_checkpoints),
        )
        .route("/preview/training-jobs", post(preview::create_training_job))
        .route(
            "/preview/sft-training-jobs",
            post(preview::create_sft_training_job),
        )
        .route(
            "/preview/training-jobs/{id}/events",
            get(preview::job_events),
        )
        .route("/art/models/{name}/history", get(logging::history))
        .route(
            "/art/models/{name}/trajectories/{split}/{step}",
            get(logging::trajectories),
        )
        // Training batches of long multi-turn rollouts with logprobs run to many megabytes.
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .route_layer(middleware::from_fn(join_caller_trace));
    Router::new()
        .route("/health", get(health))
        .nest("/v1", v1)
        .fallback(|| async {
            ApiError::not_found("No such route. The API lives under /v1 (see the README).")
        })
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}

/// Every request in a `request` span (method, path), logged when answered: failures (5xx) as
/// warnings, refusals (4xx) as info, the rest at debug (`RUST_LOG=art_core=debug` shows them).
async fn log_request(request: Request, next: Next) -> Response {
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path()
    );
    let started = std::time::Instant::now();
    let response = next.run(request).instrument(span.clone()).await;
    let (status, ms) = (response.status().as_u16(), started.elapsed().as_millis());
    span.in_scope(|| match status {
        500.. => tracing::warn!(status, ms, "answered"),
        400..=499 => tracing::info!(status, ms, "answered"),
        _ => tracing::debug!(status, ms, "answered"),
    });
    response
}

/// Serves until the process is stopped. Prints one line with the address once it is listening.
pub async fn serve(options: ServeOptions) -> anyhow::Result<()> {
    if crate::telemetry::init("art-serve") {
        tracing::info!("exporting traces over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT)");
    }
    let state = tokio::task::block_in_place(|| build_state(&options))?;
    let listener = tokio::net::TcpListener::bind((options.host.as_str(), options.port)).await?;
    let address: SocketAddr = listener.local_addr()?;
    println!(
        "art serve: {} listening on http://{address}/v1",
        state.base_model
    );
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    tokio::task::block_in_place(crate::telemetry::shutdown);
    Ok(())
}

/// Serves `app` on an already bound listener (tests bind port 0 themselves).
pub async fn serve_on(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(listener, app).await
}

async fn shutdown_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

/// Runs the request under the trace its caller sent (`traceparent`), so that the spans the
/// handlers open (`chat`, `train_step`, `model.log`) join the caller's rollout or step.
async fn join_caller_trace(request: Request, next: Next) -> Response {
    if !crate::telemetry::enabled() {
        return next.run(request).await;
    }
    let headers = request
        .headers()
        .iter()
        .filter(|(name, _)| matches!(name.as_str(), "traceparent" | "tracestate"))
        .filter_map(|(name, value)| Some((name.to_string(), value.to_str().ok()?.to_string())))
        .collect();
    let parent = crate::telemetry::extract(&headers);
    next.run(request).with_context(parent).await
}

async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &state.api_key {
        let sent = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        // Compared in constant time, so that response times do not tell how much of a guessed
        // key was right.
        let matches = sent
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|sent| bool::from(sent.as_bytes().ct_eq(key.as_bytes())));
        if !matches {
            return Err(ApiError::unauthorized());
        }
    }
    Ok(next.run(request).await)
}

/// The server's state: `ok`, `degraded` when some inference replica has stopped (the others
/// serve), `unavailable` when none runs; the batch summed over the replicas, and each one's.
async fn health(State(state): State<AppState>) -> Json<Value> {
    let health = state.replicas.health();
    Json(json!({
        "status": health.status,
        "model": state.base_model,
        "batch": health.batch,
        "replicas": health.replicas,
    }))
}

async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let data: Vec<Value> = state
        .model_ids()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": "art"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}
