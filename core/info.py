"""Model size, activation and cache figures of a `ModelConfig` (what `dsv41 info` prints),
computed without allocating a single weight.

`model_info(cfg)` returns::

    {"kv_bytes_per_token": float, "swa_bytes_per_sequence": int,
     "params": {"backbone", "engram", "dspark", "vision",
                "activated_prefill", "activated_decode", "total": int},
     "layers": {"swa", "full", "reindex", "reuse", "encoder", "decoder": [layer ids]}}

Counting rules
--------------
* **Logical parameters.** A tensor counts its logical elements: a packed FP4 expert weight
  stored as int8 [N, K/2] counts N*K; FP8 / bf16 / fp32 tensors count their numel. Quantisation
  scale tensors (checkpoint names ending in `.scale`: Linear block scales, Engram row scales)
  are not parameters. Non-persistent buffers (RoPE tables, Engram multipliers, the Engram
  token map) are not in the checkpoint and are not counted. Everything else in the checkpoint
  is a parameter, small fp32 ones included (`attn_sink`, `hc_*_{fn,base,scale}`, router
  `bias` / `bias_vl`).
* **backbone** = every tensor of the Transformer: `embed`, `head`, `norm` and all layers
  (attention, compressor, indexer, mHC, norms, router, routed + shared experts), EXCEPT the
  Engram tables `layers.N.engram.embed.weight`; Engram's `wkv`, `q_weight`, `k_weight` are
  backbone. The shapes come from the model classes (`core/model.py`): one `Block` is
  instantiated on the meta device per distinct layer pattern (kind, compress ratio, Engram or
  not) from a config copy with ONE routed expert; the routed-expert part of that block
  (`ffn.experts.0.*` plus the router rows `ffn.gate.*`, all of which have one row per expert)
  is then multiplied by `n_routed_experts`. Building the whole full-config model on meta takes
  ~5 s (15360 expert modules); this takes milliseconds. `embed` [V, d] and `norm` [d] are plain
  tensors of `Transformer` and are written out here; `head` is built as the model builds it.
  tests/test_info.py checks the result against an actually built tiny model.
* **engram** = sum(engram_num_embeddings) * engram_head_dim (the hashed tables only).
* **dspark** = the `mtp.0..2` stages (MODEL.md section 3, built by `core/dspark.py`; equal to its
  logical count, checked in tests/test_info.py),
  each taken as a backbone `Block` of an SWA-only layer (ratio 0: attention without compressor
  or indexer; mHC `hc_*`; `attn_norm`, `ffn_norm`; a MoE with `dspark_n_routed_experts`
  routed experts of `moe_intermediate_size`, `n_shared_experts` shared expert(s) and the router,
  incl. `bias_vl` when vision is configured, as the backbone router has), no Engram; plus
  - `mtp.0.main_proj` [d, len(dspark_target_layer_ids) * d] and `mtp.0.main_norm` [d];
  - `mtp.2.markov_head.embed` [V, r] and `mtp.2.markov_head.head` [V, r] with
    r = dspark_markov_rank. Our reading of "a Markov head adds embed[previous draft] . head^T":
    a rank-r factorisation of a V x V bigram logit table, so `embed[prev] @ head^T` is a [V]
    logit vector added to the stage's logits; both factors are [V, r], consistent with the
    spec's sharding rule that splits both on dim 0 (the vocabulary);
  - `mtp.2.confidence_head.proj` [1, d + r] (reads concat(hidden before the final norm,
    Markov embedding), no bias) and `mtp.2.norm` [d].
  The embedding and the output head are shared with the backbone and not counted again.
* **vision** = DeepSeek-ViT + aligner + image embeddings, with w = vision width, m = vision
  MLP width: patch embedding 3 * patch^2 -> w with bias (588 x 1024 + 1024); per layer the
  fused `wqkv` (3w^2 + 3w bias), `wo` (w^2 + w bias), the fused SwiGLU `w1` (2 w m) and `w2`
  (m w), 2 RMSNorms (w each); a final RMSNorm (w); aligner `w1` (9w -> d) and `w2` (d -> d),
  both with biases; `image_start`, `image_newline`, `image_end` (d each). 2D RoPE has no
  parameters. 0 when `cfg.vision` is None.
* **total** = backbone + engram + dspark + vision.
* **activated_decode** (per generated token): for all layers, the whole attention module
  (including compressor and indexer where present: they run for every token), `attn_norm`,
  `ffn_norm`, mHC, the router (`gate.weight` and `gate.bias`: every expert's logit is
  computed; `bias_vl` serves image tokens only), `num_experts_per_tok` routed experts and the
  shared expert(s); on Engram layers `wkv`, `q_weight`, `k_weight` and the
  (max_ngram - 1) * n_heads = 24 rows of head_dim read from the tables; plus one embedding row
  (d), `norm` (d) and the full `head` (V x d). DSpark drafting is not included.
* **activated_prefill** (per prompt token under CED prefill): the same per-layer figure for
  the encoder layers 0 .. decoder_start - 1 (Engram included), plus what the decoder's KV
  source (layer `decoder_start`) runs on every token to build the global KV
  (`Transformer.forward` -> `update_global`): its `attn_norm`, `attn.compressor.*` and the
  indexer key path `attn.indexer.{wk, k_norm}`; plus one embedding row. No head and no decoder
  layers: the decoder runs only over the last window (amortised to ~0 per token).

Published config (`ModelConfig()`): kv 890 B/token; backbone 551,880,835,184 (551.88B; equal to
the logical count of a meta-device `Transformer` state dict), engram 196,613,849,600 (196.61B),
dspark 14.23B, vision 0.49B, total 763.21B; activated prefill 7.90B, decode 16.13B. The spec
quotes "about 552B, 196B, 8B, 16B": all within 1%. Decode is 40 x ~0.39B per layer (attention
~0.13B + 7 experts x 35.4M) + head 0.66B + Engram 0.31B; prefill is the first 20 of those
layers (both Engram layers are encoder layers) + ~2.7M for layer 20's compressor / key path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .cache import kv_bytes_per_token, swa_bytes_per_sequence
from .config import ModelConfig
from .model import Block, Linear, RMSNorm

_KINDS = ("swa", "full", "reindex", "reuse")


# ---- logical sizes of a module's checkpoint tensors --------------------------------------------

def logical_sizes(module: nn.Module) -> dict[str, int]:
    """{checkpoint name: logical parameter count} of `module` (rules in the module docstring):
    Linear weights count out x in whatever their storage (packed FP4 included), `*.scale`
    quantisation scales are skipped, everything else counts its numel."""
    linears = {name: m for name, m in module.named_modules() if isinstance(m, Linear)}
    out: dict[str, int] = {}
    for name, t in module.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if leaf == "scale":
            continue
        if owner in linears and leaf == "weight":
            lin = linears[owner]
            out[name] = lin.out_features * lin.in_features
        else:
            out[name] = t.numel()
    return out


@dataclasses.dataclass
class _LayerCount:
    """Parameters of one layer, split by how they scale and activate."""

    dense: int  # attention, norms, mHC, shared experts, Engram dense parts (always run)
    per_expert: int  # one routed expert (w1, w2, w3)
    router_per_expert: int  # gate rows of one expert (weight row + bias (+ bias_vl))
    router_active_per_expert: int  # of which run for a text token (weight row + bias)
    n_experts: int
    engram_rows_dim: int  # head_dim of the Engram table rows (0: no Engram here)
    kv_source_per_token: int  # attn_norm + compressor + indexer key path (Full layers)

    @property
    def total(self) -> int:
        return self.dense + self.n_experts * (self.per_expert + self.router_per_expert)


def _block_count(cfg: ModelConfig, layer_id: int, engram: bool, n_experts: int) -> _LayerCount:
    """Count one layer by instantiating its `Block` on meta with a single routed expert."""
    one = cfg.replace(n_routed_experts=1, num_experts_per_tok=1)
    with torch.device("meta"):
        blk = Block(one, layer_id, 0 if engram else None)
    sizes = logical_sizes(blk)
    per_expert = sum(v for k, v in sizes.items() if k.startswith("ffn.experts.0."))
    router = {k: v for k, v in sizes.items() if k.startswith("ffn.gate.")}
    assert not any(k.startswith("ffn.experts.") and not k.startswith("ffn.experts.0.") for k in sizes)
    dense = sum(v for k, v in sizes.items()
                if not k.startswith(("ffn.experts.", "ffn.gate.", "engram.embed.")))
    kv_src = sizes["attn_norm.weight"] + sum(
        v for k, v in sizes.items()
        if k.startswith(("attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.")))
    return _LayerCount(
        dense=dense,
        per_expert=per_expert,
        router_per_expert=sum(router.values()),
        router_active_per_expert=sum(v for k, v in router.items() if k in ("ffn.gate.weight", "ffn.gate.bias")),
        n_experts=n_experts,
        engram_rows_dim=cfg.engram_head_dim if engram else 0,
        kv_source_per_token=kv_src,
    )


def _layer_counts(cfg: ModelConfig) -> list[_LayerCount]:
    """One `_LayerCount` per backbone layer; one Block built per distinct pattern."""
    memo: dict[tuple, _LayerCount] = {}
    out = []
    for i in range(cfg.num_hidden_layers):
        engram = i in cfg.engram_layer_ids
        key = (cfg.layer_kind(i), cfg.compress_ratios[i], engram)
        if key not in memo:
            memo[key] = _block_count(cfg, i, engram, cfg.n_routed_experts)
        out.append(memo[key])
    return out


def _activated(cfg: ModelConfig, c: _LayerCount, n_routed: int) -> int:
    """Parameters one token touches in one layer (text token)."""
    return (c.dense + n_routed * c.per_expert + c.n_experts * c.router_active_per_expert
            + cfg.n_engram_rows_per_token * c.engram_rows_dim)


# ---- the parts outside the backbone -----------------------------------------------------------

def _dspark_params(cfg: ModelConfig) -> int:
    n = cfg.num_nextn_predict_layers
    if n <= 0:
        return 0
    d, v, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    total = 0
    for k in range(n):
        # stage k uses compress_ratios[L + k] (0: SWA only); same Block as a backbone layer
        total += _block_count(cfg, cfg.num_hidden_layers + k, False, cfg.dspark_n_routed_experts).total
    with torch.device("meta"):
        extra = nn.ModuleDict({
            "main_proj": Linear(len(cfg.dspark_target_layer_ids) * d, d, "bf16"),
            "main_norm": RMSNorm(d, cfg.rms_norm_eps),
            "confidence_proj": Linear(d + r, 1, "bf16"),
            "norm": RMSNorm(d, cfg.rms_norm_eps),
        })
    total += sum(logical_sizes(extra).values())
    total += 2 * v * r  # markov_head.embed [V, r] + markov_head.head [V, r]
    return total


def _vision_params(cfg: ModelConfig) -> int:
    vc = cfg.vision
    if vc is None:
        return 0
    w, m, d = vc.hidden_size, vc.intermediate_size, cfg.hidden_size
    patch = 3 * vc.patch_size ** 2 * w + w
    layer = 4 * w * w + 4 * w + 3 * w * m + 2 * w
    aligner = vc.downsample_ratio ** 2 * w * d + d + d * d + d
    return patch + vc.num_hidden_layers * layer + w + aligner + 3 * d


# ---- public API -------------------------------------------------------------------------------

def model_info(cfg: ModelConfig) -> dict[str, Any]:
    """Sizes, activated parameters, cache bytes and layer plan of `cfg` (no weight allocation).
    The counting rules are in this module's docstring."""
    cfg.validate()
    L, d, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    counts = _layer_counts(cfg)
    with torch.device("meta"):
        head = Linear(d, v, "bf16")
    outer = v * d + d + sum(logical_sizes(head).values())  # embed [V, d], norm [d], head
    backbone = outer + sum(c.total for c in counts)
    engram = sum(cfg.engram_num_embeddings) * cfg.engram_head_dim if cfg.engram_layer_ids else 0
    dspark = _dspark_params(cfg)
    vision = _vision_params(cfg)

    k_dec = cfg.num_experts_per_tok
    per_layer = [_activated(cfg, c, k_dec) for c in counts]
    ds = cfg.decoder_start
    activated_decode = sum(per_layer) + d + d + v * d  # embed row, final norm, head
    activated_prefill = sum(per_layer[:ds]) + counts[ds].kv_source_per_token + d

    layers = {k: [i for i in range(L) if cfg.layer_kind(i) == k] for k in _KINDS}
    layers["encoder"] = list(range(ds))
    layers["decoder"] = list(range(ds, L))
    return {
        "kv_bytes_per_token": float(kv_bytes_per_token(cfg)),
        "swa_bytes_per_sequence": int(swa_bytes_per_sequence(cfg)),
        "params": {
            "backbone": int(backbone),
            "engram": int(engram),
            "dspark": int(dspark),
            "vision": int(vision),
            "activated_prefill": int(activated_prefill),
            "activated_decode": int(activated_decode),
            "total": int(backbone + engram + dspark + vision),
        },
        "layers": layers,
    }


def _count(n: int | float) -> str:
    """Billions with 2 decimals for big numbers (>= 1e8), plain counts (thousands separated)
    otherwise."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{int(n):,}"


def _bytes(n: int | float) -> str:
    s = f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"
    if n >= 1 << 20:
        s += f" ({n / (1 << 20):.2f} MiB)"
    elif n >= 1 << 10:
        s += f" ({n / (1 << 10):.2f} KiB)"
    return s


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    if not ids:
        return "-"
    parts, start, prev = [], ids[0], ids[0]
    for i in list(ids[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def format_info(info: dict[str, Any]) -> str:
    """A human-readable table of `model_info`'s result."""
    p = info["params"]
    rows: list[tuple[str, str]] = [
        ("parameters", ""),
        ("  backbone", _count(p["backbone"])),
        ("  engram tables", _count(p["engram"])),
        ("  dspark (mtp)", _count(p["dspark"])),
        ("  vision", _count(p["vision"])),
        ("  total", _count(p["total"])),
        ("activated per token", ""),
        ("  prefill (CED)", _count(p["activated_prefill"])),
        ("  decode", _count(p["activated_decode"])),
        ("caches", ""),
        ("  global KV per token", _bytes(info["kv_bytes_per_token"])),
        ("  SWA ring per sequence", _bytes(info["swa_bytes_per_sequence"])),
        ("layers", ""),
    ]
    for k in ("encoder", "decoder", *_KINDS):
        ids = info["layers"][k]
        rows.append((f"  {k}", f"{len(ids):>3}  [{_ranges(ids)}]"))
    width = max(len(a) for a, _ in rows) + 2
    return "\n".join(f"{a:<{width}}{b}".rstrip() for a, b in rows)
