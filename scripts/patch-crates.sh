#!/usr/bin/env bash
# Builds the patched copies of released crates that Cargo.toml's [patch.crates-io] points to:
# evcxr 0.22.0 from crates.io with our changes (art-kernel/evcxr-patch/*.patch, applied in order;
# each has a note beside it saying why) in patched-by-scripts-patch-crates.sh/evcxr (git-ignored).
#
# The README's commands (scripts/test.sh, scripts/main-job.sh) run this first; run it yourself
# before a plain `cargo build` in a fresh clone. Cheap when the patched copy is up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NAME=evcxr
VERSION=0.22.0
# The released crate file's sha256 (as crates.io's index lists it).
SHA256=ee69caeeefc311959b85962458e370d8eccb165123edbc5270134aaee6d7ed80
PATCHES="$ROOT/art-kernel/evcxr-patch"
DEST="$ROOT/patched-by-scripts-patch-crates.sh/$NAME"
STAMP="$DEST/.art-patches.sha256"

want="$( (echo "$NAME $VERSION $SHA256"; cat "$PATCHES"/*.patch) | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "present: patched-by-scripts-patch-crates.sh/$NAME"
  exit 0
fi

CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}"
find_crate() { # the crate file in cargo's download cache, or nothing
  ls "$CARGO_HOME"/registry/cache/*/"$NAME-$VERSION.crate" 2>/dev/null | head -n 1 || true
}
crate="$(find_crate)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
if [ -z "$crate" ]; then
  # Let cargo download it, through whatever registry configuration this machine has: a
  # throwaway package outside the workspace (so that our [patch] does not apply) depending on it.
  echo "fetching $NAME $VERSION (cargo fetch) ..."
  mkdir -p "$TMP/fetch/src"
  printf '[package]\nname = "fetch-%s"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\n%s = "=%s"\n' \
    "$NAME" "$NAME" "$VERSION" > "$TMP/fetch/Cargo.toml"
  touch "$TMP/fetch/src/lib.rs"
  (cd "$TMP/fetch" && cargo fetch --quiet)
  crate="$(find_crate)"
  [ -n "$crate" ] || { echo "patch-crates.sh: cargo fetch did not leave $NAME-$VERSION.crate in $CARGO_HOME/registry/cache" >&2; exit 1; }
fi
got="$(sha256sum "$crate" | cut -d' ' -f1)"
if [ "$got" != "$SHA256" ]; then
  echo "patch-crates.sh: $crate has sha256 $got, expected $SHA256" >&2
  exit 1
fi

tar -xzf "$crate" -C "$TMP"
for patch_file in "$PATCHES"/*.patch; do
  if ! patch --quiet --forward -p1 -d "$TMP/$NAME-$VERSION" < "$patch_file"; then
    echo "patch-crates.sh: $(basename "$patch_file") does not apply to $NAME $VERSION" >&2
    exit 1
  fi
done
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$TMP/$NAME-$VERSION" "$DEST"
echo "$want" > "$STAMP"
echo "patched: patched-by-scripts-patch-crates.sh/$NAME ($(ls "$PATCHES"/*.patch | wc -l) changes)"
