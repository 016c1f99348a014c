"""Model configuration: one `ModelConfig` for the nested Hugging Face `config.json`, the flat
inference `config.json`, and the built-in presets (`tiny`, `mini`, `full`).

Every problem found by `validate()` is reported in one `ConfigError` that lists them all, one
line each, so a user fixes a config in one pass.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPE = "deepseek_v41"


class ConfigError(ValueError):
    """A malformed or inconsistent model configuration."""


@dataclass
class RopeScaling:
    """YaRN parameters, applied only to layers whose compress ratio is > 0."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class VisionConfig:
    """DeepSeek-ViT tower, 3x3 aligner and image preprocessing (core/vision.py,
    core/image_processing.py).

    `max_image_tokens` counts every prompt position of one image, framing included (see
    `image_processing.image_layout`); `min_pixels` is the smallest area an image is upscaled to
    (544^2, flat key `vision_min_pixels`; the tiny preset uses a small one so its 64-token budget
    is not always the binding limit); `max_wh_ratio` (flat `vision_max_wh_ratio`, null as
    released) caps width / height. `rope_theta` is the 2D RoPE base (10000).
    """

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: float | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


@dataclass
class ModelConfig:
    """Text backbone (+ Engram, DSpark, vision sizes) of DeepSeek-V4.1-Flash.

    Field names follow the nested Hugging Face `text_config`. Layer roles derive from the
    id lists: `kv_source_layer_ids` are Full layers (own compressor + indexer keys), the other
    `index_source_layer_ids` are Reindex layers, every other layer with ratio > 0 is Reuse,
    ratio-0 layers are SWA-only. The decoder starts at the last KV source (CED boundary).
    """

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    compress_ratios: list[int] = field(
        default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    )
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(
        default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36]
    )
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    engram_vocab_size: int = 16000000
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int | None = 129264
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    # Storage of the dense linears: "fp8" (E4M3, E8M0 32x32 block scales) or "bf16".
    weight_dtype: str = "fp8"
    # Routed experts: "fp4" (E2M1 pairs, E8M0 per 32) or "fp8".
    expert_dtype: str = "fp4"
    # Engram rows: "fp8" (E4M3, E8M0 scale per 32) or "int8" (one fp32 scale per row; the
    # Ascend host-offload form written by `dsv41 convert --engram-dtype int8`).
    engram_dtype: str = "fp8"
    bos_token_id: int = 0
    eos_token_id: int = 1

    # ---- derived layer plan -------------------------------------------------------------
    @property
    def decoder_start(self) -> int:
        """First decoder layer: the last KV source (the decoder's only global KV source)."""
        return self.kv_source_layer_ids[-1]

    def layer_kind(self, layer: int) -> str:
        """'swa' | 'full' | 'reindex' | 'reuse' for backbone layer `layer`."""
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    def kv_source_of(self, layer: int) -> int | None:
        """Latest KV source layer at or below `layer` (None for SWA-only layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        """Latest index source (Full or Reindex layer) at or below `layer`."""
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    @property
    def n_engram_rows_per_token(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ---- validation ---------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every inconsistency in this config, one sentence each (empty when valid)."""
        p: list[str] = type_problems(self)
        if p:  # the checks below compare and divide these values
            return p
        L = self.num_hidden_layers
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters",
            "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
            "candidate_block_size", "max_position_embeddings",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{name} must be a positive integer, got {v!r}")
        if p:  # the checks below divide by these
            return p
        if self.num_key_value_heads != 1:
            p.append(f"num_key_value_heads must be 1 (one shared K=V latent), got {self.num_key_value_heads}")
        if self.num_attention_heads % self.o_groups:
            p.append(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by o_groups ({self.o_groups})"
            )
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            p.append(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most head_dim "
                f"({self.head_dim}) and index_head_dim ({self.index_head_dim})"
            )
        for name in ("hidden_size", "head_dim", "q_lora_rank", "o_lora_rank", "moe_intermediate_size",
                     "index_head_dim"):
            if getattr(self, name) % 32:
                p.append(f"{name} ({getattr(self, name)}) must be a multiple of 32 (FP8/FP4 block size)")
        if self.num_experts_per_tok > self.n_routed_experts:
            p.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.scoring_func != "sqrtsoftplus":
            p.append(f"scoring_func must be 'sqrtsoftplus' (V4.1 routing), got {self.scoring_func!r}")
        if self.weight_dtype not in ("fp8", "bf16", "int8"):
            p.append(f"weight_dtype must be 'fp8', 'bf16' or 'int8' (W8A8), got {self.weight_dtype!r}")
        if self.expert_dtype not in ("fp4", "fp8", "bf16", "int8"):
            p.append(f"expert_dtype must be 'fp4', 'fp8', 'bf16' or 'int8', got {self.expert_dtype!r}")
        if self.engram_dtype not in ("fp8", "int8"):
            p.append(f"engram_dtype must be 'fp8' or 'int8', got {self.engram_dtype!r}")
        if not isinstance(self.norm_topk_prob, bool):
            p.append(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        n_ratios = L + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_ratios:
            p.append(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"num_nextn_predict_layers = {L} + {self.num_nextn_predict_layers} = {n_ratios}"
            )
            return p
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                p.append(f"compress_ratios[{i}] = {r}: only 0 (SWA only), 1 and 2 are supported")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                p.append(f"{name} must be strictly increasing, got {ids}")
            bad = [i for i in ids if not 0 <= i < L]
            if bad:
                p.append(f"{name} has layer ids outside 0..{L - 1}: {bad}")
        if p:
            return p
        if not self.kv_source_layer_ids:
            p.append("kv_source_layer_ids is empty: the decoder needs a global KV source")
            return p
        for s in self.kv_source_layer_ids:
            if self.compress_ratios[s] == 0:
                p.append(f"KV source layer {s} has compress ratio 0: a KV source must compress (ratio 1 or 2)")
        for s in self.kv_source_layer_ids:
            if s not in self.index_source_layer_ids:
                p.append(f"KV source layer {s} is missing from index_source_layer_ids (Full layers publish top-k)")
        first_full = self.kv_source_layer_ids[0]
        for s in self.index_source_layer_ids:
            if s < first_full:
                p.append(f"Reindex layer {s} comes before the first Full layer ({first_full}): no keys to re-score")
            elif self.compress_ratios[s] == 0:
                p.append(f"index source layer {s} has compress ratio 0")
        for layer in range(L):
            r = self.compress_ratios[layer]
            if r > 0:
                src = self.kv_source_of(layer)
                if src is None:
                    p.append(f"layer {layer} has ratio {r} but no KV source at or below it")
                elif self.compress_ratios[src] != r:
                    p.append(
                        f"layer {layer} has ratio {r} but its KV source (layer {src}) has ratio "
                        f"{self.compress_ratios[src]}"
                    )
        d = self.decoder_start
        if self.compress_ratios[d] != 1:
            p.append(f"the decoder's KV source (layer {d}, last of kv_source_layer_ids) must have ratio 1")
        if self.candidate_source_layer_id != d:
            p.append(
                f"candidate_source_layer_id ({self.candidate_source_layer_id}) must be the decoder's KV source ({d})"
            )
        if self.rope_scaling is not None and self.rope_scaling.factor <= 0:
            p.append(f"rope_scaling.factor must be > 0, got {self.rope_scaling.factor}")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                p.append(
                    f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                    f"{len(self.engram_layer_ids)} engram layers"
                )
            if self.engram_max_ngram_size < 2:
                p.append(f"engram_max_ngram_size must be >= 2, got {self.engram_max_ngram_size}")
            if self.engram_head_dim % 32:
                p.append(f"engram_head_dim ({self.engram_head_dim}) must be a multiple of 32")
            if not 0 <= self.engram_pad_token_id < self.vocab_size:
                p.append(f"engram_pad_token_id ({self.engram_pad_token_id}) is outside the vocabulary")
            cv = self.engram_compressed_vocab_size
            if not isinstance(cv, int) or isinstance(cv, bool) or not 0 < cv <= self.vocab_size:
                p.append(f"engram_compressed_vocab_size ({cv!r}) must be the size of the tokenizer's Engram "
                         f"token map, between 1 and vocab_size ({self.vocab_size})")
        if self.vision is not None and self.image_token_id is not None and not 0 <= self.image_token_id < self.vocab_size:
            p.append(f"image_token_id ({self.image_token_id}) is outside the vocabulary ({self.vocab_size})")
        if self.vision is not None:
            vc = self.vision
            if vc.hidden_size % vc.num_attention_heads or (vc.hidden_size // vc.num_attention_heads) % 4:
                p.append(f"vision hidden_size ({vc.hidden_size}) / num_attention_heads ({vc.num_attention_heads}) "
                         "must be a multiple of 4 (2D RoPE: half the head rotates by rows, half by columns)")
            if vc.max_image_tokens < 4:
                p.append(f"vision max_image_tokens must be >= 4 (start, one cell, newline, end), got {vc.max_image_tokens}")
            if vc.min_pixels < 0 or vc.patch_size < 1 or vc.downsample_ratio < 1:
                p.append("vision min_pixels must be >= 0, patch_size and downsample_ratio >= 1")
            if vc.max_wh_ratio is not None and not vc.max_wh_ratio > 0:
                p.append(f"vision max_wh_ratio must be positive or null, got {vc.max_wh_ratio}")
        return p

    def validate(self) -> "ModelConfig":
        problems = self.problems()
        if problems:
            raise ConfigError("invalid model config:\n  - " + "\n  - ".join(problems))
        return self

    # ---- (de)serialisation --------------------------------------------------------------
    def to_flat_dict(self) -> dict[str, Any]:
        """The flat `inference/config.json` form, in the released file's key names only
        (`FLAT_RELEASED`, plus `max_seq_len`, a field of the official code's ModelArgs that the
        release leaves at its default), so the official inference code can read it. Raises
        ConfigError when the config holds something those keys cannot state (the flat form
        would load as a different model)."""
        field_key = {}
        for key, name in FLAT_KEYS.items():
            if key in FLAT_RELEASED or key == "max_seq_len":
                field_key.setdefault(name, key)
        out: dict[str, Any] = {key: getattr(self, name) for name, key in field_key.items()}
        rs = self.rope_scaling
        out.update(original_seq_len=rs.original_max_position_embeddings if rs else 0,
                   rope_factor=rs.factor if rs else 1.0, beta_fast=rs.beta_fast if rs else 32.0,
                   beta_slow=rs.beta_slow if rs else 1.0, dtype=self.weight_dtype, expert_dtype=self.expert_dtype)
        if self.vision is not None:
            vision_key = {}
            for key, name in FLAT_VISION.items():
                if key in FLAT_RELEASED:
                    vision_key.setdefault(name, key)
            out.update({key: getattr(self.vision, name) for name, key in vision_key.items()})
        if from_flat_dict(json.loads(json.dumps(out)), "flat form") != self:
            raise ConfigError("this config has values the released flat inference/config.json keys cannot state "
                              "(e.g. a non-default gate_temp, norm_topk_prob or weight dtype)")
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The nested Hugging Face `config.json` form."""
        text = {}
        for f in dataclasses.fields(self):
            if f.name in ("vision", "image_token_id", "weight_dtype", "expert_dtype", "engram_dtype"):
                continue
            v = getattr(self, f.name)
            text[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        if self.rope_scaling is not None:
            text["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if self.weight_dtype != "fp8":  # no quantization_config: the storage choices live here
            text["expert_dtype"], text["engram_dtype"] = self.expert_dtype, self.engram_dtype
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": MODEL_TYPE,
            "torch_dtype": "bfloat16",
            "text_config": text,
        }
        if self.vision is not None:
            out["vision_config"] = dataclasses.asdict(self.vision)
        out["image_token_id"] = self.image_token_id
        if self.weight_dtype == "int8":  # W8A8 (`dsv41 convert --linear-dtype int8`)
            out["quantization_config"] = {"quant_method": "w8a8", "linear_dtype": "int8",
                                          "expert_dtype": self.expert_dtype, "engram_dtype": self.engram_dtype}
        elif self.weight_dtype == "fp8":
            out["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "weight_block_size": [32, 32],
                "expert_dtype": self.expert_dtype,
                "engram_dtype": self.engram_dtype,
            }
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _type_ok(v: Any, kind: str) -> bool:
    """Whether a JSON value `v` fits the annotation `kind` of a config field (a float field
    takes an int; neither takes a bool, NaN or infinity)."""
    if kind.endswith(" | None"):
        return v is None or _type_ok(v, kind[: -len(" | None")])
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == "str":
        return isinstance(v, str)
    if kind == "list[int]":
        return isinstance(v, list) and all(_type_ok(x, "int") for x in v)
    return True  # nested dataclasses: checked field by field by `type_problems`


def type_problems(obj: Any, prefix: str = "") -> list[str]:
    """Fields of a config dataclass (and its nested RopeScaling / VisionConfig) whose values
    are not of the annotated type, e.g. `rope_scaling.factor` given as "x"."""
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out += type_problems(v, f"{prefix}{f.name}.")
        elif not _type_ok(v, str(f.type)):
            want = {"bool": "true or false", "list[int]": "a list of integers"}.get(str(f.type), str(f.type))
            want = want.replace(" | None", " or null")
            out.append(f"{prefix}{f.name} must be {want}, got {v!r}")
    return out


# Fields a config file must state: without them an empty or truncated file would silently be
# the published (full-size) model.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")


def quantization_problems(q: Any) -> list[str]:
    """What this stack cannot honour in a Hugging Face `quantization_config` (its FP8 blocks
    are 32 x 32: `weight_block_size` must say so when given)."""
    if not q:
        return []
    if not isinstance(q, dict):
        return [f"quantization_config must be an object, got {type(q).__name__}"]
    wbs = q.get("weight_block_size", [32, 32])
    if wbs != [32, 32]:
        return [f"quantization_config.weight_block_size must be [32, 32] (the FP8 block size), got {wbs!r}"]
    return []


# Flat inference config.json key -> ModelConfig field (the one place for these renames).
FLAT_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "window_size": "sliding_window",
    "sliding_window": "sliding_window",
    "moe_inter_dim": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "gate_temp": "gate_temp",
    "swiglu_limit": "swiglu_limit",
    "norm_eps": "rms_norm_eps",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "max_seq_len": "max_position_embeddings",
    "compress_ratios": "compress_ratios",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "engram_layers": "engram_layer_ids",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "engram_vocab_size": "engram_vocab_size",
    "n_mtp_layers": "num_nextn_predict_layers",
    "num_nextn_predict_layers": "num_nextn_predict_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layers": "dspark_target_layer_ids",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "image_token_id": "image_token_id",
}
# The keys of the released flat `inference/config.json` (what the official inference code's
# ModelArgs reads); `ModelConfig.to_flat_dict` writes exactly these.
FLAT_RELEASED = frozenset({
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts",
    "n_heads", "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "route_scale",
    "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank",
    "window_size", "kv_source_layers", "index_source_layers", "original_seq_len", "rope_theta", "rope_factor",
    "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
    "engram_vocab_size", "engram_num_embeddings", "engram_max_ngram_size", "engram_pad_id",
    "engram_compressed_vocab_size", "dtype", "expert_dtype", "compress_rope_theta", "compress_ratios",
    "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
    "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio", "image_token_id",
    "engram_n_heads", "engram_head_dim", "vision_rope_theta",
})
# Keys of the reference code's ModelArgs that a dump of it carries but V4.1 leaves at one value:
# accepted at that value (first entry), anything else is a clear error.
FLAT_NEUTRAL = {"n_hash_layers": (0,), "scale_dtype": ("fp8",)}  # no hash routing; E8M0 scales
# Flat keys that are known and deliberately not mapped (the fp8 `dtype`, batch sizing, ...).
FLAT_IGNORED = {"dtype", "scale_fmt", "max_batch_size", "expert_dtype", "mscale", "n_dense_layers"}
# Flat vision keys -> VisionConfig fields: the released file's names (`vision_n_layers`, ...,
# `vision_max_n_token`, `vision_min_pixels`, `vision_max_wh_ratio`, `vision_rope_theta`) and
# shorter aliases.
FLAT_VISION = {
    "vision_n_layers": "num_hidden_layers",
    "vision_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_downsample": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_max_tokens": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
    "vision_rope_theta": "rope_theta",
}
# Flat-config defaults of the reference code that differ from the published values: absent keys
# fall back to these (spec section 6: `max_seq_len` 4096 sizes caches and RoPE tables).
FLAT_DEFAULTS = {"max_position_embeddings": 4096}


def _build(kwargs: dict[str, Any], source: str) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown config keys {unknown}")
    missing = [k for k in REQUIRED_FIELDS if k not in kwargs]
    if missing:
        raise ConfigError(f"{source}: the config does not state {', '.join(missing)} (flat form: vocab_size, dim, "
                          "n_layers); an incomplete config is not read as the full model (use --preset full for that)")
    try:
        cfg = ModelConfig(**kwargs)
    except TypeError as e:  # pragma: no cover - guarded by the unknown-key check
        raise ConfigError(f"{source}: {e}") from None
    try:
        return cfg.validate()
    except ConfigError as e:  # name the file: "FILE: invalid model config:" + the problems
        raise ConfigError(f"{source}: {e}") from None


def _rope_scaling(d: Any, source: str) -> RopeScaling | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    return RopeScaling(**{k: v for k, v in d.items() if k in known})


def _vision(d: Any, source: str) -> VisionConfig | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: vision_config must be an object")
    known = {f.name for f in dataclasses.fields(VisionConfig)}
    aliases = {"width": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "mlp_dim": "intermediate_size", "max_tokens": "max_image_tokens", "downsample": "downsample_ratio"}
    kw = {}
    for k, v in d.items():
        k = aliases.get(k, k)
        if k in known:
            kw[k] = v
        elif k == "min_image_size":  # an earlier form of this file: the side of the minimum area
            kw.setdefault("min_pixels", v * v)
    return VisionConfig(**kw)


# Keys of the nested text_config that are Hugging Face boilerplate, not model structure.
HF_IGNORED = {
    "model_type", "torch_dtype", "dtype", "architectures", "transformers_version", "use_cache",
    "initializer_range", "tie_word_embeddings", "attention_bias", "attention_dropout", "hidden_act",
    "pad_token_id", "first_k_dense_replace", "topk_method", "n_group", "topk_group", "ep_size",
    "quantization_config", "num_experts", "auto_map", "_name_or_path",
}


def from_hf_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Load the nested Hugging Face form (`model_type` deepseek_v41 with `text_config`)."""
    if d.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{source}: unknown model_type {d.get('model_type')!r}, expected {MODEL_TYPE!r}")
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: missing the 'text_config' object")
    kw = {k: v for k, v in text.items() if k not in HF_IGNORED}
    if "rope_scaling" in kw:
        kw["rope_scaling"] = _rope_scaling(kw["rope_scaling"], source)
    kw["vision"] = _vision(d.get("vision_config"), source)
    if "image_token_id" in d:
        kw["image_token_id"] = d["image_token_id"]
    q = d.get("quantization_config")
    bad_q = quantization_problems(q)
    if bad_q:
        raise ConfigError(f"{source}: {bad_q[0]}")
    kw["weight_dtype"] = ("int8" if isinstance(q, dict) and q.get("linear_dtype") == "int8" else "fp8") if q else "bf16"
    if q and "expert_dtype" in q:
        kw["expert_dtype"] = q["expert_dtype"]
    if q and "engram_dtype" in q:
        kw["engram_dtype"] = q["engram_dtype"]
    return _build(kw, source)


def from_flat_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Load the flat inference form (`dim`, `n_layers`, `norm_eps`, `kv_source_layers`, ...)."""
    kw: dict[str, Any] = dict(FLAT_DEFAULTS)
    vision: dict[str, Any] = {}
    unknown = []
    rs: dict[str, Any] = {}
    for k, v in d.items():
        if k in FLAT_KEYS:
            kw[FLAT_KEYS[k]] = v
        elif k in FLAT_VISION:
            vision[FLAT_VISION[k]] = v
        elif k in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow"):
            rs[k] = v
        elif k in FLAT_NEUTRAL:
            if v not in FLAT_NEUTRAL[k]:
                raise ConfigError(f"{source}: {k} = {v!r} is not supported (V4.1 uses {FLAT_NEUTRAL[k][0]!r})")
        elif k not in FLAT_IGNORED:
            unknown.append(k)
    if unknown:
        raise ConfigError(f"{source}: unknown flat config keys {sorted(unknown)}")
    # original_seq_len > 0 turns YaRN on (ratio > 0 layers only); absent or 0 means off.
    if rs.get("original_seq_len", 0) > 0:
        kw["rope_scaling"] = RopeScaling(
            factor=rs.get("rope_factor", 40.0),
            original_max_position_embeddings=rs["original_seq_len"],
            beta_fast=rs.get("beta_fast", 32.0),
            beta_slow=rs.get("beta_slow", 1.0),
        )
    else:
        kw["rope_scaling"] = None
    kw["vision"] = VisionConfig(**vision) if vision else None
    if kw["vision"] is None:
        kw["image_token_id"] = kw.get("image_token_id")
    kw["weight_dtype"] = "fp8" if d.get("dtype", "fp8") == "fp8" else "bf16"
    if "expert_dtype" in d:
        kw["expert_dtype"] = d["expert_dtype"]
    return _build(kw, source)


def from_dict(d: Any, source: str = "config.json") -> ModelConfig:
    """Either config form: nested if it has `model_type` or `text_config`, else flat."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if "model_type" in d or "text_config" in d:
        return from_hf_dict(d, source)
    return from_flat_dict(d, source)


def load_config(path: str | Path) -> ModelConfig:
    """Load a config from a `config.json` file or a checkpoint directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{path}: checkpoint directory has no config.json")
    if not p.exists():
        raise ConfigError(f"{path}: no such config file")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return from_dict(d, str(p))


# ---- presets ------------------------------------------------------------------------------

# The size of the tiny tokenizer's Engram token map (`engram.build_compression_map` of
# `tokenizer.build_tiny_tokenizer()`; tests/test_engram.py checks it).
TINY_ENGRAM_COMPRESSED_VOCAB = 423


def _tiny() -> ModelConfig:
    """Seconds on 2 CPU cores; every layer mode appears, with a window of 8 so short prompts wrap
    the SWA ring and fill compressed groups, and a top-k / pool small enough to be exceeded.

    Layers: 0-1 SWA (Engram at 1) | 2 Full r2, 3 Reuse, 4 Full r2 (Engram), 5 Reuse |
    decoder: 6 Full r1 (candidate source), 7 Reuse, 8 Reindex, 9 Reuse, 10 Reindex, 11 Reuse.
    """
    return ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=12, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=32, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        sliding_window=8, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, hc_sinkhorn_iters=20,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=32, beta_slow=1),
        max_position_embeddings=2048,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        index_n_heads=4, index_head_dim=64, index_topk=8,
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8, 10],
        candidate_source_layer_id=6, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=[1, 4], engram_num_embeddings=[0, 0], engram_max_ngram_size=4,
        engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=2,
        engram_compressed_vocab_size=TINY_ENGRAM_COMPRESSED_VOCAB, engram_vocab_size=1000,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=3,
        dspark_target_layer_ids=[9, 10, 11], dspark_markov_rank=32, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, image_token_id=4,
        vision=VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                            intermediate_size=128, patch_size=14, downsample_ratio=3, max_image_tokens=64,
                            min_pixels=112 * 112),
    )


def _mini() -> ModelConfig:
    """Real per-layer widths with few layers and experts: the one-GPU benchmark config."""
    return ModelConfig(
        num_hidden_layers=6, n_routed_experts=16,
        compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3,
        engram_layer_ids=[0, 1], engram_num_embeddings=[0, 0], engram_vocab_size=100000,
        dspark_target_layer_ids=[3, 4, 5], max_position_embeddings=131072,
        # the drafter in proportion: the published one has a third of the backbone's experts
        # (128 of 384); 8 of 16 keeps every model-parallel split up to 8 ways
        dspark_n_routed_experts=8,
        rope_scaling=RopeScaling(),
    )


PRESETS = {"tiny": _tiny, "mini": _mini, "full": ModelConfig}


def preset(name: str) -> ModelConfig:
    """A built-in config. Engram table sizes of tiny/mini are filled in from their primes."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    if cfg.engram_layer_ids and 0 in cfg.engram_num_embeddings:
        from .engram import engram_primes

        primes = engram_primes(cfg)
        cfg = cfg.replace(engram_num_embeddings=[sum(p) for p in primes])
    return cfg.validate()


def rope_ratio_uses_yarn(cfg: ModelConfig, ratio: int) -> bool:
    return ratio > 0 and cfg.rope_scaling is not None


def yarn_inv_freq(cfg: ModelConfig, ratio: int) -> "list[float]":
    """Inverse frequencies of the interleaved RoPE pairs for a layer of this compress ratio.

    Ratio-0 layers: theta `rope_theta`, no YaRN. Ratio > 0: theta `compress_rope_theta` with
    the YaRN blend and no magnitude scaling (for the published config: pairs >= 25 divided by
    16, pairs <= 15 unchanged, a linear ramp between).
    """
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta
    freqs = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if not rope_ratio_uses_yarn(cfg, ratio):
        return freqs
    rs = cfg.rope_scaling
    assert rs is not None

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        smooth = 1.0 - ramp
        out.append(f / rs.factor * (1 - smooth) + f * smooth)
    return out
