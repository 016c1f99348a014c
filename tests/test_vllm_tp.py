"""`dsv41 serve --tensor-parallel-size 2` on CPU: our model-parallel group backed by vLLM's
tensor-parallel group gives the reference engine's greedy tokens (vLLM CPU build only), with
each rank's piece of the Engram tables offloaded to host memory (`engram_offload`)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from _vllm import running_server
from dsv41.core.config import preset
from dsv41.core.engine import Engine, SamplingParams
from dsv41.deploy.checkpoint import load_checkpoint, make_checkpoint


def test_tensor_parallel_2_equals_reference(tmp_path, fresh_seed, rng):
    ckpt = tmp_path / "tiny"
    make_checkpoint(preset("tiny"), ckpt, seed=fresh_seed)
    engine = Engine(load_checkpoint(ckpt)[1], prefill_mode="exact")
    prompts = [[int(x) for x in torch.randint(9, 500, (n,), generator=rng)] for n in (7, 20)]
    # two CPU workers: bind one OpenMP thread each (vLLM refuses to guess with one NUMA node)
    flags = ["--tensor-parallel-size", "2", "--additional-config", json.dumps({"dsv41": {"engram_offload": True}})]
    with running_server(ckpt, tmp_path / "server.log", flags, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as srv:
        with open(srv.log_path) as f:
            log = f.read()
        assert "world_size=2" in log  # vLLM really started two TP workers
        assert log.count("dsv41: Engram tables in host memory") == 2  # one per rank
        for ids in prompts:
            status, body = srv.request("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 10,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "return_token_ids": True})
            assert status == 200, body
            want = engine.generate(ids, SamplingParams(max_new_tokens=10)).token_ids
            assert body["choices"][0]["token_ids"] == want
