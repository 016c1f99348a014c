"""The portable Triton kernels on the NPU's storage of float8 data (uint8 bytes,
`backends.platform.storage_dtype`): given byte pools / tables instead of float8 ones they read
and write the same bytes (interpreter on CPU; `simulate_float8_as_bytes` stands for the NPU's
choice). Unverified on hardware."""

import torch

from _triton import triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.platform import simulate_float8_as_bytes  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import compress_kv as ckv  # noqa: E402
from dsv41.npu_ops.triton import engram_lookup as eg  # noqa: E402
from dsv41.npu_ops.triton import fp4_kv_store as fks  # noqa: E402


def test_engram_lookup_reads_byte_tables(rng):
    table, scale = quant.fp8_quant(torch.randn(50, 64, generator=rng))
    rows = torch.randint(0, 50, (4, 3), generator=rng)
    want = eg.engram_lookup(table, scale, rows)
    got = eg.engram_lookup(table.view(torch.uint8), scale.view(torch.uint8), rows)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp4_quant_returns_byte_scales_where_float8_is_stored_as_bytes(rng):
    x = torch.randn(6, 64, generator=rng)
    codes, scales = fks.fp4_quant(x)
    assert scales.dtype == torch.float8_e4m3fn
    with simulate_float8_as_bytes("cpu"):
        b_codes, b_scales = fks.fp4_quant(x)
    assert b_scales.dtype == torch.uint8
    assert torch.equal(b_codes, codes) and torch.equal(b_scales, scales.view(torch.uint8))


def test_compress_kv_writes_byte_pools(rng):
    n, ratio, d, r, cap = 5, 2, 64, 16, 12
    kv = torch.randn(n * ratio, d, generator=rng)
    score = torch.randn(n * ratio, d, generator=rng)
    weight = (1 + 0.3 * torch.randn(d, generator=rng)).to(torch.bfloat16)
    ang = torch.rand(n, r // 2, generator=rng) * 100
    cos, sin = torch.cos(ang), torch.sin(ang)
    slots = torch.randperm(cap, generator=rng)[:n]
    codes = torch.randint(0, 256, (cap, d // 2), generator=rng, dtype=torch.uint8)
    scales = torch.randint(0, 127, (cap, d // 16), generator=rng, dtype=torch.uint8)
    f8_codes, f8_scales = codes.clone(), scales.clone().view(torch.float8_e4m3fn)
    want = ckv.compress_kv(kv, score, ratio, weight, 1e-6, cos, sin, f8_codes, f8_scales, slots)
    got = ckv.compress_kv(kv, score, ratio, weight, 1e-6, cos, sin, codes, scales, slots)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(codes, f8_codes) and torch.equal(scales, f8_scales.view(torch.uint8))
    assert not torch.equal(scales[slots], torch.zeros_like(scales[slots]))  # the rows were written


def test_sparse_attention_reads_byte_pools(rng):
    from test_triton_sparse_attention import make_inputs

    from dsv41.npu_ops.triton import sparse_attention as sa

    q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink = make_inputs(rng, 4, 2, 64, 8, 16, 4)
    want = sa.sparse_attention(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, 0.125)
    got = sa.sparse_attention(q, swa_kv.view(torch.uint8), swa_scale.view(torch.uint8), win_idx, glob_kv,
                              glob_scale.view(torch.uint8), glob_idx, sink, 0.125)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and want.float().abs().max() > 0
