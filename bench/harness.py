"""The one harness of the benchmarks in bench/: timing, ceilings, device name, result files.

Timing (CUDA events, medians; every call gets fresh L2 unless said otherwise):
  time_ms(fn)        the median of per-call CUDA event spans, a 256 MiB write before each call
                     (outside the span) so that no call finds the previous one's data in L2, after
                     a warm-up; the number of calls follows the time budgets (as triton's do_bench).
                     What a user meets: the host's work per call is inside the span when the host
                     is slower than the GPU.
  time_iters_ms(fn)  the same for calls of 20 ms to 1 s: a fixed number of warm-up and timed calls.
  time_back_to_back(fn)  ms and host ms per call of back-to-back calls (no flush between)
  time_graph_ms(fn)  the median per call of CUDA graph replays of `per_graph` back-to-back calls:
                     the GPU's time alone, no host work per call (the raw C ABI calls).
Ceilings, measured in the same run as the kernels they bound:
  copy_tbps()        a device-to-device copy of 4 GiB, (bytes read + bytes written) / s;
  gemm_tflops()      a bf16 8192³ product through torch.matmul, after 0.3 s of the same products
                     (the clocks up), 2·n³ / s.
Results: bench/results/<bench>-<device>.json, overwritten by each run on that device (git keeps
the history); `merge=True` replaces only the records measured now (a second call that adds the
peers needing another runtime). The schema is in docs/performance.md ("Result files").

Only the standard library is imported at module level: tables.py and the CPU benchmark use the
file helpers on machines without torch or a GPU.
"""
import ctypes
import datetime
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
SCHEMA = "fusedce-bench/1"
FLUSH_BYTES = 256 << 20

# this checkout's binding, unless PYTHONPATH names another fusedce (dev/before_after.sh)
if not any(os.path.isdir(os.path.join(p, "fusedce"))
           for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))


# ------------------------------------------------------------------------ the device ----
def device_name():
    """The CUDA device's name as result files spell it: spaces → '-' (NVIDIA-H200)."""
    import torch
    return torch.cuda.get_device_name().replace(" ", "-")


def dtypes():
    import torch
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def fce_dtype(dtype):
    import torch
    from fusedce import _lib
    return {torch.float32: _lib.FCE_FLOAT32, torch.float16: _lib.FCE_FLOAT16,
            torch.bfloat16: _lib.FCE_BFLOAT16}[dtype]


# ------------------------------------------------------------------------- timing ----
_FLUSH = {}


def _flush_buffer():
    import torch
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return _FLUSH[dev]


def _events(n):
    import torch
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)]


def _timed_calls(fn, n, flush):
    import torch
    cache = _flush_buffer() if flush else None
    ev = _events(n)
    for a, b in ev:
        if cache is not None:
            cache.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def time_ms(fn, warmup_ms=25.0, rep_ms=100.0, flush=True, min_reps=5, max_reps=1000):
    """Median ms of fn() per call: CUDA events around each call, after warmup_ms of calls."""
    import torch
    torch.cuda.synchronize()
    est = statistics.median(_timed_calls(fn, 3, flush))
    for _ in range(max(1, int(warmup_ms / max(est, 1e-3)))):
        fn()
    reps = min(max_reps, max(min_reps, int(rep_ms / max(est, 1e-3))))
    return statistics.median(_timed_calls(fn, reps, flush))


def time_back_to_back(fn, calls=200, warmup=20):
    """(ms, host_ms) per call of `calls` back-to-back calls with no flush and no event between
    them: ms spans the first call's start to the last one's end on the GPU, so host time shows
    wherever the host cannot keep ahead of the GPU; host_ms is the host's own time per call
    (perf_counter around the loop, before the final synchronisation)."""
    import time

    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    host = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls, host


def time_iters_ms(fn, warmup=1, reps=5, flush=True):
    """Median ms of `reps` event-timed calls after `warmup` calls (slow calls: 20 ms to 1 s)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_timed_calls(fn, reps, flush))


def time_graph_ms(fn, per_graph=10, replays=10, warmup=2):
    """Median ms per call of CUDA graph replays of `per_graph` calls of fn (captured on a side
    stream; fn must be capturable: no host synchronisation, no allocation)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # the first call outside the capture: lazy initialisations happen here
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(per_graph):
                fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        graph.replay()
    times = _timed_calls(graph.replay, replays, flush=False)
    return statistics.median(times) / per_graph


def peak_extra_mib(fn, baseline_bytes=0):
    """Peak bytes torch allocated while running fn, above what was allocated before and above
    baseline_bytes (e.g. the gradients fn returns), in MiB."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return max(0.0, (torch.cuda.max_memory_allocated() - start - baseline_bytes) / 2 ** 20)


# ----------------------------------------------------------------------- ceilings ----
def copy_tbps(nbytes=4 << 30):
    """Device-to-device copy of nbytes: (bytes read + written) / s, in TB/s."""
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush=False)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def gemm_tflops(n=8192):
    """bf16 n³ product through torch.matmul after 0.3 s of the same products, in TFLOP/s."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b, out=c), warmup_ms=300.0, flush=False)
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def ceilings():
    """{copy_tbps, gemm_tflops} of this device, now."""
    return dict(copy_tbps=round(copy_tbps(), 3), gemm_tflops=round(gemm_tflops(), 1))


# ---------------------------------------------------------------- the run and files ----
def versions(*dists):
    """{distribution: version} of the installed Python distributions named (those found)."""
    from importlib import metadata
    out = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_info(**extra):
    """What identifies a run: its id (UTC time), date, the library, torch/CUDA, host."""
    now = datetime.datetime.now(datetime.timezone.utc)
    info = dict(id=now.strftime("%Y-%m-%dT%H:%M:%SZ"), date=now.strftime("%Y-%m-%d"),
                python=platform.python_version(), host=platform.node(),
                argv=" ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)))
    try:
        import fusedce
        info["fusedce"] = ".".join(map(str, fusedce.library_version()))
    except Exception:  # noqa: BLE001 - the file is still worth writing
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    info.update(extra)
    return info


def result_path(bench, device, out_dir=None):
    return os.path.join(out_dir or RESULTS, f"{bench}-{device}.json")


def load(path):
    """A result file: {schema, bench, device, date, runs, records}."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} result file")
    return doc


def write(bench, device, run, records, out_dirs=(), merge_key=None):
    """Writes bench/results/<bench>-<device>.json (and the same name in each of out_dirs):
    this run's records, replacing the file. With merge_key (a function of a record), the
    existing file's runs and records are kept except those whose key is measured now. Records
    carry run = the run's id. Returns the document."""
    path = result_path(bench, device)
    for r in records:
        r.setdefault("run", run["id"])
    runs, kept = [run], []
    if merge_key is not None and os.path.exists(path):
        old = load(path)
        now = {merge_key(r) for r in records}
        kept = [r for r in old["records"] if merge_key(r) not in now]
        used = {r.get("run") for r in kept}
        runs = [x for x in old["runs"] if x["id"] in used] + [run]
    doc = dict(schema=SCHEMA, bench=bench, device=device, date=max(x["date"] for x in runs),
               runs=runs, records=kept + records)
    for d in [RESULTS, *out_dirs]:
        if d:
            os.makedirs(d, exist_ok=True)
            with open(result_path(bench, device, d), "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
    return doc


def print_table(rows, cols):
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


# ------------------------------------------------------------- the C ABI, through ctypes ----
def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def stream():
    import torch
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def options(dtype, **fields):
    """fce_options for the CUDA backend, int64 targets, the tensor dtype, and fields."""
    from fusedce import _lib
    o = _lib.default_options()
    o.backend = _lib.FCE_BACKEND_CUDA
    o.dtype = fce_dtype(dtype)
    o.target_dtype = _lib.FCE_INT64
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def ce_calls(z, y, grad):
    """fce_forward on logits z [N, V], targets y (int64), mean: (forward(), forward_grad(),
    workspace MiB). forward_grad writes the gradient into grad in the same pass (the training
    path). Both read the stream when called, so they can be captured in a CUDA graph."""
    import torch
    from fusedce import _lib
    N, V = z.shape
    o = options(z.dtype)
    ws_bytes = ctypes.c_size_t()
    _lib.call("fce_forward_workspace_size", ctypes.byref(o), N, V, ctypes.byref(ws_bytes))
    ws = torch.empty(max(ws_bytes.value, 16), dtype=torch.uint8, device="cuda")
    loss = torch.empty(1, device="cuda")
    lse = torch.empty(N, device="cuda")
    lib = _lib.load()
    args = (ctypes.byref(o), N, V, ptr(z), ptr(y))
    out_loss = _lib.outputs(loss=loss.data_ptr())
    out_lse = _lib.outputs(loss=loss.data_ptr(), lse=lse.data_ptr())
    grads = _lib.gradients(grad_logits=grad.data_ptr())

    def forward():
        lib.fce_forward(*args, ctypes.byref(out_loss), None, ptr(ws), ws_bytes.value, stream())

    def forward_grad():
        lib.fce_forward(*args, ctypes.byref(out_lse), ctypes.byref(grads), ptr(ws),
                        ws_bytes.value, stream())

    _lib.check(lib.fce_forward(*args, ctypes.byref(out_lse), ctypes.byref(grads), ptr(ws),
                               ws_bytes.value, stream()), "fce_forward")
    return forward, forward_grad, ws_bytes.value / 2 ** 20
