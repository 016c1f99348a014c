"""Model-parallel execution: make-checkpoint -> convert --model-parallel 2 -> 2 ranks (torchrun
with gloo, and in-process threads) give the one-process run's greedy tokens and logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from _util import rand_prompt
from dsv41.backends import ops
from dsv41.core.engine import SingleSequence
from dsv41.core.config import preset
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.engram import build_compression_map
from dsv41.core.parallel import SINGLE, Group
from dsv41.core.weights import WeightError, build_model
from dsv41.deploy.checkpoint import (
    load_checkpoint,
    load_checkpoint_weights,
    make_checkpoint,
    read_config,
)
from dsv41.deploy.cli import main
from dsv41.deploy.convert import convert

MP = 2

pytestmark = pytest.mark.slow  # every test starts 2-rank process groups


class ThreadGroup(Group):
    """N ranks as threads of one process (same rank-order sums as a 2-rank gloo all-reduce)."""

    def __init__(self, rank: int, world: int, shared: dict):
        self.rank, self.world_size, self.shared = rank, world, shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self.rank] = x
        self.shared["barrier"].wait()
        parts = list(self.shared["slots"])
        self.shared["barrier"].wait()  # every rank has read before the next exchange overwrites
        return parts

    def all_reduce_sum(self, x):
        parts = self._exchange(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, x, dim=-1):
        return torch.cat(self._exchange(x), dim)


def thread_groups(world: int) -> list[ThreadGroup]:
    shared = {"barrier": threading.Barrier(world, timeout=120), "slots": [None] * world}
    return [ThreadGroup(r, world, shared) for r in range(world)]


def run_ranks(fn, models) -> list:
    """fn(model) on every rank's model concurrently; the results in rank order."""
    out, errs = [None] * len(models), []

    def work(r):
        try:
            out[r] = fn(models[r])
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errs.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, fresh_seed):
    """(seed, A = make-checkpoint tiny, B = convert A --model-parallel 2)."""
    root = tmp_path_factory.mktemp("mp")
    make_checkpoint(preset("tiny"), root / "A", seed=fresh_seed)
    convert(root / "A", root / "B", MP, expert_dtype="fp4", progress=False)
    return fresh_seed, root / "A", root / "B"


def all_logits(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Logits of every position: exact prefill of ids[:n_prefill], then one-token decode steps."""
    cache = SingleSequence(model)
    out = [cache.feed(ids[:n_prefill], all_logits=True)]
    for k in range(n_prefill, ids.numel()):
        out.append(cache.feed(ids[k:k + 1], all_logits=True))
    return torch.cat(out)


def test_torchrun_two_ranks_equal_single_process(ckpts, rng):
    """The CI acceptance run: torchrun --nproc-per-node 2 (gloo) on the mp2 shards gives the
    greedy tokens of `dsv41 run --ckpt A` and of the random-weight run the checkpoint holds."""
    seed, a, b = ckpts
    cfg = preset("tiny")
    prompt = [cfg.bos_token_id] + rand_prompt(cfg, 14, rng).tolist()  # > window: CED prefill path
    params = SamplingParams(max_new_tokens=4)
    _, m1, tok = load_checkpoint(a)
    want = Engine(m1).generate(prompt, params).token_ids
    random = build_model(cfg, seed=seed)  # what `dsv41 run --preset tiny --seed S` runs
    random.set_engram_vocab(*build_compression_map(tok, vocab_size=cfg.vocab_size, pad_token_id=cfg.engram_pad_token_id))
    assert Engine(random).generate(prompt, params).token_ids == want

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={MP}",
           "-m", "dsv41.deploy.cli", "run", "--ckpt", str(b), "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", "4", "--ignore-eos", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, res.stdout  # only rank 0 prints
    out = json.loads(lines[0])
    print(f"\n[dsv41] mp1 tokens {want}, torchrun mp2 tokens {out['token_ids']}")
    assert out["model_parallel"] == MP
    assert out["token_ids"] == want


def test_sharded_logits_equal_single_process(ckpts, rng):
    """Every position's logits (exact prefill + decode steps) of 2 ranks (threads, rank-order
    sums like gloo) against one process: partial sums are combined before the one rounding, so
    they agree up to fp64 rounding (observed: bit-identical)."""
    _, a, b = ckpts
    cfg = read_config(b)
    _, m1, tok = load_checkpoint(a)
    ranks = [load_checkpoint_weights(b, cfg, "cpu", tok, g) for g in thread_groups(MP)]
    ids = rand_prompt(cfg, 26, rng)
    want = all_logits(m1, ids, 20)
    got = run_ranks(lambda m: all_logits(m, ids, 20), ranks)
    scale = want.abs().max().item()
    for r, g in enumerate(got):
        diff = (g - want).abs().max().item()
        print(f"\n[dsv41] rank {r}: max |logit mp2 - mp1| = {diff:.3e} (max |logit| {scale:.3f})")
        assert torch.equal(g.argmax(-1), want.argmax(-1))
        assert diff <= 1e-6 * scale


def test_shard_shapes_follow_convert(ckpts):
    """The rank-r model expects exactly the shapes convert wrote (vocabulary, heads, groups,
    expert ranges under global ids, Engram pieces of ceil(rows / N))."""
    _, _, b = ckpts
    cfg = read_config(b)
    g = thread_groups(MP)[1]
    m = load_checkpoint_weights(b, cfg, "cpu", None, g)
    sd = m.state_dict()
    assert sd["embed.weight"].shape[0] == cfg.vocab_size // MP
    assert sd["layers.2.attn.wq_b.weight"].shape[0] == cfg.num_attention_heads * cfg.head_dim // MP
    assert sd["layers.2.attn.wo_b.weight"].shape[1] == cfg.o_groups * cfg.o_lora_rank // MP
    experts = {int(k.split(".")[4]) for k in sd if k.startswith("layers.0.ffn.experts.")}
    assert experts == set(range(cfg.n_routed_experts // MP, cfg.n_routed_experts))
    rows = cfg.engram_num_embeddings[0]
    c = -(-rows // MP)
    assert sd[f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"].shape[0] == rows - c


def test_world_size_mismatch_is_one_error(ckpts, tmp_path, capsys):
    _, a, b = ckpts
    assert main(["run", "--ckpt", str(b), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "split for 2-way model parallelism" in err[0] and "--nproc-per-node 2" in err[0]
    cfg = read_config(a)
    with pytest.raises(WeightError, match="not split for model parallelism"):
        load_checkpoint_weights(a, cfg, "cpu", None, thread_groups(2)[0])
    with pytest.raises(WeightError, match="split for 2-way .* has 3 processes"):
        load_checkpoint_weights(b, cfg, "cpu", None, thread_groups(3)[0])
    partial = tmp_path / "partial"
    shutil.copytree(b, partial)
    (partial / "model1-mp2.safetensors").unlink()
    with pytest.raises(WeightError, match=r"shard\(s\) missing: model1-mp2.safetensors"):
        load_checkpoint_weights(partial, cfg, "cpu", None, thread_groups(2)[0])


def test_group_ranges():
    assert (SINGLE.all_reduce_sum(t := torch.ones(3)) is t) and SINGLE.all_gather(t) is t
    g = thread_groups(3)
    assert [x.ceil_range(10) for x in g] == [(0, 4), (4, 8), (8, 10)]
    assert [x.ceil_range(4) for x in g] == [(0, 2), (2, 4), (4, 4)]  # the last piece may be empty
    assert [x.even_range(6) for x in g] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="does not divide into 3"):
        g[0].split(8, "n_routed_experts")


def test_engram_int8_checkpoint(ckpts, tmp_path, rng):
    """`convert --engram-dtype int8` loads (one process and 2 ranks): INT8 rows + per-row scale,
    dequantised by `ops.engram_lookup` within int8 rounding of the FP8 rows; the sharded INT8
    run, each rank's row piece offloaded to host memory (the Ascend layout), equals the
    one-process INT8 run."""
    _, a, _ = ckpts
    c1, c2 = tmp_path / "i8mp1", tmp_path / "i8mp2"
    convert(a, c1, 1, engram_dtype="int8", progress=False)
    convert(a, c2, MP, engram_dtype="int8", progress=False)
    cfg8, m8, tok = load_checkpoint(c1)
    assert cfg8.engram_dtype == "int8"
    _, m1, _ = load_checkpoint(a)
    layer = cfg8.engram_layer_ids[0]
    e8, e1 = m8.layers[layer].engram.embed, m1.layers[layer].engram.embed
    assert e8.weight.dtype == torch.int8 and e8.scale.shape == (e8.weight.shape[0], 1)
    rows = torch.randint(0, e1.weight.shape[0], (16, 6), generator=rng)
    got = ops.engram_lookup(e8.weight, e8.scale, rows).float()
    want = ops.engram_lookup(e1.weight, e1.scale, rows).float()
    amax = want.view(16, 6, -1).abs().amax(-1, keepdim=True)
    rel = ((got - want).view(16, 6, -1).abs() / amax).max().item()
    print(f"\n[dsv41] Engram INT8 vs FP8 lookup: max error {rel:.2e} of the row amax")
    assert 0 < rel <= 0.5 / 127 + 2 ** -8  # half an int8 step + bf16 rounding of the output

    ids = rand_prompt(cfg8, 12, rng)
    want8 = all_logits(m8, ids, 10)
    ref = all_logits(m1, ids, 10)
    print(f"[dsv41] logits INT8 vs FP8 Engram: max diff {(want8 - ref).abs().max().item():.3e} "
          f"(max |logit| {ref.abs().max().item():.3f})")
    ranks = [load_checkpoint_weights(c2, read_config(c2), "cpu", tok, g, engram_offload=True)
             for g in thread_groups(MP)]
    assert all(m.layers[layer].engram.embed.offloaded for m in ranks)
    for g in run_ranks(lambda m: all_logits(m, ids, 10), ranks):
        assert (g - want8).abs().max().item() <= 1e-6 * want8.abs().max().item()
