#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter (OpenPipe ART needs one): python3 itself when it
# is new enough, else python3.13 / python3.12 on PATH, else one that pyenv installed.
set -euo pipefail
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
for candidate in python3 python3.13 python3.12; do
  if path="$(command -v "$candidate")" && new_enough "$path"; then
    echo "$path"
    exit 0
  fi
done
for path in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$path" ] && new_enough "$path"; then
    echo "$path"
    exit 0
  fi
done
echo "no Python >= 3.12 found (OpenPipe ART needs one): install one (e.g. pyenv install 3.12)" >&2
exit 1
