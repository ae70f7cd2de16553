"""Per-CTA timeline of the register-path row kernel (dev/NOTES.md, "What the remaining targets ask, measured").

A measurement, not part of the library: it needs a build with instrument.patch applied, which
stamps %globaltimer in thread 0 of each CTA (before its loads, after its CTA-wide fold, before
its gradient, at its end) into a device array that `fce_debug_timeline` copies out:
    git worktree add /tmp/tl HEAD && cd /tmp/tl && git apply dev/cta_timeline/instrument.patch
    cmake -S . -B build90 -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90
    cmake --build build90 --target fusedce
then, on an sm_90 GPU, from the repository root:
    FUSEDCE_LIBRARY=/tmp/tl/build90/libfusedce.so PYTHONPATH=bindings/python \
        python3 dev/cta_timeline/probe.py 4096x32000 1024x128256      # bf16, fwd + grad, mean
FLUSH=zero (default: a 256 MB fill before the call, as do_bench), read (a 256 MB read) or none.
Prints, per shape and repetition, the span from the first CTA's start to the last CTA's end, the
median phases of the first wave, of all CTAs and of the last tenth, and for the last repetition
the bandwidth per 4 µs (each CTA's row bytes spread over its load+fold and its gradient phase).
"""
import ctypes, os, sys, statistics
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from harness import ce_calls
from fusedce import _lib
lib = _lib.load()
NT = (1 << 17) * 5
buf = (ctypes.c_ulonglong * NT)()
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
mode = os.environ.get("FLUSH", "zero")
def do_flush():
    if mode == "zero": flush.zero_()
    elif mode == "read": flush.view(torch.int64).sum()
for s in sys.argv[1:]:
    N, V = (int(x) for x in s.split("x"))
    torch.manual_seed(0)
    z = (torch.randn(N, V, device="cuda") * 4).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda")
    grad = torch.empty_like(z)
    fwd, fwd_grad, _ = ce_calls(z, y, grad)
    for rep in range(3):
        for _ in range(3): do_flush(); fwd_grad()
        do_flush(); torch.cuda.synchronize(); fwd_grad(); torch.cuda.synchronize()
        assert lib.fce_debug_timeline(buf, ctypes.sizeof(buf)) == 0
        e = [buf[i*5:(i+1)*5] for i in range(NT // 5)]
        tmax = max(r[3] for r in e)
        e = [r for r in e if r[0] and r[3] > tmax - 3_000_000 and r[0] <= r[3]]
        ncta = len(e); k = max(1, ncta // N)
        T0 = min(r[0] for r in e); Tend = max(r[3] for r in e)
        rb = V * 2 / k  # bytes per CTA, each way
        dur = (Tend - T0) / 1e3
        ideal = 2 * N * V * 2 / 3.03e12 * 1e6
        life = sorted((r[3] - r[0]) / 1e3 for r in e)
        starts = sorted((r[0] - T0) / 1e3 for r in e)
        ends = sorted((r[3] - T0) / 1e3 for r in e)
        sms = len(set(r[4] for r in e))
        print(f"[{mode}] {s} rep{rep}: {ncta} CTAs (k={k}) on {sms} SMs, first start..last end {dur:.1f} us (ideal {ideal:.1f}); "
              f"first exit at {ends[0]:.1f}, last start at {starts[-1]:.1f}, last end - last start {dur - starts[-1]:.1f}")
        first = [r for r in e if (r[0] - T0) < 1000]
        def med(xs): return statistics.median(xs) if xs else float('nan')
        for name, grp in (("first wave", first), ("all", e), ("last 10%", sorted(e, key=lambda r: r[0])[-max(1, ncta // 10):])):
            print(f"   {name:10s} n={len(grp):5d} load+fold {med([(r[1]-r[0])/1e3 for r in grp]):6.2f}  exchange {med([(r[2]-r[1])/1e3 for r in grp]):5.2f}  "
                  f"grad {med([(r[3]-r[2])/1e3 for r in grp]):6.2f}  life {med([(r[3]-r[0])/1e3 for r in grp]):6.2f} us")
        if rep == 2:
            # bandwidth over time (reads spread over [t0, t1], writes over [t2, t3]), 4 us bins
            nb = int(dur // 4) + 1; rd = [0.0] * nb; wr = [0.0] * nb
            for r in e:
                for (a, b, arr) in ((r[0], r[1], rd), (r[2], r[3], wr)):
                    a = (a - T0) / 1e3; b = max((b - T0) / 1e3, a + 1e-3)
                    for i in range(int(a // 4), int(b // 4) + 1):
                        lo, hi = max(a, i * 4), min(b, i * 4 + 4)
                        if hi > lo and i < nb: arr[i] += rb * (hi - lo) / (b - a)
            print("   TB/s per 4 us (read+write):", " ".join(f"{(rd[i]+wr[i])/4e-6/1e12:.2f}" for i in range(nb)))
    del z, y, grad
