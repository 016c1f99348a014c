"""The block-scaled linear and the grouped MoE experts (npu_ops/triton/block_linear.py,
moe_experts.py) against the fp64 reference ops.

Interpreter variants (TRITON_INTERPRET=1, small shapes) and `gpu`-marked compiled variants at
model widths (decode M = 1..64 with split-K, the prefill path with x quantised beforehand).
Bound: the kernels' operands are exact and only the fp32 summation order differs from the
reference, so fp32 outputs agree to ~1e-6 relative and bf16 outputs to the final rounding
(2^-9 per element, ~3e-3 in norm).
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.numerics import numerics  # noqa: E402
from dsv41.backends.reference import basic, moe, quant  # noqa: E402
from dsv41.npu_ops.triton import block_linear as bl  # noqa: E402
from dsv41.npu_ops.triton import moe_experts as me  # noqa: E402

pytestmark = cuda_only

BOUND = {torch.bfloat16: 4e-3, torch.float32: 2e-5, torch.float64: 2e-5}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got - want).norm() / want.norm()).item()


def weight(fmt: str, n: int, k: int, rng: torch.Generator):
    """A random weight in a checkpoint storage format: (weight, scale or None)."""
    w = torch.randn(n, k, generator=rng) * k ** -0.5 * torch.exp2(torch.randint(-3, 4, (n, 1), generator=rng).float())
    if fmt == "fp8":
        return quant.fp8_block_quant(w)
    if fmt == "fp4":
        return quant.fp4_weight_quant(w)
    return w.to(torch.bfloat16 if fmt == "bf16" else torch.float32), None


def check_linear(dev, fmt, m, k, n, out_dtype, rng, x_dtype=torch.bfloat16, **tiles):
    x = (torch.randn(m, k, generator=rng) * 3).to(x_dtype)
    w, s = weight(fmt, n, k, rng)
    want = basic.linear(x, w, s, out_dtype)
    got = bl.linear(x.to(dev), w.to(dev), None if s is None else s.to(dev), out_dtype, **tiles)
    assert got.shape == (m, n) and got.device.type == torch.device(dev).type
    assert got.dtype == (torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)  # never fp64
    err = rel_err(got, want)
    assert err < BOUND[out_dtype], f"{fmt} M={m} K={k} N={n} {out_dtype}: rel err {err:.2e}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_linear_formats(dev, fmt, out_dtype, rng):
    check_linear(dev, fmt, 3, 96, 80, out_dtype, rng)


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_split_k_and_fp32_input(dev, rng):
    check_linear(dev, "fp8", 2, 256, 64, torch.float32, rng, split_k=3, bk=32)
    check_linear(dev, "bf16", 2, 64, 48, torch.float32, rng, x_dtype=torch.float32)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_linear_gemv_path(dev, fmt, m, rng):
    """The M <= GEMV_MAX_M path (x quantised in the kernel, CUDA cores), split-K and whole-K."""
    for out_dtype in (torch.bfloat16, torch.float32):
        check_linear(dev, fmt, m, 160, 72, out_dtype, rng, path="gemv")
    check_linear(dev, fmt, m, 320, 40, torch.float32, rng, path="gemv", split_k=3, bk=64)



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m", [1, 5, 17, 64])
def test_linear_fold_path(dev, m, rng):
    """The FP8 decode path on the tensor cores (`_fold_linear_kernel`): M = 1 (x quantised in the
    kernel, or by the separate pass), M = 5 / 17 / 64 (padded row tiles), N and K not multiples of
    the tiles (N = 72, K = 160 with BK = 128), scales folded into x (bn 32) or into the weight
    tile (bn 64), split-K; outputs poisoned with NaN beforehand, fresh random inputs each call."""
    for out_dtype in (torch.bfloat16, torch.float32):
        check_linear(dev, "fp8", m, 160, 72, out_dtype, rng, path="fold", bk=128)
    check_linear(dev, "fp8", m, 160, 72, torch.float32, rng, path="fold", bn=64)
    check_linear(dev, "fp8", m, 320, 40, torch.float32, rng, path="fold", split_k=3, bk=64)
    k, n = 96, 80
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
    w, s = weight("fp8", n, k, rng)
    want = basic.linear(x, w, s, torch.float32)
    for qdq_row in ([True, False] if m == 1 else [False]):
        out = torch.full((m, n), float("nan"), device=dev)
        bl._launch_fold(x.to(dev), w.to(dev), s.to(dev), out, qdq_row=qdq_row, split_k=2, bk=32)
        assert rel_err(out, want) < BOUND[torch.float32], f"M={m} qdq_row={qdq_row}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m", [9, 17, 64])
def test_linear_fold_tm_path(dev, m, rng):
    """The token-major FP8 kernel (`_fold_tm_kernel`, 9..64 rows): partial row tiles, N and K not
    multiples of the tiles (N = 72, K = 160 with BK = 128: a ragged last step and scale block
    ahead), 32- and 64-wide weight tiles, split-K (the scales loaded a step ahead across slice
    ends), outputs poisoned with NaN beforehand."""
    for out_dtype in (torch.bfloat16, torch.float32):
        check_linear(dev, "fp8", m, 160, 72, out_dtype, rng, path="foldtm", bk=128)
    check_linear(dev, "fp8", m, 160, 72, torch.float32, rng, path="foldtm", bn=64, bk=64)
    check_linear(dev, "fp8", m, 320, 40, torch.float32, rng, path="foldtm", split_k=3, bk=64)
    k, n = 96, 80
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
    w, s = weight("fp8", n, k, rng)
    out = torch.full((m, n), float("nan"), device=dev)
    bl._launch_fold_tm(x.to(dev), w.to(dev), s.to(dev), out, split_k=2, bk=32)
    assert rel_err(out, basic.linear(x, w, s, torch.float32)) < BOUND[torch.float32], f"M={m}"


def test_fold_tm_choice(monkeypatch):
    """Above XS_MAX_M rows the default modes take the token-major kernel for weights up to
    FOLD_TM_SMALL_BYTES (32-wide tiles), from FOLD_TM_LARGE_BYTES (128-wide tiles, a K split) and
    for weights wide enough to occupy the SMs twice without a K split, else `_fold_linear_kernel`;
    DSV41_FP8_DECODE=fold keeps fold at every row count."""
    assert bl.fold_tm_tiles(512, 5120, 132) == bl.FOLD_TM_SMALL
    assert bl.fold_tm_tiles(2 * 2304, 5120, 132) == bl.FOLD_TM_SMALL  # the stacked shared w1 / w3
    assert bl.fold_tm_tiles(32768, 1280, 132) == {}
    assert bl.fold_tm_tiles(5120, 8192, 132) is None
    assert bl.fold_tm_tiles(25600, 6144, 132) == bl.FOLD_TM_LARGE  # Engram's wkv
    monkeypatch.setattr(bl, "FOLD_TM_LARGE_BYTES", 0)
    assert bl.fold_tm_tiles(25600, 6144, 132) == {}
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.delenv("DSV41_FP8_DECODE", raising=False)
    assert bl.fp8_default_path(9, 5120, 512, 132) == ("foldtm", bl.FOLD_TM_SMALL)
    assert bl.fp8_default_path(64, 8192, 5120, 132) == ("fold", {})
    assert bl.fp8_default_path(8, 5120, 512, 132)[0] == "xscale"
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.setenv("DSV41_FP8_DECODE", "fold")
    assert bl.fp8_default_path(9, 5120, 512, 132) == ("fold", {})
    with pytest.raises(ValueError, match="foldtm path takes FP8"):
        bl.linear(torch.randn(9, 64).to(torch.bfloat16), *quant.fp4_weight_quant(torch.randn(8, 64)), path="foldtm")


def test_linear_fold_is_the_fp8_decode_default():
    """FP8 weights at M <= FOLD_MAX_M take the fold path; FP4 keeps the gemv / tiled paths, and the
    fold path refuses FP4 / bf16 weights with one clear error."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    w4, s4 = quant.fp4_weight_quant(torch.randn(8, 64))
    with pytest.raises(ValueError, match="fold path takes FP8"):
        bl.linear(x, w4, s4, path="fold")
    with pytest.raises(ValueError, match="fold path takes FP8"):
        bl.linear(x, torch.randn(8, 64).to(torch.bfloat16), None, path="fold")
    assert bl.FOLD_MAX_M >= 64


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("path", ["fp8mma", "fp16mma"])
@pytest.mark.parametrize("m", [1, 5, 20])
def test_linear_fp8_mma_path(dev, path, m, rng):
    """The decode kernel on the FP8 tensor cores (`_fp8_mma_kernel`): raw E4M3 codes times x's
    codes per 32-wide block, both scales on the block sums; partial tiles in N / M / K, split-K,
    x quantised by `fp8_quant` or (M = 1) in the kernel. Compiled, the FP8 MMA sums a block's 32
    products in less than fp32 precision: bound 2e-4 for fp32 outputs there (bf16: the usual);
    fp16mma (fp16 MMAs on the widened codes, fp32 accumulation) keeps the usual bounds."""
    loose = dev != "cpu" and path == "fp8mma"
    bound = {torch.bfloat16: BOUND[torch.bfloat16], torch.float32: 2e-4 if loose else BOUND[torch.float32]}
    for out_dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(m, 160, generator=rng) * 3).to(torch.bfloat16)
        w, s = weight("fp8", 72, 160, rng)
        got = bl.linear(x.to(dev), w.to(dev), s.to(dev), out_dtype, path=path, bk=128)
        assert rel_err(got, basic.linear(x, w, s, out_dtype)) < bound[out_dtype]
    k, n = 320, 40
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
    w, s = weight("fp8", n, k, rng)
    want = basic.linear(x, w, s, torch.float32)
    for kw in ([dict(qdq_row=True), dict(qdq_row=False)] if m == 1 else [dict()]):
        out = torch.full((m, n), float("nan"), device=dev)
        bl._launch_fp8_mma(x.to(dev), w.to(dev), s.to(dev), out, f16=path == "fp16mma", split_k=3, bk=32, bn=16, **kw)
        assert rel_err(out, want) < bound[torch.float32], f"M={m} {kw}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("path", ["xscale", "place"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_xscale_paths(dev, path, m, rng):
    """The decode kernel with the weight scales on x's side (`_fold_xs_kernel`): hardware
    conversion ("xscale") or bit placement ("place"); N = 72 (a partial scale row and tile), K = 160
    (a partial BK step), 32 / 64 / 128-row tiles (1 / 2 / 4 scale rows sharing x's columns),
    split-K, bf16 / fp32 outputs, x quantised in the kernel (M = 1) or by the separate pass."""
    for out_dtype in (torch.bfloat16, torch.float32):
        check_linear(dev, "fp8", m, 160, 72, out_dtype, rng, path=path, bk=128)
    for bn in (32, 128):
        check_linear(dev, "fp8", m, 160, 72, torch.float32, rng, path=path, bn=bn, bk=64)
    check_linear(dev, "fp8", m, 320, 40, torch.float32, rng, path=path, split_k=3, bk=32)
    if m == 1:
        k, n = 96, 80
        x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
        w, s = weight("fp8", n, k, rng)
        out = torch.full((m, n), float("nan"), device=dev)
        bl._launch_fold_xs(x.to(dev), w.to(dev), s.to(dev), out, place=path == "place", qdq_row=False, split_k=2,
                           bk=32)
        assert rel_err(out, basic.linear(x, w, s, torch.float32)) < BOUND[torch.float32]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("k", [160, 96, 128])
def test_linear_rows_path(dev, k, rng):
    """The one-row kernel streaming whole weight rows (`_row_gemv_kernel`): K = 160 (40 words =
    32 + 8: two parts), 96 (16 + 8), 128 (one part); N = 72 (a partial scale row, a partial last
    program) and 40; 1 / 2 / 4 rows per step, 4 to 32 rows per program; bf16 and fp32 outputs
    (fp32 at the fold kernels' bound: exact products, fp32 sums); the output poisoned first."""
    for n, rs, rpp in ((72, None, None), (72, 1, 8), (40, 2, 4), (72, 4, 32)):
        x = (torch.randn(1, k, generator=rng) * 3).to(torch.bfloat16)
        w, s = weight("fp8", n, k, rng)
        for out_dtype in (torch.bfloat16, torch.float32):
            out = torch.full((1, n), float("nan"), dtype=out_dtype, device=dev)
            bl._launch_row_gemv(x.to(dev), w.to(dev), s.to(dev), out, rs=rs, rpp=rpp)
            err = rel_err(out, basic.linear(x, w, s, out_dtype))
            assert err < BOUND[out_dtype], f"K={k} N={n} rs={rs} rpp={rpp} {out_dtype}: {err:.2e}"
    check_linear(dev, "fp8", 1, k, 72, torch.float32, rng, path="rows")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("k,n_a,n_b", [(160, 64, 40), (96, 32, 72), (5120, 1280, 512)])
def test_linear_pair(dev, k, n_a, n_b, rng):
    """`linear_pair` on two weights of their own allocations (not stacked: a module built by hand)
    runs each weight's own `linear`: outputs equal to it bit for bit and within the dtype's bound
    of the reference, at one row and several, for FP8, bf16 and mixed pairs (the model's wq_a / wkv
    widths compiled only: the interpreter takes minutes there)."""
    if dev == "cpu" and k > 256:
        pytest.skip("model widths run compiled only (minutes under the interpreter)")
    cases = (("fp8", "fp8", 1, torch.bfloat16), ("fp8", "fp8", 3, torch.bfloat16), ("fp8", "bf16", 1, torch.bfloat16),
             ("bf16", "bf16", 1, torch.float32), ("bf16", "bf16", 1, torch.bfloat16), ("bf16", "bf16", 2, torch.float32))
    for fmt_a, fmt_b, m, odt in cases:
        x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16).to(dev)
        (w_a, s_a), (w_b, s_b) = weight(fmt_a, n_a, k, rng), weight(fmt_b, n_b, k, rng)
        w_a, w_b = w_a.to(dev), w_b.to(dev)
        s_a, s_b = (None if s is None else s.to(dev) for s in (s_a, s_b))
        case = f"{fmt_a}/{fmt_b} M={m} K={k} {odt}"
        outs = bl.linear_pair(x, w_a, s_a, w_b, s_b, odt)
        for got, w, s, name in zip(outs, (w_a, w_b), (s_a, s_b), "ab"):
            assert got.shape == (m, w.shape[0]) and got.dtype == odt, f"{case} weight {name}"
            assert torch.equal(got, bl.linear(x, w, s, odt)), f"{case} weight {name}: differs from its own linear"
            err = rel_err(got, basic.linear(x.cpu(), w.cpu(), None if s is None else s.cpu(), odt))
            assert err < BOUND[odt], f"{case} weight {name}: rel err {err:.2e}"


def stacked(fmt: str, n_a: int, n_b: int, k: int, rng, dev):
    """Two weights of one allocation, b's rows (and scale rows) right after a's, as
    `core.weights.stack_linears` lays them: ((w_a, s_a), (w_b, s_b))."""
    (w_a, s_a), (w_b, s_b) = weight(fmt, n_a, k, rng), weight(fmt, n_b, k, rng)
    cat = lambda a, b: torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(a.dtype).to(dev)  # noqa: E731
    w = cat(w_a, w_b)
    if s_a is None:
        return (w[:n_a], None), (w[n_a:], None)
    s = cat(s_a, s_b)
    return (w[:n_a], s[:s_a.shape[0]]), (w[n_a:], s[s_a.shape[0]:])


def check_stacked_pair(dev, fmt, k, n_a, n_b, m, rng, odt=torch.bfloat16):
    """`linear_pair` on stacked weights: one linear over the stacked rows (its output's views,
    bit for bit), each within the bound of its own reference linear; at one row each equal to its
    own weight's `linear` bit for bit (the one-row kernels compute every weight row alike)."""
    from dsv41.backends.fused import stacked_pair

    (w_a, s_a), (w_b, s_b) = stacked(fmt, n_a, n_b, k, rng, dev)
    both = stacked_pair(w_a, s_a, w_b, s_b)
    assert both is not None and both[0].shape == (n_a + n_b, k)
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16).to(dev)
    out_a, out_b = bl.linear_pair(x, w_a, s_a, w_b, s_b, odt)
    whole = bl.linear(x, *both, odt)
    case = f"{fmt} M={m} K={k} N={n_a}+{n_b} {odt}"
    assert torch.equal(out_a, whole[:, :n_a]) and torch.equal(out_b, whole[:, n_a:]), case
    assert out_b.data_ptr() == out_a.data_ptr() + n_a * out_a.element_size(), f"{case}: not views of one output"
    for got, w, s in ((out_a, w_a, s_a), (out_b, w_b, s_b)):
        err = rel_err(got, basic.linear(x.cpu(), w.cpu(), None if s is None else s.cpu(), odt))
        assert err < BOUND[odt], f"{case}: rel err {err:.2e}"
        if m == 1:
            assert torch.equal(got, bl.linear(x, w, s, odt)), f"{case}: differs from its own linear at one row"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m", [1, 3, 12])
def test_linear_pair_stacked(dev, m, rng):
    """Stacked FP8 and bf16 pairs take one linear at one row, a few rows and the token-major
    range; an FP8 pair whose first weight ends inside a 32-row scale block is not taken as
    stacked (its scale rows would not line up) and runs as two linears; so does the composite
    (`backends.fused.linear_pair`, the reference) on stacked weights, bit for bit."""
    from dsv41.backends import fused
    from dsv41.backends.fused import stacked_pair

    check_stacked_pair(dev, "fp8", 160, 64, 40, m, rng)
    check_stacked_pair(dev, "bf16", 96, 24, 40, m, rng)
    check_stacked_pair(dev, "bf16", 96, 24, 40, m, rng, torch.float32)
    (w_a, s_a), (w_b, s_b) = stacked("fp8", 40, 64, 160, rng, dev)
    assert stacked_pair(w_a, s_a, w_b, s_b) is None
    x = (torch.randn(m, 160, generator=rng) * 3).to(torch.bfloat16)
    for got, w, s in zip(bl.linear_pair(x.to(dev), w_a, s_a, w_b, s_b), (w_a, w_b), (s_a, s_b)):
        assert torch.equal(got, bl.linear(x.to(dev), w, s))
    (w_a, s_a), (w_b, s_b) = stacked("fp8", 64, 40, 160, rng, "cpu")
    for got, w, s in zip(fused.linear_pair(x, w_a, s_a, w_b, s_b), (w_a, w_b), (s_a, s_b)):
        assert torch.equal(got, basic.linear(x, w, s))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 33, 64])
def test_linear_pair_stacked_model_widths_gpu(dev, m, rng):
    """The mini preset's stacked pairs (wq_a / wkv, the shared expert's w1 / w3, the compressor's
    bf16 wkv / wgate with fp32 outputs) at decode row counts: one launch's output, within the bound
    of each weight's reference."""
    check_stacked_pair(dev, "fp8", 5120, 1280, 512, m, rng)
    check_stacked_pair(dev, "fp8", 5120, 2304, 2304, m, rng)
    check_stacked_pair(dev, "bf16", 5120, 512, 512, m, rng, torch.float32)


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_dense_row(dev, rng, monkeypatch):
    """One bf16 row and a small bf16 weight on `_dense_row_kernel` (`dense_row_fits`): bf16 and
    fp32 outputs equal, bit for bit, that weight's part of a stacked pair's one launch (the
    compressor's wkv / wgate) and lie within the dtype's bound of the reference; several rows, a
    scaled weight or one past DENSE_ROW_MAX_BYTES keep the other paths (same bound)."""
    k, n = 200, 37
    x = (torch.randn(1, 1, k, generator=rng) * 3).to(torch.bfloat16)
    (wd, _), (w2, _) = stacked("bf16", n, 8, k, rng, dev)
    w, xd = wd.cpu(), x.to(dev)
    assert bl.dense_row_fits(xd.view(1, k), wd, None)
    assert not bl.dense_row_fits(xd.view(1, k).expand(2, k), wd, None)
    for odt in (torch.bfloat16, torch.float32):
        got = bl.linear(xd, wd, None, odt)
        assert got.shape == (1, 1, n) and got.dtype == odt
        assert torch.equal(got.view(1, n), bl.linear_pair(xd.view(1, k), wd, None, w2, None, odt)[0])
        assert rel_err(got.view(1, n), basic.linear(x.view(1, k), w, None, odt)) < BOUND[odt]
    monkeypatch.setattr(bl, "DENSE_ROW_MAX_BYTES", w.numel() * 2 - 1)
    assert not bl.dense_row_fits(xd.view(1, k), wd, None)
    check_linear(dev, "bf16", 1, k, n, torch.float32, rng)


def test_linear_rows_path_rejects():
    """One clear error for what the rows path does not take: several rows, K not 4 x (a sum of two
    powers of two), rows per program that are not a power of two dividing 32."""
    w, s = quant.fp8_block_quant(torch.randn(40, 96))
    x = torch.randn(2, 96).to(torch.bfloat16)
    with pytest.raises(ValueError, match="one activation row"):
        bl._launch_row_gemv(x, w, s, torch.empty(2, 40))
    with pytest.raises(ValueError, match="powers of two"):
        bl._launch_row_gemv(x[:1], w, s, torch.empty(1, 40), rpp=64)
    w7, s7 = quant.fp8_block_quant(torch.randn(40, 224))  # 56 words = 32 + 16 + 8
    with pytest.raises(ValueError, match="sum of two powers"):
        bl._launch_row_gemv(torch.randn(1, 224).to(torch.bfloat16), w7, s7, torch.empty(1, 40))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_linear_rowmma_path(dev, m, rng):
    """The register-fed MMA kernel (`row_mma`): N = 72 / 100 (partial 16-row groups, a partial
    scale row), K = 96 / 160 / 224 (3, 5, 7 blocks: partial loop steps); 1 / 2 / 4 / 8 warps,
    1 / 2 / 4 blocks a step, no split, split-K 2 and 3 (partials and the last-slice sum), tokens
    1..8 sharing one MMA column set; bf16 and fp32 outputs, each poisoned first. K = 256 / 384
    (whole 4-block steps): one token takes the block-diagonal operand (`_diag_step`), one slice
    and three. Under the interpreter the MMA is emulated lane by lane, so this checks the
    fragment bookkeeping."""
    from dsv41.npu_ops.triton import row_mma

    for n, k, tiles in ((72, 96, {}), (100, 160, {"num_warps": 2, "bb": 2, "split_k": 2}),
                        (72, 224, {"num_warps": 1, "bb": 4, "split_k": 3}), (40, 160, {"num_warps": 8, "bb": 1}),
                        (72, 256, {}), (100, 384, {"num_warps": 2, "split_k": 3})):
        x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
        w, s = weight("fp8", n, k, rng)
        for out_dtype in (torch.bfloat16, torch.float32):
            out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
            row_mma.launch_row_mma(x.to(dev), w.to(dev), s.to(dev), out, **tiles)
            err = rel_err(out, basic.linear(x, w, s, out_dtype))
            assert err < BOUND[out_dtype], f"M={m} K={k} N={n} {tiles} {out_dtype}: {err:.2e}"
    check_linear(dev, "fp8", m, 96, 48, torch.float32, rng, path="rowmma")
    # the 16-row panel layout (`panel_weight`, `panel=True`)
    x = (torch.randn(m, 160, generator=rng) * 3).to(torch.bfloat16)
    w, s = weight("fp8", 48, 160, rng)
    out = torch.full((m, 48), float("nan"), dtype=torch.float32, device=dev)
    row_mma.launch_row_mma(x.to(dev), row_mma.panel_weight(w).to(dev), s.to(dev), out, num_warps=2, bb=2, panel=True)
    assert rel_err(out, basic.linear(x, w, s, torch.float32)) < BOUND[torch.float32]


def test_linear_rowmma_rejects():
    """One clear error for what the rowmma path does not take: more than 8 rows, K not a multiple
    of 32."""
    from dsv41.npu_ops.triton import row_mma

    w, s = quant.fp8_block_quant(torch.randn(40, 96))
    with pytest.raises(ValueError, match="M <= 8"):
        row_mma.launch_row_mma(torch.randn(9, 96).to(torch.bfloat16), w, s, torch.empty(9, 40))
    w2, s2 = quant.fp8_block_quant(torch.randn(40, 80))
    with pytest.raises(ValueError, match="K % 32"):
        row_mma.launch_row_mma(torch.randn(1, 80).to(torch.bfloat16), w2, s2, torch.empty(1, 40))


def all_e4m3_codes(k: int = 64):
    """A weight whose row c holds E4M3 code c in column 0 (zeros elsewhere), scale 2^0, and x = e_0:
    output row c is code c's value exactly (NaN for 0x7F / 0xFF)."""
    codes = torch.zeros(256, k, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    s = torch.full((8, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    return x, w, s


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("path", ["fold", "xscale", "place", "fp8mma", "fp16mma", "rows", "rowmma"])
def test_linear_fp8_decode_every_code_exact(dev, path):
    """Every E4M3 code through each decode path gives the reference's value bit for bit
    (subnormals included) and NaN for the two NaN codes, as the hardware conversion does. (The
    interpreter's own fp8 cast, used by all paths but "place" there, reads 0x7F / 0xFF as +-480, so
    under the interpreter the NaN codes are checked for "place" only; compiled, for all.)"""
    x, w, s = all_e4m3_codes()
    want = basic.linear(x, w, s, torch.float32)
    got = bl.linear(x.to(dev), w.to(dev), s.to(dev), torch.float32, path=path).cpu()
    assert torch.isnan(want[0, 0x7F]) and torch.isnan(want[0, 0xFF])
    assert want[0, 1] == 2.0 ** -9 and want[0, 0x7E] == 448.0  # the data covers subnormals and the top
    if dev != "cpu" or path == "place":
        assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want.float()[ok].view(torch.int32))


def place_ptx_model(word: int) -> tuple[int, int]:
    """The instruction sequence of block_linear._E4M3_BF16_ASM on one 32-bit register (4 E4M3
    bytes), step for step in Python: the two bf16x2 results."""
    mask = 0xFFFFFFFF
    m = word & 0x7F7F7F7F
    n = ((m + 0x01010101) & mask) & 0x80808080
    u = (n - (n >> 4)) & mask
    lo = ((word << 4) & mask) & 0xF0F0F0F0
    hi = (word & 0x80808080) | ((word >> 4) & 0x07070707) | u

    def prmt(a, b, sel):  # PTX prmt.b32 (default mode): result byte i = byte sel[i] of b:a
        src = a | (b << 32)
        return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))

    return prmt(lo, hi, 0x5140), prmt(lo, hi, 0x7362)


def test_e4m3_placement_ptx_every_code():
    """The packed PTX placement (CUDA only, so modelled here instruction by instruction) gives, for
    every code in every byte position, the bf16 of code's value x 2^-120 (E4M3 subnormals to bf16
    subnormals) and a bf16 NaN for 0x7F / 0xFF, element i in halfword i."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float() * 2.0 ** -120
    want = vals.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    assert (vals[1:8] > 0).all() and (vals[1:8] < 2.0 ** -126).all()  # subnormal in bf16 too
    for pos in range(4):
        for c in range(256):
            word = (c << (8 * pos)) | (0x38 << (8 * ((pos + 1) % 4)))  # a 1.0 beside it
            r0, r1 = place_ptx_model(word)
            halves = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
            got = halves[pos]
            if c & 0x7F == 0x7F:
                assert got & 0x7F80 == 0x7F80 and got & 0x7F, f"code {c:#x}: {got:#06x} is not NaN"
            else:
                assert got == int(want[c]), f"code {c:#x} at byte {pos}: {got:#06x} != {int(want[c]):#06x}"
            assert halves[(pos + 1) % 4] == 0x0380  # 1.0 x 2^-120, untouched by its neighbour


def test_fp8_decode_switch(monkeypatch):
    """DSV41_FP8_DECODE: mode and tile settings parsed once, bad values one clear error, and the
    default dispatch of FP8 weights at M <= XS_MAX_M follows it (more rows take a fold kernel);
    unset, "rows" with `rows_tiles` by K (the register-fed MMA kernel from ROWMMA_MIN_K at whole
    4-block steps, else xscale from ROWS_MAX_K); "rowdiag": that kernel at one row and any such K."""
    assert bl.parse_fp8_decode("place:bn=128,waves=8,stages=3") == (
        "place", {"bn": 128, "waves": 8, "num_stages": 3})
    assert bl.parse_fp8_decode("") == ("fold", {})
    assert bl.parse_fp8_decode("fp8mma:maxm=8") == ("fp8mma", {"max_m": 8})
    for bad in ("sideways", "place:bn=x", "xscale:depth=2"):
        with pytest.raises(ValueError, match="DSV41_FP8_DECODE"):
            bl.parse_fp8_decode(bad)
    seen = []
    monkeypatch.setattr(bl, "_launch_fold_xs", lambda *a, **kw: seen.append(kw))
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.setenv("DSV41_FP8_DECODE", "place:bn=32")
    x = torch.randn(1, 64).to(torch.bfloat16)
    w, s = quant.fp8_block_quant(torch.randn(40, 64))
    bl.linear(x, w, s)
    assert seen == [{"place": True, "qdq_row": None, "bn": 32}]
    monkeypatch.setenv("DSV41_FP8_DECODE", "fold")  # read once: still "place"
    bl.linear(x, w, s)
    assert len(seen) == 2
    check = bl.linear(torch.randn(bl.XS_MAX_M + 1, 64).to(torch.bfloat16), w, s)  # a fold kernel
    assert len(seen) == 2 and check.shape == (bl.XS_MAX_M + 1, 40)
    f8 = []
    monkeypatch.setattr(bl, "_launch_fp8_mma", lambda *a, **kw: f8.append(kw))
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.setenv("DSV41_FP8_DECODE", "fp8mma:maxm=16")
    bl.linear(torch.randn(16, 64).to(torch.bfloat16), w, s)
    assert f8 == [{"f16": False, "bm": None, "qdq_row": None}]
    bl.linear(torch.randn(17, 64).to(torch.bfloat16), w, s)  # past maxm: the fold path
    assert len(f8) == 1 and bl.fp8_decode_mode() == ("fp8mma", {"max_m": 16})  # the cached choice unchanged
    rows, xs = [], []
    monkeypatch.setattr(bl, "_launch_row_gemv", lambda *a, **kw: rows.append(kw))
    monkeypatch.setattr(bl, "_launch_fold_xs", lambda *a, **kw: xs.append(kw))
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.setenv("DSV41_FP8_DECODE", "rows:rs=2,rpp=8")
    bl.linear(x, w, s)  # one row: the rows kernel with its settings
    assert rows == [{"rs": 2, "rpp": 8}] and not xs
    bl.linear(torch.randn(2, 64).to(torch.bfloat16), w, s)  # two rows: xscale, default tiles
    w7, s7 = quant.fp8_block_quant(torch.randn(40, 224))  # K / 4 = 56 = 32 + 16 + 8: not the rows kernel's
    bl.linear(torch.randn(1, 224).to(torch.bfloat16), w7, s7)
    assert len(rows) == 1 and xs == [{"place": False, "qdq_row": None}] * 2
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.delenv("DSV41_FP8_DECODE")  # the default: "rows" with the measured tiles by K
    assert bl.fp8_decode_mode() == ("rows", {})
    mma = []
    monkeypatch.setattr(bl.row_mma, "launch_row_mma", lambda *a, **kw: mma.append(kw))
    for k, want in ((1280, {}), (2304, {"rs": 2, "waves": 8}), (5120, {"rs": 2}), (6144, "mma"), (8192, "mma"),
                    (6176, None), (bl.ROWS_MAX_K + 32, None)):
        wk, sk = quant.fp8_block_quant(torch.randn(32, k))
        rows.clear(), xs.clear(), mma.clear()
        bl.linear(torch.randn(1, k).to(torch.bfloat16), wk, sk)
        if want == "mma":
            assert (rows, xs, mma) == ([], [], [{}]), k
        else:
            assert (rows, mma) == (([want], []) if want is not None else ([], [])), k
            assert xs == ([] if want is not None else [{"place": False, "qdq_row": None}]), k
    monkeypatch.setattr(bl, "_FP8_DECODE", [])
    monkeypatch.setenv("DSV41_FP8_DECODE", "rowdiag")
    for k, n_mma in ((1280, 1), (224, 0)):  # K = 224: not whole 4-block steps, the rows rules (xscale here)
        wk, sk = quant.fp8_block_quant(torch.randn(32, k))
        mma.clear()
        bl.linear(torch.randn(1, k).to(torch.bfloat16), wk, sk)
        assert len(mma) == n_mma, k


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("path", ["xscale", "place", "fp8mma", "fp16mma", "rows", "rowmma"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_linear_xscale_model_shapes_gpu(dev, path, m, rng):
    """Model widths (wq_a, wq_b, wo_b; "rows" at one row only); fp8mma's fp32 outputs at its own bound (its FP8 MMA block
    sums, see test_linear_fp8_mma_path)."""
    if path == "rows" and m > 1:
        pytest.skip("the rows path takes one row")
    for k, n in ((5120, 1280), (1280, 32768), (8192, 5120), (2304, 5120), (5120, 512)):
        check_linear(dev, "fp8", m, k, n, torch.bfloat16, rng, path=path)
        if path != "fp8mma":
            check_linear(dev, "fp8", m, k, n, torch.float32, rng, path=path)
        else:
            x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
            w, s = weight("fp8", n, k, rng)
            got = bl.linear(x.to(dev), w.to(dev), s.to(dev), torch.float32, path=path)
            assert rel_err(got, basic.linear(x, w, s, torch.float32)) < 2e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("l2_hint", [False, True])
def test_linear_rowmma_l2_hint_gpu(dev, l2_hint, rng):
    """The block-diagonal step's weight loads with and without the L2 hint (`row_mma.lane_words`,
    PTX asm; on by default) at one row and model widths (wo_b, Engram's wkv), one K slice and
    several, both output dtypes."""
    from dsv41.npu_ops.triton import row_mma

    for k, n, tiles in ((8192, 5120, {}), (6144, 25600, {}), (8192, 5120, {"split_k": 1})):
        x = (torch.randn(1, k, generator=rng) * 3).to(torch.bfloat16)
        w, s = weight("fp8", n, k, rng)
        for out_dtype in (torch.bfloat16, torch.float32):
            out = torch.full((1, n), float("nan"), dtype=out_dtype, device=dev)
            row_mma.launch_row_mma(x.to(dev), w.to(dev), s.to(dev), out, l2_hint=l2_hint, **tiles)
            err = rel_err(out, basic.linear(x, w, s, out_dtype))
            assert err < BOUND[out_dtype], f"K={k} N={n} {tiles} {out_dtype} l2_hint {l2_hint}: {err:.2e}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_linear_w8a8(dev, m, rng):
    """INT8 weights with a per-channel fp32 scale (W8A8, `convert --linear-dtype int8`): per-token
    int8 activations, exact int32 sums (padded to cuBLASLt's row minimum below 17 rows)."""
    k, n = 96, 40
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
    w, s = quant.int8_row_quant(torch.randn(n, k, generator=rng) * k ** -0.5)
    for out_dtype in (torch.bfloat16, torch.float32):
        want = basic.linear(x, w, s, out_dtype)
        got = bl.linear(x.to(dev), w.to(dev), s.to(dev), out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert rel_err(got, want) < BOUND[out_dtype]


def test_linear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        bl.linear(torch.zeros(1, 40), *quant.fp8_block_quant(torch.zeros(8, 40)))
    with pytest.raises(ValueError, match="out_dtype"):
        bl.linear(torch.zeros(1, 32), torch.zeros(8, 32), None, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
@pytest.mark.parametrize("m", [1, 7, 17, 64, 300, 1100])
def test_linear_model_shapes_gpu(dev, fmt, m, rng):
    for out_dtype in (torch.bfloat16, torch.float32):
        check_linear(dev, fmt, m, 5120, 1536, out_dtype, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("m", [16, 64])
def test_linear_fp8_batch_default_gpu(dev, m, rng):
    """The default FP8 dispatch at 9..64 rows at the mini preset's widths, each shape class of
    `fold_tm_tiles`: a small weight (token-major, 32-wide tiles, split-K), a wide one (token-major,
    no split), a large one that needs a split (the weight-major fold) and Engram's wkv
    (FOLD_TM_LARGE: 128-wide tiles, K split)."""
    for k, n in [(5120, 512), (1280, 32768), (8192, 5120), (6144, 25600)]:
        check_linear(dev, "fp8", m, k, n, torch.bfloat16, rng)
    check_linear(dev, "fp8", m, 1280, 32768, torch.float32, rng)


def experts_in(fmt: str, n_exp: int, d: int, inter: int, rng):
    return [(weight(fmt, inter, d, rng), weight(fmt, d, inter, rng), weight(fmt, inter, d, rng)) for _ in range(n_exp)]


def check_moe(dev, fmt, t, n_exp, topk, d, inter, rng, with_skipped=True, **tiles):
    x = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(t)])
    if with_skipped:
        ids[::3, -1] = -1  # slots held by another model-parallel rank
    w = torch.rand(t, topk, generator=rng) + 0.1
    ex = experts_in(fmt, n_exp, d, inter, rng)
    with numerics("official"):  # the kernels round where the official expert does
        want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    dex = [tuple((a.to(dev), None if b is None else b.to(dev)) for a, b in e) for e in ex]
    got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64, **tiles)
    assert got.dtype == torch.float32 and got.shape == (t, d)
    err = rel_err(got, want)
    # an fp32 summation-order difference can move a rare value across a bf16 or FP8 rounding
    # boundary (one step, 2^-8 or 2^-4 relative, in one of ~1e6 values): a few 1e-5 in norm
    bound = 1e-4
    assert err < bound, f"moe {fmt} T={t}: rel err {err:.2e}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_moe_experts_formats(dev, fmt, rng):
    check_moe(dev, fmt, 5, 4, 2, 64, 64, rng)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_moe_experts_gemv_path(dev, fmt, t, rng):
    """The decode path (T <= GEMV_MAX_T): each program finds its expert and rows from the ids;
    repeated ids across tokens, skipped (-1) slots, more experts than routed rows."""
    check_moe(dev, fmt, t, 6, 3, 96, 64, rng, path="gemv")


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_shared_expert_call(dev, rng):
    """The model's shared-expert call: one expert, every token routed to it with weight 1."""
    t, d, inter = 4, 64, 96
    x = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    ex = experts_in("fp8", 1, d, inter, rng)
    ones, zeros = torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long)
    with numerics("official"):
        want = moe.moe_experts(x, ones, zeros, ex, 10.0)
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    assert rel_err(me.moe_experts(x.to(dev), ones.to(dev), zeros.to(dev), dex, 10.0), want) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 4, 64])
def test_moe_shared_expert_stacked_gpu(dev, t, rng):
    """The shared expert with w1 / w3 stacked (the model's layout): one launch for both, the
    SwiGLU reading g and u at the stacked row stride; within the bound of the reference."""
    d, inter = 512, 256
    x = torch.randn(t, d, generator=rng).to(torch.bfloat16)
    (w1, w3), w2 = stacked("fp8", inter, inter, d, rng, dev), weight("fp8", d, inter, rng)
    ex = [(w1, tuple(a.to(dev) for a in w2), w3)]
    ones, zeros = torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long)
    with numerics("official"):
        want = moe.moe_experts(x, ones, zeros, [tuple((a.cpu(), b.cpu()) for a, b in ex[0])], 10.0)
    got = me.moe_experts(x.to(dev), ones.to(dev), zeros.to(dev), ex, 10.0)
    assert rel_err(got, want) < 4e-3, f"T={t}: rel err {rel_err(got, want):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 64, 200])
@pytest.mark.parametrize("old", [False, True])
def test_moe_experts_model_shapes_gpu(dev, t, old, rng):
    """The default path (the fold path up to 64 tokens) and the GEMV / tiled kernels it replaced
    there (still taken for experts the fold path does not take)."""
    check_moe(dev, "fp4", t, 16, 6, 1024, 512, rng, **({"path": "gemv" if t <= 4 else "tiled"} if old else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 3])
def test_moe_experts_fp8_decode_gpu(dev, t, rng):
    check_moe(dev, "fp8", t, 4, 2, 1024, 512, rng)
