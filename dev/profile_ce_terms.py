"""One fce_forward (loss + gradient in one pass) with rule 18's outputs, for a profiler (ncu)
to set beside the plain call of dev/profile_ce.py:
    ncu --clock-control none -k regex:ce_rows --launch-skip 2 --launch-count 1 \
        python3 dev/profile_ce_terms.py 16384 128256 grad_lse
variant: plain, grad_lse, entropy, entropy+grad_entropy (grad_lse and grad_entropy random)."""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import options, ptr, stream  # noqa: E402

from fusedce import _lib  # noqa: E402

N, V, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
z = (torch.randn(N, V, device="cuda") * 4).to(torch.bfloat16)
y = torch.randint(0, V, (N,), device="cuda")
grad = torch.empty_like(z)
loss, lse, ent = (torch.empty(N, device="cuda") for _ in range(3))
gl, ge = torch.rand(N, device="cuda"), torch.rand(N, device="cuda")
o = options(torch.bfloat16)
ws = ctypes.c_size_t()
_lib.check(_lib.load().fce_forward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws)), "ws")
w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")
out = _lib.outputs(loss=loss.data_ptr(), lse=lse.data_ptr(),
                   entropy=ent.data_ptr() if "entropy" in variant else None)
gr = _lib.gradients(grad_logits=grad.data_ptr(),
                    grad_lse=gl.data_ptr() if variant != "plain" and variant != "entropy" else None,
                    grad_entropy=ge.data_ptr() if "grad_entropy" in variant else None)
lib = _lib.load()
for _ in range(3):
    _lib.check(lib.fce_forward(ctypes.byref(o), N, V, ptr(z), ptr(y), ctypes.byref(out),
                               ctypes.byref(gr), ptr(w), ws.value, stream()), "fce_forward")
torch.cuda.synchronize()
