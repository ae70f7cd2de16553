#!/usr/bin/env bash
# Builds the gradient-half measurement (dz_gemm.cu; dev/NOTES.md "∂Z made inside the ∂h GEMM") into
# build/cutlass_dz/: dz_gemm_mode{0,1,2}_ahead{1,2} (DZ_MODE: the RS GEMM alone, with the ∂Z
# transform, with the transform but no exponential; DZ_AHEAD: k-blocks transformed ahead). Headers: dev/cutlass_fetch.sh. Run on an sm_90 GPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
inc=$(bash "$root/dev/cutlass_fetch.sh")
out=$root/build/cutlass_dz
mkdir -p "$out"
flags=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I"$inc")
for ahead in ${DZ_AHEADS:-1 2}; do
  for mode in ${DZ_MODES:-0 1 2}; do
    nvcc "${flags[@]}" -DDZ_MODE=$mode -DDZ_AHEAD=$ahead -o "$out/dz_gemm_mode${mode}_ahead$ahead" \
      "$root/dev/cutlass_dz/dz_gemm.cu" &
  done
  wait
done
wait
ls -la "$out"
