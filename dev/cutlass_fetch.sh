#!/usr/bin/env bash
# Prints the folder holding CUTLASS's headers (cutlass/cutlass.h) for the bench prototypes
# (dev/cutlass_stats, dev/cutlass_dz): FCE_CUTLASS_DIR when set, else PyPI's nvidia-cutlass
# wheel unpacked once into third_party/ (ignored).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ver=4.2.0.0
inc=${FCE_CUTLASS_DIR:-$root/third_party/cutlass-$ver/include}
if [ ! -e "$inc/cutlass/cutlass.h" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --disable-pip-version-check "nvidia-cutlass==$ver" -d "$tmp" >&2
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
echo "$inc"
