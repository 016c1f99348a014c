"""Mega-mHC kernel (npu_ops/triton/mega_mhc.py, op `mhc_mix`) against the torch reference.

x_new / x_hat: equal to the reference's bf16 values except for rare differences (the kernel
sums the fp32 products in fp32, the reference in fp64, so a value lying within ~1e-7 relative
of a bf16 rounding midpoint can round the other way; x_hat is checked against the collapse of
the kernel's own x_new, which it inherits those flips from). The bound checked:
every element within 1 bf16 ulp plus 2^-20 x the sum of its absolute terms (fp32 summation
error where the terms cancel), and at most max(2, 0.1%) of the elements differing at all.
pre / post / comb: rtol 1e-5 / atol 1e-6 (1e-5 on devices: tensor-core accumulation) against
the reference coefficients of the kernel's own x_new (fp32 dot products vs the reference's fp64 `mm`), rtol 1e-3 / atol 1e-3 against the full
reference (the rare x_new flips move m), comb doubly stochastic. Interpreter variant on CPU (TRITON_INTERPRET=1), compiled variant marked `gpu`.
"""

import pytest
import torch

from _triton import ASCEND_TRITON, DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.reference import mhc as ref  # noqa: E402
from dsv41.npu_ops.triton import mega_mhc as mm  # noqa: E402


NORM_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20


def make_inputs(g: torch.Generator, t: int, d: int, n: int = 4):
    x = (torch.randn(t, n, d, generator=g) * (1 + 3 * torch.rand(t, n, 1, generator=g))).to(torch.bfloat16)
    y = torch.randn(t, d, generator=g).to(torch.bfloat16)
    post = 2 * torch.rand(t, n, generator=g)
    comb = ref.sinkhorn(torch.randn(t, n, n, generator=g) * 2, ITERS, HC_EPS)
    pre = torch.rand(t, n, generator=g) + 1e-6
    fn = torch.randn(6 * n, n * d, generator=g) * (2.0 / (n * d) ** 0.5)
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(6 * n, generator=g) * 0.5
    return x, y, post, comb, pre, fn, scale, base


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, max_frac: float = 1e-3):
    """Equal, or apart by at most 1 bf16 ulp of `want` plus 2^-20 * `mag` (the sum of the
    absolute terms: fp32 summation error where terms cancel), on at most max(2, `max_frac` *
    numel) elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g = got.detach().cpu().float()
    w = want.float()
    ulp = torch.where(w == 0, torch.full_like(w, 2.0 ** -133),
                      torch.exp2(torch.floor(torch.log2(w.abs())) - 7))
    diff = (g - w).abs()
    bound = ulp * 1.0001 + mag.float() * 2.0 ** -20
    assert (diff <= bound).all(), f"max diff {(diff / bound).max().item()} x bound"
    n_diff = int((diff > 0).sum())
    assert n_diff <= max(2, max_frac * diff.numel()), f"{n_diff} of {diff.numel()} elements differ"


def check(dev, inputs, with_fn: bool, **kw):
    x, y, post, comb, pre, fn, scale, base = inputs
    if not with_fn:
        fn = scale = base = None
    want = ref.mhc_mix(x, y, post, comb, pre, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    mv = lambda v: None if v is None else v.to(dev)  # noqa: E731
    got = mm.mhc_mix(x.to(dev), y.to(dev), post.to(dev), comb.to(dev), pre.to(dev), mv(fn), mv(scale),
                     mv(base), NORM_EPS, HC_EPS, ITERS, **kw)
    mag_new = ref.mhc_update(x.float().abs(), y.float().abs(), post.abs(), comb.abs())
    assert_bf16_close(got[0], want[0], mag_new)
    # x_hat from the kernel's own x_new (a flipped x_new element moves x_hat by pre * 1 ulp)
    x_new = got[0].cpu()
    assert_bf16_close(got[1], ref.mhc_collapse(x_new, pre), ref.mhc_collapse(x_new.float().abs(), pre.abs()))
    if not with_fn:
        assert got[2] is None
        return got
    # the coefficients of the kernel's own x_new (a 1-ulp flip of one x_new element moves m by
    # ~1e-5 relative, so against the reference's x_new the bound is looser)
    own = ref.mhc_mixes(got[0].cpu(), fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    for a, b, c in zip(got[2], own, want[2]):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        # on devices the dot products run on tensor cores (three exact bf16 x bf16 parts of
        # fn, accumulated in hardware fp32, whose rounding is coarser than IEEE fp32) in d
        # chunks summed afterwards; measured on the H200 at d = 5120 over 24 fresh inputs: up to
        # 1.1e-4 beyond rtol 1e-5 (Sinkhorn's 20 rounds amplify the logits' error), hence 2e-4
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6 if dev == "cpu" else 2e-4)
        torch.testing.assert_close(a.cpu(), c, rtol=1e-3, atol=1e-3)
    c = got[2][2].cpu().double()
    # doubly stochastic: columns exactly (the last step), rows up to Sinkhorn's convergence
    # after 20 rounds (the reference's rows are off by as much on the same logits)
    torch.testing.assert_close(c.sum(-2), torch.ones_like(c.sum(-2)), rtol=0, atol=1e-5)
    torch.testing.assert_close(c.sum(-1), torch.ones_like(c.sum(-1)), rtol=0, atol=0.1)
    assert (c > 0).all()
    assert c.std() > 0.01
    return got


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d", [(1, 128), (5, 128), (19, 96), (33, 256)])
@pytest.mark.parametrize("with_fn", [True, False], ids=["fn", "nofn"])
def test_mhc_mix_random(dev, t, d, with_fn, rng):
    check(dev, make_inputs(rng, t, d), with_fn)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,tiles", [(1, 128, {}), (5, 128, {}), (19, 96, {}), (33, 256, dict(block_t=32)),
                                       (40, 192, dict(block_d=32, num_stages=1))])
def test_mhc_mix_transposed_projection(dev, t, d, tiles, rng):
    """`tdot` (fn's cached bf16 parts x x_new^T) against the reference, as the default form is held,
    at several tiles; with d not a multiple of the slice and token tiles cut short."""
    check(dev, make_inputs(rng, t, d), True, tdot=True, **tiles)


def test_tiles_for_rules(monkeypatch):
    """CUDA decode batches take DECODE_TDOT's tiles (16-token tiles below wide_t tokens, 32 from it),
    larger calls PREFILL_TDOT's, batch-invariant calls the table's; DSV41_MHC_TDOT=0 turns both
    rules off, a bad value is one clear error (read once per process: memo reset here)."""
    from dsv41.backends import platform
    from dsv41.npu_ops.triton import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    cuda, rule = torch.device("cuda"), mm.DECODE_TDOT
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.delenv("DSV41_MHC_TDOT", raising=False)
    for t, bt in ((1, rule["block_t"]), (rule["wide_t"] - 1, rule["block_t"]), (rule["wide_t"], rule["wide_block_t"]),
                  (rule["max_t"], rule["wide_block_t"])):
        tiles = mm.tiles_for(t, cuda)
        assert tiles["tdot"] and tiles["block_t"] == bt and tiles["num_stages"] == rule["num_stages"], t
    for t in (rule["max_t"] + 1, 4096):
        tiles = mm.tiles_for(t, cuda)
        assert tiles["tdot"] and all(tiles[k] == v for k, v in mm.PREFILL_TDOT.items()), t
        assert tiles["num_warps"] == mm.TILES["cuda"]["num_warps"]
    assert mm.tiles_for(8, cuda, sized=False) is mm.TILES["cuda"]
    assert mm.tiles_for(4096, cuda, sized=False) is mm.TILES["cuda"]
    assert mm.tiles_for(8, torch.device("cpu")) is mm.TILES["default"]
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.setenv("DSV41_MHC_TDOT", "0")
    assert mm.tiles_for(8, cuda) is mm.TILES["cuda"]
    assert mm.tiles_for(4096, cuda) is mm.TILES["cuda"]
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.setenv("DSV41_MHC_TDOT", "on")
    with pytest.raises(ValueError, match="DSV41_MHC_TDOT"):
        mm.tiles_for(8, cuda)


def test_coef_launch_forks_only_inside_the_lane_scope(monkeypatch):
    """`coef_launch` on a CUDA device with the lane on: forked on MHC_COEF_LANE (reading the chunk
    partials) only inside `mhc_coef_lane_scope`; outside it, and with a `norm` (the next
    sublayer's input), the launch runs on the calling stream. A recording platform stands in for
    the device (the launch itself is recorded, not run)."""
    from dsv41.backends import platform
    from dsv41.npu_ops.triton import launch

    log = []

    class Recording(platform.Platform):
        def fork(self, fn, lane=0, reads=()):
            log.append(("fork", lane, len(reads)))
            return fn()

    monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": True})
    monkeypatch.setattr(platform, "cached_platform", lambda device: Recording("cuda", torch.device("cpu")))
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(mm, "launch_coef", lambda *a, **kw: log.append(("launch", kw.get("norm") is not None)))
    cuda = torch.device("cuda")
    mm.coef_launch(cuda, "part", "pcomp", "pss")
    assert log == [("launch", False)]  # an op called on its own: on the calling stream
    log.clear()
    with platform.mhc_coef_lane_scope():
        mm.coef_launch(cuda, "part", "pcomp", "pss")
        mm.coef_launch(cuda, "part", "pcomp", "pss", norm=("x_hat",))
    assert log == [("fork", platform.MHC_COEF_LANE, 3), ("launch", False), ("launch", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t", [1, 64])
def test_mhc_coef_lane_same_bits_gpu(dev, t, rng, monkeypatch):
    """The coefficient launch forked on the side lane (the CUDA default inside
    `mhc_coef_lane_scope`, as the model's forward runs) and joined (`join_mhc_coef`) before
    anything reads it, eagerly and inside a captured CUDA graph: the same bits as the launch on
    the calling stream."""
    from dsv41.backends import platform

    x, y, post, comb, pre, fn, scale, base = (v.to(dev) for v in make_inputs(rng, t, 5120))
    args = (x, y, post, comb, pre, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    plat = platform.platform_for(torch.device(dev))
    monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": False})
    want = mm.mhc_mix(*args)
    monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": True})

    @platform.mhc_coef_lane_scope()
    def run():
        out = mm.mhc_mix(*args)
        platform.join_mhc_coef(plat, out[2])
        return out

    got = run()
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        run()  # (warm-up on the capture's side stream)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize(dev)
    for out in (got, captured):
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
        for a, b in zip(out[2], want[2]):
            assert torch.equal(a, b)


def test_fn_bf16_parts_exact_and_cached(rng):
    """fn's three bf16 parts add up to fn exactly (the split the kernel did per call; exact while
    the last part stays a normal number, |fn| above ~2^-110), are kept on the tensor, and are made
    again after fn changes in place."""
    fn = torch.randn(24, 512, generator=rng) * 0.03
    fn[0, :4] = torch.tensor([1e-30, -3.0, 0.0, 1.0 + 2.0 ** -23])  # tiny, large, zero, all 24 bits
    parts = mm.fn_bf16_parts(fn)
    assert parts.shape == (3, 24, 512) and parts.dtype == torch.bfloat16
    assert torch.equal(parts.double().sum(0), fn.double())
    assert mm.fn_bf16_parts(fn) is parts
    fn.mul_(2.0)
    again = mm.fn_bf16_parts(fn)
    assert again is not parts and torch.equal(again.double().sum(0), fn.double())
    with torch.inference_mode():  # an inference tensor (no version counter): split once, kept
        frozen = fn * 1.0
    kept = mm.fn_bf16_parts(frozen)
    assert mm.fn_bf16_parts(frozen) is kept and torch.equal(kept, again)


@pytest.mark.skipif(ASCEND_TRITON, reason="the fused coefficient epilogue (atomics, L2 loads) is the CUDA path")
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,d_split", [(1, 256, 4), (5, 128, 2), (33, 192, 3)])
def test_mhc_mix_fused_coefficients(dev, t, d, d_split, rng):
    """The coefficients from the main kernel's last program per token tile (one launch), with
    several chunks per tile (chunk partials met through the tile counter), and again on the same
    buffers (the counters are back at zero after each call)."""
    inputs = make_inputs(rng, t, d)
    for _ in range(2):
        check(dev, inputs, True, fused=True, d_split=d_split)


@pytest.mark.skipif(ASCEND_TRITON, reason="mhc_mix_norm is a CUDA kernel (Ascend runs its composition)")
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,with_fn,fused,dtype", [
    (1, 128, True, False, torch.bfloat16), (5, 96, True, True, torch.bfloat16), (19, 256, True, False, torch.bfloat16),
    (3, 128, False, False, torch.bfloat16), (6, 64, True, True, torch.float32), (2, 64, True, False, torch.float32)])
def test_mhc_mix_norm(dev, t, d, with_fn, fused, dtype, rng, monkeypatch):
    """`mhc_mix_norm`: the mix's outputs exactly as `mhc_mix` gives them, and the fourth output
    rms_norm(x_hat) (made in the coefficient epilogue, or by the rms_norm kernel without fn)
    within one rounding of the fp64 reference norm of the kernel's own x_hat and of the rms_norm
    kernel."""
    from dsv41.backends.reference import basic
    from dsv41.npu_ops.triton import mhc_mix_norm as mn
    from dsv41.npu_ops.triton import rms_norm as rn

    x, y, post, comb, pre, fn, scale, base = make_inputs(rng, t, d)
    x, y = x.to(dtype), y.to(dtype)
    if not with_fn:
        fn = scale = base = None
    w = (torch.rand(d, generator=rng) + 0.5).to(torch.bfloat16)
    mv = lambda v: None if v is None else v.to(dev)  # noqa: E731
    args = [mv(v) for v in (x, y, post, comb, pre, fn, scale, base)]
    # the coefficient epilogue in its own launch or in the main kernel; narrow tiles at 1-2 tokens
    monkeypatch.setattr(mm, "_COEF_MODE", [(fused, t <= 2)])
    got = mn.mhc_mix_norm(*args, NORM_EPS, HC_EPS, ITERS, w.to(dev), 1e-6)
    plain = mm.mhc_mix(*args, NORM_EPS, HC_EPS, ITERS)
    assert len(got) == 4
    assert torch.equal(got[0].cpu(), plain[0].cpu()) and torch.equal(got[1].cpu(), plain[1].cpu())
    if with_fn:
        for a, b in zip(got[2], plain[2]):
            assert torch.equal(a.cpu(), b.cpu())
    else:
        assert got[2] is None
    x_hat = got[1].cpu()
    want = basic.rms_norm(x_hat, w, 1e-6)
    kern = rn.rms_norm(got[1], w.to(dev), 1e-6).cpu()
    assert got[3].dtype == dtype and got[3].shape == (t, d)
    assert want.abs().max() > 0.5
    if dtype == torch.bfloat16:
        none = torch.zeros_like(want)  # (one whole-row reduction: no cancellation term)
        assert_bf16_close(got[3], want, none, max_frac=0.02)
        assert_bf16_close(got[3], kern, none, max_frac=0.02)
    else:
        torch.testing.assert_close(got[3].cpu(), want.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[3].cpu(), kern, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(ASCEND_TRITON, reason="mhc_enter_norm is a CUDA kernel (Ascend runs its composition)")
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,fused,dtype", [(1, 128, False, torch.bfloat16), (6, 96, True, torch.bfloat16),
                                             (19, 256, False, torch.bfloat16), (5, 64, True, torch.float32)])
def test_mhc_enter_norm(dev, t, d, fused, dtype, rng, monkeypatch):
    """`mhc_enter_norm`: the coefficients exactly as `mhc_mixes` gives them, x_hat as the
    `mhc_collapse` kernel (the same fp32 expression), and attn_norm(x_hat) within one rounding
    of the fp64 reference norm of the kernel's own x_hat."""
    from dsv41.backends.reference import basic
    from dsv41.npu_ops.triton import mhc_mix_norm as mn
    from dsv41.npu_ops.triton import mhc_mixes as mx

    x, _, _, _, pre, fn, scale, base = make_inputs(rng, t, d)
    x = x.to(dtype)
    w = (torch.rand(d, generator=rng) + 0.5).to(torch.bfloat16)
    args = [v.to(dev) for v in (x, pre, fn, scale, base)]
    monkeypatch.setattr(mm, "_COEF_MODE", [(fused, t <= 2)])  # (mhc_mixes reads mega_mhc's mode)
    coef, x_hat, x_norm = mn.mhc_enter_norm(*args, NORM_EPS, HC_EPS, ITERS, w.to(dev), 1e-6)
    plain = mx.mhc_mixes(args[0], *args[2:], NORM_EPS, HC_EPS, ITERS)
    for a, b in zip(coef, plain):
        assert torch.equal(a.cpu(), b.cpu())
    want_hat = ref.mhc_collapse(x, pre)
    assert torch.equal(x_hat.cpu(), mx.mhc_collapse(args[0], args[1]).cpu()) or dev != "cpu"
    want = basic.rms_norm(x_hat.cpu(), w, 1e-6)
    assert x_norm.dtype == x_hat.dtype == dtype and x_norm.shape == x_hat.shape == (t, d)
    assert want.abs().max() > 0.5
    if dtype == torch.bfloat16:
        assert_bf16_close(x_hat, want_hat, ref.mhc_collapse(x.float().abs(), pre.abs()))
        assert_bf16_close(x_norm, want, torch.zeros_like(want), max_frac=0.02)
    else:
        torch.testing.assert_close(x_hat.cpu(), want_hat.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x_norm.cpu(), want.float(), rtol=1e-6, atol=1e-6)
@pytest.mark.skipif(ASCEND_TRITON, reason="the fused coefficient epilogue (atomics, L2 loads) is the CUDA path")
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", ["narrow", "fused-narrow", "fused"])
@pytest.mark.parametrize("t", [1, 2, 6])
def test_mhc_coef_modes(dev, mode, t, monkeypatch, rng):
    """DSV41_MHC_COEF: the narrow coefficient tile (in its own launch one token a program up to
    COEF_ONE_MAX_T tokens; fused, fewer than COEF_T tokens: a tile of just those, 6 tokens keep
    COEF_T), every chunk in one reduction step, for mhc_mix and mhc_mixes, with several d chunks;
    called twice (the counters return to 0)."""
    from dsv41.npu_ops.triton import mhc_mixes as mx

    monkeypatch.setattr(mm, "_COEF_MODE", [])
    monkeypatch.setenv("DSV41_MHC_COEF", mode)
    assert mm.coef_mode() == (mode.startswith("fused"), mode.endswith("narrow"))
    assert mm.coef_tokens(t, True) == 1 and mm.coef_tokens(mm.COEF_ONE_MAX_T + 1, True) == mm.COEF_T
    assert mm.coef_tokens(t, True, fused=True) == min(mm.COEF_T, 1 << (t - 1).bit_length())
    inputs = make_inputs(rng, t, 192)
    x, fn, scale, base = inputs[0], inputs[5], inputs[6], inputs[7]
    want = ref.mhc_mixes(x, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    for _ in range(2):
        check(dev, inputs, True, d_split=3)
        got = mx.mhc_mixes(x.to(dev), fn.to(dev), scale.to(dev), base.to(dev), NORM_EPS, HC_EPS, ITERS)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6 if dev == "cpu" else 2e-4)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 2])
def test_mhc_mix_early_loads_same_bits(dev, t, monkeypatch, rng):
    """EARLY_LOADS (decode: fn slices requested before the activations in the main kernel; the
    x_hat row and norm weight before the Sinkhorn chain in the coefficient kernel) changes only
    when loads are issued: every output, the rms_norm of x_hat included, is bit-identical to the
    default order (narrow tiles, one BLOCK_D slice per chunk at d = 192; and the reference check)."""
    monkeypatch.setattr(mm, "_COEF_MODE", [(False, True)])
    inputs = make_inputs(rng, t, 192)
    x, y, post, comb, pre, fn, scale, base = (v.to(dev) for v in inputs)
    nw = (torch.rand(192, generator=rng) + 0.5).to(dev)
    check(dev, inputs, True, early=True, d_split=3)
    for norm in (None, (nw, 1e-6)):
        outs = [mm.mhc_mix(x, y, post, comb, pre, fn, scale, base, NORM_EPS, HC_EPS, ITERS, norm=norm, early=e,
                           block_d=64 if dev == "cpu" else None, d_split=3) for e in (False, True)]
        flat = [[a, *b, *a2] for a, b, *a2 in [(o[0], o[2], o[1], *o[3:]) for o in outs]]
        assert len(flat[0]) == len(flat[1]) == (5 if norm is None else 6)
        for a, b in zip(*flat):
            assert torch.equal(a.cpu(), b.cpu())


def test_mhc_coef_mode_rejects_unknown(monkeypatch):
    monkeypatch.setattr(mm, "_COEF_MODE", [])
    monkeypatch.setenv("DSV41_MHC_COEF", "sideways")
    with pytest.raises(ValueError, match="DSV41_MHC_COEF"):
        mm.coef_mode()


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t", [1, 64, 300])
@pytest.mark.parametrize("kw", [dict(sized_tiles=False), {}, dict(tdot=True)], ids=["table", "default", "tdot"])
def test_mhc_mix_real_width(dev, t, kw, rng):
    """At the model's width: the table's tiles, the defaults (`tiles_for`: the decode rule up to 64
    tokens, the prefill rule above) and the transposed projection on the table's tiles at every T."""
    check(dev, make_inputs(rng, t, 5120), True, **kw)


@pytest.mark.parametrize("dev", DEVICES)
def test_mhc_mix_via_registry(dev, monkeypatch, rng):
    from dsv41.backends import ops, registry

    impl, used, reason = registry.resolve("mhc_mix", "cuda")
    assert (impl, used) == (mm.mhc_mix, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")
    x, y, post, comb, pre, fn, scale, base = make_inputs(rng, 3, 64)
    got = ops.mhc_mix(x.to(dev), y.to(dev), post.to(dev), comb.to(dev), pre.to(dev), fn.to(dev),
                      scale.to(dev), base.to(dev), NORM_EPS, HC_EPS, ITERS)
    want = ref.mhc_mix(x, y, post, comb, pre, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    assert_bf16_close(got[0], want[0], ref.mhc_update(x.float().abs(), y.float().abs(), post, comb))
    torch.testing.assert_close(got[2][0].cpu(), want[2][0], rtol=1e-5, atol=1e-6)


def test_mhc_mix_rejects_bad_shapes():
    with pytest.raises(ValueError):
        mm.mhc_mix(torch.zeros(2, 3, 8), torch.zeros(2, 8), torch.zeros(2, 3), torch.zeros(2, 3, 3),
                   torch.zeros(2, 3), None, None, None, NORM_EPS, HC_EPS, ITERS)
