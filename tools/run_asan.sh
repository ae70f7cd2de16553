#!/usr/bin/env bash
# make test-asan (and make test): the CPU test suites (every GoogleTest binary of tests/, the
# fuzz corpus replay, the C99 header check) built with AddressSanitizer + UndefinedBehavior-
# Sanitizer, library included (g++, FCE_WITH_CUDA=OFF, a build of its own), run on the CPU
# backend. Any report aborts its test (-fno-sanitize-recover=all, halt_on_error).
#   tools/run_asan.sh [BUILD_DIR]        default build-asan
#   FCE_ASAN_CTEST_ARGS="-R Linear"      extra ctest arguments (a subset)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build-asan}
CXX=${ASAN_CXX:-g++}
CC=${ASAN_CC:-gcc}
JOBS=${JOBS:-$(nproc)}
# float-cast-overflow is not part of GCC's -fsanitize=undefined; a float -> integer conversion out
# of range is undefined behaviour all the same.
SAN="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer"

mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
start=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFCE_WITH_CUDA=OFF \
  -DFCE_BUILD_EXAMPLES=OFF -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
  "-DCMAKE_C_FLAGS=$SAN" "-DCMAKE_CXX_FLAGS=$SAN" \
  "-DCMAKE_EXE_LINKER_FLAGS=$SAN" "-DCMAKE_SHARED_LINKER_FLAGS=$SAN" \
  >"$BUILD/configure.log" || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" -j "$JOBS" >"$BUILD/build.log" 2>&1 || { tail -50 "$BUILD/build.log"; exit 1; }
echo "asan: built $BUILD in $(( $(date +%s) - start )) s"

export FCE_TEST_BACKEND=cpu
# detect_leaks: LeakSanitizer needs ptrace-like access to the process, which some containers
# deny; it is then switched off with a note rather than failing every test.
leaks=1
if ! ASAN_OPTIONS=detect_leaks=1 "$BUILD/tests/test_api" --gtest_filter=Api.Version >/dev/null 2>&1; then
  echo "asan: LeakSanitizer cannot run here: leak checking off"
  leaks=0
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=$leaks:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
start=$(date +%s)
status=0
# shellcheck disable=SC2086
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" ${FCE_ASAN_CTEST_ARGS:-} || status=$?
echo "asan: ctest took $(( $(date +%s) - start )) s"
exit $status
