"""`Dsv41ForCausalLM`: DeepSeek-V4.1-Flash from `dsv41.core` as a vLLM model.

vLLM schedules, batches, allocates and prefix-caches; this class runs ONE `core.Transformer`
forward per vLLM step over every scheduled token (prefill chunks and decodes mixed; raw token
ids, so Engram hashes exactly as the reference does), with vLLM's page tensors and block tables
handed to the ops, which read and write the pages in place (`paged_cache.PagedCaches.run_step`).
Every op goes through `dsv41.backends.ops`, so the same class
runs on CPU, CUDA and NPU tensors. Each request's result equals the reference engine's
(`dsv41 run --prefill exact`) token for token, because the reference is batch-invariant
(chunked prefill == one pass == token-by-token decode == any batch).

Images (`multimodal.py`): vLLM's processor expands each image token to the image's span;
`embed_multimodal` runs the vision tower once per image (vLLM caches the output by image hash);
`embed_input_ids` scatters a step's image rows into `inputs_embeds` and notes vLLM's mask of
the step's image positions; the rows at those positions reach the core model as
`image_embeds`, wherever a chunk starts. A generated token equal to the image token id is text.

Configuration (`--additional-config '{"dsv41": {...}}'`):
- `replay`: "window" (default: recompute `sliding_window` tokens after a prefix-cache hit,
  approximate) or "exact" (`sliding_window * num_hidden_layers` tokens: the same tokens as a
  cold run).
- `engram_offload`: true keeps the Engram tables in host memory (`Transformer.offload_engram`;
  with tensor parallelism each rank's row piece), so they never take device memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...backends.platform import as_storage
from ...core.config import ModelConfig
from ...core.model import Transformer
from ...core.parallel import SINGLE, Group, TorchGroup
from ...core.weights import check_state_dict, checkpoint_dtypes, materialize
from ..convert import shard_of
from ..names import hf_to_native
from . import options
from .layers import PagedLayer
from .multimodal import (
    IMAGE_PLACEHOLDER,
    Dsv41DummyInputsBuilder,
    Dsv41MultiModalProcessor,
    Dsv41ProcessingInfo,
    split_pixels,
)
from .paged_cache import PagedCaches, replay_length

# a child of vLLM's logger, so our lines go where vLLM's go (its handlers sit on "vllm")
logger = init_logger("vllm.dsv41")


def plugin_options(vllm_config: VllmConfig) -> dict:
    """Our keys of `--additional-config` (under "dsv41"), validated (`options.plugin_options`)."""
    return options.plugin_options(vllm_config.additional_config)


def model_config_of(vllm_config: VllmConfig) -> ModelConfig:
    """Our `ModelConfig`, read from the checkpoint's own config.json (vLLM's config object has
    already been reshaped by its DeepSeek-V4.1 config class)."""
    from ..checkpoint import read_config

    return read_config(vllm_config.model_config.model)


def tensor_parallel_group(vllm_config: VllmConfig) -> Group:
    """Our model-parallel group backed by vLLM's tensor-parallel group: heads, index heads and
    vocabulary split across it, routed experts in contiguous ranges per rank (so expert
    parallelism within the TP group comes with it), Engram rows in ceil(rows/tp) pieces.
    Collectives run on vLLM's device group (gloo on CPU, NCCL / HCCL on devices)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return SINGLE
    from vllm.distributed import get_tp_group

    return TorchGroup(get_tp_group().device_group)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device` (nothing may read back to the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@MULTIMODAL_REGISTRY.register_processor(Dsv41MultiModalProcessor, info=Dsv41ProcessingInfo,
                                        dummy_inputs=Dsv41DummyInputsBuilder)
class Dsv41ForCausalLM(nn.Module, SupportsMultiModal):
    """vLLM model interface over `dsv41.core.model.Transformer`."""

    # Engram hashes the raw ids, so vLLM passes them along with the merged embeddings.
    requires_raw_input_tokens = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = model_config_of(vllm_config)
        self.cfg, self.options = cfg, plugin_options(vllm_config)
        self.group = tensor_parallel_group(vllm_config)
        device = vllm_config.device_config.device
        # vLLM builds models under its activation dtype as torch's default: the core model
        # states every dtype it creates (tests/test_model.py checks it does not depend on it)
        with torch.device("meta"):
            model = Transformer(cfg, self.group)
        if self.options["engram_offload"]:
            model.offload_engram(device)
            logger.info("dsv41: Engram tables in host memory")
        self.model = materialize(model, device)
        replay = replay_length(cfg, self.options["replay"])
        self.caches = PagedCaches(cfg, vllm_config.cache_config.block_size, prefix or "dsv41", replay, PagedLayer)
        self.tokenizer_path = vllm_config.model_config.tokenizer
        self._image_positions: torch.Tensor | None = None  # vLLM's mask of this step's image positions

    # -- vLLM model interface --
    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality == "image":
            return IMAGE_PLACEHOLDER
        raise ValueError(f"dsv41: unsupported modality {modality!r} (images only)")

    def embed_multimodal(self, pixel_values: torch.Tensor, image_hw: torch.Tensor, **kwargs) -> list[torch.Tensor]:
        """The span embeddings [n_i, d] of each image (the vision tower runs once per image;
        vLLM keeps the result in its encoder cache, keyed by the image's hash)."""
        from ...core.vision import encode_image

        with torch.no_grad():
            return [encode_image(self.model, p.float()) for p in split_pixels(pixel_values, image_hw)]

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the image rows of this step scattered into their positions."""
        x = self.model.embed_tokens(input_ids)
        self._image_positions = None if is_multimodal is None else is_multimodal.to(input_ids.device)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0 or is_multimodal is None:
            return x
        rows = torch.cat(list(multimodal_embeddings)).to(device=x.device, dtype=x.dtype)
        mask = is_multimodal.to(x.device)
        if int(mask.sum()) != rows.shape[0]:
            raise ValueError(f"dsv41: {rows.shape[0]} image rows for {int(mask.sum())} image positions")
        x = x.clone()
        x[mask] = rows
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Collapsed final streams [tokens, d] of every scheduled token (see `compute_logits`):
        ONE core forward over the step, in place on vLLM's pages."""
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):  # micro-batched: one dict per micro-batch (not used on CPU)
            raise NotImplementedError("dsv41 plugin: micro-batching is not supported")
        if not meta or self.caches.swa[0].prefix not in meta:
            # vLLM's profiling / warm-up run: no request, no cache to touch
            return torch.zeros(input_ids.shape[0], self.cfg.hidden_size, dtype=torch.bfloat16, device=input_ids.device)
        first = meta[self.caches.swa[0].prefix]
        is_image, image_embeds = self._step_images(input_ids, inputs_embeds)
        return self.caches.run_step(self.model, meta, input_ids, positions, first.query_start_loc, first.num_reqs,
                                    is_image, image_embeds)

    def _step_images(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None):
        """(image positions, their rows of `inputs_embeds`) of this step: positions vLLM marked
        multimodal that hold the image token (generated tokens are never marked, so a sampled
        image token id stays text), or (None, None) in a text-only step."""
        mask, self._image_positions = self._image_positions, None
        if inputs_embeds is None or mask is None or self.cfg.vision is None or _capturing(input_ids.device):
            return None, None  # (graphs capture decode batches only: no image position there)
        t = input_ids.shape[0]
        if mask.shape[0] < t:  # (vLLM's mask covers the scheduled tokens; the rest is padding)
            mask = torch.cat((mask, mask.new_zeros(t - mask.shape[0])))
        is_image = mask[:t] & (input_ids == self.cfg.image_token_id)
        if not bool(is_image.any()):  # (one host read, in steps that carry image positions only)
            return None, None
        return is_image, inputs_embeds[is_image]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (native or Hugging Face names) into the model; one error
        (`check_state_dict`, as for every other loader) lists every unexpected, misshapen, wrongly
        typed or missing tensor. The released file form of `attn.wo_a` (FP8 + E8M0 32x32 block
        `.scale`, `names.RELEASED_FP8_BF16`) is dequantised to the model's bf16 weight once both
        halves have arrived, exactly as `dsv41 convert` and the checkpoint loader do."""
        from ...backends.reference.quant import fp8_block_dequant
        from ..names import RELEASED_FP8_BF16

        expected = self.model.state_dict()
        dtypes = checkpoint_dtypes(self.model)  # float8 where a buffer holds the bytes (NPU)
        seen: dict[str, torch.Tensor] = {}  # native name -> shape/dtype stand-in, for the check
        released: dict[str, dict[str, torch.Tensor]] = {}  # owner -> {"weight", "scale"} of the FP8 form
        group = self.group

        def take(native: str, t: torch.Tensor) -> None:
            if group.world_size > 1:  # vLLM hands every rank whole tensors: keep this rank's piece
                t = shard_of(self.cfg, native, t, group.rank, group.world_size)
                if t is None:
                    return  # another rank's routed expert
            seen[native] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            buf = expected.get(native)
            if buf is not None and buf.shape == t.shape and dtypes[native] == t.dtype:
                with torch.no_grad():
                    buf.copy_(as_storage(t, buf.dtype))

        for name, t in weights:
            native = hf_to_native(name)
            owner, _, leaf = native.rpartition(".")
            if RELEASED_FP8_BF16.match(owner) and expected.get(owner + ".weight") is not None \
                    and expected[owner + ".weight"].dtype == torch.bfloat16 \
                    and (leaf == "scale" or (leaf == "weight" and t.dtype == torch.float8_e4m3fn)):
                released.setdefault(owner, {})[leaf] = t
                continue
            take(native, t)
        for owner, parts in released.items():
            if set(parts) == {"weight", "scale"}:
                take(owner + ".weight", fp8_block_dequant(parts["weight"], parts["scale"]).to(torch.bfloat16))
            else:  # half a pair: reported by the check as what it is
                for leaf, t in parts.items():
                    take(f"{owner}.{leaf}", t)
        check_state_dict(self.model, seen)
        self._install_engram_vocab()
        return {f"model.{k}" for k in seen}

    def _install_engram_vocab(self) -> None:
        if not self.cfg.engram_layer_ids:
            return
        from ..checkpoint import install_engram_vocab, read_tokenizer

        tok = read_tokenizer(self.tokenizer_path)
        if tok is None:
            raise ValueError(f"dsv41 plugin: Engram needs the checkpoint's tokenizer.json ({self.tokenizer_path})")
        install_engram_vocab(self.model, tok)
