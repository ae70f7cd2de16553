#!/usr/bin/env python3
"""Fails when a file of the repository speaks of how the work was organised instead of the
project: issue or session numbers, leases, "the brief", "the lead".

    python3 tools/check_words.py [--self-test] [--skip PREFIX]... [ROOT]

Scans every file git tracks under ROOT (default: the repository this script is in), or every
file below ROOT when git is absent or ROOT is not a checkout (build folders, caches and .git
left out), and the paths themselves; this file, which holds the self-test's examples, excepted. Files holding a NUL byte or that are not UTF-8 are
binary and skipped. Each hit is printed as `file:line: text`; the exit status is 1 when there
is any. `--skip PREFIX` leaves out paths that start with PREFIX (for looking at a part of the
tree; `make test` passes none). `--self-test` checks the patterns against the examples below
first.

The rule and its allowed spellings are in CONTRIBUTING.md ("Words"). In short: a peer's issue
is cited as `Repo#N` or `owner/repo#N` (`Liger-Kernel#332`, `NVIDIA/Megatron-LM#737`), never
as "issue N"; history is dated or versioned ("since 0.3", "measured 2026-11-24"); a number does
not follow the words issue(s) or session(s) ("a warp issues up to 4 instructions", not "issues 4").
"""
import os
import re
import subprocess
import sys

PATTERNS = [
    re.compile(r"\b(issue|session)s? ?#?[0-9]+\b", re.I),
    re.compile(r"\blease\b", re.I),
    re.compile(r"\bthe brief\b", re.I),
    re.compile(r"\bthe lead\b", re.I),
]

# (text, must it be reported?) — the self-test's cases
EXAMPLES = [
    ("fixed in issue 8", True),
    ("Issue #12 on two GPUs", True),
    ("see issues 3 and 4", True),
    ("NOTES, session 10", True),
    ("torch-issue8-s8.json", True),
    ("measured in one lease", True),
    ("as the brief asks", True),
    ("The lead said so", True),
    ("Liger-Kernel#332", False),
    ("NVIDIA/Megatron-LM#737", False),
    ("released in 0.3", False),
    ("a warp issues up to 4 instructions", False),
    ("pytest fixture scope='session'", False),
    ("the leading element", False),
    ("int lead = 3;", False),
    ("please report the issue", False),
]

SELF = "tools/check_words.py"
SKIP_DIRS = {".git", "__pycache__", "node_modules", "target", ".pytest_cache", ".ruff_cache"}


def hits(text):
    """The matched substrings of one line."""
    return [m.group(0) for p in PATTERNS for m in p.finditer(text)]


def tracked_files(root):
    """git ls-files under root, or None when git cannot list them."""
    try:
        r = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return [p for p in r.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def walked_files(root):
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("build"))
        rel = os.path.relpath(d, root)
        out.extend(os.path.normpath(os.path.join(rel, f)) for f in sorted(files))
    return out


def read_text(path):
    """The file's text, or None for a binary (NUL byte, not UTF-8) or unreadable file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def self_test():
    bad = [(t, want) for t, want in EXAMPLES if bool(hits(t)) != want]
    for t, want in bad:
        print(f"self-test: {t!r} should {'' if want else 'not '}be reported")
    return not bad


def main(argv):
    args, skips, root, run_self_test = list(argv), [], None, False
    while args:
        a = args.pop(0)
        if a == "--self-test":
            run_self_test = True
        elif a == "--skip" and args:
            skips.append(args.pop(0))
        elif not a.startswith("-") and root is None:
            root = a
        else:
            print(__doc__)
            return 2
    if run_self_test and not self_test():
        return 1
    root = os.path.abspath(root or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = tracked_files(root)
    source = "git ls-files"
    if files is None:
        files, source = walked_files(root), "the tree (no git)"
    files = [f for f in files if not any(f.startswith(s) for s in skips) and f != SELF]
    found = scanned = 0
    for rel in files:
        for h in hits(rel):
            print(f"{rel}: the path holds {h!r}")
            found += 1
        text = read_text(os.path.join(root, rel))
        if text is None:
            continue
        scanned += 1
        for n, line in enumerate(text.split("\n"), 1):
            for h in hits(line):
                print(f"{rel}:{n}: {h!r} in: {line.strip()[:160]}")
                found += 1
    print(f"words: {scanned} text files of {len(files)} ({source}) scanned, {found} hits"
          + (" (CONTRIBUTING.md, 'Words', says how to write them)" if found else ""))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
