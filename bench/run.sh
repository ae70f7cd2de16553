#!/usr/bin/env bash
# make bench: on a GPU machine, times fusedce and its peers; writes bench/results/*.json.
# bench_ce.py and bench_linear.py time the C ABI calls (bench_options.py: what the 0.3 options
# cost; adversarial.py: errors on adversarial rows against float64 and torch eager); bench_torch.py
# is the torch-level benchmark
# (loss + .backward() through each library's torch API; FCE_BENCH_TORCH_ARGS, e.g. "--ops ce --merge").
# Peers (Liger-Kernel, cut-cross-entropy) are used when importable, or installed from wheels
# carried in .whl/ (see bench/NOTES.md); never vendored.
set -euo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so"
if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fce-peers "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/fce-peers${PYTHONPATH:+:$PYTHONPATH}
fi
cd "$ROOT/bench"
export PYTHONUNBUFFERED=1
python3 bench_ce.py ${OUT:+--out "$OUT"} ${FCE_BENCH_CE_ARGS:-}
python3 bench_linear.py ${OUT:+--out "$OUT"} ${FCE_BENCH_LINEAR_ARGS:-}
python3 bench_options.py
PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" python3 adversarial.py --device cuda
python3 bench_torch.py ${OUT:+--out "$OUT"} ${FCE_BENCH_TORCH_ARGS:-}
