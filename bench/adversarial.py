"""Loss and gradient on adversarial logits: fusedce's paths and torch eager against float64.

Each family is a batch of --rows rows of --vocab classes whose logits no float32 lse can carry:
rows all at ±1e30 (float32, bfloat16), ±3e38 (float32, bfloat16: near bfloat16's largest) or
±6e4 (every dtype: near float16's largest); rows with -inf entries; logits of spread 1e4 (float16:
1e3 times N(0, 1)); one logit 80 above the rest (the target's in half the rows); a NaN in every
row; a -inf target logit (loss +inf). Every family runs in each dtype that holds its values.

Implementations, each against the float64 reference (torch float64 F.cross_entropy, i.e.
log_softmax, on the same values upcast), with an upstream gradient of 1 per row:
  fusedce-onepass      fusedce.torch.cross_entropy(x, y, reduction="sum") + backward: the
                       one-pass training path (fce_forward writes loss and gradient, the backward
                       is fce_backward_rescale, nothing to do for an upstream 1). Its loss is the
                       sum over the rows, compared with the reference's sum.
  fusedce-onepass-rows fusedce.forward(x, y, reduction="none", return_grad=True) (the core
                       API): the same fce_forward one pass, with per-row losses.
  fusedce-backward     fusedce.torch.cross_entropy(x, y, reduction="none") + backward(ones): the
                       forward writes the loss and lse only, the backward is fce_backward from
                       the saved float32 lse.
  torch-eager          F.cross_entropy(x, y, reduction="none") in the same dtype + backward(ones).
Metrics: loss_err = max |loss - ref| over the entries (rows, or the one sum) where the reference
is finite (loss_scale = max |ref| over them: a float32 loss is rounded to about 6e-8 of it);
grad_err = max |grad - ref grad| / max |ref grad| over the entries where the reference is finite;
nonfinite_mismatch = entries where the reference is NaN or ±inf and the result is not the same
(NaN for NaN, the same infinity), plus entries where the reference is finite and the result is
not (then the error is reported as inf).

    python3 bench/adversarial.py [--device cpu|cuda] [--rows 64] [--vocab 32000] [--out DIR]
Writes bench/results/adversarial-<device name>.json (and DIR/) and prints a table. Needs torch
(and libfusedce: FUSEDCE_LIBRARY), no network.
"""
import argparse
import math
import platform

import torch
import torch.nn.functional as F

import harness
import fusedce
import fusedce.torch as fce_torch
from harness import print_table

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
IMPLS = ["fusedce-onepass", "fusedce-onepass-rows", "fusedce-backward", "torch-eager"]


def device_name(device):
    if device == "cuda":
        return harness.device_name()
    return "cpu-" + (platform.machine() or "unknown")


# ------------------------------------------------------------------------ families ----
def _base(n, v, gen):
    return torch.randn(n, v, generator=gen, dtype=torch.float64)


def fam_constant(value):
    def make(n, v, y, gen):
        return torch.full((n, v), float(value), dtype=torch.float64)
    return make


def fam_neg_inf_entries(n, v, y, gen):
    z = _base(n, v, gen)
    z[torch.rand(n, v, generator=gen) < 0.1] = -math.inf
    z[torch.arange(n), y] = torch.randn(n, generator=gen, dtype=torch.float64)  # finite target
    return z


def fam_spread(scale):
    def make(n, v, y, gen):
        return _base(n, v, gen) * scale
    return make


def fam_one_high(n, v, y, gen):
    z = _base(n, v, gen)
    at = torch.randint(0, v, (n,), generator=gen)
    at[::2] = y[::2]  # the target's logit is the high one in half the rows
    z[torch.arange(n), at] += 80.0
    return z


def fam_nan(n, v, y, gen):
    z = _base(n, v, gen)
    z[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] = math.nan
    return z


def fam_neg_inf_target(n, v, y, gen):
    z = _base(n, v, gen)
    z[torch.arange(n), y] = -math.inf
    return z


# (name, maker, dtypes that represent its values)
FAMILIES = [
    ("all -1e30", fam_constant(-1e30), ("f32", "bf16")),
    ("all +1e30", fam_constant(1e30), ("f32", "bf16")),
    ("all -3e38", fam_constant(-3e38), ("f32", "bf16")),
    ("all +3e38", fam_constant(3e38), ("f32", "bf16")),
    ("all -6e4", fam_constant(-6e4), ("f32", "bf16", "f16")),
    ("all +6e4", fam_constant(6e4), ("f32", "bf16", "f16")),
    ("-inf entries", fam_neg_inf_entries, ("f32", "bf16", "f16")),
    ("spread 1e4", fam_spread(1e4), ("f32", "bf16")),
    ("spread 1e3", fam_spread(1e3), ("f16",)),
    ("one logit +80", fam_one_high, ("f32", "bf16", "f16")),
    ("NaN rows", fam_nan, ("f32", "bf16", "f16")),
    ("-inf target", fam_neg_inf_target, ("f32", "bf16", "f16")),
]


# --------------------------------------------------------------------- evaluation ----
def reference(z, y):
    """Per-row loss and gradient (upstream 1 per row) in float64."""
    x = z.double().detach().requires_grad_(True)
    loss = F.cross_entropy(x, y, reduction="none")
    (g,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    return loss.detach(), g


def run_impl(impl, z, y):
    """(loss, grad) of one implementation: the loss per row, or the sum for fusedce-onepass."""
    if impl == "fusedce-onepass":
        x = z.clone().requires_grad_(True)
        loss = fce_torch.cross_entropy(x, y, reduction="sum")
        loss.backward()
        return loss.detach(), x.grad
    if impl == "fusedce-onepass-rows":
        r = fusedce.forward(z, y, reduction="none", return_grad=True, error_flags=False)
        return r.loss, r.grad_logits
    if impl == "fusedce-backward":
        x = z.clone().requires_grad_(True)
        loss = fce_torch.cross_entropy(x, y, reduction="none")
        loss.backward(torch.ones_like(loss))
        return loss.detach(), x.grad
    if impl == "torch-eager":
        x = z.clone().requires_grad_(True)
        loss = F.cross_entropy(x, y, reduction="none")
        loss.backward(torch.ones_like(loss))
        return loss.detach(), x.grad
    raise ValueError(impl)


def compare(x, ref, relative):
    """(max error over the reference's finite entries, number of non-finite mismatches)."""
    x, ref = x.double().cpu().reshape(-1), ref.double().cpu().reshape(-1)
    fin = torch.isfinite(ref)
    mismatch = int((~fin & ~(torch.isnan(x) & torch.isnan(ref))
                    & ~(torch.isinf(x) & (x == ref))).sum())
    bad = fin & ~torch.isfinite(x)
    mismatch += int(bad.sum())
    if not fin.any():
        return 0.0, mismatch
    if bad.any():
        return math.inf, mismatch
    err = (x[fin] - ref[fin]).abs().max().item()
    if relative:
        err /= max(ref[fin].abs().max().item(), 1e-300)
    return err, mismatch


def fmt(e):
    return "inf" if e == math.inf else f"{e:.2e}"


def main():
    ap = argparse.ArgumentParser(description="fusedce and torch eager on adversarial logits")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtypes", default="f32,bf16,f16")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not (torch.cuda.is_available() and fusedce.cuda_available()):
        ap.error("--device cuda: no CUDA device, or libfusedce has no CUDA backend")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    name = device_name(dev)
    lib = fusedce.library_path()
    print(f"device {name}, libfusedce {'.'.join(map(str, fusedce.library_version()))} ({lib}), "
          f"torch {torch.__version__}, {args.rows} rows x {args.vocab} classes per family")
    records = []
    for fam, make, ok in FAMILIES:
        gen = torch.Generator().manual_seed(args.seed + len(records))
        y = torch.randint(0, args.vocab, (args.rows,), generator=gen)
        z64 = make(args.rows, args.vocab, y, gen)
        for dn in dtypes:
            if dn not in ok:
                continue
            z = z64.to(DTYPES[dn]).to(dev)
            yd = y.to(dev)
            ref_loss, ref_grad = reference(z, yd)
            for impl in IMPLS:
                rec = dict(family=fam, dtype=dn, impl=impl, device=name, rows=args.rows,
                           vocab=args.vocab)
                try:
                    loss, grad = run_impl(impl, z, yd)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    rl = ref_loss.sum() if impl == "fusedce-onepass" else ref_loss
                    le, lm = compare(loss, rl, relative=False)
                    fin = torch.isfinite(rl)
                    rec["loss_scale"] = float(rl[fin].abs().max()) if fin.any() else 0.0
                    ge, gm = compare(grad, ref_grad, relative=True)
                    rec.update(loss_err=le, grad_err=ge, nonfinite_mismatch=lm + gm,
                               loss_kind="sum" if impl == "fusedce-onepass" else "per row")
                except Exception as e:  # noqa: BLE001 - a failure is a result too
                    rec.update(error=f"{type(e).__name__}: {e}"[:200])
                records.append(rec)
    run = harness.run_info(rows=args.rows, vocab=args.vocab)
    harness.write("adversarial", name, run,
                  [{k: (None if v == math.inf else v) if k in ("loss_err", "grad_err") else v
                    for k, v in r.items() if k != "device"} for r in records], [args.out])
    print(f"wrote {harness.result_path('adversarial', name)} (loss_err/grad_err null = inf: a "
          "non-finite value where the reference is finite)\n")
    rows = [dict(r, loss_err=fmt(r["loss_err"]) if "loss_err" in r else "",
                 loss_scale=f"{r['loss_scale']:.3g}" if "loss_scale" in r else "",
                 grad_err=fmt(r["grad_err"]) if "grad_err" in r else "",
                 nonfinite_mismatch=r.get("nonfinite_mismatch", ""), error=r.get("error", ""))
            for r in records]
    print_table(rows, ["family", "dtype", "impl", "loss_err", "loss_scale", "grad_err",
                       "nonfinite_mismatch", "error"])


if __name__ == "__main__":
    main()
