"""Run the tests from the source tree: the package is imported from bindings/python and, when
FUSEDCE_LIBRARY is not set, the library is looked for in the usual build folders."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(PKG_ROOT))
if PKG_ROOT not in sys.path:
    sys.path.insert(0, PKG_ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if not os.environ.get("FUSEDCE_LIBRARY"):
    for build in ("build", "build-py", "build-cpu", "build-cuda"):
        candidate = os.path.join(REPO, build, "libfusedce.so")
        if os.path.exists(candidate):
            os.environ["FUSEDCE_LIBRARY"] = candidate
            break
