#!/usr/bin/env bash
# make fuzz (and make test, for 60 s): the libFuzzer target tests/fuzz/fuzz_api.cpp over the
# argument validation of every entry point on the CPU backend, with AddressSanitizer and
# UndefinedBehaviorSanitizer, the library's CPU sources compiled in (a build of its own, clang,
# FCE_WITH_CUDA=OFF).
#   tools/run_fuzz.sh [BUILD_DIR [SECONDS]]     default build-fuzz, 60 s
#   FUZZ_MERGE=1: afterwards, add to tests/fuzz/corpus the inputs of the run that reach code it
#                 does not (libFuzzer -merge on edge coverage: the corpus stays small)
#   FUZZ_JOBS=N:  N fuzzing processes (libFuzzer -fork) instead of 1
# It starts from tests/fuzz/corpus (read only) plus BUILD_DIR/corpus (what earlier runs found).
# A failure leaves the input in BUILD_DIR/artifacts/; reproduce with
#   FCE_FUZZ_VERBOSE=1 BUILD_DIR/tests/fuzz_api BUILD_DIR/artifacts/crash-...
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build-fuzz}
SECONDS_BUDGET=${2:-60}
JOBS=${FUZZ_JOBS:-1}
CXX=${FUZZ_CXX:-clang++}
CC=${FUZZ_CC:-clang}

need() { echo "make fuzz: $*" >&2; echo "  (make setup installs it: apt-get install clang libclang-rt-dev)" >&2; exit 1; }
command -v "$CXX" >/dev/null || need "no $CXX (clang with libFuzzer is needed)"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
  > "$probe/p.cpp"
"$CXX" -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" 2>"$probe/err" \
  || { cat "$probe/err" >&2; need "$CXX cannot link a libFuzzer target (no compiler-rt fuzzer/sanitizer runtime)"; }

mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
start=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFCE_WITH_CUDA=OFF \
  -DFCE_BUILD_FUZZ=ON -DFCE_BUILD_EXAMPLES=OFF -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
  >"$BUILD/configure.log" || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" --target fuzz_api -j "$(nproc)" >"$BUILD/build.log" 2>&1 \
  || { tail -50 "$BUILD/build.log"; exit 1; }
echo "fuzz: built $BUILD/tests/fuzz_api in $(( $(date +%s) - start )) s"

mkdir -p "$BUILD/corpus" "$BUILD/artifacts"
# One BLAS thread: the fuzzer's calls are small, and libFuzzer's timing is steadier.
export OPENBLAS_NUM_THREADS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
args=(-max_total_time="$SECONDS_BUDGET" -timeout=60 -rss_limit_mb=4096 -max_len=512
      -artifact_prefix="$BUILD/artifacts/" -print_final_stats=1)
[ "$JOBS" -gt 1 ] && args+=(-fork="$JOBS")
log="$BUILD/fuzz.log"
echo "fuzz: $SECONDS_BUDGET s from tests/fuzz/corpus ($(ls "$ROOT/tests/fuzz/corpus" | wc -l) inputs) and $BUILD/corpus"
status=0
"$BUILD/tests/fuzz_api" "${args[@]}" "$BUILD/corpus" "$ROOT/tests/fuzz/corpus" >"$log" 2>&1 || status=$?
if [ $status -eq 0 ]; then grep -a -E "^(stat::|INFO: seed corpus)|DONE " "$log" || true; fi
if [ $status -ne 0 ]; then
  echo "---- fuzz FAILED (exit $status); the end of $log:"
  grep -a -v -E "^#[0-9]+ +(NEW|REDUCE|pulse)|NEW_FUNC" "$log" | tail -60
  echo "----"
  ls "$BUILD/artifacts/" 2>/dev/null | sed "s|^|input: $BUILD/artifacts/|"
  echo "reproduce: FCE_FUZZ_VERBOSE=1 $BUILD/tests/fuzz_api $BUILD/artifacts/<input>"
  exit 1
fi
if [ "${FUZZ_MERGE:-0}" = 1 ]; then
  before=$(ls "$ROOT/tests/fuzz/corpus" | wc -l)
  "$BUILD/tests/fuzz_api" -merge=1 -use_counters=0 -max_len=512 "$ROOT/tests/fuzz/corpus" "$BUILD/corpus" >"$BUILD/merge.log" 2>&1
  echo "fuzz: merged into tests/fuzz/corpus: $before -> $(ls "$ROOT/tests/fuzz/corpus" | wc -l) inputs"
fi
echo "fuzz: no crash, no write outside a buffer, no wrong verdict in $SECONDS_BUDGET s"
