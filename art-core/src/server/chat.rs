//! `POST /v1/chat/completions`: OpenAI's request in, the engine's tokens out, as one JSON answer or
//! as server-sent events. Every choice carries its sampled `token_ids` (and logprobs on request),
//! which is what training needs.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::chat_template::RenderOptions;
use crate::engine::tool_calls::{conversation_for_template, ParsedCompletion, ToolCallFormat};
use crate::engine::{
    Completion, Constraint, GenerationOutput, GenerationRequest, SampledToken, SamplingParams,
};
use crate::telemetry;
use crate::types::{
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChoiceLogprobs,
    ChunkChoice, ChunkDelta, Content, ResponseFormat, TokenLogprob, Tool, ToolCallDelta,
    TopLogprob, Usage,
};

use super::batcher::BatchEvent;
use super::error::{ApiError, ApiJson};
use super::state::AppState;

/// What a request turned into, kept to shape the answer.
struct Prepared {
    id: String,
    created: u64,
    model: String,
    /// Set when the request offered tools: how to read tool calls out of the model's text.
    tool_format: Option<ToolCallFormat>,
    logprobs: bool,
    include_usage: bool,
    n: usize,
    /// The prompt's tokens, when the request asked for them (`return_token_ids`).
    prompt_token_ids: Option<Vec<u32>>,
    /// Logprob tokens written as `token_id:<id>` (`return_tokens_as_token_ids`).
    tokens_as_ids: bool,
}

pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    // The `chat <model>` span (GenAI conventions), under the caller's rollout when it sent its
    // trace; a streamed answer ends it when the last chunk is sent.
    let span = telemetry::start_chat(&request, SpanKind::Server);
    let answer = async {
        let (prepared, generation) = prepare(&state, &request)?;
        let events = state
            .replicas
            .route(&generation)?
            .batcher
            .submit(generation)?;
        if request.stream == Some(true) {
            return Ok(stream(state.clone(), prepared, events, span.clone()).into_response());
        }
        let output = wait_for_output(events).await?;
        let completion = completion(&state, &prepared, output);
        telemetry::end_chat(&span, &completion);
        Ok(ApiJson(completion).into_response())
    }
    .await;
    if let Err(e) = &answer {
        telemetry::end(&span, Some(e));
    }
    answer
}

fn prepare(
    state: &AppState,
    request: &ChatCompletionRequest,
) -> Result<(Prepared, GenerationRequest), ApiError> {
    let adapter = state.resolve_model(&request.model)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` is empty; send at least one message.",
        ));
    }
    let offered = request.tools.as_deref().filter(|tools| !tools.is_empty());
    // With `tool_choice: "none"` the prompt still lists the tools (as OpenAI's models see them,
    // and as the trainer renders the trajectory, which does not know the tool choice); only the
    // reply is not read as a tool call.
    let tool_choice_none = request.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
    let tools = offered.filter(|_| !tool_choice_none);
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "This model ships no chat template, so it cannot serve chat completions.",
        )
    })?;
    let tool_format = tools.map(|_| template.tool_call_format());
    let conversation =
        conversation_for_template(&request.messages, offered, template.tool_call_format());
    let mut render = RenderOptions::generation();
    render.kwargs = request.chat_template_kwargs.clone().unwrap_or_default();
    let prompt_text = template
        .render_with_options(&conversation.messages, conversation.tools, &render)
        .map_err(|e| {
            ApiError::invalid_param(
                "messages",
                format!("The chat template could not render these messages: {e}"),
            )
        })?;
    let prompt = state
        .engine
        .encode(&prompt_text, false)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let mut params = sampling_params(
        request,
        prompt.len(),
        state.context_length(),
        state.default_max_tokens,
    )?;
    params.constraint = response_constraint(request.response_format.as_ref())?;
    if let Some(forced) = forced_tool_call(request, tools, tool_format)? {
        if params.constraint.is_some() {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "a forced tool call and a response_format cannot both shape the reply; drop one",
            ));
        }
        params.constraint = Some(forced);
    }
    let prepared = Prepared {
        id: format!(
            "chatcmpl-{}",
            crate::engine::tool_calls::new_tool_call_id().trim_start_matches("call_")
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: request.model.clone(),
        tool_format,
        logprobs: params.logprobs,
        include_usage: request
            .stream_options
            .as_ref()
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        n: params.n,
        prompt_token_ids: (request.return_token_ids == Some(true)).then(|| prompt.clone()),
        tokens_as_ids: request.return_tokens_as_token_ids == Some(true),
    };
    Ok((
        prepared,
        GenerationRequest {
            prompt,
            params,
            adapter,
        },
    ))
}

/// `response_format` as a decoding constraint: the reply is then valid JSON (for the schema) by
/// construction.
fn response_constraint(format: Option<&ResponseFormat>) -> Result<Option<Constraint>, ApiError> {
    match format {
        None | Some(ResponseFormat::Text) => Ok(None),
        Some(ResponseFormat::JsonObject) => Ok(Some(Constraint::JsonObject)),
        Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
            Some(schema) => Ok(Some(Constraint::JsonSchema(schema.clone()))),
            None => Err(ApiError::invalid_param(
                "response_format",
                "response_format json_schema needs a `schema`.",
            )),
        },
    }
}

/// `tool_choice: "required"` or a named function as a decoding constraint: the reply is then a
/// call (of that function) with arguments valid against its schema.
fn forced_tool_call(
    request: &ChatCompletionRequest,
    tools: Option<&[Tool]>,
    format: Option<ToolCallFormat>,
) -> Result<Option<Constraint>, ApiError> {
    let choice = request.tool_choice.as_ref();
    let (Some(tools), Some(format)) = (tools, format) else {
        let forced =
            choice.is_some_and(|c| c.as_str() != Some("none") && c.as_str() != Some("auto"));
        return if forced {
            Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice asks for a tool call but the request has no `tools`",
            ))
        } else {
            Ok(None)
        };
    };
    Constraint::from_tool_choice(tools, format, choice)
        .map_err(|e| ApiError::invalid_param("tool_choice", e.to_string()))
}

/// OpenAI's sampling parameters, checked, as the engine takes them.
fn sampling_params(
    request: &ChatCompletionRequest,
    prompt_tokens: usize,
    context: usize,
    default_max_tokens: usize,
) -> Result<SamplingParams, ApiError> {
    let temperature = request.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("temperature must be between 0 and 2, got {temperature}."),
        ));
    }
    let top_p = request.top_p.unwrap_or(1.0);
    if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}."),
        ));
    }
    let top_k = match request.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}."),
            ))
        }
    };
    let n = request.n.unwrap_or(1) as usize;
    if !(1..=128).contains(&n) {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be between 1 and 128, got {n}."),
        ));
    }
    let logprobs = request.logprobs.unwrap_or(false);
    let top_logprobs = request.top_logprobs.unwrap_or(0) as usize;
    if top_logprobs > 20 {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            format!("top_logprobs must be at most 20, got {top_logprobs}."),
        ));
    }
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs needs `logprobs: true`.",
        ));
    }
    let stop = request
        .stop
        .as_ref()
        .map(|s| s.to_vec())
        .unwrap_or_default();
    if stop.len() > 16 || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param(
            "stop",
            "stop takes up to 16 non-empty strings.",
        ));
    }
    let room = context.saturating_sub(prompt_tokens);
    let max_tokens = match request.max_new_tokens() {
        Some(0) => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "max_tokens must be at least 1.",
            ))
        }
        Some(asked) => asked as usize,
        None => default_max_tokens.min(room),
    };
    if room == 0 || prompt_tokens + max_tokens > context {
        return Err(ApiError::context_length(format!(
            "This model's context is {context} tokens; the messages take {prompt_tokens} and {max_tokens} more \
             were asked for. Shorten the messages or lower max_tokens."
        )));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k,
        seed: request.seed,
        max_tokens,
        stop,
        n,
        logprobs,
        top_logprobs,
        ignore_eos: request.ignore_eos.unwrap_or(false),
        ..SamplingParams::default()
    })
}

async fn wait_for_output(
    mut events: mpsc::UnboundedReceiver<BatchEvent>,
) -> Result<GenerationOutput, ApiError> {
    while let Some(event) = events.recv().await {
        match event {
            BatchEvent::Token(_) => {}
            BatchEvent::Done(output) => return Ok(output),
            BatchEvent::Failed {
                message,
                invalid_request,
            } => return Err(failure(message, invalid_request)),
        }
    }
    Err(ApiError::internal(
        "the batching thread stopped before answering",
    ))
}

fn failure(message: String, invalid_request: bool) -> ApiError {
    if invalid_request {
        ApiError::bad_request(message)
    } else {
        ApiError::internal(message)
    }
}

fn completion(state: &AppState, prepared: &Prepared, output: GenerationOutput) -> ChatCompletion {
    let choices = output
        .completions
        .iter()
        .map(|c| choice(state, prepared, c))
        .collect();
    ChatCompletion {
        id: prepared.id.clone(),
        object: "chat.completion".into(),
        created: prepared.created,
        model: prepared.model.clone(),
        choices,
        usage: Some(usage(&output)),
        system_fingerprint: None,
        extra: prepared
            .prompt_token_ids
            .iter()
            .map(|ids| ("prompt_token_ids".to_string(), json!(ids)))
            .collect(),
    }
}

/// The token counts of an answer (the same whether streamed or not).
fn usage(output: &GenerationOutput) -> Usage {
    let completion_tokens = output.completions.iter().map(|c| c.tokens.len() as u64);
    Usage::new(output.prompt_tokens as u64, completion_tokens.sum())
        .with_cached_tokens(output.cached_prompt_tokens as u64)
}

fn choice(state: &AppState, prepared: &Prepared, completion: &Completion) -> Choice {
    let parsed = parse_message(prepared.tool_format, &completion.text);
    let finish_reason = if parsed.tool_calls.is_empty() {
        completion.finish_reason.as_str()
    } else {
        "tool_calls"
    };
    Choice {
        index: completion.index as u32,
        message: parsed.into_assistant_message(),
        finish_reason: Some(finish_reason.to_string()),
        logprobs: prepared.logprobs.then(|| ChoiceLogprobs {
            content: Some(
                completion
                    .tokens
                    .iter()
                    .map(|t| token_logprob(state, t, prepared.tokens_as_ids))
                    .collect(),
            ),
            refusal: None,
        }),
        token_ids: Some(completion.token_ids()),
        extra: Default::default(),
    }
}

fn parse_message(tool_format: Option<ToolCallFormat>, text: &str) -> ParsedCompletion {
    match tool_format {
        Some(format) => format.parse(text),
        None => ParsedCompletion {
            content: Some(text.to_string()),
            tool_calls: Vec::new(),
        },
    }
}

/// A sampled token's logprob entry; `as_ids` writes tokens as `token_id:<id>` (vLLM's
/// `return_tokens_as_token_ids`), which names them exactly where text could be ambiguous.
fn token_logprob(state: &AppState, token: &SampledToken, as_ids: bool) -> TokenLogprob {
    let name = |id: u32| {
        if as_ids {
            format!("token_id:{id}")
        } else {
            state.token_text(id)
        }
    };
    let text = name(token.id);
    TokenLogprob {
        bytes: Some(text.as_bytes().to_vec()),
        token: text,
        logprob: f64::from(token.logprob),
        top_logprobs: token
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| {
                let text = name(id);
                TopLogprob {
                    bytes: Some(text.as_bytes().to_vec()),
                    token: text,
                    logprob: f64::from(logprob),
                }
            })
            .collect(),
    }
}

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. The text comes as
/// the scheduler releases it ([`TokenEvent::text`](crate::engine::TokenEvent)); the last chunk
/// of each choice is built by [`choice`], as the non-streamed answer is.
fn stream(
    state: AppState,
    prepared: Prepared,
    mut events: mpsc::UnboundedReceiver<BatchEvent>,
    span: opentelemetry::Context,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let (sender, mut receiver) = mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let chunk = |choices: Vec<ChunkChoice>| ChatCompletionChunk {
            id: prepared.id.clone(),
            object: "chat.completion.chunk".into(),
            created: prepared.created,
            model: prepared.model.clone(),
            choices,
            usage: None,
            prompt_token_ids: None,
        };
        for index in 0..prepared.n {
            let mut first = chunk(vec![ChunkChoice {
                index: index as u32,
                delta: ChunkDelta {
                    role: Some("assistant".into()),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                ..ChunkChoice::default()
            }]);
            // vLLM sends the prompt's tokens with the first chunk.
            if index == 0 {
                first.prompt_token_ids = prepared.prompt_token_ids.clone();
            }
            if sender.send(data(&first)).await.is_err() {
                return;
            }
        }
        while let Some(event) = events.recv().await {
            match event {
                BatchEvent::Token(token) => {
                    // With tools on, the reply may turn out to be a tool call: it is sent whole at the end.
                    let delta = if prepared.tool_format.is_some() {
                        String::new()
                    } else {
                        token.text
                    };
                    let logprobs = prepared.logprobs.then(|| ChoiceLogprobs {
                        content: Some(vec![token_logprob(
                            &state,
                            &token.token,
                            prepared.tokens_as_ids,
                        )]),
                        refusal: None,
                    });
                    if delta.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    let body = chunk(vec![ChunkChoice {
                        index: token.index as u32,
                        delta: ChunkDelta {
                            content: Some(delta),
                            ..ChunkDelta::default()
                        },
                        logprobs,
                        ..ChunkChoice::default()
                    }]);
                    if sender.send(data(&body)).await.is_err() {
                        return;
                    }
                }
                BatchEvent::Done(output) => {
                    telemetry::end_with(&span, &Ok::<_, ApiError>(&output), |output| {
                        streamed_attributes(&prepared, output)
                    });
                    for completion in &output.completions {
                        let whole = choice(&state, &prepared, completion);
                        // Without tools the token chunks carried the whole text (their deltas add
                        // up to it); with tools none was sent, so the text before the calls
                        // comes here.
                        let rest = match prepared.tool_format {
                            Some(_) => whole.message.content.as_ref().map(Content::text),
                            None => None,
                        };
                        let tool_calls = (!whole.message.tool_calls.is_empty()).then(|| {
                            whole
                                .message
                                .tool_calls
                                .iter()
                                .enumerate()
                                .map(|(i, call)| ToolCallDelta {
                                    index: i as u32,
                                    call: call.clone(),
                                })
                                .collect()
                        });
                        let body = chunk(vec![ChunkChoice {
                            index: whole.index,
                            delta: ChunkDelta {
                                role: None,
                                content: rest.filter(|text| !text.is_empty()),
                                tool_calls,
                            },
                            logprobs: None,
                            finish_reason: whole.finish_reason,
                            token_ids: whole.token_ids,
                        }]);
                        if sender.send(data(&body)).await.is_err() {
                            return;
                        }
                    }
                    if prepared.include_usage {
                        let mut body = chunk(Vec::new());
                        body.usage = Some(usage(&output));
                        let _ = sender.send(data(&body)).await;
                    }
                    let _ = sender.send(Event::default().data("[DONE]")).await;
                    return;
                }
                BatchEvent::Failed {
                    message,
                    invalid_request,
                } => {
                    let error = failure(message, invalid_request);
                    telemetry::end(&span, Some(&error));
                    let _ = sender.send(error_data(&error.body())).await;
                    return;
                }
            }
        }
    });
    let stream =
        futures::stream::poll_fn(move |cx| receiver.poll_recv(cx).map(|event| event.map(Ok)));
    // A comment line every 15 s while a long generation is silent, so that proxies and clients
    // with idle timeouts keep the stream open.
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A streamed answer's GenAI attributes (the non-streamed path has the whole `ChatCompletion`).
fn streamed_attributes(prepared: &Prepared, output: &GenerationOutput) -> Vec<KeyValue> {
    use telemetry::genai;
    let completion_tokens: usize = output.completions.iter().map(|c| c.tokens.len()).sum();
    let texts: Vec<Value> = output
        .completions
        .iter()
        .map(|c| json!({"role": "assistant", "content": c.text}))
        .collect();
    let finish: Vec<opentelemetry::StringValue> = output
        .completions
        .iter()
        .map(|c| c.finish_reason.as_str().to_string().into())
        .collect();
    vec![
        KeyValue::new(genai::RESPONSE_MODEL, prepared.model.clone()),
        KeyValue::new(genai::RESPONSE_ID, prepared.id.clone()),
        KeyValue::new(genai::INPUT_TOKENS, output.prompt_tokens as i64),
        KeyValue::new(genai::OUTPUT_TOKENS, completion_tokens as i64),
        KeyValue::new(
            genai::FINISH_REASONS,
            opentelemetry::Value::Array(finish.into()),
        ),
        KeyValue::new(
            genai::OUTPUT_MESSAGES,
            telemetry::cut(Value::from(texts).to_string()),
        ),
    ]
}

fn data(chunk: &ChatCompletionChunk) -> Event {
    Event::default().data(serde_json::to_string(chunk).expect("a chunk serializes"))
}

fn error_data(body: &Value) -> Event {
    Event::default().data(body.to_string())
}
