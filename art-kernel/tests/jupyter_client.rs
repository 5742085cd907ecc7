//! Runs tests/kernel/test_kernel.py: a real Jupyter client (jupyter_client) starts the installed
//! kernel and checks evaluation, rich and live outputs, errors, completion and interrupts.
//!
//! Needs a Python with jupyter_client, named by ART_TEST_PYTHON; without one the test says so and
//! passes without running.

use std::path::Path;
use std::process::Command;

#[test]
fn jupyter_client_drives_the_kernel() {
    let Some(python) = std::env::var_os("ART_TEST_PYTHON") else {
        eprintln!(
            "SKIPPED: set ART_TEST_PYTHON to a Python with jupyter_client to run the kernel tests"
        );
        return;
    };
    let has_client = Command::new(&python)
        .args(["-c", "import jupyter_client"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_client {
        eprintln!(
            "SKIPPED: {} cannot import jupyter_client (pip install jupyter_client)",
            Path::new(&python).display()
        );
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kernel/test_kernel.py");
    let status = Command::new(&python)
        .arg(&script)
        .env("ART_KERNEL_BIN", env!("CARGO_BIN_EXE_art-kernel"))
        .status()
        .expect("cannot run the kernel test script");
    assert!(status.success(), "{} failed", script.display());
}
