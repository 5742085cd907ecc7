#!/usr/bin/env bash
# Creates a venv (git-ignored) with pinned Python packages; cheap when already done.
#   scripts/setup-python.sh                 .venv with scripts/requirements-test.txt (the tests' clients)
#   scripts/setup-python.sh VENV REQUIREMENTS   another venv, e.g. the browser test's
#   scripts/setup-python.sh VENV REQUIREMENTS PYTHON   ... made with that interpreter
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
REQS="${2:-$ROOT/scripts/requirements-test.txt}"
PYTHON="${3:-python3}"
STAMP="$VENV/.requirements.sha256"
want="$(sha256sum "$REQS" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  echo "present: $(basename "$VENV")"
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQS"
echo "$want" > "$STAMP"
echo "ready: $(basename "$VENV")"
