//! Opens the saved tutorial notebooks in JupyterLab in headless Chromium, untrusted as a clone's
//! are, and checks what a reader sees (scripts/browser-check.py: transcripts, reward tables and
//! charts rendered and visible, readable column widths, no sideways overflow, equal ranks, charts
//! sharp and without a white box in the dark theme), in the light and the dark theme, 1400 px wide
//! and in a 1440x900 window. Screenshots go to target/browser-screenshots.
//!
//! Cost on the 2-core dev machine: `scripts/setup-browser.sh` cold ~50 s (apt-get chromium, the
//! venv), then ~50 s per run; warm setup is instant. Needs ART_TEST_BROWSER_PYTHON, the
//! python of the venv that script makes (.venv-browser), so it is ignored by default;
//! scripts/test.sh runs it with `cargo test --workspace --test browser -- --ignored`.

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
#[ignore = "needs scripts/setup-browser.sh (Chromium, JupyterLab); scripts/test.sh runs it"]
fn saved_notebooks_render_in_jupyterlab() {
    let python = std::env::var_os("ART_TEST_BROWSER_PYTHON").expect(
        "set ART_TEST_BROWSER_PYTHON to .venv-browser/bin/python (run scripts/setup-browser.sh first)",
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shots = std::env::var_os("ART_BROWSER_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/browser-screenshots"));
    let script = root.join("scripts/browser-check.py");
    let status = Command::new(&python)
        .arg(&script)
        .arg(&shots)
        .status()
        .expect("cannot run scripts/browser-check.py");
    assert!(
        status.success(),
        "{} failed (screenshots in {})",
        script.display(),
        shots.display()
    );
}
