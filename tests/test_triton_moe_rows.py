"""The FP4 routed experts at one or two tokens on the CUDA cores (npu_ops/triton/moe_rows.py)
against the reference.

The word conversion bit-exactly against the reference dequantisation for every E2M1 code and
scale bytes 1..240 (the PTX variant on the GPU, the plain-Triton one everywhere); the whole path
(`moe_experts(..., path="rows")`) against the fp64 reference in its official mode: one and two
tokens, a skipped (-1) slot, an expert routed from both tokens, both K parts of the kernels (K / 32
blocks as two powers of two), every scratch buffer poisoned (NaN) first. Interpreter variants at
small widths, `gpu`-marked compiled variants at model widths (the mini preset's 5120 x 2304
included). Bound as tests/test_triton_moe_fold.py (the same numerics class).
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from test_triton_block_linear import weight  # noqa: E402  (the random weights in storage formats)
from test_triton_moe_grouped import check as grouped_check  # noqa: E402  (inputs, reference, bound)
from test_triton_moe_grouped import every_code_weight  # noqa: E402
from test_triton_moe_fold import assert_default_reaches, pays_case, poison_buffers  # noqa: E402  (shared)

from dsv41.backends.reference.basic import dequant_weight  # noqa: E402
from dsv41.npu_ops.triton import moe_experts as me  # noqa: E402
from dsv41.npu_ops.triton import moe_rows as mr  # noqa: E402
from dsv41.npu_ops.triton.block_scaled import e8m0_value  # noqa: E402
from dsv41.npu_ops.triton.launch import interpreting  # noqa: E402

tl = triton.language
pytestmark = [cuda_only, pytest.mark.usefixtures("official_reference")]


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the rows path allocates starts as NaN."""
    poison_buffers(monkeypatch, mr)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, KW, NW: tl.constexpr, ASM: tl.constexpr):
    """out[row, 8c + i] = element i of word c of the row, times 2^14 and its block's scale."""
    r = tl.program_id(0)
    c = tl.arange(0, NW)
    wd = tl.load(w_ptr + r * KW + c)
    s = e8m0_value(tl.load(s_ptr + r * (KW // 4) + c // 4).to(tl.int32)) * 16384.0
    w0, w1, w2, w3, w4, w5, w6, w7 = mr.e2m1x8_f32(wd, ASM)
    o = out_ptr + r * KW * 8 + 8 * c
    tl.store(o, w0 * s)
    tl.store(o + 1, w1 * s)
    tl.store(o + 2, w2 * s)
    tl.store(o + 3, w3 * s)
    tl.store(o + 4, w4 * s)
    tl.store(o + 5, w5 * s)
    tl.store(o + 6, w6 * s)
    tl.store(o + 7, w7 * s)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("asm", [False, True])
def test_rows_decode_bit_exact(dev, asm):
    """Every E2M1 code at scale bytes 1..240: bit-equal to the reference dequantisation wherever
    the result is fp32-normal (>= 2^-126); the one smaller result (0.5 at byte 1) is exact or 0."""
    if asm and interpreting():
        pytest.skip("inline PTX does not run under the interpreter")
    w, s = every_code_weight(240, 16)
    n, k = w.shape[0], w.shape[1] * 2
    want = dequant_weight(w, s).double()
    out = torch.full((n, k), float("nan"), dtype=torch.float32, device=dev)
    wd = w.view(torch.uint8).to(dev).view(torch.int32)
    _decode_kernel[(n,)](wd, s.view(torch.uint8).to(dev), out, k // 8, NW=k // 8, ASM=asm)
    got = out.cpu().double()
    normal = (want.abs() >= 2.0 ** -126) | (want == 0)
    assert (~normal).sum() == 4  # 0.5 and -0.5, twice each, at byte 1
    assert torch.equal(got[normal], want[normal])
    assert ((got[~normal] == want[~normal]) | (got[~normal] == 0)).all()


def check(dev, t, n_exp, topk, d, inter, rng, used=None, **tiles):
    """moe_experts through the rows path (unless `path` says otherwise) against the reference:
    test_triton_moe_grouped.check with FP4 experts."""
    grouped_check(dev, "fp4", t, n_exp, topk, d, inter, rng, used, **dict({"path": "rows"}, **tiles))


def test_block_parts():
    """K / 32 blocks as two powers of two (the kernels' register parts), None otherwise."""
    assert mr.block_parts(5120) == (128, 32) and mr.block_parts(2304) == (64, 8)
    assert mr.block_parts(256) == (8, 0) and mr.block_parts(96) == (2, 1)
    assert mr.block_parts(224) is None and mr.block_parts(100) is None and mr.block_parts(0) is None


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 2])
def test_rows_path(dev, t, rng, poisoned):
    """One and two tokens, 8 experts, top-4 (a skipped slot; at T = 2 the tokens share an expert
    at least once: 4 + 4 of 5 experts); d = 320 and width 96 (both K parts: 8 + 2 and 2 + 1 blocks)."""
    check(dev, t, 8, 4, 320, 96, rng, used=5)


@pytest.mark.parametrize("dev", DEVICES)
def test_rows_tiles(dev, rng, poisoned):
    """Other rows per step / per program (one step per program; many steps)."""
    check(dev, 1, 8, 4, 256, 64, rng, used=7, rs_up=8, rs_down=8, rpp_down=8)
    check(dev, 2, 8, 4, 256, 64, rng, used=7, rs_up=1, rs_down=1, rpp_down=32)


@pytest.mark.slow  # 2-4 minutes under the interpreter (the MMA emulated lane by lane)
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 8])
def test_rows_mma_path(dev, t, rng, poisoned):
    """The MMA variant (`moe_rows_mma`, `mma=True`): 1, 2 tokens (a program per routed row) and 3,
    8 tokens (a program per expert, its rows as MMA columns: up to 8 of them), 8 experts, top-4
    with a skipped slot, d = 320 (5 down programs of 64 rows) and width 96 (3 gate/up programs; 10
    and 3 K blocks: partial loop steps); under the interpreter the MMA is emulated lane by lane."""
    check(dev, t, 8, 4, 320, 96, rng, used=5, mma=True)
    # K slices: gate/up in 2 (5 + 5 blocks), down in 3 (1 block each), one block a step; and the
    # other program layout (grouped at 1-2 tokens, per routed row at 3-8)
    check(dev, t, 8, 4, 320, 96, rng, used=5, mma=True, mma_bb=1, mma_split_up=2, mma_split_down=3,
          mma_grouped=t <= 2)
    # a step's scale bytes as one word (d 512: 16 K blocks, 4 steps; width 128: 4 blocks, one
    # step), with and without K slices of whole steps
    check(dev, t, 8, 4, 512, 128, rng, used=5, mma=True, mma_scale_words=True)
    check(dev, t, 8, 4, 512, 128, rng, used=5, mma=True, mma_scale_words=True, mma_split_up=2)
    # and the weight words as 16-byte loads transposed across each quad of lanes
    check(dev, t, 8, 4, 512, 128, rng, used=5, mma=True, mma_vec_words=True, mma_split_down=1)
    check(dev, t, 8, 4, 512, 128, rng, used=5, mma=True, mma_vec_words=True, mma_split_up=4)
    if t == 1:  # (at one token the defaults take the block-diagonal operand instead of the transpose)
        check(dev, t, 8, 4, 512, 128, rng, used=5, mma=True, mma_vec_words=True, mma_diag=False)


def test_rows_refuses(rng):
    """Too many tokens or widths the kernels do not take: one clear error each."""
    ex = [(weight("fp4", 64, 256, rng), weight("fp4", 256, 64, rng), weight("fp4", 64, 256, rng)) for _ in range(2)]
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    ids = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="at most 2 tokens"):
        me.moe_experts(x, torch.ones(3, 1), ids, ex, 10.0, path="rows")
    with pytest.raises(ValueError, match="rows per program"):
        me.moe_experts(x[:1], torch.ones(1, 1), ids[:1], ex, 10.0, path="rows", rpp_down=48)
    bad = [(weight("fp4", 64, 224, rng), weight("fp4", 224, 64, rng), weight("fp4", 64, 224, rng))]
    with pytest.raises(ValueError, match="two powers of two"):
        me.moe_experts(torch.zeros(1, 224, dtype=torch.bfloat16), torch.ones(1, 1), ids[:1], bad, 10.0, path="rows")
    fp8 = [(weight("fp8", 64, 256, rng), weight("fp8", 256, 64, rng), weight("fp8", 64, 256, rng))]
    with pytest.raises(ValueError, match="rows path takes FP4"):
        me.moe_experts(x[:1], torch.ones(1, 1), ids[:1], fp8, 10.0, path="rows")
    with pytest.raises(ValueError, match="l2_hint is a bool or a"):
        me.moe_experts(x[:1], torch.ones(1, 1), ids[:1], ex, 10.0, path="rows", mma=True, mma_l2_hint=(True,))


def test_rows_pays(rng, monkeypatch):
    """The default takes the rows path exactly for word-aligned FP4 experts at 1..ROWS_DEFAULT_T
    tokens and widths it takes, on CUDA (the interpreters keep the old default)."""
    ex, cuda, interpreting = pays_case(rng, monkeypatch)
    assert me.rows_pays(cuda, 1, ex, 128, 256) and me.rows_pays(cuda, me.ROWS_DEFAULT_T, ex, 128, 256)
    assert not me.rows_pays(cuda, me.ROWS_DEFAULT_T + 1, ex, 128, 256)
    assert not me.rows_pays(torch.device("cpu"), 1, ex, 128, 256)
    assert not me.rows_pays(cuda, 1, ex, 128, 224)  # K / 32 = 7 blocks: no two powers of two
    fp8 = [(weight("fp8", 128, 256, rng), weight("fp8", 256, 128, rng), weight("fp8", 128, 256, rng))]
    me._expert_table(fp8, torch.device("cpu"))
    assert not me.rows_pays(cuda, 1, fp8, 128, 256)
    interpreting(True)
    assert not me.rows_pays(cuda, 1, ex, 128, 256)


@pytest.mark.parametrize("dev", DEVICES)
def test_default_dispatch_reaches_rows(dev, rng, poisoned, monkeypatch):
    """With `rows_pays` true, the default call runs the rows path (and gets the reference's
    result): the dispatch passes the right arguments."""
    assert_default_reaches(monkeypatch, "rows_pays", mr, "rows_moe",
                           lambda: check(dev, 1, 8, 4, 320, 96, rng, path=None))


@pytest.mark.parametrize("dev", DEVICES)
def test_rows_mma_more_rows_than_columns(dev, rng, poisoned):
    """An expert routed more than 8 rows (an expert repeated inside a token: 9 rows of expert 0)
    takes two passes of the MMA's 8 columns, with and without K slices."""
    from dsv41.backends.reference import moe

    d, inter = 128, 64
    ex = [(weight("fp4", inter, d, rng), weight("fp4", d, inter, rng), weight("fp4", inter, d, rng)) for _ in range(2)]
    x = (torch.randn(3, d, generator=rng) * 2).to(torch.bfloat16)
    ids = torch.tensor([[0, 0, 0, 1], [0, 0, 1, -1], [0, 0, 0, 0]])
    w = torch.rand(3, 4, generator=rng) + 0.1
    want = moe.moe_experts(x, w, ids, ex, 10.0, torch.float64)
    dex = [tuple((a.to(dev), b.to(dev)) for a, b in e) for e in ex]
    for split in (1, 2):
        got = me.moe_experts(x.to(dev), w.to(dev), ids.to(dev), dex, 10.0, torch.float64, path="rows", mma=True,
                             mma_grouped=True, mma_bb=1, mma_split_up=split, mma_split_down=split)
        err = ((got.double().cpu() - want).norm() / want.norm()).item()
        assert err < 1e-4, f"split {split}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [2, 3, 5])
def test_rows_mma_tokens_gpu(dev, t, rng, poisoned):
    """The MMA variant at the token counts the interpreter test leaves out, both program layouts."""
    for grouped in (False, True):
        check(dev, t, 8, 4, 320, 96, rng, used=5, mma=True, mma_grouped=grouped)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [12, 64])
def test_rows_mma_grouped_many_tokens_gpu(dev, t, rng, poisoned):
    """The grouped MMA layout past 8 tokens (not a default: `sweep_kernels.py --only moe_rows`
    times it against fold): 5 used experts get 9-64 rows each, 8 columns a pass; with K slices."""
    check(dev, t, 8, 4, 320, 96, rng, used=5, mma=True, mma_grouped=True)
    check(dev, t, 8, 4, 320, 96, rng, used=5, mma=True, mma_grouped=True, mma_split_up=2, mma_split_down=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 2])
def test_rows_model_shapes_gpu(dev, t, rng, poisoned):
    """d 1024, width 512 (one K part each), 16 experts, top-6."""
    check(dev, t, 16, 6, 1024, 512, rng, used=14)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t, mma", [(1, False), (2, False), (1, True), (2, True), (8, True), (1, "words"),
                                    (8, "words"), (1, "vec"), (8, "vec")])
def test_rows_mini_widths_gpu(dev, t, mma, rng, poisoned):
    """The mini preset's widths, d 5120 and width 2304 (two K parts each), 8 experts, top-6; the
    CUDA-core kernels (up to 2 tokens) and the MMA variant (a step's scale bytes as one word:
    "words"; 16-byte weight loads: "vec")."""
    kw = dict(mma=True, mma_scale_words=True) if mma == "words" else dict(mma=mma)
    if mma == "vec":  # (16-byte weight loads, transposed across lanes)
        kw = dict(mma=True, mma_vec_words=True)
    check(dev, t, 8, 6, 5120, 2304, rng, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("l2_hint", [False, True, (False, True)])
def test_rows_mma_l2_hint_gpu(dev, l2_hint, rng, poisoned):
    """The block-diagonal operand's weight loads with and without the L2 hint (`mma_l2_hint`, PTX
    asm; the default hints the gate/up kernel only) at the mini widths, one token, with K slices
    and without."""
    check(dev, 1, 8, 6, 5120, 2304, rng, mma=True, mma_l2_hint=l2_hint)
    check(dev, 1, 8, 6, 5120, 2304, rng, mma=True, mma_l2_hint=l2_hint, mma_split_up=1, mma_split_down=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("tiles", [dict(rs_up=1), dict(rs_up=4), dict(rs_down=2, rpp_down=16),
                                   dict(rs_down=8, rpp_down=64), dict(num_warps=8)])
def test_rows_tiles_gpu(dev, tiles, rng, poisoned):
    """The tile settings the benchmark times, at d 1024, width 512."""
    check(dev, 1, 16, 6, 1024, 512, rng, used=14, **tiles)
