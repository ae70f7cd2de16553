#!/usr/bin/env bash
# bench/frontdoor.sh: the numbers behind the one-GPU tables of README.md and docs/performance.md
# in as little GPU time as possible, on a GPU machine with no network and no BLAS headers (so the
# library is built here and carried). The vocabulary-parallel table (two GPUs) and the CPU table
# (`make bench-cpu`) come from their committed files. Three steps:
#
#   here, once:   bash bench/frontdoor.sh pack          build-sm90/ (sm_90, library only) and
#                                                       .device/fce-lib.tar.xz: the library +
#                                                       the OpenBLAS runtime it links
#                 bash bench/stage_torch_lce.sh         .peers/torch_lce (torch 2.15's chunked CE)
#                 peers' wheels in .whl/ (Liger-Kernel, Cut Cross-Entropy, Quack and the small
#                 parts of the CuTe DSL runtime); the CuTe DSL runtime's libraries as an xz tar
#                 split in two: .cutlA/cutl.part.aa and .cutlB/cutl.part.ab
#   GPU, call 1:  bash bench/frontdoor.sh 1              (with .device .whl .cutlA .peers)
#                 the torch-level CE and linear CE side by side with every peer but those that
#                 need the CuTe DSL runtime (bench_torch.py), the plot
#   GPU, call 2:  bash bench/frontdoor.sh 2              (with .device .cutlB; the same machine,
#                 /tmp kept) the CuTe DSL peers (Liger-Kernel's CuTe DSL path, Quack), merged into
#                 the file; the ∂W accuracy study behind the chunk rule (accuracy_dw.py --study);
#                 the raw CE grid (bench_ce.py) if the time limit leaves room for it
# Each call copies the result files and its log into $OUT (default /tmp/fce-out); put the JSON
# and PNG files into bench/results/ and run `python3 bench/tables.py --write` here. `make bench`
# runs every benchmark instead.
# Time limits: FCE_FRONTDOOR_SECONDS (call 1: 520, call 2: 520) bound the benchmarks so that the
# files are written before a 10-minute limit.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
step=${1:?usage: bench/frontdoor.sh pack|1|2}
OUT=${OUT:-/tmp/fce-out}
SITE=/tmp/fce-site
LIB=/tmp/fce-lib
t0=$SECONDS

pack() {
  set -e
  cmake -S . -B build-sm90 -DCMAKE_BUILD_TYPE=Release -DFCE_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DFCE_BUILD_TESTS=OFF -DFCE_BUILD_EXAMPLES=OFF \
    ${NVCC:+-DCMAKE_CUDA_COMPILER=$NVCC} >/dev/null
  cmake --build build-sm90 --target fusedce -j "$(nproc)"
  local tmp; tmp=$(mktemp -d)
  cp -P build-sm90/libfusedce.so* "$tmp/"
  # the shared libraries it needs that a bare CUDA image lacks (OpenBLAS and its Fortran runtime)
  ldd build-sm90/libfusedce.so | awk '/openblas|gfortran|quadmath/ {print $3}' | xargs -r -I{} cp -L {} "$tmp/"
  mkdir -p .device
  tar -C "$tmp" -cJf .device/fce-lib.tar.xz .
  rm -rf "$tmp"
  ls -la .device/fce-lib.tar.xz
  tar -tJf .device/fce-lib.tar.xz
}

environment() {  # the library, its CUDA libraries, the peers
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  if [ ! -e "$LIB/libfusedce.so" ]; then
    [ -f .device/fce-lib.tar.xz ] || { echo "frontdoor: no .device/fce-lib.tar.xz (bench/frontdoor.sh pack)"; exit 2; }
    mkdir -p "$LIB" && tar -xJf .device/fce-lib.tar.xz -C "$LIB"
  fi
  local cuda_dirs
  cuda_dirs=$(python3 - <<'PY'
import glob, os
roots = ["/usr/local/cuda/lib64"]
try:
    import nvidia
    roots = list(nvidia.__path__) + roots
except ImportError:
    pass
found = {os.path.dirname(f) for r in roots for f in glob.glob(os.path.join(r, "**", "libcublasLt.so.*"), recursive=True)}
print(":".join(sorted(found)))
PY
)
  export LD_LIBRARY_PATH="$LIB${cuda_dirs:+:$cuda_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FUSEDCE_LIBRARY=$LIB/libfusedce.so
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
}

run() {  # run NAME SECONDS COMMAND...: output to $LOG and the console
  local name=$1 lim=$2; shift 2
  echo "=== $name (limit ${lim} s, at $((SECONDS - t0)) s)" | tee -a "$LOG"
  timeout "$lim" "$@" 2>&1 | tee -a "$LOG"
  echo "--- $name: rc ${PIPESTATUS[0]} at $((SECONDS - t0)) s" | tee -a "$LOG"
}

left() { local n=$(( ${1} - (SECONDS - t0) )); echo $(( n > 30 ? n : 30 )); }

collect() {  # the result files of this device into $OUT, and into /tmp for the next call
  local dev; dev=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
  mkdir -p /tmp/fce-results
  for f in bench/results/{torch,ce,accuracy-dw}-"$dev".json "bench/results/torch-$dev.png"; do
    [ -f "$f" ] && cp "$f" "$OUT/" && cp "$f" /tmp/fce-results/
  done
  ls -la "$OUT"
}

case "$step" in
  pack) pack ;;
  1)
    budget=${FCE_FRONTDOOR_SECONDS:-520}
    mkdir -p "$OUT" "$SITE"
    LOG=$OUT/frontdoor-1.log
    environment
    { date -u; nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$LOG"
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    [ -f .cutlA/cutl.part.aa ] && cp .cutlA/cutl.part.aa /tmp/  # for call 2
    # every impl but the CuTe DSL peers (and the in-place variant, whose leaf-gradient copy
    # in this benchmark says nothing about its use after a layer)
    run bench_torch "$(left $((budget - 40)))" python3 bench/bench_torch.py \
      --skip liger-cute,quack,fusedce-inplace
    run plot 60 python3 bench/plot.py
    collect ;;
  2)
    budget=${FCE_FRONTDOOR_SECONDS:-520}
    mkdir -p "$OUT"
    LOG=$OUT/frontdoor-2.log
    [ -d "$SITE" ] || { echo "frontdoor: $SITE is missing: call 2 runs on call 1's machine"; exit 2; }
    environment
    cp /tmp/fce-results/*.json bench/results/ 2>/dev/null  # call 1's files, to merge into
    if [ -f /tmp/cutl.part.aa ] && [ -f .cutlB/cutl.part.ab ]; then
      cat /tmp/cutl.part.aa .cutlB/cutl.part.ab | xz -dc | tar x -C "$SITE"
    else
      echo "frontdoor: no CuTe DSL runtime parts (/tmp/cutl.part.aa from call 1, .cutlB/cutl.part.ab)"
    fi
    run bench_torch_cute "$(left $((budget - 300)))" python3 bench/bench_torch.py --merge \
      --impls liger-cute,quack
    run plot 60 python3 bench/plot.py
    run accuracy_dw "$(left $((budget - 60)))" python3 bench/accuracy_dw.py --study
    [ $(( budget - (SECONDS - t0) )) -gt 100 ] && run bench_ce "$(left $((budget - 10)))" python3 bench/bench_ce.py
    collect ;;
  *) echo "usage: bench/frontdoor.sh pack|1|2"; exit 2 ;;
esac
