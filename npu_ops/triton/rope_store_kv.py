"""The attention's query and window-entry tails in one launch (op `rope_store_kv`).

Programs 0 .. T * ceil(H / BLOCK_H) - 1 rotate the query rows (as `rope`); the last T programs
each take one token's kv row [D]: RMSNorm (fp32 math, rounded to bf16 as `rms_norm` returns),
RoPE of the last R channels (rounded to bf16 as `rope` returns), FP8 E4M3 quantisation in groups
of 32 (as `fp8_quant`), and the codes and E8M0 scales stored straight into the window pool's row
for that token (row-strided pools: vLLM's page records). The row is held as [D / 32, 32] so the
groups' amax needs no reshape; a channel's pair partner is loaded, not shuffled.

The oracle is the composition `backends.fused.rope_store_kv` (rms_norm -> rope -> fp8_quant ->
row write, and rope of q). Codes agree with it except where the fp32 norm sum, summed in another
order, moves a value across a bf16 rounding boundary (one FP8 step). CUDA only for now (E4M3
codes through uint8 pointers; on Ascend the composition runs: unvetted on triton-ascend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import rope_store_kv as rope_store_kv_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import FP8_GROUP, bf16_round, fp8_code, fp8_exponent, pow2
from .rope import partner_cols, rope_cols, rope_rows

MAX_D = 8192  # a kv row in registers


@triton.jit
def _rope_store_kv_kernel(q_ptr, qo_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, codes_ptr, scales_ptr, rows_ptr,
                          H, D, R, eps, n_q_programs, n_head_blocks, kv_stride, codes_stride, scales_stride,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    if pid < n_q_programs:  # a block of query heads of one token
        t = pid // n_head_blocks
        heads = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        rope_rows(q_ptr, cos_ptr, sin_ptr, qo_ptr, t, heads, H, D, R, 1.0, BLOCK_D, True)
    else:  # one token's window entry
        t = pid - n_q_programs
        g = tl.arange(0, BLOCK_G)
        cols = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [groups, 32]
        ok = cols < D
        base = kv_ptr + t.to(tl.int64) * kv_stride
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
        partner = partner_cols(cols, D, R)
        xp = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
        n = bf16_round(x * inv * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32))
        n_p = bf16_round(xp * inv * tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32))
        y = bf16_round(rope_cols(n, n_p, cos_ptr, sin_ptr, t, cols, D, R, 1.0, ok))
        e = fp8_exponent(tl.max(tl.abs(y), axis=1))
        row = tl.load(rows_ptr + t).to(tl.int64)
        gok = (g < D // 32) & (row >= 0)
        tl.store(codes_ptr + row * codes_stride + cols, fp8_code(y * pow2(-e)[:, None]).to(tl.uint8),
                 mask=ok & gok[:, None])
        tl.store(scales_ptr + row * scales_stride + g, tl.minimum(tl.maximum(e + 127, 0), 254).to(tl.uint8),
                 mask=gok)


def rope_store_kv(q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, swa_kv: torch.Tensor, swa_scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`ops.rope_store_kv` in one launch (the composition where the kernel does not apply: other
    dtypes, rows wider than MAX_D, pools whose rows are not contiguous)."""
    t, d = kv.shape[0], kv.shape[-1]
    r = 2 * cos.shape[-1]
    if q.shape[0] != t or q.shape[-1] != d or kv.dim() != 2 or cos.shape != (t, r // 2) or sin.shape != cos.shape \
            or r > d or rows.shape != (t,) or norm_weight.shape != (d,):
        raise ValueError(f"rope_store_kv: q {tuple(q.shape)}, kv {tuple(kv.shape)}, cos {tuple(cos.shape)}, rows "
                         f"{tuple(rows.shape)}, norm weight {tuple(norm_weight.shape)} do not fit together")
    if (q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or d % FP8_GROUP or d > MAX_D
            or swa_kv.stride(-1) != 1 or swa_scale.stride(-1) != 1 or swa_kv.element_size() != 1
            or swa_scale.element_size() != 1):
        return rope_store_kv_ref(q, kv, norm_weight, eps, cos, sin, swa_kv, swa_scale, rows)
    qc = q.contiguous()
    kvc = kv if kv.stride(-1) == 1 else kv.contiguous()  # (rows at their stride: `linear_pair`'s views)
    out = torch.empty_like(qc)
    h = qc.numel() // (t * d) if t * d else 0
    if t == 0:
        return out
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(max(h, 1)), 4096 // bd))
    n_hb = -(-h // bh) if h else 0
    n_q = t * n_hb
    _rope_store_kv_kernel[(n_q + t,)](
        qc, out.view(torch.int16), kvc, norm_weight.contiguous(), cos.float().contiguous(),
        sin.float().contiguous(), swa_kv.view(torch.uint8), swa_scale.view(torch.uint8), rows.contiguous(),
        h, d, r, float(eps), n_q, max(n_hb, 1), kvc.stride(0), swa_kv.stride(0), swa_scale.stride(0),
        BLOCK_H=bh, BLOCK_D=bd, BLOCK_G=triton.next_power_of_2(d // FP8_GROUP), **pdl_launch(qc))
    return out


OPS = {"rope_store_kv": rope_store_kv}
