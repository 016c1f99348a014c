"""`dsv41` command line: `run` (reference engine), `make-checkpoint` (random-weight checkpoint
in the shipped form), `info` (sizes without weights), `backends`.

Every user error (bad config, bad prompt, missing device, bad option) ends in one line on
stderr, `dsv41: error: ...`, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2."""


def _add_model_args(p: argparse.ArgumentParser, with_ckpt: bool) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", choices=["tiny", "mini", "full"], help="built-in config (default: tiny)")
    g.add_argument("--config", metavar="FILE", help="a nested Hugging Face or flat inference config.json")
    if with_ckpt:
        g.add_argument("--ckpt", metavar="DIR", help="checkpoint directory (config.json + *.safetensors)")


def _resolve_config(args):
    from ..core.config import load_config, preset

    if getattr(args, "ckpt", None):
        from .checkpoint import read_config

        return read_config(args.ckpt)
    if args.config:
        return load_config(args.config)
    return preset(args.preset or "tiny")


def _device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available on this machine")
    if name == "npu":
        from ..backends.platform import npu_unavailable_reason

        why = npu_unavailable_reason()
        if why:
            raise UserError(f"--device npu: {why}")
    return torch.device(name)


def _tokenizer_for(args, cfg):
    from ..core.tokenizer import build_tiny_tokenizer

    if getattr(args, "ckpt", None):
        from .checkpoint import read_tokenizer

        return read_tokenizer(args.ckpt)
    if not getattr(args, "ckpt", None) and not args.config and (args.preset or "tiny") == "tiny":
        return build_tiny_tokenizer()
    return None


def _prompt_ids(args, tok, cfg) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not ids:
            raise UserError("--prompt-ids is empty")
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise UserError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        return ids
    if tok is None:
        raise UserError("this model has no tokenizer (use a checkpoint with tokenizer.json, or --prompt-ids)")
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    ids = [cfg.bos_token_id] + tok.encode(text).ids
    return ids


def _load_weights(args, cfg, device, tok=None):
    """Random seeded weights, or the checkpoint's safetensors (validated, memory-mapped, one
    tensor at a time; never pickle) with the Engram compression map of its tokenizer."""
    from ..core.weights import build_model

    if not getattr(args, "ckpt", None):
        return build_model(cfg, seed=args.seed, device=device)
    from .checkpoint import load_checkpoint_weights

    return load_checkpoint_weights(args.ckpt, cfg, device, tok)


def cmd_run(args) -> int:
    import torch

    from ..core.engine import Engine, SamplingParams
    from ..core.engram import build_compression_map

    cfg = _resolve_config(args)
    device = _device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = _tokenizer_for(args, cfg)
    prompt = _prompt_ids(args, tok, cfg)
    model = _load_weights(args, cfg, device, tok)
    if tok is not None and cfg.engram_layer_ids and not args.ckpt:  # a checkpoint's is installed
        comp, n_comp = build_compression_map(tok, vocab_size=cfg.vocab_size, pad_token_id=cfg.engram_pad_token_id)
        model.set_engram_vocab(comp, n_comp)
    engine = Engine(model, prefill_mode=args.prefill_mode)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed,
                            stop_token_ids=() if args.ignore_eos else (cfg.eos_token_id,))
    try:
        params.validate()
        res = engine.generate(prompt, params)
    except ValueError as e:
        raise UserError(str(e)) from None
    text = tok.decode(res.token_ids, skip_special_tokens=False) if tok is not None else None
    out = {
        "prompt_ids": prompt,
        "token_ids": res.token_ids,
        "text": text,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "prefill_tokens_per_s": round(res.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(res.decode_tokens_per_s, 2),
        "prefill_mode": args.prefill_mode,
        "device": str(device),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"prompt ({len(prompt)} tokens): {prompt}")
        print(f"generated ids: {res.token_ids}")
        if text is not None:
            print(f"generated text: {text!r}")
        print(f"finish: {res.finish_reason}")
        print(f"prefill: {out['prefill_tokens_per_s']} tokens/s ({args.prefill_mode}); "
              f"decode: {out['decode_tokens_per_s']} tokens/s")
    return 0


def cmd_make_checkpoint(args) -> int:
    from .checkpoint import CheckpointExistsError, make_checkpoint, parse_size

    cfg = _resolve_config(args)
    name = args.preset or "tiny"
    size = args.max_shard_size or ("2MB" if not args.config and name == "tiny" else "5GB")
    try:
        max_bytes = parse_size(size)
    except ValueError as e:
        raise UserError(f"--max-shard-size: {e}") from None
    try:
        out = make_checkpoint(cfg, args.out, seed=args.seed, max_shard_bytes=max_bytes, force=args.force)
    except CheckpointExistsError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        where = e.filename or args.out
        raise UserError(f"{where}: cannot write the checkpoint ({e.strerror or e}); nothing was written") from None
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: " + ", ".join(files))
    return 0


def cmd_convert(args) -> int:
    from .convert import ConvertError, run_convert

    try:
        return run_convert(args)
    except ConvertError as e:
        raise UserError(str(e)) from None


def cmd_info(args) -> int:
    from ..core.info import format_info, model_info

    cfg = _resolve_config(args)
    info = model_info(cfg)
    print(json.dumps(info) if args.json else format_info(info))
    return 0


def cmd_backends(args) -> int:
    from ..backends.report import backend_report

    print(backend_report(as_json=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment stack")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate with the reference engine (random weights unless --ckpt)")
    _add_model_args(r, with_ckpt=True)
    pr = r.add_mutually_exclusive_group()
    pr.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    pr.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 5,17,42")
    r.add_argument("--max-new-tokens", type=int, default=16)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int, default=0, help="seeds the random weights and the sampler")
    r.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    r.add_argument("--prefill-mode", choices=["ced", "exact"], default="ced")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_run)

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the shipped form")
    _add_model_args(m, with_ckpt=False)
    m.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create")
    m.add_argument("--seed", type=int, default=0, help="the weights of `dsv41 run --seed S`")
    m.add_argument("--max-shard-size", metavar="SIZE", help="e.g. 2MB, 5GB (default: 2MB for tiny, else 5GB)")
    m.add_argument("--force", action="store_true", help="replace an existing non-empty DIR")
    m.set_defaults(func=cmd_make_checkpoint)

    c = sub.add_parser("convert", help="stream a checkpoint into model-parallel shards model{i}-mp{N}.safetensors")
    from .convert import add_convert_args

    add_convert_args(c)
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="parameter counts and cache sizes, without allocating weights")
    _add_model_args(i, with_ckpt=False)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("backends", help="which backend each op resolves to on this machine, and why")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..core.config import ConfigError
    from ..core.weights import WeightError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, ConfigError, WeightError) as e:
        print(f"dsv41: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
