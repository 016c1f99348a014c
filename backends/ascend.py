"""The Ascend backend: torch_npu's fused operators where they fit, the portable Triton kernels
(`npu_ops/triton`, compiled by triton-ascend) next, and for every other op either a
device-legal fallback or an explicit error -- never the fp64 / float8 reference on NPU tensors.

UNVERIFIED ON HARDWARE. No NPU was reachable: every call below is written against the
documented signatures of torch_npu 2.10.0.post4 (the pin in images/versions.env), which the
`torch_npu_contract` nox session checks statically (names, argument names and counts, and the
dtypes in `TORCH_NPU_DTYPES` against the wheel's `_op_plugin_docs.py`); the Triton kernels pass
triton-ascend's front end in CI (`nox -s triton_ascend`); the integer decoders and the fp32
fallbacks run on CPU in tests/test_ascend_backend.py. Nothing here has run on an Atlas A2 / A3.

NPU-legal data (Atlas A2 / A3 have no float8 / float64 tensors, HCCL no fp64 collectives):
- FP8 E4M3, E8M0 and packed FP4 data are uint8 / int8 tensors on the NPU: the platform's
  `storage_dtype` says so (backends/platform.py), `core.weights.materialize` gives the model's
  float8 buffers that dtype and the loaders copy the checkpoint's bytes in (`as_storage`), and
  `core.cache.KVPool` allocates its FP8 / E8M0 pools through it. Every op here accepts those
  uint8 forms (a uint8 tensor in a float8 slot holds that format's bytes) and decodes them with
  integer and fp32 ops only; the quantising ops return uint8 bytes where the reference returns
  float8 dtypes.
- No fp64 on the NPU: an `out_dtype=torch.float64` request is refused with an error naming
  `ops.partial_sum_dtype` (fp32 there); reference ops that accumulate in fp64 run on the NPU
  with fp32 accumulation instead (`_fp32_reference`).

Which implementation each op gets, and why, is in `IMPLEMENTATIONS` (printed by `dsv41 backends`).
Importing this module is cheap; `load` (called by the registry on the first NPU tensor or with
`DSV41_BACKEND=ascend`) imports torch_npu and triton lazily.
"""

from __future__ import annotations

import weakref

import torch

from .platform import npu_unavailable_reason, triton_unavailable_reason
from .registry import composite_of, register, register_backend_loader

BACKEND = "ascend"

# The dtypes this module hands each torch_npu op (checked against the docs of the pinned wheel by
# backends/ascend_contract.py; keys are the ops' Python argument names).
TORCH_NPU_DTYPES = {
    "npu_rms_norm": {"input": ("bfloat16", "float32")},
    "npu_dynamic_quant": {"input": ("bfloat16",), "dst_type": ("int8",)},
    "npu_quant_matmul": {"x1": ("int8",), "x2": ("int8",), "scale": ("float32",), "pertoken_scale": ("float32",),
                         "output_dtype": ("bfloat16",)},
    "npu_moe_init_routing_v2": {"x": ("bfloat16",), "expert_idx": ("int32",)},
    "npu_grouped_matmul": {"x": ("int8", "bfloat16"), "weight": ("int8", "bfloat16"), "scale": ("float32",),
                           "per_token_scale": ("float32",), "group_list": ("int64",), "output_dtype": ("bfloat16",)},
    "npu_moe_finalize_routing": {"expanded_permuted_rows": ("float32",), "expanded_src_to_dst_row": ("int32",),
                                 "export_for_source_row": ("int32",)},
}

# op -> what the Ascend backend runs for it (filled by `load`; `dsv41 backends` prints it).
IMPLEMENTATIONS: dict[str, str] = {}

# vllm-ascend's DeepSeek-V4 custom operators (torch.ops._C_ascend, registered by
# `vllm_ascend.utils.enable_custom_op()`). Argument lists as declared in its
# csrc/torch_binding.cpp at tag v0.23.0 (the source of the 0.23.0.post1 pin in
# images/versions.env): names in order, "=" marks a default, "*" starts the keyword-only ones.
# `nox -s torch_npu_contract` checks every torch.ops._C_ascend call in the project against this
# table (statically; the table itself is transcribed: pip cannot fetch vllm-ascend's sources,
# whose metadata step needs CANN).
VLLM_ASCEND_SCHEMAS = {
    "npu_hc_post": "x, residual, post, comb",
    "npu_hc_pre_v2": "x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps",
    "compressor": "x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, "
                  "seqused, start_pos, rope_head_dim, cmp_ratio, coff, norm_eps, rotary_mode, cache_mode",
    "npu_vllm_quant_lightning_indexer": "query, key, weights, query_dequant_scale, key_dequant_scale, "
                                        "query_quant_mode=, key_quant_mode=, actual_seq_lengths_query=, "
                                        "actual_seq_lengths_key=, block_table=, metadata=, layout_query=, "
                                        "layout_key=, sparse_count=, sparse_mode=, pre_tokens=, next_tokens=, "
                                        "cmp_ratio=, return_value=",
    "npu_sparse_flash_attention": "query, key, value, sparse_indices, scale_value, *, block_table=, "
                                  "actual_seq_lengths_query=, actual_seq_lengths_kv=, query_rope=, key_rope=, "
                                  "sparse_block_size=, layout_query=, layout_kv=, sparse_mode=, pre_tokens=, "
                                  "next_tokens=, attention_mode=, return_softmax_lse=",
}
# Our ops those operators could serve, and why they do not (shown by `dsv41 backends`).
VLLM_ASCEND_NOT_USED = {
    "compress_kv": "vllm-ascend's `compressor` runs the wkv / wgate projections itself and keeps its own state "
                   "cache (state_cache, ape, cache_mode); ours gets projected rows and writes FP4 entries (E2M1 + "
                   "E4M3 per 16) into our pool",
    "indexer_topk": "vllm-ascend's `npu_vllm_quant_lightning_indexer` scores keys in its own quant modes over its "
                    "block table; our keys are MXFP4 (E2M1 + E8M0 per 32) and decode scores a candidate pool",
    "sparse_attention": "vllm-ascend's `npu_sparse_flash_attention` reads key / value through one block table; ours "
                        "takes FP8 SWA rows and FP4 global entries into one softmax with a sink",
    "mhc_mixes": "vllm-ascend's `npu_hc_pre_v2` returns the collapsed input with post / comb, not pre: DSV4.1's "
                 "single-pass mHC collapses with the previous sublayer's pre",
}


def vllm_ascend_ops() -> frozenset[str]:
    """The VLLM_ASCEND_SCHEMAS operators this process has (vllm-ascend installed and its custom
    ops enabled), else empty. Import-guarded: any failure means none."""
    try:
        from vllm_ascend.utils import enable_custom_op

        if not enable_custom_op():
            return frozenset()
    except Exception:  # noqa: BLE001  (not installed, or its CANN libraries missing)
        return frozenset()
    return frozenset(n for n in VLLM_ASCEND_SCHEMAS if hasattr(torch.ops._C_ascend, n))


def _refuse_fp64(out_dtype: torch.dtype, op: str) -> None:
    if out_dtype == torch.float64:
        raise ValueError(f"{op}: float64 output asked on the NPU (Atlas A2/A3 have no fp64 matmul and HCCL no fp64 "
                         "all-reduce); ask for dsv41.backends.ops.partial_sum_dtype(device) (float32 there)")


# ---- integer decoders / encoders (torch ops only: device-agnostic, tested on CPU) ---------------

def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for integer e in [-126, 127], built from the exponent bits (exact)."""
    return _bits_to_f32((e.to(torch.int32) + 127) << 23)


def e4m3_decode(byte: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bytes (uint8 / int8 / float8 view) -> exact fp32 values (0x7F / 0xFF: NaN)."""
    b = byte.view(torch.uint8).to(torch.int32)
    e, m = (b >> 3) & 15, b & 7
    normal = _bits_to_f32(((e + 120) << 23) | (m << 20))
    mag = torch.where(e == 0, m.to(torch.float32) * 2.0 ** -9, normal)
    mag = torch.where((e == 15) & (m == 7), torch.full_like(mag, float("nan")), mag)
    return _bits_to_f32(mag.view(torch.int32) | ((b & 0x80) << 24))


def e8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b - 127) (b = 0: 2^-127, b = 255: inf, as the reference's ldexp)."""
    b = byte.view(torch.uint8).to(torch.int32)
    return torch.where(b == 0, _bits_to_f32(torch.full_like(b, 1 << 22)), _bits_to_f32(b << 23))


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., k] (element 0 in the low nibble) -> fp32 [..., 2k]."""
    p = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack((p & 15, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    table = torch.tensor(_E2M1, dtype=torch.float32, device=p.device)
    mag = table[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def fp8_block_scale_exponent(g: torch.Tensor, floor: float = 1e-4) -> torch.Tensor:
    """ceil(log2(max(amax, floor) / 448)) per group (last axis), from the fp32 bits of the
    quotient the reference computes (exact for the normal quotients this floor guarantees)."""
    v = g.abs().amax(-1, keepdim=True).clamp_min(floor) / 448.0
    vb = v.view(torch.int32)
    return ((vb >> 23) & 255) - 127 + ((vb & 0x7FFFFF) != 0).to(torch.int32)


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-448, 448] -> the nearest E4M3 values (ties to even), as fp32, with the
    rounding done on the bits (the torch cast to float8 is not available on Atlas A2/A3)."""
    b = y.view(torch.int32)
    normal = _bits_to_f32((b + 0x7FFFF + ((b >> 20) & 1)) & ~0xFFFFF)
    sub = torch.round(y * 512.0) * (1.0 / 512.0)  # below 2^-6: multiples of 2^-9 (round half to even)
    return torch.where(y.abs() < 2.0 ** -6, sub, normal)


def fp8_qdq_int(x: torch.Tensor) -> torch.Tensor:
    """`quant.fp8_qdq` (blockwise FP8 quantise-dequantise of activations, groups of 32) with
    integer / fp32 ops only; bit-exact with the reference."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    e = fp8_block_scale_exponent(g)
    q = e4m3_round((g * _pow2(-e)).clamp(-448.0, 448.0))
    return (q * _pow2(e)).reshape(x.shape)


def e4m3_encode(q: torch.Tensor) -> torch.Tensor:
    """E4M3 values (fp32, already on the grid, |q| <= 448) -> their bytes (uint8)."""
    b = q.view(torch.int32)
    sign = (b >> 24) & 0x80
    mag = q.abs()
    normal = ((((b >> 23) & 255) - 120) << 3) | ((b >> 20) & 7)
    sub = torch.round(mag * 512.0).to(torch.int32)
    return (torch.where(mag < 2.0 ** -6, sub, normal) | sign).to(torch.uint8)


def fp8_quant_int(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.fp8_quant` on the NPU: (E4M3 bytes [..., D] uint8, E8M0 bytes [..., D/32] uint8) --
    the same bytes as the reference's float8 tensors, held in uint8."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    e = fp8_block_scale_exponent(g)
    q = e4m3_round((g * _pow2(-e)).clamp(-448.0, 448.0))
    return e4m3_encode(q).reshape(x.shape), (e.squeeze(-1) + 127).clamp(0, 254).to(torch.uint8)


def fp8_dequant_int(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`ops.fp8_dequant` from bytes: fp32 out."""
    v = e4m3_decode(q)
    g = v.reshape(*v.shape[:-1], v.shape[-1] // 32, 32) * e8m0_decode(scale).unsqueeze(-1)
    return g.reshape(v.shape)


def fp4_dequant_int(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`ops.fp4_dequant` (E2M1 + E4M3 scale per 16) from bytes: fp32 out."""
    v = e2m1_decode_packed(packed)
    g = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16) * e4m3_decode(scale).unsqueeze(-1)
    return g.reshape(v.shape)


def mxfp4_dequant_int(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`ops.mxfp4_dequant` (E2M1 + E8M0 scale per 32) from bytes: fp32 out."""
    v = e2m1_decode_packed(packed)
    g = v.reshape(*v.shape[:-1], v.shape[-1] // 32, 32) * e8m0_decode(scale).unsqueeze(-1)
    return g.reshape(v.shape)


def weight_to_bf16(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A stored linear / expert weight -> bf16 [N, K], decoded on its device with integer ops.
    Exact: E4M3 x 2^k and E2M1 x 2^k values have at most 4 significant bits. int8 per-channel
    weights are not decoded here (they go to the int8 matmul)."""
    if scale is None:
        return weight.to(torch.bfloat16)
    if weight.dtype == torch.int8 and scale.dtype == torch.float32:
        return (weight.float() * scale.float()).to(torch.bfloat16)  # W8A8 weight, for a bf16 fallback
    if scale.dim() == 2 and weight.shape[-1] * 2 == scale.shape[-1] * 32:  # packed FP4 + E8M0 per 32
        return mxfp4_dequant_int(weight, scale).to(torch.bfloat16)
    n, k = weight.shape  # FP8 E4M3 + E8M0 per 32x32 block
    s = e8m0_decode(scale).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return (e4m3_decode(weight) * s).to(torch.bfloat16)


# ---- per-weight caches (weights are read-only during inference) ----------------------------------

_CACHE: dict[tuple, tuple] = {}


def _cached(key_tensor: torch.Tensor, tag: str, make):
    """make() memoised per (weight tensor, tag); dropped when the weight is freed or rewritten."""
    key = (id(key_tensor), tag)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is key_tensor and hit[1] == key_tensor._version:
        return hit[2]
    val = make()
    _CACHE[key] = (weakref.ref(key_tensor, lambda _, k=key: _CACHE.pop(k, None)), key_tensor._version, val)
    return val


def _is_w8a8(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """int8 weight [N, K] with one fp32 scale per output channel ([N, 1]): the W8A8 format."""
    return scale is not None and weight.dtype == torch.int8 and scale.dtype == torch.float32 \
        and scale.numel() == weight.shape[0] and weight.shape[-1] * 2 != scale.shape[-1] * 32


# ---- torch_npu fused ops ------------------------------------------------------------------------

def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through torch_npu's fused kernel (fp32 math inside). gamma must share the input's
    dtype: bf16 inputs keep bf16 (the weight is bf16 in the checkpoint), anything else runs fp32."""
    import torch_npu

    xin = x if x.dtype == torch.bfloat16 else x.float()
    return torch_npu.npu_rms_norm(xin, weight.to(xin.dtype), epsilon=eps)[0].to(x.dtype)


def npu_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`ops.linear` on the NPU. W8A8 (int8 weight, fp32 scale per output channel): per-token
    dynamic int8 activations (`npu_dynamic_quant`, bf16 in) and `npu_quant_matmul` with both
    scales applied in the epilogue, bf16 out. FP8 / FP4 release weights: decoded once to bf16 on
    the device (integer ops, exact) and the activations FP8-quantise-dequantised with integer
    ops (bit-exact with the reference), then a bf16 matmul (exact products, fp32 accumulation)."""
    _refuse_fp64(out_dtype, "linear")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if _is_w8a8(weight, scale):
        import torch_npu

        w_t = _cached(weight, "t", lambda: weight.t().contiguous())  # [K, N], as npu_quant_matmul's x2
        w_scale = _cached(scale, "flat", lambda: scale.reshape(-1).float().contiguous())
        xq, x_scale = torch_npu.npu_dynamic_quant(x2.to(torch.bfloat16), dst_type=torch.int8)
        y = torch_npu.npu_quant_matmul(xq, w_t, w_scale, pertoken_scale=x_scale, output_dtype=torch.bfloat16)
    else:
        w = _cached(weight, "bf16", lambda: weight_to_bf16(weight, scale))
        xin = fp8_qdq_int(x2) if scale is not None else x2.float()
        if out_dtype == torch.bfloat16:
            y = torch.matmul(xin.to(torch.bfloat16), w.t())
        else:  # unrounded fp32 partial sums
            y = torch.matmul(xin, w.float().t())
    return y.reshape(*x.shape[:-1], -1).to(out_dtype)


def _stacked_experts(experts: list, which: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert weights `which` (0: w1, 1: w2, 2: w3) stacked as [E, K, N] for npu_grouped_matmul
    (int8 + fp32 scales [E, N] for W8A8, else decoded bf16), cached on the first weight."""
    first = experts[0][which][0]

    def build():
        ws = [e[which] for e in experts]
        if fmt == "w8a8":
            return (torch.stack([w.t() for w, _ in ws]).contiguous(),
                    torch.stack([s.reshape(-1).float() for _, s in ws]).contiguous())
        return torch.stack([weight_to_bf16(w, s).t() for w, s in ws]).contiguous(), None

    return _cached(first, f"stack{which}{fmt}{len(experts)}", build)


def npu_moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`ops.moe_experts` on the NPU: `npu_moe_init_routing_v2` sorts the token copies by expert,
    three `npu_grouped_matmul` calls (W8A8: int8 with per-token dynamic scales; otherwise bf16 of
    the decoded weights) run every expert's w1 / w3 / w2 as one grouped GEMM each, and
    `npu_moe_finalize_routing` adds each token's k rows weighted by the router weights.

    The router weight is applied after w2 (by finalize) instead of before it: equal up to
    rounding (w2 is linear, and a per-token int8 quantisation is invariant to a per-row scale).
    ids < 0 (experts of another rank) are routed to a phantom expert outside `active_expert_range`,
    which init_routing drops; its finalize weight is 0.

    Row indices (checked against CANN's kernel sources and golden scripts of MoeInitRoutingV2 /
    MoeFinalizeRouting; unverified on hardware): init_routing's expanded_row_idx with
    row_idx_type=0 maps each SOURCE slot s = token * K + k (row-major) to its row in expanded_x,
    -1 where the expert is outside active_expert_range; finalize reads
    expanded_src_to_dst_row[k * NUM_ROWS + token] (k-major) and needs every entry in
    [0, NUM_ROWS * K). So the map is transposed to k-major, and dropped slots point at the last
    row, which is then a row past the routed ones (undefined after the grouped matmul) and is
    zeroed here. vllm-ascend combines with `npu_moe_token_unpermute` instead (row-major, bf16
    only); finalize keeps fp32 partial sums for the model-parallel all-reduce."""
    import torch_npu

    _refuse_fp64(out_dtype, "moe_experts")
    t, d = x.shape
    n_exp = len(experts)
    k = ids.shape[1]
    fmt = "w8a8" if _is_w8a8(*experts[0][0]) else "bf16"
    w1, s1 = _stacked_experts(experts, 0, fmt)
    w3, s3 = _stacked_experts(experts, 2, fmt)
    w2, s2 = _stacked_experts(experts, 1, fmt)
    local = torch.where(ids < 0, torch.full_like(ids, n_exp), ids).to(torch.int32)
    xs, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x.to(torch.bfloat16), local, active_num=t * k, expert_num=n_exp + 1, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, n_exp], row_idx_type=0)

    def gmm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        if fmt == "w8a8":
            aq, a_scale = torch_npu.npu_dynamic_quant(a.to(torch.bfloat16), dst_type=torch.int8)
            out = torch_npu.npu_grouped_matmul([aq], [w], scale=[s], per_token_scale=[a_scale], group_list=counts,
                                               split_item=2, group_type=0, group_list_type=1,
                                               output_dtype=torch.bfloat16)
        else:
            out = torch_npu.npu_grouped_matmul([a.to(torch.bfloat16)], [w], group_list=counts, split_item=2,
                                               group_type=0, group_list_type=1)
        return out[0].float()

    from .reference.basic import swiglu_clamped

    with _fp32_accumulation():
        h = swiglu_clamped(gmm(xs, w1, s1), gmm(xs, w3, s3), limit)
    if fmt != "w8a8":  # the release format quantises w2's input to FP8 (bit-exact emulation)
        h = fp8_qdq_int(h)
    y = gmm(h, w2, s2)
    n_rows = t * k
    routed = torch.arange(n_rows, device=y.device) < counts.sum()  # rows past these are undefined
    y = torch.where(routed.unsqueeze(1), y, torch.zeros((), dtype=y.dtype, device=y.device))
    src_to_dst = torch.where(row_idx < 0, torch.full_like(row_idx, n_rows - 1), row_idx)
    src_to_dst = src_to_dst.reshape(t, k).t().reshape(-1).to(torch.int32).contiguous()  # k-major
    scales = torch.where(ids < 0, torch.zeros_like(weights), weights).float()
    out = torch_npu.npu_moe_finalize_routing(y, None, None, None, scales, src_to_dst, local, drop_pad_mode=0)
    return out.to(out_dtype)


# ---- vllm-ascend's custom operators (UNVERIFIED on hardware) ----------------------------------

def vllm_ascend_mhc_update(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`ops.mhc_update` through vllm-ascend's `npu_hc_post` (its DeepSeek-V4 model calls it with
    the sublayer output, the streams, post and comb, each with a leading batch axis, as a drop-in
    for the official hc_post: out_j = post[j] * y + sum_i comb[i][j] * x_i)."""
    out = torch.ops._C_ascend.npu_hc_post(y.unsqueeze(0), x.unsqueeze(0), post.unsqueeze(0), comb.unsqueeze(0))
    return out.squeeze(0).to(x.dtype)


def vllm_ascend_mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters):
    """`ops.mhc_mix` without its Triton kernel: the update through `npu_hc_post`, the collapse and
    the next coefficients through the fp32 reference math."""
    x_new = vllm_ascend_mhc_update(x, y, post, comb)
    x_hat = _fp32_reference("mhc_collapse")(x_new, pre)
    coef = _fp32_reference("mhc_mixes")(x_new, fn, scale, base, norm_eps, hc_eps, iters) if fn is not None else None
    return x_new, x_hat, coef


VLLM_ASCEND_USED = {
    "mhc_update": (vllm_ascend_mhc_update, "npu_hc_post", "vllm-ascend torch.ops._C_ascend.npu_hc_post"),
    "mhc_mix": (vllm_ascend_mhc_mix, "npu_hc_post", "vllm-ascend npu_hc_post + fp32 reference collapse / mixes "
                                                    "(fallback when the Triton mega-mHC kernel is missing)"),
}


# ---- fallbacks that stay legal on the NPU ------------------------------------------------------

def _fp32_accumulation():
    from .reference import basic

    return basic.fp32_accumulation()


def _fp32_reference(name: str):
    """The reference implementation of `name` with fp32 instead of fp64 accumulation (its only
    fp64 use: `mm` / `einsum` / `exact_fn` follow `basic.ACCUM_DTYPE`), for ops whose reference
    touches no float8 data. Same formulas, fp32 sums: not bit-exact with the CPU oracle."""
    from .registry import resolve

    ref = resolve(name, "reference")[0]

    def run(*args, **kwargs):
        with _fp32_accumulation():
            return ref(*args, **kwargs)

    run.__name__ = f"{name}_fp32_reference"
    return run


def _host_reference(name: str):
    """The reference implementation of `name` run on the host (its fp64 math stays off the NPU;
    small inputs and outputs cross the bus, one host synchronisation): for ops whose precision
    needs fp64 and whose tensors are tiny (rope_tables: positions up to 1M times fp32
    frequencies). Tensor results come back to the first tensor argument's device."""
    from .registry import resolve

    ref = resolve(name, "reference")[0]

    def run(*args, **kwargs):
        dev = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), torch.device("cpu"))
        host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        out = ref(*host, **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(o.to(dev) if isinstance(o, torch.Tensor) else o for o in out)
        return out.to(dev) if isinstance(out, torch.Tensor) else out

    run.__name__ = f"{name}_host_reference"
    return run


def _composition(name: str):
    """Fused op `name` as the composition of its parts, each dispatched to the NPU's own
    implementation (a function of its own, so the registry tells it from the reference)."""
    fn = composite_of(name)

    def run(*args, **kwargs):
        return fn(*args, **kwargs)

    run.__name__ = f"{name}_composition"
    return run


def _unavailable(name: str, why: str):
    """An op that cannot run legally on the NPU without its kernel: one clear error."""

    def fail(*args, **kwargs):
        raise NotImplementedError(f"op '{name}' has no Ascend implementation here ({why}); its reference uses "
                                  "float8 / float64 tensors, which Atlas A2/A3 do not support")

    fail.__name__ = f"{name}_unavailable"
    return fail


def engram_lookup_npu(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`ops.engram_lookup` without Triton. INT8 tables (the Ascend recipe's storage): gather + one
    fp32 multiply per row (the reference's own math, legal on the NPU). FP8 tables (E4M3 bytes +
    E8M0 bytes per 32, uint8 on the NPU or float8 in host memory): the rows' bytes are gathered
    (where the table is, then copied over) and decoded with integer ops; bit-exact with the
    reference. Tables with plain float scales need the Triton kernel."""
    from .reference.basic import engram_lookup, gather_rows_to

    if table.dtype == torch.int8:
        return engram_lookup(table, scale, rows)
    if table.element_size() != 1 or scale.element_size() != 1:
        raise NotImplementedError(f"engram_lookup of a {table.dtype} table with {scale.dtype} scales on the NPU needs "
                                  "triton-ascend (only INT8 tables and FP8 tables with E8M0 scales run without it)")
    table, scale = table.view(torch.uint8), scale.view(torch.uint8)  # bytes: no float8 reaches the NPU
    if table.device != rows.device:
        table, scale, rows = gather_rows_to(table, scale, rows)
    t, r = rows.shape
    flat = rows.reshape(-1)
    return fp8_dequant_int(table[flat], scale[flat]).reshape(t, r * table.shape[-1]).to(torch.bfloat16)


def mxfp4_quant_int(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.mxfp4_quant` with integer / fp32 ops: (packed E2M1 uint8 [..., D/2], E8M0 bytes
    uint8 [..., D/32]); bit-exact with the reference."""
    from .reference import quant

    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    v = g.abs().amax(-1, keepdim=True).clamp_min(quant.MXFP4_AMAX_FLOOR) / 6.0  # normal: >= 2^-126
    vb = v.view(torch.int32)
    e = ((vb >> 23) & 255) - 127 + ((vb & 0x7FFFFF) != 0).to(torch.int32)
    codes = quant.e2m1_encode(g * _pow2(-e))
    return quant.pack_nibbles(codes.reshape(x.shape)), (e.squeeze(-1) + 127).clamp(0, 254).to(torch.uint8)


def fp4_quant_int(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.fp4_quant` (E2M1 + E4M3 scale per 16) with integer / fp32 ops: (packed uint8
    [..., D/2], E4M3 scale bytes uint8 [..., D/16]); bit-exact with the reference."""
    from .reference import quant

    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(quant.FP4_KV_AMAX_FLOOR)
    scale = e4m3_round((amax / quant.FP4_MAX).clamp_max(quant.FP8_MAX))
    codes = quant.e2m1_encode(g / scale)
    return quant.pack_nibbles(codes.reshape(x.shape)), e4m3_encode(scale.squeeze(-1))


# Ops whose reference has fp64 accumulation only (no float8): legal in fp32 on the NPU.
FP32_REFERENCE_OPS = ("rope", "grouped_linear", "swiglu_clamped", "sinkhorn", "mhc_mixes", "mhc_collapse", "sample_race",
                      "mhc_update", "mhc_mix", "moe_route", "engram_gate", "greedy_pick", "feed_tokens")
# Ops whose reference needs fp64 on tiny tensors: run on the host, results copied to the NPU.
HOST_REFERENCE_OPS = ()
# Ops that touch float8 data: integer-op versions here (a Triton kernel wins where one exists).
INTEGER_OPS = {"fp8_quant": fp8_quant_int, "fp8_dequant": fp8_dequant_int, "fp4_dequant": fp4_dequant_int,
               "mxfp4_dequant": mxfp4_dequant_int, "mxfp4_quant": mxfp4_quant_int, "fp4_quant": fp4_quant_int,
               "mxfp4_act_quant": lambda x: mxfp4_dequant_int(*mxfp4_quant_int(x))}
FUSED_OPS = {
    "rms_norm": (npu_rms_norm, "torch_npu.npu_rms_norm"),
    "linear": (npu_linear, "W8A8: torch_npu.npu_dynamic_quant + npu_quant_matmul; FP8/FP4 release weights: "
                           "integer-op decode to bf16 + bf16 matmul (fallback)"),
    "moe_experts": (npu_moe_experts, "torch_npu.npu_moe_init_routing_v2 + npu_grouped_matmul (W8A8 int8, or "
                                     "decoded bf16) + npu_moe_finalize_routing"),
}


def plan(op_names: list[str], triton_ops: list[str], triton_why: str | None,
         vllm_ops: frozenset[str] = frozenset()) -> dict[str, tuple]:
    """op -> (implementation, what it is) on the NPU, by precedence: torch_npu fused op,
    vllm-ascend custom operator (`vllm_ops`: those present) where it replaces a whole op, Triton
    kernel (triton-ascend), vllm-ascend operator plus fp32 pieces, integer-op version, fp32
    reference, else an explicit error. Ops vllm-ascend's operators do not serve say why."""
    out = _plan(op_names, triton_ops, triton_why, vllm_ops)
    for name, why in VLLM_ASCEND_NOT_USED.items():
        if name in out:
            out[name] = (out[name][0], f"{out[name][1]} [{why}]")
    return out


def _plan(op_names, triton_ops, triton_why, vllm_ops) -> dict[str, tuple]:
    out = {}
    for name in op_names:
        used = VLLM_ASCEND_USED.get(name)
        if name in FUSED_OPS:
            out[name] = FUSED_OPS[name]
        elif used and used[1] in vllm_ops and (name == "mhc_update" or name not in triton_ops):
            out[name] = (used[0], used[2])  # mhc_update is the vendor kernel whole; mhc_mix only in part
        elif name in triton_ops:
            out[name] = (None, "Triton kernel (triton-ascend)")
        elif composite_of(name) is not None:  # a fused op without an Ascend kernel: its parts on the NPU
            out[name] = (_composition(name), "composition of the Ascend ops (backends/fused.py; no fused kernel)")
        elif name in INTEGER_OPS:
            out[name] = (INTEGER_OPS[name], "integer-op version on the NPU (uint8 bytes; no float8 tensors)")
        elif name == "rope_tables":
            from .rope_tables import rope_tables

            out[name] = (rope_tables, "angle-sum identities over fp64 tables made once (fp32 on the NPU, no host sync)")
        elif name == "engram_lookup":
            out[name] = (engram_lookup_npu, "INT8 tables: gather + fp32 scale; FP8 tables: gather bytes + integer "
                                            "decode (fallback)")
        elif name in HOST_REFERENCE_OPS:
            out[name] = (_host_reference(name), "reference on the host in fp64, tables copied to the NPU "
                                                "(fallback; one host sync)")
        elif name in FP32_REFERENCE_OPS:
            out[name] = (_fp32_reference(name), "reference math with fp32 accumulation on the NPU (fallback; no fp64)")
        else:
            why = f"triton unavailable: {triton_why}" if triton_why else "no kernel"
            out[name] = (_unavailable(name, why), f"error: needs its Triton kernel ({why})")
    return out


def triton_op_names() -> tuple[list[str], str | None]:
    """The ops the portable Triton kernels implement (importing them), or ([], why not)."""
    why = triton_unavailable_reason()
    if why:
        return [], why
    import importlib

    from ..npu_ops.triton import KERNELS

    return [op for m in KERNELS for op in importlib.import_module(f"dsv41.npu_ops.triton.{m}").OPS], None


def load() -> None:
    """Register the Ascend implementations chosen by `plan`."""
    why = npu_unavailable_reason()
    if why:
        raise RuntimeError(why)
    from .registry import op_names

    triton_ops, triton_why = triton_op_names()
    if triton_ops:
        from .cuda import register_triton_kernels

        register_triton_kernels(BACKEND)  # then overridden below where a fused op wins
    for name, (fn, what) in plan(op_names(), triton_ops, triton_why, vllm_ascend_ops()).items():
        if fn is not None:
            register(name, BACKEND)(fn)
        IMPLEMENTATIONS[name] = what


register_backend_loader(BACKEND, load)
