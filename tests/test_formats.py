"""Numeric formats of MODEL.md section 4, checked against oracles written from the spec text.

The oracles below decode E4M3 / E2M1 from their bit layouts and round with plain Python
floats; they do not call the implementation's rounding.

Round-trip error bounds used here (s = the group's power-of-two or E4M3 scale actually used):
- FP8 E4M3 (3 mantissa bits): a normal value rounds with relative error <= 2^-4 (half an ulp
  of 2^-3 relative); a subnormal (|x/s| < 2^-6) with absolute error <= 2^-10 * s. So per element
  |err| <= 2^-4 |x| + 2^-10 s, and per block |err| <= 2^-4 * amax (s <= amax / 224 because
  2^ceil(log2(amax/448)) < amax / 224).
- FP4 KV (E2M1 with an E4M3 scale s = e4m3(amax/6)): the codes are 0.5 apart below 2, 1 apart
  in [2, 4], 2 apart in [4, 6], so rounding errs by at most s; if s rounded down the group max
  saturates at 6s, and |x| - 6s <= amax - 6s <= 2^-4 amax < s. Hence |err| <= s and
  s <= (1 + 2^-4) amax / 6 for normal scales: about 0.177 of the group amax.
- MXFP4 (E8M0 scale s = 2^ceil(log2(amax/6)), so amax/s is in (3, 6]): if amax/s > 4 the
  error is at most s < amax/4; otherwise every scaled value is <= 4 and errs by at most
  s/2 < amax/6. Hence |err| < amax / 4.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.backends import ops
from dsv41.backends.reference import quant

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---- independent oracles ---------------------------------------------------------------------

def _e4m3_byte_value(b: int) -> float:
    """Positive E4M3 (fn) byte -> value, from the bit layout (bias 7, 3 mantissa bits)."""
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0:
        return m * 2.0**-9
    return (1 + m / 8) * 2.0 ** (e - 7)


E4M3_POS = [(_e4m3_byte_value(b), b) for b in range(0x7F)]  # 0x7F is NaN
assert E4M3_POS[-1][0] == 448.0


def e4m3_round(v: float) -> float:
    """Round a non-negative value to E4M3, nearest, ties to the even mantissa, saturating."""
    if v >= 448.0:
        return 448.0
    best = min(E4M3_POS, key=lambda t: (abs(t[0] - v), t[1] & 1))
    return best[0]


def e2m1_round_code(v: float) -> int:
    """Nearest E2M1 code (ties to the even code), saturating at 6, sign in bit 3."""
    a = abs(v)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))
    return code | (8 if v < 0 else 0)


def ceil_log2_exact(v: float) -> int:
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


def _rand(*shape, scale=1.0):
    x = torch.randn(*shape) * scale
    assert x.abs().max() > 0
    return x


# ---- E2M1 ----------------------------------------------------------------------------------

def test_e2m1_code_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = quant.e2m1_decode(codes)
    for c in range(16):
        mag = E2M1[c & 7]
        expect = -mag if c & 8 else mag
        assert vals[c].item() == expect
        if c & 8:  # sign bit set: negative, or -0.0 for code 8
            assert math.copysign(1.0, vals[c].item()) == -1.0
    assert sorted(set(abs(v) for v in vals.tolist())) == list(E2M1)


def test_e2m1_encode_decode_exact_on_table_values():
    vals = torch.tensor([s * v for v in E2M1 for s in (1.0, -1.0)])
    codes = quant.e2m1_encode(vals)
    assert torch.equal(quant.e2m1_decode(codes), vals)
    # positive values take codes 0..7, negative non-zero ones 9..15
    for v, c in zip(vals.tolist(), codes.tolist()):
        assert c == e2m1_round_code(v)


@pytest.mark.parametrize("mid,lo,hi,even", [
    (0.25, 0, 1, 0), (0.75, 1, 2, 2), (1.25, 2, 3, 2), (1.75, 3, 4, 4),
    (2.5, 4, 5, 4), (3.5, 5, 6, 6), (5.0, 6, 7, 6),
])
def test_e2m1_midpoints_round_to_even_code(mid, lo, hi, even):
    m = torch.tensor(mid)
    below = m.nextafter(torch.tensor(0.0)).item()  # fp32 neighbours
    above = m.nextafter(torch.tensor(10.0)).item()
    x = torch.tensor([mid, below, above, -mid, -below, -above], dtype=torch.float32)
    # the fp32 neighbours of the midpoint must be distinct fp32 values
    assert len(set(x.tolist())) == 6
    got = quant.e2m1_encode(x).tolist()
    assert got == [even, lo, hi, even | 8, lo | 8, hi | 8]
    assert quant.e2m1_decode(torch.tensor([even], dtype=torch.uint8)).item() == E2M1[even]


def test_e2m1_saturates_above_6():
    x = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, float("inf"), -6.5, -1e9, float("-inf")])
    codes = quant.e2m1_encode(x).tolist()
    assert codes == [7, 7, 7, 7, 7, 7, 15, 15, 15]


def test_e2m1_encode_matches_oracle_on_random_values():
    x = _rand(4096, scale=3.0)
    got = quant.e2m1_encode(x).tolist()
    assert got == [e2m1_round_code(v) for v in x.tolist()]


def test_nibble_order_element0_low():
    codes = torch.tensor([[1, 2, 15, 7, 0, 9]], dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x7F, 0x90]]
    assert torch.equal(quant.unpack_nibbles(packed), codes)
    # through fp4_quant: a group [0.5, 6, 0 ...] with amax 6 has scale 1; byte 0 = (7 << 4) | 1
    x = torch.zeros(16)
    x[0], x[1], x[2], x[3] = 0.5, 6.0, -1.0, 3.0
    p, s = quant.fp4_quant(x)
    assert s.float().item() == 1.0
    assert p[0].item() == 0x71 and p[1].item() == 0x5A
    # same bytes when reinterpreted as torch's packed FP4 pair type (element 0 = low nibble is
    # its documented layout; CPU torch has no fp4 casts, so the layout is checked by construction)
    if hasattr(torch, "float4_e2m1fn_x2"):
        v = p.view(torch.float4_e2m1fn_x2)
        assert v.shape == p.shape and v.element_size() == 1
        assert torch.equal(v.view(torch.uint8), p)


def test_unpack_accepts_int8():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = quant.pack_nibbles(codes).view(torch.int8)
    assert torch.equal(quant.unpack_nibbles(packed), codes)


# ---- FP4 main KV: E2M1 + E4M3 per 16 -----------------------------------------------------------

@pytest.mark.parametrize("amax,scale", [
    (6.0, 1.0), (3.0, 0.5), (12.0, 2.0), (7.0, 1.125), (6.0 * 448, 448.0), (6.0 * 500, 448.0),
    (1e-5, 2.0**-9), (0.0, 2.0**-9), (6.0 * 2.0**-9, 2.0**-9), (5.9 * 2.0**-9, 2.0**-9),
    (6.0 * 3 * 2.0**-9, 3 * 2.0**-9),
])
def test_fp4_kv_scale_constructed(amax, scale):
    g = torch.rand(16) * amax * 0.9
    g[5] = -amax if amax else 0.0
    assert e4m3_round(max(amax, 6 * 2.0**-9) / 6) == scale  # the oracle agrees with the table
    _, s = quant.fp4_quant(g)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (1,)
    assert s.float().item() == scale


def test_fp4_kv_all_tiny_group_floor():
    x = torch.full((2, 32), 1e-6)
    x[1, 16:] = 0.0
    x[0, 3] = -3e-6
    p, s = quant.fp4_quant(x)
    assert s.float().tolist() == [[2.0**-9] * 2] * 2
    # values tiny relative to 2^-9 all round to (signed) zero
    assert quant.fp4_dequant(p, s).abs().max().item() == 0.0


def test_fp4_kv_entry_is_288_bytes():
    x = _rand(3, 512)
    p, s = ops.fp4_quant(x)
    assert p.shape == (3, 256) and p.dtype == torch.uint8
    assert s.shape == (3, 32) and s.dtype == torch.float8_e4m3fn
    assert p[0].numel() * p.element_size() + s[0].numel() * s.element_size() == 288


def test_fp4_kv_matches_oracle():
    x = _rand(8, 64, scale=2.0)
    x[0] *= 1e-3  # scales in the E4M3 subnormal range
    x[1] *= 1000.0  # saturating scales (amax / 6 > 448)
    p, s = quant.fp4_quant(x)
    g = x.reshape(8, 4, 16)
    amax = g.abs().amax(-1)
    exp_s = torch.tensor([[e4m3_round(max(a, 6 * 2.0**-9) / 6) for a in row] for row in amax.tolist()])
    assert torch.equal(s.float(), exp_s)
    scaled = (g / exp_s.unsqueeze(-1)).reshape(8, 64)  # fp32 true division, as the spec says
    exp_codes = torch.tensor([[e2m1_round_code(v) for v in row] for row in scaled.tolist()], dtype=torch.uint8)
    assert torch.equal(quant.unpack_nibbles(p), exp_codes)


def test_fp4_kv_roundtrip_error_bound():
    x = _rand(64, 512)
    p, s = ops.fp4_quant(x)
    y = ops.fp4_dequant(p, s)
    assert y.dtype == torch.float32 and y.shape == x.shape
    g, gy = x.reshape(64, 32, 16), y.reshape(64, 32, 16)
    err = (g - gy).abs()
    sf = s.float().unsqueeze(-1)
    amax = g.abs().amax(-1, keepdim=True)
    assert (err <= sf * (1 + 1e-6)).all()
    assert (err <= (1 + 2.0**-4) * amax / 6 * (1 + 1e-6)).all()
    # and it is not trivially exact: the mean relative error of FP4 is a few percent
    rel = (err.sum() / g.abs().sum()).item()
    assert 0.01 < rel < 0.2


# ---- MXFP4: E2M1 + E8M0 per 32 -----------------------------------------------------------------

@pytest.mark.parametrize("k", [-126, -100, -20, -3, -1, 0, 1, 5, 20, 100, 125])
def test_mxfp4_scale_exact_powers_of_two(k):
    g = torch.rand(32) * 6.0 * 2.0**k * 0.99
    g[7] = 6.0 * 2.0**k
    g[9] = -6.0 * 2.0**k * 0.5
    assert g.abs().max().item() == 6.0 * 2.0**k
    p, s = quant.mxfp4_quant(g)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (1,)
    assert quant.e8m0_to_float(s).item() == 2.0**k
    codes = quant.unpack_nibbles(p)
    assert codes[7].item() == 7 and codes[9].item() == 5 | 8  # 6 and -3
    # one fp32 ulp above 6*2^k needs the next power of two
    if k < 125:
        g[7] = torch.tensor(6.0 * 2.0**k).nextafter(torch.tensor(math.inf))
        _, s2 = quant.mxfp4_quant(g)
        assert quant.e8m0_to_float(s2).item() == 2.0 ** (k + 1)


def test_mxfp4_scale_floor():
    for amax in (0.0, 1e-40, 6 * 2.0**-127):
        g = torch.zeros(32)
        g[3] = amax
        _, s = quant.mxfp4_quant(g)
        assert quant.e8m0_to_float(s).item() == 2.0**-126


def test_mxfp4_matches_oracle():
    x = _rand(16, 128) * torch.logspace(-20, 20, 16).unsqueeze(-1)
    p, s = quant.mxfp4_quant(x)
    g = x.reshape(16, 4, 32)
    exps = [[ceil_log2_exact(max(a, 6 * 2.0**-126) / 6) for a in row] for row in g.abs().amax(-1).tolist()]
    e = torch.tensor(exps, dtype=torch.int32)
    assert torch.equal(quant.e8m0_to_float(s), torch.ldexp(torch.ones(16, 4), e))
    assert torch.equal(s.view(torch.uint8).int(), e + 127)
    scaled = torch.ldexp(g, -e.unsqueeze(-1)).reshape(16, 128)
    exp_codes = [[e2m1_round_code(v) for v in row] for row in scaled.tolist()]
    assert quant.unpack_nibbles(p).tolist() == exp_codes


def test_mxfp4_key_is_68_bytes_and_roundtrip_bound():
    x = _rand(256, 128)
    p, s = ops.mxfp4_quant(x)
    assert p.shape == (256, 64) and p.dtype == torch.uint8 and s.shape == (256, 4)
    assert p[0].numel() * p.element_size() + s[0].numel() * s.element_size() == 68
    y = ops.mxfp4_dequant(p, s)
    g, gy = x.reshape(256, 4, 32), y.reshape(256, 4, 32)
    err = (g - gy).abs()
    amax = g.abs().amax(-1, keepdim=True)
    assert (err < amax / 4).all()
    assert torch.equal(ops.mxfp4_act_quant(x), y)


def test_fp4_weight_roundtrip():
    w = _rand(64, 96)
    packed, scale = quant.fp4_weight_quant(w)
    assert packed.dtype == torch.int8 and packed.shape == (64, 48)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (64, 3)
    assert torch.equal(quant.fp4_weight_dequant(packed, scale), quant.mxfp4_dequant(*quant.mxfp4_quant(w)))


# ---- FP8 activations: E4M3 with 2^ceil scales per 32 ------------------------------------------

@pytest.mark.parametrize("amax,exp", [
    (448.0, 0), (449.0, 1), (447.0, 0), (1.0, -8), (448.0 * 2.0**-20, -20), (1e-4, -22), (0.0, -22),
    (1e-9, -22), (448.0 * 2.0**30, 30),
])
def test_fp8_act_scale(amax, exp):
    assert ceil_log2_exact(max(amax, 1e-4) / 448) == exp  # the oracle agrees with the table
    g = torch.rand(2, 32) * amax * 0.5
    g[0, 4] = amax
    g[1, 30] = -amax
    q, s = quant.fp8_quant(g)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 1)
    assert quant.e8m0_to_float(s).tolist() == [[2.0**exp], [2.0**exp]]
    assert q.float().abs().max().item() <= 448.0
    if amax > 0 and amax == 448.0 * 2.0**exp:  # exact power: the max hits +-448 exactly
        assert q[0, 4].float().item() == 448.0 and q[1, 30].float().item() == -448.0


def test_fp8_act_matches_oracle():
    x = _rand(4, 64) * torch.tensor([1e-6, 1e-2, 1.0, 1e4]).unsqueeze(-1)
    q, s = quant.fp8_quant(x)
    g = x.reshape(4, 2, 32)
    exps = [[ceil_log2_exact(max(a, 1e-4) / 448) for a in row] for row in g.abs().amax(-1).tolist()]
    assert quant.e8m0_to_float(s).tolist() == [[2.0**e for e in row] for row in exps]
    for r in range(4):
        for c in range(64):
            v = x[r, c].item() * 2.0 ** -exps[r][c // 32]
            expect = math.copysign(e4m3_round(min(abs(v), 448.0)), v)
            assert q[r, c].float().item() == expect


def test_fp8_e4m3_values_roundtrip_exactly():
    # random finite E4M3 bytes (no NaN), so every value is exactly representable
    b = torch.randint(0, 256, (64, 64), dtype=torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b ^ 1, b)
    x = b.view(torch.float8_e4m3fn).float()
    x[:, 0] = 448.0  # the group max sets the scale to 1 ...
    x[::2, 32] = 0.5  # ... or, with the rest clamped to +-0.5, to 2^-9
    x[::2, 33:] = x[::2, 33:].clamp(-0.5, 0.5)
    y = ops.fp8_dequant(*ops.fp8_quant(x))
    assert torch.equal(y, x)
    assert torch.equal(quant.fp8_qdq(x), x)
    # exact E4M3 values times any power of two also survive
    # (not below the 1e-4 amax floor, which coarsens the grid on purpose)
    for k in (-5, 7, 40):
        xs = x * 2.0**k
        assert torch.equal(quant.fp8_qdq(xs), xs)


def test_fp8_act_roundtrip_bound_and_qdq_consistency():
    x = _rand(32, 256) * torch.logspace(-3, 3, 32).unsqueeze(-1)
    q, s = ops.fp8_quant(x)
    y = ops.fp8_dequant(q, s)
    assert torch.equal(y, quant.fp8_qdq(x))
    sf = quant.e8m0_to_float(s).repeat_interleave(32, -1)
    err = (x - y).abs()
    assert (err <= (2.0**-4 * x.abs() + 2.0**-10 * sf) * (1 + 1e-6)).all()
    amax = x.reshape(32, 8, 32).abs().amax(-1).repeat_interleave(32, -1)
    assert (err <= 2.0**-4 * amax * (1 + 1e-6)).all()
    assert err.max() > 0


def test_fp8_rejects_non_multiple_of_group():
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        quant.fp8_quant(torch.randn(3, 40))


# ---- FP8 32x32 weight blocks -----------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(50, 70), (33, 31), (1, 100), (64, 64), (32, 33)])
def test_fp8_block_quant_shapes_and_scales(n, k):
    w = _rand(n, k) * torch.logspace(-2, 2, n).unsqueeze(-1)
    q, s = quant.fp8_block_quant(w)
    nb, kb = -(-n // 32), -(-k // 32)
    assert q.shape == (n, k) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (nb, kb) and s.dtype == torch.float8_e8m0fnu
    sf = quant.e8m0_to_float(s)
    for i in range(nb):
        for j in range(kb):
            blk = w[32 * i:32 * i + 32, 32 * j:32 * j + 32]
            amax = max(blk.abs().max().item(), 1e-4)
            assert sf[i, j].item() == 2.0 ** ceil_log2_exact(amax / 448)
    y = quant.fp8_block_dequant(q, s)
    assert y.shape == (n, k)
    full_s = sf.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    err = (w - y).abs()
    assert (err <= (2.0**-4 * w.abs() + 2.0**-10 * full_s) * (1 + 1e-6)).all()
    pad = torch.zeros(nb * 32, kb * 32)
    pad[:n, :k] = w.abs()
    bmax = pad.reshape(nb, 32, kb, 32).amax(dim=(1, 3))
    bmax = bmax.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    assert (err <= 2.0**-4 * bmax * (1 + 1e-6)).all()  # <= 2^-4 of the block max
    assert err.max() > 0


def test_fp8_block_dequant_used_by_linear():
    w = _rand(40, 64)
    q, s = quant.fp8_block_quant(w)
    x = _rand(5, 64)
    y = ops.linear(x, q, s, out_dtype=torch.float32)
    ref = quant.fp8_qdq(x).double() @ quant.fp8_block_dequant(q, s).double().t()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
