#!/usr/bin/env bash
# Installs what the build and the tests need, once: Debian packages (a C++ toolchain, CMake,
# a BLAS for the CPU backend, GoogleTest, bindgen + libclang for the Rust bindings check,
# clang-format for the format check) and Python packages (NumPy, pytest, ruff). It looks for each thing itself (a command, a header), so
# a machine that already has them, however installed, is left alone; it is quiet then.
set -euo pipefail
MODE=${1:-test}  # demo: what building and running the demo needs; test: everything make test needs
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

have_header() {  # have_header NAME: found in the usual include folders
  local h
  for h in /usr/include/"$1" /usr/include/*/"$1" /usr/local/include/"$1" /usr/include/*/*/"$1"; do
    [ -e "$h" ] && return 0
  done
  return 1
}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
# OpenBLAS itself (its openblas_config.h), not just any cblas.h: Debian's reference BLAS
# (libblas-dev) also has one, and the CPU backend would then run ~35x slower
have_header openblas_config.h || missing+=(libopenblas-dev)
have_header gtest/gtest.h || missing+=(libgtest-dev)
if [ "$MODE" = test ]; then
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  command -v bindgen >/dev/null || missing+=(bindgen)
  command -v "${CLANG_FORMAT:-clang-format}" >/dev/null || missing+=(clang-format)
  ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/*/libclang*.so* >/dev/null 2>&1 \
    || missing+=(libclang-dev)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: missing ${missing[*]} and no apt-get to install them" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ "$MODE" = test ] || exit 0
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import numpy, pytest" >/dev/null 2>&1; then
  echo "setup: installing Python packages: numpy pytest"
  "$PYTHON" -m pip install -q --disable-pip-version-check numpy pytest
fi
if ! "$PYTHON" -m ruff --version >/dev/null 2>&1; then  # the Python lint of make test
  echo "setup: installing Python packages: ruff"
  "$PYTHON" -m pip install -q --disable-pip-version-check ruff
fi

# ---- tests/fuzz (make fuzz, run by make test): clang++ able to link a libFuzzer target with
# AddressSanitizer + UndefinedBehaviorSanitizer. Debian 12 keeps the compiler-rt runtimes in
# libclang-rt-<N>-dev (libclang-rt-dev: the default N's); older releases in
# libclang-common-<N>-dev, which clang itself pulls in. (make test-asan needs nothing more:
# g++'s libasan and libubsan come with it.)
fuzz_runtime() {
  command -v clang++ >/dev/null || return 1
  local dir
  dir=$(clang++ -print-resource-dir 2>/dev/null) || return 1
  find "$dir" -name 'libclang_rt.fuzzer*.a' 2>/dev/null | grep -q . \
    && find "$dir" -name 'libclang_rt.asan*.a' 2>/dev/null | grep -q .
}
if ! fuzz_runtime; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: make fuzz needs clang with libFuzzer (compiler-rt) and no apt-get to install it" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  fz=(clang)
  $SUDO apt-get update -qq
  apt-cache show libclang-rt-dev >/dev/null 2>&1 && fz+=(libclang-rt-dev)
  echo "setup: installing Debian packages for the fuzz target: ${fz[*]}"
  $SUDO apt-get install -y -qq "${fz[@]}" >/dev/null
  fuzz_runtime || { echo "setup: clang++ still cannot find libFuzzer (libclang_rt.fuzzer)" >&2; exit 1; }
fi
