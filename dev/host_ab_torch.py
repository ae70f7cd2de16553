"""Host time of one loss + backward through fusedce.torch.cross_entropy against a floor and
torch eager, the variants taken in turns within one process (the device's host moves by 2x
between machines and within one, so only variants timed in turns compare).

Variants, each timed as enqueue time (a synchronize before every iteration, outside the timed
span; BUSY=1: a ~2 ms spin kernel enqueued first, so the GPU is busy while the host enqueues,
as in a timing loop or a training step), p25 and median of ITERS iterations, then as
triton's do_bench (the GPU span of a call with L2 flushed before each, what bench_torch.py
reports; host-bound when the host takes longer than the GPU):
  prev   the previous build's Python layer, if importable as ``fusedce_prev`` (a copy of an
         earlier bindings/python/fusedce renamed so, with its ``"fusedce::`` op names changed
         to ``"fusedceprev::`` so that both register), else left out;
  new    fusedce.torch.cross_entropy as it is;
  floor  a minimal torch.autograd.Function calling fce_forward and fce_backward_rescale
         straight through ctypes (one options struct, workspace and lse in one buffer, no
         argument handling): what the Python layer could cost at least;
  eager  torch.nn.functional.cross_entropy.
REDUCTION=none times reduction 'none' with loss.sum().backward() instead (prev, new, eager).
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python \
        python3 dev/host_ab_torch.py 64x512 4096x50257
"""
import ctypes
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import fusedce.torch as ft
from fusedce import _lib
from fusedce.torch import _calls as tc
from fusedce._options import CEOptions

try:
    import fusedce_prev.torch as ft_prev
except ImportError:
    ft_prev = None

BUSY = os.environ.get("BUSY", "0") == "1"
ITERS = int(os.environ.get("ITERS", "1000"))
# REDUCTION=none: reduction 'none' and loss.sum().backward() (no floor variant)
REDUCTION = os.environ.get("REDUCTION", "mean")


def floor_function(n, v):
    """The minimal Function for bf16 [n, v] logits, int64 targets, mean over rows."""
    lib = _lib.load()
    opts = CEOptions()
    _, o = tc.options(_lib.FCE_BACKEND_CUDA, _lib.FCE_BFLOAT16, _lib.FCE_INT64, opts)
    o.class_weights, o.row_stride, o.grad_row_stride = None, v, v
    size = ctypes.c_size_t()
    lib.fce_forward_workspace_size(ctypes.byref(o), n, v, ctypes.byref(size))
    ws = size.value
    lib.fce_backward_workspace_size(ctypes.byref(o), n, v, ctypes.byref(size))
    ws = max(ws, size.value)
    oref, off = ctypes.byref(o), (n + 1 + 63) // 64 * 64
    raw = torch._C._cuda_getCurrentRawStream

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, y):
            grad = torch.empty(z.shape, dtype=z.dtype, device=z.device)
            buf = torch.empty(off + (ws + 3) // 4, dtype=torch.float32, device=z.device)
            p, s = buf.data_ptr(), raw(z.get_device())
            if lib.fce_forward(oref, n, v, z.data_ptr(), y.data_ptr(), p + 4 * n, p, None,
                               grad.data_ptr(), None, None, p + 4 * off, ws, s):
                raise RuntimeError(_lib.load().fce_last_error())
            ctx.save_for_backward(z, y, buf)
            ctx.grad = grad
            ctx.set_materialize_grads(False)
            return buf[n]

        @staticmethod
        def backward(ctx, g):
            z, y, buf = ctx.saved_tensors
            grad, ctx.grad = ctx.grad, None
            p = buf.data_ptr()
            if lib.fce_backward_rescale(oref, n, v, z.data_ptr(), y.data_ptr(), p, g.data_ptr(),
                                        grad.data_ptr(), None, p + 4 * off, ws,
                                        raw(z.get_device())):
                raise RuntimeError(_lib.load().fce_last_error())
            return grad, None

    return Floor


def main():
    for shape in sys.argv[1:] or ["64x512", "4096x50257"]:
        n, v = (int(s) for s in shape.split("x"))
        z = (torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        floor = floor_function(n, v)

        def step(fn, **kw):
            def run():
                z.grad = None
                loss = fn(z, y, **kw)
                (loss.sum() if REDUCTION == "none" else loss).backward()
            return run

        kw = {"reduction": "none"} if REDUCTION == "none" else {}
        variants = [("new", step(ft.cross_entropy, **kw)), ("eager", step(F.cross_entropy, **kw))]
        if REDUCTION != "none":
            variants.insert(1, ("floor", step(floor.apply)))
        if ft_prev is not None:
            variants.insert(0, ("prev", step(ft_prev.cross_entropy, **kw)))
        grads = []
        for _, f in variants:
            f()
            grads.append(z.grad.clone())
        same = all(torch.equal(grads[0], g) for g in grads[:-1])  # eager: its own rounding
        for _, f in variants:
            for _ in range(20):
                f()
        ts = {name: [] for name, _ in variants}
        for _ in range(ITERS):
            for name, f in variants:
                torch.cuda.synchronize()
                if BUSY:
                    torch.cuda._sleep(4_000_000)
                t0 = time.perf_counter()
                f()
                ts[name].append(time.perf_counter() - t0)
        torch.cuda.synchronize()

        def q(a, p):
            a = sorted(a)
            return round(a[int(p * (len(a) - 1))] * 1e6, 1)
        print(f"{shape} {REDUCTION} {'GPU busy' if BUSY else 'GPU idle'}, enqueue µs (p25 / median); "
              f"fusedce gradients bitwise equal: {same}")
        for name, _ in variants:
            print(f"  {name}: {q(ts[name], .25)} / {q(ts[name], .5)}")
        for name, f in variants:
            ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
            print(f"  {name} do_bench: {ms * 1e3:.1f} µs")


if __name__ == "__main__":
    main()
