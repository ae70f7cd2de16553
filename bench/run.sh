#!/usr/bin/env bash
# make bench: every benchmark of bench/ on this machine's GPU(s), against the library in build dir
# $1 (default build). Each writes bench/results/<bench>-<device>.json, replacing that device's
# previous file (git keeps the history); then `python3 bench/tables.py --write` refreshes the
# tables of README.md and docs/ from them (docs/performance.md says which table comes from which).
#   bench_ce.py             the raw one-pass CE call against the copy speed
#   bench_options.py        what the options cost (argmax, token scaling, z-loss, fce_backward)
#   bench_linear.py         the raw fused linear CE call against its GEMM floor
#   adversarial.py          errors on adversarial rows against float64 and torch eager
#   accuracy_dw.py          the error of a 16-bit ∂W summed over token chunks
#   bench_torch.py + plot.py  loss + backward through each library's torch API (FCE_BENCH_TORCH_ARGS)
#   bench_vocab_parallel.py the sharded linear CE over NCCL (with 2 or more GPUs)
# Peers (Liger-Kernel, Cut Cross-Entropy, Quack) are used when importable, or installed from
# wheels in .whl/; torch 2.15's chunked linear CE from bench/stage_torch_lce.sh's .peers/.
# bench/frontdoor.sh is the short path to the tables alone.
set -uo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fce-peers "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/fce-peers:$PYTHONPATH
fi
cd "$ROOT/bench"
failed=()
bench() { echo "=== $*"; python3 "$@" || failed+=("$1"); }
bench bench_ce.py
bench bench_options.py
bench bench_linear.py
bench adversarial.py --device cuda
bench accuracy_dw.py
# shellcheck disable=SC2086  # FCE_BENCH_TORCH_ARGS holds several arguments
bench bench_torch.py ${FCE_BENCH_TORCH_ARGS:-}
bench plot.py
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then bench bench_vocab_parallel.py --gpus "$gpus"; fi
echo "now: python3 bench/tables.py --write   (README.md and docs/*.md from bench/results)"
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
