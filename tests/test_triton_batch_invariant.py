"""Batch-invariant mode (DSV41_BATCH_INVARIANT=1, npu_ops/triton/batch_invariant.py) under the
Triton interpreter: a row computed alone equals, bit for bit, the same row inside a batch of
other random rows, op by op through the CUDA dispatch; and on the tiny preset greedy decode
(one row per step) equals the argmax of one exact prefill of prompt + generated tokens.

The interpreter fixes some of the default path's row-count choices already (no split-K, one
tile table), so not every case below would fail in the default mode there; the linear (FP8 fold
vs tiled at > 64 rows, FP4 GEMV at one row) and the MoE (GEMV vs tiled) cases would. On the
GPU the same equalities are what the e2e numerics phase measures (greedy agreement with the mode
on). The split tests (linear, tiled experts, sparse attention) run a one-row call through the
split launches and a many-row call through the in-program slices / query chunks, and show that
the inputs would reveal a split that followed the row count (one split gives other bits)."""

import pytest
import torch
from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)
from test_triton_block_linear import BOUND, experts_in, rel_err, weight
from test_triton_indexer_topk import paged
from test_triton_indexer_topk import random_inputs as indexer_inputs
from test_triton_mega_mhc import make_inputs as mhc_inputs
from test_triton_sparse_attention import make_inputs as attention_inputs

from dsv41.backends import ops, registry
from dsv41.backends.numerics import numerics
from dsv41.backends.reference import basic, moe, quant
from dsv41.core.config import preset
from dsv41.core.weights import build_model
from dsv41.deploy.device_numerics import greedy_self_consistency
from dsv41.npu_ops.triton import batch_invariant as bi
from dsv41.npu_ops.triton import block_linear
from dsv41.npu_ops.triton import moe_experts as moe_mod
from dsv41.npu_ops.triton import sparse_attention as attn_mod
from dsv41.npu_ops.triton.launch import interpreting

interp_only = pytest.mark.skipif(not interpreting(), reason="interpreter variant (TRITON_INTERPRET=1)")
# the mode registers CUDA implementations only (CUDA-only kernel modules among them)
pytestmark = cuda_only


@pytest.fixture
def invariant(monkeypatch):
    """The CUDA op set (on CPU tensors: the interpreter) in batch-invariant mode."""
    monkeypatch.setenv("DSV41_BACKEND", "cuda")
    monkeypatch.setenv(registry.INVARIANT_VAR, "1")
    yield
    registry.reset_warnings()


def wide(rng, rows: int, k: int) -> torch.Tensor:
    """bf16 [rows, k] whose 32-wide groups span 2^-12 .. 2^12: dot products then round in fp32,
    so a different summation order shows (narrow random inputs often sum exactly)."""
    scale = torch.exp2(torch.randint(-12, 13, (rows, k // 32, 1), generator=rng).float())
    return (torch.randn(rows, k // 32, 32, generator=rng) * scale).reshape(rows, k).to(torch.bfloat16)


def on(dev, *tensors):
    """The tensors moved to `dev` (a list)."""
    return [t.to(dev) for t in tensors]


def rows_alone_equal_batch(fn, batch_args, row_args, rows, out_of=lambda r: r):
    """fn(*batch_args) vs fn(*row_args(i)) for each i in rows: torch.equal on the row's output."""
    full = out_of(fn(*batch_args))
    for i in rows:
        alone = out_of(fn(*row_args(i)))
        assert alone.shape[0] == 1
        assert torch.equal(alone[0], full[i]), f"row {i}: alone differs from the batch"


@interp_only
def test_dispatch_takes_the_invariant_implementations(invariant):
    """Every op of the CUDA set has an invariant implementation or is row-local as it is."""
    for name, fn in bi.OPS.items():
        assert registry.dispatch(name, "cpu") is fn, name
    cuda_ops = {n for n in registry.op_names() if "cuda" in registry._OPS[n].impls or registry.composite_of(n)}
    assert cuda_ops <= set(bi.OPS) | bi.ROW_LOCAL_OPS, cuda_ops - set(bi.OPS) - bi.ROW_LOCAL_OPS


@interp_only
def test_mode_off_keeps_the_default_kernels(monkeypatch):
    monkeypatch.setenv("DSV41_BACKEND", "cuda")
    monkeypatch.delenv(registry.INVARIANT_VAR, raising=False)
    assert registry.dispatch("linear", "cpu") is not bi.linear
    with registry.batch_invariant_mode():
        assert registry.dispatch("linear", "cpu") is bi.linear
    assert registry.dispatch("linear", "cpu") is not bi.linear
    registry.reset_warnings()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt,out_dtype", [("fp8", torch.float32), ("fp8", torch.bfloat16), ("fp4", torch.float32),
                                           ("bf16", torch.float32), ("bf16", torch.bfloat16)])
def test_linear_row_alone_equals_batch(invariant, dev, fmt, out_dtype, rng):
    w, s = weight(fmt, 48, 96, rng)
    w, s = w.to(dev), None if s is None else s.to(dev)
    x, = on(dev, wide(rng, 70, 96))  # > 64 rows: the default leaves the fold path
    rows_alone_equal_batch(lambda a: ops.linear(a, w, s, out_dtype), (x,), lambda i: (x[i:i + 1],), (0, 33, 69))


def _key(dev: str) -> str:
    return "cuda" if dev == "cuda" else "interp"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
def test_linear_k_split_is_the_same_for_every_row_count(invariant, dev, fmt, rng, monkeypatch):
    """The K split (several slices for this weight shape) runs as programs of their own at one
    row and inside each tile's program at 70 rows (the tile threshold set between them); a row
    alone equals it in the batch bit for bit, both launch forms agree at 70 rows, and one slice (a
    split that followed the row count would give it at some M) differs: the check can fail."""
    key = _key(dev)
    n, k = (192, 1024) if key == "cuda" else (48, 256)  # slices of several K steps
    tiles = bi.LINEAR_TILES[key]
    slices = bi.linear_slices(n, k, key)
    assert slices > 1
    monkeypatch.setitem(bi.LINEAR_SPLIT[key], "parallel_tiles", -(-n // tiles["bn"]) + 1)
    assert not bi.linear_serial(1, n, key) and bi.linear_serial(70, n, key)
    w, s = weight(fmt, n, k, rng)
    x = wide(rng, 70, k)
    want = basic.linear(x, w, s, torch.float64)
    w, s = w.to(dev), None if s is None else s.to(dev)
    x, = on(dev, x)
    call = lambda a: ops.linear(a, w, s, torch.float32)  # noqa: E731
    rows_alone_equal_batch(call, (x,), lambda i: (x[i:i + 1],), (0, 33, 69))
    full = call(x)
    assert rel_err(full, want) < BOUND[torch.float32]
    parallel = block_linear.linear(x, w, s, torch.float32, path="tiled", split_k=slices, **tiles)
    assert torch.equal(parallel, full), "the split launch differs from the in-program slices"
    one = block_linear.linear(x, w, s, torch.float32, path="tiled", split_k=1, **tiles)
    assert not torch.equal(one, full), "one K slice gives the same bits: these inputs cannot show the split"


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_linear_row_alone_equals_batch(invariant, dev, rng):
    w = (torch.randn(2 * 32, 64, generator=rng) * 0.1).to(torch.bfloat16)
    x, w = on(dev, wide(rng, 37 * 2, 64).view(37, 2, 64), w)
    rows_alone_equal_batch(ops.grouped_linear, (x, w), lambda i: (x[i:i + 1], w), (0, 36))


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_experts_row_alone_equals_batch(invariant, dev, rng):
    t, n_exp, topk, d, inter = 37, 6, 2, 64, 64
    x = wide(rng, t, d)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    w = torch.rand(t, topk, generator=rng) + 0.1
    x, w, ids = on(dev, x, w, ids)
    ex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in experts_in("fp4", n_exp, d, inter, rng)]
    rows_alone_equal_batch(lambda a, b, c: ops.moe_experts(a, b, c, ex, 10.0), (x, w, ids),
                           lambda i: (x[i:i + 1], w[i:i + 1], ids[i:i + 1]), (0, 20))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])  # (FP4 experts take the fold path: the next test)
def test_moe_k_split_is_the_same_for_every_token_count(invariant, dev, fmt, rng, monkeypatch):
    """As the linear's split test, for both expert kernels: the slices as programs at one token,
    inside each program at t tokens (the row threshold set between them), row alone = row in
    the batch, both launch forms equal at t tokens, and no split gives other bits."""
    key = _key(dev)
    t, n_exp, topk = (37, 6, 2) if key == "cuda" else (9, 4, 2)
    d, inter = (1024, 512) if key == "cuda" else (256, 256)
    split = bi.moe_slices(inter, d, key)
    assert min(split) > 1
    monkeypatch.setitem(bi.MOE_SPLIT[key], "parallel_rows", topk)
    x = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    w = torch.rand(t, topk, generator=rng) + 0.1
    ex = experts_in(fmt, n_exp, d, inter, rng)
    with numerics("official"):  # the kernels round where the official expert does
        want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    x, w, ids = on(dev, x, w, ids)
    ex = [tuple((a.to(dev), None if b is None else b.to(dev)) for a, b in e) for e in ex]
    call = lambda a, b, c: ops.moe_experts(a, b, c, ex, 10.0)  # noqa: E731
    rows_alone_equal_batch(call, (x, w, ids), lambda i: (x[i:i + 1], w[i:i + 1], ids[i:i + 1]), (0, t // 2, t - 1))
    full = call(x, w, ids)
    assert rel_err(full, want) < 1e-4  # test_triton_block_linear's MoE bound (rare rounding-boundary moves)
    tiles = bi.MOE_TILES[key]
    parallel = moe_mod.moe_experts(x, w, ids, ex, 10.0, path="tiled", k_split=split, **tiles)
    assert torch.equal(parallel, full), "the split launch differs from the in-program slices"
    # The experts round their sums to bf16 (official mode), which hides most fp32 order changes:
    # rows that cancel across the gate/up slice boundary (+L in the first slice, -L in the second,
    # small values beside them, nothing in later slices, w1 = w3 constant along K) sum to 0 split
    # and to the second slice's small values in one pass, so there the split shows in the output.
    kps = moe_mod._k_slices(d, tiles["bk"], split[0])[1]
    xc = torch.zeros(t, d)
    xc[:, 32:kps] = torch.rand(t, kps - 32, generator=rng) + 0.5
    xc[:, kps + 32:2 * kps] = torch.rand(t, kps - 32, generator=rng) + 0.5
    xc[:, 0], xc[:, kps] = 2.0 ** 40, -2.0 ** 40  # fp32 spacing there: 2^17
    flat = [(weight_const(fmt, inter, d), weight_const(fmt, d, inter), weight_const(fmt, inter, d))
            for _ in range(n_exp)]
    flat = [tuple((a.to(dev), None if b is None else b.to(dev)) for a, b in e) for e in flat]
    xc, = on(dev, xc.to(torch.bfloat16))
    got = ops.moe_experts(xc, w, ids, flat, 10.0)
    assert torch.equal(got, moe_mod.moe_experts(xc, w, ids, flat, 10.0, path="tiled", k_split=split, **tiles))
    assert got.abs().max() == 0  # the split sums cancel exactly
    one = moe_mod.moe_experts(xc, w, ids, flat, 10.0, path="tiled", **tiles)
    assert one.abs().min() > 0, "one pass over K keeps the small values"


def weight_const(fmt: str, n: int, k: int):
    """A weight whose rows are constant along K (0.5, 1, 2 by row), exact in `fmt`."""
    w = torch.exp2(torch.arange(n).remainder(3).float() - 1).unsqueeze(1).expand(n, k).contiguous()
    if fmt == "bf16":
        return w.to(torch.bfloat16), None
    return quant.fp8_block_quant(w) if fmt == "fp8" else quant.fp4_weight_quant(w)


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_fp4_fold_path_row_alone_equals_batch(invariant, dev, rng):
    """FP4 experts the folded kernels take run there with one tile table for every token count:
    a token alone equals it among 37 (several row tiles per expert), and the result is the
    reference's within the MoE kernels' bound."""
    key = _key(dev)
    t, n_exp, topk = 37, 4, 3
    d, inter = (1024, 512) if key == "cuda" else (128, 128)
    x = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    w = torch.rand(t, topk, generator=rng) + 0.1
    ex = experts_in("fp4", n_exp, d, inter, rng)
    with numerics("official"):
        want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    x, w, ids = on(dev, x, w, ids)
    ex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    moe_mod._expert_table(ex, x.device)
    assert moe_mod.foldable(ex)  # the fold branch is the one taken
    call = lambda a, b, c: ops.moe_experts(a, b, c, ex, 10.0)  # noqa: E731
    rows_alone_equal_batch(call, (x, w, ids), lambda i: (x[i:i + 1], w[i:i + 1], ids[i:i + 1]), (0, 18, 36))
    assert rel_err(call(x, w, ids), want) < 1e-4


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_route_row_alone_equals_batch(invariant, dev, rng):
    x = (torch.randn(37, 64, generator=rng) * 0.5).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=rng) * 0.125).to(torch.bfloat16)
    x, w, bias = on(dev, x, w, torch.randn(16, generator=rng) * 0.1)
    for part in (0, 1):  # weights, ids
        rows_alone_equal_batch(lambda a: ops.moe_route(a, w, bias, 4, 2.5), (x,), lambda i: (x[i:i + 1],), (0, 36),
                               out_of=lambda r: r[part])


def mhc_rows_alone_equal_batch(dev, rng, t: int, d: int, iters: int):
    """`mhc_mix` and `mhc_mixes` over t rows of width d: rows 0 and t - 1 alone equal the batch's."""
    x, y, post, comb, pre, fn, scale, base = on(dev, *mhc_inputs(rng, t, d))
    sl = lambda i: [a[i:i + 1] for a in (x, y, post, comb, pre)]  # noqa: E731
    mix = lambda *a: torch.cat([a[0].flatten(1), a[1], *(c.flatten(1) for c in a[2])], 1)  # noqa: E731
    rows_alone_equal_batch(lambda *a: mix(*ops.mhc_mix(*a, fn, scale, base, 1e-6, 1e-6, iters)),
                           (x, y, post, comb, pre), sl, (0, t - 1))
    rows_alone_equal_batch(lambda a: torch.cat([c.flatten(1) for c in ops.mhc_mixes(a, fn, scale, base, 1e-6, 1e-6,
                                                                                    iters)], 1),
                           (x,), lambda i: (x[i:i + 1],), (0, t - 1))
    return x, y, post, comb


@pytest.mark.parametrize("dev", DEVICES)
def test_mhc_row_alone_equals_batch(invariant, dev, rng):
    x, y, post, comb = mhc_rows_alone_equal_batch(dev, rng, 37, 64, 3)
    rows_alone_equal_batch(ops.mhc_update, (x, y, post, comb), lambda i: [a[i:i + 1] for a in (x, y, post, comb)],
                           (0, 36))
    logits, = on(dev, torch.randn(37, 4, 4, generator=rng) * 2)
    rows_alone_equal_batch(lambda a: ops.sinkhorn(a, 5, 1e-6), (logits,), lambda i: (logits[i:i + 1],), (0, 36))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
def test_mhc_row_alone_equals_batch_at_model_width_gpu(invariant, dev, rng, monkeypatch):
    """mHC at the mini width (d 5120, 40 d chunks) and a prefill-sized batch: the coefficients of
    a row alone equal that row's in the batch. The coefficient epilogue's default block of chunk
    partials follows its tokens per tile; with it the row differs (this broke greedy = prefill on
    mini; narrow widths hide it), so the test sees the mode's block `MHC_COEF_CB` at work. (The
    default takes one token a tile up to `COEF_ONE_MAX_T` tokens, so 48 rows would share the lone
    row's block there: the negative check sets the 4-token tiles that a longer batch takes.)"""
    from dsv41.npu_ops.triton import mega_mhc

    x = torch.empty(1, 4, 5120, device=dev)
    assert bi._mhc_d_split(x) > 8, "the mode's d split no longer exceeds the blocks the default groups by"
    mhc_rows_alone_equal_batch(dev, rng, 48, 5120, 20)
    monkeypatch.setattr(bi, "MHC_COEF_CB", None)
    monkeypatch.setattr(mega_mhc, "COEF_ONE_MAX_T", 0)
    with pytest.raises(AssertionError, match="alone differs"):
        mhc_rows_alone_equal_batch(dev, rng, 48, 5120, 20)


@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_query_alone_equals_batch(invariant, dev, rng, monkeypatch):
    q, swa_kv, swa_scale, win, glob_kv, glob_scale, glob_idx, sink = on(dev, *attention_inputs(rng, 37, 16, 64, 24,
                                                                                               64, 20))

    def run(qq, ww, gg):
        return ops.sparse_attention(qq, swa_kv, swa_scale, ww, glob_kv, glob_scale, gg, sink, 0.125)

    key = _key(dev)
    assert bi.attention_splits(win.shape[1], glob_idx.shape[1], key) > 1
    rows_alone_equal_batch(run, (q, win, glob_idx), lambda i: (q[i:i + 1], win[i:i + 1], glob_idx[i:i + 1]),
                           (0, 5, 36))
    full = run(q, win, glob_idx)
    monkeypatch.setitem(bi.ATTN_SPLIT[key], "partial_bytes", 1)  # one query per launch
    assert torch.equal(run(q[:9], win[:9], glob_idx[:9]), full[:9]), "query chunks differ from one launch"
    # the split shows in the bits: one split per query (a query-count-dependent split) differs
    cfg = {a: b for a, b in attn_mod.CONFIGS[key].items() if a != "min_blocks_per_split"}
    one = attn_mod.sparse_attention_launch(q, swa_kv, swa_scale, win, glob_kv, glob_scale, glob_idx, sink, 0.125,
                                           n_split=1, **cfg)
    assert not torch.equal(one, full), "one split gives the same bits: these inputs cannot show the split"


@pytest.mark.parametrize("dev", DEVICES)
def test_indexer_query_alone_equals_batch(invariant, dev, rng):
    """Scores through the top-k: rows of two sequences side by side, and one sequence alone."""
    t, h, d, e = 37, 4, 64, 8
    q, w, codes, kscale = indexer_inputs(rng, t, h, d, 96)
    codes2, kscale2 = quant.mxfp4_quant(torch.randn(64, d, generator=rng))
    seq_of = [i % 2 for i in range(t)]
    pool_c, pool_s, table = paged(rng, [(codes, kscale), (codes2, kscale2)], seq_of, e)
    n_vis = torch.tensor([min(96 if s == 0 else 64, 10 + 2 * i) for i, s in enumerate(seq_of)])
    q, w, pool_c, pool_s, table, n_vis = on(dev, q, w, pool_c, pool_s, table, n_vis)

    def run(qq, ww, tt, nn):
        return ops.indexer_topk(qq, ww, pool_c, pool_s, tt, e, nn, 8)[0]

    args = (q, w, table, n_vis)
    rows_alone_equal_batch(run, args, lambda i: [a[i:i + 1] for a in args], (0, 1, 36))
    one = [i for i in range(t) if seq_of[i] == 0]  # one sequence: the shared-rows MMA path
    sub = [a[one] for a in args]
    rows_alone_equal_batch(run, sub, lambda i: [a[i:i + 1] for a in sub], (0, len(one) - 1))


@interp_only
@pytest.mark.slow  # about 3 minutes under the interpreter (four tiny-model forwards)
def test_greedy_decode_equals_exact_prefill_tiny(invariant, fresh_seed):
    """The tiny preset on the CUDA op set (interpreter): greedy decode == exact prefill argmax at
    every position, and the decode steps' logits equal the prefill's rows bit for bit."""
    model = build_model(preset("tiny"), seed=fresh_seed, with_drafter=False)
    r = greedy_self_consistency(model, n_prompt=5, n_new=3, seed=fresh_seed, batch_invariant=True)
    assert r["batch_invariant"] and r["positions"] == 3
    assert r["agree"] == 1.0 and r["max_logit_diff"] == 0.0, r
