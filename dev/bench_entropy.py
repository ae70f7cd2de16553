"""dev/bench_entropy.py: what the per-row entropy and the lse/entropy gradient terms cost on the
raw fce_forward (loss + gradient in one pass), against the plain call, bf16, CUDA graph replays;
and the entropy of a forward without a gradient against that forward. Prints one line per shape
and variant; --out writes the records as JSON."""
import argparse
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import harness  # noqa: E402
from harness import options, stream  # noqa: E402

SHAPES = [(16384, 128256), (8192, 256000), (32768, 32000), (4096, 50257)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from fusedce import _lib
    lib = _lib.load()
    records = []
    for N, V in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + V)
        z = (torch.randn(N, V, device="cuda", generator=g) * 4).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device="cuda", generator=g)
        grad = torch.empty_like(z)
        loss, lse, ent = (torch.empty(N, device="cuda") for _ in range(3))
        gl, ge = torch.rand(N, device="cuda"), torch.rand(N, device="cuda")
        o = options(torch.bfloat16)
        ws = ctypes.c_size_t()
        _lib.check(lib.fce_forward_workspace_size(ctypes.byref(o), N, V, ctypes.byref(ws)), "ws")
        w = torch.empty(max(ws.value, 16), dtype=torch.uint8, device="cuda")
        variants = {
            "plain": ({}, {}),
            "+entropy": ({"entropy": ent.data_ptr()}, {}),
            "+grad_lse": ({}, {"grad_lse": gl.data_ptr()}),
            "+entropy+grad_entropy": ({"entropy": ent.data_ptr()},
                                      {"grad_lse": gl.data_ptr(), "grad_entropy": ge.data_ptr()}),
            "forward": ({}, None),
            "forward+entropy": ({"entropy": ent.data_ptr()}, None),
        }
        base = None
        for name, (of, gf) in variants.items():
            if name == "forward":
                base = None  # the forward-only rows against the plain forward
            out = _lib.outputs(loss=loss.data_ptr(), lse=lse.data_ptr())
            for k, v in of.items():
                setattr(out, k, v)
            gr = None
            if gf is not None:
                gr = _lib.gradients(grad_logits=grad.data_ptr())
                for k, v in gf.items():
                    setattr(gr, k, v)

            def f(out=out, gr=gr):
                return lib.fce_forward(ctypes.byref(o), N, V, ctypes.c_void_p(z.data_ptr()),
                                       ctypes.c_void_p(y.data_ptr()), ctypes.byref(out),
                                       ctypes.byref(gr) if gr is not None else None,
                                       ctypes.c_void_p(w.data_ptr()), ws.value, stream())
            _lib.check(f(), name)
            ms = harness.time_graph_ms(f)
            base = base or ms
            records.append(dict(N=N, V=V, dtype="bf16", variant=name, ms=round(ms, 4),
                                over_plain=round(ms / base, 3)))
            print(records[-1], flush=True)
        del z, grad
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=harness.device_name(), records=records), fh, indent=1)


if __name__ == "__main__":
    main()
