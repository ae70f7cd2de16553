"""Markdown tables of a bench_torch.py result for the README: one row per shape, one column per impl.

    python3 torch_table.py [bench/results/torch-<device>.json]   (default: the newest torch-*.json)

CE cells: ms (% of copy) / extra MiB. Linear CE cells: ms (x floor) / extra MiB. "failed" where the
record has an error (the reasons are listed under the table).
"""
import glob
import json
import re
import os
import sys


def shape(r):
    return f"{r['N']}×{r['D']}×{r['V']}" if r["op"] == "linear_ce" else f"{r['N']}×{r['V']}"


def cell(r):
    if r is None:
        return "–"
    if r.get("error") or r.get("ms") is None:
        return "failed"
    if r["op"] == "ce":
        rel = f"{r['pct_of_copy']:.0f} %" if r.get("pct_of_copy") is not None else "?"
    else:
        rel = f"{r['ratio_to_floor']:.2f}×" if r.get("ratio_to_floor") is not None else "?"
    mib = "?" if r.get("extra_mib") is None else f"{r['extra_mib']:.0f}"
    return f"{r['ms']:.3g} ({rel}) / {mib} MiB"


def table(recs, op, title):
    rs = [r for r in recs if r["op"] == op]
    if not rs:
        return
    impls = list(dict.fromkeys(r["impl"] for r in rs))
    shapes = list(dict.fromkeys(shape(r) for r in rs))
    by = {(shape(r), r["impl"]): r for r in rs}
    print(f"**{title}**\n")
    print("| shape | " + " | ".join(impls) + " |")
    print("|---|" + "---|" * len(impls))
    for s in shapes:
        print(f"| {s} | " + " | ".join(cell(by.get((s, i))) for i in impls) + " |")
    failed = [r for r in rs if r.get("error")]
    if failed:
        print()
        for r in failed:
            reason = re.sub(r"\x1b\[[0-9;]*m", "", str(r["error"]))  # no terminal colours
            print(f"- {r['impl']} {shape(r)}: {reason}")
    print()


def main():
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        found = glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "torch-*.json"))
        if not found:
            sys.exit("no bench/results/torch-*.json; give the path")
        path = max(found, key=os.path.getmtime)
    with open(path) as f:
        recs = json.load(f)
    ok = [r for r in recs if r.get("ms") is not None] or recs
    if ok:
        r = ok[0]
        print(f"{r.get('device', '?')}, bf16; copy {r.get('copy_tbps', '?')} TB/s, bf16 GEMM "
              f"{r.get('gemm_tflops', '?')} TFLOP/s (measured in the same run); loss + backward.\n")
    table(recs, "ce", "Cross-entropy over logits: ms (% of copy speed) / extra MiB")
    table(recs, "linear_ce", "Linear + cross-entropy: ms (× GEMM floor 6·N·D·V) / extra MiB")


if __name__ == "__main__":
    main()
