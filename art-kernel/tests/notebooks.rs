//! Runs every tutorial notebook (notebooks/*.ipynb) headless with the ART kernel through
//! scripts/run-notebooks.py (nbclient): any error output fails, and notebook 3 must show its trained
//! reward beating the base reward.
//!
//! Needs ART_TEST_PYTHON (a Python with nbclient; `scripts/test.sh` sets it) and the `art` binary
//! next to the kernel's (`cargo test --workspace` builds both), so it is ignored by default;
//! scripts/test.sh runs it after the kernel test with `-- --ignored`. The kernel's build cache is
//! the one the jupyter_client test warms (`target/art-kernel-test-cache`, or ART_KERNEL_CACHE).

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
#[ignore = "needs ART_TEST_PYTHON, a Python with nbclient (scripts/setup-python.sh), and the kernel cache the jupyter_client test warms; scripts/test.sh runs it"]
fn tutorial_notebooks_run_top_to_bottom() {
    let python = std::env::var_os("ART_TEST_PYTHON").expect(
        "set ART_TEST_PYTHON to a Python with nbclient (.venv/bin/python after scripts/setup-python.sh)",
    );
    let kernel_bin = PathBuf::from(env!("CARGO_BIN_EXE_art-kernel"));
    let bin_dir = kernel_bin.parent().unwrap();
    let art = std::env::var_os("ART_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir.join("art"));
    assert!(
        art.is_file(),
        "no `art` binary at {}: build it with `cargo build -p art-core --features server --bin art` \
         (or run `cargo test --workspace`), or set ART_BIN",
        art.display()
    );
    let cache = std::env::var_os("ART_KERNEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir.parent().unwrap().join("art-kernel-test-cache"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/run-notebooks.py");
    let status = Command::new(&python)
        .arg(&script)
        .env("ART_KERNEL_BIN", &kernel_bin)
        .env("ART_KERNEL_CACHE", &cache)
        .env("ART_BIN", &art)
        .status()
        .expect("cannot run scripts/run-notebooks.py");
    assert!(status.success(), "{} failed", script.display());
}
