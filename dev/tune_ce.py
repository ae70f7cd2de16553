"""Times fusedce's CE kernels under each setting of the knobs of lib/cuda/common/knobs.h
(FCE_CUDA_CE_PATH, FCE_CUDA_CE_SMEM, FCE_CUDA_CE_CLUSTER are read once per process, so each
setting runs in a child process).
    python3 tune_ce.py [--settings default,k=8,...] [--shapes ...]   # the table
    python3 tune_ce.py --child SHAPES                                # one setting (internal)
"""
import argparse
import json
import os
import subprocess
import sys

SHAPES = "16384x128256xbf16,8192x256000xbf16,32768x32000xbf16,8192x151936xbf16,4096x50257xbf16,8192x128256xf32"
ALL_SETTINGS = {"default": {}, "twopass": {"FCE_CUDA_CE_PATH": "twopass"},
                "regs": {"FCE_CUDA_CE_PATH": "regs"},
                "k>=2": {"FCE_CUDA_CE_CLUSTER": "2"}, "k>=4": {"FCE_CUDA_CE_CLUSTER": "4"},
                "k=8": {"FCE_CUDA_CE_CLUSTER": "8"}, "k=16": {"FCE_CUDA_CE_CLUSTER": "16"},
                "bulk0": {"FCE_CUDA_CE_PATH": "nobulk"}, "bulk2": {"FCE_CUDA_CE_PATH": "bulk"},
                "smem0": {"FCE_CUDA_CE_SMEM": "0"}, "smem4": {"FCE_CUDA_CE_SMEM": "4"},
                "smem8": {"FCE_CUDA_CE_SMEM": "8"},
                "smemA": {"FCE_CUDA_CE_SMEM": "always"},
                "k1": {"FCE_CUDA_CE_CLUSTER": "1"}, "k2": {"FCE_CUDA_CE_CLUSTER": "2"},
                "k3": {"FCE_CUDA_CE_CLUSTER": "3"}, "k4": {"FCE_CUDA_CE_CLUSTER": "4"},
                "k5": {"FCE_CUDA_CE_CLUSTER": "5"}, "k6": {"FCE_CUDA_CE_CLUSTER": "6"}}
# The settings pf* (FCE_CUDA_CE_PREFETCH), xmbar0 (FCE_CUDA_CE_XMBAR=0), pdl0 (FCE_CUDA_CE_PDL=0)
# and the FCE_CUDA_CE_BULK_GRAD ones (bulkgrad, bulkgrad0, smem12bg0, smem0bg0) are gone with
# their knobs: their measurements are in dev/NOTES.md; the defaults they chose are in
# ce/policy.h's table. smemA is now FCE_CUDA_CE_SMEM=always, which also keeps the bulk kernel
# off rows with a gradient (what smemAbg0 was).
# (FCE_CUDA_CE_CLUSTER=k: that cluster size wherever a row's slices fit it, else the chosen one;
# the "k>=" names are from when it meant the smallest size to use)
SETTINGS = "default,twopass,k>=2,k>=4,k=8"
# FUSEDCE_LIBRARY_B=path[:path...]: also time those libraries (settings "libB", "libC", ...,
# defaults otherwise) for an A/B of builds in one run


def child(shapes):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from harness import ce_calls, copy_tbps, dtypes, time_ms as bench_ms
    DTYPES = dtypes()
    out = {"copy_tbps": copy_tbps(4 << 30)}
    for s in shapes.split(","):
        N, V, dt = s.split("x")
        N, V = int(N), int(V)
        gen = torch.Generator(device="cuda").manual_seed(N + V)  # the same data in every child
        z = (torch.randn(N, V, device="cuda", generator=gen) * 4).to(DTYPES[dt])
        y = torch.randint(0, V, (N,), device="cuda", generator=gen)
        grad = torch.empty_like(z)
        fwd, fwd_grad, _ = ce_calls(z, y, grad)
        t = (bench_ms(fwd), bench_ms(fwd_grad))
        fwd_grad()
        torch.cuda.synchronize()
        # a checksum of the gradient's bits: identical across settings that compute the same bits
        # (in blocks of rows: int64 copies of a whole 2.5 G-element gradient would not fit)
        flat = grad.view(torch.int16 if grad.element_size() == 2 else torch.int32).view(-1)
        step, total = 1 << 28, 0
        for b in range(0, flat.numel(), step):
            bits = flat[b:b + step].to(torch.int64)
            pos = torch.arange(b + 1, b + bits.numel() + 1, device="cuda")
            total += int((bits * pos % 1000003).sum())
            del bits, pos
        out[s] = (t[0], t[1], total)
        del z, y, grad
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--settings", default=SETTINGS, help="comma list of " + ",".join(ALL_SETTINGS))
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    rows = {}
    names = args.settings.split(",")
    # FUSEDCE_LIBRARY_B=path[:path...]: also time those builds (settings libB, libC, ...)
    for i, path in enumerate(filter(None, os.environ.get("FUSEDCE_LIBRARY_B", "").split(":"))):
        ALL_SETTINGS["lib" + "BCDEFG"[i]] = {"FUSEDCE_LIBRARY": path}
        names.append("lib" + "BCDEFG"[i])
    for name in names:
        env = ALL_SETTINGS[name]
        r = subprocess.run([sys.executable, __file__, "--child", args.shapes], capture_output=True,
                           text=True, env={**os.environ, **env})
        if r.returncode != 0:
            print(name, "failed:", r.stderr[-2000:])
            continue
        rows[name] = json.loads(r.stdout.strip().splitlines()[-1])
    print("fwd ms / fwd+grad ms (fwd % / fwd+grad % of copy) per setting; * = gradient bits differ from the default's")
    print("shape".ljust(20) + "".join(n.ljust(30) for n in rows))
    for s in args.shapes.split(","):
        ref = rows["default"][s][2] if "default" in rows else None
        N, V, dt = s.split("x")
        nbytes = 2 * int(N) * int(V) * (4 if dt == "f32" else 2)

        def cell(n):
            fw, fg, bits = rows[n][s]
            pct = 100 * nbytes / (rows[n]["copy_tbps"] * 1e12) / (fg * 1e-3)
            pf = 100 * nbytes / 2 / (rows[n]["copy_tbps"] * 1e12) / (fw * 1e-3)
            return (f"{fw:.3f}/{fg:.3f} ({pf:.1f}/{pct:.1f})" + ("*" if ref is not None and bits != ref else "")).ljust(30)
        print(s.ljust(20) + "".join(cell(n) for n in rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
