"""The `dsv41` command line, run as a user would (a subprocess through the console script's
module), including its one-line errors."""

import json
import subprocess
import sys

import pytest
import torch

from dsv41.core.config import ModelConfig


def dsv41(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", *args], capture_output=True, text=True,
                       timeout=300)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_run_tiny_json():
    out = json.loads(dsv41("run", "--preset", "tiny", "--prompt-ids", "5,17,42", "--max-new-tokens", "4",
                           "--ignore-eos", "--json").stdout)
    for key in ("token_ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert key in out
    assert len(out["token_ids"]) == 4 and all(0 <= t < 512 for t in out["token_ids"])
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_run_text_prompt_prints_rates():
    p = dsv41("run", "--prompt", "Hello there", "--max-new-tokens", "3", "--ignore-eos")
    assert "generated ids" in p.stdout and "tokens/s" in p.stdout
    # random weights say so, in one line, and nothing else goes to stderr
    note = "dsv41: note: random weights (seed 0; no --ckpt): the generated text is meaningless"
    assert p.stderr.strip().splitlines() == [note]


def test_info_published_config(tmp_path):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(ModelConfig().to_hf_dict()))
    info = json.loads(dsv41("info", "--config", str(cfg_file), "--json").stdout)
    assert info["kv_bytes_per_token"] == 890
    params = info["params"]
    for k in ("backbone", "engram", "dspark", "vision", "activated_prefill", "activated_decode"):
        assert k in params
    assert 540e9 < params["backbone"] < 560e9 and 190e9 < params["engram"] < 200e9
    assert "swa_bytes_per_sequence" in info


@pytest.mark.parametrize("args, message", [
    (["run", "--prompt-ids", "5,100000"], "outside the vocabulary"),
    (["run", "--prompt-ids", "a,b"], "comma-separated integers"),
    (["run", "--ckpt", "."], "no config.json"),
    pytest.param(["run", "--device", "cuda"], "no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the machine has a CUDA device")),
    (["run", "--max-new-tokens", "0"], "max_new_tokens"),
    (["run", "--prompt-ids", "5", "--max-new-tokens", "5000"], "max_position_embeddings"),
    (["info", "--config", "missing.json"], "no such config file"),
])
def test_errors_are_one_clear_line(args, message, tmp_path):
    if "--ckpt" in args:
        args = ["run", "--ckpt", str(tmp_path)]
    p = dsv41(*args, check=False)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bad_config_lists_the_problem(tmp_path):
    d = ModelConfig().to_hf_dict()
    d["text_config"]["compress_ratios"] = [0, 2]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(d))
    p = dsv41("info", "--config", str(f), check=False)
    assert p.returncode == 2 and "compress_ratios has 2 entries" in p.stderr


def test_backends_lists_every_op():
    p = dsv41("backends")
    assert "reference: available" in p.stdout
    for op in ("sparse_attention", "indexer_topk", "mhc_mixes", "engram_lookup", "moe_route"):
        assert op in p.stdout


def test_model_parallel_failure_is_one_line(tmp_path):
    """`run --nproc-per-node 2` (torchrun's launcher in-process): a rank's error is the whole
    report, without torchrun's traceback and log lines after it."""
    p = dsv41("run", "--nproc-per-node", "2", "--prompt-ids", "5,100000", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "dsv41: error: --prompt-ids: token id 100000 is outside the vocabulary [0, 512)"]


def test_sigterm_mid_write_leaves_nothing(tmp_path):
    """SIGTERM while the second shard is written (here sent by the writer itself, to hit that
    moment): status 143 and no temporary folder, lock or destination left."""
    code = ("import os, signal, sys; from dsv41.deploy import cli, convert as conv; real = conv.ShardWriter._write_all\n"
            "def w(self, data, pos):\n"
            "    if self.path.name.startswith('model-00002'): os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return real(self, data, pos)\n"
            "conv.ShardWriter._write_all = w\n"
            f"sys.exit(cli.main(['make-checkpoint', '--out', {str(tmp_path / 'ck')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 143, p.stderr
    assert "Traceback" not in p.stderr and list(tmp_path.iterdir()) == []


def test_warm_up_run_leaves_the_timed_run_unchanged(tiny_model, tiny_cfg, rng):
    """`run`'s device warm-up (the same prompt, at most two new tokens, before the timed run)
    leaves the engine empty and the timed run's tokens as a fresh engine gives them, sampled
    with a seed included."""
    from _util import rand_prompt

    from dsv41.core.engine import Engine, SamplingParams
    from dsv41.core.parallel import SINGLE
    from dsv41.deploy.cli import _warm_up

    prompt = rand_prompt(tiny_cfg, 9, rng).tolist()
    for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)):
        want = Engine(tiny_model, prefill_mode="exact").generate(prompt, params).token_ids
        engine = Engine(tiny_model, prefill_mode="exact")
        assert _warm_up(engine, prompt, params, [], None, SINGLE) > 0
        assert not engine.running and not engine.waiting
        assert engine.pool.free_global_blocks == engine.pool.global_capacity - 1
        assert engine.generate(prompt, params).token_ids == want


def test_random_weight_note_points_large_models_to_make_checkpoint(capsys):
    """Random weights beyond the tiny preset take minutes to draw: the note names the
    `make-checkpoint` command that writes the same weights once (same preset and seed); the tiny
    preset's note stays one plain sentence."""
    from dsv41.core.parallel import SINGLE
    from dsv41.deploy.cli import _first_contact_notes, build_parser

    parser = build_parser()
    _first_contact_notes(parser.parse_args(["run", "--preset", "mini", "--seed", "7"]), object(), SINGLE)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "`dsv41 make-checkpoint --preset mini --seed 7 --out DIR`" in note[0]
    _first_contact_notes(parser.parse_args(["run"]), object(), SINGLE)
    assert "make-checkpoint" not in capsys.readouterr().err
