"""The attention backend vLLM sees for our cache layers.

vLLM builds one metadata object per KV cache group per step; ours only carries what the model
needs (per-request token ranges and the group's block table, both vLLM's own device tensors).
The attention math itself is not here: the model runs `dsv41.core` over the step with vLLM's
pages and block tables handed to the ops, and `core` calls `dsv41.backends.ops`, which
dispatches on the tensors' device (reference on CPU, Triton on CUDA, torch_npu / Triton-Ascend
on NPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class PagedMetadata:
    """One KV cache group's view of a step: request i owns tokens
    [query_start_loc[i], query_start_loc[i+1]) of the flattened batch and the pages in
    block_table[i] (device tensors; nothing is read back to the host)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    num_reqs: int


class PagedMetadataBuilder(AttentionMetadataBuilder[PagedMetadata]):
    """The per-request ranges and block table of one cache group (vLLM's persistent tensors,
    not copies, so a captured graph sees each step's values).

    CUDA graphs: the step reads nothing back to the host (`PagedCaches.run_step`; the images
    path, which does, is left out while a graph is captured), so vLLM may capture single-token
    decode batches (FULL_DECODE_ONLY and the decode half of FULL_AND_PIECEWISE). Declared from
    the code's properties; capture through vLLM is unverified on a GPU."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return PagedMetadata(m.query_start_loc, m.block_table_tensor, n)


class PagedImpl(AttentionImplBase):
    """No kernel of its own: the model computes attention through `dsv41.backends.ops`."""

    def __init__(self, *args, **kwargs):
        self.num_heads, self.head_size, self.scale = 1, 0, 1.0


class Dsv41PagedBackend(AttentionBackend):
    """Backend of the dsv41 cache layers (global KV, FP8 SWA ring) on any device."""

    accept_output_buffer: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "DSV41_PAGED"

    @staticmethod
    def get_impl_cls():
        return PagedImpl

    @staticmethod
    def get_builder_cls():
        return PagedMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True
