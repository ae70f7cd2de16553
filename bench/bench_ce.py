"""Cross-entropy over given logits, the raw C ABI call against the copy speed of the same bytes.

fce_forward (mean, 5 % of rows ignored, random logits of std 4) through ctypes, timed as CUDA
graph replays (harness.time_graph_ms: the GPU's time, no host work):
  forward        loss only: reads N·V·e bytes;
  forward+grad   loss and gradient in one pass (the training path): reads and writes N·V·e.
pct_of_copy = the bytes moved / time, over a device-to-device copy measured in this run (bytes
read + written / s); "copy-ceiling" rows are that copy's time for the same bytes.

    python3 bench/bench_ce.py [--shapes 16384x128256xbf16,...] [--matrix] [--out DIR]
--matrix: the speed-of-light grid instead (V in 32000, 50257, 128256, 151936, 256000 x N in
1024, 4096, 16384, bf16 and f16; float32 at N = 4096), written as ce-matrix-<device>.json.
Writes bench/results/ce-<device>.json (and DIR/).
"""
import argparse
import gc

import harness

SHAPES = [(16384, 128256, "bf16"), (8192, 256000, "bf16"), (32768, 32000, "bf16"),
          (4096, 50257, "bf16"), (8192, 128256, "f32")]
MATRIX_V = (32000, 50257, 128256, 151936, 256000)
MATRIX_N = (1024, 4096, 16384)
IGNORE = -100


def parse_shapes(text):
    out = []
    for tok in text.split(","):
        n, v, *dt = tok.strip().split("x")
        out.append((int(n), int(v), dt[0] if dt else "bf16"))
    return out


def run_shape(N, V, dt, copy, records):
    import torch
    dtype = harness.dtypes()[dt]
    e = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device="cuda").manual_seed(N + V)
    z = (torch.randn(N, V, device="cuda", generator=gen) * 4).to(dtype)
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    y[torch.rand(N, device="cuda", generator=gen) < 0.05] = IGNORE
    grad = torch.empty_like(z)
    nbytes = N * V * e
    forward, forward_grad, ws_mib = harness.ce_calls(z, y, grad)

    def rec(op, impl, ms, extra):
        moved = nbytes * (1 if op == "forward" else 2)
        tbps = moved / (ms * 1e-3) / 1e12
        records.append(dict(op=op, impl=impl, dtype=dt, N=N, V=V, ms=round(ms, 4),
                            tbps=round(tbps, 3), pct_of_copy=round(100 * tbps / copy, 1),
                            extra_mib=round(extra, 1)))

    rec("forward", "fusedce", harness.time_graph_ms(forward), ws_mib)
    rec("forward+grad", "fusedce", harness.time_graph_ms(forward_grad), ws_mib)
    rec("forward", "copy-ceiling", nbytes / (copy * 1e12 / 2) * 1e3, 0.0)
    rec("forward+grad", "copy-ceiling", 2 * nbytes / (copy * 1e12) * 1e3, 0.0)
    del z, y, grad, forward, forward_grad
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help="e.g. 16384x128256xbf16,4096x50257xbf16")
    ap.add_argument("--matrix", action="store_true", help="the speed-of-light grid")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    args = ap.parse_args()
    shapes = SHAPES
    if args.matrix:
        shapes = [(n, v, dt) for dt in ("bf16", "f16") for v in MATRIX_V for n in MATRIX_N]
        shapes += [(4096, v, "f32") for v in MATRIX_V]
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    dev = harness.device_name()
    copy = harness.copy_tbps()
    print(f"device {dev}: copy {copy:.3f} TB/s (read + written, 4 GiB)")
    run = harness.run_info(copy_tbps=round(copy, 3), timing="CUDA graph replays of 10 calls, median")
    records = []
    for N, V, dt in shapes:
        run_shape(N, V, dt, copy, records)
        harness.print_table([r for r in records if (r["N"], r["V"], r["dtype"]) == (N, V, dt)],
                            ["op", "impl", "dtype", "N", "V", "ms", "tbps", "pct_of_copy", "extra_mib"])
        print(flush=True)
    bench = "ce-matrix" if args.matrix else "ce"
    harness.write(bench, dev, run, records, [args.out])
    print(f"wrote {harness.result_path(bench, dev)}")


if __name__ == "__main__":
    main()
