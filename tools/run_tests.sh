#!/usr/bin/env bash
# make test: every test that needs no GPU, against the library in build dir $1.
# One line per suite: its name, what its runners counted (tools/test_counts.py: ctest, pytest,
# cargo, the documentation checker), ok or FAILED, and its seconds; a failing suite's log is
# printed in full below its line. Every suite's full output is in BUILD/test-logs/<suite>.log.
# The last line counts the suites: "suites: N passed, M failed" (CI reads it).
set -uo pipefail
BUILD=${1:-build}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "$BUILD" && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so"
export LD_LIBRARY_PATH="$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PYTHON=${PYTHON:-python3}
LOGS="$BUILD/test-logs"
mkdir -p "$LOGS"
passed=0; failed=0; failed_names=(); start_all=$(date +%s)

suite() {  # suite NAME COMMAND...: runs COMMAND with its output in $LOGS/<name>.log
  local name=$1; shift
  local slug log start rc secs counts status
  slug=$(printf '%s' "$name" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//' | cut -c1-60)
  log="$LOGS/${slug:-suite}.log"
  printf '%-58s ' "$name"
  start=$(date +%s)
  "$@" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  counts=$("$PYTHON" "$ROOT/tools/test_counts.py" "$log" 2>/dev/null)
  if [ $rc -eq 0 ]; then status=ok; passed=$((passed + 1))
  else status=FAILED; failed=$((failed + 1)); failed_names+=("$name"); fi
  printf '%-6s %-42s %5d s\n' "$status" "${counts:--}" "$secs"
  if [ $rc -ne 0 ]; then
    echo "---- $name: exit status $rc; its log ($log):"
    cat "$log"
    echo "---- end of $name"
  fi
}

in_root() { (cd "$ROOT" && "$@"); }  # for checkers that find their configuration from the cwd

echo "make test: $(sed -n 's/^#define FCE_VERSION_\(MAJOR\|MINOR\|PATCH\) //p' "$ROOT/include/fusedce.h" \
  | paste -sd.), $BUILD, logs in $LOGS"
suite "words (tools/check_words.py)" "$PYTHON" "$ROOT/tools/check_words.py" --self-test "$ROOT"
suite "ruff (ruff.toml)" in_root "$PYTHON" -m ruff check .
suite "clang-format (tools/format_files.txt)" bash "$ROOT/tools/check_format.sh"
suite "tables: README and docs match bench/results (bench/tables.py --check)" \
  "$PYTHON" "$ROOT/bench/tables.py" --check
suite "ctest: C ABI suites, CPU backend" ctest --test-dir "$BUILD" --output-on-failure -j 2
if [ -d "$ROOT/bindings/python/tests" ]; then
  suite "pytest: Python binding (NumPy, CPU backend)" env PYTHONPATH="$ROOT/bindings/python" \
    "$PYTHON" -m pytest -q "$ROOT/bindings/python/tests"
fi
if [ -x "$ROOT/bindings/rust/run_tests.sh" ]; then
  suite "cargo: Rust crates fusedce-sys + fusedce" "$ROOT/bindings/rust/run_tests.sh" "$BUILD"
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
suite "documentation code blocks (tools/check_readme.py)" \
  "$PYTHON" "$ROOT/tools/check_readme.py" "$BUILD"
# the sdist, pip-installed into a fresh virtual environment with nvcc hidden (CPU-only, with the
# warning), then the Python tests against that installed package with no FUSEDCE_LIBRARY set
suite "pip install <sdist> (fresh venv, nvcc hidden: CPU-only)" env -u FUSEDCE_LIBRARY \
  bash "$ROOT/tools/test_pip_install.sh"
suite "fusedce-cu13 wheel (build, auditwheel, fresh venv, CPU tests)" env -u FUSEDCE_LIBRARY \
  bash "$ROOT/tools/test_wheel.sh"
# The CPU backend under the sanitizers: the libFuzzer target over every entry point's argument
# checks for FCE_FUZZ_SECONDS (60; make fuzz runs longer), and the C suites built with
# AddressSanitizer + UBSan (make test-asan). Each in a build directory of its own.
suite "fuzz: argument checks (libFuzzer, ASan+UBSan, ${FCE_FUZZ_SECONDS:-60} s)" \
  bash "$ROOT/tools/run_fuzz.sh" "${FUZZ_BUILD:-$ROOT/build-fuzz}" "${FCE_FUZZ_SECONDS:-60}"
suite "ctest under AddressSanitizer + UBSan (make test-asan)" \
  bash "$ROOT/tools/run_asan.sh" "${ASAN_BUILD:-$ROOT/build-asan}"
echo "SKIPPED: GPU tests (make test-gpu) need a CUDA device; this run tests the CPU backend"
echo "total: $((passed + failed)) suites in $(( $(date +%s) - start_all )) s"
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
