"""Tensor names: native checkpoint names (the model's buffer names, MODEL.md section 5) and
their Hugging Face-style equivalents. This module is the one place for those renames.

Native -> Hugging Face, applied to dot-separated components of a name:

* everything gets a `model.` prefix, except `head.*`, which becomes `lm_head.*`;
* the top-level `embed` becomes `embed_tokens` (`model.embed_tokens.weight`);
* `attn` -> `self_attn`, `ffn` -> `mlp`, `attn_norm` -> `input_layernorm`,
  `ffn_norm` -> `post_attention_layernorm` (whole components only: `hc_attn_fn` is unchanged);
* a final `scale` component (block scales of FP8/FP4 weights, Engram row scales) ->
  `weight_scale_inv` (the `hc_*_scale` mHC parameters are not `.scale` and are unchanged);
* the router's `gate.bias` -> `gate.e_score_correction_bias`;
* expert projections directly under `experts.E` or `shared_experts`: `w1` -> `gate_proj`,
  `w2` -> `down_proj`, `w3` -> `up_proj`.

Every other component (`wq_a`, `wkv`, `wo_a`, `compressor`, `indexer`, `engram`, `mtp`,
`bias_vl`, ...) keeps its native spelling, and the vision tower (`vision.*`, `aligner.*`) keeps
its official names whole (only the `model.` prefix): its `attn` / `mlp` are not the text
layers' modules. `hf_to_native` is the inverse on every name that
`native_to_hf` produces, and is the identity on native names, so a loader may apply it to every
key of a checkpoint in either naming.
"""

from __future__ import annotations

import re

HF_PREFIX = "model."

# Linears the released checkpoint stores FP8 E4M3 + `.scale` (E8M0 per 32x32 block) but the model
# holds in bf16: `attn.wo_a` (the official convert.py dequantises it). Loaders and `dsv41 convert`
# accept both forms and dequantise this one (native module names, without `.weight`).
RELEASED_FP8_BF16 = re.compile(r"^(layers|mtp)\.\d+\.attn\.wo_a$")

# Whole-component renames, native -> Hugging Face (any position in the name).
_COMPONENTS: dict[str, str] = {
    "attn": "self_attn",
    "ffn": "mlp",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_COMPONENTS_INV = {v: k for k, v in _COMPONENTS.items()}

# Expert projections (component right after `experts.E` or `shared_experts`).
_EXPERT_PROJ: dict[str, str] = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_PROJ_INV = {v: k for k, v in _EXPERT_PROJ.items()}

# Top-level modules renamed on the Hugging Face side (`head` also loses the `model.` prefix).
_TOP: dict[str, str] = {"embed": "embed_tokens"}
_TOP_INV = {v: k for k, v in _TOP.items()}

NATIVE_SCALE, HF_SCALE = "scale", "weight_scale_inv"
NATIVE_GATE_BIAS, HF_GATE_BIAS = "bias", "e_score_correction_bias"


def _is_expert_proj(parts: list[str], i: int) -> bool:
    if i >= 1 and parts[i - 1] == "shared_experts":
        return True
    return i >= 2 and parts[i - 2] == "experts" and parts[i - 1].isdigit()


_VERBATIM_TOP = ("vision", "aligner")


def _rename(parts: list[str], comps: dict, proj: dict, scale: tuple, bias: tuple) -> list[str]:
    out = list(parts)
    if parts[0] in _VERBATIM_TOP:
        return out
    last = len(parts) - 1
    for i, c in enumerate(parts):
        if c in comps:
            out[i] = comps[c]
        elif c in proj and _is_expert_proj(parts, i):
            out[i] = proj[c]
        elif i == last and i > 0 and c == scale[0]:
            out[i] = scale[1]
        elif i == last and i > 0 and c == bias[0] and parts[i - 1] == "gate":
            out[i] = bias[1]
    return out


def native_to_hf(name: str) -> str:
    """The Hugging Face-style name of a native checkpoint name."""
    parts = name.split(".")
    parts = _rename(parts, _COMPONENTS, _EXPERT_PROJ, (NATIVE_SCALE, HF_SCALE), (NATIVE_GATE_BIAS, HF_GATE_BIAS))
    if parts[0] == "head":
        return ".".join(["lm_head", *parts[1:]])
    parts[0] = _TOP.get(parts[0], parts[0])
    return HF_PREFIX + ".".join(parts)


def hf_to_native(name: str) -> str:
    """The native checkpoint name of a Hugging Face-style name (identity on native names)."""
    if name.startswith("lm_head."):
        return "head." + name[len("lm_head."):]
    if name.startswith(HF_PREFIX):
        name = name[len(HF_PREFIX):]
        parts = name.split(".")
        parts[0] = _TOP_INV.get(parts[0], parts[0])
    else:
        parts = name.split(".")
    parts = _rename(parts, _COMPONENTS_INV, _EXPERT_PROJ_INV, (HF_SCALE, NATIVE_SCALE), (HF_GATE_BIAS, NATIVE_GATE_BIAS))
    return ".".join(parts)


def is_hf_name(name: str) -> bool:
    """Whether `name` is in the Hugging Face spelling (it differs from its native name)."""
    return hf_to_native(name) != name


def released_fp8_bf16(stored: dict, expected: dict) -> tuple[list[str], list[str]]:
    """Find the released-form FP8 weights of bf16 linears (`RELEASED_FP8_BF16`).

    `stored` and `expected` map native tensor names to (shape, torch dtype): the checkpoint's and
    the model's. Returns (owners stored FP8 + `.scale` where the model wants a bf16 `.weight`
    without a scale, problems with such pairs: a missing or misshapen scale, a misshapen weight).
    """
    import torch

    owners, problems = [], []
    for name, (shape, dtype) in stored.items():
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight" or not RELEASED_FP8_BF16.match(owner) or dtype != torch.float8_e4m3fn:
            continue
        want = expected.get(name)
        if want is None or want[1] != torch.bfloat16 or owner + ".scale" in expected:
            continue
        n, k = want[0]
        block = (-(-n // 32), -(-k // 32))
        scale = stored.get(owner + ".scale")
        if tuple(shape) != tuple(want[0]):
            problems.append(f"wrong shape: {name} is {list(shape)}, expected {list(want[0])}")
        elif scale is None:
            problems.append(f"missing: {owner}.scale (the E8M0 32x32 block scales of the FP8 {name})")
        elif tuple(scale[0]) != block or scale[1] != torch.float8_e8m0fnu:
            problems.append(f"wrong scale: {owner}.scale is {scale[1]} {list(scale[0])}, expected "
                            f"torch.float8_e8m0fnu {list(block)} for the FP8 {name}")
        else:
            owners.append(owner)
    return owners, problems
