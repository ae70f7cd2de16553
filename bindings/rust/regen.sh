#!/usr/bin/env bash
# Regenerates fusedce-sys/src/bindings.rs from include/fusedce.h with the bindgen CLI
# (Debian: apt-get install bindgen libclang-dev). The output is committed, so building the
# crates needs neither bindgen nor libclang; check_bindings.sh checks that it is current.
#
#   bindings/rust/regen.sh            rewrite bindings/rust/fusedce-sys/src/bindings.rs
#   bindings/rust/regen.sh OUT.rs     write to OUT.rs instead (what check_bindings.sh does)
#
# The flags below are the whole recipe; change them here only.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
header="$root/include/fusedce.h"
out="${1:-$here/fusedce-sys/src/bindings.rs}"
BINDGEN="${BINDGEN:-bindgen}"
RUSTFMT="${RUSTFMT:-$(command -v rustfmt || echo "$HOME/.cargo/bin/rustfmt")}"

command -v "$BINDGEN" >/dev/null || { echo "regen.sh: '$BINDGEN' not found (apt-get install bindgen libclang-dev)" >&2; exit 1; }
[ -x "$RUSTFMT" ] || command -v "$RUSTFMT" >/dev/null || { echo "regen.sh: rustfmt not found (set RUSTFMT)" >&2; exit 1; }

tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
# --allowlist-*: only the fce_* API and the FCE_* constants, nothing from the system headers.
# (glibc's __int32_t & co. come along as unused aliases: blocklisting them would stop bindgen
#  deriving Copy/Clone/Debug for fce_options.)
# --no-prepend-enum-name: FCE_SUCCESS, not fce_status_FCE_SUCCESS (the C names, unchanged).
# --size_t-is-usize: size_t as usize. Formatting is a separate rustfmt step, explicit.
"$BINDGEN" "$header" \
  --allowlist-function 'fce_.*' \
  --allowlist-type 'fce_.*' \
  --allowlist-var 'FCE_.*' \
  --no-prepend-enum-name \
  --size_t-is-usize \
  --no-rustfmt-bindings \
  -- -x c -std=c99 > "$tmp"
"$RUSTFMT" --edition 2021 --emit stdout < "$tmp" > "$out"
echo "regen.sh: wrote $out"
