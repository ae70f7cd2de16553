"""The performance tables, as markdown, from the committed result files (bench/results/*.json).

    python3 bench/tables.py --op ce [--device NVIDIA-H200]    print one table
    python3 bench/tables.py --write [FILE ...]                fill the marker blocks
    python3 bench/tables.py --check [FILE ...]                exit 1 with a diff if one differs

FILE defaults to README.md and docs/*.md. A marker block is
    <!-- table:NAME -->          or   <!-- table:NAME device=NVIDIA-H100-80GB-HBM3 -->
    (anything: replaced)
    <!-- /table -->
NAME is one of TABLES below. Without device=, a table comes from the newest file of its
benchmark (the latest run date among the devices). Only the standard library is used: this
runs in `make test`, without a GPU, torch or numpy.
"""
import argparse
import difflib
import glob
import os
import re
import sys

import harness

ROOT = harness.ROOT
MARK = re.compile(r"<!-- table:([\w-]+)((?:\s+\w+=[^\s>]+)*)\s*-->\n(.*?)<!-- /table -->", re.S)
IMPL_ORDER = ["fusedce-c-abi", "fusedce", "fusedce-inplace", "fusedce-lean", "liger",
              "liger-cute", "quack", "cce", "cce-exact", "torch-lce", "torch-compile", "torch-eager"]
IMPL_NAME = {
    "fusedce-c-abi": "fusedce, the C call alone", "fusedce": "**fusedce**",
    "fusedce-inplace": "fusedce, in place", "fusedce-lean": "fusedce, lean (128 MiB + N·D·4)",
    "liger": "Liger-Kernel (Triton)", "liger-cute": "Liger-Kernel (CuTe DSL)", "quack": "Quack",
    "cce": "Cut Cross-Entropy", "cce-exact": "Cut Cross-Entropy, exact",
    "torch-lce": "torch 2.15 chunked `F.linear_cross_entropy`", "torch-compile": "torch.compile",
    "torch-eager": "torch eager",
}
DIST_NAME = {"liger-kernel": "Liger-Kernel", "cut-cross-entropy": "Cut Cross-Entropy",
             "quack-kernels": "Quack", "nvidia-cutlass-dsl": "CuTe DSL", "triton": "Triton",
             "torch-lce": "torch chunked linear CE from"}


# ---------------------------------------------------------------------- the files ----
def candidates(bench):
    """Result files of one benchmark: {device: doc}."""
    out = {}
    for path in glob.glob(os.path.join(harness.RESULTS, f"{bench}-*.json")):
        try:
            doc = harness.load(path)
        except (ValueError, OSError):
            continue
        if doc["bench"] == bench:
            out[doc["device"]] = (path, doc)
    return out


def pick(bench, device=None):
    """The path of bench's result file for device, or of the newest run's device."""
    found = candidates(bench)
    if not found:
        raise SystemExit(f"tables: no bench/results/{bench}-*.json")
    if device is not None:
        if device not in found:
            raise SystemExit(f"tables: no {bench} result for device {device} "
                             f"(there are: {', '.join(sorted(found))})")
        return found[device][0]
    newest = max(found.values(), key=lambda pd: (pd[1]["date"], max(r["id"] for r in pd[1]["runs"])))
    return newest[0]


def doc_of(bench, device=None):
    return harness.load(pick(bench, device))


# ------------------------------------------------------------------------ helpers ----
def ms(x):
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def mib(x):
    return f"{x:.0f} MiB" if x >= 1 or x == 0 else f"{x:.1f} MiB"


def shape(r):
    return "×".join(str(r[k]) for k in (("N", "D", "V") if "D" in r and r.get("D") else ("N", "V")))


def device_words(device):
    return device.replace("-", " ")


def grid(rows, header):
    """A markdown table: header [str], rows [[str]]."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def clean(reason):
    return re.sub(r"\x1b\[[0-9;]*m", "", str(reason)).replace("|", "\\|").strip()


def short(reason, most=160):
    """A failure's reason for a footnote: cleaned, without object addresses, at most `most`
    characters (cut at a word)."""
    text = re.sub(r" at 0x[0-9a-f]+", "", clean(reason))
    if len(text) > most:
        text = text[:most].rsplit(" ", 1)[0] + " …"
    return text


def runs_line(doc, recs):
    """Which runs the records come from: date, ceilings, versions of what has rows here."""
    by_id = {r["id"]: r for r in doc["runs"]}
    runs = [by_id.get(rid, {}) for rid in dict.fromkeys(r.get("run") for r in recs)]
    impls = {r["impl"] for r in recs if r.get("ms") is not None}
    # a peer's version is named only where one of its rows was measured
    peer_impls = {"liger-kernel": {"liger"}, "cut-cross-entropy": {"cce", "cce-exact"},
                  "quack-kernels": {"quack"}, "nvidia-cutlass-dsl": {"quack", "liger-cute"},
                  "torch-lce": {"torch-lce"}}

    def span(key, fmt):
        vals = sorted({fmt % run[key] for run in runs if run.get(key)}, key=float)
        return "–".join([vals[0], vals[-1]] if len(vals) > 1 else vals)

    dates = sorted({run.get("date", "date unknown") for run in runs})
    text = ", ".join(dates)
    if len(runs) > 1:
        text += f", {len(runs)} runs back to back on one machine"
    what = [f"copy {span('copy_tbps', '%.2f')} TB/s" if any(r.get("copy_tbps") for r in runs)
            else None,
            f"bf16 GEMM {span('gemm_tflops', '%.0f')} TFLOP/s"
            if any(r.get("gemm_tflops") for r in runs) else None]
    if any(what):
        text += ", " + ", ".join(w for w in what if w) + " measured in each"
    soft = {}
    for run in runs:
        if run.get("torch"):
            soft.setdefault("torch", f"torch {run['torch'].split('+')[0]}")
        if run.get("fusedce"):
            soft.setdefault("fusedce", f"fusedce {run['fusedce']}")
        for k, v in (run.get("peers") or {}).items():
            if k != "triton" and (k not in peer_impls or peer_impls[k] & impls):
                soft.setdefault(k, f"{DIST_NAME.get(k, k)} {v}")
    if soft:
        text += "; " + ", ".join(soft.values())
    return text


def by_impl_table(doc, op, cell, note, failures=True):
    recs = [r for r in doc["records"] if r["op"] == op]
    if not recs:
        raise SystemExit(f"tables: {doc['device']} has no {op} rows")
    shapes = list(dict.fromkeys(shape(r) for r in recs))
    rank = {i: n for n, i in enumerate(IMPL_ORDER)}
    impls = sorted({r["impl"] for r in recs if failures or r.get("ms") is not None},
                   key=lambda i: (rank.get(i, 99), i))
    got = {(r["impl"], shape(r)): r for r in recs}
    def show(r):
        return "–" if r is None else "failed" if r.get("ms") is None else cell(r)
    rows = [[IMPL_NAME.get(i, i)] + [show(got.get((i, s))) for s in shapes] for i in impls]
    lines = [f"{device_words(doc['device'])}, {runs_line(doc, recs)}. {note}", ""]
    lines += grid(rows, ["", *shapes])
    failed = {}  # (impl, reason) -> shapes: one line per reason
    for r in recs:
        if failures and r.get("error"):
            failed.setdefault((r["impl"], short(r["error"])), []).append(shape(r))
    if failed:
        lines.append("")
        lines += [f"- {IMPL_NAME.get(i, i)}, "
                  f"{'every shape' if len(ss) == len(shapes) > 1 else ', '.join(ss)}: {why}"
                  for (i, why), ss in failed.items()]
    return lines


# ------------------------------------------------------------------------- tables ----
def timed(rel, min_mib):
    """A cell of a timed record: ms (rel) and, from min_mib, the memory beyond the gradients."""
    def cell(r):
        text = f"{ms(r['ms'])} ({rel(r)})" if rel(r) else ms(r["ms"])
        if r.get("extra_mib") is not None and r["extra_mib"] >= min_mib:
            text += f", {mib(r['extra_mib'])}"
        return text
    return cell


def t_ce(device):
    return by_impl_table(
        doc_of("torch", device), "ce",
        timed(lambda r: r.get("pct_of_copy") and f"{r['pct_of_copy']:.0f} %", 1.0),
        "bf16 logits, loss + `.backward()`, ms (the copy speed's share: N·V·2 bytes read and "
        "written at the copy rate over the time), and the memory beyond the inputs and the "
        "gradient returned where it is 1 MiB or more.")


def t_linear(device):
    return by_impl_table(
        doc_of("torch", device), "linear_ce",
        timed(lambda r: r.get("ratio_to_floor") and f"{r['ratio_to_floor']:.2f}×", 0.0),
        "bf16 hidden states and weight, loss + `.backward()` (∂h and ∂W), ms (× the floor: "
        "6·N·D·V FLOPs at the GEMM rate), and the memory beyond the inputs and the gradients "
        "returned.")


def t_linear_dw(device):
    doc = doc_of("torch", device)
    if not any(r.get("dw_rel_fro") is not None for r in doc["records"]):
        return [f"{device_words(doc['device'])}, {doc['date']}: this run measured no ∂W errors."]
    return by_impl_table(
        doc, "linear_ce",
        lambda r: "–" if r.get("dw_rel_fro") is None else f"{r['dw_rel_fro']:.2e} / {r['dw_max_rel']:.2e}",
        "∂W of the same calls against float64 on 4096 sampled vocabulary rows: relative "
        "Frobenius error / max |error| over max |reference| (failed calls: in the table above).",
        failures=False)


VP_NAMES = {"fusedce-vp": "fusedce", "fusedce-vp-two-phase": "two-phase",
            "megatron-torch": "Megatron-style"}


def t_vp(device):
    doc = doc_of("vocab-parallel", device)
    recs = doc["records"]
    P = recs[0]["ranks"]
    rows = []
    for r in recs:
        mem = r.get("extra_mib_rank0") or {}

        def c(t, eff=None, m=None):
            text = ms(t) + (f" ({eff:.2f})" if eff is not None else "")
            return text + (f", {mib(m)}" if m is not None else "")
        bad = [f"{VP_NAMES.get(k, k)} (max {max(v.get('grad_hidden_rel', 0), v.get('grad_weight_rel', 0)):.4f})"
               for k, v in r.get("check", {}).items() if not v.get("ok")]
        rows.append([shape(r), ms(r["t1_ms"]),
                     c(r["fusedce_vp_ms"], r["efficiency"], mem.get("fusedce-vp")),
                     c(r["fusedce_vp_two_phase_ms"], r["two_phase_efficiency"], mem.get("fusedce-vp-two-phase")),
                     c(r["megatron_torch_ms"], r["megatron_efficiency"], mem.get("megatron-torch")),
                     "yes" if not bad else "no: " + ", ".join(bad)])
    run = doc["runs"][0]
    lines = [f"{P} × {device_words(doc['device'].rsplit('x', 1)[0])}, {run.get('date', '')}, one process "
             f"per GPU over NCCL; bf16, loss + `.backward()`, ms (parallel efficiency t₁ / ({P}·t_P)), "
             "memory beyond the inputs and the gradients returned on rank 0; \"equal\": loss and "
             "gradients equal the one-GPU call's within rounding (else which did not, with its "
             "largest gradient difference over the largest value).", ""]
    lines += grid(rows, ["N×D×V", "1 GPU, fusedce", f"fusedce, {P} GPUs",
                               f"fusedce two-phase, {P} GPUs", f"Megatron-style torch, {P} GPUs", "equal"])
    return lines


def t_ce_raw(device):
    doc = doc_of("ce", device)
    recs = doc["records"]
    shapes = list(dict.fromkeys((r["N"], r["V"], r["dtype"]) for r in recs))
    got = {(r["op"], r["impl"], r["N"], r["V"], r["dtype"]): r for r in recs}
    rows = []
    for N, V, dt in shapes:
        def c(op, impl="fusedce"):
            r = got.get((op, impl, N, V, dt))
            return "–" if r is None else f"{ms(r['ms'])} ({r['pct_of_copy']:.1f} %)"
        rows.append([f"{N}×{V} {dt}", c("forward"), c("forward+grad"),
                     ms(got[("forward+grad", "copy-ceiling", N, V, dt)]["ms"])
                     if ("forward+grad", "copy-ceiling", N, V, dt) in got else "–"])
    run = doc["runs"][0]
    lines = [f"{device_words(doc['device'])}, {runs_line(doc, recs)}. The C call `fce_forward` "
             f"alone ({run.get('timing', 'median')}), ms (bytes moved / time over the copy rate).", ""]
    lines += grid(rows, ["N×V", "loss only", "loss + gradient", "copy of the same bytes"])
    return lines


def t_linear_raw(device):
    doc = doc_of("linear", device)
    recs = [r for r in doc["records"] if r["op"] == "forward+grad"]
    shapes = list(dict.fromkeys((r["N"], r["D"], r["V"]) for r in recs))
    cols = [c for c in ("floor", "fusedce-1GiB", "fusedce", "fusedce-1GiB-fp32dW", "gemms-unchunked")
            if any(r["impl"] == c for r in recs)]
    got = {(r["impl"], r["N"], r["D"], r["V"]): r for r in recs}
    rows = []
    for s in shapes:
        rows.append([f"{s[0]}×{s[1]}×{s[2]}"] + [
            f"{ms(got[(c, *s)]['ms'])} ({got[(c, *s)]['pct_of_floor']:.0f} %)" if (c, *s) in got else "–"
            for c in cols])
    lines = [f"{device_words(doc['device'])}, {runs_line(doc, doc['records'])}. `fce_linear_ce` "
             "through ctypes, loss + ∂h + ∂W, ms (the floor 6·N·D·V at the GEMM rate as a share "
             "of the time).", ""]
    lines += grid(rows, ["N×D×V", *cols])
    return lines


def t_options(device):
    doc = doc_of("options-cost", device)
    recs = doc["records"]
    ops = list(dict.fromkeys(r["op"] for r in recs))
    shapes = list(dict.fromkeys((r["N"], r["V"], r["dtype"]) for r in recs))
    got = {(r["op"], r["N"], r["V"], r["dtype"]): r for r in recs}
    rows = [[f"{N}×{V} {dt}"] + [ms(got[(o, N, V, dt)]["ms"]) if (o, N, V, dt) in got else "–" for o in ops]
            for N, V, dt in shapes]
    lines = [f"{device_words(doc['device'])}, {runs_line(doc, recs)}. What the options cost, "
             "the C calls alone, ms.", ""]
    lines += grid(rows, ["N×V", *ops])
    return lines


def t_accuracy_dw(device):
    doc = doc_of("accuracy-dw", device)
    recs = doc["records"]
    cases = list(dict.fromkeys((r["N"], r["D"], r["V"]) for r in recs))
    ks = [2, 4, 8, 16, 32]

    def worst(r):  # the larger of the Frobenius and the max-abs ratio
        return max(r["ratio"], r.get("max_ratio", r["ratio"]))

    ratio, fused = {}, {}
    for r in recs:
        c = (r["N"], r["D"], r["V"])
        if r["method"] == "bf16-accum" and r["grad"] == "dW":
            ratio[(c, r["k"])] = max(ratio.get((c, r["k"]), 0.0), worst(r))
        if r["method"] == "fusedce-torch" and r["grad"] == "dW" and r["ws"] == "optimal":
            fused[c] = max(fused.get(c, 0.0), worst(r))
    eager = {((r["N"], r["D"], r["V"]), r["regime"]): r for r in recs
             if r["method"] == "eager" and r["grad"] == "dW"}
    rows = []
    for c in cases:
        e = eager.get((c, "std2"))
        measured = sorted(k for (cc, k) in ratio if cc == c)
        bad = [k for k in measured if ratio[(c, k)] > 2.0]
        passing = [k for k in measured if not bad or k < bad[0]]  # every k up to it passes
        row = [f"{c[0]}×{c[1]}×{c[2]}", f"{c[0] / c[2]:.2f}",
               f"{e['err']:.2e} / {e['maxerr']:.2e}" if e and "maxerr" in e else
               (f"{e['err']:.2e}" if e else "–")]
        row += [f"{ratio[(c, k)]:.2f}" if (c, k) in ratio else "–" for k in ks]
        row.append(str(max(passing)) if passing else "–")
        row.append(str(max(1, min(64, 3 * c[2] // c[0]))))
        row.append(f"{fused[c]:.2f}" if c in fused else "–")
        rows.append(row)
    run = doc["runs"][0]
    lines = [f"{device_words(doc['device'])}, {run.get('date', '')}. A bf16 ∂W summed over k token "
             "chunks (k roundings): its error against float64 over torch eager's (one GEMM over "
             "all rows), the larger of the relative Frobenius and the max-abs (over max |ref|) "
             "ratios, the worse of logits of standard deviation 2 and 0.5. Eager's own errors "
             "(Frobenius / max-abs) are for std 2. The rule: the k fce_linear_ce allows; "
             "fusedce: its own ∂W through torch at the default workspace, the same ratio.", ""]
    lines += grid(rows, ["N×D×V", "N/V", "eager's error", *[f"k = {k}" for k in ks],
                         "largest k ≤ 2×", "rule: k ≤ 3·V/N", "fusedce"])
    return lines


def t_cpu(device):
    doc = doc_of("cpu", device)
    run = doc["runs"][0]
    rows = []
    for r in doc["records"]:
        what = (f"CE {r['N']}×{r['V']}" if r["op"] == "ce"
                else f"linear CE N={r['N']} D={r['D']} V={r['V']}")
        pct = f" ({r['pct_of_sgemm']:.0f} % of sgemm)" if r.get("pct_of_sgemm") else ""
        rows.append([what, f"{r['fusedce_ms']:.1f}{pct}", f"{r['baseline_ms']:.1f}"])
    lines = [f"{run.get('machine', device_words(doc['device']))}, {run.get('date', '')}, float32, "
             f"loss + gradients, best of {run.get('reps', 5)} (ms); the baseline is "
             f"{run.get('baseline', 'torch')} {run.get('baseline_version', '')} on the same cores.", ""]
    lines += grid(rows, ["", "fusedce", run.get("baseline", "torch")])
    return lines


def t_headline(device):
    """Two lines for the README's first screen: fusedce against the fastest peer measured, at
    the first shape of each op, from the same file as the full tables below it."""
    doc = doc_of("torch", device)
    out = []
    for op, what in (("ce", "cross-entropy over logits"), ("linear_ce", "linear + cross-entropy")):
        recs = [r for r in doc["records"] if r["op"] == op and r.get("ms") is not None]
        if not recs:
            continue
        first = shape(recs[0])
        at = [r for r in recs if shape(r) == first]
        ours = next((r for r in at if r["impl"] == "fusedce"), None)
        peers = sorted((r for r in at if not r["impl"].startswith("fusedce")), key=lambda r: r["ms"])
        if ours is None or not peers:
            continue
        def pmem(r, op=op):
            return (f" ({mib(r['extra_mib'])})"
                    if op == "linear_ce" and r.get("extra_mib") is not None else "")
        extra = (f" in {mib(ours['extra_mib'])} beyond the gradients"
                 if op == "linear_ce" and ours.get("extra_mib") is not None else "")
        out.append(f"- {what}, {first} bf16: **{ms(ours['ms'])} ms**{extra}; fastest peer "
                   f"{IMPL_NAME.get(peers[0]['impl'], peers[0]['impl'])} {ms(peers[0]['ms'])} ms"
                   f"{pmem(peers[0])}, "
                   f"torch eager {ms(next((r['ms'] for r in at if r['impl'] == 'torch-eager'), float('nan')))} ms")
    return [f"Loss + `.backward()` through torch on one {device_words(doc['device'])} "
            f"({doc['date']}; full tables below):", ""] + out


def t_heads(device):
    """bench/bench_heads.py: per section, each variant's ms (× the section's first row, or × the
    floor), and the memory beyond the inputs and the gradients returned; shapes as columns."""
    return sections_table(doc_of("heads", device), {
        "ce": "cross-entropy, logits N×V", "linear": "linear cross-entropy, N×D×V",
        "distill": "distillation, logits N×V",
        "linear_distill": "linear distillation, N×D×Dt×V (× the floor)"})


def t_vp_invariance(device):
    """bench/bench_heads.py --sections vp --name vp-invariance: the vocabulary-parallel calls on
    one rank, plain and under batch_invariant, beside the one-GPU call."""
    return sections_table(doc_of("vp-invariance", device), {
        "vp": "vocabulary-parallel over logits N×V, one rank, reduction none"},
        relative="the plain vocabulary-parallel call")


def sections_table(doc, titles, relative="the section's first row; linear distillation: × its "
                   "floor, 6·N·D·V + 2·N·Dt·V FLOPs at the GEMM rate"):
    lines = [f"{device_words(doc['device'])}, {runs_line(doc, doc['records'])}. bf16, loss + "
             f"`.backward()`: ms (× {relative}) and the memory beyond the inputs and the "
             "gradients returned.", ""]
    for sec, title in titles.items():
        recs = [r for r in doc["records"] if r["section"] == sec]
        if not recs:
            continue
        shapes = list(dict.fromkeys(r["shape"] for r in recs))
        got = {(r["variant"], r["shape"]): r for r in recs}

        def cell(r):
            if r is None:
                return "–"
            if r.get("ms") is None:
                return "failed: " + short(r.get("error", ""), 60)
            rel = r.get("x_floor") or r.get("x_first")
            return f"{ms(r['ms'])} ({rel:.2f}×), {mib(r['extra_mib'])}"
        rows = [[v] + [cell(got.get((v, s))) for s in shapes]
                for v in dict.fromkeys(r["variant"] for r in recs)]
        lines += grid(rows, [f"**{title}**", *[s.replace("x", "×") for s in shapes]])
        lines.append("")
    return lines[:-1]


TABLES = {"headline": t_headline, "ce": t_ce, "linear": t_linear, "linear-dw": t_linear_dw, "vp": t_vp,
          "ce-raw": t_ce_raw, "linear-raw": t_linear_raw, "options": t_options,
          "accuracy-dw": t_accuracy_dw, "cpu": t_cpu, "heads": t_heads,
          "vp-invariance": t_vp_invariance}


def render(name, device=None):
    if name not in TABLES:
        raise SystemExit(f"tables: unknown table {name!r} (known: {', '.join(TABLES)})")
    return "\n".join(TABLES[name](device)) + "\n"


# ------------------------------------------------------------------ marker blocks ----
def fill(text):
    """text with every marker block's body replaced by its table."""
    def body(m):
        params = dict(kv.split("=", 1) for kv in m.group(2).split())
        unknown = set(params) - {"device"}
        if unknown:
            raise SystemExit(f"tables: <!-- table:{m.group(1)} --> has unknown parameters {sorted(unknown)}")
        head = m.group(0)[:m.group(0).index("-->") + 3]
        return f"{head}\n{render(m.group(1), params.get('device'))}\n<!-- /table -->"
    return MARK.sub(body, text)


def default_files():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--op", choices=sorted(TABLES), help="print this table")
    g.add_argument("--write", nargs="*", metavar="FILE", help="fill the marker blocks of FILEs")
    g.add_argument("--check", nargs="*", metavar="FILE", help="exit 1 if a block differs")
    ap.add_argument("--device", default=None, help="with --op: this device's file")
    args = ap.parse_args()
    if args.op:
        sys.stdout.write(render(args.op, args.device))
        return 0
    files = (args.write if args.write is not None else args.check) or default_files()
    stale = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = fill(old)
        blocks = len(MARK.findall(old))
        if args.write is not None:
            if new != old:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
            print(f"{os.path.relpath(path)}: {blocks} table(s){' written' if new != old else ', current'}")
        elif new != old:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), f"{path} (committed)",
                f"{path} (from bench/results)"))
    if args.check is not None:
        if stale:
            print(f"tables: {stale} file(s) differ from bench/results; run python3 bench/tables.py --write")
            return 1
        print(f"tables: {len(files)} file(s) current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
