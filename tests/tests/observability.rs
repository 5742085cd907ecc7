//! Observability end to end, through the clients users watch runs with: one training iteration
//! (`traced_run`: rollouts judged by RULER, `model.log`, a step, all through `art serve`) exports
//! its spans over OTLP to a loopback receiver that decodes them with the official
//! `opentelemetry-proto` package, and its curves are read back by TensorBoard's own
//! EventAccumulator, equal to history.jsonl, also after a resumed run. An endpoint that refuses
//! connections or hangs loses no history and warns once per process.
//!
//! Cost: four runs of the default model (~15-25 s each on 2 cores). Needs ART_TEST_PYTHON with
//! `tensorboard` and `opentelemetry-proto` (scripts/setup-python.sh) and the default model
//! (scripts/fetch-models.sh); scripts/test.sh runs it with `--ignored`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use art_e2e::{smollm2, temp_dir};
use serde_json::Value;

fn python() -> String {
    std::env::var("ART_TEST_PYTHON")
        .expect("ART_TEST_PYTHON: a Python from scripts/setup-python.sh")
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("observability")
        .join(name)
}

/// The OTLP receiver on a free port, writing spans to `spans`; killed when dropped.
struct Receiver {
    child: Child,
    port: u16,
}

impl Receiver {
    fn start(spans: &Path, hang: bool) -> Self {
        let mut command = Command::new(python());
        command
            .arg(script("otlp_receiver.py"))
            .arg(spans)
            .stdout(Stdio::piped());
        if hang {
            command.arg("--hang");
        }
        let mut child = command.spawn().expect("the OTLP receiver starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver said {line:?}"));
        Receiver { child, port }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Run {
    model_dir: PathBuf,
    step: u64,
    stderr: String,
}

/// One `traced_run` with `env` (the OTEL_* variables of the caller's shell are removed first).
fn traced_run(art_dir: &Path, name: &str, env: &[(&str, String)]) -> Run {
    let model = smollm2();
    let mut command = Command::new(env!("CARGO_BIN_EXE_traced_run"));
    command.arg(art_dir).arg(&model).arg(name);
    for (key, _) in std::env::vars() {
        if key.starts_with("OTEL_") || key == "TRACEPARENT" || key == "ART_TRACEPARENT_FILE" {
            command.env_remove(key);
        }
    }
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().expect("traced_run runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "traced_run failed:\n{stdout}\n{stderr}"
    );
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("traced_run printed {stdout:?} ({e})"));
    Run {
        model_dir: PathBuf::from(summary["model_dir"].as_str().unwrap()),
        step: summary["step"].as_u64().unwrap(),
        stderr,
    }
}

/// TensorBoard's EventAccumulator against history.jsonl (see tensorboard_check.py).
fn check_tensorboard(model_dir: &Path) -> Value {
    let output = Command::new(python())
        .arg(script("tensorboard_check.py"))
        .arg(model_dir)
        .output()
        .expect("tensorboard_check.py runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "TensorBoard and history.jsonl differ: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

fn history_lines(model_dir: &Path) -> usize {
    std::fs::read_to_string(model_dir.join("history.jsonl"))
        .unwrap()
        .lines()
        .count()
}

/// The received spans, by id.
struct Spans(Vec<Value>);

impl Spans {
    fn read(path: &Path) -> Self {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        Spans(
            text.lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect(),
        )
    }

    fn named(&self, name: &str) -> Vec<&Value> {
        self.0.iter().filter(|s| s["name"] == name).collect()
    }

    fn children<'a>(&'a self, parent: &Value, name: &str) -> Vec<&'a Value> {
        self.0
            .iter()
            .filter(|s| s["parent_span_id"] == parent["span_id"] && s["name"] == name)
            .collect()
    }

    fn only_child<'a>(&'a self, parent: &Value, name: &str) -> &'a Value {
        let children = self.children(parent, name);
        assert_eq!(
            children.len(),
            1,
            "one `{name}` under `{}`, got {children:#?}",
            parent["name"]
        );
        children[0]
    }
}

const SERVER: i64 = 2;
const CLIENT: i64 = 3;

/// A client `chat` span under `parent`, and the server's `chat` span joined to it.
fn assert_chat_pair(spans: &Spans, parent: &Value, model: &str) {
    let client = spans.only_child(parent, &format!("chat {model}"));
    assert_eq!(client["kind"], CLIENT, "{client}");
    assert_eq!(client["service"], "art");
    let server = spans.only_child(client, &format!("chat {model}"));
    assert_eq!(server["kind"], SERVER, "{server}");
    assert_eq!(server["service"], "art-serve");
    assert_eq!(server["trace_id"], client["trace_id"]);
    for attributes in [&client["attributes"], &server["attributes"]] {
        assert_eq!(attributes["gen_ai.operation.name"], "chat");
        assert_eq!(attributes["gen_ai.request.model"], model);
        assert!(attributes["gen_ai.usage.input_tokens"].as_i64().unwrap() > 0);
        assert!(attributes["gen_ai.usage.output_tokens"].as_i64().unwrap() > 0);
        assert!(attributes["gen_ai.input.messages"]
            .as_str()
            .unwrap()
            .starts_with('['));
        assert!(attributes["gen_ai.output.messages"].as_str().is_some());
    }
}

#[test]
#[ignore = "needs ART_TEST_PYTHON with tensorboard and opentelemetry-proto, and the default model; scripts/test.sh runs it"]
fn spans_reach_an_otlp_receiver_and_curves_reach_tensorboard() {
    let dir = temp_dir("observability");
    let spans_path = dir.path().join("spans.jsonl");
    let receiver = Receiver::start(&spans_path, false);
    let art_dir = dir.path().join(".art");
    let run = traced_run(
        &art_dir,
        "watched",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-test=yes".into()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    );
    assert_eq!(run.step, 1);
    assert!(
        !run.stderr.contains("not exported") && !run.stderr.contains("cannot export"),
        "{}",
        run.stderr
    );
    let spans = Spans::read(&spans_path);
    for span in &spans.0 {
        assert_eq!(
            span["headers"]["x-test"], "yes",
            "OTEL_EXPORTER_OTLP_HEADERS sent"
        );
        assert_eq!(span["headers"]["content-type"], "application/x-protobuf");
        assert_eq!(span["scope"], "art-for-rust");
    }

    // gather_trajectory_groups > trajectory_group x2 > rollout x2 > chat (client) > chat (server),
    // and in each group ruler > chat > chat.
    let gather = spans.named("gather_trajectory_groups");
    assert_eq!(gather.len(), 1, "{:#?}", spans.0);
    let gather = gather[0];
    assert_eq!(gather["parent_span_id"], "");
    assert_eq!(gather["attributes"]["art.trajectories"], 4);
    let groups = spans.children(gather, "trajectory_group");
    assert_eq!(groups.len(), 2);
    for group in groups {
        let rollouts = spans.children(group, "rollout");
        assert_eq!(rollouts.len(), 2);
        for rollout in rollouts {
            assert!(rollout["attributes"]["art.reward"].is_number());
            assert_chat_pair(&spans, rollout, "watched");
        }
        let ruler = spans.only_child(group, "ruler");
        assert_eq!(
            ruler["attributes"]["art.ruler.scores"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert_chat_pair(&spans, ruler, "watched");
        assert!(spans
            .0
            .iter()
            .filter(|s| s["trace_id"] == group["trace_id"])
            .all(|s| s["status"] != 2));
    }

    // model.log and train_step, each the client's span with the server's under it.
    for (name, detail) in [
        ("model.log", "art.log.reward"),
        ("train_step", "art.train.loss"),
    ] {
        let client = spans.named(name);
        let client: Vec<_> = client.into_iter().filter(|s| s["kind"] == CLIENT).collect();
        assert_eq!(client.len(), 1, "{name}");
        let server = spans.only_child(client[0], name);
        assert_eq!(server["kind"], SERVER);
        assert!(server["attributes"][detail].is_number(), "{server}");
    }

    // TensorBoard: the same scalars and steps as history.jsonl...
    let tensorboard = check_tensorboard(&run.model_dir);
    assert_eq!(tensorboard["steps"], serde_json::json!([0, 1]));
    assert_eq!(history_lines(&run.model_dir), 2);
    // ...and after a resumed run (a new process, no traces), the curves go on in the same file.
    let resumed = traced_run(&art_dir, "watched", &[]);
    assert_eq!(resumed.step, 2);
    let tensorboard = check_tensorboard(&resumed.model_dir);
    assert_eq!(tensorboard["steps"], serde_json::json!([0, 1, 2]));
    let files = std::fs::read_dir(resumed.model_dir.join("tensorboard"))
        .unwrap()
        .count();
    assert_eq!(files, 1, "one event file per model");

    // The notebook's inline dashboard: TensorBoard's own server on the art dir lists the
    // model's run and its scalars.
    let binary = Path::new(&python()).with_file_name("tensorboard");
    let board = art_core::display::tensorboard_with(&art_dir, &binary).expect("TensorBoard starts");
    let again = art_core::display::tensorboard_with(&art_dir, &binary).unwrap();
    assert_eq!(board.url, again.url, "one server per directory");
    let tags = http_get(&format!("{}data/plugin/scalars/tags", board.url));
    assert!(
        tags.contains("observability/models/watched/tensorboard") && tags.contains("train/loss"),
        "{tags}"
    );
}

/// The body of a plain HTTP GET on loopback.
fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut stream = std::net::TcpStream::connect(host).unwrap();
    write!(stream, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or(response)
}

#[test]
#[ignore = "needs ART_TEST_PYTHON with opentelemetry-proto, and the default model; scripts/test.sh runs it"]
fn an_endpoint_that_refuses_or_hangs_loses_no_history() {
    let dir = temp_dir("observability-down");
    let refusing = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
        // Dropped here: nothing listens on the port any more.
    };
    let hanging = Receiver::start(&dir.path().join("never.jsonl"), true);
    let mut warnings = HashMap::new();
    for (case, endpoint) in [("refusing", refusing), ("hanging", hanging.endpoint())] {
        let run = traced_run(
            &dir.path().join(case),
            case,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000".into()),
            ],
        );
        assert_eq!(run.step, 1, "{case}: the step completed");
        // The rollouts' line (model.log) and the step's line (train).
        assert_eq!(history_lines(&run.model_dir), 2, "{case}");
        // One warning per process at most (this program and its `art serve`), never one per span.
        let count = run.stderr.matches("cannot export traces").count();
        assert!(count <= 2, "{case}: {count} warnings\n{}", run.stderr);
        warnings.insert(case, count);
        assert!(
            run.stderr.contains("spans were not exported"),
            "{case}: the lost spans are counted\n{}",
            run.stderr
        );
    }
    assert!(
        warnings["refusing"] >= 1,
        "a refused connection is reported"
    );
}
