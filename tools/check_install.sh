#!/usr/bin/env bash
# Installs build dir $1 into a temporary prefix, then builds and runs a consumer through
# find_package(fusedce) and through pkg-config; and, when the build has libfusedce_nccl, its
# consumer through FusedCE::fusedce_nccl and pkg-config fusedce_nccl (no GPU needed).
set -euo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$BUILD" --prefix "$tmp/prefix" >/dev/null
cmake -S "$ROOT/tools/consumer" -B "$tmp/cm" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/cm" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/cm/consumer"
# libfusedce_nccl, when the build had it (FusedCE::fusedce_nccl, fusedce_nccl.pc)
if [ -x "$tmp/cm/consumer_nccl" ]; then LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/cm/consumer_nccl"; fi
libdir=$(ls -d "$tmp"/prefix/lib*/pkgconfig | head -1)
cc "$ROOT/tools/consumer/consumer.c" -o "$tmp/pc" $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs fusedce)
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/pc"
if PKG_CONFIG_PATH="$libdir" pkg-config --exists fusedce_nccl; then
  cc "$ROOT/tools/consumer/consumer_nccl.c" -o "$tmp/pc_nccl" \
    $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs fusedce_nccl)
  LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/pc_nccl"
fi
