"""Engram row gather kernel (npu_ops/triton/engram_lookup.py, op `engram_lookup`), bit-exact
against the torch reference: FP8 E4M3 rows with E8M0 (or fp32) scales per 32, INT8 rows with an
fp32 scale per row. Interpreter variant on CPU (TRITON_INTERPRET=1), compiled variant `gpu`
(also reading a pinned host table through its device-visible address)."""

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.reference import basic  # noqa: E402
from dsv41.npu_ops.triton import engram_lookup as eg  # noqa: E402



def assert_bits_equal(got: torch.Tensor, want: torch.Tensor):
    """Same bits, NaNs only where the reference has NaNs (payloads not compared)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.detach().cpu(), want
    gn, wn = g.isnan(), w.isnan()
    assert torch.equal(gn, wn), f"{int((gn != wn).sum())} NaN mismatches"
    gb, wb = g.view(torch.int16)[~gn], w.view(torch.int16)[~wn]
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} mismatches, first {g[~gn][bad[0]].item()} vs {w[~wn][bad[0]].item()}"


def fp8_table(g, n, dh, scale_lo=100, scale_hi=150, nan=False):
    codes = torch.randint(0, 256, (n, dh), generator=g, dtype=torch.uint8)
    if not nan:
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # avoid the NaN codes
    sc = torch.randint(scale_lo, scale_hi, (n, dh // 32), generator=g, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu)


def lookup(dev, table, scale, rows):
    return eg.engram_lookup(table.to(dev), scale.to(dev), rows.to(dev))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t,r,dh,n", [(1, 24, 256, 300), (5, 3, 64, 97), (9, 7, 32, 50)])
@pytest.mark.parametrize("row_dtype", [torch.int64, torch.int32])
def test_engram_fp8_e8m0(dev, t, r, dh, n, row_dtype, rng):
    table, scale = fp8_table(rng, n, dh)
    rows = torch.randint(0, n, (t, r), generator=rng).to(row_dtype)
    assert_bits_equal(lookup(dev, table, scale, rows), basic.engram_lookup(table, scale, rows))


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")  # inf, 0 * inf
@pytest.mark.parametrize("dev", DEVICES)
def test_engram_fp8_all_codes_and_scales(dev, rng):
    """Every E4M3 byte (subnormals, +-0, NaN) under every E8M0 byte (2^-127 .. inf): results
    that overflow to inf, underflow to fp32/bf16 subnormals, and 0 * inf = NaN."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row b: all 256 codes
    sc = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)  # row b: scale byte b
    table, scale = codes.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu)
    rows = torch.randperm(256, generator=rng).reshape(32, 8)
    assert_bits_equal(lookup(dev, table, scale, rows), basic.engram_lookup(table, scale, rows))


@pytest.mark.parametrize("dev", DEVICES)
def test_engram_fp8_f32_scale(dev, rng):
    table, _ = fp8_table(rng, 40, 64)
    scale = torch.randn(40, 2, generator=rng) * 1e-3
    rows = torch.randint(0, 40, (6, 5), generator=rng)
    assert_bits_equal(lookup(dev, table, scale, rows), basic.engram_lookup(table, scale, rows))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("scale_shape", ["flat", "col"])
def test_engram_int8(dev, scale_shape, rng):
    n, dh = 77, 96
    table = torch.randint(-128, 128, (n, dh), generator=rng, dtype=torch.int8)
    scale = torch.rand(n, generator=rng) * 0.05 + 1e-4  # products not exact in bf16: rounding checked
    if scale_shape == "col":
        scale = scale[:, None]
    rows = torch.randint(0, n, (7, 11), generator=rng)
    assert_bits_equal(lookup(dev, table, scale, rows), basic.engram_lookup(table, scale, rows))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", DEVICES[1:])
def test_engram_pinned_host_table(dev, rng):
    """FP8 and INT8 tables in pinned host memory, row ids and output on the GPU."""
    table, scale = fp8_table(rng, 5000, 256)
    rows = torch.randint(0, 5000, (64, 24), generator=rng)
    got = eg.engram_lookup(table.pin_memory(), scale.pin_memory(), rows.to(dev))
    assert got.device.type == "cuda"
    assert_bits_equal(got, basic.engram_lookup(table, scale, rows))
    t8 = torch.randint(-128, 128, (5000, 256), generator=rng, dtype=torch.int8)
    s8 = torch.rand(5000, 1, generator=rng)
    got = eg.engram_lookup(t8.pin_memory(), s8.pin_memory(), rows.to(dev))
    assert_bits_equal(got, basic.engram_lookup(t8, s8, rows))


@pytest.mark.parametrize("dev", DEVICES)
def test_engram_via_registry(dev, monkeypatch, rng):
    from dsv41.backends import ops, registry

    impl, used, reason = registry.resolve("engram_lookup", "cuda")
    assert (impl, used) == (eg.engram_lookup, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")
    table, scale = fp8_table(rng, 60, 64)
    rows = torch.randint(0, 60, (3, 4), generator=rng)
    assert_bits_equal(ops.engram_lookup(table.to(dev), scale.to(dev), rows.to(dev)),
                      basic.engram_lookup(table, scale, rows))


def test_engram_rejects_bad_inputs():
    table, scale = fp8_table(torch.Generator().manual_seed(0), 8, 64)
    with pytest.raises(ValueError):
        eg.engram_lookup(table, scale[:, :1], torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        eg.engram_lookup(torch.zeros(8, 64, dtype=torch.int8), torch.ones(4), torch.zeros(2, 3, dtype=torch.long))
