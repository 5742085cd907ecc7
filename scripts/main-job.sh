#!/usr/bin/env bash
# The main job (README): fetches the default model, builds the backend and runs a short GRPO
# training on SmolLM2-135M-Instruct, printing the held-out reward before and after.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-models.sh
# Cargo.toml patches evcxr (the notebook kernel's); the workspace does not load without it.
scripts/patch-crates.sh
# The dev profile compiles dependencies optimised (see Cargo.toml) and shares its build with the tests.
cargo build -p art-core --features server --bin art --example main_job
export ART_MODELS_DIR="$ROOT/models"
target/debug/examples/main_job "$@"
