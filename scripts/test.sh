#!/usr/bin/env bash
# The test command (README): fetches the default model, prepares the Python test clients, and
# runs every test of the workspace. Extra arguments go to `cargo test`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-models.sh
scripts/patch-crates.sh
scripts/setup-python.sh
# OpenPipe ART itself (Python >= 3.12), the client of the ServerlessBackend API test.
scripts/setup-python.sh "$ROOT/.venv-art" "$ROOT/scripts/requirements-python-art.txt" \
  "$(scripts/python312.sh)"
# Chromium (Debian) and JupyterLab for the browser test of the saved notebooks.
scripts/setup-browser.sh
export ART_TEST_PYTHON="$ROOT/.venv/bin/python"
export ART_TEST_ART_PYTHON="$ROOT/.venv-art/bin/python"
export ART_TEST_BROWSER_PYTHON="$ROOT/.venv-browser/bin/python"
export ART_MODELS_DIR="$ROOT/models"
# The CPU thread settings `art serve` applies to itself (engine::process): the tests that load a
# model in their own process get them from here (a test harness has threads: it cannot set them).
export CANDLE_NUM_THREADS="${CANDLE_NUM_THREADS:-1}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-$(nproc)}"
cargo test --workspace "$@"
# Ignored by default (they need the Python clients above), in this order: the kernel test warms
# the kernel's build cache (~10 min cold) that the notebooks then use (~5 min).
cargo test --workspace --test jupyter_client -- --ignored
cargo test --workspace --test notebooks -- --ignored
# Ignored by default (it needs what setup-browser.sh installs): ~50 s. `--workspace`, as above,
# so that features resolve the same and nothing is rebuilt.
cargo test --workspace --test browser -- --ignored
# Ignored by default (it needs .venv): ~1 s. pyarrow reads our trajectories parquet.
cargo test --workspace --test python_parquet -- --ignored
# Ignored by default (it needs .venv): ~1 s. The official openai SDK against our server.
cargo test --workspace --test openai_sdk -- --ignored
# Ignored by default (it needs .venv-art): ~20 s. Python ART trains on `art serve`.
cargo test --workspace --test python_art -- --ignored
# Ignored by default (it needs tensorboard and opentelemetry-proto from setup-python.sh): ~30 s.
cargo test --workspace --test observability -- --ignored
