"""DeepSeek-ViT, the 3x3 aligner and the image framing: pixels -> embeddings of the prompt
positions one image occupies (the official weights and arithmetic, MODEL.md section 3, Vision).

Tower (`vision.*`): `patch_embed.proj` Linear(3 * 14 * 14 = 588 -> w) WITH bias over each patch
flattened channel-major (feature = c * 196 + py * 14 + px, as a 14x14 stride-14 convolution) ->
blocks of [`norm1` -> attention (`attn.wqkv` one fused q, k, v Linear WITH bias; 2D RoPE on q
and k; bidirectional over the image's patches; `attn.wo` WITH bias) -> residual, `norm2` ->
`mlp` (`w1` one fused gate + up Linear, SiLU(gate) * up, `w2`; no biases) -> residual] ->
final `norm`. RMSNorms: eps `norm_eps` (1e-6), fp32 weights. Linears are bf16 and return bf16,
and every elementwise step rounds to bf16 as the official code's bf16 activations do (the tower
runs once per image, so the batch-invariant fp64 arithmetic of the text path buys nothing here
and matching the official embeddings does).

2D RoPE: rotate-half over each head (channel i pairs with i + head_dim / 2); of the head_dim / 2
angles, the first head_dim / 4 are row * f_j and the rest col * f_j, with
f_j = rope_theta^(-j / (head_dim / 4)) (16 row + 16 column frequencies at head_dim 64); cos / sin
in fp32, the rotated q and k cast back to bf16.

Aligner (`aligner.*`): the patch grid is padded (zeros, bottom / right) to a multiple of 3 and
each 3 x 3 block is concatenated channel-major (feature = c * 9 + ky * 3 + kx, as
`pixel_unshuffle`), then `w1` (9w -> d, bias), exact GELU, `w2` (d -> d, bias).

Framing: [image_start, row 0 cells, image_newline, row 1 cells, image_newline, ..., image_end]
(rows * (cols + 1) + 2 positions, `image_processing.ImageLayout.num_tokens`). These rows replace
the embeddings at the image-token positions of the prompt, in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import ops
from .config import VisionConfig
from .image_processing import layout_of_pixels
from .model import BF16, Linear, RMSNorm

IMAGE_FRAME = ("image_start", "image_newline", "image_end")


def bf16_op(fn, *xs: torch.Tensor) -> torch.Tensor:
    """An elementwise op on bf16 activations as torch runs it on bf16 tensors: fp32 math, one
    rounding of the result to bf16."""
    return fn(*(x.float() for x in xs)).to(BF16)


class BiasedLinear(Linear):
    """A bf16 Linear with a bf16 bias: y = x W^T + b, accumulated in fp32, rounded once to bf16."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, "bf16")
        self.register_buffer("bias", torch.empty(out_features, dtype=BF16))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = BF16) -> torch.Tensor:
        return (ops.linear(x, self.weight, None, torch.float32) + self.bias.float()).to(out_dtype)


def vision_norm(dim: int, eps: float) -> RMSNorm:
    """The tower's RMSNorm: fp32 weight (as the official checkpoint stores it)."""
    norm = RMSNorm(dim, eps)
    norm.weight = torch.empty(dim, dtype=torch.float32)
    return norm


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
    """x [N, H, hd] (any float dtype), rotated in fp32 by the per-patch angles (cos/sin [N, hd]);
    the result in x's dtype (bf16 in the tower: the official cast after the rotation)."""
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


# ---- tower ------------------------------------------------------------------------------------

class VisionAttention(nn.Module):
    """Full attention over one image's patches: fused q/k/v with bias, 2D RoPE on q and k."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        w = vc.hidden_size
        self.n_heads, self.head_dim = vc.num_attention_heads, w // vc.num_attention_heads
        self.wqkv = BiasedLinear(w, 3 * w)
        self.wo = BiasedLinear(w, w)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        # [H, N, hd]; bf16 values, fp32 softmax on every backend (runs once per image)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1).float() for t in (q, k, v)))
        return self.wo(o.transpose(0, 1).reshape(n, -1).to(BF16))


class VisionMLP(nn.Module):
    """SwiGLU with one fused gate + up projection: w2(silu(gate) * up), [gate | up] = w1 x."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        w, m = vc.hidden_size, vc.intermediate_size
        self.w1, self.w2 = Linear(w, 2 * m, "bf16"), Linear(m, w, "bf16")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(bf16_op(torch.mul, bf16_op(F.silu, gate), up))


class VisionBlock(nn.Module):
    """Pre-norm transformer layer; bf16 residual adds."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.norm1 = vision_norm(vc.hidden_size, vc.norm_eps)
        self.attn = VisionAttention(vc)
        self.norm2 = vision_norm(vc.hidden_size, vc.norm_eps)
        self.mlp = VisionMLP(vc)

    def forward(self, x, cos, sin):
        x = bf16_op(torch.add, x, self.attn(self.norm1(x), cos, sin))
        return bf16_op(torch.add, x, self.mlp(self.norm2(x)))


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [rows * cols, 3 * patch * patch], patches row-major, each flattened
    channel-major (c, py, px), as a stride-`patch` convolution's weight is laid out."""
    c, h, w = pixels.shape
    x = pixels.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return x.reshape((h // patch) * (w // patch), c * patch * patch)


class PatchEmbed(nn.Module):
    """`patch_embed.proj`: Linear(3 * patch^2 -> width) with bias over flattened patches."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = BiasedLinear(3 * vc.patch_size ** 2, vc.hidden_size)


class VisionTransformer(nn.Module):
    """DeepSeek-ViT: pixels [3, H, W] in [-1, 1] -> feature grid [rows, cols, width] bf16."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.num_hidden_layers))
        self.norm = vision_norm(vc.hidden_size, vc.norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        lay = layout_of_pixels(self.vc, pixels)
        x = self.patch_embed.proj(patchify(pixels, self.vc.patch_size).to(BF16))
        cos, sin = rope_2d_tables(self.vc, lay.patch_rows, lay.patch_cols, device=x.device)
        for blk in self.blocks:
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
    """3x3 pixel-unshuffle, then `w1` (9w -> d, bias) - exact GELU - `w2` (d -> d, bias)."""

    def __init__(self, vc: VisionConfig, dim: int):
        super().__init__()
        self.r = vc.downsample_ratio
        self.w1 = BiasedLinear(vc.hidden_size * self.r ** 2, dim)
        self.w2 = BiasedLinear(dim, dim)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        return self.w2(bf16_op(F.gelu, self.w1(pixel_unshuffle(grid, self.r))))


def frame_cells(cells: torch.Tensor, start: torch.Tensor, newline: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """[rows, cols, d] -> [rows * (cols + 1) + 2, d]: start, each row + newline, end."""
    rows, cols, d = cells.shape
    nl = newline.to(cells.dtype).expand(rows, 1, d)
    body = torch.cat((cells, nl), dim=1).reshape(rows * (cols + 1), d)
    return torch.cat((start.to(cells.dtype)[None], body, end.to(cells.dtype)[None]))


def encode_image(model, pixels: torch.Tensor) -> torch.Tensor:
    """One preprocessed image [3, H, W] (bf16, `preprocess`) -> the embeddings of its prompt
    span [n, d] bf16
    (n = `num_image_tokens` of the original size). `model` is a `Transformer` with vision."""
    if getattr(model, "vision", None) is None:
        raise ValueError("this model has no vision tower (its config has no vision_config)")
    dev = model.embed.weight.device
    grid = model.vision(pixels.to(device=dev, dtype=BF16))  # preprocessing gives bf16 pixels
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

