"""W8A8 for Atlas A2/A3: `dsv41 convert --linear-dtype int8` on the tiny checkpoint, and the
reference path running its int8 weights with dynamic per-token int8 activations."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsv41.backends import ops
from dsv41.backends.reference import quant
from dsv41.backends.reference.basic import _dequant_weight
from dsv41.core.model import Linear
from dsv41.deploy import convert as cv

from test_convert import make_source, tiny_sd  # noqa: F401  (the tiny checkpoint fixture)


def load_rank(out, r: int, mp: int) -> dict[str, torch.Tensor]:
    with safe_open(str(out / f"model{r}-mp{mp}.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_sd):  # noqa: F811
    cfg, sd = tiny_sd
    root = tmp_path_factory.mktemp("w8a8")
    src = make_source(root, cfg, sd)
    rep = cv.convert(src, root / "out", 2, progress=False, linear_dtype="int8")
    return cfg, sd, rep, root / "out"


def fp8_linears(sd: dict) -> list[str]:
    return sorted(k for k, v in sd.items() if k.endswith(".weight") and v.dtype == torch.float8_e4m3fn
                  and ".engram.embed." not in k)  # Engram rows: --engram-dtype


def fp4_experts(sd: dict) -> list[str]:
    return sorted(k for k, v in sd.items() if ".experts." in k and k.endswith(".weight") and v.dtype == torch.int8)


def test_convert_writes_per_channel_int8(converted):
    cfg, sd, rep, out = converted
    ranks = [load_rank(out, r, 2) for r in range(2)]
    names = fp8_linears(sd) + fp4_experts(sd)
    assert names and rep["counts"]["linear_int8_converted"] == len(names)
    for name in names:
        owner = name[: -len(".weight")]
        pieces = [(rk[name], rk[owner + ".scale"]) for rk in ranks if name in rk]
        for q, s in pieces:
            assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (q.shape[0], 1)
        full = _dequant_weight(sd[name], sd[owner + ".scale"])
        want_q, want_s = quant.int8_row_quant(full)
        if ".wo_b." in name:  # split along K: every rank keeps the whole row's scale
            got_q = torch.cat([q for q, _ in pieces], 1)
            assert all(torch.equal(s, want_s) for _, s in pieces)
        elif len(pieces) == 2 and pieces[0][0].shape[0] < full.shape[0]:  # split along N
            got_q = torch.cat([q for q, _ in pieces])
            assert torch.equal(torch.cat([s for _, s in pieces]), want_s)
        else:  # replicated, or a routed expert on its one rank
            got_q = pieces[0][0]
            assert torch.equal(pieces[0][1], want_s)
        assert torch.equal(got_q, want_q), name
    # the error report: one entry per tensor kind, within half an int8 step of the row amax
    kinds = rep["linear_int8_error"]
    assert {cv.tensor_kind(n) for n in names} == set(kinds)
    for kind, e in kinds.items():
        assert 0 < e["mean_rel"] <= e["max_rel"] <= 0.5 / 127 + 1e-6, (kind, e)
    text = cv.format_report(rep)
    assert "int8 layers.*.ffn.experts.*.w1" in text
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
    assert all(desc[n] == "W8A8_DYNAMIC" for n in names)
    assert desc["embed.weight"] == "FLOAT"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["linear_dtype"] == "int8" and qc["expert_dtype"] == "int8"


def test_reference_int8_linear_math(rng):
    """Per-token int8 activations x per-channel int8 weights: the integer sums scaled once,
    against the same formula written out in fp64."""
    x = torch.randn(6, 64, generator=rng).to(torch.bfloat16)
    q, s = quant.int8_row_quant(torch.randn(40, 64, generator=rng) * 0.1)
    xs = x.float().abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x.float() / xs).clamp(-127, 127)
    want = ((xq.double() @ q.double().t()) * xs.double() * s.double().t()).float()
    got = ops.linear(x, q, s, torch.float32)
    assert torch.equal(got, want)
    assert ops.linear(x, q, s).dtype == torch.bfloat16


def test_int8_checkpoint_runs_through_the_reference(converted, rng):
    """Each converted linear and the routed experts run from the int8 checkpoint through the
    reference ops; measured against the exact product with the release weight, the W8A8 error
    stays below the FP8 path's own (both quantise activations, FP8 more coarsely)."""
    cfg, sd, rep, out = converted
    ranks = [load_rank(out, r, 2) for r in range(2)]
    worst = {"int8": 0.0, "fp8": 0.0}
    for name in fp8_linears(sd):
        owner = name[: -len(".weight")]
        if name not in ranks[0] or ".wo_b." in name or ranks[0][name].shape[0] != sd[name].shape[0]:
            continue  # replicated ones only: whole weights on rank 0
        w, s = sd[name], sd[owner + ".scale"]
        x = torch.randn(5, w.shape[1], generator=rng).to(torch.bfloat16)
        exact = x.double() @ _dequant_weight(w, s).double().t()

        def rel(y):
            return float((y.double() - exact).norm() / exact.norm())

        worst["int8"] = max(worst["int8"], rel(ops.linear(x, ranks[0][name], ranks[0][owner + ".scale"], torch.float32)))
        worst["fp8"] = max(worst["fp8"], rel(ops.linear(x, w, s, torch.float32)))
    print(f"relative error vs the exact product, worst linear: W8A8 {worst['int8']:.2e}, FP8 {worst['fp8']:.2e}")
    assert 0 < worst["int8"] < 0.02 and worst["int8"] < worst["fp8"], worst

    # routed experts of layer 0 held by rank 0, in the int8 storage, through ops.moe_experts
    layer_experts = sorted({int(n.split(".")[4]) for n in ranks[0] if n.startswith("layers.0.ffn.experts.")})
    assert layer_experts

    def parts(src, e):
        p = f"layers.0.ffn.experts.{e}."
        return tuple((src[p + w + ".weight"], src[p + w + ".scale"]) for w in ("w1", "w2", "w3"))
    t, k = 7, 2
    x = torch.randn(t, cfg.hidden_size, generator=rng).to(torch.bfloat16)
    ids = torch.randint(0, len(layer_experts), (t, k), generator=rng)
    wts = torch.rand(t, k, generator=rng)
    got = ops.moe_experts(x, wts, ids, [parts(ranks[0], e) for e in layer_experts], cfg.swiglu_limit)
    ref = ops.moe_experts(x, wts, ids, [parts(sd, e) for e in layer_experts], cfg.swiglu_limit)
    assert got.shape == ref.shape == (t, cfg.hidden_size)
    moe_rel = float((got - ref).norm() / ref.norm())
    print(f"routed experts, W8A8 vs the FP4 release path: relative error {moe_rel:.2e}")
    # per-channel INT8 flattens MXFP4's per-32 power-of-two scales: groups far below the row's
    # amax lose bits (measured 4.8e-2 .. 6.0e-2 on the tiny random experts, seeds 1-4)
    assert 0 < moe_rel < 0.1


def test_linear_int8_storage():
    lin = Linear(64, 48, "int8")
    assert lin.weight.dtype == torch.int8 and lin.weight.shape == (48, 64)
    assert lin.scale.dtype == torch.float32 and lin.scale.shape == (48, 1)
    q, s = quant.int8_row_quant(torch.randn(48, 64))
    lin.load_state_dict({"weight": q, "scale": s})
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(lin(x, torch.float32), ops.linear(x, q, s, torch.float32))


def test_bad_linear_dtype(tmp_path, tiny_sd):  # noqa: F811
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    with pytest.raises(cv.ConvertError, match="--linear-dtype must be native or int8"):
        cv.convert(src, tmp_path / "out", 1, progress=False, linear_dtype="int4")
    assert not (tmp_path / "out").exists()


def test_int8_checkpoint_builds_and_generates(tmp_path, tiny_sd):  # noqa: F811
    """A W8A8 checkpoint's config builds int8 Linears (dense and experts) and the whole model
    runs through the reference: the next-token logits stay close to the FP8 release's."""
    from dsv41.core.engine import SingleSequence
    from dsv41.deploy.checkpoint import load_checkpoint_weights, read_config

    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    cv.convert(src, tmp_path / "out", 1, progress=False, linear_dtype="int8")
    cfg8 = read_config(tmp_path / "out")
    assert cfg8.weight_dtype == "int8" and cfg8.expert_dtype == "int8"
    model = load_checkpoint_weights(tmp_path / "out", cfg8, "cpu")
    assert model.layers[0].attn.wq_a.storage == "int8" and model.layers[0].ffn.experts["0"].w1.storage == "int8"
    ref = load_checkpoint_weights(src, read_config(src), "cpu")
    ids = torch.randint(5, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    got = SingleSequence(model).feed(ids, all_logits=True)
    want = SingleSequence(ref).feed(ids, all_logits=True)
    assert torch.isfinite(got).all()
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    print(f"\n[dsv41] W8A8 vs FP8 release, tiny random model, per-position logit rel. error (max): {err:.3g}")
    # unrelated logits of this size differ by about sqrt(2); chaotic random weights amplify the
    # int8 rounding, so the bound only says the int8 model computes the same function roughly
    assert 0 < err < 1.0
