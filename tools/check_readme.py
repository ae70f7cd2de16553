#!/usr/bin/env python3
"""Runs the code blocks of the documentation, doctest-style: README.md, docs/*.md,
CONTRIBUTING.md and bindings/python/README.md.

    python3 tools/check_readme.py [BUILD_DIR] [FILE.md...]     (default: build, all of them)

One line per block: "ok", "SKIPPED: why" or "FAILED" (with the output that says why); exit
status 0 when no block failed.

  ```python  run with this interpreter (sys.executable; `make test` runs it with python3),
             PYTHONPATH=bindings/python and FUSEDCE_LIBRARY=BUILD_DIR/libfusedce.so, in a
             fresh process, from a scratch directory. A block that mentions torch is skipped
             when torch cannot be imported, one that imports another module (transformers, jax)
             when that cannot; one that asks for a CUDA device when none is visible.
  ```c       pasted into tools/readme_c_harness.c (which declares the buffers the snippets use),
             compiled with cc against include/ and BUILD_DIR/libfusedce.so, and run twice: as
             written (CUDA backend: without a device every call returns
             FCE_ERROR_BACKEND_UNAVAILABLE, which counts as running) and with FCE_OPTIONS_INIT
             giving the CPU backend, where every call must succeed.
  ```cpp     pasted into tools/readme_cpp_harness.cpp (which declares what the snippets use)
             and compiled with c++ -fsyntax-only against include/: type-checked against the
             headers, not run (the C++ snippets need NCCL and several GPUs).
  ```rust    the body of main() (returning Result<(), Box<dyn Error>>, so `?` works) of a
             scratch crate that depends on bindings/rust/fusedce by path; built offline with
             cargo against BUILD_DIR/libfusedce.so (cargo's output in BUILD_DIR/rust-target)
             and run. Skipped when cargo is not found.
  ```sh      not run (they install and build): every `make` target must exist in the Makefile
             and every repository path mentioned (scripts, examples, manifests) must exist;
             `cargo --example NAME` must name a file of the crate's examples/.
  Others (cmake, toml, julia, ...) are listed as skipped: there is no checker for them.

A block preceded by the line `<!-- readme-check: continues -->` runs after the blocks of the
same language before it in that file (as doctest shares a docstring's names); by default each
block runs alone.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def default_files():
    """README.md, every Markdown file of docs/, CONTRIBUTING.md, bindings/python/README.md."""
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                  if f.endswith(".md"))
    return ["README.md"] + docs + ["CONTRIBUTING.md", "bindings/python/README.md"]

CONTINUES = "<!-- readme-check: continues -->"
TIMEOUT = 300


class Block:
    def __init__(self, path, line, lang, code, continues):
        self.path, self.line, self.lang, self.code, self.continues = path, line, lang, code, continues

    @property
    def name(self):
        return f"{self.path}:{self.line} ({self.lang})"


def extract(path):
    """The fenced blocks of a Markdown file; `line` is the first line of code (1-based)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2).lower()
        prev = lines[i - 1].strip() if i > 0 else ""
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j]]
        blocks.append(Block(path, i + 2, lang, body, prev == CONTINUES))
        i = j + 1
    return blocks


def chain(blocks, k):
    """Block k and, when it continues, the blocks of its language before it in its file."""
    out = [blocks[k]]
    while out[0].continues:
        prev = [b for b in blocks[:blocks.index(out[0])] if b.lang == out[0].lang]
        if not prev:
            break
        out.insert(0, prev[-1])
    return out


def tail(text, n=25):
    lines = [ln for ln in text.strip().split("\n") if ln.strip()]
    return "\n".join("    " + ln for ln in lines[-n:])


def head(text, n=25):
    lines = [ln for ln in text.strip().split("\n") if ln.strip()]
    return "\n".join("    " + ln for ln in lines[:n])


# ---------------------------------------------------------------------------------- python --
def python_has(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
    return r.returncode == 0


def run_python(blocks, env, have):
    code = "\n".join("\n".join(b.code) for b in blocks)
    if re.search(r"\btorch\b", code) and not have["torch"]:
        return "SKIPPED: needs torch (not importable by %s)" % sys.executable
    # optional frameworks a block imports (transformers, jax, ...): skipped where absent
    for module in sorted(set(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M))):
        if module in ("fusedce", "torch", "numpy", "os", "sys", "tempfile", "math"):
            continue
        if module not in have:
            have[module] = python_has(module)
        if not have[module]:
            return "SKIPPED: needs %s (not importable by %s)" % (module, sys.executable)
    if re.search(r"""\.cuda\(|device=["']cuda|["']cuda:\d""", code) and not have["gpu"]:
        return "SKIPPED: needs a CUDA device"
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "block.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code + "\n")
        try:
            r = subprocess.run([sys.executable, script], cwd=tmp, env=env, capture_output=True,
                               text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"FAILED: timed out after {TIMEOUT} s"
    if r.returncode != 0:
        return "FAILED:\n" + tail(r.stdout + r.stderr)
    return "ok"


# --------------------------------------------------------------------------------------- c --
def paste(harness_name, marker, blocks):
    """The harness's text with the blocks' code in place of its marker line (None without one);
    #line directives make compiler messages point into the Markdown file."""
    with open(os.path.join(ROOT, "tools", harness_name), encoding="utf-8") as f:
        harness = f.read()
    if marker not in harness:
        return None
    snippets = []
    for b in blocks:
        snippets.append(f'#line {b.line} "{b.path}"')
        snippets.extend(b.code)
    after = f'#line 1 "{harness_name} (after the snippets)"'
    return harness.replace(marker, "\n".join(snippets) + "\n" + after)


def run_c(blocks, build, have):
    source = paste("readme_c_harness.c", "/* @SNIPPETS@ */", blocks)
    if source is None:
        return "FAILED: tools/readme_c_harness.c has no /* @SNIPPETS@ */ line"
    cc = os.environ.get("CC", "cc")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "readme.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        for label, define in (("CPU backend", "-DREADME_BACKEND=FCE_BACKEND_CPU"),
                              ("as written (CUDA backend)", None)):
            exe = os.path.join(tmp, "readme_cpu" if define else "readme_cuda")
            cmd = [cc, "-std=c11", "-Wall", "-Werror", "-Wno-unused-variable",
                   "-Wno-unused-but-set-variable", "-I", os.path.join(ROOT, "include"), src,
                   "-o", exe, "-L", build, "-Wl,-rpath," + build, "-lfusedce", "-ldl", "-lm"]
            if define:
                cmd.insert(1, define)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                return f"FAILED: does not compile ({label}):\n" + head(r.stdout + r.stderr)
            env = dict(os.environ, LD_LIBRARY_PATH=build + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
            try:
                r = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                return f"FAILED: timed out after {TIMEOUT} s ({label})"
            if r.returncode != 0:
                return f"FAILED: {label}: exit status {r.returncode}:\n" + tail(r.stdout + r.stderr)
            summary = r.stdout.strip().split("\n")[-1] if r.stdout.strip() else "ran"
            results.append(f"{label}: {summary}")
    return "ok (" + "; ".join(results) + ")"


# ------------------------------------------------------------------------------------- cpp --
def run_cpp(blocks):
    source = paste("readme_cpp_harness.cpp", "// @SNIPPETS@", blocks)
    if source is None:
        return "FAILED: tools/readme_cpp_harness.cpp has no // @SNIPPETS@ line"
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "readme.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror",
                            "-Wno-unused-variable", "-I", os.path.join(ROOT, "include"), src],
                           capture_output=True, text=True)
    if r.returncode != 0:
        return "FAILED: does not compile:\n" + head(r.stdout + r.stderr)
    return "ok (compiled against the headers; not run: it needs NCCL and GPUs)"


# ------------------------------------------------------------------------------------ rust --
def find_cargo():
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    home = os.path.join(os.path.expanduser("~"), ".cargo", "bin", "cargo")
    return cargo or (home if os.access(home, os.X_OK) else None)


def run_rust(blocks, build):
    cargo = find_cargo()
    if cargo is None:
        return "SKIPPED: needs cargo (not found; set CARGO)"
    code = "\n".join("\n".join(b.code) for b in blocks)
    if not re.search(r"^\s*fn main\s*\(", code, re.M):
        code = ("fn main() -> Result<(), Box<dyn std::error::Error>> {\n" + code +
                "\n    Ok(())\n}")
    crate = os.path.join(ROOT, "bindings", "rust", "fusedce")
    manifest = ("[package]\nname = \"readme_block\"\nversion = \"0.0.0\"\nedition = \"2021\"\n"
                "publish = false\n\n[dependencies]\nfusedce = { path = " + json.dumps(crate) +
                " }\n\n[workspace]\n")
    env = dict(os.environ, FUSEDCE_LIB_DIR=build, FUSEDCE_INCLUDE_DIR=os.path.join(ROOT, "include"),
               CARGO_TARGET_DIR=os.path.join(build, "rust-target"),
               LD_LIBRARY_PATH=build + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "src"))
        with open(os.path.join(tmp, "Cargo.toml"), "w", encoding="utf-8") as f:
            f.write(manifest)
        with open(os.path.join(tmp, "src", "main.rs"), "w", encoding="utf-8") as f:
            f.write(code + "\n")
        try:
            r = subprocess.run([cargo, "run", "--offline", "--quiet", "--manifest-path",
                                os.path.join(tmp, "Cargo.toml")], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"FAILED: timed out after {TIMEOUT} s"
    if r.returncode != 0:
        return "FAILED:\n" + tail(r.stdout + r.stderr)
    out = r.stdout.strip().split("\n")[-1] if r.stdout.strip() else "ran"
    return f"ok (CPU backend: {out})"


# -------------------------------------------------------------------------------------- sh --
def make_targets():
    targets = set()
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.\-/ $()]+?)\s*:(?!=)", line)
            if m and not line.startswith("\t"):
                targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets


def check_sh(block):
    problems, targets = [], make_targets()
    text = "\n".join(ln.split(" #")[0] if not ln.lstrip().startswith("#") else ""
                     for ln in block.code)
    text = text.replace("\\\n", " ")
    for line in text.split("\n"):
        try:
            words = shlex.split(line)
        except ValueError as e:
            problems.append(f"cannot parse {line!r}: {e}")
            continue
        while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
            words.pop(0)
        words = [w.replace("$PWD/", "").split("=", 1)[-1] if w.startswith("--") or "$PWD" in w
                 else w for w in words]
        cmd_words = words
        if cmd_words[:1] == ["make"]:
            for w in cmd_words[1:]:
                if "=" not in w and not w.startswith("-") and w not in targets:
                    problems.append(f"make target {w!r} is not in the Makefile")
        if cmd_words[:1] == ["cargo"] and "--example" in cmd_words:
            name = cmd_words[cmd_words.index("--example") + 1]
            manifest = next((w for w in cmd_words if w.endswith("Cargo.toml")), "Cargo.toml")
            ex = os.path.join(os.path.dirname(manifest), "examples", name + ".rs")
            if not os.path.exists(os.path.join(ROOT, ex)):
                problems.append(f"cargo example {name!r}: {ex} does not exist")
        for w in words:
            w = w.rstrip(";,")
            if w.startswith("./"):
                w = w[2:]
            if "$" in w or w.startswith(("build/", "/", "-")) or "/" not in w:
                continue
            if re.match(r"^[\w.\-]+(/[\w.\-]+)+/?$", w) and not os.path.exists(os.path.join(ROOT, w)):
                problems.append(f"path {w} does not exist")
    return "ok (not run; commands and paths checked)" if not problems else \
        "FAILED: " + "; ".join(problems)


# ------------------------------------------------------------------------------------ main --
def main():
    args = sys.argv[1:]
    build = os.path.abspath(args.pop(0) if args and not args[0].endswith(".md")
                            else os.path.join(ROOT, "build"))
    files = [os.path.relpath(os.path.abspath(a), ROOT) for a in args] or default_files()
    lib = os.path.join(build, "libfusedce.so")
    if not os.path.exists(lib):
        print(f"FAILED: {lib} does not exist (build first)")
        return 1
    env = dict(os.environ, FUSEDCE_LIBRARY=lib,
               PYTHONPATH=os.path.join(ROOT, "bindings", "python") +
               (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    import ctypes
    have = {"torch": python_has("torch"), "gpu": bool(ctypes.CDLL(lib).fce_cuda_available())}
    failed = counted = 0
    for path in files:
        blocks = extract(path)
        for k, b in enumerate(blocks):
            if b.lang in ("python", "py"):
                result = run_python(chain(blocks, k), env, have)
            elif b.lang == "c":
                result = run_c(chain(blocks, k), build, have)
            elif b.lang in ("cpp", "c++"):
                result = run_cpp(chain(blocks, k))
            elif b.lang == "rust":
                result = run_rust(chain(blocks, k), build)
            elif b.lang in ("sh", "bash", "shell", "console"):
                result = check_sh(b)
            else:
                result = f"SKIPPED: no checker for ```{b.lang or '(no language)'} blocks"
            counted += 1
            failed += result.startswith("FAILED")
            print(f"{b.name}: {result}", flush=True)
    print(f"doc blocks: {counted - failed} ok or skipped, {failed} failed ({len(files)} files)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
