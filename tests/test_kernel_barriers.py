"""A static check of the Triton kernels for one class of intra-program race that the
one-thread interpreters cannot show: global memory stored by the threads of a program and
loaded back by the same program with no `tl.debug_barrier()` between (on a GPU other threads
store and load it; without the CTA barrier a load can return the stale value).

Every `@triton.jit` function in npu_ops/triton/ is walked in program order, with the jit
helpers it calls inlined (their pointer parameters bound to the caller's), each loop body
walked twice (a store late in one iteration, a load early in the next) and `if` branches taken
as alternatives, except tests of compile-time flags (tl.constexpr parameters, literal
arguments, `not` / `and` / `or` of them): the walk is repeated for each combination of the
flags it meets, so that branches of one flag are never mixed. A pointer is named by its base,
the parameter it is derived from (`ptr + offs`, `.to(...)`, `tl.multiple_of`, local names
assigned from those), so rows of one buffer count as one (a persistent loop's row t and row
t + P are not told apart: a load of either after a store of either, with no barrier between,
is flagged). A flagged (function, base) pair can be allowed in ALLOWED with the reason it is
safe; none is needed today. Atomics are left out (read-modify-writes of one word: coherent by
themselves). Aliasing of different parameters (one tensor passed twice) is beyond it; the
launchers are reviewed for that by hand.
"""

from __future__ import annotations

import ast
import pathlib
import re

KERNEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "npu_ops" / "triton"

# (jit function, pointer base) -> why a store followed by a load of it is not a race.
ALLOWED: dict[tuple[str, str], str] = {}


def _is_jit(fn: ast.FunctionDef) -> bool:
    """Decorated with triton.jit or triton.jit(...)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _modules(overrides: dict[str, str] | None = None) -> dict[str, tuple[dict, dict]]:
    """module name -> (its jit functions by name, names imported from sibling modules ->
    (module, name)); `overrides` replaces a module's source text (for the self-test)."""
    out = {}
    for path in sorted(KERNEL_DIR.glob("*.py")):
        text = (overrides or {}).get(path.stem) or path.read_text()
        tree = ast.parse(text)
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        imports = {}
        for n in tree.body:
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module:
                for a in n.names:
                    imports[a.asname or a.name] = (n.module, a.name)
        out[path.stem] = (funcs, imports)
    return out


def _tl_call(node: ast.AST, *names: str) -> bool:
    """node is a call of tl.<one of names>."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl")


class _Undecided(Exception):
    """A test of a compile-time flag not fixed yet in this walk."""

    def __init__(self, flag: str):
        super().__init__(flag)
        self.flag = flag


_UNKNOWN = object()


class _Walker:
    """Walks one root jit function (helpers inlined) for one setting of its compile-time flags
    and collects flagged loads."""

    def __init__(self, modules: dict, module: str, root: str, flags: dict):
        self.modules = modules
        self.root = f"{module}.{root}"
        self.flags = flags  # compile-time flag -> value chosen for this walk
        self.found: set[tuple[str, str, int, int]] = set()  # (root, base, store line, load line)
        self.unseen: set[tuple[str, int]] = set()  # (function, line) of accesses the check cannot name
        self.stack: list[str] = []
        self.consts: list[dict] = []  # per frame: constexpr name -> ("lit", value) | ("flag", name)
        self.lines: list[int] = []  # call lines of the inlined frames (a load is reported at the root's)

    def test(self, node: ast.AST):
        """A branch test's value when it is made of compile-time flags and literals, else _UNKNOWN."""
        if isinstance(node, ast.Constant):
            return bool(node.value)
        if isinstance(node, ast.Name):
            kind, v = self.consts[-1].get(node.id, (None, None))
            if kind == "lit":
                return bool(v)
            if kind == "flag":
                if v not in self.flags:
                    raise _Undecided(v)
                return self.flags[v]
            return _UNKNOWN
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.test(node.operand)
            return v if v is _UNKNOWN else not v
        if isinstance(node, ast.BoolOp):
            vals = [self.test(v) for v in node.values]
            stop = isinstance(node.op, ast.Or)  # the value that decides: True for or, False for and
            if stop in vals:
                return stop
            return _UNKNOWN if _UNKNOWN in vals else not stop
        return _UNKNOWN

    def base(self, expr: ast.AST, env: dict) -> frozenset:
        """The pointer bases an expression is derived from."""
        if isinstance(expr, ast.Name):
            return env.get(expr.id, frozenset())
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub)):
            return self.base(expr.left, env)
        if isinstance(expr, ast.IfExp):
            return self.base(expr.body, env) | self.base(expr.orelse, env)
        if isinstance(expr, ast.Subscript):  # p[:, None]: a pointer tensor broadcast, same base
            return self.base(expr.value, env)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr == "to":
                return self.base(expr.func.value, env)
            if _tl_call(expr, "multiple_of", "max_contiguous") and expr.args:
                return self.base(expr.args[0], env)
        return frozenset()

    def resolve(self, module: str, name: str):
        """(module, FunctionDef) of a jit helper called by name from `module`, or None."""
        funcs, imports = self.modules[module]
        if name in funcs:
            return module, funcs[name]
        if name in imports:
            mod, real = imports[name]
            if mod in self.modules and real in self.modules[mod][0]:
                return mod, self.modules[mod][0][real]
        return None

    def calls_in(self, node: ast.AST) -> list[ast.Call]:
        """Calls inside an expression, innermost (evaluated) first."""
        found = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        return list(reversed(found))

    def expr(self, node: ast.AST, env: dict, module: str, pending: dict) -> dict:
        """Effects of evaluating an expression: loads checked, stores added, barriers clear,
        jit helpers inlined. Returns the pending stores (base -> store line) after it."""
        for call in self.calls_in(node):
            if _tl_call(call, "load", "store"):
                b = self.base(call.args[0], env) if call.args else frozenset()
                if not b or (call.func.attr == "store" and any(":" in x for x in b)):  # no base, or a local one
                    self.unseen.add((self.stack[-1], call.lineno))
            if _tl_call(call, "make_block_ptr", "make_tensor_descriptor"):
                self.unseen.add((self.stack[-1], call.lineno))
            if _tl_call(call, "debug_barrier"):
                pending = {}
            elif _tl_call(call, "load") and call.args:
                for b in self.base(call.args[0], env):
                    if b in pending and (self.root.split(".")[1], b) not in ALLOWED:
                        line = self.lines[0] if self.lines else call.lineno
                        self.found.add((self.root, b, pending[b], line))
            elif _tl_call(call, "store") and call.args:
                pending = dict(pending)
                for b in self.base(call.args[0], env):
                    pending[b] = call.lineno
            elif isinstance(call.func, ast.Name):
                found = self.resolve(module, call.func.id)
                if found and found[1].name not in self.stack:
                    pending = self.inline(found[0], found[1], call, env, pending)
        return pending

    def inline(self, module: str, fn: ast.FunctionDef, call: ast.Call, env: dict, pending: dict) -> dict:
        """A helper's effects, its parameters bound to the caller's pointer bases."""
        params = [a.arg for a in fn.args.args]
        inner = {p: frozenset() for p in params}
        consts = {}
        bound = list(zip(params, call.args)) + [(kw.arg, kw.value) for kw in call.keywords if kw.arg in inner]
        for p, a in bound:
            inner[p] = self.base(a, env)
            if isinstance(a, ast.Constant):
                consts[p] = ("lit", a.value)
            elif isinstance(a, ast.Name) and a.id in self.consts[-1]:
                consts[p] = self.consts[-1][a.id]
        self.stack.append(fn.name)
        self.consts.append(consts)
        self.lines.append(call.lineno)
        pending = self.body(fn.body, inner, module, pending)
        self.lines.pop()
        self.consts.pop()
        self.stack.pop()
        return pending

    def assign(self, targets: list, value: ast.AST, env: dict, prefix: str) -> None:
        """Bind assigned names to the value's pointer bases (a local base when it has none)."""
        for t in targets:
            names = [t] if isinstance(t, ast.Name) else [e for e in getattr(t, "elts", []) if isinstance(e, ast.Name)]
            for n in names:
                b = self.base(value, env) if isinstance(t, ast.Name) else frozenset()
                env[n.id] = b or frozenset({f"{prefix}:{n.id}"})

    def body(self, stmts: list, env: dict, module: str, pending: dict) -> dict:
        """Walk statements in order; returns the pending stores at the end (union over paths)."""
        prefix = ".".join(self.stack)
        for s in stmts:
            if isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                if s.value is not None:
                    pending = self.expr(s.value, env, module, pending)
                    if isinstance(s, ast.Assign):
                        self.assign(s.targets, s.value, env, prefix)
            elif isinstance(s, (ast.Expr, ast.Return)) and s.value is not None:
                pending = self.expr(s.value, env, module, pending)
            elif isinstance(s, ast.If):
                pending = self.expr(s.test, env, module, pending)
                taken = self.test(s.test)
                if taken is _UNKNOWN:  # a run-time test: either branch
                    a = self.body(s.body, env, module, pending)
                    b = self.body(s.orelse, env, module, pending)
                    pending = {**a, **b}
                else:
                    pending = self.body(s.body if taken else s.orelse, env, module, pending)
            elif isinstance(s, (ast.For, ast.While)):
                head = s.iter if isinstance(s, ast.For) else s.test
                pending = self.expr(head, env, module, pending)
                if isinstance(s, ast.For):
                    self.assign([s.target], ast.Constant(0), env, prefix)
                once = self.body(s.body, env, module, pending)
                twice = self.body(s.body, env, module, {**pending, **once})  # the next iteration
                pending = {**pending, **once, **twice}
        return pending


def _walk(modules: dict, module: str, fn: ast.FunctionDef) -> tuple[set, set]:
    """Flagged loads and unnamed accesses of one root function over every setting of the flags
    its tests meet."""
    found: set = set()
    unseen: set = set()
    todo = [{}]
    while todo:
        flags = todo.pop()
        w = _Walker(modules, module, fn.name, flags)
        w.stack.append(fn.name)
        w.consts.append({a.arg: ("flag", a.arg) for a in fn.args.args
                         if isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr"})
        try:
            w.body(fn.body, {a.arg: frozenset({a.arg}) for a in fn.args.args}, module, {})
        except _Undecided as e:  # walk again with the flag fixed each way
            todo += [{**flags, e.flag: True}, {**flags, e.flag: False}]
            continue
        found |= w.found
        unseen |= w.unseen
    return found, unseen


def scan(overrides: dict[str, str] | None = None, only: str | None = None) -> tuple[list, list]:
    """(every (module.function, pointer base, store line, load line) flagged in npu_ops/triton/
    (the load's line in the root function where it is inside an inlined helper), every
    (function, line) of a global access whose pointer the check cannot name); `only`: the
    functions of that module alone."""
    modules = _modules(overrides)
    found: set = set()
    unseen: set = set()
    for module, (funcs, _) in modules.items():
        if only and module != only:
            continue
        for fn in funcs.values():
            f, u = _walk(modules, module, fn)
            found |= f
            unseen |= u
    return sorted(found), sorted(unseen)


def races(overrides: dict[str, str] | None = None, only: str | None = None) -> list[tuple[str, str, int, int]]:
    """The flagged loads of `scan`."""
    return scan(overrides, only)[0]


def test_no_unordered_reload_of_stored_memory():
    """No kernel loads global memory its own program stored since the last barrier, and the
    check names every access (each load and store through a pointer derived from a parameter,
    every store from one of the function's own; no block pointers or tensor descriptors)."""
    found, unseen = scan()
    assert found == []
    assert unseen == []


def test_check_finds_the_select_race_without_its_barriers():
    """The check can fail: with the select kernel's barriers removed (the code before the fix
    for stale top-k ids on the H200) the chunk list and the survivors are flagged."""
    src = (KERNEL_DIR / "indexer_topk.py").read_text()
    start = src.index("def _topk_select_kernel")
    end = src.index("@triton.jit", start)
    kernel = re.sub(r"\n\s*tl\.debug_barrier\(\).*", "", src[start:end])
    assert kernel != src[start:end]
    flagged = {(f, b) for f, b, _, _ in races({"indexer_topk": src[:start] + kernel + src[end:]}, "indexer_topk")}
    assert ("indexer_topk._topk_select_kernel", "chunk_ptr") in flagged
    assert ("indexer_topk._topk_select_kernel", "surv_s_ptr") in flagged
    assert ("indexer_topk._topk_select_kernel", "surv_p_ptr") in flagged


def _barrier_sites() -> list[tuple[str, int]]:
    """(module, line) of every tl.debug_barrier() in the kernels."""
    return [(p.stem, i) for p in sorted(KERNEL_DIR.glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if line.strip().startswith("tl.debug_barrier()")]


def test_every_barrier_orders_a_reload():
    """Each barrier in the kernels is needed, and seen by the check: without it (and only it)
    some load of memory stored before it is flagged."""
    sites = _barrier_sites()
    assert len(sites) >= 8
    for module, line in sites:
        lines = (KERNEL_DIR / f"{module}.py").read_text().splitlines()
        lines[line - 1] = lines[line - 1].replace("tl.debug_barrier()", "pass")
        assert races({module: "\n".join(lines)}, module), f"{module}.py:{line}: the check sees no reload it orders"
