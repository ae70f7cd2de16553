#!/usr/bin/env bash
# The wheels on a GPU machine with no CUDA toolkit: for each fusedce_cu13-*.whl / fusedce_cu12-*.whl
# in WHEEL_DIR, the CUDA toolkit is moved aside (/usr/local/cuda*, root needed) and kept off
# PATH / LD_LIBRARY_PATH, the wheel is installed with `pip install --no-deps --target
# /tmp/fce-<tag>` and put first on PYTHONPATH, then:
#   1. python -m fusedce (the library, the cuBLASLt it loaded, the GPU)
#   2. a NumPy-only cross-entropy on the CPU backend
#   3. a torch CUDA call (fusedce.torch.cross_entropy + backward against F.cross_entropy) with
#      fusedce imported BEFORE torch in one process and AFTER torch in another, each printing
#      the libcublasLt files /proc/self/maps shows
#   4. FUSEDCE_CUBLASLT=<missing file>: the CPU backend works, a CUDA call raises
#      BackendUnavailableError naming libcublasLt
#   5. the package's own tests (test_numpy*, test_loading, test_torch*, test_transformers; a copy
#      outside the repository, so that conftest.py does not import the source tree)
# The machine's python3 is expected to have torch (+cu13x, whose nvidia-cublas provides
# libcublasLt.so.13), numpy, transformers and pytest. It has no nvidia-cublas-cu12: the cu12
# wheel then finds no cuBLASLt 12 and its CUDA backend is off (step 3 checks that it says so),
# unless CUBLAS12_WHEEL names an nvidia_cublas_cu12-*.whl to install beside it (~581 MB).
# Everything goes to LOG; the toolkit is put back on exit (trap).
#
#   tools/wheel_gpu_check.sh WHEEL_DIR LOG     e.g. .wheelhouse bench/results/wheel-h200.log
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 WHEEL_DIR LOG" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEEL_DIR=$(cd "$1" && pwd)
mkdir -p "$(dirname "$2")"
LOG=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
PYTHON=${PYTHON:-python3}
HIDDEN=/usr/local/.fce-hidden-cuda
exec > >(tee "$LOG") 2>&1
failures=()

restore() {
  if [ -d "$HIDDEN" ]; then
    for d in "$HIDDEN"/*; do [ -e "$d" ] && mv "$d" /usr/local/; done
    rmdir "$HIDDEN" 2>/dev/null
    echo "=== toolkit restored: $(ls -d /usr/local/cuda* 2>/dev/null | paste -sd' ')"
  fi
}
trap restore EXIT

echo "=== wheel_gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda)"

# ---- hide the CUDA toolkit
mkdir -p "$HIDDEN"
for d in /usr/local/cuda*; do [ -e "$d" ] && mv "$d" "$HIDDEN/"; done
strip_cuda() { tr ':' '\n' <<<"${1:-}" | grep -v -i "/cuda" | paste -sd: -; }
PATH=$(strip_cuda "$PATH")
LD_LIBRARY_PATH=$(strip_cuda "${LD_LIBRARY_PATH:-}")
export PATH LD_LIBRARY_PATH
unset CUDA_HOME CUDA_PATH CUDACXX FUSEDCE_LIBRARY FUSEDCE_CUBLASLT
echo "=== toolkit hidden in $HIDDEN: nvcc $(command -v nvcc || echo 'not on PATH');" \
     "ldconfig still lists: $(ldconfig -p | grep -c 'libcublasLt') libcublasLt entries (their files are gone)"

TESTS=$(mktemp -d /tmp/fce-tests.XXXXXX)
cp -r "$ROOT/bindings/python/tests/." "$TESTS/"
rm -rf "$TESTS/__pycache__"

check() {  # check NAME COMMAND...: runs it, records a failure
  echo "--- $1"
  shift
  if "$@"; then echo "--- ok"; else echo "--- FAILED"; failures+=("$TAG: $*"); fi
}

TORCH_CALL='
import os, sys
first = sys.argv[1]
if first == "fusedce":
    import fusedce, fusedce.torch
import torch
import torch.nn.functional as F
if first == "torch":
    import fusedce, fusedce.torch
print("fusedce", fusedce.__file__, "imported", "before" if first == "fusedce" else "after", "torch")
print("build info:", fusedce.build_info())
z = torch.randn(512, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, 32000, (512,), device="cuda")
try:
    loss = fusedce.torch.cross_entropy(z, y)
    loss.backward()
    zr = z.detach().float().requires_grad_()
    ref = F.cross_entropy(zr, y)
    ref.backward()
    err = (loss.float() - ref).abs().item()
    gerr = (z.grad.float() - zr.grad).abs().max().item()
    print("loss %.6f ref %.6f |diff| %.2e, grad max |diff| %.2e" % (loss.item(), ref.item(), err, gerr))
    ok = err < 1e-2 and gerr < 1e-3
    # the fused linear CE (cuBLASLt GEMMs)
    h = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 4096, (256,), device="cuda")
    l2 = fusedce.torch.linear_cross_entropy(h, w, t)
    r2 = F.cross_entropy((h.float() @ w.float().t()), t)
    print("linear CE %.5f ref %.5f" % (l2.item(), r2.item()))
    ok = ok and abs(l2.item() - r2.item()) < 5e-2
    expect_cuda = sys.argv[2] == "yes"
    if not expect_cuda:
        print("UNEXPECTED: the CUDA call ran"); ok = False
except fusedce.BackendUnavailableError as e:
    print("BackendUnavailableError:", e)
    ok = sys.argv[2] == "no" and "libcublasLt.so." in str(e)
maps = sorted({l.split(None, 5)[5].strip() for l in open("/proc/self/maps")
               if len(l.split(None, 5)) == 6 and "libcublasLt" in l})
print("libcublasLt in /proc/self/maps:", maps or "none")
sys.exit(0 if ok else 1)
'

NUMPY_CALL='
import numpy as np, fusedce
z = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)
y = np.arange(64) % 1000
r = fusedce.forward(z, y, reduction="mean", return_grad=True)
m = z.max(1, keepdims=True); lse = (m[:, 0] + np.log(np.exp(z - m).sum(1)))
ref = (lse - z[np.arange(64), y]).mean()
print("CPU loss %.7f ref %.7f" % (float(r.loss), ref))
assert abs(float(r.loss) - ref) < 1e-5
'

MISSING_CALL='
import numpy as np, torch, fusedce, fusedce.torch
r = fusedce.forward(np.zeros((2, 3), np.float32), np.array([0, 2]), reduction="sum")
assert abs(float(r.loss) - 2 * np.log(3)) < 1e-6
print("CPU backend ok; cuda_available:", fusedce.cuda_available())
try:
    fusedce.torch.cross_entropy(torch.randn(8, 100, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda"))
    print("UNEXPECTED: the CUDA call ran"); raise SystemExit(1)
except fusedce.BackendUnavailableError as e:
    print("BackendUnavailableError:", e)
    assert "libcublasLt.so." in str(e) and "/nonexistent/libcublasLt" in str(e)
'

for whl in "$WHEEL_DIR"/fusedce_cu13-*.whl "$WHEEL_DIR"/fusedce_cu12-*.whl; do
  [ -e "$whl" ] || continue
  case $(basename "$whl") in fusedce_cu13-*) TAG=cu13 ;; *) TAG=cu12 ;; esac
  t0=$SECONDS
  TARGET=/tmp/fce-$TAG
  echo
  echo "=================== $(basename "$whl") ($(du -k "$whl" | cut -f1) KB) -> $TARGET"
  rm -rf "$TARGET"
  "$PYTHON" -m pip install -q --no-deps --no-compile --target "$TARGET" "$whl" || { failures+=("$TAG: install"); continue; }
  expect=yes
  if [ $TAG = cu12 ]; then
    if [ -n "${CUBLAS12_WHEEL:-}" ]; then
      "$PYTHON" -m pip install -q --no-deps --no-compile --target "$TARGET" "$CUBLAS12_WHEEL" || failures+=("cu12: cublas")
      echo "nvidia-cublas-cu12 installed beside it from $CUBLAS12_WHEEL"
    else
      expect=no
      echo "NOTE: no nvidia-cublas-cu12 on this machine (CUBLAS12_WHEEL unset): the cu12 wheel" \
           "cannot find cuBLASLt 12, so its CUDA backend must be off and say so"
    fi
  fi
  export PYTHONPATH="$TARGET"
  check "python -m fusedce" "$PYTHON" -m fusedce
  check "NumPy, CPU backend" "$PYTHON" -c "$NUMPY_CALL"
  check "torch CUDA call, fusedce imported before torch" "$PYTHON" -c "$TORCH_CALL" fusedce $expect
  check "torch CUDA call, fusedce imported after torch" "$PYTHON" -c "$TORCH_CALL" torch $expect
  check "FUSEDCE_CUBLASLT=/nonexistent/libcublasLt: CPU works, CUDA says what is missing" \
    env FUSEDCE_CUBLASLT=/nonexistent/libcublasLt.so "$PYTHON" -c "$MISSING_CALL"
  check "pytest: the package's tests against $TARGET" \
    "$PYTHON" -m pytest -q -p no:cacheprovider "$TESTS"/test_numpy*.py "$TESTS/test_loading.py" \
      "$TESTS"/test_torch*.py "$TESTS/test_transformers.py"
  echo "=================== $TAG: $(( SECONDS - t0 ))s"
done
unset PYTHONPATH
echo
if [ ${#failures[@]} -eq 0 ]; then echo "wheel_gpu_check: all passed"; else
  printf 'wheel_gpu_check: FAILED: %s\n' "${failures[@]}"; fi
[ ${#failures[@]} -eq 0 ]
