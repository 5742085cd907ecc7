//! OpenPipe ART's own Python package (openpipe-art 0.5.23, unmodified) trains on `art serve`
//! through its ServerlessBackend: scripts/python_art_check.py starts the server itself (it kills
//! and restarts it), registers, samples, trains two GRPO steps and an SFT job, logs, deletes, and
//! checks the bad paths. About 20 s on two cores.

use art_e2e::{python_check, smollm2};

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs ART_TEST_ART_PYTHON: a Python >= 3.12 with openpipe-art (scripts/test.sh makes .venv-art and runs this with --ignored)"]
async fn python_art_trains_through_the_serverless_backend_api() {
    let python = std::env::var_os("ART_TEST_ART_PYTHON")
        .expect("set ART_TEST_ART_PYTHON to a Python with openpipe-art (scripts/setup-python.sh .venv-art, as scripts/test.sh does)");
    let model = smollm2();
    let binary = art_e2e::art_binary();
    let stdout = python_check(
        python,
        "python_art_check.py",
        &[binary.as_os_str(), model.as_os_str()],
    )
    .await;
    eprintln!("{}", stdout.trim());
}

/// The recording of ART's RULER that art-core/tests/ruler.rs compares ours with
/// (art-core/tests/fixtures/ruler_art.json) is still what the installed openpipe-art records.
/// About 3 s.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs ART_TEST_ART_PYTHON: a Python >= 3.12 with openpipe-art (scripts/test.sh makes .venv-art and runs this with --ignored)"]
async fn the_ruler_recording_matches_the_installed_art() {
    let python = std::env::var_os("ART_TEST_ART_PYTHON")
        .expect("set ART_TEST_ART_PYTHON to a Python with openpipe-art");
    python_check(python, "ruler_art_shapes.py", &["--check".as_ref()]).await;
}
