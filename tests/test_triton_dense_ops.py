"""The CUDA backend's smaller ops (fp8_quant, mxfp4_quant, rms_norm, rope, swiglu_clamped,
mhc_mixes, mhc_collapse, engram_gate) against the reference, and the backend's completeness.

Quantisers are bit-exact; the rest agree within fp32 rounding before the final rounding to the
output dtype (bf16 outputs: within one bf16 step, ~3e-3 relative in norm at most).
Interpreter variants on CPU and `gpu`-marked compiled variants at model widths.
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import cuda, registry  # noqa: E402
from dsv41.backends.reference import basic, mhc, quant  # noqa: E402
from dsv41.npu_ops.triton import engram_gate as eg  # noqa: E402
from dsv41.npu_ops.triton import fp8_quant as fq  # noqa: E402
from dsv41.npu_ops.triton import mhc_mixes as mm  # noqa: E402
from dsv41.npu_ops.triton import mxfp4_quant as mq  # noqa: E402
from dsv41.npu_ops.triton import rms_norm as rn  # noqa: E402
from dsv41.npu_ops.triton import rope as rp  # noqa: E402
from dsv41.npu_ops.triton import swiglu as sw  # noqa: E402

pytestmark = cuda_only

GPU = [DEVICES[1]]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got - want).norm() / want.norm()).item()


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.cpu().contiguous().view(torch.uint8),
                                                   want.contiguous().view(torch.uint8))


def scaled_rows(rng, *shape):
    """Rows with per-row magnitudes from 2^-20 to 2^20, some zero groups and a -0.0."""
    x = torch.randn(*shape, generator=rng) * torch.exp2(torch.randint(-20, 21, (*shape[:-1], 1), generator=rng).float())
    x.view(-1, shape[-1])[0, :32] = 0.0
    x.view(-1)[x.numel() // 2 + 1] = -0.0
    return x


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 5, 64)])
def test_fp8_quant_bit_exact(dev, shape, rng):
    x = scaled_rows(rng, *shape)
    q, s = fq.fp8_quant(x.to(dev))
    rq, rs = quant.fp8_quant(x)
    assert same_bytes(q, rq) and same_bytes(s, rs)
    assert torch.equal(fq.fp8_qdq_bf16(x.to(dev)).cpu().float(), quant.fp8_qdq(x))
    xb = x.to(torch.bfloat16)
    assert same_bytes(fq.fp8_quant(xb.to(dev))[0], quant.fp8_quant(xb)[0])


@pytest.mark.parametrize("dev", DEVICES)
def test_fp8_quant_rounding_edges(dev):
    """Every E4M3 value, the midpoints between neighbours and their float neighbours, in groups
    whose amax is 448 (scale 1), so each value meets the rounding unchanged."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (v[:-1] + v[1:]) / 2
    vals = torch.cat([v, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    vals = torch.cat([vals, -vals])
    pad = (-vals.numel()) % 31
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], 1)
    q, s = fq.fp8_quant(x.to(dev))
    rq, rs = quant.fp8_quant(x)
    assert same_bytes(q, rq) and same_bytes(s, rs)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", [(1, 32), (9, 128), (2, 3, 64)])
def test_mxfp4_quant_bit_exact(dev, shape, rng):
    x = scaled_rows(rng, *shape)
    p, s = mq.mxfp4_quant(x.to(dev))
    rp_, rs = quant.mxfp4_quant(x)
    assert same_bytes(p, rp_) and same_bytes(s, rs)


def test_quantisers_reject_bad_width():
    with pytest.raises(ValueError, match="multiple of 32"):
        fq.fp8_quant(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        mq.mxfp4_quant(torch.zeros(2, 48))


def check_dense(dev, t, d, r, heads, rng):
    """rms_norm, rope (both directions), swiglu at one size."""
    for dtype, bound in ((torch.bfloat16, 4e-3), (torch.float32, 1e-6)):
        x = (torch.randn(t, heads, d, generator=rng) * 5).to(dtype)
        w = (1 + 0.2 * torch.randn(d, generator=rng)).to(torch.bfloat16)
        assert rel_err(rn.rms_norm(x.to(dev), w.to(dev), 1e-20), basic.rms_norm(x, w, 1e-20)) < bound
        ang = torch.rand(t, r // 2, generator=rng) * 100
        for inverse in (False, True):
            got = rp.rope(x.to(dev), ang.cos().to(dev), ang.sin().to(dev), inverse)
            assert got.dtype == dtype
            assert rel_err(got, basic.rope(x, ang.cos(), ang.sin(), inverse)) < bound
    g, u = torch.randn(t, 3 * d, generator=rng) * 8, torch.randn(t, 3 * d, generator=rng) * 8
    assert rel_err(sw.swiglu_clamped(g.to(dev), u.to(dev), 10.0), basic.swiglu_clamped(g, u, 10.0)) < 1e-6


@pytest.mark.parametrize("dev", DEVICES)
def test_norm_rope_swiglu(dev, rng):
    check_dense(dev, 3, 64, 16, 2, rng)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_row_strided(dev, dtype, rng):
    """Rows of a 2-D view read at their stride (`linear_pair`'s outputs: columns of one stacked
    output): the same bits as the contiguous copy, a contiguous result, the view untouched."""
    t, d, wide = 5, 96, 160
    y = (torch.randn(t, wide, generator=rng) * 5).to(dtype).to(dev)
    w = (1 + 0.2 * torch.randn(d, generator=rng)).to(torch.bfloat16).to(dev)
    before = y.clone()
    for x in (y[:, :d], y[:, wide - d:]):
        got = rn.rms_norm(x, w, 1e-20)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, rn.rms_norm(x.contiguous(), w, 1e-20))
        assert rel_err(got, basic.rms_norm(x.cpu(), w.cpu(), 1e-20)) < (4e-3 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(y, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("t", [1, 64, 1000])
def test_norm_rope_swiglu_model_shapes_gpu(dev, t, rng):
    check_dense(dev, t, 512, 64, 64, rng)
    x = torch.randn(t, 5120, generator=rng).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(5120, generator=rng)).to(torch.bfloat16)
    assert rel_err(rn.rms_norm(x.to(dev), w.to(dev), 1e-20), basic.rms_norm(x, w, 1e-20)) < 4e-3


def check_mhc_engram(dev, t, d, rng):
    n = 4
    x = torch.randn(t, n, d, generator=rng).to(torch.bfloat16)
    fn = torch.randn(24, n * d, generator=rng) * (n * d) ** -0.5
    scale, base = torch.rand(3, generator=rng) + 0.5, torch.randn(24, generator=rng) * 0.5
    got = mm.mhc_mixes(x.to(dev), fn.to(dev), scale.to(dev), base.to(dev), 1e-20, 1e-6, 20)
    for g, w in zip(got, mhc.mhc_mixes(x, fn, scale, base, 1e-20, 1e-6, 20)):
        assert rel_err(g, w) < 1e-5
    pre = torch.rand(t, n, generator=rng)
    assert rel_err(mm.mhc_collapse(x.to(dev), pre.to(dev)), mhc.mhc_collapse(x, pre)) < 4e-3
    k, v = torch.randn(t, n, d, generator=rng), torch.randn(t, d, generator=rng)
    qw = (torch.rand(n, d, generator=rng) + 0.5).to(torch.bfloat16)
    kw = (torch.rand(n, d, generator=rng) + 0.5).to(torch.bfloat16)
    img = torch.rand(t, generator=rng) < 0.3
    got = eg.engram_gate(x.to(dev), k.to(dev), v.to(dev), qw.to(dev), kw.to(dev), 1e-20, img.to(dev))
    assert rel_err(got, basic.engram_gate(x, k, v, qw, kw, 1e-20, img)) < 4e-3
    # the model's form: bf16 k and v as strided views of one wkv output row [(n + 1) d], read in
    # place; the same values as widened, contiguous copies of them
    kv = torch.randn(t, (n + 1) * d, generator=rng).to(torch.bfloat16).to(dev)
    kb, vb = kv[:, : n * d].reshape(t, n, d), kv[:, n * d:]
    got = eg.engram_gate(x.to(dev), kb, vb, qw.to(dev), kw.to(dev), 1e-20, img.to(dev))
    want = eg.engram_gate(x.to(dev), kb.float().contiguous(), vb.float().contiguous(), qw.to(dev), kw.to(dev), 1e-20,
                          img.to(dev))
    assert torch.equal(got, want) and rel_err(got, basic.engram_gate(x, kb.cpu(), vb.cpu(), qw, kw, 1e-20, img)) < 4e-3
    with pytest.raises(ValueError, match=rf"q_weight must be \[n_streams, d\] = \[{n}, {d}\]"):
        eg.engram_gate(x.to(dev), k.to(dev), v.to(dev), qw[0].to(dev), kw[0].to(dev), 1e-20, img.to(dev))


@pytest.mark.parametrize("dev", DEVICES)
def test_mhc_entry_and_engram_gate(dev, rng):
    check_mhc_engram(dev, 3, 128, rng)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["two_launches", "fused"])
@pytest.mark.parametrize("t", [1, 19])
@pytest.mark.parametrize("tdot", [False, True], ids=["fn_dot", "tdot"])
def test_mhc_mixes_coefficient_paths(dev, fused, t, tdot, rng):
    """mhc_mixes with the coefficients in a second launch or in the partials kernel's last
    program per token tile (several d chunks per tile; called twice: the tile counters return
    to zero), with either projection form (tdot: fn's bf16 parts, transposed), outputs poisoned
    beforehand by NaN-filled allocations."""
    n, d = 4, 256
    x = torch.randn(t, n, d, generator=rng).to(torch.bfloat16)
    fn = torch.randn(24, n * d, generator=rng) * (n * d) ** -0.5
    scale, base = torch.rand(3, generator=rng) + 0.5, torch.randn(24, generator=rng) * 0.5
    want = mhc.mhc_mixes(x, fn, scale, base, 1e-20, 1e-6, 20)
    for _ in range(2):
        torch.empty(4 << 16, device=dev).fill_(float("nan"))  # poison the allocator's free blocks
        got = mm.mhc_mixes(x.to(dev), fn.to(dev), scale.to(dev), base.to(dev), 1e-20, 1e-6, 20, fused=fused, tdot=tdot)
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("t", [1, 64, 512])
def test_mhc_entry_and_engram_gate_model_shapes_gpu(dev, t, rng):
    check_mhc_engram(dev, t, 5120, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", GPU)
def test_torch_ops_gpu(dev, rng):
    """The backend's torch-sequence ops: sinkhorn, mhc_update (fp32 math; grouped_linear's cuBLAS
    path is tests/test_triton_grouped_linear.py's)."""
    t, k = 5, 512
    logits = torch.randn(t, 4, 4, generator=rng)
    assert rel_err(cuda.sinkhorn(logits.to(dev), 20, 1e-6), mhc.sinkhorn(logits, 20, 1e-6)) < 1e-5
    xs, y = torch.randn(t, 4, k, generator=rng).to(torch.bfloat16), torch.randn(t, k, generator=rng).to(torch.bfloat16)
    post, comb = torch.rand(t, 4, generator=rng) * 2, torch.softmax(torch.randn(t, 4, 4, generator=rng), -1)
    assert rel_err(cuda.mhc_update(xs.to(dev), y.to(dev), post.to(dev), comb.to(dev)),
                   mhc.mhc_update(xs, y, post, comb)) < 4e-3


def test_cuda_backend_covers_every_op(monkeypatch):
    """Every op resolves to a CUDA implementation (no reference fallback): with DSV41_STRICT=1
    a missing one raises. Runs wherever the CUDA backend loads (a GPU, or the interpreter)."""
    monkeypatch.setenv("DSV41_STRICT", "1")
    registry.reset_warnings()
    missing = [op for op in registry.op_names() if registry.resolve(op, "cuda")[1] != "cuda"]
    assert missing == []
    for op in registry.op_names():
        assert registry.dispatch(op, "cuda") is registry.resolve(op, "cuda")[0]
