#!/usr/bin/env bash
# Installs build dir $1 into a temporary prefix, then builds and runs a consumer through
# find_package(fusedce) and through pkg-config.
set -euo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$BUILD" --prefix "$tmp/prefix" >/dev/null
cmake -S "$ROOT/tools/consumer" -B "$tmp/cm" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/cm" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/cm/consumer"
libdir=$(ls -d "$tmp"/prefix/lib*/pkgconfig | head -1)
cc "$ROOT/tools/consumer/consumer.c" -o "$tmp/pc" $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs fusedce)
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/pc"
