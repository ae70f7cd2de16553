#!/usr/bin/env python3
"""Reads a test suite's log and prints what its runners counted, for tools/run_tests.sh.

    python3 tools/test_counts.py LOG       ->  e.g. "1193 passed, 0 failed, 2 skipped"

It knows the summaries of ctest, pytest, cargo test, tools/check_readme.py and libFuzzer, and
the one-line "SKIPPED: ..." notes a suite prints for a part it cannot run here (each counts one
skip), and adds up every one it finds (a suite may run several runners). Nothing is printed
when the log holds none of them.
"""
import re
import sys

PYTEST_PART = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
PYTEST_KIND = {"error": "failed", "errors": "failed", "xfailed": "passed", "xpassed": "passed"}


def ctest(m):
    failed, total = int(m.group(2)), int(m.group(3))
    return {"passed": total - failed, "failed": failed}


def pytest(m):
    out = {}
    for n, kind in PYTEST_PART.findall(m.group(1)):
        kind = PYTEST_KIND.get(kind, kind)
        out[kind] = out.get(kind, 0) + int(n)
    return out


# (pattern, what a match counts): each runner's summary line. ctest and check_readme.py count a
# skipped test among the passed ones; their per-test "skipped" lines move it over.
SUMMARIES = [
    (re.compile(r"(\d+)% tests passed, (\d+) tests? failed out of (\d+)"), ctest),
    (re.compile(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected|"
                r"warnings?)(?:, )?)+) in [\d.]+s"), pytest),
    (re.compile(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored"),
     lambda m: {"passed": int(m.group(1)), "failed": int(m.group(2)), "skipped": int(m.group(3))}),
    (re.compile(r"^doc blocks: (\d+) ok or skipped, (\d+) failed"),
     lambda m: {"passed": int(m.group(1)), "failed": int(m.group(2))}),
]
SKIPPED_AMONG_PASSED = [
    re.compile(r"Test\s+#\d+: .*\*\*\*Skipped"),  # ctest
    re.compile(r"^\S+:\d+ \(\S*\): SKIPPED"),       # check_readme.py
]
# A part of a suite its runner could not run here ("SKIPPED: julia not on PATH ..."): one skip.
PART_SKIPPED = re.compile(r"^SKIPPED: ")
FUZZ = re.compile(r"^(?:Done (\d+) runs in|stat::number_of_executed_units:\s*(\d+))")


def counts(text):
    c = {"passed": 0, "failed": 0, "skipped": 0}
    found, fuzz_runs, moved = False, 0, 0
    for line in text.split("\n"):
        line = line.strip()
        for pattern, count in SUMMARIES:
            m = pattern.search(line)
            if m:
                for kind, n in count(m).items():
                    c[kind] += n
                found = True
                break
        else:
            moved += any(p.search(line) for p in SKIPPED_AMONG_PASSED)
            if PART_SKIPPED.search(line):
                c["skipped"] += 1
            m = FUZZ.search(line)
            if m:
                fuzz_runs += int(m.group(1) or m.group(2))
    if found:
        c["passed"] -= moved
        c["skipped"] += moved
    parts = []
    if found or c["skipped"]:
        parts.append(f"{c['passed']} passed, {c['failed']} failed")
        if c["skipped"]:
            parts.append(f"{c['skipped']} skipped")
    if fuzz_runs:
        parts.append(f"{fuzz_runs} fuzz runs")
    return ", ".join(parts)


def main(argv):
    if len(argv) != 1:
        print(__doc__)
        return 2
    with open(argv[0], encoding="utf-8", errors="replace") as f:
        print(counts(f.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
