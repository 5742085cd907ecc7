//! Our server against the official `openai` Python SDK as the client (scripts/openai_sdk_check.py).
//! Needs ART_TEST_PYTHON pointing at an interpreter with `openai` (scripts/setup-python.sh makes one).

use art_e2e::TestServer;

#[tokio::test(flavor = "multi_thread")]
async fn the_official_python_sdk_works_against_our_server() {
    let Some(python) = std::env::var_os("ART_TEST_PYTHON") else {
        eprintln!("skipping: set ART_TEST_PYTHON to a Python with the openai package (scripts/test.sh does)");
        return;
    };
    let server = TestServer::tiny(|o| o.api_key = Some("sk-test".into())).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/openai_sdk_check.py"
    );
    let output = tokio::process::Command::new(python)
        .args([script, &server.base_url, &server.model, "sk-test"])
        .output()
        .await
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the SDK check failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("\"ok\": true"), "{stdout}");
}
