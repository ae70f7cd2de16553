#!/usr/bin/env bash
# Installs what the build and the tests need, once: Debian packages (a BLAS for the CPU
# backend, bindgen + libclang for the Rust bindings check) and Python packages (NumPy, pytest).
# Idempotent and quiet when everything is already there.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

apt_pkgs=(cmake g++ pkg-config libopenblas-dev bindgen libclang-dev libgtest-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import numpy, pytest" >/dev/null 2>&1; then
  echo "setup: installing Python packages: numpy pytest"
  "$PYTHON" -m pip install -q --disable-pip-version-check numpy pytest
fi
