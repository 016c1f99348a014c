"""Pure-torch emulations of the torch_npu operators the Ascend backend calls, following their
documented semantics (torch_npu 2.10.0.post4's `_op_plugin_docs.py` and CANN's operator
descriptions / golden scripts), so the backend's use of them runs on CPU in tests.

- `npu_moe_init_routing_v2`: a stable sort of the flattened (row-major, s = token * K + k)
  expert ids; expanded_x[j] = x[sorted[j] // K] for the slots whose expert lies in
  active_expert_range; expanded_row_idx (row_idx_type=0) maps slot s -> its row j, -1 for
  dropped slots; counts per active expert (count mode). Rows past the routed ones are
  undefined: filled with NaN here, so a caller that reads them shows it.
- `npu_grouped_matmul` (split_item=2, group_type=0, count-mode group_list): consecutive row
  groups times their expert's [K, N] weight; rows past the groups undefined (NaN).
- `npu_moe_finalize_routing`: out[i] = skip1 + skip2 + sum_k scales[i, k] *
  (rows[src_to_dst[k * NUM_ROWS + i]] + bias[expert[i, k]]) (k-major, CANN's golden script);
  an index outside [0, NUM_ROWS * K) raises (the documented range with drop_pad_mode=0).
- `npu_dynamic_quant`, `npu_quant_matmul`, `npu_rms_norm`: per-token symmetric int8, the
  int8 matmul with both scales in the epilogue, RMSNorm returning (y, rstd).
These are test doubles, not the operators: agreement shows the backend uses the documented
semantics correctly, not that the hardware implements them so (unverified on hardware).
"""

from __future__ import annotations

import types

import torch

UNDEFINED = float("nan")


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0):
    assert expert_idx.dtype == torch.int32 and drop_pad_mode == 0 and quant_mode == -1 and row_idx_type == 0
    assert expert_tokens_num_type == 1 and expert_tokens_num_flag
    n, k = expert_idx.shape
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    flat = expert_idx.reshape(-1).long()
    active = (flat >= start) & (flat < end)
    key = torch.where(active, flat, torch.full_like(flat, end))  # dropped slots sort last
    order = torch.sort(key, stable=True).indices  # row j <- slot order[j]
    n_active = int(active.sum())
    row_idx = torch.full((n * k,), -1, dtype=torch.int32)
    row_idx[order[:n_active]] = torch.arange(n_active, dtype=torch.int32)
    expanded = torch.full((n * k, x.shape[1]), UNDEFINED, dtype=x.dtype)
    expanded[:n_active] = x[order[:n_active] // k]
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    return expanded, row_idx, counts, torch.empty(n * k, dtype=torch.float32)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None):
    assert split_item == 2 and group_type == 0 and group_list_type == 1 and len(x) == 1 and len(weight) == 1
    a, w = x[0], weight[0]
    out = torch.full((a.shape[0], w.shape[2]), UNDEFINED, dtype=torch.float32)
    row = 0
    for e, c in enumerate(group_list.tolist()):
        if a.dtype == torch.int8:  # exact int32 sums, both scales in the epilogue
            acc = (a[row:row + c].to(torch.int64) @ w[e].to(torch.int64)).float()
            out[row:row + c] = acc * per_token_scale[0][row:row + c].unsqueeze(1) * scale[0][e].unsqueeze(0)
        else:
            out[row:row + c] = a[row:row + c].float() @ w[e].float()
        row += c
    return [out.to(output_dtype or (torch.bfloat16 if a.dtype == torch.int8 else a.dtype))]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    rows = expanded_permuted_rows.float()
    n, k = scales.shape
    idx = expanded_src_to_dst_row.long()
    if idx.min() < 0 or idx.max() >= n * k:
        raise IndexError("expanded_src_to_dst_row outside [0, NUM_ROWS * K) (drop_pad_mode=0)")
    out = torch.zeros(n, rows.shape[1])
    for s in (skip1, skip2):
        if s is not None:
            out += s.float()
    for kk in range(k):
        picked = rows[idx[kk * n:(kk + 1) * n]]
        if bias is not None:
            picked = picked + bias.float()[export_for_source_row[:, kk].long()]
        out += scales[:, kk:kk + 1].float() * picked
    return out.to(expanded_permuted_rows.dtype)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=torch.int8):
    xf = input.float()
    s = xf.abs().amax(-1).clamp_min(1e-30) / 127.0
    q = torch.round(xf / s.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, s


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    acc = (x1.to(torch.int64) @ x2.to(torch.int64)).float()
    return (acc * pertoken_scale.unsqueeze(1) * scale.unsqueeze(0)).to(output_dtype or torch.int8)


def npu_rms_norm(input, gamma, epsilon=1e-6):
    xf = input.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(input.dtype), rstd


def fake_torch_npu() -> types.ModuleType:
    """A module object standing in for `torch_npu` with the emulations above."""
    mod = types.ModuleType("torch_npu")
    for name in ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_dynamic_quant",
                 "npu_quant_matmul", "npu_rms_norm"):
        setattr(mod, name, globals()[name])
    return mod
