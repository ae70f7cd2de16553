"""Kernel breakdown of fusedce.torch.linear_cross_entropy loss + backward at the benchmark's linear
shapes (torch profiler, the torch layer's default 1 GiB budget), with the bf16 8192^3 reference
rate of the same run and the ratio to the 6·N·D·V floor.
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python3 dev/profile_linear.py [NxDxV ...]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fusedce.torch as ft

SHAPES = ["8192x4096x128256", "8192x2304x256000", "16384x4096x32000", "32768x4096x151936"]


def problem(N, D, V):
    """bf16 hidden states, weight and targets of one shape, and a loss + backward step on them."""
    torch.manual_seed(0)
    h = (torch.randn(N, D, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    W = (torch.randn(V, D, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def step():
        h.grad = None
        W.grad = None
        ft.linear_cross_entropy(h, W, y).backward()
    return h, W, y, step


def shapes_of(argv, default):
    return [tuple(int(x) for x in s.split("x")) for s in (argv or default)]


def main():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    rate = 20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12
    print(f"ref 8192^3 bf16 {rate:.1f} TFLOP/s")
    del a, b
    for N, D, V in shapes_of(sys.argv[1:], SHAPES):
        h, W, y, it = problem(N, D, V)
        for _ in range(2):
            it()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            it()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / 3 * 1e3
        floor = 6 * N * D * V / rate / 1e9
        print(f"\n== {N}x{D}x{V}: {ms:.2f} ms, floor {floor:.2f} ms, {ms/floor:.3f}x")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            it()
            torch.cuda.synchronize()
        tot = 0.0
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total <= 0:
                continue
            tot += e.device_time_total
            print(f"{e.device_time_total/1e3:9.3f} ms x{e.count:3d}  {e.key[:110]}")
        print(f"{tot/1e3:9.3f} ms total kernels")
        del h, W, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
