"""Triton indexer scores + top-k (npu_ops/triton/indexer_topk.py) against the torch reference.

Interpreter variants (TRITON_INTERPRET=1, small shapes) and `gpu`-marked compiled variants.
Scores are compared with a bound relative to the row's largest |score| (the kernel sums in fp32,
the reference in fp64); the selected indices are compared exactly (a) on "exact" inputs where
every score is exact in fp32 (dyadic weights, MXFP4 operands) so ties are real ties in both, and
(b) on random inputs, row by row, wherever the k-th and (k+1)-th scores are clearly separated
(otherwise the chosen score sets are compared).
"""

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import attention as ref_att  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import indexer_topk as itk  # noqa: E402

RTOL = 1e-5


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


# ---- kernel -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,h,d,n", [(1, 4, 64, 40), (5, 4, 64, 200), (3, 8, 128, 150), (2, 3, 96, 70)])
def test_scores_match_reference(dev, t, h, d, n, rng):
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    nv = torch.randint(1, n + 1, (t,), generator=rng)
    nv[0] = n
    got = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev))
    want = itk.indexer_scores_ref(q, w, codes, kscale)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert_scores_close(got, want, valid)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg", [(8, 2, 32, 3, 4), (16, 1, 16, 2, 4), (4, 8, 64, 4, 8)])
def test_tile_configs(dev, cfg, rng):
    """Padded heads, several key blocks per tile (NSUB > 1) and skipped invisible blocks."""
    t, h, d, n = 5, 4, 64, 333
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=True)
    nv = torch.tensor([n, 1, 0, 100, 200])
    args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev))
    got = itk.indexer_scores(*args, _cfg=cfg)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert torch.equal(got.cpu()[valid], itk.indexer_scores_ref(q, w, codes, kscale)[valid])
    assert torch.isneginf(got.cpu()[~valid]).all()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,n,k", [(6, 40, 8), (4, 150, 16), (3, 70, 100)])
def test_topk_exact_inputs_equal_reference(dev, t, n, k, rng):
    """Exact scores: indices (with real ties) and the candidate pool equal the reference's."""
    q, w, codes, kscale = random_inputs(rng, t, 4, 64, n, exact=True)
    nv = torch.randint(0, n + 1, (t,), generator=rng)
    nv[0], nv[-1] = 0, n
    want_idx, want_pool = itk.indexer_topk_ref(q, w, codes, kscale, nv, k, pool_blocks=3, pool_block_size=4)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev), k,
                                         pool_blocks=3, pool_block_size=4)
    assert got_idx.dtype == want_idx.dtype and torch.equal(got_idx.cpu(), want_idx)
    assert torch.equal(got_pool.cpu(), want_pool)
    s = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev)).cpu()
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert torch.equal(s[valid], itk.indexer_scores_ref(q, w, codes, kscale)[valid])  # bit-exact here
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev), k)
    assert got_pool is None and torch.equal(got_idx.cpu(), want_idx)


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_random_inputs(dev, rng):
    t, h, d, n, k = 5, 8, 128, 260, 24
    q, w, codes, kscale = random_inputs(rng, t, h, d, n)
    nv = torch.tensor([n, 1, 23, 200, 150])
    want_idx, _ = itk.indexer_topk_ref(q, w, codes, kscale, nv, k)
    got_idx, _ = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev), k)
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    check_topk_rowwise(got_idx, want_idx, itk.indexer_scores_ref(q, w, codes, kscale), valid, k)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("exact", [True, False])
def test_candidates(dev, exact, rng):
    t, h, d, n, p, k = 4, 4, 64, 120, 40, 6
    q, w, codes, kscale = random_inputs(rng, t, h, d, n, exact=exact)
    cands = torch.full((t, p), -1, dtype=torch.long)
    for i, m in enumerate((3, 40, 17, 0)):
        cands[i, :m] = torch.randperm(n, generator=rng)[:m].sort().values
    nv = torch.full((t,), n)
    want_idx, want_pool = itk.indexer_topk_ref(q, w, codes, kscale, nv, k, candidates=cands)
    got_idx, got_pool = itk.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev), k,
                                         candidates=cands.to(dev))
    assert got_pool is None and want_pool is None
    s_ref = itk.indexer_scores_ref(q, w, codes, kscale, cands)
    s = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), None, cands.to(dev))
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
    nv = torch.full((t,), n)
    got = itk.indexer_scores(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev))
    want = itk.indexer_scores_ref(q, w, codes, kscale)
    valid = torch.ones(t, n, dtype=torch.bool)
    assert_scores_close(got, want, valid)
    tiny = (quant.mxfp4_dequant(codes[:3], kscale[:3]) != 0).any(-1)
    assert tiny.all()  # the subnormal-scale keys are non-zero keys


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("t,n", [(1, 4096), (3, 5000), (40, 2000)])
def test_benchmark_widths_gpu(dev, t, n, rng):
    """Mini-preset widths: 32 heads x 128, top-512."""
    q, w, codes, kscale = random_inputs(rng, t, 32, 128, n)
    nv = torch.randint(n // 2, n + 1, (t,), generator=rng)
    nv[0] = n
    args = (q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev))
    valid = torch.arange(n).unsqueeze(0) < nv.unsqueeze(1)
    assert_scores_close(itk.indexer_scores(*args), itk.indexer_scores_ref(q, w, codes, kscale), valid)
    want_idx, _ = itk.indexer_topk_ref(q, w, codes, kscale, nv, 512)
    got_idx, _ = itk.indexer_topk(*args, 512)
    check_topk_rowwise(got_idx, want_idx, itk.indexer_scores_ref(q, w, codes, kscale), valid, 512)


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
    nv = torch.tensor([30, 5, 0])
    got, _ = ops.indexer_topk(q.to(dev), w.to(dev), codes.to(dev), kscale.to(dev), nv.to(dev), 8)
    want, _ = itk.indexer_topk_ref(q, w, codes, kscale, nv, 8)
    assert torch.equal(got.cpu(), want)
