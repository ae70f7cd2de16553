"""What the options cost on the CUDA backend, through the C ABI: fce_forward (loss only, and
loss + gradient in one pass) plain against argmax + accuracy, token scaling and z-loss, and
fce_backward from the saved lse, at the CE benchmark's shapes. Timed as bench_ce.py times
(CUDA graph replays); pct_of_copy as there (bytes moved / time over the copy rate of this run).

    python3 bench/bench_options.py [--out DIR]
Writes bench/results/options-cost-<device>.json (and DIR/).
"""
import argparse
import ctypes

import harness
from fusedce import _lib
from harness import options, ptr, stream

SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16"),
          (4096, 50257, "bf16"), (8192, 128256, "f32")]
# (op, option fields, with the gradient)
VARIANTS = [("fwd", {}, False), ("fwd+argmax", {"argmax": 1}, False),
            ("fwd+grad", {}, True), ("fwd+grad+argmax+acc", {"argmax": 1, "accuracy": 1}, True),
            ("fwd+grad token_scaling", {"token_scaling": 1}, True),
            ("fwd+grad z_loss", {"z_loss_scale": 1e-4}, True)]


def run_shape(lib, N, V, dt, copy, records):
    import torch
    dtype = harness.dtypes()[dt]
    g = torch.Generator(device="cuda").manual_seed(1)
    z = (torch.randn(N, V, device="cuda", generator=g) * 4).to(dtype)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    y[::50] = -100
    grad = torch.empty_like(z)
    loss, lse = torch.empty(1, device="cuda"), torch.empty(N, device="cuda")
    am, acc = torch.empty(N, dtype=torch.int64, device="cuda"), torch.empty(1, device="cuda")
    e = z.element_size()

    def rec(op, ms, nbytes):
        records.append(dict(op=op, dtype=dt, N=N, V=V, ms=round(ms, 4),
                            pct_of_copy=round(100 * nbytes / (ms * 1e-3) / 1e12 / copy, 1)))
        print(records[-1], flush=True)

    for name, fields, with_grad in VARIANTS:
        o = options(dtype)
        out = _lib.outputs(loss=loss.data_ptr(), lse=lse.data_ptr())
        for k, v in fields.items():
            if k == "argmax":
                out.argmax = am.data_ptr()
            elif k == "accuracy":
                out.accuracy = acc.data_ptr()
            else:
                setattr(o, k, v)
        ws = ctypes.c_size_t()
        _lib.check(lib.fce_forward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws)),
                   "fce_forward_workspace_size")
        w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")
        grads = _lib.gradients(grad_logits=grad.data_ptr()) if with_grad else None

        def f(o=o, out=out, grads=grads, w=w, n=ws.value):
            return lib.fce_forward(ctypes.byref(o), N, V, ptr(z), ptr(y), ctypes.byref(out),
                                   ctypes.byref(grads) if grads is not None else None,
                                   ptr(w), n, stream())
        _lib.check(f(), "fce_forward")
        rec(name, harness.time_graph_ms(f), N * V * e * (2 if with_grad else 1))
    o = options(dtype)
    ws = ctypes.c_size_t()
    _lib.check(lib.fce_backward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws)),
               "fce_backward_workspace_size")
    w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")

    bgrads = _lib.gradients(grad_logits=grad.data_ptr())

    def b():
        return lib.fce_backward(ctypes.byref(o), N, V, ptr(z), ptr(y), ptr(lse), None,
                                ctypes.byref(bgrads), ptr(w), ws.value, stream())
    _lib.check(b(), "fce_backward")
    rec("backward", harness.time_graph_ms(b), 2 * N * V * e)
    del z, grad, w
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write the JSON there")
    args = ap.parse_args()
    lib = _lib.load()
    dev = harness.device_name()
    copy = harness.copy_tbps()
    print(f"device {dev}: copy {copy:.3f} TB/s")
    run = harness.run_info(copy_tbps=round(copy, 3), timing="CUDA graph replays of 10 calls, median")
    records = []
    for N, V, dt in SHAPES:
        run_shape(lib, N, V, dt, copy, records)
    harness.write("options-cost", dev, run, records, [args.out])
    print(f"wrote {harness.result_path('options-cost', dev)}")


if __name__ == "__main__":
    main()
