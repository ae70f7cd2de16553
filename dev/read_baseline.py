"""Forward-only CE against plain reads of the same bytes (dev/NOTES.md, "What bounds the remaining cells, and linear CE measured in turns").
    python3 read_baseline.py --timing   1024x32000 4096x32000 ...  # fusedce fwd / fwd+grad, a Triton
                     row read, a copy; do_bench's zero-fill L2 flush, a read flush, back to back
    python3 read_baseline.py --timeline 1024x32000 ...  # kernel durations (torch profiler)
    python3 read_baseline.py --triton   1024x32000 ...  # Triton reads: with the online exp or not,
                     pipelined or not, persistent grids or one program per row
bf16 logits; FUSEDCE_LIBRARY and PYTHONPATH=bindings/python as for bench_ce.py. Run from the
repository root or dev/.
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from torch.profiler import profile, ProfilerActivity

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import ce_calls, copy_tbps  # noqa: E402


@triton.jit
def rowread(X, O, V, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, V, BLOCK):
        i = off + tl.arange(0, BLOCK)
        acc += tl.load(X + r * V + i, mask=i < V, other=0.0).to(tl.float32)
    tl.store(O + r, tl.sum(acc))


@triton.jit
def rowread_opts(X, O, N, V, BLOCK: tl.constexpr, PERSIST: tl.constexpr, EXP: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rr = pid
    while rr < N:
        r = rr.to(tl.int64)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, V, BLOCK):
            i = off + tl.arange(0, BLOCK)
            x = tl.load(X + r * V + i, mask=i < V, other=-float("inf")).to(tl.float32)
            if EXP:
                mn = tl.maximum(m, x)
                s = s * tl.exp2((m - mn) * 1.4427) + tl.exp2((x - mn) * 1.4427)
                m = mn
            else:
                s += tl.where(i < V, x, 0.0)
        tl.store(O + r, tl.sum(s))
        rr += nprog if PERSIST else N


def shapes(args):
    for s in args:
        N, V = map(int, s.split("x"))
        yield s, N, V


flushbuf = None


def t_read_flush(fn, reps=100):
    for _ in range(10):
        fn()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flushbuf.view(torch.int64).sum()  # a read: leaves L2 clean
        st[i].record()
        fn()
        en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(st, en))


def t_zero_flush(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def t_noflush(fn, reps=100):
    for _ in range(10):
        fn()
    st = torch.cuda.Event(enable_timing=True)
    en = torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(reps):
        fn()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) / reps


def setup(N, V):
    """bf16 logits [N, V] (std 4), targets, a gradient buffer, a row buffer, fusedce's calls."""
    z = (torch.randn(N, V, device="cuda") * 4).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda")
    g = torch.empty_like(z)
    o = torch.empty(N, device="cuda")
    fwd, fwdg, _ = ce_calls(z, y, g)
    return z, g, o, fwd, fwdg


def timing(args):
    global flushbuf
    flushbuf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    cp = copy_tbps(4 << 30)
    print(f"copy 4 GiB {cp:.3f} TB/s")
    for s, N, V in shapes(args):
        z, g, o, fwd, fwdg = setup(N, V)
        dst = torch.empty_like(z)
        # (the last column: the bytes the forward reads, moved at HALF the copy rate: the time
        # a copy of them takes; pct_of_copy elsewhere divides by the full rate, half this)
        ideal = N * V * 2 / (cp / 2 * 1e12) * 1e6
        for name, fn in (("fusedce fwd", fwd),
                         ("triton read", lambda: rowread[(N,)](z, o, V, BLOCK=4096, num_warps=8)),
                         ("copy(2x bytes)", lambda: dst.copy_(z)), ("fusedce fwd+grad", fwdg)):
            a, b, c = t_zero_flush(fn) * 1e3, t_read_flush(fn) * 1e3, t_noflush(fn) * 1e3
            print(f"{s} {name:18s} zero-flush {a:8.1f} us  read-flush {b:8.1f} us  "
                  f"no-flush(back to back) {c:8.1f} us   (a 4 GiB-rate copy of the bytes read {ideal:.1f} us)")
        del z, g, dst


def timeline_of(tag, fn, flush):
    for _ in range(5):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and e.time_range.end > e.time_range.start], key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in ev:
        if "fill" in e.name or "elementwise" in e.name or "memset" in e.name.lower() or "zero" in e.name:
            if cur:
                calls.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur:
        calls.append(cur)
    calls = [c for c in calls if c][2:]
    span = statistics.median([c[-1].time_range.end - c[0].time_range.start for c in calls])
    names = {}
    for c in calls:
        for i, e in enumerate(c):
            names.setdefault((i, e.name.split("<")[0].split("(")[0][-24:]), []).append(
                e.time_range.end - e.time_range.start)
    print(f"{tag}: span {span:.1f} us; " + ", ".join(
        f"{nm} {statistics.median(d):.1f}" for (i, nm), d in sorted(names.items())))


def timeline(args):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for s, N, V in shapes(args):
        z, g, o, fwd, fwdg = setup(N, V)
        print(f"{s}: ideal read at 3.027 TB/s {N * V * 2 / 3.027e6:.1f} us")
        timeline_of(f"{s} fusedce fwd", fwd, flush)
        timeline_of(f"{s} triton read", lambda: rowread[(N,)](z, o, V, BLOCK=4096, num_warps=8), flush)


def triton_variants(args):
    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    for s, N, V in shapes(args):
        z = (torch.randn(N, V, device="cuda") * 4).bfloat16()
        o = torch.empty(N, device="cuda")
        ideal = N * V * 2 / 3.027e6
        out = []
        for name, grid, kw in (
                ("plain 8w B4096 st3", N, dict(BLOCK=4096, num_warps=8, num_stages=3, PERSIST=False, EXP=False)),
                ("plain 8w B4096 st1", N, dict(BLOCK=4096, num_warps=8, num_stages=1, PERSIST=False, EXP=False)),
                ("exp   8w B4096 st3", N, dict(BLOCK=4096, num_warps=8, num_stages=3, PERSIST=False, EXP=True)),
                ("exp   8w B2048 st4", N, dict(BLOCK=2048, num_warps=4, num_stages=4, PERSIST=False, EXP=True)),
                ("persist132 8w st3", 132, dict(BLOCK=4096, num_warps=8, num_stages=3, PERSIST=True, EXP=False)),
                ("persist528 8w st3", 528, dict(BLOCK=4096, num_warps=8, num_stages=3, PERSIST=True, EXP=False)),
                ("persist132 16w B8192", 132, dict(BLOCK=8192, num_warps=16, num_stages=3, PERSIST=True, EXP=False))):
            t = ms(lambda: rowread_opts[(grid,)](z, o, N, V, **kw)) * 1e3
            out.append(f"{name} {t:.1f}us ({100 * ideal / t:.0f}%)")
        print(s, f"ideal {ideal:.1f}us |", " | ".join(out))


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    {"--timing": timing, "--timeline": timeline, "--triton": triton_variants}[mode](rest)
