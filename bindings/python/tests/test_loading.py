"""How the package finds what it runs on, and what it says when something is missing: the CUDA
backend absent from the build (a clear error naming the wheels that have it), cuBLASLt absent
(the CPU backend still works; the CUDA backend names the library and where it looked), the
preload of cuBLASLt from an ``nvidia`` package on sys.path, and ``python -m fusedce``'s report.
Runs in CI on the CPU (each test skips what the loaded library cannot show)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fusedce
from test_numpy import FakeCudaArray

INFO = fusedce.build_info() or ""
HAS_CUDA_BACKEND = "backends: cpu, cuda" in INFO
CUDA_MAJOR = re.search(r"CUDA (\d+)\.", INFO)
SONAME = "libcublasLt.so.%s" % CUDA_MAJOR.group(1) if CUDA_MAJOR else None
TESTS = os.path.dirname(os.path.abspath(__file__))


def _python(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter (this one's sys.path first, ``env`` added); it prints
    one JSON object, returned."""
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in [TESTS] + sys.path if p)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CUDA_CALL = """
import json, fusedce
from test_numpy import FakeCudaArray
try:
    fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<i8"),
                    loss=FakeCudaArray((), "<f4"), workspace=FakeCudaArray((1024,), "|u1"))
    error = None
except fusedce.BackendUnavailableError as e:
    error = str(e)
"""


@pytest.mark.skipif(HAS_CUDA_BACKEND, reason="this library has the CUDA backend")
def test_cuda_array_on_a_build_without_cuda_names_the_wheels():
    with pytest.raises(fusedce.BackendUnavailableError) as e:
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<i8"),
                        loss=FakeCudaArray((), "<f4"), workspace=FakeCudaArray((1024,), "|u1"))
    text = str(e.value)
    assert "fce_forward" in text and "this build has no CUDA backend" in text, text
    assert "pip install fusedce-cu13" in text and "fusedce-cu12" in text, text
    # the CPU backend is there all the same
    r = fusedce.forward(np.zeros((2, 3), np.float32), np.array([0, 2]), reduction="sum")
    assert abs(float(r.loss) - 2 * np.log(3)) < 1e-5


@pytest.mark.skipif(not HAS_CUDA_BACKEND, reason="this library has no CUDA backend")
def test_cublaslt_not_found_leaves_the_cpu_backend_and_names_the_library():
    missing = "/nonexistent/fusedce-test/libcublasLt.so.99"
    got = _python(CUDA_CALL + """
import numpy as np
r = fusedce.forward(np.zeros((2, 3), np.float32), np.array([0, 2]), reduction="sum")
print(json.dumps({"info": fusedce.build_info(), "cuda": fusedce.cuda_available(),
                  "cpu_loss": float(r.loss), "error": error}))
""", FUSEDCE_CUBLASLT=missing)
    assert got["cuda"] is False
    assert abs(got["cpu_loss"] - 2 * np.log(3)) < 1e-5
    m = re.search(r"cuBLASLt: not loaded: (.*?)(; BLAS: |$)", got["info"])
    assert m, got["info"]
    assert SONAME in m.group(1) and "FUSEDCE_CUBLASLT=" + missing in m.group(1), m.group(1)
    if "device visible" in got["info"]:  # on a GPU: the CUDA call says why it cannot run
        assert got["error"] and "fce_forward" in got["error"], got
        assert SONAME in got["error"] and missing in got["error"], got["error"]


def _real_cublaslt():
    """A cuBLASLt of this build's CUDA major on this machine (the dynamic loader's, else the
    toolkit's), or None."""
    if not SONAME:
        return None
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    hits = [ln.split("=>")[-1].strip() for ln in out.splitlines()
            if ln.strip().startswith(SONAME + " ")]
    for path in hits + ["/usr/local/cuda/lib64/" + SONAME]:
        if os.path.isfile(path):
            return path
    return None


@pytest.mark.skipif(not HAS_CUDA_BACKEND or _real_cublaslt() is None,
                    reason="needs a CUDA build and a cuBLASLt of its major on this machine")
def test_preload_from_an_nvidia_package_on_sys_path(tmp_path):
    """fusedce/_lib.py preloads the cuBLASLt of fusedce/_build.py from <sys.path entry>/nvidia/..
    and the library's loader takes that copy (already in the process) before any other."""
    wheel_dir = "nvidia/cu%s/lib" % CUDA_MAJOR.group(1)
    site = tmp_path / "site"
    (site / wheel_dir).mkdir(parents=True)
    link = site / wheel_dir / SONAME
    link.symlink_to(_real_cublaslt())
    got = _python("""
import json, sys, types
build = types.ModuleType("fusedce._build")
build.CUDA_BACKEND, build.CUBLASLT_SONAME, build.CUBLASLT_WHEEL_DIR = True, %r, %r
sys.modules["fusedce._build"] = build  # what pip writes into an installed package
sys.path.insert(0, %r)  # before any nvidia package already on the path (torch's)
import fusedce
from fusedce import _lib
_lib._DRIVER_MARKERS = ("/",)  # as on a machine with an NVIDIA driver
print(json.dumps({"preload": _lib.cublaslt_preload(), "info": fusedce.build_info()}))
""" % (SONAME, wheel_dir, str(site)))
    assert got["preload"] == "loaded %s" % link, got
    assert "cuBLASLt: %s;" % link in got["info"], got["info"]


SKIPPED_CUDA = """
import json, sys, types, warnings
build = types.ModuleType("fusedce._build")
build.CUDA_BACKEND, build.CUBLASLT_SONAME, build.CUBLASLT_WHEEL_DIR = False, None, None
build.CUDA_SKIPPED = "nvcc was not found when pip built this package"
sys.modules["fusedce._build"] = build  # what pip writes where nvcc was missing
import fusedce
from fusedce import _lib
_lib._DRIVER_MARKERS = (%r,)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fusedce.load()
print(json.dumps([str(w.message) for w in caught]))
"""


def test_a_source_build_that_skipped_cuda_says_so_on_a_gpu_machine(tmp_path):
    """pip shows no build output: a package built where nvcc was missing warns on first use
    where an NVIDIA driver is (a marker file exists), and stays quiet where none is."""
    marker = tmp_path / "nvidiactl"
    assert _python(SKIPPED_CUDA % str(marker)) == []
    marker.write_text("")
    got = _python(SKIPPED_CUDA % str(marker))
    assert len(got) == 1 and "no CUDA backend: nvcc was not found" in got[0], got
    assert "pip install fusedce-cu13" in got[0], got


def test_python_m_fusedce_reports_cublaslt():
    out = subprocess.run([sys.executable, "-m", "fusedce"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = dict(ln.split(":", 1) for ln in out.stdout.splitlines() if ":" in ln)
    for key in ("library", "backends", "cuBLASLt", "cuBLASLt preload", "cuBLASLt in process"):
        assert key in rows, out.stdout
    if not HAS_CUDA_BACKEND:
        assert "no CUDA backend" in rows["cuBLASLt"], out.stdout
        assert "pip install fusedce-cu13" in rows["backends"], out.stdout
    elif rows["cuBLASLt"].strip().startswith("/"):  # the file that process's library loaded
        loaded = rows["cuBLASLt"].strip()            # is one that process maps
        mapped = [p.strip() for p in rows["cuBLASLt in process"].split(",")]
        assert os.path.realpath(loaded) in {os.path.realpath(p) for p in mapped}, out.stdout
