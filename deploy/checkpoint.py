"""Checkpoint directories: writing the shipped form and loading it (safetensors + JSON only).

A checkpoint directory holds the nested Hugging Face `config.json`, sharded safetensors with
`model.safetensors.index.json` (or a single / several `*.safetensors` without an index), and
optionally `tokenizer.json` / `tokenizer_config.json`. Tensor names may be native or Hugging
Face-style (`deploy/names.py`); tensors are in their storage dtypes (FP8 E4M3 + E8M0 block
scales, FP4 pairs in int8 bytes + E8M0 scales, bf16 / fp32).

Loading never unpickles: it memory-maps every file with `safetensors.safe_open`, validates every
name, shape and dtype against the model before reading any data (one `WeightError` listing all
problems), then copies one tensor at a time into the model's buffers on the target device.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from ..core.config import ConfigError, ModelConfig, load_config
from ..core.parallel import SINGLE, Group
from ..core.weights import DEFAULT_INIT, WeightError, check_state_dict
from .names import hf_to_native, released_fp8_bf16

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"

# safetensors dtype strings -> torch dtypes (the ones a checkpoint of this model may hold).
ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def _read_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (SafetensorError, OSError, RuntimeError, ValueError)


_READ_ERRORS = _read_errors()


# ---- writing --------------------------------------------------------------------------------

class CheckpointExistsError(FileExistsError):
    """The output directory exists and is not empty (and replacing it was not asked for)."""


def parse_size(text: str | int) -> int:
    """Bytes from `123`, `500KB`, `2MB`, `5GB` (1000-based) or `2MiB`, `5GiB` (1024-based)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
             "K": 1000, "M": 1000**2, "G": 1000**3, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 2MB, 512KiB, 5GB or a byte count)") from None
    if not math.isfinite(value) or value <= 0 or value * mult < 1:
        raise ValueError(f"size must be a positive, finite number of bytes, got {text!r}")
    return int(value * mult)


def _plan_shards(sizes, max_shard_bytes: int) -> list[list]:
    """Keys of (key, bytes) pairs grouped in order into shards of at most `max_shard_bytes`
    (a bigger tensor gets its own)."""
    shards: list[list] = []
    cur: list = []
    size = 0
    for key, n in sizes:
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur:
        shards.append(cur)
    return shards


def write_state_dict(sd: dict[str, torch.Tensor], out_dir: str | os.PathLike, max_shard_bytes: int,
                     *, rename=None) -> list[str]:
    """Write `sd` as sharded safetensors + `model.safetensors.index.json` into an existing
    directory (names optionally mapped through `rename`). Returns the shard file names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    plan = _plan_shards(((k, t.numel() * t.element_size()) for k, t in sd.items()), max_shard_bytes)
    n = len(plan)
    weight_map: dict[str, str] = {}
    files = []
    total = 0
    for i, names in enumerate(plan, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        part = {}
        for k in names:
            key = rename(k) if rename else k
            t = sd[k]
            # a view into a larger allocation (`weights.stack_linears`' pairs): its own copy, as
            # safetensors refuses tensors that share memory
            part[key] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t.contiguous()
            weight_map[key] = fname
            total += sd[k].numel() * sd[k].element_size()
        save_file(part, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _fsync_dir_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def make_checkpoint(cfg: ModelConfig, out_dir: str | os.PathLike, seed: int = 0,
                    max_shard_bytes: int = 2_000_000, *, tokenizer=None, force: bool = False,
                    progress: bool = False, init: str = DEFAULT_INIT) -> Path:
    """Write a complete checkpoint of the weights `build_model(cfg, seed, init=init)` builds.

    `config.json` (nested form), `inference/config.json` (the released flat form, where the
    config can be stated in its keys), sharded safetensors + index in the storage dtypes, and
    `tokenizer.json` / `tokenizer_config.json` (chat template) when `tokenizer` is given (for
    the tiny vocabulary the tiny tokenizer is used when `tokenizer` is None).

    Streamed: the shard layout comes from the meta-device model, every shard is created with its
    full header, and the weights are drawn one unit at a time (`weights.iter_random_state`) and
    written at their offsets, so the memory used is one unit, whatever the model's size.

    Everything goes into a temporary directory next to `out_dir`, renamed into place at the end,
    holding a lock on `out_dir` (a second writer gets `outdir.DestinationBusy`); leftovers of a
    killed run are removed first. A failure leaves neither a partial `out_dir` nor the temporary
    directory. Files and folders follow the umask. An existing non-empty `out_dir` raises
    CheckpointExistsError unless `force`. OSErrors propagate (after clean-up).
    With a tokenizer, `config.json` records the size of its Engram token map as
    `engram_compressed_vocab_size` (what loading checks the tokenizer against).
    """
    from ..core.model import Transformer
    from ..core.tokenizer import (
        TINY_VOCAB_SIZE,
        build_tiny_tokenizer,
        write_tokenizer_files,
    )
    from ..core.weights import iter_random_state, progress_bar
    from .convert import TORCH_TO_ST, OutTensor, ShardWriter
    from .outdir import clean_stale_temps, destination_lock, temp_dir_beside

    out = Path(out_dir)
    check_output_dir(out, force)
    cfg.validate()
    if tokenizer is None and cfg.vocab_size == TINY_VOCAB_SIZE:
        tokenizer = build_tiny_tokenizer()
    if tokenizer is not None and cfg.engram_layer_ids:
        from ..core.engram import build_compression_map

        n_comp = build_compression_map(tokenizer, vocab_size=cfg.vocab_size, pad_token_id=cfg.engram_pad_token_id)[1]
        cfg = cfg.replace(engram_compressed_vocab_size=n_comp).validate()

    with torch.device("meta"):
        model = Transformer(cfg)
    layout = [OutTensor(k, TORCH_TO_ST[v.dtype], tuple(v.shape)) for k, v in model.state_dict().items()]
    shards = _plan_shards(((o, o.nbytes) for o in layout), max_shard_bytes)

    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(out):
        check_output_dir(out, force)  # again, now that no other writer can change it
        for p in clean_stale_temps(out):
            print(f"dsv41: note: removed {p}, left by an interrupted run", file=sys.stderr)
        tmp = temp_dir_beside(out)
        writers: list = []
        try:
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
            try:  # the released flat form too, for the official inference code
                flat = cfg.to_flat_dict()
            except ConfigError as e:
                print(f"dsv41: note: no inference/{CONFIG_NAME} written: {e}", file=sys.stderr)
            else:
                (tmp / "inference").mkdir()
                (tmp / "inference" / CONFIG_NAME).write_text(json.dumps(flat, indent=2) + "\n")
            n = len(shards)
            names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
            writer_of = {}
            for fname, outs in zip(names, shards):
                writers.append(ShardWriter(tmp / fname, outs, {"format": "pt"}))
                writer_of.update(dict.fromkeys((o.name for o in outs), writers[-1]))
            total = sum(o.nbytes for o in layout)
            with progress_bar(total, "writing checkpoint", progress) as bar:
                for part in iter_random_state(model, seed, init):
                    for k, t in part.items():
                        bar.update(writer_of[k].write(k, t))
            for w in writers:
                w.close()
            weight_map = {o.name: f for f, outs in zip(names, shards) for o in outs}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            if tokenizer is not None:
                write_tokenizer_files(tokenizer, tmp, model_max_length=cfg.max_position_embeddings)
            _fsync_dir_tree(tmp)
            _replace_dir(tmp, out)
        except BaseException:
            for w in writers:
                with contextlib.suppress(OSError):
                    w.close(check=False)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def check_output_dir(out: Path, force: bool) -> None:
    """CheckpointExistsError unless `out` is absent, an empty directory, or `force` is given
    for a directory; an OSError when its parent cannot be written (checked before slow work)."""
    if out.exists() and not out.is_dir():
        raise CheckpointExistsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointExistsError(f"{out}: directory exists and is not empty (use --force to replace it)")
    from .outdir import unwritable_reason

    why = unwritable_reason(out)
    if why:
        raise PermissionError(errno.EACCES, why, str(out))


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` (moved aside first, put back if the
    rename fails); the aside folder is removed whatever happens."""
    if not out.exists():
        os.replace(tmp, out)
        return
    from .outdir import temp_dir_beside

    old = temp_dir_beside(out, "old")
    try:
        os.replace(out, old / "x")
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old / "x", out)
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# ---- loading --------------------------------------------------------------------------------

def read_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """The config of a checkpoint directory (ConfigError naming the path when absent)."""
    p = Path(ckpt_dir)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such checkpoint directory")
    return load_config(p)


def read_tokenizer(ckpt_dir: str | os.PathLike):
    """The directory's `tokenizer.json` as a `tokenizers.Tokenizer`, or None if it has none."""
    from ..core.tokenizer import load_tokenizer

    f = Path(ckpt_dir) / TOKENIZER_NAME
    if not f.exists():
        return None
    try:
        return load_tokenizer(f)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _weight_files(d: Path) -> dict[str, Path]:
    """Tensor name (as stored) -> file, from the index if there is one, else every
    `*.safetensors` file in the directory. Opens each file's header (no tensor data)."""
    index = d / INDEX_NAME
    if index.exists():
        try:
            wm = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise WeightError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise WeightError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise WeightError(f"{d / missing[0]}: shard named in {INDEX_NAME} is missing"
                              + (f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""))
        for f in files:
            if Path(f).name != f:
                raise WeightError(f"{index}: shard {f!r} is not a plain file name in the checkpoint directory")
        by_file = {f: _keys(d / f) for f in files}
        absent = [f"{k} (in {f})" for k, f in wm.items() if k not in by_file[f]]
        if absent:
            raise WeightError(f"{index}: {len(absent)} tensor(s) listed in the index are not in their shard: "
                              + ", ".join(absent[:5]) + (" ..." if len(absent) > 5 else ""))
        return {k: d / f for k, f in wm.items()}
    paths = sorted(d.glob("*.safetensors"))
    if not paths:
        raise WeightError(no_weights_message(d))
    out: dict[str, Path] = {}
    for p in paths:
        for k in _keys(p):
            if k in out:
                raise WeightError(f"{p}: tensor {k} is also in {out[k].name}")
            out[k] = p
    return out


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def no_weights_message(d: Path) -> str:
    """Why a directory without safetensors has no loadable weights; for PyTorch pickle files
    (`pytorch_model.bin`), that they are never loaded and how to convert them."""
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES) if d.is_dir() else []
    if pickles:
        first = pickles[0]
        return (f"{d}: no *.safetensors files, only PyTorch pickle files ({', '.join(pickles[:3])}"
                f"{' ...' if len(pickles) > 3 else ''}), which are never loaded (unpickling can run code); "
                "convert them in an environment you trust, e.g. `python -c \"import torch; "
                "from safetensors.torch import save_file; "
                f"save_file(torch.load('{first}', weights_only=True), 'model.safetensors')\"`")
    return f"{d}: no *.safetensors files (and no {INDEX_NAME}) in the checkpoint directory"


MP_SHARD = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")  # `dsv41 convert` output


def _rank_weight_files(d: Path, group: Group) -> dict[str, Path]:
    """Tensor name -> file for this rank: `model{rank}-mp{N}.safetensors` of a converted
    checkpoint (N must equal the world size, every shard must exist), or the whole
    checkpoint's files for a one-process run of an unsplit checkpoint. Every rank reaches the
    same verdict, so a mismatch stops all of them with the same one error."""
    found: dict[int, set[int]] = {}
    for p in d.glob("model*-mp*.safetensors"):
        m = MP_SHARD.match(p.name)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    world = group.world_size
    if not found:
        if world > 1:
            raise WeightError(f"{d}: not split for model parallelism (no model{{i}}-mp{world}.safetensors) but "
                              f"this run has {world} processes; convert it with `dsv41 convert --model-parallel "
                              f"{world}` or run one process")
        return _weight_files(d)
    if len(found) > 1:
        raise WeightError(f"{d}: shards of several model-parallel sizes ({sorted(found)}); keep one set")
    (mp, ranks), = found.items()
    if mp != world:
        how = (f"launch it with `torchrun --nproc-per-node {mp} -m dsv41.deploy.cli run ...`" if mp > 1
               else "run it as one process")
        raise WeightError(f"{d}: the checkpoint is split for {mp}-way model parallelism (model{{i}}-mp{mp}.safetensors) "
                          f"but this run has {world} process{'es' if world > 1 else ''}; {how}")
    missing = [f"model{i}-mp{mp}.safetensors" for i in range(mp) if i not in ranks]
    if missing:
        raise WeightError(f"{d}: model-parallel shard(s) missing: {', '.join(missing)}")
    f = d / f"model{group.rank}-mp{mp}.safetensors"
    return {k: f for k in _keys(f)}


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return list(fh.keys())
    except _READ_ERRORS as e:  # truncated / corrupt header, unreadable file
        raise WeightError(f"{path}: not a readable safetensors file (truncated or corrupt: {e})") from None


def _meta_state_dict(files: dict[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, Path]], list[str]]:
    """Native name -> meta tensor of the stored shape / dtype, native name -> (stored name,
    file), and problems (unsupported dtypes, two stored names for one native name)."""
    from safetensors import safe_open

    meta: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, Path]] = {}
    problems: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for k in keys:
                    sl = fh.get_slice(k)
                    shape, st = list(sl.get_shape()), sl.get_dtype()
                    native = hf_to_native(k)
                    if native in where:
                        problems.append(f"duplicate: {k} and {where[native][0]} are both {native}")
                        continue
                    if st not in ST_DTYPES:
                        problems.append(f"unsupported dtype: {k} is {st}")
                        continue
                    meta[native] = torch.empty(shape, dtype=ST_DTYPES[st], device="meta")
                    where[native] = (k, f)
        except WeightError:
            raise
        except _READ_ERRORS as e:
            raise WeightError(f"{f}: not a readable safetensors file (truncated or corrupt: {e})") from None
    return meta, where, problems


def _problem_lines(e: WeightError) -> list[str]:
    return [line[4:] for line in str(e).splitlines() if line.startswith("  - ")]


def load_checkpoint_weights(ckpt_dir: str | os.PathLike, cfg: ModelConfig, device: str | torch.device = "cpu",
                            tokenizer=None, group: Group = SINGLE, engram_offload: bool = False, *,
                            with_drafter: bool = True, progress: bool = False):
    """A model of `cfg` on `device` holding the directory's weights (validated first, then
    copied one memory-mapped tensor at a time, each checked for NaN / Inf). Installs the Engram
    compression map of `tokenizer` when given. With a model-parallel `group`, this rank's shard
    of a converted checkpoint is loaded into this rank's part of the model. With
    `engram_offload` the Engram tables are loaded into host memory instead of `device`
    (`Transformer.offload_engram`). Without `with_drafter` the DSpark stages (`mtp.*`) are
    neither built nor read. `progress` shows a bar over the bytes read."""
    from safetensors import safe_open

    from ..core.model import Transformer
    from ..backends.platform import as_storage
    from ..core.weights import count_nonfinite, materialize, progress_bar

    d = Path(ckpt_dir)
    files = _rank_weight_files(d, group)
    meta, where, problems = _meta_state_dict(files)
    if not with_drafter:
        for native in [k for k in where if k.startswith("mtp.")]:
            del meta[native], where[native]
    with torch.device("meta"):
        model = Transformer(cfg, group, with_drafter=with_drafter)
    dequant = _released_forms(model, meta, problems)
    try:
        check_state_dict(model, meta)
    except WeightError as e:
        problems += _problem_lines(e)
    if problems:
        raise WeightError(f"{d}: {len(problems)} problem(s) with the checkpoint's weights:\n  - "
                          + "\n  - ".join(problems))
    vocab = engram_vocab(cfg, tokenizer, d) if tokenizer is not None else None

    if engram_offload:
        model.offload_engram(device)
    model = materialize(model, torch.device(device))
    buffers = dict(model.named_buffers())
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for native, (stored, f) in where.items():
        if native.rpartition(".")[0] not in dequant:
            by_file.setdefault(f, []).append((native, stored))
    total = sum(t.numel() * t.element_size() for t in meta.values())
    with torch.no_grad(), progress_bar(total, "loading weights", progress) as bar:
        for f, pairs in by_file.items():
            try:
                with safe_open(str(f), framework="pt", device="cpu") as fh:
                    for native, stored in pairs:
                        t = fh.get_tensor(stored)
                        bad = count_nonfinite(t)
                        if bad:  # checked here, once, rather than on every step's logits
                            raise WeightError(f"{f}: tensor {stored} holds {bad} NaN/Inf value(s) "
                                              "(a corrupt or badly converted checkpoint)")
                        buffers[native].copy_(as_storage(t, buffers[native].dtype))  # float8: bytes on NPU
                        bar.update(t.numel() * t.element_size())
            except WeightError:
                raise
            except _READ_ERRORS as e:
                raise WeightError(f"{f}: cannot read tensor data (truncated or corrupt: {e})") from None
        for owner in dequant:
            buffers[owner + ".weight"].copy_(_read_dequantised(where, owner))
    if vocab is not None:
        model.set_engram_vocab(*vocab)
    return model


def _released_forms(model, meta: dict[str, torch.Tensor], problems: list[str]) -> list[str]:
    """Accept the released file form of `attn.wo_a` (FP8 + E8M0 block `.scale`, `names.RELEASED_FP8_BF16`)
    for the model's bf16 weight: `meta` then shows the bf16 weight the loader will produce (the
    scale is consumed). Returns the owners to dequantise on load; adds pair problems."""
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    owners, bad = released_fp8_bf16({k: (tuple(v.shape), v.dtype) for k, v in meta.items()}, expected)
    problems += bad
    for owner in owners:
        meta[owner + ".weight"] = torch.empty(meta[owner + ".weight"].shape, dtype=torch.bfloat16, device="meta")
        del meta[owner + ".scale"]
    return owners


def _read_dequantised(where: dict[str, tuple[str, Path]], owner: str) -> torch.Tensor:
    """The bf16 weight of a released-form FP8 `owner` (exact: an E4M3 value times a power of two)."""
    from safetensors import safe_open

    from ..backends.reference.quant import fp8_block_dequant

    parts = []
    for leaf in ("weight", "scale"):
        stored, f = where[f"{owner}.{leaf}"]
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                parts.append(fh.get_tensor(stored))
        except _READ_ERRORS as e:
            raise WeightError(f"{f}: cannot read tensor data (truncated or corrupt: {e})") from None
    return fp8_block_dequant(*parts).to(torch.bfloat16)


def engram_vocab(cfg: ModelConfig, tokenizer, where: str | os.PathLike = "") -> tuple | None:
    """(token -> compressed id map, its size) of `tokenizer` for Engram's hashes, None for a
    model without Engram layers. A config whose `engram_compressed_vocab_size` differs from the
    map's size is a ConfigError (naming `where`): the config and tokenizer do not belong together."""
    if not cfg.engram_layer_ids:
        return None
    from ..core.engram import build_compression_map, check_compressed_vocab

    comp, n_comp = build_compression_map(tokenizer, vocab_size=cfg.vocab_size, pad_token_id=cfg.engram_pad_token_id)
    try:
        check_compressed_vocab(cfg, n_comp)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}" if str(where) else str(e)) from None
    return comp, n_comp


def install_engram_vocab(model, tokenizer) -> None:
    """Install the Engram compression map of `tokenizer` (the token -> compressed id map the
    hashes use) into `model` after checking it against the config (`engram_vocab`); nothing to
    do for a model without Engram layers."""
    vocab = engram_vocab(model.cfg, tokenizer)
    if vocab is not None:
        model.set_engram_vocab(*vocab)


def load_checkpoint(ckpt_dir: str | os.PathLike, device: str | torch.device = "cpu", group: Group = SINGLE):
    """(cfg, model, tokenizer or None) of a checkpoint directory, native- or HF-named, sharded
    or single-file (or this rank's model-parallel shard). Errors are one `ConfigError` /
    `WeightError` naming the file."""
    cfg = read_config(ckpt_dir)
    tok = read_tokenizer(ckpt_dir)
    model = load_checkpoint_weights(ckpt_dir, cfg, device, tok, group)
    return cfg, model, tok
