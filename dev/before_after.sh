#!/usr/bin/env bash
# dev/before_after.sh: two builds of fusedce measured in one run on one GPU, alternately, with the
# same harness: the torch-level loss + backward (bench/bench_torch.py, fusedce's own rows only)
# and the raw CE call against a copy (bench_ce.py of each version, since the C ABI changed).
#
#   bash dev/before_after.sh BEFORE AFTER_LIB OUT
#     BEFORE     a folder with lib/ (the older libfusedce.so and the OpenBLAS it links),
#                python/ (that version's bindings/python), bench_ce.py and harness.py
#     AFTER_LIB  a folder with this checkout's libfusedce.so (and its OpenBLAS)
#     OUT        where the result files go: {before,after}-{1,2}/torch-<gpu>.json and
#                ce-<gpu>.json
# Each build runs twice (before, after, before, after) so that drift shows as a difference
# between the two runs of one build. PARTS="torch ce" (default) picks the benchmarks. dev/compare_before_after.py OUT prints the table.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BEFORE=$(cd "${1:?BEFORE}" && pwd)
AFTER=$(cd "${2:?AFTER_LIB}" && pwd)
OUT=${3:?OUT}
mkdir -p "$OUT"
SHAPES=${SHAPES:-16384x128256,8192x256000,32768x32000,4096x50257,8192x4096x128256,16384x4096x32000}
PARTS=${PARTS:-torch ce}
run() {  # which round
  local which=$1 round=$2 lib py bench_ce
  if [ "$which" = before ]; then
    lib=$BEFORE/lib py=$BEFORE/python bench_ce=$BEFORE/bench_ce.py
  else
    lib=$AFTER py=$ROOT/bindings/python bench_ce=$ROOT/bench/bench_ce.py
  fi
  echo "=== $which, round $round"
  if [[ " $PARTS " == *" torch "* ]]; then
    LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" FUSEDCE_LIBRARY="$lib/libfusedce.so" PYTHONPATH="$py" \
      python3 "$ROOT/bench/bench_torch.py" --impls fusedce,fusedce-inplace --no-dw \
      --shapes "$SHAPES" --out "$OUT/$which-$round" || echo "bench_torch ($which) failed"
  fi
  case " $PARTS " in *" ce "*) ;; *) return 0 ;; esac
  LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" FUSEDCE_LIBRARY="$lib/libfusedce.so" PYTHONPATH="$py" \
    python3 "$bench_ce" --out "$OUT/$which-$round" || echo "bench_ce ($which) failed"
}
for round in 1 2; do
  run before $round
  run after $round
done
