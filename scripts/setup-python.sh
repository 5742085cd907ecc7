#!/usr/bin/env bash
# Creates .venv (git-ignored) with the Python packages the tests use; cheap when already done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/scripts/requirements-test.txt"
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha256"
want="$(sha256sum "$REQS" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  echo "present: .venv"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQS"
echo "$want" > "$STAMP"
echo "ready: .venv"
