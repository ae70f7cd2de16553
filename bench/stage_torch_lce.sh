#!/usr/bin/env bash
# Stages torch 2.15's chunked F.linear_cross_entropy as the package torch_lce in .peers/torch_lce/
# (ignored, never committed), so that bench_torch.py can time it ("torch-lce") on an older torch
# (the GPU machine's 2.11): its two modules, torch/nn/modules/linear_cross_entropy.py and
# linear_cross_entropy_options.py, and the two functions of torch/nn/functional.py that route a
# call to them (linear_cross_entropy, _linear_cross_entropy_chunked_applies), taken unchanged from
# the wheel but for the one import that names the module's place inside torch.
# The Python files are the same in every platform's wheel: the macOS arm64 one (~140 MB) is
# downloaded rather than the Linux x86_64 one (~900 MB). Needs pip's access to PyPI.
#   bash bench/stage_torch_lce.sh [VERSION]        (default 2.15.0)
set -euo pipefail
ver=${1:-2.15.0}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/.peers/torch_lce
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform macosx_14_0_arm64 --platform macosx_11_0_arm64 -d "$tmp" "torch==$ver"
python3 - "$tmp" "$dest" "$ver" <<'PYEOF'
import ast, glob, os, shutil, sys, zipfile
tmp, dest, ver = sys.argv[1:]
wheel = glob.glob(os.path.join(tmp, "torch-*.whl"))[0]
pkg = os.path.join(dest, "torch_lce")
shutil.rmtree(pkg, ignore_errors=True)
os.makedirs(pkg)
with zipfile.ZipFile(wheel) as z:
    read = lambda name: z.read(name).decode()
    for mod in ("linear_cross_entropy", "linear_cross_entropy_options"):
        with open(os.path.join(pkg, mod + ".py"), "w") as f:
            f.write(read(f"torch/nn/modules/{mod}.py"))
    functional = read("torch/nn/functional.py")
    version = read("torch/version.py")
if f"__version__ = '{ver}'" not in version and f'__version__ = "{ver}"' not in version:
    sys.exit(f"stage_torch_lce: the wheel's torch/version.py does not say {ver}")
lines = functional.splitlines(keepends=True)
parts = []
for node in ast.parse(functional).body:
    if isinstance(node, ast.FunctionDef) and node.name in ("_linear_cross_entropy_chunked_applies",
                                                          "linear_cross_entropy"):
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        parts.append("".join(lines[start:node.end_lineno]))
if len(parts) != 2:
    sys.exit("stage_torch_lce: functional.py has no linear_cross_entropy / "
             "_linear_cross_entropy_chunked_applies")
old = "from torch.nn.modules.linear_cross_entropy import"
body = "\n\n".join(parts)
if old not in body:
    sys.exit(f"stage_torch_lce: linear_cross_entropy no longer says {old!r}")
body = body.replace(old, "from torch_lce.linear_cross_entropy import")
header = (
    f'"""F.linear_cross_entropy of torch {ver} (torch/nn/functional.py), staged by '
    'bench/stage_torch_lce.sh."""\n'
    "import dataclasses\nimport math\nimport warnings\n\nimport torch\n"
    "from torch import Tensor\n"
    "from torch.nn.functional import cross_entropy, linear\n"
    "from torch.overrides import handle_torch_function, has_torch_function_variadic\n\n"
    "from torch_lce.linear_cross_entropy_options import LinearCrossEntropyOptions\n\n\n")
with open(os.path.join(pkg, "functional.py"), "w") as f:
    f.write(header + body + "\n")
with open(os.path.join(pkg, "__init__.py"), "w") as f:
    f.write(f'"""torch {ver}\'s chunked linear cross-entropy, staged by bench/stage_torch_lce.sh."""\n'
            f'SOURCE_VERSION = "{ver}"\n'
            "from torch_lce.functional import linear_cross_entropy  # noqa: E402,F401\n"
            "from torch_lce.linear_cross_entropy_options import LinearCrossEntropyOptions  # noqa: E402,F401\n")
print(f"staged torch {ver}'s linear_cross_entropy in {pkg}")
PYEOF
du -sh "$dest"
