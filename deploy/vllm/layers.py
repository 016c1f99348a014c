"""The vLLM side of our caches: one `AttentionLayerBase` per cache owner, declaring its KV
cache spec (`paged_cache.LayerRequest` -> vLLM spec) and registered in vLLM's forward context,
so vLLM's block manager allocates, frees and prefix-caches it and binds its pages.

- "global" (KV-source layers): `FullAttentionSpec` with `tokens_per_state = ratio` and one
  uint8 record per state: prefix-cacheable, paged like any full-attention cache.
- "swa" (every layer): `SlidingWindowMLASpec(bounded_replay=True)`, vLLM's DeepSeek-V4.1 mode:
  blocks outside the window are freed, the group is never prefix-cached, and after a hit the
  scheduler rewinds the computed tokens by `sliding_window` (our replay length) to rebuild it.
"""

from __future__ import annotations

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


class PagedLayer(nn.Module, AttentionLayerBase):
    """A cache owner registered in vLLM's forward context under its prefix."""

    def __init__(self, req: LayerRequest):
        super().__init__()
        self.prefix = req.prefix
        common = {"block_size": req.block_size, "num_kv_heads": 1, "dtype": torch.uint8, "head_size_v": 0,
                  "head_size": req.record_bytes, "page_size_padded": req.page_bytes}
        if req.kind == "global":
            self.spec: KVCacheSpec = FullAttentionSpec(tokens_per_state=req.ratio, **common)
        else:
            self.spec = SlidingWindowMLASpec(sliding_window=req.window, bounded_replay=True, **common)
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if req.prefix in ctx:
            raise ValueError(f"duplicate cache layer name: {req.prefix}")
        ctx[req.prefix] = self

    def get_attn_backend(self):
        return Dsv41PagedBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec
