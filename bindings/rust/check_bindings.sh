#!/usr/bin/env bash
# Fails when fusedce-sys/src/bindings.rs is stale: regenerates it (regen.sh, same flags) into a
# temporary file and diffs it against the committed one. Part of `make test`.
# FCE_SKIP_BINDGEN_CHECK=1 skips the check (for machines without bindgen/libclang).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
committed="$here/fusedce-sys/src/bindings.rs"
if [ "${FCE_SKIP_BINDGEN_CHECK:-0}" = 1 ]; then
  echo "check_bindings.sh: SKIPPED (FCE_SKIP_BINDGEN_CHECK=1)"
  exit 0
fi
fresh="$(mktemp --suffix=.rs)"
trap 'rm -f "$fresh"' EXIT
bash "$here/regen.sh" "$fresh" >/dev/null
if diff -u "$committed" "$fresh"; then
  echo "check_bindings.sh: OK, $committed matches include/fusedce.h"
else
  echo "check_bindings.sh: STALE: $committed differs from what include/fusedce.h generates" >&2
  echo "  committed by: $(head -n1 "$committed")" >&2
  echo "  this bindgen: $(head -n1 "$fresh")" >&2
  echo "  run bindings/rust/regen.sh and commit the result" >&2
  exit 1
fi
