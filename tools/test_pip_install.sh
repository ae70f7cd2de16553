#!/usr/bin/env bash
# A source install tested the way a user gets it: the sdist of the repository (`python -m build
# --sdist`: the C++/CUDA sources, CMake files and the package), then `pip install <sdist>` into a
# fresh virtual environment in a temporary folder (scikit-build-core runs CMake on the unpacked
# sources, as for `pip install .` or `pip install git+...`), then, with FUSEDCE_LIBRARY unset and
# the working directory outside the repository, `python -m fusedce` and the binding's tests (a
# copy of bindings/python/tests: run in place, their conftest.py would import the package from
# the source tree) against the installed package and the library inside it.
#
#   tools/test_pip_install.sh              # nvcc hidden (FCE_NVCC=<missing file>): the build
#                                          # must go CPU-only, warn, and record why (_build.py)
#   FCE_PIP_CUDA=OFF tools/test_pip_install.sh    # CPU-only, chosen (no warning)
#   FCE_PIP_CUDA=auto tools/test_pip_install.sh   # let CMake decide (CUDA when nvcc is found)
#   KEEP=1 tools/test_pip_install.sh       # keep the temporary folder (the venv) afterwards
#
# Needs: python3 with venv, CMake >= 3.24, a C++ compiler, OpenBLAS (`make setup` installs them)
# and PyPI (or a pip index/find-links set in pip's config) for build, scikit-build-core, numpy,
# pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
FCE_PIP_CUDA=${FCE_PIP_CUDA:-hidden}   # hidden, OFF, ON, or auto
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

phase "python -m build --sdist (the repository)"
"$VPY" -m pip install -q --progress-bar off build "scikit-build-core>=0.10"
"$VPY" -m build --sdist --no-isolation --outdir "$TMP/sdist" "$ROOT" >"$TMP/sdist.log" 2>&1 ||
  { cat "$TMP/sdist.log"; exit 1; }
SDIST=$(ls "$TMP"/sdist/fusedce-*.tar.gz)
tar -tzf "$SDIST" >"$TMP/sdist.files"
echo "$(basename "$SDIST"): $(du -k "$SDIST" | cut -f1) KB, $(wc -l <"$TMP/sdist.files") files"
for f in CMakeLists.txt include/fusedce.h lib/cuda/common/gemm.cu lib/cuda/common/cublaslt_loader.cpp \
         lib/cpu/ce.cpp bindings/python/fusedce/_lib.py cmake/_build.py.in; do
  grep -q "^fusedce-[0-9.]*/$f$" "$TMP/sdist.files" || { echo "sdist lacks $f" >&2; exit 1; }
done

phase "pip install <sdist> (FCE_WITH_CUDA: $FCE_PIP_CUDA) pytest"
cuda_define=()
case $FCE_PIP_CUDA in
  hidden) cuda_define=(--config-settings=cmake.define.FCE_NVCC=/nonexistent/bin/nvcc) ;;
  auto) ;;
  *) cuda_define=(--config-settings="cmake.define.FCE_WITH_CUDA=$FCE_PIP_CUDA") ;;
esac
# -v: pip shows the build's output (CMake's warning) only then; the log is checked below
"$VPY" -m pip install -v --progress-bar off "${cuda_define[@]}" "$SDIST" pytest >"$TMP/pip.log" 2>&1 ||
  { tail -80 "$TMP/pip.log"; exit 1; }
grep -E "^Successfully installed|Building wheel for fusedce" "$TMP/pip.log" || true
if [ "$FCE_PIP_CUDA" = hidden ]; then
  grep -A3 "CMake Warning" "$TMP/pip.log" | grep "nvcc not found" >/dev/null ||
    { echo "test_pip_install: no CMake warning about the missing nvcc in pip -v's output" >&2; exit 1; }
  "$VPY" -c 'from fusedce import _build; assert not _build.CUDA_BACKEND and "nvcc" in _build.CUDA_SKIPPED, vars(_build)'
  echo "the build warned that nvcc is missing, and fusedce/_build.py records it"
fi

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
