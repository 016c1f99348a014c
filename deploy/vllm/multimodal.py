"""Images through vLLM: the multimodal processor of `Dsv41ForCausalLM`.

vLLM renders the chat template with one image token per image (`IMAGE_PLACEHOLDER`, our
tokenizer's `<｜image｜>`, in the text the template sees), tokenises it, and this processor
- preprocesses each image with `core.image_processing.preprocess` (the official canvas,
  [-1, 1]) and hands the pixels on as `pixel_values` (flattened, one slice per image) with the
  canvas size `image_hw` [n, 2];
- replaces each image token by the image's whole span: `image_token_id` repeated
  `rows * (cols + 1) + 2` times (start, rows of cells + newline, end; `core/vision.py`).

The model side (`model.Dsv41ForCausalLM.embed_multimodal`) runs the vision tower once per image;
vLLM caches that output by the image's hash (its encoder cache) and scatters the rows of each
scheduled chunk into the image positions, also when a chunk starts inside a span.

There is no Hugging Face processor for this model: `_call_hf_processor` is ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageSize, MultiModalDataItems
from vllm.multimodal.processing import BaseDummyInputsBuilder
from vllm.multimodal.processing.processor import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)

from ...core.config import ModelConfig
from ...core.image_processing import (
    ImageError,
    image_layout,
    layout_of_pixels,
    preprocess,
)
from ...core.tokenizer import IMAGE_TOKEN

IMAGE_PLACEHOLDER = IMAGE_TOKEN  # what vLLM writes into the chat-template text per image


class Dsv41ProcessingInfo(BaseProcessingInfo):
    """Facts about images for vLLM: limits, span lengths, the largest image, the target ids."""

    @cached_property
    def model_cfg(self) -> ModelConfig:
        """Our `ModelConfig`, read from the checkpoint's config.json."""
        from ..checkpoint import read_config

        return read_config(self.ctx.model_config.model)

    def get_hf_processor(self, **kwargs: object):
        raise NotImplementedError("dsv41: this model has no Hugging Face processor (see deploy/vllm/multimodal.py)")

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        # a checkpoint without a vision tower takes no images at all
        return {"image": None} if self.model_cfg.vision is not None else {}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.model_cfg.vision.max_image_tokens}

    def placeholder_ids(self) -> list[int]:
        """Token ids of `IMAGE_PLACEHOLDER` in the served tokenizer (the replacement target)."""
        return list(self.get_tokenizer().encode(IMAGE_PLACEHOLDER, add_special_tokens=False))

    def get_image_size_with_most_features(self) -> ImageSize:
        """An image size whose span is as long as the budget allows (for vLLM's profiling run):
        the best grid of aligner cells rows x cols with rows * (cols + 1) + 2 <= budget, laid
        out in pixels and checked through `image_layout` (which may rescale it)."""
        vc = self.model_cfg.vision
        cell = vc.patch_size * vc.downsample_ratio
        best, best_n = ImageSize(width=cell, height=cell), 0
        for rows in range(1, (vc.max_image_tokens - 2) // 2 + 1):
            cols = (vc.max_image_tokens - 2) // rows - 1
            if cols < 1:
                break
            w, h = cols * cell, rows * cell
            n = image_layout(vc, w, h).num_tokens
            if n > best_n:
                best, best_n = ImageSize(width=w, height=h), n
        return best


class Dsv41DummyInputsBuilder(BaseDummyInputsBuilder[Dsv41ProcessingInfo]):
    """Profiling inputs: one placeholder per image, images of the largest span."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        size = self.info.get_image_size_with_most_features()
        overrides = mm_options.get("image") if mm_options else None
        return {"image": self._get_dummy_images(width=size.width, height=size.height,
                                                num_images=mm_counts.get("image", 0), overrides=overrides)}


class Dsv41MultiModalProcessor(BaseMultiModalProcessor[Dsv41ProcessingInfo]):
    """Pixels via `core.image_processing.preprocess`; each image token -> the image's span."""

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        vc = self.info.model_cfg.vision
        if vc is None:
            raise ValueError("this model has no vision tower (its config has no vision_config): images are not accepted")
        pixels = []
        for k, image in enumerate(hf_data.get("images") or []):
            try:
                # bf16 pixels carried as fp32 (exact), the dtype vLLM's transports were tested with
                pixels.append(preprocess(vc, image, name=f"image {k}").float())
            except ImageError as e:  # vLLM answers a ValueError from here with a 400
                raise ValueError(str(e)) from None
        if not pixels:
            return BatchFeature({})
        return BatchFeature({
            "pixel_values": torch.cat([p.reshape(-1) for p in pixels]),
            "image_hw": torch.tensor([p.shape[1:] for p in pixels], dtype=torch.int64),
        })

    def _get_mm_fields_config(self, hf_inputs: BatchFeature,
                              hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping[str, MultiModalFieldConfig]:
        hw = hf_inputs.get("image_hw")
        sizes = 3 * hw.prod(-1) if hw is not None else torch.empty(0, dtype=torch.int64)
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "image_hw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        cfg = self.info.model_cfg
        if cfg.vision is None or cfg.image_token_id is None:
            return []

        def span(item_idx: int) -> list[int]:
            # the span length follows from the preprocessed pixels, exactly as the tower sees them
            h, w = (int(v) for v in out_mm_kwargs["image"][item_idx]["image_hw"].data)
            return [cfg.image_token_id] * layout_of_pixels(cfg.vision, torch.empty(3, h, w, device="meta")).num_tokens

        return [PromptReplacement(modality="image", target=self.info.placeholder_ids(), replacement=span)]


def split_pixels(pixel_values: torch.Tensor, image_hw: torch.Tensor) -> list[torch.Tensor]:
    """`pixel_values` (flattened, concatenated) + `image_hw` [n, 2] -> n tensors [3, H, W]."""
    hw = [(int(h), int(w)) for h, w in image_hw.reshape(-1, 2).tolist()]
    flat = pixel_values.reshape(-1)
    if flat.numel() != sum(3 * h * w for h, w in hw):
        raise ValueError(f"dsv41: {flat.numel()} pixel values do not match the image sizes {hw}")
    parts = torch.split(flat, [3 * h * w for h, w in hw])
    return [p.view(3, h, w) for p, (h, w) in zip(parts, hw)]
