"""The pool-reading / pool-writing Triton kernels on row-strided pool views: every pool field
sits inside wider records with bytes before and after it (as the fields of vLLM's page records
do, `deploy/vllm/paged_cache.py`), so a pool's row stride is not its width. Each kernel must
give the same bits as on a contiguous copy of the same pool, and a write must leave every byte
outside its field untouched."""

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import compress_kv as ck  # noqa: E402
from dsv41.npu_ops.triton import indexer_topk as itk  # noqa: E402
from dsv41.npu_ops.triton import sparse_attention as sa  # noqa: E402

BEFORE, AFTER = 12, 20  # record bytes around the field (the slot stays a multiple of 4)


def in_records(x: torch.Tensor, g: torch.Generator, before: int = BEFORE,
               after: int = AFTER) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, records): `x` [n, w] (1-byte dtype) copied into the middle of random records
    [n, before + w + after] uint8, and the view of that field as x's dtype."""
    n, w = x.shape
    rec = torch.randint(0, 256, (n, before + w + after), generator=g, dtype=torch.uint8)
    rec[:, before:before + w] = x.view(torch.uint8)
    view = rec[:, before:before + w].view(x.dtype)
    assert view.stride(0) != w
    return view, rec


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_attention_reads_strided_pools(device, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    t, h, d, n_win, n_glob = 3, 16, 64, 24, 16
    q = torch.randn(t, h, d, generator=g).bfloat16()
    swa_kv, swa_sc = quant.fp8_quant(torch.randn(n_win, d, generator=g))
    glob_kv, glob_sc = quant.fp4_quant(torch.randn(n_glob, d, generator=g).bfloat16())
    win_idx = torch.randint(-1, n_win, (t, 8), generator=g)
    glob_idx = torch.randint(-1, n_glob, (t, 5), generator=g)
    sink = torch.randn(h, generator=g)
    views = [in_records(p, g)[0] for p in (swa_kv, swa_sc, glob_kv, glob_sc)]
    dev = lambda x: x.to(device)  # noqa: E731
    want = sa.sparse_attention(*map(dev, (q, swa_kv, swa_sc, win_idx, glob_kv, glob_sc, glob_idx, sink)), d ** -0.5)
    v = [dev(x) for x in views]
    got = sa.sparse_attention(dev(q), v[0], v[1], dev(win_idx), v[2], v[3], dev(glob_idx), dev(sink), d ** -0.5)
    assert torch.isfinite(want.float()).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    # the MQA kernel (whole rows decoded once as K and V) reads the same views
    mqa = dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None, MQA=True)
    want = sa.sparse_attention_launch(*map(dev, (q, swa_kv, swa_sc, win_idx, glob_kv, glob_sc, glob_idx, sink)),
                                      d ** -0.5, **mqa)
    got = sa.sparse_attention_launch(dev(q), v[0], v[1], dev(win_idx), v[2], v[3], dev(glob_idx), dev(sink),
                                     d ** -0.5, **mqa)
    assert torch.isfinite(want.float()).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    # it reads pools as 32-bit words: fields that start off a 4-byte boundary, or records whose
    # width is not a multiple of 4, are copied to aligned rows first (the same bits)
    for before, after in ((13, 19), (12, 21)):
        v = [dev(in_records(p, g, before, after)[0]) for p in (swa_kv, swa_sc, glob_kv, glob_sc)]
        got = sa.sparse_attention_launch(dev(q), v[0], v[1], dev(win_idx), v[2], v[3], dev(glob_idx), dev(sink),
                                         d ** -0.5, **mqa)
        assert torch.equal(got, want), (before, after)
    # the rows form (every pool row read decoded into a bf16 table first) reads the same views
    rows = dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None, ROWS=True)
    want = sa.sparse_attention_launch(*map(dev, (q, swa_kv, swa_sc, win_idx, glob_kv, glob_sc, glob_idx, sink)),
                                      d ** -0.5, **rows)
    v = [dev(x) for x in views]
    got = sa.sparse_attention_launch(dev(q), v[0], v[1], dev(win_idx), v[2], v[3], dev(glob_idx), dev(sink),
                                     d ** -0.5, **rows)
    assert torch.isfinite(want.float()).all() and want.abs().max() > 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_topk_reads_strided_keys(device, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    t, h, di, e, nb, k = 4, 4, 64, 4, 3, 5
    n_pool = (nb * 2 + 1) * e
    q = torch.randn(t, h, di, generator=g)
    w = torch.randn(t, h, generator=g)
    codes, scales = quant.mxfp4_quant(torch.randn(n_pool, di, generator=g))
    table = torch.stack([torch.randperm(2 * nb, generator=g)[:nb] + 1 for _ in range(2)])[torch.tensor([0, 0, 1, 1])]
    n_vis = torch.tensor([5, 9, 12, 7])
    cv, sv = in_records(codes, g)[0], in_records(scales, g)[0]
    dev = lambda x: x.to(device)  # noqa: E731
    want_idx, _ = itk.indexer_topk(*map(dev, (q, w, codes, scales, table)), e, dev(n_vis), k)
    got_idx, _ = itk.indexer_topk(dev(q), dev(w), dev(cv), dev(sv), dev(table), e, dev(n_vis), k)
    assert (want_idx >= 0).any()
    assert torch.equal(got_idx, want_idx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2])
def test_compress_kv_writes_strided_pools(device, ratio, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    n, d, half_r, cap = 3, 64, 8, 10
    kv = torch.randn(n * ratio, d, generator=g)
    score = torch.randn(n * ratio, d, generator=g) if ratio > 1 else None
    weight = torch.rand(d, generator=g).bfloat16() + 0.5
    cos, sin = torch.rand(n, half_r, generator=g), torch.rand(n, half_r, generator=g)
    slots = torch.tensor([7, 2, 5])
    codes = torch.zeros(cap, d // 2, dtype=torch.uint8)
    scales = torch.zeros(cap, d // 16, dtype=torch.float8_e4m3fn)
    (cv, c_rec), (sv, s_rec) = in_records(codes, g), in_records(scales, g)
    c_before, s_before = c_rec.clone(), s_rec.clone()
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    args = [dev(x) for x in (kv, score)] + [ratio, dev(weight), 1e-6, dev(cos), dev(sin)]
    codes, scales = dev(codes), dev(scales)
    want = ck.compress_kv(*args, codes, scales, dev(slots))
    cv, sv, c_rec, s_rec = dev(cv), dev(sv), dev(c_rec), dev(s_rec)
    cv, sv = c_rec[:, BEFORE:BEFORE + d // 2], s_rec[:, BEFORE:BEFORE + d // 16].view(torch.float8_e4m3fn)
    got = ck.compress_kv(*args, cv, sv, dev(slots))
    assert torch.equal(got, want)
    assert torch.equal(cv, codes) and torch.equal(sv.view(torch.uint8), scales.view(torch.uint8))
    assert codes[slots].any()
    for rec, before, w in ((c_rec, c_before, d // 2), (s_rec, s_before, d // 16)):  # nothing outside the field
        rec = rec.cpu()
        assert torch.equal(rec[:, :BEFORE], before[:, :BEFORE])
        assert torch.equal(rec[:, BEFORE + w:], before[:, BEFORE + w:])
