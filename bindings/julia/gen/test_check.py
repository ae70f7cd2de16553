"""Self-test of check.py: the checker passes the real package and fails on real mistakes.

    python3 -m pytest -q bindings/julia/gen/test_check.py

Each failure case copies the package to a temporary directory, plants one mistake (a ccall with
the wrong arity or a wrong type, a struct field out of order, a stale generated file, a header
function nobody wraps, ...) and asserts that check.py reports that mistake and exits 1. Two more
tests hold the header parser (shared by the generator and the checker) to a C compiler: clang's
AST for the prototypes and the struct, and a compiled program for the layout and the values.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GEN = Path(__file__).resolve().parent
sys.path.insert(0, str(GEN))
import check  # noqa: E402
import generate as gen  # noqa: E402

PACKAGE = gen.PACKAGE
HEADER = gen.HEADER


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    dst = tmp_path / "FusedCE.jl"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("Manifest.toml", "*.cov"))
    return dst


def problems(package: Path, header: Path = HEADER) -> list[str]:
    return check.check(package, header)[0]


def plant(package: Path, rel: str, code: str) -> None:
    path = package / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))


def edit(package: Path, rel: str, old: str, new: str) -> None:
    path = package / rel
    text = path.read_text()
    assert old in text, f"{old!r} not in {rel}"
    path.write_text(text.replace(old, new, 1))


def only(found: list[str], *needles: str) -> list[str]:
    """The problems that mention every needle."""
    return [p for p in found if all(n in p for n in needles)]


# ------------------------------------------------------------------------------ passing


def test_real_package_passes():
    found, summary = check.check(PACKAGE, HEADER)
    assert found == [], "\n".join(found)
    assert "header functions" in summary and "current" in summary


def test_every_header_function_is_wrapped_once_in_the_generated_file():
    hdr = gen.parse_header(HEADER.read_text())
    src = check.Source(PACKAGE / "src/libfusedce.jl", "", "")
    src.text = (PACKAGE / "src/libfusedce.jl").read_text()
    src.masked = check.mask(src.text)
    names = [c.name for c in check.find_ccalls(src)]
    assert sorted(names) == sorted(f.name for f in hdr.functions)


def test_generated_file_is_current_and_generation_deterministic():
    text = HEADER.read_text()
    assert gen.render(text) == gen.render(text)
    assert gen.render(text) == (PACKAGE / "src/libfusedce.jl").read_text()


def test_cli_exit_status(pkg: Path):
    cmd = [sys.executable, str(GEN / "check.py"), "--package", str(pkg), "--header", str(HEADER)]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout
    plant(pkg, "src/bad.jl", """
        f(o, n) = ccall(libfusedce_symbol(:fce_forward_workspace_size), Cint,
                        (Ref{FceOptions}, Int64, Ptr{Csize_t}), o, n, C_NULL)
    """)
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "FAILED" in bad.stdout and "arity" in bad.stdout


def test_accepted_spellings_pass(pkg: Path):
    # CuPtr for device buffers, aliases (fce_options, fce_status), Int32 for Cint, @ccall forms
    plant(pkg, "ext/spellings.jl", """
        const CuPtr = Ptr   # stands in for CUDA.jl's type in this self-test only
        g(o, rows, vocab, z, y, out, grads, ws, nws, s) =
            ccall(libfusedce_symbol(:fce_forward), fce_status,
                  (Ref{fce_options}, Int64, Int64, CuPtr{Cvoid}, PtrOrCuPtr{Cvoid},
                   Ref{fce_outputs}, Ref{FceGradients}, CuPtr{Cvoid}, Csize_t, CUstream),
                  o, rows, vocab, z, y, out, grads, ws, nws, s)
        st(o, sh, rows, z, y, stats, s) =
            ccall(libfusedce_symbol(:fce_vp_stats), Cint,
                  (Ref{FceOptions}, Ref{FceVpShard}, Int64, CuPtr{Cvoid}, CuPtr{Cvoid},
                   CuPtr{Float32}, CUstream), o, sh, rows, z, y, stats, s)
        h() = @ccall libfusedce.fce_cuda_available()::Int32
        k(s) = @ccall $(libfusedce_symbol(:fce_status_string))(s::Cint)::Ptr{UInt8}
        m(o) = ccall((:fce_options_default, "libfusedce"), Cvoid, (Ptr{FceOptions},), o)
    """)
    found = problems(pkg)
    assert found == [], "\n".join(found)


def test_comments_and_strings_are_not_code(pkg: Path):
    plant(pkg, "src/notes.jl", '''
        # ccall(libfusedce_symbol(:fce_forward), Cint, (Cint,), x)
        #= a block comment
           ccall(libfusedce_symbol(:fce_backward), Cint, (), )
        =#
        const NOTE = "ccall(libfusedce_symbol(:fce_version), Cint, (Cint, Cint), 1, 2)"
        const DOC = """
            @ccall libfusedce.fce_version(x::Cint)::Cdouble
        """
        t(x) = x'  # an adjoint, not a char literal: the next line is still code
        ok() = ccall(libfusedce_symbol(:fce_version), Cuint, ())
    ''')
    found = problems(pkg)
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------------------ failing


def test_wrong_arity_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f(o, n) = ccall(libfusedce_symbol(:fce_forward_workspace_size), Cint,
                        (Ref{FceOptions}, Int64, Ref{Csize_t}), o, n, Ref{Csize_t}(0))
    """)
    found = problems(pkg)
    assert only(found, "src/bad.jl:2", "fce_forward_workspace_size", "arity",
                "3 argument types", "4 parameters"), found


def test_values_not_matching_types_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f(o) = ccall(libfusedce_symbol(:fce_forward_workspace_size), Cint,
                     (Ref{FceOptions}, Int64, Int64, Ref{Csize_t}), o, 1, 2)
    """)
    assert only(problems(pkg), "fce_forward_workspace_size", "3 argument values for 4")


def test_wrong_scalar_type_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f(o, n) = ccall(libfusedce_symbol(:fce_forward_workspace_size), Cint,
                        (Ref{FceOptions}, Int32, Int64, Ref{Csize_t}), o, n, n, Ref{Csize_t}(0))
    """)
    assert only(problems(pkg), "argument 2 (int64_t rows) is typed Int32", "expected Int64")


@pytest.mark.parametrize("function,position,wrong,needle", [
    ("fce_forward", 4, "Ptr{Cfloat}", "argument 4 (const void* logits)"),  # void* as float*
    ("fce_vp_stats", 6, "Ptr{Cdouble}", "argument 6 (float* stats)"),     # float* as double*
    ("fce_forward", 9, "Cint", "argument 9 (size_t workspace_bytes)"),    # size_t as int
    ("fce_forward", 1, "FceOptions", "argument 1 (const fce_options* options)"),  # by value
    ("fce_forward", 6, "FceOutputs", "argument 6 (const fce_outputs* outputs)"),  # by value
    ("fce_forward", 7, "Ptr{Cfloat}", "argument 7 (const fce_gradients* gradients)"),  # a float*
    ("fce_vp_stats", 6, "Ref{Cfloat}", "argument 6 (float* stats)"),      # Ref for a device buffer
])
def test_wrong_pointer_and_struct_types_fail(pkg: Path, function, position, wrong, needle):
    types = {
        "fce_forward": ["Ref{FceOptions}", "Int64", "Int64", "Ptr{Cvoid}", "Ptr{Cvoid}",
                        "Ref{FceOutputs}", "Ref{FceGradients}", "Ptr{Cvoid}", "Csize_t",
                        "Ptr{Cvoid}"],
        "fce_vp_stats": ["Ref{FceOptions}", "Ref{FceVpShard}", "Int64", "Ptr{Cvoid}",
                         "Ptr{Cvoid}", "Ptr{Cfloat}", "Ptr{Cvoid}"],
    }[function]
    types[position - 1] = wrong
    args = ", ".join(f"a{i}" for i in range(len(types)))
    plant(pkg, "src/bad.jl", f"""
        f({args}) = ccall(libfusedce_symbol(:{function}), Cint,
                     ({", ".join(types)}), {args})
    """)
    found = problems(pkg)
    assert only(found, "src/bad.jl", needle, f"typed {wrong}"), found


def test_callback_parameter_must_be_ptr_cvoid(pkg: Path, tmp_path: Path):
    # No 1.0 function takes a callback by value (fce_vp_linear_ce's all-gather travels in
    # fce_vp_shard): a header with one more declaration that does, for the parameter rule.
    text = HEADER.read_text() + (
        "\nFCE_API fce_status fce_with_callback(fce_vp_all_gather_fn all_gather, void* context);\n")
    header = tmp_path / "fusedce.h"
    header.write_text(text)
    hdr = gen.parse_header(text)
    fn = next(f for f in hdr.functions
              if any(hdr.callback_of(p.ctype.base) and not p.ctype.pointers for p in f.params))
    i = next(i for i, p in enumerate(fn.params) if hdr.callback_of(p.ctype.base))
    types = [gen.julia_type(p.ctype, hdr, "param") for p in fn.params]
    assert types[i] == "Ptr{Cvoid}"
    types[i] = "Ptr{Cfloat}"
    args = ", ".join(f"a{k}" for k in range(len(types)))
    plant(pkg, "src/bad.jl", f"""
        f({args}) = ccall(libfusedce_symbol(:{fn.name}), Cint,
                     ({", ".join(types)}), {args})
    """)
    p = fn.params[i]
    found = problems(pkg, header)
    needle = f"argument {i + 1} ({p.ctype} {p.name}) is typed Ptr{{Cfloat}}"
    assert only(found, "src/bad.jl", needle, "expected Ptr{Cvoid}"), found


def test_wrong_return_type_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        v() = ccall(libfusedce_symbol(:fce_version), Cint, ())
        s(x) = ccall(libfusedce_symbol(:fce_status_string), Ptr{Cvoid}, (Cint,), x)
    """)
    found = problems(pkg)
    assert only(found, "fce_version", "return type Cint", "expected Cuint"), found
    assert only(found, "fce_status_string", "return type Ptr{Cvoid}"), found


def test_unknown_function_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f() = ccall(libfusedce_symbol(:fce_fowrard), Cint, ())
    """)
    assert only(problems(pkg), "fce_fowrard", "does not declare")


def test_macro_ccall_is_checked(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f(o, n) = @ccall libfusedce.fce_forward_workspace_size(o::Ref{FceOptions}, n::Int64,
                                                               n::Cfloat, C_NULL::Ptr{Csize_t})::Cint
    """)
    assert only(problems(pkg), "@ccall to fce_forward_workspace_size",
                "argument 3 (int64_t vocab) is typed Cfloat")


def test_ext_is_checked(pkg: Path):
    plant(pkg, "ext/Bad.jl", """
        module Bad
        f(x) = ccall(FusedCE.libfusedce_symbol(:fce_status_string), Cstring, (Int64,), x)
        end
    """)
    assert only(problems(pkg), "ext/Bad.jl:3", "argument 1 (fce_status status)", "expected Cint")


def test_unreadable_callee_fails(pkg: Path):
    plant(pkg, "src/bad.jl", """
        f(p) = ccall(p, Cint, ())
    """)
    assert only(problems(pkg), "src/bad.jl:2", "cannot tell which C function")


def test_missing_wrapper_fails(pkg: Path, tmp_path: Path):
    header = tmp_path / "fusedce.h"
    text = HEADER.read_text()
    text = text.replace("FCE_API int fce_cuda_available(void);",
                        "FCE_API int fce_cuda_available(void);\n"
                        "FCE_API fce_status fce_new_function(int64_t rows);")
    header.write_text(text)
    found = problems(pkg, header)
    assert only(found, "fce_new_function has no wrapper"), found
    assert only(found, "out of date"), found  # and the generated file no longer matches


def test_struct_field_order_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl",
         "    row_stride::Int64           # int64_t row_stride (offset 24)\n"
         "    grad_row_stride::Int64      # int64_t grad_row_stride (offset 32)\n",
         "    grad_row_stride::Int64      # int64_t grad_row_stride (offset 32)\n"
         "    row_stride::Int64           # int64_t row_stride (offset 24)\n")
    found = problems(pkg)
    assert only(found, "struct FceOptions fields", "names and order"), found


def test_struct_field_type_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "    label_smoothing::Cfloat ", "    label_smoothing::Cdouble")
    found = problems(pkg)
    assert only(found, "field label_smoothing is Cdouble", "expected Cfloat"), found


def test_struct_missing_field_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl",
         "    vp_entropy::Int32           # int32_t vp_entropy (offset 100)\n", "")
    found = problems(pkg)
    assert only(found, "struct FceOptions fields"), found


def test_stale_generated_file_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "# ---------------------------------------------------------------- functions",
         "# ---------------------------------------------------------------- functions (edited)")
    found = problems(pkg)
    assert only(found, "src/libfusedce.jl is out of date", "generate.py"), found


def test_wrong_enum_value_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "const FCE_ERROR_CUDA = fce_status(7)",
         "const FCE_ERROR_CUDA = fce_status(70)")
    assert only(problems(pkg), "FCE_ERROR_CUDA", "the header says 7")


def test_enum_not_cint_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "const FCE_ERROR_CUDA = fce_status(7)",
         "const FCE_ERROR_CUDA = 7")
    assert only(problems(pkg), "FCE_ERROR_CUDA must be a Cint")


def test_wrong_define_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "const FCE_FLAG_TARGET_OUT_OF_RANGE = Cuint(1)",
         "const FCE_FLAG_TARGET_OUT_OF_RANGE = Cuint(2)")
    assert only(problems(pkg), "FCE_FLAG_TARGET_OUT_OF_RANGE", "the header says 1")


def test_wrong_initializer_fails(pkg: Path):
    edit(pkg, "src/libfusedce.jl", "FceOptions(sizeof(FceOptions), C_NULL, -100,",
         "FceOptions(sizeof(FceOptions), C_NULL, -1,")
    assert only(problems(pkg), "FCE_OPTIONS_INIT: field ignore_index is -1", "-100")


# ------------------------------------------------------------------------------ the parser vs C


def test_parser_matches_clang_ast():
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang not installed")
    out = subprocess.run([clang, "-x", "c", "-std=c99", "-fsyntax-only", "-Xclang",
                          "-ast-dump=json", str(HEADER)], capture_output=True, text=True, check=True)
    ast = json.loads(out.stdout)
    norm = lambda s: re.sub(r"\s+", "", s.replace("unsigned int", "unsigned"))  # noqa: E731
    funcs = {n["name"]: n for n in ast["inner"]
             if n.get("kind") == "FunctionDecl" and n["name"].startswith("fce_")}
    hdr = gen.parse_header(HEADER.read_text())
    assert sorted(funcs) == sorted(f.name for f in hdr.functions)
    for f in hdr.functions:
        node = funcs[f.name]
        assert norm(node["type"]["qualType"].split("(")[0]) == norm(str(f.ret)), f.name
        params = [p for p in node.get("inner", []) if p.get("kind") == "ParmVarDecl"]
        assert [p.get("name") for p in params] == [p.name for p in f.params], f.name
        assert [norm(p["type"]["qualType"]) for p in params] == \
            [norm(str(p.ctype)) for p in f.params], f.name
    records = {n.get("name"): n for n in ast["inner"]
               if n.get("kind") == "RecordDecl" and n.get("completeDefinition")}
    for st in hdr.structs:
        fields = [n for n in records[st.name]["inner"] if n.get("kind") == "FieldDecl"]
        assert [(n["name"], norm(n["type"]["qualType"])) for n in fields] == \
            [(p.name, norm(str(p.ctype))) for p in st.fields]
    enums = [c["name"] for n in ast["inner"] if n.get("kind") == "EnumDecl"
             for c in n.get("inner", []) if c.get("kind") == "EnumConstantDecl"]
    assert enums == [name for e in hdr.enums for name, _ in e.values]


def test_layout_values_and_prototypes_match_c_compiler(tmp_path: Path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    hdr = gen.parse_header(HEADER.read_text())

    # the prototypes as parsed: initialising pointers of these types with the real functions
    # does not compile (-Werror) if any return or parameter type differs
    def prototypes(functions) -> str:
        out = ['#include "fusedce.h"']
        # the callback typedefs as parsed: a function of the parsed type must initialise one
        for c in hdr.callbacks:
            params = ", ".join(f"{p.ctype} {p.name}" for p in c.params) or "void"
            out.append(f"static {c.ret} cb_{c.name}({params}) {{ return ({c.ret})0; }}")
            out.append(f"{c.name} const p_{c.name} = cb_{c.name};")
        for f in functions:
            params = ", ".join(str(p.ctype) for p in f.params) or "void"
            out.append(f"{f.ret} (*const p_{f.name})({params}) = {f.name};")
        return "\n".join(out) + "\n"

    def compiles(code: str) -> bool:
        src = tmp_path / "protos.c"
        src.write_text(code)
        return subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-fsyntax-only", "-I",
                               str(HEADER.parent), str(src)], capture_output=True).returncode == 0

    assert compiles(prototypes(hdr.functions))
    # and the probe does catch a wrong type
    wrong = [gen.Function(f.name, f.ret, [gen.Param(p.name, gen.CType("int32_t"))
                                          if p.ctype.base == "int64_t" else p for p in f.params],
                          f.line) for f in hdr.functions]
    assert not compiles(prototypes(wrong))

    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "fusedce.h"']
    lines.append("int main(void) {")
    for st in hdr.structs:
        lines.append(f'  printf("size {st.name} %zu\\n", sizeof({st.name}));')
        for p in st.fields:
            lines.append(f'  printf("offset {st.name}.{p.name} %zu\\n", '
                         f'offsetof({st.name}, {p.name}));')
    for name, value in hdr.constants().items():
        lines.append(f'  printf("value {name} %lld\\n", (long long)({name}));')
    for d in hdr.defines:
        if d.init is not None:
            st = next(s for s in hdr.structs if len(s.fields) == len(d.init))
            lines.append(f"  {{ {st.name} init = {d.name};")
            for p in st.fields:
                cast = "(double)(size_t)" if p.ctype.pointers else "(double)"
                lines.append(f'    printf("init {d.name}.{p.name} %.9g\\n", {cast}init.{p.name});')
            lines.append("  }")
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-I", str(HEADER.parent), str(src), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())
    for st in hdr.structs:
        offsets, size = gen.c_layout(st, hdr)
        assert int(got[f"size {st.name}"]) == size
        assert [int(got[f"offset {st.name}.{p.name}"]) for p in st.fields] == offsets
        gen_text = (PACKAGE / "src/libfusedce.jl").read_text()
        assert f"sizeof({gen.julia_struct_name(st.name)}) == {size}" in gen_text
    for name, value in hdr.constants().items():
        assert int(got[f"value {name}"]) == value, name
    for d in hdr.defines:
        if d.init is not None:
            st = next(s for s in hdr.structs if len(s.fields) == len(d.init))
            for p, item in zip(st.fields, d.init):
                expected = check._c_init_value(item, hdr)
                if expected == ("sizeof", gen.julia_struct_name(st.name)):
                    expected = gen.c_layout(st, hdr)[1]
                elif expected == ("null",):
                    expected = 0
                assert float(got[f"init {d.name}.{p.name}"]) == float(expected), p.name
