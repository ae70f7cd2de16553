"""Accuracy of the weight gradient ∂W = Σ_rows ∂Zᵀ·h when it is accumulated in bf16 over k token chunks.

A fused linear + cross-entropy that processes the N rows in k token chunks can sum ∂W directly in
the bf16 output buffer: dW = bf16(dZ_1ᵀh_1), dW = bf16(dW + dZ_2ᵀh_2), ... (exactly
`dW.addmm_(dZc.t(), hc)` in bf16: cuBLAS accumulates in float32 and rounds once per call), so k
roundings instead of one. The spec allows that only if "its error stays within 2x torch eager's
against float64 at N up to 65536". This script measures it.

Per case (N, D, V) and per logit regime (std ~2, where eager's own error is dominated by rounding
the logits to bf16, and std ~0.5), the relative Frobenius error ||X - ref|| / ||ref|| against a
float64 reference (mean cross-entropy of the exact h·Wᵀ of the bf16 inputs, 5 % ignored rows), and
the max-abs error max |X - ref| / max |ref|, of:
  eager        torch eager bf16: F.linear -> F.cross_entropy(logits.float()) -> backward
  bf16-accum   dW = 0 (bf16); dW.addmm_(dZ16[c].t(), h[c]) over k equal row chunks
  fp32-accum   the same into a float32 buffer (float32 inputs, no TF32), one final cast to bf16
  fusedce-*    fusedce's own ∂W and ∂h, when the library loads (FUSEDCE_LIBRARY)
dZ16 is eager's own gradient of the bf16 logits (logits.retain_grad()), so the ∂W plans share it
and differ only in how ∂W is summed. ratio = err / eager's err for the same gradient, max_ratio the
same for the max-abs error.

  FUSEDCE_LIBRARY=build/libfusedce.so python3 bench/accuracy_dw.py [--out DIR] [--no-big | --study]
Writes bench/results/accuracy-dw-<device>.json (and DIR/ or $OUT/); bench/tables.py --op
accuracy-dw prints its table.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

import harness
from harness import print_table

CASES = [(8192, 1024, 32000), (32768, 1024, 32000), (65536, 1024, 32000)]
BIG = (8192, 4096, 128256)
# The chunk rule's study (docs/performance.md): N up to 65536, V from 32000 to 256000, N / V from
# 0.06 to 2 (--study: these and CASES[1:] + BIG)
STUDY = [(32768, 4096, 151936), (65536, 4096, 151936), (65536, 4096, 128256),
         (65536, 2304, 256000), (65536, 4096, 50257), (65536, 4096, 32000)]
REGIMES = {"std2": 2.0, "std0.5": 0.5}  # target standard deviation of the logits
KS = [1, 2, 4, 8, 12, 16, 24, 32, 64]
WORKSPACES = [None, 256 << 20, 64 << 20]  # None: the library's optimal size
IGNORE = -100


def rel_err(x, ref, ref_norm, ref_max, rows=8192):
    """(||x - ref||_F / ||ref||_F, max |x - ref| / max |ref|) in float64, by row chunks (no
    whole float64 copy of x)."""
    acc = torch.zeros((), dtype=torch.float64, device=ref.device)
    top = torch.zeros((), dtype=torch.float64, device=ref.device)
    for i in range(0, ref.shape[0], rows):
        d = x[i:i + rows].double() - ref[i:i + rows]
        acc += d.pow(2).sum()
        top = torch.maximum(top, d.abs().max())
        del d
    return math.sqrt(acc.item()) / ref_norm, top.item() / ref_max


def reference(h, W, y, n_valid):
    """float64 ∂W [V, D], ∂h [N, D] of the mean cross-entropy of h·Wᵀ, by row chunks; and the
    standard deviation of the first chunk's logits."""
    N, D = h.shape
    V = W.shape[0]
    W64 = W.double()
    dW = torch.zeros(V, D, dtype=torch.float64, device=h.device)
    dh = torch.empty(N, D, dtype=torch.float64, device=h.device)
    rows = max(256, (1 << 28) // V)  # <= 2 GiB per [rows, V] float64 temporary
    logit_std = None
    for i in range(0, N, rows):
        hc, yc = h[i:i + rows].double(), y[i:i + rows]
        z = hc @ W64.T
        if logit_std is None:
            logit_std = z.std().item()
        dz = torch.softmax(z, dim=1)
        del z
        valid = yc != IGNORE
        idx = valid.nonzero().squeeze(1)
        dz[idx, yc[idx]] -= 1.0
        dz[~valid] = 0.0
        dz /= n_valid
        dW.addmm_(dz.T, hc)
        dh[i:i + rows] = dz @ W64
        del dz
    return dW, dh, logit_std


def eager(h, W, y, n_valid, full):
    """torch eager in bf16: (∂W, ∂h, dZ16), dZ16 [N, V] bf16 the gradient reaching the logits.
    full: one autograd graph over all rows (logits.retain_grad()). Otherwise dZ16 by chunks of
    rows (autograd of the 'sum' loss with upstream 1/n_valid in float32: the same -1/n_valid and
    the same log_softmax backward as the mean's), then ∂W and ∂h by ONE GEMM each over all rows."""
    if full:
        hh, WW = h.detach().requires_grad_(True), W.detach().requires_grad_(True)
        z = F.linear(hh, WW)
        z.retain_grad()
        F.cross_entropy(z.float(), y, ignore_index=IGNORE).backward()
        return WW.grad, hh.grad, z.grad
    N, V = h.shape[0], W.shape[0]
    dZ = torch.empty(N, V, dtype=h.dtype, device=h.device)
    g = torch.full((), 1.0 / n_valid, dtype=torch.float32, device=h.device)
    rows = max(256, (1 << 28) // V)
    for i in range(0, N, rows):
        zc = F.linear(h[i:i + rows], W).detach().requires_grad_(True)
        loss = F.cross_entropy(zc.float(), y[i:i + rows], ignore_index=IGNORE, reduction="sum")
        dZ[i:i + rows] = torch.autograd.grad(loss, zc, grad_outputs=g)[0]
    return (h.t() @ dZ).t(), dZ @ W, dZ  # ∂W as autograd's mm backward computes it


def chunked_dw(dZ, h, k, fp32):
    """∂W summed over k equal chunks of rows (the last one smaller), in a bf16 buffer
    (k roundings) or a float32 one (one final rounding)."""
    N = h.shape[0]
    step = -(-N // k)
    dW = torch.zeros(dZ.shape[1], h.shape[1], device=h.device,
                     dtype=torch.float32 if fp32 else h.dtype)
    for i in range(0, N, step):
        a, b = dZ[i:i + step].t(), h[i:i + step]
        if fp32:
            a, b = a.float(), b.float()
        dW.addmm_(a, b)
    return dW.to(h.dtype)


def load_fusedce():
    try:
        import fusedce
        import fusedce.torch  # noqa: F401  (registers the ops)
        fusedce.load()
        return fusedce, f"fusedce from {fusedce.library_path()}"
    except Exception as e:  # noqa: BLE001
        return None, f"fusedce skipped ({type(e).__name__}: {e})"


def fusedce_grads(fusedce, h, W, y):
    """[(method, workspace, ∂W, ∂h)] from fusedce, and notes on what could not run.
    fusedce-torch: fusedce.torch.linear_cross_entropy + backward (the workspace through a
    workspace_bytes keyword, where this version has one). fusedce-core: fusedce.linear_ce with a
    bf16 ∂W buffer (grad_weight_fp32=False), the library's own 16-bit ∂W path."""
    out, notes = [], []
    for ws in WORKSPACES:
        hh, WW = h.detach().requires_grad_(True), W.detach().requires_grad_(True)
        kw = {} if ws is None else {"workspace_bytes": ws}
        try:
            fusedce.torch.linear_cross_entropy(hh, WW, y, ignore_index=IGNORE, **kw).backward()
            out.append(("fusedce-torch", ws, WW.grad, hh.grad))
        except Exception as e:  # noqa: BLE001  (TypeError: no workspace_bytes keyword)
            notes.append(f"fusedce-torch ws={ws_label(ws)}: {type(e).__name__}: {e}")
        del hh, WW
        try:
            r = fusedce.linear_ce(h, W, y, ignore_index=IGNORE, return_grad=("hidden", "weight"),
                                  workspace_size="optimal" if ws is None else ws)
            out.append(("fusedce-core", ws, r.grad_weight, r.grad_hidden))
        except Exception as e:  # noqa: BLE001  (e.g. a workspace below the minimum)
            notes.append(f"fusedce-core ws={ws_label(ws)}: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    return out, notes


def ws_label(ws):
    return "" if ws is False else ("optimal" if ws is None else f"{ws >> 20}MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write the JSON here ($OUT)")
    ap.add_argument("--cases", default=None, help="NxDxV,... (default: the three D=1024 cases)")
    ap.add_argument("--no-big", action="store_true", help=f"skip {'x'.join(map(str, BIG))}")
    ap.add_argument("--study", action="store_true",
                    help="the chunk rule's study: CASES[1:], BIG and STUDY (about 4 minutes)")
    ap.add_argument("--no-fusedce", action="store_true")
    ap.add_argument("--eager-full-gb", type=float, default=40.0,
                    help="one eager autograd graph when ~16*N*V bytes fit in this; else by chunks")
    args = ap.parse_args()
    if args.cases:
        cases = [tuple(int(v) for v in s.split("x")) for s in args.cases.split(",")]
    elif args.study:
        cases = CASES[1:] + [BIG] + STUDY
    else:
        cases = CASES + ([] if args.no_big else [BIG])
    torch.set_float32_matmul_precision("highest")  # fp32-accum: true float32 GEMMs, no TF32
    dev = harness.device_name()
    red16 = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    print(f"device {dev}, torch {torch.__version__}, "
          f"allow_bf16_reduced_precision_reduction={red16} (left as the user has it)")
    fusedce, msg = (None, "fusedce skipped (--no-fusedce)") if args.no_fusedce else load_fusedce()
    print(msg)
    records, verdicts, t0 = [], [], time.time()
    for N, D, V in cases:
        case = f"{N}x{D}x{V}"
        gen = torch.Generator(device="cuda").manual_seed(1234 + N + D + V)
        h = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
        W0 = torch.randn(V, D, device="cuda", generator=gen)
        y = torch.randint(0, V, (N,), device="cuda", generator=gen)
        y[torch.rand(N, device="cuda", generator=gen) < 0.05] = IGNORE
        n_valid = int((y != IGNORE).sum())
        full = 16 * N * V <= args.eager_full_gb * 1e9
        case_recs = []
        for regime, std in REGIMES.items():
            W = (W0 * (std / math.sqrt(D))).to(torch.bfloat16)
            dW64, dh64, logit_std = reference(h, W, y, n_valid)
            nW, nh = dW64.norm().item(), dh64.norm().item()
            mW, mh = dW64.abs().max().item(), dh64.abs().max().item()
            base = dict(case=case, N=N, D=D, V=V, regime=regime, logit_std=round(logit_std, 3),
                        n_valid=n_valid, device=dev, torch=torch.__version__,
                        bf16_reduced_precision_reduction=bool(red16))

            def rec(method, grad, err, ref_err, k="", ws=False, **extra):
                (err, maxerr), (ref_err, ref_maxerr) = err, ref_err
                r = dict(base, method=method, grad=grad, k=k, ws=ws_label(ws), err=err,
                         ratio=err / ref_err, maxerr=maxerr, max_ratio=maxerr / ref_maxerr,
                         **extra)
                case_recs.append(r)
                records.append(r)

            gW, gh, dZ16 = eager(h, W, y, n_valid, full)
            eW, eh = rel_err(gW, dW64, nW, mW), rel_err(gh, dh64, nh, mh)
            rec("eager", "dW", eW, eW, eager_graph="full" if full else "row-chunks")
            rec("eager", "dh", eh, eh, eager_graph="full" if full else "row-chunks")
            del gh
            for k in KS:
                # (the float32 sum, a baseline, at the ends of the range only: true float32
                # GEMMs are slow at the large shapes)
                for method, fp32 in (("bf16-accum", False), ("fp32-accum", True)):
                    if fp32 and k not in (KS[0], KS[-1]):
                        continue
                    dW = chunked_dw(dZ16, h, k, fp32)
                    extra = {"bitwise_eq_eager": torch.equal(dW, gW)} if k == 1 and not fp32 else {}
                    rec(method, "dW", rel_err(dW, dW64, nW, mW), eW, k=k, **extra)
                    del dW
            del dZ16, gW
            torch.cuda.empty_cache()
            if fusedce is not None:
                runs, notes = fusedce_grads(fusedce, h, W, y)
                for note in notes:
                    print(f"  {case} {regime}: {note}")
                for method, ws, fW, fh in runs:
                    rec(method, "dW", rel_err(fW, dW64, nW, mW), eW, ws=ws)
                    rec(method, "dh", rel_err(fh, dh64, nh, mh), eh, ws=ws)
                del runs
            del W, dW64, dh64
            torch.cuda.empty_cache()
        del h, W0, y
        torch.cuda.empty_cache()
        for r in case_recs:
            r["err"], r["ratio"] = float(f"{r['err']:.4e}"), round(r["ratio"], 3)
            r["maxerr"], r["max_ratio"] = float(f"{r['maxerr']:.4e}"), round(r["max_ratio"], 3)
        print(f"\n{case} (eager: {'one graph' if full else 'row chunks'}; "
              f"{time.time() - t0:.0f} s so far)")
        print_table(case_recs, ["regime", "logit_std", "method", "grad", "k", "ws", "err", "ratio",
                                "maxerr", "max_ratio", "bitwise_eq_eager"])
        ratio = {(r["regime"], r["k"]): max(r["ratio"], r["max_ratio"])
                 for r in case_recs if r["method"] == "bf16-accum"}
        ok = [k for k in KS if all(ratio[(g, k)] <= 2.0 for g in REGIMES)]
        first_bad = next((k for k in KS if k not in ok), None)
        verdicts.append(f"verdict {case}: largest k with bf16-accum dW ratios (Frobenius and max) "
                        f"<= 2 in both regimes: "
                        f"{max(ok) if ok else 'none'} (passing k: {ok}"
                        f"{'' if first_bad is None else f'; first failing k: {first_bad}'})")
        print(verdicts[-1])
    print("\n" + "\n".join(verdicts) + f"\n({time.time() - t0:.0f} s)")
    harness.write("accuracy-dw", dev, harness.run_info(bf16_reduced_precision_reduction=bool(red16)),
                  [{k: v for k, v in r.items() if k != "device"} for r in records], [args.out])
    print(f"wrote {harness.result_path('accuracy-dw', dev)}")

if __name__ == "__main__":
    main()
