"""Draws bench/results/torch-<device>.json (bench_torch.py) as bench/results/torch-<device>.png:
one row per op (ce, linear_ce), ms per loss + backward and extra MiB (log scale) per shape and
impl. Failed rows are left out (their reasons are in the tables). Needs matplotlib.

    python3 bench/plot.py [--device NVIDIA-H200]     (default: the device of the newest file)
"""
import argparse
import os

import harness
import tables

ORDER = ["fusedce-c-abi", "fusedce", "fusedce-inplace", "fusedce-lean", "liger", "liger-cute",
         "quack", "cce", "cce-exact", "torch-lce", "torch-compile", "torch-eager"]


def shape_str(r):
    return f"{r['N']}x{r['D']}x{r['V']}" if r["op"] == "linear_ce" else f"{r['N']}x{r['V']}"


def draw(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in doc["records"] if r.get("ms") is not None]
    ops = [o for o in ("ce", "linear_ce") if any(r["op"] == o for r in ok)]
    if not ops:
        raise SystemExit(f"{doc['device']}: no measured rows to draw")
    rank = {i: n for n, i in enumerate(ORDER)}
    impls = sorted({r["impl"] for r in ok}, key=lambda i: (rank.get(i, 99), i))
    fig, axes = plt.subplots(len(ops), 2, figsize=(16, 4.8 * len(ops)), squeeze=False)
    for row, op in enumerate(ops):
        rs = [r for r in ok if r["op"] == op]
        shapes = list(dict.fromkeys(shape_str(r) for r in rs))
        names = [i for i in impls if any(r["impl"] == i for r in rs)]
        w = 0.84 / len(names)
        for j, impl in enumerate(names):
            got = {shape_str(r): r for r in rs if r["impl"] == impl}
            xs = [i - 0.42 + w * (j + 0.5) for i, s in enumerate(shapes) if s in got]
            ms = [got[s]["ms"] for s in shapes if s in got]
            mib = [max(got[s].get("extra_mib") or 0.0, 0.1) for s in shapes if s in got]
            color = f"C{impls.index(impl) % 10}"
            axes[row][0].bar(xs, ms, w, label=impl, color=color)
            axes[row][1].bar(xs, mib, w, label=impl, color=color)
        what = "cross-entropy over logits [N x V]" if op == "ce" else "linear + cross-entropy [N x D x V]"
        for col, lab in enumerate(("ms per loss + backward",
                                   "extra MiB beyond inputs and gradients (0 shown as 0.1)")):
            ax = axes[row][col]
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=8)
            ax.set_title(f"{what}: {lab}", fontsize=9)
        axes[row][1].set_yscale("log")
        axes[row][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{doc['device']}, {doc['date']}, bf16, loss + backward through each torch API",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    path = tables.pick("torch", args.device)
    doc = harness.load(path)
    out = os.path.join(harness.RESULTS, f"torch-{doc['device']}.png")
    draw(doc, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
