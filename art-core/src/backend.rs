//! Backends: where the model is served and trained. [`LocalBackend`] starts `art serve` as a child
//! process on loopback; [`RemoteBackend`] talks to one running elsewhere (a GPU machine). Both speak
//! the same HTTP protocol, so a [`TrainableModel`] works the same with either.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::client::ChatEndpoint;
use crate::store::{HistoryEntry, LoggedMetrics, MetricGoal};
use crate::telemetry;
use crate::types::{
    CheckpointList, DeleteCheckpointsRequest, DeleteCheckpointsResponse, HistoryList, LoraConfig,
    ModelInfo, RegisterRequest, SftBatchMetrics, SftConfig, SftEvent, SftResult, Split, StepResult,
    TrainConfig, TrainEvent, TrainProgress, Trajectory, TrajectoryGroup, TrajectoryGroupList,
};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(
        "cannot find the default model {file}: tried {tried}. Fetch it with scripts/fetch-models.sh, \
         or set ART_MODELS_DIR to the folder that holds it"
    )]
    DefaultModelNotFound { file: String, tried: String },
    #[error("cannot find the `art` binary: {0}. Build it with `cargo build --release -p art-core --features server --bin art`, or set ART_BIN")]
    BinaryNotFound(String),
    #[error("`art serve` did not start: {0}")]
    StartFailed(String),
    #[error("the backend at {url} answered HTTP {status}: {message}")]
    Api {
        url: String,
        status: u16,
        message: String,
    },
    #[error("cannot reach the backend at {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("the training step failed on the backend: {0}")]
    TrainFailed(String),
}

/// A server that serves and trains models.
pub trait Backend: Send + Sync {
    /// The API root, ending in `/v1`.
    fn base_url(&self) -> &str;
    fn api_key(&self) -> Option<&str>;
    /// Something to keep alive while models of this backend are in use (the local child process).
    fn keepalive(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        None
    }
}

/// `art serve` on another machine, reached over HTTP with an API key.
#[derive(Debug, Clone)]
pub struct RemoteBackend {
    base_url: String,
    api_key: Option<String>,
}

impl RemoteBackend {
    /// `url` is the server's root or its `/v1` (e.g. `http://gpu-box:8000`).
    pub fn new(url: impl Into<String>, api_key: Option<String>) -> Self {
        let url = url.into();
        let root = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        RemoteBackend {
            base_url: format!("{root}/v1"),
            api_key,
        }
    }

    /// Checks that the server answers.
    pub async fn health(&self) -> Result<(), BackendError> {
        let http = Http::new(&self.base_url, self.api_key.clone());
        let _: serde_json::Value = http.get_root("/health").await?;
        Ok(())
    }
}

impl Backend for RemoteBackend {
    fn base_url(&self) -> &str {
        &self.base_url
    }

    fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
    }
}

/// How to start a [`LocalBackend`].
#[derive(Debug, Clone)]
pub struct LocalBackendOptions {
    /// The model to serve (GGUF file, HF directory or hub-cache repository id).
    pub model: String,
    /// Where trained models are kept (default `$ART_DIR`, else `.art`).
    pub art_dir: PathBuf,
    /// The `art` binary (default: $ART_BIN, then next to this program, then on PATH).
    pub binary: Option<PathBuf>,
    /// Extra arguments for `art serve` (e.g. `--max-batch 32`).
    pub extra_args: Vec<String>,
    pub startup_timeout: Duration,
}

impl LocalBackendOptions {
    pub fn new(model: impl Into<String>) -> Self {
        LocalBackendOptions {
            model: model.into(),
            art_dir: crate::store::default_art_dir(),
            binary: None,
            extra_args: Vec::new(),
            startup_timeout: Duration::from_secs(120),
        }
    }

    /// Options for the embedded default model, SmolLM2-135M-Instruct, as `scripts/fetch-models.sh`
    /// puts it: in `$ART_MODELS_DIR`, else in a `models/` folder of the working directory or one
    /// above it (so notebooks under the checkout find the checkout's models).
    pub fn default_model() -> Result<Self, BackendError> {
        let mut tried = Vec::new();
        let dirs = std::env::var_os("ART_MODELS_DIR")
            .map(PathBuf::from)
            .into_iter()
            .chain(std::env::current_dir().into_iter().flat_map(|cwd| {
                cwd.ancestors()
                    .map(|d| d.join("models"))
                    .collect::<Vec<_>>()
            }));
        for dir in dirs {
            let candidate = dir.join(DEFAULT_MODEL_FILE);
            if candidate.is_file() {
                return Ok(Self::new(candidate.display().to_string()));
            }
            tried.push(dir.display().to_string());
        }
        Err(BackendError::DefaultModelNotFound {
            file: DEFAULT_MODEL_FILE.into(),
            tried: tried.join(", "),
        })
    }
}

/// The embedded default model's file, as `scripts/fetch-models.sh` names it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `art serve` as a child process on a free loopback port, stopped when the last handle goes.
#[derive(Clone)]
pub struct LocalBackend {
    base_url: String,
    art_dir: PathBuf,
    process: Arc<ChildProcess>,
}

struct ChildProcess(std::sync::Mutex<tokio::process::Child>);

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(child) = self.0.get_mut() {
            if crate::telemetry::enabled() {
                // Closing its standard input lets the server send its last spans and exit
                // (`--exit-with-stdin`); it is killed only if it has not within a few seconds.
                drop(child.stdin.take());
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while std::time::Instant::now() < deadline {
                    if !matches!(child.try_wait(), Ok(None)) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let _ = child.start_kill();
        }
    }
}

impl LocalBackend {
    /// Starts `art serve` and waits until it is ready.
    pub async fn start(options: LocalBackendOptions) -> Result<Self, BackendError> {
        let binary = match options.binary.clone() {
            Some(binary) => binary,
            None => find_art_binary()?,
        };
        let mut command = tokio::process::Command::new(&binary);
        // The server's stderr is this program's (a notebook cell's, a script's): it says only what
        // went wrong there (warnings and errors) unless RUST_LOG asks for more.
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        let mut child = command
            .arg("serve")
            .args([
                "--model",
                &options.model,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .arg("--art-dir")
            .arg(&options.art_dir)
            // The server exits when this pipe closes: when the backend is dropped, and also when
            // this process is killed before it could drop it (a notebook kernel restarted).
            .arg("--exit-with-stdin")
            .args(&options.extra_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| BackendError::StartFailed(format!("{}: {e}", binary.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        // The server prints `... listening on http://127.0.0.1:PORT/v1` once it is ready.
        let ready = tokio::time::timeout(options.startup_timeout, async {
            while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
                if let Some(url) = line.split("listening on ").nth(1) {
                    return Ok(url.trim().to_string());
                }
            }
            Err("it exited before listening (its error is above)".to_string())
        })
        .await;
        let base_url = match ready {
            Ok(Ok(url)) => url,
            Ok(Err(why)) => return Err(BackendError::StartFailed(why)),
            Err(_) => {
                return Err(BackendError::StartFailed(format!(
                    "not ready after {:?}",
                    options.startup_timeout
                )))
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(LocalBackend {
            base_url,
            art_dir: options.art_dir,
            process: Arc::new(ChildProcess(std::sync::Mutex::new(child))),
        })
    }
}

impl LocalBackend {
    /// The art dir the server keeps its models in (`<art_dir>/<project>/models/<name>/`): open a
    /// model's directory with [`crate::ModelStore::open`] to read its trajectories files here.
    pub fn art_dir(&self) -> &Path {
        &self.art_dir
    }
}

impl Backend for LocalBackend {
    fn base_url(&self) -> &str {
        &self.base_url
    }

    fn api_key(&self) -> Option<&str> {
        None
    }

    fn keepalive(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        Some(self.process.clone())
    }
}

/// The `art` binary a [`LocalBackend`] starts: `$ART_BIN`, else next to this program (or one folder
/// up), else on PATH. Public so that a notebook can start `art serve` itself (as a remote server).
pub fn find_art_binary() -> Result<PathBuf, BackendError> {
    if let Some(path) = std::env::var_os("ART_BIN") {
        return Ok(PathBuf::from(path));
    }
    let mut tried = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // Next to this program, or one level up (cargo puts test binaries in target/<profile>/deps).
        for dir in exe.ancestors().skip(1).take(2) {
            let candidate = dir.join("art");
            if candidate.is_file() {
                return Ok(candidate);
            }
            tried.push(candidate.display().to_string());
        }
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let candidate = dir.join("art");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(BackendError::BinaryNotFound(format!(
        "tried $ART_BIN, {} and PATH",
        tried.join(", ")
    )))
}

/// A model that can be trained: a name on a backend, served as an OpenAI-compatible model.
#[derive(Clone)]
pub struct TrainableModel {
    pub name: String,
    pub project: String,
    pub base_model: String,
    pub lora: LoraConfig,
    http: Http,
    _keepalive: Option<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for TrainableModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainableModel")
            .field("name", &self.name)
            .field("project", &self.project)
            .field("base_model", &self.base_model)
            .field("backend", &self.http.base_url)
            .finish()
    }
}

impl TrainableModel {
    /// Registers (or reconnects to) the model `name` in `project` on the backend. A model trained
    /// before resumes from its last checkpoint.
    pub async fn register(
        backend: &impl Backend,
        name: impl Into<String>,
        project: impl Into<String>,
    ) -> Result<Self, BackendError> {
        Self::register_with(backend, name, project, LoraConfig::default()).await
    }

    /// As [`TrainableModel::register`], with a LoRA shape other than the default.
    pub async fn register_with(
        backend: &impl Backend,
        name: impl Into<String>,
        project: impl Into<String>,
        lora: LoraConfig,
    ) -> Result<Self, BackendError> {
        let http = Http::new(backend.base_url(), backend.api_key().map(str::to_string));
        let request = RegisterRequest {
            name: name.into(),
            project: project.into(),
            base_model: None,
            lora,
        };
        let info: ModelInfo = http.post("/art/models", &request).await?;
        Ok(TrainableModel {
            name: info.name,
            project: info.project,
            base_model: info.base_model,
            lora: info.lora,
            http,
            _keepalive: backend.keepalive(),
        })
    }

    /// The chat endpoint for rollouts. Requests name this model, which the server resolves to its
    /// latest checkpoint (the base model before the first training step).
    pub fn endpoint(&self) -> ChatEndpoint {
        let endpoint = ChatEndpoint::new(&self.http.base_url, &self.name);
        match &self.http.api_key {
            Some(key) => endpoint.with_api_key(key.clone()),
            None => endpoint,
        }
    }

    /// An async-openai client bound to the backend (use `self.name` as the model).
    pub fn openai_client(&self) -> async_openai::Client<crate::client::EndpointConfig> {
        self.endpoint().openai_client()
    }

    /// Optimizer steps taken so far.
    pub async fn get_step(&self) -> Result<u64, BackendError> {
        let info: ModelInfo = self.http.get(&format!("/art/models/{}", self.name)).await?;
        Ok(info.step)
    }

    /// One GRPO step on `groups` (see [`TrainConfig`]). Returns once the new checkpoint is
    /// written and served: the next rollout already samples from it. A batch the backend cannot
    /// train on (no token ids, too long, bad config) is refused before anything changes.
    pub async fn train(
        &self,
        groups: &[TrajectoryGroup],
        config: &TrainConfig,
    ) -> Result<StepResult, BackendError> {
        self.train_with_progress(groups, config, |_| {}).await
    }

    /// As [`TrainableModel::train`], calling `on_progress` as micro-batches finish (first with
    /// `micro_batch == 0` once the batch is accepted).
    pub async fn train_with_progress(
        &self,
        groups: &[TrajectoryGroup],
        config: &TrainConfig,
        on_progress: impl FnMut(&TrainProgress),
    ) -> Result<StepResult, BackendError> {
        let rollouts: usize = groups.iter().map(|g| g.trajectories.len()).sum();
        let span = telemetry::start(
            "train_step",
            SpanKind::Client,
            vec![
                KeyValue::new("art.model", self.name.clone()),
                KeyValue::new("art.groups", groups.len() as i64),
                KeyValue::new("art.trajectories", rollouts as i64),
            ],
        );
        telemetry::in_span(span, self.train_in(groups, config, on_progress), |step| {
            vec![KeyValue::new("art.step", step.step as i64)]
        })
        .await
    }

    async fn train_in(
        &self,
        groups: &[TrajectoryGroup],
        config: &TrainConfig,
        mut on_progress: impl FnMut(&TrainProgress),
    ) -> Result<StepResult, BackendError> {
        let request = TrainRequestRef {
            trajectory_groups: groups,
            config,
        };
        let response = self
            .http
            .post_streaming(&format!("/art/models/{}/train", self.name), &request)
            .await?;
        self.read_events(response, |event| match event {
            TrainEvent::Progress(progress) => {
                on_progress(&progress);
                None
            }
            TrainEvent::Result(result) => Some(Ok(*result)),
            TrainEvent::Error { message } => Some(Err(BackendError::TrainFailed(message))),
        })
        .await
    }

    /// Supervised fine-tuning (ART's `train_sft`) on `trajectories`: their assistant turns are
    /// learnt by cross-entropy, one optimizer step per `config.batch_size` of them, and one new
    /// checkpoint at the end, served at once as `name@step` and `name`. Data the backend cannot
    /// train on (no assistant turn, too long, bad config) is refused before anything changes.
    pub async fn train_sft(
        &self,
        trajectories: &[Trajectory],
        config: &SftConfig,
    ) -> Result<SftResult, BackendError> {
        self.train_sft_with_progress(trajectories, config, |_| {})
            .await
    }

    /// As [`TrainableModel::train_sft`], calling `on_batch` as each batch's update is done.
    pub async fn train_sft_with_progress(
        &self,
        trajectories: &[Trajectory],
        config: &SftConfig,
        mut on_batch: impl FnMut(&SftBatchMetrics),
    ) -> Result<SftResult, BackendError> {
        let span = telemetry::start(
            "train_sft",
            SpanKind::Client,
            vec![
                KeyValue::new("art.model", self.name.clone()),
                KeyValue::new("art.trajectories", trajectories.len() as i64),
            ],
        );
        let work = async {
            let request = SftRequestRef {
                trajectories,
                config,
            };
            let response = self
                .http
                .post_streaming(&format!("/art/models/{}/train_sft", self.name), &request)
                .await?;
            self.read_events(response, |event| match event {
                SftEvent::Started { .. } => None,
                SftEvent::Batch(batch) => {
                    on_batch(&batch);
                    None
                }
                SftEvent::Result(result) => Some(Ok(*result)),
                SftEvent::Error { message } => Some(Err(BackendError::TrainFailed(message))),
            })
            .await
        };
        telemetry::in_span(span, work, |result| {
            vec![KeyValue::new("art.step", result.step as i64)]
        })
        .await
    }

    /// Reads a training call's NDJSON answer, giving each event to `handle` until it returns
    /// the outcome.
    async fn read_events<E: DeserializeOwned, T>(
        &self,
        mut response: reqwest::Response,
        mut handle: impl FnMut(E) -> Option<Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let unreachable = |message: String| BackendError::Unreachable {
            url: self.http.base_url.clone(),
            message,
        };
        let mut buffer = Vec::new();
        loop {
            while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let event: E = serde_json::from_slice(&line).map_err(|e| {
                    unreachable(format!("unexpected line in the training stream ({e})"))
                })?;
                if let Some(outcome) = handle(event) {
                    return outcome;
                }
            }
            match response.chunk().await {
                Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
                Ok(None) => {
                    return Err(unreachable(
                        "the training stream ended before the step finished; the step may still \
                         complete on the backend (check get_step)"
                            .into(),
                    ))
                }
                Err(e) => return Err(unreachable(e.to_string())),
            }
        }
    }

    /// The checkpoints the backend keeps for this model, oldest first.
    pub async fn checkpoints(&self) -> Result<CheckpointList, BackendError> {
        self.http
            .get(&format!("/art/models/{}/checkpoints", self.name))
            .await
    }

    /// Deletes every checkpoint except the steps in `keep` and the latest one.
    pub async fn delete_checkpoints_except(
        &self,
        keep: &[u64],
    ) -> Result<DeleteCheckpointsResponse, BackendError> {
        let request = DeleteCheckpointsRequest {
            keep: keep.to_vec(),
            ..Default::default()
        };
        self.http
            .post(
                &format!("/art/models/{}/checkpoints/delete", self.name),
                &request,
            )
            .await
    }

    /// ART's `delete_checkpoints(best_checkpoint_metric)`: deletes every checkpoint except the
    /// latest and the best by `best_metric` in the model's history (`"val/reward"`; a name
    /// without a split looks in `val`, then `train`). Higher is better; see
    /// [`TrainableModel::delete_checkpoints_by`] for metrics where lower is. A metric the history
    /// never recorded is an error and deletes nothing.
    pub async fn delete_checkpoints(
        &self,
        best_metric: &str,
    ) -> Result<DeleteCheckpointsResponse, BackendError> {
        self.delete_checkpoints_by(best_metric, MetricGoal::Maximize, &[])
            .await
    }

    /// As [`TrainableModel::delete_checkpoints`], with the metric's direction and more steps to
    /// keep.
    pub async fn delete_checkpoints_by(
        &self,
        best_metric: &str,
        goal: MetricGoal,
        keep: &[u64],
    ) -> Result<DeleteCheckpointsResponse, BackendError> {
        let request = DeleteCheckpointsRequest {
            keep: keep.to_vec(),
            best_metric: Some(best_metric.to_string()),
            goal,
        };
        self.http
            .post(
                &format!("/art/models/{}/checkpoints/delete", self.name),
                &request,
            )
            .await
    }

    /// ART's `model.log(groups, split)`: records a batch of groups in the model's directory on
    /// the backend, at the model's current step. The backend writes
    /// `trajectories/<split>/<step:04>.parquet` (atomically) and appends to history.jsonl the
    /// reward mean and std, the mean within-group std (`reward_std_dev`), the exception rate,
    /// the mean of every trajectory metric and the mean completion tokens (see
    /// [`crate::store::metrics`]). Returns that history entry.
    pub async fn log(
        &self,
        groups: &[TrajectoryGroup],
        split: impl Into<Split>,
    ) -> Result<LoggedMetrics, BackendError> {
        let request = LogRequestRef {
            trajectory_groups: groups,
            split: split.into(),
        };
        let span = telemetry::start(
            "model.log",
            SpanKind::Client,
            vec![
                KeyValue::new("art.model", self.name.clone()),
                KeyValue::new("art.split", request.split.to_string()),
                KeyValue::new("art.groups", groups.len() as i64),
            ],
        );
        let path = format!("/art/models/{}/log", self.name);
        let logged = self.http.post::<LoggedMetrics>(&path, &request);
        telemetry::in_span(span, logged, |logged| {
            vec![KeyValue::new("art.step", logged.entry.step as i64)]
        })
        .await
    }

    /// The model's history.jsonl as the backend has it: what [`TrainableModel::log`] recorded
    /// and each training step's metrics (`loss`, `grad_norm`, ... in the `train` split), in the
    /// order they were written. Feed it to `frames::history_frame` or the `plots` charts.
    pub async fn history(&self) -> Result<Vec<HistoryEntry>, BackendError> {
        let list: HistoryList = self
            .http
            .get(&format!("/art/models/{}/history", self.name))
            .await?;
        Ok(list.data)
    }

    /// The groups logged as `split` at `step`, read back from their trajectories file on the
    /// backend (for `frames::groups_frame` or a second look at a step's rollouts).
    pub async fn trajectories(
        &self,
        split: impl Into<Split>,
        step: u64,
    ) -> Result<Vec<TrajectoryGroup>, BackendError> {
        let list: TrajectoryGroupList = self
            .http
            .get(&format!(
                "/art/models/{}/trajectories/{}/{step}",
                self.name,
                split.into()
            ))
            .await?;
        Ok(list.data)
    }
}

/// The log request as sent: borrowed, so a client's groups are not copied.
#[derive(Serialize)]
struct LogRequestRef<'a> {
    trajectory_groups: &'a [TrajectoryGroup],
    split: Split,
}

/// The SFT request as sent, borrowed.
#[derive(Serialize)]
struct SftRequestRef<'a> {
    trajectories: &'a [Trajectory],
    config: &'a SftConfig,
}

/// The train request as sent: borrowed, so a client's groups are not copied.
#[derive(Serialize)]
struct TrainRequestRef<'a> {
    trajectory_groups: &'a [TrajectoryGroup],
    config: &'a TrainConfig,
}

/// One failed request, and whether sending it again is safe and may succeed.
struct FailedAttempt {
    error: BackendError,
    retry: bool,
}

/// JSON over HTTP to the backend, with its error JSON turned into [`BackendError`].
#[derive(Clone)]
struct Http {
    base_url: String,
    api_key: Option<String>,
}

impl Http {
    fn new(base_url: &str, api_key: Option<String>) -> Self {
        Http {
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key,
        }
    }

    /// The HTTP client of the running runtime for this server (see `client::request_client`).
    fn client(&self) -> reqwest::Client {
        crate::client::request_client(&self.base_url, None)
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, BackendError> {
        self.send(self.client().get(format!("{}{path}", self.base_url)))
            .await
    }

    /// A path outside `/v1` (such as `/health`).
    async fn get_root<T: DeserializeOwned>(&self, path: &str) -> Result<T, BackendError> {
        let root = self.base_url.trim_end_matches("/v1");
        self.send(self.client().get(format!("{root}{path}"))).await
    }

    fn json_post(&self, path: &str, body: &impl Serialize) -> reqwest::RequestBuilder {
        let body = serde_json::to_vec(body).expect("request bodies serialize");
        self.client()
            .post(format!("{}{path}", self.base_url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
    }

    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, BackendError> {
        self.send(self.json_post(path, body)).await
    }

    /// A POST whose answer is read as it arrives (after its status was checked).
    async fn post_streaming(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<reqwest::Response, BackendError> {
        self.send_checked(self.json_post(path, body)).await
    }

    /// Sends a request; a non-2xx answer becomes [`BackendError::Api`] with the server's message.
    /// What cannot have done anything on the server is retried with backoff and jitter
    /// ([`crate::client::backoff`]): a connection that could not be made, and a 429 or 503
    /// (the server refused before starting); a GET also after a connection lost mid-answer or a
    /// proxy's 502/504. A POST that may have reached the server (a training step) is not sent twice.
    async fn send_checked(
        &self,
        mut request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, BackendError> {
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let mut trace = reqwest::header::HeaderMap::new();
        crate::client::add_trace_headers(&mut trace);
        request = request.headers(trace);
        let attempt = || async {
            let request = request.try_clone().expect("request bodies are bytes");
            self.send_once(request).await
        };
        attempt
            .retry(crate::client::backoff(3))
            .when(|failed: &FailedAttempt| failed.retry)
            .await
            .map_err(|failed| failed.error)
    }

    async fn send_once(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, FailedAttempt> {
        let url = self.base_url.clone();
        let is_get = request
            .try_clone()
            .and_then(|r| r.build().ok())
            .is_some_and(|r| r.method() == reqwest::Method::GET);
        let response = request.send().await.map_err(|e| FailedAttempt {
            retry: e.is_connect() || is_get,
            error: BackendError::Unreachable {
                url: url.clone(),
                message: e.to_string(),
            },
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry = match status.as_u16() {
            429 | 503 => true,
            502 | 504 => is_get,
            _ => false,
        };
        let bytes = response.bytes().await.unwrap_or_default();
        let message = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        Err(FailedAttempt {
            retry,
            error: BackendError::Api {
                url,
                status: status.as_u16(),
                message,
            },
        })
    }

    async fn send<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, BackendError> {
        let url = self.base_url.clone();
        let response = self.send_checked(request).await?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| BackendError::Unreachable {
                url: url.clone(),
                message: e.to_string(),
            })?;
        serde_json::from_slice(&bytes).map_err(|e| BackendError::Api {
            url,
            status: status.as_u16(),
            message: format!("unexpected response ({e})"),
        })
    }
}
