"""The block-diagonal bf16 projection at decode batches (op `grouped_linear`: the attention's
`wo_a`, x [T, G, K] with weight [G * R, K] -> [T, G * R] bf16) on tensor cores.

`_grouped_linear_kernel`: program p owns BN consecutive output rows (inside one group, R % BN ==
0) for every token: acc [BN, TB] = W[rows, :] @ x[:, group, :]^T, the weight tile the dot's left
operand, the T tokens padded to TB (16..64) on its narrow side, fp32 accumulation, bf16 output.
Each program streams one contiguous run of BN * K weight values through the compiler's pipelined
copies; its group's x rows are shared by R / BN programs (L2 hits after the first). One launch
reads the weight once whatever T is. Against cuBLAS's batched product over the groups
(`torch.bmm`, the path above MAX_T tokens and for other dtypes) at the mini width (64 MB), H100
2026-12-06, graph replay, three weight copies cycled past the L2: 24.0 / 24.2 / 24.4 / 24.7 /
25.4 / 26.4 us at T = 2 / 4 / 8 / 16 / 32 / 64 against 24.7 / 25.0 / 25.1 / 25.6 / 26.2 / 27.1
(floor 22.4-24.1 us at the card's 3.0 TB/s); the mini decode step at 4K (processes alternated,
two rounds) batch 8 2.900 / 2.896 -> 2.879 / 2.882 ms, batch 32 even, batch 64 4.400 / 4.410 ->
4.388 / 4.400 (benchmarks/RESULTS.md, session forty-three): a few us a step, since cuBLAS was
already within 1.1x of the weight's bytes. Whole tiles only (K % BK == 0, R % BN == 0; the
launcher falls back to cuBLAS otherwise).

Numerics: bf16 products, fp32 sums (in the MMA's order), one bf16 rounding: cuBLAS's class and
the reference's bound (`backends.reference.basic.grouped_linear`, fp64 then bf16). CUDA only for
now (registered by the CUDA backend; Ascend runs its own composition).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_scaled import bf16_bits16
from .pdl import pdl_launch, pdl_start

MAX_T = 64  # tokens up to which the kernel runs (decode batches); above, cuBLAS's batched product
# CUDA tiles (the H100 sweep above, `sweep_kernels.py --only grouped_linear`): BN 64 on 4 warps, 4
# stages of 128-wide K steps. Within 0.3 us at every T: bk 256 / 3 stages; slower by 0.3-1.7 us:
# bn 128 on 8 warps, 3 stages, bk 64 / 5 stages; bn 32 (two programs an SM) 33.3 us at 64 tokens.
TILES = {"bn": 64, "bk": 128, "num_warps": 4, "num_stages": 4}
TILES_INTERP = {"bn": 16, "bk": 32}


@triton.jit
def _grouped_linear_kernel(x_ptr, w_ptr, out_ptr, T, N, K, GK, RO, TB: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, LOWP: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t, rows of program_id(0)] for t < T (bf16 bits, rounded to nearest even): the tile's
    weight rows (group rows // RO) times token t's channels of that group (x rows of GK = G * K
    values)."""
    pdl_start(PDL)
    n0 = tl.program_id(0) * BN
    rn = (n0 + tl.arange(0, BN)).to(tl.int64)
    rt = tl.arange(0, TB)
    tmask = rt < T
    kk = tl.arange(0, BK)
    xg = x_ptr + (n0 // RO) * K
    acc = tl.zeros((BN, TB), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k0 = tl.multiple_of(k0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + kk)[None, :])
        xt = tl.load(xg + rt.to(tl.int64)[None, :] * GK + (k0 + kk)[:, None], mask=tmask[None, :], other=0.0)
        if LOWP:
            acc = tl.dot(w, xt, acc)
        else:  # the interpreter: fp32 products of the bf16 values
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    tl.store(out_ptr + rt.to(tl.int64)[None, :] * N + rn[:, None], bf16_bits16(acc), mask=tmask[None, :])


def grouped_linear_bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ops.grouped_linear` as one batched cuBLAS product over the groups (bf16 operands, fp32
    accumulation; other dtypes in fp32). The product is written in place into the [T, G, R]
    result through a transposed view (cuBLAS takes the row stride G * R as its leading
    dimension): no transposing copy after it (2.6 us a layer at 8 tokens on the H200)."""
    t, g, k = x.shape
    w = weight.view(g, -1, k)
    if not (x.dtype == weight.dtype == torch.bfloat16):
        x, w = x.float(), w.float()
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(t, -1).to(torch.bfloat16)
    out = torch.empty(t, g, w.shape[1], dtype=torch.bfloat16, device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out.view(t, -1)


def kernel_fits(t: int, g: int, k: int, n: int, bn: int, bk: int) -> bool:
    """Whether `_grouped_linear_kernel` takes this call: 1..MAX_T tokens and whole tiles."""
    return 0 < t <= MAX_T and n % g == 0 and (n // g) % bn == 0 and k % bk == 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, **tiles) -> torch.Tensor:
    """`ops.grouped_linear` on CUDA: bf16 x [T, G, K] and weight [G * R, K] at 1..MAX_T tokens in
    one `_grouped_linear_kernel` launch (`tiles`: bn, bk, num_warps, num_stages for sweeps),
    otherwise `grouped_linear_bmm`."""
    from .launch import interpreting

    t, g, k = x.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or n % g:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"(weight [G * R, K] with G = {g}, K = {k})")
    interp = interpreting()
    cfg = dict(TILES_INTERP if interp else TILES, **tiles)
    if not (x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and kernel_fits(t, g, k, n, cfg["bn"], cfg["bk"])):
        return grouped_linear_bmm(x, weight)
    x = x.contiguous()
    out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
    kw = {} if interp else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    _grouped_linear_kernel[(n // cfg["bn"],)](x, weight, out.view(torch.int16), t, n, k, g * k, n // g,
                                              TB=max(16, triton.next_power_of_2(t)), BN=cfg["bn"], BK=cfg["bk"],
                                              LOWP=not interp, **kw, **pdl_launch(weight))
    return out


OPS = {"grouped_linear": grouped_linear}
