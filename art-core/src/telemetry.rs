//! Traces over OpenTelemetry, for the tools people watch runs in (Langfuse, Weave, Jaeger, any
//! OTLP collector). Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set;
//! then the standard variables configure everything (`OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_BSP_*`,
//! `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`, `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none` turn export off).
//!
//! The spans: `gather_trajectory_groups` > `trajectory_group` > `rollout` in the process that
//! gathers; `chat <model>` for every completion (the client's, with the W3C `traceparent` header
//! sent along, and the server's, joined to it, with the GenAI semantic conventions' attributes);
//! `ruler` per judged group; `train_step` and `model.log` on both sides. A process with no span
//! open joins the one named by `TRACEPARENT`, or written in the file `ART_TRACEPARENT_FILE`
//! names (the notebook kernel writes each cell's span there, so a cell's rollouts nest under it).
//!
//! Spans are exported in the background by the SDK's batch processor (its own thread, a bounded
//! queue): a rollout or a training step never waits on the endpoint. An endpoint that refuses or
//! hangs costs one warning; spans that could not be sent are counted and reported at
//! [`shutdown`]. Without the `otlp` feature, or with no endpoint set, every span is the
//! `opentelemetry` API's no-op.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::OnceLock;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{FutureExt as _, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue};

use crate::types::{ChatCompletion, ChatCompletionRequest};

/// The instrumentation scope our spans are reported under.
const SCOPE: &str = "art-for-rust";

/// Whether spans are exported by this process (the exporter is set up on first use).
pub fn enabled() -> bool {
    *EXPORTING.get_or_init(|| exporter::install(None))
}

static EXPORTING: OnceLock<bool> = OnceLock::new();

/// Sets up export (when the environment asks for it) under `service` unless
/// `OTEL_SERVICE_NAME` names another; the first call in a process decides. `art serve` and the
/// kernel call it to name themselves; other processes get `art` on their first span.
pub fn init(service: &str) -> bool {
    *EXPORTING.get_or_init(|| exporter::install(Some(service)))
}

/// Sends what is queued and stops exporting (waiting at most a few seconds for an endpoint that
/// hangs), reporting spans that could not be sent. Call it at the end of a program; `art serve`
/// calls it when it stops. A no-op when nothing is exported.
pub fn shutdown() {
    if EXPORTING.get() == Some(&true) {
        exporter::shutdown();
    }
}

/// Starts a span as a child of the current context's span (or of the process's ambient parent,
/// see the module doc) and returns the context holding it: run work under it with [`in_span`]
/// (or `.with_context(cx.clone())` and [`end_with`]).
pub fn start(name: impl Into<String>, kind: SpanKind, attributes: Vec<KeyValue>) -> Context {
    if !enabled() {
        // Before `parent()`: no environment or file is read for a span nobody exports.
        return Context::current();
    }
    start_with_parent(&parent(), name, kind, attributes)
}

/// As [`start`], under `parent` (e.g. a context extracted from a request's headers).
pub fn start_with_parent(
    parent: &Context,
    name: impl Into<String>,
    kind: SpanKind,
    attributes: Vec<KeyValue>,
) -> Context {
    if !enabled() {
        return Context::current();
    }
    let tracer = global::tracer(SCOPE);
    let span = tracer
        .span_builder(name.into())
        .with_kind(kind)
        .with_attributes(attributes)
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

/// Ends the span of `cx`, as failed with `error` when there is one.
pub fn end<E: Display>(cx: &Context, error: Option<&E>) {
    let span = cx.span();
    if let Some(error) = error {
        span.set_status(Status::error(error.to_string()));
    }
    span.end();
}

/// Ends the span of `cx` as `result` says: a success with the attributes `on_ok` gives (computed
/// only when spans are exported), a failure with its error as the status.
pub fn end_with<T, E: Display>(
    cx: &Context,
    result: &Result<T, E>,
    on_ok: impl FnOnce(&T) -> Vec<KeyValue>,
) {
    match result {
        Ok(value) => {
            if enabled() {
                cx.span().set_attributes(on_ok(value));
            }
            end::<E>(cx, None);
        }
        Err(error) => end(cx, Some(error)),
    }
}

/// Runs `work` under the span of `cx`, then ends the span with [`end_with`].
pub async fn in_span<T, E: Display>(
    cx: Context,
    work: impl Future<Output = Result<T, E>>,
    on_ok: impl FnOnce(&T) -> Vec<KeyValue>,
) -> Result<T, E> {
    let result = work.with_context(cx.clone()).await;
    end_with(&cx, &result, on_ok);
    result
}

/// The parent of a new span: the current one, else the ambient parent of the process.
fn parent() -> Context {
    let current = Context::current();
    if current.has_active_span() {
        return current;
    }
    match ambient_traceparent() {
        Some(traceparent) => extract(&HashMap::from([("traceparent".to_string(), traceparent)])),
        None => current,
    }
}

/// `TRACEPARENT`, or the first line of the file `ART_TRACEPARENT_FILE` names (re-read at every
/// root span: the kernel rewrites it for every cell).
fn ambient_traceparent() -> Option<String> {
    if let Some(path) = std::env::var_os("ART_TRACEPARENT_FILE") {
        if let Ok(text) = std::fs::read_to_string(path) {
            let line = text.lines().next().unwrap_or("").trim().to_string();
            if !line.is_empty() {
                return Some(line);
            }
        }
    }
    std::env::var("TRACEPARENT").ok().filter(|t| !t.is_empty())
}

/// The W3C trace-context headers (`traceparent`, `tracestate`) of `cx`; empty when nothing is
/// exported.
pub fn headers_of(cx: &Context) -> Vec<(String, String)> {
    struct Headers(Vec<(String, String)>);
    impl Injector for Headers {
        fn set(&mut self, key: &str, value: String) {
            self.0.push((key.to_string(), value));
        }
    }
    let mut headers = Headers(Vec::new());
    if enabled() {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut headers));
    }
    headers.0
}

/// The context a request's trace-context headers carry (lower-case names).
pub fn extract(headers: &HashMap<String, String>) -> Context {
    struct Headers<'a>(&'a HashMap<String, String>);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }
    if !enabled() {
        return Context::new();
    }
    global::get_text_map_propagator(|p| p.extract(&Headers(headers)))
}

/// Cuts a text attribute (a prompt, a completion) to `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT` bytes
/// (16 KiB when unset), on a character boundary.
pub fn cut(text: String) -> String {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    let limit = *LIMIT.get_or_init(|| {
        std::env::var("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(16 * 1024)
    });
    let mut text = text;
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(feature = "otlp")]
mod exporter {
    //! The OTLP/HTTP exporter behind the global tracer provider.

    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use opentelemetry::global;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{
        BatchSpanProcessor, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
    };
    use opentelemetry_sdk::Resource;

    /// How long [`super::shutdown`] waits for the last batch.
    const SHUTDOWN_WAIT: Duration = Duration::from_secs(3);

    static PROVIDER: OnceLock<(SdkTracerProvider, Arc<Counts>)> = OnceLock::new();

    #[derive(Debug, Default)]
    struct Counts {
        ended: AtomicU64,
        exported: AtomicU64,
        warned: AtomicBool,
    }

    pub(super) fn endpoint() -> Option<String> {
        [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
    }

    pub(super) fn install(service: Option<&str>) -> bool {
        // The specification's switches for turning an SDK off whatever else is set.
        let var = |name: &str| {
            std::env::var(name)
                .unwrap_or_default()
                .trim()
                .to_lowercase()
        };
        if var("OTEL_SDK_DISABLED") == "true" || var("OTEL_TRACES_EXPORTER") == "none" {
            return false;
        }
        let Some(endpoint) = endpoint() else {
            return false;
        };
        // OTLP over HTTP with protobuf bodies: what Langfuse, Weave and collectors all accept.
        // The builder reads the endpoint (appending /v1/traces to the generic one), headers and
        // timeout from the standard variables itself.
        let exporter = match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()
        {
            Ok(exporter) => exporter,
            Err(e) => {
                eprintln!("art: traces are off: cannot export to {endpoint}: {e}");
                return false;
            }
        };
        let counts = Arc::new(Counts::default());
        let watched = Watched {
            inner: exporter,
            endpoint,
            counts: counts.clone(),
        };
        let processor = Counted {
            inner: BatchSpanProcessor::builder(watched).build(),
            counts: counts.clone(),
        };
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(service.unwrap_or("art").to_string());
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build();
        global::set_text_map_propagator(TraceContextPropagator::new());
        global::set_tracer_provider(provider.clone());
        let _ = PROVIDER.set((provider, counts));
        true
    }

    pub(super) fn shutdown() {
        let Some((provider, counts)) = PROVIDER.get() else {
            return;
        };
        let _ = provider.shutdown_with_timeout(SHUTDOWN_WAIT);
        let ended = counts.ended.load(Ordering::Relaxed);
        let exported = counts.exported.load(Ordering::Relaxed);
        if exported < ended {
            eprintln!(
                "art: {} of {ended} spans were not exported (endpoint unreachable, too slow, or \
                 the queue was full)",
                ended - exported
            );
        }
    }

    /// Counts the spans that ended, so that [`shutdown`] can say how many never left.
    #[derive(Debug)]
    struct Counted {
        inner: BatchSpanProcessor,
        counts: Arc<Counts>,
    }

    impl SpanProcessor for Counted {
        fn on_start(&self, span: &mut Span, cx: &opentelemetry::Context) {
            self.inner.on_start(span, cx);
        }

        fn on_end(&self, span: SpanData) {
            self.counts.ended.fetch_add(1, Ordering::Relaxed);
            self.inner.on_end(span);
        }

        fn force_flush(&self) -> OTelSdkResult {
            self.inner.force_flush()
        }

        fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
            self.inner.shutdown_with_timeout(timeout)
        }

        fn set_resource(&mut self, resource: &Resource) {
            self.inner.set_resource(resource);
        }
    }

    /// The OTLP exporter, counting what it delivered and warning once when it cannot.
    #[derive(Debug)]
    struct Watched {
        inner: opentelemetry_otlp::SpanExporter,
        endpoint: String,
        counts: Arc<Counts>,
    }

    impl SpanExporter for Watched {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            let count = batch.len() as u64;
            let result = self.inner.export(batch).await;
            match &result {
                Ok(()) => {
                    self.counts.exported.fetch_add(count, Ordering::Relaxed);
                }
                Err(e) => {
                    if !self.counts.warned.swap(true, Ordering::Relaxed) {
                        eprintln!(
                            "art: cannot export traces to {}: {e}. Spans are dropped until it \
                             answers (training goes on; this is said once)",
                            self.endpoint
                        );
                    }
                }
            }
            result
        }

        fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
            self.inner.shutdown_with_timeout(timeout)
        }

        fn force_flush(&self) -> OTelSdkResult {
            self.inner.force_flush()
        }

        fn set_resource(&mut self, resource: &Resource) {
            self.inner.set_resource(resource);
        }
    }
}

#[cfg(not(feature = "otlp"))]
mod exporter {
    pub(super) fn install(_service: Option<&str>) -> bool {
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
            eprintln!(
                "art: OTEL_EXPORTER_OTLP_ENDPOINT is set, but this build has no OTLP exporter \
                 (art-core's `otlp` feature)"
            );
        }
        false
    }

    pub(super) fn shutdown() {}
}

/// A `chat <model>` span for a completion request, with its GenAI attributes (the client's
/// `Client` span, or the server's `Server` span).
pub fn start_chat(request: &ChatCompletionRequest, kind: SpanKind) -> Context {
    let attributes = if enabled() {
        chat_request_attributes(request)
    } else {
        Vec::new()
    };
    start(format!("chat {}", request.model), kind, attributes)
}

/// Records what a completion answered on its `chat` span and ends it.
pub fn end_chat(cx: &Context, response: &ChatCompletion) {
    end_with(cx, &Ok::<_, String>(response), |r| {
        chat_response_attributes(r)
    });
}

/// A chat completion request as GenAI attributes (the span's name is `chat <model>`).
pub fn chat_request_attributes(request: &ChatCompletionRequest) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new(genai::OPERATION, "chat"),
        KeyValue::new(genai::PROVIDER, "openai"),
        KeyValue::new(genai::REQUEST_MODEL, request.model.clone()),
        KeyValue::new(
            genai::INPUT_MESSAGES,
            cut(serde_json::to_string(&request.messages).unwrap_or_default()),
        ),
    ];
    if let Some(t) = request.temperature {
        attributes.push(KeyValue::new(genai::REQUEST_TEMPERATURE, t));
    }
    if let Some(max) = request.max_completion_tokens.or(request.max_tokens) {
        attributes.push(KeyValue::new(genai::REQUEST_MAX_TOKENS, i64::from(max)));
    }
    attributes
}

/// What a chat completion answered, as GenAI attributes.
pub fn chat_response_attributes(response: &ChatCompletion) -> Vec<KeyValue> {
    let messages: Vec<_> = response.choices.iter().map(|c| &c.message).collect();
    let finish: Vec<opentelemetry::StringValue> = response
        .choices
        .iter()
        .map(|c| c.finish_reason.clone().unwrap_or_default().into())
        .collect();
    let mut attributes = vec![
        KeyValue::new(genai::RESPONSE_MODEL, response.model.clone()),
        KeyValue::new(genai::RESPONSE_ID, response.id.clone()),
        KeyValue::new(
            genai::FINISH_REASONS,
            opentelemetry::Value::Array(finish.into()),
        ),
        KeyValue::new(
            genai::OUTPUT_MESSAGES,
            cut(serde_json::to_string(&messages).unwrap_or_default()),
        ),
    ];
    if let Some(usage) = &response.usage {
        attributes.push(KeyValue::new(
            genai::INPUT_TOKENS,
            usage.prompt_tokens as i64,
        ));
        attributes.push(KeyValue::new(
            genai::OUTPUT_TOKENS,
            usage.completion_tokens as i64,
        ));
    }
    attributes
}

/// Attribute names of the GenAI semantic conventions we set.
pub mod genai {
    pub const OPERATION: &str = "gen_ai.operation.name";
    pub const PROVIDER: &str = "gen_ai.provider.name";
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    pub const RESPONSE_ID: &str = "gen_ai.response.id";
    pub const REQUEST_TEMPERATURE: &str = "gen_ai.request.temperature";
    pub const REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
    pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    pub const FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
    /// The request's messages as JSON (cut to the attribute length limit).
    pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
    /// The choices' messages as JSON (cut to the attribute length limit).
    pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_on_a_character_boundary() {
        let text = "é".repeat(10_000);
        let cut = cut(text);
        assert!(cut.len() <= 16 * 1024 && cut.len() > 16 * 1024 - 2);
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(super::cut("short".into()), "short");
    }
}
