"""`dsv41` command line: `run` (reference engine), `make-checkpoint` (random-weight checkpoint
in the shipped form), `info` (sizes without weights), `backends`.

Every user error (bad config, bad prompt, missing device, bad option) ends in one line on
stderr, `dsv41: error: ...`, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2."""


class OtherRankFailed(UserError):
    """Model parallel: another rank failed and reports the error; this rank exits quietly."""


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints."""
    return int(os.environ.get("RANK", "0") or 0)


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
        raise UserError(f"{_model_name(args)} has no tokenizer, so --prompt cannot be encoded: give --prompt-ids "
                        "(or use a checkpoint with tokenizer.json)")
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    ids = [cfg.bos_token_id] + tok.encode(text).ids
    return ids


def _prompt_and_images(args, tok, cfg):
    """(prompt ids, preprocessed images): `--messages` / `--image` go through the chat template
    with each image span expanded (core/messages.py); otherwise `_prompt_ids`."""
    images = getattr(args, "image", None) or []
    messages = getattr(args, "messages", None)
    if not images and messages is None:
        return _prompt_ids(args, tok, cfg), []
    from ..core.messages import (
        encode_messages,
        encode_text_with_images,
        load_messages_file,
    )

    if args.prompt_ids is not None or (images and messages is not None):
        raise UserError("--image goes with --prompt (put the images of --messages in the messages file)")
    if tok is None:
        raise UserError("this model has no tokenizer (use a checkpoint with tokenizer.json)")
    if cfg.vision is None and images:
        raise UserError("--image: this model has no vision tower (its config has no vision_config)")
    try:
        if messages is not None:
            base = os.path.dirname(messages) or "."
            roots = [base, *(getattr(args, "allow_local_images", None) or [])]
            mm = encode_messages(tok, cfg, load_messages_file(messages), base_dir=base, image_roots=roots)
        else:
            text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
            mm = encode_text_with_images(tok, cfg, text, images)
    except ValueError as e:  # ImageError, MessagesError
        raise UserError(str(e)) from None
    return mm.ids, mm.images


def _add_engram_offload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engram-offload", action="store_true",
                   help="keep the Engram tables in host memory (page-locked on a device); lookups read them in "
                        "place (CUDA) or copy the step's rows over (NPU, CPU)")


def _load_weights(args, cfg, device, tok=None, group=None, with_drafter: bool = True):
    """Random seeded weights, or the checkpoint's safetensors (validated, memory-mapped, one
    tensor at a time; never pickle) with the Engram compression map of its tokenizer. Under
    model parallelism every rank loads its shard, then the ranks agree on success, so a shard
    that fails on one rank stops all of them with that rank's one error."""
    import torch

    from ..core.config import ConfigError
    from ..core.parallel import SINGLE
    from ..core.weights import WeightError, build_model

    group = group or SINGLE
    if not getattr(args, "ckpt", None):
        if group.world_size > 1:
            raise UserError("a model-parallel run needs a converted checkpoint: --ckpt DIR from "
                            f"`dsv41 convert --model-parallel {group.world_size}`")
        _check_memory(args, cfg, device, group, with_drafter)
        _first_contact_notes(args, tok, group)
        return build_model(cfg, seed=args.seed, device=device, engram_offload=args.engram_offload,
                           with_drafter=with_drafter, progress=True)
    from .checkpoint import load_checkpoint_weights

    model, err = None, None
    try:
        _check_memory(args, cfg, device, group, with_drafter)
        _first_contact_notes(args, tok, group)
        model = load_checkpoint_weights(args.ckpt, cfg, device, tok, group, engram_offload=args.engram_offload,
                                        with_drafter=with_drafter, progress=group.rank == 0)
    except (WeightError, ConfigError, UserError) as e:
        err = e
    if group.world_size > 1:
        failed = group.all_gather(torch.tensor([float(err is not None)], device=device), 0).tolist()
        first = next((r for r, f in enumerate(failed) if f), None)
        if first is not None and first != group.rank:
            raise OtherRankFailed(f"rank {first} failed")
        if err is not None and group.rank != 0:
            err.rank_local = True  # printed by this rank (rank 0 is fine)
    if err is not None:
        raise err
    return model


def _check_memory(args, cfg, device, group, with_drafter: bool) -> None:
    """Fail with one line, before allocating, when the weights cannot fit (deploy/preflight.py)."""
    from .preflight import InsufficientMemory, check_memory

    what = f"the {'random-weight ' if not getattr(args, 'ckpt', None) else ''}model"
    try:
        check_memory(cfg, device, with_drafter=with_drafter, engram_offload=args.engram_offload,
                     random_weights=not getattr(args, "ckpt", None), group=group, what=what)
    except InsufficientMemory as e:
        raise UserError(str(e)) from None


def _sampling_params(args, cfg):
    """`run`'s sampling options, validated before anything slow (NaN and infinity included)."""
    import math

    from ..core.engine import SamplingParams

    for name in ("temperature", "top_p"):
        v = getattr(args, name)
        if not math.isfinite(v):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {v}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed,
                            stop_token_ids=() if args.ignore_eos else (cfg.eos_token_id,))
    try:
        params.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.max_new_tokens >= cfg.max_position_embeddings:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: "
                        f"max_position_embeddings is {cfg.max_position_embeddings}")
    if args.spec_len is not None and not 0 <= args.spec_len <= cfg.dspark_block_size:
        raise UserError(f"--spec-len: spec_len must be in 0..{cfg.dspark_block_size} (dspark_block_size), got {args.spec_len}")
    return params


def _check_prompt(prompt: list[int], images: list, params, cfg) -> None:
    """What can be checked of the prompt before the weights are built: the context length, and
    image tokens without images."""
    total = len(prompt) + params.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise UserError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                        f"max_position_embeddings ({cfg.max_position_embeddings})")
    if not images and cfg.vision is not None and cfg.image_token_id in prompt:
        raise UserError(f"the prompt holds the image token (id {cfg.image_token_id}) but no image was given "
                        "(pass images with --image or as image_url parts of --messages)")


def _first_contact_notes(args, tok, group) -> None:
    """One line each, on rank 0, once everything is checked and before the weights are built:
    random weights, a preset or config without a tokenizer."""
    if group.rank != 0:
        return
    if not getattr(args, "ckpt", None):
        note = f"random weights (seed {args.seed}; no --ckpt): the generated text is meaningless"
        config, preset = getattr(args, "config", None), getattr(args, "preset", None)
        if config or (preset or "tiny") != "tiny":  # minutes of CPU work (FP4 experts fitted to their RMS)
            source = f"--config {config}" if config else f"--preset {preset}"
            note += (f"; drawing them takes minutes on the CPU: `dsv41 make-checkpoint {source} --seed {args.seed} "
                     "--out DIR` writes the same weights once for `--ckpt DIR`")
        print(f"dsv41: note: {note}", file=sys.stderr)
    if tok is None and not getattr(args, "ckpt", None) and hasattr(args, "prompt_ids"):  # `run`, not profile-spec
        print(f"dsv41: note: {_model_name(args)} has no tokenizer: prompts are token ids (--prompt-ids) and "
              "the output is ids only", file=sys.stderr)


def _model_name(args) -> str:
    """How messages name the model: the checkpoint, the config file or the preset."""
    if getattr(args, "ckpt", None):
        return f"checkpoint {args.ckpt}"
    if args.config:
        return f"config {args.config}"
    return f"the {args.preset or 'tiny'} preset"


def _process_group(device):
    """(group, device): torchrun's process group and this rank's device when launched with
    more than one rank (RANK / WORLD_SIZE in the environment), else the one-process group."""
    from ..core import parallel

    if not parallel.launched_distributed():
        return parallel.SINGLE, device
    device = parallel.local_device(device)
    return parallel.init_distributed(device), device


def cmd_run(args) -> int:
    """`dsv41 run`; under `torchrun --nproc-per-node N` one rank of an N-way model-parallel run
    of a converted checkpoint (rank 0 prints; the process group is left at exit)."""
    from ..backends import numerics
    from ..core import parallel

    numerics.set_mode(args.numerics or ("exact" if args.device == "cpu" else "official"))
    group, device = _process_group(_device(args.device))
    try:
        return _generate(args, group, device)
    finally:
        parallel.destroy(group)


def _warm_up(engine, prompt, params, images, spec_opts, group) -> float:
    """One short run of the same request before the timed one, on a device: the first run of a
    process compiles the Triton kernels its shapes need (cached on disk for later processes) and
    fills per-device tables, which would otherwise be counted as prefill and decode time. The
    same prompt with at most two new tokens, so prefill sees the timed run's shapes. Seconds."""
    import dataclasses
    import time

    if group.rank == 0:
        print(f"dsv41: warming up on {engine.model.embed.weight.device} (first-run kernel compiles; "
              "--no-warmup skips this)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    short = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 2))
    if spec_opts is not None:
        engine.generate_speculative(prompt, short, spec_opts, images=images)
    else:
        engine.generate(prompt, short, images=images)
    return time.perf_counter() - start


def _settle_host(device) -> None:
    """On a device, once the model and engine are built (and warmed up): the long-lived Python
    objects out of the garbage collector's full passes (`platform.freeze_host_objects`), so no
    collection of them stalls the host inside a prefill or decode step, and torch's intra-op CPU
    threads down to `DSV41_HOST_THREADS` (default 1: `platform.serving_host_threads`)."""
    if device.type != "cpu":
        from ..backends.platform import freeze_host_objects, limit_host_threads

        freeze_host_objects()
        limit_host_threads()


def _check_host_threads(device) -> None:
    """`DSV41_HOST_THREADS` read before anything loads, so a bad value fails at once."""
    if device.type != "cpu":
        from ..backends.platform import serving_host_threads

        try:
            serving_host_threads()
        except ValueError as e:
            raise UserError(str(e)) from None


def _generate(args, group, device) -> int:
    import torch

    from ..core.engine import Engine
    from .checkpoint import install_engram_vocab

    cfg = _resolve_config(args)
    params = _sampling_params(args, cfg)
    if not args.speculative and (args.spec_len is not None or args.spec_profile):
        raise UserError("--spec-len and --spec-profile go with --speculative")
    if args.speculative and group.world_size > 1:
        raise UserError("--speculative is not supported under model parallelism yet")
    if args.speculative and cfg.num_nextn_predict_layers <= 0:
        raise UserError("--speculative: this model has no DSpark drafter (num_nextn_predict_layers = 0)")
    spec_opts = _spec_options(args, cfg, device) if args.speculative else None
    _check_host_threads(device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = _tokenizer_for(args, cfg)
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_tokens_per_step is not None and args.max_tokens_per_step < 1:
        raise UserError(f"--max-tokens-per-step must be >= 1, got {args.max_tokens_per_step}")
    if args.prompts_file:
        return _generate_file(args, cfg, tok, group, device, params)
    prompt, images = _prompt_and_images(args, tok, cfg)
    _check_prompt(prompt, images, params, cfg)
    model = _load_weights(args, cfg, device, tok, group, with_drafter=args.speculative)
    if tok is not None and not args.ckpt:  # a checkpoint's map is installed by the loader
        install_engram_vocab(model, tok)
    graphs = device.type != "cpu" and not args.eager  # decode steps, verifications and greedy drafts replayed
    margin = cfg.dspark_block_size if args.speculative else 0  # a draft block reaches past the last token
    engine = Engine(model, prefill_mode=args.prefill_mode, max_batch=1, graphs=graphs, overlap=not args.no_overlap,
                    max_tokens_per_step=args.max_tokens_per_step,
                    max_model_len=min(len(prompt) + max(args.max_new_tokens, 1) + margin, cfg.max_position_embeddings))
    try:
        warmup_s = _warm_up(engine, prompt, params, images, spec_opts, group) \
            if device.type != "cpu" and not args.no_warmup else None
        _settle_host(device)
        if spec_opts is not None:
            res = engine.generate_speculative(prompt, params, spec_opts, images=images)
        else:
            res = engine.generate(prompt, params, images=images)
    except ValueError as e:
        raise UserError(str(e)) from None
    text = tok.decode(res.token_ids, skip_special_tokens=False) if tok is not None else None
    out = {
        "prompt_ids": prompt,
        "token_ids": res.token_ids,
        "text": text,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "images": len(images),
        "prefill_tokens_per_s": round(res.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(res.decode_tokens_per_s, 2),
        "prefill_mode": args.prefill_mode,
        "device": str(device),
    }
    if warmup_s is not None:
        out["warmup_s"] = round(warmup_s, 2)
    if group.world_size > 1:
        out["model_parallel"] = group.world_size
    if res.spec is not None:
        out["speculative"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in res.spec.items()}
    if group.rank != 0:
        return 0
    if args.json:
        print(json.dumps(out))
    else:
        print(f"prompt ({len(prompt)} tokens): {prompt}")
        print(f"generated ids: {res.token_ids}")
        if text is not None:
            print(f"generated text: {text!r}")
        print(f"finish: {res.finish_reason}")
        if warmup_s is not None:
            print(f"warm-up run: {warmup_s:.1f} s (kernel compiles; not counted in the rates below)")
        print(f"prefill: {out['prefill_tokens_per_s']} tokens/s ({args.prefill_mode}); "
              f"decode: {out['decode_tokens_per_s']} tokens/s")
        if res.spec is not None:
            sp = out["speculative"]
            print(f"speculative: {sp['steps']} steps, acceptance rate {sp['acceptance_rate']:.3f} "
                  f"({sp['accepted']}/{sp['drafted']} drafts), mean accepted length "
                  f"{sp['mean_accepted_length']:.3f} tokens/step, mean verify length {sp['mean_verify_len']:.2f}")
    return 0


def _generate_file(args, cfg, tok, group, device, base) -> int:
    """`run --prompts-file`: every request of the file in one continuous batch (`base`: the
    command's sampling options, which a line may override)."""
    from ..core.engine import Engine
    from .checkpoint import install_engram_vocab
    from .prompts_file import encode_prompts_file, run_prompts_file

    if args.speculative or args.prompt is not None or args.prompt_ids is not None or args.messages or args.image:
        raise UserError("--prompts-file takes the prompts from the file (no --prompt / --prompt-ids / --messages / "
                        "--image / --speculative)")
    try:  # every line read, checked and encoded before any weight is built
        reqs, batch = encode_prompts_file(args, tok, cfg, base)
    except ValueError as e:
        raise UserError(str(e)) from None
    model = _load_weights(args, cfg, device, tok, group, with_drafter=False)
    if tok is not None and not args.ckpt:
        install_engram_vocab(model, tok)
    longest = min(max(len(ids) + p.max_new_tokens for ids, p, _ in batch), cfg.max_position_embeddings)
    try:
        engine = Engine(model, prefill_mode=args.prefill_mode, max_batch=args.max_batch,
                        max_tokens_per_step=args.max_tokens_per_step,
                        graphs=device.type != "cpu" and not args.eager, max_model_len=longest,
                        overlap=not args.no_overlap)
        if device.type != "cpu" and not args.no_warmup:
            ids, first, images = batch[0]
            _warm_up(engine, ids, first, images, None, group)
        _settle_host(device)
        rows = run_prompts_file(engine, tok, reqs, batch)
    except ValueError as e:
        raise UserError(str(e)) from None
    if group.rank != 0:
        return 0
    for row in rows:
        if args.json:
            print(json.dumps(row))
        elif "line" in row:
            text = f" {row['text']!r}" if row["text"] is not None else ""
            print(f"[line {row['line']}] {row['finish_reason']}: {row['token_ids']}{text}")
        else:
            print(f"{row['requests']} requests, {row['generated_tokens']} tokens in {row['wall_s']} s: "
                  f"{row['total_tokens_per_s']} tokens/s (max batch {args.max_batch})")
    return 0


def _spec_options(args, cfg, device):
    """`run --speculative`: a fixed --spec-len, or the scheduler over the throughput profile
    (--spec-profile, else the default location; a flat step time when none was measured)."""
    from pathlib import Path

    from ..core.spec_decode import SpecOptions, ThroughputProfile, default_profile_path

    if args.spec_len is not None:
        return SpecOptions(spec_len=args.spec_len)
    path = args.spec_profile or default_profile_path(device, cfg)
    if args.spec_profile is None and not Path(path).exists():
        print(f"dsv41: note: no throughput profile at {path} (run `dsv41 profile-spec`); "
              "assuming a flat step time", file=sys.stderr)
        return SpecOptions()
    try:
        return SpecOptions(profile=ThroughputProfile.load(path))
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_profile_spec(args) -> int:
    """`dsv41 profile-spec`: measure the engine throughput curve the DSpark scheduler reads."""
    import torch

    from ..backends.platform import platform_for
    from ..core.engine import Engine
    from ..core.spec_decode import default_profile_path, measure_profile

    cfg = _resolve_config(args)
    device = _device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if cfg.num_nextn_predict_layers <= 0:
        raise UserError("this model has no DSpark drafter (num_nextn_predict_layers = 0)")
    path = args.out or default_profile_path(device, cfg)
    _check_writable_file(path, "--out")
    if args.repeats < 1 or not 1 <= args.prompt_len <= cfg.max_position_embeddings - cfg.dspark_block_size - 2:
        raise UserError(f"--repeats must be >= 1 and --prompt-len in 1..{cfg.max_position_embeddings - cfg.dspark_block_size - 2}")
    model = _load_weights(args, cfg, device, _tokenizer_for(args, cfg))
    sync, bar = _progress_sync(platform_for(device).synchronize, cfg.dspark_block_size, args.repeats)
    try:
        with bar:
            # timed as `run` decodes: on a device the verification and the greedy draft block replay
            # their graphs (`graphs/verify.py`, `graphs/draft.py`), unless --eager
            b, graphs = cfg.dspark_block_size, device.type != "cpu" and not args.eager
            engine = Engine(model, max_batch=1, graphs=graphs,
                            max_model_len=min(args.prompt_len + 2 * b + 2, cfg.max_position_embeddings))
            prof = measure_profile(engine, prompt_len=args.prompt_len, repeats=args.repeats, seed=args.seed, sync=sync)
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        prof.save(path)
    except OSError as e:
        raise UserError(f"{e.filename or path}: cannot write the profile ({e.strerror or e})") from None
    curve = ", ".join(f"{n}: {v:.1f}" for n, v in zip(prof.tokens, prof.tokens_per_s))
    print(f"wrote {path}: tokens/s by tokens verified per step {{{curve}}}; draft {prof.draft_s * 1e3:.2f} ms")
    tps = prof.tokens_per_s
    drops = [(prof.tokens[i], prof.tokens[i + 1]) for i in range(len(tps) - 1) if tps[i + 1] <= tps[i]]
    if drops:
        print(f"dsv41: warning: the measured curve is not increasing (tokens/s at {drops[0][1]} tokens <= at "
              f"{drops[0][0]}{f' and {len(drops) - 1} more' if len(drops) > 1 else ''}): timing noise or a busy "
              "machine; the scheduler will rarely verify more tokens. Rerun with more --repeats on an idle device",
              file=sys.stderr)
    return 0


def _progress_sync(sync, block_size: int, repeats: int):
    """(sync, bar): `measure_profile` calls `sync` twice per timed run, (repeats + 1) runs per
    point, block_size + 1 verify points and one draft point; counting the calls drives a bar."""
    from ..core.weights import progress_bar

    bar = progress_bar(2 * (repeats + 1) * (block_size + 2), "profile-spec", True)
    bar.unit, bar.unit_scale = "sync", False

    def counted():
        sync()
        bar.update(1)

    return counted, bar


def _check_writable_file(path, option: str) -> None:
    """UserError unless `path` can be created or replaced (checked before slow work)."""
    from pathlib import Path

    from .outdir import unwritable_reason

    p = Path(path)
    why = "is a directory" if p.is_dir() else unwritable_reason(p)
    if why is None and p.exists() and not os.access(p, os.W_OK):
        why = "no write permission"
    if why:
        raise UserError(f"{option} {p}: cannot be written ({why})")


def cmd_make_checkpoint(args) -> int:
    from .checkpoint import CheckpointExistsError, make_checkpoint, parse_size

    cfg = _resolve_config(args)
    name = args.preset or "tiny"
    size = args.max_shard_size or ("2MB" if not args.config and name == "tiny" else "5GB")
    try:
        max_bytes = parse_size(size)
    except ValueError as e:
        raise UserError(f"--max-shard-size: {e}") from None
    from .outdir import DestinationBusy

    try:
        out = make_checkpoint(cfg, args.out, seed=args.seed, max_shard_bytes=max_bytes, force=args.force,
                              progress=True)
    except (CheckpointExistsError, DestinationBusy) as e:
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


def cmd_import_mindspore(args) -> int:
    from .checkpoint import CheckpointExistsError, parse_size
    from .mindspore_import import MindSporeImportError, import_mindspore

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        raise UserError(f"--max-shard-size: {e}") from None
    try:
        rep = import_mindspore(args.ckpt, args.out, args.config, args.strategy, tokenizer_path=args.tokenizer_path,
                               quantize=args.quantize, max_shard_bytes=max_bytes)
    except (MindSporeImportError, CheckpointExistsError) as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{e.filename or args.out}: cannot write the checkpoint ({e.strerror or e}); "
                        "nothing was written") from None
    print(f"imported {len(args.ckpt)} MindSpore file(s) -> {rep['out']}: {rep['tensors']} tensors, "
          f"{rep['bytes'] / 1e6:.1f} MB in {rep['shards']} shard(s); {rep['reinterpreted']} reinterpreted from "
          f"uint8/int8, {rep['quantised']} quantised, {rep['cast']} cast, "
          f"{rep['skipped_training_state']} training-state entries skipped")
    return 0


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


def cmd_serve(args) -> int:
    """Start vLLM's OpenAI-compatible server with our model (replaces this process)."""
    from .vllm import serve

    why = serve.vllm_missing_reason()
    if why:
        raise UserError(why)
    from .checkpoint import read_config

    try:
        read_config(args.model_dir)  # a missing directory or a bad config fails here, not in vLLM
        serve.server_command(args.model_dir, args.flags)
    except ValueError as e:  # ConfigError too
        raise UserError(str(e)) from None
    serve.exec_server(args.model_dir, args.flags)
    return 0  # not reached: exec replaced the process


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows every option's default, except flags and options whose help already
    says it or that have none."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment stack")
    sub = p.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with our model (other flags go to vLLM)",
                        description="Runs vLLM's `serve` command on MODEL_DIR with our architecture selected "
                                    "(--hf-overrides), a --block-size that fits the page layout, --reasoning-parser "
                                    "and --tool-call-parser deepseek_v41, VLLM_MLA_DISABLE=1 and (CPU build) a KV "
                                    "space that fits; every flag given is passed to vLLM and wins over these.")
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="checkpoint directory (config.json, safetensors, tokenizer)")
    sv.add_argument("flags", nargs=argparse.REMAINDER, help="vLLM server flags, e.g. --port 8000 --max-model-len 4096")
    sv.set_defaults(func=cmd_serve)

    r = sub.add_parser("run", help="generate with the reference engine (random weights unless --ckpt)",
                       formatter_class=DefaultsFormatter)
    _add_model_args(r, with_ckpt=True)
    pr = r.add_mutually_exclusive_group()
    pr.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    pr.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 5,17,42")
    pr.add_argument("--messages", metavar="FILE", help="OpenAI-style chat messages JSON (text and image_url parts)")
    r.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help="one request per line ({\"prompt\" | \"prompt_ids\" | \"messages\": ..., optional "
                        "\"max_new_tokens\", \"temperature\", \"seed\"}), run as one continuous batch; results in "
                        "input order, then the total tokens/s")
    r.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="most sequences decoding at once (continuous batching; default 64)")
    r.add_argument("--eager", action="store_true",
                   help="on a device, run every step eagerly instead of replaying captured decode graphs")
    r.add_argument("--max-tokens-per-step", type=int, metavar="N",
                   help="tokens per forward step (prefill chunk + decode tokens); default: on a device, the most "
                        "whose prefill activations stay within 0.15 x (weights + KV), 2048 on the CPU")
    r.add_argument("--no-warmup", action="store_true",
                   help="on a device, time the first run as it comes (by default one short run of the same "
                        "prompt goes first, so kernel compiles are not counted as prefill / decode time)")
    r.add_argument("--no-overlap", action="store_true",
                   help="with decode graphs, read each step's tokens before building the next step (by default "
                        "greedy decode steps are launched one ahead, so host work overlaps device work)")
    r.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the prompt's user message (repeatable; placed at each image token of "
                        "--prompt, else prepended)")
    r.add_argument("--allow-local-images", action="append", metavar="DIR",
                   help="let --messages read local images under DIR too (repeatable; by default only under the "
                        "messages file's folder)")
    r.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate at most")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    r.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    r.add_argument("--seed", type=int, default=0, help="seeds the random weights and the sampler")
    r.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu", help="where the model runs")
    _add_engram_offload(r)
    r.add_argument("--prefill-mode", choices=["ced", "exact"], default="ced",
                   help="ced: the encoder layers run over the whole prompt but the decoder layers only over its "
                        "last sliding_window tokens, their global KV projected from the encoder output; an "
                        "approximation of exact (every layer over every prompt token, as the reference "
                        "implementation does) that prefills long prompts faster")
    r.add_argument("--numerics", choices=["exact", "official"],
                   help="reference arithmetic: exact (fp32, fp64 sums) or official (bf16 where the official "
                        "code rounds; see README); default exact on cpu, official elsewhere")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--speculative", action="store_true", help="DSpark speculative decoding (reports acceptance)")
    r.add_argument("--spec-len", type=int, metavar="K", help="verify K drafts per step (default: the scheduler picks)")
    r.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="run N model-parallel ranks on this host (a converted --ckpt; torchrun's launcher, "
                        "reporting a failure as one line)")
    r.add_argument("--spec-profile", metavar="FILE", help="throughput profile from `dsv41 profile-spec` "
                   "(default: $DSV41_SPEC_PROFILE or ~/.cache/dsv41/spec-profile-<device>-<model>.json)")
    r.set_defaults(func=cmd_run)

    sp = sub.add_parser("profile-spec", help="measure tokens/s vs tokens verified per step for the DSpark scheduler",
                        formatter_class=DefaultsFormatter)
    _add_model_args(sp, with_ckpt=True)
    sp.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    _add_engram_offload(sp)
    sp.add_argument("--out", metavar="FILE", help="where to write the JSON (default: as `run --spec-profile`)")
    sp.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; one warm-up before)")
    sp.add_argument("--prompt-len", type=int, default=32, help="context length the steps are timed at")
    sp.add_argument("--seed", type=int, default=0, help="random weights (without --ckpt) and prompt")
    sp.add_argument("--eager", action="store_true", help="time the steps without device graphs (as `run --eager`)")
    sp.set_defaults(func=cmd_profile_spec)

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the shipped form",
                       formatter_class=DefaultsFormatter)
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

    ms = sub.add_parser("import-mindspore", help="a MindSpore (HyperParallel) checkpoint -> a native checkpoint")
    ms.add_argument("--ckpt", required=True, action="append", metavar="FILE",
                    help="MindSpore .ckpt / .safetensors file (repeat: parts of one checkpoint, or one per rank "
                         "in rank order with --strategy)")
    ms.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create")
    ms.add_argument("--config", metavar="FILE", help="config.json (default: the one next to the first --ckpt)")
    ms.add_argument("--strategy", metavar="FILE", help="parallel strategy file: merge the per-rank slices")
    ms.add_argument("--tokenizer-path", metavar="DIR", help="copy tokenizer.json / tokenizer_config.json from DIR")
    ms.add_argument("--quantize", action="store_true",
                    help="quantise floating masters into the config's storage formats (FP8 / FP4), cast others")
    ms.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="e.g. 2MB, 5GB (default 5GB)")
    ms.set_defaults(func=cmd_import_mindspore)

    i = sub.add_parser("info", help="parameter counts and cache sizes, without allocating weights")
    _add_model_args(i, with_ckpt=False)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("backends", help="which backend each op resolves to on this machine, and why")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends)

    a = sub.add_parser("audit-ops", help="replay every op call of a device forward on the CPU reference, "
                                         "per-op errors (deploy/op_audit.py)")
    from .op_audit import add_arguments, run as audit_run

    add_arguments(a)
    a.set_defaults(func=audit_run)
    return p


MAX_LISTED = 20  # problems listed under an error's first line


def error_text(message: str) -> str:
    """`dsv41: error: <summary>` first, whatever the error: a message listing problems as
    "HEADER:\n  - a\n  - b" becomes "HEADER: a" on the first line (with "(and N more below)")
    and keeps its list after it, so scripts and people see one line first."""
    lines = str(message).splitlines() or [""]
    bullets = [line[4:] for line in lines[1:] if line.startswith("  - ")]
    if not bullets:
        return "dsv41: error: " + "\n".join(lines)
    head = lines[0].rstrip().rstrip(":")
    if len(bullets) == 1:
        return f"dsv41: error: {head}: {bullets[0]}"
    rest = lines[1:]
    if len(rest) > MAX_LISTED:  # a wholly mismatched checkpoint lists hundreds of tensors
        rest = [*rest[:MAX_LISTED], f"  ... and {len(rest) - MAX_LISTED} more"]
    return "\n".join([f"dsv41: error: {head}: {bullets[0]} (and {len(bullets) - 1} more below)", *rest])


def _out_of_memory(e: BaseException) -> bool:
    """An allocation the memory estimate did not foresee (a long generation, a busy machine):
    MemoryError, torch.OutOfMemoryError (accelerators) or the CPU allocator's RuntimeError."""
    import torch

    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _exit_on_sigterm(signum, frame):
    """SIGTERM (kill, a scheduler, torchrun stopping the other ranks) unwinds like Ctrl-C, so
    the writers remove their temporary folders; status 143 as for a plain SIGTERM."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    from ..core.config import ConfigError
    from ..core.weights import WeightError

    args = build_parser().parse_args(argv)
    if getattr(args, "nproc_per_node", 1) != 1:
        from ..core.parallel import launched_distributed
        from .launch import launch

        if args.nproc_per_node < 1 or launched_distributed():
            print("dsv41: error: --nproc-per-node must be >= 1 and is not for use under torchrun", file=sys.stderr)
            return 2
        return launch(args.nproc_per_node, sys.argv[1:] if argv is None else list(argv))
    try:
        return args.func(args)
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        print(error_text(f"out of memory ({str(e).splitlines()[0] if str(e) else type(e).__name__}); try a "
                         "smaller preset, fewer tokens or a bigger machine"), file=sys.stderr)
        return 2
    except (UserError, ConfigError, WeightError, OSError) as e:
        if isinstance(e, OtherRankFailed):
            return 2  # the failing rank prints its error
        if isinstance(e, OSError):  # the last resort: an OS refusal we did not foresee, in one line
            e = UserError(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        if _rank() == 0:
            print(error_text(str(e)), file=sys.stderr)
        elif getattr(e, "rank_local", False):
            print(error_text(f"rank {_rank()}: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the writers have already removed their temporary files
        if _rank() == 0:
            print("dsv41: error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
