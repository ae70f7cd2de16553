"""Run the tests from the source tree: the package is imported from bindings/python and, when
FUSEDCE_LIBRARY is not set, the library is looked for in the usual build folders."""

import os
import sys

import pytest

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


@pytest.fixture(scope="session")
def jax_shim_cache(tmp_path_factory):
    """The JAX suites' shim, built into a temporary cache once per session unless told where it
    is (FUSEDCE_JAX_LIBRARY or FUSEDCE_JAX_CACHE_DIR); skips where no C++ compiler is found."""
    if os.environ.get("FUSEDCE_JAX_LIBRARY") or os.environ.get("FUSEDCE_JAX_CACHE_DIR"):
        yield
        return
    from fusedce import jax_ffi
    try:
        jax_ffi.compiler()
    except jax_ffi.ShimBuildError as e:
        pytest.skip(str(e))
    os.environ["FUSEDCE_JAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("fusedce_jax_cache"))
    yield
    del os.environ["FUSEDCE_JAX_CACHE_DIR"]
