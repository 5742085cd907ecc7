//! The socket tasks: heartbeat echoes, iopub publishes from one queue (so output keeps its order),
//! shell handles requests one at a time, control answers interrupts and shutdowns even while a
//! cell runs, and SIGINT interrupts like `interrupt_request` does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use jupyter_protocol::{
    CodeMirrorMode, CommInfoReply, CompleteReply, ConnectionInfo, DisplayData, ErrorOutput,
    ExecuteInput, ExecuteReply, ExecuteResult, ExecutionCount, HelpLink, HistoryReply,
    InspectReply, InterruptReply, IsCompleteReply, JupyterMessage, JupyterMessageContent,
    KernelInfoReply, LanguageInfo, Media, ReplyError, ReplyStatus, ShutdownReply, Status,
    StreamContent, Transient, Transport, UpdateDisplayData,
};
use tokio::sync::{mpsc, oneshot};
use zeromq::{Socket, SocketRecv, SocketSend};

use super::wire::Signer;
use super::{
    Bundle, Completeness, Engine, ErrorReport, Interrupter, LanguageDescription, Output, OutputSink,
};

type SharedEngine<E> = Arc<Mutex<E>>;

/// Everything the tasks share.
struct Kernel {
    signer: Signer,
    iopub: mpsc::UnboundedSender<JupyterMessage>,
    /// The request whose execution output belongs to (the last one, between executions).
    parent: Mutex<Option<JupyterMessage>>,
    language: LanguageDescription,
    interrupter: OnceLock<Arc<dyn Interrupter>>,
}

impl Kernel {
    fn publish(&self, content: impl Into<JupyterMessageContent>, parent: &JupyterMessage) {
        let mut message = JupyterMessage::new(content, Some(parent));
        message.header.username = "art-kernel".into();
        // On PUB the identity frames are the topic; clients subscribe to everything.
        message.zmq_identities = vec![Bytes::from_static(b"kernel")];
        let _ = self.iopub.send(message);
    }

    fn reply(
        &self,
        content: impl Into<JupyterMessageContent>,
        request: &JupyterMessage,
    ) -> Result<zeromq::ZmqMessage> {
        let mut message = JupyterMessage::new(content, Some(request));
        message.header.username = "art-kernel".into();
        self.signer.encode(&message)
    }

    fn output(&self, output: Output) {
        let Some(parent) = self
            .parent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        else {
            // Output before any request (engine start-up) has no cell to go to.
            return;
        };
        match output {
            Output::Stdout(text) => self.publish(StreamContent::stdout(&text), &parent),
            Output::Stderr(text) => self.publish(StreamContent::stderr(&text), &parent),
            Output::Display {
                data,
                metadata,
                display_id,
                update,
            } => {
                let media = media(data);
                match (display_id, update) {
                    (Some(id), true) => self.publish(
                        UpdateDisplayData {
                            data: media,
                            metadata,
                            transient: Transient {
                                display_id: Some(id),
                            },
                        },
                        &parent,
                    ),
                    (id, _) => self.publish(
                        DisplayData {
                            data: media,
                            metadata,
                            transient: id.map(|id| Transient {
                                display_id: Some(id),
                            }),
                        },
                        &parent,
                    ),
                }
            }
        }
    }

    fn kernel_info(&self) -> KernelInfoReply {
        let l = &self.language;
        KernelInfoReply {
            status: ReplyStatus::Ok,
            protocol_version: "5.3".into(),
            implementation: l.implementation.clone(),
            implementation_version: l.implementation_version.clone(),
            language_info: LanguageInfo {
                name: l.name.clone(),
                version: l.version.clone(),
                mimetype: Some(l.mimetype.clone()),
                file_extension: Some(l.file_extension.clone()),
                pygments_lexer: Some(l.pygments_lexer.clone()),
                codemirror_mode: Some(CodeMirrorMode::Simple(l.codemirror_mode.clone())),
                nbconvert_exporter: None,
            },
            banner: l.banner.clone(),
            help_links: l
                .help_links
                .iter()
                .map(|(text, url)| HelpLink {
                    text: text.clone(),
                    url: url.clone(),
                })
                .collect(),
            debugger: false,
            error: None,
        }
    }
}

fn media(bundle: Bundle) -> Media {
    serde_json::from_value(serde_json::Value::Object(bundle)).unwrap_or_default()
}

fn endpoint(connection: &ConnectionInfo, port: u16) -> Result<String> {
    match connection.transport {
        Transport::TCP => Ok(format!("tcp://{}:{}", connection.ip, port)),
        Transport::IPC => {
            bail!("the ipc transport is not supported; use tcp in the connection file")
        }
    }
}

async fn bind<S: Socket>(connection: &ConnectionInfo, port: u16) -> Result<S> {
    let mut socket = S::new();
    let endpoint = endpoint(connection, port)?;
    socket
        .bind(&endpoint)
        .await
        .with_context(|| format!("cannot bind {endpoint}"))?;
    Ok(socket)
}

/// Runs the kernel until a shutdown request. The engine is started in the background (it may
/// compile for a while) so that the kernel answers `kernel_info_request` at once.
pub async fn serve<E, F>(
    connection: ConnectionInfo,
    language: LanguageDescription,
    start_engine: F,
) -> Result<()>
where
    E: Engine,
    F: FnOnce(OutputSink) -> Result<E> + Send + 'static,
{
    let signer = Signer::new(&connection.key, &connection.signature_scheme)?;
    let mut heartbeat: zeromq::RepSocket = bind(&connection, connection.hb_port).await?;
    let mut shell: zeromq::RouterSocket = bind(&connection, connection.shell_port).await?;
    let mut control: zeromq::RouterSocket = bind(&connection, connection.control_port).await?;
    let _stdin: zeromq::RouterSocket = bind(&connection, connection.stdin_port).await?;
    let mut iopub_socket: zeromq::PubSocket = bind(&connection, connection.iopub_port).await?;

    let (iopub, mut iopub_queue) = mpsc::unbounded_channel::<JupyterMessage>();
    let kernel = Arc::new(Kernel {
        signer: signer.clone(),
        iopub,
        parent: Mutex::new(None),
        language,
        interrupter: OnceLock::new(),
    });

    tokio::spawn(async move {
        while let Ok(ping) = heartbeat.recv().await {
            if heartbeat.send(ping).await.is_err() {
                break;
            }
        }
    });
    let (flushed_tx, flushed_rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    {
        let signer = signer.clone();
        tokio::spawn(async move {
            let mut flush_requests = flushed_rx;
            loop {
                tokio::select! {
                    Some(message) = iopub_queue.recv() => {
                        match signer.encode(&message) {
                            Ok(framed) => {
                                if let Err(error) = iopub_socket.send(framed).await {
                                    eprintln!("art-kernel: iopub send failed: {error}");
                                }
                            }
                            Err(error) => eprintln!("art-kernel: cannot encode an iopub message: {error:#}"),
                        }
                    }
                    Some(done) = flush_requests.recv() => {
                        // Everything queued before the request has been sent.
                        while let Ok(message) = iopub_queue.try_recv() {
                            if let Ok(framed) = signer.encode(&message) {
                                let _ = iopub_socket.send(framed).await;
                            }
                        }
                        let _ = done.send(());
                    }
                    else => break,
                }
            }
        });
    }

    // Start the engine in the background.
    let (engine_tx, engine_rx) = oneshot::channel::<Result<SharedEngine<E>, String>>();
    {
        let sink_kernel = kernel.clone();
        let sink: OutputSink = Arc::new(move |output| sink_kernel.output(output));
        let kernel = kernel.clone();
        tokio::task::spawn_blocking(move || match start_engine(sink) {
            Ok(engine) => {
                let _ = kernel.interrupter.set(engine.interrupter());
                let _ = engine_tx.send(Ok(Arc::new(Mutex::new(engine))));
            }
            Err(error) => {
                let _ = engine_tx.send(Err(format!("{error:#}")));
            }
        });
    }

    // SIGINT (Jupyter's default interrupt) interrupts the running cell instead of ending us.
    {
        let kernel = kernel.clone();
        let mut signals =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        tokio::spawn(async move {
            while signals.recv().await.is_some() {
                if let Some(interrupter) = kernel.interrupter.get() {
                    interrupter.interrupt(true);
                }
            }
        });
    }

    // Control: interrupts and shutdowns, answered even while shell is busy.
    let (shutdown_tx, mut shutdown_rx) = mpsc::unbounded_channel::<()>();
    {
        let kernel = kernel.clone();
        let shutdown_tx = shutdown_tx.clone();
        let flush = flushed_tx.clone();
        tokio::spawn(async move {
            loop {
                let Ok(raw) = control.recv().await else { break };
                let request = match kernel.signer.decode(raw) {
                    Ok(request) => request,
                    Err(error) => {
                        eprintln!("art-kernel: dropping a control message: {error:#}");
                        continue;
                    }
                };
                let reply = match &request.content {
                    JupyterMessageContent::InterruptRequest(_) => {
                        if let Some(interrupter) = kernel.interrupter.get() {
                            interrupter.interrupt(false);
                        }
                        kernel.reply(InterruptReply::new(), &request)
                    }
                    JupyterMessageContent::ShutdownRequest(r) => {
                        let reply = kernel.reply(
                            ShutdownReply {
                                restart: r.restart,
                                status: ReplyStatus::Ok,
                                error: None,
                            },
                            &request,
                        );
                        if let Ok(reply) = reply {
                            let _ = control.send(reply).await;
                        }
                        let (done, wait) = oneshot::channel();
                        let _ = flush.send(done);
                        let _ = wait.await;
                        let _ = shutdown_tx.send(());
                        break;
                    }
                    JupyterMessageContent::KernelInfoRequest(_) => {
                        kernel.reply(kernel.kernel_info(), &request)
                    }
                    other => {
                        eprintln!(
                            "art-kernel: ignoring control message {}",
                            other.message_type()
                        );
                        continue;
                    }
                };
                match reply {
                    Ok(reply) => {
                        let _ = control.send(reply).await;
                    }
                    Err(error) => eprintln!("art-kernel: cannot reply on control: {error:#}"),
                }
            }
        });
    }

    // Shell: one request at a time.
    {
        let kernel = kernel.clone();
        let shutdown_tx = shutdown_tx.clone();
        let flush = flushed_tx.clone();
        tokio::spawn(async move {
            let mut shell_state = ShellState::<E> {
                engine: EngineState::Starting(engine_rx),
                execution_count: 0,
            };
            loop {
                let Ok(raw) = shell.recv().await else { break };
                let request = match kernel.signer.decode(raw) {
                    Ok(request) => request,
                    Err(error) => {
                        eprintln!("art-kernel: dropping a shell message: {error:#}");
                        continue;
                    }
                };
                kernel.publish(Status::busy(), &request);
                let outcome = handle_shell(&kernel, &mut shell_state, &request).await;
                let stop = matches!(outcome, Ok(ShellAction::ReplyThenShutdown(_)));
                match outcome {
                    Ok(ShellAction::Reply(reply)) | Ok(ShellAction::ReplyThenShutdown(reply)) => {
                        match kernel.reply(reply, &request) {
                            Ok(framed) => {
                                if let Err(error) = shell.send(framed).await {
                                    eprintln!("art-kernel: shell send failed: {error}");
                                }
                            }
                            Err(error) => eprintln!("art-kernel: cannot encode a reply: {error:#}"),
                        }
                    }
                    Ok(ShellAction::None) => {}
                    Err(error) => {
                        eprintln!("art-kernel: error handling a shell message: {error:#}")
                    }
                }
                kernel.publish(Status::idle(), &request);
                if stop {
                    let (done, wait) = oneshot::channel();
                    let _ = flush.send(done);
                    let _ = wait.await;
                    let _ = shutdown_tx.send(());
                    break;
                }
            }
        });
    }

    shutdown_rx.recv().await;
    if let Some(interrupter) = kernel.interrupter.get() {
        interrupter.shutdown();
    }
    Ok(())
}

enum EngineState<E> {
    Starting(oneshot::Receiver<Result<SharedEngine<E>, String>>),
    Ready(SharedEngine<E>),
    Failed(String),
}

struct ShellState<E> {
    engine: EngineState<E>,
    execution_count: usize,
}

impl<E: Engine> ShellState<E> {
    /// The engine, waiting for it to finish starting if need be.
    async fn engine(&mut self) -> Result<SharedEngine<E>, String> {
        if let EngineState::Starting(receiver) = &mut self.engine {
            self.engine = match receiver.await {
                Ok(Ok(engine)) => EngineState::Ready(engine),
                Ok(Err(error)) => EngineState::Failed(error),
                Err(_) => EngineState::Failed("the engine start-up thread died".into()),
            };
        }
        match &self.engine {
            EngineState::Ready(engine) => Ok(engine.clone()),
            EngineState::Failed(error) => Err(error.clone()),
            EngineState::Starting(_) => unreachable!("resolved above"),
        }
    }
}

enum ShellAction {
    Reply(JupyterMessageContent),
    ReplyThenShutdown(JupyterMessageContent),
    None,
}

async fn handle_shell<E: Engine>(
    kernel: &Arc<Kernel>,
    state: &mut ShellState<E>,
    request: &JupyterMessage,
) -> Result<ShellAction> {
    Ok(match &request.content {
        JupyterMessageContent::KernelInfoRequest(_) => {
            ShellAction::Reply(kernel.kernel_info().into())
        }
        JupyterMessageContent::ExecuteRequest(execute) => {
            let silent = execute.silent;
            if !silent {
                state.execution_count += 1;
            }
            let count = ExecutionCount::new(state.execution_count);
            if !silent {
                kernel.publish(
                    ExecuteInput {
                        code: execute.code.clone(),
                        execution_count: count,
                    },
                    request,
                );
            }
            *kernel.parent.lock().unwrap_or_else(|e| e.into_inner()) = Some(request.clone());
            let result = match state.engine().await {
                Ok(engine) => {
                    let code = execute.code.clone();
                    tokio::task::spawn_blocking(move || {
                        engine
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .execute(&code)
                    })
                    .await
                    .context("the execution thread died")?
                }
                Err(error) => Err(ErrorReport {
                    ename: "KernelStartError".into(),
                    evalue: error.clone(),
                    traceback: std::iter::once(
                        "The ART kernel could not start its Rust evaluator:".to_string(),
                    )
                    .chain(error.lines().map(str::to_string))
                    .collect(),
                }),
            };
            let reply = match result {
                Ok(value) => {
                    if let Some(result) = value.filter(|_| !silent) {
                        let mut content = ExecuteResult::new(count, media(result.data));
                        content.metadata = result.metadata;
                        kernel.publish(content, request);
                    }
                    ExecuteReply {
                        status: ReplyStatus::Ok,
                        execution_count: count,
                        payload: Vec::new(),
                        user_expressions: Some(HashMap::new()),
                        error: None,
                    }
                }
                Err(report) => {
                    kernel.publish(
                        ErrorOutput {
                            ename: report.ename.clone(),
                            evalue: report.evalue.clone(),
                            traceback: report.traceback.clone(),
                        },
                        request,
                    );
                    ExecuteReply {
                        status: ReplyStatus::Error,
                        execution_count: count,
                        payload: Vec::new(),
                        user_expressions: Some(HashMap::new()),
                        error: Some(Box::new(ReplyError {
                            ename: report.ename,
                            evalue: report.evalue,
                            traceback: report.traceback,
                        })),
                    }
                }
            };
            ShellAction::Reply(reply.into())
        }
        JupyterMessageContent::CompleteRequest(complete) => {
            let code = complete.code.clone();
            let cursor = char_to_byte(&code, complete.cursor_pos);
            let reply = match state.engine().await {
                Ok(engine) => {
                    let code2 = code.clone();
                    tokio::task::spawn_blocking(move || {
                        engine
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .complete(&code2, cursor)
                    })
                    .await?
                    .map_err(|e| format!("{e:#}"))
                }
                Err(error) => Err(error),
            };
            let reply = match reply {
                Ok(completions) => CompleteReply {
                    matches: completions.matches,
                    cursor_start: byte_to_char(&code, completions.start),
                    cursor_end: byte_to_char(&code, completions.end),
                    metadata: Default::default(),
                    status: ReplyStatus::Ok,
                    error: None,
                },
                Err(error) => CompleteReply {
                    cursor_start: complete.cursor_pos,
                    cursor_end: complete.cursor_pos,
                    status: ReplyStatus::Error,
                    error: Some(Box::new(ReplyError {
                        ename: "CompletionError".into(),
                        evalue: error,
                        traceback: Vec::new(),
                    })),
                    ..Default::default()
                },
            };
            ShellAction::Reply(reply.into())
        }
        JupyterMessageContent::IsCompleteRequest(is_complete) => {
            let verdict = super::bracket_completeness(&is_complete.code);
            ShellAction::Reply(
                match verdict {
                    Completeness::Complete => IsCompleteReply::complete(),
                    Completeness::Incomplete { indent } => IsCompleteReply::incomplete(indent),
                    Completeness::Invalid => IsCompleteReply::invalid(),
                }
                .into(),
            )
        }
        JupyterMessageContent::InspectRequest(inspect) => {
            let code = inspect.code.clone();
            let cursor = char_to_byte(&code, inspect.cursor_pos);
            let found = match state.engine().await {
                Ok(engine) => {
                    tokio::task::spawn_blocking(move || {
                        engine
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .inspect(&code, cursor)
                    })
                    .await?
                }
                Err(_) => None,
            };
            ShellAction::Reply(
                InspectReply {
                    found: found.is_some(),
                    data: found.map(media).unwrap_or_default(),
                    ..Default::default()
                }
                .into(),
            )
        }
        JupyterMessageContent::CommInfoRequest(_) => {
            ShellAction::Reply(CommInfoReply::default().into())
        }
        JupyterMessageContent::HistoryRequest(_) => {
            ShellAction::Reply(HistoryReply::new(Vec::new()).into())
        }
        JupyterMessageContent::ShutdownRequest(r) => ShellAction::ReplyThenShutdown(
            ShutdownReply {
                restart: r.restart,
                status: ReplyStatus::Ok,
                error: None,
            }
            .into(),
        ),
        other => {
            eprintln!(
                "art-kernel: ignoring shell message {}",
                other.message_type()
            );
            ShellAction::None
        }
    })
}

/// Jupyter counts cursor positions in Unicode code points; Rust tools count bytes.
fn char_to_byte(code: &str, chars: usize) -> usize {
    code.char_indices()
        .nth(chars)
        .map_or(code.len(), |(byte, _)| byte)
}

fn byte_to_char(code: &str, byte: usize) -> usize {
    code[..byte.min(code.len())].chars().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_positions_convert_between_code_points_and_bytes() {
        let code = "é1✓x";
        assert_eq!(char_to_byte(code, 0), 0);
        assert_eq!(char_to_byte(code, 1), 2);
        assert_eq!(char_to_byte(code, 3), 6);
        assert_eq!(char_to_byte(code, 10), code.len());
        assert_eq!(byte_to_char(code, 6), 3);
    }
}
