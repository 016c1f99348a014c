"""Vision input: DeepSeek-ViT pieces (patchify, 2D RoPE, 3x3 aligner, framing), preprocessing
and placeholder counts, messages -> prompt ids, the model's image-embedding input (bias_vl and
Engram gate 0 on image positions) and `dsv41 run --image` end to end (tiny preset)."""

import base64
import json
import math
from dataclasses import replace
import subprocess
import sys

import numpy as np
import pytest
import torch
from dsv41.core.config import VisionConfig
from dsv41.core.engine import Engine, SamplingParams, SingleSequence
from dsv41.core.image_processing import (
    ImageError,
    expand_image_placeholders,
    image_layout,
    load_image,
    num_image_tokens,
    preprocess,
)
from dsv41.core.info import model_info
from dsv41.core.messages import MessagesError, encode_messages, encode_text_with_images
from dsv41.core.tokenizer import IMAGE_TOKEN, build_tiny_tokenizer
from dsv41.core.vision import (
    encode_image,
    encode_images,
    frame_cells,
    patchify,
    pixel_unshuffle,
    rope_2d_tables,
)
from dsv41.core.weights import build_model
from PIL import Image

from _util import rand_prompt


def _png(path, w, h, gen):
    arr = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
    Image.fromarray(arr).save(path)
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def vmodel(tiny_cfg, fresh_seed):
    """A private tiny model: some tests perturb its router biases and Engram weights."""
    return build_model(tiny_cfg, seed=fresh_seed + 1)


# ---- tower pieces ------------------------------------------------------------------------------

def test_patchify_channel_major_like_a_convolution(rng):
    px = torch.randn(3, 28, 42, generator=rng)
    p = patchify(px, 14)
    assert p.shape == (6, 588)
    for r, c in [(0, 0), (0, 2), (1, 1), (1, 2)]:
        k = r * 3 + c
        for ch, py, pxx in [(0, 0, 0), (2, 13, 5), (1, 7, 13), (0, 3, 9)]:
            assert p[k, ch * 196 + py * 14 + pxx] == px[ch, r * 14 + py, c * 14 + pxx]
    # a Linear over these rows is a stride-14 convolution with the weight viewed [w, 3, 14, 14]
    w = torch.randn(5, 588, generator=rng, dtype=torch.float64)
    conv = torch.nn.functional.conv2d(px.double()[None], w.view(5, 3, 14, 14), stride=14)[0]
    assert torch.allclose(p.double() @ w.t(), conv.permute(1, 2, 0).reshape(6, 5), rtol=1e-12, atol=1e-12)


def test_pixel_unshuffle_is_channel_major_with_zero_padding(rng):
    h, w, c = 7, 5, 4
    grid = torch.randn(h, w, c, generator=rng)
    out = pixel_unshuffle(grid, 3)
    assert out.shape == (3, 2, c * 9)
    for i in range(3):
        for j in range(2):
            for ch in range(c):
                for ky in range(3):
                    for kx in range(3):
                        y, x = 3 * i + ky, 3 * j + kx
                        want = grid[y, x, ch] if y < h and x < w else 0.0
                        assert out[i, j, ch * 9 + ky * 3 + kx] == want
    # a few indices written out by hand
    assert out[0, 0, 0] == grid[0, 0, 0] and out[0, 0, 1] == grid[0, 1, 0] and out[0, 0, 3] == grid[1, 0, 0]
    assert out[0, 0, 9] == grid[0, 0, 1] and out[1, 1, 2 * 9 + 2 * 3 + 1] == grid[5, 4, 2]
    assert out[2, 1, 1 * 9 + 1 * 3 + 0] == 0  # row 7 is padding


@pytest.mark.parametrize("vc", [VisionConfig(), VisionConfig(hidden_size=64, num_attention_heads=2)],
                         ids=["full", "tiny"])
def test_rope_2d_matches_complex_rotation(vc, rng):
    """rotate-half RoPE == multiplying z = x[:h] + i x[h:] by exp(i theta), theta = row * f for
    the first quarter-head frequencies and col * f for the second."""
    from dsv41.core.vision import apply_rope_2d

    hd = vc.hidden_size // vc.num_attention_heads
    rows, cols, heads = 5, 7, 3
    x = torch.randn(rows * cols, heads, hd, generator=rng, dtype=torch.float64)
    cos, sin = rope_2d_tables(vc, rows, cols)
    got = apply_rope_2d(x.float(), cos, sin).double()
    n = hd // 4
    f = np.array([vc.rope_theta ** (-j / n) for j in range(n)])
    want = np.empty((rows * cols, heads, hd))
    xn = x.numpy()
    for r in range(rows):
        for c in range(cols):
            k = r * cols + c
            theta = np.concatenate([r * f, c * f])
            z = (xn[k, :, : hd // 2] + 1j * xn[k, :, hd // 2:]) * np.exp(1j * theta)
            want[k] = np.concatenate([z.real, z.imag], axis=-1)
    err = np.abs(got.numpy() - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # bf16 in, bf16 out: the fp32 rotation rounded once (the official cast after RoPE)
    xb = x.to(torch.bfloat16)
    assert torch.equal(apply_rope_2d(xb, cos, sin), apply_rope_2d(xb.float(), cos, sin).to(torch.bfloat16))
    assert (n, hd) == ((16, 64) if vc.hidden_size == 1024 else (8, 32))


def test_frame_cells_layout(rng):
    rows, cols, d = 3, 4, 8
    cells = torch.randn(rows, cols, d, generator=rng)
    s, nl, e = (torch.randn(d, generator=rng) for _ in range(3))
    out = frame_cells(cells, s, nl, e)
    assert out.shape == (rows * (cols + 1) + 2, d)
    assert torch.equal(out[0], s) and torch.equal(out[-1], e)
    for r in range(rows):
        base = 1 + r * (cols + 1)
        assert torch.equal(out[base:base + cols], cells[r]) and torch.equal(out[base + cols], nl)


def official_vision_shapes(cfg) -> dict[str, tuple[list[int], torch.dtype]]:
    """The official vision tensors (MODEL.md section 3, Vision), written out from the config."""
    vc, d = cfg.vision, cfg.hidden_size
    w, m, bf, f32 = vc.hidden_size, vc.intermediate_size, torch.bfloat16, torch.float32
    out = {"vision.patch_embed.proj.weight": ([w, 3 * 14 * 14], bf), "vision.patch_embed.proj.bias": ([w], bf),
           "vision.norm.weight": ([w], f32),
           "aligner.w1.weight": ([d, 9 * w], bf), "aligner.w1.bias": ([d], bf),
           "aligner.w2.weight": ([d, d], bf), "aligner.w2.bias": ([d], bf),
           "image_start": ([d], bf), "image_newline": ([d], bf), "image_end": ([d], bf)}
    for i in range(vc.num_hidden_layers):
        b = f"vision.blocks.{i}."
        out.update({b + "norm1.weight": ([w], f32), b + "norm2.weight": ([w], f32),
                    b + "attn.wqkv.weight": ([3 * w, w], bf), b + "attn.wqkv.bias": ([3 * w], bf),
                    b + "attn.wo.weight": ([w, w], bf), b + "attn.wo.bias": ([w], bf),
                    b + "mlp.w1.weight": ([2 * m, w], bf), b + "mlp.w2.weight": ([w, m], bf)})
    return out


def test_vision_weights_have_the_official_names_shapes_and_info(vmodel, tiny_cfg):
    sd = vmodel.state_dict()
    got = {k: (list(v.shape), v.dtype) for k, v in sd.items() if k.startswith(("vision.", "aligner.", "image_"))}
    assert got == official_vision_shapes(tiny_cfg)
    assert sum(sd[k].numel() for k in got) == model_info(tiny_cfg)["params"]["vision"]
    rows = vmodel.image_start.float()
    assert rows.std() > 0.05 and rows.mean().abs() < 0.05  # embedding-like rows (mean 0), not norm weights (mean 1)
    assert 0 < sd["aligner.w1.bias"].float().abs().max() < 0.5  # biases drawn small, not zero
    # the Hugging Face spelling keeps the tower's names whole (its attn / mlp are not the text ones)
    from dsv41.deploy.names import hf_to_native, native_to_hf

    for k in got:
        assert native_to_hf(k) == "model." + k and hf_to_native("model." + k) == k and hf_to_native(k) == k


@pytest.mark.parametrize("spelling", ["native", "hf"])
def test_official_vision_weights_load_from_a_checkpoint(tmp_path, tiny_cfg, rng, fresh_seed, spelling):
    """A checkpoint whose vision tensors are written under the official names (in either
    spelling) loads, and the tower then computes with exactly those values."""
    from safetensors.torch import load_file
    from dsv41.deploy.checkpoint import INDEX_NAME, load_checkpoint, make_checkpoint, write_state_dict
    from dsv41.deploy.names import native_to_hf

    ckpt = make_checkpoint(tiny_cfg, tmp_path / "ckpt", seed=fresh_seed)
    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(str(f)))
        f.unlink()
    (ckpt / INDEX_NAME).unlink()
    for k, (shape, dtype) in official_vision_shapes(tiny_cfg).items():
        assert k in sd  # make-checkpoint writes the official names
        sd[k] = (torch.randn(shape, generator=rng) * 0.05).to(dtype)
    write_state_dict(sd, ckpt, 1 << 30, rename=native_to_hf if spelling == "hf" else None)
    _, model, _ = load_checkpoint(ckpt)
    for k in ("vision.blocks.1.attn.wqkv.bias", "vision.patch_embed.proj.weight", "aligner.w2.bias",
              "vision.norm.weight", "vision.blocks.0.mlp.w1.weight"):
        assert torch.equal(model.state_dict()[k], sd[k]), k
    px = preprocess(tiny_cfg.vision, Image.new("RGB", (60, 40), (10, 200, 30)))
    assert torch.isfinite(encode_image(model, px).float()).all()


# ---- preprocessing and placeholder counts ------------------------------------------------------

def official_canvas(width, height, min_pixels, budget, max_ratio=None):
    """(canvas width, canvas height) of the official planning rule, MODEL.md section 3, Vision,
    written out here on its own: ratio cap, minimum area, round up to 14, closed form."""
    w, h = width, height
    if max_ratio is not None and w > h * max_ratio:
        w = h * max_ratio
    if 0 < w * h < min_pixels:
        f = math.sqrt(min_pixels / (w * h))
        w, h = int(w * f), int(h * f)
    cw, ch = math.ceil(w / 14) * 14, math.ceil(h / 14) * 14
    if math.ceil(ch / 42) * (math.ceil(cw / 42) + 1) + 2 <= budget:
        return cw, ch
    r = h / w
    ws = math.sqrt((budget - 2) / r + 0.25) - 0.5
    hs = ws * r
    if ws < 1:
        return 42, (budget - 2) // 2 * 42
    if hs < 1:
        return (budget - 3) * 42, 42
    beta = min(math.floor(ws) * 42 / w, math.floor(hs) * 42 / h)
    return math.floor(w * beta / 14) * 14, math.floor(h * beta / 14) * 14


@pytest.mark.parametrize("size,canvas,count", [
    ((544, 544), (546, 546), 13 * 14 + 2),       # 39 x 39 patches -> 13 x 13 cells
    ((100, 100), (546, 546), 13 * 14 + 2),       # upscaled to the 544^2 minimum area
    ((1, 1), (546, 546), 13 * 14 + 2),           # tiny: 544 x 544 after the upscale
    ((1302, 1302), (1302, 1302), 31 * 32 + 2),   # the largest square within 1024 positions
    ((2000, 2000), (1302, 1302), 31 * 32 + 2),   # over budget: w* = 31.47 -> beta = 1302 / 2000
    ((3000, 1000), (2268, 756), 18 * 55 + 2),    # over budget: beta = 54 * 42 / 3000 = 18 * 42 / 1000
    ((1000, 3000), (714, 2142), 51 * 18 + 2),    # w* = 17.96, h* = 53.9: beta = 17 * 42 / 1000
    ((10000, 10), (17206, 28), 1 * 411 + 2),     # upscaled to 17203 x 17 px, in budget
    ((100000, 10), (42882, 42), 1 * 1022 + 2),   # h* < 1: one row of 1021 cells
    ((10, 100000), (42, 21462), 511 * 2 + 2),    # w* < 1: one column of 511 cells
])
def test_canvas_and_counts_published_config(size, canvas, count):
    vc = VisionConfig()
    lay = image_layout(vc, *size)
    assert (lay.width, lay.height) == canvas == official_canvas(*size, 544 ** 2, 1024)
    assert (lay.patch_cols, lay.patch_rows) == (canvas[0] // 14, canvas[1] // 14)
    assert (lay.cols, lay.rows) == (math.ceil(canvas[0] / 42), math.ceil(canvas[1] / 42))
    assert num_image_tokens(vc, *size) == lay.num_tokens == count <= 1024


def test_over_budget_tiny_preset_example(tiny_cfg):
    """MODEL.md's example: 900 x 1500 under the tiny budget (64) is 15 x 25 patches."""
    lay = image_layout(tiny_cfg.vision, 900, 1500)
    assert (lay.patch_cols, lay.patch_rows) == (15, 25) and (lay.width, lay.height) == (210, 350)
    assert lay.num_tokens == 9 * 6 + 2


def test_layout_follows_the_closed_form_on_many_sizes(rng):
    """Random sizes and aspect ratios, small and large budgets, with and without a ratio cap:
    the layout is the official rule's, never over budget."""
    for budget, min_pixels, max_ratio in [(64, 112 ** 2, None), (300, 200 ** 2, None), (1024, 544 ** 2, None),
                                          (1024, 544 ** 2, 2.5), (100, 0, None)]:
        vc = VisionConfig(max_image_tokens=budget, min_pixels=min_pixels, max_wh_ratio=max_ratio)
        for _ in range(60):
            w, h = (int(v) for v in torch.randint(1, 6000, (2,), generator=rng))
            if bool(torch.rand((), generator=rng) < 0.3):  # extreme aspect ratios
                w = max(1, w // 200)
            lay = image_layout(vc, w, h)
            assert (lay.width, lay.height) == official_canvas(w, h, min_pixels, budget, max_ratio), (w, h)
            assert 4 <= lay.num_tokens <= budget and lay.width % 14 == 0 and lay.height % 14 == 0
            assert lay.stretch == (max_ratio is not None and w > h * max_ratio)


def _expected_pixels(img, canvas, stretch=False):
    """The official canvas and normalisation, written out: ImageOps.pad (bicubic, centred, grey
    127) or a plain resize, then x / 255, (x - 0.5) / 0.5 in fp32, bf16."""
    from PIL import ImageOps

    out = img.resize(canvas, Image.Resampling.BICUBIC) if stretch else ImageOps.pad(
        img, canvas, method=Image.Resampling.BICUBIC, color=(127, 127, 127), centering=(0.5, 0.5))
    arr = np.asarray(out, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
    return torch.from_numpy((arr - np.float32(0.5)) / np.float32(0.5)).to(torch.bfloat16)


@pytest.mark.parametrize("size", [(200, 150), (37, 300), (600, 20), (900, 1500), (1, 1), (5, 3), (1000, 1000)])
def test_preprocess_gives_the_official_pixels(tiny_cfg, size, rng):
    vc = tiny_cfg.vision
    img = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy())
    px = preprocess(vc, img)
    canvas = official_canvas(*size, 112 ** 2, 64)
    assert px.dtype == torch.bfloat16 and px.shape == (3, canvas[1], canvas[0])
    assert torch.equal(px, _expected_pixels(img, canvas))
    lay = image_layout(vc, *size)
    assert px.shape[1:] == (lay.patch_rows * 14, lay.patch_cols * 14)


def test_preprocess_centres_the_image_between_grey_bars(tiny_cfg):
    """A wide red image on a taller canvas: equal grey bars above and below (ImageOps.pad), the
    grey value (127 / 255 - 0.5) / 0.5 in bf16; a max-ratio image is stretched, no bars."""
    vc = tiny_cfg.vision
    img = Image.new("RGB", (300, 100), (255, 0, 0))
    px = preprocess(vc, img)
    grey = torch.tensor((127 / 255 - 0.5) / 0.5, dtype=torch.float32).to(torch.bfloat16)
    is_grey = (px == grey).all(0).all(1)  # rows that are entirely grey
    top = int(is_grey.long().cumprod(0).sum())
    bottom = int(is_grey.flip(0).long().cumprod(0).sum())
    assert top > 0 and abs(top - bottom) <= 1, (top, bottom)
    assert torch.equal(px[0, top + 2], torch.ones(px.shape[2], dtype=torch.bfloat16))  # red, full width
    stretched = preprocess(replace(vc, max_wh_ratio=2.0), img)
    lay = image_layout(replace(vc, max_wh_ratio=2.0), 300, 100)
    assert lay.stretch and stretched.shape == (3, lay.height, lay.width)
    assert not (stretched == grey).all(0).any()
    assert torch.equal(stretched, _expected_pixels(img, (lay.width, lay.height), stretch=True))


@pytest.mark.parametrize("size", [(200, 150), (1000, 1000), (37, 300), (600, 20)])
def test_tiny_tower_output_matches_count(vmodel, tiny_cfg, size, rng):
    vc = tiny_cfg.vision
    img = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy())
    px = preprocess(vc, img)
    assert px.min() >= -1 and px.max() <= 1
    emb = encode_image(vmodel, px)
    assert emb.shape == (num_image_tokens(vc, *size), tiny_cfg.hidden_size) and emb.shape[0] <= 64
    assert (200, 150) != size or emb.shape[0] == 4 * 6 + 2  # 210 x 154 canvas: 15 x 11 patches -> 5 x 4 cells
    assert (1000, 1000) != size or emb.shape[0] == 7 * 8 + 2  # budget 64: 7 x 7 cells


def _official_tower(sd, vc, pixels):
    """The official tower and aligner written out in plain torch from the state dict (fp32
    matmuls of bf16 values, bf16 activations between ops): conv2d patch embedding, fused qkv
    with bias, rotate-half 2D RoPE cast to bf16, softmax attention, fused SwiGLU, aligner."""
    bf, f = torch.bfloat16, torch.nn.functional
    w_, nh = vc.hidden_size, vc.num_attention_heads
    hd = w_ // nh

    def lin(x, name, bias=True):
        y = x.float() @ sd[name + ".weight"].float().t()
        return (y + sd[name + ".bias"].float() if bias else y).to(bf)

    def norm(x, name):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + vc.norm_eps) * sd[name].float()).to(bf)

    conv_w = sd["vision.patch_embed.proj.weight"].float().view(w_, 3, 14, 14)
    x = f.conv2d(pixels.float()[None], conv_w, sd["vision.patch_embed.proj.bias"].float(), stride=14)[0]
    rows, cols = x.shape[1:]
    x = x.permute(1, 2, 0).reshape(rows * cols, w_).to(bf)
    inv = 1.0 / vc.rope_theta ** (torch.arange(hd // 4, dtype=torch.float64) / (hd // 4))
    yy, xx = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                            indexing="ij")
    ang = torch.cat((yy.reshape(-1, 1) * inv, xx.reshape(-1, 1) * inv), -1)
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()  # [N, hd / 2]

    def rope(t):  # t [N, H, hd]: pairs (i, i + hd / 2)
        a, b = t.float()[..., : hd // 2], t.float()[..., hd // 2:]
        c, s_ = cos[:, None], sin[:, None]
        return torch.cat((a * c - b * s_, b * c + a * s_), -1).to(bf)

    for i in range(vc.num_hidden_layers):
        p = f"vision.blocks.{i}."
        qkv = lin(norm(x, p + "norm1.weight"), p + "attn.wqkv")
        q, k, v = (t.reshape(-1, nh, hd) for t in qkv.split(w_, -1))
        q, k = rope(q), rope(k)
        att = torch.softmax(torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * hd ** -0.5, -1)
        o = torch.einsum("hnm,mhd->nhd", att, v.float()).reshape(-1, w_).to(bf)
        x = (x.float() + lin(o, p + "attn.wo").float()).to(bf)
        g, u = lin(norm(x, p + "norm2.weight"), p + "mlp.w1", bias=False).float().chunk(2, -1)
        hmid = (f.silu(g).to(bf).float() * u).to(bf)
        x = (x.float() + lin(hmid, p + "mlp.w2", bias=False).float()).to(bf)
    grid = norm(x, "vision.norm.weight").view(rows, cols, w_).float()
    pr, pc = -(-rows // 3) * 3, -(-cols // 3) * 3
    grid = f.pad(grid, (0, 0, 0, pc - cols, 0, pr - rows))
    # each 3 x 3 block, channel-major: feature = c * 9 + ky * 3 + kx
    cells = grid.view(pr // 3, 3, pc // 3, 3, w_).permute(0, 2, 4, 1, 3).reshape(pr // 3, pc // 3, 9 * w_)
    hmid = f.gelu(lin(cells.to(bf), "aligner.w1").float()).to(bf)
    return lin(hmid, "aligner.w2")


@pytest.mark.parametrize("size", [(90, 60), (40, 300)])
def test_tower_matches_the_official_arithmetic(vmodel, tiny_cfg, size, rng):
    vc = tiny_cfg.vision
    img = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy())
    px = preprocess(vc, img)
    sd = vmodel.state_dict()
    want = _official_tower(sd, vc, px).float()
    got = vmodel.aligner(vmodel.vision(px)).float()
    assert got.shape == want.shape
    err = float((got - want).abs().max() / want.abs().max())
    print(f"\n[dsv41] vision tower vs the written-out official arithmetic {size}: max rel err {err:.2e}")
    assert err < 2e-2  # bf16 activations: roundings flipped by fp32 vs fp64 matmul sums (up to 6e-3)


def test_vision_preprocessing_keys_load_from_both_config_forms(tiny_cfg):
    from dsv41.core.config import from_dict
    from test_config import FLAT

    released = {k: v for k, v in FLAT.items() if k != "vision_max_tokens"}
    released.update(vision_min_pixels=295936, vision_max_n_token=1024, vision_max_wh_ratio=None,
                    vision_rope_theta=10000.0)
    assert from_dict(released).vision == VisionConfig()
    vc = from_dict({**released, "vision_min_pixels": 1000, "vision_max_wh_ratio": 2.5}).vision
    assert (vc.min_pixels, vc.max_wh_ratio) == (1000, 2.5)
    nested = tiny_cfg.to_hf_dict()
    assert from_dict(nested).vision == tiny_cfg.vision
    del nested["vision_config"]["min_pixels"]
    nested["vision_config"]["min_image_size"] = 100  # the earlier form: the side of the minimum area
    assert from_dict(nested).vision.min_pixels == 100 * 100


def test_expand_placeholders():
    assert expand_image_placeholders([1, 4, 9, 4], 4, [3, 2]) == [1, 4, 4, 4, 9, 4, 4]
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_image_placeholders([4, 4], 4, [3])


# ---- messages ----------------------------------------------------------------------------------

def test_two_images_text_form_equals_messages_form(tmp_path, tok, tiny_cfg, rng):
    a = _png(tmp_path / "a.png", 90, 60, rng)
    b = _png(tmp_path / "b.png", 40, 300, rng)
    text = f"Compare {IMAGE_TOKEN} with {IMAGE_TOKEN}, please."
    t = encode_text_with_images(tok, tiny_cfg, text, [str(a), str(b)])
    data_url = "data:image/png;base64," + base64.b64encode(b.read_bytes()).decode()
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "a.png"}},  # relative to base_dir
        {"type": "text", "text": " with "},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": ", please."},
    ]}]
    m = encode_messages(tok, tiny_cfg, msgs, base_dir=tmp_path)
    assert t.ids == m.ids
    n_a, n_b = num_image_tokens(tiny_cfg.vision, 90, 60), num_image_tokens(tiny_cfg.vision, 40, 300)
    assert t.image_tokens == m.image_tokens == [n_a, n_b] and n_a != n_b
    assert all(torch.equal(x, y) for x, y in zip(t.images, m.images))
    # layout: bos, <User>, text, n_a image ids, text, n_b image ids, text, <Assistant>
    ids, img = t.ids, tiny_cfg.image_token_id
    runs, k = [], 0
    while k < len(ids):
        if ids[k] == img:
            j = k
            while j < len(ids) and ids[j] == img:
                j += 1
            runs.append(j - k)
            k = j
        else:
            k += 1
    assert runs == [n_a, n_b]
    assert ids[:2] == [tiny_cfg.bos_token_id, tok.token_to_id("<｜User｜>")]
    assert ids[-1] == tok.token_to_id("<｜Assistant｜>")
    no_img = encode_text_with_images(tok, tiny_cfg, "Compare  with , please.", [])
    assert len(ids) - n_a - n_b == len(no_img.ids) and not no_img.images


def test_messages_errors(tmp_path, tok, tiny_cfg):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    with pytest.raises(ImageError, match="bad.png: not a readable image"):
        preprocess(tiny_cfg.vision, str(bad))
    with pytest.raises(ImageError, match="missing.png: no such image file"):
        load_image(str(tmp_path / "missing.png"))
    garbage = "data:image/png;base64," + base64.b64encode(b"garbage").decode()
    with pytest.raises(ImageError, match="message 0 part 1 .data URL.: not a readable image"):
        encode_messages(tok, tiny_cfg, [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": garbage}}]}])
    with pytest.raises(MessagesError, match="message 0 part 0: remote image URLs"):
        encode_messages(tok, tiny_cfg, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    with pytest.raises(MessagesError, match="message 1: expected an object with role"):
        encode_messages(tok, tiny_cfg, [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(MessagesError, match="image token itself"):
        encode_messages(tok, tiny_cfg, [{"role": "user", "content": f"sneaky {IMAGE_TOKEN}"}])
    with pytest.raises(MessagesError, match="no vision tower"):
        encode_messages(tok, tiny_cfg.replace(vision=None), [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(bad)}}]}])


def test_truncated_png_is_a_clear_error(tmp_path, rng, tiny_cfg):
    good = _png(tmp_path / "good.png", 64, 64, rng)
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ImageError, match="cut.png: not a readable image"):
        preprocess(tiny_cfg.vision, str(cut))


# ---- model input ------------------------------------------------------------------------------

def _logits(model, ids, embeds):
    return SingleSequence(model).feed(ids, all_logits=True, image_embeds=embeds)


def _image_first_prompt(vmodel, tiny_cfg, rng, size=(120, 90)):
    """[image span] + text: the image positions see nothing but the image (causal)."""
    vc = tiny_cfg.vision
    img = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy())
    n = num_image_tokens(vc, *size)
    text = rand_prompt(tiny_cfg, 12, rng).tolist()
    return [tiny_cfg.image_token_id] * n + text, encode_images(vmodel, [preprocess(vc, img)]), n


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_image_embeddings_change_the_output(vmodel, tiny_cfg, rng):
    ids, emb, _ = _image_first_prompt(vmodel, tiny_cfg, rng)
    _, emb2, _ = _image_first_prompt(vmodel, tiny_cfg, rng)
    with_img = _logits(vmodel, ids, emb)
    assert _rel(_logits(vmodel, ids, emb2)[-1], with_img[-1]) > 1e-2  # another image
    assert _rel(_logits(vmodel, ids, None)[-1], with_img[-1]) > 1e-2  # the placeholder token rows
    assert torch.equal(_logits(vmodel, ids, emb), with_img)  # deterministic


def test_bias_vl_applies_on_image_positions_only(vmodel, tiny_cfg, rng):
    ids, emb, n = _image_first_prompt(vmodel, tiny_cfg, rng)
    text_ids = [tiny_cfg.bos_token_id] + rand_prompt(tiny_cfg, 20, rng).tolist()
    base_img, base_txt = _logits(vmodel, ids, emb), _logits(vmodel, text_ids, None)
    gates = [blk.ffn.gate for blk in vmodel.layers]
    for which in ("bias_vl", "bias"):
        saved = [getattr(g, which).clone() for g in gates]
        try:
            for g in gates:
                getattr(g, which).copy_(torch.randn(g.bias.shape, generator=rng) * 3)
            img, txt = _logits(vmodel, ids, emb), _logits(vmodel, text_ids, None)
        finally:
            for g, s in zip(gates, saved):
                getattr(g, which).copy_(s)
        if which == "bias_vl":
            assert torch.equal(txt, base_txt)  # text-only prompts never read bias_vl
            assert _rel(img[:n], base_img[:n]) > 1e-3  # image positions route with it
        else:
            assert torch.equal(img[:n], base_img[:n])  # image positions never read bias
            assert _rel(txt, base_txt) > 1e-3 and _rel(img[n:], base_img[n:]) > 1e-3


def test_engram_gate_is_zero_on_image_positions(vmodel, tiny_cfg, rng):
    ids, emb, n = _image_first_prompt(vmodel, tiny_cfg, rng)
    base = _logits(vmodel, ids, emb)
    wkv = [blk.engram.wkv for blk in vmodel.layers if blk.engram is not None]
    assert wkv
    saved = [(w.weight.clone(), w.scale.clone() if w.scale is not None else None) for w in wkv]
    try:
        for w in wkv:  # a different Engram projection: other keys and values everywhere
            w.weight.copy_(w.weight[torch.randperm(w.weight.shape[0], generator=rng)])
        got = _logits(vmodel, ids, emb)
    finally:
        for w, (ws, ss) in zip(wkv, saved):
            w.weight.copy_(ws)
            if ss is not None:
                w.scale.copy_(ss)
    assert torch.equal(got[:n], base[:n])  # no Engram on the image span
    assert _rel(got[n:], base[n:]) > 1e-3  # text after it does use Engram


def test_image_embeds_count_and_chunks_inside_a_span(vmodel, tiny_cfg, rng):
    ids, emb, n = _image_first_prompt(vmodel, tiny_cfg, rng)
    cache = SingleSequence(vmodel)
    with pytest.raises(ValueError, match=f"{n} image-token positions"):
        cache.feed(ids, image_embeds=emb[:-1])
    assert cache.length == 0 and not cache.tokens  # rejected before the cache changed
    # a serving engine's chunks may start after position 0 and cut a span: same result as one pass
    ids = [tiny_cfg.bos_token_id, 7] + ids
    whole = SingleSequence(vmodel).feed(ids, image_embeds=emb)
    k = 2 + n // 2
    cache = SingleSequence(vmodel)
    cache.feed(ids[:2])
    cache.feed(ids[2:k], image_embeds=emb[:k - 2])
    split = cache.feed(ids[k:], image_embeds=emb[k - 2:])
    assert torch.equal(split, whole)


def test_engine_images_bypass_prefix_cache(vmodel, tiny_cfg, rng):
    ids, _, _ = _image_first_prompt(vmodel, tiny_cfg, rng, size=(50, 50))
    img = preprocess(tiny_cfg.vision, Image.new("RGB", (50, 50), (200, 10, 10)))
    eng = Engine(vmodel, prefix_cache=True)
    p = SamplingParams(max_new_tokens=2)
    a = eng.generate([tiny_cfg.bos_token_id] + ids, p, images=[img])
    b = eng.generate([tiny_cfg.bos_token_id] + ids, p, images=[img])
    assert a.token_ids == b.token_ids and eng.prefix.stats["inserts"] == 0 and a.prefix_hit_tokens == 0


# ---- command line -------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_cli_run_image_changes_output(tmp_path, rng, fresh_seed, tiny_cfg):
    img = _png(tmp_path / "photo.png", 130, 70, rng)
    msgs = tmp_path / "text.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Describe it."}]))
    common = ("--preset", "tiny", "--seed", str(fresh_seed), "--max-new-tokens", "8", "--ignore-eos", "--json")
    with_img = _cli("run", "--image", str(img), "--prompt", "Describe it.", *common)
    assert with_img.returncode == 0, with_img.stderr
    no_img = _cli("run", "--messages", str(msgs), *common)
    assert no_img.returncode == 0, no_img.stderr
    a, b = json.loads(with_img.stdout), json.loads(no_img.stdout)
    n = num_image_tokens(tiny_cfg.vision, 130, 70)
    assert a["images"] == 1 and a["prompt_ids"].count(tiny_cfg.image_token_id) == n
    # the same chat prompt with the image span removed
    assert [t for t in a["prompt_ids"] if t != tiny_cfg.image_token_id] == b["prompt_ids"]
    assert a["token_ids"] != b["token_ids"]


def test_cli_image_errors(tmp_path, capsys):
    from dsv41.deploy.cli import main

    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    for argv, msg in [
        (["run", "--image", str(bad)], "notes.txt: not a readable image"),
        (["run", "--image", str(tmp_path / "nope.png")], "nope.png: no such image file"),
        (["run", "--messages", str(tmp_path / "none.json")], "none.json: no such messages file"),
        (["run", "--messages", str(bad)], "notes.txt: not valid JSON"),
        (["run", "--image", str(bad), "--prompt-ids", "5,6"], "--image goes with --prompt"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dsv41: error: ") and msg in err and len(err.splitlines()) == 1, err


def test_a_generated_image_token_id_is_text(vmodel, tiny_cfg, rng, monkeypatch):
    """Only a prompt's image spans are image positions: when the sampler picks the image token
    id after an image prompt, the next steps decode it as text (no image row is looked for)."""
    from dsv41.core import engine as engine_mod

    ids, _, _ = _image_first_prompt(vmodel, tiny_cfg, rng, size=(50, 50))
    img = preprocess(tiny_cfg.vision, Image.new("RGB", (50, 50), (200, 10, 10)))
    monkeypatch.setattr(engine_mod, "sample_rows",
                        lambda logits, params, gens, **kw: [tiny_cfg.image_token_id] * len(params))
    res = Engine(vmodel).generate([tiny_cfg.bos_token_id] + ids, SamplingParams(max_new_tokens=3), images=[img])
    assert res.token_ids == [tiny_cfg.image_token_id] * 3
