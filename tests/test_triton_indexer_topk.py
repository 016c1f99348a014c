"""Triton indexer scores + top-k (npu_ops/triton/indexer_topk.py) against the torch reference.

Interpreter variants (TRITON_INTERPRET=1, small shapes) and `gpu`-marked compiled variants.
Keys are read through block tables: `one_seq` addresses a dense key array as one sequence;
`paged` scatters several sequences' keys over the blocks of one pool (tokens of different
sequences side by side in a launch, so kernel tiles mix sequences).
Scores are compared with a bound relative to the row's largest |score| (the kernel sums in fp32,
the reference in fp64); the selected indices are compared exactly (a) on "exact" inputs where
every score is exact in fp32 (dyadic weights, MXFP4 operands) so ties are real ties in both, and
(b) on random inputs, row by row, wherever the k-th and (k+1)-th scores are clearly separated
(otherwise the chosen score sets are compared).
"""

import types

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import attention as ref_att  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import indexer_topk as itk  # noqa: E402

RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("official_reference")  # (conftest.py)


def random_inputs(g, t, h, d, n, exact=False):
    """MXFP4 queries (quantise-dequantised, as the op's contract says) and keys, head weights.
    exact=True: dyadic weights and no extra key scaling, so every score is exact in fp32."""
    q = quant.mxfp4_qdq(torch.randn(t, h, d, generator=g))
    keys = torch.randn(n, d, generator=g)
    if not exact:
        keys = keys * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
        weights = torch.randn(t, h, generator=g)
    else:
        weights = torch.randint(-4, 5, (t, h), generator=g).float() / 4
        weights[:, 0] = 1.0
    codes, kscale = quant.mxfp4_quant(keys)
    if n > 12:
        for dup in (7, n - 1):  # duplicated keys: exact ties
            codes[dup], kscale[dup] = codes[3], kscale[3]
    return q, weights, codes, kscale


def one_seq(codes, t):
    """(block table, entries per block) addressing pool rows 0..N-1 as one sequence's entries."""
    return torch.zeros(t, 1, dtype=torch.long), codes.shape[0]


def paged(g, seqs, seq_of_token, e):
    """Scatter each sequence's dense keys (codes, scales) over random blocks of e rows of one
    pool (plus unused blocks holding other keys); per-token block tables (rows padded with
    block 0). Returns (pool codes, pool scales, block_table [T, nb])."""
    n_blocks = [-(-c.shape[0] // e) for c, _ in seqs]
    total = sum(n_blocks) + 2
    perm = torch.randperm(total, generator=g)
    di2 = seqs[0][0].shape[1]
    pool_c = torch.randint(0, 256, (total * e, di2), generator=g, dtype=torch.uint8)
    pool_s = torch.randint(100, 140, (total * e, seqs[0][1].shape[1]), generator=g, dtype=torch.uint8)
    tables, used = [], 0
    for (c, sc), nb in zip(seqs, n_blocks):
        blocks = perm[used:used + nb]
        used += nb
        rows = (blocks.repeat_interleave(e) * e + torch.arange(e).repeat(nb))[:c.shape[0]]
        pool_c[rows] = c
        pool_s[rows] = sc.view(torch.uint8)
        tables.append(blocks.tolist())
    width = max(n_blocks)
    table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in seq_of_token])
    return pool_c, pool_s.view(torch.float8_e8m0fnu), table


def assert_scores_close(got, want, valid):
    got, want = got.cpu(), want.cpu()
    assert torch.isneginf(got[~valid]).all(), "masked positions must be -inf"
    g, w = got.masked_fill(~valid, 0), want.masked_fill(~valid, 0)
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((g - w).abs() / scale).max().item()
    assert err <= RTOL, f"max error relative to the row max: {err:.3g}"


def check_topk_rowwise(idx, want_idx, s_ref, valid, k):
    """Exact where the k-th boundary is separated; otherwise equal multisets of scores."""
    idx, want_idx = idx.cpu(), want_idx.cpu()
    assert idx.shape == want_idx.shape and idx.dtype == want_idx.dtype
    for t in range(s_ref.shape[0]):
        v = s_ref[t][valid[t]].sort(descending=True).values
        kk = min(k, v.numel())
        sep = kk == v.numel() or (v[kk - 1] - v[kk]).item() > 1e-4 * v.abs().max().item()
        if sep:
            assert idx[t].tolist() == want_idx[t].tolist(), t
        else:
            sel = idx[t][idx[t] >= 0]
            assert sel.numel() == kk
            torch.testing.assert_close(s_ref[t][sel].sort().values, v[:kk].sort().values,
                                       rtol=0, atol=1e-4 * v.abs().max().item())


# ---- the exact selection helpers (pure torch) ---------------------------------------------------

def test_topk_sorted_equals_stable_sort_with_ties(rng):
    for n, k in ((1, 4), (17, 5), (64, 64), (300, 32)):
        s = torch.randint(-3, 4, (9, n), generator=rng).float()  # many ties
        s[0] = 0.0
        s[1, ::2] = -0.0  # -0.0 ties with +0.0
        s[2] = torch.randn(n, generator=rng)
        nv = torch.randint(0, n + 1, (9,), generator=rng)
        nv[3] = 0
        valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
        valid[4] = torch.rand(n, generator=rng) < 0.5  # arbitrary validity
        assert torch.equal(itk._topk_sorted(s, k, valid), ref_att._stable_topk_sorted(s, k, valid))


def test_candidate_pool_equals_reference(rng):
    t, n = 6, 53
    s = torch.randint(-2, 3, (t, n), generator=rng).float()
    nv = torch.tensor([0, 1, 7, 8, 40, 53])
    s = s.masked_fill(torch.arange(n).unsqueeze(0) >= nv.unsqueeze(1), float("-inf"))
    for blocks, size in ((3, 4), (2, 8), (20, 3), (1, 1)):
        assert torch.equal(itk._candidate_pool(s, nv, blocks, size), ref_att.candidate_pool(s, nv, blocks, size))


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_select_equals_stable_sort(dev, rng):
    """The Triton radix select against the reference's stable sort: many ties, -0.0 / +0.0,
    negative scores, rows with nothing visible, fewer visible than k, k wider than the row."""
    for n, k in ((1, 4), (17, 5), (64, 64), (300, 32), (700, 600)):
        s = torch.randint(-3, 4, (8, n), generator=rng).float()
        s[0] = 0.0
        s[1, ::2] = -0.0  # -0.0 ties with +0.0
        s[2] = torch.randn(n, generator=rng)
        s[3] = -torch.rand(n, generator=rng) * 1e30  # all negative, wide exponents
        s[4] = torch.randn(n, generator=rng) * 1e-38  # subnormals
        nv = torch.randint(0, n + 1, (8,), generator=rng)
        nv[5], nv[6], nv[7] = 0, n, min(n, k)
        valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
        masked = s.masked_fill(~valid, float("-inf"))
        want = ref_att._stable_topk_sorted(s, k, valid)
        assert torch.equal(itk.topk_select(masked.to(dev), nv.to(dev), k).cpu(), want), (n, k)
        for bits in itk.RADIX_BITS_CHOICES:  # every digit width selects the same set, in the same order
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, radix_bits=bits)
            assert torch.equal(got.cpu(), want), (n, k, bits)
        # bounded by chunk maxima (as the scores kernel writes them; min_maxima_per_k=0 forces
        # the bound however few they are), and with a survivor buffer too small for the tied
        # rows (those take the whole-row path); the default skips a bound from too few maxima
        # the survivors selected on a smaller tile than the row's (survivor_block, or its
        # full-tile fallback when they outnumber it), and a survivor buffer smaller than that tile
        # (overflowed rows take the whole-row path, not the tile: the H200 read past the buffer)
        for maxg, cap, per_k, sb in ((1, None, 0, None), (4, None, 0, None), (4, 16, 0, None), (4, None, None, None),
                                     (4, None, 0, 16), (2, None, 0, 32), (4, 16, 0, 32)):
            pad = -(-n // maxg) * maxg - n
            maxima = torch.nn.functional.pad(masked, (0, pad), value=float("-inf")).view(8, -1, maxg).amax(-1)
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, capacity=cap,
                                  min_maxima_per_k=per_k, survivor_block=sb)
            assert torch.equal(got.cpu(), want), (n, k, maxg, cap, per_k, sb)
        # the bound from a few radix passes over the maxima's span (a lower bound, not the exact
        # k-th maximum) and the survivors' select over their span: one to three passes (one is a
        # coarse bound); a tile wide enough for the maxima; survivors on a smaller tile, on the
        # full one, and past a small survivor buffer (the whole-row path)
        for passes, maxg, cap, sb in ((1, 4, None, 64), (2, 2, None, 128), (2, 4, 16, 0), (3, 1, None, 0)):
            pad = -(-n // maxg) * maxg - n
            maxima = torch.nn.functional.pad(masked, (0, pad), value=float("-inf")).view(8, -1, maxg).amax(-1)
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, capacity=cap, block=256,
                                  min_maxima_per_k=0, survivor_block=sb, bound_passes=passes, span=True)
            assert torch.equal(got.cpu(), want), (n, k, maxg, cap, passes, sb)


@pytest.mark.parametrize("dev", DEVICES)
def test_split_select_equals_stable_sort(dev, rng):
    """The split select (a row over several programs, the last one to count selects among the
    parts' survivors) against the reference's stable sort: ties, -0.0 / +0.0, negatives, rows
    with nothing / k visible, too few chunks for the bound (whole-row select), a row whose
    top-k all sit in its last part (the other parts' regions empty); the final select on one
    tile and past it (the looped path), one part, uneven parts, span passes."""
    for n, k in ((300, 32), (700, 100)):
        s = torch.randint(-3, 4, (8, n), generator=rng).float()
        s[0] = 0.0
        s[1, ::2] = -0.0  # -0.0 ties with +0.0
        s[2] = torch.randn(n, generator=rng)
        s[3] = -torch.rand(n, generator=rng) * 1e30  # all negative, wide exponents
        s[4] = torch.arange(n).float() + torch.rand(n, generator=rng)  # the top k at the row's end
        nv = torch.randint(0, n + 1, (8,), generator=rng)
        nv[2], nv[3], nv[4], nv[5], nv[6], nv[7] = n, n, n, 0, min(n, k), k + 3  # k + 3: fewer chunks than k
        valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
        masked = s.masked_fill(~valid, float("-inf"))
        want = ref_att._stable_topk_sorted(s, k, valid)
        maxima = torch.nn.functional.pad(masked, (0, -(-n // 4) * 4 - n), value=float("-inf")).view(8, -1, 4).amax(-1)
        for parts, final, span in ((1, None, False), (3, 16, False), (16, 64, True), (5, None, True)):
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), 4, min_maxima_per_k=0, parts=parts,
                                  survivor_block=final, span=span)
            assert torch.equal(got.cpu(), want), (n, k, parts, final, span)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("parts", [16, 32])
def test_split_select_maxima_per_k(dev, parts, rng):
    """The split select with 4 and 2 chunk maxima per k (a threshold of 2 per k takes both) and
    16 or 32 parts against the reference's stable sort:
    ties with -0.0 / +0.0, random scores, the top k at the row's end, a row with fewer chunks
    than k visible; survivors on the final tile and past it (the looped path)."""
    n, k = 512, 8
    s = torch.randint(-3, 4, (4, n), generator=rng).float()
    s[0, ::2] = -0.0  # ties, and -0.0 ties with +0.0
    s[1] = torch.randn(n, generator=rng)
    s[2] = torch.arange(n).float() + torch.rand(n, generator=rng)  # the top k at the row's end
    nv = torch.tensor([n, n, n - 5, 200])  # 200: fewer chunks than k at 2 maxima per k (32 entries each)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    masked = s.masked_fill(~valid, float("-inf"))
    want = ref_att._stable_topk_sorted(s, k, valid)
    for per_k in (4, 2):
        maxg = n // (per_k * k)
        maxima = masked.view(4, -1, maxg).amax(-1)
        for final in (None, 16) if per_k == 2 else (None,):  # 16: the tied row's survivors take the looped path
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, parts=parts,
                                  survivor_block=final, min_maxima_per_k=2)
            assert torch.equal(got.cpu(), want), (per_k, parts, final)


@pytest.mark.parametrize("dev", DEVICES)
def test_split_select_merged_bound(dev, rng):
    """The split select's bound over merged neighbouring chunk maxima (`_maxima_bound`): with 8
    maxima per k, a full row merges 4 of them, a row with half its entries visible 2, a quarter
    none, fewer chunks than k the whole-row select; the bound each part computes is the k-th
    largest of the merged maxima, and the ids equal the reference's for every merge limit."""
    n, k, maxg = 1024, 8, 16  # 64 maxima: 8 per k
    s = torch.randn(6, n, generator=rng)
    s[4] = torch.randint(-2, 3, (n,), generator=rng).float()  # ties
    s[4, ::3] = -0.0
    s[5] = torch.arange(n).float()  # the top k at the row's end (its last part holds them all)
    nv = torch.tensor([n, 600, 300, 100, n, n])  # 64 / 38 / 19 / 7 visible chunks
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    masked = s.masked_fill(~valid, float("-inf"))
    maxima = masked.view(6, -1, maxg).amax(-1)
    want = ref_att._stable_topk_sorted(s, k, valid)
    for merge in (1, 2, 4):
        for parts in (4, 8):
            got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, parts=parts,
                                  min_maxima_per_k=0, merge=merge)
            assert torch.equal(got.cpu(), want), (merge, parts)
    # the bound itself (STOP=1: each part writes it in its output column)
    out = torch.empty(6, k, dtype=torch.long, device=dev)
    itk._split_select(masked.to(dev), maxima.to(dev), maxg, nv.to(dev), out, k, 4, 64, itk.RADIX_BITS, None,
                      False, None, _stop=1, merge=4)
    for row, f in ((0, 4), (1, 2), (2, 1), (4, 4), (5, 4)):
        g = -(-int(nv[row]) // maxg)
        m = maxima[row, :g]
        m = torch.nn.functional.pad(m, (0, -(-g // f) * f - g), value=float("-inf")).view(-1, f).amax(-1)
        bound = itk.order_keys(m).topk(k).values[-1]
        assert out[row, :4].cpu().tolist() == [int(bound)] * 4, (row, f)
    for parts in (4, 0):  # an invalid merge is refused on the split and the one-program path alike
        with pytest.raises(ValueError, match="merge 3"):
            itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, parts=parts, min_maxima_per_k=0,
                            merge=3)


def bound_hist_ref(maxima, shift):
    """The split select's bound histograms in torch: each row's finite maxima counted by the top
    32 - shift bits of their order keys read unsigned ([T, 2^(32 - shift)] int32)."""
    nbins = 1 << (32 - shift)
    bins = ((itk.order_keys(maxima) ^ -(2**31)) >> shift) & (nbins - 1)
    return torch.stack([torch.bincount(b[torch.isfinite(m)].long(), minlength=nbins)
                        for b, m in zip(bins, maxima)]).int()


def hist_bound_ref(hist, k, shift):
    """`_hist_bound` in torch: the order key at the lower edge of each row's highest bin with at
    least k maxima at or above it (bin 0's edge where none has)."""
    at_or_above = hist.long().flip(-1).cumsum(-1).flip(-1)
    bins = torch.arange(hist.shape[1])
    sel = torch.where(at_or_above >= k, bins, 0).amax(-1)
    return (sel << shift) - 2**31


@pytest.mark.parametrize("dev", DEVICES)
def test_split_select_histogram_bound(dev, rng):
    """The split select's bound from the histogram of the chunk maxima (`_hist_bound`): the ids
    equal the reference's (random scores, ties with -0.0, all-negative wide exponents, the top k
    at the row's end, maxima crowded into the k-th's bin, partly visible rows, a row with fewer
    chunks than k taking the whole-row select); each part's bound is the lower edge of the
    highest bin holding k maxima at or above it; the histogram is zero after every path (the
    split parts, the whole-row select, the one-program kernel)."""
    n, k, maxg = 1024, 8, 16  # 64 maxima: 8 per k
    shift = itk.SPLIT_BOUND_HIST_SHIFT
    s = torch.randn(8, n, generator=rng)
    s[1] = torch.randint(-2, 3, (n,), generator=rng).float()  # ties
    s[1, ::3] = -0.0
    s[2] = -torch.rand(n, generator=rng) * 1e30  # all negative, wide exponents
    s[3] = torch.arange(n).float()  # the top k at the row's end
    s[4] = 1.0 + torch.randperm(n, generator=rng).float() * 2.0**-20  # every maximum in one bin
    nv = torch.tensor([n, n, n, n, n, 600, 300, 100])  # 100: 7 visible chunks, fewer than k
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    masked = s.masked_fill(~valid, float("-inf"))
    maxima = masked.view(8, -1, maxg).amax(-1)
    want = ref_att._stable_topk_sorted(s, k, valid)
    hist = bound_hist_ref(maxima, shift)
    assert int(hist[7].sum()) == 7 and int(hist[4].count_nonzero()) == 1
    for parts in (4, 8, 0):
        h = hist.flatten().to(dev)
        got = itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, parts=parts, min_maxima_per_k=0,
                              hist=h)
        assert torch.equal(got.cpu(), want), parts
        assert not h.cpu().any(), parts
    out = torch.empty(8, k, dtype=torch.long, device=dev)  # the bound itself (STOP=1: each part writes it)
    h = hist.flatten().to(dev)
    itk._split_select(masked.to(dev), maxima.to(dev), maxg, nv.to(dev), out, k, 4, 64, itk.RADIX_BITS, None,
                      False, None, _stop=1, hist=h)
    bound = hist_bound_ref(hist, k, shift)
    for row in range(7):
        assert out[row, :4].cpu().tolist() == [int(bound[row])] * 4, row
        kth = itk.order_keys(maxima[row]).topk(k).values[-1]
        assert bound[row] <= kth, row  # a lower bound of the k-th largest maximum
    assert bound[4] <= itk.order_keys(maxima[4]).min()  # every maximum in one bin: all of them are >= it
    assert not h.cpu().any()
    with pytest.raises(ValueError, match="bound histogram"):
        itk.topk_select(masked.to(dev), nv.to(dev), k, maxima.to(dev), maxg, parts=4, min_maxima_per_k=0,
                        hist=h[:100])


def _mapped_want(s, cand, cb, lim, k):
    """The Reindex selection written out: the stable top-k among the valid candidate columns
    (block >= 0, entry < lim), as entry ids ascending, -1 padded."""
    ent = (cand.long() * cb).repeat_interleave(cb, 1) + torch.arange(cand.shape[1] * cb) % cb
    valid = (cand >= 0).repeat_interleave(cb, 1) & (ent < lim.unsqueeze(1))
    cols = ref_att._stable_topk_sorted(s, k, valid)
    big = 1 << 62
    ids = torch.where(cols >= 0, ent.gather(1, cols.clamp(min=0)), big).sort(-1).values
    return torch.where(ids == big, -1, ids), valid


@pytest.mark.parametrize("dev", DEVICES)
def test_split_select_candidates(dev, rng):
    """The Reindex selection on the split select (MAP: the candidate columns' maxima bound it,
    parts keep valid columns only, the final select stages the ids and puts them in entry-id
    order): candidate blocks in the pool's ascending order with padding last and the newest
    block partly past n_visible, blocks in no order with -1 anywhere, fewer valid entries than
    k, none, ties with -0.0; without n_visible; the final select on one tile and looped; rows
    with fewer chunks than k and with at most k columns (part 0 alone). Equal to the
    reference's selection among valid columns sorted by entry id."""
    t, p, cb, k, maxg = 6, 64, 4, 8, 4
    n = p * cb
    cand = torch.full((t, p), -1, dtype=torch.int32)
    cand[0] = torch.randperm(200, generator=rng)[:p].sort().values.int()
    cand[1, :40] = torch.randperm(100, generator=rng)[:40].sort().values.int()
    cand[2, torch.randperm(p, generator=rng)[:50]] = torch.randperm(300, generator=rng)[:50].int()
    cand[3, 7] = 5  # one valid block: 4 entries, fewer than k
    cand[5] = torch.arange(p, dtype=torch.int32) * 3
    lim = torch.tensor([10 ** 6, int(cand[1, 39]) * cb + 2, 10 ** 6, 22, 10 ** 6, 10 ** 6])  # row 3: 2 of its 4
    s = torch.randn(t, n, generator=rng)
    s[5] = torch.randint(-2, 3, (n,), generator=rng).float()  # ties
    s[5, ::3] = -0.0
    for nvis in (lim, None):
        want, valid = _mapped_want(s, cand, cb, lim if nvis is not None else torch.full((t,), 10 ** 6), k)
        masked = s.masked_fill(~valid, float("-inf"))  # (the scores kernel's -inf at invalid columns)
        maxima = masked.view(t, -1, maxg).amax(-1)
        assert (want[3] >= 0).sum() == (2 if nvis is not None else 4) and (want[4] == -1).all()
        for parts, final, merge in ((4, None, 4), (16, 16, 1), (5, None, 2)):
            got = itk.topk_select(masked.to(dev), None if nvis is None else nvis.to(dev), k, maxima.to(dev), maxg,
                                  candidates=cand.to(dev), candidate_block_size=cb, parts=parts,
                                  survivor_block=final, min_maxima_per_k=0, merge=merge)
            assert torch.equal(got.cpu(), want), (nvis is None, parts, final, merge)
    for p2, k2 in ((4, 20), (16, 20)):  # at most k columns; fewer chunks than k (whole-row select)
        c2 = cand[:, :p2].clone()
        want, valid = _mapped_want(s[:, :p2 * cb], c2, cb, lim, k2)
        masked = s[:, :p2 * cb].masked_fill(~valid, float("-inf"))
        got = itk.topk_select(masked.to(dev), lim.to(dev), k2, masked.view(t, -1, maxg).amax(-1).to(dev), maxg,
                              candidates=c2.to(dev), candidate_block_size=cb, parts=4, min_maxima_per_k=0)
        assert torch.equal(got.cpu(), want), (p2, k2)


@pytest.mark.parametrize("dev", DEVICES)
def test_candidates_take_split_select(dev, rng, monkeypatch):
    """A decode row's Reindex selection over a candidate pool long enough for chunk maxima: the
    gather scores kernel writes them, the split select takes them with the candidates, and the
    ids equal the reference's (exact scores; pool-ordered blocks, the newest partly past
    n_visible, padding last)."""
    seen = []
    split_select = itk._split_select
    monkeypatch.setattr(itk, "_split_select",
                        lambda *a, **kw: seen.append(kw.get("candidates") is not None) or split_select(*a, **kw))
    cb, p, k, e, n = 4, 40, 6, 8, 240
    q, w, codes, kscale = random_inputs(rng, 1, 4, 64, n, exact=True)
    table, e = one_seq(codes, 1)
    nv = torch.tensor([n - 2])
    reach = -(-int(nv[0]) // cb)
    blocks = torch.full((1, p), -1, dtype=torch.int32)
    pick = torch.randperm(reach - 1, generator=rng)[:p - 5].sort().values
    blocks[0, :p - 4] = torch.cat([pick, torch.tensor([reach - 1])]).int()  # the newest last, then padding
    want_idx, _ = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k, candidates=blocks, candidate_block_size=cb)
    got_idx, _ = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev),
                                  k, candidates=blocks.to(dev), candidate_block_size=cb)
    assert torch.equal(got_idx.cpu(), want_idx)
    assert seen == [True]


def test_split_select_dispatch(monkeypatch):
    """The split select serves up to SPLIT_MAX_T rows (fewer parts per row for more rows), not
    Ascend (which keeps the one-program-per-row kernel)."""
    from dsv41.npu_ops.triton import launch

    monkeypatch.setattr(launch, "num_workers", lambda device=None, cores="vector": 132)
    cuda = torch.device("cuda")
    assert itk.select_parts(1, cuda) == itk.SPLIT_PARTS
    assert 1 <= itk.select_parts(itk.SPLIT_MAX_T, cuda) <= itk.SPLIT_PARTS
    assert itk.select_parts(itk.SPLIT_MAX_T + 1, cuda) == 0
    monkeypatch.setattr(itk, "SPLIT_MAX_T", 64)
    room = itk.SPLIT_PROGRAMS_PER_WORKER * 132
    parts = itk.select_parts(64, cuda)  # halved until 64 rows of them fit the program budget
    assert 64 * parts <= room < 64 * parts * 2
    npu = types.SimpleNamespace(type="npu")  # (torch names no "npu" device without torch_npu)
    assert itk.select_parts(1, npu) == 0
    # the scores kernel writes the split select's maxima per k only where that select runs
    monkeypatch.setattr(itk, "SPLIT_MAX_T", 1)
    assert itk.maxima_per_k(1, cuda) == itk.SPLIT_MAXIMA_PER_K
    assert itk.maxima_per_k(2, cuda) == itk.SELECT_MAXIMA_PER_K
    assert itk.maxima_per_k(1, npu) == itk.SELECT_MAXIMA_PER_K
    # a row just past one select tile (no maxima at 8 per k) gets SPLIT_SHORT_MAXIMA_PER_K per k
    # where the split select runs, enough for its bound; elsewhere the chunk is select_chunk's
    k, bn, short = 512, 128, itk.SELECT_BLOCK + 64
    assert itk.select_chunk(short, k, bn, itk.SPLIT_MAXIMA_PER_K) == 1
    g = itk.scores_chunk(1, short, k, bn, cuda)
    assert g == itk.select_chunk(short, k, bn, itk.SPLIT_SHORT_MAXIMA_PER_K) > 1
    assert -(-short // g) >= itk.SPLIT_MAXIMA_MIN_PER_K * k
    assert itk.scores_chunk(2, short, k, bn, cuda) == 1  # batches: the one-program select
    assert itk.scores_chunk(1, short, k, bn, npu) == 1
    assert itk.scores_chunk(1, itk.SELECT_BLOCK, k, bn, cuda) == 1  # one tile: the direct select
    assert itk.scores_chunk(1, 65536, k, bn, cuda) == itk.select_chunk(65536, k, bn, itk.SPLIT_MAXIMA_PER_K)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("per_k", [8, 2])
@pytest.mark.parametrize("bound", ["histogram", "radix"])
def test_split_select_maxima_from_scores(dev, per_k, bound, rng, monkeypatch):
    """The whole op at decode rows with the split select: the scores kernel writes
    SPLIT_MAXIMA_PER_K maxima per k, the split select takes them as its bound (not the
    whole-row select), from their histogram (counted by the scores kernel, zero again after
    the select) or by radix passes over them, and the ids equal the reference's (exact scores,
    ties)."""
    if bound == "radix":
        monkeypatch.setattr(itk, "SPLIT_BOUND_HIST_SHIFT", 0)
    monkeypatch.setattr(itk, "SPLIT_MAX_T", 64)
    monkeypatch.setattr(itk, "SPLIT_MAXIMA_PER_K", per_k)
    monkeypatch.setattr(itk, "SPLIT_MAXIMA_MIN_PER_K", min(per_k, itk.SPLIT_MAXIMA_MIN_PER_K))
    seen = []
    split_select = itk._split_select
    monkeypatch.setattr(itk, "_split_select",
                        lambda *a, **kw: seen.append((a[2], kw.get("hist") is not None)) or split_select(*a, **kw))
    t, n, k, e = 2, 256, 5, 4
    q, w, codes, kscale = random_inputs(rng, t, 4, 64, n, exact=True)
    pc, ps, table = paged(rng, [(codes, kscale)], [0] * t, e)
    nv = torch.tensor([n, 201])
    want_idx, _ = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, k)
    got_idx, _ = itk.indexer_topk(q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, nv.to(dev), k)
    assert torch.equal(got_idx.cpu(), want_idx)
    bn = itk._rows_config(t, 4, n, dev)[2]
    hist_on = itk.SPLIT_BOUND_HIST_SHIFT > 0
    assert seen == [(itk.select_chunk(n, k, bn, per_k), hist_on)] and seen[0][0] > 1
    if hist_on:  # the bound from the scores kernel's histogram, which the select left zero
        assert not itk.bound_histogram(t, torch.device(dev)).any()


# ---- kernel -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,h,d,n", [(1, 4, 64, 40), (5, 4, 64, 200), (3, 8, 128, 150), (2, 3, 96, 70)])
def test_scores_match_reference(dev, t, h, d, n, rng):
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    table, e = one_seq(codes, t)
    nv = torch.randint(1, n + 1, (t,), generator=rng)
    nv[0] = n
    got = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
    want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert_scores_close(got, want, valid)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg,rows", [((8, 2, 32, 3, 4), False), ((16, 1, 16, 2, 4), False), ((4, 8, 64, 4, 8), False),
                                      ((8, 2, 32, 3, 4, 2), False), ((16, 1, 32, 2, 4, 4), False),
                                      ((16, 1, 16, 1, 4), True), ((16, 1, 16, 3, 4), True), ((16, 1, 32, 4, 8), True)])
@pytest.mark.parametrize("layout", ["one_seq", "paged"])
def test_tile_configs(dev, cfg, rows, layout, rng):
    """Padded heads, several key blocks per tile (NSUB > 1), query groups (QSUB, the 6th entry:
    one key decode for the group where its queries share rows, else each sub-tile alone),
    skipped invisible blocks, a token that sees nothing; paged: three sequences in scattered
    blocks of 8 entries, so multi-query tiles mix sequences. Both scores kernels (rows: one query per tile, the next block's keys
    loaded ahead); exact inputs, so scores and chunk maxima equal the reference's bit for bit."""
    t, h, d, n = 5, 4, 64, 333
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=True)
    nv = torch.tensor([n, 1, 0, 100, 200])
    if layout == "one_seq":
        table, e = one_seq(codes, t)
    else:
        seqs = [(codes, kscale), (codes[:120].flip(0), kscale[:120].flip(0)), (codes[100:], kscale[100:])]
        e = 8
        codes, kscale, table = paged(rng, seqs, [0, 1, 2, 1, 2], e)
    args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
    got = itk.indexer_scores(*args, _cfg=cfg, rows=rows)
    want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
    valid = torch.arange(want.shape[1]).unsqueeze(0) < nv.unsqueeze(1)
    assert torch.equal(got.cpu()[valid], want[valid])
    assert torch.isneginf(got.cpu()[~valid]).all()
    shift = itk.SPLIT_BOUND_HIST_SHIFT
    hist = torch.zeros(t << (32 - shift), dtype=torch.int32, device=dev) if rows else None
    s, maxima, maxg = itk._scores(*args, topk=4, _cfg=cfg, rows=rows, maxg=4, hist=hist)  # the chunk maxima it writes
    pad = -(-want.shape[1] // 4) * 4 - want.shape[1]
    ref_max = torch.nn.functional.pad(want.masked_fill(~valid, float("-inf")), (0, pad),
                                      value=float("-inf")).view(t, -1, 4).amax(-1)
    assert maxg == 4 and torch.equal(maxima.cpu(), ref_max)
    if rows:  # the bound histograms it counts them into (finite maxima only: row 2 sees nothing)
        assert torch.equal(hist.cpu().view(t, -1), bound_hist_ref(ref_max, shift))
        assert int(hist.view(t, -1)[2].sum()) == 0 and int(hist.view(t, -1)[0].sum()) == -(-n // 4)
    else:
        with pytest.raises(ValueError, match="bound histogram"):
            itk._scores(*args, topk=4, _cfg=cfg, rows=rows, maxg=4,
                        hist=torch.zeros(t << (32 - shift), dtype=torch.int32, device=dev))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("keys_m", [False, True], ids=["keys-n", "keys-m"])
@pytest.mark.parametrize("layout", ["one_seq", "paged"])
def test_rows_word_decode(dev, keys_m, layout, rng):
    """The rows kernel's word decode (`_decode_key_words`: int32 words through the experts' bf16x2
    conversion, one dot over all channels, either orientation): on exact inputs the scores and
    chunk maxima equal the reference's bit for bit, with two index head widths (2 and 4 scale
    groups), padded heads, several blocks a tile, a token that sees nothing."""
    for d, h in ((64, 4), (128, 3)):
        t, n = 4, 200
        q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=True)
        nv = torch.tensor([n, 0, 77, 150])
        if layout == "one_seq":
            table, e = one_seq(codes, t)
        else:
            e = 8
            codes, kscale, table = paged(rng, [(codes, kscale), (codes[:90].flip(0), kscale[:90].flip(0))],
                                         [0, 1, 0, 1], e)
            nv[3] = 90
        args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
        assert itk.rows_words_fit(args[2], d)
        want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
        valid = torch.arange(want.shape[1]).unsqueeze(0) < nv.unsqueeze(1)
        for cfg in ((16, 1, 16, 3, 4), (16, 1, 32, 2, 4)):
            s, maxima, maxg = itk._scores(*args, topk=4, _cfg=cfg, rows=True, maxg=4, words=True, keys_m=keys_m)
            assert torch.equal(s.cpu()[valid], want[valid]), (d, cfg)
            assert torch.isneginf(s.cpu()[~valid]).all()
            pad = -(-want.shape[1] // 4) * 4 - want.shape[1]
            ref_max = torch.nn.functional.pad(want.masked_fill(~valid, float("-inf")), (0, pad),
                                              value=float("-inf")).view(t, -1, 4).amax(-1)
            assert maxg == 4 and torch.equal(maxima.cpu(), ref_max), (d, cfg)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_rows_extreme_key_scales(dev, words, rng):
    """Scale bytes 0 (2^-127, subnormal), 1, 2 and past 128 (the word decode's second factor, up to
    2^53) in one key set, through the rows kernel's two decodes."""
    t, h, d, n = 2, 4, 64, 48
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    ks = kscale.view(torch.uint8).clone()
    ks[:10] = torch.tensor([0, 1, 2, 127, 128, 129, 140, 167, 180, 3], dtype=torch.uint8).unsqueeze(1)
    kscale = ks.view(torch.float8_e8m0fnu)
    q = q * 2.0 ** 60  # keep products of the tiny keys away from fp32 underflow
    table, e = one_seq(codes, t)
    nv = torch.full((t,), n)
    got = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev),
                             _cfg=(16, 1, 16, 2, 4), rows=True, words=words, keys_m=True)
    want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
    assert_scores_close(got, want, torch.ones(t, n, dtype=torch.bool))


def test_rows_words_fit():
    """The word decode takes 16-byte aligned rows of a power-of-two count of 4-word groups only."""
    codes = torch.zeros(64, 64, dtype=torch.uint8)
    assert itk.rows_words_fit(codes, 128)
    assert not itk.rows_words_fit(codes[:, 4:], 128)  # rows 16-byte aligned, the start is not
    assert not itk.rows_words_fit(torch.zeros(64, 48, dtype=torch.uint8), 96)  # 12 words: no power of two
    assert not itk.rows_words_fit(torch.zeros(64, 72, dtype=torch.uint8)[:, :64], 128)  # row stride 72 bytes


def test_rows_kernel_is_dense_only():
    """The one-query-per-tile kernel refuses candidates (the Reindex gather) with one clear error."""
    q, w, codes, kscale = random_inputs(torch.Generator().manual_seed(0), 2, 4, 64, 16)
    table, e = one_seq(codes, 2)
    with pytest.raises(ValueError, match="dense only"):
        itk.indexer_scores(q, w, codes, kscale, table, e, torch.tensor([16, 16]),
                           candidates=torch.zeros(2, 3, dtype=torch.long), rows=True)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,n,k", [(6, 40, 8), (4, 150, 16), (3, 70, 100)])
def test_topk_exact_inputs_equal_reference(dev, t, n, k, rng):
    """Exact scores: indices (with real ties) and the candidate pool equal the reference's."""
    q, w, codes, kscale = random_inputs(rng, t, 4, 64, n, exact=True)
    table, e = one_seq(codes, t)
    nv = torch.randint(0, n + 1, (t,), generator=rng)
    nv[0], nv[-1] = 0, n
    want_idx, want_pool = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k, pool_blocks=3, pool_block_size=4)
    args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
    got_idx, got_pool = itk.indexer_topk(*args, k, pool_blocks=3, pool_block_size=4)
    assert got_idx.dtype == want_idx.dtype and torch.equal(got_idx.cpu(), want_idx)
    assert torch.equal(got_pool.cpu(), want_pool)
    s = itk.indexer_scores(*args).cpu()
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert torch.equal(s[valid], itk.indexer_scores_ref(q, w, codes, kscale, table, e)[valid])  # bit-exact here
    got_idx, got_pool = itk.indexer_topk(*args, k)
    assert got_pool is None and torch.equal(got_idx.cpu(), want_idx)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("k", [3, 12])
@pytest.mark.parametrize("rows_max_t", [0, 64], ids=["tiles", "rows"])
@pytest.mark.parametrize("split_max_t", [0, 64], ids=["one-program", "split"])
def test_paged_equals_reference(dev, k, rows_max_t, split_max_t, rng, monkeypatch):
    """Three sequences in scattered blocks of one pool (blocks of 4 entries), tokens of all of
    them in one launch, a token that sees nothing: top-k and candidate pool (from the scores
    kernel's block maxima) equal the reference's paged results exactly (exact scores), with the
    multi-query tiles and with the one-query-per-tile kernel as the default scores path, and
    with the one-program or the split select."""
    monkeypatch.setattr(itk, "ROWS_MAX_T", rows_max_t)
    monkeypatch.setattr(itk, "SPLIT_MAX_T", split_max_t)
    t, n = 7, 90  # k = 3: the select is bounded by maxima of 2-entry chunks
    assert itk.use_rows_kernel(t, False) == (rows_max_t >= t)
    q, w, codes, kscale = random_inputs(rng, t, 4, 64, n, exact=True)
    seqs = [(codes[:90], kscale[:90]), (codes[10:50], kscale[10:50]), (codes[30:61], kscale[30:61])]
    e = 4
    pc, ps, table = paged(rng, seqs, [0, 1, 2, 0, 1, 2, 0], e)
    nv = torch.tensor([90, 40, 31, 0, 7, 13, 50])
    want_idx, want_pool = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, k, pool_blocks=2, pool_block_size=8)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, nv.to(dev),
                                         k, pool_blocks=2, pool_block_size=8)
    assert torch.equal(got_idx.cpu(), want_idx)
    assert torch.equal(got_pool.cpu(), want_pool)
    assert (want_idx[3] == -1).all() and (want_idx[0] >= 0).all()  # nothing visible / a full row


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_random_inputs(dev, rng):
    t, h, d, n, k = 5, 8, 128, 260, 24
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    table, e = one_seq(codes, t)
    nv = torch.tensor([n, 1, 23, 200, 150])
    want_idx, _ = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k)
    got_idx, _ = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e,
                                  nv.to(dev), k)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    check_topk_rowwise(got_idx, want_idx, itk.indexer_scores_ref(q, w, codes, kscale, table, e), valid, k)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("exact", [True, False])
def test_candidates(dev, exact, rng):
    """Reindex layers: candidate entry ids per token, resolved through each token's table."""
    t, h, d, n, p, k = 4, 4, 64, 120, 40, 6
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=exact)
    e = 8
    pc, ps, table = paged(rng, [(codes, kscale), (codes[:64].flip(0), kscale[:64].flip(0))], [0, 1, 1, 0], e)
    lens = [n, 64, 64, n]
    cands = torch.full((t, p), -1, dtype=torch.long)
    for i, m in enumerate((3, 40, 17, 0)):
        cands[i, :m] = torch.randperm(lens[i], generator=rng)[:m].sort().values
    nv = torch.tensor(lens)
    want_idx, want_pool = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, k, candidates=cands)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, nv.to(dev),
                                         k, candidates=cands.to(dev))
    assert got_pool is None and want_pool is None
    s_ref = itk.indexer_scores_ref(q, w, pc, ps, table, e, cands)
    s = itk.indexer_scores(q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, None, cands.to(dev))
    assert_scores_close(s, s_ref, cands >= 0)
    if exact:
        assert torch.equal(got_idx.cpu(), want_idx)
    else:  # map back to candidate-local columns for the row-wise check
        local = torch.stack([torch.tensor([(cands[i] == c).nonzero()[0, 0].item() if c >= 0 else -1
                                           for c in row.tolist()]) for i, row in enumerate(got_idx.cpu())])
        want_local = ref_att._stable_topk_sorted(s_ref, k, cands >= 0)
        check_topk_rowwise(local, want_local, s_ref, cands >= 0, k)
        assert torch.equal(got_idx.cpu().sort(-1).values, torch.where(local >= 0, cands.gather(-1, local.clamp_min(0)), -1).sort(-1).values)


@pytest.mark.parametrize("dev", DEVICES)
def test_extreme_key_scales(dev, rng):
    """E8M0 bytes 0 (2^-127, subnormal), 1 and up to 2^40, in one key set."""
    t, h, d, n = 2, 4, 64, 48
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    ks = kscale.view(torch.uint8).clone()
    ks[:8] = torch.tensor([0, 1, 2, 127, 140, 167, 100, 3], dtype=torch.uint8).unsqueeze(1)
    kscale = ks.view(torch.float8_e8m0fnu)
    q = q * 2.0 ** 60  # keep products of the tiny keys away from fp32 underflow
    table, e = one_seq(codes, t)
    nv = torch.full((t,), n)
    got = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
    want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
    valid = torch.ones(t, n, dtype=torch.bool)
    assert_scores_close(got, want, valid)
    tiny = (quant.mxfp4_dequant(codes[:3], kscale[:3]) != 0).any(-1)
    assert tiny.all()  # the subnormal-scale keys are non-zero keys


def test_rejects_unknown_radix_width():
    """A digit width that does not tile the 32-bit keys is refused with one clear error."""
    with pytest.raises(ValueError, match="radix_bits"):
        itk.topk_select(torch.zeros(1, 8), torch.tensor([8]), 2, radix_bits=5)


def test_rejects_bad_block_table(rng):
    q, w, codes, kscale = random_inputs(rng, 2, 4, 64, 16)
    with pytest.raises(ValueError, match="block_table"):
        itk.indexer_topk(q, w, codes, kscale, torch.zeros(3, 1, dtype=torch.long), 16, torch.tensor([4, 4]), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t,n", [(1, 4096), (1, 4160), (3, 5000), (40, 2000), (64, 8192), (1, 65536)])
@pytest.mark.parametrize("rows,passes,split", [(False, 0, True), (True, 0, True), (True, 3, True), (True, 0, False),
                                               ("words", 0, True)],
                         ids=["tiles", "rows", "rows-span", "rows-one-program", "rows-words"])
def test_benchmark_widths_gpu(dev, t, n, rows, passes, split, rng, monkeypatch):
    """Mini-preset widths: 32 heads x 128, top-512; two sequences in blocks of 64 entries; the
    multi-query tiles and the one-query-per-tile kernel (rows) as the default scores path; the
    split select (here up to 64 rows) or the one-program-per-row select with the
    exact chunk-maxima bound or a three-pass one with the survivors' select over their span."""
    monkeypatch.setattr(itk, "ROWS_MAX_T", 1 << 20 if rows else 0)
    monkeypatch.setattr(itk, "SPLIT_PARTS", itk.SPLIT_PARTS if split else 0)
    monkeypatch.setattr(itk, "SPLIT_MAX_T", 64)  # the split select for the batches too (fewer parts per row)
    monkeypatch.setattr(itk, "SELECT_BOUND_PASSES", passes)
    monkeypatch.setattr(itk, "SELECT_SPAN", passes > 0)
    monkeypatch.setattr(itk, "ROWS_WORDS", rows == "words")  # the word decode, keys on the M side
    monkeypatch.setattr(itk, "ROWS_KEYS_M", rows == "words")
    q, w, codes, kscale = random_inputs(rng, t, 32, 128, n)
    e = 64
    pc, ps, table = paged(rng, [(codes, kscale), (codes[: n // 2], kscale[: n // 2])],
                          [i % 2 for i in range(t)], e)
    lens = torch.tensor([n if i % 2 == 0 else n // 2 for i in range(t)])
    nv = torch.minimum(torch.randint(n // 4, n + 1, (t,), generator=rng), lens)
    nv[0] = n
    args = (q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, nv.to(dev))
    s_ref = itk.indexer_scores_ref(q, w, pc, ps, table, e)
    valid = torch.arange(s_ref.shape[1]).unsqueeze(0) < nv.unsqueeze(1)
    assert_scores_close(itk.indexer_scores(*args), s_ref, valid)
    want_idx, _ = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, 512)
    got_idx, _ = itk.indexer_topk(*args, 512)
    check_topk_rowwise(got_idx, want_idx, s_ref, valid, 512)


def test_scores_tiles_by_device():
    """The scores kernel's tiles per device: 128-entry blocks and 4 warps on CUDA (gather tiles of
    fewer than GATHER_FOUR_WARPS_MIN_T queries keep 8), dense tiles of at most DENSE_TILE_ENTRIES
    entries; 64-entry blocks and 8 warps on Ascend and under the interpreters."""
    assert itk.tile_shape(1792, 32, False, False, False) == (32, 4, 128)
    assert itk.tile_shape(1792, 32, False, True, False)[2] == itk.tile_shape(1792, 32, False, False, True)[2] == 64
    assert itk.tile_shape(1, 32, True, False, False) == (32, 1, 128)
    assert itk.scores_warps(1792, False, "cuda") == itk.scores_warps(64, True, "cuda") == 4
    assert itk.scores_warps(8, True, "cuda") == 4
    assert itk.scores_warps(1, True, "cuda") == itk.scores_warps(1792, False, "cpu") == 8
    assert itk.DENSE_TILE_ENTRIES // 128 == 4


def _old_scores_config(t, h, nc, gather):
    """`_config`'s CUDA tiles before the 4-warp tiles: 8 warps, 64-entry blocks for the dense
    multi-query tiles, up to 8 blocks a tile (the same worker-filling rule)."""
    hp, bt, bn = itk.tile_shape(t, h, gather, False, False)
    bn = bn if gather else 64
    n_tb, n_nb = -(-t // bt), -(-nc // bn)
    target = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    qsub = 1
    while not gather and qsub < itk.scores_qsub("cuda") and -(-n_tb // (qsub * 2)) * n_nb >= target:
        qsub *= 2
    n_tg, nsub = -(-n_tb // qsub), 1
    while nsub < 8 and n_tg * (-(-n_nb // (nsub * 2))) >= target:
        nsub *= 2
    return hp, bt, bn, nsub, 8, qsub


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t,n,layout", [(1792, 8192, "one_seq"), (128, 4096, "paged"), (256, 2048, "paged"),
                                        (64, 4096, "gather"), (8, 4096, "gather")])
def test_default_tiles_gpu(dev, t, n, layout, rng):
    """Mini widths (32 heads x 128), the default tiles (`_config`) against the 8-warp / 64-entry
    tiles before them: one sequence (a prefill chunk) and gather (Reindex) tiles over candidates
    give the same scores and chunk maxima bit for bit; queries of two sequences side by side (a
    large decode batch) equal the reference within RTOL (which key blocks share one MMA depends
    on the tile's width there, so the last bits may differ from the old tiles')."""
    h, d = 32, 128
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    cands = None
    if layout == "paged":
        half = n // 2
        codes, kscale, table = paged(rng, [(codes, kscale), (codes[:half].flip(0), kscale[:half].flip(0))],
                                     [i % 2 for i in range(t)], 64)
        e = 64
        lens = torch.tensor([n if i % 2 == 0 else half for i in range(t)])
        nv = torch.minimum(torch.randint(n // 4, n + 1, (t,), generator=rng), lens)
    else:
        table, e = one_seq(codes, t)
        nv = torch.randint(n // 4, n + 1, (t,), generator=rng)
    if layout == "gather":
        cands = torch.randint(-1, n, (t, n // 2), generator=rng)
        nv = torch.full((t,), n)
    args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev))
    nc = cands.shape[1] if cands is not None else table.shape[1] * e
    cand = None if cands is None else cands.to(dev)
    topk = 0 if cands is not None else 512
    new = itk._scores(*args, candidates=cand, topk=topk)
    if layout == "paged":
        want = itk.indexer_scores_ref(q, w, codes, kscale, table, e)
        assert_scores_close(new[0], want, torch.arange(want.shape[1]).unsqueeze(0) < nv.unsqueeze(1))
        return
    old_cfg = _old_scores_config(t, h, nc, cands is not None)
    assert itk._config(t, h, nc, cands is not None, dev) != old_cfg  # (the tiles did change here)
    old = itk._scores(*args, candidates=cand, topk=topk, _cfg=old_cfg, maxg=new[2] or None)
    assert torch.equal(new[0], old[0]), f"scores differ from the tiles {old_cfg}"
    assert (new[1] is None) == (old[1] is None) and (new[1] is None or torch.equal(new[1], old[1]))


@pytest.mark.parametrize("dev", DEVICES)
def test_cuda_backend_registers_kernel(dev, monkeypatch, rng):
    from dsv41.backends import ops
    from dsv41.npu_ops.triton import KERNELS

    assert "indexer_topk" in KERNELS
    impl, used, reason = registry.resolve("indexer_topk", "cuda")
    assert (impl, used) == (itk.indexer_topk, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")
    q, w, codes, kscale = random_inputs(rng, 3, 4, 64, 30, exact=True)
    table, e = one_seq(codes, 3)
    nv = torch.tensor([30, 5, 0])
    got, _ = ops.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev), 8)
    want, _ = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, 8)
    assert torch.equal(got.cpu(), want)


# ---- the Triton Reindex selection, candidate pool and prefill chunking --------------------------

@pytest.mark.parametrize("dev", DEVICES)
def test_candidates_any_order_and_padding(dev, rng):
    """Reindex selection with candidates in no particular order, -1 padding anywhere in a row,
    fewer valid candidates than k, none at all, and more than k: equal to the reference (which
    selects among the valid columns, ties to the lower column, and sorts by entry id)."""
    t, h, d, n, p, k = 5, 4, 64, 120, 48, 10
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=True)
    table, e = one_seq(codes, t)
    cands = torch.full((t, p), -1, dtype=torch.long)
    for i, m in enumerate((p, 30, 4, 0, 25)):
        cands[i, torch.randperm(p, generator=rng)[:m]] = torch.randperm(n, generator=rng)[:m]
    cands[4, :25] = torch.arange(25) * 2  # ascending ids, padding after them
    cands[4, 25:] = -1
    nv = torch.full((t,), n)
    want_idx, _ = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k, candidates=cands)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e,
                                         nv.to(dev), k, candidates=cands.to(dev))
    assert got_pool is None
    assert torch.equal(got_idx.cpu(), want_idx)
    assert (want_idx[3] == -1).all() and (want_idx[2] >= 0).sum() == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("ordered", [True, False], ids=["pool-order", "any-order"])
def test_wide_tile_select_gpu(dev, ordered, rng):
    """Dense rows just past one select tile without chunk maxima take one SELECT_WIDE_BLOCK
    tile, Reindex rows (candidates) two tiles: the ids equal the stable sort's, and those of the
    tile widths not taken by default."""
    t, n, k = 3, itk.SELECT_BLOCK + 64, 512
    s = torch.randn(t, n, generator=rng)
    s[:, 100:140] = s[:, 60:100]  # ties
    cand = torch.stack([torch.randperm(4 * n, generator=rng)[:n] for _ in range(t)])
    cand[torch.rand(t, n, generator=rng) < 0.1] = -1
    if ordered:  # the candidate pool's order: ascending ids, the padding last
        cand = torch.where(cand >= 0, cand, torch.full_like(cand, 1 << 62)).sort(-1).values
        cand[cand == 1 << 62] = -1
    s = torch.where(cand >= 0, s, torch.full_like(s, float("-inf")))
    cols = itk._topk_sorted(torch.where(cand >= 0, s, torch.zeros_like(s)), k, cand >= 0)
    ids = torch.where(cols >= 0, cand.gather(1, cols.clamp(min=0)), torch.full_like(cols, 1 << 62)).sort(-1).values
    want = torch.where(ids == 1 << 62, torch.full_like(ids, -1), ids)
    got = itk.topk_select(s.to(dev), None, k, candidates=cand.to(dev))
    wide = itk.topk_select(s.to(dev), None, k, candidates=cand.to(dev), block=itk.SELECT_WIDE_BLOCK)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(wide.cpu(), want)
    d = torch.randn(t, n, generator=rng)  # dense rows, no maxima, the last one partly visible
    vis = torch.tensor([n, n, n - 100])
    want_d = itk._topk_sorted(d, k, torch.arange(n).unsqueeze(0) < vis.unsqueeze(1))
    assert torch.equal(itk.topk_select(d.to(dev), vis.to(dev), k).cpu(), want_d)
    assert torch.equal(itk.topk_select(d.to(dev), vis.to(dev), k, block=itk.SELECT_BLOCK).cpu(), want_d)


def block_maxima(scores, n_visible, block):
    """The scores kernel's block maxima, written out: max over each block of visible scores."""
    t, n = scores.shape
    nb = -(-n // block)
    padded = torch.full((t, nb * block), float("-inf"))
    padded[:, :n] = scores
    vis = torch.arange(nb * block).unsqueeze(0) < n_visible.unsqueeze(1)
    return padded.masked_fill(~vis, float("-inf")).reshape(t, nb, block).amax(-1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cb", [8, 3])
@pytest.mark.parametrize("exact", [True, False])
def test_candidate_blocks(dev, cb, exact, rng):
    """Reindex candidates as block ids (the pool's form, CB entries a block; 3: a block size
    that is no power of two): blocks in any order, -1 blocks anywhere, the newest block partly
    past n_visible, a token whose blocks are all -1; two sequences side by side in scattered
    pool blocks. Scores and selection equal the reference's over the blocks' entries."""
    t, h, d, n, p, k = 5, 4, 64, 96, 6, 10
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=exact)
    e = 8
    pc, ps, table = paged(rng, [(codes, kscale), (codes[:64].flip(0), kscale[:64].flip(0))], [0, 1, 0, 1, 0], e)
    nv = torch.tensor([n - 5, 61, 37, 64, 20])
    blocks = torch.full((t, p), -1, dtype=torch.int32)
    for i in range(t - 1):
        reach = -(-int(nv[i]) // cb)
        pick = torch.randperm(reach, generator=rng)[:p - 1]
        if reach - 1 not in pick.tolist():
            pick[0] = reach - 1  # the newest (partial unless cb divides n_visible) block
        blocks[i, torch.randperm(p, generator=rng)[:len(pick)]] = pick.int()
    entries = ref_att.pool_entries(blocks, cb, nv)
    assert (entries[:t - 1] == -1).any(1).all() and (entries[t - 1] == -1).all()
    want_idx, _ = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, k, candidates=blocks, candidate_block_size=cb)
    want_by_entries, _ = itk.indexer_topk_ref(q, w, pc, ps, table, e, nv, k, candidates=entries)
    assert torch.equal(want_idx, want_by_entries)
    args = (q.to(dev), w.to(dev), pc.to(dev), ps.to(dev), table.to(dev), e, nv.to(dev))
    got_idx, got_pool = itk.indexer_topk(*args, k, candidates=blocks.to(dev), candidate_block_size=cb)
    assert got_pool is None
    s = itk.indexer_scores(*args, blocks.to(dev), candidate_block_size=cb)
    s_ref = itk.indexer_scores_ref(q, w, pc, ps, table, e, entries)
    assert_scores_close(s, s_ref, entries >= 0)
    assert torch.isneginf(s.cpu()[entries < 0]).all()
    if exact:
        assert torch.equal(got_idx.cpu(), want_idx)
    else:
        chosen = got_idx.cpu()
        assert ((chosen == -1) | torch.isin(chosen, entries)).all() and (chosen < nv.unsqueeze(1)).all()
        # the chosen entries as candidate columns, in column order (the blocks are not in entry order)
        local = torch.stack([torch.tensor(sorted((entries[i] == c).nonzero()[0, 0].item()
                                                 for c in row.tolist() if c >= 0) + [-1] * int((row < 0).sum()))
                             for i, row in enumerate(chosen)])
        check_topk_rowwise(local, ref_att._stable_topk_sorted(s_ref, k, entries >= 0), s_ref, entries >= 0, k)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("block,n_blocks", [(4, 3), (8, 5), (2, 40)])
@pytest.mark.parametrize("bits", [4, 8])
def test_pool_select_equals_candidate_pool(dev, block, n_blocks, bits, rng):
    """The Triton candidate pool equals `reference.attention.candidate_pool`: tied block maxima
    (to the older block), the newest partial block forced in, nothing visible, fewer reachable
    blocks than the pool holds, and a row whose pool is a strict subset."""
    t, n = 6, 70
    s = torch.randint(-3, 4, (t, n), generator=rng).float()  # small integers: many exact ties
    nv = torch.tensor([70, 0, 1, 13, 33, 64])
    s = s.masked_fill(torch.arange(n).unsqueeze(0) >= nv.unsqueeze(1), float("-inf"))
    want = ref_att.candidate_pool(s, nv, n_blocks, block)
    got = itk.pool_select(block_maxima(s, nv, block).to(dev), nv.to(dev), n, n_blocks, block, radix_bits=bits)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("block,n_blocks", [(4, 3), (2, 40)])
def test_pool_beside_split_select(dev, block, n_blocks, rng, monkeypatch):
    """`topk_select(..., pool_out=)`: the candidate pool from the select's block maxima, made by
    programs beside the split select's parts (POOL_BESIDE_SELECT), by `pool_select` after it, and
    beside the one-program select: every form's ids equal the stable sort's and its pool the
    reference's (ties, the newest partial block, nothing visible, fewer blocks than the pool)."""
    t, n, k = 6, 70, 5
    s = torch.randint(-3, 4, (t, n), generator=rng).float()  # small integers: many exact ties
    s[2] = torch.randn(n, generator=rng)
    nv = torch.tensor([70, 0, 61, 13, 33, 64])
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    s = s.masked_fill(~valid, float("-inf"))
    want_idx = ref_att._stable_topk_sorted(s, k, valid)
    want_pool = ref_att.candidate_pool(s, nv, n_blocks, block)
    maxima = block_maxima(s, nv, block).to(dev)
    for beside, parts in ((True, 4), (False, 4), (True, 0)):
        monkeypatch.setattr(itk, "POOL_BESIDE_SELECT", beside)
        pool = torch.full((t, want_pool.shape[1]), -7, dtype=torch.int32, device=dev)
        got = itk.topk_select(s.to(dev), nv.to(dev), k, maxima, block, parts=parts, min_maxima_per_k=0,
                              pool_out=pool, pool_n=n_blocks)
        assert torch.equal(got.cpu(), want_idx), (beside, parts)
        assert torch.equal(pool.cpu().long(), want_pool.long()), (beside, parts)
    with pytest.raises(ValueError, match="pool"):
        itk.topk_select(s.to(dev), nv.to(dev), k, maxima, block, candidates=torch.zeros(t, n, dtype=torch.long,
                        device=dev), pool_out=pool, pool_n=n_blocks)


@pytest.mark.parametrize("dev", DEVICES)
def test_prefill_chunks_equal_reference(dev, rng, monkeypatch):
    """A prefill scored in chunks of queries (the score matrix bounded by SCORE_CHUNK_ELEMS)
    gives the reference's top-k, candidate pool and Reindex selection."""
    t, h, d, n, k = 9, 4, 64, 96, 5
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=True)
    table, e = one_seq(codes, t)
    nv = torch.tensor([96, 90, 3, 50, 0, 17, 64, 95, 40])
    monkeypatch.setattr(itk, "SCORE_CHUNK_ELEMS", 2 * n)  # 2 queries per chunk
    scored_rows = []
    real_scores = itk._scores

    def recording_scores(q, *a, **kw):  # the score matrix of one chunk: at most 2 queries
        scored_rows.append(q.shape[0])
        return real_scores(q, *a, **kw)

    monkeypatch.setattr(itk, "_scores", recording_scores)
    want_idx, want_pool = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k, pool_blocks=3, pool_block_size=8)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e,
                                         nv.to(dev), k, pool_blocks=3, pool_block_size=8)
    assert torch.equal(got_idx.cpu(), want_idx) and torch.equal(got_pool.cpu(), want_pool)
    assert got_pool.dtype == torch.int32  # block ids: 4 bytes a block of 8 entries
    assert scored_rows == [2, 2, 2, 2, 1]
    want_re, _ = itk.indexer_topk_ref(q, w, codes, kscale, table, e, nv, k, candidates=want_pool,
                                      candidate_block_size=8)
    got_re, _ = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), table.to(dev), e, nv.to(dev),
                                 k, candidates=got_pool, candidate_block_size=8)
    assert torch.equal(got_re.cpu(), want_re)
    assert scored_rows[5:] == [8, 1]  # the Reindex selection in chunks too (24 candidate entries a row)
