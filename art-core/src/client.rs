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

/// The HTTP client for requests to `base_url` from the running tokio runtime: one per runtime,
/// base URL and timeout, kept and shared, so that a GRPO step's 128 rollouts reuse one client and
/// its pooled connections. Built per request, the rollouts of a step built theirs one after
/// another as they were first polled: with the one async-openai made beside it (see
/// `ChatEndpoint::client`), ~4 ms a request on a 2-core machine, and the last of the CPU main
/// job's 128 requests reached the server ~0.45 s after the first rollout started. Keyed by runtime
/// because a pooled connection is driven by a task of the runtime that opened it: in the kernel
/// each cell may run its own runtime, and a connection of a finished cell's runtime is dead.
/// Outside a runtime a fresh client is built (and not kept).
pub(crate) fn request_client(base_url: &str, timeout: Option<Duration>) -> reqwest::Client {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => CLIENTS.get_or_make((runtime.id(), base_url.to_string(), timeout), || {
            build_client(base_url, timeout)
        }),
        Err(_) => build_client(base_url, timeout),
    }
}

static CLIENTS: RecentValues<(tokio::runtime::Id, String, Option<Duration>), reqwest::Client> =
    RecentValues::new();

/// No idle timeout on pooled connections: its reaper is a task that calls tokio's timer from a
/// runtime thread, where (in the kernel) the cell's tokio has no context. A plain `http://`
/// server (a local backend) gets no TLS roots: loading the system's took ~2.6 ms per client on a
/// 2-core machine.
fn build_client(base_url: &str, timeout: Option<Duration>) -> reqwest::Client {
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

/// The values made for the most recent keys (a few: runtimes come and go with notebook cells,
/// and a dropped value closes what it holds, such as a dead runtime's connections).
struct RecentValues<K, V> {
    entries: std::sync::Mutex<std::collections::VecDeque<(K, V)>>,
}

impl<K: PartialEq, V: Clone> RecentValues<K, V> {
    const KEPT: usize = 8;

    const fn new() -> Self {
        RecentValues {
            entries: std::sync::Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// The value kept for `key`, or a new one from `make` (kept, the oldest dropped past `KEPT`).
    fn get_or_make(&self, key: K, make: impl FnOnce() -> V) -> V {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, value)) = entries.iter().find(|(k, _)| *k == key) {
            return value.clone();
        }
        let value = make();
        entries.push_back((key, value.clone()));
        if entries.len() > Self::KEPT {
            entries.pop_front();
        }
        value
    }
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

    /// A client for this endpoint; its HTTP client (and connections) is shared by the requests
    /// made from the same runtime (see `request_client`).
    fn client(&self) -> async_openai::Client<EndpointConfig> {
        // async-openai sends an empty bearer token when no key is set; servers that need none ignore it.
        let config = OpenAIConfig::new()
            .with_api_base(&self.base_url)
            .with_api_key(self.api_key.clone().unwrap_or_default());
        // `build`, not `with_config(..).with_http_client(..)`: `with_config` first makes a default
        // HTTP client of its own (~2.5 ms, loading the system's TLS roots) that is thrown away.
        let http = request_client(&self.base_url, Some(self.timeout));
        async_openai::Client::build(http, EndpointConfig(config))
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

#[cfg(test)]
mod tests {
    use super::RecentValues;

    #[test]
    fn a_value_is_made_once_per_key_and_only_recent_keys_are_kept() {
        let kept = RecentValues::new();
        let made = std::cell::Cell::new(0);
        let get = |key: usize| {
            kept.get_or_make(key, || {
                made.set(made.get() + 1);
                key * 10
            })
        };
        assert_eq!((get(1), get(1), get(2)), (10, 10, 20));
        for key in 3..=9 {
            get(key);
        }
        assert_eq!(get(2), 20);
        assert_eq!(made.get(), 9, "keys 1-9 made once each, key 2 still kept");
        get(1); // dropped as the oldest when key 9 came: made again
        assert_eq!(made.get(), 10);
    }

    #[test]
    fn each_runtime_gets_its_own_client_so_no_request_waits_on_an_idle_runtime() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", server.local_addr().unwrap());
        // Answers every request on every connection, keeping connections open (keep-alive).
        std::thread::spawn(move || {
            for stream in server.incoming().flatten() {
                std::thread::spawn(move || answer_each_request(stream));
            }
        });
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let get = |url: String| async move {
            let client = super::request_client(&url, None);
            let reply = client.get(&url).send();
            let reply = tokio::time::timeout(std::time::Duration::from_secs(5), reply).await;
            reply
                .expect("no answer in 5 s")
                .unwrap()
                .text()
                .await
                .unwrap()
        };
        // A runtime that stays alive but is no longer driven (as a finished notebook cell's may):
        // its pooled connection is served by a task of that runtime, which nothing polls now.
        let first = runtime();
        assert_eq!(first.block_on(get(url.clone())), "ok");
        assert_eq!(runtime().block_on(get(url.clone())), "ok");
        assert_eq!(first.block_on(get(url.clone())), "ok");
    }

    fn answer_each_request(stream: std::net::TcpStream) {
        use std::io::{BufRead, BufReader, Write};
        let mut writer = stream.try_clone().unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                let reply = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if writer.write_all(reply.as_bytes()).is_err() {
                    return;
                }
            }
        }
    }
}
