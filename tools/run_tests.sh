#!/usr/bin/env bash
# make test: every test that needs no GPU, against the library in build dir $1.
# Each suite's own runner prints its details; the last line counts the suites.
set -uo pipefail
BUILD=${1:-build}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "$BUILD" && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so"
export LD_LIBRARY_PATH="$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PYTHON=${PYTHON:-python3}
passed=0; failed=0; failed_names=()

suite() {  # suite NAME COMMAND...
  local name=$1; shift
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); echo "--- $name: ok"
  else failed=$((failed + 1)); failed_names+=("$name"); echo "--- $name: FAILED"; fi
}

suite "C ABI tests (CPU backend, ctest)" ctest --test-dir "$BUILD" --output-on-failure -j 2
if [ -d "$ROOT/bindings/python/tests" ]; then
  suite "Python binding (NumPy, CPU backend)" env PYTHONPATH="$ROOT/bindings/python" \
    "$PYTHON" -m pytest -q "$ROOT/bindings/python/tests"
fi
if [ -x "$ROOT/bindings/rust/run_tests.sh" ]; then
  suite "Rust crates fusedce-sys + fusedce" "$ROOT/bindings/rust/run_tests.sh" "$BUILD"
fi
if [ -x "$ROOT/bindings/julia/run_tests.sh" ]; then
  suite "Julia package (header/ccall checker)" "$ROOT/bindings/julia/run_tests.sh" "$BUILD"
fi
suite "install + find_package + pkg-config consumer" "$ROOT/tools/check_install.sh" "$BUILD"
suite "C example (demo, CPU backend, small sizes)" "$BUILD/examples/demo" --cpu --small
if [ -f "$ROOT/examples/python/train_lm_head.py" ]; then
  # With torch: fusedce.torch against F.cross_entropy; without it: the NumPy path
  # (fusedce.core.linear_ce + SGD on the CPU backend). Either fails when the loss does not fall.
  suite "Python example (CPU)" env PYTHONPATH="$ROOT/bindings/python" \
    "$PYTHON" "$ROOT/examples/python/train_lm_head.py" --device cpu --steps 5
fi
if [ -x "$BUILD/examples/cpp_example" ]; then
  suite "C++ example (CPU backend)" "$BUILD/examples/cpp_example" --cpu
fi
suite "README code blocks (tools/check_readme.py)" "$PYTHON" "$ROOT/tools/check_readme.py" "$BUILD"
# the sdist, pip-installed into a fresh virtual environment with nvcc hidden (CPU-only, with the
# warning), then the Python tests against that installed package with no FUSEDCE_LIBRARY set
suite "pip install <sdist> (fresh venv, nvcc hidden: CPU-only)" env -u FUSEDCE_LIBRARY \
  bash "$ROOT/tools/test_pip_install.sh"
suite "fusedce-cu13 wheel (build, auditwheel, fresh venv, CPU tests)" env -u FUSEDCE_LIBRARY \
  bash "$ROOT/tools/test_wheel.sh"
# The CPU backend under the sanitizers: the libFuzzer target over every entry point's argument
# checks for FCE_FUZZ_SECONDS (60; make fuzz runs longer), and the C suites built with
# AddressSanitizer + UBSan (make test-asan). Each in a build directory of its own.
suite "fuzz: the one-GPU entry points' argument checks (libFuzzer, ASan+UBSan, ${FCE_FUZZ_SECONDS:-60} s)" \
  bash "$ROOT/tools/run_fuzz.sh" "${FUZZ_BUILD:-$ROOT/build-fuzz}" "${FCE_FUZZ_SECONDS:-60}"
suite "C ABI tests under AddressSanitizer + UBSan (CPU backend, make test-asan)" \
  bash "$ROOT/tools/run_asan.sh" "${ASAN_BUILD:-$ROOT/build-asan}"
echo "SKIPPED: GPU tests (make test-gpu) need a CUDA device; this run tests the CPU backend"
echo
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
