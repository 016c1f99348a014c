"""Image preprocessing for DeepSeek-ViT and the prompt framing of one image (Pillow, CPU).

The official rule (MODEL.md section 3, Vision), from the image's width W and height H alone, so
the number of prompt positions is known before any forward pass:

1. if `max_wh_ratio` is set and W > H x ratio, W = H x ratio (the image is then stretched, not
   padded, in step 5);
2. if 0 < W x H < `min_pixels`, both sides are scaled by sqrt(min_pixels / (W x H)) and
   truncated to whole pixels;
3. the canvas is each side rounded UP to a multiple of the patch size (14);
4. if the framed token count rows x (cols + 1) + 2 (aligner cells = ceil(patches / 3)) exceeds
   `max_image_tokens`, the canvas is solved in closed form: r = H / W,
   w* = sqrt((budget - 2) / r + 0.25) - 0.5, h* = w* x r, cell = 14 x 3 = 42 px; w* < 1 gives
   one column ((budget - 2) // 2 cells tall), h* < 1 one row (budget - 3 cells wide), else
   beta = min(floor(w*) x 42 / W, floor(h*) x 42 / H) and the canvas is
   floor(W x beta / 14) x 14 by floor(H x beta / 14) x 14 px;
5. the image goes onto the canvas with `PIL.ImageOps.pad` (fit keeping its aspect ratio,
   bicubic, centred, grey (127, 127, 127) bars); a max-ratio image is plainly resized instead;
6. pixels / 255, then (x - 0.5) / 0.5, bf16 ([3, H, W], values in [-1, 1]).

One image occupies rows * (cols + 1) + 2 prompt positions: `image_start`, each row's cells
followed by one `image_newline`, `image_end` (see `core/vision.py`). With the published config
(544^2 minimum area, 1024 positions) a square image gets a 1302 px canvas at most (31 x 31
cells, 994 positions). All positions of an image hold `image_token_id` in the prompt; the model
replaces their embeddings with the encoder's output (`Transformer.forward(image_embeds=...)`).

Reading an image (`load_image`) also applies its EXIF orientation, as a viewer shows it.
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
    """Where one image of a given size ends up: its canvas, ViT patch grid and aligner cells."""

    width: int  # canvas in pixels (a multiple of the patch size)
    height: int
    patch_cols: int  # ViT grid
    patch_rows: int
    cols: int  # aligner cells (patch grid padded to a multiple of downsample_ratio)
    rows: int
    stretch: bool = False  # max_wh_ratio applied: resized onto the canvas, no bars

    @property
    def num_tokens(self) -> int:
        """Prompt positions: image_start + rows x (cells + image_newline) + image_end."""
        return self.rows * (self.cols + 1) + 2


def _canvas_layout(vc: VisionConfig, width: int, height: int, stretch: bool) -> ImageLayout:
    p, r = vc.patch_size, vc.downsample_ratio
    pc, pr = width // p, height // p
    return ImageLayout(width, height, pc, pr, -(-pc // r), -(-pr // r), stretch)


def image_layout(vc: VisionConfig, width: int, height: int) -> ImageLayout:
    """The layout of a `width` x `height` image (the official rule: module docstring).

    The arithmetic follows the official expressions term by term (Python floats, the same
    operation order), so the floors land on the same side of every integer."""
    if int(width) != width or int(height) != height or width < 1 or height < 1:
        raise ValueError(f"image size must be positive integers, got {width} x {height}")
    w, h = int(width), int(height)
    p, cell, budget = vc.patch_size, vc.patch_size * vc.downsample_ratio, vc.max_image_tokens
    stretch = vc.max_wh_ratio is not None and w > h * vc.max_wh_ratio
    if stretch:
        w = h * vc.max_wh_ratio
    if 0 < w * h < vc.min_pixels:
        f = math.sqrt(vc.min_pixels / (w * h))
        w, h = int(w * f), int(h * f)
    best = _canvas_layout(vc, math.ceil(w / p) * p, math.ceil(h / p) * p, stretch)
    if best.num_tokens <= budget:
        return best
    ratio = h / w
    w_star = math.sqrt((budget - 2) / ratio + 0.25) - 0.5
    h_star = w_star * ratio
    if w_star < 1:  # taller than any grid of two or more cell columns: one column
        return _canvas_layout(vc, cell, (budget - 2) // 2 * cell, stretch)
    if h_star < 1:  # one row
        return _canvas_layout(vc, (budget - 3) * cell, cell, stretch)
    beta = min(math.floor(w_star) * cell / w, math.floor(h_star) * cell / h)
    return _canvas_layout(vc, math.floor(w * beta / p) * p, math.floor(h * beta / p) * p, stretch)


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


def normalize_pixels(canvas) -> torch.Tensor:
    """RGB canvas (Pillow) -> [3, H, W] bf16: x / 255, then (x - 0.5) / 0.5, in fp32 first."""
    x = torch.from_numpy(np.asarray(canvas, dtype=np.uint8).copy()).permute(2, 0, 1).float()
    return ((x / 255 - 0.5) / 0.5).to(torch.bfloat16)


def preprocess(vc: VisionConfig, image, name: str | None = None) -> torch.Tensor:
    """Image (path, bytes or Pillow image) -> pixels [3, patch_rows*14, patch_cols*14] bf16 in
    [-1, 1]: fitted, centred on the `image_layout` canvas with grey 127 bars (module docstring)."""
    from PIL import Image, ImageOps

    img = load_image(image, name)
    lay = image_layout(vc, *img.size)
    size = (lay.width, lay.height)
    if lay.stretch:
        canvas = img.resize(size, Image.Resampling.BICUBIC)
    else:
        canvas = ImageOps.pad(img, size, method=Image.Resampling.BICUBIC, color=(PAD_GREY,) * 3,
                              centering=(0.5, 0.5))
    return normalize_pixels(canvas)


def layout_of_pixels(vc: VisionConfig, pixels: torch.Tensor) -> ImageLayout:
    """The patch / cell grid of a preprocessed pixel tensor [3, H, W] (its canvas)."""
    p = vc.patch_size
    if pixels.dim() != 3 or pixels.shape[0] != 3 or pixels.shape[1] % p or pixels.shape[2] % p:
        raise ValueError(f"pixels must be [3, H, W] with H and W multiples of {p}, got {tuple(pixels.shape)}")
    return _canvas_layout(vc, pixels.shape[2], pixels.shape[1], False)


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
