"""The vLLM side of our caches: one `AttentionLayerBase` per cache owner, declaring its KV
cache spec (`paged_cache.LayerRequest` -> vLLM spec) and registered in vLLM's forward context,
so vLLM's block manager allocates, frees and prefix-caches it and binds its pages.

On vLLM (`vllm_specs`):
- "global" (KV-source layers): `FullAttentionSpec` with `tokens_per_state = ratio` and one
  uint8 record per state: prefix-cacheable, paged like any full-attention cache.
- "swa" (every layer): `SlidingWindowMLASpec(bounded_replay=True)`, vLLM's DeepSeek-V4.1 mode:
  blocks outside the window are freed, the group is never prefix-cached, and after a hit the
  scheduler rewinds the computed tokens by `sliding_window` (our replay length) to rebuild it.

On vllm-ascend (`ascend_specs`; its platform is the current one and its spec module imports):
its runner allocates and binds DeepSeek-V4 caches only for its own spec classes
(`vllm_ascend.core.kv_cache_interface`, v0.23.0), and groups the layers by them; vLLM's classes
there are unpacked as a (K, V) pair. So the same pages are declared in its terms:
- "global": `AscendMLAAttentionSpec(block_size=records per block, compress_ratio=ratio,
  head_size=record bytes, scale_dim=0)`: its page is block_size * head_size bytes (its own
  `page_size_bytes`, which ignores `page_size_padded`), and its managers count
  block_size * compress_ratio tokens per block. (vllm-ascend's main after v0.23.0 counts tokens
  in block_size and records in `storage_block_size`; where the class has that, tokens are given.)
- "swa": `AscendSlidingWindowMLASpec(block_size=tokens, head_size=record bytes,
  compress_ratio=1, page_size_padded=page)`, with `bounded_replay=True` where the class has the
  field (vLLM releases that know it; v0.23.0's does not, see docs/serving.md).
Both carry `model_version="deepseek_v4"`, as vllm-ascend's own DeepSeek-V4 caches do, so its
coordinator handles the compress ratio. Unverified on hardware: no NPU was available.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowMLASpec,
)

from .backend import Dsv41PagedBackend
from .paged_cache import LayerRequest


def ascend_spec_classes() -> tuple[type, type] | None:
    """(AscendMLAAttentionSpec, AscendSlidingWindowMLASpec) when vLLM runs on vllm-ascend's
    platform, else None. Both conditions: vllm-ascend installed on a CPU machine (no torch_npu)
    leaves vLLM's own platform and classes in charge."""
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) != "npu":
        return None
    try:
        from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec, AscendSlidingWindowMLASpec
    except ImportError:
        return None
    return AscendMLAAttentionSpec, AscendSlidingWindowMLASpec


def vllm_specs(req: LayerRequest) -> KVCacheSpec:
    """The layer's spec in vLLM's own classes."""
    common = {"block_size": req.block_size, "num_kv_heads": 1, "dtype": torch.uint8, "head_size_v": 0,
              "head_size": req.record_bytes, "page_size_padded": req.page_bytes}
    if req.kind == "global":
        return FullAttentionSpec(tokens_per_state=req.ratio, **common)
    return SlidingWindowMLASpec(sliding_window=req.window, bounded_replay=True, **common)


def ascend_specs(req: LayerRequest, mla_cls: type, swa_cls: type) -> KVCacheSpec:
    """The layer's spec in vllm-ascend's DeepSeek-V4 classes (module docstring); its page must
    be exactly `req.page_bytes`, the page every layer shares."""
    common = {"num_kv_heads": 1, "head_size": req.record_bytes, "dtype": torch.uint8,
              "model_version": "deepseek_v4", "page_size_padded": req.page_bytes}
    if req.kind == "global":
        # v0.23.0 counts records per block; later (main 182b75ea84) tokens, with the records as
        # `storage_block_size`: the class says which
        per_block = req.block_size if hasattr(mla_cls, "storage_block_size") else req.block_size // req.ratio
        spec = mla_cls(block_size=per_block, compress_ratio=req.ratio, scale_dim=0, **common)
    else:
        extra = {"bounded_replay": True} if "bounded_replay" in {f.name for f in dataclasses.fields(swa_cls)} else {}
        spec = swa_cls(block_size=req.block_size, sliding_window=req.window, compress_ratio=1, **common, **extra)
    if spec.page_size_bytes != req.page_bytes:
        raise ValueError(f"dsv41: vllm-ascend's {type(spec).__name__} gives {req.prefix} a page of "
                         f"{spec.page_size_bytes} bytes, the layout needs {req.page_bytes}")
    return spec


class PagedLayer(nn.Module, AttentionLayerBase):
    """A cache owner registered in vLLM's forward context under its prefix."""

    def __init__(self, req: LayerRequest):
        super().__init__()
        self.prefix = req.prefix
        ascend = ascend_spec_classes()
        self.spec: KVCacheSpec = ascend_specs(req, *ascend) if ascend else vllm_specs(req)
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if req.prefix in ctx:
            raise ValueError(f"duplicate cache layer name: {req.prefix}")
        ctx[req.prefix] = self

    def get_attn_backend(self):
        return Dsv41PagedBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec
