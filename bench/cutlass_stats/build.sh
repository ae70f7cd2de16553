#!/usr/bin/env bash
# Builds the CUTLASS statistics-epilogue prototype (a measurement, not part of the library;
# bench/NOTES.md "Issue 8, session 5") into build/cutlass_stats/: stats_test (the default
# configuration) and its variants stats_test_{pingpong,noexp,nooob,epi64,branchfree,lean,node,frag}, and base_gemm. The CUTLASS
# headers come from PyPI's nvidia-cutlass wheel into third_party/ (ignored), or from
# FCE_CUTLASS_DIR (a folder holding cutlass/cutlass.h). Run the binaries on an sm_90 GPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
ver=4.2.0.0
inc=${FCE_CUTLASS_DIR:-$root/third_party/cutlass-$ver/include}
if [ ! -e "$inc/cutlass/cutlass.h" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --disable-pip-version-check "nvidia-cutlass==$ver" -d "$tmp"
  python3 - "$tmp" "$root/third_party/cutlass-$ver" <<'PYEOF'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            out = os.path.join(dest, "include", n[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(n) as src, open(out, "wb") as f:
                f.write(src.read())
PYEOF
  rm -rf "$tmp"
fi
out=$root/build/cutlass_stats
mkdir -p "$out"
here=$root/bench/cutlass_stats
flags=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I"$inc" -I"$here")
variant() {  # variant NAME [defines...]
  local name=$1; shift
  nvcc "${flags[@]}" "$@" -c "$here/stats_gemm.cu" -o "$out/$name.o"
  nvcc "${flags[@]}" "$@" -o "$out/$name" "$here/stats_test.cu" "$out/$name.o"
  echo "built $out/$name"
}
variant stats_test
variant stats_test_pingpong -DFCE_STATS_PINGPONG
variant stats_test_noexp -DFCE_STATS_NOEXP
variant stats_test_nooob -DFCE_STATS_OOB=false
variant stats_test_epi64 -DFCE_STATS_EPI=64
variant stats_test_branchfree -DFCE_STATS_BRANCHFREE
variant stats_test_lean -DFCE_STATS_LEAN
variant stats_test_node -DFCE_STATS_NODE -DFCE_STATS_LEAN
variant stats_test_frag -DFCE_STATS_NODE -DFCE_STATS_LEAN -DFCE_STATS_FRAG
nvcc "${flags[@]}" -o "$out/base_gemm" "$here/base_gemm.cu"
echo "built $out/base_gemm"
