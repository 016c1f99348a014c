"""Sparse attention (CSA2): one softmax per query over its SWA window entries (FP8) followed by
its selected global entries (packed FP4), read in place from the paged cache pools, split-K
flash-decoding style.

Inputs (`ops.sparse_attention`): q [T, H, D] bf16 (RoPE'd); the SWA pool swa_kv [Nw, D]
float8_e4m3fn with E8M0 scales per 32 channels swa_scale [Nw, D/32], and win_idx [T, S]: the
pool rows each query attends (-1 = masked); the global pool glob_kv [Ng, D/2] (E2M1 nibbles,
element 0 in the low nibble) with E4M3 scales per 16 glob_scale [Ng, D/16], and glob_idx
[T, K] pool rows (-1 = masked); sink [H]; K = V. Output [T, H, D] bf16. The oracle is
`sparse_attention_ref` (= `backends.reference.attention.sparse_attention`).

How it runs:
- The entry list of a query is its S window rows (padded to whole blocks of BLOCK_N) followed
  by its K global rows; every block is pure window or pure global, and both kinds are gathered
  by pool row (each query has its own rows: tokens of different sequences share a launch). A
  tile is (query, split, head block, output-channel block); a split is a contiguous run of
  blocks. Tiles are walked by a 1-D persistent loop. With one split per query the tile
  normalises (sink included) and writes bf16 directly; otherwise it writes an fp32 partial
  (unnormalised acc, running max, sum) and `_combine_kernel` merges the splits, loading every
  split of a (query, head, channel block) at once.
- FP8 / FP4 storage is decoded with integer and bit ops only (int8 loads masked to 0..255:
  Ascend takes no uint8 pointers; exponent fields built into fp32 bit patterns). Blocks are
  loaded as [BLOCK_N, groups, bytes per group], so each scale byte is loaded and decoded once
  per group and broadcast over it; the tiled path loads window bytes contiguously and splits
  them into channel pairs (`tl.split`), the whole-row path keeps two stride-2 byte loads (the
  form run with 64-head whole-row tiles on the H200). Every decoded value is exact
  in bf16 (E2M1 x E4M3: <= 6 significant bits; E4M3 x 2^k: 4 bits), so the q.k^T and p.V
  products run as bf16 tl.dot with fp32 accumulation, heads as M, entries as N. (Under the
  interpreter the dot operands stay fp32: same values, interpreter bf16 math is unreliable.)
- KV_X2 (the two-pass form; the CUDA decode table's default, DSV41_SPARSE_KV_X2=0 turns it off): the rows are decoded straight to bf16 pairs
  instead (`_kv_decode_x2`; sm_90a SASS, triton 3.6: the logits pass's chunk loop 1222 -> 482
  instructions, a values-pass block 657 / 832 -> 461 / 480 for FP4 / window rows):
  packed FP4 bytes through the FP4 experts' conversion (`moe_fold._E2M1_BF16X4_ASM`: nibble
  bits placed under bf16's exponent, the value times 2^-126, then one `mul.rn.bf16x2` by the
  row's E4M3 scale times 2^62), FP8 window bytes through `block_linear.e4m3_placed` (the value
  times 2^-120) and one `mul.rn.bf16x2` by 2^(s - 71) from the E8M0 scale byte s. A bf16
  factor holds at most 2^127, so the decoded values cannot carry their true scale: every K / V
  value is the true one times KV_SHIFT = 2^-64, still exact (<= 6 significant bits, far above
  bf16's subnormals: the smallest is 2^-74 for FP4 rows, 2^-95 for window rows at the
  quantiser's floor s >= 105) with every factor a normal bf16 (window scale bytes up to 198,
  i.e. cache values below 2^71 x 448). The kernels multiply the softmax scale by 2^64 and the
  accumulator by 2^64 before the output or the fp32 partial. Powers of two commute with every
  rounding here (products and sums stay normal fp32 unless a q x k product is below 2^-62), so
  the result has the unshifted bits: the tests hold KV_X2 bit-equal to the fp32 decode. Under
  the interpreters (ASM off) the same shift runs on the fp32 decode, so they check the
  bookkeeping; the bf16x2 conversions run on CUDA only (the experts' GPU tests check the FP4 one
  bit for bit, and the factors were checked exhaustively against torch's E4M3 / bf16 on the CPU).
  The same decode in the one-pass tiled kernel (the T=1 table) faulted on the H200 with triton
  3.6 (illegal memory access; that kernel runs at 255 registers with spill), so it was taken
  out of that kernel (2026-12-06).
- Channels are handled as even / odd halves: a packed FP4 byte holds channel 2j (low nibble)
  and 2j+1 (high nibble), so q.k^T = q_even.k_even^T + q_odd.k_odd^T and the output is
  written as two interleaved halves; all row loads stay contiguous (bytes) or stride 2.
- Online softmax: running max starts at -1e30 (an all-masked row gives 0), masked logits are
  -inf, probabilities are rounded to bf16 before p.V, the sum stays fp32; the sink adds
  exp(sink - max) to the denominator only.
- MQA kernel (`_mqa_kernel`, `MQA=True`; CUDA's prefill table "cuda"): a tile is (query, split,
  head block) with whole rows; pool rows are loaded as 32-bit words ([rows, groups, words]:
  contiguous vector loads, four bytes a register while in flight), the next block's index row
  and words while the current block is computed (AHEAD); each block is decoded once into even /
  odd channel halves straight from the words (shifts and masks, no join / reshape back into
  channel order) and serves as K and as V for every head; LAZY (optional) moves the running
  max only when a block passes it by more than that margin. (An earlier form decoded into
  channel order by joining the FP4 nibble halves and reshaping; compiled by triton 3.6 on the
  H200 it gave wrong global-entry results with its loads in the loop and faulted at model widths
  (8 and 16 warps, 1-3 stages); the source has no global memory written and read back and every load
  is masked or clamped. This form is right in every configuration tried there.)
- Rows form (`sparse_attention_rows.py`, `ROWS=True`; CUDA's prefill entry "cuda_prefill"):
  every pool row the launch reads is decoded once into a dense bf16 table (sized without a host
  read: `rows_bound`), then one program per (query, all heads) gathers bf16 rows into the MMAs.
- Per-backend tile tables (`config_for`): at decode shapes (T <= 66 on the H200) CUDA takes
  all 64 heads with 128-channel contraction / output blocks and one split per entry block;
  above that the rows form, except while a graph is captured, when CUDA takes the whole-row
  kernel with all 64 heads in one tile (also the batch-invariant mode's table); the MQA kernel (each
  decoded row serves every head; M = 64 is one wgmma tile; q stays in shared memory) is the
  opt-in `cuda_mqa` entry (faster alone at 1792 / 8192 tokens, not end to end: see CONFIGS);
  Ascend tiles the contraction (BLOCK_D) and the output channels (BLOCK_DV, part of the tile
  id: q.k^T is recomputed per output block) so a program's live tiles stay a few tens of KB,
  well inside the 192 KB unified buffer. Two whole-row options exist for tuning: QK_T computes
  k.q^T (entries as M) and DV_HALF gives each tile one output-channel parity (half the fp32
  accumulator, q.k^T computed twice); neither was faster on the H200 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_linear import e4m3_placed
from .moe_fold import _E2M1_BF16X4_ASM
from .pdl import pdl_launch, pdl_start

from ...backends.reference.attention import sparse_attention as sparse_attention_ref  # noqa: F401  (the oracle)

RUNNING_MAX_INIT = tl.constexpr(-1e30)  # a row with no valid entry outputs 0

# Tile tables: BLOCK_D / BLOCK_DV of None mean the full head_dim (one decode per block).
CONFIGS = {
    # cuda (the main entry: prefill shapes while a graph is captured, and the batch-invariant
    # mode's table; the prefill default until 2026-12-04, now cuda_prefill): the whole-row
    # table: `_sparse_attn_kernel` with whole 512-wide rows (byte loads in the loop, no
    # prefetch). H200 sweep (T=256, 64K context, CUDA-graph time): this 530 us; BLOCK_N 16: 586; BLOCK_N 64 + QK_T: 811; 16 warps: 1208; DV_HALF (BLOCK_N 32 / 64, 4 or
    # 8 warps): 667-759. ptxas: 255 registers + ~1 KB spill (the 64x512 fp32 accumulator alone is
    # 128 registers a thread). Prefill shapes (2026-12-01 08:14 UTC, triton 3.6, kernel time):
    # T=1792: 3.72 ms (8K context) / 3.75 ms (32K), 40 TFLOP/s; T=8192: 15.5 / 15.6 ms, 44
    # TFLOP/s (num_stages 3: within 2%, 08:25 UTC).
    "cuda": dict(BLOCK_H=64, BLOCK_N=32, BLOCK_D=None, BLOCK_DV=None, num_warps=8, num_stages=2, QK_T=False,
                 min_blocks_per_split=2),
    # cuda_mqa (opt-in, not the default): `_mqa_kernel`: all 64 heads of a token in one tile
    # (wgmma M = 64), whole rows loaded as 32-bit words one block ahead and decoded once per block
    # as K and V. Same block size and arithmetic as the whole-row table (cuda): the same bits (0
    # difference at T=1792 on the H200).
    # H200 (2026-12-01 08:25 UTC, torch 2.11, triton 3.6, kernel time, CUDA events; 8K / 32K
    # context): T=1792 3.435 / 3.345 ms (whole-row 3.685 / 3.659); T=8192 13.995 / 14.261 ms
    # (whole-row 15.599 / 15.664): 8-10% faster, 44-49 TFLOP/s. Neighbours (T=8192, 8K / 32K):
    # LAZY=8 13.941 / 14.360; BLOCK_N 16 15.019 / 15.334 (with LAZY=8 14.767 / 14.467; 3 stages
    # 14.741 / 14.572); loads in the loop (AHEAD False, BLOCK_N 16, LAZY=8) 17.568 / 17.539; 16
    # warps (BLOCK_N 16 / 32, LAZY=8) 20.6 / 20.6. ptxas (sm_90a): 255 registers, ~1.3 KB spill.
    # Not the default: in the e2e run of 08:49 UTC with it as the prefill table, mini prefill was
    # slower than at 08:03 with the whole-row table (CED 8K 0.158 -> 0.218 s, CED 32K 0.584 ->
    # 0.775, exact 8K 0.285 -> 0.305; exact 32K 1.265 -> 1.214): the kernel-level gain did not
    # carry over, the CED loss is unexplained (untimed shapes: fewer tokens than SMs, splits).
    "cuda_mqa": dict(BLOCK_H=64, BLOCK_N=32, BLOCK_D=None, BLOCK_DV=None, num_warps=8, num_stages=2, MQA=True,
                     AHEAD=True, LAZY=0.0, min_blocks_per_split=1),
    # cuda_prefill (the prefill shapes' default on CUDA, `config_for`): the rows form
    # (`sparse_attention_rows`): every pool row the launch reads decoded once into a dense bf16
    # table, then one program per (query, all 64 heads) gathering bf16 rows (pipelined) straight
    # into the MMAs. H200 (2026-12-04 05:10 UTC, `benchmarks/sparse_prefill.py --time`, kernel
    # time with the table step, T=1792, 8K / 32K context): this 1.239 / 1.250 ms (121 / 120
    # TFLOP/s) against the whole-row table's 3.737 / 3.635; BLOCK_N 32 (2 / 3 / 4 stages)
    # 1.497-1.553 / 1.558-2.056; BLOCK_N 16 (4 stages) 2.026 / 2.031; 16 warps (BLOCK_N 64 / 32)
    # 1.98-2.12; BLOCK_N 128 (1 stage) 1.37-1.42 against 1.36-1.37 (second call). Those times
    # read the table size back (the first form); without the read (05:20 UTC): 1.064 / 1.083
    # ms (141 / 139 TFLOP/s), BLOCK_N 32 / 2 stages 1.023 / 1.056 (within 4%, after trailing
    # by 17-35% in the first form: not changed), the table step alone 0.31-0.34 ms (CUDA events
    # around the Python call: host launch gaps included). Never while a graph is
    # captured (its launches are sized by the step): the main entry serves then.
    "cuda_prefill": dict(BLOCK_H=64, BLOCK_N=64, BLOCK_D=None, BLOCK_DV=None, num_warps=8, num_stages=2, ROWS=True),
    # cuda at decode shapes (few tokens): all 64 heads per tile (wgmma M = 64, 4 warps = one warp
    # group), the contraction and the output channels in blocks of 128, one split per entry
    # block (flash-decoding): a T=1 step is 4 channel blocks x 20 splits = 80 programs. H200
    # sweep (T=1, 64K, CUDA-graph time, with the combine): this 13.9 us (13.4-13.6 on
    # 2026-12-01); 16-head tiles with 128 / 256-channel blocks and 8 warps 28.6 / 23.0 us;
    # 16-head whole rows 23.3 us; on 2026-12-01 every neighbour was slower: BLOCK_N 16 15.5,
    # BLOCK_N 64 19.4, 2 blocks per split 19.5, 8 warps 16.0, 256-channel contraction (8 warps)
    # 15.5, 256-channel output blocks (8 warps) 18.1, both 256 at BLOCK_N 16 15.1 us. At T=64
    # (4K) this entry took 159.9 us against 269.3 for the prefill table, at T=8 41.6 against
    # 108.1, so it serves up to 66 tokens (DECODE_FILL_FRACTION). num_stages=1 (BLOCK_N 16)
    # gave wrong results, then an illegal address (triton 3.6).
    "cuda_decode": dict(BLOCK_H=64, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128, num_warps=4, num_stages=2,
                        QK_T=False, min_blocks_per_split=1),
    # cuda_decode_two_pass (from TWO_PASS_MIN_T tokens by default): the decode shapes through the
    # two-pass form (`sparse_attention_two_pass.py`: logits once per query, then p.V per output
    # block). H200 neighbours (2026-12-03, T=8 / T=64 at 4K, graph us): this 27.1 / 95.3; 2 or 4
    # blocks per split 27.1 / 94.4, 27.0 / 94.2; BLOCK_N 16 38.7 / 163.5; 256-channel contraction
    # (8 warps) 35.8 / 148.2; 256-channel output blocks (8 warps) 32.7 / 152.1. VALUES_AHEAD (the
    # values pass loads each entry block's index row and bytes one block ahead), H100 2026-12-06
    # (graph us, 4K, logits capped as shipped): T=8 29.6 -> 27.7, T=32 54.0 -> 49.1, T=64 87.0 ->
    # 78.9 (values kernel 48 -> 40); the batch-64 step 4.850 / 4.806 -> 4.741 / 4.730 ms at 4K,
    # 5.270 / 5.260 -> 5.161 / 5.200 at 32K (processes alternated). The same look-ahead on the
    # logits pass's channel chunks lost (T=64 78 -> 106 us), as did BLOCK_N 16 with it (146).
    # KV_X2 (rows decoded straight to bf16 pairs: `_kv_decode_x2`), H200 2026-12-06 (graph us, 4K, the
    # shipped forms: no cap at 8, the cap at 64): T=8 25.0 -> 21.1, T=64 77.6 -> 66.6 (the same error against
    # the reference).
    # On by default since 2026-12-07 (session forty-six): its GPU tests passed on an H100 (KV_X2
    # bit-equal to the fp32 decode at model widths, split partials included) and the mini decode
    # step at 4K (graph ms, processes alternated, one H100) went batch 8 2.930 / 2.939 -> 2.901 /
    # 2.915, batch 64 4.437 / 4.436 -> 4.396 / 4.396; the sweep there: T=64 78.2 -> 68.6 us.
    # DSV41_SPARSE_KV_X2=0 turns it off (`sparse_kv_x2`). (The one-pass T=1 kernel does not take
    # it: the same decode faulted there, module docstring.)
    "cuda_decode_two_pass": dict(BLOCK_H=64, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128, num_warps=4, num_stages=2,
                                 TWO_PASS=True, min_blocks_per_split=1, VALUES_AHEAD=True, KV_X2=True),
    "npu": dict(BLOCK_H=16, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128, num_warps=None, min_blocks_per_split=2),
    "interp": dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None, num_warps=None, min_blocks_per_split=1),
}
# a backend's "<key>_decode" entry is used when the main entry's tiles (tokens x head blocks)
# would occupy at most 1 / DECODE_FILL_FRACTION of the workers (T <= 66 on the H200's 132 SMs:
# the decode entry won at T = 1, 8 and 64; the prefill table stays for prefill chunks)
DECODE_FILL_FRACTION = 2
COMBINE_ELEMS = 4096  # partial-accumulator elements a combine tile loads at once (splits x channels)


# ---- decoding (integer / bit ops only) --------------------------------------------------------

@triton.jit
def _e4m3_pos(c):
    """E4M3 code 0..126 (int32, sign cleared) -> fp32 value."""
    e = c >> 3
    p2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(max(e,1)-10)
    return (tl.where(e > 0, 8, 0) + (c & 7)).to(tl.float32) * p2


@triton.jit
def _e4m3_signed(b):
    """E4M3 byte b (int32 0..255, bit 7 the sign) -> fp32 value."""
    e = (b >> 3) & 15
    p2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)
    v = (tl.where(e > 0, 8, 0) + (b & 7)).to(tl.float32) * p2
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def _e2m1_fast(c):
    """E2M1 nibble 0..15 (int32) -> fp32 value, built as fp32 bits: codes 2..7 are normal
    numbers 2^(e-1) (1 + m/2), i.e. the 3 code bits placed under the exponent field plus a bias;
    codes 0 / 1 are 0 / 0.5; bit 3 is the sign."""
    a = c & 7
    mag = tl.where(a < 2, a * 0x3F000000, (a << 22) + 0x3F000000)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _glob_raw(gkv_ptr, gsc_ptr, rows, ok, c0, W: tl.constexpr, kv_stride, sc_stride):
    """`_glob_cols`' loads alone: the bytes [BN, W/16, 8] and the scale bytes [BN, W/16] as loaded
    (int8), for `_glob_decode` (a load issued a block ahead of its use)."""
    g = tl.arange(0, W // 16)
    e = tl.arange(0, 8)
    byte = c0 // 2 + (g * 8)[None, :, None] + e[None, None, :]
    b = tl.load(gkv_ptr + rows[:, None, None] * kv_stride + byte, mask=ok[:, None, None], other=0)
    sc = tl.load(gsc_ptr + rows[:, None] * sc_stride + (c0 // 16 + g)[None, :], mask=ok[:, None], other=0)
    return b, sc


@triton.jit
def _glob_decode(b, sc, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_glob_raw`'s bytes -> even / odd channel halves, fp32 [BN, W/2] each."""
    b = b.to(tl.int32) & 0xFF
    s = _e4m3_pos(sc.to(tl.int32) & 127)[:, :, None]
    k_e = tl.reshape(_e2m1_fast(b & 15) * s, [BLOCK_N, W // 2])
    k_o = tl.reshape(_e2m1_fast((b >> 4) & 15) * s, [BLOCK_N, W // 2])
    return k_e, k_o


@triton.jit
def _glob_cols(gkv_ptr, gsc_ptr, rows, ok, c0, W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               kv_stride, sc_stride):
    """Packed FP4 rows [BN] (int64), channels c0 .. c0 + W -> even / odd channel halves, fp32
    [BN, W/2] each (a byte holds channel 2j in its low nibble, 2j + 1 in its high one). The
    bytes are one contiguous load of [BN, W/16, 8] (8 bytes = one 16-channel scale group), so
    each E4M3 scale is loaded and decoded once and broadcast over its group."""
    b, sc = _glob_raw(gkv_ptr, gsc_ptr, rows, ok, c0, W, kv_stride, sc_stride)
    return _glob_decode(b, sc, W, BLOCK_N)


@triton.jit
def _win_raw(win_ptr, wsc_ptr, rows, ok, c0, W: tl.constexpr, kv_stride, sc_stride):
    """`_win_cols`' loads alone: the bytes [BN, W/32, 32] and the scale bytes [BN, W/32] as loaded
    (int8), for `_win_decode`."""
    g = tl.arange(0, W // 32)
    e = tl.arange(0, 32)
    ch = c0 + (g * 32)[None, :, None] + e[None, None, :]
    b = tl.load(win_ptr + rows[:, None, None] * kv_stride + ch, mask=ok[:, None, None], other=0)
    sb = tl.load(wsc_ptr + rows[:, None] * sc_stride + (c0 // 32 + g)[None, :], mask=ok[:, None], other=0)
    return b, sb


@triton.jit
def _win_decode(b, sb, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_win_raw`'s bytes -> even / odd channel halves, fp32 [BN, W/2] each."""
    b0, b1 = tl.split(tl.reshape(b.to(tl.int32) & 0xFF, [BLOCK_N, W // 32, 16, 2]))
    sc = ((sb.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)[:, :, None]
    k_e = tl.reshape(_e4m3_signed(b0) * sc, [BLOCK_N, W // 2])
    k_o = tl.reshape(_e4m3_signed(b1) * sc, [BLOCK_N, W // 2])
    return k_e, k_o


@triton.jit
def _win_rows(win_ptr, wsc_ptr, rows, ok, D: tl.constexpr, BLOCK_N: tl.constexpr, kv_stride, sc_stride):
    """Whole FP8 window rows [BN] (int64) -> even / odd channel halves, fp32 [BN, D/2] each;
    the E8M0 scale of each 32-channel group (16 channel pairs) is loaded once per group. Byte
    loads at stride 2: the whole-row tiles keep this form, the one run on the H200 with 64-head
    whole-row tiles (the split form of `_win_cols` faulted there with an illegal address)."""
    g = tl.arange(0, D // 32)
    e = tl.arange(0, 16)
    m3 = ok[:, None, None]
    ch = (g * 32)[None, :, None] + 2 * e[None, None, :]
    base = rows[:, None, None] * kv_stride + ch
    b0 = tl.load(win_ptr + base, mask=m3, other=0).to(tl.int32) & 0xFF
    b1 = tl.load(win_ptr + base + 1, mask=m3, other=0).to(tl.int32) & 0xFF
    sb = tl.load(wsc_ptr + rows[:, None] * sc_stride + g[None, :], mask=ok[:, None], other=0).to(tl.int32) & 0xFF
    sc = (sb << 23).to(tl.float32, bitcast=True)[:, :, None]
    k_e = tl.reshape(_e4m3_signed(b0) * sc, [BLOCK_N, D // 2])
    k_o = tl.reshape(_e4m3_signed(b1) * sc, [BLOCK_N, D // 2])
    return k_e, k_o


@triton.jit
def _kv_raw(kv_ptr, sc_ptr, rows, ok, c0, W: tl.constexpr, IS_GLOB: tl.constexpr, kv_stride, sc_stride):
    """The loads of channels c0 .. c0 + W of one pool's rows (bytes and scale bytes as loaded), for
    `_kv_decode` / `_kv_decode_x2` (split so a block's loads can be issued ahead of its decode)."""
    if IS_GLOB:
        b, sc = _glob_raw(kv_ptr, sc_ptr, rows, ok, c0, W, kv_stride, sc_stride)
    else:
        b, sc = _win_raw(kv_ptr, sc_ptr, rows, ok, c0, W, kv_stride, sc_stride)
    return b, sc


@triton.jit
def _kv_decode(b, sc, W: tl.constexpr, BLOCK_N: tl.constexpr, IS_GLOB: tl.constexpr):
    """`_kv_raw`'s bytes -> even / odd channel halves [BN, W/2]."""
    if IS_GLOB:
        e, o = _glob_decode(b, sc, W, BLOCK_N)
    else:
        e, o = _win_decode(b, sc, W, BLOCK_N)
    return e, o


# KV_X2's shift of every decoded value (module docstring) and the factor that undoes it; an FP4
# row's E4M3 scale enters the bf16x2 multiply as scale * 2^62, a window row's E8M0 scale as
# 2^(s - 127 + 120 - 64)
KV_SHIFT = tl.constexpr(2.0 ** -64)
KV_UNSHIFT = tl.constexpr(2.0 ** 64)
_GLOB_FACTOR = tl.constexpr(2.0 ** 62)
_WIN_SHIFT_BITS = tl.constexpr(64)


@triton.jit
def _kv_decode_x2(b, sc, W: tl.constexpr, BLOCK_N: tl.constexpr, IS_GLOB: tl.constexpr, ASM: tl.constexpr):
    """`_kv_raw`'s bytes -> even / odd channel halves [BN, W/2] of the values times KV_SHIFT:
    with ASM (CUDA) bf16 from the bf16x2 conversions (module docstring), else fp32 from the
    shared decode times the shift (exact either way)."""
    if ASM and IS_GLOB:  # E2M1 nibbles placed as bf16 (value * 2^-126), times the E4M3 scale * 2^62
        f = (_e4m3_pos(sc.to(tl.int32) & 127) * _GLOB_FACTOR).to(tl.bfloat16)
        f = tl.broadcast_to(f[:, :, None], (BLOCK_N, W // 16, 8))
        e, o = tl.inline_asm_elementwise(_E2M1_BF16X4_ASM, "=r,=r,=r,=r,r,r,r", [b, f],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        e = tl.reshape(e, [BLOCK_N, W // 2])
        o = tl.reshape(o, [BLOCK_N, W // 2])
    elif ASM:  # E4M3 bytes placed as bf16 (value * 2^-120), one bf16x2 multiply by 2^(s - 127 + 120) * KV_SHIFT
        b0, b1 = tl.split(tl.reshape(b, [BLOCK_N, W // 32, 16, 2]))
        # the factor's bf16 exponent field: s - 127 + 120 - 64, biased by 127 (normal for s <= 198)
        f = ((((sc.to(tl.int32) & 0xFF) + (120 - _WIN_SHIFT_BITS)) << 7).to(tl.int16)).to(tl.bfloat16, bitcast=True)
        f = tl.broadcast_to(f[:, :, None], (BLOCK_N, W // 32, 16))
        e = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [e4m3_placed(b0, True), f],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
        o = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [e4m3_placed(b1, True), f],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
        e = tl.reshape(e, [BLOCK_N, W // 2])
        o = tl.reshape(o, [BLOCK_N, W // 2])
    else:  # the interpreters (and any non-CUDA compile): the shared fp32 decode, shifted (exact)
        e, o = _kv_decode(b, sc, W, BLOCK_N, IS_GLOB)
        e = e * KV_SHIFT
        o = o * KV_SHIFT
    return e, o


@triton.jit
def _kv_block(kv_ptr, sc_ptr, rows, ok, c0, W: tl.constexpr, BLOCK_N: tl.constexpr, IS_GLOB: tl.constexpr,
              kv_stride, sc_stride, X2: tl.constexpr, ASM: tl.constexpr):
    """Channels c0 .. c0 + W of pool rows [BN] as even / odd halves [BN, W/2]: the shared fp32
    decode, or with X2 `_kv_decode_x2`'s (values times KV_SHIFT)."""
    b, sc = _kv_raw(kv_ptr, sc_ptr, rows, ok, c0, W, IS_GLOB, kv_stride, sc_stride)
    if X2:
        e, o = _kv_decode_x2(b, sc, W, BLOCK_N, IS_GLOB, ASM)
    else:
        e, o = _kv_decode(b, sc, W, BLOCK_N, IS_GLOB)
    return e, o


@triton.jit
def _load_halves(ptr, row, ok, c0, W: tl.constexpr, BLOCK: tl.constexpr):
    """Rows `row` (element offsets, [BLOCK]) of a row-major tensor, columns c0 .. c0 + W, as even
    / odd column halves [BLOCK, W/2] each: one contiguous load, split into pairs."""
    c = tl.arange(0, W)
    x = tl.load(ptr + row[:, None] + c0 + c[None, :], mask=ok[:, None], other=0.0)
    return tl.split(tl.reshape(x, [BLOCK, W // 2, 2]))


@triton.jit
def _store_halves(ptr, row, ok, c0, x_e, x_o, W: tl.constexpr, BLOCK: tl.constexpr):
    """Interleave even / odd column halves [BLOCK, W/2] back into columns c0 .. c0 + W of rows
    `row` (element offsets): one contiguous store."""
    c = tl.arange(0, W)
    tl.store(ptr + row[:, None] + c0 + c[None, :], tl.reshape(tl.join(x_e, x_o), [BLOCK, W]), mask=ok[:, None])


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; integer ops only (the
    interpreters' fp32 -> bf16 cast truncates). Finite inputs."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _dot_in(x, DOT_BF16: tl.constexpr):
    """A dot operand (fp32 holding bf16-exact values) in the dot dtype."""
    if DOT_BF16:
        y = x.to(tl.bfloat16)
    else:
        y = x
    return y


@triton.jit
def _q_in(q, DOT_BF16: tl.constexpr):
    """The bf16 query as a dot operand: as loaded when compiled (so it can stay in shared memory
    as wgmma's A operand instead of occupying registers), fp32 under the interpreters."""
    if DOT_BF16:
        y = q
    else:
        y = q.to(tl.float32)
    return y


@triton.jit
def _to_bf16(x, NATIVE: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even on every backend."""
    if NATIVE:  # compiled: the hardware cast rounds to nearest even
        y = x.to(tl.bfloat16)
    else:
        y = _round_bf16(x).to(tl.bfloat16)
    return y


@triton.jit
def _query_tile(r, n_hb, n_split, H, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Tile index r = (query * n_split + split) * n_hb + head block -> (split, query, heads
    [BLOCK_H], their mask, their q / output row offsets (elements, int64))."""
    hb = r % n_hb
    r = r // n_hb
    sp = r % n_split
    tq = r // n_split
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    return sp, tq, heads, heads < H, (tq * H + heads).to(tl.int64) * D


@triton.jit
def _online_softmax(s, ok, m_i, l_i, scale, DOT_BF16: tl.constexpr):
    """Online-softmax update for a block of raw logits s [BH, BN] (entries valid where ok):
    (new running max, new sum, the factor rescaling the accumulator, the probabilities rounded
    to bf16 as the p.V operand). Masked logits are -inf; the sum stays fp32."""
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pb = _to_bf16(p, DOT_BF16)  # probabilities rounded to bf16 (nearest even)
    if not DOT_BF16:
        pb = pb.to(tl.float32)
    return m_new, l_i, alpha, pb


# ---- one block of entries: logits, online softmax, p.V ----------------------------------------

@triton.jit
def _block(q_ptr, qrow, hok, q_e, q_o, win_ptr, wsc_ptr, gkv_ptr, gsc_ptr, rows, ok,
           m_i, l_i, acc_e, acc_o, dv0, half, scale,
           D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_DV: tl.constexpr, IS_GLOB: tl.constexpr, DOT_BF16: tl.constexpr, QK_T: tl.constexpr,
           DV_HALF: tl.constexpr, kv_stride, sc_stride):
    """One entry block for the tile: logits (whole rows: one decode as K and V; tiled: BLOCK_D
    chunks for K, then the tile's BLOCK_DV channels for V), online-softmax update, p.V."""
    if IS_GLOB:
        kv_ptr = gkv_ptr
        sc_ptr = gsc_ptr
    else:
        kv_ptr = win_ptr
        sc_ptr = wsc_ptr
    if BLOCK_D == D and BLOCK_DV == D:
        # whole rows: decode once, use as K and as V
        if IS_GLOB:
            k_e, k_o = _glob_cols(gkv_ptr, gsc_ptr, rows, ok, 0, D, D, BLOCK_N, kv_stride, sc_stride)
        else:
            k_e, k_o = _win_rows(win_ptr, wsc_ptr, rows, ok, D, BLOCK_N, kv_stride, sc_stride)
        v_e = _dot_in(k_e, DOT_BF16)
        v_o = _dot_in(k_o, DOT_BF16)
        if QK_T:  # entries as M: a full-width MMA when BLOCK_H is small next to BLOCK_N
            s = tl.trans(tl.dot(v_o, tl.trans(q_o), tl.dot(v_e, tl.trans(q_e))))
        else:
            s = tl.dot(q_o, tl.trans(v_o), tl.dot(q_e, tl.trans(v_e)))
    else:
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, D, BLOCK_D):
            qe, qo = _load_halves(q_ptr, qrow, hok, c0, BLOCK_D, BLOCK_H)
            k_e, k_o = _kv_block(kv_ptr, sc_ptr, rows, ok, c0, BLOCK_D, BLOCK_N, IS_GLOB, kv_stride, sc_stride,
                                 False, False)
            s += tl.dot(_dot_in(qe.to(tl.float32), DOT_BF16), tl.trans(_dot_in(k_e, DOT_BF16)))
            s += tl.dot(_dot_in(qo.to(tl.float32), DOT_BF16), tl.trans(_dot_in(k_o, DOT_BF16)))
        v_e, v_o = _kv_block(kv_ptr, sc_ptr, rows, ok, dv0, BLOCK_DV, BLOCK_N, IS_GLOB, kv_stride, sc_stride,
                             False, False)
        v_e = _dot_in(v_e, DOT_BF16)
        v_o = _dot_in(v_o, DOT_BF16)
    m_new, l_i, alpha, pb = _online_softmax(s, ok, m_i, l_i, scale, DOT_BF16)
    if DV_HALF:  # this tile owns one channel parity of the output: acc_e holds it, acc_o is unused
        if half == 0:
            acc_e = tl.dot(pb, v_e, acc_e * alpha[:, None])
        else:
            acc_e = tl.dot(pb, v_o, acc_e * alpha[:, None])
    else:
        acc_e = tl.dot(pb, v_e, acc_e * alpha[:, None])
        acc_o = tl.dot(pb, v_o, acc_o * alpha[:, None])
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _sparse_attn_kernel(q_ptr, win_ptr, wsc_ptr, widx_ptr, gkv_ptr, gsc_ptr, gidx_ptr, sink_ptr,
                        out_ptr, pacc_ptr, pm_ptr, pl_ptr,
                        H, S, K, n_wb, n_blocks, bps, n_split, n_hb, n_dv, n_tiles, num_programs, scale,
                        w_stride, ws_stride, g_stride, gs_stride,
                        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr,
                        DOT_BF16: tl.constexpr, QK_T: tl.constexpr, DV_HALF: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nn = tl.arange(0, BLOCK_N)
    jv = tl.arange(0, BLOCK_DV // 2)
    jq = tl.arange(0, BLOCK_D // 2)
    for tile in range(pid, n_tiles, num_programs):
        dvb = tile % n_dv
        sp, tq, heads, hok, qrow = _query_tile(tile // n_dv, n_hb, n_split, H, D, BLOCK_H)
        dv0 = dvb * BLOCK_DV
        # q halves for the whole-row path (unused, and dropped, in the tiled path); loaded as bf16
        # straight into the MMA (compiled, it can stay in shared memory as wgmma's A operand)
        qp = q_ptr + qrow[:, None] + 2 * jq[None, :]
        q_e = _q_in(tl.load(qp, mask=hok[:, None], other=0.0), DOT_BF16)
        q_o = _q_in(tl.load(qp + 1, mask=hok[:, None], other=0.0), DOT_BF16)
        m_i = tl.full([BLOCK_H], RUNNING_MAX_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_e = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        b_lo = sp * bps
        b_hi = tl.minimum(b_lo + bps, n_blocks)
        # window blocks: this query's SWA pool rows
        for nb in range(b_lo, tl.minimum(b_hi, n_wb)):
            s_idx = nb * BLOCK_N + nn
            inr = s_idx < S
            widx = tl.load(widx_ptr + tq.to(tl.int64) * S + s_idx, mask=inr, other=-1)
            ok = widx >= 0
            m_i, l_i, acc_e, acc_o = _block(q_ptr, qrow, hok, q_e, q_o, win_ptr, wsc_ptr, gkv_ptr, gsc_ptr,
                                            tl.maximum(widx, 0).to(tl.int64), ok, m_i, l_i, acc_e, acc_o, dv0, dvb, scale,
                                            D, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, False, DOT_BF16, QK_T, DV_HALF,
                                            w_stride, ws_stride)
        # global blocks
        for nb in range(tl.maximum(b_lo, n_wb), b_hi):
            k_idx = (nb - n_wb) * BLOCK_N + nn
            inr = k_idx < K
            idx = tl.load(gidx_ptr + tq.to(tl.int64) * K + k_idx, mask=inr, other=-1)
            ok = idx >= 0
            rows = tl.maximum(idx, 0).to(tl.int64)
            m_i, l_i, acc_e, acc_o = _block(q_ptr, qrow, hok, q_e, q_o, win_ptr, wsc_ptr, gkv_ptr, gsc_ptr,
                                            rows, ok, m_i, l_i, acc_e, acc_o, dv0, dvb, scale,
                                            D, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, True, DOT_BF16, QK_T, DV_HALF,
                                            g_stride, gs_stride)
        # whole rows: two stores at stride 2 (the form run with 64-head whole-row tiles on the
        # H200); tiled: one contiguous store of the interleaved halves
        STRIDED: tl.constexpr = DV_HALF or (BLOCK_D == D and BLOCK_DV == D)
        if DV_HALF:
            col = 2 * jv + dvb  # channels of this tile's parity
        else:
            col = dv0 + 2 * jv
        if SPLIT:
            prow = ((tq * n_split + sp) * H + heads).to(tl.int64)
            if STRIDED:
                pp = pacc_ptr + prow[:, None] * D + col[None, :]
                tl.store(pp, acc_e, mask=hok[:, None])
                if not DV_HALF:
                    tl.store(pp + 1, acc_o, mask=hok[:, None])
            else:
                _store_halves(pacc_ptr, prow * D, hok, dv0, acc_e, acc_o, BLOCK_DV, BLOCK_H)
            first = hok & (dvb == 0)
            tl.store(pm_ptr + prow, m_i, mask=first)
            tl.store(pl_ptr + prow, l_i, mask=first)
        else:
            sk = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
            inv = 1.0 / (l_i + tl.exp(sk - m_i))
            if STRIDED:
                op = out_ptr + qrow[:, None] + col[None, :]
                tl.store(op, _to_bf16(acc_e * inv[:, None], DOT_BF16), mask=hok[:, None])
                if not DV_HALF:
                    tl.store(op + 1, _to_bf16(acc_o * inv[:, None], DOT_BF16), mask=hok[:, None])
            else:
                _store_halves(out_ptr, qrow, hok, dv0, _to_bf16(acc_e * inv[:, None], DOT_BF16),
                              _to_bf16(acc_o * inv[:, None], DOT_BF16), BLOCK_DV, BLOCK_H)


# ---- MQA path: whole rows as 32-bit words, decoded once per block as K and V, next block loaded ahead ----

@triton.jit
def _entry_rows(idx_ptr, tq, L, nb, active, BLOCK_N: tl.constexpr):
    """Pool rows [BN] (int64; row 0 where masked) and validity of entries nb*BN .. of query tq's
    index list of length L (-1 = masked; nothing valid unless `active`)."""
    j = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_ptr + tq.to(tl.int64) * L + j, mask=(j < L) & active, other=-1)
    return tl.maximum(idx, 0).to(tl.int64), idx >= 0


@triton.jit
def _raw_rows(kv_ptr, sc_ptr, rows, ok, GROUPS: tl.constexpr, GWORDS: tl.constexpr, kv_stride, sc_stride):
    """The stored words of pool rows [BN] (int64): codes [BN, GROUPS, GWORDS] int32 (one scale
    group each: contiguous vector loads, four bytes a register while in flight) and scales
    [BN, GROUPS] int8; masked rows 0 (never read). FP8 window rows: D/32 groups of 8 words
    (E8M0 scales); packed FP4 global rows: D/16 groups of 2 words (E4M3 scales)."""
    g = tl.arange(0, GROUPS)
    e = tl.arange(0, GWORDS)
    w = tl.load(kv_ptr + rows[:, None, None] * kv_stride + (g * GWORDS)[None, :, None] + e[None, None, :],
                mask=ok[:, None, None], other=0)
    sc = tl.load(sc_ptr + rows[:, None] * sc_stride + g[None, :], mask=ok[:, None], other=0)
    return w, sc


@triton.jit
def _win_words(w, sb, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """FP8 window words [BN, D/32, 8] (word j holds channels 4j .. 4j+3, byte i = channel 4j+i)
    -> even / odd channel halves [BN, D/2] fp32 (bytes 0, 2 / 1, 3 of each word)."""
    sh = (tl.arange(0, 2) * 16)[None, None, None, :]
    w4 = w[:, :, :, None]
    sc = ((sb.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)[:, :, None, None]
    k_e = _e4m3_signed((w4 >> sh) & 0xFF) * sc
    k_o = _e4m3_signed((w4 >> (sh + 8)) & 0xFF) * sc
    return tl.reshape(k_e, [BLOCK_N, D // 2]), tl.reshape(k_o, [BLOCK_N, D // 2])


@triton.jit
def _glob_words(w, sc, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Packed FP4 words [BN, D/16, 2] (word j holds channels 8j .. 8j+7, nibble i = channel
    8j+i) -> even / odd channel halves [BN, D/2] fp32 (nibbles 0, 2, 4, 6 / 1, 3, 5, 7)."""
    sh = (tl.arange(0, 4) * 8)[None, None, None, :]
    w4 = w[:, :, :, None]
    s = _e4m3_pos(sc.to(tl.int32) & 127)[:, :, None, None]
    k_e = _e2m1_fast((w4 >> sh) & 15) * s
    k_o = _e2m1_fast((w4 >> (sh + 4)) & 15) * s
    return tl.reshape(k_e, [BLOCK_N, D // 2]), tl.reshape(k_o, [BLOCK_N, D // 2])


@triton.jit
def _halves_step(q_e, q_o, k_e, k_o, ok, m_i, l_i, acc_e, acc_o, scale, DOT_BF16: tl.constexpr,
                 LAZY: tl.constexpr):
    """One block of decoded entries (even / odd channel halves [BN, D/2], bf16-exact) for all the
    tile's heads: logits, online-softmax update, p.V with the same halves as V. LAZY > 0: the
    running max (and with it the accumulator and sum) moves only when some head's block max
    passes it by more than LAZY, so most blocks skip the [BH, D] rescale; probabilities are
    then exp(logit - a max at most LAZY below the true one): <= e^LAZY, same relative bf16
    rounding, the same normalised result."""
    v_e = _dot_in(k_e, DOT_BF16)
    v_o = _dot_in(k_o, DOT_BF16)
    s = tl.dot(q_o, tl.trans(v_o), tl.dot(q_e, tl.trans(v_e)))
    if LAZY > 0:
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if tl.max(m_new - m_i, axis=0) > LAZY:  # one decision for the whole tile
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha
            acc_e = acc_e * alpha[:, None]
            acc_o = acc_o * alpha[:, None]
            m_i = m_new
        p = tl.exp(s - m_i[:, None])
        l_i = l_i + tl.sum(p, axis=1)
        pb = _to_bf16(p, DOT_BF16)
        if not DOT_BF16:
            pb = pb.to(tl.float32)
        acc_e = tl.dot(pb, v_e, acc_e)
        acc_o = tl.dot(pb, v_o, acc_o)
    else:
        m_i, l_i, alpha, pb = _online_softmax(s, ok, m_i, l_i, scale, DOT_BF16)
        acc_e = tl.dot(pb, v_e, acc_e * alpha[:, None])
        acc_o = tl.dot(pb, v_o, acc_o * alpha[:, None])
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _mqa_range(q_e, q_o, idx_ptr, tq, L, off, lo, hi, kv_ptr, sc_ptr, kv_stride, sc_stride, m_i, l_i, acc_e, acc_o,
               scale, D: tl.constexpr, BLOCK_N: tl.constexpr, IS_GLOB: tl.constexpr, DOT_BF16: tl.constexpr,
               AHEAD: tl.constexpr, LAZY: tl.constexpr):
    """Entry blocks lo .. hi of one kind (window rows, or global rows when IS_GLOB) for the
    tile: block nb holds entries (nb - off) * BLOCK_N .. of query tq's index list (length L).
    AHEAD: the next block's index row and words are loaded before this block is computed."""
    GROUPS: tl.constexpr = D // 16 if IS_GLOB else D // 32
    GWORDS: tl.constexpr = 2 if IS_GLOB else 8
    if AHEAD:
        first = lo < hi
    else:  # loaded in the loop: nothing before it (lo >= 0)
        first = lo < 0
    rows, ok = _entry_rows(idx_ptr, tq, L, lo - off, first, BLOCK_N)
    w, sc = _raw_rows(kv_ptr, sc_ptr, rows, ok, GROUPS, GWORDS, kv_stride, sc_stride)
    for nb in range(lo, hi):
        if AHEAD:  # in flight during this block's math
            rows_n, ok_n = _entry_rows(idx_ptr, tq, L, nb + 1 - off, nb + 1 < hi, BLOCK_N)
            w_n, sc_n = _raw_rows(kv_ptr, sc_ptr, rows_n, ok_n, GROUPS, GWORDS, kv_stride, sc_stride)
        else:
            rows, ok = _entry_rows(idx_ptr, tq, L, nb - off, nb < hi, BLOCK_N)
            w, sc = _raw_rows(kv_ptr, sc_ptr, rows, ok, GROUPS, GWORDS, kv_stride, sc_stride)
            ok_n, w_n, sc_n = ok, w, sc
        if IS_GLOB:
            k_e, k_o = _glob_words(w, sc, BLOCK_N, D)
        else:
            k_e, k_o = _win_words(w, sc, BLOCK_N, D)
        m_i, l_i, acc_e, acc_o = _halves_step(q_e, q_o, k_e, k_o, ok, m_i, l_i, acc_e, acc_o, scale, DOT_BF16, LAZY)
        ok, w, sc = ok_n, w_n, sc_n
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _mqa_kernel(q_ptr, win_ptr, wsc_ptr, widx_ptr, gkv_ptr, gsc_ptr, gidx_ptr, sink_ptr, out_ptr, pacc_ptr, pm_ptr,
                pl_ptr, H, S, K, n_wb, n_blocks, bps, n_split, n_hb, n_tiles, num_programs, scale,
                w_stride, ws_stride, g_stride, gs_stride,
                D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT: tl.constexpr, DOT_BF16: tl.constexpr, AHEAD: tl.constexpr, LAZY: tl.constexpr, PDL: tl.constexpr = 0):
    """Tiles (query, split, head block), walked by a 1-D persistent loop; heads are the MMA's M
    (all heads of a token share each decoded entry, decoded once per tile and used as K and V).
    Pools arrive as 32-bit words (row strides in words). AHEAD: each block's index row and
    words are loaded one block ahead, so the gather's latency overlaps the previous block's
    math. One split: the tile normalises (sink included) and writes bf16; several: fp32
    partials for `_combine_kernel`. Outputs are written as even / odd halves (stride 2)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    jq = tl.arange(0, D // 2)
    for tile in range(pid, n_tiles, num_programs):
        sp, tq, heads, hok, qrow = _query_tile(tile, n_hb, n_split, H, D, BLOCK_H)
        qp = q_ptr + qrow[:, None] + 2 * jq[None, :]
        q_e = _q_in(tl.load(qp, mask=hok[:, None], other=0.0), DOT_BF16)
        q_o = _q_in(tl.load(qp + 1, mask=hok[:, None], other=0.0), DOT_BF16)
        m_i = tl.full([BLOCK_H], RUNNING_MAX_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_e = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
        b_lo = sp * bps
        b_hi = tl.minimum(b_lo + bps, n_blocks)
        # window blocks b_lo .. w_hi (this query's SWA pool rows), then global blocks g_lo .. b_hi
        w_hi = tl.minimum(b_hi, n_wb)
        m_i, l_i, acc_e, acc_o = _mqa_range(q_e, q_o, widx_ptr, tq, S, 0, b_lo, w_hi, win_ptr, wsc_ptr, w_stride,
                                            ws_stride, m_i, l_i, acc_e, acc_o, scale, D, BLOCK_N, False, DOT_BF16,
                                            AHEAD, LAZY)
        m_i, l_i, acc_e, acc_o = _mqa_range(q_e, q_o, gidx_ptr, tq, K, n_wb, tl.maximum(b_lo, n_wb), b_hi, gkv_ptr,
                                            gsc_ptr, g_stride, gs_stride, m_i, l_i, acc_e, acc_o, scale, D, BLOCK_N,
                                            True, DOT_BF16, AHEAD, LAZY)
        col = 2 * jq
        if SPLIT:
            prow = ((tq * n_split + sp) * H + heads).to(tl.int64)
            pp = pacc_ptr + prow[:, None] * D + col[None, :]
            tl.store(pp, acc_e, mask=hok[:, None])
            tl.store(pp + 1, acc_o, mask=hok[:, None])
            tl.store(pm_ptr + prow, m_i, mask=hok)
            tl.store(pl_ptr + prow, l_i, mask=hok)
        else:
            sk = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
            inv = 1.0 / (l_i + tl.exp(sk - m_i))
            op = out_ptr + qrow[:, None] + col[None, :]
            tl.store(op, _to_bf16(acc_e * inv[:, None], DOT_BF16), mask=hok[:, None])
            tl.store(op + 1, _to_bf16(acc_o * inv[:, None], DOT_BF16), mask=hok[:, None])


@triton.jit
def _combine_kernel(pacc_ptr, pm_ptr, pl_ptr, sink_ptr, out_ptr, H, n_split, n_db, n_tiles, num_programs,
                    D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE_CAST: tl.constexpr, PDL: tl.constexpr = 0):
    """Merge the splits of one (query, head, channel block) per tile: every split's running max,
    sum and partial accumulator are loaded at once ([SPLITS] and [SPLITS, BLOCK_D], SPLITS >=
    n_split), so the merge costs one round trip to memory, not one per split."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    sp = tl.arange(0, SPLITS)
    spm = sp < n_split
    dd = tl.arange(0, BLOCK_D)
    for tile in range(pid, n_tiles, num_programs):
        db = tile % n_db
        r = tile // n_db
        head = r % H
        tq = r // H
        prow = ((tq * n_split + sp) * H + head).to(tl.int64)
        m = tl.load(pm_ptr + prow, mask=spm, other=RUNNING_MAX_INIT)
        mx = tl.max(m, axis=0)
        w = tl.where(spm, tl.exp(m - mx), 0.0)
        den = tl.sum(w * tl.load(pl_ptr + prow, mask=spm, other=0.0), axis=0)
        col = db * BLOCK_D + dd
        a = tl.load(pacc_ptr + prow[:, None] * D + col[None, :], mask=spm[:, None], other=0.0)
        acc = tl.sum(w[:, None] * a, axis=0)
        sk = tl.load(sink_ptr + head).to(tl.float32)
        inv = 1.0 / (den + tl.exp(sk - mx))
        orow = (tq * H + head).to(tl.int64) * D
        tl.store(out_ptr + orow + col, _to_bf16(acc * inv, NATIVE_CAST))


# ---- launcher -----------------------------------------------------------------------------------

def _backend_key(device: torch.device) -> str:
    from .launch import interpreting

    if interpreting():
        return "interp"
    return "npu" if device.type == "npu" else "cuda"


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def sparse_attention_launch(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, softmax_scale,
                            *, BLOCK_H: int, BLOCK_N: int, BLOCK_D: int | None, BLOCK_DV: int | None,
                            num_warps: int | None = None, num_stages: int | None = None, QK_T: bool = False,
                            DV_HALF: bool = False, MQA: bool = False, AHEAD: bool = True, LAZY: float = 0.0,
                            TWO_PASS: bool = False, ROWS: bool = False, min_blocks_per_split: int = 2,
                            LOGITS_MAXNREG: int | None = None, VALUES_AHEAD: bool = False, KV_X2: bool = False,
                            LOGITS_BLOCK_N: int | None = None, LOGITS_SPLIT_D: bool = False,
                            n_split: int | None = None,
                            rows_bound: tuple[int, int] | None = None) -> torch.Tensor:
    """`sparse_attention` with explicit tile sizes (tests and tuning); `n_split` forces the split
    count. MQA (CUDA; whole rows): `_mqa_kernel` (each entry decoded once per head block and used
    as K and as V, the next block's words loaded ahead; LAZY: the running max moves only past
    that margin) instead of `_sparse_attn_kernel`. TWO_PASS: every logit first, then the values
    (`sparse_attention_two_pass`; tiled, BLOCK_D / BLOCK_DV as given; LOGITS_MAXNREG: a register
    cap for its logits pass on CUDA; VALUES_AHEAD: its values pass loads each entry block one
    ahead; KV_X2: both passes decode the cache rows straight to bf16 pairs on CUDA
    (`_kv_decode_x2`), elsewhere through the shifted fp32 decode that mirrors it; LOGITS_BLOCK_N:
    the logits pass on entry blocks of its own size, each pool in its own loop,
    `_logits_pools_kernel`); LOGITS_SPLIT_D: the logits pass a tile per BLOCK_D-channel chunk
    too, the values pass summing the chunks and each split taking its own maximum).
    ROWS: every pool row read decoded once into a dense bf16 table, then bf16 gathers
    (`sparse_attention_rows`; whole rows, no splits; `rows_bound` sizes the table, see
    `ops.sparse_attention`)."""
    from .launch import as_int8, grid_for, interpreting, num_workers

    t, h, d = q.shape
    if d % 32 or d < 32:
        raise ValueError(f"head_dim {d} must be a multiple of 32")
    s = win_idx.shape[-1]
    if swa_kv.dim() != 2 or swa_kv.shape[1] != d or swa_scale.shape != (swa_kv.shape[0], d // 32) \
            or win_idx.shape != (t, s):
        raise ValueError(f"window pool {tuple(swa_kv.shape)} / {tuple(swa_scale.shape)} or win_idx "
                         f"{tuple(win_idx.shape)} do not match q {tuple(q.shape)}")
    have_glob = glob_idx is not None and glob_idx.shape[-1] > 0
    k = glob_idx.shape[-1] if have_glob else 0
    if have_glob and (glob_idx.shape != (t, k) or glob_kv.shape[1:] != (d // 2,)
                      or glob_scale.shape != (glob_kv.shape[0], d // 16)):
        raise ValueError(f"global pool {tuple(glob_kv.shape)} / {tuple(glob_scale.shape)} or glob_idx "
                         f"{tuple(glob_idx.shape)} do not match q {tuple(q.shape)}")
    block_d = d if BLOCK_D is None else min(BLOCK_D, d)
    block_dv = d if BLOCK_DV is None else min(BLOCK_DV, d)
    if d % block_d or d % block_dv or block_d < 32 or block_dv < 32:
        raise ValueError(f"BLOCK_D {block_d} / BLOCK_DV {block_dv} must divide head_dim {d} (and be >= 32)")
    if MQA and BLOCK_N < 16:
        raise ValueError(f"MQA tiles need BLOCK_N >= 16 (tl.dot's least N), got {BLOCK_N}")
    if MQA and d & (d - 1):
        raise ValueError(f"MQA tiles need a power-of-two head_dim, got {d}")
    if TWO_PASS and (MQA or DV_HALF or QK_T):
        raise ValueError("TWO_PASS takes none of MQA / DV_HALF / QK_T")
    if KV_X2 and not TWO_PASS:
        raise ValueError("KV_X2 is an option of the two-pass form (TWO_PASS=True)")
    if LOGITS_BLOCK_N is not None and (not TWO_PASS or LOGITS_BLOCK_N < 16 or LOGITS_BLOCK_N & (LOGITS_BLOCK_N - 1)):
        raise ValueError(f"LOGITS_BLOCK_N is an option of the two-pass form (TWO_PASS=True), a power of two >= 16 "
                         f"(tl.dot's least N); got {LOGITS_BLOCK_N}")
    if LOGITS_SPLIT_D and (not TWO_PASS or LOGITS_BLOCK_N is not None):
        raise ValueError("LOGITS_SPLIT_D is an option of the two-pass form (TWO_PASS=True) without LOGITS_BLOCK_N")
    if ROWS and (MQA or DV_HALF or QK_T or TWO_PASS or BLOCK_N < 16 or d & (d - 1)):
        raise ValueError(f"ROWS takes none of MQA / DV_HALF / QK_T / TWO_PASS, BLOCK_N >= 16 and a power-of-two "
                         f"head_dim (got BLOCK_N {BLOCK_N}, head_dim {d})")
    if MQA and (block_d != d or block_dv != d):
        raise ValueError(f"MQA tiles take whole rows (BLOCK_D = BLOCK_DV = head_dim {d}; got {block_d} / {block_dv})")
    block_h = _pow2_at_least(min(BLOCK_H, h), 16)  # tl.dot needs M >= 16; extra heads are masked

    dev = q.device
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=dev)
    if t == 0 or h == 0:
        return out
    qc = q.contiguous()
    # storage bytes as int8 (Ascend loads no uint8 pointers); the kernel masks them to 0..255
    # pools may be row-strided views (fields of vLLM's page records): rows are addressed by stride
    wk = as_int8(_rows_view(swa_kv))
    ws = as_int8(_rows_view(swa_scale))
    wi = _index_rows(win_idx)
    if have_glob:
        gk = as_int8(_rows_view(glob_kv))
        gs = as_int8(_rows_view(glob_scale))
        gi = _index_rows(glob_idx)
    else:
        gk, gs, gi = wk, ws, wi  # placeholders: K = 0, so no global block is visited (no fill launched)
    sk = sink.contiguous()

    kw = {}
    compiled_cuda = dev.type == "cuda" and not interpreting()
    if compiled_cuda:
        kw = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
    dot_bf16 = not interpreting()  # interpreters: fp32 dot operands (same values), integer bf16 rounding
    if ROWS:
        from .sparse_attention_rows import rows_attention

        return rows_attention(qc, swa_kv, swa_scale, win_idx, glob_kv if have_glob else None,
                              glob_scale if have_glob else None, glob_idx if have_glob else None, sk, softmax_scale,
                              out, BLOCK_H=block_h, BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages,
                              dot_bf16=dot_bf16, rows_bound=rows_bound)
    if TWO_PASS:
        from .sparse_attention_two_pass import launch_two_pass

        n_split, pacc, pm, pl = launch_two_pass(
            qc, wk, ws, wi, gk, gs, gi, sk, out, softmax_scale, s=s, k=k, block_h=block_h, block_n=BLOCK_N,
            block_d=block_d, block_dv=block_dv, n_split=n_split, min_blocks_per_split=min_blocks_per_split,
            kw=kw, dot_bf16=dot_bf16,
            logits_kw={"maxnreg": LOGITS_MAXNREG} if LOGITS_MAXNREG and compiled_cuda else {},
            values_ahead=VALUES_AHEAD, kv_x2=KV_X2, asm=KV_X2 and compiled_cuda, logits_block_n=LOGITS_BLOCK_N,
            logits_split_d=LOGITS_SPLIT_D)
        _combine_splits(pacc, pm, pl, sk, out, n_split, dot_bf16)
        return out
    n_hb = -(-h // block_h)
    dv_half = bool(DV_HALF) and not MQA and block_d == d and block_dv == d  # whole rows only
    n_dv = 2 if dv_half else 1 if MQA else d // block_dv
    n_wb = -(-s // BLOCK_N)
    n_blocks = n_wb + -(-k // BLOCK_N)
    base_tiles = t * n_hb * n_dv
    if n_split is None:
        n_split = _auto_splits(base_tiles, n_blocks, num_workers(dev, "cube"), min_blocks_per_split)
    n_split, bps, pacc, pm, pl = split_buffers(out, n_blocks, n_split)
    split = n_split > 1
    n_tiles = base_tiles * n_split
    grid = grid_for(n_tiles, dev, cores="cube")  # tl.dot: one program per AI core on Ascend
    if MQA:
        ww, gw = _words(wk), _words(gk)
        _mqa_kernel[(grid,)](qc, ww, ws, wi, gw, gs, gi, sk, out, pacc, pm, pl,
                             h, s, k, n_wb, n_blocks, bps, n_split, n_hb, n_tiles, grid, float(softmax_scale),
                             ww.stride(0), ws.stride(0), gw.stride(0), gs.stride(0),
                             D=d, BLOCK_H=block_h, BLOCK_N=BLOCK_N, SPLIT=split, DOT_BF16=dot_bf16,
                             AHEAD=bool(AHEAD), LAZY=float(LAZY), **kw, **pdl_launch(qc))
    else:
        _sparse_attn_kernel[(grid,)](qc, wk, ws, wi, gk, gs, gi, sk, out, pacc, pm, pl,
                                     h, s, k, n_wb, n_blocks, bps, n_split, n_hb, n_dv, n_tiles, grid,
                                     float(softmax_scale), wk.stride(0), ws.stride(0), gk.stride(0), gs.stride(0),
                                     D=d, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
                                     BLOCK_D=block_d, BLOCK_DV=block_dv, SPLIT=split, DOT_BF16=dot_bf16,
                                     QK_T=bool(QK_T), DV_HALF=dv_half, **kw, **pdl_launch(qc))
    _combine_splits(pacc, pm, pl, sk, out, n_split, dot_bf16)
    return out


def split_buffers(out: torch.Tensor, n_blocks: int, n_split: int):
    """(splits, entry blocks per split, fp32 partials [T, splits, H, D], maxima and sums [T,
    splits, H]) for n_split asked over n_blocks blocks: at most one split per block, none empty;
    one split writes `out` directly (it stands in for the partials)."""
    t, h, d = out.shape
    n_split = max(1, min(n_split, max(1, n_blocks)))
    bps = max(1, -(-n_blocks // n_split))
    n_split = max(1, -(-n_blocks // bps))
    if n_split == 1:
        return 1, bps, out, out, out
    f32 = dict(dtype=torch.float32, device=out.device)
    return (n_split, bps, torch.empty(t, n_split, h, d, **f32), torch.empty(t, n_split, h, **f32),
            torch.empty(t, n_split, h, **f32))


def _combine_splits(pacc, pm, pl, sk, out, n_split: int, dot_bf16: bool) -> None:
    """`_combine_kernel` over the n_split partials [T, n_split, H, D] into out [T, H, D] (nothing
    to do for one split: the kernel wrote `out`)."""
    from .launch import grid_for

    if n_split <= 1:
        return
    t, h, d = out.shape
    splits = _pow2_at_least(n_split, 2)
    cb_d = min(d, _pow2_at_least(max(32, COMBINE_ELEMS // splits), 32))  # [splits, cb_d] fp32 per tile
    while d % cb_d:
        cb_d //= 2
    c_tiles = t * h * (d // cb_d)
    c_grid = grid_for(c_tiles, out.device)
    _combine_kernel[(c_grid,)](pacc, pm, pl, sk, out, h, n_split, d // cb_d, c_tiles, c_grid,
                               D=d, SPLITS=splits, BLOCK_D=cb_d, NATIVE_CAST=dot_bf16, **pdl_launch(pacc))


def ub_tiles(cfg: dict, d: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak (a tile table entry, head_dim d): the running
    state (max, sum, two accumulator halves), the logits and probabilities, and the block being
    used: in the tiled path a query chunk and one decoded contraction chunk (bytes, scales, two
    halves) or the decoded output block; whole rows hold q and both decoded halves."""
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    bd = d if cfg["BLOCK_D"] is None else min(cfg["BLOCK_D"], d)
    bdv = d if cfg["BLOCK_DV"] is None else min(cfg["BLOCK_DV"], d)
    tiles = {"m": (bh,), "l": (bh,), "acc_e": (bh, bdv // 2), "acc_o": (bh, bdv // 2), "s": (bh, bn),
             "p": (bh, bn), "rows": (bn,), "ok": (bn,)}
    if bd == d and bdv == d:
        tiles.update(q_e=(bh, d // 2), q_o=(bh, d // 2), bytes=(bn, d), k_e=(bn, d // 2), k_o=(bn, d // 2))
    else:
        w = max(bd, bdv)
        tiles.update(q=(bh, bd), bytes=(bn, w), scales=(bn, w // 16), k_e=(bn, w // 2), k_o=(bn, w // 2))
    return tiles


def _rows_view(pool: torch.Tensor) -> torch.Tensor:
    """A pool [rows, width] whose rows the kernels address by `stride(0)`: as given when each
    row is contiguous (a row-strided view of page records), else a contiguous copy."""
    return pool if pool.stride(-1) == 1 else pool.contiguous()


def _words(pool: torch.Tensor) -> torch.Tensor:
    """An int8 pool [rows, bytes] as 32-bit words [rows, bytes / 4] (the MQA kernel's loads): a
    view where the start and the row stride are 4-byte aligned, else an aligned copy."""
    if pool.data_ptr() % 4 or pool.stride(0) % 4:
        pool = pool.clone(memory_format=torch.contiguous_format)
    return pool.view(torch.int32)


def _index_rows(idx: torch.Tensor) -> torch.Tensor:
    """Pool-row indices as int32 / int64 (other integer types widened), contiguous."""
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.long()
    return idx.contiguous()


def _auto_splits(base_tiles: int, n_blocks: int, workers: int, min_blocks_per_split: int) -> int:
    """Splits per query (flash-decoding): enough tiles to give every worker one, each split at
    least `min_blocks_per_split` entry blocks; 1 when the queries alone fill the workers."""
    if base_tiles >= workers or n_blocks <= min_blocks_per_split:
        return 1
    return max(1, min(-(-workers // base_tiles), n_blocks // max(1, min_blocks_per_split)))


# The form of the decode entry (DSV41_SPARSE_DECODE, read once per process): "one_pass" (the
# "<key>_decode" entry: online softmax, logits recomputed per output block), "two_pass" (its
# "<key>_decode_two_pass" entry where the backend has one), "auto": two-pass from TWO_PASS_MIN_T
# tokens, or "split_d" (the default): as "auto", but one token takes the two-pass form with its
# logits split over channel chunks (LOGITS_SPLIT_D). H200 2026-12-03 (benchmarks/sweep_kernels.py,
# 64 heads x 512, window 128 + top-512, graph us, one-pass / two-pass): T=1 at 64K 14.4 / 18.3 (pass
# 1 has only 20 tiles then), T=8 at 4K 43.9 / 27.1, T=64 at 4K 160.9 / 95.3. T = 2..7 untimed: 2 is
# a guess. H100 2026-12-07 (session forty-seven, KV_X2 on), T=1 at 64K: one-pass 14.4, two-pass
# 15.0, split over D 11.9-12.0 (ops.py: 14.4 -> 11.8); the mini batch-1 step at 4K 1.944 -> 1.931 ms
# (three alternated rounds each). At T=64 the split form is slower (113 against 68 us): one token only.
SPARSE_DECODE_FORMS = ("auto", "one_pass", "two_pass", "split_d")
SPARSE_DECODE_DEFAULT = "split_d"
TWO_PASS_MIN_T = 2
# A register cap on the two-pass form's logits pass from that many tokens, (tokens, registers) per
# backend key: 210 -> 168 registers leaves room for 3 programs of 4 warps an SM instead of 2 (its
# tiles' loads come from L2, so more of them in flight pays); the values pass keeps its registers
# (capped too, it slowed: session twenty-seven). H200 2026-12-04 (`sweep_kernels.py --only
# sparse_two_pass`, 4K, graph us, no cap / 128 / 168 / 192): T=8 27.3 / 30.3 / 28.9 / 27.0,
# T=16 40.4 / 40.9 / 37.2 / 39.4, T=24 50.4 / 48.5 / 50.7 / 48.5, T=32 57.9 / 56.7 / 53.8 / 55.5,
# T=64 94.6 / 89.9 / 88.3 / 92.6.
TWO_PASS_LOGITS_CAP = {"cuda": (16, 168)}
_SPARSE_DECODE: list = []


def sparse_decode_form() -> str:
    """The DSV41_SPARSE_DECODE choice, read once per process (one clear error for a bad value)."""
    import os

    if not _SPARSE_DECODE:
        form = os.environ.get("DSV41_SPARSE_DECODE", SPARSE_DECODE_DEFAULT).strip() or SPARSE_DECODE_DEFAULT
        if form not in SPARSE_DECODE_FORMS:
            raise ValueError(f"DSV41_SPARSE_DECODE: unknown form {form!r} (one of {', '.join(SPARSE_DECODE_FORMS)})")
        _SPARSE_DECODE.append(form)
    return _SPARSE_DECODE[0]


def sparse_kv_x2() -> bool:
    """DSV41_SPARSE_KV_X2 ("1" / "0", default "1"), read once per process: whether the two-pass
    decode entry keeps its KV_X2 (the cache rows decoded straight to bf16 pairs; the entry's
    comment has the measurements); "0" gives the fp32 decode (`backends.platform.env_switch`)."""
    from ...backends.platform import env_switch

    return env_switch("DSV41_SPARSE_KV_X2", True)


def config_for(device: torch.device, t: int, h: int) -> dict:
    """The tile table entry for a launch: the decode entry (in the DSV41_SPARSE_DECODE form: by
    default two-pass, its logits split over channel chunks for one token, its logits pass under
    TWO_PASS_LOGITS_CAP's register cap from that many tokens, without its KV_X2 under
    DSV41_SPARSE_KV_X2=0) when the queries' whole-head tiles would leave most workers idle (small
    T: flash-decoding over head blocks and entry splits); otherwise the "<key>_prefill" entry
    where the backend has one, except while a graph is captured (the rows form's table is sized by
    the step's shapes, which a graph would freeze), else the main entry."""
    from .launch import num_workers

    key = _backend_key(device)
    decode = key + "_decode"
    if decode in CONFIGS:
        cfg = CONFIGS[key]
        if t * -(-h // cfg["BLOCK_H"]) <= num_workers(device, "cube") // DECODE_FILL_FRACTION:
            two = decode + "_two_pass"
            form = sparse_decode_form()
            # "split_d" (the default): as "auto", but one token takes the two-pass form with its
            # logits split over channel chunks (LOGITS_SPLIT_D)
            split_d = form == "split_d" and t == 1
            if two in CONFIGS and (form == "two_pass" or split_d or form in ("auto", "split_d") and t >= TWO_PASS_MIN_T):
                cap = TWO_PASS_LOGITS_CAP.get(key)
                extra = {"LOGITS_MAXNREG": cap[1]} if cap and t >= cap[0] else {}
                if split_d:
                    extra["LOGITS_SPLIT_D"] = True
                if CONFIGS[two].get("KV_X2") and not sparse_kv_x2():
                    extra["KV_X2"] = False
                return dict(CONFIGS[two], **extra) if extra else CONFIGS[two]
            return CONFIGS[decode]
    prefill = CONFIGS.get(key + "_prefill")
    if prefill is not None:
        from ...backends.platform import platform_for

        if not platform_for(device).is_capturing():
            return prefill
    return CONFIGS[key]


def sparse_attention(q: torch.Tensor, swa_kv: torch.Tensor, swa_scale: torch.Tensor, win_idx: torch.Tensor,
                     glob_kv: torch.Tensor | None, glob_scale: torch.Tensor | None, glob_idx: torch.Tensor | None,
                     sink: torch.Tensor, softmax_scale: float,
                     rows_bound: tuple[int, int] | None = None) -> torch.Tensor:
    """`ops.sparse_attention` on the Triton kernel: [T, H, D] bf16 out. Requires triton."""
    cfg = config_for(q.device, q.shape[0], q.shape[1])
    if cfg.get("ROWS"):
        cfg = dict(cfg, rows_bound=rows_bound)
    return sparse_attention_launch(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink,
                                   softmax_scale, **cfg)


OPS = {"sparse_attention": sparse_attention}
