"""Loss + .backward() through each library's torch API: fusedce.torch against Liger-Kernel,
cut-cross-entropy, Quack, torch eager and torch.compile, plus fusedce's raw one-pass C call.

One iteration = every input's .grad set to None, loss = f(inputs), loss.backward().
Time: cross-entropy over logits ("ce"): triton do_bench median; linear + cross-entropy
("linear_ce", 20 ms to 1 s an iteration): median of LIN_REP event-timed iterations after
LIN_WARMUP warm-up ones. An impl whose iteration takes more than SLOW_MS is timed once.
Every impl first runs one untimed iteration (torch.compile compiles, Triton / CuTe JIT).
Memory, extra_mib: gradients of the previous iteration freed, gc, empty_cache; baseline =
memory_allocated() (the inputs); peak = max_memory_allocated() over one iteration; extra =
peak - baseline - the bytes of every input's .grad that is a new tensor (a gradient written
over its input's storage costs nothing new). The loss tensor (4 bytes) is ignored.
Ceilings from this same run: device-to-device copy TB/s (ce: ideal_ms = N*V*e read + N*V*e
written at that rate) and the bf16 8192^3 GEMM TFLOP/s (linear_ce: floor_ms = 6*N*D*V at that rate).
Writes bench/results/torch-<device>.json (and --out DIR), draws torch-<device>.png beside it.
  python3 bench_torch.py [--ops ce,linear_ce] [--impls a,b] [--shapes 4096x50257,8192x4096x128256]
                         [--out DIR] [--merge]
"""
import argparse
import gc
import inspect
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from common import DTYPES, bench_ms, copy_tbps, device_name, gemm_tflops, print_table

HERE = os.path.dirname(os.path.abspath(__file__))
CE_SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16"),
             (4096, 50257, "bf16")]
LIN_SHAPES = [(8192, 4096, 128256, "bf16"), (8192, 2304, 256000, "bf16"),
              (16384, 4096, 32000, "bf16"), (32768, 4096, 151936, "bf16")]  # N, D, V
# Quack last in each list: a peer that faults the CUDA context fails every impl after it.
CE_IMPLS = ["fusedce-c-abi", "fusedce", "fusedce-inplace", "liger", "torch-eager",
            "torch-compile", "quack"]
LIN_IMPLS = ["fusedce", "fusedce-lean", "liger", "cce", "cce-exact", "torch-eager",
             "torch-compile", "quack"]
LEAN_BYTES = 128 << 20  # fusedce-lean: 128 MiB of scratch + the float32 [N, D] ∂h accumulator
                        # the vocab-sliced plan needs (the lean budget), as workspace_bytes
SLOW_MS = 2000.0        # one iteration slower than this: no further repetitions
LIN_WARMUP, LIN_REP = 2, 5
CE_WARMUP_MS, CE_REP_MS = 10, 100  # do_bench's budgets, in ms
IGNORE = -100


def ce_eager(z, y):
    return F.cross_entropy(z.float(), y)


def lin_eager(h, W, y):
    return F.cross_entropy(F.linear(h, W).float(), y)


_COMPILED = {}


def compiled(fn):
    """torch.compile(fn), static shapes (one compile per shape; nothing happens until a call)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def noted(fn, note):
    fn.note = note  # recorded in the row, e.g. which exact mode of cut-cross-entropy ran
    return fn


def ce_loss_fn(impl):
    """loss(z, y) for a CE impl. Imports happen here: a missing peer fails only its own rows."""
    if impl in ("fusedce", "fusedce-inplace"):
        import fusedce.torch as fce_torch
        if impl == "fusedce":
            return lambda z, y: fce_torch.cross_entropy(z, y)
        return lambda z, y: fce_torch.cross_entropy(z, y, inplace_backward=True)
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_cross_entropy
        return lambda z, y: liger_cross_entropy(z, y)
    if impl == "quack":
        from quack.cross_entropy import cross_entropy as qce
        params = inspect.signature(qce).parameters
        if "ignore_index" not in params:  # targets of -100 would be read as classes
            raise RuntimeError("this quack's cross_entropy has no ignore_index")
        if "reduction" in params:
            return lambda z, y: qce(z, y, reduction="mean")
        return noted(lambda z, y: qce(z, y).sum() / (y != IGNORE).sum(), "per-row loss, mean in torch")
    if impl == "torch-eager":
        return ce_eager
    if impl == "torch-compile":
        return compiled(ce_eager)
    raise ValueError(impl)


def lin_loss_fn(impl):
    """loss(h, W, y) for a linear CE impl."""
    if impl in ("fusedce", "fusedce-lean"):
        import fusedce.torch as fce_torch
        if impl == "fusedce":
            return lambda h, W, y: fce_torch.linear_cross_entropy(h, W, y)
        return lambda h, W, y: fce_torch.linear_cross_entropy(
            h, W, y, workspace_bytes=LEAN_BYTES + h.shape[0] * h.shape[1] * 4)
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lflce
        return lambda h, W, y: lflce(h, W, y)
    if impl in ("cce", "cce-exact"):
        import cut_cross_entropy
        cce = cut_cross_entropy.linear_cross_entropy
        if impl == "cce":
            return lambda h, W, y: cce(h, W, y)
        enum = getattr(cut_cross_entropy, "LinearCrossEntropyImpl", None)
        if enum is not None and hasattr(enum, "CCE_EXACT"):
            return noted(lambda h, W, y: cce(h, W, y, impl="cce_exact"), "impl=cce_exact")
        if "filter_eps" in inspect.signature(cce).parameters:
            return noted(lambda h, W, y: cce(h, W, y, filter_eps=None), "filter_eps=None")
        raise RuntimeError("this cut-cross-entropy has no exact mode")
    if impl == "quack":
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as qlce
        if "ignore_index" not in inspect.signature(qlce).parameters:
            raise RuntimeError("this quack's chunked_linear_cross_entropy has no ignore_index")
        return lambda h, W, y: qlce(h, W, y)
    if impl == "torch-eager":
        return lin_eager
    if impl == "torch-compile":
        return compiled(lin_eager)
    raise ValueError(impl)


def targets(N, V, gen):
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    y[torch.rand(N, device="cuda", generator=gen) < 0.05] = IGNORE
    return y


def step_of(fn, leaves, args):
    def step():
        for t in leaves:
            t.grad = None
        fn(*args).backward()
    return step


def free(leaves=()):
    for t in leaves:
        t.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def new_grad_bytes(leaves):
    """Bytes of the inputs' gradients that do not share storage with an input."""
    inputs = {t.untyped_storage().data_ptr() for t in leaves}
    return sum(t.grad.numel() * t.grad.element_size() for t in leaves
               if t.grad is not None and t.grad.untyped_storage().data_ptr() not in inputs)


def timed(step):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def measure(step, leaves, slow):
    """{ms, extra_mib, grad_mib, timing}. leaves None: memory not measured (raw C call)."""
    step()  # untimed warm-up: compiles, JITs, allocator settles
    out = {}
    if leaves is not None:
        free(leaves)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        grads = new_grad_bytes(leaves)  # 0 for a gradient written over its input
        out.update(extra_mib=max(0.0, (peak - base - grads) / 2 ** 20), grad_mib=grads / 2 ** 20)
        free(leaves)
    first = timed(step)  # the time guard; also the first of the warm-up iterations
    if first > SLOW_MS:
        return dict(out, ms=first, timing="1 iteration (slow)")
    if not slow:
        return dict(out, ms=bench_ms(step, warmup=CE_WARMUP_MS, rep=CE_REP_MS), timing="do_bench median")
    for _ in range(LIN_WARMUP - 1):
        step()
    return dict(out, ms=statistics.median([timed(step) for _ in range(LIN_REP)]), timing=f"median of {LIN_REP}")


def shape_str(r):
    return f"{r['N']}x{r['D']}x{r['V']}" if r["op"] == "linear_ce" else f"{r['N']}x{r['V']}"


def run_impl(rec, go, on_success):
    """Runs go() -> measure()'s dict into rec; a failure keeps the row with its reason."""
    t0 = time.time()
    try:
        got = go()
        rec.update({k: round(v, 1 if k.endswith("mib") else 4) if isinstance(v, float) else v
                    for k, v in got.items() if v is not None})
        on_success(rec)
    except Exception as e:  # noqa: BLE001 - OOM, import errors, peers' own errors
        lines = str(e).strip().splitlines()
        rec.update(ms=None, extra_mib=None, error=f"{type(e).__name__}: {lines[0] if lines else ''}"[:240])
    try:
        free()
    except Exception as e:  # noqa: BLE001 - a faulted context fails here too; keep going
        print(f"  cleanup failed: {e}")
    what = f"{rec['ms']} ms, {rec['extra_mib']} MiB" if rec["ms"] is not None else rec["error"]
    print(f"  {rec['op']} {shape_str(rec)} {rec['impl']}: {what}  ({time.time() - t0:.0f} s)", flush=True)


def run_ce(N, V, dt, impls, ceil, records):
    dtype = DTYPES[dt]
    ideal = 2 * N * V * (torch.finfo(dtype).bits // 8) / (ceil["copy_tbps"] * 1e12) * 1e3
    for impl in impls:
        rec = dict(op="ce", impl=impl, dtype=dt, N=N, V=V, ideal_ms=round(ideal, 4), **ceil)

        def go():
            gen = torch.Generator(device="cuda").manual_seed(N + V)
            # Fresh logits for every impl. In-place impls (fusedce-inplace, liger) overwrite
            # them with the gradient: they are then timed again and again on that same buffer,
            # whose values change (the gradient, then its gradient...) but not the work done.
            z = torch.randn(N, V, device="cuda", dtype=dtype, generator=gen).mul_(4)
            y = targets(N, V, gen)
            if impl == "fusedce-c-abi":  # fce_forward, one pass, grad_output NULL: time only
                from bench_ce import fusedce_fns
                grad = torch.empty_like(z)
                _, fwd_grad, ws_mib, _ = fusedce_fns(z, y, grad)
                return dict(measure(fwd_grad, None, slow=False), extra_mib=ws_mib,
                            note="extra_mib = its workspace; gradient into a preallocated buffer")
            z.requires_grad_(True)
            fn = ce_loss_fn(impl)
            return dict(measure(step_of(fn, [z], (z, y)), [z], slow=False), note=getattr(fn, "note", None))

        run_impl(rec, go, lambda r: r.update(pct_of_copy=round(100 * ideal / r["ms"], 1)))
        records.append(rec)


def run_linear(N, D, V, dt, impls, ceil, records):
    dtype = DTYPES[dt]
    floor = 6.0 * N * D * V / (ceil["gemm_tflops"] * 1e12) * 1e3
    for impl in impls:
        rec = dict(op="linear_ce", impl=impl, dtype=dt, N=N, V=V, D=D, floor_ms=round(floor, 3), **ceil)

        def go():
            gen = torch.Generator(device="cuda").manual_seed(N + D + V)
            h = torch.randn(N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
            W = torch.randn(V, D, device="cuda", dtype=dtype, generator=gen).mul_(2.0 / D ** 0.5)
            W.requires_grad_(True)
            y = targets(N, V, gen)
            fn = lin_loss_fn(impl)
            return dict(measure(step_of(fn, [h, W], (h, W, y)), [h, W], slow=True), note=getattr(fn, "note", None))

        run_impl(rec, go, lambda r: r.update(ratio_to_floor=round(r["ms"] / floor, 3)))
        records.append(rec)


def key(r):
    return tuple(r.get(k) for k in ("op", "impl", "dtype", "N", "V", "D"))


def load_existing(name, dirs):
    for d in dirs:
        p = os.path.join(d, name) if d else None
        if p and os.path.exists(p):
            with open(p) as f:
                print(f"merging into {p}")
                return json.load(f)
    print(f"--merge: no {name} found; starting a new one")
    return []


def save(records, existing, dirs, name):
    """existing minus the (op, impl, shape) measured now, plus records; adds ratio_to_c_abi."""
    now = {key(r) for r in records}
    allr = [r for r in existing if key(r) not in now] + records
    rank = {i: n for n, i in enumerate(dict.fromkeys(CE_IMPLS + LIN_IMPLS))}
    shapes = list(dict.fromkeys((r["op"], shape_str(r)) for r in allr))
    allr.sort(key=lambda r: (r["op"] != "ce", shapes.index((r["op"], shape_str(r))), rank.get(r["impl"], 99)))
    c_abi = {key(r)[2:]: r["ms"] for r in allr
             if r["op"] == "ce" and r["impl"] == "fusedce-c-abi" and r.get("ms")}
    for r in allr:
        if r["op"] == "ce" and r["impl"].startswith("fusedce"):
            c = c_abi.get(key(r)[2:])
            r["ratio_to_c_abi"] = round(r["ms"] / c, 3) if c and r.get("ms") else None
    for d in dirs:
        if d:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, name), "w") as f:
                json.dump(allr, f, indent=1)
    return allr


def plot(recs, dev, paths):
    """Rows: ce, linear_ce (those with data); columns: ms, extra MiB (log). Failures left out."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"no plot: matplotlib does not import ({e})")
        return
    ok = [r for r in recs if r.get("ms") is not None]
    ops = [o for o in ("ce", "linear_ce") if any(r["op"] == o for r in ok)]
    if not ops:
        return
    order = list(dict.fromkeys(CE_IMPLS + LIN_IMPLS))
    impls = sorted({r["impl"] for r in ok}, key=lambda i: (order.index(i) if i in order else 99, i))
    fig, axes = plt.subplots(len(ops), 2, figsize=(16, 4.8 * len(ops)), squeeze=False)
    for row, op in enumerate(ops):
        rs = [r for r in ok if r["op"] == op]
        shapes = list(dict.fromkeys(shape_str(r) for r in rs))
        mine = CE_IMPLS if op == "ce" else LIN_IMPLS  # bars in the op's own order; colors global
        names = sorted({r["impl"] for r in rs}, key=lambda i: (mine.index(i) if i in mine else 99, i))
        w = 0.84 / len(names)
        for j, impl in enumerate(names):
            got = {shape_str(r): r for r in rs if r["impl"] == impl}
            xs = [i - 0.42 + w * (j + 0.5) for i, s in enumerate(shapes) if s in got]
            ms = [got[s]["ms"] for s in shapes if s in got]
            mib = [max(got[s].get("extra_mib") or 0.0, 0.1) for s in shapes if s in got]
            color = f"C{impls.index(impl) % 10}"
            axes[row][0].bar(xs, ms, w, label=impl, color=color)
            axes[row][1].bar(xs, mib, w, label=impl, color=color)
        what = "cross-entropy over logits [N x V]" if op == "ce" else "linear + cross-entropy [N x D x V]"
        for col, lab in enumerate(("ms per loss + backward", "extra MiB beyond inputs and grads (0 shown as 0.1)")):
            ax = axes[row][col]
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=8)
            ax.set_title(f"{what}: {lab}", fontsize=9)
        axes[row][1].set_yscale("log")
        axes[row][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{dev}, bf16, loss + backward through each torch API", fontsize=11)
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=110)
        print(f"wrote {p}")
    plt.close(fig)


def parse_shapes(text, ap):
    ce, lin = [], []
    for tok in text.split(","):
        parts = tok.strip().lower().split("x")
        dt = parts.pop() if parts[-1] in DTYPES else "bf16"
        try:
            nums = tuple(int(p) for p in parts)
        except ValueError:
            ap.error(f"bad shape {tok!r}")
        if len(nums) == 2:
            ce.append(nums + (dt,))
        elif len(nums) == 3:
            lin.append(nums + (dt,))
        else:
            ap.error(f"shape {tok!r}: NxV (ce) or NxDxV (linear_ce), optionally xbf16")
    return ce, lin


def main():
    ap = argparse.ArgumentParser(description="loss + backward through each library's torch API")
    ap.add_argument("--ops", default="ce,linear_ce")
    ap.add_argument("--impls", default=None, help="comma list of " + ",".join(dict.fromkeys(CE_IMPLS + LIN_IMPLS)))
    ap.add_argument("--shapes", default=None, help="e.g. 4096x50257,8192x4096x128256 (NxV for ce, "
                    "NxDxV for linear_ce, optional xbf16); replaces both default lists")
    ap.add_argument("--out", default=None, help="also write the JSON and PNG there")
    ap.add_argument("--merge", action="store_true", help="replace only the rows measured now in "
                    "the existing bench/results (or --out) torch-<device>.json")
    args = ap.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or set(ops) - {"ce", "linear_ce"}:
        ap.error("--ops takes ce and/or linear_ce")
    wanted = None if args.impls is None else [i.strip() for i in args.impls.split(",") if i.strip()]
    if wanted is not None and set(wanted) - set(CE_IMPLS + LIN_IMPLS):
        ap.error(f"unknown impls {sorted(set(wanted) - set(CE_IMPLS + LIN_IMPLS))}")
    ce_impls = [i for i in CE_IMPLS if wanted is None or i in wanted]
    lin_impls = [i for i in LIN_IMPLS if wanted is None or i in wanted]
    ce_shapes, lin_shapes = parse_shapes(args.shapes, ap) if args.shapes else (CE_SHAPES, LIN_SHAPES)
    try:  # static compiles: one per shape and function, more than dynamo's default limit of 8
        from torch import _dynamo
        for k in ("cache_size_limit", "recompile_limit"):
            if hasattr(_dynamo.config, k):
                setattr(_dynamo.config, k, 64)
    except Exception as e:  # noqa: BLE001
        print(f"could not raise dynamo's recompile limit ({e})")

    dev = device_name()
    copy, rate = copy_tbps(4 << 30), gemm_tflops()
    ceil = dict(device=dev, copy_tbps=round(copy, 3), gemm_tflops=round(rate, 1))
    print(f"device {dev}: copy {copy:.2f} TB/s (read + written, 4 GiB), bf16 8192^3 GEMM {rate:.0f} TFLOP/s")
    name = f"torch-{dev}"
    dirs = [os.path.join(HERE, "results"), args.out]
    existing = load_existing(name + ".json", dirs) if args.merge else []
    records, t0 = [], time.time()
    if "ce" in ops:
        for N, V, dt in ce_shapes:
            run_ce(N, V, dt, ce_impls, ceil, records)
            save(records, existing, dirs, name + ".json")  # after each shape: a crash keeps them
    if "linear_ce" in ops:
        for N, D, V, dt in lin_shapes:
            run_linear(N, D, V, dt, lin_impls, ceil, records)
            save(records, existing, dirs, name + ".json")
    allr = save(records, existing, dirs, name + ".json")
    print(f"wrote {os.path.join(dirs[0], name + '.json')} ({len(allr)} records) in {time.time() - t0:.0f} s")
    try:
        plot(allr, dev, [os.path.join(d, name + ".png") for d in dirs if d])
    except Exception as e:  # noqa: BLE001 - the JSON is written; a plot problem is not fatal
        print(f"plot failed: {type(e).__name__}: {e}")
    for op, col in (("ce", "pct_of_copy"), ("linear_ce", "ratio_to_floor")):
        rows = [dict(r, shape=shape_str(r)) for r in records if r["op"] == op]
        if rows:
            print(f"\n{op} ({dev})")
            print_table(rows, ["impl", "shape", "ms", "extra_mib", col, "error"])


if __name__ == "__main__":
    main()
