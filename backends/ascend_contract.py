"""Static contract check of the project's torch_npu calls against a torch_npu wheel, without
importing torch_npu (its import needs CANN's shared libraries).

`python -m dsv41.backends.ascend_contract WHEEL [SOURCE_DIR]` (the `torch_npu_contract` nox
session downloads the pinned wheel with `pip download --no-deps` and runs this). From the wheel
it reads:
- `torch_npu/include/torch_npu/csrc/aten/CustomFunctions.h`: every custom op's C++ signature
  (argument names, order, which have defaults); overloads are kept apart;
- `torch_npu/_op_plugin_docs.py` (parsed with `ast`, never executed): each op's documentation,
  its Python prototype (`*` marks keyword-only arguments) and, per argument, the dtypes it
  allows on Atlas A2 / A3 (lines naming only other products are ignored);
- `torch_npu/npu/__init__.py`: the names `torch.npu` / `torch_npu.npu` export (`__all__`).
From the project's sources (`ast` as well) it collects every call `torch_npu.X(...)`,
`torch.npu.X(...)` and `torch_npu.npu.X(...)` and every `TORCH_NPU_DTYPES` table (op -> argument
-> dtypes the project passes) and checks: the name exists; some overload takes the call's
positional count and keyword names, gets every argument without a default, and no keyword-only
argument is passed positionally; each called custom op has a dtype table whose dtypes the docs
allow. Calls of vllm-ascend's custom operators, `torch.ops._C_ascend.X(...)`, are checked the
same way (name, counts, keyword names, required and keyword-only arguments) against the
project's `VLLM_ASCEND_SCHEMAS` table (backends/ascend.py), which records their argument lists
from vllm-ascend's csrc/torch_binding.cpp at the pinned version's tag.
Problems are printed one a line with file:line; exit status 1 when there are any.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HEADER = "torch_npu/include/torch_npu/csrc/aten/CustomFunctions.h"
DOCS = "torch_npu/_op_plugin_docs.py"
NPU_MODULE = "torch_npu/npu/__init__.py"
DTYPE_TABLE = "TORCH_NPU_DTYPES"
SCHEMA_TABLE = "VLLM_ASCEND_SCHEMAS"  # vllm-ascend's torch.ops._C_ascend argument lists (backends/ascend.py)
VLLM_ASCEND_MODULE = "torch.ops._C_ascend"

# dtype words as the docs write them -> one canonical spelling
_DTYPE_RX = re.compile(r"(?<![A-Za-z0-9_])(u?int(?:4|8|16|32|64)|float(?:16|32|64)|bfloat16|double|bool|fp16|fp32|bf16|"
                       r"float8_e4m3fn|float8_e5m2|float8_e8m0fnu|hifloat8|float4_e2m1|float4_e1m2|quint4x2)(?![A-Za-z0-9_])",
                       re.IGNORECASE)
_DTYPE_ALIAS = {"fp16": "float16", "fp32": "float32", "bf16": "bfloat16", "double": "float64"}


@dataclass
class Param:
    name: str
    ctype: str
    has_default: bool


@dataclass
class DocEntry:
    prototype: list[str] | None = None  # argument names of the Python prototype, in order
    kwonly_from: int | None = None      # index of the first keyword-only argument in `prototype`
    dtypes: dict[str, set[str]] = field(default_factory=dict)  # argument -> dtypes (A2/A3)


@dataclass
class Call:
    where: str           # file:line
    module: str          # "torch_npu" or "torch.npu"
    name: str
    n_positional: int
    keywords: list[str]
    star_args: bool      # *args / **kwargs present: counts cannot be checked


# ---- the wheel --------------------------------------------------------------------------------

def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside <>, (), {}, [] and string literals."""
    out, depth, cur, quote = [], 0, [], None
    for ch in s:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


_DECL_RX = re.compile(r"^\s*TORCH_NPU_API\s+(.+?)\s+(\w+)\((.*)\);\s*$")


def parse_header(text: str) -> dict[str, list[list[Param]]]:
    """CustomFunctions.h -> op name -> overloads, each a list of parameters. The C++ `self`
    is the Python `input` (PyTorch's argument parser exposes it under that name)."""
    ops: dict[str, list[list[Param]]] = {}
    for line in text.splitlines():
        m = _DECL_RX.match(line)
        if not m:
            continue
        params = []
        for a in _split_top(m.group(3)):
            decl, _, default = a.partition("=")
            ctype, _, name = decl.strip().rpartition(" ")
            name = name.strip().lstrip("&*")
            params.append(Param("input" if name == "self" else name, ctype.strip(), bool(default.strip())))
        ops.setdefault(m.group(2), []).append(params)
    return ops


def _doc_strings(source: str) -> dict[str, str]:
    """The (name, docstring) pairs of `_add_torch_npu_docstr(name, doc)` calls."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_add_torch_npu_docstr"
                and len(node.args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)):
            found[node.args[0].value] = node.args[1].value
    return found


def _prototype(name: str, doc: str) -> tuple[list[str], int | None] | None:
    """Argument names (and where keyword-only ones start) of the doc's `[torch_npu.]name(...)` line."""
    m = re.search(r"(?:torch_npu\.)?\b" + re.escape(name) + r"\((.*?)\)\s*->", doc)
    if not m:
        return None
    names, kwonly = [], None
    for a in _split_top(m.group(1)):
        if a.strip() == "*":
            kwonly = len(names)
            continue
        decl = a.partition("=")[0].strip()
        if decl:
            names.append(decl.split()[-1])
    return names, kwonly


def _foreign_product_line(line: str) -> bool:
    """A line about a product other than Atlas A2 / A3 (e.g. 'Atlas 推理系列产品: ...')."""
    return "Atlas" in line and "A2" not in line and "A3" not in line


def _dtype_sections(doc: str, arg_names: list[str]) -> dict[str, set[str]]:
    """Per argument, the dtype words of its description (the lines from the one that starts with
    the argument's name to the next argument's), on Atlas A2 / A3."""
    start_rx = re.compile(r"^[\s\-*]*(" + "|".join(map(re.escape, sorted(arg_names, key=len, reverse=True)))
                          + r")\s*(?:[:：]|\(|（)")
    sections: dict[str, set[str]] = {}
    current = None
    for line in doc.splitlines():
        m = start_rx.match(line)
        if m:
            current = m.group(1)
            sections.setdefault(current, set())
        elif re.match(r"^\s*(输出说明|约束说明|调用示例|示例|支持的|Output|Constraints)", line):
            current = None
        if current is None or _foreign_product_line(line):
            continue
        for w in _DTYPE_RX.findall(line):
            w = w.lower()
            sections[current].add(_DTYPE_ALIAS.get(w, w))
    return sections


def parse_docs(source: str, header: dict[str, list[list[Param]]]) -> dict[str, DocEntry]:
    """_op_plugin_docs.py -> op name -> its prototype and per-argument dtypes."""
    out = {}
    for name, doc in _doc_strings(source).items():
        entry = DocEntry()
        proto = _prototype(name, doc)
        if proto:
            entry.prototype, entry.kwonly_from = proto
        names = set(entry.prototype or [])
        for overload in header.get(name, []):
            names.update(p.name for p in overload)
        names.update({"self", "input"})  # the docs write either
        entry.dtypes = _dtype_sections(doc, sorted(names))
        out[name] = entry
    return out


def npu_module_names(source: str) -> set[str]:
    """The names `torch_npu/npu/__init__.py` exports (its `__all__`)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


@dataclass
class Wheel:
    header: dict[str, list[list[Param]]]
    docs: dict[str, DocEntry]
    npu_names: set[str]


def read_wheel(path: str | Path) -> Wheel:
    """The three files of a torch_npu wheel (a .whl path, or an unpacked folder)."""
    p = Path(path)

    def read(member: str) -> str:
        if p.is_dir():
            return (p / member).read_text(encoding="utf-8")
        with zipfile.ZipFile(p) as z:
            return z.read(member).decode("utf-8")

    header = parse_header(read(HEADER))
    return Wheel(header, parse_docs(read(DOCS), header), npu_module_names(read(NPU_MODULE)))


# ---- the project ------------------------------------------------------------------------------

def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def parse_schema(args: str) -> tuple[list[Param], set[str]]:
    """A VLLM_ASCEND_SCHEMAS entry ("a, b=, *, c=") -> (parameters, keyword-only names)."""
    params, kwonly, star = [], set(), False
    for a in (x.strip() for x in args.split(",") if x.strip()):
        if a == "*":
            star = True
            continue
        name = a.rstrip("=")
        params.append(Param(name, "", a.endswith("=")))
        if star:
            kwonly.add(name)
    return params, kwonly


def project_schemas(files: list[Path]) -> dict[str, str]:
    """The project's VLLM_ASCEND_SCHEMAS table (read with ast, never imported)."""
    out = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == SCHEMA_TABLE for t in node.targets):
                out.update(ast.literal_eval(node.value))
    return out


def project_calls(files: list[Path], root: Path) -> tuple[list[Call], dict[str, dict[str, tuple[str, ...]]], dict[str, str]]:
    """(calls, merged dtype tables, where each table entry was declared) over `files`."""
    calls, tables, where = [], {}, {}
    for f in files:
        rel = f.relative_to(root) if f.is_relative_to(root) else f
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == DTYPE_TABLE for t in node.targets):
                for op, args in ast.literal_eval(node.value).items():
                    tables[op] = {a: tuple(d) for a, d in args.items()}
                    where[op] = f"{rel}:{node.lineno}"
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if not name:
                continue
            for prefix, module in (("torch_npu.npu.", "torch.npu"), ("torch.npu.", "torch.npu"), ("torch_npu.", "torch_npu"),
                                   (VLLM_ASCEND_MODULE + ".", VLLM_ASCEND_MODULE)):
                if name.startswith(prefix) and "." not in name[len(prefix):]:
                    star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
                    calls.append(Call(f"{rel}:{node.lineno}", module, name[len(prefix):], len(node.args),
                                      [k.arg for k in node.keywords if k.arg], star))
                    break
    return calls, tables, where


# ---- the checks -------------------------------------------------------------------------------

def _overload_problem(call: Call, params: list[Param], kwonly_names: set[str]) -> str | None:
    """Why this overload cannot take the call, or None."""
    names = [p.name for p in params]
    if call.n_positional > len(params):
        return f"{call.n_positional} positional arguments, the signature has {len(params)}"
    positional = names[:call.n_positional]
    bad_pos = [n for n in positional if n in kwonly_names]
    if bad_pos:
        return f"keyword-only argument(s) {bad_pos} passed positionally"
    unknown = [k for k in call.keywords if k not in names]
    if unknown:
        return f"unknown argument name(s) {unknown} (signature: {', '.join(names)})"
    twice = [k for k in call.keywords if k in positional]
    if twice:
        return f"argument(s) {twice} given both positionally and by name"
    if not call.star_args:
        missing = [p.name for p in params[call.n_positional:] if not p.has_default and p.name not in call.keywords]
        if missing:
            return f"required argument(s) {missing} not given"
    return None


def _doc_arg(entry: DocEntry, params: list[Param], arg: str) -> str:
    """The docs' name of header argument `arg` (the docs sometimes rename: r1 -> cos)."""
    if arg in entry.dtypes or not entry.prototype:
        return arg
    names = [p.name for p in params]
    i = names.index(arg) if arg in names else -1
    return entry.prototype[i] if 0 <= i < len(entry.prototype) else arg


def check(wheel: Wheel, calls: list[Call], tables: dict, table_where: dict[str, str],
          schemas: dict[str, str] | None = None) -> list[str]:
    """Every problem, one line each (empty: the project's calls fit the wheel, and its
    torch.ops._C_ascend calls the vllm-ascend argument lists in `schemas`)."""
    problems = []
    for c in calls:
        if c.module == VLLM_ASCEND_MODULE:
            if c.name not in (schemas or {}):
                problems.append(f"{c.where}: {VLLM_ASCEND_MODULE}.{c.name} has no {SCHEMA_TABLE} entry")
                continue
            params, kwonly = parse_schema(schemas[c.name])
            why = _overload_problem(c, params, kwonly)
            if why:
                problems.append(f"{c.where}: {VLLM_ASCEND_MODULE}.{c.name}: {why}")
            continue
        if c.module == "torch.npu":
            if c.name not in wheel.npu_names:
                problems.append(f"{c.where}: torch.npu.{c.name} is not exported by torch_npu.npu (__all__)")
            continue
        overloads = wheel.header.get(c.name)
        if overloads is None:
            if c.name not in wheel.docs:
                problems.append(f"{c.where}: torch_npu.{c.name} is neither a custom op (CustomFunctions.h) nor documented")
            continue
        entry = wheel.docs.get(c.name, DocEntry())
        kwonly = set(entry.prototype[entry.kwonly_from:]) if entry.prototype and entry.kwonly_from is not None else set()
        why = [_overload_problem(c, params, kwonly) for params in overloads]
        if all(why):
            problems.append(f"{c.where}: torch_npu.{c.name}: " + "; ".join(sorted(set(w for w in why if w))))
        if c.name not in tables:
            problems.append(f"{c.where}: torch_npu.{c.name} has no {DTYPE_TABLE} entry (the dtypes it is given)")
    for op, args in tables.items():
        at = table_where[op]
        overloads = wheel.header.get(op)
        if overloads is None:
            problems.append(f"{at}: {DTYPE_TABLE}[{op!r}]: no such custom op in the wheel")
            continue
        entry = wheel.docs.get(op)
        if entry is None:
            problems.append(f"{at}: {DTYPE_TABLE}[{op!r}]: the wheel has no documentation for {op}")
            continue
        all_names = {p.name for params in overloads for p in params}
        for arg, dtypes in args.items():
            if arg not in all_names:
                problems.append(f"{at}: {DTYPE_TABLE}[{op!r}]: {op} has no argument {arg!r}")
                continue
            params = next(ps for ps in overloads if arg in {p.name for p in ps})
            doc_arg = _doc_arg(entry, params, arg)
            allowed = entry.dtypes.get(doc_arg)
            if not allowed:
                problems.append(f"{at}: {DTYPE_TABLE}[{op!r}][{arg!r}]: the docs list no dtypes for {doc_arg!r}")
                continue
            bad = [d for d in dtypes if d not in allowed]
            if bad:
                problems.append(f"{at}: {DTYPE_TABLE}[{op!r}][{arg!r}]: {bad} not allowed on Atlas A2/A3 "
                                f"(docs: {', '.join(sorted(allowed))})")
    return problems


def source_files(root: Path) -> list[Path]:
    """The project's Python sources (tests, virtual environments and build outputs excluded)."""
    skip = {"tests", ".nox", "build", "dist", "__pycache__"}
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip or part.startswith(".") for part in p.relative_to(root).parts))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print("usage: python -m dsv41.backends.ascend_contract TORCH_NPU_WHEEL [SOURCE_DIR]", file=sys.stderr)
        return 2
    wheel = read_wheel(argv[0])
    root = Path(argv[1] if len(argv) > 1 else ".").resolve()
    files = source_files(root)
    calls, tables, where = project_calls(files, root)
    problems = check(wheel, calls, tables, where, project_schemas(files))
    for p in problems:
        print(p)
    n_ops = len({c.name for c in calls})
    n_vendor = sum(c.module == VLLM_ASCEND_MODULE for c in calls)
    print(f"torch_npu contract: {len(calls)} call(s) of {n_ops} name(s) ({n_vendor} to vllm-ascend's "
          f"{VLLM_ASCEND_MODULE}), {len(tables)} dtype table(s) checked against {Path(argv[0]).name}: "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
