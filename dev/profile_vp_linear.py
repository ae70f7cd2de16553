"""Where the time of one vocabulary-parallel linear CE step goes, kernel by kernel (torch.profiler,
CUPTI: every kernel, the library's included), against the one-GPU fce_linear_ce: one process,
one rank (no torch.distributed), bf16, loss + backward.

    python3 dev/profile_vp_linear.py [--shape 16384x4096x128256] [--iters 3] [--nccl]
Prints, per step kind, the step's time (CUDA events, median), the host time of its forward
(the enqueue: long when something inside waits for the device) and the CUDA time per kernel
name summed over the iterations / iters. --nccl: the vocabulary-parallel steps on a
torch.distributed NCCL group of one rank (its collectives real), else without a group.
"""
import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x128256")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--nccl", action="store_true")
    args = ap.parse_args()
    group = None
    if args.nccl:
        import tempfile
        import torch.distributed as dist
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0,
                                world_size=1)
        group = dist.group.WORLD
    N, D, V = (int(x) for x in args.shape.split("x"))
    import fusedce.torch as ft
    from fusedce import _lib
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy as vp
    g = torch.Generator(device="cuda").manual_seed(1234)
    h = (torch.randn(N, D, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)

    def one_gpu():
        t0 = time.perf_counter()
        loss = ft.linear_cross_entropy(h, W, y)
        host.append((time.perf_counter() - t0) * 1e3)
        loss.backward()

    host = []

    def fused():
        t0 = time.perf_counter()
        loss = vp(h, W, y, vocab_start=0, vocab_total=V, group=group)
        host.append((time.perf_counter() - t0) * 1e3)
        loss.backward()

    def two_phase():
        had = _lib.has_vp_linear_ce
        _lib.has_vp_linear_ce = lambda: False
        try:
            t0 = time.perf_counter()
            loss = vp(h, W, y, vocab_start=0, vocab_total=V, group=group)
            host.append((time.perf_counter() - t0) * 1e3)
            loss.backward()
        finally:
            _lib.has_vp_linear_ce = had

    for name, step in (("fce_linear_ce", one_gpu), ("fce_vp_linear_ce", fused),
                       ("two-phase", two_phase)):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        host.clear()
        wall = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            wall.append(a.elapsed_time(b))
        print(f"== {name}: step {statistics.median(wall):.2f} ms (events), forward's host time "
              f"{statistics.median(host):.2f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                h.grad = None
                W.grad = None
                step()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:90]] += e.device_time_total / 1e3 / args.iters
        total = sum(per.values())
        print(f"   {total:.2f} ms of kernels per step")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {v:8.3f} ms  {k}")


if __name__ == "__main__":
    main()
