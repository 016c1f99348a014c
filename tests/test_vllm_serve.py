"""End-to-end: `dsv41 serve` (vLLM's OpenAI server with our plugin) on a tiny checkpoint.

Runs in the `vllm` nox session (vLLM's CPU build); skipped where vLLM is not installed. One
server serves the whole module (start-up takes about a minute) and is stopped at the end,
whatever happened. Expected tokens come from the reference engine (`dsv41 run --prefill-mode
exact`) on the same checkpoint.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm")

from _vllm import MAX_LEN, running_server, tiny_checkpoint
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.tokenizer import CHAT_TEMPLATE
from dsv41.deploy.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, fresh_seed):
    return tiny_checkpoint(tmp_path_factory, fresh_seed)


@pytest.fixture(scope="module")
def reference(ckpt):
    _, model, tok = load_checkpoint(ckpt)
    engine = Engine(model, prefill_mode="exact")

    def greedy(ids: list[int], n: int) -> list[int]:
        return engine.generate(ids, SamplingParams(max_new_tokens=n)).token_ids

    return greedy, tok


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with running_server(ckpt, tmp_path_factory.mktemp("log") / "server.log",
                        ["--additional-config", json.dumps({"dsv41": {"replay": "exact"}})]) as srv:
        yield srv


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
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    msg = plain["choices"][0]["message"]
    # the answer and the reasoning each arrive whole, in whichever order the parser splits them
    assert "".join(d.get("content") or "" for d in deltas) == (msg.get("content") or "")
    assert "".join(d.get("reasoning") or d.get("reasoning_content") or "" for d in deltas) == \
        (msg.get("reasoning") or msg.get("reasoning_content") or "")
    assert "Reasoning Effort" in CHAT_TEMPLATE


def test_structured_output_constrains_the_answer_with_thinking_off(server):
    """With thinking off the reasoning parser treats the output as the answer, so vLLM's
    structured outputs apply from the first token (and the tiny model's free text never would
    land on one of the choices by chance)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 8,
            "chat_template_kwargs": {"thinking": False}, "structured_outputs": {"choice": ["yes", "no"]}}
    status, out = server.request("/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] in ("yes", "no"), out


def test_concurrent_requests_do_not_cross_talk(server, rng):
    prompts = [_prompt(rng, n) for n in (7, 13, 18, 26)]
    alone = [_complete(server, p, 12)["token_ids"] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _complete(server, p, 12)["token_ids"], prompts))
    assert together == alone


def test_sixty_four_streaming_clients_each_get_their_tokens_alone(server, rng):
    """64 concurrent streaming clients with different prompts share vLLM's steps (one forward
    over all of them, in place on the pages); each one's tokens equal the same prompt served
    alone. (Throughput is measured by benchmarks/serve_load.py, not asserted here.)"""
    def streamed(ids):
        events = server.stream("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]

    prompts = [_prompt(rng, 5 + (7 * k) % 120) for k in range(64)]
    alone = [_complete(server, p, 12)["token_ids"] for p in prompts]
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == alone


def hit_grain(cfg, block_size: int, replay: int) -> int:
    """Prefix hits come in multiples of the largest of our layers' block sizes (their least
    common multiple: every block is the server's --block-size times a power of two)."""
    from dsv41.deploy.vllm.paged_cache import PagedCaches
    from torch import nn

    return max(PagedCaches(cfg, block_size, "t", replay, lambda r: nn.Module()).block_sizes.values())


def _prefix_hits(server) -> float:
    status, text = server.request("/metrics")
    assert status == 200
    m = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    assert m, "no prefix-cache metric"
    return sum(float(x) for x in m)


def test_prefix_cache_hit_with_exact_replay(server, reference, rng):
    greedy, _ = reference
    ids = _prompt(rng, 150)  # hit: 128 tokens (whole 64-token blocks) > replay (window 8 x 12 layers = 96)
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


def _metric(server, name: str) -> float:
    """Sum of a gauge over its label sets in vLLM's /metrics."""
    status, text = server.request("/metrics")
    assert status == 200
    m = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"no {name} metric"
    return sum(float(x) for x in m)


def _settled(server, baseline: float, timeout: float = 60.0) -> tuple[float, float]:
    """(KV cache usage, running requests) once back at `baseline` and 0, or at the timeout."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        usage, running = _metric(server, "vllm:kv_cache_usage_perc"), _metric(server, "vllm:num_requests_running")
        if (usage <= baseline and running == 0) or time.monotonic() > deadline:
            return usage, running
        time.sleep(0.5)


def test_faults_free_their_blocks_and_the_server_keeps_serving(server, reference, rng):
    """A client that disconnects mid-stream, a request whose client gives up (aborted), one over
    --max-model-len and malformed JSON: every block comes back (vLLM's KV usage returns to its
    idle value, nothing is left running) and the next request is still exact."""
    import socket
    import urllib.error
    import urllib.request

    greedy, _ = reference
    baseline, running = _settled(server, 0.0)
    assert running == 0
    # 1. a streaming client that reads a few tokens and hangs up
    body = {"model": "tiny", "prompt": _prompt(rng, 40), "max_tokens": MAX_LEN - 50, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = 0
        for line in r:
            events += line.startswith(b"data: ")
            if events == 3:
                break
        assert _metric(server, "vllm:kv_cache_usage_perc") > baseline  # the request holds blocks
    # 2. a non-streaming request whose client gives up before the answer (vLLM aborts it)
    body = {**body, "stream": False, "prompt": _prompt(rng, 30)}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises((socket.timeout, TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=1.0)
    # 3. over --max-model-len, and 4. malformed JSON
    status, _ = server.request("/v1/completions", {"model": "tiny", "prompt": _prompt(rng, MAX_LEN + 1), "max_tokens": 2})
    assert 400 <= status < 500
    status, _ = server.request("/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert 400 <= status < 500
    usage, running = _settled(server, baseline)
    assert usage <= baseline and running == 0, f"blocks not freed: usage {usage} (idle {baseline}), running {running}"
    ids = _prompt(rng, 9)
    assert _complete(server, ids, 8)["token_ids"] == greedy(ids, 8)


def _png_data_url(rng, w: int, h: int) -> tuple[str, bytes]:
    """A random RGB PNG (Pillow) as a data URL, and its bytes."""
    import base64
    import io

    from PIL import Image

    pixels = torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    raw = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(raw).decode(), raw


def _image_chat(url: str, text: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": text}]}]


def _chat_tokens(server, messages, n):
    status, body = server.request("/v1/chat/completions", {
        "model": "tiny", "messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert status == 200, body
    return body


def test_chat_with_image_equals_reference(server, ckpt, rng):
    from dsv41.core.messages import encode_messages

    cfg, model, tok = load_checkpoint(ckpt)
    engine = Engine(model, prefill_mode="exact")
    p = SamplingParams(max_new_tokens=12)

    def expected(messages):
        # the chat template renders content lists in place, so vLLM's prompt is `run --messages`'s
        return encode_messages(tok, cfg, messages)

    url, _ = _png_data_url(rng, 61, 45)
    msgs = _image_chat(url, "What is in this picture?")
    want = expected(msgs)
    assert want.image_tokens[0] > 4 and cfg.image_token_id in want.ids  # a real grid, not a 1-cell image
    got = _chat_tokens(server, msgs, 12)
    assert got["usage"]["prompt_tokens"] == len(want.ids)
    if got.get("prompt_token_ids") is not None:
        assert got["prompt_token_ids"] == want.ids
    ref = engine.generate(want.ids, p, images=want.images).token_ids
    assert got["choices"][0]["token_ids"] == ref
    blank = [torch.zeros_like(x) for x in want.images]  # same spans, other pixels
    assert engine.generate(want.ids, p, images=blank).token_ids != ref  # the image rows matter

    # two images of different sizes in one message: spans and rows in order
    url2, _ = _png_data_url(rng, 20, 90)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "image_url", "image_url": {"url": url2}},
                                         {"type": "text", "text": "Which one is taller?"}]}]
    want = expected(msgs)
    assert len(want.images) == 2 and want.image_tokens[0] != want.image_tokens[1]
    got = _chat_tokens(server, msgs, 12)
    assert got["usage"]["prompt_tokens"] == len(want.ids)
    assert got["choices"][0]["token_ids"] == engine.generate(want.ids, p, images=want.images).token_ids

    # Twice the same long prompt whose image span holds the second request's replay start (prefix
    # hit of H tokens, rewound by the replay length): a chunk that starts inside the span.
    replay = cfg.sliding_window * cfg.num_hidden_layers
    block = hit_grain(cfg, 8, replay)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds", "sing"]
    system = " ".join(words[int(k)] for k in torch.randint(0, len(words), (10,), generator=rng))
    text = "Describe it"
    for _ in range(400):
        msgs = _image_chat(url, text, system)
        want = expected(msgs)
        first = want.ids.index(cfg.image_token_id)
        start = (len(want.ids) - 1) // block * block - replay
        if first < start < first + want.image_tokens[0]:
            break
        text += " " + words[int(torch.randint(0, len(words), (1,), generator=rng))]
    else:
        pytest.fail("could not place the replay start inside the image span")
    assert len(want.ids) + 12 <= MAX_LEN
    ref = engine.generate(want.ids, p, images=want.images).token_ids
    before = _prefix_hits(server)
    one = _chat_tokens(server, msgs, 12)["choices"][0]["token_ids"]
    mid = _prefix_hits(server)
    two = _chat_tokens(server, msgs, 12)["choices"][0]["token_ids"]
    assert _prefix_hits(server) - mid >= replay, f"no prefix-cache hit ({before} -> {mid})"
    assert one == two == ref


def test_corrupt_image_is_400_and_server_survives(server, rng):
    import base64

    _, raw = _png_data_url(rng, 30, 30)
    truncated = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    not_image = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    for bad in (truncated, not_image):
        status, body = server.request("/v1/chat/completions", {
            "model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}},
                                                      {"type": "text", "text": "hi"}]}]})
        assert 400 <= status < 500 and "image" in json.dumps(body).lower(), (status, body)
    ids = _prompt(rng, 6)
    assert len(_complete(server, ids, 3)["token_ids"]) == 3  # still serving
