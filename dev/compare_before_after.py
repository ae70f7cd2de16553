"""dev/compare_before_after.py OUT: the table of dev/before_after.sh's runs — per row (op, impl,
shape) the milliseconds of each build in each round and after / before (the mean of the rounds)."""
import collections
import glob
import json
import os
import sys


def rows(path):
    doc = json.load(open(path))
    for r in doc["records"]:
        ms = r.get("ms")
        if ms is None:
            continue
        shape = "x".join(str(r[k]) for k in ("N", "D", "V") if k in r)
        yield (doc["bench"], r.get("op", ""), r.get("impl", ""), shape, r.get("dtype", "")), ms


def main(out):
    table = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(out, "*-*", "*.json"))):
        run = os.path.basename(os.path.dirname(path))
        for key, ms in rows(path):
            table[key][run] = ms
    runs = ["before-1", "after-1", "before-2", "after-2"]
    print("| bench | op | impl | shape | dtype | " + " | ".join(runs) + " | after/before |")
    print("|" + "---|" * (6 + len(runs)))
    for key in sorted(table):
        t = table[key]
        b = [t[r] for r in runs if r.startswith("before") and r in t]
        a = [t[r] for r in runs if r.startswith("after") and r in t]
        ratio = f"{(sum(a) / len(a)) / (sum(b) / len(b)):.3f}" if a and b else "-"
        cells = [f"{t[r]:.4g}" if r in t else "-" for r in runs]
        print("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
