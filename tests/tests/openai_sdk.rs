//! Our server against the official `openai` Python SDK as the client (scripts/openai_sdk_check.py).
//! Needs ART_TEST_PYTHON pointing at an interpreter with `openai` (scripts/setup-python.sh makes one);
//! ignored by default, scripts/test.sh runs it with --ignored. About 1 s.

use art_e2e::{python_check, TestServer};

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs ART_TEST_PYTHON: a Python with the openai package (scripts/test.sh makes .venv and runs this with --ignored)"]
async fn the_official_python_sdk_works_against_our_server() {
    let python = std::env::var_os("ART_TEST_PYTHON")
        .expect("set ART_TEST_PYTHON to a Python with the openai package (scripts/setup-python.sh makes .venv, as scripts/test.sh does)");
    let server = TestServer::tiny(|o| o.api_key = Some("sk-test".into())).await;
    python_check(
        python,
        "openai_sdk_check.py",
        &[
            server.base_url.as_ref(),
            server.model.as_ref(),
            "sk-test".as_ref(),
        ],
    )
    .await;
}
