"""Programmatic dependent launch (npu_ops/triton/pdl.py): a kernel launched with `launch_pdl`
must wait for the kernel ahead before it touches memory, so every kernel taking `PDL` starts
with `pdl_start(PDL)` and every launch of it passes `pdl_launch(...)`; off wherever it does not
apply; on CUDA the decode graphs give the same logits with it on and off."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from _util import rand_prompt

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "npu_ops" / "triton"


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


# What a kernel may compute before its wait on the kernel ahead when it prefetches weights
# (`pdl_prefetch_rows_start` / `pdl_prefetch_range_start`): its ids and ranges, never a load or a store.
BEFORE_WAIT = {"tl.program_id", "tl.num_programs", "tl.arange", "tl.minimum", "tl.maximum", "_decode_tile_ids",
               "_k_slice"}
PREFETCH_WAITS = {"pdl_prefetch_rows_start", "pdl_prefetch_range_start"}
WAITS = {"pdl_start"} | PREFETCH_WAITS


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _wait_call(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name) \
            and stmt.value.func.id in WAITS:
        return stmt.value.func.id
    return None


def _memory_free(stmt: ast.stmt) -> bool:
    """An assignment whose calls are all BEFORE_WAIT functions or `.to` casts."""
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return False
    calls = [c for c in ast.walk(stmt) if isinstance(c, ast.Call)]
    return all(ast.unparse(c.func) in BEFORE_WAIT or (isinstance(c.func, ast.Attribute) and c.func.attr == "to")
               for c in calls)


def _launch_asks(call: ast.Call, scope: ast.FunctionDef | None) -> bool:
    """The launch passes `**pdl_launch(...)`, or `**name` with name from `pdl_prefetch_launch`."""
    for k in call.keywords:
        if k.arg is not None:
            continue
        if "pdl_launch" in ast.unparse(k.value):
            return True
        if isinstance(k.value, ast.Name) and scope is not None:
            for a in ast.walk(scope):
                if isinstance(a, ast.Assign) and "pdl_prefetch_launch(" in ast.unparse(a.value) and any(
                        k.value.id in ast.unparse(t) for t in a.targets):
                    return True
    return False


def test_every_pdl_kernel_waits_first_and_every_launch_asks():
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        pdl_kernels = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _is_jit(fn)
                       and "PDL" in [a.arg for a in fn.args.args] and fn.name not in WAITS}
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in pdl_kernels:
                body = _body(fn)
                i = next((i for i, st in enumerate(body) if _wait_call(st)), None)
                assert i is not None, f"{path.name}:{fn.lineno} {fn.name} never waits (pdl_start or a prefetch start)"
                wait = ast.unparse(body[i])
                if _wait_call(body[i]) == "pdl_start":
                    assert i == 0 and wait == "pdl_start(PDL)", f"{path.name}:{fn.lineno} {fn.name} starts with " \
                                                                f"{ast.unparse(body[0])!r}"
                else:
                    assert wait.split("(")[0] in PREFETCH_WAITS and wait.split("(")[1].startswith("PDL, "), \
                        f"{path.name}:{fn.lineno} {wait!r}"
                    for st in body[:i]:
                        assert _memory_free(st), \
                            f"{path.name}:{st.lineno} {fn.name}: {ast.unparse(st)!r} before the wait"
        scopes = {id(c): fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for c in ast.walk(fn)}
        launches = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                    and isinstance(c.func.value, ast.Name) and c.func.value.id.endswith("_kernel")]
        for call in launches:
            name = call.func.value.id
            # every kernel launched here takes PDL (a launch without it would leave the kernel plain)
            assert name in pdl_kernels and _launch_asks(call, scopes.get(id(call))), \
                f"{path.name}:{call.lineno} launches {name} without pdl_launch"
            checked += 1
    assert checked >= 50  # (the folder's launches; a parse that found none would prove nothing)


def test_pdl_is_off_where_it_does_not_apply(monkeypatch):
    pytest.importorskip("triton")
    from dsv41.npu_ops.triton import pdl

    cpu = torch.zeros(1)
    monkeypatch.delenv("DSV41_PDL", raising=False)
    pdl.set_pdl(None)
    assert pdl.pdl_mode() == pdl.DEFAULT == "chain"  # the default (measured fastest)
    try:
        for mode in ("wait", "trigger", "chain"):
            pdl.set_pdl(mode)
            assert pdl.pdl_mode() == mode
            assert pdl.pdl_launch(cpu) == {}  # a CPU tensor (also the interpreters' device)
        with pytest.raises(ValueError, match="DSV41_PDL='sometimes'"):
            pdl.set_pdl("sometimes")
        monkeypatch.setenv("DSV41_PDL", "wait")
        pdl.set_pdl(None)
        assert pdl.pdl_mode() == "wait"
        if torch.cuda.is_available():
            dev = torch.zeros(1, device="cuda")
            pdl.set_pdl("off")
            assert pdl.pdl_launch(dev) == {}
            pdl.set_pdl("trigger")
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            assert pdl.pdl_launch(dev) == {}
    finally:
        monkeypatch.delenv("DSV41_PDL", raising=False)
        pdl.set_pdl(None)


def test_prefetch_budget_and_each_programs_share(monkeypatch):
    """DSV41_PDL_PREFETCH (MiB, 0 = off): a bad value is one error naming the variable; the
    launch keywords carry PREFETCH_BIT only where PDL applies, the budget is on and the rows are
    16-byte aligned; each program's share is the budget over the programs in 16-byte units."""
    pytest.importorskip("triton")
    from dsv41.npu_ops.triton import pdl

    try:
        monkeypatch.setenv("DSV41_PDL_PREFETCH", "lots")
        with pytest.raises(ValueError, match="DSV41_PDL_PREFETCH='lots'"):
            pdl.set_pdl_prefetch(None)
        with pytest.raises(ValueError, match=">= 0 MiB"):
            pdl.set_pdl_prefetch(-1)
        monkeypatch.setenv("DSV41_PDL_PREFETCH", "24")
        pdl.set_pdl_prefetch(None)
        assert pdl.pdl_prefetch_launch(torch.zeros(1), 100) == ({}, 0)  # PDL does not apply on the CPU
        chain = {"PDL": 3, "launch_pdl": True}
        monkeypatch.setattr(pdl, "pdl_launch", lambda t: chain)
        assert pdl.pdl_prefetch_launch(torch.zeros(1), 100) == ({"PDL": 3 | 4, "launch_pdl": True},
                                                                (24 << 20) // 100 // 16 * 16)
        assert pdl.pdl_prefetch_launch(torch.zeros(1), 100, aligned=False) == (chain, 0)
        assert pdl.pdl_prefetch_launch(torch.zeros(1), 1 << 30) == (chain, 0)  # a share under 16 bytes
        pdl.set_pdl_prefetch(0)
        assert pdl.pdl_prefetch_launch(torch.zeros(1), 100) == (chain, 0)
    finally:
        monkeypatch.delenv("DSV41_PDL_PREFETCH", raising=False)
        pdl.set_pdl_prefetch(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["wait", "trigger", "chain", "chain+prefetch"])
def test_cuda_decode_graphs_give_the_same_logits_with_and_without_pdl(tiny_cfg, fresh_seed, rng, mode):
    """Only the launch overlaps, never the memory effects: the same bits in captured decode
    steps (with the second stream's fork and join at its CUDA default) and eager prefill;
    "+prefetch": with the linears' weight prefetch before the wait (24 MiB a kernel)."""
    from dsv41.core.engine import Engine, SamplingParams
    from dsv41.core.weights import build_model
    from dsv41.npu_ops.triton import pdl

    if torch.cuda.get_device_capability()[0] < 9 or not pdl._supported(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability >= 9 and Triton's gdc_* calls")
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 11, 3)]

    def run(m: str):
        m, _, pre = m.partition("+")
        pdl.set_pdl(m)
        pdl.set_pdl_prefetch(24 if pre else 0)
        try:
            engine = Engine(model, max_batch=4, graphs=True, max_model_len=64, record_logits=True)
            assert (pdl.pdl_launch(model.embed.weight) != {}) == (m != "off")
            assert (pdl.pdl_prefetch_launch(model.embed.weight, 1)[1] > 0) == bool(pre)
            return engine.generate_batch([(p, SamplingParams(max_new_tokens=8), None) for p in prompts])
        finally:
            pdl.set_pdl(None)
            pdl.set_pdl_prefetch(None)

    want, got = run("off"), run(mode)
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        assert all(a.abs().max() > 0 and torch.equal(a, b) for a, b in zip(w.logits, g.logits))
