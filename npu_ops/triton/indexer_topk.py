"""CSA2 indexer over MXFP4 keys read in place from the paged key pool: scores, the top-k
selection, the Reindex selection and the candidate pool in Triton (no host sync, no torch sort).

score(t, j) = sum_h relu(q[t, h, :] . k[row(t, j), :]) * weights[t, h], where entry j of token
t's sequence sits at pool row row(t, j) = block_table[t, j // E] * E + j % E.

Scores (`_indexer_scores_kernel`): one tile = BLOCK_T queries (x all heads, padded to HP) by
NSUB blocks of BLOCK_N entries, tiles walked by a 1-D persistent loop; at decode shapes (few
queries) the N entries alone give hundreds of tiles, so a long context is spread over every
worker. Each tile resolves its entries' pool rows through the queries' block tables: when
every query of the tile that sees an entry reads the same row (tokens of one sequence, the
prefill case) the keys are decoded once and scored by all of them in one MMA; otherwise (tokens
of different sequences side by side) each query is scored against its own rows. Key bytes
(int8 loads masked to 0..255: Ascend takes no uint8 pointers) are decoded with integer/bit ops:
E2M1 nibbles (element 0 in the low nibble) become fp32 bit patterns, times the E8M0 scale (one
byte per 32 channels, 2^(byte - 127), built from its bits). The low nibbles hold the even
channels and the high nibbles the odd ones, so the queries are loaded as even / odd channel
halves and the dot is tl.dot(q_even, k_lo) + tl.dot(q_odd, k_hi) over [BLOCK_T * HP, D/2] x
[D/2, BLOCK_N] with fp32 accumulation; relu, the head weights and the sum over heads follow in
fp32. Entries >= n_visible[t] (dense) or candidates < 0 (Reindex) are stored as -inf, and entry
blocks wholly past the visible range of a query block are not computed at all. At prefill
sizes a tile is a group of QSUB such query tiles (`scores_qsub`): a key block the whole group
reads from the same rows is loaded and decoded once and scored against each sub-tile in turn
(the same dots, so the same bits as QSUB 1).

Operand precision: compiled (CUDA / Ascend), the dot operands are bf16. That is exact for the
op's contract: keys are E2M1 * 2^k, and the queries are MXFP4 quantise-dequantised (E2M1 * 2^k
as well), both representable in bf16, so every product is exact and only the fp32 summation
order differs from the reference (which sums in fp64). Arbitrary fp32 queries would be rounded
to bf16 (~3 significant digits) - outside the contract. Under TRITON_INTERPRET=1 bf16 math is
broken, so the interpreter runs the same dots in fp32 (input_precision="ieee").

Decode shapes (`_indexer_rows_kernel`, dense, up to ROWS_MAX_T queries): a tile is one query by
NSUB key blocks, each query reading its own rows, and the next block's pool rows and key bytes
are loaded while the current block is scored. By default on CUDA and the interpreters
(`ROWS_WORDS`, where `rows_words_fit`) the keys are read as int32 words and decoded with the
routed experts' bf16x2 conversion (`_decode_key_words`), one dot over all channels in the words'
channel order, the keys on the dot's M side (`ROWS_KEYS_M`: 1.5x faster than the byte decode at 64
queries on an H100); elsewhere (Ascend) each block's bytes are decoded as in the tiles
(`_byte_scores`).

Selection (`_topk_select_kernel`, dense path): a program per query row finds the K-th largest
score by radix select over order-preserving int32 keys (-0.0 folded into +0.0; one pass per
RADIX_BITS-bit digit, `tl.histogram`), then one ordered pass keeps the scores above it and the
lowest-id entries equal to it, placed by a running prefix sum: the reference's
`_stable_topk_sorted` (ties to the lower id, ascending ids, -1 padding) without a sort and
without a host sync. The chunk-maxima bound (`_topk_select_kernel`) is used only when there are
at least SELECT_MAXIMA_MIN_PER_K * k maxima; otherwise the direct select reads the row once.

Split select (`_split_select_kernel`, dense rows with chunk maxima, up to SPLIT_MAX_T rows (a
decode step of one token), not Ascend): a row's select runs on up to SPLIT_PARTS programs. Each computes the exact K-th largest
chunk maximum (the bound), reads its slice of the row once and compacts its scores >= the bound
into its own region; the program that bumps the row's counter last (acq_rel, a self-resetting
counter) selects the K among the regions' survivors on one tile: the same ids in the same
order as the one-program kernel, deterministic whichever program finishes last. Every part
repeats the bound's radix passes over all the chunk maxima, so fewer maxima shorten every part
(SPLIT_MAXIMA_PER_K; 2 per k: 1024 of 64 entries at 64K / top-512, about 700 survivors, still one
1024 final tile). On the H200 at T=1 / 64K the whole op took 41.8 us with the one-program
select, 39.3 with 16 parts over 8 maxima per k, 36.9 with 32 parts over 8 (the default), 32.3
with 32 parts over 2 (benchmarks/RESULTS.md). The default stays at 8 per k: the chunk follows the
block table's width N (n_visible is on the device), and a row with fewer than K chunks visible
has no bound, so part 0 alone runs the whole-row select. At 8 per k that is a row below N / 8
entries, at 2 per k below N / 2: in a decode graph whose table is sized for the longest
sequence, most shorter rows would take the slow path (not timed on the device). The parts' bound
is then the K-th largest of the maxima of up to SPLIT_BOUND_MERGE neighbouring chunks, or, by
default (SPLIT_BOUND_HIST_SHIFT), read off a histogram of the maxima: the rows scores kernel
counts each finite maximum into one of 8192 bins (the order key's top 13 bits: sign, exponent,
4 mantissa bits; one atomic per maximum, `_count_maxima`), and each part takes the lower edge of
the highest bin with K maxima at or above it (one 32 KB load and a prefix sum, `_hist_bound`,
instead of radix passes over the maxima); the part that finishes the row zeroes its histogram,
so the buffer (`bound_histogram`, one per device and stream) stays zero between calls.

Reindex selection (same kernel, MAP): the row's columns are the candidate blocks' entries (-1
blocks and entries past n_visible scored -inf); the chosen columns are written as their entry
ids with those dropped, then each id is
stored at its rank among the chosen (a [RB, k] comparison count, no sort primitive): the
reference's selection sorted by entry id, whatever the candidates' order. Chosen ids that
already ascend (candidates in the pool's entry order, as the model's Reindex layers get them)
are copied without the ranks (H200, T=1, 4096 candidates: 55.9 -> 15.9 us). At a decode token
(where the split select runs) the Reindex selection is split too (`SPLIT_CANDIDATES`): the
gather scores kernel writes the candidate columns' chunk maxima, each part keeps its valid
columns >= the bound as entry ids, and the final select's ids are staged and put in entry-id
order as above (H100, T=1, 8192 candidates: 35.6 -> 20.5 us for the whole op).

Candidate pool (`_pool_kernel`): the scores kernel writes each row's maxima over the pool's
blocks (MAXG = pool block size, a power of two); the pool kernel raises the newest reachable
block to +inf, radix-selects the best `pool_blocks` reachable blocks (ties to the older one)
and writes their ids in order (int32, -1 padded). The pool stays in blocks: the Reindex layers'
scores and selection kernels take block ids (CB entries a block) and expand them to entries in
registers (an entry past the query's n_visible is no candidate), so the pool costs 4 bytes a
block instead of 8 bytes an entry (8 KiB instead of 128 KiB a query at the mini preset's 2048
blocks of 8: the largest buffer that lived through a prefill step). With model-parallel score
reduction (or a block size that is no power of two) the pool falls back to torch
(`_candidate_pool`). A row of up to POOL_BLOCK blocks is selected on registers (`_pool_row`, on the
smallest of three tiles that holds its reachable blocks).
Where the split select runs, the pool is made by programs of the same launch beside its parts
(`POOL_BESIDE_SELECT`: the pool's one program no longer runs after the select on the layer's
critical path; H100, T=1, 32K entries, the mini preset's pool of 2048 blocks of 8: the whole
op 38.2 -> 24.7 us).

Long prefills are scored in chunks of queries (SCORE_CHUNK_ELEMS scores per chunk), so the
[T, N] score matrix, which grows quadratically, never exists whole. `tl.histogram` on Ascend is
unverified on hardware (the triton-ascend interpreter accepts it). The Reindex selection and
the pool kernel are checked under both interpreters and on CUDA (H100 GPU tests, 2026-12-06).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...backends.reference import attention as ref_attention
from ...backends.paging import table_rows
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_round, pow2
from .fp4_common import bf16x2_halves, e2m1_place, word_order
from ...backends.reference.attention import candidate_pool

MX_GROUP = 32
RADIX_BITS_DEFAULT = 4  # digit width of the radix select (8 passes; the 2 * 16 bins give one per lane)
_SCALE_2M127 = tl.constexpr(5.877471754111438e-39)  # 2^-127 (E8M0 byte 0), an fp32 subnormal


def indexer_topk_ref(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, topk,
                     candidates=None, pool_blocks=0, pool_block_size=1, candidate_block_size=1):
    """The torch reference (the oracle)."""
    return ref_attention.indexer_topk(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible,
                                      topk, candidates, pool_blocks, pool_block_size,
                                      candidate_block_size=candidate_block_size)


def indexer_scores_ref(q, weights, key_codes, key_scale, block_table, entries_per_block, candidates=None):
    """Reference scores [T, N] over each token's N = nb * E addressable entries (or [T, P] over
    the candidates' entries, padding scored as entry 0), from the reference's own pieces."""
    from ...backends.reference import quant

    t = q.shape[0]
    n = block_table.shape[1] * entries_per_block
    ent = candidates if candidates is not None else torch.arange(n, device=q.device).unsqueeze(0).expand(t, n)
    rows = table_rows(block_table, entries_per_block, ent.clamp_min(0))
    keys = quant.mxfp4_dequant(key_codes[rows], key_scale[rows])  # [T, P, Di]
    return ref_attention._finish_scores(ref_attention._partial_scores(q, weights, keys))


@triton.jit
def _e2m1_value(c):
    """E2M1 codes (int32 0..15, sign in bit 3) -> fp32 values, from bit patterns."""
    m = c & 7
    # m = 1 -> 0.5 (0x3F000000), m = 0 -> 0; m >= 2 -> 2^(m//2 - 1) * (1 + (m & 1) / 2)
    bits = tl.where(m < 2, m * 0x3F000000, (m << 22) + 0x3F000000)
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_bytes(code_ptr, scale_ptr, rows, kvalid, DH: tl.constexpr, DHP: tl.constexpr, code_stride, scale_stride):
    """The stored MXFP4 keys at pool rows `rows` [BLOCK_N] (int64; kvalid masks): code bytes
    [BLOCK_N, DHP/16, 16] (one contiguous load; 16 bytes = one 32-channel scale group) and
    E8M0 scale bytes [BLOCK_N, DHP/16], as loaded (int8: a byte a value while in flight;
    masked: codes 0, scales 127)."""
    g = tl.arange(0, DHP // 16)
    e = tl.arange(0, 16)
    byte = (g * 16)[None, :, None] + e[None, None, :]
    km = kvalid[:, None, None] & (byte < DH)
    b = tl.load(code_ptr + rows[:, None, None] * code_stride + byte, mask=km, other=0)
    e8 = tl.load(scale_ptr + rows[:, None] * scale_stride + g[None, :], mask=kvalid[:, None] & (g < DH // 16)[None, :],
                 other=127)
    return b, e8


@triton.jit
def _decode_keys(b, e8, DHP: tl.constexpr, BLOCK_N: tl.constexpr, LOWP: tl.constexpr):
    """Keys given as their stored bytes (`_key_bytes`) -> even / odd channel halves [BLOCK_N,
    DHP]: E2M1 nibbles and E8M0 scales decoded with bit ops; bf16 when compiled (exact: E2M1 *
    2^k values are bf16 numbers), fp32 under the interpreters."""
    b = b.to(tl.int32) & 0xFF  # int8 loads (Ascend takes no uint8 pointers) back to 0..255
    e8 = e8.to(tl.int32) & 0xFF
    scale = tl.where(e8 > 0, (e8 << 23).to(tl.float32, bitcast=True), _SCALE_2M127)[:, :, None]
    k_lo = tl.reshape(_e2m1_value(b & 15) * scale, [BLOCK_N, DHP])  # even channels
    k_hi = tl.reshape(_e2m1_value(b >> 4) * scale, [BLOCK_N, DHP])  # odd channels
    if LOWP:
        k_lo = k_lo.to(tl.bfloat16)
        k_hi = k_hi.to(tl.bfloat16)
    return k_lo, k_hi


@triton.jit
def _dot_scores(q_even, q_odd, wh, k_lo, k_hi, NQ: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr,
                LOWP: tl.constexpr):
    """Scores [NQ, BLOCK_N] of NQ queries (rows [NQ * HP, DHP] of even / odd channels, head
    weights wh) against decoded keys (`_decode_keys`): two MMAs (even / odd channels), relu,
    weights, sum over heads."""
    if LOWP:
        acc = tl.dot(q_even, tl.trans(k_lo))
        acc = tl.dot(q_odd, tl.trans(k_hi), acc)
    else:
        acc = tl.dot(q_even, tl.trans(k_lo), input_precision="ieee")
        acc = tl.dot(q_odd, tl.trans(k_hi), acc, input_precision="ieee")
    rel = tl.maximum(acc, 0.0) * wh[:, None]
    return tl.sum(tl.reshape(rel, (NQ, HP, BLOCK_N)), axis=1)


@triton.jit
def _byte_scores(q_even, q_odd, wh, b, e8, DHP: tl.constexpr, NQ: tl.constexpr, HP: tl.constexpr,
                 BLOCK_N: tl.constexpr, LOWP: tl.constexpr):
    """Scores [NQ, BLOCK_N] of NQ queries against keys given as their stored bytes
    (`_key_bytes`): `_decode_keys` then `_dot_scores`."""
    k_lo, k_hi = _decode_keys(b, e8, DHP, BLOCK_N, LOWP)
    return _dot_scores(q_even, q_odd, wh, k_lo, k_hi, NQ, HP, BLOCK_N, LOWP)


@triton.jit
def _key_scores(q_even, q_odd, wh, code_ptr, scale_ptr, rows, kvalid,
                DH: tl.constexpr, DHP: tl.constexpr, NQ: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr,
                LOWP: tl.constexpr, code_stride, scale_stride):
    """Scores [NQ, BLOCK_N] of NQ queries against the MXFP4 keys at pool rows `rows` [BLOCK_N]
    (int64; kvalid masks): `_key_bytes` then `_byte_scores`."""
    b, e8 = _key_bytes(code_ptr, scale_ptr, rows, kvalid, DH, DHP, code_stride, scale_stride)
    return _byte_scores(q_even, q_odd, wh, b, e8, DHP, NQ, HP, BLOCK_N, LOWP)


@triton.jit
def _load_queries(q_ptr, w_ptr, t0, T, H: tl.constexpr, HP: tl.constexpr, DH: tl.constexpr,
                  DHP: tl.constexpr, NQ: tl.constexpr, LOWP: tl.constexpr):
    """Queries t0 .. t0 + NQ - 1 (all heads, padded to HP): even / odd channel halves
    [NQ * HP, DHP] (one contiguous load, split into pairs) and fp32 head weights [NQ * HP]
    (0 for padding), rounded to bf16: the official `weights_proj` returns bf16 (the reference's
    official mode; the folded power-of-two weight scale does not change the rounding)."""
    r = tl.arange(0, NQ * HP)
    r_h = r % HP
    trow = t0 + r // HP
    rmask = (trow < T) & (r_h < H)
    qrow = trow.to(tl.int64) * H + r_h
    c = tl.arange(0, 2 * DHP)
    x = tl.load(q_ptr + qrow[:, None] * (2 * DH) + c[None, :], mask=rmask[:, None] & (c < 2 * DH)[None, :],
                other=0.0)
    # compiled: bf16 at once (exact for MXFP4 queries; the MMA's A operand is held by every warp,
    # so its width is registers); interpreters: fp32
    x = x.to(tl.bfloat16) if LOWP else x.to(tl.float32)
    q_even, q_odd = tl.split(tl.reshape(x, [NQ * HP, DHP, 2]))
    wh = bf16_round(tl.load(w_ptr + qrow, mask=rmask, other=0.0).to(tl.float32))
    return q_even, q_odd, wh


@triton.jit
def _entry_blocks(table_ptr, ts, vis, cols, NB, E):
    """The pool blocks [len(ts), BLOCK_N] (int64) of entries cols for queries ts where visible,
    their largest per entry (-1: nobody sees it), whether someone sees it, and 1 if two queries
    that see one entry read it from different blocks (tokens of different sequences)."""
    blk = tl.load(table_ptr + ts.to(tl.int64)[:, None] * NB + (cols // E)[None, :], mask=vis, other=0).to(tl.int64)
    bmax = tl.max(tl.where(vis, blk, -1), axis=0)
    bmin = tl.min(tl.where(vis, blk, 1 << 62), axis=0)
    kvalid = bmax >= 0
    return blk, bmax, kvalid, tl.max((kvalid & (bmax != bmin)).to(tl.int32), axis=0)


@triton.jit
def _dense_block(q_ptr, w_ptr, code_ptr, scale_ptr, table_ptr, q_even, q_odd, wh, nv, t0, T, NB, E, n0, cols,
                 code_stride, scale_stride, H: tl.constexpr, HP: tl.constexpr, HP1: tl.constexpr,
                 DH: tl.constexpr, DHP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                 LOWP: tl.constexpr):
    """Scores [BLOCK_T, BLOCK_N] of queries t0 .. (loaded: q_even / q_odd / wh, n_visible nv)
    at entries cols (dense: entry c of query t sits at pool row table[t, c // E] * E + c % E),
    -inf where not visible; entries past every query's n_visible compute nothing."""
    tq = tl.arange(0, BLOCK_T)
    ts = t0 + tq
    tmask = ts < T
    if n0 < tl.max(nv, axis=0):
        vis = tmask[:, None] & (cols[None, :] < nv[:, None])  # [BLOCK_T, BLOCK_N]
        blk, bmax, kvalid, differ = _entry_blocks(table_ptr, ts, vis, cols, NB, E)
        if differ == 0:  # every query that sees these entries reads the same rows: one MMA
            rows = tl.maximum(bmax, 0) * E + cols % E
            s = _key_scores(q_even, q_odd, wh, code_ptr, scale_ptr, rows, kvalid,
                            DH, DHP, BLOCK_T, HP, BLOCK_N, LOWP, code_stride, scale_stride)
        else:  # queries of different sequences: each against its own rows
            s = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for i in range(BLOCK_T):
                vis_i = tl.max(tl.where(tq[:, None] == i, vis.to(tl.int32), 0), axis=0) > 0
                blk_i = tl.max(tl.where(tq[:, None] == i, blk, 0), axis=0)
                # one query's heads padded to HP1 >= 16 rows (tl.dot's least M)
                qe_i, qo_i, wh_i = _load_queries(q_ptr, w_ptr, t0 + i, T, H, HP1, DH, DHP, 1, LOWP)
                s_i = _key_scores(qe_i, qo_i, wh_i, code_ptr, scale_ptr, blk_i * E + cols % E, vis_i,
                                  DH, DHP, 1, HP1, BLOCK_N, LOWP, code_stride, scale_stride)
                s = tl.where(tq[:, None] == i, s_i, s)
        s = tl.where(vis, s, float("-inf"))
    else:
        s = tl.full([BLOCK_T, BLOCK_N], float("-inf"), dtype=tl.float32)
    return s


@triton.jit
def _visible(nvis_ptr, ts, tmask, NC):
    """n_visible of queries ts (0 where masked), at most NC."""
    return tl.minimum(tl.load(nvis_ptr + ts, mask=tmask, other=0).to(tl.int32), NC)


@triton.jit
def _store_scores(out_ptr, max_ptr, s, ts, tmask, cols, cmask, n0, NC, G, BLOCK_T: tl.constexpr,
                  BLOCK_N: tl.constexpr, MAXG: tl.constexpr):
    """Scores [BLOCK_T, BLOCK_N] of queries ts at entries cols, and (MAXG > 0) each query's
    maximum over every MAXG entries (they bound the top-k select)."""
    tl.store(out_ptr + ts.to(tl.int64)[:, None] * NC + cols[None, :], s, mask=tmask[:, None] & cmask[None, :])
    if MAXG > 0:
        if MAXG == 1:
            mx = s
        else:
            mx = tl.max(tl.reshape(s, (BLOCK_T, BLOCK_N // MAXG, MAXG)), axis=2)
        gc = n0 // MAXG + tl.arange(0, BLOCK_N // MAXG)
        tl.store(max_ptr + ts.to(tl.int64)[:, None] * G + gc[None, :], mx, mask=tmask[:, None] & (gc < G)[None, :])


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, code_ptr, scale_ptr, table_ptr, nvis_ptr, cand_ptr, out_ptr, max_ptr,
                           T, NC, NB, E, G, n_nc, n_tiles, num_programs, code_stride, scale_stride,
                           H: tl.constexpr, HP: tl.constexpr, HP1: tl.constexpr, DH: tl.constexpr,
                           DHP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
                           GATHER: tl.constexpr, LOWP: tl.constexpr, MAXG: tl.constexpr, QSUB: tl.constexpr = 1,
                           CB: tl.constexpr = 1, PDL: tl.constexpr = 0):
    """Tiles (query group, NSUB key blocks), walked by a 1-D persistent loop. A group is QSUB
    sub-tiles of BLOCK_T queries (dense only): where every query of the group that sees a key
    block reads it from the same pool rows (a prefill chunk of one sequence), the block is
    loaded and decoded once and scored against each sub-tile in turn; otherwise each sub-tile
    goes its own way (`_dense_block`). GATHER (Reindex candidates): BLOCK_T == QSUB == 1; the
    candidates are ids of blocks of CB entries (cand_ptr [T, NC / CB]; CB 1: entry ids), and a
    column's entry is block * CB + column % CB, a candidate unless its block is -1 or the entry
    is past the query's n_visible."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    cn = tl.arange(0, BLOCK_N)
    tq = tl.arange(0, BLOCK_T)
    QG: tl.constexpr = QSUB * BLOCK_T
    for tile in range(pid, n_tiles, num_programs):
        tg = tile // n_nc + tl.zeros([], dtype=tl.int32)  # a tensor also under the interpreter
        nc = tile - tg * n_nc
        g0 = tg * QG
        ts = g0 + tq
        tmask = ts < T
        if QSUB == 1:  # the tile's queries, loaded once for its NSUB key blocks
            q_even, q_odd, wh = _load_queries(q_ptr, w_ptr, g0, T, H, HP, DH, DHP, BLOCK_T, LOWP)
            if GATHER:  # (the tile's one query's visible entries)
                nv = tl.load(nvis_ptr + tg).to(tl.int32)
            else:
                nv = _visible(nvis_ptr, ts, tmask, NC)
        else:  # the group's visibility, for the shared-rows test of each key block
            tsg = g0 + tl.arange(0, QG)
            gmask = tsg < T
            nvg = _visible(nvis_ptr, tsg, gmask, NC)
            glimit = tl.max(nvg, axis=0)
        for sub in range(NSUB):
            n0 = (nc * NSUB + sub) * BLOCK_N
            cols = n0 + cn
            cmask = cols < NC
            if GATHER:  # this tile's query is tg; candidates are blocks of CB entries
                if n0 < NC:
                    cblk = tl.load(cand_ptr + tg.to(tl.int64) * (NC // CB) + cols // CB, mask=cmask, other=-1)
                    ent = cblk * CB + cols % CB
                    kvalid = cmask & (cblk >= 0) & (ent < nv)
                    ent = tl.maximum(ent, 0)
                    blk = tl.load(table_ptr + tg.to(tl.int64) * NB + ent // E, mask=kvalid, other=0)
                    rows = blk.to(tl.int64) * E + ent % E
                    s = _key_scores(q_even, q_odd, wh, code_ptr, scale_ptr, rows, kvalid,
                                    DH, DHP, BLOCK_T, HP, BLOCK_N, LOWP, code_stride, scale_stride)
                    s = tl.where(kvalid[None, :], s, float("-inf"))
                else:
                    s = tl.full([BLOCK_T, BLOCK_N], float("-inf"), dtype=tl.float32)
                _store_scores(out_ptr, max_ptr, s, ts, tmask, cols, cmask, n0, NC, G, BLOCK_T, BLOCK_N, MAXG)
            elif QSUB == 1:
                s = _dense_block(q_ptr, w_ptr, code_ptr, scale_ptr, table_ptr, q_even, q_odd, wh, nv, g0, T, NB, E,
                                 n0, cols, code_stride, scale_stride, H, HP, HP1, DH, DHP, BLOCK_T, BLOCK_N, LOWP)
                _store_scores(out_ptr, max_ptr, s, ts, tmask, cols, cmask, n0, NC, G, BLOCK_T, BLOCK_N, MAXG)
            else:
                visg = gmask[:, None] & (cols[None, :] < nvg[:, None])  # [QG, BLOCK_N]
                _, bmax, kvalid, differ = _entry_blocks(table_ptr, tsg, visg, cols, NB, E)
                # where the group's queries share the block's rows, one load and decode of it for
                # them all (elsewhere the load is masked off and each sub-tile goes its own way)
                shared = (n0 < glimit) & (differ == 0)
                b, e8 = _key_bytes(code_ptr, scale_ptr, tl.maximum(bmax, 0) * E + cols % E, kvalid & shared,
                                   DH, DHP, code_stride, scale_stride)
                k_lo, k_hi = _decode_keys(b, e8, DHP, BLOCK_N, LOWP)
                for qs in range(QSUB):
                    t0 = g0 + qs * BLOCK_T
                    ts_q = t0 + tq
                    tm_q = ts_q < T
                    nv_q = _visible(nvis_ptr, ts_q, tm_q, NC)
                    if n0 < tl.max(nv_q, axis=0):
                        qe, qo, wq = _load_queries(q_ptr, w_ptr, t0, T, H, HP, DH, DHP, BLOCK_T, LOWP)
                        if shared:
                            s = _dot_scores(qe, qo, wq, k_lo, k_hi, BLOCK_T, HP, BLOCK_N, LOWP)
                            s = tl.where(tm_q[:, None] & (cols[None, :] < nv_q[:, None]), s, float("-inf"))
                        else:
                            s = _dense_block(q_ptr, w_ptr, code_ptr, scale_ptr, table_ptr, qe, qo, wq, nv_q, t0, T,
                                             NB, E, n0, cols, code_stride, scale_stride, H, HP, HP1, DH, DHP,
                                             BLOCK_T, BLOCK_N, LOWP)
                    else:
                        s = tl.full([BLOCK_T, BLOCK_N], float("-inf"), dtype=tl.float32)
                    _store_scores(out_ptr, max_ptr, s, ts_q, tm_q, cols, cmask, n0, NC, G, BLOCK_T, BLOCK_N, MAXG)


@triton.jit
def _row_keys(table_ptr, code_ptr, scale_ptr, tq, cols, nv, NB, E, DH: tl.constexpr, DHP: tl.constexpr,
              code_stride, scale_stride):
    """Query tq's entries `cols` [BLOCK_N]: visibility (cols < nv) and the stored key bytes of
    their pool rows (block table, then the rows: `_key_bytes`)."""
    vis = cols < nv
    blk = tl.load(table_ptr + tq.to(tl.int64) * NB + cols // E, mask=vis, other=0).to(tl.int64)
    b, e8 = _key_bytes(code_ptr, scale_ptr, blk * E + cols % E, vis, DH, DHP, code_stride, scale_stride)
    return b, e8, vis


@triton.jit
def _row_key_words(table_ptr, code_ptr, scale_ptr, tq, cols, nv, NB, E, W: tl.constexpr, G: tl.constexpr,
                   code_stride, scale_stride):
    """`_row_keys` for the word decode: query tq's entries `cols` [BLOCK_N] -> their key codes as
    int32 words [BLOCK_N, W] (8 nibbles each: 4 bytes a register while in flight instead of one),
    their E8M0 scale bytes [BLOCK_N, G] (int8 as loaded) and visibility. The launcher checks that
    the code rows are 16-byte aligned (`rows_words_fit`)."""
    vis = cols < nv
    blk = tl.load(table_ptr + tq.to(tl.int64) * NB + cols // E, mask=vis, other=0).to(tl.int64)
    rows = blk * E + cols % E
    words = tl.load(code_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (code_stride // 4)
                    + tl.arange(0, W)[None, :], mask=vis[:, None], other=0)
    e8 = tl.load(scale_ptr + rows[:, None] * scale_stride + tl.arange(0, G)[None, :], mask=vis[:, None], other=127)
    return words, e8, vis


@triton.jit
def _scale2_wide(placed, s, ASM: tl.constexpr):
    """`e2m1_place`'d bf16x2 bits (value * 2^-126) times 2^(s - 1) for any E8M0 byte s (int32
    0..255): as two exact factors 2^(min(s, 128) - 1) and 2^(max(s, 128) - 128), each a finite
    bf16 (the experts' single factor stops at byte 128; key scales go past it). On CUDA two
    `mul.rn.bf16x2` (sm_90 bf16 arithmetic keeps subnormals: byte 0 gives 2^-128); elsewhere the
    same products in fp32."""
    lo = tl.minimum(s, 128)
    hi = tl.maximum(s, 128)
    if ASM:
        e1 = (lo + 126) << 7
        e2 = (hi - 1) << 7
        return tl.inline_asm_elementwise("{ .reg .b32 t; mul.rn.bf16x2 t, $1, $2; mul.rn.bf16x2 $0, t, $3; }",
                                         "=r,r,r,r", [placed, e1 | (e1 << 16), e2 | (e2 << 16)], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        f = pow2(lo - 1)
        g = pow2(hi - 128)
        a = ((placed << 16).to(tl.float32, bitcast=True) * f * g).to(tl.int32, bitcast=True)
        b = ((placed & -65536).to(tl.float32, bitcast=True) * f * g).to(tl.int32, bitcast=True)
        return ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _decode_key_words(words, e8, W: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                      LOWP: tl.constexpr):
    """Keys as int32 words [BLOCK_N, W] and scale bytes [BLOCK_N, G] -> [BLOCK_N, 8 W] exact bf16
    (LOWP) or fp32 values, channels in `word_order` inside each 8 (the experts'
    conversion: 3 integer ops and two bf16x2 multiplies per two values, against ~10 ops a value
    for `_decode_keys`' fp32 bit patterns). Word j holds channels 8j .. 8j + 7, scale group j // (W / G)."""
    s = e8.to(tl.int32) & 0xFF
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, G, W // G)), (BLOCK_N, W))
    high = words >> 8  # elements 2, 3, 6, 7 at the places of 0, 1, 4, 5
    r0 = _scale2_wide(e2m1_place(words, 0), s, ASM)
    r1 = _scale2_wide(e2m1_place(words, 4), s, ASM)
    r2 = _scale2_wide(e2m1_place(high, 0), s, ASM)
    r3 = _scale2_wide(e2m1_place(high, 4), s, ASM)
    return tl.reshape(bf16x2_halves(tl.join(tl.join(r0, r1), tl.join(r2, r3)), LOWP), (BLOCK_N, 8 * W))


@triton.jit
def _load_query_words(q_ptr, w_ptr, tq, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, LOWP: tl.constexpr):
    """Query tq (heads padded to HP) as [HP, D] with its channels in the word decode's order
    (`word_order`, so the dot pairs each channel with its key channel), bf16 (LOWP) or fp32, and
    its head weights rounded to bf16 (as `_load_queries`)."""
    r = tl.arange(0, HP)
    rmask = r < H
    qrow = tq.to(tl.int64) * H + r
    c = word_order(tl.arange(0, D))
    x = tl.load(q_ptr + qrow[:, None] * D + c[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.bfloat16) if LOWP else x.to(tl.float32)
    wh = bf16_round(tl.load(w_ptr + qrow, mask=rmask, other=0.0).to(tl.float32))
    return x, wh


@triton.jit
def _word_scores(q, wh, words, e8, W: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_M: tl.constexpr,
                 ASM: tl.constexpr, LOWP: tl.constexpr):
    """One query's scores [1, BLOCK_N] against keys given as words: one dot over all channels
    (K = D), relu, head weights, sum over heads. KEYS_M: the decoded keys as the dot's left
    operand (M = entries: on Hopper wgmma's register operand, so M = 128 keys instead of 32 heads
    on mma.sync; the tile still passes through shared memory into that layout, 8 LDSM a 128-key
    block at sm_90a) and the heads along N (the head sum stays within a thread quad); otherwise q
    on the left."""
    k = _decode_key_words(words, e8, W, G, BLOCK_N, ASM, LOWP)
    if KEYS_M:
        if LOWP:
            acc = tl.dot(k, tl.trans(q))
        else:
            acc = tl.dot(k, tl.trans(q), input_precision="ieee")
        return tl.sum(tl.maximum(acc, 0.0) * wh[None, :], axis=1)[None, :]
    else:
        if LOWP:
            acc = tl.dot(q, tl.trans(k))
        else:
            acc = tl.dot(q, tl.trans(k), input_precision="ieee")
        return tl.sum(tl.maximum(acc, 0.0) * wh[:, None], axis=0)[None, :]


@triton.jit
def _indexer_rows_kernel(q_ptr, w_ptr, code_ptr, scale_ptr, table_ptr, nvis_ptr, out_ptr, max_ptr, hist_ptr,
                         T, NC, NB, E, G, n_nc, n_tiles, num_programs, code_stride, scale_stride,
                         H: tl.constexpr, HP: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr,
                         BLOCK_N: tl.constexpr, NSUB: tl.constexpr, LOWP: tl.constexpr, MAXG: tl.constexpr,
                         WORDS: tl.constexpr = 0, KEYS_M: tl.constexpr = 0, ASM: tl.constexpr = 0,
                         HIST_SHIFT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Dense scores at decode shapes: a tile is one query (its heads padded to HP >= 16 rows) by
    NSUB blocks of BLOCK_N entries, tiles walked by a 1-D persistent loop. Each query reads its
    own rows (no test whether the tile's queries share them), and the next block's pool rows
    and key bytes are loaded while the current block is scored, so a program keeps a load in
    flight instead of waiting on one chain of dependent loads per block. Same arithmetic as
    `_indexer_scores_kernel` (`_byte_scores`); tiles wholly past n_visible compute nothing.
    WORDS: the keys loaded as int32 words and converted by `_decode_key_words` (one dot over
    all channels; KEYS_M picks its orientation). HIST_SHIFT > 0: each finite chunk maximum is
    also counted into its query's bound histogram (hist_ptr [T, 2^(32 - HIST_SHIFT)], zero
    before; `_count_maxima`), which the split select reads for its bound and zeroes."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    cn = tl.arange(0, BLOCK_N)
    W: tl.constexpr = DH // 4
    GK: tl.constexpr = DH // 16  # scale groups of 32 channels
    for tile in range(pid, n_tiles, num_programs):
        tq = tile // n_nc + tl.zeros([], dtype=tl.int32)  # a tensor also under the interpreter
        n0 = (tile - tq * n_nc) * (NSUB * BLOCK_N)
        nv = tl.minimum(tl.load(nvis_ptr + tq).to(tl.int32), NC)
        orow = out_ptr + tq.to(tl.int64) * NC
        mrow = max_ptr + tq.to(tl.int64) * G
        hrow = hist_ptr
        if HIST_SHIFT > 0:
            hrow = hist_ptr + (tq.to(tl.int64) << (32 - HIST_SHIFT))
        if n0 < nv:
            if WORDS:
                qw, wh = _load_query_words(q_ptr, w_ptr, tq, H, HP, 2 * DH, LOWP)
                b, e8, vis = _row_key_words(table_ptr, code_ptr, scale_ptr, tq, n0 + cn, nv, NB, E, W, GK,
                                            code_stride, scale_stride)
            else:
                q_even, q_odd, wh = _load_queries(q_ptr, w_ptr, tq, T, H, HP, DH, DHP, 1, LOWP)
                b, e8, vis = _row_keys(table_ptr, code_ptr, scale_ptr, tq, n0 + cn, nv, NB, E, DH, DHP,
                                       code_stride, scale_stride)
            for sub in tl.static_range(NSUB):
                if sub + 1 < NSUB:  # in flight while this block is scored
                    if WORDS:
                        b_n, e8_n, vis_n = _row_key_words(table_ptr, code_ptr, scale_ptr, tq,
                                                          n0 + (sub + 1) * BLOCK_N + cn, nv, NB, E, W, GK,
                                                          code_stride, scale_stride)
                    else:
                        b_n, e8_n, vis_n = _row_keys(table_ptr, code_ptr, scale_ptr, tq, n0 + (sub + 1) * BLOCK_N + cn,
                                                     nv, NB, E, DH, DHP, code_stride, scale_stride)
                if WORDS:
                    s = _word_scores(qw, wh, b, e8, W, GK, BLOCK_N, KEYS_M, ASM, LOWP)
                else:
                    s = _byte_scores(q_even, q_odd, wh, b, e8, DHP, 1, HP, BLOCK_N, LOWP)
                s = tl.where(vis[None, :], s, float("-inf"))
                _store_row_scores(orow, mrow, hrow, s, n0 + sub * BLOCK_N, NC, G, BLOCK_N, MAXG, HIST_SHIFT)
                if sub + 1 < NSUB:
                    b, e8, vis = b_n, e8_n, vis_n
        else:
            for sub in tl.static_range(NSUB):
                _store_row_scores(orow, mrow, hrow, tl.full([1, BLOCK_N], float("-inf"), dtype=tl.float32),
                                  n0 + sub * BLOCK_N, NC, G, BLOCK_N, MAXG, 0)


@triton.jit
def _store_row_scores(orow, mrow, hrow, s, c0, NC, G, BLOCK_N: tl.constexpr, MAXG: tl.constexpr,
                      HIST_SHIFT: tl.constexpr):
    """One query's scores s [1, BLOCK_N] at entries c0 .. c0 + BLOCK_N, and (MAXG > 0) their
    maxima over every MAXG entries, counted into the bound histogram hrow (HIST_SHIFT > 0)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    tl.store(orow + cols[None, :], s, mask=(cols < NC)[None, :])
    if MAXG > 0:
        if MAXG == 1:
            mx = s
        else:
            mx = tl.max(tl.reshape(s, (1, BLOCK_N // MAXG, MAXG)), axis=2)
        gc = c0 // MAXG + tl.arange(0, BLOCK_N // MAXG)
        tl.store(mrow + gc[None, :], mx, mask=(gc < G)[None, :])
        if HIST_SHIFT > 0:
            _count_maxima(hrow, mx, (gc < G)[None, :], HIST_SHIFT)


@triton.jit
def _count_maxima(hrow, mx, ok, HIST_SHIFT: tl.constexpr):
    """Count the finite chunk maxima mx (where ok) into the bound histogram hrow: bin = the top
    32 - HIST_SHIFT bits of the order key read unsigned (sign, exponent and the leading mantissa
    bits), so bins ascend with the scores. -inf maxima (chunks past n_visible) are not counted."""
    NBINS: tl.constexpr = 1 << (32 - HIST_SHIFT)
    b = ((_order_key(mx) ^ -2147483648) >> HIST_SHIFT) & (NBINS - 1)
    tl.atomic_add(hrow + b, 1, mask=ok & (mx > float("-inf")), sem="relaxed")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_shape(t: int, h: int, gather: bool, on_npu: bool, interp: bool) -> tuple[int, int, int]:
    """(HP, BLOCK_T, BLOCK_N): heads padded, queries and entries per tile."""
    if gather:
        hp, bt = max(16, _pow2(h)), 1
    else:
        hp = _pow2(h)
        # query rows (queries x heads) per MMA; on Ascend 32 keep a program's tiles within half
        # the unified buffer (tests/test_triton_ub.py: 64 rows need ~131 KB of the 96 KB)
        rows = 32 if on_npu else 128
        bt = max(1, min(rows // hp, _pow2(t)))
        bt = max(bt, -(-16 // hp))  # tl.dot needs M >= 16
        hp = max(hp, -(-16 // bt))
    # compiled on CUDA: 128-entry blocks (SCORES_WARPS for the measurements); 64 elsewhere
    bn = 64 if (on_npu or interp) else 128
    return hp, bt, bn


def _config(t: int, h: int, nc: int, gather: bool, device) -> tuple[int, int, int, int, int, int]:
    """(HP, BLOCK_T, BLOCK_N, NSUB, num_warps, QSUB) for a launch: query groups of up to
    `scores_qsub` sub-tiles while the tiles still fill the workers twice, then NSUB key blocks a
    tile likewise."""
    from .launch import interpreting, num_workers

    hp, bt, bn = tile_shape(t, h, gather, torch.device(device).type == "npu", interpreting())
    n_tb, n_nb = -(-t // bt), -(-nc // bn)
    target = 2 * num_workers(device, "cube")
    qsub = 1
    limit = 1 if gather else scores_qsub(device)
    while qsub < limit and -(-n_tb // (qsub * 2)) * n_nb >= target:
        qsub *= 2
    n_tg = -(-n_tb // qsub)
    nsub = 1
    nsub_max = 8 if gather else max(1, DENSE_TILE_ENTRIES // bn)
    while nsub < nsub_max and n_tg * (-(-n_nb // (nsub * 2))) >= target:
        nsub *= 2
    return hp, bt, bn, nsub, scores_warps(t, gather, device), qsub


# Warps of a scores program (`_config`). CUDA: 4 for the dense multi-query tiles and for gather
# (Reindex) tiles of GATHER_FOUR_WARPS_MIN_T+ queries, 8 otherwise (elsewhere: 8). H200
# (2026-12-04 20:09-20:13 UTC, `_scores` with fixed tiles, CUDA-event median of 11, two passes,
# every variant bit-equal to the tiles before, scores and chunk maxima): at 8 warps the program
# holds 255 registers a thread, one program an SM (ncu: 12.5% occupancy, no eligible warp 68% of
# the cycles). One sequence, dense, T=1792: over 8K entries 1692 / 1784 us (8 warps, 64-entry
# blocks x 8) -> 1357 / 1404 (4 warps) -> 1256 / 1244 (4 warps, 128-entry blocks x 4, the new
# tiles); over 32K 6816 / 6830 -> 5107 / 5137 -> 4170 / 4219; T=256 over 8K 287 / 295 -> 274 /
# 239 -> 256 / 210; T=128 over 4K 177 / 157 -> 149 / 146 -> 148 / 133 (the new tiles there:
# QSUB 2, unmeasured). Queries of different sequences side by side (a decode batch past the rows
# kernel, each query against its own rows; 20:22 UTC, one pass): T=128 over 4K 403 -> 289 us, T=256
# 585 -> 366. Gather over 16K candidates: T=1792 5703 / 5553 -> 3832 / 3806 us; T=64 262 / 256 ->
# 200 / 197; T=8 over 32K 107 / 120 -> 84; T=1 over 32K 83 / 75 against 100 at 4 warps, so one
# query keeps 8 (T=2..7 unmeasured: 8). Bits: one sequence's tiles and gather tiles give the same
# scores as before; where sequences mix, a key block's queries take one shared MMA or one MMA each
# (`_dense_block`) depending on what else the tile holds, so with 128-entry blocks some scores
# differ in the last bits (fp32 sums of MMAs of other shapes; the reference comparisons hold).
SCORES_WARPS = {"cuda": 4}
GATHER_FOUR_WARPS_MIN_T = 8
# Entries of a dense tile at most (NSUB x BLOCK_N): the 512 measured above at 128-entry blocks.
DENSE_TILE_ENTRIES = 512


def scores_warps(t: int, gather: bool, device) -> int:
    """num_warps of `_indexer_scores_kernel` for t queries (`SCORES_WARPS`)."""
    warps = SCORES_WARPS.get(torch.device(device).type, 8)
    return warps if not gather or t >= GATHER_FOUR_WARPS_MIN_T else 8


# Query sub-tiles a dense scores tile may group (`_indexer_scores_kernel`'s QSUB): a key block
# is decoded once per group where the group's queries read the same rows (a prefill chunk).
# H200 (2026-12-04, `benchmarks/indexer_prefill.py`, scores kernel alone, one sequence, bit-equal
# at every QSUB): T=1792 over 8K entries QSUB 1 / 4 / 8 / 16: 1.644 / 1.555 / 1.472 / 1.817 ms
# (a second call 1.726 / - / 1.560); over 16K 3.138 / 2.901 / 2.795 / 3.086; T=128 over 2K / 8K:
# QSUB 1 0.126 / 0.204, QSUB 8 0.095 / 0.163 ms. The decode is a small part of the tile's work:
# the rest (two MMAs, relu, the head sum, the stores) is per query tile either way.
SCORES_QSUB = {"cuda": 8}


def scores_qsub(device) -> int:
    """The most query sub-tiles per dense scores tile on this device (1: no grouping)."""
    from .launch import interpreting

    return 2 if interpreting() else SCORES_QSUB.get(torch.device(device).type, 1)


def _rows_config(t: int, h: int, nc: int, device, block_n: int | None = None,
                 warps: int | None = None) -> tuple[int, int, int, int, int]:
    """(HP, 1, BLOCK_N, NSUB, num_warps) for `_indexer_rows_kernel`: one query per tile, heads
    padded to >= 16 rows, NSUB blocks per tile so that the tiles about fill the workers once
    (at most ROWS_NSUB_MAX blocks). `block_n` / `warps` replace the device's defaults (the
    benchmarks' tile variants)."""
    from .launch import interpreting, num_workers

    hp = max(16, _pow2(h))
    bn = block_n or (64 if interpreting() or torch.device(device).type == "npu" else ROWS_BLOCK_N)
    blocks = t * -(-nc // bn)
    nsub = 1
    while nsub < ROWS_NSUB_MAX and blocks >= 2 * nsub * num_workers(device, "cube"):
        nsub *= 2
    return hp, 1, bn, nsub, warps or ROWS_WARPS


def use_rows_kernel(t: int, gather: bool) -> bool:
    """Whether the dense scores of t queries go to `_indexer_rows_kernel` (decode shapes:
    t <= ROWS_MAX_T) rather than the multi-query tiles of `_indexer_scores_kernel`."""
    return not gather and t <= ROWS_MAX_T


def ub_tiles(shape: tuple, d: int, maxg: int = 1) -> dict[str, tuple[int, ...]]:
    """Live tiles of one scores program at its peak (shape = `tile_shape(...)`, index head dim
    d): the queries (loaded pairs, two halves), head weights, the block table rows, the key
    bytes and scales, the two decoded halves, the dot result and the scores."""
    hp, bt, bn = shape
    m, dh = bt * hp, _pow2(d // 2)
    return {"q": (m, 2 * dh), "q_even": (m, dh), "q_odd": (m, dh), "w": (m,), "blk": (bt, bn), "vis": (bt, bn),
            "bytes": (bn, dh), "scales": (bn, dh // 16), "k_lo": (bn, dh), "k_hi": (bn, dh), "acc": (m, bn),
            "s": (bt, bn), "maxima": (bt, bn // max(1, maxg))}


def select_ub_tiles(block: int, radix_bits: int = RADIX_BITS_DEFAULT, topk: int = 512) -> dict[str, tuple[int, ...]]:
    """Live tiles of one selection program at its peak: a block of keys with its mask, digits,
    prefix sums and ids, and the histogram; the Reindex ordering's row of ids and its [rows,
    ids] comparison tile (`sort_rows`), which come after the block's tiles are dead."""
    kp = _pow2(topk)
    block_tiles = {"keys": (block,), "mask": (block,), "digit": (block,), "cumsum": (block,), "ids": (block,),
                   "hist": (2 << radix_bits,)}
    order_tiles = {"row": (kp,), "compare": (sort_rows(kp, True), kp), "rank": (sort_rows(kp, True),)}
    return max(block_tiles, order_tiles, key=lambda d: sum(math.prod(v) for v in d.values()))


def sort_rows(kp: int, on_npu: bool) -> int:
    """Ids ranked at a time by the Reindex ordering (a [rows, kp] comparison tile): SORT_ROWS on
    CUDA; on Ascend within SORT_ELEMS_NPU elements."""
    return max(1, min(SORT_ROWS, SORT_ELEMS_NPU // kp)) if on_npu else SORT_ROWS


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor,
                   block_table: torch.Tensor, entries_per_block: int, n_visible: torch.Tensor | None,
                   candidates: torch.Tensor | None = None, _cfg: tuple | None = None,
                   rows: bool | None = None, candidate_block_size: int = 1, words: bool | None = None,
                   keys_m: bool | None = None) -> torch.Tensor:
    """Indexer scores [T, N] over each token's N = nb * E entries (dense; entries >= n_visible[t]
    are -inf) or [T, P * candidate_block_size] over the entries of the candidate blocks (-1
    blocks and entries >= n_visible[t] are -inf), fp32, with the keys read in place from the
    pool through the per-token block tables. `rows` (dense): one query per tile
    (`_indexer_rows_kernel`); None: `use_rows_kernel`; `words` / `keys_m`: that kernel's word
    decode (`_scores`). Requires triton."""
    return _scores(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, candidates,
                   _cfg=_cfg, rows=rows, candidate_block_size=candidate_block_size, words=words, keys_m=keys_m)[0]


def rows_words_fit(codes: torch.Tensor, d: int) -> bool:
    """Whether the rows kernel can read these key codes as int32 words (`_row_key_words`): a
    power-of-two count of 16-byte groups per key (at least one scale group of four words) and
    16-byte aligned rows; CUDA and the interpreters (the conversion's bf16x2 multiplies are
    inline PTX; Ascend keeps the byte decode)."""
    w = d // 8
    return (codes.device.type in ("cuda", "cpu") and d % 32 == 0 and w & (w - 1) == 0
            and codes.data_ptr() % 16 == 0 and codes.stride(0) % 16 == 0)


def _scores(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, candidates=None,
            topk: int = 0, _cfg: tuple | None = None, maxg: int | None = None, rows: bool | None = None,
            candidate_block_size: int = 1, words: bool | None = None, keys_m: bool | None = None,
            hist: torch.Tensor | None = None):
    """`indexer_scores` plus, when topk > 0 (dense), the chunk maxima that bound the top-k
    select: (scores, maxima [T, ceil(N / maxg)] or None, maxg). `hist` (int32, zero, at least
    T * 2^(32 - SPLIT_BOUND_HIST_SHIFT); `bound_histogram`): the rows kernel also counts the
    maxima into it for the split select's bound (`topk_select(..., hist=)`, which zeroes it
    again); untouched where no maxima are written (maxg 0). `_cfg` fixes the tiles of the
    chosen kernel (`_config`'s tuple; with rows, (HP, 1, BLOCK_N, NSUB, warps)); a `_cfg` without
    `rows` keeps the multi-query kernel (the batch-invariant mode's fixed tiles). `words` /
    `keys_m`: the rows kernel's word decode and its dot orientation (default ROWS_WORDS /
    ROWS_KEYS_M; the word decode only where `rows_words_fit`)."""
    from .launch import as_int8, grid_for, interpreting

    t, h, d = q.shape
    if d % MX_GROUP:
        raise ValueError(f"index head dim {d} is not a multiple of {MX_GROUP}")
    # key bytes as int8 (Ascend loads no uint8 pointers); the kernel masks them to 0..255
    # the pool may be row-strided views (fields of vLLM's page records): rows go by stride(0)
    codes = as_int8(key_codes if key_codes.stride(-1) == 1 else key_codes.contiguous())
    scales = as_int8(key_scale if key_scale.stride(-1) == 1 else key_scale.contiguous())
    n_pool = codes.shape[0]
    if codes.shape[1:] != (d // 2,) or scales.shape != (n_pool, d // MX_GROUP):
        raise ValueError(f"key pool {tuple(key_codes.shape)} / {tuple(key_scale.shape)} does not fit head dim {d}")
    e = int(entries_per_block)
    if block_table.dim() != 2 or block_table.shape[0] != t or e <= 0:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [T={t}, nb] with entries_per_block "
                         f"{entries_per_block} > 0")
    nb = block_table.shape[1]
    gather = candidates is not None
    cb = int(candidate_block_size)
    if gather and (candidates.dim() != 2 or candidates.shape[0] != t):
        raise ValueError(f"candidates {tuple(candidates.shape)} must be [T={t}, P]")
    if gather and cb < 1:
        raise ValueError(f"candidate_block_size must be >= 1, got {candidate_block_size}")
    nc = candidates.shape[1] * cb if gather else nb * e
    out = torch.empty(t, nc, dtype=torch.float32, device=q.device)
    if t == 0 or nc == 0:
        return out, None, 0
    if rows is None:
        rows = _cfg is None and use_rows_kernel(t, gather)
    if rows and gather:
        raise ValueError("the one-query-per-tile scores kernel is dense only (no candidates)")
    if hist is not None and not rows:
        raise ValueError("only the one-query-per-tile scores kernel counts the bound histogram")
    if _cfg is not None:
        hp, bt, bn, nsub, warps, *more = _cfg
        qsub = more[0] if more else 1
    elif rows:
        hp, bt, bn, nsub, warps = _rows_config(t, h, nc, q.device)
        qsub = 1
    else:
        hp, bt, bn, nsub, warps, qsub = _config(t, h, nc, gather, q.device)
    if qsub < 1 or qsub > 1 and (gather or rows):
        raise ValueError(f"query groups (QSUB {qsub}) are for the dense multi-query tiles only")
    if rows and (bt != 1 or hp < max(16, h)):
        raise ValueError(f"rows tiles take one query and all its heads padded to >= 16 rows, got {_cfg}")
    if topk <= 0 or gather and not (SPLIT_CANDIDATES and select_parts(t, q.device)):
        maxg = 0  # (candidates: only the split select takes their columns' maxima)
    elif maxg is None:
        maxg = scores_chunk(t, nc, topk, bn, q.device)
        maxg = 0 if maxg == 1 else maxg  # maxima of single entries bound nothing: not written
    if maxg and bn % maxg:
        raise ValueError(f"chunk {maxg} must divide BLOCK_N {bn}")
    g = -(-nc // maxg) if maxg else 1
    maxima = torch.empty(t, g, dtype=torch.float32, device=q.device) if maxg else out
    n_nc = -(-(-(-nc // bn)) // nsub)
    n_tiles = -(-t // (bt * qsub)) * n_nc
    grid = grid_for(n_tiles, q.device, cores="cube")  # tl.dot: one program per AI core on Ascend
    table = block_table.contiguous()
    cand = candidates.contiguous() if gather else table  # unused pointer when dense
    if n_visible is None and not gather:
        raise ValueError("dense indexer scores need n_visible")
    nvis = n_visible.contiguous() if n_visible is not None else \
        torch.full((t,), 2**31 - 1, dtype=torch.int32, device=q.device)  # (candidates, no visible limit)
    extra = {} if interpreting() else {"num_warps": warps}
    if rows:
        words = ROWS_WORDS if words is None else words
        if words and not rows_words_fit(codes, d):
            words = False
        shift = _hist_shift(hist, t) if maxg else 0
        _indexer_rows_kernel[(grid,)](
            q.contiguous(), weights.contiguous(), codes, scales, table, nvis, out, maxima,
            hist if shift else nvis, t, nc, nb, e, g, n_nc, n_tiles, grid, codes.stride(0), scales.stride(0),
            H=h, HP=hp, DH=d // 2, DHP=_pow2(d // 2), BLOCK_N=bn, NSUB=nsub, LOWP=not interpreting(), MAXG=maxg,
            WORDS=bool(words), KEYS_M=bool(ROWS_KEYS_M if keys_m is None else keys_m),
            ASM=q.device.type == "cuda" and not interpreting(), HIST_SHIFT=shift, **extra, **pdl_launch(codes))
        return out, (maxima if maxg else None), maxg
    _indexer_scores_kernel[(grid,)](
        q.contiguous(), weights.contiguous(), codes, scales, table, nvis, cand, out, maxima,
        t, nc, nb, e, g, n_nc, n_tiles, grid, codes.stride(0), scales.stride(0),
        H=h, HP=hp, HP1=max(hp, 16), DH=d // 2, DHP=_pow2(d // 2), BLOCK_T=bt, BLOCK_N=bn, NSUB=nsub,
        GATHER=gather, LOWP=not interpreting(), MAXG=maxg, QSUB=qsub, CB=cb if gather else 1, **extra,
        **pdl_launch(codes))
    return out, (maxima if maxg else None), maxg


# ---- selection (Triton): bound from chunk maxima, compaction, radix select ----------------------

@triton.jit
def _order_key(x):
    """fp32 scores -> int32 keys whose signed order is the scores' order (-0.0 folded into +0.0,
    which tie under float comparison)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _radix_pick(hist, need, NBIN: tl.constexpr):
    """From the histogram of the current digit (bins >= NBIN: values outside the prefix), the
    digit holding the need-th largest, and the need left within that digit."""
    bins = tl.arange(0, 2 * NBIN)
    hist = tl.where(bins < NBIN, hist, 0)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # values with digit >= bin
    dsel = tl.max(tl.where((bins < NBIN) & (at_or_above >= need), bins, -1), axis=0)
    return dsel, need - tl.sum(tl.where(bins > dsel, hist, 0), axis=0)


@triton.jit
def _radix_digit(hist, need, prefix, pmask, shift, NBIN: tl.constexpr):
    """One radix step (`_radix_pick`); returns the updated need, prefix and mask."""
    dsel, need = _radix_pick(hist, need, NBIN)
    return need, prefix | (dsel << shift), pmask | ((NBIN - 1) << shift)


@triton.jit
def _kth_key_span(src, n, k, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """`_kth_key` for n <= BLOCK values (loaded once), radix passes over the span of the keys
    only: rel = key - min(key) < 2^b, and the passes walk b's RADIX_BITS-bit digits from the top,
    so the leading bits every value shares cost no pass (scores within a factor of two of each
    other span ~23 bits: 6 passes of 4 bits instead of 8). After MAX_PASSES passes (fewer than
    the span needs) it stops: the lower edge of the digit range holding the k-th largest is a
    lower bound of it (at least k values are >= it; `need` is then meaningless), which is all
    the chunk-maxima bound needs."""
    cols = tl.arange(0, BLOCK)
    m = cols < n
    return _kth_of_keys_span(_order_key(tl.load(src + cols, mask=m, other=0.0)), m, k, RADIX_BITS, MAX_PASSES)


@triton.jit
def _kth_of_keys_span(key, m, k, RADIX_BITS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """`_kth_key_span` on keys already in registers (order keys `key`, valid where m)."""
    NBIN: tl.constexpr = 1 << RADIX_BITS
    lo = tl.min(tl.where(m, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(m, key, -2147483648), axis=0).to(tl.int64)
    rel = key.to(tl.int64) - lo  # 0 .. hi - lo < 2^32 where m
    # bits of the span (from the fp32 exponent of hi - lo; rounding up only adds a pass)
    e = ((hi - lo).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126
    n_pass = tl.minimum((tl.maximum(e, 0) + RADIX_BITS - 1) // RADIX_BITS, MAX_PASSES)
    top = (tl.maximum(e, 0) + RADIX_BITS - 1) // RADIX_BITS  # passes the whole span needs
    prefix = tl.zeros([], dtype=tl.int64)  # rel's digits found so far
    pmask = tl.zeros([], dtype=tl.int64)
    need = k + tl.zeros([], dtype=tl.int32)
    for p in range(0, n_pass):
        shift = (RADIX_BITS * (top - 1 - p)).to(tl.int64)
        digit = ((rel >> shift) & (NBIN - 1)).to(tl.int32)
        hist = tl.histogram(tl.where(m & ((rel & pmask) == prefix), digit, NBIN), 2 * NBIN)
        dsel, need = _radix_pick(hist, need, NBIN)
        prefix = prefix | (dsel.to(tl.int64) << shift)
        pmask = pmask | ((NBIN - 1) << shift)
    return (lo + prefix).to(tl.int32), need


@triton.jit
def _kth_of_keys(key, m, k, RADIX_BITS: tl.constexpr):
    """`_kth_key` on keys already in registers (order keys `key`, valid where m, k <= their
    count): every radix pass runs on the tile as loaded. The passes stop as soon as the digit
    holding the k-th largest holds exactly as many values as the top k still needs: every value
    with the prefix found so far is then taken, so the k-th largest is their minimum, and every
    value equal to it belongs to the top k. Distinct scores get there before the last of the 8
    passes of 4 bits (a 4096-entry select on an H100: 15.2 -> 13.6 us); rows of many ties run
    them all."""
    NBIN: tl.constexpr = 1 << RADIX_BITS
    NPASS: tl.constexpr = 32 // RADIX_BITS
    bins = tl.arange(0, 2 * NBIN)
    prefix = tl.zeros([], dtype=tl.int32)  # digits found so far (unsigned key bits)
    pmask = tl.zeros([], dtype=tl.int32)
    need = k + tl.zeros([], dtype=tl.int32)  # how many of the values matching the prefix to take
    held = tl.zeros([], dtype=tl.int32) - 1  # values matching the prefix (-1: not counted yet)
    u = key ^ -2147483648  # unsigned order
    p = tl.zeros([], dtype=tl.int32)
    while (p < NPASS) & (held != need):
        shift = 32 - RADIX_BITS * (p + 1)
        digit = (u >> shift) & (NBIN - 1)
        hist = tl.histogram(tl.where(m & ((u & pmask) == prefix), digit, NBIN), 2 * NBIN)
        dsel, need = _radix_pick(hist, need, NBIN)
        held = tl.sum(tl.where(bins == dsel, hist, 0), axis=0)
        prefix = prefix | (dsel << shift)
        pmask = pmask | ((NBIN - 1) << shift)
        p += 1
    if held == need:  # the whole prefix group is taken: its minimum and all its copies
        group = m & ((u & pmask) == prefix)
        thr = tl.min(tl.where(group, key, 2147483647), axis=0)
        need = tl.sum((group & (key == thr)).to(tl.int32), axis=0)
    else:
        thr = prefix ^ -2147483648
    return thr, need


@triton.jit
def _kth_key(src, n, k, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The k-th largest order key among the values src[0:n] (fp32 or bf16; 1 <= k <= n), found digit by
    digit (RADIX_BITS at a time, most significant first: a histogram of the digit over the
    values matching the prefix found so far picks the digit holding the k-th), and how many
    values equal to it belong to the top k (the rest of the top k is strictly above it).
    When n <= BLOCK the values are loaded once and every pass runs on registers."""
    NBIN: tl.constexpr = 1 << RADIX_BITS
    cols = tl.arange(0, BLOCK)
    prefix = tl.zeros([], dtype=tl.int32)  # digits found so far (unsigned key bits)
    pmask = tl.zeros([], dtype=tl.int32)
    need = k + tl.zeros([], dtype=tl.int32)  # how many of the values matching the prefix to take
    if n <= BLOCK:
        m = cols < n
        thr, need = _kth_of_keys(_order_key(tl.load(src + cols, mask=m, other=0.0).to(tl.float32)), m, k, RADIX_BITS)
    else:
        for p in range(0, 32 // RADIX_BITS):
            shift = 32 - RADIX_BITS * (p + 1)
            hist = tl.zeros([2 * NBIN], dtype=tl.int32)
            for c0 in range(0, n, BLOCK):
                c = c0 + cols
                m = c < n
                u = _order_key(tl.load(src + c, mask=m, other=0.0).to(tl.float32)) ^ -2147483648
                digit = (u >> shift) & (NBIN - 1)
                hist += tl.histogram(tl.where(m & ((u & pmask) == prefix), digit, NBIN), 2 * NBIN)
            need, prefix, pmask = _radix_digit(hist, need, prefix, pmask, shift, NBIN)
        thr = prefix ^ -2147483648
    return thr, need


@triton.jit
def _kth_merged(src, g, k, CB: tl.constexpr, F: tl.constexpr, RADIX_BITS: tl.constexpr):
    """`_kth_key` over the maxima of every F consecutive values of src[0:g] (ceil(g / F) <= CB, on
    one tile): a lower bound of src's k-th largest (k groups each hold a value at least as large)."""
    j = tl.arange(0, CB)
    idx = j[:, None] * F + tl.arange(0, F)[None, :]
    x = tl.load(src + idx, mask=idx < g, other=float("-inf")).to(tl.float32)
    return _kth_of_keys(_order_key(tl.max(x, axis=1)), j * F < g, k, RADIX_BITS)


@triton.jit
def _maxima_bound(src, g, k, BLOCK: tl.constexpr, MERGE: tl.constexpr, PER_K: tl.constexpr,
                  RADIX_BITS: tl.constexpr):
    """The split select's lower bound from a row's g chunk maxima (g <= BLOCK): the k-th largest
    of their maxima over MERGE neighbours while that leaves at least PER_K * k of them, else over
    2 neighbours, else of the maxima themselves. Fewer values, less radix work a pass (every
    part computes the bound); still a lower bound, so only the survivors grow."""
    if g >= MERGE * PER_K * k:
        thr, _ = _kth_merged(src, g, k, BLOCK // MERGE, MERGE, RADIX_BITS)
    elif g >= 2 * PER_K * k:
        thr, _ = _kth_merged(src, g, k, BLOCK // 2, 2, RADIX_BITS)
    else:
        thr, _ = _kth_key(src, g, k, BLOCK, RADIX_BITS)
    return thr


@triton.jit
def _hist_bound(hrow, k, HIST_SHIFT: tl.constexpr):
    """The split select's bound from a row's histogram of chunk maxima (`_count_maxima`): the
    lowest order key of the highest bin with at least k maxima at or above it. At least k maxima
    are >= it, so it is a lower bound of their k-th largest (one bin's width below it at most:
    1/16 of the value with HIST_SHIFT 19). Fewer than k counted: bin 0's edge, which keeps every
    score (the select stays exact, only its survivors grow)."""
    NBINS: tl.constexpr = 1 << (32 - HIST_SHIFT)
    bins = tl.arange(0, NBINS)
    c = tl.load(hrow + bins, cache_modifier=".cg")
    at_or_above = tl.sum(c, axis=0) - tl.cumsum(c, axis=0) + c
    sel = tl.max(tl.where(at_or_above >= k, bins, 0), axis=0)
    return (sel << HIST_SHIFT) ^ -2147483648


@triton.jit
def _hist_clear(hrow, HIST_SHIFT: tl.constexpr):
    """Zero a row's bound histogram (kept zero between calls, as `tile_counters`). The barrier
    orders the zeros before any later load of the buffer by this program (a later job reads
    another row's histogram, never this one's, but the loads are of the same buffer:
    tests/test_kernel_barriers.py)."""
    NBINS: tl.constexpr = 1 << (32 - HIST_SHIFT)
    tl.store(hrow + tl.arange(0, NBINS), tl.zeros([NBINS], dtype=tl.int32))
    tl.debug_barrier()


@triton.jit
def _take_flags(key, m, thr, need, n_eq):
    """Which values of a block (order keys `key`, valid where m) belong to the top set: those
    above `thr` and the first `need` equal to it (n_eq equal ones came in earlier blocks).
    Returns (take, equal) as int32 flags."""
    gt = (m & (key > thr)).to(tl.int32)
    eq = (m & (key == thr)).to(tl.int32)
    return gt | (eq & ((n_eq + tl.cumsum(eq, axis=0) - eq) < need).to(tl.int32)), eq


@triton.jit
def _take_ordered(src, pos_src, n, thr, need, orow, crow, BLOCK: tl.constexpr, POS: tl.constexpr,
                  MAP: tl.constexpr, CB: tl.constexpr = 1, lim=0):
    """Write, in ascending order, the ids of the values in src[0:n] above `thr` (order key) and
    of the first `need` equal to it: ids from pos_src[0:n] when POS, else the indices; MAP: the
    ids are columns of the candidate row `crow` (blocks of CB entries: column c is entry
    crow[c // CB] * CB + c % CB), written as those entries, dropping -1 blocks and entries >=
    `lim`. Returns how many ids were written."""
    cols = tl.arange(0, BLOCK)
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        c = c0 + cols
        m = c < n
        take, eq = _take_flags(_order_key(tl.load(src + c, mask=m, other=0.0)), m, thr, need, n_eq)
        if POS:
            ids = tl.load(pos_src + c, mask=m, other=0)
        else:
            ids = c
        if MAP:  # the entry ids of the chosen candidates; padding (-1) is not an entry
            cblk = tl.load(crow + ids // CB, mask=take != 0, other=-1)
            ent = cblk * CB + ids % CB
            ok = (cblk >= 0) & (ent < lim)
            ids = tl.where(ok, ent, -1)
            take = take & ok.to(tl.int32)
        pos = n_sel + tl.cumsum(take, axis=0) - take
        tl.store(orow + pos, ids.to(tl.int64), mask=take != 0)
        n_sel += tl.sum(take, axis=0)
        n_eq += tl.sum(eq, axis=0)
    return n_sel


@triton.jit
def _sort_row(stage, n, orow, KOUT, KP: tl.constexpr, RB: tl.constexpr):
    """orow[0:KOUT] = the n ids at stage[0:n] in ascending order, then -1 (KP >= n, a power of
    two). Ids that already ascend (the candidate pool's blocks come in entry order, so the
    model's Reindex rows do) are copied; otherwise each id is stored at its rank (the ids below
    it, and equal ones earlier in the row), counted RB ids at a time against the whole row, so no
    sort primitive is needed (portable; the candidates' entry ids need not ascend with their
    columns). H200, T=1, 4096 candidates, top-512: the ranks cost ~40 us of the select's ~55."""
    tl.debug_barrier()  # the staged ids, written by every thread of the program, are read back
    big = 1 << 62
    c = tl.arange(0, KP)
    v = tl.load(stage + c, mask=c < n, other=big)
    nxt = tl.load(stage + c + 1, mask=c + 1 < n, other=big)
    if tl.max(((c + 1 < n) & (nxt <= v)).to(tl.int32), axis=0) == 0:  # already ascending
        tl.store(orow + c, v, mask=c < n)
    else:
        for r0 in range(0, n, RB):
            ci = r0 + tl.arange(0, RB)
            vi = tl.load(stage + ci, mask=ci < n, other=big)
            below = (v[None, :] < vi[:, None]) | ((v[None, :] == vi[:, None]) & (c[None, :] < ci[:, None]))
            tl.store(orow + tl.sum(below.to(tl.int32), axis=1), vi, mask=ci < n)
    for c0 in range(n, KOUT, KP):
        cc = c0 + c
        tl.store(orow + cc, tl.full([KP], -1, dtype=tl.int64), mask=cc < KOUT)


@triton.jit
def _select_row(nvis_ptr, t, N, MAP: tl.constexpr, MAP_NV: tl.constexpr):
    """A select kernel's query row t: (64-bit t for its row offsets, the entry limit (MAP_NV:
    n_visible[t]; else none), the selectable columns (MAP: all N; else n_visible[t], at most N))."""
    t64 = t + tl.zeros([], dtype=tl.int64)  # (a plain int under the interpreter otherwise)
    lim = 2147483647 + tl.zeros([], dtype=tl.int32)  # (MAP: entries past it are not candidates)
    if MAP:
        nv = N + tl.zeros([], dtype=tl.int32)
        if MAP_NV:
            lim = tl.load(nvis_ptr + t).to(tl.int32)
    else:
        nv = tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), N)
    return t64, lim, nv


@triton.jit
def _whole_row(row, orow, crow, stage, nv, K, KOUT, lim, everything, BLOCK: tl.constexpr,
               RADIX_BITS: tl.constexpr, MAP: tl.constexpr, CB: tl.constexpr, KP: tl.constexpr,
               RB: tl.constexpr):
    """A row selected without a bound: all nv columns (`everything`: nv <= K), else the K largest
    by radix passes over the whole row; MAP: written as entry ids, invalid ones dropped, staged
    and put in entry-id order (`_sort_row`); else the ascending columns, -1 padded."""
    if everything:
        thr = tl.full([], -2147483648, dtype=tl.int32)
        need = tl.zeros([], dtype=tl.int32)
    else:
        thr, need = _kth_key(row, nv, K, BLOCK, RADIX_BITS)
    if MAP:
        n_out = _take_ordered(row, row, nv, thr, need, stage, crow, BLOCK, False, True, CB, lim)
        _sort_row(stage, n_out, orow, KOUT, KP, RB)
    elif everything:
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, KOUT, BLOCK):
            c = c0 + cols
            tl.store(orow + c, tl.where(c < nv, c, -1).to(tl.int64), mask=c < KOUT)
    else:
        _take_ordered(row, row, nv, thr, need, orow, row, BLOCK, False, False)


@triton.jit
def _topk_select_kernel(s_ptr, max_ptr, nvis_ptr, out_ptr, chunk_ptr, surv_s_ptr, surv_p_ptr, cand_ptr, stage_ptr,
                        T, N, G, K, KOUT, num_programs,
                        MAXG: tl.constexpr, CAP: tl.constexpr, USE_MAX: tl.constexpr, BLOCK: tl.constexpr,
                        RADIX_BITS: tl.constexpr, MAP: tl.constexpr, KP: tl.constexpr, RB: tl.constexpr,
                        SBLOCK: tl.constexpr, BOUND_PASSES: tl.constexpr, SPAN: tl.constexpr,
                        CB: tl.constexpr = 1, MAP_NV: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Per query row t (persistent loop): the K largest of scores[t, :n_visible[t]] (ties to the
    lower entry id) as ascending entry ids in out[t, :KOUT], -1 padded.

    1. A lower bound L of the K-th largest score: the K-th largest of the row's chunk maxima
       (max_ptr [T, G], one per MAXG entries, written by the scores kernel): K chunks have a
       score >= L, so every score of the top K is >= L.
    2. The chunks whose maximum is >= L are listed (in order), and their scores >= L compacted
       in entry order (a running prefix sum) into the row's survivor buffer (CAP entries;
       typically a little over K of them). Only those chunks' scores are read.
    3. The K-th largest survivor by radix select, then one ordered pass over the survivors takes
       those above it and the first ones equal to it: ascending ids without a sort. Up to SBLOCK
       (<= BLOCK) survivors, both run on tiles of SBLOCK values (a radix pass costs its tile).
    Rows without maxima, with fewer than K chunks, or whose survivors overflow CAP (many ties at
    the bound) run step 3 on the whole row.
    BOUND_PASSES > 0 (at most BLOCK chunks): step 1 takes that many radix passes over the span of
    the maxima's keys (`_kth_key_span`), a lower bound of their K-th largest, not the exact one
    (a few more chunks are read in step 2). SPAN: step 3's select on a tile runs its passes over
    the survivors' span only (`_kth_key_span`, exact).
    MAP (Reindex: the row's columns are the entries of candidate blocks, cand_ptr [T, N / CB]
    block ids (CB 1: entry ids), -1 padding and, with MAP_NV, entries >= n_visible[t] scored
    -inf): the whole row is selectable, the chosen columns are written as their entry ids with
    those invalid ones dropped (the reference's selection among valid columns), staged
    (stage_ptr [T, KP]), then placed in entry-id order."""
    pdl_start(PDL)
    CH: tl.constexpr = BLOCK // MAXG  # chunks per iteration of the survivor pass
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    for t in range(pid, T, num_programs):
        t64, lim, nv = _select_row(nvis_ptr, t, N, MAP, MAP_NV)
        row = s_ptr + t64 * N
        orow = out_ptr + t64 * KOUT
        crow = cand_ptr + t64 * (N // CB)
        stage = stage_ptr + t64 * KP
        if nv <= K:  # everything visible is selected
            _whole_row(row, orow, crow, stage, nv, K, KOUT, lim, True, BLOCK, RADIX_BITS, MAP, CB, KP, RB)
        else:
            srow = surv_s_ptr + t64 * CAP
            prow = surv_p_ptr + t64 * CAP
            cnt = tl.full([], CAP + 1, dtype=tl.int32)  # "overflowed" unless the bounded path runs
            g = (nv + MAXG - 1) // MAXG  # chunks holding a visible entry
            if USE_MAX:
                if g >= K:
                    maxrow = max_ptr + t64 * G
                    crow_ch = chunk_ptr + t64 * G
                    if BOUND_PASSES > 0 and g <= BLOCK:  # a lower bound of the K-th maximum
                        bound, _ = _kth_key_span(maxrow, g, K, BLOCK, RADIX_BITS, BOUND_PASSES)
                    else:
                        bound, _ = _kth_key(maxrow, g, K, BLOCK, RADIX_BITS)
                    n_ch = tl.zeros([], dtype=tl.int32)
                    for c0 in range(0, g, BLOCK):  # the chunks that can hold a top-K score
                        ch = c0 + cols
                        keep = ((ch < g) & (_order_key(tl.load(maxrow + ch, mask=ch < g, other=0.0)) >= bound))
                        keep = keep.to(tl.int32)
                        tl.store(crow_ch + n_ch + tl.cumsum(keep, axis=0) - keep, ch, mask=keep != 0)
                        n_ch += tl.sum(keep, axis=0)
                    # the chunk list, stored by every thread of the program, is read back below by
                    # other threads: global memory is not ordered between threads without a barrier
                    # (the interpreters run one thread; the H200 returned stale ids without it)
                    tl.debug_barrier()
                    cnt = tl.zeros([], dtype=tl.int32)
                    for c0 in range(0, n_ch, CH):  # their scores >= bound, in entry order
                        ci = c0 + tl.arange(0, CH)
                        chid = tl.load(crow_ch + ci, mask=ci < n_ch, other=0)
                        ent = tl.reshape(chid[:, None] * MAXG + tl.arange(0, MAXG)[None, :], [BLOCK])
                        m = tl.reshape((ci < n_ch)[:, None] & (tl.arange(0, MAXG) >= 0)[None, :], [BLOCK]) & (ent < nv)
                        x = tl.load(row + ent, mask=m, other=0.0)
                        keep = (m & (_order_key(x) >= bound)).to(tl.int32)
                        pos = cnt + tl.cumsum(keep, axis=0) - keep
                        ok = (keep != 0) & (pos < CAP)
                        tl.store(srow + pos, x, mask=ok)
                        tl.store(prow + pos, ent, mask=ok)
                        cnt += tl.sum(keep, axis=0)
                    tl.debug_barrier()  # the survivors, likewise, are read back by other threads
            if SBLOCK < BLOCK and cnt <= SBLOCK and cnt <= CAP:  # (CAP can be below SBLOCK)
                if SPAN:
                    thr, need = _kth_key_span(srow, cnt, K, SBLOCK, RADIX_BITS, 32)
                else:
                    thr, need = _kth_key(srow, cnt, K, SBLOCK, RADIX_BITS)
                _take_ordered(srow, prow, cnt, thr, need, orow, crow, SBLOCK, True, False)
            elif cnt <= CAP:
                if SPAN and cnt <= BLOCK:
                    thr, need = _kth_key_span(srow, cnt, K, BLOCK, RADIX_BITS, 32)
                else:
                    thr, need = _kth_key(srow, cnt, K, BLOCK, RADIX_BITS)
                _take_ordered(srow, prow, cnt, thr, need, orow, crow, BLOCK, True, False)
            else:
                _whole_row(row, orow, crow, stage, nv, K, KOUT, lim, False, BLOCK, RADIX_BITS, MAP, CB, KP, RB)


@triton.jit
def _region_take(srow, prow, cnts, starts, total, SL, K, orow, PP: tl.constexpr, FB: tl.constexpr,
                 RADIX_BITS: tl.constexpr, SPAN: tl.constexpr):
    """The final select of `_split_select_kernel` when the survivors fit one tile (total <= FB):
    region r's cnts[r] survivors (scores srow[r * SL + j], entry ids prow[...], j < cnts[r]) are
    gathered into tile positions starts[r] + j (regions ascend, so the tile is in entry order),
    their K-th largest key found on registers, and the ids above it plus the first ones equal
    to it written to orow in order (all of them when total <= K)."""
    i = tl.arange(0, FB)
    pi = tl.arange(0, PP)
    # region of tile position i: the last region starting at or before i (empty regions share
    # their start with the next one, so the last such region is the one holding i)
    inr = (starts[None, :] <= i[:, None]) & (cnts[None, :] > 0)
    region = tl.max(tl.where(inr, pi[None, :], 0), axis=1)
    start = tl.max(tl.where(inr, starts[None, :], 0), axis=1)
    m = i < total
    src = region * SL + (i - start)
    x = tl.load(srow + src, mask=m, other=0.0, cache_modifier=".cg")
    ids = tl.load(prow + src, mask=m, other=0, cache_modifier=".cg")
    key = _order_key(x)
    if total <= K:  # (Reindex rows with at most K valid candidates: every survivor is taken)
        thr = tl.full([], -2147483648, dtype=tl.int32)
        need = tl.zeros([], dtype=tl.int32)
    elif SPAN:
        thr, need = _kth_of_keys_span(key, m, K, RADIX_BITS, 32)
    else:
        thr, need = _kth_of_keys(key, m, K, RADIX_BITS)
    take, _ = _take_flags(key, m, thr, need, 0)
    tl.store(orow + tl.cumsum(take, axis=0) - take, ids.to(tl.int64), mask=take != 0)


@triton.jit
def _final_take(srow, prow, cnts, total, SL, K, orow, PP: tl.constexpr, FBLOCK: tl.constexpr,
                RADIX_BITS: tl.constexpr, SPAN: tl.constexpr):
    """The split select's final select over the regions' `total` survivors: on one tile
    (`_region_take`) up to FBLOCK of them, else looped over the regions (`_region_take_looped`).
    (MAP: the launcher's FBLOCK >= K, so the looped path sees more than K.)"""
    if total <= FBLOCK:
        _region_take(srow, prow, cnts, tl.cumsum(cnts, axis=0) - cnts, total, SL, K, orow, PP, FBLOCK, RADIX_BITS,
                     SPAN)
    else:
        _region_take_looped(srow, prow, cnts, SL, K, orow, PP, FBLOCK // PP, RADIX_BITS)


@triton.jit
def _region_take_looped(srow, prow, cnts, SL, K, orow, PP: tl.constexpr, WB: tl.constexpr,
                        RADIX_BITS: tl.constexpr):
    """The final select of `_split_select_kernel` for any number of survivors, without moving
    them: the regions are read as a [PP, WB] tile per step of WB survivors per region (every
    region at once). Radix passes accumulate the histogram over the steps; then per-region
    counts above / equal to the K-th key give each region's first output position (ties taken
    in entry order: regions ascend, entries ascend within a region) and a second sweep writes
    the ids there."""
    NBIN: tl.constexpr = 1 << RADIX_BITS
    pi = tl.arange(0, PP)
    j = tl.arange(0, WB)
    maxc = tl.max(cnts, axis=0)
    prefix = tl.zeros([], dtype=tl.int32)
    pmask = tl.zeros([], dtype=tl.int32)
    need = K + tl.zeros([], dtype=tl.int32)
    for p in range(0, 32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        hist = tl.zeros([2 * NBIN], dtype=tl.int32)
        for j0 in range(0, maxc, WB):
            m = (j0 + j)[None, :] < cnts[:, None]
            x = tl.load(srow + pi[:, None] * SL + (j0 + j)[None, :], mask=m, other=0.0, cache_modifier=".cg")
            u = tl.reshape(_order_key(x) ^ -2147483648, [PP * WB])
            m1 = tl.reshape(m, [PP * WB])
            hist += tl.histogram(tl.where(m1 & ((u & pmask) == prefix), (u >> shift) & (NBIN - 1), NBIN), 2 * NBIN)
        need, prefix, pmask = _radix_digit(hist, need, prefix, pmask, shift, NBIN)
    thr = prefix ^ -2147483648
    n_gt = tl.zeros([PP], dtype=tl.int32)
    n_eq = tl.zeros([PP], dtype=tl.int32)
    for j0 in range(0, maxc, WB):  # per-region counts above / equal to the threshold
        m = (j0 + j)[None, :] < cnts[:, None]
        key = _order_key(tl.load(srow + pi[:, None] * SL + (j0 + j)[None, :], mask=m, other=0.0,
                                 cache_modifier=".cg"))
        n_gt += tl.sum((m & (key > thr)).to(tl.int32), axis=1)
        n_eq += tl.sum((m & (key == thr)).to(tl.int32), axis=1)
    eq_before = tl.cumsum(n_eq, axis=0) - n_eq  # equal ones in earlier regions
    taken = n_gt + tl.minimum(tl.maximum(need - eq_before, 0), n_eq)
    base = tl.cumsum(taken, axis=0) - taken  # each region's first output position
    eq_seen = eq_before
    done = base
    for j0 in range(0, maxc, WB):
        m = (j0 + j)[None, :] < cnts[:, None]
        off = pi[:, None] * SL + (j0 + j)[None, :]
        key = _order_key(tl.load(srow + off, mask=m, other=0.0, cache_modifier=".cg"))
        gt = (m & (key > thr)).to(tl.int32)
        eq = (m & (key == thr)).to(tl.int32)
        take = gt | (eq & ((eq_seen[:, None] + tl.cumsum(eq, axis=1) - eq) < need).to(tl.int32))
        ids = tl.load(prow + off, mask=take != 0, other=0, cache_modifier=".cg")
        tl.store(orow + done[:, None] + tl.cumsum(take, axis=1) - take, ids.to(tl.int64), mask=take != 0)
        eq_seen += tl.sum(eq, axis=1)
        done += tl.sum(take, axis=1)


@triton.jit
def _split_select_kernel(s_ptr, max_ptr, nvis_ptr, out_ptr, surv_s_ptr, surv_p_ptr, part_ptr, count_ptr,
                         cand_ptr, stage_ptr, pool_ptr, work_ptr, hist_ptr, NBLK, NPOOL, T, N, G, K, KOUT, SL, P,
                         num_programs,
                         MAXG: tl.constexpr, MBLOCK: tl.constexpr, SBLOCK: tl.constexpr, FBLOCK: tl.constexpr,
                         BLOCK: tl.constexpr, PP: tl.constexpr, RADIX_BITS: tl.constexpr, SPAN: tl.constexpr,
                         MERGE: tl.constexpr = 1, PER_K: tl.constexpr = 2, STOP: tl.constexpr = 0,
                         MAP: tl.constexpr = False, CB: tl.constexpr = 1, MAP_NV: tl.constexpr = False,
                         KP: tl.constexpr = 1, RB: tl.constexpr = 1, POOL: tl.constexpr = False,
                         POOL_BLOCK: tl.constexpr = 16, HIST_SHIFT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """The dense top-K select of `_topk_select_kernel` (same result: the K largest of
    scores[t, :n_visible[t]], ties to the lower entry id, ascending ids, -1 padded) split over P
    programs per row, so that a decode step's few rows use many SMs:

    1. Every part computes the exact K-th largest of the row's chunk maxima (max_ptr [T, G], one
       per MAXG entries, from the scores kernel): a lower bound of the K-th largest score
       (computed redundantly by the P parts instead of a launch or a wait). With MERGE > 1 (the
       maxima on one tile) the K-th largest of the maxima of up to MERGE neighbouring chunks,
       while at least PER_K * K of those remain (`_maxima_bound`): the scores kernel writes
       maxima fine enough for rows with a fraction of their entries visible, and a full row's
       bound runs on a tile MERGE times narrower.
    2. Part p reads its slice of SL entries once (contiguous) and compacts its scores >= bound
       in entry order into region p of the row's survivor buffers (surv_s / surv_p [T, N]: the
       region has room for the whole slice, so nothing overflows), its count into part_ptr
       [T, P].
    3. After a CTA barrier, each part bumps the row's counter (count_ptr, acq_rel; zero before
       and left zero after: `tile_counters`); the part that counts last selects the K among the
       regions' survivors (`_region_take`: on one tile; `_region_take_looped` beyond FBLOCK).
       Which part comes last varies; what it computes does not (regions are read in order).
    Rows with at most K visible entries, or fewer than K chunks, are done by part 0 alone as
    `_topk_select_kernel` does them (no counter). STOP (timing the stages; no result): 1 ends
    after the bound, 2 after the slices. CUDA only (atomics, `.cg` loads); Ascend keeps
    `_topk_select_kernel`.
    MAP (the Reindex selection, as `_topk_select_kernel`'s MAP: every column selectable, cand_ptr
    [T, N / CB] candidate block ids, -1 padding and, with MAP_NV, entries >= n_visible[t]
    invalid, their scores -inf): the maxima are the candidate columns' (the gather scores
    kernel's), a part keeps only valid columns and stores their entry ids as survivor ids, so the
    final select takes the K best valid candidates (all of them when fewer) in column order,
    staged (stage_ptr [T, KP]) and then put in entry-id order by `_sort_row` (a copy for the
    candidate pool's ascending blocks).
    POOL: programs num_programs .. + NPOOL make each row's candidate pool from the same maxima
    (`_pool_row`: blocks of MAXG entries, NBLK of them, into pool_ptr; work_ptr its scratch), so
    the pool's one-program select runs beside the parts instead of in a launch after them.
    HIST_SHIFT > 0 (dense rows): step 1's bound comes from the row's histogram of its chunk
    maxima instead (hist_ptr [T, 2^(32 - HIST_SHIFT)], counted by the scores kernel,
    `_count_maxima`): the lower edge of the highest bin with at least K maxima at or above it, a
    lower bound of the K-th largest maximum within one bin's width (`_hist_bound`: one load and a
    prefix sum instead of the radix passes). The part that finishes the row (or part 0 where it
    selects the whole row) zeroes the row's histogram for the next call; the ids are the same
    whichever bound runs (any lower bound of the K-th largest score selects the same K)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if POOL:
        if pid >= num_programs:
            for t in range(pid - num_programs, T, NPOOL):
                _pool_row(max_ptr, nvis_ptr, pool_ptr, work_ptr, t, N, G, NBLK, MAXG, POOL_BLOCK, RADIX_BITS)
    first = tl.where(pid < num_programs, pid, T * P)  # (the pool's programs take no select job)
    for job in range(first, T * P, num_programs):
        t = job // P
        p = job - t * P
        t64, lim, nv = _select_row(nvis_ptr, t, N, MAP, MAP_NV)
        row = s_ptr + t64 * N
        orow = out_ptr + t64 * KOUT
        crow = cand_ptr + t64 * (N // CB)
        stage = stage_ptr + t64 * KP
        g = (nv + MAXG - 1) // MAXG  # chunks holding a visible entry
        hrow = hist_ptr
        if HIST_SHIFT > 0:
            hrow = hist_ptr + (t64 << (32 - HIST_SHIFT))
        if nv <= K or g < K:  # everything visible is selected, or the maxima bound nothing
            if p == 0:
                _whole_row(row, orow, crow, stage, nv, K, KOUT, lim, nv <= K, BLOCK, RADIX_BITS, MAP, CB, KP, RB)
                if HIST_SHIFT > 0:
                    _hist_clear(hrow, HIST_SHIFT)
        else:
            if HIST_SHIFT > 0:
                bound = _hist_bound(hrow, K, HIST_SHIFT)
            elif SPAN:  # (G <= MBLOCK: the launcher's condition)
                bound, _ = _kth_key_span(max_ptr + t64 * G, g, K, MBLOCK, RADIX_BITS, 32)
            elif MERGE > 1:  # (G <= MBLOCK: the launcher's condition)
                bound = _maxima_bound(max_ptr + t64 * G, g, K, MBLOCK, MERGE, PER_K, RADIX_BITS)
            else:
                bound, _ = _kth_key(max_ptr + t64 * G, g, K, MBLOCK, RADIX_BITS)
            srow = surv_s_ptr + t64 * N
            prow = surv_p_ptr + t64 * N
            lo = p * SL
            hi = tl.minimum(lo + SL, nv)
            cnt = tl.zeros([], dtype=tl.int32)
            if STOP == 1:  # (timing only: the bound alone)
                hi = lo
                tl.store(orow + p, bound.to(tl.int64))
            for c0 in range(lo, hi, SBLOCK):  # this part's scores >= bound, in entry order
                c = c0 + tl.arange(0, SBLOCK)
                m = c < hi
                x = tl.load(row + c, mask=m, other=0.0)
                keep = m & (_order_key(x) >= bound)
                ids = c
                if MAP:  # valid candidates only, kept as their entry ids
                    cblk = tl.load(crow + c // CB, mask=keep, other=-1)
                    ids = cblk * CB + c % CB
                    keep = keep & (cblk >= 0) & (ids < lim)
                keep = keep.to(tl.int32)
                pos = lo + cnt + tl.cumsum(keep, axis=0) - keep
                tl.store(srow + pos, x, mask=keep != 0)
                tl.store(prow + pos, ids, mask=keep != 0)
                cnt += tl.sum(keep, axis=0)
            tl.store(part_ptr + t64 * P + p, cnt)
            tl.debug_barrier()  # every thread's survivors are written before the release below
            done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
            if STOP > 0:  # (timing only: no final select; the counter back to zero)
                if done == P - 1:
                    if HIST_SHIFT > 0:
                        _hist_clear(hrow, HIST_SHIFT)
                    tl.atomic_xchg(count_ptr + t, 0)
            elif done == P - 1:  # every part has written its region: select among them
                if HIST_SHIFT > 0:  # every part has read the histogram (before its count above)
                    _hist_clear(hrow, HIST_SHIFT)
                pi = tl.arange(0, PP)
                cnts = tl.load(part_ptr + t64 * P + pi, mask=pi < P, other=0, cache_modifier=".cg")
                total = tl.sum(cnts, axis=0)
                if MAP:  # staged, then in entry-id order
                    _final_take(srow, prow, cnts, total, SL, K, stage, PP, FBLOCK, RADIX_BITS, SPAN)
                    _sort_row(stage, tl.minimum(total, K), orow, KOUT, KP, RB)
                else:
                    _final_take(srow, prow, cnts, total, SL, K, orow, PP, FBLOCK, RADIX_BITS, SPAN)
                # the row's counter back to zero for the next call (`tile_counters`): every part
                # of the row has counted, so nothing else touches it in this launch
                tl.atomic_xchg(count_ptr + t, 0)


@triton.jit
def _pool_row(max_ptr, nvis_ptr, out_ptr, work_ptr, t, N, G, NBLK, B: tl.constexpr, BLOCK: tl.constexpr,
              RADIX_BITS: tl.constexpr):
    """Query row t's hierarchical candidate pool (`_pool_kernel`). A row of at most BLOCK blocks
    stays on registers, on the smallest of the tiles BLOCK / 8, BLOCK / 2 and BLOCK that holds its
    reachable blocks (chosen at run time from its visible count: the rows' block tables are as
    wide as the longest context, so the width says nothing); a longer one goes through work_ptr,
    tile by tile."""
    t64 = t + tl.zeros([], dtype=tl.int64)
    nv = tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), N)
    gv = (nv + B - 1) // B  # reachable blocks
    mrow = max_ptr + t64 * G
    orow = out_ptr + t64 * NBLK
    cols = tl.arange(0, BLOCK)
    for c0 in range(tl.minimum(gv, NBLK), NBLK, BLOCK):  # past the chosen blocks
        c = c0 + cols
        tl.store(orow + c, tl.full([BLOCK], -1, dtype=tl.int32), mask=c < NBLK)
    if gv <= BLOCK // 8:
        _pool_row_regs(mrow, orow, gv, NBLK, BLOCK // 8, RADIX_BITS)
    elif gv <= BLOCK // 2:
        _pool_row_regs(mrow, orow, gv, NBLK, BLOCK // 2, RADIX_BITS)
    elif gv <= BLOCK:
        _pool_row_regs(mrow, orow, gv, NBLK, BLOCK, RADIX_BITS)
    else:
        _pool_row_tiles(mrow, work_ptr + t64 * G, orow, gv, NBLK, BLOCK, RADIX_BITS)


@triton.jit
def _pool_row_regs(mrow, orow, gv, NBLK, TILE: tl.constexpr, RADIX_BITS: tl.constexpr):
    """`_pool_row` for a row of gv <= TILE reachable blocks: one load (the newest block raised to
    +inf), the radix passes and the ordered take on registers."""
    cols = tl.arange(0, TILE)
    m = cols < gv
    key = _order_key(tl.where(cols == gv - 1, float("inf"), tl.load(mrow + cols, mask=m, other=0.0)))
    if gv > NBLK:
        thr, need = _kth_of_keys(key, m, NBLK, RADIX_BITS)
    else:  # every reachable block
        thr = tl.full([], -2147483648, dtype=tl.int32)
        need = tl.zeros([], dtype=tl.int32)
    take, _ = _take_flags(key, m, thr, need, 0)
    tl.store(orow + tl.cumsum(take, axis=0) - take, cols, mask=take != 0)


@triton.jit
def _pool_row_tiles(mrow, wrow, orow, gv, NBLK, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """`_pool_row` for a row past one tile: the maxima (the newest raised) copied to wrow, the
    radix passes and the ordered take over it tile by tile."""
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, gv, BLOCK):
        c = c0 + cols
        x = tl.load(mrow + c, mask=c < gv, other=0.0)
        tl.store(wrow + c, tl.where(c == gv - 1, float("inf"), x), mask=c < gv)
    tl.debug_barrier()  # the raised maxima, written by every thread of the program, are read back
    thr = tl.full([], -2147483648, dtype=tl.int32)  # every reachable block, unless more than NBLK
    need = tl.zeros([], dtype=tl.int32)
    if gv > NBLK:
        thr, need = _kth_key(wrow, gv, NBLK, BLOCK, RADIX_BITS)
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, gv, BLOCK):  # the chosen blocks, in order
        c = c0 + cols
        m = c < gv
        take, eq = _take_flags(_order_key(tl.load(wrow + c, mask=m, other=0.0)), m, thr, need, n_eq)
        pos = n_sel + tl.cumsum(take, axis=0) - take
        tl.store(orow + pos, c, mask=take != 0)
        n_sel += tl.sum(take, axis=0)
        n_eq += tl.sum(eq, axis=0)


@triton.jit
def _pool_kernel(max_ptr, nvis_ptr, out_ptr, work_ptr, T, N, G, NBLK, num_programs,
                 B: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, PDL: tl.constexpr = 0):
    """Per query row (persistent loop): the hierarchical candidate pool of
    `reference.attention.candidate_pool` from the row's block maxima (max_ptr [T, G], one per B
    entries, entries past n_visible excluded, written by the scores kernel): the reachable
    blocks (those holding a visible entry) with the newest one forced in (+inf), the best NBLK
    of them by radix select (ties to the older block), their ids in ascending order (int32
    out_ptr [T, NBLK]), -1 after the chosen blocks. work_ptr [T, G]: scratch for rows past one
    BLOCK tile (their maxima with the newest one raised, read back every radix pass); rows
    within one tile are selected on registers (`_pool_row`)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    for t in range(pid, T, num_programs):
        _pool_row(max_ptr, nvis_ptr, out_ptr, work_ptr, t, N, G, NBLK, B, BLOCK, RADIX_BITS)


def pool_select(maxima: torch.Tensor, n_visible: torch.Tensor, n: int, n_blocks: int, block: int,
                radix_bits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.attention.candidate_pool` (scores [T, n]) from the scores' block maxima [T,
    ceil(n / block)] (one per `block` entries, invisible entries excluded) in one Triton launch:
    [T, min(n_blocks, blocks)] int32 block ids, ascending, -1 padded (into `out` when given).
    `block` a power of two; `radix_bits` as `topk_select`'s."""
    from .launch import grid_for, interpreting

    radix = _radix_bits(radix_bits)
    t, g = maxima.shape
    if block & (block - 1) or g != -(-n // block):
        raise ValueError(f"block maxima {tuple(maxima.shape)} do not fit {n} entries in blocks of {block} "
                         "(a power of two)")
    n_blocks = min(n_blocks, g)  # as the reference: the best min(n_blocks, blocks) blocks
    out = _pool_out(out, t, n_blocks, maxima.device)
    if t == 0 or n_blocks == 0:
        return out
    # the select's tile (blocks are not expanded to entries here: one block a lane; the
    # interpreter's 16 keeps its tests on the multi-tile loops)
    blk = SELECT_BLOCK_NPU if maxima.device.type == "npu" else POOL_BLOCK
    work = torch.empty(t, g, dtype=torch.float32, device=maxima.device)
    grid = grid_for(t, maxima.device)
    extra = {} if interpreting() else {"num_warps": SELECT_WARPS}
    _pool_kernel[(grid,)](maxima.contiguous(), n_visible.contiguous(), out, work, t, n, g, n_blocks, grid,
                          B=block, BLOCK=16 if interpreting() else blk, RADIX_BITS=radix, **extra, **pdl_launch(out))
    return out


def _pool_out(out: torch.Tensor | None, t: int, n_blocks: int, device) -> torch.Tensor:
    """The candidate pool's output [t, n_blocks] int32: `out` checked, or a new tensor."""
    if out is None:
        return torch.empty(t, n_blocks, dtype=torch.int32, device=device)
    if out.shape != (t, n_blocks) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"pool out {tuple(out.shape)} {out.dtype} must be a contiguous int32 [{t}, {n_blocks}]")
    return out


def _radix_bits(bits: int | None) -> int:
    """The radix select's digit width: `bits`, or the module default RADIX_BITS, checked."""
    bits = RADIX_BITS if bits is None else int(bits)
    if bits not in RADIX_BITS_CHOICES:
        raise ValueError(f"radix_bits must be one of {RADIX_BITS_CHOICES} (digits that tile 32 bits), got {bits}")
    return bits


def select_chunk(n: int, k: int, block_n: int, per_k: int | None = None) -> int:
    """Entries per chunk maximum (a power of two dividing the scores kernel's BLOCK_N): about
    per_k * k maxima per row (default SELECT_MAXIMA_PER_K), so their k-th largest is a tight
    bound and only about 1 / per_k of the row's chunks are read again."""
    per_k = per_k or SELECT_MAXIMA_PER_K
    g = 1
    while g * 2 <= block_n and n // (g * 2) >= per_k * k:
        g *= 2
    return g


def topk_select(scores: torch.Tensor, n_visible: torch.Tensor | None, k: int, maxima: torch.Tensor | None = None,
                maxg: int = 1, *, candidates: torch.Tensor | None = None, block: int | None = None,
                capacity: int | None = None, num_warps: int | None = None,
                min_maxima_per_k: int | None = None, radix_bits: int | None = None,
                survivor_block: int | None = None, bound_passes: int | None = None,
                span: bool | None = None, parts: int | None = None, candidate_block_size: int = 1,
                merge: int | None = None, pool_out: torch.Tensor | None = None,
                pool_n: int = 0, hist: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's `_stable_topk_sorted(scores, k, arange < n_visible)` for finite visible
    scores, in one Triton launch (a program per query row, no host sync): [T, min(k, N)] int64.
    `maxima` [T, ceil(N / maxg)]: each row's maximum over every `maxg` entries (entries past
    n_visible excluded), which bounds the selection when there are enough of them (at least
    `min_maxima_per_k` (default SELECT_MAXIMA_MIN_PER_K, or SPLIT_MAXIMA_MIN_PER_K for the split
    select) * k chunks; otherwise the direct select is cheaper).
    With `candidates` [T, N / candidate_block_size] (ids of blocks of that many entries, 1: entry
    ids; -1 padding): the Reindex selection, `_stable_topk_sorted(scores, k, entries >= 0)`
    over the candidates' entries (`reference.attention.pool_entries`; entries >= n_visible[t]
    are invalid when n_visible is given; invalid columns' scores are -inf) and sorted by entry
    id (-1 padded), as `reference.attention.indexer_topk`.
    `hist`: the bound histograms the scores kernel counted the maxima into (`_scores(...,
    hist=)`): the split select takes its bound from them and zeroes them; any other path
    zeroes them here (the buffer must be zero for the next call).
    `radix_bits`: the radix select's digit width (RADIX_BITS_CHOICES; default RADIX_BITS).
    `survivor_block`: the tile of the bounded path's survivor select (a power of two >= k, at
    most `block`; default SELECT_SURVIVOR_BLOCK, 0 = `block`).
    `bound_passes`: radix passes of the chunk-maxima bound over the maxima's span (a lower bound
    of their k-th largest; default SELECT_BOUND_PASSES, 0 = the exact k-th by full passes).
    `span`: the survivors' exact select passes over their span only (default SELECT_SPAN).
    `parts`: with a maxima bound (dense), the row's select split over this many programs
    (`_split_select_kernel`; then `survivor_block` is the final select's tile, default
    SPLIT_FINAL_BLOCK); None: `select_parts`; 0: the one-program-per-row kernel.
    `merge`: the split select's bound over the maxima of up to this many neighbouring chunks
    (`_maxima_bound`; default SPLIT_BOUND_MERGE).
    `pool_out` [T, pool_n] int32 (dense rows with maxima of pool blocks of maxg entries): also
    the candidate pool of `pool_select`, of pool_n blocks, from the same maxima; where the split
    select runs, in its launch by programs beside the select's (POOL_BESIDE_SELECT), else by
    `pool_select`."""
    from .launch import grid_for, interpreting

    radix = _radix_bits(radix_bits)
    merge = _bound_merge(merge)  # (checked whichever path runs)
    t, n = scores.shape
    kout = min(k, n)
    out = torch.empty(t, kout, dtype=torch.long, device=scores.device)
    if pool_out is not None and (candidates is not None or maxima is None):
        raise ValueError("the candidate pool comes from a dense row's block maxima (no candidates)")
    if t == 0 or kout == 0:
        if pool_out is not None and t:
            pool_select(maxima, n_visible, n, pool_n, maxg, radix_bits, out=pool_out)
        if hist is not None:
            hist.zero_()
        return out
    blk = block or (64 if interpreting() else SELECT_BLOCK_NPU if scores.device.type == "npu" else SELECT_BLOCK)
    cap = capacity or max(SELECT_CAPACITY, _pow2(4 * k))
    mapped = candidates is not None
    cb = int(candidate_block_size)
    if mapped and (cb < 1 or candidates.dim() != 2 or candidates.shape[0] != t or candidates.shape[1] * cb != n):
        raise ValueError(f"candidates {tuple(candidates.shape)} in blocks of {candidate_block_size} do not match "
                         f"scores {tuple(scores.shape)}")
    if not mapped and n_visible is None:
        raise ValueError("topk_select needs n_visible (or candidates)")
    sblk = SELECT_SURVIVOR_BLOCK if survivor_block is None else survivor_block
    sblk = blk if not sblk else min(sblk, blk)
    if sblk & (sblk - 1):
        raise ValueError(f"survivor_block {sblk} must be a power of two")
    if parts is None:
        parts = select_parts(t, scores.device) if maxima is not None else 0
    split = bool(parts) and scores.device.type != "npu"
    if min_maxima_per_k is None:
        per_k = SPLIT_MAXIMA_MIN_PER_K if split else SELECT_MAXIMA_MIN_PER_K
    else:
        per_k = min_maxima_per_k
    # (the one-program kernel's Reindex path has no bound: only the split select takes the
    # candidate columns' maxima)
    use_max = maxima is not None and (split or not mapped) and maxg > 1 and maxima.shape[1] >= per_k * k
    if use_max and (blk % maxg or maxima.shape[0] != t):
        raise ValueError(f"maxima {tuple(maxima.shape)} every {maxg} do not fit block {blk} / {t} rows")
    if hist is not None and (mapped or not (split and use_max)):
        hist.zero_()  # (counted for a bound this path does not take)
        hist = None
    if split and use_max:
        beside = pool_out is not None and POOL_BESIDE_SELECT
        _split_select(scores, maxima, maxg, n_visible, out, k, parts, blk, radix,
                      SPLIT_FINAL_BLOCK if survivor_block is None else survivor_block,
                      SELECT_SPAN if span is None else bool(span), num_warps, merge=merge,
                      candidates=candidates if mapped else None, candidate_block_size=cb,
                      pool=(pool_out, pool_n) if beside else None, hist=hist)
        if pool_out is not None and not beside:
            pool_select(maxima, n_visible, n, pool_n, maxg, radix_bits, out=pool_out)
        return out
    if pool_out is not None:
        pool_select(maxima, n_visible, n, pool_n, maxg, radix_bits, out=pool_out)
    if (block is None and not use_max and not mapped and scores.device.type == "cuda" and not interpreting()
            and blk < n <= SELECT_WIDE_BLOCK):
        blk = SELECT_WIDE_BLOCK  # a row just past one tile: one wide tile, not two tiles a pass
    g = maxima.shape[1] if use_max else 1
    surv_s = torch.empty(t if use_max else 1, cap, dtype=torch.float32, device=scores.device)
    surv_p = torch.empty(t if use_max else 1, cap, dtype=torch.int32, device=scores.device)
    chunks = torch.empty(t, g, dtype=torch.int32, device=scores.device)  # a row's listed chunks
    grid = grid_for(t, scores.device)
    extra = {} if interpreting() else {"num_warps": num_warps or SELECT_WARPS}
    cand = candidates.contiguous() if mapped else out  # (unused pointers unless mapped)
    stage = torch.empty(t, _pow2(kout), dtype=torch.long, device=scores.device) if mapped else out
    nvis = n_visible.contiguous() if n_visible is not None else out
    _topk_select_kernel[(grid,)](scores.contiguous(), maxima.contiguous() if use_max else scores,
                                 nvis, out, chunks, surv_s, surv_p, cand, stage, t, n, g, k, kout, grid,
                                 MAXG=maxg if use_max else 1, CAP=cap, USE_MAX=use_max, BLOCK=blk,
                                 RADIX_BITS=radix, MAP=mapped, KP=_pow2(kout),
                                 RB=sort_rows(_pow2(kout), scores.device.type == "npu"), SBLOCK=sblk,
                                 BOUND_PASSES=SELECT_BOUND_PASSES if bound_passes is None else int(bound_passes),
                                 SPAN=SELECT_SPAN if span is None else bool(span), CB=cb if mapped else 1,
                                 MAP_NV=mapped and n_visible is not None, **extra, **pdl_launch(nvis))
    return out


def select_parts(t: int, device: torch.device) -> int:
    """Programs per row for the split select (`_split_select_kernel`) of t rows: SPLIT_PARTS,
    halved while t rows of them would pass SPLIT_PROGRAMS_PER_WORKER programs per worker; 0 (the
    one-program-per-row kernel) above SPLIT_MAX_T rows and on Ascend (atomics, `.cg` loads)."""
    from .launch import num_workers

    if device.type == "npu" or t > SPLIT_MAX_T or SPLIT_PARTS <= 0:
        return 0
    parts, room = SPLIT_PARTS, SPLIT_PROGRAMS_PER_WORKER * num_workers(device)
    while parts > 1 and t * parts > room:
        parts //= 2
    return parts


def maxima_per_k(t: int, device, parts: int | None = None) -> int:
    """Chunk maxima per k that the scores kernel writes for t rows (`select_chunk`):
    SPLIT_MAXIMA_PER_K when the split select will take them (`select_parts`, or `parts` when the
    caller has it), else SELECT_MAXIMA_PER_K (the one-program kernel's survivors grow as the
    maxima thin out)."""
    if parts is None:
        parts = select_parts(t, device)
    return SPLIT_MAXIMA_PER_K if parts else SELECT_MAXIMA_PER_K


def scores_chunk(t: int, n: int, k: int, block_n: int, device) -> int:
    """Entries per chunk maximum the scores kernel writes for t rows of n entries (1: none):
    `select_chunk` at `maxima_per_k`. Rows past one select tile that would get none there (a
    4K context plus the step's token: 4097+ entries, which the direct select reads as two
    tiles per radix pass) get SPLIT_SHORT_MAXIMA_PER_K per k when the split select runs: a row
    visible in fewer than k of those chunks is selected whole by one program, as without them."""
    parts = select_parts(t, device)
    g = select_chunk(n, k, block_n, maxima_per_k(t, device, parts))
    if g == 1 and parts and n > SELECT_BLOCK:
        g = select_chunk(n, k, block_n, SPLIT_SHORT_MAXIMA_PER_K)
    return g


def bound_histogram(t: int, device) -> torch.Tensor | None:
    """The zeroed int32 histograms [t, 2^(32 - SPLIT_BOUND_HIST_SHIFT)] (flat) of t rows' chunk
    maxima for the split select's bound, or None where that bound is off (the shift 0) or the
    split select does not run for t rows (`select_parts`). One buffer per device and stream
    (`tile_counters`, its own purpose): the scores kernel counts into it and the select's launch
    right after zeroes it again, so no memset runs per call."""
    from .launch import tile_counters

    device = torch.device(device)
    if SPLIT_BOUND_HIST_SHIFT <= 0 or not select_parts(t, device):
        return None
    return tile_counters(device, t << (32 - SPLIT_BOUND_HIST_SHIFT), "indexer_bound")


def _hist_shift(hist: torch.Tensor | None, t: int) -> int:
    """The kernels' HIST_SHIFT for a bound histogram buffer of t rows (0 without one)."""
    if hist is None:
        return 0
    shift = SPLIT_BOUND_HIST_SHIFT
    if not 0 < shift < 32 or hist.dtype != torch.int32 or hist.numel() < t << (32 - shift):
        raise ValueError(f"bound histogram {hist.dtype} [{hist.numel()}] does not hold {t} rows of "
                         f"2^{32 - shift} int32 bins")
    return shift


def _bound_merge(merge: int | None) -> int:
    """The split select's bound merge (`merge` or SPLIT_BOUND_MERGE), one of 1, 2, 4."""
    merge = SPLIT_BOUND_MERGE if merge is None else int(merge)
    if merge not in (1, 2, 4):
        raise ValueError(f"merge {merge}: the split select's bound merges 1, 2 or 4 chunk maxima")
    return merge


def _split_select(scores, maxima, maxg, n_visible, out, k, parts, blk, radix, final_block, span, num_warps,
                  _stop=0, merge=None, candidates=None, candidate_block_size=1, pool=None, hist=None):
    """`topk_select`'s bounded select on `_split_select_kernel`: `parts` programs per row
    (slices of the row's entries), the final select on a `final_block` tile. `merge`: the most
    neighbouring chunk maxima the bound merges (1, 2 or 4; default SPLIT_BOUND_MERGE; taken only
    without span passes and with the maxima on one tile). `candidates`: the Reindex selection
    (the kernel's MAP; n_visible may then be None). `pool` (out [T, n_blocks] int32, n_blocks):
    the candidate pool of the maxima's blocks (`pool_select`) by T more programs of the launch
    (the kernel's POOL). `hist`: the maxima's bound histograms (`bound_histogram`, counted by the
    scores kernel; dense rows only), read for the bound and zeroed (the kernel's HIST_SHIFT).
    `_stop`: the kernel's STOP (timing its stages)."""
    from .launch import grid_for, interpreting, tile_counters

    t, n = scores.shape
    g = maxima.shape[1]
    sl = -(-n // max(1, min(int(parts), n)))  # entries per part
    p = -(-n // sl)
    pp = _pow2(p)
    fb = max(_pow2(final_block or SPLIT_FINAL_BLOCK), pp, 16)
    mapped = candidates is not None
    kp = _pow2(out.shape[1])
    if mapped:  # fewer than K valid survivors must fit the one-tile take (`_region_take`)
        fb = max(fb, _pow2(k))
    merge = _bound_merge(merge)
    # the maxima on one tile when they fit (else `_kth_key` loops over tiles every pass); a merged
    # bound loads up to SPLIT_BOUND_WIDE of them at once
    mblock = min(_pow2(g), blk if span or merge == 1 else max(blk, SPLIT_BOUND_WIDE))
    if span or g > mblock or mblock < merge:
        merge = 1  # (span passes, or maxima past one tile: the plain bound)
    surv_s = torch.empty(t, n, dtype=torch.float32, device=scores.device)
    surv_p = torch.empty(t, n, dtype=torch.int32, device=scores.device)
    part = torch.empty(t, p, dtype=torch.int32, device=scores.device)
    grid = grid_for(t * p, scores.device)
    extra = {} if interpreting() else {"num_warps": num_warps or SPLIT_WARPS}
    stage = torch.empty(t, kp, dtype=torch.long, device=scores.device) if mapped else out
    nvis = n_visible.contiguous() if n_visible is not None else out
    pool_out, n_pool, work = out, 0, out  # (unused pointers without a pool)
    if pool is not None:
        if mapped or maxg & (maxg - 1) or g != -(-n // maxg):
            raise ValueError(f"a pool of blocks of {maxg} entries comes from a dense row's maxima of those blocks")
        n_pool = min(pool[1], g)
        pool_out = _pool_out(pool[0], t, n_pool, scores.device)
        work = torch.empty(t, g, dtype=torch.float32, device=scores.device)
    pool_programs = t if pool is not None and n_pool > 0 else 0
    if hist is not None and mapped:
        raise ValueError("the bound histogram is a dense row's (the Reindex selection's scores kernel writes none)")
    shift = _hist_shift(hist, t)
    _split_select_kernel[(grid + pool_programs,)](scores.contiguous(), maxima.contiguous(), nvis, out, surv_s,
                                  surv_p, part, tile_counters(scores.device, t),
                                  candidates.contiguous() if mapped else out, stage, pool_out, work,
                                  hist if shift else part, n_pool,
                                  max(pool_programs, 1), t, n, g, k, out.shape[1], sl, p,
                                  grid, MAXG=maxg, MBLOCK=mblock, SBLOCK=min(blk, _pow2(sl)), FBLOCK=fb, BLOCK=blk,
                                  PP=pp, RADIX_BITS=radix, SPAN=span and g <= mblock, MERGE=merge,
                                  PER_K=SPLIT_BOUND_PER_K, STOP=_stop, MAP=mapped,
                                  CB=int(candidate_block_size) if mapped else 1,
                                  MAP_NV=mapped and n_visible is not None, KP=kp,
                                  RB=sort_rows(kp, scores.device.type == "npu"), POOL=pool_programs > 0,
                                  POOL_BLOCK=16 if interpreting() else POOL_BLOCK, HIST_SHIFT=shift, **extra,
                                  **pdl_launch(nvis))
    return out


SELECT_BLOCK = 4096  # values per iteration of the selection passes (compiled); a set this small stays in registers
SELECT_BLOCK_NPU = 2048  # within half the unified buffer (tests/test_triton_ub.py)
SELECT_WARPS = 16  # sm_90 ptxas: 115 registers at BLOCK 4096 (8 warps: 191)
# dense rows of SELECT_BLOCK < n <= SELECT_WIDE_BLOCK entries without chunk maxima (the mini
# step's candidate-pool layer at a 4K context: 4160 entries, maxima of 8-entry pool blocks too few
# to bound; decode batches' rows) take one tile of this width (CUDA). H200, 2026-12-02 (select
# alone, T=1, 16 warps): 4160 entries 32.2 us on two 4096 tiles, 26.9 on one 8192 tile (26.7 at
# 4096 entries, so rows within one tile keep SELECT_BLOCK); in the mini step 31.5 -> 26.3 us. The
# Reindex selection keeps two tiles: alone on pool-ordered candidates one 8192 tile measured 28.2
# against 31.2, but the mini step's Reindex select took 38.7 us with it (31.4 with two tiles).
SELECT_WIDE_BLOCK = 8192
SELECT_CAPACITY = 4096  # survivor buffer per row (at least 4 k)
SELECT_MAXIMA_PER_K = 8  # chunk maxima per row, in units of k
SORT_ROWS = 32  # ids ranked at a time when the Reindex selection is put in entry-id order
SORT_ELEMS_NPU = 4096  # the comparison tile's elements on Ascend (unified buffer)
SELECT_MAXIMA_MIN_PER_K = 4  # fewer chunk maxima than this many k: the bound would keep most scores
# the survivor select's tile (0: SELECT_BLOCK; see topk_select): at 64K entries and k = 512 about
# 500-600 scores survive the chunk-maxima bound, so a 1024 tile does a quarter of the radix work;
# H200, T=1 at 64K, the whole op (with the rows scores kernel): 49.7 -> 41.5 us (2026-12-01)
SELECT_SURVIVOR_BLOCK = 1024
# radix passes over the span of the chunk maxima's keys for their bound (0: the exact k-th
# largest by full passes), and whether the survivors' select passes over their span only.
# H200 (triton 3.6, T=1 at 64K, whole op, CUDA-graph time; 2026-12-01 08:21 and 08:27 UTC, two
# random inputs): exact bound 41.6 / 42.0 us; exact + span 41.3 / 41.8; 3 passes + span
# 40.1 / 40.6 (T=8: 105.2 against 107.0, T=64: 582.6 against 580.3); 2 passes + span 43.2 /
# 339.4. So a radix pass costs ~0.2-0.3 us here: the passes are not what the select's 29 us
# (graph, alone; its launch floor 1.8 us) is made of. Not the default: the passes' resolution is
# a fraction of the keys' span, and maxima straddling zero span ~2^31 keys (on the CPU, inputs
# drawn as the benchmark draws them, seed 0: 2 passes kept 3061 chunks, 5458 survivors, past
# SELECT_CAPACITY, so the whole-row select runs: likely the 339 us; 3 passes 817 chunks / 920
# survivors, 4 passes 523, exact 512), so a coarse bound can cost a row the whole-row select
# for a ~1.4 us gain.
SELECT_BOUND_PASSES = 0
SELECT_SPAN = False
# the split select (`_split_select_kernel`): programs per row (at most), up to how many rows, the
# program budget per worker that halves the parts for larger batches, its final tile and warps.
# H200 (triton 3.6, 64K entries, top-512, CUDA-graph time, whole op; 2026-12-01 14:00 UTC, one
# run; benchmarks/RESULTS.md): T=1 one-program select 41.8 us, split 8 / 16 / 32 parts 40.5 /
# 39.0 / 37.1 us (16 with span passes 39.3, with 8 warps 42.4); the select alone 28.7 -> 26.0 us
# (16 parts). T=64 (rows of different sequences): one-program 616.6 us, split 2 / 4 parts per row
# 639.6 / 657.4: slower, so only T=1 takes it.
# Chunk maxima per k that the scores kernel writes when the split select takes them, and the
# fewest per k that still bound it: every part repeats the bound's radix passes over all the
# maxima, so fewer maxima shorten every part, and the extra survivors only fill the one final
# tile. H200, 2026-12-01 ~16:25 UTC, one run, ids equal to the official-mode reference in every
# row: T=1 at 64K, 16 parts with 8 / 4 / 2 maxima per k 39.3 / 34.7 / 33.5 us, 32 parts 36.9 /
# 33.3 / 32.3 (the dispatch with 32 x 2 as its default, 32.4; scores kernel alone 12.8); T=1 at 4K (2 per k
# is the only one that writes maxima there, of 2 entries) 20.0-20.6 against the direct select's
# 19.8; T=8 at 64K the one-program select 111.4, split 16 x 8 / 16 x 2 / 32 x 2 109.2 / 112.6 /
# 118.1, so batches keep it (SPLIT_MAX_T).
# Default 8 per k (the one-program kernel's): 2 per k was 4.6 us faster at a full 64K row but
# leaves rows below N / 2 visible entries without a bound (module docstring); merging fine maxima
# by a factor chosen from the visible count at run time would give both (not built).
SPLIT_PARTS = 32
SPLIT_MAX_T = 1
SPLIT_MAXIMA_PER_K = 8
# rows just past one select tile (SELECT_BLOCK < n < 2 * SPLIT_MAXIMA_PER_K * k: no maxima at 8
# per k) take this many per k instead (`scores_chunk`), and the split select accepts maxima down
# to SPLIT_MAXIMA_MIN_PER_K per k (only those rows have fewer than 8)
SPLIT_SHORT_MAXIMA_PER_K = 2
SPLIT_MAXIMA_MIN_PER_K = 2
# The split select's bound over the maxima of up to SPLIT_BOUND_MERGE neighbouring chunks while
# SPLIT_BOUND_PER_K per k of them remain (`_maxima_bound`, decided per row from its visible
# chunks): a full row's bound on 2 per k (4.6-5 us faster at a full 64K row than 8 per k, above),
# the fine 8 per k still bounding rows with an eighth of their entries visible. H100 2026-12-06
# (`sweep_kernels.py --only indexer_topk --tokens 1`, CUDA-graph time, the whole op at 64K, ids
# equal to the reference's): merge 4 / none, all entries visible 28.0 / 34.1 us, half 30.0 / 33.6,
# a quarter 30.8 / 30.6 (no merge left there); the bound alone 12.9 -> 6.6 us (32 parts).
SPLIT_BOUND_MERGE = 4
SPLIT_BOUND_PER_K = 2
# The split select's bound from a histogram of the chunk maxima (`_count_maxima` in the rows scores
# kernel, `_hist_bound` in the select; 0 turns it off, leaving the merged radix bound above): the
# bins are the order keys' top 32 - SHIFT bits (19: 8192 bins, the sign, the exponent and 4
# mantissa bits, so the bound lies at most 1/16 of the value below the K-th largest maximum). Every
# part then loads 32 KB and takes one prefix sum instead of the radix passes over the maxima, and
# the fine maxima (8 per k) bound every row, merged or not.
HIST_SHIFT_DEFAULT = 19
SPLIT_BOUND_HIST_SHIFT = HIST_SHIFT_DEFAULT
# the most chunk maxima a merged bound takes on one tile: up to 8192 the merged bound loads a row's
# maxima at once instead of the unmerged bound's looped passes over 4096 tiles in every part (the
# pool source's rows past 32K: one maximum per 8-entry pool block, 8192 of them at 64K). sm_90a:
# 128 registers, 32 bytes of spill (44 for the 4096 form). H100 2026-12-06 (`sweep_kernels.py
# --only reindex`, T=1, the pool source's whole op with the pool beside the select, ids and pool
# equal to the reference's): 64K 50.7 -> 38.8 us, 32K (4096 maxima: one tile either way) 36.3 /
# 36.2; the mini batch-1 step at 32K unchanged (2.008 / 2.008 ms).
SPLIT_BOUND_WIDE = SELECT_WIDE_BLOCK
# the Reindex selection of a decode row on the split select: the gather scores kernel writes the
# candidate columns' chunk maxima and `_split_select_kernel` takes them (MAP), instead of one
# program's whole-row select over every candidate (the mini step's Reindex layer at 32K: 8192
# candidates, one program ~60 us in the step). H100 2026-12-06 (`sweep_kernels.py --only
# reindex`, T=1, 8192 candidates, CUDA-graph time, ids equal to the reference's): the whole op
# 35.1 / 35.6 -> 20.3 / 20.5 us (two calls); the step: benchmarks/RESULTS.md, session thirty-seven.
SPLIT_CANDIDATES = True
# the candidate pool's largest register tile on CUDA (`_pool_row`): a row of up to this many
# reachable blocks is loaded once and selected on registers, on the smallest of the tiles POOL_BLOCK
# / 8, / 2 and POOL_BLOCK that holds it, chosen per row at run time (longer rows: once per radix
# pass per tile, through a scratch copy). H100 2026-12-06 (`sweep_kernels.py --only reindex`, T=1,
# the mini preset's 8-entry pool blocks, CUDA-graph time; before the run-time choice, one tile for
# every row): the pool alone at 32K (4096 blocks) 13.5 us on a 4096 tile, 24.9 on an 8192 one; at
# 64K (8192 blocks) 36.2 on 4096 tiles through the scratch, 24.9 on one 8192 tile; the pool
# source's whole op with the pool beside the select at 32K 24.7 us (4096) against 36.3 (8192).
POOL_BLOCK = SELECT_WIDE_BLOCK
# the candidate pool made by programs of the split select's launch, beside its parts (T=1 rows
# whose select splits), instead of a `pool_select` launch after it: in the mini step at 32K the
# pool's one program took ~36 us on the critical path after the select. H100 2026-12-06 (T=1,
# the pool source's whole op, ids and pool equal to the reference's; 32K entries in 4-entry pool
# blocks, 8192 of them: 81.6 / 82.7 -> 46.1 / 46.4 us on 4096-block tiles, 71.4 -> 47.1 on one 8192
# tile; the mini preset's 8-entry blocks at 32K: 38.2 -> 24.7 us on a 4096 tile).
POOL_BESIDE_SELECT = True
SPLIT_PROGRAMS_PER_WORKER = 2
SPLIT_FINAL_BLOCK = 1024
SPLIT_WARPS = 16
RADIX_BITS = RADIX_BITS_DEFAULT
# 8 passes of 2 * 16 bins, or 4 passes of 2 * 256 bins; on the H200 (T=1, 64K) 8-bit digits were
# slower, 78.2 against 52.4 us for the whole op (tl.histogram's cost grows with its bins)
RADIX_BITS_CHOICES = (4, 8)


# ---- selection (torch) ------------------------------------------------------------------------

def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """`_order_key` in torch: fp32 scores -> int32 keys whose signed order is the scores' order
    (-0.0 folded into +0.0, which tie under float comparison)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores.float())
    b = s.contiguous().view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def _topk_sorted(scores: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Same result as `reference.attention._stable_topk_sorted` (top-k column ids among `valid`,
    ties to the lower id, ascending, -1 padded) for finite scores, through torch.topk on
    distinct int64 keys instead of a full stable sort."""
    t, n = scores.shape
    k = min(k, n)
    if k == 0:
        return torch.empty(t, 0, dtype=torch.long, device=scores.device)
    b = order_keys(scores).long()  # order-preserving fp32 -> int, -0.0 ties with +0.0
    pos = torch.arange(n, device=scores.device)
    key = (b << 32) | (n - 1 - pos)
    lowest = torch.iinfo(torch.long).min
    key = torch.where(valid, key, torch.full_like(key, lowest))
    top = torch.topk(key, k, dim=-1, sorted=False).values
    big = torch.iinfo(torch.long).max
    ids = torch.where(top != lowest, (n - 1) - (top & 0xFFFFFFFF), torch.full_like(top, big)).sort(-1).values
    return torch.where(ids == big, torch.full_like(ids, -1), ids)


def _candidate_pool(scores: torch.Tensor, n_visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """`reference.attention.candidate_pool` with `_topk_sorted` for the block choice."""
    return candidate_pool(scores, n_visible, n_blocks, block, topk_sorted=_topk_sorted)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor,
                 block_table: torch.Tensor, entries_per_block: int, n_visible: torch.Tensor, topk: int,
                 candidates: torch.Tensor | None = None, pool_blocks: int = 0, pool_block_size: int = 1,
                 reduce_scores=None, candidate_block_size: int = 1,
                 _cfg: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ops.indexer_topk`: Triton scores over the paged key pool, then the Triton selections (top-k
    radix select, the Reindex selection over the candidates, the candidate pool from the scores
    kernel's block maxima): the reference's results, without a host sync. A long prefill is
    scored in chunks of queries so that one chunk's [rows, entries] fp32 scores stay within
    SCORE_CHUNK_ELEMS (the full [T, N] matrix is what grows quadratically). `_cfg`: the scores
    kernel's tiles (`_config`'s tuple; batch-invariant mode fixes them)."""
    n_visible = n_visible.to(q.device)
    t = q.shape[0]
    cb = candidate_block_size
    n = candidates.shape[1] * cb if candidates is not None else block_table.shape[1] * entries_per_block
    step = max(1, SCORE_CHUNK_ELEMS // max(1, n))
    if t <= step:
        return _indexer_topk_rows(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, topk,
                                  candidates, pool_blocks, pool_block_size, reduce_scores, cb, _cfg)
    idx = torch.empty(t, min(topk, n), dtype=torch.long, device=q.device)
    pool = torch.empty(t, min(pool_blocks, -(-n // pool_block_size)), dtype=torch.int32,
                       device=q.device) if candidates is None and pool_blocks > 0 else None
    for i in range(0, t, step):
        j = min(t, i + step)
        part, part_pool = _indexer_topk_rows(q[i:j], weights[i:j], key_codes, key_scale, block_table[i:j],
                                             entries_per_block, n_visible[i:j], topk,
                                             None if candidates is None else candidates[i:j], pool_blocks,
                                             pool_block_size, reduce_scores, cb, _cfg)
        idx[i:j] = part
        if pool is not None:
            pool[i:j] = part_pool
        # copied: freed before the next part is computed (else the previous part's pool stays
        # live beside the next one and the whole pool: 0.5 GiB at an 8192-token mini chunk)
        del part, part_pool
    return idx, pool


def _indexer_topk_rows(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, topk,
                       candidates, pool_blocks, pool_block_size, reduce_scores, candidate_block_size=1, _cfg=None):
    """`indexer_topk` for one chunk of queries (every output row depends on its query alone)."""
    # the pool comes from the scores kernel's maxima over its blocks (a power of two dividing
    # every BLOCK_N of tile_shape), which also bound the top-k select
    pool_maxima = (candidates is None and pool_blocks > 0 and reduce_scores is None
                   and pool_block_size & (pool_block_size - 1) == 0 and pool_block_size <= 64)
    # the split select's bound from a histogram of the maxima the scores kernel counts (dense rows
    # whose select splits; `bound_histogram`), handed from the scores launch to the select's
    hist = (bound_histogram(q.shape[0], q.device) if candidates is None and reduce_scores is None and topk > 0
            and _cfg is None and use_rows_kernel(q.shape[0], False) else None)
    s, maxima, maxg = _scores(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible,
                              candidates, topk=topk if reduce_scores is None else 0,
                              maxg=pool_block_size if pool_maxima else None, _cfg=_cfg,
                              candidate_block_size=candidate_block_size, hist=hist)
    if maxima is None:
        hist = None  # (nothing counted)
    if reduce_scores is not None:  # model parallel: add the other ranks' heads (-inf stays -inf)
        s = reduce_scores(s)  # (this rank's maxima would not bound the summed scores: none taken)
    if candidates is not None:
        return topk_select(s, n_visible, topk, maxima, maxg or 1, candidates=candidates,
                           candidate_block_size=candidate_block_size), None
    if pool_blocks > 0 and pool_maxima:  # the pool from the select's maxima (beside it where it can)
        pool = _pool_out(None, s.shape[0], min(pool_blocks, maxima.shape[1]), s.device)
        return topk_select(s, n_visible, topk, maxima, maxg, pool_out=pool, pool_n=pool_blocks, hist=hist), pool
    idx = topk_select(s, n_visible, topk, maxima, maxg or 1, hist=hist)
    if pool_blocks <= 0:
        return idx, None
    return idx, _candidate_pool(s, n_visible, pool_blocks, pool_block_size)


# `_indexer_rows_kernel` (one query per tile, the next block's keys loaded ahead): used for the
# dense scores of up to ROWS_MAX_T queries; tiles of NSUB (<= ROWS_NSUB_MAX) blocks of
# ROWS_BLOCK_N entries, ROWS_WARPS warps. H200 (2026-12-01, 64K context, CUDA-graph time): the
# scores at T=1 15.4 -> 12.7 us, at T=64 tokens of different sequences 1567 -> 426 us (the
# multi-query tiles' per-query path); benchmarks/RESULTS.md. Above ROWS_MAX_T (prefill chunks
# of one sequence) the multi-query tiles decode each key block once for several queries.
ROWS_MAX_T = 64
ROWS_BLOCK_N = 128
ROWS_NSUB_MAX = 8
ROWS_WARPS = 8
# the rows kernel's keys as int32 words through the experts' bf16x2 conversion (`_decode_key_words`),
# one dot over all channels, the keys on the dot's M side (KEYS_M) or N side. Written 2026-12-05
# (session thirty-five) for the batch-64 step at long contexts, where the byte decode's rows kernel
# took 426 us at T=64 / 64K on the H200 (255 registers and 168 bytes of spill at sm_90a, one 8-warp
# program an SM). H100 2026-12-06 (`sweep_kernels.py --only indexer_rows`, CUDA-graph time, each
# query on its own keys): the scores at T=64 / 64K 521.9 us (bytes) -> 521.8 (words, keys N) ->
# 348.3 (words, keys M), T=8 / 64K 67.3 -> 45.9, T=1 / 64K 12.4 -> 11.2; the whole `indexer_topk` at
# T=64 / 64K 734.3 -> 387.2 us; the mini batch-64 decode step at 32K 5.72 -> 5.45 ms (batch 1
# unchanged). So on, keys on M.
ROWS_WORDS = True
ROWS_KEYS_M = True
# queries x entries of fp32 scores per chunk of a long prefill (256 MiB)
SCORE_CHUNK_ELEMS = 1 << 26


OPS = {"indexer_topk": indexer_topk}
