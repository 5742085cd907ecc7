#!/usr/bin/env bash
# Installs what the browser test (scripts/browser-check.py) needs; cheap when already done:
#   - Debian's `chromium` (apt-get; the test drives this binary, playwright downloads no browser),
#   - .venv-browser (git-ignored) with the pinned JupyterLab and playwright of
#     scripts/requirements-browser.txt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/scripts/requirements-browser.txt"
VENV="$ROOT/.venv-browser"

if command -v chromium >/dev/null 2>&1; then
  echo "present: chromium"
else
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >/dev/null
  echo "ready: chromium ($(chromium --version 2>/dev/null || true))"
fi

"$ROOT/scripts/setup-python.sh" "$VENV" "$REQS"
