#!/usr/bin/env bash
# Builds the CUTLASS statistics-epilogue prototype (a measurement, not part of the library;
# dev/NOTES.md "What bounds the remaining cells, and linear CE measured in turns") into build/cutlass_stats/: stats_test (the default
# configuration) and its variants stats_test_{pingpong,noexp,nooob,epi64,branchfree,lean,node,frag}, and base_gemm. The CUTLASS
# headers: dev/cutlass_fetch.sh (FCE_CUTLASS_DIR, else PyPI's nvidia-cutlass into third_party/).
# Run the binaries on an sm_90 GPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
inc=$(bash "$root/dev/cutlass_fetch.sh")
out=$root/build/cutlass_stats
mkdir -p "$out"
here=$root/dev/cutlass_stats
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
