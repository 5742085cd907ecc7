//! Runs tests/kernel/test_kernel.py: a real Jupyter client (jupyter_client) installs the kernel
//! into a temporary prefix, starts it and checks evaluation, rich and live outputs, errors,
//! completion and interrupts.
//!
//! Needs a Python with jupyter_client, named by ART_TEST_PYTHON (`scripts/test.sh` sets it to the
//! .venv made by `scripts/setup-python.sh`), so it is ignored by default; scripts/test.sh runs it
//! with `cargo test --workspace --test jupyter_client -- --ignored`. Run so without
//! ART_TEST_PYTHON, or with a Python lacking jupyter_client, it fails saying what to do.
//!
//! The kernel's build cache (art-core and its dependencies compiled for cells) goes under the
//! target directory, `art-kernel-test-cache`, unless ART_KERNEL_CACHE names another: a cold
//! target directory pays for warming it once (minutes), later runs find it warm.

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
#[ignore = "needs ART_TEST_PYTHON, a Python with jupyter_client (scripts/setup-python.sh); scripts/test.sh runs it"]
fn jupyter_client_drives_the_kernel() {
    let python = std::env::var_os("ART_TEST_PYTHON").expect(
        "set ART_TEST_PYTHON to a Python with jupyter_client (.venv/bin/python after scripts/setup-python.sh)",
    );
    let has_client = Command::new(&python)
        .args(["-c", "import jupyter_client"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_client,
        "{} cannot import jupyter_client: run scripts/setup-python.sh",
        Path::new(&python).display()
    );
    let kernel_bin = PathBuf::from(env!("CARGO_BIN_EXE_art-kernel"));
    let cache = std::env::var_os("ART_KERNEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // target/<profile>/art-kernel -> target/art-kernel-test-cache
            let target = kernel_bin.parent().and_then(Path::parent).unwrap();
            target.join("art-kernel-test-cache")
        });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kernel/test_kernel.py");
    let status = Command::new(&python)
        .arg(&script)
        .env("ART_KERNEL_BIN", &kernel_bin)
        .env("ART_KERNEL_CACHE", &cache)
        .status()
        .expect("cannot run the kernel test script");
    assert!(status.success(), "{} failed", script.display());
}
