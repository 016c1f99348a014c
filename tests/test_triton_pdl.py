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


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[0]


def test_every_pdl_kernel_waits_first_and_every_launch_asks():
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        pdl_kernels = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _is_jit(fn)
                       and "PDL" in [a.arg for a in fn.args.args] and fn.name != "pdl_start"}
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in pdl_kernels:
                first = ast.unparse(_first_statement(fn))
                assert first == "pdl_start(PDL)", f"{path.name}:{fn.lineno} {fn.name} starts with {first!r}"
        launches = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                    and isinstance(c.func.value, ast.Name) and c.func.value.id.endswith("_kernel")]
        for call in launches:
            name = call.func.value.id
            asks = [k for k in call.keywords if k.arg is None and "pdl_launch" in ast.unparse(k.value)]
            # every kernel launched here takes PDL (a launch without it would leave the kernel plain)
            assert name in pdl_kernels and asks, f"{path.name}:{call.lineno} launches {name} without pdl_launch"
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["wait", "trigger", "chain"])
def test_cuda_decode_graphs_give_the_same_logits_with_and_without_pdl(tiny_cfg, fresh_seed, rng, mode):
    """Only the launch overlaps, never the memory effects: the same bits in captured decode
    steps (with the second stream's fork and join at its CUDA default) and eager prefill."""
    from dsv41.core.engine import Engine, SamplingParams
    from dsv41.core.weights import build_model
    from dsv41.npu_ops.triton import pdl

    if torch.cuda.get_device_capability()[0] < 9 or not pdl._supported(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability >= 9 and Triton's gdc_* calls")
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 11, 3)]

    def run(m: str):
        pdl.set_pdl(m)
        try:
            engine = Engine(model, max_batch=4, graphs=True, max_model_len=64, record_logits=True)
            assert (pdl.pdl_launch(model.embed.weight) != {}) == (m != "off")
            return engine.generate_batch([(p, SamplingParams(max_new_tokens=8), None) for p in prompts])
        finally:
            pdl.set_pdl(None)

    want, got = run("off"), run(mode)
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        assert all(a.abs().max() > 0 and torch.equal(a, b) for a, b in zip(w.logits, g.logits))
