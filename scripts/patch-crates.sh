#!/usr/bin/env bash
# Builds the patched copies of released crates that Cargo.toml's [patch.crates-io] points to, in
# patched-by-scripts-patch-crates.sh/<crate> (git-ignored): the crate file from crates.io (checked
# against its sha256) with our changes applied in order, each small enough to offer upstream and
# with a note beside it saying why:
# - evcxr 0.22.0: art-kernel/evcxr-patch/*.patch (the notebook kernel's evaluator);
# - candle-kernels 0.11.1: art-core/candle-kernels-patch/*.patch (a type-check without nvcc's
#   minutes on kernels that only a link needs).
#
# The README's commands (scripts/test.sh, scripts/main-job.sh) run this first; run it yourself
# before a plain `cargo build` in a fresh clone. Cheap when the patched copies are up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}"
# Each crate's scratch directory, removed however the script ends (a failed check exits early).
TMPS=()
trap 'rm -rf "${TMPS[@]}"' EXIT

# patch_crate NAME VERSION SHA256 PATCH_DIR: SHA256 is the released crate file's, as crates.io's
# index (and Cargo.lock before the patch) lists it.
patch_crate() {
  local name="$1" version="$2" sha256="$3" patches="$ROOT/$4"
  local dest="$ROOT/patched-by-scripts-patch-crates.sh/$name"
  local stamp="$dest/.art-patches.sha256"
  local want
  want="$( (echo "$name $version $sha256"; cat "$patches"/*.patch) | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "present: patched-by-scripts-patch-crates.sh/$name"
    return
  fi

  find_crate() { # the crate file in cargo's download cache, or nothing
    ls "$CARGO_HOME"/registry/cache/*/"$name-$version.crate" 2>/dev/null | head -n 1 || true
  }
  local crate tmp
  crate="$(find_crate)"
  tmp="$(mktemp -d)"
  TMPS+=("$tmp")
  if [ -z "$crate" ]; then
    # Let cargo download it, through whatever registry configuration this machine has: a
    # throwaway package outside the workspace (so that our [patch] does not apply) depending on it.
    echo "fetching $name $version (cargo fetch) ..."
    mkdir -p "$tmp/fetch/src"
    printf '[package]\nname = "fetch-%s"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\n%s = "=%s"\n' \
      "$name" "$name" "$version" > "$tmp/fetch/Cargo.toml"
    touch "$tmp/fetch/src/lib.rs"
    (cd "$tmp/fetch" && cargo fetch --quiet)
    crate="$(find_crate)"
    [ -n "$crate" ] || { echo "patch-crates.sh: cargo fetch did not leave $name-$version.crate in $CARGO_HOME/registry/cache" >&2; exit 1; }
  fi
  local got
  got="$(sha256sum "$crate" | cut -d' ' -f1)"
  if [ "$got" != "$sha256" ]; then
    echo "patch-crates.sh: $crate has sha256 $got, expected $sha256" >&2
    exit 1
  fi

  tar -xzf "$crate" -C "$tmp"
  local patch_file
  for patch_file in "$patches"/*.patch; do
    if ! patch --quiet --forward -p1 -d "$tmp/$name-$version" < "$patch_file"; then
      echo "patch-crates.sh: $(basename "$patch_file") does not apply to $name $version" >&2
      exit 1
    fi
  done
  rm -rf "$dest"
  mkdir -p "$(dirname "$dest")"
  mv "$tmp/$name-$version" "$dest"
  echo "$want" > "$stamp"
  echo "patched: patched-by-scripts-patch-crates.sh/$name ($(ls "$patches"/*.patch | wc -l) changes)"
}

patch_crate evcxr 0.22.0 ee69caeeefc311959b85962458e370d8eccb165123edbc5270134aaee6d7ed80 \
  art-kernel/evcxr-patch
patch_crate candle-kernels 0.11.1 8dc057aec95c3b1a0e595227cd039c1436da596f79ccc9e025ba17d070315851 \
  art-core/candle-kernels-patch
