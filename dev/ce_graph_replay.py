"""fce_forward at small shapes: eager calls (do_bench, as tune_ce.py times them) against the same
calls replayed from a CUDA graph (no host work per call), to split the host's share of the time
from the GPU's.  Run from the repository root:
    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python3 dev/ce_graph_replay.py [NxVxdtype ...]
"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from harness import ce_calls, copy_tbps, dtypes, time_ms as bench_ms
DTYPES = dtypes()
copy = copy_tbps(4 << 30)
for s in (sys.argv[1:] or ["4096x32000xbf16", "1024x128256xbf16", "4096x50257xbf16", "1024x32000xbf16"]):
    N, V, dt = s.split("x"); N, V = int(N), int(V)
    z = (torch.randn(N, V, device="cuda") * 4).to(DTYPES[dt]); y = torch.randint(0, V, (N,), device="cuda")
    grad = torch.empty_like(z)
    fwd, fwd_grad, _ = ce_calls(z, y, grad)
    out = [s]
    for name, fn, nb in (("fwd", fwd, N * V * z.element_size()), ("fwd+grad", fwd_grad, 2 * N * V * z.element_size())):
        e = bench_ms(fn)
        st = torch.cuda.Stream()
        with torch.cuda.stream(st):
            fn(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=st):
                for _ in range(10): fn()
        torch.cuda.synchronize()
        gr = bench_ms(lambda: g.replay()) / 10
        out.append(f"{name}: eager {e*1e3:.1f} us ({100*nb/copy/1e12/(e*1e-3):.1f} %), graph {gr*1e3:.1f} us ({100*nb/copy/1e12/(gr*1e-3):.1f} %)")
    print(" | ".join(out))
