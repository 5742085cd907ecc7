#!/usr/bin/env bash
# The test command (README): fetches the default model, prepares the Python test clients, and
# runs every test of the workspace. Extra arguments go to `cargo test`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-models.sh
scripts/patch-crates.sh
scripts/setup-python.sh
export ART_TEST_PYTHON="$ROOT/.venv/bin/python"
export ART_MODELS_DIR="$ROOT/models"
cargo test --workspace "$@"
