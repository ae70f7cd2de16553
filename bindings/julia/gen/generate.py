#!/usr/bin/env python3
"""Generate the Julia package's low-level wrappers from the C header.

    python3 bindings/julia/gen/generate.py            # writes FusedCE.jl/src/libfusedce.jl
    python3 bindings/julia/gen/generate.py --stdout   # prints it instead

Reads include/fusedce.h (functions, enums, the options struct, #define constants and the
FCE_OPTIONS_INIT initialiser) and writes bindings/julia/FusedCE.jl/src/libfusedce.jl: one Julia
function per fce_* function, each a single ccall, a status-returning one checked with
check_status (FusedCE.jl throws FusedCEError); the struct mirrored field for field; enums as Cint
constants. The style is that of CUDA.jl's generated lib/cublas/src/libcublasLt.jl.

The header parser here is also what check.py uses to hold the package to the header; it only
knows the C that fusedce.h is written in (C99 prototypes, typedef'd enums and structs, typedef'd
function pointers (callbacks, passed as Ptr{Cvoid}), object-like #defines) and fails loudly on
anything else rather than guessing. Standard library only.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent / "FusedCE.jl"
REPO = HERE.parents[2]
HEADER = REPO / "include" / "fusedce.h"
OUTPUT = PACKAGE / "src" / "libfusedce.jl"


class HeaderError(Exception):
    """The header uses C this parser does not handle."""


# ------------------------------------------------------------------------------ the C model


@dataclass(frozen=True)
class CType:
    base: str          # "int64_t", "void", "char", "unsigned", "fce_options", "fce_status", ...
    pointers: int = 0  # number of '*'
    const: bool = False  # the pointee (pointers == 1) or the value (pointers == 0) is const

    def __str__(self) -> str:
        s = ("const " if self.const else "") + self.base
        return s + "*" * self.pointers


@dataclass
class Param:
    name: str
    ctype: CType


@dataclass
class Function:
    name: str
    ret: CType
    params: list[Param]
    line: int

    def prototype(self) -> str:
        args = ", ".join(f"{p.ctype} {p.name}" for p in self.params) or "void"
        return f"{self.ret} {self.name}({args})"


@dataclass
class Enum:
    name: str
    values: list[tuple[str, int]]


@dataclass
class Struct:
    name: str
    fields: list[Param]


@dataclass
class Define:
    name: str
    text: str                 # the C replacement text, whitespace-normalised
    value: int | None = None  # integer constants
    unsigned: bool = False    # a 'u' suffix: unsigned int
    init: list[str] | None = None  # brace initialisers: the items


@dataclass
class Header:
    functions: list[Function] = field(default_factory=list)
    enums: list[Enum] = field(default_factory=list)
    structs: list[Struct] = field(default_factory=list)
    defines: list[Define] = field(default_factory=list)
    callbacks: list[Function] = field(default_factory=list)  # typedef RET (*NAME)(PARAMS);

    def enum_of(self, name: str) -> Enum | None:
        return next((e for e in self.enums if e.name == name), None)

    def struct_of(self, name: str) -> Struct | None:
        return next((s for s in self.structs if s.name == name), None)

    def callback_of(self, name: str) -> Function | None:
        return next((c for c in self.callbacks if c.name == name), None)

    def constants(self) -> dict[str, int]:
        out = {n: v for e in self.enums for n, v in e.values}
        out.update({d.name: d.value for d in self.defines if d.value is not None})
        return out


# ------------------------------------------------------------------------------ parsing

_SCALARS = {"void", "char", "int", "unsigned", "float", "double", "size_t", "ptrdiff_t",
            "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t",
            "uint64_t"}


def _strip_comments(text: str) -> str:
    """Removes /* */ and // comments, keeping newlines so that line numbers stay right."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise HeaderError("unterminated /* comment")
            out.append(re.sub(r"[^\n]", " ", text[i:j + 2]))
            i = j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _join_continuations(text: str) -> str:
    """Joins backslash-continued lines, padding with newlines to keep line numbers."""
    lines, out, pending, extra = text.split("\n"), [], "", 0
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            extra += 1
            continue
        out.append(pending + line)
        out.extend([""] * extra)
        pending, extra = "", 0
    if pending:
        out.append(pending)
    return "\n".join(out)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _parse_params(name: str, raw: str, known: set[str]) -> list[Param]:
    """The parameter list of a prototype or a function-pointer typedef."""
    params = []
    raw = " ".join(raw.split())
    if raw not in ("", "void"):
        for i, decl in enumerate(_split_top(raw)):
            if "(" in decl or decl == "...":
                raise HeaderError(f"{name}: unsupported parameter {decl!r}")
            ctype, pname = parse_decl(decl, known)
            params.append(Param(pname or f"arg{i + 1}", ctype))
    return params


def parse_decl(decl: str, known_types: set[str]) -> tuple[CType, str | None]:
    """'const fce_options* options' -> (CType('fce_options', 1, True), 'options')."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|\S", decl)
    bad = [t for t in tokens if not (t == "*" or re.fullmatch(r"[A-Za-z_]\w*", t))]
    if bad:
        raise HeaderError(f"cannot parse declaration {decl!r} (unexpected {bad[0]!r})")
    pointers = tokens.count("*")
    # const after the last '*' qualifies the pointer itself: irrelevant to the ABI
    last_star = max((i for i, t in enumerate(tokens) if t == "*"), default=-1)
    tail = tokens[last_star + 1:]
    head = tokens[:last_star] if last_star >= 0 else []
    const = "const" in (head if pointers else tail)
    words = [t for t in tokens if t not in ("*", "const")]
    if words and words[0] in ("struct", "enum"):
        words = words[1:]
    name = None
    # the last identifier is the name unless the declaration is just a type ('void', 'int')
    if len(words) >= 2 or (len(words) == 1 and words[0] not in _SCALARS | known_types):
        name = words[-1]
        words = words[:-1]
        if tokens[-1] == "*":
            raise HeaderError(f"cannot parse declaration {decl!r}")
    base = " ".join(words)
    base = {"unsigned int": "unsigned", "signed int": "int", "signed": "int"}.get(base, base)
    if base not in _SCALARS and base not in known_types:
        raise HeaderError(f"unknown type {base!r} in {decl!r}")
    return CType(base, pointers, const), name


def _eval_int(expr: str, names: dict[str, int]) -> tuple[int, bool]:
    """Evaluates a C integer constant expression: (value, has an unsigned suffix)."""
    unsigned = bool(re.search(r"\b(?:0[xX][0-9a-fA-F]+|\d+)[uU]", expr))
    py = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)
    py = re.sub(r"(?<![/])/(?![/])", "//", py)
    for name in sorted(set(re.findall(r"[A-Za-z_]\w*", py)), key=len, reverse=True):
        if name not in names:
            raise HeaderError(f"unknown name {name!r} in constant expression {expr!r}")
        py = re.sub(rf"\b{name}\b", str(names[name]), py)
    tree = ast.parse(py.strip(), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
               ast.FloorDiv, ast.Mod, ast.LShift, ast.RShift, ast.BitOr, ast.BitAnd, ast.BitXor,
               ast.USub, ast.UAdd, ast.Invert)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or (isinstance(node, ast.Constant)
                                             and not isinstance(node.value, int)):
            raise HeaderError(f"not an integer constant expression: {expr!r}")
    return int(eval(compile(tree, "<c-expr>", "eval"), {"__builtins__": {}})), unsigned


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_header(text: str) -> Header:
    hdr = Header()
    code = _join_continuations(_strip_comments(text))
    constants: dict[str, int] = {}

    # typedef'd enums and structs first: they name the types the prototypes use
    known: set[str] = set()
    for m in re.finditer(r"typedef\s+enum\s*(\w*)\s*\{(.*?)\}\s*(\w+)\s*;", code, re.S):
        values, nxt = [], 0
        for item in _split_top(m.group(2)):
            if not item:
                continue
            em = re.fullmatch(r"([A-Za-z_]\w*)\s*(?:=\s*(.+))?", item, re.S)
            if not em:
                raise HeaderError(f"cannot parse enum item {item!r}")
            val = _eval_int(em.group(2), constants)[0] if em.group(2) else nxt
            values.append((em.group(1), val))
            constants[em.group(1)] = val
            nxt = val + 1
        hdr.enums.append(Enum(m.group(3), values))
        known.add(m.group(3))

    nopp = re.sub(r"^[ \t]*#.*$", lambda mm: " " * len(mm.group(0)), code, flags=re.M)
    # function-pointer typedefs (callbacks), before the structs that may hold one:
    # typedef <return type> (*<name>)(<parameters>);
    for m in re.finditer(r"\btypedef\s+([^;{}()]*?)\s*\(\s*\*\s*(\w+)\s*\)\s*"
                         r"\(([^;{}]*?)\)\s*;", nopp, re.S):
        ret, rname = parse_decl(" ".join(m.group(1).split()), known)
        if rname is not None:
            raise HeaderError(f"cannot parse the return type of {m.group(0)!r}")
        name = m.group(2)
        params = _parse_params(name, m.group(3), known)
        hdr.callbacks.append(Function(name, ret, params, _line_of(nopp, m.start())))
        known.add(name)
    for m in re.finditer(r"typedef\s+struct\s*(\w*)\s*\{(.*?)\}\s*(\w+)\s*;", code, re.S):
        known.add(m.group(3))
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            if re.search(r"[\[\]:(]", decl):
                raise HeaderError(f"unsupported struct member {decl!r} (array, bit-field or "
                                  "function pointer)")
            ctype, name = parse_decl(decl, known)
            if name is None:
                raise HeaderError(f"struct member without a name: {decl!r}")
            fields.append(Param(name, ctype))
        hdr.structs.append(Struct(m.group(3), fields))

    # object-like #defines named FCE_*: integer constants and brace initialisers
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(FCE_\w+)(\()?[ \t]*(.*)$", code, re.M):
        name, fnlike, body = m.group(1), m.group(2), " ".join(m.group(3).split())
        if fnlike or not body:
            continue
        if body.startswith("{") and body.endswith("}"):
            hdr.defines.append(Define(name, body, init=_split_top(body[1:-1])))
            continue
        try:
            value, unsigned = _eval_int(body, constants)
        except (HeaderError, SyntaxError):
            continue  # FCE_API and the like: not constants
        constants[name] = value
        hdr.defines.append(Define(name, body, value, unsigned))

    # prototypes: FCE_API <return type> <name>(<parameters>);
    for m in re.finditer(r"\bFCE_API\s+([^;{}()]*?)\s*\(([^;{}]*?)\)\s*;", nopp, re.S):
        ret, name = parse_decl(" ".join(m.group(1).split()), known)
        if name is None:
            raise HeaderError(f"cannot find the function name in {m.group(0)!r}")
        params = _parse_params(name, m.group(2), known)
        hdr.functions.append(Function(name, ret, params, _line_of(nopp, m.start())))
    if not hdr.functions:
        raise HeaderError("no FCE_API functions found")
    return hdr


# ------------------------------------------------------------------------------ C -> Julia

_JULIA_SCALAR = {
    "void": "Cvoid", "char": "Cchar", "int": "Cint", "unsigned": "Cuint", "float": "Cfloat",
    "double": "Cdouble", "size_t": "Csize_t", "ptrdiff_t": "Cptrdiff_t", "int8_t": "Int8",
    "uint8_t": "UInt8", "int16_t": "Int16", "uint16_t": "UInt16", "int32_t": "Int32",
    "uint32_t": "UInt32", "int64_t": "Int64", "uint64_t": "UInt64",
}
# pointers to these are host-side out-parameters (workspace sizes): Ref{T} in the wrappers
HOST_OUT_POINTEES = {"size_t"}


def julia_struct_name(c_name: str) -> str:
    """fce_options -> FceOptions."""
    return "".join(part.capitalize() for part in c_name.split("_"))


def julia_type(ct: CType, hdr: Header, role: str) -> str:
    """The Julia type the generated code uses for a C type; role: 'ret', 'param' or 'field'."""
    if ct.pointers == 0:
        if hdr.enum_of(ct.base):
            return "Cint"
        if hdr.struct_of(ct.base):
            return julia_struct_name(ct.base)
        if hdr.callback_of(ct.base):
            return "Ptr{Cvoid}"  # a C function pointer: @cfunction's result
        return _JULIA_SCALAR[ct.base]
    if ct.pointers == 1 and ct.base == "char" and role != "field":
        return "Cstring"
    inner = julia_type(CType(ct.base, ct.pointers - 1), hdr, "field")
    if ct.pointers == 1 and role == "param" and (hdr.struct_of(ct.base)
                                                 or ct.base in HOST_OUT_POINTEES):
        return f"Ref{{{inner}}}"
    return f"Ptr{{{inner}}}"


_JULIA_KEYWORDS = {
    "abstract", "baremodule", "begin", "break", "catch", "const", "continue", "do", "else",
    "elseif", "end", "export", "false", "finally", "for", "function", "global", "if", "import",
    "in", "isa", "let", "local", "macro", "module", "mutable", "primitive", "quote", "return",
    "struct", "true", "try", "type", "using", "where", "while", "public", "outer",
}


def julia_ident(name: str) -> str:
    return name + "_" if name in _JULIA_KEYWORDS else name


def c_layout(st: Struct, hdr: Header) -> tuple[list[int], int]:
    """Field offsets and size of a struct under the LP64 ABI (x86-64, aarch64)."""
    sizes = {"char": 1, "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int": 4,
             "unsigned": 4, "float": 4, "int32_t": 4, "uint32_t": 4, "double": 8, "size_t": 8,
             "ptrdiff_t": 8, "int64_t": 8, "uint64_t": 8}
    offsets, off, align_max = [], 0, 1
    for f in st.fields:
        if f.ctype.pointers or hdr.callback_of(f.ctype.base):
            size = 8
        elif hdr.enum_of(f.ctype.base):
            size = 4
        elif f.ctype.base in sizes:
            size = sizes[f.ctype.base]
        else:
            raise HeaderError(f"{st.name}.{f.name}: no layout rule for {f.ctype}")
        off = (off + size - 1) // size * size
        offsets.append(off)
        off += size
        align_max = max(align_max, size)
    return offsets, (off + align_max - 1) // align_max * align_max


def julia_initializer_item(item: str, hdr: Header) -> str:
    """One item of a C brace initialiser as a Julia expression."""
    item = item.strip()
    m = re.fullmatch(r"sizeof\s*\(\s*(\w+)\s*\)", item)
    if m and hdr.struct_of(m.group(1)):
        return f"sizeof({julia_struct_name(m.group(1))})"
    if item == "NULL":
        return "C_NULL"
    if re.fullmatch(r"[A-Za-z_]\w*", item) and item in hdr.constants():
        return item
    m = re.fullmatch(r"([-+]?\d*\.\d*(?:[eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+)[fF]", item)
    if m:
        mant = m.group(1)
        mant = mant + "0" if mant.endswith(".") else mant
        mant = "0" + mant if mant.startswith(".") else mant
        if re.search(r"[eE]", mant):
            return re.sub(r"[eE]", "f", mant)
        return mant + "f0"
    if re.fullmatch(r"[-+]?\d+", item):
        return item
    raise HeaderError(f"cannot translate initialiser item {item!r}")


# ------------------------------------------------------------------------------ rendering


def _pack(items: list[str], first: str, cont: str, close: str, width: int = 100) -> list[str]:
    """items joined by ', ' after the prefix first, wrapped at width onto lines starting with
    cont, ended by close: the layout of every generated call and tuple."""
    lines, cur = [], first
    for i, it in enumerate(items):
        piece = it + (close if i == len(items) - 1 else ",")
        if cur not in (first, cont) and len(cur) + 1 + len(piece) > width:
            lines.append(cur)
            cur = cont
        cur += ("" if cur in (first, cont) else " ") + piece
    if not items:
        cur += close
    lines.append(cur)
    return lines


def render(header_text: str, header_name: str = "include/fusedce.h") -> str:
    hdr = parse_header(header_text)
    out: list[str] = []
    w = out.append
    w(f"# libfusedce.jl: the low-level binding of {header_name}, one Julia function per C function.")
    w("#")
    w(f"# GENERATED by bindings/julia/gen/generate.py from {header_name}: do not edit by hand.")
    w("# Regenerate with `python3 bindings/julia/gen/generate.py`; `bindings/julia/gen/check.py`")
    w("# (run by `make test`) fails when this file is stale or a ccall disagrees with the header.")
    w("#")
    w("# Conventions, as in CUDA.jl's generated wrappers (lib/cublas/src/libcublasLt.jl):")
    w("#   - C enums are Cint: the typedef names are aliases of Cint, the enumerators Cint values.")
    w("#   - Buffers are Ptr{T}: host addresses for the CPU backend; for the CUDA backend the")
    w("#     FusedCECUDAExt extension turns a CuArray into its address through CUDA.jl's")
    w("#     Base.unsafe_convert(CuPtr{T}, x), so the same wrappers serve both backends.")
    w("#   - A function returning fce_status passes the status to check_status (FusedCE.jl), which")
    w("#     throws FusedCEError(status, fce_last_error()) unless it is FCE_SUCCESS; such a")
    w("#     function returns nothing. The others return what the C function returns.")
    w("#   - A C function-pointer typedef (a callback) is an alias of Ptr{Cvoid}: pass what")
    w("#     @cfunction makes for the C prototype shown above the alias.")
    w("#   - The library is found at run time (libfusedce_symbol, FusedCE.jl):")
    w("#     ENV[\"FUSEDCE_LIBRARY\"], else \"libfusedce\" on the library search path.")
    w("")

    int_defines = [d for d in hdr.defines if d.value is not None]
    if int_defines:
        w("# ---------------------------------------------------------------- #define constants")
        for d in int_defines:
            val = f"Cuint({d.value})" if d.unsigned else str(d.value)
            line = f"const {d.name} = {val}"
            if d.text != str(d.value):
                if len(line) + len(d.text) + 4 > 100:
                    w(f"# {d.name} = {d.text}")
                else:
                    line += f"  # {d.text}"
            w(line)
        w("")

    for e in hdr.enums:
        w(f"# ---------------------------------------------------------------- enum {e.name}")
        w(f"const {e.name} = Cint")
        for n, v in e.values:
            w(f"const {n} = {e.name}({v})")
        w("")

    for st in hdr.structs:
        jname = julia_struct_name(st.name)
        offsets, size = c_layout(st, hdr)
        w(f"# ---------------------------------------------------------------- struct {st.name}")
        w(f"# Field for field the C struct (same names, order and types): pass it as Ref{{{jname}}}.")
        w(f"struct {jname}")
        width = max(len(f"{julia_ident(f.name)}::{julia_type(f.ctype, hdr, 'field')}")
                    for f in st.fields)
        for f, off in zip(st.fields, offsets):
            decl = f"{julia_ident(f.name)}::{julia_type(f.ctype, hdr, 'field')}"
            w(f"    {decl.ljust(width)}  # {f.ctype} {f.name} (offset {off})")
        w("end")
        w(f"const {st.name} = {jname}")
        w("")
        w(f"# The C layout under the LP64 ABI (x86-64, aarch64): {size} bytes.")
        w("@assert Sys.WORD_SIZE == 64 \"fusedce's Julia binding needs a 64-bit platform\"")
        w(f"@assert sizeof({jname}) == {size} \"{jname} does not have the size of C's {st.name}\"")
        w(f"@assert Int[fieldoffset({jname}, i) for i in 1:fieldcount({jname})] ==")
        out.extend(_pack([str(o) for o in offsets], "        [", "         ", "]"))
        w("")

    for d in hdr.defines:
        if d.init is None:
            continue
        st = next((s for s in hdr.structs if len(s.fields) == len(d.init)), None)
        if st is None:
            raise HeaderError(f"{d.name}: no struct with {len(d.init)} fields to initialise")
        jname = julia_struct_name(st.name)
        items = [julia_initializer_item(it, hdr) for it in d.init]
        w(f"# {d.name}: the C initialiser, item for item.")
        head = f"const {d.name} = {jname}("
        out.extend(_pack(items, head, " " * len(head), ")"))
        w("")

    for cb in hdr.callbacks:
        w(f"# ---------------------------------------------------------------- callback {cb.name}")
        decls = [f"{p.ctype} {p.name}" for p in cb.params] or ["void"]
        out.extend(_pack(decls, f"# typedef {cb.ret} (*{cb.name})(", "#     ", ");"))
        types = [julia_type(p.ctype, hdr, "param") for p in cb.params]
        ret = julia_type(cb.ret, hdr, "ret")
        tail = "," if len(types) == 1 else ""
        out.extend(_pack(types, f"# A C function pointer: @cfunction(f, {ret}, (", "#     ",
                         tail + "))"))
        w(f"const {cb.name} = Ptr{{Cvoid}}")
        w("")

    w("# ---------------------------------------------------------------- functions")
    out.extend(_pack([f":{f.name}" for f in hdr.functions], "const FCE_FUNCTIONS = (",
                     " " * len("const FCE_FUNCTIONS = ("), ",)" if len(hdr.functions) == 1 else ")"))
    w("")
    for fn in hdr.functions:
        args = [julia_ident(p.name) for p in fn.params]
        types = [julia_type(p.ctype, hdr, "param") for p in fn.params]
        ret = julia_type(fn.ret, hdr, "ret")
        checked = fn.ret.pointers == 0 and fn.ret.base == "fce_status"
        decls = [f"{p.ctype} {p.name}" for p in fn.params] or ["void"]
        out.extend(_pack(decls, f"# {fn.ret} {fn.name}(", "#     ", ")"))
        out.extend(_pack(args, f"function {fn.name}(", " " * len(f"function {fn.name}("), ")"))
        head = "    status = ccall(" if checked else "    return ccall("
        pad = " " * len(head)
        if not types:
            w(f"{head}libfusedce_symbol(:{fn.name}), {ret}, ())")
        else:
            w(f"{head}libfusedce_symbol(:{fn.name}), {ret},")
            tail = "," if len(types) == 1 else ""
            out.extend(_pack(types, pad + "(", pad + " ", tail + "),"))
            out.extend(_pack(args, pad, pad, ")"))
        if checked:
            w("    return check_status(status)")
        w("end")
        w("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--header", type=Path, default=HEADER)
    ap.add_argument("--output", type=Path, default=OUTPUT)
    ap.add_argument("--stdout", action="store_true", help="print instead of writing")
    a = ap.parse_args(argv)
    text = render(a.header.read_text())
    if a.stdout:
        sys.stdout.write(text)
    else:
        a.output.write_text(text)
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
