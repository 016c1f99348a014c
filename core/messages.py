"""OpenAI-style chat messages (text and images) -> prompt token ids + preprocessed images.

Accepted input: a list of `{"role": "system" | "user" | "assistant" | "tool", "content": ...}` (or
an object with such a list under "messages" and optionally OpenAI `tools`, as in a request body).
An assistant message may carry OpenAI `tool_calls` (`arguments` as a JSON string or an object);
`tool` messages are tool results. Both render in DeepSeek-V4.1's DSML form (`tokenizer.CHAT_TEMPLATE`). `content` is a string or a list
of parts `{"type": "text", "text": ...}` / `{"type": "image_url", "image_url": {"url": ...}}`
(`image_url` may also be the URL string itself). Parts are concatenated without separators.
An image URL is `data:image/...;base64,...`, `file://PATH` or a local path (relative paths are
resolved against `base_dir`, e.g. the messages file's folder; with `image_roots` a path must
resolve, symlinks followed, to a file inside one of those folders); remote URLs are not fetched.

Each image part becomes one image token in the text given to the chat template
(`tokenizer.CHAT_TEMPLATE`); after tokenisation each image token is expanded to that image's
whole span (`image_processing.num_image_tokens`: start, rows of cells + newline, end). The text
form `encode_text_with_images` (a user message whose text holds image tokens, one per image)
gives the same ids as the equivalent parts list.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .image_processing import (
    ImageError,
    expand_image_placeholders,
    load_image,
    num_image_tokens,
    preprocess,
)
from .tokenizer import CHAT_TEMPLATE

ROLES = ("system", "user", "assistant", "tool")


class MessagesError(ValueError):
    """Malformed messages (the message says which message / part is wrong)."""


@dataclass
class MultimodalPrompt:
    """Prompt ids with every image span expanded, and each image's pixels in prompt order."""

    ids: list[int]
    images: list[torch.Tensor] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)  # span length of each image


def image_token_text(tok, cfg) -> str:
    """The image token's text in `tok` (what a prompt writes for one image)."""
    if cfg.vision is None or cfg.image_token_id is None:
        raise MessagesError("this model has no vision tower (its config has no vision_config): images are not accepted")
    text = tok.id_to_token(cfg.image_token_id)
    if text is None:
        raise MessagesError(f"the tokenizer has no token for image_token_id {cfg.image_token_id}")
    return text


def render_chat(messages: list[dict], tok_bos: str, tok_eos: str, add_generation_prompt: bool = True,
                template: str = CHAT_TEMPLATE, **template_kwargs) -> str:
    """The chat template rendered with string contents (a sandboxed Jinja environment with
    `raise_exception`, as Hugging Face's `apply_chat_template` provides); `template_kwargs` are
    the template's optional variables (`reasoning_effort`, `thinking`)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise MessagesError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, bos_token=tok_bos, eos_token=tok_eos,
                                            add_generation_prompt=add_generation_prompt, **template_kwargs)


def local_image_path(url: str, base_dir: str | os.PathLike | None, roots, where: str) -> Path:
    """The file a local image reference (`file://PATH` or a path, relative to `base_dir`) names,
    symlinks resolved. With `roots` (folders), it must be a file inside one of them: a missing
    file and one outside get the same error, so a messages file cannot probe which files exist."""
    path = Path(url.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if roots is None:
        return path
    real = Path(os.path.realpath(path))
    allowed = [Path(os.path.realpath(r)) for r in roots]
    if not real.is_file() or not any(real.is_relative_to(r) for r in allowed):
        raise MessagesError(f"{where}: image {url!r} is not a file inside {', '.join(map(str, allowed))} "
                            "(images of a messages file must be in its folder; --allow-local-images DIR widens that)")
    return real


def read_image_url(url: str, base_dir: str | os.PathLike | None, where: str, roots=None):
    """A Pillow image from a data URL, file:// URL or local path (inside `roots` when given:
    `local_image_path`)."""
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise MessagesError(f"{where}: a data URL must be 'data:<mime>;base64,<data>'")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MessagesError(f"{where}: the data URL is not valid base64 ({e})") from None
        return load_image(raw, f"{where} (data URL)")
    if url.startswith(("http://", "https://")):
        raise MessagesError(f"{where}: remote image URLs are not fetched; use a data URL or a local path")
    path = local_image_path(url, base_dir, roots, where)
    return load_image(path, str(path))


def _parts(msg: dict, i: int) -> list[dict]:
    content = msg.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list):
        raise MessagesError(f"message {i}: content must be a string or a list of parts, got {type(content).__name__}")
    return content


def _tools(tools) -> list[dict] | None:
    """OpenAI `tools` checked: a list of `{"type": "function", "function": {"name": ...}}`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise MessagesError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MessagesError(f"tool {i}: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")
    return tools


def _tool_calls(msg: dict, i: int) -> list[dict] | None:
    """An assistant message's `tool_calls`, checked, with JSON-string arguments parsed into
    objects (as vLLM's OpenAI server hands them to the template)."""
    calls = msg.get("tool_calls")
    if calls is None:
        return None
    if msg["role"] != "assistant":
        raise MessagesError(f"message {i}: only assistant messages carry tool_calls")
    if not isinstance(calls, list):
        raise MessagesError(f"message {i}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MessagesError(f"message {i} tool call {j}: expected {{'function': {{'name': str, 'arguments': ...}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise MessagesError(f"message {i} tool call {j}: arguments are not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise MessagesError(f"message {i} tool call {j}: arguments must be a JSON object")
        out.append({"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}})
    return out


def encode_messages(tok, cfg, messages, *, base_dir=None, add_generation_prompt: bool = True,
                    template: str = CHAT_TEMPLATE, image_roots=None, tools=None) -> MultimodalPrompt:
    """Messages -> `MultimodalPrompt` (ids through the chat template, image spans expanded).
    `image_roots`: folders local image paths must lie in (None: anywhere). `tools` (OpenAI
    format) may also come inside a request-body object beside "messages"."""
    if isinstance(messages, dict) and "messages" in messages:
        tools = messages.get("tools", tools)
        messages = messages["messages"]
    tools = _tools(tools)
    if not isinstance(messages, list) or not messages:
        raise MessagesError("messages must be a non-empty list of {role, content} objects")
    img_text = None
    flat, pil = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise MessagesError(f"message {i}: expected an object with role in {list(ROLES)}")
        text = []
        for j, part in enumerate(_parts(msg, i)):
            where = f"message {i} part {j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise MessagesError(f"{where}: image_url needs a 'url' string")
                img_text = img_text or image_token_text(tok, cfg)
                pil.append(read_image_url(url, base_dir, where, image_roots))
                text.append(img_text)
            else:
                raise MessagesError(f"{where}: expected {{'type': 'text', 'text': str}} or "
                                    f"{{'type': 'image_url', 'image_url': {{'url': str}}}}")
        entry = {"role": msg["role"], "content": "".join(text)}
        calls = _tool_calls(msg, i)
        if calls:
            entry["tool_calls"] = calls
        flat.append(entry)
    n_markers = 0
    if cfg.vision is not None and cfg.image_token_id is not None:
        marker = tok.id_to_token(cfg.image_token_id)
        n_markers = sum(m["content"].count(marker) for m in flat) if marker else 0
    if n_markers != len(pil):
        raise MessagesError(f"the message text contains the image token itself ({n_markers - len(pil)} extra); "
                            "pass images as image_url parts")
    bos, eos = tok.id_to_token(cfg.bos_token_id), tok.id_to_token(cfg.eos_token_id)
    extra = {"tools": tools} if tools else {}
    ids = tok.encode(render_chat(flat, bos, eos, add_generation_prompt, template, **extra), add_special_tokens=False).ids
    return _expand(cfg, ids, pil)


def encode_text_with_images(tok, cfg, text: str, images: list, *, add_generation_prompt: bool = True,
                            template: str = CHAT_TEMPLATE) -> MultimodalPrompt:
    """Text form: one user message whose `text` holds one image token per image (in order);
    when it holds none, the images are prepended to the text. Images: paths, bytes or Pillow
    images."""
    marker = image_token_text(tok, cfg) if images else None
    if marker is not None and marker not in text:
        text = marker * len(images) + text
    pil = [load_image(im) for im in images]
    bos, eos = tok.id_to_token(cfg.bos_token_id), tok.id_to_token(cfg.eos_token_id)
    msgs = [{"role": "user", "content": text}]
    ids = tok.encode(render_chat(msgs, bos, eos, add_generation_prompt, template), add_special_tokens=False).ids
    return _expand(cfg, ids, pil)


def _expand(cfg, ids: list[int], pil: list) -> MultimodalPrompt:
    if cfg.vision is None or cfg.image_token_id is None:
        return MultimodalPrompt(ids)
    counts = [num_image_tokens(cfg.vision, *im.size) for im in pil]
    try:
        ids = expand_image_placeholders(ids, cfg.image_token_id, counts)
    except ValueError as e:
        raise MessagesError(str(e)) from None
    return MultimodalPrompt(ids, [preprocess(cfg.vision, im) for im in pil], counts)


def load_messages_file(path: str | os.PathLike):
    """Parse a messages JSON file (a list of messages or {"messages": [...]})."""
    p = Path(path)
    if not p.is_file():
        raise MessagesError(f"{p}: no such messages file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MessagesError(f"{p}: not valid JSON ({e})") from None


__all__ = ["ImageError", "MessagesError", "MultimodalPrompt", "encode_messages", "encode_text_with_images",
           "load_messages_file", "render_chat"]
