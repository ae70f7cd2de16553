"""Streams and devices of the CUDA backend: the cudaStream_t a call is enqueued on (an explicit
``stream=``, torch's current stream, the ``__cuda_array_interface__`` stream, else the legacy
default stream) and the device made current for it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from ._arrays import _Arr


def _stream_int(stream) -> Optional[int]:
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"stream must be an int (cudaStream_t), a torch or a CuPy stream, got "
                    f"{type(stream).__name__}")


def _call_stream(explicit: Optional[int], arrays) -> int:
    """The cudaStream_t (as an int) a CUDA call is enqueued on."""
    if explicit is not None:
        return explicit
    for a in arrays:
        if a is not None and a.framework == "torch" and a.is_cuda:
            import torch
            return torch.cuda.current_stream(a.obj.device).cuda_stream
    for a in arrays:
        if a is not None and a.stream is not None:
            return int(a.stream)  # 1 / 2: the legacy / per-thread handles, usable as they are
    return 0


@contextlib.contextmanager
def _device_of(ref: _Arr):
    """Make ref's CUDA device current for the call (torch and CuPy inputs)."""
    if ref.is_cuda and ref.framework == "torch":
        import torch
        with torch.cuda.device(ref.obj.device):
            yield
    elif ref.is_cuda and ref.framework == "cupy" and ref.device[1] is not None:
        import cupy
        with cupy.cuda.Device(ref.device[1]):
            yield
    else:
        yield

