"""A prefill step's transient device memory, and the engine's default tokens per step from it.

vLLM sizes its scheduler's token budget from a memory budget; the engine does the same: when the
user gives no `max_tokens_per_step`, a device engine takes the most tokens per step whose
estimated transient memory (activations and scratch that live only during the step) stays
within `TRANSIENT_FRACTION` of the weights plus the KV pools, so a long prompt's prefill peaks
at about (1 + TRANSIENT_FRACTION) x (weights + KV), and at most one MoE pass
(`MAX_TOKENS_PER_STEP`).

The estimate follows the device path's allocations, item by item, as the allocator history of
an exact 32K prefill of the mini preset showed them (`benchmarks/prefill_memory.py`, H200,
2026-12-01; the comments give the mini size at 8192 tokens). It is a model of the CUDA kernels'
buffers, not of the CPU reference (which computes in fp64 and is not memory-bound), and it
over-counts slightly (every item taken at its largest, all live at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

TRANSIENT_FRACTION = 0.15  # the bound: peak <= 1.15 x (weights + KV)
STEP_MULTIPLE = 256  # the default is rounded down to a multiple of this many tokens
MIN_TOKENS_PER_STEP = 256  # below this the weights are read too often per token: not worth it
CPU_TOKENS_PER_STEP = 2048  # the reference engine's fixed default on the CPU

# The MoE prefill path's constants (npu_ops/triton/moe_grouped.py: PREFILL_SLICE_TOKENS,
# PREDEQUANT_GROUP, the prefill tiles' BM). Repeated here because core/ imports no kernel code;
# tests/test_memory.py holds them equal.
MOE_SLICE_TOKENS = 2048
# The default's ceiling: the MoE's pass length. A longer step runs its MoE in several passes,
# each filling the bf16 expert scratch again (the largest fixed cost of a step: 6 x 0.48 ms at
# the mini preset on the H200), so past one pass a step saves only the dense weights' re-reads
# and some launches while its transient memory keeps growing.
MAX_TOKENS_PER_STEP = MOE_SLICE_TOKENS
MOE_SCRATCH_EXPERTS = 2
MOE_BLOCK_ROWS = 128
# Everything else per token and hidden unit: norm and linear outputs, FP8 copies, the gathered
# table rows, the MoE's fp32 [T, d] sum (0.93 GiB at 8192 mini tokens: about 24 bytes per unit)
OTHER_BYTES_PER_UNIT = 24


@dataclass(frozen=True)
class PrefillFootprint:
    """Transient bytes of one prefill step: `per_token` x tokens (up to the MoE pass length,
    `moe_per_token` only up to it) + `fixed`."""

    per_token: int  # everything that grows with the step's tokens
    moe_per_token: int  # the MoE pass buffers (grow up to MOE_SLICE_TOKENS tokens, then stay)
    fixed: int  # the expert scratch and the padded blocks of one pass

    def bytes(self, tokens: int) -> int:
        return self.per_token * tokens + self.moe_per_token * min(tokens, MOE_SLICE_TOKENS) + self.fixed


def prefill_footprint(cfg: ModelConfig) -> PrefillFootprint:
    """The estimate for `cfg` (module docstring)."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    streams = hc * d * 2  # the [T, hc, d] bf16 residual streams (0.31 GiB)
    mhc = hc * d * 5  # mHC mixing: fp32 stream copies + bf16 outputs (0.78 GiB)
    pool = (cfg.candidate_topk_blocks * 4  # int32 block ids (64 MiB; 1 GiB as int64 entry ids before)
            if cfg.candidate_source_layer_id is not None and cfg.candidate_topk_blocks > 0 else 0)
    topk = len(cfg.index_source_layer_ids) * 2 * cfg.index_topk * 8  # kept ids + one in flight (0.19 GiB)
    other = OTHER_BYTES_PER_UNIT * d
    k, inter, n_exp = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_routed_experts
    moe = k * d * 4 + k * inter * 2 + 2 * d * 2  # fp32 expert outputs, bf16 h, x quantised (+ permuted)
    fixed = (min(MOE_SCRATCH_EXPERTS, n_exp) * 3 * inter * d * 2  # bf16 scratch of a group of experts
             + n_exp * MOE_BLOCK_ROWS * inter * 2)  # h's padding: up to a block per expert
    return PrefillFootprint(streams + mhc + pool + topk + other, moe, fixed)


def tokens_per_step_for(cfg: ModelConfig, budget_bytes: int) -> int:
    """The most tokens per step (a multiple of STEP_MULTIPLE, within MIN_TOKENS_PER_STEP ..
    MAX_TOKENS_PER_STEP) whose estimated transient memory fits `budget_bytes`."""
    fp = prefill_footprint(cfg)
    lo, hi = MIN_TOKENS_PER_STEP // STEP_MULTIPLE, MAX_TOKENS_PER_STEP // STEP_MULTIPLE
    best = lo
    for m in range(lo, hi + 1):  # (64 candidates: no need to invert the piecewise-linear form)
        if fp.bytes(m * STEP_MULTIPLE) <= budget_bytes:
            best = m
    return best * STEP_MULTIPLE


def weight_bytes(model, skip: tuple[str, ...] = ("cpu", "meta")) -> int:
    """Bytes of a model's tensors on the device (parameters and buffers, each storage once;
    tensors on the `skip` device types, such as Engram tables held in host memory, left out)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type not in skip and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def default_tokens_per_step(cfg: ModelConfig, weight_bytes: int, kv_bytes: int = 0,
                            fraction: float = TRANSIENT_FRACTION) -> int:
    """The engine's default step budget on a device: transient <= fraction x (weights + KV)."""
    if not 0 < fraction:
        raise ValueError(f"the transient memory fraction must be > 0, got {fraction}")
    if weight_bytes < 0 or kv_bytes < 0:
        raise ValueError(f"weight and KV bytes must be >= 0, got {weight_bytes} and {kv_bytes}")
    return tokens_per_step_for(cfg, int(fraction * (weight_bytes + kv_bytes)))
