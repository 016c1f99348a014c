"""The ops interface: the only way `dsv41.core` reaches a device.

Each function below is the contract of one op (signature + docstring); the body is a dispatch
to the implementation chosen by `dsv41.backends.registry` from the first tensor argument's
device (or `DSV41_BACKEND`). The reference implementations (plain torch, fp32 math) live in
`dsv41.backends.reference` and are the oracle every kernel is tested against.
"""

from __future__ import annotations

import functools
import inspect

import torch

from . import reference  # noqa: F401  (registers the reference implementations)
from .registry import backend_for_device, dispatch

Tensor = torch.Tensor


def partial_sum_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of unrounded partial sums that are all-reduced across model-parallel ranks
    before the one rounding (row-parallel `linear`, `moe_experts`): float64 on the reference
    backend (so N ranks reproduce 1 rank bit for bit), float32 on CUDA and Ascend (Atlas A2/A3
    have no fp64 matmul and HCCL no fp64 all-reduce). Callers pass it as `out_dtype`."""
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind == "npu" or backend_for_device(device) != "reference":
        return torch.float32
    return torch.float64


def _first_device(args, kwargs) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _op(stub=None, *, device_arg: str | None = None):
    """Turn a documented stub into the dispatching entry point of the op of the same name. The
    backend follows the first tensor argument's device, or the argument named `device_arg`."""
    if stub is None:
        return functools.partial(_op, device_arg=device_arg)
    name = stub.__name__
    pos = list(inspect.signature(stub).parameters).index(device_arg) if device_arg else None

    @functools.wraps(stub)
    def call(*args, **kwargs):
        if pos is None:
            device = _first_device(args, kwargs)
        else:
            device = (args[pos] if len(args) > pos else kwargs[device_arg]).device
        return dispatch(name, device)(*args, **kwargs)

    return call


# ---- formats --------------------------------------------------------------------------------
@_op
def fp4_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """[..., D] -> (packed E2M1 uint8 [..., D/2], E4M3 scales [..., D/16]) (main KV entries)."""


@_op
def fp4_dequant(packed: Tensor, scale: Tensor) -> Tensor:
    """Inverse of `fp4_quant`, fp32 out."""


@_op
def mxfp4_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """[..., D] -> (packed E2M1 uint8 [..., D/2], E8M0 scales [..., D/32]) (indexer keys)."""


@_op
def mxfp4_dequant(packed: Tensor, scale: Tensor) -> Tensor:
    """Inverse of `mxfp4_quant`, fp32 out."""


@_op
def mxfp4_act_quant(x: Tensor) -> Tensor:
    """Quantise-dequantise through MXFP4 (the indexer query), fp32 out."""


@_op
def fp8_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """[..., D] -> (E4M3 [..., D], E8M0 power-of-two scales [..., D/32]) (activations, SWA)."""


@_op
def fp8_dequant(q: Tensor, scale: Tensor) -> Tensor:
    """Inverse of `fp8_quant`, fp32 out."""


# ---- dense math -----------------------------------------------------------------------------
@_op
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight in fp32; output in x's dtype."""


@_op
def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate interleaved adjacent pairs of the LAST 2*cos.shape[-1] channels of x [T, ..., D]
    by the per-position angles (cos/sin [T, R/2]); `inverse` rotates back. Output x's dtype."""


@_op
def rope_tables(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos / sin [T, R/2] fp32 of the angles positions[t] * inv_freq[i] (positions reach 1M, so
    the angle must be formed in more than fp32 precision or from exact pieces)."""


@_op
def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """y = x @ W^T. With `scale`, W is stored FP8 E4M3 (E8M0 32x32 block scales) or packed FP4
    (int8 [N, K/2], E8M0 per 32 along K) and x is FP8-quantised in blocks of 32 first.
    `out_dtype` float64 asks for the unrounded accumulation (row-parallel partial sums; take it
    from `partial_sum_dtype`: on devices there is no fp64, CUDA returns fp32 and Ascend refuses).
    `scale` fp32 [N, 1] with an int8 W: per-output-channel INT8 weight (W8A8); x is then
    int8-quantised per token."""


@_op
def grouped_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Block-diagonal bf16 projection: x [T, G, K] with weight [G * R, K] (rows g*R..g*R+R-1
    belong to group g) -> [T, G * R] bf16 (the attention's `wo_a`)."""


@_op
def swiglu_clamped(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32."""


# ---- attention ------------------------------------------------------------------------------
@_op
def sparse_attention(q: Tensor, swa_kv: Tensor, swa_scale: Tensor, win_idx: Tensor,
                     glob_kv: Tensor | None, glob_scale: Tensor | None, glob_idx: Tensor | None,
                     sink: Tensor, softmax_scale: float, rows_bound: tuple[int, int] | None = None) -> Tensor:
    """One softmax over a query's SWA window entries then its selected global entries, read in
    place from the paged cache pools.

    q [T, H, D] (RoPE applied); swa_kv [Nw, D] FP8 + swa_scale [Nw, D/32] E8M0 (the rows of the
    layer's SWA block pool); win_idx [T, S]: the pool rows each query attends (-1 = masked);
    glob_kv [Ng, D/2] packed FP4 + glob_scale [Ng, D/16] (the rows of the KV source's global
    block pool), glob_idx [T, K] pool rows (-1 = masked); sink [H]. K = V. Duplicated rows count
    as often as they appear. Returns [T, H, D] bf16.

    rows_bound (optional): (window, global) upper bounds of the distinct pool rows the index
    lists name, known on the host before the step (the rows its block tables reach). A backend
    that first gathers the rows read into a scratch table sizes the table with them (it may
    take less; it never reads the count back); past a too-small bound entries are dropped.
    """


@_op
def indexer_topk(q: Tensor, weights: Tensor, key_codes: Tensor, key_scale: Tensor, block_table: Tensor,
                 entries_per_block: int, n_visible: Tensor, topk: int, candidates: Tensor | None = None,
                 pool_blocks: int = 0, pool_block_size: int = 1, reduce_scores=None,
                 candidate_block_size: int = 1) -> tuple[Tensor, Tensor | None]:
    """CSA2 indexer: score(i, s) = sum_h relu(q_ih . k_s) * weights_ih over the MXFP4 keys.

    q [T, Hi, Di] (RoPE'd, MXFP4 quantise-dequantised), weights [T, Hi] (scales folded in),
    key pool [Ng, Di/2] + [Ng, Di/32]; block_table [T, nb]: row t is the global block table of
    token t's sequence, whose entry j sits at pool row block_table[t, j // E] * E + j % E
    (E = entries_per_block). Query t sees entries j < n_visible[t] (N = nb * E addressable).
    With `candidates` [T, P] only the candidates' entries are scored (Reindex layers): ids of
    blocks of `candidate_block_size` entries (1: entry ids), -1 padded; entries >= n_visible[t]
    are not candidates. Returns the top min(topk, N) entry ids sorted by position (-1 padded,
    ties to the lower id; over candidates min(topk, P * candidate_block_size)) and, when
    pool_blocks > 0, the hierarchical candidate pool: [T, min(pool_blocks, ceil(N /
    pool_block_size))] ascending ids of blocks of pool_block_size entries, -1 padded (int32 or
    int64; pass it back as `candidates` with that block size). `reduce_scores` (model
    parallelism, heads split by rank) maps this rank's partial score sums to the full sums (an
    all-reduce) before any selection.
    """


@_op
def compress_kv(kv: Tensor, score: Tensor | None, ratio: int, norm_weight: Tensor, eps: float,
                cos: Tensor, sin: Tensor, codes: Tensor, scales: Tensor, slots: Tensor) -> Tensor:
    """Compressor tail for G = rows // ratio complete groups, in one pass: ratio > 1 pools each
    group with a per-channel softmax over `score` (fp32); then RMSNorm (fp32 math) -> latent
    bf16; RoPE at the entries' positions (cos/sin [G, R/2]); FP4 (E2M1 + E4M3/16) written into
    codes/scales [cap, ...] at `slots` [G]. kv, score [G * ratio, D] fp32 (score None at
    ratio 1, where kv may also be bf16: the compressor's matmul output). Returns the un-rotated latent [G, D] bf16 (the indexer key's input)."""


@_op
def table_rows(block_table: Tensor, per_block: int, index: Tensor, *, null_invalid: bool = False) -> Tensor:
    """Pool rows [T, ...] long of logical indices [T, ...] through per-row block tables [T, nb]
    (`backends.paging.table_rows`, the entry point the pools and ops use; -1 where masked)."""


@_op
def window_rows(block_table: Tensor, per_block: int, lo: Tensor, hi: Tensor, floor: Tensor, width: int) -> Tensor:
    """Pool rows [T, width] long of each query's window positions lo[t] .. lo[t] + width - 1,
    -1 outside [floor[t], hi[t]] or in the null block (`backends.paging.window_rows`)."""


@_op
def compress_rows(pos: Tensor, glob_from: Tensor, glob_table: Tensor, entries_per_block: int, swa_table: Tensor,
                  swa_block: int, ratio: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A compressing layer's addresses for rows at positions pos [T]: (write [T] bool, entry
    slots [T] (0 where nothing is written), entry positions [T], compressor group rows [T *
    ratio] or None at ratio 1) (`backends.paging.compress_rows`)."""


# ---- fused (compositions of the ops above in one launch; backends/fused.py) -----------------
@_op
def rope_store_kv(q: Tensor, kv: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                  swa_kv: Tensor, swa_scale: Tensor, rows: Tensor) -> Tensor:
    """The attention's query and window-entry tails in one pass: returns rope(q, cos, sin), and
    writes fp8_quant(rope(rms_norm(kv, norm_weight, eps), cos, sin)) into the window pool
    (swa_kv [Nw, D] E4M3, swa_scale [Nw, D/32] E8M0; row-strided views allowed) at pool rows
    `rows` [T]. q [T, H, D], kv [T, D] bf16, cos / sin [T, R/2]."""


@_op
def rope_store_key(key: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor, key_codes: Tensor,
                   key_scale: Tensor, slots: Tensor) -> None:
    """The compressed entries' indexer keys in one pass: writes mxfp4_quant(rope(rms_norm(key,
    norm_weight, eps), cos, sin)) into the key pool (key_codes [Ng, Di/2] packed E2M1,
    key_scale [Ng, Di/32] E8M0; row-strided views allowed) at pool rows `slots` [T]. key [T, Di]
    bf16, cos / sin [T, R/2]."""


@_op
def unrope_grouped_linear(x: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, groups: int) -> Tensor:
    """The attention output's tail: grouped_linear(rope(x, cos, sin, inverse=True) as [T,
    groups, H * D / groups], weight) -> [T, groups * R] bf16. x [T, H, D] bf16."""


@_op
def engram_hash(ngram_ids: Tensor, ngram_image: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor,
                pad_id: int, n_heads: int) -> Tensor:
    """Engram row ids [T, (N - 1) * n_heads] long of n-gram windows: ngram_ids [T, N] token ids
    at p, p-1, .. (-1 before the start), ngram_image [T, N] bool; a slot on or behind an image
    token, or before the start, hashes as `pad_id`, the others as token_map[id]; multipliers
    [N] and primes [(N - 1) * n_heads] int64 (`core.engram.engram_window_row_ids`, int64
    wraparound)."""


@_op
def linear_pair(x: Tensor, weight_a: Tensor, scale_a: Tensor | None, weight_b: Tensor, scale_b: Tensor | None,
                out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """Two projections of the same input in one pass: (linear(x, weight_a, scale_a, out_dtype),
    linear(x, weight_b, scale_b, out_dtype)) (the attention's wq_a and wkv, the shared expert's w1
    and w3, the compressor's wkv and wgate). Where the model stacked the two weights
    (`core.weights.stack_linears`) the results are views of one output, rows strided."""


@_op
def indexer_queries(q: Tensor, cos: Tensor, sin: Tensor, w: Tensor, w_scale: float) -> tuple[Tensor, Tensor]:
    """The indexer's query tail in one pass: (mxfp4_act_quant(rope(q, cos, sin)) fp32 [T, H, Di],
    w * w_scale fp32 [T, H]). q [T, H, Di] bf16, w [T, H] fp32 head weights."""


@_op
def mhc_mix_norm(x: Tensor, y: Tensor, post: Tensor, comb: Tensor, pre: Tensor, fn: Tensor | None,
                 scale: Tensor | None, base: Tensor | None, norm_eps: float, hc_eps: float, iters: int,
                 norm_weight: Tensor, eps: float):
    """`mhc_mix` and the next sublayer's input norm in one pass: returns (x_new, x_hat, coef or
    None, rms_norm(x_hat, norm_weight, eps))."""


@_op
def mhc_enter_norm(x: Tensor, pre: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_eps: float, hc_eps: float,
                   iters: int, norm_weight: Tensor, eps: float):
    """A block's mHC entry from plain streams in one pass: returns (mhc_mixes(x, fn, scale, base,
    ...), x_hat = mhc_collapse(x, pre), rms_norm(x_hat, norm_weight, eps))."""


# ---- mHC ------------------------------------------------------------------------------------
@_op
def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """[T, n, n] logits -> doubly stochastic comb: softmax over j + eps, one column
    normalisation, then iters-1 rounds of row-then-column normalisation (divisions by sum+eps)."""


@_op
def mhc_mixes(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_eps: float, hc_eps: float,
              iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficient prediction from the streams x [T, n, d]: (pre [T, n], post [T, n], comb [T, n, n])."""


@_op
def mhc_collapse(x: Tensor, pre: Tensor) -> Tensor:
    """Sublayer input sum_i pre[i] * x_i: [T, n, d] -> [T, d] (fp32 math, x's dtype)."""


@_op
def mhc_update(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Residual update: out_j = post[j] * y + sum_i comb[i][j] * x_i (fp32 math, x's dtype)."""


@_op
def mhc_mix(x: Tensor, y: Tensor, post: Tensor, comb: Tensor, pre: Tensor, fn: Tensor | None,
            scale: Tensor | None, base: Tensor | None, norm_eps: float, hc_eps: float, iters: int):
    """Single-pass mHC step after a sublayer (the Mega-mHC fusion): x_new = mhc_update(x, y,
    post, comb); x_hat = mhc_collapse(x_new, pre) (the next sublayer's input uses this
    sublayer's `pre`); and, when `fn` is given, the next sublayer's mhc_mixes(x_new, ...).
    Reads x and y once, writes x_new and x_hat once. Returns (x_new, x_hat, coef or None)."""


# ---- MoE and Engram -------------------------------------------------------------------------
@_op
def moe_route(x: Tensor, gate_weight: Tensor, bias: Tensor, topk: int, route_scale: float,
              gate_temp: float = 1.0, norm_topk_prob: bool = True, image_bias: Tensor | None = None,
              is_image: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """sqrtsoftplus router in fp32: bias [E] or [T, E] chooses the top-k (with `image_bias`, of
    bias's shape, and is_image [T] bool: image tokens choose with image_bias instead); the weights
    are the raw scores of the chosen experts, divided by (their sum + 1e-20) only when
    `norm_topk_prob` and topk > 1, then times route_scale. Returns (weights [T, k], ids [T, k])."""


@_op
def moe_experts(x: Tensor, weights: Tensor, ids: Tensor, experts: list, limit: float,
                out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Routed experts: sum_k weights[t,k] folded in before w2 of expert ids[t,k]'s clamped SwiGLU.
    `experts[e]` = ((w1, s1), (w2, s2), (w3, s3)); ids < 0 are skipped (experts held by another
    model-parallel rank). Expert outputs are summed in `out_dtype` (fp32, or fp64 for sums that
    are combined across ranks before rounding; device backends sum in fp32 and return fp32 for
    the fp64 request). Returns [T, d] of `out_dtype`, or bf16 when every value is a bf16 value
    (a device backend's one expert routed top-1, the shared expert: no widening launch)."""


@_op
def moe_experts_add(x: Tensor, weights: Tensor, ids: Tensor, experts: list, limit: float, add: Tensor,
                    join=None) -> Tensor:
    """The MoE's output: `moe_experts` summed in fp32, plus `add` [T, d] (the shared expert's
    output, bf16 or fp32) in fp32, rounded to bf16 once. `join` (optional, no arguments) is
    called after the experts are issued and before `add` is read: the join with the stream that
    makes `add` (`Platform.overlap`'s `joined`), so the experts run beside it."""


@_op
def engram_gate(x: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                is_image: Tensor) -> Tensor:
    """Engram's per-stream gated add: x [T, n, d] bf16, keys k [T, n, d] and value v [T, d]
    (bf16 or fp32; views of one wkv output, any strides), q_weight / k_weight [n, d] (row s
    weights stream s); dot_s = sum(rms(k_s) * k_weight[s] * rms(x_s) * q_weight[s]) * d^-0.5
    (both RMS-normalised with eps); gate_s = sigmoid(sign(dot_s) sqrt(max(|dot_s|, 1e-6))), 0 on
    image tokens; x_s + gate_s * v in fp32, cast to x's dtype."""


@_op(device_arg="rows")
def engram_lookup(table: Tensor, scale: Tensor, rows: Tensor) -> Tensor:
    """Hashed row ids [T, R] -> gather FP8 (scale per 32) or INT8 (scale per row) rows ->
    dequantised bf16 [T, R * Dh] on rows' device. Dispatched on rows' device: the table may be
    held in host memory (Engram offload; page-locked on a device)."""


# ---- sampling -------------------------------------------------------------------------------
@_op
def sample_race(logits: Tensor, rows: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, keys: Tensor,
                max_top_k: int, any_top_p: bool) -> Tensor:
    """The sampled tokens of a step, int64 [S]: row rows[s] of logits [R, V] (fp32 or bf16) draws
    argmax_v p[v] / -log U[v], the seeded exponential race, where p is its distribution
    (logits / temperature[s], top-k top_k[s] (0 = off), softmax, top-p top_p[s] (1 = off), both
    cuts keeping ties, renormalised) and U[v] its counter-based uniforms for the 32-bit key
    keys[s] (int64 [S]). `max_top_k` (the largest top_k, 0 when no row cuts) and `any_top_p`
    (whether a row cuts by top-p) are known on the host so no implementation reads the device.
    Reference: `dsv41.backends.reference.sampling`. Backends may round p differently in the
    last bit (a near-tie of two race scores can then go the other way)."""


@_op
def greedy_pick(logits: Tensor, out: Tensor | None = None) -> Tensor:
    """Each row's greedy token and finiteness in one pass, int64 [R, 2] (written into `out`, a
    persistent [R, 2] buffer, when given): column 0 the argmax of logits [R, V] (fp32 or bf16;
    the first of equal maxima, as `torch.argmax`), column 1 is 1 where the row holds a NaN or an
    infinity, else 0. A broken row's column 0 is still a token id in [0, V) (the overlapped
    decode loop feeds it to the next step before the host reads the flag). Reference:
    `dsv41.backends.reference.sampling`."""


@_op(device_arg="picked")
def feed_tokens(ids: Tensor, ngram_ids: Tensor, picked: Tensor) -> None:
    """In place, the first thing a captured decode step does: each row whose input id is
    negative, ids[i] = -1 - r, takes row r's greedy token of the step before, picked[r, 0]
    (`greedy_pick`'s output, possibly patched by `sample_race` since), as its id and as its
    n-gram's own token, ngram_ids[i, 0]; rows with ids >= 0 are left alone. ids [T] int64,
    ngram_ids [T, n] int64, picked [R, 2] int64, all on one device."""


from . import fused  # noqa: E402, F401  (registers the fused ops' compositions; imports this module)
