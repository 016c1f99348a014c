"""The Ascend backend's NPU-legal pieces on CPU tensors: the integer-op FP8 / FP4 / E8M0 codecs
against the reference (bit for bit), the fp32 fallbacks (no fp64 or float8 tensor is created),
the per-op plan, and `partial_sum_dtype`. torch_npu itself is not needed (nor importable here)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41.backends import ascend, ops
from dsv41.backends.reference import basic, quant
from dsv41.backends.registry import op_names

FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu}


class DtypeRecorder(TorchDispatchMode):
    """Records the dtype of every tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def npu_legal(fn, *args, **kwargs):
    """Run fn and assert it made no fp64 and no float8 tensor (what Atlas A2/A3 cannot hold)."""
    with DtypeRecorder() as rec:
        out = fn(*args, **kwargs)
    bad = rec.dtypes & (FLOAT8 | {torch.float64})
    assert not bad, f"{getattr(fn, '__name__', fn)} made {bad} tensors"
    return out


def wide(rng, *shape):
    """Values over many binades (exercises subnormal and saturating scales)."""
    return torch.randn(*shape, generator=rng) * torch.exp2(torch.randint(-30, 30, shape, generator=rng).float())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_byte_decoders_cover_every_code():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = npu_legal(ascend.e4m3_decode, b)
    ref = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), ref.isnan())
    assert same_bits(got[~ref.isnan()], ref[~ref.isnan()])  # -0.0 included
    assert torch.equal(npu_legal(ascend.e8m0_decode, b), quant.e8m0_to_float(b.view(torch.float8_e8m0fnu)))


def test_fp8_codecs_match_the_reference(rng):
    x = wide(rng, 6, 128)
    x[0, :32] = 0.0
    x[1, 5] = -1e-30  # rounds to -0.0 like the reference
    assert same_bits(npu_legal(ascend.fp8_qdq_int, x), quant.fp8_qdq(x))
    q, s = npu_legal(ascend.fp8_quant_int, x)
    rq, rs = quant.fp8_quant(x)
    assert q.dtype == torch.uint8 and s.dtype == torch.uint8
    assert same_bits(q, rq) and same_bits(s, rs)
    assert same_bits(npu_legal(ascend.fp8_dequant_int, q, s), quant.fp8_dequant(rq, rs))


def test_fp4_and_mxfp4_codecs_match_the_reference(rng):
    x = wide(rng, 5, 64)
    p, s = npu_legal(ascend.fp4_quant_int, x)
    rp, rs = quant.fp4_quant(x)
    assert same_bits(p, rp) and same_bits(s, rs)
    assert same_bits(npu_legal(ascend.fp4_dequant_int, p, s), quant.fp4_dequant(rp, rs))
    p, s = npu_legal(ascend.mxfp4_quant_int, x)
    rp, rs = quant.mxfp4_quant(x)
    assert same_bits(p, rp) and same_bits(s, rs)
    assert same_bits(npu_legal(ascend.mxfp4_dequant_int, p, s), quant.mxfp4_dequant(rp, rs))


def test_weights_decode_exactly_to_bf16(rng):
    w = torch.randn(72, 96, generator=rng)
    q8, s8 = quant.fp8_block_quant(w)
    got = npu_legal(ascend.weight_to_bf16, q8.view(torch.uint8), s8.view(torch.uint8))
    assert torch.equal(got.float(), basic._dequant_weight(q8, s8))
    q4, s4 = quant.fp4_weight_quant(w)
    got = npu_legal(ascend.weight_to_bf16, q4, s4.view(torch.uint8))
    assert torch.equal(got.float(), basic._dequant_weight(q4, s4))


def test_linear_fallback_on_release_weights(rng):
    """FP8 weight, FP8 activations emulated with integer ops, bf16 matmul: close to the oracle
    (fp32 sums of exact products; bf16 output rounding)."""
    x = torch.randn(5, 96, generator=rng).to(torch.bfloat16)
    w = torch.randn(64, 96, generator=rng) * 0.05
    q8, s8 = quant.fp8_block_quant(w)
    ref = basic.linear(x, q8, s8, torch.float32)
    got = npu_legal(ascend.npu_linear, x, q8.view(torch.uint8), s8.view(torch.uint8), torch.float32)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    got16 = npu_legal(ascend.npu_linear, x, q8.view(torch.uint8), s8.view(torch.uint8), torch.bfloat16)
    assert (got16.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    with pytest.raises(ValueError, match="partial_sum_dtype"):
        ascend.npu_linear(x, q8.view(torch.uint8), s8.view(torch.uint8), torch.float64)


def test_fp32_reference_fallbacks_make_no_fp64(rng):
    t, n, d = 3, 4, 32
    x = torch.randn(t, n, d, generator=rng).to(torch.bfloat16)
    fn = torch.randn(24, n * d, generator=rng)
    scale, base = torch.rand(3, generator=rng), torch.randn(24, generator=rng)
    pre, post, comb = npu_legal(ascend._fp32_reference("mhc_mixes"), x, fn, scale, base, 1e-6, 1e-6, 3)
    rpre, rpost, rcomb = ops.mhc_mixes(x, fn, scale, base, 1e-6, 1e-6, 3)
    for a, b in ((pre, rpre), (post, rpost), (comb, rcomb)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    g, u = torch.randn(4, 16, generator=rng), torch.randn(4, 16, generator=rng)
    y = npu_legal(ascend._fp32_reference("swiglu_clamped"), g, u, 7.0)
    assert (y - basic.swiglu_clamped(g, u, 7.0)).abs().max() <= 1e-6 * y.abs().max()
    w, ids = npu_legal(ascend._fp32_reference("moe_route"), torch.randn(5, 32, generator=rng),
                       torch.randn(8, 32, generator=rng), torch.zeros(8), 2, 1.5)
    assert ids.shape == (5, 2) and torch.allclose(w.sum(-1), torch.full((5,), 1.5))
    assert basic.ACCUM_DTYPE == torch.float64  # the context is left


def test_every_op_has_a_legal_plan():
    plan = ascend.plan(op_names(), [], "no triton here")
    assert set(plan) == set(op_names())
    errors = sorted(n for n, (_, what) in plan.items() if what.startswith("error"))
    assert errors == ["compress_kv", "indexer_topk", "sparse_attention"]
    # angle sums over fp64 tables made once on the host; fp32 on the device, no host sync
    inv = torch.rand(8) * 0.1
    pos = torch.tensor([0, 7, 999_999])
    cos, sin = plan["rope_tables"][0](inv, pos)
    rcos, rsin = ops.rope_tables(inv, pos)
    assert (cos - rcos).abs().max() < 4e-7 and (sin - rsin).abs().max() < 4e-7
    with pytest.raises(NotImplementedError, match="op 'sparse_attention' has no Ascend implementation"):
        plan["sparse_attention"][0]()
    with_triton = ascend.plan(op_names(), ["sparse_attention", "indexer_topk", "compress_kv", "fp4_quant"], None)
    assert not [n for n, (_, what) in with_triton.items() if what.startswith("error")]
    assert with_triton["fp4_quant"][1].startswith("Triton") and with_triton["rms_norm"][1] == "torch_npu.npu_rms_norm"


def test_partial_sum_dtype(monkeypatch):
    monkeypatch.delenv("DSV41_BACKEND", raising=False)
    assert ops.partial_sum_dtype(torch.device("cpu")) == torch.float64
    assert ops.partial_sum_dtype("npu:0") == torch.float32
    assert ops.partial_sum_dtype("cuda") == torch.float32
    monkeypatch.setenv("DSV41_BACKEND", "reference")
    assert ops.partial_sum_dtype("npu") == torch.float32  # never fp64 on an NPU


def test_load_registers_every_op_without_the_reference(monkeypatch):
    """`ascend.load` on a machine that pretends to have an NPU (torch_npu itself is never
    called): every op gets an Ascend entry, so nothing falls back to the fp64 reference."""
    from dsv41.backends import registry

    saved = {n: dict(op.impls) for n, op in registry._OPS.items()}
    monkeypatch.setattr(ascend, "npu_unavailable_reason", lambda: None)
    monkeypatch.setattr(ascend, "triton_op_names", lambda: ([], "no triton in this test"))
    monkeypatch.setattr(ascend, "IMPLEMENTATIONS", {})
    try:
        ascend.load()
        for name in op_names():
            assert "ascend" in registry._OPS[name].impls, name
            assert registry._OPS[name].impls["ascend"] is not registry._OPS[name].impls["reference"], name
        assert registry._OPS["rms_norm"].impls["ascend"] is ascend.npu_rms_norm
        assert set(ascend.IMPLEMENTATIONS) == set(op_names())
    finally:
        for n, impls in saved.items():
            registry._OPS[n].impls.clear()
            registry._OPS[n].impls.update(impls)


def _fake_hc_post():
    """torch.ops._C_ascend.npu_hc_post on CPU with the official hc_post formula (the semantics
    vllm-ascend's DeepSeek-V4 model relies on): out_j = post_j * x + sum_i comb[i, j] * residual_i."""
    if not hasattr(torch.ops._C_ascend, "npu_hc_post"):
        @torch.library.custom_op("_C_ascend::npu_hc_post", mutates_args=())
        def npu_hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
            out = post.unsqueeze(-1) * x.float().unsqueeze(-2) + (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
            return out.to(x.dtype)


def test_vllm_ascend_operators_in_the_plan(rng):
    """Without vllm-ascend nothing of it is chosen; with its npu_hc_post (a CPU fake here) the
    mHC update runs through it and equals the reference; the ops it cannot serve say why."""
    assert ascend.vllm_ascend_ops() == frozenset()  # not installed here
    plain = ascend.plan(op_names(), ["mhc_mix"], None)
    assert plain["mhc_update"][0].__name__ == "mhc_update_fp32_reference"
    assert "npu_sparse_flash_attention" in plain["sparse_attention"][1] and "compressor" in plain["compress_kv"][1]
    with_vendor = ascend.plan(op_names(), ["mhc_mix"], None, frozenset({"npu_hc_post"}))
    assert with_vendor["mhc_update"][0] is ascend.vllm_ascend_mhc_update
    assert with_vendor["mhc_mix"][1].startswith("Triton")  # the whole fused kernel wins over a part
    no_triton = ascend.plan(op_names(), [], "none", frozenset({"npu_hc_post"}))
    assert no_triton["mhc_mix"][0] is ascend.vllm_ascend_mhc_mix
    _fake_hc_post()
    t, n, d = 3, 4, 32
    x = torch.randn(t, n, d, generator=rng).to(torch.bfloat16)
    y = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    post, comb = torch.rand(t, n, generator=rng), torch.rand(t, n, n, generator=rng)
    want = ops.mhc_update(x, y, post, comb)
    got = npu_legal(ascend.vllm_ascend_mhc_update, x, y, post, comb)
    assert got.dtype == want.dtype and (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    pre = torch.rand(t, n, generator=rng)
    fn = torch.randn(24, n * d, generator=rng)
    scale, base = torch.rand(3, generator=rng), torch.randn(24, generator=rng)
    x_new, x_hat, coef = ascend.vllm_ascend_mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-6, 1e-6, 3)
    r_new, r_hat, r_coef = ops.mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-6, 1e-6, 3)
    assert (x_new.float() - r_new.float()).abs().max() <= 2 ** -7 * r_new.float().abs().max()
    assert (x_hat.float() - r_hat.float()).abs().max() <= 2 ** -7 * r_hat.float().abs().max()
    for a, b in zip(coef, r_coef):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()
