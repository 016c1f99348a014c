"""`dsv41 run --prompts-file FILE.jsonl`: many requests in one continuous batch.

Each line is one JSON object with exactly one of `prompt` (text), `prompt_ids` (token ids) or
`messages` (OpenAI-style chat messages; image paths relative to the file's folder), and
optionally `max_new_tokens`, `temperature`, `seed` (defaulting to the command's options). The
whole file is read and checked before any weight is built; a bad line is one error naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

PROMPT_KEYS = ("prompt", "prompt_ids", "messages")
OPTION_KEYS = {"max_new_tokens": int, "temperature": (int, float), "seed": int}


@dataclass
class FileRequest:
    """One line of a prompts file, validated."""

    line: int
    kind: str  # "prompt" | "prompt_ids" | "messages"
    value: object
    options: dict


def read_prompts_file(path: str) -> list[FileRequest]:
    """Parse and check every line (ValueError naming the line on the first problem)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--prompts-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--prompts-file {path}: not UTF-8 text") from None
    out = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"--prompts-file {path} line {n}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        given = [k for k in PROMPT_KEYS if k in obj]
        if len(given) != 1:
            raise ValueError(f"{where}: needs exactly one of {', '.join(PROMPT_KEYS)}")
        unknown = set(obj) - set(PROMPT_KEYS) - set(OPTION_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {list(PROMPT_KEYS) + list(OPTION_KEYS)})")
        kind, value = given[0], obj[given[0]]
        if kind == "prompt" and not (isinstance(value, str) and value):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if kind == "prompt_ids" and not (isinstance(value, list) and value
                                         and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        if kind == "messages" and not isinstance(value, list):
            raise ValueError(f"{where}: 'messages' must be a list of chat messages")
        opts = {}
        for k, typ in OPTION_KEYS.items():
            if k in obj:
                v = obj[k]
                if isinstance(v, bool) or not isinstance(v, typ):
                    raise ValueError(f"{where}: '{k}' must be a number")
                opts[k] = v
        out.append(FileRequest(n, kind, value, opts))
    if not out:
        raise ValueError(f"--prompts-file {path}: no requests in the file")
    return out


def encode_request(req: FileRequest, tok, cfg, base_dir: str, image_roots=None) -> tuple[list[int], list]:
    """(prompt ids, preprocessed images) of one request; local images only inside `image_roots`
    (`messages.local_image_path`) when given."""
    where = f"line {req.line}"
    if req.kind == "prompt_ids":
        bad = [t for t in req.value if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        return list(req.value), []
    if tok is None:
        raise ValueError(f"{where}: this model has no tokenizer (use prompt_ids, or a checkpoint with tokenizer.json)")
    if req.kind == "prompt":
        return [cfg.bos_token_id] + tok.encode(req.value).ids, []
    from ..core.messages import encode_messages

    try:
        mm = encode_messages(tok, cfg, req.value, base_dir=base_dir, image_roots=image_roots)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return mm.ids, mm.images


def encode_prompts_file(args, tok, cfg, base_params) -> tuple[list[FileRequest], list[tuple]]:
    """(requests, batch of (ids, params, images)): every request encoded and checked (token
    ids, images, sampling options, context length), so a bad line fails before weights are built."""
    from dataclasses import replace

    reqs = read_prompts_file(args.prompts_file)
    base_dir = os.path.dirname(args.prompts_file) or "."
    roots = [base_dir, *(getattr(args, "allow_local_images", None) or [])]  # as run --messages
    batch = []
    for r in reqs:
        ids, images = encode_request(r, tok, cfg, base_dir, roots)
        params = replace(base_params, **r.options).validate()
        if len(ids) + params.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"line {r.line}: prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds max_position_embeddings ({cfg.max_position_embeddings})")
        batch.append((ids, params, images))
    return reqs, batch


def run_prompts_file(engine, tok, reqs: list[FileRequest], batch: list[tuple]) -> list[dict]:
    """Run the encoded requests as one continuous batch; results in input order plus a summary
    (total generated tokens / wall time)."""
    import time

    t0 = time.perf_counter()
    results = engine.generate_batch(batch)
    wall = time.perf_counter() - t0
    out = []
    for r, (ids, _, _), res in zip(reqs, batch, results):
        out.append({"line": r.line, "prompt_tokens": len(ids), "token_ids": res.token_ids,
                    "text": tok.decode(res.token_ids, skip_special_tokens=False) if tok is not None else None,
                    "finish_reason": res.finish_reason, "prefix_hit_tokens": res.prefix_hit_tokens})
    generated = sum(len(r.token_ids) for r in results)
    summary = {"requests": len(results), "generated_tokens": generated, "wall_s": round(wall, 3),
               "total_tokens_per_s": round(generated / wall, 2) if wall > 0 else None}
    return out + [summary]
