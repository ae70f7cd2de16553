"""Where the host time of one loss + backward through fusedce.torch.cross_entropy goes.

Each part is timed as enqueue time with the GPU idle at its start (a synchronize before every
iteration, outside the timed span), median of ITERS iterations, so that neither a full launch
queue nor a busy GPU enters the number; then cProfile of the whole loss + backward (sorted by
own time). Parts: the C calls through ctypes (fusedce/torch/_calls.py: ce_forward / ce_backward), a Python
autograd.Function that does nothing, fusedce's loss alone (the graph built), loss + backward,
and torch eager's loss + backward, at each shape given.
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python \
        python3 dev/host_profile_torch.py 64x512 4096x50257
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fusedce.torch as ft
from fusedce.torch import _calls as tc
from fusedce._options import CEOptions

ITERS = int(os.environ.get("ITERS", "300"))
# BUSY=1: each timed iteration starts with the GPU busy (a ~2 ms spin kernel enqueued after
# the synchronize), as in a timing loop or a training step, instead of idle
BUSY = os.environ.get("BUSY", "0") == "1"


def enqueue_us(f, iters=ITERS):
    for _ in range(20):
        f()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if BUSY:
            torch.cuda._sleep(4_000_000)
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


class Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, g):
        return None


def main():
    for shape in sys.argv[1:] or ["64x512", "4096x50257"]:
        n, v = (int(s) for s in shape.split("x"))
        z = (torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        opts = CEOptions()
        grad = torch.empty_like(z)
        one = torch.ones((), device="cuda")
        _, lse, *_ = tc.ce_forward(z.detach(), y, None, opts, grad=grad)

        def c_fwd():
            tc.ce_forward(z.detach(), y, None, opts, grad=grad)

        def c_rescale():
            tc.ce_backward(z.detach(), y, lse, one, None, opts, rescale=grad)

        def nothing():
            Nothing.apply(z).backward()

        def loss_only():
            z.grad = None
            return ft.cross_entropy(z, y)

        def both():
            z.grad = None
            ft.cross_entropy(z, y).backward()

        def eager():
            z.grad = None
            F.cross_entropy(z, y).backward()

        parts = [("c fce_forward (ctypes)", c_fwd), ("c fce_backward_rescale", c_rescale),
                 ("empty autograd.Function fwd+bwd", nothing), ("fusedce loss (graph)", loss_only),
                 ("fusedce loss+backward", both), ("torch eager loss+backward", eager)]
        for name, f in parts:
            print(f"{shape} {name}: {enqueue_us(f)} us")
        import triton.testing

        def c_both():
            c_fwd()
            c_rescale()
        for name, f in (("do_bench c fwd+rescale", c_both), ("do_bench fusedce loss+backward", both),
                        ("do_bench torch eager", eager)):
            ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            print(f"{shape} {name}: {ms * 1e3:.1f} us (GPU span per call, L2 flushed before each)")
        prof = cProfile.Profile()
        for _ in range(20):
            both()
        torch.cuda.synchronize()
        for _ in range(ITERS):
            torch.cuda.synchronize()
            if BUSY:
                torch.cuda._sleep(4_000_000)
            prof.enable()
            both()
            prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"--- {shape}: cProfile of {ITERS} loss+backward, by own time")
        print(s.getvalue())
        del z, y, grad


if __name__ == "__main__":
    main()
