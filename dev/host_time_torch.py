"""Host time per iteration (enqueue, best of 5 loops of 200) at small shapes: the one-pass C call
through ctypes, fusedce.torch.cross_entropy (forward with the graph, under no_grad, loss +
backward) and torch eager (dev/NOTES.md, "What bounds the remaining cells, and linear CE measured in turns").
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python3 dev/host_time_torch.py 64 512
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import fusedce.torch as ft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import ce_calls  # noqa: E402
N, V = int(sys.argv[1]), int(sys.argv[2])
z = (torch.randn(N, V, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, V, (N,), device="cuda")
grad = torch.empty_like(z)
fwd, fwd_grad, _ = ce_calls(z.detach(), y, grad)
def t(f, n=200):
    for _ in range(20): f()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)
def f_fwd():  # forward with the graph, no backward
    z.grad = None
    return ft.cross_entropy(z, y)
def t_fwd():
    return F.cross_entropy(z, y)
def f_nograd():
    with torch.no_grad():
        return ft.cross_entropy(z, y)
def f_both():
    z.grad = None
    ft.cross_entropy(z, y).backward()
def t_both():
    z.grad = None
    F.cross_entropy(z, y).backward()
print(N, V, "us/iter host: c-abi fwd+grad", t(fwd_grad), "| fusedce fwd (graph)", t(f_fwd), "no_grad", t(f_nograd),
      "loss+bwd", t(f_both), "| torch fwd", t(t_fwd), "loss+bwd", t(t_both))
