//! OpenPipe ART's own Python package (openpipe-art 0.5.23, unmodified) trains on `art serve`
//! through its ServerlessBackend: scripts/python_art_check.py starts the server itself (it kills
//! and restarts it), registers, samples, trains two steps, logs, deletes, and checks the bad
//! paths. About 20 s on two cores.

use art_e2e::smollm2;

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs ART_TEST_ART_PYTHON: a Python >= 3.12 with openpipe-art (scripts/test.sh makes .venv-art and runs this with --ignored)"]
async fn python_art_trains_through_the_serverless_backend_api() {
    let python = std::env::var_os("ART_TEST_ART_PYTHON")
        .expect("set ART_TEST_ART_PYTHON to a Python with openpipe-art (scripts/setup-python.sh .venv-art, as scripts/test.sh does)");
    let model = smollm2().expect("the default model (scripts/fetch-models.sh)");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/python_art_check.py"
    );
    let output = tokio::process::Command::new(python)
        .arg(script)
        .arg(art_e2e::art_binary())
        .arg(&model)
        .output()
        .await
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python ART check failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("\"ok\": true"), "{stdout}");
    eprintln!("{}", stdout.trim());
}
