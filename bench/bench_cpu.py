"""CPU benchmark: fusedce's CPU backend against PyTorch CPU (NumPy when torch is not installed).

  cross-entropy  loss + gradient (mean, float32) of logits [N, V]:  1024 x 128256, 4096 x 32000
  linear CE      loss + dh + dW (mean, float32), N in {512, 2048}, D = 1024, V = 32000, with the
                 machine's sgemm rate for the same three GEMMs (h.Wt, dz.W, dzt.h) measured in the
                 same run: fusedce's 6 N D V / time as a percentage of it.

Timings are the best of --reps runs after a warm-up, on every core torch / OpenBLAS use (the
whole machine). Prints a table and writes bench/results/cpu-<machine>.json (harness.write) with
the machine (/proc/cpuinfo model name and core count) and the torch / NumPy versions.

  FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python bench/bench_cpu.py
"""
import argparse
import os
import platform
import re
import time

import numpy as np

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
if "FUSEDCE_LIBRARY" not in os.environ:
    for cand in ("build/libfusedce.so", os.path.join(HERE, "..", "build", "libfusedce.so")):
        if os.path.exists(cand):
            os.environ["FUSEDCE_LIBRARY"] = os.path.abspath(cand)
            break
import fusedce  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # NumPy baseline
    torch = None


def machine():
    model, cores = platform.processor() or platform.machine(), os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if m:
            model = m.group(1).strip()
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    return model, cores


def best_ms(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


# ------------------------------------------------------------------ cross-entropy ----
def ce_case(N, V, reps, rng):
    z = rng.standard_normal((N, V), dtype=np.float32)
    y = rng.integers(0, V, size=N, dtype=np.int64)
    grad = np.empty_like(z)

    def fce():
        fusedce.forward(z, y, reduction="mean", grad_logits=grad, backend="cpu")

    out = {"N": N, "V": V, "fusedce_ms": best_ms(fce, reps)}
    if torch is not None:
        zt, yt = torch.from_numpy(z).requires_grad_(), torch.from_numpy(y)

        def ref():
            zt.grad = None
            F.cross_entropy(zt, yt, reduction="mean").backward()

        out["baseline"] = "torch"
    else:
        def ref():
            m = z.max(axis=1, keepdims=True)
            e = np.exp(z - m)
            s = e.sum(axis=1, keepdims=True)
            loss = (np.log(s[:, 0]) + m[:, 0] - z[np.arange(N), y]).mean()
            g = e / s
            g[np.arange(N), y] -= 1.0
            g /= N
            return loss, g

        out["baseline"] = "numpy"
    out["baseline_ms"] = best_ms(ref, reps)
    out["ratio"] = out["fusedce_ms"] / out["baseline_ms"]
    # a sanity check: the same loss
    res = fusedce.forward(z, y, reduction="mean", grad_logits=grad, backend="cpu")
    zt64 = z.astype(np.float64)
    m = zt64.max(axis=1)
    lse = m + np.log(np.exp(zt64 - m[:, None]).sum(axis=1))
    want = float((lse - zt64[np.arange(N), y]).mean())
    out["loss_rel_err"] = abs(float(res.loss) - want) / abs(want)
    return out


# ---------------------------------------------------------------------- linear CE ----
def linear_case(N, D, V, reps, rng):
    h = (rng.standard_normal((N, D), dtype=np.float32) * 0.5).astype(np.float32)
    W = (rng.standard_normal((V, D), dtype=np.float32) * (1.0 / np.sqrt(D))).astype(np.float32)
    y = rng.integers(0, V, size=N, dtype=np.int64)
    dh, dW = np.empty_like(h), np.empty_like(W)
    nbytes = fusedce.linear_ce_workspace_size(N, D, V, with_grad=True)[1]
    ws = np.empty(max(1, nbytes), dtype=np.uint8)

    def fce():
        fusedce.linear_ce(h, W, y, reduction="mean", grad_hidden=dh, grad_weight=dW, workspace=ws,
                          backend="cpu")

    flops = 6.0 * N * D * V
    out = {"N": N, "D": D, "V": V, "fusedce_ms": best_ms(fce, reps)}
    dz = rng.standard_normal((N, V), dtype=np.float32)
    if torch is not None:
        ht, Wt, yt, dzt = (torch.from_numpy(a) for a in (h, W, y, dz))
        ht.requires_grad_()
        Wt.requires_grad_()
        z_buf = torch.empty(N, V)
        dh_buf, dW_buf = torch.empty(N, D), torch.empty(V, D)

        def ref():
            ht.grad = None
            Wt.grad = None
            F.cross_entropy(ht @ Wt.t(), yt, reduction="mean").backward()

        def gemms():  # the three GEMMs of the same shapes, into preallocated outputs
            with torch.no_grad():
                torch.mm(ht, Wt.t(), out=z_buf)
                torch.mm(dzt, Wt, out=dh_buf)
                torch.mm(dzt.t(), ht, out=dW_buf)

        out["baseline"] = "torch"
    else:
        z_buf, dh_buf, dW_buf = np.empty((N, V), np.float32), np.empty_like(h), np.empty_like(W)

        def ref():
            z = h @ W.T
            m = z.max(axis=1, keepdims=True)
            e = np.exp(z - m)
            s = e.sum(axis=1, keepdims=True)
            g = e / s
            g[np.arange(N), y] -= 1.0
            g /= N
            return g @ W, g.T @ h

        def gemms():
            np.matmul(h, W.T, out=z_buf)
            np.matmul(dz, W, out=dh_buf)
            np.matmul(dz.T, h, out=dW_buf)

        out["baseline"] = "numpy"
    out["baseline_ms"] = best_ms(ref, reps)
    out["sgemm_ms"] = best_ms(gemms, reps)
    out["ratio"] = out["fusedce_ms"] / out["baseline_ms"]
    out["fusedce_gflops"] = flops / out["fusedce_ms"] * 1e-6
    out["sgemm_gflops"] = flops / out["sgemm_ms"] * 1e-6
    out["pct_of_sgemm"] = 100.0 * out["fusedce_gflops"] / out["sgemm_gflops"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the smaller shape of each kind only")
    ap.add_argument("--out", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    model, cores = machine()
    if torch is not None:
        torch.set_num_threads(cores)
    info = {
        "machine": f"{model}, {cores} cores",
        "cpu_model": model,
        "cores": cores,
        "baseline": "torch" if torch is not None else "numpy",
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "numpy": np.__version__,
        "fusedce": getattr(fusedce, "__version__", None),
        "library": os.environ.get("FUSEDCE_LIBRARY"),
        "timing": f"best of {args.reps} after one warm-up, wall clock",
        "dtype": "float32",
    }
    ce_shapes = [(4096, 32000)] if args.quick else [(1024, 128256), (4096, 32000)]
    lin_shapes = [(512, 1024, 32000)] if args.quick else [(512, 1024, 32000), (2048, 1024, 32000)]
    print(f"# {info['machine']}; baseline {info['baseline']} {info['torch'] or info['numpy']}")
    ce = []
    print(f"{'cross-entropy (loss + grad, mean)':36s} {'fusedce ms':>11s} {info['baseline']+' ms':>10s} {'ratio':>6s}")
    for N, V in ce_shapes:
        r = ce_case(N, V, args.reps, rng)
        ce.append(r)
        print(f"{f'{N} x {V}':36s} {r['fusedce_ms']:11.1f} {r['baseline_ms']:10.1f} {r['ratio']:6.2f}",
              flush=True)
    lin = []
    print(f"\n{'linear CE (loss + dh + dW, mean)':36s} {'fusedce ms':>11s} {info['baseline']+' ms':>10s} "
          f"{'ratio':>6s} {'GFLOP/s':>8s} {'sgemm GFLOP/s':>14s} {'% sgemm':>8s}")
    for N, D, V in lin_shapes:
        r = linear_case(N, D, V, args.reps, rng)
        lin.append(r)
        print(f"{f'N={N} D={D} V={V}':36s} {r['fusedce_ms']:11.1f} {r['baseline_ms']:10.1f} "
              f"{r['ratio']:6.2f} {r['fusedce_gflops']:8.1f} {r['sgemm_gflops']:14.1f} "
              f"{r['pct_of_sgemm']:7.1f}%", flush=True)
    name = re.sub(r"[^A-Za-z0-9]+", "-", f"{model}-{cores}c").strip("-")
    run = harness.run_info(machine=info["machine"], cpu_model=model, cores=cores,
                           baseline=info["baseline"], baseline_version=info["torch"] or info["numpy"],
                           numpy=info["numpy"], timing=info["timing"], dtype="float32", reps=args.reps)
    records = [dict(op="ce", **r) for r in ce] + [dict(op="linear_ce", **r) for r in lin]
    harness.write("cpu", name, run, records, [args.out])
    path = harness.result_path("cpu", name)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
