//! A client for any OpenAI-compatible chat endpoint (our backend, a local server, a provider),
//! built on async-openai with our own request and response types, so that the token ids and
//! logprobs our backend returns reach the caller intact.

use std::time::Duration;

use async_openai::config::{Config, OpenAIConfig};
use async_openai::error::OpenAIError;
use backon::ExponentialBuilder;
use opentelemetry::trace::SpanKind;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use secrecy::SecretString;

use crate::telemetry;
use crate::types::{ChatCompletion, ChatCompletionRequest};

/// async-openai's configuration of our clients: OpenAI's, plus the W3C trace-context headers of
/// the span current when a request is made (a rollout's, when traces are on), so that the
/// server's `chat` span joins the rollout's trace.
#[derive(Debug, Clone)]
pub struct EndpointConfig(OpenAIConfig);

impl Config for EndpointConfig {
    fn headers(&self) -> HeaderMap {
        let mut headers = self.0.headers();
        add_trace_headers(&mut headers);
        headers
    }

    fn url(&self, path: &str) -> String {
        self.0.url(path)
    }

    fn query(&self) -> Vec<(&str, &str)> {
        self.0.query()
    }

    fn api_base(&self) -> &str {
        self.0.api_base()
    }

    fn api_key(&self) -> &SecretString {
        self.0.api_key()
    }
}

/// Adds the current span's trace-context headers (none when traces are off).
pub(crate) fn add_trace_headers(headers: &mut HeaderMap) {
    for (name, value) in telemetry::headers_of(&opentelemetry::Context::current()) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            headers.insert(name, value);
        }
    }
}

/// Where to send chat completion requests: base URL (ending in `/v1`), API key, model name.
#[derive(Clone)]
pub struct ChatEndpoint {
    base_url: String,
    api_key: Option<String>,
    model: String,
    timeout: Duration,
}

impl std::fmt::Debug for ChatEndpoint {
    /// Leaves the API key out, so that it cannot end up in a notebook's output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatEndpoint")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{url} answered HTTP {status}: {message}")]
    Api {
        url: String,
        status: u16,
        message: String,
    },
    #[error("could not reach {url}: {message}")]
    Transport { url: String, message: String },
    #[error("{url} sent a response that is not a chat completion: {message}")]
    BadResponse { url: String, message: String },
}

impl ClientError {
    /// Whether trying again later may succeed: the server was unreachable or overloaded (429,
    /// 502, 503, 504), as opposed to refusing the request itself.
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Api { status, .. } => matches!(status, 429 | 502 | 503 | 504),
            ClientError::BadResponse { .. } => false,
        }
    }
}

/// How the backend client and retried rollouts wait before trying again what may succeed later
/// (an overloaded server's 429/503, a connection refused or reset): after 0.25 s, then twice as long each time up to 8 s, each wait
/// with random jitter (so that many rollouts refused together do not all come back together),
/// at most `retries` more attempts.
pub(crate) fn backoff(retries: usize) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(8))
        .with_factor(2.0)
        .with_jitter()
        .with_max_times(retries)
}

/// The HTTP client of one request to `base_url` (see `ChatEndpoint::client` for why none is
/// kept). No idle timeout on pooled connections: its reaper is a task that calls tokio's timer
/// from a runtime thread, where (in the kernel) the cell's tokio has no context. A plain `http://`
/// server (a local backend) gets no TLS roots: loading the system's took ~2.6 ms per client on a
/// 2-core machine, where it was ~0.35 s of each of the CPU main job's steps (128 rollouts).
pub(crate) fn request_client(base_url: &str, timeout: Option<Duration>) -> reqwest::Client {
    let mut builder = reqwest::Client::builder().pool_idle_timeout(None);
    if base_url.starts_with("http://") {
        builder = builder.tls_certs_only(Vec::new());
    }
    match timeout {
        Some(timeout) => builder.timeout(timeout),
        None => builder,
    }
    .build()
    .expect("a reqwest client builds")
}

impl ChatEndpoint {
    /// An endpoint at `base_url` (for example `http://127.0.0.1:8000/v1`) serving `model`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self::build(
            base_url.into().trim_end_matches('/').to_string(),
            None,
            model.into(),
            Duration::from_secs(600),
        )
    }

    /// The same endpoint, authenticating with this key (sent as a bearer token).
    pub fn with_api_key(self, api_key: impl Into<String>) -> Self {
        Self::build(
            self.base_url,
            Some(api_key.into()),
            self.model,
            self.timeout,
        )
    }

    /// The same endpoint with another per-request timeout (default 10 minutes).
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self::build(self.base_url, self.api_key, self.model, timeout)
    }

    /// The same server, another model name (e.g. a newer checkpoint `name@step`).
    pub fn with_model(&self, model: impl Into<String>) -> Self {
        ChatEndpoint {
            model: model.into(),
            ..self.clone()
        }
    }

    fn build(base_url: String, api_key: Option<String>, model: String, timeout: Duration) -> Self {
        ChatEndpoint {
            base_url,
            api_key,
            model,
            timeout,
        }
    }

    /// A client for one request. Clients are not kept: in the ART kernel each cell is compiled
    /// on its own with its own copy of tokio, and a client made in one cell spawns its connection
    /// tasks through that cell's copy, which in a later cell finds no runtime ("there is no
    /// reactor running"). A client made where it is used always matches the running cell.
    fn client(&self) -> async_openai::Client<EndpointConfig> {
        // async-openai sends an empty bearer token when no key is set; servers that need none ignore it.
        let config = OpenAIConfig::new()
            .with_api_base(&self.base_url)
            .with_api_key(self.api_key.clone().unwrap_or_default());
        async_openai::Client::with_config(EndpointConfig(config))
            .with_http_client(request_client(&self.base_url, Some(self.timeout)))
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// An async-openai client bound to this endpoint, for code written against async-openai's types.
    pub fn openai_client(&self) -> async_openai::Client<EndpointConfig> {
        self.client()
    }

    /// Sends one (non-streaming) chat completion request. An empty `model` in the request is
    /// filled with this endpoint's model. async-openai's client retries a 429, a 5xx and a refused
    /// connection by itself (three times, after 0.1, 0.2, 0.4 s, or the server's `Retry-After`).
    pub async fn complete(
        &self,
        mut request: ChatCompletionRequest,
    ) -> Result<ChatCompletion, ClientError> {
        if request.model.is_empty() {
            request.model = self.model.clone();
        }
        request.stream = None;
        let span = telemetry::start_chat(&request, SpanKind::Client);
        let client = self.client();
        let answer = async {
            client
                .chat()
                .create_byot(request)
                .await
                .map_err(|error| self.describe(error))
        };
        telemetry::in_span(span, answer, telemetry::chat_response_attributes).await
    }

    fn describe(&self, error: OpenAIError) -> ClientError {
        let url = format!("{}/chat/completions", self.base_url);
        match error {
            OpenAIError::ApiError(response) => ClientError::Api {
                url,
                status: response.status_code.as_u16(),
                message: response.api_error.message,
            },
            OpenAIError::Reqwest(error) => ClientError::Transport {
                url,
                message: error.to_string(),
            },
            OpenAIError::JSONDeserialize(error, content) => {
                let excerpt: String = content.chars().take(300).collect();
                ClientError::BadResponse {
                    url,
                    message: format!("{error}; body starts: {excerpt}"),
                }
            }
            other => ClientError::Transport {
                url,
                message: other.to_string(),
            },
        }
    }
}
