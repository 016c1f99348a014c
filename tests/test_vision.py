"""Vision input: DeepSeek-ViT pieces (patchify, 2D RoPE, 3x3 aligner, framing), preprocessing
and placeholder counts, messages -> prompt ids, the model's image-embedding input (bias_vl and
Engram gate 0 on image positions) and `dsv41 run --image` end to end (tiny preset)."""

import base64
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from dsv41.core.cache import SequenceCache
from dsv41.core.config import VisionConfig
from dsv41.core.engine import Engine, SamplingParams
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

def test_patchify_row_column_channel_order(rng):
    px = torch.randn(3, 28, 42, generator=rng)
    p = patchify(px, 14)
    assert p.shape == (6, 588)
    for k, (r, c) in enumerate([(0, 0), (0, 2), (1, 1), (1, 2)]):
        k = r * 3 + c
        for py, pxx, ch in [(0, 0, 0), (13, 5, 2), (7, 13, 1), (3, 9, 0)]:
            assert p[k, (py * 14 + pxx) * 3 + ch] == px[ch, r * 14 + py, c * 14 + pxx]


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


def test_vision_weights_and_info_agree(vmodel, tiny_cfg):
    sd = vmodel.state_dict()
    names = [k for k in sd if k.startswith(("vision.", "aligner.", "image_"))]
    assert {"image_start", "image_newline", "image_end", "vision.patch_embed.weight", "vision.norm.weight",
            "aligner.fc1.weight", "aligner.fc2.weight", "vision.layers.1.attn.wq.weight"} <= set(names)
    assert sum(sd[k].numel() for k in names) == model_info(tiny_cfg)["params"]["vision"]
    assert all(sd[k].dtype == torch.bfloat16 for k in names)
    rows = vmodel.image_start.float()
    assert rows.std() > 0.05 and rows.mean().abs() < 0.05  # embedding-like rows (mean 0), not norm weights (mean 1)


# ---- preprocessing and placeholder counts ------------------------------------------------------

@pytest.mark.parametrize("size,count,cells", [
    ((544, 544), 184, (13, 13)),     # 39 x 39 patches -> 13 x 13 cells: 13 * 14 + 2
    ((100, 100), 184, (13, 13)),     # upscaled to the 544^2 minimum area
    ((1302, 1302), 994, (31, 31)),   # the largest square within 1024 positions
    ((2000, 2000), 994, (31, 31)),   # over budget: rescaled to 1302 px
    ((1344, 1344), 994, (31, 31)),   # 32 x 32 cells would be 1058 positions
    ((10000, 10), 413, (1, 410)),    # upscaled to 17203 x 17 px: 1229 patches -> 410 cells
    ((100000, 10), 1024, (1, 1021)),  # over budget in one row: 1 * (1021 + 1) + 2
    ((10, 100000), 1024, (511, 1)),  # one column: 511 * 2 + 2
])
def test_placeholder_counts_published_config(size, count, cells):
    vc = VisionConfig()
    lay = image_layout(vc, *size)
    assert num_image_tokens(vc, *size) == lay.num_tokens == count
    assert (lay.rows, lay.cols) == cells
    if size in ((2000, 2000), (1344, 1344)):
        assert lay.width == lay.height == 1302
    if count < vc.max_image_tokens - 100:  # not budget-bound: area at least 544^2, aspect kept
        assert (lay.width + 0.5) * (lay.height + 0.5) >= 544 ** 2  # each side rounded to whole px
        assert abs(lay.width / lay.height - size[0] / size[1]) / (size[0] / size[1]) < 0.1


def test_budget_is_tight_and_respected(rng):
    """Random sizes: never over budget; when rescaled, 2% more scale would not fit."""
    vc = VisionConfig(max_image_tokens=300, min_image_size=200)
    for _ in range(50):
        w, h = (int(v) for v in torch.randint(1, 5000, (2,), generator=rng))
        lay = image_layout(vc, w, h)
        assert 4 <= lay.num_tokens <= 300
        s = lay.width / w
        from dsv41.core.image_processing import _layout_at

        # rescaled for the budget (not the layout at the minimum-area scale, whose pixel sizes
        # are rounded, so compare layouts rather than the rounded scale)
        rescaled = lay != _layout_at(vc, w, h, max(1.0, 200 / math.sqrt(w * h)))
        if rescaled and min(lay.width, lay.height) > 1:
            assert _layout_at(vc, w, h, s * 1.02).num_tokens > 300


@pytest.mark.parametrize("size", [(200, 150), (1000, 1000), (37, 300), (600, 20)])
def test_tiny_tower_output_matches_count(vmodel, tiny_cfg, size, rng):
    vc = tiny_cfg.vision
    img = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy())
    px = preprocess(vc, img)
    lay = image_layout(vc, *size)
    assert px.shape == (3, lay.patch_rows * 14, lay.patch_cols * 14)
    assert px.min() >= -1 and px.max() <= 1
    if lay.patch_cols * 14 > lay.width:  # grey 127 padding on the right
        assert torch.allclose(px[:, :, -1], torch.full_like(px[:, :, -1], 127 / 127.5 - 1))
    emb = encode_image(vmodel, px)
    assert emb.shape == (num_image_tokens(vc, *size), tiny_cfg.hidden_size) and emb.shape[0] <= 64
    assert (200, 150) != size or emb.shape[0] == 4 * 6 + 2  # 15 x 11 patches -> 5 x 4 cells
    assert (1000, 1000) != size or emb.shape[0] == 7 * 8 + 2  # budget 64: 7 x 7 cells


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
    cache = SequenceCache.allocate(model.cfg, len(ids) + 1, "cpu")
    return model(torch.tensor(ids), cache, all_logits=True, image_embeds=embeds)


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
    cache = SequenceCache.allocate(tiny_cfg, len(ids) + 4, "cpu")
    with pytest.raises(ValueError, match=f"{n} image-token positions"):
        vmodel(torch.tensor(ids), cache, image_embeds=emb[:-1])
    assert cache.length == 0 and not cache.tokens  # rejected before the cache changed
    # a serving engine's chunks may start after position 0 and cut a span: same result as one pass
    ids = [tiny_cfg.bos_token_id, 7] + ids
    whole = vmodel(torch.tensor(ids), SequenceCache.allocate(tiny_cfg, len(ids), "cpu"), image_embeds=emb)
    k = 2 + n // 2
    cache = SequenceCache.allocate(tiny_cfg, len(ids), "cpu")
    vmodel(torch.tensor(ids[:2]), cache)
    vmodel(torch.tensor(ids[2:k]), cache, image_embeds=emb[:k - 2])
    split = vmodel(torch.tensor(ids[k:]), cache, image_embeds=emb[k - 2:])
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
