"""DeepSeek-ViT, the 3x3 aligner and the image framing: pixels -> embeddings of the prompt
positions one image occupies.

Tower (`vision.*`): linear patch embedding of 14 x 14 x 3 = 588 values (flattened row, column,
channel: feature = (py * 14 + px) * 3 + c; the spec names the size, not the order: our choice,
one place to change) -> layers of [RMSNorm -> attention with 2D RoPE -> residual, RMSNorm ->
SwiGLU -> residual] -> final RMSNorm. RMSNorm eps `norm_eps` (1e-6); linears are bf16 without
biases; attention is full (non-causal) over the image's patches, softmax in fp32.

2D RoPE: rotate-half over each head (channel i pairs with i + head_dim / 2); of the head_dim / 2
angles, the first head_dim / 4 are row * f_j and the rest col * f_j, with
f_j = rope_theta^(-j / (head_dim / 4)) (16 row + 16 column frequencies at head_dim 64).

Aligner (`aligner.*`): the patch grid is padded (zeros) to a multiple of 3 and each 3 x 3 block
is concatenated channel-major (feature = c * 9 + ky * 3 + kx, as `pixel_unshuffle`), then
fc1 (9w -> d), GELU (erf), fc2 (d -> d).

Framing: [image_start, row 0 cells, image_newline, row 1 cells, image_newline, ..., image_end]
(rows * (cols + 1) + 2 positions, `image_processing.ImageLayout.num_tokens`). These rows replace
the embeddings at the image-token positions of the prompt, in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .image_processing import layout_of_pixels
from .model import BF16, Linear, RMSNorm

IMAGE_FRAME = ("image_start", "image_newline", "image_end")


# ---- 2D RoPE ----------------------------------------------------------------------------------

def rope_2d_tables(vc: VisionConfig, rows: int, cols: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [rows * cols, head_dim] fp32 for the row-major patch grid (angles in fp64)."""
    hd = vc.hidden_size // vc.num_attention_heads
    n = hd // 4
    freq = vc.rope_theta ** (-torch.arange(n, dtype=torch.float64) / n)
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    ang = torch.cat((r[:, None] * freq, c[:, None] * freq), dim=-1)  # [N, hd / 2]
    ang = torch.cat((ang, ang), dim=-1)
    # built on the CPU: not every accelerator has fp64
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd] (any float dtype) -> fp32, rotated by the per-patch angles (cos/sin [N, hd])."""
    x = x.float()
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# ---- tower ------------------------------------------------------------------------------------

class VisionAttention(nn.Module):
    """Full attention over one image's patches with 2D RoPE on q and k."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        w = vc.hidden_size
        self.n_heads, self.head_dim = vc.num_attention_heads, w // vc.num_attention_heads
        self.wq, self.wk, self.wv, self.wo = (Linear(w, w, "bf16") for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rope_2d(self.wq(x).view(n, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope_2d(self.wk(x).view(n, self.n_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(n, self.n_heads, self.head_dim).float()
        # [H, N, hd]; fp32 inputs keep the softmax in fp32 on every backend (runs once per image)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(o.transpose(0, 1).reshape(n, -1).to(BF16))


class VisionMLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), fp32 activation math."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        w, m = vc.hidden_size, vc.intermediate_size
        self.w1, self.w2, self.w3 = Linear(w, m, "bf16"), Linear(m, w, "bf16"), Linear(w, m, "bf16")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x, torch.float32)) * self.w3(x, torch.float32)
        return self.w2(h.to(BF16))


class VisionBlock(nn.Module):
    """Pre-norm transformer layer; residual sums in fp32, stored bf16."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.attn_norm = RMSNorm(vc.hidden_size, vc.norm_eps)
        self.attn = VisionAttention(vc)
        self.ffn_norm = RMSNorm(vc.hidden_size, vc.norm_eps)
        self.ffn = VisionMLP(vc)

    def forward(self, x, cos, sin):
        x = (x.float() + self.attn(self.attn_norm(x), cos, sin).float()).to(BF16)
        return (x.float() + self.ffn(self.ffn_norm(x)).float()).to(BF16)


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [rows * cols, patch * patch * 3], patches row-major, each flattened
    (py, px, c)."""
    c, h, w = pixels.shape
    x = pixels.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 2, 4, 0)
    return x.reshape((h // patch) * (w // patch), patch * patch * c)


class VisionTransformer(nn.Module):
    """DeepSeek-ViT: pixels [3, H, W] in [-1, 1] -> feature grid [rows, cols, width] bf16."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = Linear(3 * vc.patch_size ** 2, vc.hidden_size, "bf16")
        self.layers = nn.ModuleList(VisionBlock(vc) for _ in range(vc.num_hidden_layers))
        self.norm = RMSNorm(vc.hidden_size, vc.norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        lay = layout_of_pixels(self.vc, pixels)
        x = self.patch_embed(patchify(pixels, self.vc.patch_size).to(BF16))
        cos, sin = rope_2d_tables(self.vc, lay.patch_rows, lay.patch_cols, device=x.device)
        for blk in self.layers:
            x = blk(x, cos, sin)
        return self.norm(x).view(lay.patch_rows, lay.patch_cols, -1)


# ---- aligner and framing ----------------------------------------------------------------------

def pixel_unshuffle(grid: torch.Tensor, r: int) -> torch.Tensor:
    """[rows, cols, C] -> [ceil(rows/r), ceil(cols/r), C * r * r]: zero-pad to a multiple of r,
    then each r x r block channel-major (feature = c * r * r + ky * r + kx)."""
    h, w, c = grid.shape
    hp, wp = -(-h // r) * r, -(-w // r) * r
    if (hp, wp) != (h, w):
        grid = F.pad(grid, (0, 0, 0, wp - w, 0, hp - h))
    x = grid.reshape(hp // r, r, wp // r, r, c).permute(0, 2, 4, 1, 3)  # [R, C', c, ky, kx]
    return x.reshape(hp // r, wp // r, c * r * r)


class Aligner(nn.Module):
    """3x3 pixel-unshuffle, then Linear (9w -> d) - GELU - Linear (d -> d), bf16 linears."""

    def __init__(self, vc: VisionConfig, dim: int):
        super().__init__()
        self.r = vc.downsample_ratio
        self.fc1 = Linear(vc.hidden_size * self.r ** 2, dim, "bf16")
        self.fc2 = Linear(dim, dim, "bf16")

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(pixel_unshuffle(grid, self.r), torch.float32))
        return self.fc2(h.to(BF16))


def frame_cells(cells: torch.Tensor, start: torch.Tensor, newline: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """[rows, cols, d] -> [rows * (cols + 1) + 2, d]: start, each row + newline, end."""
    rows, cols, d = cells.shape
    nl = newline.to(cells.dtype).expand(rows, 1, d)
    body = torch.cat((cells, nl), dim=1).reshape(rows * (cols + 1), d)
    return torch.cat((start.to(cells.dtype)[None], body, end.to(cells.dtype)[None]))


def encode_image(model, pixels: torch.Tensor) -> torch.Tensor:
    """One preprocessed image [3, H, W] -> the embeddings of its prompt span [n, d] bf16
    (n = `num_image_tokens` of the original size). `model` is a `Transformer` with vision."""
    if getattr(model, "vision", None) is None:
        raise ValueError("this model has no vision tower (its config has no vision_config)")
    dev = model.embed.weight.device
    grid = model.vision(pixels.to(device=dev, dtype=torch.float32))
    cells = model.aligner(grid)
    return frame_cells(cells, model.image_start, model.image_newline, model.image_end)


@torch.no_grad()
def encode_images(model, images: list[torch.Tensor]) -> torch.Tensor:
    """Preprocessed images -> their span embeddings concatenated in prompt order [sum n, d]
    (the tower runs once per image: sizes differ)."""
    d = model.cfg.hidden_size
    if not images:
        return torch.empty(0, d, dtype=BF16, device=model.embed.weight.device)
    return torch.cat([encode_image(model, p) for p in images])


def check_image_embeds(cfg, is_image: torch.Tensor, image_embeds: torch.Tensor, start: int) -> None:
    """One row per image position of the chunk. The chunk may start anywhere (`start`): the
    reference engine passes whole spans with the first chunk, while a serving engine's chunked
    prefill or prefix-cache replay can begin inside or after a span."""
    n = int(is_image.sum())
    if image_embeds.dim() != 2 or image_embeds.shape != (n, cfg.hidden_size):
        raise ValueError(f"the chunk has {n} image-token positions, so image_embeds must be [{n}, "
                         f"{cfg.hidden_size}], got {list(image_embeds.shape)}")

