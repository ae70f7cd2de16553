"""``python -m fusedce``: what this installation is made of, for bug reports (in the spirit of
``python -m torch.utils.collect_env``): the package and library versions, the library's path and
where it was found, the backends, the cuBLASLt the CUDA backend loaded (the library's answer,
and the files /proc/self/maps shows in the process), the BLAS, the GPU, the Python side.

Exit status: 0 when the library loads, 1 when it does not (the report says why).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys


def _gpu() -> str:
    """The GPU(s) as torch, else CuPy, else nvidia-smi sees them."""
    try:
        import torch
    except Exception:  # not installed, or broken: try the next
        torch = None
    if torch is not None:
        try:
            cuda = getattr(torch.version, "cuda", None)
            head = "torch %s (CUDA %s)" % (torch.__version__, cuda or "none")
            if not torch.cuda.is_available():
                return head + ": no CUDA device available"
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            caps = ["sm %d%d" % torch.cuda.get_device_capability(i) for i in range(len(names))]
            return head + ": " + "; ".join("%d: %s (%s)" % (i, n, c)
                                           for i, (n, c) in enumerate(zip(names, caps)))
        except Exception as e:
            return "torch: error querying the GPU: %s" % e
    try:
        import cupy
    except Exception:
        cupy = None
    if cupy is not None:
        try:
            rt = cupy.cuda.runtime
            n = rt.getDeviceCount()
            if n == 0:
                return "cupy %s: no CUDA device" % cupy.__version__
            props = [rt.getDeviceProperties(i) for i in range(n)]
            return "cupy %s: " % cupy.__version__ + "; ".join(
                "%d: %s (sm %d%d)" % (i, p["name"].decode() if isinstance(p["name"], bytes)
                                      else p["name"], p["major"], p["minor"])
                for i, p in enumerate(props))
        except Exception as e:
            return "cupy %s: no CUDA device (%s)" % (cupy.__version__, e)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=index,name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30)
            lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
            if p.returncode == 0 and lines:
                return "nvidia-smi: " + "; ".join(lines)
            return "nvidia-smi: no GPU (%s)" % (p.stderr.strip() or p.stdout.strip()
                                                 or "exit %d" % p.returncode)
        except Exception as e:
            return "nvidia-smi: %s" % e
    return "none found (no torch, no cupy, no nvidia-smi)"


def _info_part(info, key: str, absent: str) -> str:
    """The part "<key>: ..." of fce_build_info's line (``absent`` when it has none)."""
    if info is None:
        return "unknown (library older than 0.3)"
    for part in info.split("; "):
        if part.startswith(key + ": "):
            return part[len(key) + 2:]
    return absent


def _backends(lib, info) -> str:
    cuda = bool(lib.fce_cuda_available())
    if cuda:
        return "cpu, cuda (fce_cuda_available: 1)"
    if info is not None and "built without CUDA" in info:
        why = ("this library was built without CUDA: pip install fusedce-cu13 (or fusedce-cu12) "
               "for one with it")
    elif info is not None and "device not visible" in info:
        why = "built with CUDA, but no CUDA device is visible"
    elif info is not None and "cuBLASLt: not loaded" in info:
        why = "built with CUDA, but cuBLASLt could not be loaded (see cuBLASLt below)"
    else:
        why = "no CUDA backend in this library, or no CUDA device visible"
    return "cpu (cuda: not available: %s)" % why


def _mapped(name: str) -> str:
    """The files whose name holds ``name`` mapped into this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError as e:
        return "unknown (%s)" % e
    found = sorted(p for p in paths if name in os.path.basename(p))
    return ", ".join(found) if found else "none"


def _distribution() -> str:
    """The installed distributions that hold the package (fusedce, fusedce-cu13, fusedce-cu12:
    one name for the import, several for pip), with their versions."""
    names = ("fusedce", "fusedce-cu13", "fusedce-cu12")
    found = ["%s %s" % (n, _version_of(n)) for n in names if _version_of(n) != "not installed"]
    return ", ".join(found) if found else "not installed (a source tree)"


def _version_of(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "not installed"


def main(argv=None) -> int:
    rows = []

    def row(key, value):
        rows.append((key, value))

    from . import _lib
    from . import __version__
    row("fusedce", "%s (package %s, distribution %s)" % (
        __version__, os.path.dirname(os.path.abspath(_lib.__file__)), _distribution()))
    env = os.environ.get("FUSEDCE_LIBRARY")
    status = 0
    try:
        lib = _lib.load()
    except Exception as e:  # LibraryNotFoundError, VersionMismatchError
        row("library", "NOT LOADED: %s: %s" % (type(e).__name__, e))
        lib = None
        status = 1
    if lib is not None:
        path = _lib.library_path()
        real = os.path.realpath(path) if os.sep in path else path
        row("library", "%s%s (found: %s)" % (
            path, " -> " + os.path.basename(real) if real != path else "", _lib.library_origin()))
        row("library version", _lib.format_version(_lib.version()))
        info = _lib.build_info()
        row("build info", info if info is not None else "unknown (library older than 0.3)")
        row("backends", _backends(lib, info))
        row("cuBLASLt", _info_part(info, "cuBLASLt", "none (no CUDA backend)"))
        row("cuBLASLt preload", _lib.cublaslt_preload())
        row("cuBLASLt in process", _mapped("libcublasLt"))
        row("BLAS", _info_part(info, "BLAS", "unknown (not in fce_build_info)"))
    row("FUSEDCE_LIBRARY", env if env else "(not set)")
    row("GPU", _gpu())
    row("Python", "%s (%s)" % (platform.python_version(), sys.executable))
    row("platform", platform.platform())
    row("numpy", _version_of("numpy"))
    for name in ("torch", "cupy", "jax", "ml_dtypes"):
        v = _version_of(name)
        if v != "not installed":
            row(name, v)
    width = max(len(k) for k, _ in rows) + 1
    for k, v in rows:
        print("%-*s %s" % (width, k + ":", v))
    return status


if __name__ == "__main__":
    sys.exit(main())
