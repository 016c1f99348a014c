"""The fused decode-path kernels (rope_tables, table_rows, window_rows, compress_rows, rope_store_kv,
rope_store_key, unrope_grouped_linear, engram_hash, indexer_queries) against the
compositions they stand for (backends/fused.py, on the reference ops), and the registry's
handling of fused ops (a composition is no fallback, on any backend).

Interpreter variants on CPU and `gpu`-marked compiled variants at model widths.
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import fused, ops, paging, registry  # noqa: E402
from dsv41.backends.reference import basic, quant  # noqa: E402
from dsv41.npu_ops.triton import engram_hash as eh  # noqa: E402
from dsv41.npu_ops.triton import rope as rp  # noqa: E402
from dsv41.npu_ops.triton import rope_store_key as rk  # noqa: E402
from dsv41.npu_ops.triton import rope_store_kv as rs  # noqa: E402
from dsv41.npu_ops.triton import table_rows as tr  # noqa: E402
from dsv41.npu_ops.triton import unrope_grouped_linear as ug  # noqa: E402

pytestmark = cuda_only

# bf16 outputs: one bf16 step of the largest element is 2^-8 of it; allow two
BF16_REL = 2 * 2.0**-8


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got - want).abs().max() / want.abs().max()).item()


def strided_pool(rows: int, width: int, dtype: torch.dtype, pad: int) -> torch.Tensor:
    """A [rows, width] pool whose rows are `pad` bytes apart beyond their width (a field of a
    page record), filled with 0xFF bytes."""
    return torch.full((rows, width + pad), 0xFF, dtype=torch.uint8)[:, :width].view(dtype)


@pytest.mark.parametrize("dev", DEVICES)
def test_rope_tables_kernel(dev, rng):
    """One launch, against the torch angle-sum version and the fp64 reference, positions from
    -2^20 to 2^20 - 1."""
    from dsv41.backends.rope_tables import rope_tables as torch_tables

    f = torch.rand(16, generator=rng) * 0.1
    pos = torch.cat([torch.arange(-70, 70), torch.randint(-2**20, 2**20, (300,), generator=rng),
                     torch.tensor([-2**20, 2**20 - 1])])
    cos, sin = rp.rope_tables(f.to(dev), pos.to(dev))
    tcos, tsin = torch_tables(f, pos)
    rcos, rsin = basic.rope_tables(f, pos)
    assert cos.shape == rcos.shape and cos.dtype == torch.float32
    assert (cos.cpu() - tcos).abs().max() < 1e-6 and (sin.cpu() - tsin).abs().max() < 1e-6
    assert (cos.cpu() - rcos).abs().max() < 4e-7 and (sin.cpu() - rsin).abs().max() < 4e-7


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("null_invalid", [False, True])
def test_table_rows_kernel(dev, null_invalid, rng):
    """Equal to the torch arithmetic: negative indices, indices past the table's last block
    (clamped to it), null blocks, [T] and [T, S] indices, a row-strided table."""
    t, nb, per = 5, 6, 4
    table = torch.randint(0, 9, (t, nb + 3), generator=rng)[:, :nb]
    table[0, 1] = 0
    for shape in ((t, 1), (t, 11)):
        idx = torch.randint(-3, nb * per + 6, shape, generator=rng)
        idx[0, 0], idx[-1, -1] = -1, 5  # (a masked and a held entry in every case)
        want = paging.table_rows_torch(table, per, idx, null_invalid=null_invalid)
        got = tr.table_rows(table.to(dev), per, idx.to(dev), null_invalid=null_invalid)
        assert got.dtype == torch.long and torch.equal(got.cpu(), want)
        assert (want == -1).any() and (want >= 0).any()


@pytest.mark.parametrize("dev", DEVICES)
def test_window_rows_kernel(dev, rng):
    """Equal to the torch composition: windows reaching before the floor, past hi (a draft
    block's), before position 0, into null blocks; the floor a column of a [T, 3] tensor."""
    t, nb, per, width = 6, 5, 4, 7
    table = torch.randint(0, 9, (t, nb), generator=rng)
    table[1, 0] = 0
    hi = torch.randint(0, nb * per, (t,), generator=rng)
    lo = hi - width + 1 + torch.randint(0, 3, (t,), generator=rng)
    floors = torch.randint(0, 6, (t, 3), generator=rng)
    want = paging.window_rows_torch(table, per, lo, hi, floors[:, 1], width)
    got = tr.window_rows(table.to(dev), per, lo.to(dev), hi.to(dev), floors.to(dev)[:, 1], width)
    assert got.dtype == torch.long and torch.equal(got.cpu(), want)
    assert (want == -1).any() and (want >= 0).any()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2, 4, 3])
def test_compress_rows_kernel(dev, ratio, rng):
    """Equal to the torch arithmetic: negative positions (floor division), entries held already
    (p < glob_from), groups reaching before position 0, every position's remainder."""
    t, nb, per = 9, 6, 4
    gt, st = torch.randint(0, 9, (t, nb), generator=rng), torch.randint(0, 9, (t, nb + 2), generator=rng)[:, :nb]
    pos = torch.cat([torch.tensor([-5, -1, 0, ratio - 1, 4 * ratio - 1]), torch.randint(1, nb * per, (t - 5,),
                                                                                       generator=rng)])
    glob_from = torch.randint(0, 8, (t,), generator=rng)
    glob_from[3], glob_from[4] = 0, 4 * ratio  # an entry written, an entry held already
    want = paging.compress_rows_torch(pos, glob_from, gt, per, st, per, ratio)
    got = tr.compress_rows(pos.to(dev), glob_from.to(dev), gt.to(dev), per, st.to(dev), per, ratio)
    assert got[0].dtype == torch.bool and want[0].any() and (ratio == 1 or not want[0].all())
    for g, w in zip(got, want):
        assert (g is None and w is None and ratio == 1) or torch.equal(g.cpu(), w)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("n,heads", [(4, 8), (3, 2), (2, 1), (4, 3)])
@pytest.mark.parametrize("m", [1, 37, 130])
def test_engram_hash_kernel(dev, n, heads, m, rng):
    """Equal to the composition (validity, token map, `engram_window_row_ids`): int64 products
    that wrap, negative hashes (the remainder follows the divisor), slots before the start and
    on or behind an image token hashing as the pad id, the model's primes; one decode position,
    a partial tile and several tiles, row counts that are and are not powers of two."""
    from dsv41.core.config import preset
    from dsv41.core.engram import engram_primes

    vocab = 300
    ids = torch.randint(-1, vocab, (m, n), generator=rng)
    image = torch.rand(m, n, generator=rng) > 0.85
    ids[0, -1] = -1  # a slot before the start, and (below) an image token, in every case
    image[-1, 0] = m > 1  # (one position: its other slots hash as tokens)
    token_map = torch.randint(0, 50_000, (vocab,), generator=rng)
    mult = torch.randint(-2**62, 2**62, (n,), generator=rng)
    primes = torch.randint(1_000, 2**31, ((n - 1) * heads,), generator=rng)
    cfg = preset("tiny")
    if (n - 1) * heads == len(engram_primes(cfg)[0]):
        primes = torch.tensor(engram_primes(cfg)[0], dtype=torch.long)
    want = fused.engram_hash(ids, image, token_map, mult, primes, 7, heads)
    got = eh.engram_hash(ids.to(dev), image.to(dev), token_map.to(dev), mult.to(dev), primes.to(dev), 7, heads)
    assert got.dtype == torch.long and torch.equal(got.cpu(), want)
    assert ((want - (torch.cumsum(primes, 0) - primes)) < primes).all()


def _store_case(rng, t, h, d, r, pad):
    q = torch.randn(t, h, d, generator=rng).to(torch.bfloat16)
    kv = (torch.randn(t, d, generator=rng) * torch.exp2(torch.randint(-6, 7, (t, 1), generator=rng).float()))
    w = (torch.rand(d, generator=rng) + 0.5).to(torch.bfloat16)
    ang = torch.randn(t, r // 2, generator=rng) * 3
    pools = (strided_pool(4 * t + 3, d, torch.float8_e4m3fn, pad), strided_pool(4 * t + 3, d // 32,
                                                                                    torch.float8_e8m0fnu, pad))
    rows = torch.randperm(4 * t + 3, generator=rng)[:t]
    return q, kv.to(torch.bfloat16), w, ang.cos(), ang.sin(), pools, rows


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,h,d,r,pad", [(1, 4, 64, 32, 0), (5, 3, 96, 32, 16), (2, 16, 128, 64, 8)])
def test_rope_store_kv_kernel(dev, t, h, d, r, pad, rng):
    """The query equals the composition's bit for bit (the same rope arithmetic); the window
    entries written (codes and scales, at the given rows of a row-strided pool, nothing else
    touched) agree with the composition's: bytes equal except where the norm's fp32 sum, summed
    in another order, moves one bf16 rounding (one FP8 step, dequantised within 2^-3)."""
    q, kv, w, cos, sin, (pk, ps), rows = _store_case(rng, t, h, d, r, pad)
    want_k, want_s = pk.clone(), ps.clone()
    want_q = fused.rope_store_kv(q, kv, w, 1e-6, cos, sin, want_k, want_s, rows)
    got_k, got_s = pk.clone().to(dev), ps.clone().to(dev)
    got_q = rs.rope_store_kv(q.to(dev), kv.to(dev), w.to(dev), 1e-6, cos.to(dev), sin.to(dev), got_k, got_s,
                             rows.to(dev))
    assert torch.equal(got_q.cpu(), want_q)
    gk, wk = got_k.cpu().view(torch.uint8), want_k.view(torch.uint8)
    assert torch.equal(got_s.cpu().view(torch.uint8), ps.view(torch.uint8).clone().index_copy_(
        0, rows, want_s.view(torch.uint8)[rows]))  # scales, and nothing outside the rows changed
    assert torch.equal(gk[~torch.isin(torch.arange(gk.shape[0]), rows)], wk[~torch.isin(torch.arange(gk.shape[0]), rows)])
    assert (gk[rows] == wk[rows]).float().mean() >= 0.99
    deq = lambda k, s: quant.fp8_dequant(k[rows], s[rows])  # noqa: E731
    assert max_rel(deq(got_k.cpu(), got_s.cpu()), deq(want_k, want_s)) <= 2.0**-3


@pytest.mark.parametrize("dev", DEVICES)
def test_rope_store_kv_row_strided_kv(dev, rng):
    """kv rows read at their stride (the stacked wq_a / wkv output's view): the same query and
    the same pool bytes as with the contiguous copy."""
    t, h, d, r = 4, 3, 96, 32
    q, kv, w, cos, sin, (pk, ps), rows = _store_case(rng, t, h, d, r, 8)
    wide = torch.cat([torch.randn(t, 64, generator=rng).to(torch.bfloat16), kv], dim=1).to(dev)
    outs = []
    for kv_in in (wide[:, 64:], wide[:, 64:].contiguous()):
        k_, s_ = pk.clone().to(dev), ps.clone().to(dev)
        got_q = rs.rope_store_kv(q.to(dev), kv_in, w.to(dev), 1e-6, cos.to(dev), sin.to(dev), k_, s_, rows.to(dev))
        outs.append((got_q, k_.view(torch.uint8), s_.view(torch.uint8)))
    assert wide[:, 64:].stride(0) == 64 + d
    for got, want in zip(*outs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,d,r,pad", [(1, 64, 32, 0), (6, 128, 64, 8), (3, 96, 96, 4)])
def test_rope_store_key_kernel(dev, t, d, r, pad, rng):
    """The indexer keys written (packed E2M1 and E8M0 at the given rows of a row-strided pool,
    nothing else touched) agree with the composition's: bytes equal except where the norm's
    fp32 sum, summed in another order, moves one bf16 rounding (one E2M1 step)."""
    _, key, w, cos, sin, _, slots = _store_case(rng, t, 1, d, r, pad)
    codes = strided_pool(4 * t + 3, d // 2, torch.uint8, pad)
    scales = strided_pool(4 * t + 3, d // 32, torch.float8_e8m0fnu, pad)
    want_c, want_s = codes.clone(), scales.clone()
    fused.rope_store_key(key, w, 1e-6, cos, sin, want_c, want_s, slots)
    got_c, got_s = codes.clone().to(dev), scales.clone().to(dev)
    assert rk.rope_store_key(key.to(dev), w.to(dev), 1e-6, cos.to(dev), sin.to(dev), got_c, got_s, slots.to(dev)) is None
    gc, wc = got_c.cpu(), want_c
    others = ~torch.isin(torch.arange(gc.shape[0]), slots)
    assert torch.equal(gc[others], wc[others]) and not torch.equal(gc[slots], codes[slots])
    assert torch.equal(got_s.cpu().view(torch.uint8), want_s.view(torch.uint8))
    assert (gc[slots] == wc[slots]).float().mean() >= 0.99
    deq = lambda c, s: quant.mxfp4_dequant(c[slots], s[slots])  # noqa: E731
    assert max_rel(deq(gc, got_s.cpu()), deq(wc, want_s)) <= 2.0**-2


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,h,d,r,groups,ro", [(1, 4, 64, 32, 2, 32), (1, 8, 128, 64, 4, 64), (3, 8, 64, 16, 4, 16),
                                               (12, 4, 64, 32, 2, 32)])
def test_unrope_grouped_linear_kernel(dev, t, h, d, r, groups, ro, rng):
    """Against the composition on the reference ops (rope back, then the grouped fp64 product):
    within two bf16 steps; one token takes the rows kernel (several programs a group, several
    steps a program in the second case), 12 tokens the composition's path on the device ops."""
    x = torch.randn(t, h, d, generator=rng).to(torch.bfloat16)
    ang = torch.randn(t, r // 2, generator=rng) * 3
    w = (torch.randn(groups * ro, h * d // groups, generator=rng) * 0.05).to(torch.bfloat16)
    want = fused.unrope_grouped_linear(x, ang.cos(), ang.sin(), w, groups)
    got = ug.unrope_grouped_linear(x.to(dev), ang.cos().to(dev), ang.sin().to(dev), w.to(dev), groups)
    assert got.shape == want.shape == (t, groups * ro) and got.dtype == torch.bfloat16
    assert max_rel(got, want) <= BF16_REL
    with pytest.raises(ValueError, match="do not fit"):
        ug.unrope_grouped_linear(x.to(dev), ang.cos().to(dev), ang.sin().to(dev), w.to(dev), 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unrope_grouped_linear_model_widths_gpu(rng):
    """One token at the model's widths (64 heads of 512, 64 rotated, 8 groups of 1024 rows: the
    64 MB `wo_a`, past MAX_WEIGHT_BYTES, on the rows kernel) against the composition."""
    x = torch.randn(1, 64, 512, generator=rng).to(torch.bfloat16)
    ang = torch.randn(1, 32, generator=rng) * 3
    w = (torch.randn(8 * 1024, 4096, generator=rng) * 4096 ** -0.5).to(torch.bfloat16)
    want = fused.unrope_grouped_linear(x, ang.cos(), ang.sin(), w, 8)
    got = ug.unrope_grouped_linear(x.cuda(), ang.cos().cuda(), ang.sin().cuda(), w.cuda(), 8)
    assert max_rel(got, want) <= BF16_REL


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,h,d,r", [(1, 4, 64, 32), (3, 5, 128, 64), (2, 2, 96, 96)])
def test_indexer_queries_kernel(dev, t, h, d, r, rng):
    """Bit for bit the composition (rope, MXFP4 quantise-dequantise, the weight multiply), on
    queries spanning many binades (every E8M0 scale path) with a few zero groups."""
    from dsv41.npu_ops.triton import indexer_queries as iq

    q = torch.randn(t, h, d, generator=rng) * torch.exp2(torch.randint(-20, 20, (t, h, 1), generator=rng).float())
    q[0, 0, :32] = 0.0
    q[-1, -1, :32] = torch.linspace(-11.0, 11.0, 32)
    q[-1, -1, 0] = 12.0  # amax 1.5 * 2^3 exactly: the scale's ceil(log2(amax / 6)) at its edge
    q = q.to(torch.bfloat16)
    ang = torch.randn(t, r // 2, generator=rng) * 3
    w = torch.randn(t, h, generator=rng)
    scale = 128 ** -0.5 * 3 ** -0.5  # not a power of two: the multiply rounds
    want_q, want_w = fused.indexer_queries(q, ang.cos(), ang.sin(), w, scale)
    got_q, got_w = iq.indexer_queries(q.to(dev), ang.cos().to(dev), ang.sin().to(dev), w.to(dev), scale)
    assert got_q.dtype == got_w.dtype == torch.float32 and got_q.shape == (t, h, d) and got_w.shape == (t, h)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_w.cpu(), want_w)
    assert torch.equal(got_q.cpu().view(torch.int32), want_q.view(torch.int32))  # zeros' signs too
    assert not torch.equal(want_q, q.float())  # (the rotation and the quantisation change values)


def test_fused_ops_are_compositions_on_every_backend(monkeypatch):
    """A fused op's reference is its composition; a backend without its kernel runs the
    composition of its own ops (no reference fallback, so allowed under DSV41_STRICT=1); CUDA
    registers the kernels, which run by default (each won on the H200), and when DSV41_FUSED
    names them (the composition under DSV41_FUSED=none)."""
    monkeypatch.setenv("DSV41_STRICT", "1")
    registry.reset_warnings()
    for name in ("rope_store_kv", "rope_store_key", "unrope_grouped_linear", "table_rows", "window_rows",
                 "compress_rows", "engram_hash", "linear_pair", "moe_experts_add"):
        comp = registry.composite_of(name)
        assert comp is (getattr(paging, f"{name}_torch") if name.endswith("_rows") else getattr(fused, name))
        assert registry.resolve(name, "reference")[0] is comp
        monkeypatch.setenv("DSV41_FUSED", "none")
        assert registry.resolve(name, "cuda")[:2] == (comp, "cuda")
        monkeypatch.delenv("DSV41_FUSED", raising=False)
        default = registry.resolve(name, "cuda")[0]
        assert default is not comp, name  # (every one of these won on the H200)
        monkeypatch.setenv("DSV41_FUSED", "all")
        assert registry.resolve(name, "cuda")[1] == "cuda" and registry.resolve(name, "cuda")[0] is not comp
    assert registry.composite_of("rope") is None
    op = registry._OPS["unrope_grouped_linear"]
    saved = op.impls.pop("cuda")  # (DSV41_FUSED=all still set: no kernel, so the composition)
    try:
        registry.reset_warnings()
        fn, used, why = registry.resolve("unrope_grouped_linear", "cuda")
        assert (fn, used) == (fused.unrope_grouped_linear, "cuda") and why.startswith("composition")
    finally:
        op.impls["cuda"] = saved
        registry.reset_warnings()
    assert callable(ops.rope_store_kv) and callable(ops.unrope_grouped_linear)
