//! Shared helpers for the end-to-end tests in `tests/tests/`: tiny models on disk and servers on
//! loopback.

use std::path::{Path, PathBuf};

use art_core::engine::random::RandomModelSpec;
use art_core::engine::Architecture;
use art_core::server::{build_state, router, ServeOptions};

pub use tempfile::TempDir;

/// A fresh directory under the system temp dir, removed when dropped.
pub fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("art-e2e-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

/// A tiny random-weight Qwen2 model (ChatML template) written as a Hugging Face directory.
pub fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-qwen2");
    RandomModelSpec::tiny(Architecture::Qwen2)
        .write(&model, 7)
        .expect("tiny model writes");
    model
}

/// `art` as `cargo test --workspace` builds it (target/<profile>/art), or $ART_BIN.
pub fn art_binary() -> PathBuf {
    std::env::var_os("ART_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("the test's path");
            // target/<profile>/deps/<test> -> target/<profile>/art
            exe.parent().unwrap().parent().unwrap().join("art")
        })
}

/// Runs `scripts/<script>` with `python` and `args`; it must exit 0 and print `"ok": true` (the
/// convention of our client checks). Returns its standard output.
pub async fn python_check(
    python: impl AsRef<std::ffi::OsStr>,
    script: &str,
    args: &[&std::ffi::OsStr],
) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let output = tokio::process::Command::new(python)
        .arg(&script)
        .args(args)
        .output()
        .await
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed:\n{stdout}\n{stderr}",
        script.display()
    );
    assert!(stdout.contains("\"ok\": true"), "{stdout}");
    stdout
}

/// The real default model, as `scripts/fetch-models.sh` fetches it.
/// Panics, saying how to fetch it, when it is missing (scripts/test.sh fetches it first).
pub fn smollm2() -> PathBuf {
    let dir = std::env::var_os("ART_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join(art_core::backend::DEFAULT_MODEL_FILE);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

/// A server on a free loopback port, running on the test's runtime.
pub struct TestServer {
    pub base_url: String,
    pub model: String,
    _dir: TempDir,
}

impl TestServer {
    /// Serves the tiny model; `configure` adjusts the options first.
    pub async fn tiny(configure: impl FnOnce(&mut ServeOptions)) -> Self {
        let dir = temp_dir("server");
        let mut options = ServeOptions {
            model: tiny_model(dir.path()).display().to_string(),
            served_model_name: Some("tiny".into()),
            art_dir: dir.path().join(".art"),
            default_max_tokens: 16,
            ..ServeOptions::default()
        };
        configure(&mut options);
        Self::start(options, dir).await
    }

    pub async fn start(options: ServeOptions, dir: TempDir) -> Self {
        let state = build_state(&options).expect("server state builds");
        let model = state.base_model.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move { axum_serve(listener, state).await });
        TestServer {
            base_url,
            model,
            _dir: dir,
        }
    }
}

async fn axum_serve(listener: tokio::net::TcpListener, state: art_core::server::AppState) {
    art_core::server::serve_on(listener, router(state))
        .await
        .expect("server runs");
}

/// `art serve` on `model_dir` as a child process (killed when dropped), with `api_key` if given;
/// returns it and the URL it printed. Its output is drained so that it never blocks on a full pipe.
pub async fn spawn_server(
    model_dir: &Path,
    art_dir: &Path,
    api_key: Option<&str>,
) -> (tokio::process::Child, String) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let art = art_binary();
    let mut command = tokio::process::Command::new(&art);
    command
        .args(["serve", "--port", "0", "--model"])
        .arg(model_dir);
    command.arg("--art-dir").arg(art_dir);
    if let Some(key) = api_key {
        command.args(["--api-key", key]);
    }
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e} (cargo test --workspace builds it)", art.display()));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the server prints its address");
        if let Some(url) = line.split("listening on ").nth(1) {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            return (child, url.to_string());
        }
    }
}
