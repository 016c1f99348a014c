"""`dsv41 serve MODEL_DIR` with no extra flags, driven through the `openai` client: it starts
(block size, KV space and tool parser chosen for it), renders tools, tool calls and tool results
through the checkpoint's chat template, and hands a tool call in the model's output back as
`tool_calls`, streaming and not.

The tiny random model never writes a tool call by itself, so the output is forced with vLLM's
structured outputs (a one-choice constraint holding the DSML text; thinking off, so the
constraint applies from the first token): what comes back is then vLLM's tool-call parser
reading that text, as it reads a real model's. Runs in the `vllm` nox session.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from _vllm import running_server, tiny_checkpoint
from dsv41.core.tokenizer import INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN
from dsv41.deploy.checkpoint import load_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city over the next days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL_TEXT = (f"\n\n{TOOL_CALLS_OPEN}\n{INVOKE_OPEN}\"get_weather\">\n"
             f"{PARAM_OPEN}\"city\" string=\"true\">Paris{PARAM_CLOSE}\n"
             f"{PARAM_OPEN}\"days\" string=\"false\">2{PARAM_CLOSE}\n{INVOKE_CLOSE}\n{TOOL_CALLS_CLOSE}")
FORCE_CALL = {"chat_template_kwargs": {"thinking": False}, "structured_outputs": {"choice": [CALL_TEXT]}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, fresh_seed):
    return tiny_checkpoint(tmp_path_factory, fresh_seed)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with running_server(ckpt, log, [], env={"VLLM_CPU_KVCACHE_SPACE": None}, test_defaults=False) as srv:
        srv.log = log
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def test_starts_with_no_extra_flags(server, client, model_name):
    """No --block-size, KV space, --enforce-eager or --max-model-len: the server picked a block
    size that fits the page layout and a KV space that fits the model, and answers."""
    out = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    log = server.log.read_text(errors="replace")
    assert "'block_size': 8" in log and "'tool_call_parser': 'deepseek_v41'" in log
    assert "Explicitly set (2.0/" in log  # VLLM_CPU_KVCACHE_SPACE=2: what 128 x 2048 tokens take


def _prompt_text(ckpt, ids: list[int]) -> str:
    _, _, tok = load_checkpoint(ckpt)
    return tok.decode(ids, skip_special_tokens=False)


def test_tools_history_and_results_are_rendered(client, model_name, ckpt):
    """The tools' schemas, an earlier assistant tool call and its results reach the prompt in
    the DSML / tool_result form the template defines."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    plain = client.chat.completions.create(model=model_name, messages=messages[:2], max_tokens=1,
                                           extra_body={"return_token_ids": True})
    out = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER], max_tokens=1,
                                         extra_body={"return_token_ids": True})
    assert "## Tools" not in _prompt_text(ckpt, plain.prompt_token_ids)
    text = _prompt_text(ckpt, out.prompt_token_ids)
    assert "## Tools" in text and json.dumps(WEATHER["function"], ensure_ascii=False) in text
    assert (f"{INVOKE_OPEN}\"get_weather\">\n{PARAM_OPEN}\"city\" string=\"true\">Paris{PARAM_CLOSE}\n"
            f"{PARAM_OPEN}\"days\" string=\"false\">2{PARAM_CLOSE}\n{INVOKE_CLOSE}") in text
    assert "<tool_result>sunny, 21 C</tool_result>\n\nAnd tomorrow?<｜Assistant｜>" in text


def test_tool_call_in_the_output_comes_back_as_tool_calls(client, model_name):
    msgs = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
    out = client.chat.completions.create(model=model_name, messages=msgs, tools=[WEATHER], max_tokens=400,
                                         temperature=0, extra_body=FORCE_CALL)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    stream = client.chat.completions.create(model=model_name, messages=msgs, tools=[WEATHER], max_tokens=400,
                                            temperature=0, extra_body=FORCE_CALL, stream=True)
    names, args, content, finish = [], "", "", None
    for event in stream:
        for ch in event.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.function.name:
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris", "days": 2}
    assert not content.strip() and finish == "tool_calls"

