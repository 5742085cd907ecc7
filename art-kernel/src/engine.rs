//! Rust evaluation with evcxr: each cell is compiled into a shared object and run in a child
//! process that keeps the variables. This side knows nothing of Jupyter: it produces
//! [`Output`]s and [`ErrorReport`]s for whatever protocol runs it.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use art_core::display::wire::{DisplayMessage, RESULT_METADATA_MIME};
use crossbeam_channel::{Receiver, Select, Sender};
use evcxr::{CommandContext, EvalContext, EvalContextOutputs};

use crate::child::CELL_FAILED;
use crate::config::Prelude;
use crate::protocol::{
    Bundle, CellResult, Completions, Engine, ErrorReport, Interrupter, LanguageDescription, Output,
    OutputSink,
};

pub struct EvcxrEngine {
    /// The linker the prelude linked with.
    pub linker: String,
    context: CommandContext,
    pump: Pump,
    control: Arc<Control>,
    /// Set by the output thread when the child reports that a cell's `?` returned an error.
    question_mark_failed: Arc<AtomicBool>,
    sink: OutputSink,
}

impl EvcxrEngine {
    /// Starts the evaluation context (in the build directory named by `EVCXR_TMPDIR`) and runs
    /// `prelude`: one compile, with its dependencies taken as resolved and async mode on. Output
    /// of the child process goes to `sink`. rust-analyzer starts on its first question in the
    /// background meanwhile (evcxr, patched): only a later cell that uses a variable whose type
    /// it has not answered yet waits for it.
    pub fn start(prelude: &Prelude, sink: OutputSink) -> Result<Self> {
        let started = std::time::Instant::now();
        let mut command = Command::new(std::env::current_exe()?);
        // The child that runs cells gets its own process group: a SIGINT sent to the kernel's
        // group (Jupyter's interrupt) stops compilers, and we decide whether to stop the child.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        // Cells link the standard library dynamically. evcxr relies on the rpath cargo writes,
        // which is relative to deps/ while the library is loaded from one level up: it breaks
        // when the build directory shares a prefix with the toolchain (both under $HOME). Name
        // the toolchain's library directory explicitly.
        if let Some(libdir) = target_libdir() {
            let mut path = std::ffi::OsString::from(libdir);
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                path.push(":");
                path.push(old);
            }
            command.env("LD_LIBRARY_PATH", path);
        }
        let (mut eval, outputs) =
            EvalContext::with_subprocess_command_without_initial_eval(command)
                .map_err(|e| anyhow!("cannot start the Rust evaluator: {e}"))?;
        eprintln!("art-kernel: evaluator started in {:.1?}", started.elapsed());
        let question_mark_failed = Arc::new(AtomicBool::new(false));
        let pump = Pump::spawn(outputs, sink.clone(), question_mark_failed.clone());
        let mut state = eval.state();
        state.set_offline_mode(prelude.offline);
        state.set_opt_level(&prelude.opt_level)?;
        state.set_async_mode(true);
        state.set_allow_question_mark(true);
        if let Some(linker) = &prelude.linker {
            state.set_linker(linker.clone());
        }
        for (name, value) in &prelude.dependencies {
            state.add_dep_without_validation(name, value)?;
        }
        let mut result = eval.eval_with_state(&prelude.code, state.clone());
        if result.is_err() && prelude.linker.is_none() && state.linker() != "system" {
            // At install, evcxr picks lld or mold where installed; fall back to the system's
            // linker. A linker the kernel config pins is never switched: that would change every
            // dependency's flags and recompile the whole cache.
            state.set_linker("system".into());
            result = eval.eval_with_state(&prelude.code, state);
        }
        pump.flush();
        result.map_err(|error| {
            anyhow!(
                "the prelude failed:\n{}",
                error_report(&error, &prelude.code).traceback.join("\n")
            )
        })?;
        eprintln!("art-kernel: prelude done in {:.1?}", started.elapsed());
        let linker = eval.state().linker().to_string();
        let context = CommandContext::with_eval_context(eval);
        let control = Arc::new(Control {
            executing: AtomicBool::new(false),
            interrupted: AtomicBool::new(false),
            child: context.process_handle(),
        });
        Ok(EvcxrEngine {
            linker,
            pump,
            context,
            control,
            question_mark_failed,
            sink,
        })
    }

    /// After an interrupt the child may have been killed between evcxr's checks; evcxr restarts it
    /// when it finds it dead while running code, so run a trivial statement to get a fresh one.
    fn recover_child(&mut self) {
        let dead = self
            .control
            .child
            .lock()
            .map(|mut child| matches!(child.try_wait(), Ok(Some(_))))
            .unwrap_or(false);
        if dead {
            let _ = self.context.execute("let _ = ();");
        }
    }
}

/// The span of a running cell and the file its trace context is written to.
struct CellSpan {
    cx: opentelemetry::Context,
    file: Option<std::path::PathBuf>,
}

impl CellSpan {
    fn start(code: &str) -> Self {
        use art_core::telemetry;
        if !telemetry::enabled() {
            return CellSpan {
                cx: opentelemetry::Context::new(),
                file: None,
            };
        }
        let cx = telemetry::start(
            "cell",
            opentelemetry::trace::SpanKind::Internal,
            vec![opentelemetry::KeyValue::new(
                "art.cell.code",
                telemetry::cut(code.to_string()),
            )],
        );
        let file = std::env::var_os(crate::install::CELL_TRACE_ENV).map(std::path::PathBuf::from);
        if let Some(file) = &file {
            let headers = telemetry::headers_of(&cx);
            let traceparent = headers
                .iter()
                .find(|(name, _)| name == "traceparent")
                .map_or("", |(_, value)| value.as_str());
            let _ = std::fs::write(file, traceparent);
        }
        CellSpan { cx, file }
    }

    fn end(self, error: Option<&ErrorReport>) {
        if let Some(file) = &self.file {
            // Work left running after the cell is not the cell's.
            let _ = std::fs::write(file, "");
        }
        art_core::telemetry::end(
            &self.cx,
            error.map(|e| format!("{}: {}", e.ename, e.evalue)).as_ref(),
        );
    }
}

impl EvcxrEngine {
    fn execute_cell(&mut self, code: &str) -> Result<Option<CellResult>, ErrorReport> {
        self.control.interrupted.store(false, Ordering::SeqCst);
        self.question_mark_failed.store(false, Ordering::SeqCst);
        self.control.executing.store(true, Ordering::SeqCst);
        let by_reference = bare_variable_by_reference(code);
        let code_to_run = by_reference.as_deref().unwrap_or(code);
        let mut result = self.context.execute(code_to_run);
        if matches!(&result, Err(error) if needs_network(code, error)) {
            // Cells build offline once the cache is warm (nothing to resolve). A `:dep` whose
            // crate, or a dependency of it, is not in cargo's local cache is fetched online,
            // once; the failed attempt ran nothing (cargo stopped before the compile).
            let _ = self.context.execute(":offline 0");
            result = self.context.execute(code_to_run);
            let _ = self.context.execute(":offline 1");
        }
        self.control.executing.store(false, Ordering::SeqCst);
        self.pump.flush();
        let interrupted = self.control.interrupted.swap(false, Ordering::SeqCst);
        if interrupted {
            self.recover_child();
            self.pump.flush();
            return Err(ErrorReport {
                ename: "Interrupted".into(),
                evalue: "the cell was interrupted".into(),
                traceback: vec![
                    "\x1b[1;31mInterrupted\x1b[0m: the cell was stopped.".into(),
                    "Variables are lost when a running cell is stopped; definitions (fn, struct, use) and :dep are kept.".into(),
                ],
            });
        }
        match result {
            Ok(_) if self.question_mark_failed.swap(false, Ordering::SeqCst) => Err(ErrorReport {
                ename: "Error".into(),
                evalue: "a `?` in the cell returned an error".into(),
                traceback: vec![
                    "\x1b[1;31mError\x1b[0m: a `?` in the cell returned the error printed above; the cell stopped there.".into(),
                    "Variables the cell defined are not kept.".into(),
                ],
            }),
            Ok(outputs) => {
                // After `:timing`, where each cell's time went (evcxr measures, we print).
                if outputs.timing.is_some() {
                    let phases: Vec<String> = outputs
                        .phases
                        .iter()
                        .map(|p| format!("{}: {} ms", p.name, p.duration.as_millis()))
                        .collect();
                    (self.sink)(Output::Stderr(format!("timing: {}\n", phases.join(", "))));
                }
                let mut result = CellResult::default();
                for (mime, content) in outputs.content_by_mime_type {
                    let value = if mime.contains("json") {
                        serde_json::from_str(&content).unwrap_or(serde_json::Value::String(content))
                    } else {
                        serde_json::Value::String(content)
                    };
                    match (mime.as_str(), value) {
                        (RESULT_METADATA_MIME, serde_json::Value::Object(metadata)) => {
                            result.metadata = metadata
                        }
                        (_, value) => {
                            result.data.insert(mime, value);
                        }
                    }
                }
                Ok((!result.data.is_empty()).then_some(result))
            }
            Err(error) => Err(error_report(&error, code)),
        }
    }
}

impl Engine for EvcxrEngine {
    fn execute(&mut self, code: &str) -> Result<Option<CellResult>, ErrorReport> {
        // With traces on, a `cell` span per execution; the cell's own spans (gather, RULER,
        // training steps) join it through the file the child reads (art_core::telemetry).
        let span = CellSpan::start(code);
        let result = self.execute_cell(code);
        span.end(result.as_ref().err());
        result
    }

    fn complete(&mut self, code: &str, cursor: usize) -> Result<Completions> {
        let found = self.context.completions(code, cursor)?;
        Ok(Completions {
            matches: found.completions.into_iter().map(|c| c.code).collect(),
            start: found.start_offset,
            end: found.end_offset,
        })
    }

    fn inspect(&mut self, code: &str, cursor: usize) -> Option<Bundle> {
        let (plain, markdown) = self.context.hover_at(code, cursor).ok()?;
        if plain == "No documentation found" {
            return None;
        }
        let mut bundle = Bundle::new();
        bundle.insert("text/plain".into(), plain.into());
        bundle.insert("text/markdown".into(), markdown.into());
        Some(bundle)
    }

    fn interrupter(&self) -> Arc<dyn Interrupter> {
        self.control.clone()
    }
}

/// A cell with a `:dep` that cargo could not resolve or fetch offline ("attempting to make an
/// HTTP request, but --offline was specified", or a crate it cannot find while offline).
fn needs_network(code: &str, error: &evcxr::Error) -> bool {
    code.lines()
        .any(|line| line.trim_start().starts_with(":dep"))
        && error.to_string().contains("offline")
}

fn target_libdir() -> Option<String> {
    let output = Command::new("rustc")
        .args(["--print", "target-libdir"])
        .output()
        .ok()?;
    let dir = String::from_utf8(output.stdout).ok()?;
    Some(dir.trim().to_string()).filter(|d| !d.is_empty())
}

pub fn language() -> LanguageDescription {
    let version = Command::new("rustc")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_string))
        .unwrap_or_default();
    LanguageDescription {
        implementation: "art-kernel".into(),
        implementation_version: env!("CARGO_PKG_VERSION").into(),
        name: "rust".into(),
        version,
        mimetype: "text/rust".into(),
        file_extension: ".rs".into(),
        pygments_lexer: "rust".into(),
        codemirror_mode: "rust".into(),
        banner: format!(
            "ART kernel {} (evcxr): Rust cells with art_core, tokio and rich displays preloaded",
            env!("CARGO_PKG_VERSION")
        ),
        help_links: vec![(
            "Rust standard library".into(),
            "https://doc.rust-lang.org/std/".into(),
        )],
    }
}

/// What an interrupt needs, shared with the protocol's control task.
struct Control {
    executing: AtomicBool,
    interrupted: AtomicBool,
    /// The process running cells (evcxr swaps a restarted one into the same handle).
    child: Arc<Mutex<std::process::Child>>,
}

impl Interrupter for Control {
    fn interrupt(&self, from_signal: bool) {
        if !self.executing.load(Ordering::SeqCst) {
            return;
        }
        self.interrupted.store(true, Ordering::SeqCst);
        // Stop the code: kill the child that runs it (evcxr starts a new one for the next cell).
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
        }
        // Stop a compilation: cargo and rustc are in our process group. A signal from Jupyter
        // already reached them; for an interrupt_request, signal the group ourselves, but only
        // when the group is ours alone (Jupyter starts kernels in a session of their own).
        // SAFETY: plain libc calls without pointers.
        unsafe {
            if !from_signal && libc::getpgrp() == libc::getpid() {
                libc::killpg(libc::getpgrp(), libc::SIGINT);
            }
        }
    }

    fn shutdown(&self) {
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Turns evcxr's errors into readable Jupyter errors: the offending lines with carets under the
/// spans, rustc's message and its help.
fn error_report(error: &evcxr::Error, _code: &str) -> ErrorReport {
    const RED: &str = "\x1b[1;31m";
    const BLUE: &str = "\x1b[1;34m";
    const BOLD: &str = "\x1b[1m";
    const RESET: &str = "\x1b[0m";
    match error {
        evcxr::Error::CompilationErrors(errors) => {
            let mut traceback = Vec::new();
            for error in errors {
                let code = error.code().map(|c| format!("[{c}]")).unwrap_or_default();
                traceback.push(format!("{RED}{}{code}{RESET}{BOLD}: {}{RESET}", error.level(), error.message()));
                if error.is_from_user_code() {
                    for spanned in error.spanned_messages() {
                        for line in &spanned.lines {
                            traceback.push(format!("{BLUE}  | {RESET}{line}"));
                        }
                        if let Some(span) = &spanned.span {
                            let start = span.start_column.max(1);
                            let end = if span.end_line == span.start_line {
                                span.end_column.max(start + 1)
                            } else {
                                start + 1
                            };
                            traceback.push(format!(
                                "{BLUE}  | {RESET}{}{RED}{}{RESET} {}",
                                " ".repeat(start - 1),
                                "^".repeat(end - start),
                                spanned.label
                            ));
                        } else if !spanned.label.is_empty() {
                            traceback.push(format!("  = {}", spanned.label));
                        }
                    }
                }
                for help in error.help() {
                    traceback.push(format!("{BOLD}help{RESET}: {help}"));
                }
                traceback.push(String::new());
            }
            let evalue = errors
                .first()
                .map(|e| e.message())
                .unwrap_or_else(|| "compilation failed".into());
            ErrorReport {
                ename: "CompileError".into(),
                evalue,
                traceback,
            }
        }
        evcxr::Error::SubprocessTerminated(message) => ErrorReport {
            ename: "ProcessEnded".into(),
            evalue: message.clone(),
            traceback: vec![
                format!("{RED}The process running the cells ended{RESET}: {message}"),
                "Variables are lost; definitions and :dep are kept, and the next cell runs in a fresh process.".into(),
            ],
        },
        other => ErrorReport {
            ename: "Error".into(),
            evalue: other.to_string(),
            traceback: other.to_string().lines().map(str::to_string).collect(),
        },
    }
}

/// Moves the child's stdout and stderr to the sink: display lines become rich outputs, other lines
/// are batched into stream output. `flush` returns once everything received so far was handed on.
struct Pump {
    flush: Sender<Sender<()>>,
}

impl Pump {
    fn spawn(outputs: EvalContextOutputs, sink: OutputSink, failed: Arc<AtomicBool>) -> Pump {
        let (flush, flush_requests) = crossbeam_channel::unbounded::<Sender<()>>();
        std::thread::Builder::new()
            .name("art-kernel-output".into())
            .spawn(move || {
                pump(
                    outputs.stdout,
                    outputs.stderr,
                    flush_requests,
                    sink,
                    &failed,
                )
            })
            .expect("cannot start the output thread");
        Pump { flush }
    }

    fn flush(&self) {
        let (done, wait) = crossbeam_channel::bounded(1);
        if self.flush.send(done).is_ok() {
            let _ = wait.recv();
        }
    }
}

fn pump(
    stdout: Receiver<String>,
    stderr: Receiver<String>,
    flush_requests: Receiver<Sender<()>>,
    sink: OutputSink,
    failed: &AtomicBool,
) {
    let mut text = Batch::default();
    loop {
        let mut select = Select::new();
        let out_index = select.recv(&stdout);
        let err_index = select.recv(&stderr);
        let flush_index = select.recv(&flush_requests);
        let operation = select.select();
        match operation.index() {
            i if i == out_index => match operation.recv(&stdout) {
                Ok(line) => text.stdout(line, &sink, failed),
                Err(_) => break,
            },
            i if i == err_index => match operation.recv(&stderr) {
                Ok(line) => text.stderr(line),
                Err(_) => break,
            },
            i if i == flush_index => {
                let Ok(done) = operation.recv(&flush_requests) else {
                    break;
                };
                while let Ok(line) = stdout.try_recv() {
                    text.stdout(line, &sink, failed);
                }
                while let Ok(line) = stderr.try_recv() {
                    text.stderr(line);
                }
                text.emit(&sink);
                let _ = done.send(());
                continue;
            }
            _ => unreachable!("three operations were registered"),
        }
        // Batch what is already waiting, then hand it on.
        if stdout.is_empty() && stderr.is_empty() {
            text.emit(&sink);
        }
    }
    text.emit(&sink);
}

#[derive(Default)]
struct Batch {
    stdout: String,
    stderr: String,
}

impl Batch {
    fn stdout(&mut self, line: String, sink: &OutputSink, failed: &AtomicBool) {
        if line == CELL_FAILED {
            failed.store(true, Ordering::SeqCst);
            return;
        }
        match DisplayMessage::parse_line(&line) {
            Some(display) => {
                // Keep order: text printed before the display goes out first.
                self.emit(sink);
                sink(Output::Display {
                    data: display.data,
                    metadata: display.metadata,
                    display_id: display.display_id,
                    update: display.update,
                });
            }
            None => {
                self.stdout.push_str(&line);
                self.stdout.push('\n');
            }
        }
    }

    fn stderr(&mut self, line: String) {
        self.stderr.push_str(&line);
        self.stderr.push('\n');
    }

    fn emit(&mut self, sink: &OutputSink) {
        if !self.stdout.is_empty() {
            sink(Output::Stdout(std::mem::take(&mut self.stdout)));
        }
        if !self.stderr.is_empty() {
            sink(Output::Stderr(std::mem::take(&mut self.stderr)));
        }
    }
}

/// A cell that ends with a bare variable (`let x = f(); x`) shows `&x` instead. A result without
/// a rich view is printed by art-core's `DebugDisplay`, whose `&mut self` receiver keeps
/// `RichDisplay` first; a variable not declared `mut` cannot be borrowed that way, and when the
/// cell also defines it, evcxr reports the borrow error instead of falling back to `Debug`. A
/// reference shows the same (`Render` and `Debug` both see through it) and is a temporary, which
/// can be borrowed mutably. Only the last line is looked at, and only after a `;` or a `}`.
fn bare_variable_by_reference(code: &str) -> Option<String> {
    const KEYWORDS: &[&str] = &[
        "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum",
        "extern", "false", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "match", "mod",
        "move", "mut", "pub", "ref", "return", "self", "Self", "static", "struct", "super",
        "trait", "true", "try", "type", "unsafe", "use", "where", "while", "yield",
    ];
    fn significant(line: &str) -> Option<&str> {
        let line = line.split("//").next().unwrap_or("").trim_end();
        (!line.trim().is_empty()).then_some(line)
    }
    let lines: Vec<&str> = code.lines().collect();
    let last = lines.iter().rposition(|line| significant(line).is_some())?;
    let name = significant(lines[last])?.trim();
    let is_identifier = name
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_alphanumeric() || c == '_');
    if !is_identifier || KEYWORDS.contains(&name) {
        return None;
    }
    let before = lines[..last]
        .iter()
        .rev()
        .find_map(|line| significant(line));
    if before.is_some_and(|line| !line.ends_with([';', '}'])) {
        return None;
    }
    let mut rewritten: Vec<String> = lines.iter().map(|line| line.to_string()).collect();
    rewritten[last] = lines[last].replacen(name, &format!("&{name}"), 1);
    Some(rewritten.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_dep_that_failed_offline_is_retried_online() {
        let offline = evcxr::Error::Message(
            "error: failed to download `crunchy v0.2.4`\n\nCaused by:\n  attempting to make an \
             HTTP request, but --offline was specified"
                .into(),
        );
        let other = evcxr::Error::Message("no matching package named `hlaf` found".into());
        assert!(needs_network(":dep half = \"2\"", &offline));
        assert!(needs_network("let x = 1;\n  :dep half = \"2\"", &offline));
        assert!(!needs_network(":dep hlaf = \"2\"", &other));
        assert!(!needs_network("let x = 1; // offline", &offline));
    }

    #[test]
    fn a_bare_variable_at_the_end_is_shown_by_reference() {
        let shown = |code: &str| bare_variable_by_reference(code);
        assert_eq!(shown("x").as_deref(), Some("&x"));
        assert_eq!(
            shown("let x = 1;\n  x  \n\n").as_deref(),
            Some("let x = 1;\n  &x  \n")
        );
        assert_eq!(
            shown("let x = f(); // why\n// note\nx // shown").as_deref(),
            Some("let x = f(); // why\n// note\n&x // shown")
        );
        assert_eq!(shown("if c { 1; }\nx").as_deref(), Some("if c { 1; }\n&x"));
        // Anything else is left to evcxr.
        for code in [
            "x + 1",
            "x.len()",
            "let x = 1;",
            "break",
            "let y = 1 +\nx",
            "f(\nx",
            "Some(x)",
            "let s = \"a\n\";",
            "",
        ] {
            assert_eq!(shown(code), None, "{code:?}");
        }
    }

    #[test]
    fn pump_keeps_order_and_turns_display_lines_into_outputs() {
        let (out_tx, out_rx) = crossbeam_channel::unbounded();
        let (err_tx, err_rx) = crossbeam_channel::unbounded();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink: OutputSink = {
            let seen = seen.clone();
            Arc::new(move |o| seen.lock().unwrap().push(o))
        };
        let pump = Pump::spawn(
            EvalContextOutputs {
                stdout: out_rx,
                stderr: err_rx,
            },
            sink,
            Arc::new(AtomicBool::new(false)),
        );
        let mut data = serde_json::Map::new();
        data.insert("text/html".into(), "<b>x</b>".into());
        let display = DisplayMessage {
            data: data.clone(),
            metadata: Default::default(),
            display_id: Some("d".into()),
            update: true,
        };
        out_tx.send("before".to_string()).unwrap();
        out_tx.send(display.to_line()).unwrap();
        out_tx.send("after".to_string()).unwrap();
        out_tx.send(CELL_FAILED.to_string()).unwrap();
        err_tx.send("oops".to_string()).unwrap();
        pump.flush();
        let seen = seen.lock().unwrap().clone();
        let position = |wanted: &Output| seen.iter().position(|o| o == wanted);
        let before = position(&Output::Stdout("before\n".into())).expect("before");
        let shown = position(&Output::Display {
            data,
            metadata: Default::default(),
            display_id: Some("d".into()),
            update: true,
        })
        .expect("display");
        assert!(before < shown);
        assert!(seen
            .iter()
            .any(|o| matches!(o, Output::Stdout(t) if t.contains("after"))));
        assert!(seen.contains(&Output::Stderr("oops\n".into())));
        // The failure marker is noted, not shown.
        assert!(!seen
            .iter()
            .any(|o| matches!(o, Output::Stdout(t) if t.contains(CELL_FAILED))));
    }
}
