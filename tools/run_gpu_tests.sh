#!/usr/bin/env bash
# make test-gpu: the C ABI suites on the CUDA backend, a subset under compute-sanitizer
# (memcheck, racecheck), the torch parity tests and the Python binding's GPU tests.
set -uo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so"
export LD_LIBRARY_PATH="$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 - <<'PY'
import ctypes, os, sys
lib = ctypes.CDLL(os.environ["FUSEDCE_LIBRARY"])
sys.exit(0 if lib.fce_cuda_available() else 1)
PY
then
  echo "SKIPPED: make test-gpu needs a CUDA device and a CUDA build; none here"
  exit 0
fi
passed=0; failed=0; failed_names=()
suite() {
  local name=$1; shift
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); echo "--- $name: ok"
  else failed=$((failed + 1)); failed_names+=("$name"); echo "--- $name: FAILED"; fi
}
suite "C ABI tests on CUDA (ctest)" env FCE_TEST_BACKEND=cuda ctest --test-dir "$BUILD" --output-on-failure
if command -v compute-sanitizer >/dev/null; then
  for t in "$BUILD"/tests/test_ce "$BUILD"/tests/test_linear_ce; do
    [ -x "$t" ] || continue
    filter=${FCE_SANITIZER_FILTER:-*Small*:*Shift*:*InPlace*:*Odd*}
    suite "memcheck $(basename "$t")" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool memcheck \
      --error-exitcode 1 "$t" --gtest_filter="$filter"
    suite "racecheck $(basename "$t")" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool racecheck \
      --error-exitcode 1 "$t" --gtest_filter="$filter"
  done
else
  echo "SKIPPED: compute-sanitizer not on PATH"
fi
[ -x "$BUILD/tests/smoke_linear_ce" ] && suite "linear CE smoke (CUDA)" "$BUILD/tests/smoke_linear_ce"
suite "torch parity (tests/gpu)" python3 -m pytest -q "$ROOT/tests/gpu"
if [ -f "$ROOT/bindings/python/tests/test_torch.py" ]; then
  suite "Python binding on CUDA (torch, CuPy)" python3 -m pytest -q "$ROOT/bindings/python/tests/test_torch.py"
fi
suite "demo (CUDA)" "$BUILD/examples/demo" --small
echo
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "gpu suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
