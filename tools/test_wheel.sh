#!/usr/bin/env bash
# The CUDA 13 wheel as a user gets it, tested without a GPU (a make test suite): build it
# (tools/build_wheels.sh: manylinux, cudart static, cuBLASLt loaded at run time, OpenBLAS from
# scipy-openblas32 bundled), check it with `auditwheel show` (a manylinux tag; nothing of a CUDA
# toolkit, no system OpenBLAS, no cuBLAS among libfusedce's NEEDED), install it into a fresh
# virtual environment with numpy and pytest only (--no-deps: the ~0.4 GB nvidia-cublas wheel is
# for GPU machines; the library must load without it), then, outside the repository and with
# FUSEDCE_LIBRARY unset, `python -m fusedce` and a copy of the binding's tests against it.
#
#   tools/test_wheel.sh                      # builds it into WHEELHOUSE (.wheelhouse), where
#                                            # it stays for tools/wheel_gpu_check.sh
#   FCE_WHEEL=path/to/fusedce_cu13-*.whl tools/test_wheel.sh   # test a wheel already built
#   CUDA_ARCHS=90-real tools/test_wheel.sh   # a faster build (the wheel's default: all four;
#                                            # with FCE_WHEEL: the architectures it was built for)
#   KEEP=1 tools/test_wheel.sh               # keep the temporary folder
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
start=$SECONDS
phase_start=$SECONDS
phase() {
  echo "--- $(( SECONDS - phase_start ))s"
  phase_start=$SECONDS
  echo "=== test_wheel: $1"
}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/fusedce-wheel.XXXXXX")
cleanup() { if [ -n "${KEEP:-}" ]; then echo "test_wheel: kept $TMP"; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
unset FUSEDCE_LIBRARY PYTHONPATH FUSEDCE_CUBLASLT
export PIP_DISABLE_PIP_VERSION_CHECK=1

whl=${FCE_WHEEL:-}
if [ -z "$whl" ]; then
  house=${WHEELHOUSE:-$ROOT/.wheelhouse}
  phase "tools/build_wheels.sh (fusedce-cu13) into $house"
  WHEELS=cu13 bash "$ROOT/tools/build_wheels.sh" "$house"
  whl=$(ls "$house"/fusedce_cu13-*.whl)
fi
whl=$(cd "$(dirname "$whl")" && pwd)/$(basename "$whl")

phase "auditwheel show $(basename "$whl")"
"$PYTHON" -m venv "$TMP/tools"
"$TMP/tools/bin/python" -m pip install -q --progress-bar off auditwheel
show=$("$TMP/tools/bin/auditwheel" show "$whl")
echo "$show"
case $(basename "$whl") in
  *-manylinux_2_[0-9]*_x86_64.whl) ;;
  *) echo "test_wheel: $(basename "$whl") has no manylinux x86_64 tag" >&2; exit 1 ;;
esac
tr -s '\n ' '  ' <<<"$show" | grep 'is consistent with the following platform tag: "manylinux_' >/dev/null ||
  { echo "test_wheel: auditwheel does not find the wheel consistent with a manylinux tag" >&2; exit 1; }
if echo "$show" | grep -E "libcublas|libcudart\.so|libopenblas\.so|/usr/local/cuda"; then
  echo "test_wheel: the wheel depends on the line(s) above" >&2
  exit 1
fi

cd "$TMP"   # outside the repository from here on
phase "fresh venv: numpy, pytest, ml_dtypes and the wheel (--no-deps)"
"$PYTHON" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
"$VPY" -m pip install -q --progress-bar off numpy pytest ml_dtypes
"$VPY" -m pip install --no-deps --progress-bar off "$whl"

phase "python -m fusedce"
"$VPY" -m fusedce

phase "the installed package: its library, its metadata, a NumPy call"
"$VPY" - "$TMP/venv" "$ROOT/include/fusedce.h" <<'EOF'
import os, re, subprocess, sys
from importlib.metadata import metadata, version
import numpy as np
import fusedce
from fusedce import _build, _lib
venv, header = sys.argv[1], sys.argv[2]
real = os.path.realpath
pkg = os.path.dirname(real(fusedce.__file__))
assert pkg.startswith(real(venv) + os.sep), "fusedce imported from %s, not the venv" % pkg
so = os.path.join(pkg, "lib", "libfusedce.so.%d" % fusedce.HEADER_VERSION_MAJOR)
assert _lib.library_origin() == "packaged" and real(fusedce.library_path()) == so
hv = ".".join(re.search(r"#define FCE_VERSION_%s (\d+)" % k, open(header).read()).group(1)
              for k in ("MAJOR", "MINOR", "PATCH"))
got = (version("fusedce-cu13"), fusedce.__version__, "%d.%d.%d" % fusedce.library_version())
assert got == (hv, hv, hv), "versions (distribution, package, library) %s != header %s" % (got, hv)
requires = metadata("fusedce-cu13").get_all("Requires-Dist")
assert any(r.startswith("nvidia-cublas") for r in requires), requires
assert _build.CUDA_BACKEND and _build.CUBLASLT_SONAME == "libcublasLt.so.13", vars(_build)
info = fusedce.build_info()
archs = os.environ.get("CUDA_ARCHS", "80-real;90-real;100-real;120").replace(";", " ")
assert "backends: cpu, cuda (sm %s, CUDA 13." % archs in info, (archs, info)
assert "BLAS: OpenBLAS" in info, info
needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
print("\n".join(ln for ln in needed.splitlines() if "NEEDED" in ln or "PATH" in ln))
assert "cublas" not in needed and "libopenblas.so" not in needed, needed
r = fusedce.forward(np.array([[0.0, 1.0, 2.0]], np.float32), np.array([2]), reduction="sum")
ref = np.log(np.exp([0.0, 1.0, 2.0]).sum()) - 2.0
assert abs(float(r.loss) - ref) < 1e-6, (float(r.loss), ref)
print("ok: %s (%s); %s" % (so, info, _lib.cublaslt_preload()))
EOF

phase "pytest (a copy of bindings/python/tests, against the installed wheel)"
cp -r "$ROOT/bindings/python/tests" "$TMP/tests"
rm -rf "$TMP/tests/__pycache__"
"$VPY" -m pytest -q -p no:cacheprovider "$TMP/tests"

phase "done"
echo "test_wheel: ok in $(( SECONDS - start ))s ($(basename "$whl"), $(du -k "$whl" | cut -f1) KB)"
