"""What the 0.3 options cost on the CUDA backend, through the C ABI: fce_forward (loss only, and
loss + gradient in one pass) plain against argmax + accuracy, token scaling and z-loss, and
fce_backward from the saved lse, at the CE benchmark's shapes. pct_of_copy as in bench_ce.py.
Writes bench/results/options-cost-<device>.json (and $OUT/ when set)."""
import ctypes
import json
import os

import torch

from common import RESULTS, _lib, bench_ms, copy_tbps, device_name, options, ptr, stream

lib = _lib.load()
rows = []
copy = copy_tbps(4 << 30)
print(f"device {device_name()}: copy {copy:.2f} TB/s")
for N, V, dt in [(16384, 128256, torch.bfloat16), (8192, 256000, torch.bfloat16),
                 (32768, 32000, torch.bfloat16), (4096, 50257, torch.bfloat16),
                 (8192, 128256, torch.float32)]:
    g = torch.Generator(device="cuda").manual_seed(1)
    z = (torch.randn(N, V, device="cuda", generator=g) * 4).to(dt)
    y = torch.randint(0, V, (N,), device="cuda", generator=g); y[::50] = -100
    grad = torch.empty_like(z)
    loss = torch.empty(1, device="cuda"); lse = torch.empty(N, device="cuda")
    am = torch.empty(N, dtype=torch.int64, device="cuda"); acc = torch.empty(1, device="cuda")
    e = z.element_size()
    for name, fields, with_grad in [("fwd", {}, False), ("fwd+argmax", {"argmax": 1}, False),
                                    ("fwd+grad", {}, True), ("fwd+grad+argmax+acc", {"argmax": 1, "accuracy": 1}, True),
                                    ("fwd+grad token_scaling", {"token_scaling": 1}, True),
                                    ("fwd+grad z_loss", {"z_loss_scale": 1e-4}, True)]:
        o = options(dt)
        for k, v in fields.items():
            if k == "argmax": o.argmax = am.data_ptr()
            elif k == "accuracy": o.accuracy = acc.data_ptr()
            else: setattr(o, k, v)
        ws = ctypes.c_size_t()
        _lib.check(lib.fce_forward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws)), "ws")
        w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")
        gp = ptr(grad) if with_grad else None
        f = lambda: lib.fce_forward(ctypes.byref(o), N, V, ptr(z), ptr(y), ptr(loss), ptr(lse), None, gp, None, None, ptr(w), ws.value, stream())
        _lib.check(f(), name)
        ms = bench_ms(f)
        nbytes = N * V * e * (2 if with_grad else 1)
        r = dict(shape=f"{N}x{V}", dtype=str(dt).split(".")[-1], op=name, ms=round(ms, 4),
                 pct_of_copy=round(100 * nbytes / (ms * 1e-3) / 1e12 / copy, 1))
        print(r); rows.append(r)
    o = options(dt)
    ws = ctypes.c_size_t()
    lib.fce_backward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws))
    w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")
    f = lambda: lib.fce_backward(ctypes.byref(o), N, V, ptr(z), ptr(y), ptr(lse), None, ptr(grad), None, ptr(w), ws.value, stream())
    _lib.check(f(), "bwd"); ms = bench_ms(f)
    r = dict(shape=f"{N}x{V}", dtype=str(dt).split(".")[-1], op="backward", ms=round(ms, 4),
             pct_of_copy=round(100 * 2 * N * V * e / (ms * 1e-3) / 1e12 / copy, 1))
    print(r); rows.append(r)
    del z, grad, w
    torch.cuda.empty_cache()
for d in (RESULTS, os.environ.get("OUT")):
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"options-cost-{device_name()}.json"), "w") as f:
            json.dump(dict(device=device_name(), copy_tbps=copy, rows=rows), f, indent=1)
