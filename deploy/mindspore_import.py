"""`dsv41 import-mindspore`: MindSpore (HyperParallel) checkpoints -> a native safetensors checkpoint.

HyperParallel trains this model from its Hugging Face definition, so parameter names are
Hugging Face-style (`model.layers.0.self_attn.wq_a.weight`); `deploy/names.py` maps them onto
the native names. What is specific to MindSpore checkpoints (training-wrapper prefixes,
optimizer state and step counters that are skipped) is in the one table below
(`WRAPPER_PREFIXES`, `WRAPPER_COMPONENTS`, `TRAINING_STATE_PREFIXES`, `TRAINING_STATE_NAMES`).

Sources. `ckpt_files` are MindSpore `.ckpt` (protobuf) or `.safetensors` files read with
`mindspore.load_checkpoint` (never pickle). Without a strategy file they are parts of one
complete checkpoint (each name in one file only). With a parallel `strategy` file (protobuf, or
MindSpore's JSON form) they are the per-rank slices in rank order, merged into complete tensors
by MindSpore's own `mindspore.transform_checkpoints` (destination strategy None = unsliced).

Dtypes. The rule for carrying the storage formats through MindSpore (whose 2.10 CPU build
cannot save float8 tensors, and which has no E8M0 type at all):
* a tensor already in the native dtype is copied bit for bit (bf16 through a uint16 view);
* a native one-byte tensor (FP8 E4M3 weights and Engram rows, E8M0 scales, packed-FP4 int8
  experts) may be stored as `uint8` or `int8` of the native shape: its bytes are reinterpreted,
  never converted (a float8 tensor in a checkpoint written elsewhere, e.g. on Ascend, is read
  through a uint8 view; untested, since no such file can be made on CPU);
* with `quantize=True` (`--quantize`), a floating master (fp32 / bf16 / fp16, the form a training
  checkpoint holds) of a weight the config stores quantised is quantised by the reference
  quantisers exactly as `make-checkpoint` does (FP8 32x32 block, FP4 expert pairs + E8M0 per 32,
  FP8 Engram rows), its scale produced alongside; a floating master of another float dtype is
  cast (round to nearest even). Without it every dtype must match, and a config with
  `weight_dtype` / `expert_dtype` bf16 takes bf16 masters unchanged (Engram rows stay FP8).
Everything is checked against the model's expected state dict (`core.weights.check_state_dict`)
before anything is written: unknown names, missing / misshapen / wrongly typed tensors are
listed in one `WeightError`.

Output: `config.json` (the given or source-directory config file, copied unchanged after it
loads and validates), sharded safetensors + index (`checkpoint.write_state_dict`), tokenizer
files (from `tokenizer_path`, else any beside the config file); written into a temporary
directory beside `out_dir` and renamed at the end, so a failure leaves nothing behind. The merged MindSpore checkpoint and all tensors are held in memory.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

INSTALL_HINT = "pip install 'dsv41[mindspore]' (mindspore==2.10.0 with numpy<2)"

# ---- the one table of MindSpore / HyperParallel-specific names -------------------------------
# Prefixes training wrappers (TrainOneStepCell, WithLossCell) may put before the model's names.
WRAPPER_PREFIXES = ("network.", "_backbone.")
# Components FSDP / activation-checkpoint / compile wrappers may insert anywhere in a name.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Optimizer state and gradient accumulators saved next to the weights: skipped (counted).
TRAINING_STATE_PREFIXES = ("adam_m.", "adam_v.", "moment1.", "moment2.", "exp_avg.", "exp_avg_sq.",
                           "accu_grads.", "accum_grads.", "optimizer.")
TRAINING_STATE_NAMES = frozenset({"global_step", "learning_rate", "beta1_power", "beta2_power", "scale_sense",
                                  "loss_scale", "current_iterator_step", "last_overflow_iterator_step",
                                  "epoch_num", "step_num"})
CKPT_SUFFIXES = (".ckpt", ".safetensors")
# What MindSpore raises on corrupt files, bad strategies or a broken install.
MS_ERRORS = (ValueError, RuntimeError, TypeError, OSError, KeyError, IndexError, AttributeError)


class MindSporeImportError(ValueError):
    """An import that cannot proceed (mindspore missing, bad arguments, unreadable source)."""


def ms_to_native(name: str) -> str | None:
    """The native name of a MindSpore parameter name, or None for training state."""
    from .names import hf_to_native

    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    name = ".".join(c for c in name.split(".") if c not in WRAPPER_COMPONENTS)
    if name in TRAINING_STATE_NAMES or name.startswith(TRAINING_STATE_PREFIXES):
        return None
    return hf_to_native(name)


def _mindspore():
    """The `mindspore` module, imported on first use (one sentence if it is missing)."""
    try:
        import mindspore
    except (ImportError, *MS_ERRORS) as e:  # absent, or numpy>=2 breaking it at import
        raise MindSporeImportError(f"importing MindSpore checkpoints needs mindspore: {INSTALL_HINT} "
                                   f"[{type(e).__name__}: {e}]") from None
    return mindspore


# ---- reading --------------------------------------------------------------------------------

def _to_torch(ms, value) -> torch.Tensor:
    """A MindSpore tensor as a CPU torch tensor with the same bits (bf16 / float8 via views)."""
    import numpy as np

    dt = value.dtype
    if dt == ms.bfloat16:
        return torch.from_numpy(value.asnumpy().view(np.uint16).copy()).view(torch.bfloat16)
    fp8 = {ms.float8_e4m3fn: torch.float8_e4m3fn, ms.float8_e5m2: torch.float8_e5m2}
    if dt in fp8:
        return torch.from_numpy(value.view(ms.uint8).asnumpy().copy()).view(fp8[dt])
    try:
        return torch.from_numpy(value.asnumpy().copy())
    except TypeError as e:
        raise MindSporeImportError(f"MindSpore dtype {dt} has no torch equivalent ({e})") from None


def _load(ms, path: Path) -> dict:
    fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    try:
        return ms.load_checkpoint(str(path), format=fmt)
    except MS_ERRORS as e:
        raise MindSporeImportError(f"{path}: not a readable MindSpore checkpoint ({type(e).__name__}: {e})") from None


def _n_devices(ms, strategy: Path) -> int:
    """Ranks a strategy file describes: devices per pipeline stage x stages."""
    layouts = ms.build_searched_strategy(str(strategy))
    if not layouts:
        raise MindSporeImportError(f"{strategy}: the strategy file holds no parameter layouts")
    first = next(iter(layouts.values()))
    stages = {k.split("-", 1)[0] for k in layouts if "-" in k} or {"0"}
    return math.prod(first.dev_matrix[0].dim) * len(stages)


def _merge_ranks(ms, files: list[Path], strategy: Path, work: Path) -> Path:
    """Per-rank slices (rank order) -> one complete MindSpore checkpoint, by
    `mindspore.transform_checkpoints` (it expects `src/rank_{i}/*.ckpt`)."""
    try:
        n = _n_devices(ms, strategy)
    except MindSporeImportError:
        raise
    except MS_ERRORS as e:  # MindSpore's own errors for a malformed file
        raise MindSporeImportError(f"{strategy}: not a MindSpore parallel strategy file ({type(e).__name__}: {e})") from None
    if n != len(files):
        raise MindSporeImportError(f"{strategy}: the strategy describes {n} ranks but {len(files)} checkpoint file(s) "
                                   "were given (pass one --ckpt per rank, in rank order)")
    src, dst = work / "src", work / "dst"
    for rank, f in enumerate(files):
        (src / f"rank_{rank}").mkdir(parents=True)
        os.symlink(f.resolve(), src / f"rank_{rank}" / f.name)
    try:
        ms.transform_checkpoints(str(src), str(dst), "merged", src_strategy_file=str(strategy), dst_strategy_file=None)
    except MS_ERRORS as e:
        raise MindSporeImportError(f"merging {len(files)} rank checkpoints with {strategy} failed "
                                   f"({type(e).__name__}: {e})") from None
    merged = sorted(dst.rglob("*.ckpt")) + sorted(dst.rglob("*.safetensors"))
    if len(merged) != 1:
        raise MindSporeImportError(f"merging with {strategy} produced {len(merged)} files, expected one")
    return merged[0]


def read_mindspore(ms, files: list[Path], strategy: Path | None, work: Path):
    """(native name -> tensor, native name -> MindSpore name, skipped training-state names,
    problems). Duplicate names are problems; unknown names are kept for validation."""
    if strategy is not None:
        files = [_merge_ranks(ms, files, strategy, work)]
    sd: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    skipped: list[str] = []
    problems: list[str] = []
    for f in files:
        params = _load(ms, f)
        for name in list(params):
            value = params.pop(name)  # drop MindSpore's copy as we go: peak ~ one checkpoint, not two
            native = ms_to_native(name)
            if native is None:
                skipped.append(name)
                continue
            if native in origin:
                problems.append(f"duplicate: {name} ({f.name}) and {origin[native]} are both {native}")
                continue
            sd[native] = _to_torch(ms, value)
            origin[native] = name
    return sd, origin, skipped, problems


# ---- dtype rule -----------------------------------------------------------------------------

ONE_BYTE = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
FLOATING = (torch.float32, torch.bfloat16, torch.float16)


def _quantise(native: str, master: torch.Tensor, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The storage tensors (weight + scale) of a floating master, as `make-checkpoint` makes them."""
    from ..backends.reference import quant

    owner = native.rpartition(".")[0]
    w, e = master.float(), expected[native]
    if native.endswith("engram.embed.weight"):
        q, s = quant.fp8_quant(w)
    elif e.dtype == torch.float8_e4m3fn:
        q, s = quant.fp8_block_quant(w)
    else:
        q, s = quant.fp4_weight_quant(w)
    return {native: q, owner + ".scale": s}


def adapt_dtypes(sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], quantize: bool,
                 problems: list[str]) -> tuple[dict, dict]:
    """Apply the module's dtype rule; returns (state dict, counts of reinterpreted / quantised /
    cast tensors). Tensors it cannot adapt are left for `check_state_dict` to report."""
    out: dict[str, torch.Tensor] = {}
    counts = {"reinterpreted": 0, "quantised": 0, "cast": 0}
    for k, t in sd.items():
        e = expected.get(k)
        if e is None or t.dtype == e.dtype:
            out.setdefault(k, t)
            continue
        if e.dtype in ONE_BYTE and t.dtype in (torch.uint8, torch.int8) and t.shape == e.shape:
            out[k] = t.view(e.dtype)
            counts["reinterpreted"] += 1
            continue
        scale = k.rpartition(".")[0] + ".scale"
        if (quantize and t.dtype in FLOATING and k.endswith(".weight") and scale in expected
                and e.dtype in (torch.float8_e4m3fn, torch.int8)):
            if scale in sd:
                problems.append(f"floating master with a stored scale: {k} is {t.dtype} but {scale} exists "
                                f"(store the quantised {e.dtype} weight, or drop the scale)")
                out[k] = t
                continue
            out.update(_quantise(k, t, expected))
            counts["quantised"] += 1
            continue
        if quantize and t.dtype in FLOATING and e.dtype in FLOATING:
            out[k] = t.to(e.dtype)
            counts["cast"] += 1
            continue
        out[k] = t
    return out, counts


# ---- the import -----------------------------------------------------------------------------

def _problem_lines(e: Exception) -> list[str]:
    return [line[4:] for line in str(e).splitlines() if line.startswith("  - ")]


def validate(cfg, sd: dict[str, torch.Tensor], origin: dict[str, str], problems: list[str]) -> None:
    """One `WeightError` listing every problem, unknown names under their MindSpore spelling."""
    from ..core.model import Transformer
    from ..core.weights import WeightError, check_state_dict

    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        check_state_dict(model, sd)
    except WeightError as e:
        for line in _problem_lines(e):
            if line.startswith("unexpected: "):
                native = line[len("unexpected: "):].split(" ", 1)[0]
                ms_name = origin.get(native, native)
                line = f"unknown parameter name: {ms_name} (native name {native}, shape {list(sd[native].shape)})"
            problems.append(line)
    if problems:
        raise WeightError(f"{len(problems)} problem(s) with the MindSpore checkpoint's weights:\n  - "
                          + "\n  - ".join(problems))


def _expected(cfg) -> dict[str, torch.Tensor]:
    from ..core.model import Transformer

    with torch.device("meta"):
        return Transformer(cfg).state_dict()


def _config_file(config, files: list[Path]) -> Path:
    p = Path(config) if config is not None else files[0].parent / "config.json"
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        hint = "" if config is not None else " (pass --config FILE)"
        raise MindSporeImportError(f"{p}: no such config file{hint}")
    return p


def _tokenizer_files(tokenizer_path, cfg_file: Path) -> list[Path]:
    from .convert import TOKENIZER_FILES

    d = Path(tokenizer_path) if tokenizer_path is not None else cfg_file.parent
    found = [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    if tokenizer_path is not None and not found:
        raise MindSporeImportError(f"{d}: no {' or '.join(TOKENIZER_FILES)} found")
    return found


def import_mindspore(ckpt_files, out_dir, config=None, strategy=None, *, tokenizer_path=None, quantize: bool = False,
                     max_shard_bytes: int = 5_000_000_000) -> dict:
    """Import MindSpore checkpoint file(s) into a native checkpoint directory `out_dir`.

    `config`: a config.json (nested or flat) or a directory holding one; default: the one next
    to the first checkpoint file. `strategy`: a parallel strategy file; `ckpt_files` are then
    the per-rank slices in rank order. Returns a small report (tensor count, bytes, skipped
    training state, dtype-rule counts). Raises MindSporeImportError, ConfigError, WeightError,
    CheckpointExistsError or OSError; none of them leaves a partial `out_dir`.
    """
    from ..core.config import load_config
    from .checkpoint import (
        CONFIG_NAME,
        CheckpointExistsError,
        _fsync_dir_tree,
        write_state_dict,
    )

    ms = _mindspore()  # first: without it nothing else can be checked usefully
    files = [Path(f) for f in ([ckpt_files] if isinstance(ckpt_files, (str, os.PathLike)) else ckpt_files)]
    if not files:
        raise MindSporeImportError("no MindSpore checkpoint file given")
    for f in files:
        if not f.is_file():
            raise MindSporeImportError(f"{f}: no such checkpoint file")
        if f.suffix not in CKPT_SUFFIXES:
            raise MindSporeImportError(f"{f}: expected a MindSpore {' or '.join(CKPT_SUFFIXES)} file")
    if strategy is not None and not Path(strategy).is_file():
        raise MindSporeImportError(f"{strategy}: no such strategy file")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointExistsError(f"{out}: exists and is not an empty directory")
    cfg_file = _config_file(config, files)
    cfg = load_config(cfg_file)
    cfg.validate()
    tok_files = _tokenizer_files(tokenizer_path, cfg_file)

    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        work = tmp / ".mindspore-merge"
        sd, origin, skipped, problems = read_mindspore(ms, files, Path(strategy) if strategy else None, work)
        shutil.rmtree(work, ignore_errors=True)
        sd, counts = adapt_dtypes(sd, _expected(cfg), quantize, problems)
        validate(cfg, sd, origin, problems)
        shutil.copyfile(cfg_file, tmp / CONFIG_NAME)
        shards = write_state_dict(sd, tmp, max_shard_bytes)
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
        _fsync_dir_tree(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for t in sd.values()),
            "shards": len(shards), "merged_ranks": len(files) if strategy else 0, "skipped_training_state": len(skipped),
            "tokenizer_files": [f.name for f in tok_files], **counts}
