"""GPU timeline of fce_forward calls: per call the span from its first kernel's start to its last
kernel's end, each kernel's duration (the denominators, the rows, the finalize) and the gaps
between them (torch profiler; negative gaps: overlapped by programmatic dependent launch). A
256 MB memset between calls (as do_bench's L2 flush) keeps the host ahead of the GPU.
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python \
        python3 dev/ce_timeline.py 1024x32000xbf16xg 4096x32000xbf16xf   # g: with the gradient
"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import ce_calls, dtypes
DTYPES = dtypes()
from torch.profiler import profile, ProfilerActivity
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for s in sys.argv[1:]:
    N, V, dt, mode = s.split("x"); N, V = int(N), int(V)
    z = (torch.randn(N, V, device="cuda") * 4).to(DTYPES[dt]); y = torch.randint(0, V, (N,), device="cuda")
    grad = torch.empty_like(z)
    fwd, fwd_grad, _ = ce_calls(z, y, grad)
    fn = fwd if mode == "f" else fwd_grad
    for _ in range(5): flush.zero_(); fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            flush.zero_(); fn()
        torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start], key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in ev:
        if "fill" in e.name or "elementwise" in e.name or "memset" in e.name.lower() or "zero" in e.name:
            if cur: calls.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur: calls.append(cur)
    calls = [c for c in calls if c][2:]
    import statistics as st
    span = st.median([c[-1].time_range.end - c[0].time_range.start for c in calls])
    names = {}
    for c in calls:
        for i, e in enumerate(c):
            nm = e.name.split("<")[0].split("(")[0][-28:]
            names.setdefault((i, nm), []).append(e.time_range.end - e.time_range.start)
    gaps = [st.median([c[i + 1].time_range.start - c[i].time_range.end for c in calls if len(c) > i + 1]) for i in range(len(calls[0]) - 1)]
    nb = N * V * z.element_size() * (1 if mode == "f" else 2)
    print(f"{s}: span {span:.1f} us (ideal at 3.02 TB/s {nb / 3.02e6:.1f} us); kernels " +
          ", ".join(f"{nm} {st.median(d):.1f}" for (i, nm), d in sorted(names.items())) +
          "; gaps " + ", ".join(f"{g:.1f}" for g in gaps))
