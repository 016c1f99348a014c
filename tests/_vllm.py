"""Starting and talking to `dsv41 serve` (vLLM's OpenAI server with our plugin) in tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

MAX_LEN = 256
STARTUP_S = 600


def tiny_checkpoint(tmp_path_factory, seed: int) -> Path:
    """A fresh tiny checkpoint (random weights of `seed`) in its own temporary directory."""
    from dsv41.core.config import preset
    from dsv41.deploy.checkpoint import make_checkpoint

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(preset("tiny"), d, seed=seed)
    return d


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


@contextlib.contextmanager
def running_server(ckpt: Path, log_path: Path, flags: list[str], env: dict | None = None, test_defaults: bool = True):
    """`dsv41 serve ckpt` on a free local port (with `test_defaults`, the tests' flags and a
    1 GiB KV space; else only `flags`), healthy on entry and stopped (its whole process group)
    on exit, whatever happened."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dsv41.deploy.cli", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
    if test_defaults:
        cmd += ["--enforce-eager", "--block-size", "8", "--max-model-len", str(MAX_LEN), "--enable-prefix-caching",
                "--gpu-memory-utilization", "0.2", "--served-model-name", "tiny"]
    cmd += flags
    env = {**os.environ, **({"VLLM_CPU_KVCACHE_SPACE": "1"} if test_defaults else {}), **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None in `env`: unset
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, str(log_path))
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode}:\n{srv.log_tail()}")
            with contextlib.suppress(OSError):
                if srv.request("/health", timeout=5)[0] == 200:
                    break
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
