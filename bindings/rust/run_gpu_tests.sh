#!/usr/bin/env bash
# The Rust binding's tests on a CUDA device that has no Rust toolchain: build and pack here, carry
# the packed directory, run it there.
#
#   bindings/rust/run_gpu_tests.sh pack OUTDIR|OUT.tgz [BUILD_DIR]   (here; needs cargo, no GPU)
#     Builds every test executable of both crates (`cargo test --no-run`, tests/cuda.rs included)
#     and the examples against BUILD_DIR/libfusedce.so (default: build/; a CUDA-enabled build),
#     --offline --locked, with cargo's output in BUILD_DIR/rust-target (as run_tests.sh), and
#     copies into OUTDIR (emptied first) what the device needs:
#       bin/<package>--<suite>    the test executables (debug info stripped): fusedce--cuda,
#                                 fusedce--cross_entropy, ..., fusedce--lib, fusedce-sys--link, ...
#       bin/example--<name>       the examples (cross_entropy; cuda_device on the GPU)
#       lib/libfusedce.so.0 (+ libfusedce.so)   the library, under its soname
#       lib/libcudart.so.13       the CUDA runtime tests/cuda.rs and the example dlopen (libfusedce
#                                 links its own copy statically and needs no libcudart)
#       lib/libopenblas.so.0, libgfortran.so.5, libquadmath.so.0   libfusedce's CPU BLAS and its
#                                 needs, as ldd resolves them here (FCE_PACK_BLAS=0: left out)
#       MANIFEST                  where it came from (git revision, library version, files)
#     Not packed: libcublasLt.so.13 (libfusedce needs it; 540 MB): the device's CUDA 13 toolkit
#     has it in /usr/local/cuda/lib64 (FCE_PACK_CUBLASLT=1 packs it anyway); glibc, libstdc++ and
#     libgcc_s are the system's. About 60 MB as a directory (openblas 36 MB of it), 24 MB as a
#     tarball: an OUT ending in .tgz or .tar.gz gets the same files as a gzipped tar instead.
#     To take it to a GPU machine along with a checkout, pack the tarball into an ignored path
#     of the repository root, e.g. `bindings/rust/run_gpu_tests.sh pack
#     build-rust-gpu/rust-gpu.tgz` (/build*/ is in .gitignore), copy build-rust-gpu along, and
#     run `bindings/rust/run_gpu_tests.sh run build-rust-gpu/rust-gpu.tgz` there.
#
#   bindings/rust/run_gpu_tests.sh run OUTDIR|OUT.tgz [TEST ARGS...]   (there; no cargo needed)
#     (a tarball is unpacked into a temporary directory first; the packed directory also holds
#     a copy of this script, so neither needs the source tree)
#     Runs every packed test executable, tests/cuda.rs's and cuda_linear.rs's first
#     (--show-output: they print the runtime opened and the device count), then the examples, with
#       LD_LIBRARY_PATH=OUTDIR/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
#       FUSEDCE_CUDART_DIR=OUTDIR/lib   FUSEDCE_REQUIRE_CUDA=1 (a CUDA test that would skip fails)
#     (and, if libcublasLt.so.13 is not found that way, the first one under /usr/local, /opt or
#     /usr/lib, e.g. pip's nvidia-cublas, appended to LD_LIBRARY_PATH)
#     TEST ARGS go to every test executable (libtest's: a name filter, --test-threads=1, ...).
#     First `ldd` of each executable: a library not found is reported (and fails the run).
#     Prints one line per suite and a summary; exit status 0 only when all passed.
#     FUSEDCE_REQUIRE_CUDA=0 lets the CUDA tests skip (a machine without a GPU).
#
# Here, without a GPU, `run` on the packed directory with FUSEDCE_REQUIRE_CUDA=0 checks the
# packing: every suite passes, the CUDA tests print "skipped: no CUDA device".
set -uo pipefail

usage() {
  echo "usage: $0 pack OUTDIR [BUILD_DIR]   |   $0 run OUTDIR [TEST ARGS...]" >&2
  exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
out=$2
shift 2
tarball=""
case "$out" in *.tgz | *.tar.gz) tarball="$out" ;; esac

pack() {
  set -e
  local here root build
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  root="$(cd "$here/../.." && pwd)"
  build="$(cd "${1:-$root/build}" && pwd)"
  [ -e "$build/libfusedce.so" ] || { echo "$0: no libfusedce.so in $build (run make first)" >&2; exit 1; }
  local CARGO="${CARGO:-$(command -v cargo || echo "$HOME/.cargo/bin/cargo")}"
  [ -x "$CARGO" ] || { echo "$0: cargo not found (install rustup, or set CARGO)" >&2; exit 1; }
  command -v python3 >/dev/null || { echo "$0: python3 is needed to read cargo's JSON" >&2; exit 1; }

  export FUSEDCE_LIB_DIR="$build"
  export FUSEDCE_INCLUDE_DIR="$root/include"
  export CARGO_TARGET_DIR="$build/rust-target"
  local flags=(--offline --locked --manifest-path "$here/Cargo.toml")

  echo "--- rust-gpu: cargo test --no-run (both crates, examples) against $build"
  local json
  json="$(mktemp)"
  "$CARGO" test "${flags[@]}" --workspace --no-run --message-format=json-render-diagnostics >"$json"

  local stage=""
  if [ -n "$tarball" ]; then
    stage="$(mktemp -d)"
    out="$stage/rust-gpu"
  fi
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/lib"
  out="$(cd "$out" && pwd)"
  # "package--suite" and "example--name" for every test / example executable cargo reported.
  python3 - "$json" "$out/bin" <<'PY'
import json, os, shutil, subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
seen = {}
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    t = m["target"]
    pkg = os.path.basename(os.path.dirname(m["manifest_path"]))  # fusedce, fusedce-sys
    kinds = t["kind"]
    if "example" in kinds:
        name = "example--" + t["name"]
    elif m["profile"].get("test"):
        suite = "lib" if ("lib" in kinds or "rlib" in kinds) else t["name"]
        name = pkg + "--" + suite
    else:
        continue
    seen[name] = exe
for name, exe in sorted(seen.items()):
    shutil.copy2(exe, os.path.join(dst, name))
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-debug", os.path.join(dst, name)], check=True)
    print("    bin/" + name)
PY
  rm -f "$json"

  # The library under its soname (what the executables' NEEDED names), and the usual link.
  local real soname
  real="$(readlink -f "$build/libfusedce.so")"
  soname="$(readelf -d "$real" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
  cp "$real" "$out/lib/${soname:-libfusedce.so.0}"
  ln -sf "${soname:-libfusedce.so.0}" "$out/lib/libfusedce.so"

  # The CUDA runtime for dlopen, then what ldd resolves for libfusedce (BLAS, cuBLASLt).
  local cudart=""
  for d in "${FUSEDCE_CUDART_DIR:-}" /usr/local/cuda/lib64 /usr/local/cuda/lib; do
    [ -n "$d" ] && [ -e "$d/libcudart.so.13" ] && { cudart="$d/libcudart.so.13"; break; }
  done
  if [ -n "$cudart" ]; then
    cp -L "$cudart" "$out/lib/"
  else
    echo "    (no libcudart.so.13 found here: the device's /usr/local/cuda/lib64 one will be used)"
  fi
  local name path
  while read -r name path; do
    case "$name" in
      libopenblas*|libgfortran*|libquadmath*) [ "${FCE_PACK_BLAS:-1}" = 0 ] && continue ;;
      libcublasLt*|libcublas.*) [ "${FCE_PACK_CUBLASLT:-0}" = 1 ] || continue ;;
      *) continue ;;
    esac
    [ -f "$path" ] && cp -L "$path" "$out/lib/$name"
  done < <(ldd "$real" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')

  {
    echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
    echo "git $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "library $real"
    (cd "$out" && find bin lib -maxdepth 1 \( -type f -o -type l \) -printf '%p %s\n' | sort)
  } >"$out/MANIFEST"
  (cd "$out/lib" && ls -1) | sed 's/^/    lib\//'
  cp "$here/run_gpu_tests.sh" "$out/run_gpu_tests.sh"
  if [ -n "$tarball" ]; then
    mkdir -p "$(dirname "$tarball")"
    tar -C "$out" -czf "$tarball" .
    rm -rf "$stage"
    out="$tarball"
  fi
  echo "--- rust-gpu: packed $(du -sh "$out" | cut -f1) into $out"
  echo "    on the device: bindings/rust/run_gpu_tests.sh run $out"
}

run() {
  if [ -n "$tarball" ]; then
    [ -f "$tarball" ] || { echo "$0: no $tarball" >&2; exit 1; }
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
    tar -C "$out" -xzf "$tarball"
    echo "unpacked $tarball into $out"
  fi
  [ -d "$out/bin" ] || { echo "$0: $out/bin does not exist (run '$0 pack $out' first)" >&2; exit 1; }
  out="$(cd "$out" && pwd)"
  export LD_LIBRARY_PATH="$out/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FUSEDCE_CUDART_DIR="$out/lib"
  # cuBLASLt from elsewhere when /usr/local/cuda/lib64 lacks it (e.g. pip's nvidia-cublas).
  if ldd "$out/lib/libfusedce.so" 2>/dev/null | grep -q 'libcublasLt.so.13 => not found'; then
    local lt
    lt="$(find /usr/local /opt /usr/lib -name libcublasLt.so.13 2>/dev/null | head -n 1)"
    if [ -n "$lt" ]; then
      echo "libcublasLt.so.13 from $(dirname "$lt")"
      LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$lt")"
    fi
  fi
  export FUSEDCE_REQUIRE_CUDA="${FUSEDCE_REQUIRE_CUDA:-1}"
  [ -f "$out/MANIFEST" ] && sed -n '1,3p' "$out/MANIFEST"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

  local passed=0 failed=0 failed_names=() missing
  for exe in "$out"/bin/*; do
    missing="$(ldd "$exe" 2>&1 | grep 'not found' || true)"
    if [ -n "$missing" ]; then
      echo "--- $(basename "$exe"): libraries not found:"
      echo "$missing"
      failed=$((failed + 1))
      failed_names+=("$(basename "$exe") (ldd)")
    fi
  done
  suite() {
    local name=$1
    shift
    echo "=== $name"
    if "$@"; then
      passed=$((passed + 1))
      echo "--- $name: ok"
    else
      failed=$((failed + 1))
      failed_names+=("$name")
      echo "--- $name: FAILED"
    fi
  }
  local crate
  for crate in fusedce--cuda fusedce--cuda_linear; do
    if [ -x "$out/bin/$crate" ]; then
      suite "$crate" "$out/bin/$crate" --show-output "$@"
    else
      failed=$((failed + 1))
      failed_names+=("$crate (not packed)")
    fi
  done
  local exe name
  for exe in "$out"/bin/*--*; do
    name="$(basename "$exe")"
    case "$name" in
      fusedce--cuda | fusedce--cuda_linear | example--*) ;;
      *) suite "$name" "$exe" "$@" ;;
    esac
  done
  for exe in "$out"/bin/example--*; do
    [ -x "$exe" ] && suite "$(basename "$exe")" "$exe"
  done
  echo
  [ $failed -gt 0 ] && echo "failed: ${failed_names[*]}"
  echo "rust gpu suites: $passed passed, $failed failed"
  [ $failed -eq 0 ]
}

case "$cmd" in
  pack) pack "$@" ;;
  run) run "$@" ;;
  *) usage ;;
esac
