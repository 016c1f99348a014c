"""The official file forms: per-stream Engram gate rows, the released FP8 `attn.wo_a`, the released
flat `inference/config.json`, and the Engram compressed vocabulary checked against the tokenizer
(MODEL.md sections 1, 3 and 5)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from _util import dsv41
from test_config import RELEASED_FLAT
from test_ops_reference import _oracle_engram_gate

from dsv41.backends.reference import quant
from dsv41.core.config import FLAT_KEYS, FLAT_VISION, ConfigError, from_flat_dict
from dsv41.core.model import Transformer
from dsv41.core.tokenizer import build_tiny_tokenizer, write_tokenizer_files
from dsv41.core.weights import WeightError, random_state_dict
from dsv41.deploy import convert as cv
from dsv41.deploy.checkpoint import (
    CONFIG_NAME,
    load_checkpoint,
    make_checkpoint,
    write_state_dict,
)

PROMPT = "5,17,42,99,7,300"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def flat_config(cfg) -> dict:
    """`cfg` as a flat inference config.json under the released file's key names (plus
    `max_seq_len`, which the release leaves to the code default)."""
    out = cfg.to_flat_dict()
    assert set(out) - {"max_seq_len"} == set(RELEASED_FLAT)  # every key the release holds, no other
    return out


def released_form(sd: dict) -> tuple[dict, dict]:
    """(the state dict with every `attn.wo_a` stored FP8 + E8M0 block scale as released, the
    native state dict holding what a loader must make of it: the dequantised bf16 weight)."""
    released, native = dict(sd), dict(sd)
    owners = [k[: -len(".weight")] for k in sd if k.endswith("attn.wo_a.weight")]
    for owner in owners:
        q, s = quant.fp8_block_quant(sd[owner + ".weight"].float())
        released[owner + ".weight"], released[owner + ".scale"] = q, s
        native[owner + ".weight"] = quant.fp8_block_dequant(q, s).to(torch.bfloat16)
    assert owners and any(o.startswith("mtp.") for o in owners)
    return released, native


def write_ckpt(d: Path, config: dict, sd: dict, tokenizer=None, shard_bytes: int = 400_000) -> Path:
    d.mkdir(parents=True)
    (d / CONFIG_NAME).write_text(json.dumps(config))
    write_state_dict(sd, d, shard_bytes)
    write_tokenizer_files(tokenizer or build_tiny_tokenizer(), d)
    return d


@pytest.fixture(scope="module")
def forms(tiny_cfg, fresh_seed, tmp_path_factory):
    """(released-form checkpoint dir, native-form dir with the dequantised wo_a, native state dict)."""
    with torch.device("meta"):
        model = Transformer(tiny_cfg)
    released, native = released_form(random_state_dict(model, fresh_seed))
    root = tmp_path_factory.mktemp("forms")
    tok = build_tiny_tokenizer()
    rel = write_ckpt(root / "released", flat_config(tiny_cfg), released, tok)
    nat = write_ckpt(root / "native", tiny_cfg.to_hf_dict(), native, tok)
    return rel, nat, native


# ---- the released flat config and FP8 wo_a ------------------------------------------------------

def test_flat_config_in_released_names_is_the_tiny_config(tiny_cfg):
    assert from_flat_dict(json.loads(json.dumps(flat_config(tiny_cfg)))) == tiny_cfg


def test_released_form_loads_as_dequantised_bf16(forms):
    rel, nat, native = forms
    stored = json.loads((rel / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.0.attn.wo_a.scale" in stored and "mtp.0.attn.wo_a.scale" in stored
    cfg_r, model_r, _ = load_checkpoint(rel)
    cfg_n, model_n, _ = load_checkpoint(nat)
    assert cfg_r == cfg_n
    got = model_r.state_dict()
    assert got.keys() == native.keys()
    assert all(same(got[k], native[k]) for k in native)
    assert got["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16
    assert torch.equal(model_r.engram_map, model_n.engram_map)


def test_run_ckpt_accepts_the_released_form(forms):
    rel, nat, _ = forms
    common = ["--prompt-ids", PROMPT, "--max-new-tokens", "5", "--ignore-eos", "--json"]
    a = json.loads(dsv41("run", "--ckpt", str(rel), *common).stdout)
    b = json.loads(dsv41("run", "--ckpt", str(nat), *common).stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 5


@pytest.mark.parametrize("mp", [1, 2])
def test_convert_dequantises_the_released_wo_a(forms, tmp_path, mp):
    rel, nat, native = forms
    rep = cv.convert(rel, tmp_path / "out", mp, progress=False)
    ref = cv.convert(nat, tmp_path / "ref", mp, progress=False)
    n_wo_a = sum(k.endswith("attn.wo_a.weight") for k in native)
    assert rep["counts"]["fp8_dequantised"] == n_wo_a and ref["counts"]["fp8_dequantised"] == 0
    for r in range(mp):
        with safe_open(str(tmp_path / "out" / f"model{r}-mp{mp}.safetensors"), "pt") as a, \
                safe_open(str(tmp_path / "ref" / f"model{r}-mp{mp}.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            assert all(same(a.get_tensor(k), b.get_tensor(k)) for k in b.keys())  # noqa: SIM118
    assert "released-form FP8 wo_a" in cv.format_report(rep)
    if mp == 1:
        _, model, _ = load_checkpoint(tmp_path / "out")
        assert all(same(v, native[k]) for k, v in model.state_dict().items())


def _drop_scale(sd):
    del sd["layers.3.attn.wo_a.scale"]
    return "missing: layers.3.attn.wo_a.scale"


def _bad_scale(sd):
    sd["layers.3.attn.wo_a.scale"] = sd["layers.3.attn.wo_a.scale"][:1]
    return "wrong scale: layers.3.attn.wo_a.scale is torch.float8_e8m0fnu [1, 4]"


@pytest.mark.parametrize("damage", [_drop_scale, _bad_scale])
def test_damaged_released_form_is_one_clear_error(forms, tmp_path, damage):
    rel, _, _ = forms
    sd = {}
    for f in rel.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            sd.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    message = damage(sd)
    d = write_ckpt(tmp_path / "bad", json.loads((rel / CONFIG_NAME).read_text()), sd)
    with pytest.raises(WeightError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_checkpoint(d)
    with pytest.raises(cv.ConvertError, match="layers.3.attn.wo_a"):
        cv.convert(d, tmp_path / "out", 1, progress=False)
    assert not (tmp_path / "out").exists()


# ---- Engram: one gate row per stream -----------------------------------------------------------

def test_engram_gate_rows_differ_per_stream_in_a_checkpoint(forms, rng):
    """The checkpoint holds distinct q/k rows per stream and the model gates stream s with row s:
    its Engram output matches the per-stream oracle and differs from a shared-row gate."""
    _, nat, native = forms
    cfg, model, _ = load_checkpoint(nat)
    n, d = cfg.hc_mult, cfg.hidden_size
    for layer in cfg.engram_layer_ids:
        eng = model.layers[layer].engram
        for w in (eng.q_weight, eng.k_weight):
            assert w.shape == (n, d)
            assert all(not torch.equal(w[i], w[j]) for i in range(n) for j in range(i))
        assert torch.equal(eng.q_weight, native[f"layers.{layer}.engram.q_weight"])
        t = 6
        x = (torch.randn(t, 1, d, generator=rng) * 0.12).expand(t, n, d).bfloat16()  # as at the model's entry
        rows = torch.randint(0, eng.embed.weight.shape[0], (t, cfg.n_engram_rows_per_token), generator=rng)
        is_image = torch.zeros(t, dtype=torch.bool)
        got = eng(x, rows, is_image)
        kv = eng.wkv(quant.fp8_dequant(eng.embed.weight[rows.reshape(-1)], eng.embed.scale[rows.reshape(-1)])
                     .reshape(t, -1).bfloat16()).float()
        k, v = kv[:, : n * d].reshape(t, n, d), kv[:, n * d:]
        want, gates = _oracle_engram_gate(x, k, v, eng.q_weight, eng.k_weight, cfg.rms_norm_eps, is_image)
        assert ((got.double() - want).abs().max() / want.abs().max()) < 2.0**-7
        shared, shared_gates = _oracle_engram_gate(x, k, v, eng.q_weight[:1].expand(n, d),
                                                   eng.k_weight[:1].expand(n, d), cfg.rms_norm_eps, is_image)
        assert (gates[:, 1:] - shared_gates[:, 1:]).abs().max() > 1e-3  # the rows matter


def test_one_shared_engram_row_is_a_clear_error(forms, tmp_path):
    _, nat, native = forms
    sd = dict(native)
    sd["layers.1.engram.q_weight"] = native["layers.1.engram.q_weight"][0].clone()
    d = write_ckpt(tmp_path / "old", json.loads((nat / CONFIG_NAME).read_text()), sd)
    with pytest.raises(WeightError, match=r"wrong shape: layers.1.engram.q_weight is \[128\], expected \[4, 128\]"):
        load_checkpoint(d)


def test_convert_replicates_per_stream_engram_rows(forms, tmp_path):
    _, nat, native = forms
    cv.convert(nat, tmp_path / "out", 2, progress=False)
    for r in range(2):
        with safe_open(str(tmp_path / "out" / f"model{r}-mp2.safetensors"), "pt") as fh:
            for leaf in ("q_weight", "k_weight"):
                assert same(fh.get_tensor(f"layers.4.engram.{leaf}"), native[f"layers.4.engram.{leaf}"])


# ---- the compressed vocabulary against the tokenizer --------------------------------------------

def test_make_checkpoint_records_the_compressed_vocab(tiny_cfg, tmp_path):
    d = make_checkpoint(tiny_cfg.replace(engram_compressed_vocab_size=1), tmp_path / "c", seed=3)
    text = json.loads((d / CONFIG_NAME).read_text())["text_config"]
    assert text["engram_compressed_vocab_size"] == 423  # the tiny tokenizer's Engram token map


def test_config_disagreeing_with_tokenizer_is_one_clear_error(forms, tmp_path):
    _, nat, _ = forms
    d = tmp_path / "mismatch"
    d.mkdir()
    for f in nat.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / CONFIG_NAME).read_text())
    config["text_config"]["engram_compressed_vocab_size"] = 422
    (d / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is 422 in the config, but the tokenizer's "
                                          "Engram token map has 423 entries"):
        load_checkpoint(d)
    p = dsv41("run", "--ckpt", str(d), "--prompt-ids", PROMPT, "--max-new-tokens", "1", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("dsv41: error: ") and "422" in p.stderr and "423" in p.stderr
