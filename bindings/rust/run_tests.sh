#!/usr/bin/env bash
# The Rust binding's tests, against the libfusedce.so in build dir $1 (what `make test` runs):
#   1. check_bindings.sh: fusedce-sys/src/bindings.rs is what bindgen makes of include/fusedce.h
#   2. cargo test for fusedce-sys and fusedce (CPU backend; float64 reference in the tests;
#      tests/cuda.rs and cuda_linear.rs run the CUDA entry points against the CPU where a GPU is visible, and
#      prints "skipped: no CUDA device" otherwise)
#   3. tests/cuda.rs's and cuda_linear.rs's harness on the CPU backend over host memory
#      (FUSEDCE_CUDA_TESTS_ON_CPU=1), so that it is exercised without a GPU too
#   4. the example: cargo run --example cross_entropy
#   5. the `bundled` feature: fusedce-sys builds libfusedce from the repository's sources with
#      cmake into its OUT_DIR (CPU-only here, FUSEDCE_BUNDLED_CUDA=OFF: a CUDA build would add
#      minutes for no GPU to run it on; FUSEDCE_BUNDLED_CUDA=ON or auto selects it), links that,
#      and the workspace's tests run against it (FUSEDCE_LIB_DIR unset)
# On a GPU machine without cargo: bindings/rust/run_gpu_tests.sh (pack here, run there).
# Usage: bindings/rust/run_tests.sh BUILD_DIR
# Cargo writes only under BUILD_DIR/rust-target (CARGO_TARGET_DIR); --offline --locked: no
# network, no change to Cargo.lock. FCE_SKIP_BINDGEN_CHECK=1 skips step 1 (no bindgen).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR (the directory holding libfusedce.so)" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "$1" && pwd)"
[ -e "$build/libfusedce.so" ] || { echo "$0: no libfusedce.so in $build (run make first)" >&2; exit 1; }

CARGO="${CARGO:-$(command -v cargo || echo "$HOME/.cargo/bin/cargo")}"
[ -x "$CARGO" ] || { echo "$0: cargo not found (install rustup, or set CARGO)" >&2; exit 1; }

export FUSEDCE_LIB_DIR="$build"
export FUSEDCE_INCLUDE_DIR="$root/include"
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CARGO_TARGET_DIR="$build/rust-target"
manifest="$here/Cargo.toml"
cargo_flags=(--offline --locked --manifest-path "$manifest")

step() { echo "--- rust: $*"; }

step "bindings are current (check_bindings.sh)"
bash "$here/check_bindings.sh"

step "cargo test (fusedce-sys, fusedce)"
"$CARGO" test "${cargo_flags[@]}" --workspace

step "tests/cuda.rs's and cuda_linear.rs's harness on the CPU backend (FUSEDCE_CUDA_TESTS_ON_CPU=1)"
FUSEDCE_CUDA_TESTS_ON_CPU=1 "$CARGO" test "${cargo_flags[@]}" -p fusedce --test cuda --test cuda_linear

step "example: cargo run --example cross_entropy"
"$CARGO" run "${cargo_flags[@]}" -p fusedce --example cross_entropy

step "cargo test --features fusedce-sys/bundled (libfusedce built by build.rs, FUSEDCE_BUNDLED_CUDA=${FUSEDCE_BUNDLED_CUDA:-OFF})"
env -u FUSEDCE_LIB_DIR -u FUSEDCE_INCLUDE_DIR FUSEDCE_BUNDLED_CUDA="${FUSEDCE_BUNDLED_CUDA:-OFF}" \
  LD_LIBRARY_PATH= CARGO_TARGET_DIR="$build/rust-target-bundled" \
  "$CARGO" test "${cargo_flags[@]}" --workspace --features fusedce-sys/bundled

echo "--- rust: all passed"
