"""Shared by the benchmarks: the device ceilings measured in the same run, timing, records.

Timing is triton.testing.do_bench's median over events, after its warm-up; inputs are random
(never zeros). Memory is torch's peak allocation above what the inputs and outputs hold.
"""
import ctypes
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings", "python"))
from fusedce import _lib  # noqa: E402

# bench/results beside this file, wherever the benchmark is started from (make bench runs it in
# bench/, a developer maybe in the repository root)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
FCE_DTYPE = {torch.float32: _lib.FCE_FLOAT32, torch.float16: _lib.FCE_FLOAT16, torch.bfloat16: _lib.FCE_BFLOAT16}


def device_name():
    return torch.cuda.get_device_name().replace(" ", "-")


def bench_ms(fn, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_tbps(nbytes):
    """Device-to-device copy of nbytes: (bytes read + written) / s, in TB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e12


def gemm_tflops(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def peak_extra_mib(fn, baseline_bytes):
    """Peak bytes torch allocated while running fn, above baseline_bytes, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return max(0.0, (torch.cuda.max_memory_allocated() - start - baseline_bytes) / 2 ** 20)


def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def options(dtype, **fields):
    o = _lib.default_options()
    o.backend = _lib.FCE_BACKEND_CUDA
    o.dtype = FCE_DTYPE[dtype]
    o.target_dtype = _lib.FCE_INT64
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def write_results(records, kind, out_dirs):
    name = f"{kind}-{device_name()}.json"
    for d in out_dirs:
        if d:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, name), "w") as f:
                json.dump(records, f, indent=1)
    return name


def print_table(rows, cols):
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
