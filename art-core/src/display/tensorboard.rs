//! TensorBoard's own dashboard inline in a notebook, as Python's `%tensorboard` magic does: the
//! curves every model writes beside its history (store::tensorboard), in TensorBoard's UI. Our
//! charts stay the default; this is for the people who live in TensorBoard.
//!
//! ```no_run
//! # fn main() -> Result<(), art_core::display::TensorBoardError> {
//! // The last expression of a cell: TensorBoard, in the cell's output.
//! art_core::display::tensorboard(".art")?;
//! # Ok(()) }
//! ```
//!
//! The server is started once per directory and reused by later cells. It runs under a small
//! `sh` that holds a pipe from this process: when the process ends (the kernel stops, restarts
//! or is killed), the pipe closes and the shell stops TensorBoard, so nothing is left behind.

use std::io::{self, BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{MimeBundle, Render};

/// A TensorBoard server on loopback, showing a log directory.
#[derive(Debug, Clone)]
pub struct TensorBoard {
    pub url: String,
    pub logdir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TensorBoardError {
    #[error(
        "cannot start `{binary}`: {source}. Install it (`pip install tensorboard`) or set \
         ART_TENSORBOARD_BIN to its path"
    )]
    NotInstalled { binary: String, source: io::Error },
    #[error("TensorBoard did not answer on {url} within {seconds} s; its output: {output}")]
    NoAnswer {
        url: String,
        seconds: u64,
        output: String,
    },
    #[error("TensorBoard stopped as it started; its output: {output}")]
    Exited { output: String },
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// The pipes of the servers this copy of art-core started: open while the process runs.
static PIPES: Mutex<Vec<ChildStdin>> = Mutex::new(Vec::new());

/// Where this process notes the port of the server it started for `logdir`. A file, not a
/// static: the notebook kernel links each cell with its own copy of art-core's statics, and a
/// later cell must find the server an earlier one started.
fn port_note(logdir: &Path) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    logdir.hash(&mut hasher);
    std::env::temp_dir().join(format!(
        "art-tensorboard-{}-{:016x}.port",
        std::process::id(),
        hasher.finish()
    ))
}

/// The server noted for `logdir`, if it still answers.
fn running_server(logdir: &Path) -> Option<TensorBoard> {
    let port: u16 = std::fs::read_to_string(port_note(logdir))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    TcpStream::connect_timeout(&loopback(port), Duration::from_millis(500)).ok()?;
    Some(TensorBoard::on(logdir.to_path_buf(), port))
}

fn loopback(port: u16) -> SocketAddr {
    ([127, 0, 0, 1], port).into()
}

impl TensorBoard {
    fn on(logdir: PathBuf, port: u16) -> Self {
        TensorBoard {
            url: format!("http://127.0.0.1:{port}/"),
            logdir,
        }
    }
}

/// How long a starting TensorBoard gets to answer (its first start imports a lot of Python).
const START_WAIT: Duration = Duration::from_secs(90);

/// Starts (or finds, when this process already started it) a TensorBoard on `logdir`: an art
/// directory shows every model's curves. Shown as the dashboard in a notebook, as its URL
/// elsewhere.
pub fn tensorboard(logdir: impl AsRef<Path>) -> Result<TensorBoard, TensorBoardError> {
    let binary = std::env::var_os("ART_TENSORBOARD_BIN").unwrap_or_else(|| "tensorboard".into());
    tensorboard_with(logdir, binary)
}

/// As [`tensorboard`], with the `tensorboard` program to run (e.g. a virtualenv's).
pub fn tensorboard_with(
    logdir: impl AsRef<Path>,
    binary: impl AsRef<std::ffi::OsStr>,
) -> Result<TensorBoard, TensorBoardError> {
    let binary = binary.as_ref();
    let logdir = std::path::absolute(logdir.as_ref())?;
    let mut pipes = PIPES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(board) = running_server(&logdir) {
        return Ok(board);
    }
    if !is_program(binary) {
        return Err(TensorBoardError::NotInstalled {
            binary: binary.to_string_lossy().into_owned(),
            source: io::Error::new(io::ErrorKind::NotFound, "no such program"),
        });
    }
    let port = free_port()?;
    let log =
        std::env::temp_dir().join(format!("art-tensorboard-{}-{port}.log", std::process::id()));
    // `sh` runs TensorBoard in the background, says its pid, and waits for its standard input
    // to close, then stops it: the pipe is held by this process, so TensorBoard lives exactly
    // as long.
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(r#""$1" --logdir "$2" --host 127.0.0.1 --port "$3" >"$4" 2>&1 & board=$!; echo $board; cat >/dev/null; kill $board"#)
        .arg("sh")
        .arg(binary)
        .arg(&logdir)
        .arg(port.to_string())
        .arg(&log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdin = shell.stdin.take().expect("stdin is piped");
    let mut pid = String::new();
    BufReader::new(shell.stdout.take().expect("stdout is piped")).read_line(&mut pid)?;
    let pid: u32 = pid
        .trim()
        .parse()
        .map_err(|_| io::Error::other(format!("the shell starting TensorBoard said {pid:?}")))?;
    let board = TensorBoard::on(logdir, port);
    let started = Instant::now();
    // On an early return `stdin` is dropped, which stops the shell and what it started.
    while TcpStream::connect_timeout(&loopback(port), Duration::from_millis(200)).is_err() {
        let output = || std::fs::read_to_string(&log).unwrap_or_default();
        if !is_running(pid) {
            return Err(TensorBoardError::Exited { output: output() });
        }
        if started.elapsed() > START_WAIT {
            return Err(TensorBoardError::NoAnswer {
                url: board.url,
                seconds: START_WAIT.as_secs(),
                output: output(),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Not waited for: the shell ends with this process (or when its pipe is dropped).
    drop(shell);
    pipes.push(stdin);
    std::fs::write(port_note(&board.logdir), format!("{port}\n"))?;
    Ok(board)
}

/// A path to a file, or a name found on PATH.
fn is_program(binary: &std::ffi::OsStr) -> bool {
    let path = Path::new(binary);
    if path.components().count() > 1 {
        return path.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(path).is_file()))
}

/// Whether a process runs (on Linux; elsewhere assumed, and a TensorBoard that stopped is found
/// by the time limit). A zombie (exited, not yet reaped by the shell) does not run.
fn is_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => !Path::new("/proc/self").exists(),
    }
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Render for TensorBoard {
    fn render(&self) -> MimeBundle {
        let html = format!(
            r#"<iframe src="{url}" title="TensorBoard: {dir}" style="width: 100%; height: 800px; border: 0;"></iframe>
<div style="font-size: 0.85em;">TensorBoard on {dir}: <a href="{url}" target="_blank">{url}</a> (open it in a tab if the frame stays empty: the notebook's browser must reach this machine)</div>"#,
            url = self.url,
            dir = super::escape_html(&self.logdir.display().to_string()),
        );
        MimeBundle::new().with("text/html", html).with(
            "text/plain",
            format!("TensorBoard on {} at {}", self.logdir.display(), self.url),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_failing_tensorboard_is_a_clear_error() {
        let dir = std::env::temp_dir();
        let missing = tensorboard_with(&dir, "/no/such/tensorboard").unwrap_err();
        assert!(
            matches!(missing, TensorBoardError::NotInstalled { .. }),
            "{missing}"
        );
        assert!(missing.to_string().contains("pip install tensorboard"));
        // A program that stops at once (as TensorBoard does on a bad option or import error).
        let stopped = tensorboard_with(&dir, "false").unwrap_err();
        assert!(
            matches!(stopped, TensorBoardError::Exited { .. }),
            "{stopped}"
        );
    }
}
