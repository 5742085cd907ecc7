//! Our trajectories parquet read by pyarrow (scripts/check_parquet.py), with the Python given by
//! ART_TEST_PYTHON (scripts/test.sh sets it). Skipped, saying so, when ART_TEST_PYTHON is unset;
//! fails when that Python lacks pyarrow.

#![cfg(feature = "frames")]

mod common;

use std::path::Path;
use std::process::Command;

use art_core::ModelStore;
use common::{groups, scratch};
use serde_json::json;

fn python_with_pyarrow() -> String {
    let python = std::env::var("ART_TEST_PYTHON").expect(
        "set ART_TEST_PYTHON to a Python with pyarrow (scripts/setup-python.sh makes .venv)",
    );
    let ok = Command::new(&python)
        .args(["-c", "import pyarrow"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{python} (ART_TEST_PYTHON) cannot import pyarrow: run scripts/setup-python.sh and point \
         ART_TEST_PYTHON at .venv/bin/python"
    );
    python
}

#[test]
#[ignore = "needs ART_TEST_PYTHON: a Python with pyarrow (scripts/test.sh makes .venv and runs this with --ignored)"]
fn pyarrow_reads_our_trajectories_parquet() {
    let python = python_with_pyarrow();
    let art = scratch("python-parquet");
    let store = ModelStore::open(&art, "p", "m").unwrap();
    let logged = store.log(&groups(), "train", 7).unwrap();
    assert!(logged
        .trajectories_path
        .ends_with("trajectories/train/0007.parquet"));

    // Written out by hand from the fixture, not from our frames.
    let expected = json!({
        "rows": 4,
        "types": {
            "group_index": "int64",
            "trajectory_index": "int64",
            "reward": "double",
            "metric/correct": "bool",
            "metric/turns": "int64",
            "metric/difficulty": "double",
            "metadata/question": "string",
            "group_metadata/scenario": "string",
            "num_messages": "int64",
            "completion_tokens": "int64",
            "last_assistant": "string",
            "messages_and_choices": "string",
            "tools": "string",
            "metrics": "string",
            "logs": "list<string>",
            "group_logs": "list<string>",
            "initial_policy_version": "int64",
        },
        "values": {
            "group_index": [0, 0, 1, 1],
            "trajectory_index": [0, 1, 0, 1],
            "reward": [1.0, 0.0, 0.5, 0.5],
            "metric/correct": [true, false, true, true],
            "metric/turns": [1, 1, 1, 1],
            "metric/difficulty": [null, null, 0.5, 1.0],
            "metadata/question": ["2+2?", "2+2?", "Capital of France?", "7"],
            "group_metadata/scenario": ["arith-1", "arith-1", "geo-1", "geo-1"],
            "num_messages": [3, 3, 3, 5],
            "completion_tokens": [3, 3, 3, 5],
            "last_assistant": ["4", "5", "Paris", "Paris"],
            "logs": [["checked arithmetic"], [], [], []],
            "group_logs": [["group a judged"], ["group a judged"], [], []],
            "initial_policy_version": [0, null, null, null],
        },
        "json_columns": {
            "metrics": [
                {"correct": true, "turns": 1},
                {"correct": false, "turns": 1},
                {"correct": true, "difficulty": 0.5, "turns": 1},
                {"correct": true, "difficulty": 1.0, "turns": 1},
            ],
            "group_exceptions": [
                null, null,
                [{"type": "TimeoutError", "message": "judge took too long", "traceback": ""}],
                [{"type": "TimeoutError", "message": "judge took too long", "traceback": ""}],
            ],
        },
    });
    let expected_path = art.join("expected.json");
    std::fs::write(&expected_path, expected.to_string()).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_parquet.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg(&logged.trajectories_path)
        .arg(&expected_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("ok:"), "{stdout}");
    println!("{stdout}");

    // And the messages column is OpenAI-shaped JSON: check it in Python too.
    let check = r#"
import json, sys, pyarrow.parquet as pq
rows = pq.read_table(sys.argv[1]).column("messages_and_choices").to_pylist()
last = json.loads(rows[3])
assert [m.get("role") or m["message"]["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant"], last
assert last[2]["message"]["tool_calls"][0]["function"]["name"] == "search", last[2]
assert last[4]["token_ids"] == [31, 32, 33], last[4]
print("messages ok")
"#;
    let output = Command::new(&python)
        .args(["-c", check])
        .arg(&logged.trajectories_path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
