#!/usr/bin/env bash
# `pip install ./bindings/python` with nothing else set, tested the way a user gets it: a fresh
# virtual environment in a temporary folder, the package built there by pip (scikit-build-core
# runs CMake on the repository; CPU-only here to keep CI time down), then, with FUSEDCE_LIBRARY
# unset and the working directory outside the repository, `python -m fusedce` and the binding's
# tests (a copy of bindings/python/tests: run in place, their conftest.py would import the
# package from the source tree) against the installed package and the library inside it.
#
#   tools/test_pip_install.sh              # CPU-only build (FCE_WITH_CUDA=OFF)
#   FCE_PIP_CUDA=auto tools/test_pip_install.sh   # let CMake decide (CUDA when nvcc is found)
#   KEEP=1 tools/test_pip_install.sh       # keep the temporary folder (the venv) afterwards
#
# Needs: python3 with venv, CMake >= 3.24, a C++ compiler, OpenBLAS (`make setup` installs them)
# and PyPI (or a pip index/find-links set in pip's config) for scikit-build-core, numpy, pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
FCE_PIP_CUDA=${FCE_PIP_CUDA:-OFF}   # OFF, ON, or auto
start=$SECONDS
phase_start=$SECONDS
phase() {  # phase NAME: print the time the previous phase took, announce the next
  echo "--- $(( SECONDS - phase_start ))s"
  phase_start=$SECONDS
  echo "=== test_pip_install: $1"
}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/fusedce-pip.XXXXXX")
cleanup() {
  if [ -n "${KEEP:-}" ]; then echo "test_pip_install: kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
unset FUSEDCE_LIBRARY PYTHONPATH
export PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}
cd "$TMP"   # outside the repository from here on

echo "=== test_pip_install: virtual environment in $TMP/venv ($("$PYTHON" --version 2>&1))"
if ! "$PYTHON" -m venv "$TMP/venv"; then
  echo "test_pip_install: '$PYTHON -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
  exit 1
fi
VPY="$TMP/venv/bin/python"

phase "pip install ./bindings/python (FCE_WITH_CUDA=$FCE_PIP_CUDA) pytest"
cuda_define=()
[ "$FCE_PIP_CUDA" = auto ] || cuda_define=(--config-settings="cmake.define.FCE_WITH_CUDA=$FCE_PIP_CUDA")
"$VPY" -m pip install --progress-bar off "${cuda_define[@]}" "$ROOT/bindings/python" pytest

phase "python -m fusedce"
"$VPY" -m fusedce

phase "the installed package: its library, its version"
"$VPY" - "$TMP/venv" "$ROOT/include/fusedce.h" <<'EOF'
import os, re, sys
from importlib.metadata import version
import fusedce
from fusedce import _lib
venv, header = sys.argv[1], sys.argv[2]
real = lambda p: os.path.realpath(p)
pkg = os.path.dirname(real(fusedce.__file__))
assert pkg.startswith(real(venv) + os.sep), "fusedce imported from %s, not the venv" % pkg
lib = fusedce.library_path()
assert _lib.library_origin() == "packaged", (_lib.library_origin(), lib)
assert real(lib) == os.path.join(pkg, "lib", "libfusedce.so.%d" % fusedce.HEADER_VERSION_MAJOR), lib
h = open(header).read()
hv = ".".join(re.search(r"#define FCE_VERSION_%s (\d+)" % k, h).group(1)
              for k in ("MAJOR", "MINOR", "PATCH"))
got = (version("fusedce"), fusedce.__version__, "%d.%d.%d" % fusedce.library_version())
assert got == (hv, hv, hv), "versions (distribution, package, library) %s != header %s" % (got, hv)
info = _lib.build_info()
print("library %s, version %s, cuda_available %s" % (lib, hv, fusedce.cuda_available()))
print("build info:", info)
EOF

phase "pytest (a copy of bindings/python/tests, against the installed package)"
cp -r "$ROOT/bindings/python/tests" "$TMP/tests"
rm -rf "$TMP/tests/__pycache__"
"$VPY" -m pytest -q -p no:cacheprovider "$TMP/tests"

phase "done"
echo "test_pip_install: ok in $(( SECONDS - start ))s"
