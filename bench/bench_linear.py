"""Fused linear + cross-entropy, forward + all gradients: fusedce against torch eager,
torch.compile, Liger-Kernel and cut-cross-entropy, and the floor 6*N*D*V / (bf16 rate of a plain
8192^3 product measured in this run), through the C ABI (ctypes). Writes
bench/results/linear-<device>.json (and DIR/).

fusedce rows: "fusedce-1GiB" is the default budget of fusedce.torch.linear_cross_entropy (what
users get), "fusedce" the optimal workspace the size query returns, the fp32dW rows a float32
grad_weight. "gemms-unchunked": the three products of 6*N*D*V (logits, dh, dW) at their whole
shapes through torch.matmul, without any cross-entropy work: the GEMM time of this very problem,
hot, in this run (what a CE inside the GEMMs could at best reach; the floor's 8192^3 rate is
taken after 0.3 s of warm-up).
"floor-hot", "…-interleaved": the same three (an 8192^3 product for the rate, fusedce at the
default budget, the products alone) timed in turns, in one thermal state.
Timing: harness.time_iters_ms (CUDA events around each call, L2 flushed before each, medians).
    python3 bench/bench_linear.py [--shapes 8192x4096x128256xbf16,...] [--no-peers] [--out DIR]
"""
import argparse
import ctypes
import gc

import torch
import torch.nn.functional as F

import harness
from fusedce import _lib
from harness import options, peak_extra_mib, print_table, ptr, stream

# the shapes of docs/performance.md's tables; 65536x4096x128256 with --shapes
SHAPES = [(8192, 4096, 128256, "bf16"), (8192, 2304, 256000, "bf16"), (16384, 4096, 32000, "bf16"),
          (32768, 4096, 151936, "bf16")]


class Fused:
    """fce_linear_ce with a given workspace; gradients into preallocated buffers."""

    def __init__(self, h, W, y, ws_bytes=None, grad=True, fp32_dw=False):
        N, D = h.shape
        V = W.shape[0]
        self.o = options(h.dtype, grad_weight_fp32=int(fp32_dw))
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.call("fce_linear_ce_workspace_size", ctypes.byref(self.o), N, D, V, int(grad),
                  ctypes.byref(lo), ctypes.byref(hi))
        self.min_bytes, self.opt_bytes = lo.value, hi.value
        self.ws_bytes = hi.value if ws_bytes is None else max(ws_bytes, lo.value)
        self.ws = torch.empty(max(self.ws_bytes, 16), dtype=torch.uint8, device="cuda")
        self.loss = torch.empty(1, device="cuda")
        self.dh = torch.empty_like(h) if grad else None
        self.dW = (torch.empty(W.shape, device="cuda", dtype=torch.float32 if fp32_dw else W.dtype)
                   if grad else None)
        self.args = (N, D, V, h, W, y)

    def __call__(self):
        N, D, V, h, W, y = self.args
        out = _lib.outputs(loss=self.loss.data_ptr())
        grads = _lib.gradients(grad_hidden=self.dh.data_ptr() if self.dh is not None else None,
                               grad_weight=self.dW.data_ptr() if self.dW is not None else None)
        _lib.check(_lib.load().fce_linear_ce(
            ctypes.byref(self.o), N, D, V, ptr(h), ptr(W), None, ptr(y), ctypes.byref(out),
            ctypes.byref(grads) if self.dh is not None else None, ptr(self.ws), self.ws_bytes,
            stream()), "fce_linear_ce")


def products(h, W):
    """The three products of 6*N*D*V at their whole shapes (logits, dh, dW), no CE work; the
    logits buffer stands in for dZ (same shapes)."""
    z = torch.empty(h.shape[0], W.shape[0], device="cuda", dtype=h.dtype)
    dh, dW = torch.empty_like(h), torch.empty_like(W)

    def run():
        torch.matmul(h, W.t(), out=z)
        torch.matmul(z, W, out=dh)
        torch.matmul(z.t(), h, out=dW)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 8192x4096x128256xbf16")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-interleave", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [(int(a), int(b), int(c), d) for a, b, c, d in (s.split("x") for s in args.shapes.split(","))]
    peers = []
    if not args.no_peers:
        def eager(h, W, y):
            return F.cross_entropy(F.linear(h, W).float(), y)
        peers.append(("torch-eager", eager))
        peers.append(("torch-compile", torch.compile(eager)))
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            peers.append(("liger", lambda h, W, y: liger_fused_linear_cross_entropy(h, W, y)))
        except Exception as e:  # noqa: BLE001
            print(f"Liger-Kernel not available ({e})")
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
            peers.append(("cce", lambda h, W, y: cce(h, W, y)))
            peers.append(("cce-exact", lambda h, W, y: cce(h, W, y, filter_eps=None)))
            peers.append(("cce-torch-compile", lambda h, W, y: cce(h, W, y, impl="torch_compile")))
        except Exception as e:  # noqa: BLE001
            print(f"cut-cross-entropy not available ({e})")

    dev = harness.device_name()
    rate = harness.gemm_tflops()
    run_meta = harness.run_info(gemm_tflops=round(rate, 1))
    print(f"device {dev}: bf16 8192^3 product {rate:.0f} TFLOP/s")
    records = []
    for N, D, V, dt in shapes:
        dtype = harness.dtypes()[dt]
        gen = torch.Generator(device="cuda").manual_seed(N + D + V)
        h = torch.randn(N, D, device="cuda", generator=gen).to(dtype)
        W = (torch.randn(V, D, device="cuda", generator=gen) * (2.0 / D ** 0.5)).to(dtype)
        y = torch.randint(0, V, (N,), device="cuda", generator=gen)
        flops = 6.0 * N * D * V
        floor_ms = flops / (rate * 1e12) * 1e3

        def rec(impl, ms, extra, fl=flops, fm=floor_ms):
            records.append(dict(op="forward+grad" if fl == flops else "forward", impl=impl, dtype=dt, N=N, D=D, V=V,
                                ms=round(ms, 3), tflops=round(fl / (ms * 1e-3) / 1e12, 1),
                                pct_of_floor=round(100 * fm / ms, 1), extra_mib=round(extra, 1)))

        rec("floor", floor_ms, 0)
        grads_mib = (N * D + V * D) * h.element_size() / 2 ** 20
        # fusedce variants: (name, workspace bytes or None = optimal, float32 dW). A float32 dW
        # holds V*D*2 bytes more than the dtype's: counted as extra memory.
        variants = [("fusedce-1GiB", 1 << 30, False), ("fusedce", None, False),
                    ("fusedce-1GiB-fp32dW", 1 << 30, True),
                    ("fusedce-64MiB", 64 << 20, False), ("fusedce-64MiB-fp32dW", 64 << 20, True)]
        for impl, ws, fp32_dw in variants:
            try:
                f = Fused(h, W, y, ws_bytes=ws, fp32_dw=fp32_dw)
                if ws is not None and f.min_bytes > ws:
                    print(f"  {impl}: not run: the minimum workspace is {f.min_bytes / 2**20:.0f} MiB")
                    del f
                    continue
                f()
                extra = f.ws_bytes / 2 ** 20 + (V * D * (4 - h.element_size()) / 2 ** 20 if fp32_dw else 0)
                rec(impl, harness.time_iters_ms(f, warmup=2, reps=10), extra)
                del f
            except _lib.FusedCEError as e:
                print(f"  {impl}: {e}")
            gc.collect()
            torch.cuda.empty_cache()
        # the products alone, whole
        try:
            gemms = products(h, W)
            gemms()
            rec("gemms-unchunked", harness.time_iters_ms(gemms, warmup=2, reps=10), N * V * h.element_size() / 2 ** 20)
            del gemms
        except torch.cuda.OutOfMemoryError:
            print("  gemms-unchunked: out of memory")
        gc.collect()
        torch.cuda.empty_cache()
        # The same in one thermal state: rounds of (a plain 8192^3 product, fusedce at the default
        # budget, the products alone) taken in turn, medians. The GEMMs of a long run clock lower
        # than the short 8192^3 product taken first (dev/NOTES.md, "Linear CE in turns with the
        # products alone"):
        # "floor-hot" is 6*N*D*V at the rate of that product measured between the others.
        if not args.no_interleave:
            try:
                a8 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
                b8 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
                gemms = products(h, W)
                f = Fused(h, W, y, ws_bytes=1 << 30)
                turns = {"gemm8192": lambda: a8 @ b8, "fusedce-1GiB": f, "gemms-unchunked": gemms}
                times = {k: [] for k in turns}
                for _ in range(args.rounds):
                    for k, fn in turns.items():
                        times[k].append(harness.time_iters_ms(fn, warmup=1, reps=5))
                med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
                hot_rate = 2 * 8192 ** 3 / (med["gemm8192"] * 1e-3) / 1e12
                hot_floor = flops / (hot_rate * 1e12) * 1e3
                rec("floor-hot", hot_floor, 0, fm=hot_floor)
                rec("fusedce-1GiB-interleaved", med["fusedce-1GiB"], f.ws_bytes / 2 ** 20, fm=hot_floor)
                rec("gemms-unchunked-interleaved", med["gemms-unchunked"], N * V * h.element_size() / 2 ** 20,
                    fm=hot_floor)
                print(f"  interleaved ({args.rounds} rounds): 8192^3 {hot_rate:.0f} TFLOP/s, "
                      f"fusedce-1GiB {med['fusedce-1GiB']:.2f} ms = {med['fusedce-1GiB'] / hot_floor:.3f}x floor-hot, "
                      f"{med['fusedce-1GiB'] / med['gemms-unchunked']:.3f}x the products alone")
                del a8, b8, gemms, f
            except torch.cuda.OutOfMemoryError:
                print("  interleaved: out of memory")
            gc.collect()
            torch.cuda.empty_cache()
        f = Fused(h, W, y, grad=False)
        rec("fusedce-loss-only", harness.time_iters_ms(f, warmup=2, reps=10), f.ws_bytes / 2 ** 20, fl=flops / 3, fm=floor_ms / 3)
        del f
        for name, fn in peers:
            if N * V > 16384 * 128256 and name.startswith("torch"):
                continue  # the unfused logits alone exceed the card
            hh = h.detach().requires_grad_(True)
            WW = W.detach().requires_grad_(True)

            def run():
                hh.grad = WW.grad = None
                fn(hh, WW, y).backward()
            try:
                run()
                extra = peak_extra_mib(run, 0) - grads_mib
                rec(name, harness.time_iters_ms(run, warmup=1, reps=5), max(extra, 0.0))
            except torch.cuda.OutOfMemoryError:
                print(f"  {name}: out of memory")
            del hh, WW
            gc.collect()
            torch.cuda.empty_cache()
        del h, W, y
        gc.collect()
        torch.cuda.empty_cache()
        print_table([r for r in records if (r["N"], r["D"], r["V"]) == (N, D, V)],
                    ["op", "impl", "dtype", "N", "D", "V", "ms", "tflops", "pct_of_floor", "extra_mib"])
        print()
    harness.write("linear", dev, run_meta, records, [args.out])
    print(f"wrote {harness.result_path('linear', dev)}")


if __name__ == "__main__":
    main()
