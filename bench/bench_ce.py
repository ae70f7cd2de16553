"""Cross-entropy over given logits: fusedce against torch eager, torch.compile and Liger-Kernel.

Bytes: forward reads N*V*e; forward + gradient reads and writes N*V*e each. pct_of_copy is the
achieved (bytes read + written)/s over a device-to-device copy measured in this same run.
Writes bench/results/ce-<device>.json (and $OUT/ when set).
"""
import argparse
import ctypes
import gc

import torch
import torch.nn.functional as F

from common import (DTYPES, _lib, bench_ms, copy_tbps, device_name, options, peak_extra_mib,
                    RESULTS, print_table, ptr, stream, write_results)

MATRIX_V = (32000, 50257, 128256, 151936, 256000)
MATRIX_N = (1024, 4096, 16384)
SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16"),
          (8192, 151936, "bf16"), (4096, 50257, "bf16"), (8192, 128256, "f32")]


def fusedce_fns(z, y, grad):
    N, V = z.shape
    o = options(z.dtype)
    ws_bytes = ctypes.c_size_t()
    _lib.call("fce_forward_workspace_size", ctypes.byref(o), N, V, ctypes.byref(ws_bytes))
    ws = torch.empty(max(ws_bytes.value, 16), dtype=torch.uint8, device="cuda")
    loss = torch.empty(1, device="cuda")
    lse = torch.empty(N, device="cuda")
    lib = _lib.load()
    args = (ctypes.byref(o), N, V, ptr(z), ptr(y))

    def fwd():
        lib.fce_forward(*args, ptr(loss), None, None, None, None, None, ptr(ws), ws_bytes.value, stream())

    def fwd_grad():
        lib.fce_forward(*args, ptr(loss), ptr(lse), None, ptr(grad), None, None, ptr(ws), ws_bytes.value, stream())

    _lib.check(lib.fce_forward(*args, ptr(loss), ptr(lse), None, ptr(grad), None, None, ptr(ws),
                               ws_bytes.value, stream()), "fce_forward")
    return fwd, fwd_grad, ws_bytes.value / 2 ** 20, loss


def torch_fwd_grad(fn, z, y):
    zz = z.detach().requires_grad_(True)

    def run():
        zz.grad = None
        fn(zz, y).backward()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 16384x128256xbf16,4096x50257xbf16")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--matrix", action="store_true",
                    help="fusedce alone over the speed-of-light grid (issue 8): V in "
                         "{32000, 50257, 128256, 151936, 256000} x N in {1024, 4096, 16384} x "
                         "{bf16, f16}, and float32 at N 4096; writes ce-matrix-<device>.json")
    args = ap.parse_args()
    shapes = SHAPES
    if args.matrix:
        args.no_peers = True
        shapes = [(n, v, dt) for dt in ("bf16", "f16") for v in MATRIX_V for n in MATRIX_N]
        shapes += [(4096, v, "f32") for v in MATRIX_V]
    if args.shapes:
        shapes = [(int(a), int(b), c) for a, b, c in (s.split("x") for s in args.shapes.split(","))]
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except Exception as e:  # noqa: BLE001
        print(f"Liger-Kernel not available ({e}); its rows are skipped")
        liger_cross_entropy = None
    compiled = torch.compile(lambda z, y: F.cross_entropy(z.float(), y), dynamic=True)

    dev = device_name()
    copy = copy_tbps(4 << 30)
    print(f"device {dev}: copy {copy:.2f} TB/s (read + written, 4 GiB)")
    records = []
    for N, V, dt in shapes:
        dtype = DTYPES[dt]
        e = torch.finfo(dtype).bits // 8
        gen = torch.Generator(device="cuda").manual_seed(N + V)
        z = (torch.randn(N, V, device="cuda", generator=gen) * 4).to(dtype)
        y = torch.randint(0, V, (N,), device="cuda", generator=gen)
        y[::50] = -100
        grad = torch.empty_like(z)
        nbytes = N * V * e

        def rec(op, impl, ms, extra):
            moved = nbytes * (1 if op == "forward" else 2)
            tbps = moved / (ms * 1e-3) / 1e12
            records.append(dict(op=op, impl=impl, dtype=dt, N=N, V=V, ms=round(ms, 4), tbps=round(tbps, 3),
                                pct_of_copy=round(100 * tbps / copy, 1), extra_mib=round(extra, 1), device=dev))

        fwd, fwd_grad, ws_mib, _ = fusedce_fns(z, y, grad)
        rec("forward", "fusedce", bench_ms(fwd), ws_mib)
        rec("forward+grad", "fusedce", bench_ms(fwd_grad), ws_mib)
        rec("forward", "copy-ceiling", nbytes / (copy * 1e12 / 2) * 1e3, 0)
        rec("forward+grad", "copy-ceiling", 2 * nbytes / (copy * 1e12) * 1e3, 0)
        if not args.no_peers:
            with torch.no_grad():
                f = lambda: F.cross_entropy(z, y)  # noqa: E731
                rec("forward", "torch-eager", bench_ms(f), peak_extra_mib(f, 0))
            peers = [("torch-eager", lambda zz, yy: F.cross_entropy(zz, yy)),
                     ("torch-eager-float", lambda zz, yy: F.cross_entropy(zz.float(), yy)),
                     ("torch-compile", compiled)]
            if liger_cross_entropy is not None:
                peers.append(("liger", lambda zz, yy: liger_cross_entropy(zz, yy)))
            for name, fn in peers:
                try:
                    run = torch_fwd_grad(fn, z, y)
                    extra = peak_extra_mib(run, nbytes)  # the gradient itself is not extra
                    rec("forward+grad", name, bench_ms(run, warmup=5, rep=30), extra)
                except torch.cuda.OutOfMemoryError:
                    print(f"  {name} {N}x{V} {dt}: out of memory")
                gc.collect()
                torch.cuda.empty_cache()
        del z, y, grad
        gc.collect()
        torch.cuda.empty_cache()
        print_table([r for r in records if r["N"] == N and r["V"] == V and r["dtype"] == dt],
                    ["op", "impl", "dtype", "N", "V", "ms", "tbps", "pct_of_copy", "extra_mib"])
        print()
    name = write_results(records, "ce-matrix" if args.matrix else "ce", [RESULTS, args.out])
    print(f"wrote bench/results/{name}")


if __name__ == "__main__":
    main()
