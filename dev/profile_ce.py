"""One fusedce forward+gradient at a given shape, for a profiler (ncu) to look at.
    ncu --clock-control none -k regex:ce_rows --launch-skip 2 --launch-count 1 \
        python3 dev/profile_ce.py 16384 128256 bf16
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import ce_calls, dtypes  # noqa: E402

DTYPES = dtypes()

N, V, dt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
z = (torch.randn(N, V, device="cuda") * 4).to(DTYPES[dt])
y = torch.randint(0, V, (N,), device="cuda")
grad = torch.empty_like(z)
_, fwd_grad, _ = ce_calls(z, y, grad)
for _ in range(3):
    fwd_grad()
torch.cuda.synchronize()
