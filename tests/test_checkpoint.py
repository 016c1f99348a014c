"""Checkpoint directories: `dsv41 make-checkpoint`, loading native / Hugging Face-named, sharded /
single-file checkpoints, the name table, and one clear error for every damaged checkpoint."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from dsv41.core.config import ConfigError, from_flat_dict, load_config, preset
from dsv41.core.model import Transformer
from dsv41.core.weights import WeightError, random_state_dict
from dsv41.deploy import checkpoint as ckpt_mod
from dsv41.deploy.checkpoint import INDEX_NAME, load_checkpoint, make_checkpoint
from dsv41.deploy.names import hf_to_native, native_to_hf
from safetensors import safe_open
from safetensors.torch import save_file

from _util import dsv41

SEED = 7
PROMPT = "5,17,42,99,7"


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k]))
                                        for k in a)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """`dsv41 make-checkpoint --preset tiny --seed SEED` (through the CLI)."""
    out = tmp_path_factory.mktemp("ckpts") / "tiny"
    dsv41("make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", str(SEED))
    return out


@pytest.fixture(scope="module")
def tiny_names(tiny_cfg):
    with torch.device("meta"):
        return list(Transformer(tiny_cfg).state_dict())


def damaged_copy(ckpt: Path, dst: Path) -> Path:
    shutil.copytree(ckpt, dst)
    return dst


# ---- names ----------------------------------------------------------------------------------

def test_names_round_trip_every_tiny_name(tiny_names):
    extra = ["mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.attn.wq_a.weight", "mtp.2.norm.weight",
             "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight", "mtp.1.ffn.experts.3.w2.scale",
             "vision.blocks.0.attn.wqkv.weight", "vision.blocks.0.mlp.w1.weight", "aligner.w1.bias", "image_start"]
    names = list(dict.fromkeys(tiny_names + extra))  # the extras the tiny model already has count once
    hf = [native_to_hf(n) for n in names]
    assert len(set(hf)) == len(hf)
    for n, h in zip(names, hf):
        assert hf_to_native(h) == n
        assert hf_to_native(n) == n  # identity on native names
        assert native_to_hf(hf_to_native(h)) == h
    # every HF name is in the HF spelling: `model.` prefix (or lm_head), no native-only components
    # (the vision tower keeps its official names whole: its attn / mlp are not the text modules)
    for h in hf:
        assert h.startswith(("model.", "lm_head."))
        if h.startswith(("model.vision.", "model.aligner.")):
            continue
        assert not re.search(r"(^|\.)(attn|ffn|attn_norm|ffn_norm|scale)(\.|$)", h), h


@pytest.mark.parametrize("native, hf", [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("layers.3.attn.wq_b.scale", "model.layers.3.self_attn.wq_b.weight_scale_inv"),
    ("layers.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ("layers.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("layers.3.ffn.gate.bias", "model.layers.3.mlp.gate.e_score_correction_bias"),
    ("layers.3.ffn.experts.5.w1.weight", "model.layers.3.mlp.experts.5.gate_proj.weight"),
    ("layers.3.ffn.shared_experts.w2.scale", "model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv"),
    ("layers.3.hc_attn_scale", "model.layers.3.hc_attn_scale"),
    ("layers.1.engram.embed.scale", "model.layers.1.engram.embed.weight_scale_inv"),
])
def test_names_table(native, hf):
    assert native_to_hf(native) == hf and hf_to_native(hf) == native


# ---- writing --------------------------------------------------------------------------------

def test_make_checkpoint_layout_and_dtypes(ckpt, tiny_cfg):
    files = listing(ckpt)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2
    for f in ("config.json", INDEX_NAME, "tokenizer.json", "tokenizer_config.json"):
        assert f in files
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    cfg_json = json.loads((ckpt / "config.json").read_text())
    assert "text_config" in cfg_json
    # the released flat form beside it, in the released key names, loading as the same model
    flat = json.loads((ckpt / "inference" / "config.json").read_text())
    assert "dim" in flat and "text_config" not in flat
    assert from_flat_dict(flat) == load_config(ckpt)
    assert "chat_template" in json.loads((ckpt / "tokenizer_config.json").read_text())
    wm = json.loads((ckpt / INDEX_NAME).read_text())["weight_map"]
    assert sorted(set(wm.values())) == shards
    with torch.device("meta"):
        meta_model = Transformer(tiny_cfg)
    expected = random_state_dict(meta_model, SEED)
    stored = {}
    for name, f in wm.items():
        with safe_open(str(ckpt / f), framework="pt") as fh:
            stored[name] = fh.get_tensor(name)
    assert same_state(stored, expected)
    dtypes = {stored[k].dtype for k in stored}
    assert {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.bfloat16, torch.float32} <= dtypes
    assert stored["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.engram.embed.scale"].shape[1] == stored["layers.1.engram.embed.weight"].shape[1] // 32
    assert stored["layers.2.ffn.experts.0.w1.weight"].dtype == torch.int8


def test_run_ckpt_matches_run_preset(ckpt):
    common = ["--prompt-ids", PROMPT, "--max-new-tokens", "6", "--ignore-eos", "--json"]
    a = json.loads(dsv41("run", "--ckpt", str(ckpt), "--seed", str(SEED), *common).stdout)
    b = json.loads(dsv41("run", "--preset", "tiny", "--seed", str(SEED), *common).stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]


def test_refuses_non_empty_dir_unless_force(ckpt, tmp_path, tiny_cfg):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    p = dsv41("make-checkpoint", "--preset", "tiny", "--out", str(out), check=False)
    assert p.returncode == 2 and "not empty" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert listing(out) == ["keep.txt"]
    make_checkpoint(tiny_cfg, out, seed=SEED, max_shard_bytes=2_000_000, force=True)
    assert listing(out) == listing(ckpt)
    assert listing(tmp_path) == ["ck"] + ["ck/" + f for f in listing(ckpt)]


def test_unwritable_location_fails_cleanly(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    p = dsv41("make-checkpoint", "--preset", "tiny", "--out", str(blocker / "ck"), check=False)
    assert p.returncode == 2 and "cannot write" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert listing(tmp_path) == ["a_file"]


def test_failure_mid_write_leaves_nothing(tmp_path, tiny_cfg, monkeypatch):
    """A full disk (ENOSPC) while the second shard is written: the error propagates and
    neither the temporary folder nor the lock file nor the destination is left."""
    from dsv41.deploy import convert as conv

    shards = []
    real = conv.ShardWriter._write_all

    def flaky(self, data, pos):
        if self.path.name not in shards:
            shards.append(self.path.name)
        if len(shards) == 2:
            raise OSError(28, "No space left on device", str(self.path))
        return real(self, data, pos)

    monkeypatch.setattr(conv.ShardWriter, "_write_all", flaky)
    with pytest.raises(OSError):
        make_checkpoint(tiny_cfg, tmp_path / "ck", seed=SEED, max_shard_bytes=2_000_000)
    assert len(shards) == 2 and listing(tmp_path) == []


# ---- loading --------------------------------------------------------------------------------

def _buffers(model) -> dict:
    return {k: v for k, v in model.state_dict().items()}


def test_hf_named_copies_load_identical(ckpt, tmp_path):
    cfg, model, tok = load_checkpoint(ckpt)
    assert cfg == preset("tiny") and tok is not None
    ref = _buffers(model)
    with torch.device("meta"):
        meta_model = Transformer(cfg)
    expected = random_state_dict(meta_model, SEED)
    assert same_state(ref, {k: expected[k] for k in ref})

    # sharded, Hugging Face names (index rewritten)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(ckpt / "config.json", hf)
    ckpt_mod.write_state_dict(expected, hf, 1_500_000, rename=native_to_hf)
    keys = json.loads((hf / INDEX_NAME).read_text())["weight_map"]
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    _, model_hf, tok_hf = load_checkpoint(hf)
    assert tok_hf is None and same_state(ref, _buffers(model_hf))

    # single file, Hugging Face names, no index
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(ckpt / "config.json", single)
    save_file({native_to_hf(k): v.contiguous() for k, v in expected.items()}, str(single / "model.safetensors"))
    _, model_single, _ = load_checkpoint(single)
    assert same_state(ref, _buffers(model_single))


def _truncate(d: Path):
    f = sorted(d.glob("*.safetensors"))[1]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return f.name, "truncated"


def _truncate_header(d: Path):
    f = min(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:5])
    return f.name, "truncated"


def _drop_shard(d: Path):
    f = max(d.glob("*.safetensors"))
    f.unlink()
    return f.name, "missing"


def _drop_config(d: Path):
    (d / "config.json").unlink()
    return "config.json", "no config.json"


def _bad_index(d: Path):
    (d / INDEX_NAME).write_text("{not json")
    return INDEX_NAME, "index"


def _bad_tensors(d: Path):
    """One missing, one misshapen, one wrongly typed, one unexpected tensor: one error lists all."""
    wm = json.loads((d / INDEX_NAME).read_text())["weight_map"]
    shard = wm["norm.weight"]
    with safe_open(str(d / shard), framework="pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is no dict)
    del t["norm.weight"]
    k_shape = next(k for k in t if k.endswith("attn_sink"))
    t[k_shape] = torch.zeros(t[k_shape].numel() + 1)
    k_dtype = next(k for k in t if k.endswith("attn_norm.weight"))
    t[k_dtype] = t[k_dtype].float()
    t["layers.0.bogus"] = torch.zeros(3)
    save_file(t, str(d / shard))
    del wm["norm.weight"]
    wm["layers.0.bogus"] = shard
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    return None, ["missing: norm.weight (expected shape [128]", f"wrong shape: {k_shape}",
                  f"wrong dtype: {k_dtype} is torch.float32, expected torch.bfloat16", "unexpected: layers.0.bogus"]


@pytest.mark.parametrize("damage", [_truncate, _truncate_header, _drop_shard, _drop_config, _bad_index, _bad_tensors])
def test_damaged_checkpoint_one_clear_error(ckpt, tmp_path, damage):
    d = damaged_copy(ckpt, tmp_path / "damaged")
    fname, message = damage(d)
    before = listing(tmp_path)
    p = dsv41("run", "--ckpt", str(d), "--prompt-ids", PROMPT, "--max-new-tokens", "2", check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.startswith("dsv41: error: ")
    if isinstance(message, list):  # one error listing every problem, with expected shapes
        assert "4 problem(s)" in p.stderr
        for m in message:
            assert m in p.stderr
    else:
        assert len(p.stderr.strip().splitlines()) == 1
        assert fname in p.stderr and message in p.stderr
    assert listing(tmp_path) == before


def test_load_errors_are_typed(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    with pytest.raises(WeightError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_onto_cuda_bit_exactly(ckpt):
    """Loading straight onto the GPU gives the same bytes as loading on the CPU."""
    _, cpu_model, _ = load_checkpoint(ckpt, "cpu")
    _, gpu_model, _ = load_checkpoint(ckpt, "cuda")
    assert all(t.is_cuda for t in gpu_model.state_dict().values())
    assert same_state(cpu_model.state_dict(), {k: v.cpu() for k, v in gpu_model.state_dict().items()})
