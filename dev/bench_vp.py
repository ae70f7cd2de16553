"""The vocabulary-parallel calls (fce_vp_*, libfusedce 0.4) on ONE GPU, P ranks simulated in one
process, against the unsharded calls, through the C ABI (ctypes, torch tensors, no collective).

1. CE over logits (bf16): fce_forward (loss + gradient in one pass, the unsharded training path)
   against, for P = 1, 2, 4, 8 and each rank r, fce_vp_stats on its dense [N, V/P] shard,
   fce_vp_loss on the gathered statistics and fce_vp_backward on the shard. pct_of_copy: the
   logits bytes of the phase (stats: N*V/P*e read; backward: N*V/P*e read + the same written;
   fce_forward: N*V*e read + written) over the device-to-device copy rate measured in this run,
   (bytes read + written) / s, as in bench_ce.py / bench_options.py.
2. Fused linear + CE (bf16, N=8192, D=4096, V=128256 and 256000): fce_linear_ce (loss, dh, dW;
   workspace as fusedce.torch picks it: the optimal size capped at the 1 GiB budget,
   DEFAULT_WORKSPACE_BYTES / FUSEDCE_WORKSPACE_BYTES; also with the optimal workspace, as
   bench_linear.py's "fusedce") against per-rank fce_vp_linear_stats + fce_vp_loss +
   fce_vp_linear_backward (grad_hidden float32, as fusedce.torch.distributed; workspaces capped
   at the same budget). The floor is 6*N*D*V/P as three cuBLAS GEMMs (torch.mm: z = h W_r^T,
   dh = dz W_r, dW_r = dz^T h) measured in this run on the same shard; the vp path is expected
   near 8/6 of it (phase 1 makes the logits once more: 2*N*D*V/P + 6*N*D*V/P FLOPs).

The ranks run one after another on the one GPU: each rank's calls are timed alone, as if the
rank had a GPU to itself. The all-gather of the statistics (each rank gets P*N*32 bytes; here
torch.stack of the P stats buffers) and the all-reduce (sum) of the partial float32 dh (N*D*4
bytes) are NOT timed. "parallel efficiency" = t_unsharded / (P * t_rank), t_rank the slowest
rank's stats + backward plus the loss: an upper bound, without communication.

Timing: CUDA events around each call, a 256 MiB write between calls to flush the L2 (as
triton's do_bench), one warm-up call, then repetitions up to ~100 ms per measurement (at least
3); the reported ms is the best of them (the median is in the JSON). Before the timings each
configuration is checked once against the unsharded call (loss relative error, gradient max
difference relative to the gradient's largest element, error flags).

Writes dev/results/vp-<device>.json (and $OUT/, --out). Without CUDA, or with --smoke /
--cpu-smoke, it runs tiny sizes (on the CPU backend without CUDA or with --cpu-smoke) and
writes only to --out / $OUT / /tmp/fusedce-bench-vp, never into dev/results.

GPU: FUSEDCE_LIBRARY=build/libfusedce.so python3 dev/bench_vp.py
"""
import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
from fusedce import _lib  # noqa: E402
from fusedce import _alloc  # noqa: E402
import fusedce.torch as fce_torch  # noqa: E402
from fusedce.vocab_parallel import VP_STATS, shard_range  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from harness import print_table  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SMOKE_OUT = "/tmp/fusedce-bench-vp"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
FCE_DTYPE = {torch.float32: _lib.FCE_FLOAT32, torch.float16: _lib.FCE_FLOAT16,
             torch.bfloat16: _lib.FCE_BFLOAT16}

CE_SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16")]
LINEAR_SHAPES = [(8192, 4096, 128256, "bf16"), (8192, 4096, 256000, "bf16")]
# tiny: odd vocabularies give unequal shards (numpy.array_split's split)
SMOKE_CE_SHAPES = [(64, 1000, "bf16"), (48, 4099, "bf16"), (40, 515, "f32")]
SMOKE_LINEAR_SHAPES = [(64, 32, 1000, "bf16"), (40, 48, 2051, "bf16")]
RANKS = [1, 2, 4, 8]
CE_COLS = ["impl", "P", "vocab_local", "stats_ms", "stats_pct_of_copy", "loss_ms", "bwd_ms",
           "bwd_pct_of_copy", "total_ms", "total_pct_of_copy", "efficiency", "stats_MB",
           "loss_MB", "bwd_MB", "gather_KB", "loss_rel_err", "grad_max_rel_diff", "error_flags"]
LINEAR_COLS = ["impl", "P", "vocab_local", "ws_MiB", "stats_ms", "loss_ms", "bwd_ms", "total_ms",
               "floor_ms", "ratio_to_floor", "tflops", "efficiency", "gemm_scaling",
               "loss_rel_err", "dh_max_rel_diff", "dW_max_rel_diff", "error_flags"]

NOTES = {
    "simulation": "P ranks simulated one after another on one device; each rank's calls are "
                  "timed alone (as if it had the device to itself)",
    "not_timed": "the all-gather of the statistics (P*N*32 bytes per rank; here torch.stack of "
                 "the P stats buffers) and the all-reduce (sum) of the partial float32 dh "
                 "(N*D*4 bytes) are NOT timed",
    "total": "total_ms: the unsharded call, or one rank's stats + loss + backward (t_rank = the "
             "slowest rank's stats + backward, plus the loss); CE total_pct_of_copy counts the "
             "shard's logits read twice and written once",
    "efficiency": "parallel efficiency = t_unsharded / (P * t_rank): an upper bound, without "
                  "communication (linear: against fce_linear_ce with fusedce.torch's workspace); "
                  "gemm_scaling = floor(P=1) / (P * floor(P)), the same for the three GEMMs",
    "linear_floor": "floor_ms: 6*N*D*V/P as three torch.mm (cuBLAS) on the shard, measured in "
                    "this run; the vp path is expected near 8/6 of it (phase 1 makes the logits "
                    "once more)",
    "check": "loss_rel_err / grad_max_rel_diff / dh_ / dW_max_rel_diff: against the unsharded "
             "call, max |diff| / max |reference| (dh: the float32 partials summed, rounded to "
             "the dtype)",
    "timing": "best of CUDA-event timings, L2 flushed (256 MiB write) before each call, one "
              "warm-up; median in *_median_ms",
    "pct_of_copy": "logits bytes of the phase / time over the copy rate (read + written) / s "
                   "measured in this run; loss: its statistics + targets bytes",
}


class Ctx:
    """Device, backend, stream, timing."""

    def __init__(self, cuda: bool, reps: int, budget_ms: float):
        self.cuda = cuda
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.backend = _lib.FCE_BACKEND_CUDA if cuda else _lib.FCE_BACKEND_CPU
        self.reps = reps
        self.budget_ms = budget_ms
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None

    def stream(self):
        return torch.cuda.current_stream().cuda_stream if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def options(self, dtype, **fields):
        o = _lib.default_options()
        o.backend = self.backend
        o.dtype = FCE_DTYPE[dtype]
        o.target_dtype = _lib.FCE_INT64
        for k, v in fields.items():
            setattr(o, k, v)
        return o

    def _one(self, fn):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.flush.zero_()
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def bench(self, fn):
        """(best ms, median ms, count): one warm-up call, then repetitions (``reps``, or as
        many as fit ``budget_ms``, 3 to 25)."""
        fn()
        self.sync()
        times = [self._one(fn)]
        n = self.reps or max(3, min(25, int(self.budget_ms / max(times[0], 1e-3))))
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n - 1)]
            for s, e in ev:
                self.flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            times += [s.elapsed_time(e) for s, e in ev]
        else:
            times += [self._one(fn) for _ in range(n - 1)]
        return min(times), statistics.median(times), len(times)

    def copy_tbps(self, nbytes):
        """Copy of nbytes: (bytes read + written) / s, in TB/s (best of)."""
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.dev).normal_()
        dst = torch.empty_like(src)
        ms = self.bench(lambda: dst.copy_(src))[0]
        return 2 * nbytes / (ms * 1e-3) / 1e12

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def p(t):
    return t.data_ptr() if t is not None else None


def r4(x):
    return round(float(x), 4)


def max_rel_diff(a, b, rows=1024):
    """max |a - b| / max |b| over [rows, cols] matrices, float32, a row block at a time."""
    diff = 0.0
    ref = 0.0
    for i in range(0, a.shape[0], rows):
        x, y = a[i:i + rows].float(), b[i:i + rows].float()
        diff = max(diff, (x - y).abs().max().item())
        ref = max(ref, y.abs().max().item())
    return diff / ref if ref > 0 else diff


def ws_tensor(ctx, nbytes):
    return torch.empty(max(int(nbytes), 16), dtype=torch.uint8, device=ctx.dev)


def size_query(name, *args):
    out = ctypes.c_size_t()
    _lib.call(name, *args, ctypes.byref(out))
    return out.value


def pair_query(name, *args):
    lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
    _lib.call(name, *args, ctypes.byref(lo), ctypes.byref(hi))
    return lo.value, hi.value


def vp_loss_call(ctx, dt, P, N, V, y, gathered):
    """(closure timing fce_vp_loss, closure checking it once -> (loss, flags))."""
    o = ctx.options(dt)
    wsb = size_query("fce_vp_loss_workspace_size", ctypes.byref(o), P, N, V)
    ws = ws_tensor(ctx, wsb)
    loss = torch.empty(1, device=ctx.dev)
    lse = torch.empty(N, device=ctx.dev)
    flags = torch.zeros(1, dtype=torch.int32, device=ctx.dev)
    args = (ctypes.byref(o), P, N, V, p(y), p(gathered), p(loss), p(lse), None)
    tail = (p(ws), wsb, ctx.stream())

    def run():
        _lib.call("fce_vp_loss", *args, None, *tail)

    def check():
        flags.zero_()
        _lib.call("fce_vp_loss", *args, p(flags), *tail)
        return loss.item(), int(flags.item())
    return run, check, (ws, loss, lse, flags), wsb


# ============================================================== 1. CE over logits ====
def bench_ce(ctx, N, V, dtn, ranks, copy, check):
    dt = DTYPES[dtn]
    e = torch.empty((), dtype=dt).element_size()
    g = torch.Generator(device=ctx.dev).manual_seed(N + V)
    z = (torch.randn(N, V, device=ctx.dev, generator=g) * 4).to(dt)
    y = torch.randint(0, V, (N,), device=ctx.dev, generator=g)
    y[::50] = -100
    rows = []
    shape = f"{N}x{V}"

    # (a) unsharded: fce_forward, loss + gradient in one pass
    o = ctx.options(dt)
    wsb = size_query("fce_forward_workspace_size", ctypes.byref(o), N, V)
    ws = ws_tensor(ctx, wsb)
    grad = torch.empty_like(z)
    loss = torch.empty(1, device=ctx.dev)
    lse = torch.empty(N, device=ctx.dev)
    fargs = (ctypes.byref(o), N, V, p(z), p(y), p(loss), p(lse), None, p(grad), None, None,
             p(ws), wsb, ctx.stream())

    def fwd():
        _lib.call("fce_forward", *fargs)
    fwd()
    ctx.sync()
    ref_loss = loss.item()
    t_un, t_un_med, n_un = ctx.bench(fwd)
    un_bytes = 2 * N * V * e
    rows.append(dict(section="ce", shape=shape, N=N, V=V, dtype=dtn, P=None,
                     impl="fce_forward loss+grad (unsharded)", vocab_local=V,
                     total_ms=r4(t_un), total_median_ms=r4(t_un_med), reps=n_un,
                     total_pct_of_copy=round(100 * un_bytes / (t_un * 1e-3) / 1e12 / copy, 1),
                     logits_MB=round(un_bytes / 1e6, 1),
                     bytes=dict(read=N * V * e + 8 * N, written=N * V * e + 4 * N + 4)))
    del ws
    ctx.free()

    for P in ranks:
        if P > V:
            continue
        # the ranks' dense shards and their stats buffers
        ranks_ = []
        for r in range(P):
            vs, vl = shard_range(V, r, P)
            zr = z if P == 1 else z[:, vs:vs + vl].contiguous()
            ranks_.append(dict(vs=vs, vl=vl, z=zr,
                               o=ctx.options(dt, row_stride=vl, grad_row_stride=vl),
                               stats=torch.empty(N, VP_STATS, device=ctx.dev)))
        vl0 = ranks_[0]["vl"]  # the largest shard
        # phase 1: fce_vp_stats, each rank alone
        t_stats = []
        for rk in ranks_:
            a = (ctypes.byref(rk["o"]), N, V, rk["vs"], rk["vl"], p(rk["z"]), p(y), p(rk["stats"]),
                 ctx.stream())
            t_stats.append(ctx.bench(lambda a=a: _lib.call("fce_vp_stats", *a)))
        ctx.sync()
        # the all-gather (not timed): the P stats buffers concatenated, rank-major [P, N, 8]
        gathered = torch.stack([rk["stats"] for rk in ranks_])
        # phase 3a: fce_vp_loss (the same on every rank)
        run_loss, check_loss, keep, _ = vp_loss_call(ctx, dt, P, N, V, y, gathered)
        vp_loss_v, flags = check_loss()
        t_loss = ctx.bench(run_loss)
        # phase 3b: fce_vp_backward, each rank alone, into one reused gradient buffer
        o0 = ranks_[0]["o"]
        wsb = size_query("fce_vp_backward_workspace_size", ctypes.byref(o0), P, N, V, vl0)
        ws = ws_tensor(ctx, wsb)
        gbuf = torch.empty(N * vl0, dtype=dt, device=ctx.dev)
        t_bwd = []
        grad_diff = 0.0
        for rk in ranks_:
            gr = gbuf[:N * rk["vl"]].view(N, rk["vl"])
            a = (ctypes.byref(rk["o"]), P, N, V, rk["vs"], rk["vl"], p(rk["z"]), p(y), p(gathered),
                 None, p(gr), None, p(ws), wsb, ctx.stream())
            t_bwd.append(ctx.bench(lambda a=a: _lib.call("fce_vp_backward", *a)))
            if check:
                grad_diff = max(grad_diff, max_rel_diff(gr, grad[:, rk["vs"]:rk["vs"] + rk["vl"]]))
        t_rank = max(s[0] + b[0] for s, b in zip(t_stats, t_bwd)) + t_loss[0]
        ts, tb = max(s[0] for s in t_stats), max(b[0] for b in t_bwd)
        shard_bytes = N * vl0 * e
        loss_read = P * N * VP_STATS * 4 + 8 * N
        rows.append(dict(
            section="ce", shape=shape, N=N, V=V, dtype=dtn, P=P, impl="fce_vp_*", vocab_local=vl0,
            stats_ms=r4(ts), stats_median_ms=r4(max(s[1] for s in t_stats)),
            stats_pct_of_copy=round(100 * shard_bytes / (ts * 1e-3) / 1e12 / copy, 1),
            loss_ms=r4(t_loss[0]), loss_median_ms=r4(t_loss[1]),
            loss_pct_of_copy=round(100 * (loss_read + 4 * N) / (t_loss[0] * 1e-3) / 1e12 / copy, 2),
            bwd_ms=r4(tb), bwd_median_ms=r4(max(b[1] for b in t_bwd)),
            bwd_pct_of_copy=round(100 * 2 * shard_bytes / (tb * 1e-3) / 1e12 / copy, 1),
            total_ms=r4(t_rank),
            total_pct_of_copy=round(100 * 3 * shard_bytes / (t_rank * 1e-3) / 1e12 / copy, 1),
            efficiency=round(t_un / (P * t_rank), 3),
            stats_ms_ranks=[r4(s[0]) for s in t_stats], bwd_ms_ranks=[r4(b[0]) for b in t_bwd],
            bytes=dict(stats=dict(read=shard_bytes + 8 * N, written=N * VP_STATS * 4),
                       loss=dict(read=loss_read, written=4 * N + 4),
                       bwd=dict(read=shard_bytes + loss_read, written=shard_bytes),
                       allgather_received_not_timed=(P - 1) * N * VP_STATS * 4),
            logits_MB=round(shard_bytes / 1e6, 1), stats_MB=round(shard_bytes / 1e6, 1),
            loss_MB=round((loss_read + 4 * N) / 1e6, 3), bwd_MB=round(2 * shard_bytes / 1e6, 1),
            gather_KB=round(P * N * VP_STATS * 4 / 1e3, 1),
            loss_rel_err=float(f"{abs(vp_loss_v - ref_loss) / abs(ref_loss):.2e}"),
            error_flags=flags))
        if check:
            rows[-1]["grad_max_rel_diff"] = float(f"{grad_diff:.2e}")
        del ranks_, gathered, keep, ws, gbuf
        ctx.free()
    del z, y, grad
    ctx.free()
    return rows


# ======================================================== 2. fused linear + CE ====
def bench_linear(ctx, N, D, V, dtn, ranks, budget, check):
    dt = DTYPES[dtn]
    shape = f"{N}x{D}x{V}"
    g = torch.Generator(device=ctx.dev).manual_seed(N + D + V)
    h = torch.randn(N, D, device=ctx.dev, generator=g).to(dt)
    W = (torch.randn(V, D, device=ctx.dev, generator=g) * (2.0 / D ** 0.5)).to(dt)
    y = torch.randint(0, V, (N,), device=ctx.dev, generator=g)
    y[::50] = -100
    rows = []

    def rec(**kw):
        base = dict(section="linear", shape=shape, N=N, D=D, V=V, dtype=dtn)
        base.update(kw)
        rows.append(base)
        return base

    # the floor: three cuBLAS GEMMs on this shard, measured now
    floors = {}

    def floor_ms(vl):
        if vl not in floors:
            Wr = W[:vl]
            buf = torch.empty(N, vl, dtype=dt, device=ctx.dev)
            dh_g = torch.empty(N, D, dtype=dt, device=ctx.dev)
            dW_g = torch.empty(vl, D, dtype=dt, device=ctx.dev)

            def gemms():
                torch.mm(h, Wr.t(), out=buf)       # z = h W_r^T       2*N*D*vl
                torch.mm(buf, Wr, out=dh_g)        # dh = dz W_r       2*N*D*vl
                torch.mm(buf.t(), h, out=dW_g)     # dW_r = dz^T h     2*N*D*vl
            floors[vl] = ctx.bench(gemms)
            del buf, dh_g, dW_g
            ctx.free()
        return floors[vl]

    # fce_linear_ce: loss + dh + dW, the workspace fusedce.torch picks, then the optimal one
    o = ctx.options(dt, hidden_row_stride=D)
    lo, hi = pair_query("fce_linear_ce_workspace_size", ctypes.byref(o), N, D, V, 1)
    ws_torch = max(lo, min(hi, max(0, budget - 16 * N - 4096)))  # fusedce/torch/_calls.py linear_ce's rule
    loss = torch.empty(1, device=ctx.dev)
    lse = torch.empty(N, device=ctx.dev)
    dh = torch.empty(N, D, dtype=dt, device=ctx.dev)
    dW = torch.empty(V, D, dtype=dt, device=ctx.dev)
    fl1 = floor_ms(V)
    t_lin = None
    for label, wsb in [("torch budget", ws_torch), ("optimal", hi)]:
        if label == "optimal" and hi == ws_torch:
            continue
        ws = ws_tensor(ctx, wsb)
        a = (ctypes.byref(o), N, D, V, p(h), p(W), None, p(y), p(loss), p(lse), None, p(dh), p(dW),
             None, None, None, p(ws), wsb, ctx.stream())
        t = ctx.bench(lambda a=a: _lib.call("fce_linear_ce", *a))
        if t_lin is None:
            t_lin = t[0]
            ctx.sync()
            ref_loss = loss.item()
        rec(impl=f"fce_linear_ce (ws {label})", P=None, vocab_local=V,
            ws_MiB=round(wsb / 2 ** 20, 1), ws_bytes=wsb, ws_min_bytes=lo, ws_optimal_bytes=hi,
            total_ms=r4(t[0]), total_median_ms=r4(t[1]), reps=t[2], floor_ms=r4(fl1[0]),
            ratio_to_floor=round(t[0] / fl1[0], 3),
            tflops=round(6 * N * D * V / (t[0] * 1e-3) / 1e12, 1))
        del ws
        ctx.free()
    ref_dh = dh if check else None
    ref_dW = dW if check else None
    if not check:
        del dh, dW

    dW_vp = torch.empty(V, D, dtype=dt, device=ctx.dev) if check else None
    for P in ranks:
        if P > V:
            continue
        ranks_ = []
        for r in range(P):
            vs, vl = shard_range(V, r, P)
            ranks_.append(dict(vs=vs, vl=vl, W=W[vs:vs + vl],
                               o=ctx.options(dt, hidden_row_stride=D),
                               stats=torch.empty(N, VP_STATS, device=ctx.dev)))
        vl0 = ranks_[0]["vl"]
        o0 = ranks_[0]["o"]
        slo, shi = pair_query("fce_vp_linear_stats_workspace_size", ctypes.byref(o0), N, D, vl0)
        blo, bhi = pair_query("fce_vp_linear_backward_workspace_size", ctypes.byref(o0), P, N, D, V,
                              vl0, _lib.FCE_FLOAT32)
        ws_s = max(slo, min(shi, max(0, budget)))  # fusedce.torch.distributed's rule
        ws_b = max(blo, min(bhi, max(0, budget)))
        ws = ws_tensor(ctx, max(ws_s, ws_b))
        t_stats = []
        for rk in ranks_:
            a = (ctypes.byref(rk["o"]), N, D, V, rk["vs"], rk["vl"], p(h), p(rk["W"]), None, p(y),
                 p(rk["stats"]), p(ws), ws_s, ctx.stream())
            t_stats.append(ctx.bench(lambda a=a: _lib.call("fce_vp_linear_stats", *a)))
        ctx.sync()
        gathered = torch.stack([rk["stats"] for rk in ranks_])  # the all-gather, not timed
        run_loss, check_loss, keep, _ = vp_loss_call(ctx, dt, P, N, V, y, gathered)
        vp_loss_v, flags = check_loss()
        t_loss = ctx.bench(run_loss)
        gh = torch.empty(N, D, device=ctx.dev)  # this rank's partial dh, float32
        dh_sum = torch.zeros(N, D, device=ctx.dev) if check else None
        gw_spare = None if check else torch.empty(vl0, D, dtype=dt, device=ctx.dev)
        t_bwd = []
        for rk in ranks_:
            gw = dW_vp[rk["vs"]:rk["vs"] + rk["vl"]] if check else gw_spare[:rk["vl"]]
            a = (ctypes.byref(rk["o"]), P, N, D, V, rk["vs"], rk["vl"], p(h), p(rk["W"]), None,
                 p(y), p(gathered), None, p(gh), _lib.FCE_FLOAT32, p(gw), None, None, p(ws), ws_b,
                 ctx.stream())
            t_bwd.append(ctx.bench(lambda a=a: _lib.call("fce_vp_linear_backward", *a)))
            if check:
                dh_sum += gh  # the all-reduce, not timed
        t_rank = max(s[0] + b[0] for s, b in zip(t_stats, t_bwd)) + t_loss[0]
        ts, tb = max(s[0] for s in t_stats), max(b[0] for b in t_bwd)
        fl = floor_ms(vl0)
        fl_vp = 6 * N * D * vl0
        rec(impl="fce_vp_linear_*", P=P, vocab_local=vl0,
            ws_MiB=round(max(ws_s, ws_b) / 2 ** 20, 1),
            ws_stats_bytes=ws_s, ws_stats_optimal_bytes=shi, ws_bwd_bytes=ws_b,
            ws_bwd_optimal_bytes=bhi,
            stats_ms=r4(ts), stats_median_ms=r4(max(s[1] for s in t_stats)),
            stats_tflops=round(2 * N * D * vl0 / (ts * 1e-3) / 1e12, 1),
            loss_ms=r4(t_loss[0]), loss_median_ms=r4(t_loss[1]),
            bwd_ms=r4(tb), bwd_median_ms=r4(max(b[1] for b in t_bwd)),
            bwd_tflops=round(6 * N * D * vl0 / (tb * 1e-3) / 1e12, 1),
            total_ms=r4(t_rank), floor_ms=r4(fl[0]), floor_median_ms=r4(fl[1]),
            floor_tflops=round(fl_vp / (fl[0] * 1e-3) / 1e12, 1),
            ratio_to_floor=round(t_rank / fl[0], 3), expected_ratio=round(8 / 6, 3),
            tflops=round(fl_vp / (t_rank * 1e-3) / 1e12, 1),
            efficiency=round(t_lin / (P * t_rank), 3),
            gemm_scaling=round(fl1[0] / (P * fl[0]), 3),
            stats_ms_ranks=[r4(s[0]) for s in t_stats], bwd_ms_ranks=[r4(b[0]) for b in t_bwd],
            flops=dict(stats=2 * N * D * vl0, bwd=6 * N * D * vl0),
            bytes=dict(allgather_received_not_timed=(P - 1) * N * VP_STATS * 4,
                       allreduce_dh_not_timed=N * D * 4),
            loss_rel_err=float(f"{abs(vp_loss_v - ref_loss) / abs(ref_loss):.2e}"),
            error_flags=flags)
        if check:
            # the summed partial dh rounded to the dtype, as fusedce.torch.distributed does
            rows[-1]["dh_max_rel_diff"] = float(f"{max_rel_diff(dh_sum.to(dt), ref_dh):.2e}")
            rows[-1]["dW_max_rel_diff"] = float(f"{max_rel_diff(dW_vp, ref_dW):.2e}")
        del ranks_, gathered, keep, ws, gh, dh_sum, gw_spare
        ctx.free()
    return rows


def shown(rows):
    """Rows for the printed table: the unsharded call's P as '-'."""
    return [dict(r, P="-" if r["P"] is None else r["P"]) for r in rows]


def parse_shapes(text, n):
    out = []
    for s in text.split(","):
        parts = s.split("x")
        dt = parts[n] if len(parts) > n else "bf16"
        out.append(tuple(int(v) for v in parts[:n]) + (dt,))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (CUDA if present); writes only to --out/$OUT/" + SMOKE_OUT)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--sections", default="ce,linear")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--ce-shapes", default=None, help="e.g. 16384x128256xbf16,32768x32000")
    ap.add_argument("--linear-shapes", default=None, help="e.g. 8192x4096x128256xbf16")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per measurement (0: auto)")
    ap.add_argument("--workspace", default=None,
                    help="linear budget per call (default: fusedce.torch's, "
                         "FUSEDCE_WORKSPACE_BYTES or DEFAULT_WORKSPACE_BYTES)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the comparison with the unsharded calls")
    ap.add_argument("--out", default=None, help="another directory for the JSON")
    args = ap.parse_args()

    t0 = time.time()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    smoke = args.smoke or args.cpu_smoke or not cuda
    if not torch.cuda.is_available() and not (args.smoke or args.cpu_smoke):
        print("no CUDA device: tiny sizes on the CPU backend (--cpu-smoke)")
    if cuda and not _lib.load().fce_cuda_available():
        sys.exit("torch sees a GPU but libfusedce has no usable CUDA backend")
    _lib.require_vp()
    ctx = Ctx(cuda, args.reps or (3 if smoke and not cuda else 0), 100.0)
    dev = torch.cuda.get_device_name().replace(" ", "-") if cuda else f"cpu-{platform.machine()}"
    ranks = [int(r) for r in args.ranks.split(",")]
    budget = (_alloc.parse_bytes(args.workspace) if args.workspace
              else _alloc.default_workspace_bytes())
    ce_shapes = (parse_shapes(args.ce_shapes, 2) if args.ce_shapes
                 else SMOKE_CE_SHAPES if smoke else CE_SHAPES)
    lin_shapes = (parse_shapes(args.linear_shapes, 3) if args.linear_shapes
                  else SMOKE_LINEAR_SHAPES if smoke else LINEAR_SHAPES)
    sections = args.sections.split(",")
    check = not args.no_check

    copy = ctx.copy_tbps((4 << 30) if cuda and not smoke else (64 << 20))  # as bench_options
    ctx.free()
    print(f"device {dev}{' (smoke: tiny sizes)' if smoke else ''}: copy {copy:.3f} TB/s "
          f"(read + written); library {_lib.build_info()}")
    print(f"linear CE workspace budget {budget / 2**20:.0f} MiB "
          f"(fusedce.torch.DEFAULT_WORKSPACE_BYTES = {fce_torch.DEFAULT_WORKSPACE_BYTES})")
    for v in NOTES.values():
        print("note: " + v)
    print()

    ce_rows, lin_rows = [], []
    if "ce" in sections:
        for N, V, dtn in ce_shapes:
            rows = bench_ce(ctx, N, V, dtn, ranks, copy, check)
            ce_rows += rows
            print(f"1. CE over logits, {N}x{V} {dtn}")
            print_table(shown(rows), CE_COLS)
            print(f"  ({time.time() - t0:.0f} s)\n")
    if "linear" in sections:
        for N, D, V, dtn in lin_shapes:
            rows = bench_linear(ctx, N, D, V, dtn, ranks, budget, check)
            lin_rows += rows
            print(f"2. fused linear + CE, N={N} D={D} V={V} {dtn}")
            print_table(shown(rows), LINEAR_COLS)
            print(f"  ({time.time() - t0:.0f} s)\n")

    result = dict(device=dev, smoke=smoke, backend="cuda" if cuda else "cpu",
                  library=_lib.build_info(), torch=torch.__version__, copy_tbps=r4(copy),
                  workspace_budget_bytes=budget, ranks=ranks, notes=NOTES, ce=ce_rows,
                  linear=lin_rows, seconds=round(time.time() - t0, 1))
    if smoke:
        dirs = [args.out or os.environ.get("OUT") or SMOKE_OUT]
    else:
        dirs = [RESULTS, os.environ.get("OUT"), args.out]
    name = f"vp-{dev}.json"
    for d in dirs:
        if d:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, name), "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {os.path.join(d, name)}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
