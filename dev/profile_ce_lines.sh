#!/usr/bin/env bash
# Executed instructions per SASS line of the CE row kernel (ncu's source page), one call per
# shape, into one tarball: where the ~11 per-thread instructions per logit beyond the loops go
# (docs/performance.md, "Where the instructions go on the H200").
#   FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python:bench \
#     bash dev/profile_ce_lines.sh OUTDIR [N V dtype]...
set -euo pipefail
out=${1:?usage: profile_ce_lines.sh OUTDIR [N V dtype]...}
shift
mkdir -p "$out/lines"
[ $# -eq 0 ] && set -- 16384 128256 bf16
while [ $# -ge 3 ]; do
  tag="$1x$2-$3"
  ncu --clock-control none -k regex:ce_rows --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section InstructionStats --import-source no \
    -o "$out/lines/$tag" python3 dev/profile_ce.py "$1" "$2" "$3" > "$out/lines/$tag.log" 2>&1
  ncu --import "$out/lines/$tag.ncu-rep" --page source --csv --print-source sass \
    > "$out/lines/$tag-sass.csv" 2>&1 || true
  ncu --import "$out/lines/$tag.ncu-rep" --page details --print-details all \
    --print-metric-instances values > "$out/lines/$tag-details.txt" 2>&1 || true
  rm -f "$out/lines/$tag.ncu-rep"
  shift 3
done
tar -C "$out" -cJf "$out/ce-lines.tar.xz" lines && rm -rf "$out/lines"
