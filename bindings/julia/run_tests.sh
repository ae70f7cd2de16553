#!/usr/bin/env bash
# The Julia binding's tests: bindings/julia/run_tests.sh [BUILD_DIR]   (make test runs it)
#   1. gen/check.py      the package's ccalls, struct and constants against include/fusedce.h,
#                        and src/libfusedce.jl current with gen/generate.py (no Julia needed)
#   2. gen/test_check.py the checker's self-test: it must fail on planted mistakes
#   3. test/runtests.jl  the package on the CPU backend against a Float64 reference, and the
#                        example, only where `julia` is on the PATH
# Exits non-zero when any of them fails.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-$ROOT/build}
PYTHON=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree
status=0

echo "--- gen/check.py: header <-> ccalls, struct, constants, generated file current"
"$PYTHON" "$HERE/gen/check.py" || status=1

echo "--- gen/test_check.py: the checker's self-test"
"$PYTHON" -m pytest -q -p no:cacheprovider "$HERE/gen/test_check.py" || status=1

if command -v julia >/dev/null 2>&1; then
  if [ -z "${FUSEDCE_LIBRARY:-}" ]; then
    export FUSEDCE_LIBRARY="$(cd "$BUILD" 2>/dev/null && pwd)/libfusedce.so"
  fi
  echo "--- test/runtests.jl: the package on the CPU backend ($FUSEDCE_LIBRARY)"
  julia --project="$HERE/FusedCE.jl" "$HERE/FusedCE.jl/test/runtests.jl" || status=1
  echo "--- examples/julia/cross_entropy.jl"
  julia --project="$HERE/FusedCE.jl" "$ROOT/examples/julia/cross_entropy.jl" || status=1
else
  echo "SKIPPED: julia not on PATH (Julia tests need a Julia runtime)"
fi
exit $status
