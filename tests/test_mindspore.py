"""`dsv41 import-mindspore`: MindSpore checkpoints written by mindspore itself (single file, and
2-rank slices merged through a parallel strategy file) imported bit-exactly; the dtype rule
(uint8 bytes for FP8 / E8M0, quantised floating masters); one clear error for unknown names and
for a missing mindspore. Tests needing mindspore skip without it (`nox -s mindspore` has it);
the missing-mindspore test runs everywhere (mindspore is blocked in its subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dsv41.core.weights import WeightError
from dsv41.deploy.checkpoint import make_checkpoint
from dsv41.deploy.mindspore_import import import_mindspore
from dsv41.deploy.names import native_to_hf
from safetensors import safe_open

PROMPT = "5,17,42,99,7,11"


@pytest.fixture(scope="module")
def ms():
    return pytest.importorskip("mindspore")


def read_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by stored name."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(bits(got[k]), bits(w)), k


def ms_tensor(ms, t: torch.Tensor):
    """A torch tensor as MindSpore holds it under the import's dtype rule: bf16 as bf16, FP8 /
    E8M0 as their uint8 bytes (MindSpore's CPU build cannot save float8), others as they are."""
    if t.dtype == torch.bfloat16:
        return ms.Tensor(t.view(torch.uint16).numpy()).view(ms.bfloat16)
    if t.dtype.is_floating_point and t.element_size() == 1:
        return ms.Tensor(t.view(torch.uint8).numpy())
    return ms.Tensor(t.numpy())


def save_ms(ms, sd: dict[str, torch.Tensor], path: Path) -> Path:
    ms.save_checkpoint([{"name": k, "data": ms_tensor(ms, t)} for k, t in sd.items()], str(path))
    return path


def hf_named(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {native_to_hf(k): t for k, t in sd.items()}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if name in p.name)


def dsv41(*args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, check=False)


@pytest.fixture(scope="module")
def native(tiny_cfg, fresh_seed, tmp_path_factory):
    """`make-checkpoint` of the tiny preset (fresh seed): config, tokenizer, storage dtypes."""
    d = make_checkpoint(tiny_cfg, tmp_path_factory.mktemp("native") / "tiny", seed=fresh_seed)
    sd = read_dir(d)
    dtypes = {t.dtype for t in sd.values()}
    # every storage format the rule must carry is present (else the test proves little)
    assert {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.bfloat16, torch.float32} <= dtypes
    return d, sd


@pytest.fixture(scope="module")
def imported(ms, native, tmp_path_factory):
    """A single MindSpore checkpoint of the native weights under Hugging Face names, plus
    optimizer state and a step counter, imported."""
    src_dir, sd = native
    tmp = tmp_path_factory.mktemp("ms")
    extra = {"adam_m.model.norm.weight": torch.zeros(4), "global_step": torch.tensor([7], dtype=torch.int32)}
    ckpt = save_ms(ms, {**hf_named(sd), **extra}, tmp / "hyperparallel.ckpt")
    rep = import_mindspore([ckpt], tmp / "out", config=src_dir / "config.json", tokenizer_path=src_dir)
    return tmp / "out", rep


def test_round_trip_bit_exact(native, imported):
    (_, sd), (out, rep) = native, imported
    assert_same(read_dir(out), sd)
    assert rep["skipped_training_state"] == 2 and rep["reinterpreted"] > 0 and rep["quantised"] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json"])


def test_run_on_imported_checkpoint(native, imported):
    """`dsv41 run --ckpt OUT` works and gives the source checkpoint's greedy tokens."""
    (src, _), (out, _) = native, imported
    runs = [dsv41("run", "--ckpt", str(d), "--prompt-ids", PROMPT, "--max-new-tokens", "6", "--ignore-eos", "--json")
            for d in (src, out)]
    for p in runs:
        assert p.returncode == 0, p.stderr
    a, b = (json.loads(p.stdout) for p in runs)
    assert len(b["token_ids"]) == 6 and b["token_ids"] == a["token_ids"]


def _split_plan(sd: dict[str, torch.Tensor]) -> dict[str, int | None]:
    """Split dim per tensor for 2 ranks: dim 0 or 1 where even, alternating; else replicated."""
    plan = {}
    for i, (k, t) in enumerate(sd.items()):
        dims = [d for d in range(min(t.dim(), 2)) if t.shape[d] % 2 == 0]
        plan[k] = dims[i % len(dims)] if dims else None
    return plan


def write_strategy(path: Path, tensor_maps: dict[str, list[int]]) -> Path:
    """A 2-device parallel strategy file in MindSpore's JSON form (`.json`) or its protobuf form
    (`node_strategy.proto`, what `strategy_ckpt_config` saves by default), built with
    MindSpore's own message classes. Device matrix [2]; tensor map entry 0 = split over it."""
    if path.suffix == ".json":
        layouts = {k: {"dev_matrix": [2], "tensor_map": tm, "param_split_shape": [], "indices_offset": [],
                       "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
                   for k, tm in tensor_maps.items()}
        path.write_text(json.dumps({"current_stage": 0, "parallel_layout_item": layouts,
                                    "parallel_strategy_item": {"Default/MatMul-op0": {"stage": 0}}}))
        return path
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    m = ParallelStrategyMap(current_stage=0)
    m.parallel_strategy_item.add(node_name="Default/MatMul-op0").parallel_strategys.stage = 0
    for k, tm in tensor_maps.items():
        lay = m.parallel_layout_item.add(param_name=k).parallel_layouts
        lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, 0  # required: no optimizer shard
        lay.dev_matrix.add().dim.extend([2])
        lay.tensor_map.add().dim.extend(tm)
        lay.param_split_shape.add()
        lay.indices_offset.add()
    path.write_bytes(m.SerializeToString())
    return path


@pytest.mark.parametrize("form", ["json", "protobuf"])
def test_two_rank_slices_merged_with_strategy(ms, native, tmp_path, form):
    """Per-rank slices + a parallel strategy file -> merged by mindspore.transform_checkpoints
    -> the same bits. (MindSpore cannot write a strategy file on CPU: semi-auto parallel
    compilation needs Ascend / GPU, so the file is written here in MindSpore's formats.)"""
    src_dir, sd = native
    hf = hf_named(sd)
    plan = _split_plan(hf)
    assert any(d == 0 for d in plan.values()) and any(d == 1 for d in plan.values())
    tensor_maps = {}
    for k, dim in plan.items():
        tensor_maps[k] = [-1] * hf[k].dim()
        if dim is not None:
            tensor_maps[k][dim] = 0  # split over device-matrix axis 0 (counted from the right)
    strategy = write_strategy(tmp_path / ("strategy.json" if form == "json" else "strategy.ckpt"), tensor_maps)
    ranks = []
    for r in range(2):
        part = {k: (t if plan[k] is None else t.chunk(2, plan[k])[r].contiguous()) for k, t in hf.items()}
        ranks.append(save_ms(ms, part, tmp_path / f"rank{r}.ckpt"))
    rep = import_mindspore(ranks, tmp_path / "out", config=src_dir, strategy=strategy)
    assert rep["merged_ranks"] == 2
    assert_same(read_dir(tmp_path / "out"), sd)
    with pytest.raises(ValueError, match="describes 2 ranks but 1"):
        import_mindspore(ranks[:1], tmp_path / "out1", config=src_dir, strategy=strategy)
    assert leftovers(tmp_path, "out1") == []


def test_parts_of_one_checkpoint(ms, native, tmp_path):
    """Without a strategy several files are parts of one checkpoint; a name in two is an error."""
    src_dir, sd = native
    hf = list(hf_named(sd).items())
    a = save_ms(ms, dict(hf[::2]), tmp_path / "a.ckpt")
    b = save_ms(ms, dict(hf[1::2]), tmp_path / "b.ckpt")
    import_mindspore([a, b], tmp_path / "out", config=src_dir)
    assert_same(read_dir(tmp_path / "out"), sd)
    c = save_ms(ms, dict(hf[:1]), tmp_path / "c.ckpt")
    with pytest.raises(WeightError, match="duplicate: " + hf[0][0].replace(".", r"\.")):
        import_mindspore([a, b, c], tmp_path / "dup", config=src_dir)
    assert leftovers(tmp_path, "dup") == []


def test_bf16_weight_config(ms, tiny_cfg, fresh_seed, tmp_path):
    """A config without quantization_config (bf16 dense linears, FP4 experts, FP8 Engram rows):
    bf16 masters are imported unchanged, bit for bit."""
    from dsv41.core.model import Transformer
    from dsv41.core.weights import random_state_dict

    cfg = tiny_cfg.replace(weight_dtype="bf16")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = random_state_dict(model, fresh_seed)
    assert sum(t.dtype == torch.bfloat16 and t.dim() == 2 and "layers" in k for k, t in sd.items()) > 10
    ckpt = save_ms(ms, hf_named(sd), tmp_path / "bf16.ckpt")
    import_mindspore([ckpt], tmp_path / "out")  # config.json beside the checkpoint
    assert_same(read_dir(tmp_path / "out"), sd)


def test_unknown_name_one_error_nothing_written(ms, native, tmp_path):
    src_dir, sd = native
    bad = "model.layers.0.self_attn.not_a_weight"
    ckpt = save_ms(ms, {**hf_named(sd), bad: torch.randn(3, 5)}, tmp_path / "bad.ckpt")
    with pytest.raises(WeightError) as e:
        import_mindspore([ckpt], tmp_path / "out", config=src_dir)
    assert f"unknown parameter name: {bad}" in str(e.value) and "[3, 5]" in str(e.value)
    assert leftovers(tmp_path, "out") == []
    p = dsv41("import-mindspore", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"), "--config", str(src_dir))
    assert p.returncode == 2 and f"unknown parameter name: {bad}" in p.stderr and "Traceback" not in p.stderr
    assert leftovers(tmp_path, "out") == []


def test_engram_gate_rows_per_stream(ms, native, imported, tmp_path):
    """Engram's q/k weights are [hc_mult, d] with a distinct row per stream, carried bit-exactly;
    one shared [d] row (the form before per-stream rows) is one clear shape error."""
    (src_dir, sd), (out, _) = native, imported
    got = read_dir(out)
    for leaf in ("q_weight", "k_weight"):
        w = got[f"layers.1.engram.{leaf}"]
        assert w.shape == (4, 128) and all(not torch.equal(w[i], w[j]) for i in range(4) for j in range(i))
    old = {**hf_named(sd), "model.layers.1.engram.q_weight": sd["layers.1.engram.q_weight"][0].clone()}
    ckpt = save_ms(ms, old, tmp_path / "old.ckpt")
    with pytest.raises(WeightError, match=r"wrong shape: layers.1.engram.q_weight is \[128\], expected \[4, 128\]"):
        import_mindspore([ckpt], tmp_path / "out", config=src_dir)
    assert leftovers(tmp_path, "out") == []


def test_floating_masters_quantised_on_request(ms, native, tiny_cfg, tmp_path, rng):
    """A training checkpoint's fp32 masters of FP8 / FP4 / Engram weights: a dtype error listing
    them without --quantize; with it, exactly the reference quantisers' output."""
    from dsv41.backends.reference import quant

    src_dir, sd = native
    masters, want = {}, dict(sd)
    for k in sd:
        if not k.endswith(".scale"):
            continue
        w = k[: -len("scale")] + "weight"
        n, kk = sd[w].shape[0], sd[w].shape[1] * (2 if sd[w].dtype == torch.int8 else 1)
        m = torch.randn(n, kk, generator=rng) / kk**0.5
        masters[w] = m
        q = (quant.fp8_quant(m) if w.endswith("engram.embed.weight") else
             quant.fp4_weight_quant(m) if sd[w].dtype == torch.int8 else quant.fp8_block_quant(m))
        want[w], want[k] = q
    kinds = {sd[w].dtype for w in masters}
    assert kinds == {torch.float8_e4m3fn, torch.int8} and any("engram" in w for w in masters)
    training = {k: t for k, t in sd.items() if k not in masters and not k.endswith(".scale")}
    training.update(masters)
    ckpt = save_ms(ms, hf_named(training), tmp_path / "masters.ckpt")
    with pytest.raises(WeightError, match="wrong dtype: .*is torch.float32, expected torch.float8_e4m3fn"):
        import_mindspore([ckpt], tmp_path / "plain", config=src_dir)
    rep = import_mindspore([ckpt], tmp_path / "out", config=src_dir, quantize=True)
    assert rep["quantised"] == len(masters)
    assert_same(read_dir(tmp_path / "out"), want)


def test_name_table(tiny_cfg):
    """Every native name survives Hugging Face naming plus MindSpore wrappers; training state is
    recognised (runs without mindspore: pure name logic)."""
    from dsv41.core.model import Transformer
    from dsv41.deploy.mindspore_import import ms_to_native

    with torch.device("meta"):
        names = list(Transformer(tiny_cfg).state_dict())
    for n in names:
        hf = native_to_hf(n)
        wrapped = hf.replace("layers.", "layers._checkpoint_wrapped_module.", 1)
        assert ms_to_native(hf) == ms_to_native("network._backbone." + hf) == ms_to_native(wrapped) == n
    for state in ("adam_m." + native_to_hf(names[0]), "global_step", "network.learning_rate"):
        assert ms_to_native(state) is None
    assert ms_to_native("model.layers.0.self_attn.bogus") == "layers.0.attn.bogus"  # kept: validation lists it


def test_missing_mindspore_one_line(tmp_path):
    """Without mindspore (blocked here, so this runs in every environment): one sentence with
    the pip line, exit 2, nothing written."""
    code = ("import sys; sys.modules['mindspore'] = None; from dsv41.deploy.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "import-mindspore", "--ckpt", "x.ckpt", "--out", str(tmp_path / "never")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error: ") and "pip install 'dsv41[mindspore]'" in lines[0]
    assert list(tmp_path.iterdir()) == []
