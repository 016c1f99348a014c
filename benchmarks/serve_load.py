"""Throughput of a running `dsv41 serve` under concurrent streaming clients.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model tiny --clients 1,4,16

Each client streams one /v1/completions request of `--tokens` tokens (greedy, ignore_eos) for a
different random prompt of `--prompt-len` ids; all of a round's clients start together. Prints
one line per client count: generated tokens / wall seconds of the round, and the median time to
the first token. A warm-up request runs first. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def stream_one(url: str, model: str, prompt: list[int], n: int) -> tuple[int, float, list[int]]:
    """(tokens received, seconds to the first token, token ids) of one streaming request."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, ids = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                got = ch.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                ids += got
    return len(ids), first if first is not None else float("nan"), ids


def round_of(url: str, model: str, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(generated tokens per second, median time to first token) of all prompts at once."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        res = list(pool.map(lambda p: stream_one(url, model, p, n), prompts))
    wall = time.perf_counter() - t0
    return sum(r[0] for r in res) / wall, statistics.median(r[1] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-id", type=int, default=9, help="lowest prompt id (skip special tokens)")
    ap.add_argument("--last-id", type=int, default=499)
    a = ap.parse_args()
    rng = random.Random(a.seed)

    def prompt() -> list[int]:
        return [rng.randint(a.first_id, a.last_id) for _ in range(a.prompt_len)]

    stream_one(a.url, a.model, prompt(), 4)  # warm-up
    for c in (int(x) for x in a.clients.split(",")):
        tps, ttft = round_of(a.url, a.model, [prompt() for _ in range(c)], a.tokens)
        print(f"clients {c:3d}: {tps:7.1f} tok/s, median first token {ttft:.2f} s", flush=True)


if __name__ == "__main__":
    main()
