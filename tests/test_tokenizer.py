"""The tiny deterministic byte-level BPE, the chat template and tokenizer files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv41.core.config import preset
from dsv41.core.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    load_tokenizer,
    write_tokenizer_files,
)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_vocab_size_and_special_ids(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    ids = sorted(tok.get_vocab(with_added_tokens=True).values())
    assert ids == list(range(512))
    expected = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜dspark_noise｜>",
                "<｜image｜>", "<think>", "</think>", "<｜User｜>", "<｜Assistant｜>"]
    assert SPECIAL_TOKENS == expected
    for i, t in enumerate(expected):
        assert tok.token_to_id(t) == i
        assert tok.id_to_token(i) == t
    cfg = preset("tiny")
    assert tok.token_to_id("<｜▁pad▁｜>") == cfg.engram_pad_token_id
    assert tok.token_to_id("<｜image｜>") == cfg.image_token_id
    assert tok.token_to_id("<｜dspark_noise｜>") == cfg.dspark_noise_token_id
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == cfg.bos_token_id
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == cfg.eos_token_id


@pytest.mark.parametrize("text", [
    "Hello, world! The quick brown fox.",
    "  leading and trailing spaces  ",
    "tabs\tnew\nlines\r\n and unicode: héllo wörld 日本語 🎉",
    "",
])
def test_round_trip(tok, text):
    ids = tok.encode(text).ids
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text


def test_specials_encode_as_single_ids(tok):
    ids = tok.encode("<｜User｜>hi<｜Assistant｜><think>").ids
    assert ids[0] == 7 and ids[-2:] == [8, 5]
    assert tok.decode(ids, skip_special_tokens=False) == "<｜User｜>hi<｜Assistant｜><think>"


def test_deterministic_builds(tok):
    assert build_tiny_tokenizer().to_str() == tok.to_str()
    code = "from dsv41.core.tokenizer import build_tiny_tokenizer as b; import sys; sys.stdout.write(b().to_str())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == tok.to_str()


def test_write_and_reload(tok, tmp_path):
    out = tmp_path / "tk"
    write_tokenizer_files(tok, out, model_max_length=4096)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert cfg["eos_token"] == "<｜end▁of▁sentence｜>"
    assert cfg["pad_token"] == "<｜▁pad▁｜>"
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["model_max_length"] == 4096
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    for src in (out, out / "tokenizer.json"):
        t2 = load_tokenizer(src)
        assert t2.to_str() == tok.to_str()
        assert t2.encode("Hello there").ids == tok.encode("Hello there").ids
    # rewriting over existing files works (atomic replace)
    write_tokenizer_files(tok, out)
    assert load_tokenizer(out).get_vocab_size() == 512


def test_load_missing_names_path(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(missing)


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment()
    t = env.from_string(CHAT_TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    kw = dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    s = t.render(messages=msgs, add_generation_prompt=True, **kw)
    assert s == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
                 "<｜User｜>Bye<｜Assistant｜>")
    s2 = t.render(messages=msgs[1:2], add_generation_prompt=False, **kw)
    assert s2 == "<｜begin▁of▁sentence｜><｜User｜>Hi"
    s3 = t.render(messages=msgs[1:2], add_generation_prompt=True, thinking=True, **kw)
    assert s3.endswith("<｜Assistant｜><think>")


def test_chat_template_renders_tools_calls_and_results():
    """Tools go to the system prompt (heading, call format, one JSON schema per line); an
    assistant's tool calls render as one DSML calls block (strings as they are, other values
    as JSON); tool results are <tool_result> blocks of one user turn, a user message after them
    joining that turn."""
    import json

    from dsv41.core.messages import render_chat

    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "noon"}]},
            {"role": "user", "content": "Thanks"}]
    s = render_chat(msgs, "<B>", "<E>", tools=[{"type": "function", "function": fn}], thinking=False)
    head, _, rest = s.partition("<｜User｜>")
    assert head.startswith("<B>Be brief.\n\n## Tools\n\n") and json.dumps(fn, sort_keys=True) in head
    assert rest == ("Paris?<｜Assistant｜>\n\n<｜DSML｜ calls>\n"
                    '<｜DSML｜ invoke name="get_weather">\n'
                    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
                    '<｜DSML｜ parameter name="days" string="false">[1, 2]</｜DSML｜ parameter>\n'
                    "</｜DSML｜ invoke>\n"
                    '<｜DSML｜ invoke name="get_time">\n\n'
                    "</｜DSML｜ invoke>\n</｜DSML｜ calls><E>"
                    "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>\n\nThanks"
                    "<｜Assistant｜></think>")
    assert "## Tools" not in render_chat(msgs[:2], "<B>", "<E>")


def test_messages_with_tools_calls_and_results(tok, tiny_cfg):
    """`run --messages` takes a request body with `tools`, assistant `tool_calls` (OpenAI's JSON
    string arguments) and `tool` results: its ids are the template's rendering with the
    arguments parsed, as vLLM's server renders them; malformed tool input is one clear error."""
    from dsv41.core.messages import MessagesError, encode_messages, render_chat

    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    body = {"tools": [{"type": "function", "function": fn}], "messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"}]}
    ids = encode_messages(tok, tiny_cfg, body).ids
    parsed = [dict(body["messages"][0]),
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "sunny"}]
    bos, eos = tok.id_to_token(tiny_cfg.bos_token_id), tok.id_to_token(tiny_cfg.eos_token_id)
    text = render_chat(parsed, bos, eos, tools=body["tools"])
    assert "## Tools" in text and "<tool_result>sunny</tool_result>" in text and 'name="city"' in text
    assert ids == tok.encode(text, add_special_tokens=False).ids
    bad = [({"tools": [{"type": "function"}], "messages": body["messages"][:1]}, "tool 0"),
           ({"messages": [body["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
               {"function": {"name": "f", "arguments": "{oops"}}]}]}, "not valid JSON"),
           ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant")]
    for case, needle in bad:
        with pytest.raises(MessagesError, match=needle):
            encode_messages(tok, tiny_cfg, case)
