"""Triton kernels (npu_ops/triton) against the torch reference, bit-exact.

Runs under the Triton interpreter on CPU (`TRITON_INTERPRET=1`; the `triton` and
`triton_ascend` nox sessions set it, and this module sets it when no CUDA device is present),
and compiled on CUDA for the `gpu`-marked variants (run without TRITON_INTERPRET on a GPU).
Skipped entirely where triton is not installed (the main CPU test env).
"""

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import fp4_kv_store as fkv  # noqa: E402
from dsv41.npu_ops.triton import mxfp4_act_quant as mxa  # noqa: E402



def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes/ints of a tensor, for bit-exact comparisons (also tells -0.0 from 0.0)."""
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t.view(torch.uint8)


def assert_bits_equal(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = bits(got), bits(want)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} mismatches, first at {bad[0].tolist()}: {got.cpu()[tuple(bad[0])]} vs {want.cpu()[tuple(bad[0])]}"


def random_rows(g: torch.Generator, m: int, d: int) -> torch.Tensor:
    """Rows with widely varying magnitudes (per-group scales from 2^-20 to 2^20)."""
    x = torch.randn(m, d, generator=g)
    return x * torch.exp2(torch.randint(-20, 21, (m, d // 16), generator=g).float()).repeat_interleave(16, 1)


def mx_edge_rows() -> torch.Tensor:
    """Groups of 32 hitting the MXFP4 corner cases."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for k in (-126, -100, -3, 0, 1, 7, 100, 125):
        s = 2.0 ** k
        r = torch.zeros(32)
        r[0] = 6 * s  # amax exactly 6 * 2^k: scale exactly 2^k
        r[1:8] = mids * s  # exact midpoints: ties to the even code
        r[8:15] = -mids * s
        r[15:22] = torch.nextafter(mids * s, torch.tensor(0.0))
        r[22:29] = torch.nextafter(mids * s, torch.tensor(float("inf")))
        r[29] = -0.1 * s
        r[30] = -0.0
        rows.append(r)
    rows.append(torch.zeros(32))  # all zero: the amax floor
    rows.append(torch.full((32,), -0.0))
    rows.append(torch.full((32,), 1e-45))  # subnormals below the floor
    for amax in (1.5, 1.5000001, 2.0, 3.0, 0.75, 1.0, 6.0, 6.0000005, 3e38, 2.0 ** -125):
        r = torch.linspace(-1, 1, 32) * amax  # amax at, just above and between powers of two
        rows.append(r)
    return torch.stack(rows)


# ---- mxfp4_act_quant -------------------------------------------------------------------------

@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (19, 128), (3, 5, 96)])
def test_mxfp4_act_quant_random(dev, shape, rng):
    x = torch.randn(*shape, generator=rng) * torch.exp2(torch.randint(-30, 31, shape[:-1] + (1,), generator=rng).float())
    got = mxa.mxfp4_act_quant(x.to(dev))
    assert_bits_equal(got, mxa.mxfp4_act_quant_ref(x))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 * 2^126 is inf, in the reference too
@pytest.mark.parametrize("dev", DEVICES)
def test_mxfp4_act_quant_edges(dev):
    x = mx_edge_rows()
    assert_bits_equal(mxa.mxfp4_act_quant(x.to(dev)), mxa.mxfp4_act_quant_ref(x))
    # the same groups laid out as one wide row
    xw = x.reshape(1, -1)
    assert_bits_equal(mxa.mxfp4_act_quant(xw.to(dev)), mxa.mxfp4_act_quant_ref(xw))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_act_quant_low_precision_in_out(dev, dtype, rng):
    x = torch.randn(9, 64, generator=rng).to(dtype)
    assert_bits_equal(mxa.mxfp4_act_quant(x.to(dev)), mxa.mxfp4_act_quant_ref(x))
    # output in the input dtype: every MXFP4 value with a normal scale is exact in bf16/fp16
    assert_bits_equal(mxa.mxfp4_act_quant(x.to(dev), out_dtype=dtype), mxa.mxfp4_act_quant_ref(x).to(dtype))


def test_mxfp4_act_quant_rejects_bad_width():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxa.mxfp4_act_quant(torch.zeros(2, 48))


# ---- fp4_kv_store ----------------------------------------------------------------------------

def e4m3_boundary_rows() -> torch.Tensor:
    """Rows of 16 whose amax / 6 sits on, just below and just above every E4M3 value and
    rounding midpoint (and past the 448 saturation), with E2M1 midpoints of that scale."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (v[:-1] + v[1:]) / 2
    zero, big = torch.tensor(0.0), torch.tensor(float("inf"))
    q = torch.cat([v, mids, torch.nextafter(mids, zero), torch.nextafter(mids, big),
                   torch.tensor([448.0, 460.0, 464.0, 470.0, 1e6, 0.0])])
    amax = q * 6
    x = torch.zeros(amax.numel(), 16)
    x[:, 0] = amax
    x[:, 1] = -amax
    e2m1_mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    s = amax.div(6).clamp(2.0 ** -9, 448).to(torch.float8_e4m3fn).float()[:, None]
    x[:, 2:9] = e2m1_mids * s  # exact E2M1 midpoints of the chosen scale
    x[:, 9:16] = -torch.nextafter(e2m1_mids * s, torch.tensor(float("inf")))[:, :7]
    return x


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m,d", [(1, 16), (5, 64), (23, 128), (4, 512)])
def test_fp4_quant_random(dev, m, d, rng):
    x = random_rows(rng, m, d)
    codes, scale = fkv.fp4_quant(x.to(dev))
    rc, rs = quant.fp4_quant(x)
    assert_bits_equal(codes, rc)
    assert scale.dtype == torch.float8_e4m3fn
    assert_bits_equal(scale, rs)


@pytest.mark.parametrize("dev", DEVICES)
def test_fp4_quant_edges(dev):
    x = torch.cat([e4m3_boundary_rows(), mx_edge_rows().reshape(-1, 16)])
    codes, scale = fkv.fp4_quant(x.to(dev))
    rc, rs = quant.fp4_quant(x)
    assert_bits_equal(codes, rc)
    assert_bits_equal(scale, rs)


@pytest.mark.parametrize("dev", DEVICES)
def test_fp4_quant_bf16_word_path(dev, rng):
    """bf16 rows go through the two-channels-per-word encoder: bit-exact with the reference on
    E4M3 / E2M1 boundaries (exact in bf16), -0.0, fp32-subnormal values, zero groups and random
    rows."""
    edges = torch.cat([e4m3_boundary_rows(), mx_edge_rows().reshape(-1, 16)])
    x = torch.cat([edges, random_rows(rng, 8, 512).reshape(-1, 16)]).to(torch.bfloat16)
    x[::7, 5] = -0.0
    x = x[torch.randperm(x.shape[0], generator=rng)]
    assert fkv._words(x) is not None  # the fast path is the one under test
    rc, rs = quant.fp4_quant(x)
    codes = torch.zeros(x.shape[0], 8, dtype=torch.uint8, device=dev)
    scales = torch.zeros(x.shape[0], 1, dtype=torch.float8_e4m3fn, device=dev)
    fkv.fp4_kv_store(x.to(dev), torch.arange(x.shape[0], device=dev), codes, scales)
    assert_bits_equal(codes, rc)
    assert_bits_equal(scales, rs)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_fp4_kv_store_scatter(dev, dtype, slot_dtype, rng):
    m, d, n_slots = 11, 64, 29
    x = random_rows(rng, m, d).to(dtype)
    slots = torch.randperm(n_slots, generator=rng)[:m].to(slot_dtype)
    slots[3] = -1  # skipped row
    codes = torch.randint(0, 256, (n_slots, d // 2), generator=rng, dtype=torch.uint8)
    scales = torch.randint(0, 127, (n_slots, d // 16), generator=rng, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want_c, want_s = codes.clone(), scales.clone()
    fkv.fp4_kv_store_ref(x, slots, want_c, want_s)
    got_c, got_s = codes.to(dev), scales.to(dev)
    fkv.fp4_kv_store(x.to(dev), slots.to(dev), got_c, got_s)
    assert_bits_equal(got_c, want_c)  # written rows match, untouched rows unchanged
    assert_bits_equal(got_s, want_s)


def test_fp4_kv_store_rejects_bad_shapes():
    with pytest.raises(ValueError):
        fkv.fp4_kv_store(torch.zeros(2, 24), torch.arange(2), torch.zeros(4, 12, dtype=torch.uint8),
                         torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fkv.fp4_kv_store(torch.zeros(2, 32), torch.arange(3), torch.zeros(4, 16, dtype=torch.uint8),
                         torch.zeros(4, 2, dtype=torch.uint8))


# ---- registration ----------------------------------------------------------------------------

@pytest.mark.parametrize("dev", DEVICES)
def test_cuda_backend_registers_kernels(dev, monkeypatch, rng):
    from dsv41.backends import ops

    for name, fn in (("mxfp4_act_quant", mxa.mxfp4_act_quant), ("fp4_quant", fkv.fp4_quant)):
        impl, used, reason = registry.resolve(name, "cuda")
        assert (impl, used) == (fn, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")  # CPU tensors reach the (interpreted) kernels
    x = torch.randn(4, 64, generator=rng)
    assert_bits_equal(ops.mxfp4_act_quant(x.to(dev)), quant.mxfp4_qdq(x))
    c, s = ops.fp4_quant(x.to(dev))
    rc, rs = quant.fp4_quant(x)
    assert_bits_equal(c, rc)
    assert_bits_equal(s, rs)
