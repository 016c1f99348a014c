"""End-to-end: `dsv41 serve` (vLLM's OpenAI server with our plugin) on a tiny checkpoint.

Runs in the `vllm` nox session (vLLM's CPU build); skipped where vLLM is not installed. One
server serves the whole module (start-up takes about a minute) and is stopped at the end,
whatever happened. Expected tokens come from the reference engine (`dsv41 run --prefill-mode
exact`) on the same checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm")

from dsv41.core.config import preset  # noqa: E402
from dsv41.core.engine import Engine, SamplingParams  # noqa: E402
from dsv41.core.tokenizer import CHAT_TEMPLATE  # noqa: E402
from dsv41.deploy.checkpoint import load_checkpoint, make_checkpoint  # noqa: E402

MAX_LEN = 256
STARTUP_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str, proc: subprocess.Popen, log_path: str):
        self.base, self.proc, self.log_path = base, proc, log_path

    def request(self, path: str, body: dict | bytes | None = None, timeout: float = 120):
        """(status, parsed JSON or text) of a GET (body None) or POST."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw, status = r.read().decode(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read().decode(), e.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def stream(self, path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(self.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, fresh_seed):
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(preset("tiny"), d, seed=fresh_seed)
    return d


@pytest.fixture(scope="module")
def reference(ckpt):
    _, model, tok = load_checkpoint(ckpt)
    engine = Engine(model, prefill_mode="exact")

    def greedy(ids: list[int], n: int) -> list[int]:
        return engine.generate(ids, SamplingParams(max_new_tokens=n)).token_ids

    return greedy, tok


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    port = _free_port()
    log_path = str(tmp_path_factory.mktemp("log") / "server.log")
    cmd = [sys.executable, "-m", "dsv41.deploy.cli", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--block-size", "8", "--max-model-len", str(MAX_LEN), "--enable-prefix-caching",
           "--gpu-memory-utilization", "0.2", "--served-model-name", "tiny",
           "--additional-config", json.dumps({"dsv41": {"replay": "exact"}})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode}:\n{srv.log_tail()}")
            try:
                if srv.request("/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy after {STARTUP_S} s:\n{srv.log_tail()}")
            time.sleep(2)
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _prompt(rng, n: int) -> list[int]:
    return [int(x) for x in torch.randint(9, 500, (n,), generator=rng)]  # ids 0..8 are special


def _complete(server, ids, n, **extra):
    status, body = server.request("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": n,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]


def test_health_and_models(server):
    assert server.request("/health")[0] == 200
    status, body = server.request("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]


def test_greedy_tokens_equal_reference(server, reference, rng):
    greedy, _ = reference
    for n_prompt in (5, 23):  # one ring wrap and odd lengths (compressor carry across steps)
        ids = _prompt(rng, n_prompt)
        got = _complete(server, ids, 16)["token_ids"]
        assert got == greedy(ids, 16), f"prompt {ids}"


def test_streaming_matches_non_streaming(server, rng):
    ids = _prompt(rng, 11)
    whole = _complete(server, ids, 10)
    events = server.stream("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 10,
                                               "temperature": 0, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole["text"]


def test_chat_completions_and_reasoning_effort(server, reference):
    _, tok = reference
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0}
    status, plain = server.request("/v1/chat/completions", body)
    assert status == 200, plain
    status, effort = server.request("/v1/chat/completions", {**body, "chat_template_kwargs": {"reasoning_effort": 37}})
    assert status == 200, effort
    # the template's system line "Reasoning Effort: 37" reached the prompt
    extra = len(tok.encode("Reasoning Effort: 37").ids)
    assert effort["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + extra
    events = server.stream("/v1/chat/completions", body)
    streamed = "".join((e["choices"][0]["delta"].get("content") or "") + (e["choices"][0]["delta"].get("reasoning") or
                                                                          e["choices"][0]["delta"].get("reasoning_content") or "")
                       for e in events if e["choices"])
    msg = plain["choices"][0]["message"]
    assert streamed == (msg.get("content") or "") + (msg.get("reasoning") or msg.get("reasoning_content") or "")
    assert "Reasoning Effort" in CHAT_TEMPLATE


def test_concurrent_requests_do_not_cross_talk(server, rng):
    prompts = [_prompt(rng, n) for n in (7, 13, 18, 26)]
    alone = [_complete(server, p, 12)["token_ids"] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _complete(server, p, 12)["token_ids"], prompts))
    assert together == alone


def _prefix_hits(server) -> float:
    status, text = server.request("/metrics")
    assert status == 200
    m = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "no prefix-cache metric"
    return sum(float(x) for x in m)


def test_prefix_cache_hit_with_exact_replay(server, reference, rng):
    greedy, _ = reference
    ids = _prompt(rng, 150)  # > replay (window 8 x 12 layers = 96) + a block
    before = _prefix_hits(server)
    first = _complete(server, ids, 10)["token_ids"]
    mid = _prefix_hits(server)
    second = _complete(server, ids, 10)["token_ids"]
    after = _prefix_hits(server)
    assert after - mid >= 96, f"no prefix-cache hit on the second request ({before} -> {mid} -> {after})"
    assert second == first == greedy(ids, 10)


def test_bad_requests_are_400_and_server_survives(server, rng):
    status, body = server.request("/v1/completions", {"model": "tiny", "prompt": _prompt(rng, MAX_LEN + 10),
                                                      "max_tokens": 4})
    text = json.dumps(body).lower()
    assert 400 <= status < 500 and ("context" in text or "length" in text), body
    status, body = server.request("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"reasoning_effort": 500}})
    assert 400 <= status < 500 and "reasoning_effort" in json.dumps(body), body
    status, body = server.request("/v1/completions", b"{not json")
    assert 400 <= status < 500, body
    ids = _prompt(rng, 6)
    assert len(_complete(server, ids, 3)["token_ids"]) == 3  # still serving
