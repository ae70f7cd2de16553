#!/usr/bin/env python3
"""Hold the Julia package to the C header: the check `make test` runs for the Julia binding.

    python3 bindings/julia/gen/check.py [--package DIR] [--header FILE]

No Julia runtime is needed: the package's .jl files are read as text. Checked:

  1. Every ccall (and @ccall) to an fce_* function in the package's src/ and ext/ names a function
     the header declares, passes as many arguments as it has parameters (the type tuple and the
     values), and maps each parameter and the return type as the binding's rules say:
        int64_t -> Int64      size_t -> Csize_t     float -> Cfloat     int -> Cint
        unsigned -> Cuint     int32_t -> Int32      uint32_t -> UInt32  enums -> Cint
        const char* -> Cstring or Ptr{UInt8}        void -> Cvoid (return)
        void* / const void* -> Ptr{Cvoid} or CuPtr{Cvoid} (PtrOrCuPtr{Cvoid})
        T* (a buffer, maybe device memory) -> Ptr{T} or CuPtr{T} (PtrOrCuPtr{T})
        size_t* (a host out-parameter) -> Ref{Csize_t} or Ptr{Csize_t}
        fce_options* -> Ref{FceOptions} or Ptr{FceOptions}
        a function-pointer typedef (fce_vp_all_gather_fn) -> Ptr{Cvoid}
     Aliases the package defines (`const fce_status = Cint`) are followed, and names that are
     the same Julia type are equal (Cint and Int32, Cfloat and Float32, Csize_t and UInt).
  2. Every header function has at least one ccall.
  3. The Julia struct mirroring each C struct (fce_options -> FceOptions) has the same fields,
     in the same order, with the mapped types; FCE_OPTIONS_INIT has the C initialiser's values.
  4. Every enumerator and FCE_* integer #define exists as a Julia const with the C value (and
     enumerators are Cint-typed).
  5. src/libfusedce.jl is what gen/generate.py makes from the header today.

Exit status 0 when all hold, 1 (with one line per problem) when any does not. Standard library
only; gen/test_check.py is its self-test.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate as gen  # noqa: E402  (the header parser and the generator)

IDENT = r"[A-Za-z_][A-Za-z_0-9!]*"

# ------------------------------------------------------------------------------ Julia text


def mask(src: str) -> str:
    """src with comments and the contents of string, char and command literals blanked out
    (newlines kept), so that brackets, commas and `ccall` are only seen in code."""
    out = list(src)
    n = len(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    def skip_string(i: int) -> int:
        """i at an opening quote; returns the index just past the closing quote."""
        q = src[i] * 3 if src.startswith(src[i] * 3, i) else src[i]
        j = i + len(q)
        while j < n and not src.startswith(q, j):
            if src[j] == "\\":
                j += 2
            elif src[j] == "$" and j + 1 < n and src[j + 1] == "(":
                j = skip_code(j + 1)
            else:
                j += 1
        return min(j + len(q), n)

    def skip_code(i: int) -> int:
        """i at '(' of an interpolation; returns the index past its ')'."""
        depth, j = 0, i
        while j < n:
            c = src[j]
            if c in "\"`":
                j = skip_string(j)
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return n

    i, prev = 0, ""
    while i < n:
        c = src[i]
        if c == "#":
            if src.startswith("#=", i):
                depth, j = 1, i + 2
                while j < n and depth:
                    if src.startswith("#=", j):
                        depth, j = depth + 1, j + 2
                    elif src.startswith("=#", j):
                        depth, j = depth - 1, j + 2
                    else:
                        j += 1
            else:
                j = src.find("\n", i)
                j = n if j < 0 else j
            blank(i, j)
            i = j
            continue
        if c in "\"`":
            j = skip_string(i)
            q = 3 if src.startswith(c * 3, i) else 1
            blank(i + q, j - q)
            i, prev = j, "x"
            continue
        if c == "'":
            if prev and (prev.isalnum() or prev in "_!)]}'."):
                i, prev = i + 1, "'"  # adjoint, not a char literal
                continue
            j = i + 1
            while j < n and src[j] not in "'\n":
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, j)
            i, prev = j + 1, "x"
            continue
        if not c.isspace():
            prev = c
        i += 1
    return "".join(out)


def match_close(s: str, i: int) -> int:
    """s[i] is an opening bracket; the index of its closing one."""
    depth = 0
    for k in range(i, len(s)):
        if s[k] in "([{":
            depth += 1
        elif s[k] in ")]}":
            depth -= 1
            if depth == 0:
                return k
    raise ValueError("unbalanced brackets")


def split_top(s: str, a: int, b: int, seps: str = ",") -> list[tuple[int, int]]:
    """Spans of the top-level pieces of s[a:b] separated by any of seps."""
    spans, depth, start = [], 0, a
    for k in range(a, b):
        ch = s[k]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch in seps and depth == 0:
            spans.append((start, k))
            start = k + 1
    spans.append((start, b))
    return spans


def line_of(s: str, pos: int) -> int:
    return s.count("\n", 0, pos) + 1


@dataclass
class CCall:
    path: Path
    line: int
    form: str                 # "ccall" or "@ccall"
    name: str | None          # the fce_* function it calls; None: not an fce call
    ret: str | None
    types: list[str] | None   # None: not a literal tuple
    nvalues: int
    problem: str | None = None  # set when the call could not be read


@dataclass
class Source:
    path: Path
    text: str
    masked: str


def _callee_name(orig: str) -> tuple[str | None, bool]:
    """(fce name, any literal name at all) from the function part of a ccall."""
    names = re.findall(r"[:\"](" + IDENT + r")", orig) + re.findall(r"\.(" + IDENT + r")\s*$",
                                                                  orig)
    fce = sorted({nm for nm in names if nm.startswith("fce_")})
    if len(fce) > 1:
        raise ValueError(f"names several functions ({', '.join(fce)})")
    return (fce[0] if fce else None), bool(names)


def find_ccalls(src: Source) -> list[CCall]:
    text, m = src.text, src.masked
    calls: list[CCall] = []
    for mt in re.finditer(r"(?<![\w@!:.])ccall\s*\(", m):
        line = line_of(m, mt.start())
        open_i = mt.end() - 1
        try:
            close_i = match_close(m, open_i)
        except ValueError:
            calls.append(CCall(src.path, line, "ccall", None, None, None, 0, "unbalanced ccall"))
            continue
        spans = [sp for sp in split_top(m, open_i + 1, close_i) if m[sp[0]:sp[1]].strip()]
        if len(spans) < 3:
            calls.append(CCall(src.path, line, "ccall", None, None, None, 0,
                               "ccall with fewer than 3 arguments"))
            continue
        try:
            name, named = _callee_name(text[spans[0][0]:spans[0][1]])
        except ValueError as e:
            calls.append(CCall(src.path, line, "ccall", None, None, None, 0, f"ccall {e}"))
            continue
        k = 1
        if m[spans[1][0]:spans[1][1]].strip() in ("cdecl", "stdcall", "fastcall", "thiscall",
                                                  "llvmcall"):
            k = 2
        if len(spans) < k + 2:
            calls.append(CCall(src.path, line, "ccall", name, None, None, 0,
                               "ccall without an argument type tuple"))
            continue
        ret = m[spans[k][0]:spans[k][1]].strip()
        ta, tb = spans[k + 1]
        tup = m[ta:tb].strip()
        types: list[str] | None = None
        if tup.startswith("("):
            t0 = m.index("(", ta)
            if match_close(m, t0) == m.rindex(")", ta, tb):
                types = [m[a:b].strip() for a, b in split_top(m, t0 + 1, match_close(m, t0))]
                types = [t for t in types if t]
        call = CCall(src.path, line, "ccall", name, ret, types, len(spans) - k - 2)
        if name is None and not named:
            call.problem = "cannot tell which C function this ccall calls (no literal name)"
        calls.append(call)

    for mt in re.finditer(r"@(?:gcsafe_)?ccall\b", m):
        line = line_of(m, mt.start())
        i = mt.end()
        while i < len(m) and m[i] in " \t":
            i += 1
        j = i
        if m.startswith("$(", j):
            j = match_close(m, j + 1) + 1
        paren = m.find("(", j)
        if paren < 0:
            calls.append(CCall(src.path, line, "@ccall", None, None, None, 0, "unreadable @ccall"))
            continue
        callee = text[i:paren]
        try:
            name, named = _callee_name(callee)
        except ValueError as e:
            calls.append(CCall(src.path, line, "@ccall", None, None, None, 0, f"@ccall {e}"))
            continue
        close_i = match_close(m, paren)
        types, nvalues = [], 0
        for a, b in split_top(m, paren + 1, close_i, seps=",;"):
            piece = m[a:b]
            if not piece.strip():
                continue
            nvalues += 1
            cuts = [mm.start() for mm in re.finditer("::", piece)
                    if all(piece[:mm.start()].count(o) == piece[:mm.start()].count(c)
                           for o, c in ("()", "{}", "[]"))]
            types.append(piece[cuts[-1] + 2:].strip() if cuts else "<untyped>")
        rm = re.match(r"\s*::\s*([A-Za-z_][\w.]*)", m[close_i + 1:])
        ret = None
        if rm:
            end = close_i + 1 + rm.end()
            if end < len(m) and m[end] == "{":
                end = match_close(m, end) + 1
            ret = m[close_i + 1:end].strip()[2:].strip()
        call = CCall(src.path, line, "@ccall", name, ret or "Cvoid", types, nvalues)
        if name is None and not named:
            call.problem = "cannot tell which C function this @ccall calls"
        calls.append(call)
    return calls


def find_consts(sources: list[Source]) -> dict[str, tuple[str, Source, int]]:
    out = {}
    for src in sources:
        for mt in re.finditer(r"^[ \t]*const[ \t]+(" + IDENT + r")[ \t]*=[ \t]*", src.masked, re.M):
            start = mt.end()
            # the right-hand side runs to the end of the line, or of its brackets
            k = start
            while k < len(src.masked) and src.masked[k] != "\n":
                if src.masked[k] in "([{":
                    k = match_close(src.masked, k)
                k += 1
            out[mt.group(1)] = (src.masked[start:k].strip(), src, line_of(src.masked, mt.start()))
    return out


def find_structs(sources: list[Source]) -> dict[str, tuple[list[tuple[str, str]], Source, int]]:
    out = {}
    for src in sources:
        m = src.masked
        for mt in re.finditer(r"^[ \t]*(?:mutable[ \t]+)?struct[ \t]+(" + IDENT + r")\b[^\n]*\n",
                              m, re.M):
            fields, pos = [], mt.end()
            for line in m[pos:].split("\n"):
                s = line.strip()
                if s == "end":
                    break
                if not s:
                    continue
                fm = re.fullmatch(r"(" + IDENT + r")\s*(?:::\s*(.+))?", s)
                if fm and not re.match(r"(function|end|new)\b", s):
                    fields.append((fm.group(1), (fm.group(2) or "Any").strip()))
            out[mt.group(1)] = (fields, src, line_of(m, mt.start()))
    return out


# ------------------------------------------------------------------------------ types

# Julia names that are the same type on every platform Julia supports
_SAME = {"Cint": "Int32", "Cuint": "UInt32", "Clonglong": "Int64", "Culonglong": "UInt64",
         "Cfloat": "Float32", "Cdouble": "Float64", "Cvoid": "Nothing", "Csize_t": "UInt",
         "Cssize_t": "Int", "Cptrdiff_t": "Int", "Cshort": "Int16", "Cushort": "UInt16",
         "Cuchar": "UInt8", "Cintmax_t": "Int64", "Cuintmax_t": "UInt64"}

# the binding's rules for C scalars (see the module docstring)
_C_SCALAR = {"int": "Cint", "unsigned": "Cuint", "float": "Cfloat", "double": "Cdouble",
             "size_t": "Csize_t", "ptrdiff_t": "Cptrdiff_t", "int8_t": "Int8", "uint8_t": "UInt8",
             "int16_t": "Int16", "uint16_t": "UInt16", "int32_t": "Int32", "uint32_t": "UInt32",
             "int64_t": "Int64", "uint64_t": "UInt64", "char": "Cchar", "void": "Cvoid"}
_HOST_OUT = {"size_t"}  # T* that are host-side out-parameters (Ref allowed)


def type_aliases(consts: dict[str, tuple[str, Source, int]]) -> dict[str, str]:
    """const X = Y where Y is a type expression (a name, maybe with {parameters})."""
    out = {}
    for name, (rhs, _, _) in consts.items():
        if re.fullmatch(r"[A-Za-z_][\w.]*(\{[\w.{}, ]*\})?", rhs):
            out[name] = rhs
    return out


def canon(t: str, aliases: dict[str, str], depth: int = 0) -> str:
    """A Julia type expression in a canonical spelling: aliases followed, same types equal."""
    t = t.strip()
    if depth > 20:
        return t
    mt = re.fullmatch(r"([A-Za-z_][\w.]*)\s*(?:\{(.*)\})?", t, re.S)
    if not mt:
        return re.sub(r"\s+", "", t)
    head = mt.group(1).split(".")[-1]
    if mt.group(2) is None and head in aliases and aliases[head] != head:
        return canon(aliases[head], aliases, depth + 1)
    head = _SAME.get(head, head)
    if mt.group(2) is None:
        return head
    inner = mt.group(2)
    params = [inner[a:b] for a, b in split_top(inner, 0, len(inner))]
    return head + "{" + ",".join(canon(p, aliases, depth + 1) for p in params) + "}"


def allowed_types(ct: gen.CType, hdr: gen.Header, role: str, pname: str = "") -> list[str]:
    """The Julia spellings the rules allow for a C type; role: 'param', 'ret' or 'field'."""
    if ct.pointers == 0:
        if hdr.enum_of(ct.base):
            return ["Cint"]
        if hdr.struct_of(ct.base):
            return [gen.julia_struct_name(ct.base)]
        if hdr.callback_of(ct.base):
            return ["Ptr{Cvoid}"]
        return [_C_SCALAR[ct.base]]
    if ct.pointers == 1 and ct.base == "char":
        return ["Cstring", "Ptr{UInt8}"]
    if ct.pointers == 1 and hdr.struct_of(ct.base):
        s = gen.julia_struct_name(ct.base)
        return [f"Ref{{{s}}}", f"Ptr{{{s}}}"] if role == "param" else [f"Ptr{{{s}}}"]
    inner = allowed_types(gen.CType(ct.base, ct.pointers - 1), hdr, "field")[0]
    if role != "param" or ct.pointers > 1:
        return [f"Ptr{{{inner}}}"]
    if ct.base in _HOST_OUT:
        return [f"Ref{{{inner}}}", f"Ptr{{{inner}}}"]
    out = [f"Ptr{{{inner}}}", f"CuPtr{{{inner}}}", f"PtrOrCuPtr{{{inner}}}"]
    if ct.base == "void" and pname == "stream":
        out.append("CUstream")
    return out


# ------------------------------------------------------------------------------ values


def _julia_number(s: str, consts: dict, aliases: dict, depth: int = 0):
    """(value, canonical type or None) of a Julia constant expression, or (None, None)."""
    s = s.strip()
    if depth > 20 or not s:
        return None, None
    mt = re.fullmatch(r"([A-Za-z_][\w.]*)\s*\((.*)\)", s, re.S)
    if mt and mt.group(1) not in ("sizeof",):
        value, _ = _julia_number(mt.group(2), consts, aliases, depth + 1)
        return value, canon(mt.group(1), aliases)
    mt = re.fullmatch(r"[-+]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eEf][-+]?\d+)?", s)
    if mt and re.search(r"[.eEf]", s) and not s.lower().startswith(("0x", "-0x")):
        return float(s.replace("_", "").replace("f", "e")), None
    try:
        return int(s.replace("_", ""), 0), None
    except ValueError:
        pass
    if re.fullmatch(IDENT, s) and s in consts:
        return _julia_number(consts[s][0], consts, aliases, depth + 1)
    # simple arithmetic over names and integers
    expr = s.replace("÷", "//")
    for name in sorted(set(re.findall(IDENT, expr)), key=len, reverse=True):
        v, _ = _julia_number(name, consts, aliases, depth + 1) if name in consts else (None, None)
        if not isinstance(v, int):
            return None, None
        expr = re.sub(rf"\b{name}\b", str(v), expr)
    if re.fullmatch(r"[\d\s+\-*/()%]+", expr):
        try:
            return int(eval(expr, {"__builtins__": {}})), None
        except Exception:
            return None, None
    return None, None


def _c_init_value(item: str, hdr: gen.Header):
    item = item.strip()
    mt = re.fullmatch(r"sizeof\s*\(\s*(\w+)\s*\)", item)
    if mt:
        return ("sizeof", gen.julia_struct_name(mt.group(1)))
    if item == "NULL":
        return ("null",)
    if item in hdr.constants():
        return hdr.constants()[item]
    mt = re.fullmatch(r"([-+]?[\d.]+(?:[eE][-+]?\d+)?)[fF]?", item)
    if mt:
        return float(mt.group(1)) if re.search(r"[.eE]", mt.group(1)) else int(mt.group(1))
    return ("?", item)


def _julia_init_value(item: str, consts: dict, aliases: dict):
    item = item.strip()
    mt = re.fullmatch(r"sizeof\s*\(\s*([\w.]+)\s*\)", item)
    if mt:
        return ("sizeof", canon(mt.group(1), aliases))
    if item in ("C_NULL", "Ptr{Cvoid}(0)", "Ptr{Cfloat}(0)"):
        return ("null",)
    value, _ = _julia_number(item, consts, aliases)
    return value if value is not None else ("?", item)


# ------------------------------------------------------------------------------ the check


def package_sources(package: Path) -> list[Source]:
    files = sorted(p for d in ("src", "ext") for p in (package / d).rglob("*.jl")
                   if (package / d).is_dir())
    out = []
    for p in files:
        text = p.read_text()
        out.append(Source(p, text, mask(text)))
    return out


def check(package: Path, header: Path) -> tuple[list[str], str]:
    problems: list[str] = []
    hdr = gen.parse_header(header.read_text())
    sources = package_sources(package)
    if not sources:
        return [f"{package}: no .jl files under src/ or ext/"], ""
    rel = lambda p: p.relative_to(package) if p.is_relative_to(package) else p  # noqa: E731
    consts = find_consts(sources)
    aliases = type_aliases(consts)
    functions = {f.name: f for f in hdr.functions}

    # 1. the ccalls
    calls = [c for s in sources for c in find_ccalls(s)]
    wrapped: dict[str, int] = {}
    for c in calls:
        where = f"{rel(c.path)}:{c.line}"
        if c.problem:
            problems.append(f"{where}: {c.problem}")
            continue
        if c.name is None:
            continue  # a call into something else (libc, the Julia runtime)
        fn = functions.get(c.name)
        if fn is None:
            problems.append(f"{where}: {c.form} to {c.name}, which {header.name} does not "
                            "declare")
            continue
        wrapped[c.name] = wrapped.get(c.name, 0) + 1
        if c.types is None:
            problems.append(f"{where}: ccall to {c.name}: the argument types are not a literal "
                            "tuple")
            continue
        n = len(fn.params)
        if len(c.types) != n:
            problems.append(f"{where}: {c.form} to {c.name}: arity: {len(c.types)} argument "
                            f"types, the header has {n} parameters ({fn.prototype()})")
        if c.nvalues != len(c.types):
            problems.append(f"{where}: {c.form} to {c.name}: arity: {c.nvalues} argument values "
                            f"for {len(c.types)} argument types")
        for i, (p, jt) in enumerate(zip(fn.params, c.types), 1):
            ok = allowed_types(p.ctype, hdr, "param", p.name)
            if canon(jt, aliases) not in {canon(t, aliases) for t in ok}:
                problems.append(f"{where}: {c.form} to {c.name}: argument {i} ({p.ctype} "
                                f"{p.name}) is typed {jt}, expected {' or '.join(ok)}")
        ok = allowed_types(fn.ret, hdr, "ret")
        if c.ret is None or canon(c.ret, aliases) not in {canon(t, aliases) for t in ok}:
            problems.append(f"{where}: {c.form} to {c.name}: return type {c.ret} for C "
                            f"{fn.ret}, expected {' or '.join(ok)}")

    # 2. a wrapper for every function
    for fn in hdr.functions:
        if fn.name not in wrapped:
            problems.append(f"{header.name}:{fn.line}: {fn.name} has no wrapper: no ccall in "
                            f"{package.name}/src or ext calls it")

    # 3. the structs and their initialisers
    structs = find_structs(sources)
    for st in hdr.structs:
        jname = gen.julia_struct_name(st.name)
        if jname not in structs:
            problems.append(f"{header.name}: struct {st.name} has no Julia mirror "
                            f"(struct {jname})")
            continue
        fields, src, line = structs[jname]
        where = f"{rel(src.path)}:{line}"
        jn = [f for f, _ in fields]
        cn = [f.name for f in st.fields]
        if jn != cn:
            problems.append(f"{where}: struct {jname} fields {jn} differ from C {st.name} "
                            f"fields {cn} (names and order must be the same)")
        for (fname, jt), cf in zip(fields, st.fields):
            ok = allowed_types(cf.ctype, hdr, "field")
            if canon(jt, aliases) not in {canon(t, aliases) for t in ok}:
                problems.append(f"{where}: struct {jname} field {fname} is {jt}, expected "
                                f"{' or '.join(ok)} for C {cf.ctype} {cf.name}")
        for d in hdr.defines:
            if d.init is None or len(d.init) != len(st.fields):
                continue
            if d.name not in consts:
                problems.append(f"{header.name}: {d.name} has no Julia const")
                continue
            rhs, csrc, cline = consts[d.name]
            mt = re.fullmatch(r"([\w.]+)\s*\((.*)\)", rhs, re.S)
            cwhere = f"{rel(csrc.path)}:{cline}"
            if not mt or canon(mt.group(1), aliases) != canon(jname, aliases):
                problems.append(f"{cwhere}: {d.name} is not built with {jname}(...)")
                continue
            inner = mt.group(2)
            items = [inner[a:b] for a, b in split_top(inner, 0, len(inner))]
            if len(items) != len(d.init):
                problems.append(f"{cwhere}: {d.name} has {len(items)} items, the C "
                                f"initialiser {len(d.init)}")
                continue
            for cf, citem, jitem in zip(st.fields, d.init, items):
                cv, jv = _c_init_value(citem, hdr), _julia_init_value(jitem, consts, aliases)
                same = cv == jv or (isinstance(cv, (int, float)) and isinstance(jv, (int, float))
                                    and float(cv) == float(jv))
                if not same:
                    problems.append(f"{cwhere}: {d.name}: field {cf.name} is {jitem.strip()}, "
                                    f"the C initialiser has {citem}")

    # 4. the constants
    n_consts = 0
    for e in hdr.enums:
        for name, value in e.values:
            n_consts += 1
            if name not in consts:
                problems.append(f"{header.name}: enumerator {name} ({e.name}) has no Julia const")
                continue
            jv, jt = _julia_number(consts[name][0], consts, aliases)
            where = f"{rel(consts[name][1].path)}:{consts[name][2]}"
            if jv != value:
                problems.append(f"{where}: {name} = {consts[name][0]}, the header says {value}")
            elif jt != "Int32":
                problems.append(f"{where}: {name} must be a Cint (C enums are int), "
                                f"not {consts[name][0]}")
    for d in hdr.defines:
        if d.value is None:
            continue
        n_consts += 1
        if d.name not in consts:
            problems.append(f"{header.name}: #define {d.name} has no Julia const")
            continue
        jv, jt = _julia_number(consts[d.name][0], consts, aliases)
        where = f"{rel(consts[d.name][1].path)}:{consts[d.name][2]}"
        if jv != d.value:
            problems.append(f"{where}: {d.name} = {consts[d.name][0]}, the header says "
                            f"{d.value} ({d.text})")
        elif d.unsigned and jt != "UInt32":
            problems.append(f"{where}: {d.name} must be a Cuint ({d.text} is unsigned)")

    # 5. the generated file is current
    generated = package / "src" / "libfusedce.jl"
    expected = gen.render(header.read_text())
    actual = generated.read_text() if generated.exists() else ""
    if actual != expected:
        diff = list(difflib.unified_diff(actual.splitlines(), expected.splitlines(),
                                         f"{rel(generated)} (in the package)",
                                         f"{rel(generated)} (generated now)", lineterm="", n=1))
        shown = "\n    ".join(diff[:30]) + ("\n    ..." if len(diff) > 30 else "")
        problems.append(f"{rel(generated)} is out of date with {header.name}: run "
                        f"`python3 bindings/julia/gen/generate.py`\n    {shown}")

    fce_calls = sum(wrapped.values())
    summary = (f"{len(hdr.functions)} header functions, {fce_calls} fce ccalls in "
               f"{len(sources)} files, {len(hdr.structs)} struct(s), {n_consts} constants; "
               f"{rel(generated)} current")
    return problems, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check the Julia package against the C header.")
    ap.add_argument("--package", type=Path, default=gen.PACKAGE)
    ap.add_argument("--header", type=Path, default=gen.HEADER)
    a = ap.parse_args(argv)
    try:
        problems, summary = check(a.package.resolve(), a.header.resolve())
    except gen.HeaderError as e:
        print(f"check.py: cannot parse {a.header}: {e}")
        return 1
    if problems:
        for p in problems:
            print(f"check.py: {p}")
        print(f"check.py: FAILED ({len(problems)} problem{'s' if len(problems) != 1 else ''})")
        return 1
    print(f"check.py: OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
