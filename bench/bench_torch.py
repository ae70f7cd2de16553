"""Loss + .backward() through each library's torch API, side by side in one run: fusedce.torch
against Liger-Kernel (its Triton path and its CuTe DSL path), Quack, Cut Cross-Entropy, torch
2.15's chunked F.linear_cross_entropy, torch.compile and torch eager, plus fusedce's raw
one-pass C call.

One iteration = every input's .grad set to None, loss = f(inputs), loss.backward().
Time: cross-entropy over logits ("ce"): harness.time_ms (CUDA events around each iteration, L2
flushed before each, median over ~100 ms of iterations), and harness.time_back_to_back
(ms_back_to_back: 200 iterations back to back, no flush, where host time shows if the host
cannot keep ahead; host_ms: the host's own time per iteration); linear + cross-entropy ("linear_ce",
20 ms to 1 s an iteration): the median of --lin-reps event-timed iterations after one warm-up.
An impl whose iteration takes more than SLOW_MS is timed once. Every impl first runs one untimed
iteration (torch.compile compiles, Triton / CuTe DSL kernels are built).
Memory, extra_mib: gradients of the previous iteration freed, gc, empty_cache; baseline =
memory_allocated() (the inputs); peak = max_memory_allocated() over one iteration; extra =
peak - baseline - the bytes of every input's .grad that is a new tensor (a gradient written
over its input's storage costs nothing new). The loss tensor (4 bytes) is ignored.
∂W error (linear_ce): the last timed iteration's weight gradient on a sample of DW_SAMPLE
vocabulary rows against a float64 reference of the same rows (the softmax in float64 of the
logits of the exact bf16 inputs, accumulated in float32 by cuBLAS): dw_rel_fro = ‖∂W − ref‖_F /
‖ref‖_F and dw_max_rel = max |∂W − ref| / max |ref| over those rows.
Ceilings from this same run (harness.ceilings): the copy rate (ce: ideal_ms = N·V·e read +
N·V·e written at that rate) and the bf16 8192³ GEMM (linear_ce: floor_ms = 6·N·D·V at that rate).
A peer that fails (not installed, no such path in its version, a compile error, out of memory)
keeps its row with the reason. Peers needing the CuTe DSL runtime run last in each shape: a peer
that faults the CUDA context fails every impl after it.

    python3 bench/bench_torch.py [--ops ce,linear_ce] [--impls a,b] [--skip a,b]
                                 [--shapes 4096x50257,8192x4096x128256] [--merge] [--out DIR]
Writes bench/results/torch-<device>.json (and DIR/); bench/plot.py draws it. --merge replaces
only the rows measured now in the existing file (a second call that adds peers).
torch-lce needs bench/stage_torch_lce.sh's staged module (.peers/torch_lce, or TORCH_LCE_DIR).
"""
import argparse
import gc
import inspect
import os
import sys
import time
import warnings

import harness

CE_SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16"),
             (4096, 50257, "bf16")]
LIN_SHAPES = [(8192, 4096, 128256, "bf16"), (8192, 2304, 256000, "bf16"),
              (16384, 4096, 32000, "bf16"), (32768, 4096, 151936, "bf16")]  # N, D, V
CE_IMPLS = ["fusedce-c-abi", "fusedce", "fusedce-inplace", "liger", "torch-compile",
            "torch-eager", "liger-cute", "quack"]
LIN_IMPLS = ["fusedce", "fusedce-lean", "liger", "cce", "cce-exact", "torch-lce",
             "torch-compile", "torch-eager", "liger-cute", "quack"]
CUTE_IMPLS = ("liger-cute", "quack")  # need the CuTe DSL runtime (nvidia-cutlass-dsl)
LEAN_BYTES = 128 << 20  # fusedce-lean: 128 MiB of scratch + the float32 [N, D] ∂h accumulator
SLOW_MS = 2000.0        # one iteration slower than this: timed once
DW_SAMPLE = 4096        # vocabulary rows of ∂W compared with the float64 reference
IGNORE = -100
PEER_DISTS = ("liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl", "triton")
TORCH_LCE_DIR = os.environ.get("TORCH_LCE_DIR", os.path.join(harness.ROOT, ".peers", "torch_lce"))


# ------------------------------------------------------------------------- the impls ----
def ce_eager(z, y):
    return _F().cross_entropy(z.float(), y)


def lin_eager(h, W, y):
    F = _F()
    return F.cross_entropy(F.linear(h, W).float(), y)


def _F():
    import torch.nn.functional as F
    return F


_COMPILED = {}


def compiled(fn):
    """torch.compile(fn), static shapes (one compile per shape; nothing happens until a call)."""
    import torch
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def noted(fn, note):
    fn.note = note  # recorded in the row: what exactly ran
    return fn


def no_fallback(fn, what):
    """fn, failing instead of running when Liger falls back from its CuTe DSL path to Triton
    (it warns with LigerImplFallbackWarning, e.g. at a vocabulary not a multiple of 8)."""
    checked = []

    def run(*args):
        if checked:
            return fn(*args)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = fn(*args)
        for w in seen:
            if type(w.message).__name__ == "LigerImplFallbackWarning":
                raise RuntimeError(f"{what} fell back to Triton: {w.message}")
        checked.append(True)
        return out
    return run


def liger_dispatch():
    try:
        from liger_kernel.backends import dispatch
    except ImportError as e:
        raise RuntimeError(f"this Liger-Kernel has no CuTe DSL path ({e})") from None
    return dispatch


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
    if impl == "liger-cute":
        dispatch = liger_dispatch()
        return no_fallback(lambda z, y: dispatch(
            "cross_entropy", z, y, None, IGNORE, 0.0, 0.0, "mean", None, False, False, False,
            impl="nvidia-cutedsl")[0], "Liger's cross_entropy")
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


def torch_lce():
    """torch 2.15's F.linear_cross_entropy and LinearCrossEntropyOptions, staged as torch_lce."""
    if not os.path.isdir(os.path.join(TORCH_LCE_DIR, "torch_lce")):
        raise RuntimeError(f"no staged torch_lce in {TORCH_LCE_DIR} (run bench/stage_torch_lce.sh)")
    if TORCH_LCE_DIR not in sys.path:
        sys.path.insert(0, TORCH_LCE_DIR)
    import torch_lce
    return torch_lce


def lin_loss_fn(impl):
    """loss(h, W, y) for a linear CE impl."""
    if impl in ("fusedce", "fusedce-lean"):
        import fusedce.torch as fce_torch
        if impl == "fusedce":
            return lambda h, W, y: fce_torch.linear_cross_entropy(h, W, y)
        return noted(lambda h, W, y: fce_torch.linear_cross_entropy(
            h, W, y, workspace_bytes=LEAN_BYTES + h.shape[0] * h.shape[1] * 4),
            "workspace_bytes = 128 MiB + N·D·4")
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lflce
        return lambda h, W, y: lflce(h, W, y)
    if impl == "liger-cute":
        liger_dispatch()
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LF
        if not getattr(LF, "supports_inner_impl_dispatch", False):
            raise RuntimeError("this Liger-Kernel's fused linear CE takes no inner implementation")
        # the functional API's arguments, with the inner CE on "nvidia-cutedsl" (its default
        # when the CuTe DSL imports; None would run the Triton kernel inline)
        return no_fallback(lambda h, W, y: LF.apply(
            h, W, y, None, None, IGNORE, 0.0, 0.0, "mean", None, False, None, False, False, False,
            "nvidia-cutedsl", None)[0], "Liger's fused linear CE")
    if impl in ("cce", "cce-exact"):
        import cut_cross_entropy
        cce = cut_cross_entropy.linear_cross_entropy
        if impl == "cce":
            return noted(lambda h, W, y: cce(h, W, y), "default: gradient filter on")
        if "filter_eps" in inspect.signature(cce).parameters:
            return noted(lambda h, W, y: cce(h, W, y, filter_eps=None), "filter_eps=None")
        raise RuntimeError("this cut-cross-entropy has no exact mode")
    if impl == "torch-lce":
        t = torch_lce()
        opts = t.LinearCrossEntropyOptions()
        # bound once: the first call imports the submodule torch_lce.linear_cross_entropy,
        # which then shadows the package attribute of the same name
        from torch_lce.functional import linear_cross_entropy as lce
        return noted(lambda h, W, y: lce(h, W, y, options=opts),
                     f"torch {t.SOURCE_VERSION}'s module, options=LinearCrossEntropyOptions()")
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


# -------------------------------------------------------------------------- measuring ----
def targets(N, V, gen):
    import torch
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
    import torch
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


def measure(step, leaves, slow, lin_reps):
    """{ms, extra_mib, grad_mib, timing}. leaves None: memory not measured (raw C call)."""
    import torch
    step()  # untimed: compiles, JITs, allocator settles
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
    first = harness.time_iters_ms(step, warmup=0, reps=1)  # the time guard, and a warm-up
    if first > SLOW_MS:
        return dict(out, ms=first, timing="1 iteration (slow)")
    if not slow:
        b2b, host = harness.time_back_to_back(step)
        return dict(out, ms=harness.time_ms(step, warmup_ms=10, rep_ms=100), timing="events, median",
                    ms_back_to_back=round(b2b, 4), host_ms=round(host, 4))
    return dict(out, ms=harness.time_iters_ms(step, warmup=0, reps=lin_reps),
                timing=f"events, median of {lin_reps}")


def dw_reference(h, W, y, rows):
    """float64 ∂W[rows] of the mean cross-entropy of h·Wᵀ (rows: sorted vocabulary indices):
    logits of the exact bf16 products accumulated in float32 (cuBLAS, out_dtype), row sums of
    exp in float64, the softmax of the sampled columns in float64, by chunks of rows."""
    import torch
    N, D = h.shape
    V = W.shape[0]
    n_valid = int((y != IGNORE).sum())
    pos = torch.full((V,), -1, dtype=torch.long, device="cuda")
    pos[rows] = torch.arange(len(rows), device="cuda")
    ref = torch.zeros(len(rows), D, dtype=torch.float64, device="cuda")
    chunk = max(256, min(4096, (2 << 30) // (V * 4)))
    for i in range(0, N, chunk):
        hc, yc = h[i:i + chunk], y[i:i + chunk]
        z = torch.mm(hc, W.t(), out_dtype=torch.float32)
        m = z.amax(dim=1)
        lse = m.double() + torch.exp(z - m[:, None]).sum(dim=1, dtype=torch.float64).log()
        p = torch.exp(z[:, rows].double() - lse[:, None])
        del z
        valid = yc != IGNORE
        col = torch.where(valid, pos[yc.clamp(min=0)], -1)
        hit = (col >= 0).nonzero().squeeze(1)
        p[hit, col[hit]] -= 1.0
        p[~valid] = 0.0
        ref.addmm_(p.t(), hc.double())
        del p
    return ref.div_(n_valid)


def dw_errors(grad, ref, rows):
    g = grad[rows].double()
    diff = g - ref
    return dict(dw_rel_fro=float(f"{float(diff.norm() / ref.norm()):.4e}"),
                dw_max_rel=float(f"{float(diff.abs().max() / ref.abs().max()):.4e}"))


def shape_str(r):
    return f"{r['N']}x{r['D']}x{r['V']}" if r["op"] == "linear_ce" else f"{r['N']}x{r['V']}"


def run_impl(rec, go, on_success):
    """Runs go() -> measure()'s dict into rec; a failure keeps the row with its reason."""
    t0 = time.time()
    try:
        got = go()
        rec.update({k: round(v, 1 if k.endswith("mib") else 4) if isinstance(v, float) and not k.startswith("dw_")
                    else v for k, v in got.items() if v is not None})
        on_success(rec)
    except Exception as e:  # noqa: BLE001 - OOM, import errors, peers' own errors
        lines = str(e).strip().splitlines()
        rec.update(ms=None, extra_mib=None, error=f"{type(e).__name__}: {lines[0] if lines else ''}"[:240])
    try:
        free()
    except Exception as e:  # noqa: BLE001 - a faulted context fails here too; keep going
        print(f"  cleanup failed: {e}")
    what = f"{rec['ms']} ms, {rec['extra_mib']} MiB" if rec["ms"] is not None else rec["error"]
    if rec.get("dw_rel_fro") is not None:
        what += f", dW err {rec['dw_rel_fro']:.2e} / {rec['dw_max_rel']:.2e}"
    print(f"  {rec['op']} {shape_str(rec)} {rec['impl']}: {what}  ({time.time() - t0:.0f} s)", flush=True)


def run_ce(N, V, dt, impls, ceil, records):
    import torch
    dtype = harness.dtypes()[dt]
    ideal = 2 * N * V * (torch.finfo(dtype).bits // 8) / (ceil["copy_tbps"] * 1e12) * 1e3
    for impl in impls:
        rec = dict(op="ce", impl=impl, dtype=dt, N=N, V=V, ideal_ms=round(ideal, 4))

        def go():
            gen = torch.Generator(device="cuda").manual_seed(N + V)
            # Fresh logits for every impl. In-place impls (fusedce-inplace, liger) overwrite
            # them with the gradient: they are then timed again and again on that same buffer,
            # whose values change (the gradient, then its gradient...) but not the work done.
            z = torch.randn(N, V, device="cuda", dtype=dtype, generator=gen).mul_(4)
            y = targets(N, V, gen)
            if impl == "fusedce-c-abi":  # fce_forward, one pass, gradient into a buffer
                grad = torch.empty_like(z)
                _, forward_grad, ws_mib = harness.ce_calls(z, y, grad)
                b2b, host = harness.time_back_to_back(forward_grad)
                return dict(ms=harness.time_ms(forward_grad, warmup_ms=10, rep_ms=100),
                            timing="events, median", extra_mib=ws_mib,
                            ms_back_to_back=round(b2b, 4), host_ms=round(host, 4),
                            note="the C call alone: extra_mib = its workspace, gradient into a preallocated buffer")
            z.requires_grad_(True)
            fn = ce_loss_fn(impl)
            return dict(measure(step_of(fn, [z], (z, y)), [z], slow=False, lin_reps=0),
                        note=getattr(fn, "note", None))

        run_impl(rec, go, lambda r: r.update(pct_of_copy=round(100 * ideal / r["ms"], 1)))
        records.append(rec)


def run_linear(N, D, V, dt, impls, ceil, records, lin_reps, dw):
    import torch
    dtype = harness.dtypes()[dt]
    floor = 6.0 * N * D * V / (ceil["gemm_tflops"] * 1e12) * 1e3

    def inputs():
        gen = torch.Generator(device="cuda").manual_seed(N + D + V)
        h = torch.randn(N, D, device="cuda", dtype=dtype, generator=gen)
        W = torch.randn(V, D, device="cuda", dtype=dtype, generator=gen).mul_(2.0 / D ** 0.5)
        return h, W, targets(N, V, gen)

    ref = rows = None
    ref_note = None
    if dw:
        try:
            h, W, y = inputs()
            gen = torch.Generator(device="cuda").manual_seed(7)
            rows = torch.randperm(V, device="cuda", generator=gen)[:min(DW_SAMPLE, V)].sort().values
            ref = dw_reference(h, W, y, rows)
            del h, W, y
        except Exception as e:  # noqa: BLE001 - timings are still worth having
            ref_note = f"no ∂W reference: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            print(f"  {ref_note}")
        free()
    for impl in impls:
        rec = dict(op="linear_ce", impl=impl, dtype=dt, N=N, V=V, D=D, floor_ms=round(floor, 3))

        def go():
            h, W, y = inputs()
            h.requires_grad_(True)
            W.requires_grad_(True)
            fn = lin_loss_fn(impl)
            out = dict(measure(step_of(fn, [h, W], (h, W, y)), [h, W], slow=True, lin_reps=lin_reps),
                       note=getattr(fn, "note", None))
            if ref is not None and W.grad is not None:
                out.update(dw_errors(W.grad, ref, rows))
            elif ref_note:
                out["dw_error"] = ref_note
            return out

        run_impl(rec, go, lambda r: r.update(ratio_to_floor=round(r["ms"] / floor, 3)))
        records.append(rec)


def merge_key(r):
    return tuple(r.get(k) for k in ("op", "impl", "dtype", "N", "V", "D"))


def parse_shapes(text, ap):
    ce, lin = [], []
    for tok in text.split(","):
        parts = tok.strip().lower().split("x")
        dt = parts.pop() if parts[-1] in ("bf16", "f16", "f32") else "bf16"
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
    every = list(dict.fromkeys(CE_IMPLS + LIN_IMPLS))
    ap.add_argument("--impls", default=None, help="only these: comma list of " + ",".join(every))
    ap.add_argument("--skip", default=None, help="all but these (e.g. liger-cute,quack)")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x50257,8192x4096x128256 (NxV for ce, "
                    "NxDxV for linear_ce, optional xbf16); replaces both default lists")
    ap.add_argument("--lin-reps", type=int, default=5, help="timed iterations per linear CE impl")
    ap.add_argument("--no-dw", action="store_true", help="no ∂W error (linear_ce)")
    ap.add_argument("--merge", action="store_true", help="replace only the rows measured now in "
                    "the existing bench/results/torch-<device>.json")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    args = ap.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or set(ops) - {"ce", "linear_ce"}:
        ap.error("--ops takes ce and/or linear_ce")
    wanted = set(every) if args.impls is None else {i.strip() for i in args.impls.split(",") if i.strip()}
    skipped = set() if args.skip is None else {i.strip() for i in args.skip.split(",") if i.strip()}
    if (wanted | skipped) - set(every):
        ap.error(f"unknown impls {sorted((wanted | skipped) - set(every))}")
    ce_impls = [i for i in CE_IMPLS if i in wanted and i not in skipped]
    lin_impls = [i for i in LIN_IMPLS if i in wanted and i not in skipped]
    ce_shapes, lin_shapes = parse_shapes(args.shapes, ap) if args.shapes else (CE_SHAPES, LIN_SHAPES)
    import torch
    try:  # static compiles: one per shape and function, more than dynamo's default limit of 8
        from torch import _dynamo
        for k in ("cache_size_limit", "recompile_limit"):
            if hasattr(_dynamo.config, k):
                setattr(_dynamo.config, k, 64)
    except Exception as e:  # noqa: BLE001
        print(f"could not raise dynamo's recompile limit ({e})")

    dev = harness.device_name()
    ceil = harness.ceilings()
    peers = harness.versions(*PEER_DISTS)
    if "torch-lce" in lin_impls and "linear_ce" in ops:
        try:
            peers["torch-lce"] = torch_lce().SOURCE_VERSION
        except Exception as e:  # noqa: BLE001 - its rows say why
            print(f"torch-lce: {e}")
    run = harness.run_info(**ceil, peers=peers)
    print(f"device {dev}: copy {ceil['copy_tbps']:.2f} TB/s (read + written, 4 GiB), bf16 8192³ "
          f"GEMM {ceil['gemm_tflops']:.0f} TFLOP/s; torch {torch.__version__}; peers {peers}", flush=True)
    records, t0 = [], time.time()

    def save():  # after every shape: a crash or a time limit keeps what was measured
        return harness.write("torch", dev, run, records, [args.out], merge_key if args.merge else None)
    if "ce" in ops:
        for N, V, dt in ce_shapes:
            run_ce(N, V, dt, ce_impls, ceil, records)
            save()
    if "linear_ce" in ops:
        for N, D, V, dt in lin_shapes:
            run_linear(N, D, V, dt, lin_impls, ceil, records, args.lin_reps, not args.no_dw)
            save()
    doc = save()
    print(f"wrote {harness.result_path('torch', dev)} ({len(doc['records'])} records) "
          f"in {time.time() - t0:.0f} s")
    for op, col in (("ce", "pct_of_copy"), ("linear_ce", "ratio_to_floor")):
        rows = [dict(r, shape=shape_str(r)) for r in records if r["op"] == op]
        if rows:
            print(f"\n{op} ({dev})")
            harness.print_table(rows, ["impl", "shape", "ms", "extra_mib", col, "ms_back_to_back",
                                       "host_ms", "dw_rel_fro", "dw_max_rel", "error"])


if __name__ == "__main__":
    main()
