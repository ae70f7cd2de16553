"""Where the wall time of fusedce.torch.linear_cross_entropy goes beyond its kernels: cuda-event
timing of the torch loop and of the bare C call (the same 1 GiB-budget workspace), and the idle
gaps of one iteration's GPU timeline (chrome trace).  Run from the repository root:
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python3 dev/linear_gaps.py [NxDxV ...]
"""
import sys, json, os, ctypes, time, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import options, ptr, stream
from fusedce import _lib
from profile_linear import problem, shapes_of
from torch.profiler import profile, ProfilerActivity
shapes = shapes_of(sys.argv[1:], ["8192x4096x128256", "8192x2304x256000"])
def ev_ms(fn, n=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(n):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); out.append(s.elapsed_time(e))
    return out
for N, D, V in shapes:
    h, W, y, it = problem(N, D, V)
    t_torch = ev_ms(it)
    o = options(torch.bfloat16)
    lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
    _lib.call("fce_linear_ce_workspace_size", ctypes.byref(o), N, D, V, 1, ctypes.byref(lo), ctypes.byref(hi))
    ws_bytes = max(lo.value, min(hi.value, (1 << 30) - 16 * N - 4096))
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    loss = torch.empty(1, device="cuda"); dh = torch.empty_like(h); dW = torch.empty_like(W)
    def c():
        _lib.check(_lib.load().fce_linear_ce(ctypes.byref(o), N, D, V, ptr(h), ptr(W), None, ptr(y), ptr(loss), None, None,
            ptr(dh), ptr(dW), None, None, None, ptr(ws), ws_bytes, stream()), "fce_linear_ce")
    t_c = ev_ms(c)
    torch.cuda.synchronize(); t0 = time.perf_counter(); c(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"== {N}x{D}x{V} ws {ws_bytes/2**20:.0f} MiB (min {lo.value/2**20:.0f}, full {hi.value/2**20:.0f})")
    print("torch loop ms", " ".join(f"{x:.2f}" for x in t_torch))
    print("C call ms   ", " ".join(f"{x:.2f}" for x in t_c), f"| host enqueue {1e3*(t1-t0):.2f} ms, total {1e3*(t2-t0):.2f}")
    for name, fn in (("torch", it), ("c", c)):
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn(); torch.cuda.synchronize()
        prof.export_chrome_trace("/tmp/tr.json")
        ev = json.load(open("/tmp/tr.json"))["traceEvents"]
        k = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")], key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in k); span = k[-1]["ts"] + k[-1]["dur"] - k[0]["ts"]
        print(f"{name}: span {span/1e3:.2f} ms, busy {busy/1e3:.2f} ms, {len(k)} gpu ops")
        gaps = [(k[i+1]["ts"] - (k[i]["ts"] + k[i]["dur"]), k[i]["name"][:50], k[i+1]["name"][:50]) for i in range(len(k)-1)]
        for g in sorted(gaps, reverse=True)[:5]: print(f"   gap {g[0]/1e3:.3f} ms after {g[1]} before {g[2]}")
        cpu = sorted([e for e in ev if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"], key=lambda e: -e["dur"])[:6]
        for e in cpu: print(f"   host {e['name'][:40]} {e['dur']/1e3:.3f} ms")
    del h, W, y, ws, dh, dW; torch.cuda.empty_cache()
