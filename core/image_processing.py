"""Image preprocessing for DeepSeek-ViT and the prompt framing of one image (Pillow, CPU).

Size rule (`image_layout`), from the image's width and height alone, so the number of prompt
positions is known before any forward pass:

1. keep the aspect ratio; upscale so the area is at least `min_image_size`^2 (never downscale
   in this step);
2. the image then covers ceil(W / 14) x ceil(H / 14) patches (padded right / bottom with grey
   127) and the aligner groups them 3 x 3 into ceil(cols / 3) x ceil(rows / 3) cells (the
   patch grid is padded to a multiple of 3, with zero features);
3. one image occupies rows * (cols + 1) + 2 prompt positions: `image_start`, each row's cells
   followed by one `image_newline`, `image_end` (see `core/vision.py`);
4. if that exceeds `max_image_tokens`, the scale is lowered (bisection on the scale factor,
   aspect kept, each side at least 1 px) to the largest one that fits. The budget wins over the
   minimum area. With the published config a square image caps at 1302 px (31 x 31 cells,
   994 positions; 32 x 32 cells would take 1058 > 1024).

All positions of an image hold `image_token_id` in the prompt; the model replaces their
embeddings with the encoder's output (`Transformer.forward(image_embeds=...)`).

Pixels: RGB (EXIF orientation applied), bicubic resize, grey 127 padding, scaled as
x / 127.5 - 1 into [-1, 1]; tensor [3, rows_px, cols_px] fp32 (`preprocess`).
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from .config import VisionConfig

PAD_GREY = 127


class ImageError(ValueError):
    """An input that is not a readable image (the message names the file or source)."""


@dataclass(frozen=True)
class ImageLayout:
    """Where one image of a given size ends up: resized pixels, ViT patch grid, aligner cells."""

    width: int  # resized image, before padding
    height: int
    patch_cols: int  # ViT grid (image padded to a multiple of patch_size)
    patch_rows: int
    cols: int  # aligner cells (patch grid padded to a multiple of downsample_ratio)
    rows: int

    @property
    def num_tokens(self) -> int:
        """Prompt positions: image_start + rows x (cells + image_newline) + image_end."""
        return self.rows * (self.cols + 1) + 2


def _layout_at(vc: VisionConfig, width: int, height: int, scale: float) -> ImageLayout:
    w = max(1, math.floor(width * scale + 0.5))
    h = max(1, math.floor(height * scale + 0.5))
    pc, pr = -(-w // vc.patch_size), -(-h // vc.patch_size)
    r = vc.downsample_ratio
    return ImageLayout(w, h, pc, pr, -(-pc // r), -(-pr // r))


def image_layout(vc: VisionConfig, width: int, height: int) -> ImageLayout:
    """The layout of a `width` x `height` image (rules in the module docstring)."""
    if int(width) != width or int(height) != height or width < 1 or height < 1:
        raise ValueError(f"image size must be positive integers, got {width} x {height}")
    width, height = int(width), int(height)
    hi = max(1.0, vc.min_image_size / math.sqrt(width * height))
    best = _layout_at(vc, width, height, hi)
    if best.num_tokens <= vc.max_image_tokens:
        return best
    # Token count is non-decreasing in the scale: bisect between a 1 x 1 px image (4 positions,
    # always within budget) and the infeasible upper scale.
    lo = 1.0 / max(width, height)
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if _layout_at(vc, width, height, mid).num_tokens <= vc.max_image_tokens:
            lo = mid
        else:
            hi = mid
    return _layout_at(vc, width, height, lo)


def num_image_tokens(vc: VisionConfig, width: int, height: int) -> int:
    """Prompt positions one `width` x `height` image occupies (framing included)."""
    return image_layout(vc, width, height).num_tokens


def _pil_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image

    return (OSError, SyntaxError, ValueError, TypeError, IndexError, KeyError, struct.error,
            Image.DecompressionBombError)


def load_image(src, name: str | None = None):
    """A Pillow RGB image from a path, raw bytes or a Pillow image (EXIF orientation applied).

    Anything that is not a readable image raises one `ImageError` naming `name` (or the path).
    """
    from PIL import Image, ImageOps

    errors = _pil_errors()
    if isinstance(src, Image.Image):
        img, label = src, name or "image"
    else:
        label = name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "image bytes")
        if isinstance(src, (str, os.PathLike)) and not os.path.isfile(src):
            raise ImageError(f"{label}: no such image file")
        try:
            img = Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src)
            img.load()
        except errors as e:  # UnidentifiedImageError is an OSError; truncated data, bombs, ...
            raise ImageError(f"{label}: not a readable image ({type(e).__name__}: {e})") from None
    try:
        img = ImageOps.exif_transpose(img)
        return img.convert("RGB")
    except errors as e:
        raise ImageError(f"{label}: cannot convert the image to RGB ({type(e).__name__}: {e})") from None


def preprocess(vc: VisionConfig, image, name: str | None = None) -> torch.Tensor:
    """Image (path, bytes or Pillow image) -> pixels [3, patch_rows*14, patch_cols*14] fp32 in
    [-1, 1]: resized per `image_layout`, padded right / bottom with grey 127."""
    from PIL import Image

    img = load_image(image, name)
    lay = image_layout(vc, *img.size)
    if img.size != (lay.width, lay.height):
        img = img.resize((lay.width, lay.height), Image.Resampling.BICUBIC)
    p = vc.patch_size
    canvas = Image.new("RGB", (lay.patch_cols * p, lay.patch_rows * p), (PAD_GREY,) * 3)
    canvas.paste(img, (0, 0))
    arr = np.asarray(canvas, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def layout_of_pixels(vc: VisionConfig, pixels: torch.Tensor) -> ImageLayout:
    """The patch / cell grid of a preprocessed pixel tensor [3, H, W] (width / height are the
    padded size here: the resized size is not recoverable from the pixels)."""
    p, r = vc.patch_size, vc.downsample_ratio
    if pixels.dim() != 3 or pixels.shape[0] != 3 or pixels.shape[1] % p or pixels.shape[2] % p:
        raise ValueError(f"pixels must be [3, H, W] with H and W multiples of {p}, got {tuple(pixels.shape)}")
    pr, pc = pixels.shape[1] // p, pixels.shape[2] // p
    return ImageLayout(pixels.shape[2], pixels.shape[1], pc, pr, -(-pc // r), -(-pr // r))


def expand_image_placeholders(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Replace the k-th single `image_token_id` in `ids` by `counts[k]` copies of it (one
    placeholder per image -> that image's full span)."""
    n = sum(1 for t in ids if t == image_token_id)
    if n != len(counts):
        raise ValueError(f"the prompt has {n} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    return out
