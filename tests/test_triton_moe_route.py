"""Triton MoE router (npu_ops/triton/moe_route.py) against the torch reference.

Interpreter variants (TRITON_INTERPRET=1, small shapes) and `gpu`-marked compiled variants.
Expert ids must be equal (on inputs without near-ties: every row's choice values are checked to
be separated at the k-th boundary and between the chosen ones), weights within rtol 1e-5.
Exact ties (duplicated gate rows, equal bias) must go to the lower expert id.
"""

import pytest
import torch
import torch.nn.functional as F

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.npu_ops.triton import moe_route as mr  # noqa: E402



def inputs(g, t, d, e, x_dtype=torch.bfloat16, per_token_bias=False):
    x = (torch.randn(t, d, generator=g) * 0.5).to(x_dtype)
    w = (torch.randn(e, d, generator=g) * d ** -0.5).to(torch.bfloat16)
    shape = (t, e) if per_token_bias else (e,)
    bias = torch.randn(*shape, generator=g) * 0.1
    return x, w, bias


def choice_values(x, w, bias, gate_temp):
    logits = (x.double() @ w.double().t()) / gate_temp
    return torch.sqrt(F.softplus(logits)) + bias.double()


def separated_rows(x, w, bias, gate_temp, k, gap=1e-4):
    """Rows whose sorted top-(k+1) choice values are pairwise separated by more than `gap`."""
    c = choice_values(x, w, bias, gate_temp).sort(-1, descending=True).values[:, : k + 1]
    return ((c[:, :-1] - c[:, 1:]) > gap).all(-1)


def separated_inputs(g, t, d, e, gate_temp, k, x_dtype=torch.bfloat16):
    """`inputs` redrawn from the same generator (still fresh each run, and replayable) until more
    than half the rows are free of near-ties at the top-k boundary: with one row a draw has a
    few-percent chance of a near-tie, which only says the data cannot decide the test."""
    for _ in range(100):
        x, w, bias = inputs(g, t, d, e, x_dtype)
        ok = separated_rows(x, w, bias, gate_temp, k)
        if ok.float().mean() > 0.5:
            return x, w, bias, ok
    raise AssertionError("could not draw routing inputs without near-ties")


def check(got, want, ok_rows):
    (gw, gi), (ww, wi) = got, want
    gw, gi = gw.cpu(), gi.cpu()
    assert gw.dtype == ww.dtype == torch.float32 and gi.dtype == wi.dtype == torch.long
    assert gw.shape == ww.shape and gi.shape == wi.shape
    assert ok_rows.float().mean() > 0.5, "test data has too many near-ties"
    assert torch.equal(gi[ok_rows], wi[ok_rows])
    torch.testing.assert_close(gw[ok_rows], ww[ok_rows], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,e,k", [(1, 64, 16, 2), (5, 96, 40, 6), (19, 128, 24, 3), (3, 160, 8, 8)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_moe_route_matches_reference(dev, t, d, e, k, x_dtype, rng):
    temp, scale = 0.7, 1.5
    x, w, bias, ok = separated_inputs(rng, t, d, e, temp, k, x_dtype)
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, scale, temp)
    want = mr.moe_route_ref(x, w, bias, k, scale, temp)
    check(got, want, ok)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
def test_moe_route_per_token_bias_and_dtypes(dev, x_dtype, rng):
    t, d, e, k = 7, 64, 20, 4
    x, w, bias = inputs(rng, t, d, e, x_dtype, per_token_bias=True)
    w = w.float()  # fp32 gate weight: fp32 dots
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 2.5)
    want = mr.moe_route_ref(x, w, bias, k, 2.5)
    check(got, want, separated_rows(x, w, bias, 1.0, k))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("per_token_bias", [False, True])
def test_moe_route_image_bias(dev, per_token_bias, rng):
    """Image tokens choose with image_bias inside the kernel: the same routing as the reference
    given the selected bias (torch.where, what the model did before), and a bias far apart from
    the text one changes the image rows' choice (the selection is not a no-op)."""
    t, d, e, k = 6, 64, 16, 3
    x, w, bias = inputs(rng, t, d, e, per_token_bias=per_token_bias)
    image_bias = bias + torch.linspace(3.0, -3.0, e)  # image rows prefer the low expert ids
    is_image = torch.tensor([True, False, True, True, False, False])
    chosen = torch.where(is_image.unsqueeze(-1), image_bias, bias)
    want = mr.moe_route_ref(x, w, chosen, k, 1.5)
    for cfg in (None, "small"):  # the tiled kernel and the few-token kernel
        got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.5, image_bias=image_bias.to(dev),
                           is_image=is_image.to(dev), _cfg=cfg)
        check(got, want, separated_rows(x, w, chosen, 1.0, k))
    assert torch.equal(mr.moe_route_ref(x, w, bias, k, 1.5, image_bias=image_bias, is_image=is_image)[1], want[1])
    text_ids = mr.moe_route_ref(x, w, bias, k, 1.5)[1]
    assert not torch.equal(text_ids[is_image], want[1][is_image])
    assert torch.equal(text_ids[~is_image], want[1][~is_image])


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_route_softplus_range(dev, rng):
    """Logits far below 0 (log1p of tiny values), around 0 and above the softplus threshold."""
    t, d, e, k = 4, 64, 16, 5
    x, w, _ = inputs(rng, t, d, e, torch.float32)
    x = x * torch.tensor([[0.01], [1.0], [30.0], [200.0]])
    bias = torch.zeros(e)
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.0)
    want = mr.moe_route_ref(x, w, bias, k, 1.0)
    check(got, want, separated_rows(x, w, bias, 1.0, k, gap=1e-5))


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_route_ties_to_lower_id(dev, rng):
    t, d, e, k = 3, 64, 12, 4
    # small dyadic values: every logit is exact in fp32, whatever the summation order
    x = (torch.randint(-8, 9, (t, d), generator=rng).float() / 4).to(torch.bfloat16)
    w = (torch.randint(-8, 9, (e, d), generator=rng).float() / 64).to(torch.bfloat16)
    w[7], w[9], w[2] = w[4], w[4], w[4]  # experts 2, 4, 7, 9 share a gate row
    bias = torch.zeros(e)
    bias[[2, 4, 7, 9]] = 5.0  # ... and win by far: all tie
    wts, ids = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.0)
    assert ids.cpu().tolist() == [[2, 4, 7, 9]] * t
    torch.testing.assert_close(wts.cpu(), torch.full((t, k), 0.25))
    bias[9] = 5.5  # the bias only chooses: the weights stay equal
    wts, ids = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), 3, 1.0)
    assert ids.cpu().tolist() == [[9, 2, 4]] * t
    torch.testing.assert_close(wts.cpu(), torch.full((t, 3), 1 / 3))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg", [(16, 16, 32, 4), (32, 32, 64, 4), (16, 16, 32, 4, 3), (32, 32, 64, 4, 2)])
def test_moe_route_tile_configs(dev, cfg, rng):
    """Several token and expert blocks, ragged edges (the counter / last-tile routing), and K
    split into slices whose partial logits the last tile sums."""
    t, d, e, k = 37, 96, 72, 6
    x, w, bias = inputs(rng, t, d, e)
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.0, _cfg=cfg)
    want = mr.moe_route_ref(x, w, bias, k, 1.0)
    check(got, want, separated_rows(x, w, bias, 1.0, k))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("k", [1, 3])
def test_moe_route_without_topk_normalisation(dev, k, rng):
    """norm_topk_prob false (or top-1): the weights are the raw chosen scores times the scale."""
    t, d, e = 6, 64, 16
    x, w, bias, ok = separated_inputs(rng, t, d, e, 1.0, k)
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.5, norm_topk_prob=False)
    want = mr.moe_route_ref(x, w, bias, k, 1.5, norm_topk_prob=False)
    check(got, want, ok)
    raw = torch.sqrt(F.softplus(x.double() @ w.double().t())).gather(-1, want[1]) * 1.5
    torch.testing.assert_close(want[0].double()[ok], raw[ok], rtol=1e-6, atol=0)
    if k == 1:  # top-1: normalising is skipped even when asked for
        check(mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.5, norm_topk_prob=True), want, ok)
    else:  # top-3 normalised: the weights sum to the scale
        normed = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 1.5, norm_topk_prob=True)
        torch.testing.assert_close(normed[0].cpu().sum(-1), torch.full((t,), 1.5), rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t", [1, 64, 256])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_moe_route_benchmark_shapes_gpu(dev, t, x_dtype, rng):
    d, e, k = 5120, 384, 6
    x, w, bias, ok = separated_inputs(rng, t, d, e, 1.0, k, x_dtype)
    got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, 2.5, 1.0)
    want = mr.moe_route_ref(x, w, bias, k, 2.5, 1.0)
    check(got, want, ok)


def test_moe_route_rejects_bad_shapes():
    with pytest.raises(ValueError):
        mr.moe_route(torch.zeros(2, 32), torch.zeros(4, 16), torch.zeros(4), 2, 1.0)
    with pytest.raises(ValueError):
        mr.moe_route(torch.zeros(2, 32), torch.zeros(4, 32), torch.zeros(3, 4), 2, 1.0)


@pytest.mark.parametrize("dev", DEVICES)
def test_cuda_backend_registers_kernel(dev, monkeypatch, rng):
    from dsv41.backends import ops
    from dsv41.npu_ops.triton import KERNELS

    assert "moe_route" in KERNELS
    impl, used, reason = registry.resolve("moe_route", "cuda")
    assert (impl, used) == (mr.moe_route, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")
    x, w, bias = inputs(rng, 4, 64, 16)
    got = ops.moe_route(x.to(dev), w.to(dev), bias.to(dev), 3, 1.0)
    check(got, mr.moe_route_ref(x, w, bias, 3, 1.0), separated_rows(x, w, bias, 1.0, 3))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,e,k", [(1, 160, 16, 6), (2, 96, 16, 2), (5, 64, 12, 3), (1, 96, 64, 8)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_moe_route_small_kernel(dev, t, d, e, k, x_dtype, rng):
    """The few-token kernel (`_moe_route_small_kernel`, DSV41_MOE_ROUTE=small): K slices as
    programs, ragged last slice, the self-resetting counter (called twice: a counter left at n_ks
    would route nothing on the second call), per-token bias."""
    temp, scale = 0.7, 1.5
    for per_token in (False, True):
        x, w, bias, ok = separated_inputs(rng, t, d, e, temp, k, x_dtype)
        if per_token:
            bias = bias.expand(t, e).contiguous()
        want = mr.moe_route_ref(x, w, bias, k, scale, temp)
        for _ in range(2):
            got = mr.moe_route(x.to(dev), w.to(dev), bias.to(dev), k, scale, temp, _cfg="small")
            check(got, want, ok)
    x, w, bias, ok = separated_inputs(rng, t, d, e, 1.0, k)
    wts = torch.empty(t, k, device=dev)
    ids = torch.empty(t, k, dtype=torch.long, device=dev)
    mr.moe_route_small(x.to(dev), w.to(dev), bias.to(dev), 0, wts, ids, k, 1.0, 1.0, True, block_k=16, slices=3)
    check((wts, ids), mr.moe_route_ref(x, w, bias, k, 1.0), ok)


def test_moe_route_mode_switch(monkeypatch):
    """DSV41_MOE_ROUTE is read once; an unknown value is one clear error; the small kernel refuses
    shapes it does not fit."""
    monkeypatch.setattr(mr, "_ROUTE_MODE", [])
    monkeypatch.setenv("DSV41_MOE_ROUTE", "bogus")
    with pytest.raises(ValueError, match="DSV41_MOE_ROUTE"):
        mr.route_mode()
    monkeypatch.setattr(mr, "_ROUTE_MODE", [])
    monkeypatch.setenv("DSV41_MOE_ROUTE", "small")
    assert mr.route_mode() == "small"
    assert mr.small_fits(1, 16) and mr.small_fits(8, 16) and not mr.small_fits(1, 384)
    with pytest.raises(ValueError, match="small kernel"):
        mr.moe_route_small(torch.zeros(1, 32), torch.zeros(384, 32), torch.zeros(384), 0, torch.empty(1, 2),
                           torch.empty(1, 2, dtype=torch.long), 2, 1.0, 1.0, True)
