"""The grouped tensor-core MoE path (npu_ops/triton/moe_grouped.py) against the fp64 reference.

Interpreter variants at small widths and `gpu`-marked compiled variants at model widths: 5..64
tokens (decode batches) and a prefill size; repeated expert ids across tokens, skipped (-1)
slots, experts with no rows; every scratch and output buffer poisoned (NaN / -1) before the
call, so a row or block the kernels leave unwritten, or a padded row they read, shows up.
The reference runs in the official numerics mode, whose rounding points (the w1 / w3 outputs,
the weighted SwiGLU product, each expert's output: bf16) the kernels follow. Bound as
tests/test_triton_block_linear.py: exact products, fp32 sums (a sum next to a bf16 or FP8
rounding boundary can move a rare value by one step: 1e-4 in norm).
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from test_triton_block_linear import weight  # noqa: E402  (the random weights in storage formats)

from dsv41.backends.reference import moe  # noqa: E402
from dsv41.npu_ops.triton import moe_experts as me  # noqa: E402
from dsv41.npu_ops.triton import moe_grouped as mg  # noqa: E402

tl = triton.language
pytestmark = [cuda_only, pytest.mark.usefixtures("official_reference")]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output"
    assert want.norm() > 0
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the grouped path allocates starts as NaN (floats) or -1 (integers)."""
    def poison(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan") if dtype.is_floating_point else -1)

    monkeypatch.setattr(mg, "_buffer", poison)



def check(dev, fmt, t, n_exp, topk, d, inter, rng, used=None, **tiles):
    """moe_experts through the grouped path against the reference; `used`: the experts ids are
    drawn from (the others get no rows)."""
    used = n_exp if used is None else used
    x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(used, generator=rng)[:topk] for _ in range(t)])
    ids[::3, -1] = -1  # slots another model-parallel rank holds
    if t > 4:
        ids[1] = ids[0]  # two tokens with the same experts
    w = torch.rand(t, topk, generator=rng) + 0.1
    ex = [(weight(fmt, inter, d, rng), weight(fmt, d, inter, rng), weight(fmt, inter, d, rng)) for _ in range(n_exp)]
    want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    dex = [tuple((a.to(dev), None if b is None else b.to(dev)) for a, b in e) for e in ex]
    tiles = dict({"path": "grouped"}, **tiles)  # callers may name another path (test_triton_moe_fold.py)
    got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64, **tiles)
    assert got.dtype == torch.float32 and got.shape == (t, d)
    err = rel_err(got, want)
    # The official rounding points turn fp32-vs-fp64 summation noise (~2^-24 sqrt(K) of a sum)
    # into rare flips: a w1 / w3 output next to a bf16 boundary rounds the other way (about 5e-4
    # of them at K = 1024), moving h by 2^-8, which moves its FP8 code in about 1 of 16 cases
    # (2^-4 of that element): 2-3e-4 in norm at model widths (H200, 2026-12-01), 1e-4 at
    # the interpreter's small widths. Without the rounding points the error is ~1e-2.
    bound = 1e-4 if max(d, inter) <= 256 else 5e-4
    assert err < bound, f"{tiles['path']} moe {fmt} T={t}: rel err {err:.2e}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_grouped_formats(dev, fmt, rng, poisoned):
    check(dev, fmt, 6, 5, 2, 64, 64, rng)
    check(dev, fmt, 7, 3, 2, 96, 64, rng, swap=True, bk=64)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [5, 17, 40])
@pytest.mark.parametrize("swap", [False, True])
def test_grouped_decode_batches(dev, t, swap, rng, poisoned):
    """5..64 tokens: several blocks per expert, partial blocks, experts 6 and 7 without rows;
    both dot orientations."""
    check(dev, "fp4", t, 8, 3, 64, 96, rng, used=6, swap=swap)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("swap", [False, True])
def test_grouped_predequantised(dev, swap, rng, poisoned):
    """The prefill form: FP4 experts written out as bf16 once (scales folded), then the bf16
    GEMMs with x and the w2 input still FP8-quantised."""
    check(dev, "fp4", 20, 4, 2, 64, 128, rng, used=3, predequant=True, swap=swap)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fill_tile", [(32, 256, 4), (64, 64, 4), (64, 128, 8), (64, 96, 4)])
def test_predequantised_weights_exact(dev, fill_tile, rng, poisoned, monkeypatch):
    """The bf16 scratch holds every expert's w1, w3, w2 exactly (the reference's values), for
    square and oblong fill tiles, and for a tile that does not divide the widths (32 x 32 then)."""
    from dsv41.backends.reference.basic import dequant_weight

    monkeypatch.setattr(mg, "FILL_TILE", fill_tile)
    d, inter = 512, 256
    ex = [(weight("fp4", inter, d, rng), weight("fp4", d, inter, rng), weight("fp4", inter, d, rng)) for _ in range(3)]
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    # (the tensors' own device: "cuda" alone would not equal their "cuda:0")
    scratch, _ = mg.predequantised(me._expert_table(dex, dex[0][0][0].device), dev == "cpu")
    scratch = scratch.cpu().double()
    for i, ((w1, s1), (w2, s2), (w3, s3)) in enumerate(ex):
        assert torch.equal(scratch[i, 0].reshape(inter, d), dequant_weight(w1, s1).double())
        assert torch.equal(scratch[i, 1].reshape(inter, d), dequant_weight(w3, s3).double())
        assert torch.equal(scratch[i, 2].reshape(d, inter), dequant_weight(w2, s2).double())


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_ragged_tiles(dev, rng, poisoned):
    """N tiles wider than what is left of the matrix (the masked weight loads; the model's widths
    divide the tiles and take the unmasked ones)."""
    check(dev, "fp4", 9, 4, 2, 64, 96, rng, bn_up=64, bn_down=128)


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_several_align_chunks(dev, rng, poisoned):
    """Rows spread over several align chunks (the count pass, then prefix sums across chunks),
    K and N over several tiles."""
    check(dev, "fp4", 70, 4, 2, 128, 64, rng, chunk=16, bk=32)


@pytest.mark.parametrize("dev", DEVICES)
def test_align_rows(dev, rng, poisoned):
    """Blocks cover each expert's rows in flat order, padded to BM; -1 and absent experts skipped."""
    n_exp, bm = 7, 16
    ids = torch.randint(-1, n_exp - 2, (123,), generator=rng)
    for chunk in (None, 16):
        rows, bexp, bcnt = (v.cpu() for v in mg.align_rows(ids.to(dev), n_exp, bm, chunk))
        got = {}
        for b in range(bexp.numel()):
            if bexp[b] >= 0:
                assert 0 < bcnt[b] <= bm
                got.setdefault(int(bexp[b]), []).extend(rows[b * bm:b * bm + int(bcnt[b])].tolist())
            else:
                assert bcnt[b] == 0
        want = {e: (ids == e).nonzero().flatten().tolist() for e in range(n_exp) if (ids == e).any()}
        assert got == want
        used = bexp[bexp >= 0]
        assert (used[1:] >= used[:-1]).all()  # experts in ascending order, blocks contiguous


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("chunk", [None, 32])
def test_sort_rows(dev, chunk, rng, poisoned):
    """The tiled path's expert order: a stable sort of the ids (-1 and absent experts left out)
    and each expert's segment bounds, in one or several chunks."""
    n_exp = 9
    ids = torch.randint(-1, n_exp - 2, (150,), generator=rng)
    perm, bounds = (v.cpu().long() for v in mg.sort_rows(ids.to(dev), n_exp, chunk))
    keep = (ids >= 0).nonzero().flatten()
    order = keep[torch.sort(ids[keep], stable=True).indices]
    assert torch.equal(perm[:order.numel()], order)
    want = torch.searchsorted(torch.sort(ids[keep]).values, torch.arange(n_exp + 1))
    assert torch.equal(bounds, want)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.arange(0, BN)
    j = tl.arange(0, BK // 2)
    for k0 in range(0, K, BK):
        lo, hi = mg.fp4_tiles(w_ptr, s_ptr, rn, rn < N, k0, K, K // 2, K // 32, BN, BK, False)
        base = out_ptr + rn[:, None] * K + k0 + 2 * j[None, :]
        tl.store(base, lo, mask=(rn < N)[:, None])
        tl.store(base + 1, hi, mask=(rn < N)[:, None])


def every_code_weight(max_byte: int, blocks: int):
    """A packed FP4 weight (int8 [n, 16 * blocks], E8M0 [n, blocks]) whose 32-wide blocks each
    hold the 16 E2M1 codes twice, with scale bytes 1..max_byte in row-major block order
    (max_byte a multiple of blocks)."""
    k = 32 * blocks
    codes = torch.arange(k) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(torch.int8)
    n = max_byte // blocks
    return packed.repeat(n, 1), torch.arange(1, max_byte + 1, dtype=torch.uint8).reshape(n, blocks).view(
        torch.float8_e8m0fnu)


@pytest.mark.parametrize("dev", DEVICES)
def test_fp4_dequant_scale_range(dev, rng):
    """Every E2M1 code with scale bytes 1..240 folds exactly wherever the result is an fp32-normal
    number (>= 2^-126): bit-equal to the reference dequantisation; smaller results stay below
    2^-125 (module docstring: they may round or flush)."""
    w, s = every_code_weight(240, 16)
    n, k = w.shape[0], w.shape[1] * 2
    from dsv41.backends.reference.basic import dequant_weight

    want = dequant_weight(w, s).double()
    out = torch.full((n, k), float("nan"), dtype=torch.float32, device=dev)
    _dequant_kernel[(1,)](w.view(torch.uint8).to(dev), s.view(torch.uint8).to(dev), out, n, k, BN=16, BK=64)
    got = out.cpu().double()
    normal = want.abs() >= 2.0 ** -126
    assert torch.equal(got[normal], want[normal])
    assert (got[~normal].abs() <= 2.0 ** -125).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [5, 8, 33, 64, 300, 2048])
@pytest.mark.parametrize("swap", [False, True])
def test_grouped_model_shapes_gpu(dev, t, swap, rng, poisoned):
    check(dev, "fp4", t, 16, 6, 1024, 512, rng, used=14, swap=swap)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("predequant", [False, True])
def test_grouped_prefill_gpu(dev, predequant, rng, poisoned):
    """A prefill-sized call at model-like widths, in-loop dequantisation against the bf16 scratch."""
    check(dev, "fp4", 1500, 16, 6, 1024, 512, rng, used=16, predequant=predequant)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_grouped_other_formats_gpu(dev, fmt, rng, poisoned):
    check(dev, fmt, 48, 4, 2, 1024, 512, rng)
    check(dev, fmt, 700, 4, 2, 1024, 512, rng, swap=True)


@pytest.mark.parametrize("dev", DEVICES)
def test_default_dispatch_reaches_the_scratch_path(dev, rng, poisoned, monkeypatch):
    """Where `scratch_pays` holds, `moe_experts` without `path` runs the grouped path with the
    bf16 scratch and equals the reference (forced here, so the interpreters check the dispatch
    itself: the call a CUDA prefill takes)."""
    calls = []
    real = mg.predequantised
    monkeypatch.setattr(mg, "predequantised", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(me, "scratch_pays", lambda *a: True)
    d, inter, n_exp, topk, t = 64, 64, 3, 2, 9
    ex = [(weight("fp4", inter, d, rng), weight("fp4", d, inter, rng), weight("fp4", inter, d, rng))
          for _ in range(n_exp)]
    x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    w = torch.rand(t, topk, generator=rng) + 0.1
    want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64)
    assert calls, "the default dispatch did not take the scratch path"
    err = rel_err(got, want)
    assert err < 1e-4, f"default dispatch to the scratch path: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
def test_default_path_prefill_gpu(dev, rng, poisoned, monkeypatch):
    """Without `path`, a prefill-sized FP4 call goes through the bf16 scratch (the dispatch in
    `moe_experts`) and equals the reference; a decode-sized call does not allocate the scratch."""
    calls = []
    real = mg.predequantised
    monkeypatch.setattr(mg, "predequantised", lambda *a: calls.append(1) or real(*a))
    d, inter, n_exp, topk = 1024, 512, 16, 6
    ex = [(weight("fp4", inter, d, rng), weight("fp4", d, inter, rng), weight("fp4", inter, d, rng))
          for _ in range(n_exp)]
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    for t, scratch in ((64, False), (n_exp * mg.PREDEQUANT_MIN_ROWS // topk + 3, True)):
        calls.clear()
        x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
        w = torch.rand(t, topk, generator=rng) + 0.1
        want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
        got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64)
        assert bool(calls) == scratch, f"T={t}: scratch used {bool(calls)}, expected {scratch}"
        err = rel_err(got, want)
        assert err < 1e-4, f"default moe path T={t}: rel err {err:.2e}"


def _slicing_case(dev, rng, t, n_exp, topk, d, inter):
    """Random FP4 experts and routing for the slicing tests (device copies)."""
    x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    ids[::4, 0] = -1
    w = torch.rand(t, topk, generator=rng) + 0.1
    ex = [(weight("fp4", inter, d, rng), weight("fp4", d, inter, rng), weight("fp4", inter, d, rng))
          for _ in range(n_exp)]
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    return x, w, ids, ex, dex


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("predequant", [False, True])
def test_grouped_slices_and_expert_groups_same_bits(dev, predequant, rng, poisoned):
    """Token passes over reused buffers and expert groups of the scratch give the same bits as one
    pass over every expert (the tiles are the whole call's), and equal the reference."""
    x, w, ids, ex, dex = _slicing_case(dev, rng, 23, 5, 2, 64, 64)
    args = (x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64)
    whole = me.moe_experts(*args, path="grouped", predequant=predequant, slice_tokens=1 << 20, expert_group=5)
    want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    assert rel_err(whole, want) < 1e-4
    for s_tok, group in ((7, 2), (1, 1), (23, 3), (10, 5)):
        got = me.moe_experts(*args, path="grouped", predequant=predequant, slice_tokens=s_tok, expert_group=group)
        assert torch.equal(got, whole), f"slice_tokens={s_tok}, expert_group={group} changed the result"
    bm = mg.TILES["interp"]["bm"] if dev == "cpu" else mg.tiles_for(23, 2, False)["bm"]
    for split in (2, 4) if dev == "cpu" else (1,):  # the down GEMM over sub-blocks of each row block
        got = me.moe_experts(*args, path="grouped", predequant=predequant, down_split=split, slice_tokens=7)
        assert torch.equal(got, whole), f"down_split={split} (BM {bm}) changed the result"
    with pytest.raises(ValueError, match="down_split"):
        me.moe_experts(*args, path="grouped", down_split=3)


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_slices_bound_buffers(dev, rng, monkeypatch):
    """With passes of S tokens and scratch groups of G experts, no buffer of the call grows with
    the token count beyond S tokens' rows (h, y) and the scratch holds G experts."""
    sizes = []
    real = mg._buffer

    def record(shape, dtype, device):
        sizes.append((tuple(shape), dtype))
        return real(shape, dtype, device)

    monkeypatch.setattr(mg, "_buffer", record)
    t, n_exp, topk, d, inter = 40, 5, 2, 64, 64
    x, w, ids, _, dex = _slicing_case(dev, rng, t, n_exp, topk, d, inter)
    me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64, path="grouped", predequant=True,
                   slice_tokens=8, expert_group=2)
    bm = mg.TILES["interp"]["bm"] if dev == "cpu" else mg.tiles_for(t, topk, False)["bm"]
    floats = [s for s, dt in sizes if dt.is_floating_point]
    assert (2, 3, inter * d) in floats, floats  # the scratch: two experts
    assert (8 * topk, d) in floats  # y: one pass of 8 tokens
    rows_max = (-(-8 * topk // bm) + min(n_exp, 8 * topk)) * bm
    assert (rows_max, inter) in floats  # h: one pass's padded blocks
    assert all(s[0] <= max(rows_max, 8 * topk, 2) for s in floats), floats


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
def test_grouped_prefill_slices_same_bits_gpu(dev, rng, poisoned):
    """At model-like widths on the device: the default passes and scratch groups give the same
    bits as one pass over the whole scratch, and equal the reference."""
    x, w, ids, ex, dex = _slicing_case(dev, rng, 1500, 16, 6, 1024, 512)
    args = (x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64)
    whole = me.moe_experts(*args, path="grouped", predequant=True, slice_tokens=1 << 20, expert_group=16)
    assert rel_err(whole, moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)) < 1e-4
    for s_tok, group in ((None, None), (512, 3), (700, 1)):
        got = me.moe_experts(*args, path="grouped", predequant=True, slice_tokens=s_tok, expert_group=group)
        assert torch.equal(got, whole), f"slice_tokens={s_tok}, expert_group={group} changed the result"
    assert mg.tiles_for(1500, 6, False)["down_split"] == 2  # the default here: 64-row halves
    got = me.moe_experts(*args, path="grouped", predequant=True, down_split=1)
    assert torch.equal(got, whole), "the down GEMM over whole 128-row blocks changed the result"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 5, 70])
def test_one_fp8_expert_as_linears(dev, t, rng, monkeypatch):
    """One FP8 expert routed top-1 (the shared expert) through the dense FP8 linears: the
    reference's values (routing weights other than 1, rows of another rank's slot), as bf16; on CUDA
    the default path for it; a call that is not one FP8 expert top-1 is refused."""
    ex = [(weight("fp8", 96, 128, rng), weight("fp8", 128, 96, rng), weight("fp8", 96, 128, rng))]
    x = (torch.randn(t, 128, generator=rng) * 2).to(torch.bfloat16)
    w = torch.rand(t, 1, generator=rng) + 0.1
    ids = torch.zeros(t, 1, dtype=torch.long)
    ids[1::3] = -1  # rows another rank's slot holds (row 0 always computed)
    want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64, path="linears")
    # one expert's sum is its bf16 output: returned as it is (no widening launch)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 128)
    assert rel_err(got, want) < 1e-4, f"linears T={t}: rel err {rel_err(got, want):.2e}"
    assert (got[1::3] == 0).all()
    fp4 = [tuple((a.to(dev), b.to(dev)) for a, b in
                 (weight("fp4", 64, 128, rng), weight("fp4", 128, 64, rng), weight("fp4", 64, 128, rng)))]
    x = torch.randn(t, 128, generator=rng).to(torch.bfloat16).to(dev)
    one, zero = torch.ones(t, 1, device=dev), torch.zeros(t, 1, dtype=torch.long, device=dev)
    with pytest.raises(ValueError, match="one FP8 expert"):
        me.moe_experts(x, one, zero, fp4, 10.0, path="linears")
    if dev == "cuda":  # the default dispatch takes it for one FP8 expert top-1, not for two experts
        taken = []
        run = me._one_expert_linears
        monkeypatch.setattr(me, "_one_expert_linears", lambda *a: taken.append(1) or run(*a))
        fp8 = [tuple((a.to(dev), b.to(dev)) for a, b in
                     (weight("fp8", 96, 128, rng), weight("fp8", 128, 96, rng), weight("fp8", 96, 128, rng)))]
        me.moe_experts(x, one, zero, fp8, 10.0)
        me.moe_experts(x, one, zero, fp8 * 2, 10.0)
        assert taken == [1]
