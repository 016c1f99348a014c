"""`dsv41.deploy.convert`: streamed model-parallel conversion of a checkpoint."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from dsv41.backends.reference import quant
from dsv41.core.config import load_config, preset
from dsv41.core.weights import build_model, random_state_dict
from dsv41.deploy import convert as cv
from safetensors import safe_open
from safetensors.torch import save_file

SEED = 1234


@pytest.fixture(scope="module")
def tiny_sd():
    cfg = preset("tiny")
    model = build_model(cfg, SEED)
    return cfg, random_state_dict(model, SEED)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def make_source(root: Path, cfg, sd: dict, *, n_shards: int = 2, hf_names: bool = False, extra=None,
                tokenizer: bool = True) -> Path:
    """A checkpoint dir: nested config.json, `n_shards` shards + index (or one file, no index)."""
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    if tokenizer:
        (src / "tokenizer.json").write_text('{"model": "fake"}')
        (src / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    items = dict(sd)
    if extra:
        items.update(extra)
    if hf_names:
        from dsv41.deploy.names import native_to_hf
        items = {native_to_hf(k): v for k, v in items.items()}
    names = list(items)
    if n_shards == 1:
        save_file({k: items[k].contiguous() for k in names}, str(src / "model.safetensors"))
        return src
    wmap = {}
    for i in range(n_shards):
        fn = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: items[k].contiguous() for k in names[i::n_shards]}
        save_file(part, str(src / fn))
        wmap.update({k: fn for k in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return src


def load_shards(dst: Path, mp: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for r in range(mp):
        with safe_open(str(dst / f"model{r}-mp{mp}.safetensors"), "pt") as f:
            assert f.metadata()["rank"] == str(r)
            out.append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open, not a dict
    return out


def _no_leftovers(parent: Path, dst: Path) -> None:
    assert not dst.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]


# Independent statement of the split rules (MODEL.md section 5), for reassembly.
def _rule(name: str) -> str:
    if re.search(r"\.ffn\.experts\.\d+\.", name):
        return "expert"
    if ".engram.embed." in name:
        return "engram"
    if re.search(r"\.attn\.wo_b\.", name):
        return "dim1"
    if name in ("embed.weight", "head.weight") or re.search(
            r"\.attn\.(wq_b|wo_a|indexer\.wq_b|indexer\.weights_proj)\.|\.attn\.attn_sink$|markov_head\.", name):
        return "dim0"
    return "replicate"


def test_mp1_equals_source(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    rep = cv.convert(src, tmp_path / "out", 1, progress=False)
    (shard,) = load_shards(tmp_path / "out", 1)
    assert set(shard) == set(sd)
    assert all(_same(shard[k], sd[k]) for k in sd)
    assert rep["source_tensors"] == rep["consumed_tensors"] == len(sd)
    assert rep["written_tensors"] == [len(sd)]
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["model_parallel"] == 1 and "text_config" in out_cfg
    assert load_config(tmp_path / "out") == cfg
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "fake"}'
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    build_model(cfg, state_dict=shard)  # loads into the model: names, shapes and dtypes right


def test_mp2_reassembles_bit_exactly(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    rep = cv.convert(src, tmp_path / "out", 2, progress=False)
    shards = load_shards(tmp_path / "out", 2)
    per = cfg.n_routed_experts // 2
    seen = set()
    kinds = {}
    for name, ref in sd.items():
        kind = _rule(name)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "replicate":
            assert _same(shards[0][name], ref) and _same(shards[1][name], ref), name
        elif kind == "expert":
            e = int(re.search(r"experts\.(\d+)\.", name).group(1))
            # DSpark stages (`mtp.*`) have their own expert count
            owner = e // (cfg.dspark_n_routed_experts // 2 if name.startswith("mtp.") else per)
            assert name in shards[owner] and name not in shards[1 - owner], name
            assert _same(shards[owner][name], ref), name
        else:
            dim = 1 if kind == "dim1" else 0
            parts = [s[name] for s in shards]
            if kind != "engram":
                assert parts[0].shape == parts[1].shape
            else:
                assert parts[0].shape[0] == -(-ref.shape[0] // 2)
            assert _same(torch.cat([p.view(torch.uint8) for p in parts], dim).view(ref.dtype), ref), name
        seen.add(name)
    assert seen == set(sd)
    assert set(shards[0]) | set(shards[1]) == set(sd)
    assert kinds["dim1"] > 0 and kinds["dim0"] > 0 and kinds["engram"] == 4 and kinds["expert"] > 0
    assert sum(rep["written_tensors"]) == len(sd) + sum(v for k, v in kinds.items() if k != "expert")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_parallel"] == 2


def test_hf_names_single_file(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd, n_shards=1, hf_names=True, tokenizer=False)
    cv.convert(src, tmp_path / "out", 1, progress=False)
    (shard,) = load_shards(tmp_path / "out", 1)
    assert set(shard) == set(sd) and all(_same(shard[k], sd[k]) for k in sd)


def test_expert_fp8(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    rep = cv.convert(src, tmp_path / "out", 2, expert_dtype="fp8", progress=False)
    shards = load_shards(tmp_path / "out", 2)
    merged = {**shards[1], **shards[0]}
    n = 0
    for name, ref in sd.items():
        if _rule(name) != "expert" or not name.endswith(".weight"):
            continue
        owner = name[: -len(".weight")]
        q, s = merged[name], merged[owner + ".scale"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        want = quant.fp4_weight_dequant(ref, sd[owner + ".scale"])
        got = quant.fp8_block_dequant(q, s)
        block = quant.e8m0_to_float(s).repeat_interleave(32, 0)[: q.shape[0]].repeat_interleave(32, 1)[:, : q.shape[1]]
        # E4M3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 of the block scale
        assert ((got - want).abs() <= want.abs() * 2.0**-4 + block * 2.0**-9).all(), name
        n += 1
    assert n == 3 * (cfg.n_routed_experts * cfg.num_hidden_layers
                     + cfg.dspark_n_routed_experts * cfg.num_nextn_predict_layers)  # + DSpark stages
    assert rep["counts"]["expert_fp8_converted"] == n
    out_cfg = load_config(tmp_path / "out")
    assert out_cfg.expert_dtype == "fp8"
    full = {k: (merged[k] if _rule(k) == "expert" else v) for k, v in sd.items()}
    build_model(out_cfg, state_dict=full)  # the fp8-expert model accepts the converted experts


def test_engram_int8(tmp_path, tiny_sd, capsys):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    rep = cv.convert(src, tmp_path / "out", 2, engram_dtype="int8", progress=False)
    print(cv.format_report(rep))
    assert "engram int8" in capsys.readouterr().out
    shards = load_shards(tmp_path / "out", 2)
    errs = rep["engram_int8_error"]
    assert set(errs) == {f"layers.{i}.engram.embed.weight" for i in cfg.engram_layer_ids}
    for name, e in errs.items():
        assert 0 < e["mean_rel"] <= e["max_rel"] <= 0.5 / 127 + 1e-6, e
        owner = name[: -len(".weight")]
        q = torch.cat([s[name] for s in shards])
        sc = torch.cat([s[owner + ".scale"] for s in shards])
        assert q.dtype == torch.int8 and sc.dtype == torch.float32 and sc.shape == (q.shape[0], 1)
        ref = quant.fp8_dequant(sd[name], sd[owner + ".scale"])
        amax = ref.abs().amax(-1, keepdim=True)
        rel = ((q.float() * sc - ref).abs() / amax).amax(-1)
        assert float(rel.max()) == pytest.approx(e["max_rel"], rel=1e-5)
        assert float(rel.max()) < 0.01
        # round half to even, clamp: exactly torch.round(x / scale)
        assert torch.equal(q, torch.round(ref / (amax / 127)).clamp(-127, 127).to(torch.int8))


def test_cli_args(tmp_path, tiny_sd, capsys):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    p = argparse.ArgumentParser()
    cv.add_convert_args(p)
    args = p.parse_args(["--hf-ckpt-path", str(src), "--save-path", str(tmp_path / "out"), "--model-parallel", "2",
                         "--expert-dtype", "fp4", "--engram-dtype", "int8", "--no-progress"])
    assert cv.run_convert(args) == 0
    out = capsys.readouterr().out
    assert "mp=2" in out and "engram int8" in out
    assert (tmp_path / "out" / "model1-mp2.safetensors").exists()


# ---- bad inputs: one clear error, nothing left behind --------------------------------------

def test_mp_does_not_divide(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    with pytest.raises(cv.ConvertError, match=r"does not divide n_routed_experts = 8.*num_attention_heads = 4"):
        cv.convert(src, tmp_path / "out", 3, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_truncated_shard(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    shard = sorted(src.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(cv.ConvertError, match="truncated"):
        cv.convert(src, tmp_path / "out", 2, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_unwritable_destination(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(cv.ConvertError, match="cannot write.*not a directory"):
        cv.convert(src, blocker / "out", 2, progress=False)
    with pytest.raises(cv.ConvertError, match="cannot write.*does not exist"):
        cv.convert(src, tmp_path / "nope" / "out", 2, progress=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(cv.ConvertError, match="already exists"):
        cv.convert(src, tmp_path / "exists", 2, progress=False)


def test_unknown_tensor(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd, extra={"layers.0.attn.mystery.weight": torch.zeros(4)})
    with pytest.raises(cv.ConvertError, match=r"unknown tensor layers\.0\.attn\.mystery\.weight"):
        cv.convert(src, tmp_path / "out", 2, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_missing_and_misshapen(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    bad = dict(sd)
    del bad["norm.weight"]
    bad["head.weight"] = bad["head.weight"][:, :64].contiguous()
    src = make_source(tmp_path, cfg, bad)
    with pytest.raises(cv.ConvertError, match=r"(?s)head\.weight.*expects.*missing from the source.*norm\.weight"):
        cv.convert(src, tmp_path / "out", 2, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_index_lists_missing_tensor(tmp_path, tiny_sd):
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["layers.0.ghost"] = next(iter(idx["weight_map"].values()))
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(cv.ConvertError, match="not found in their files"):
        cv.convert(src, tmp_path / "out", 2, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("exc, expected", [(KeyboardInterrupt, KeyboardInterrupt),
                                           (OSError(28, "No space left on device"), cv.ConvertError)])
def test_failure_midway_leaves_nothing(tmp_path, tiny_sd, monkeypatch, exc, expected):
    """Ctrl-C propagates, a full disk becomes one ConvertError; neither leaves anything."""
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    real = cv.ShardWriter.write
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 200:
            raise exc
        return real(self, *a, **k)

    monkeypatch.setattr(cv.ShardWriter, "write", flaky)
    with pytest.raises(expected) as info:
        cv.convert(src, tmp_path / "out", 2, progress=False)
    if expected is cv.ConvertError:
        assert "No space left on device" in str(info.value) and "nothing was written" in str(info.value)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_small_chunks_same_result(tmp_path, tiny_sd):
    """Row chunking (here a few hundred bytes) must not change a single byte."""
    cfg, sd = tiny_sd
    src = make_source(tmp_path, cfg, sd)
    cv.convert(src, tmp_path / "a", 2, engram_dtype="int8", expert_dtype="fp8", progress=False)
    cv.convert(src, tmp_path / "b", 2, engram_dtype="int8", expert_dtype="fp8", progress=False, chunk_bytes=300)
    for r in range(2):
        a = (tmp_path / "a" / f"model{r}-mp2.safetensors").read_bytes()
        b = (tmp_path / "b" / f"model{r}-mp2.safetensors").read_bytes()
        assert a == b


def test_cli_make_checkpoint_then_convert(tmp_path):
    """The user path: `dsv41 make-checkpoint` then `dsv41 convert`, and a bad --model-parallel."""
    import subprocess
    import sys

    def dsv41(*args):
        return subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", *args], capture_output=True, text=True,
                              timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})

    src, dst = tmp_path / "tiny", tmp_path / "tiny-mp2"
    assert dsv41("make-checkpoint", "--preset", "tiny", "--out", str(src), "--seed", "3").returncode == 0
    p = dsv41("convert", "--hf-ckpt-path", str(src), "--save-path", str(dst), "--model-parallel", "2",
              "--no-progress")
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in dst.glob("*.safetensors")) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    bad = dsv41("convert", "--hf-ckpt-path", str(src), "--save-path", str(tmp_path / "x"), "--model-parallel", "3",
                "--no-progress")
    assert bad.returncode == 2 and "does not divide" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()
