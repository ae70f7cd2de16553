"""Building and finding libfusedce_jax.so, the XLA FFI shim of :mod:`fusedce.jax`.

The shim (``fusedce_jax.cc`` and ``fusedce_jax_distill.cc`` beside this file, with
``fusedce_jax_common.h``, compiled into one library) is C++ compiled against the XLA FFI
headers of the jaxlib that will run it (``jax.ffi.include_dir()``, shipped in the jaxlib wheel) and
``fusedce.h``; it needs neither the CUDA toolkit nor libfusedce at build time (it binds to the
library the Python binding loaded, at run time, with dlopen). Importing this module imports
nothing but the standard library; :func:`build` imports jax for the headers.

Where the shim comes from, in this order (:func:`library_path`):

1. ``FUSEDCE_JAX_LIBRARY``: the path of a prebuilt ``libfusedce_jax.so`` (e.g. built with
   ``python -m fusedce.jax build --output DIR`` on a machine with a compiler, for one without):
   an explicit choice, never rebuilt;
2. the cache: ``$FUSEDCE_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/fusedce/jax``, else
   ``~/.cache/fusedce/jax``, one folder per build key (a hash of the shim's source, fusedce.h,
   the XLA FFI headers, the compiler and its flags), so a new jaxlib or a changed source gets a
   new build and concurrent processes never see a half-written file;
3. otherwise it is built there, on first use (a few seconds): the compiler is ``$CXX``, else
   ``c++``, ``g++`` or ``clang++`` on the PATH.

``fusedce.h`` is looked for in ``$FUSEDCE_INCLUDE_DIR``, then ``fusedce/include`` inside the
package, then the ``include`` folder of the source checkout the package lives in.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fusedce_jax.cc")
# every source of the one library: the cross-entropy handlers and the distillation handlers
SOURCES = (SOURCE, os.path.join(HERE, "fusedce_jax_distill.cc"))
HEADERS = (os.path.join(HERE, "fusedce_jax_common.h"),)  # included by both sources
LIBRARY_NAME = "libfusedce_jax.so"
SHIM_ABI = 6  # FCE_JAX_ABI in fusedce_jax.cc: the handlers' argument / attribute layout

_PKG = os.path.dirname(HERE)                                   # .../fusedce
_REPO_INCLUDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_PKG))),
                             "include")                        # <checkout>/include


class ShimBuildError(RuntimeError):
    """libfusedce_jax.so could not be found or built (the message says what is missing)."""


def fusedce_include_dir() -> str:
    """The folder holding fusedce.h."""
    candidates = []
    env = os.environ.get("FUSEDCE_INCLUDE_DIR")
    if env:
        candidates.append(env)
    candidates += [os.path.join(_PKG, "include"), _REPO_INCLUDE]
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "fusedce.h")):
            return folder
    raise ShimBuildError(
        "fusedce.h not found (looked in: %s); set FUSEDCE_INCLUDE_DIR to the folder holding "
        "include/fusedce.h of the fusedce sources" % ", ".join(candidates))


def xla_include_dir() -> str:
    """The XLA FFI headers: $FUSEDCE_JAX_XLA_INCLUDE, else jax.ffi.include_dir()."""
    env = os.environ.get("FUSEDCE_JAX_XLA_INCLUDE")
    if env:
        folder = env
    else:
        try:
            import jax.ffi
        except ImportError as e:  # pragma: no cover - needs a jax without jax.ffi
            raise ShimBuildError("building the fusedce JAX shim needs jax >= 0.4.35 "
                                 "(jax.ffi.include_dir): %s" % e) from None
        folder = jax.ffi.include_dir()
    if not os.path.isfile(os.path.join(folder, "xla", "ffi", "api", "ffi.h")):
        raise ShimBuildError("xla/ffi/api/ffi.h not found under %s" % folder)
    return folder


def compiler() -> str:
    """The C++ compiler: $CXX, else c++, g++ or clang++ from the PATH."""
    env = os.environ.get("CXX")
    if env:
        return env
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise ShimBuildError(
        "no C++ compiler found ($CXX, c++, g++, clang++) to build libfusedce_jax.so; install "
        "one, or build the shim elsewhere (python -m fusedce.jax build --output DIR) and set "
        "FUSEDCE_JAX_LIBRARY to it")


def _cuda_include() -> Optional[str]:
    """CUDA's include folder when cuda_runtime_api.h is there (only used to check that the
    shim's own cudaStream_t declaration matches CUDA's; never needed)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def cache_dir() -> str:
    env = os.environ.get("FUSEDCE_JAX_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fusedce", "jax")


def _command(cxx: str, xla_inc: str, fce_inc: str, out: str) -> List[str]:
    cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-I", fce_inc, "-isystem", xla_inc]
    cuda = _cuda_include()
    if cuda:
        cmd += ["-DFCE_JAX_HAVE_CUDA_RUNTIME", "-isystem", cuda]
    return cmd + list(SOURCES) + ["-o", out, "-ldl"]


def _key(cmd: List[str], xla_inc: str, fce_inc: str) -> str:
    h = hashlib.sha256()
    paths = list(SOURCES) + list(HEADERS) + [os.path.join(fce_inc, "fusedce.h")] + [
        os.path.join(xla_inc, "xla", "ffi", "api", f) for f in ("api.h", "c_api.h", "ffi.h")]
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    # the flags and the compiler, not the paths of the sources and the output
    h.update("\0".join(cmd[:-(len(SOURCES) + 3)]).encode())
    h.update(str(SHIM_ABI).encode())
    return h.hexdigest()[:20]


def build(output: Optional[str] = None, *, force: bool = False, verbose: bool = False) -> str:
    """Build libfusedce_jax.so (if its build key is not in the cache yet, or ``force``) and
    return its path. ``output``: a folder to put it in instead of the cache (overwritten)."""
    fce_inc = fusedce_include_dir()
    xla_inc = xla_include_dir()
    cxx = compiler()
    probe = _command(cxx, xla_inc, fce_inc, "OUT")
    if output is not None:
        folder = os.path.abspath(output)
    else:
        folder = os.path.join(cache_dir(), _key(probe, xla_inc, fce_inc))
    target = os.path.join(folder, LIBRARY_NAME)
    if os.path.isfile(target) and not force and output is None:
        return target
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libfusedce_jax.", suffix=".so", dir=folder)
    os.close(fd)
    cmd = _command(cxx, xla_inc, fce_inc, tmp)
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise ShimBuildError("cannot run the C++ compiler %r to build %s: %s (set CXX, or "
                                 "FUSEDCE_JAX_LIBRARY to a prebuilt shim)"
                                 % (cxx, LIBRARY_NAME, e)) from None
        if p.returncode != 0:
            raise ShimBuildError("building %s failed (%s):\n%s\n%s" % (
                LIBRARY_NAME, " ".join(cmd), p.stdout, p.stderr))
        os.replace(tmp, target)  # atomic: a concurrent build writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library_path() -> str:
    """The shim to load: $FUSEDCE_JAX_LIBRARY, else the cached build (built now if missing)."""
    env = os.environ.get("FUSEDCE_JAX_LIBRARY")
    if env:
        path = os.path.join(env, LIBRARY_NAME) if os.path.isdir(env) else env
        if not os.path.isfile(path):
            raise ShimBuildError("FUSEDCE_JAX_LIBRARY=%s: no such file" % env)
        return path
    return build()
