"""Seeded random weights, produced directly in the checkpoint's storage formats, and loading a
state dict into a model with one error listing every mismatch."""

from __future__ import annotations

import math

import torch

from ..backends.reference import quant
from .model import Linear, Transformer


def _randn(gen: torch.Generator, shape, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def random_state_dict(model: Transformer, seed: int) -> dict[str, torch.Tensor]:
    """A full state dict of seeded random weights in storage formats (CPU tensors).

    Each tensor gets its own generator seeded from (seed, name), so the values of a name do not
    depend on which other tensors exist (model-parallel shards and partial loads agree).
    """
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, buf in model.state_dict().items():
        gen = torch.Generator().manual_seed(_name_seed(seed, name))
        owner, _, leaf = name.rpartition(".")
        if owner in linears:
            if leaf == "scale":
                continue  # produced together with the weight
            if leaf == "bias":  # the vision tower's biased linears
                out[name] = _randn(gen, tuple(buf.shape), 0.02).to(buf.dtype)
                continue
            lin = linears[owner]
            w = _randn(gen, (lin.out_features, lin.in_features), 1.0 / math.sqrt(lin.in_features))
            if lin.storage == "fp8":
                out[name], out[owner + ".scale"] = quant.fp8_block_quant(w)
            elif lin.storage == "fp4":
                out[name], out[owner + ".scale"] = quant.fp4_weight_quant(w)
            else:
                out[name] = w.to(buf.dtype)
            continue
        if name.endswith("engram.embed.weight"):
            out[name], out[owner + ".scale"] = quant.fp8_quant(_randn(gen, tuple(buf.shape), 1.0))
            if buf.dtype == torch.int8:  # INT8 storage: the FP8 rows re-quantised per row, as convert does
                out[name], out[owner + ".scale"] = quant.int8_row_quant(quant.fp8_dequant(out[name], out[owner + ".scale"]))
        elif name.endswith("engram.embed.scale"):
            continue
        elif name in ("embed.weight", "image_start", "image_newline", "image_end"):  # embedding rows
            out[name] = _randn(gen, tuple(buf.shape), 1.0).to(buf.dtype)
        elif leaf == "attn_sink":
            out[name] = _randn(gen, tuple(buf.shape), 1.0)
        elif "_fn" in leaf and leaf.startswith("hc_"):
            out[name] = _randn(gen, tuple(buf.shape), 1.0 / math.sqrt(buf.shape[1]))
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            out[name] = _randn(gen, tuple(buf.shape), 0.5)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            out[name] = 0.5 + 0.1 * _randn(gen, tuple(buf.shape), 1.0)
        elif leaf in ("bias", "bias_vl"):
            out[name] = _randn(gen, tuple(buf.shape), 0.1)
        elif leaf == "weight" and owner.endswith("gate"):
            out[name] = _randn(gen, tuple(buf.shape), 1.0 / math.sqrt(cfg.hidden_size)).to(buf.dtype)
        else:  # norm weights, Engram q/k weights: around 1
            out[name] = (1.0 + 0.1 * _randn(gen, tuple(buf.shape), 1.0)).to(buf.dtype)
    return out


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class WeightError(ValueError):
    """Missing, unexpected, misshapen or wrongly typed tensors, all listed in one message."""


def check_state_dict(model: Transformer, sd: dict[str, torch.Tensor]) -> None:
    """Compare `sd` with what `model` expects; raise one `WeightError` listing every problem."""
    expected = model.state_dict()
    problems = []
    for k in sorted(set(expected) - set(sd)):
        e = expected[k]
        problems.append(f"missing: {k} (expected shape {list(e.shape)}, dtype {e.dtype})")
    for k in sorted(set(sd) - set(expected)):
        problems.append(f"unexpected: {k} (shape {list(sd[k].shape)})")
    for k in sorted(set(sd) & set(expected)):
        e, g = expected[k], sd[k]
        if tuple(g.shape) != tuple(e.shape):
            problems.append(f"wrong shape: {k} is {list(g.shape)}, expected {list(e.shape)}")
        elif g.dtype != e.dtype:
            problems.append(f"wrong dtype: {k} is {g.dtype}, expected {e.dtype}")
    if problems:
        raise WeightError(f"{len(problems)} problem(s) with the weights:\n  - " + "\n  - ".join(problems))


def load_into(model: Transformer, sd: dict[str, torch.Tensor]) -> Transformer:
    """Validate, then copy every tensor into the model's buffers (on the model's device)."""
    check_state_dict(model, sd)
    model.load_state_dict(sd, strict=True, assign=False)
    return model


def materialize(model: Transformer, device: str | torch.device = "cpu") -> Transformer:
    """A meta-device model moved to `device` with uninitialised storage; the non-persistent
    buffers (not in any checkpoint) are recomputed there and every token id is its own Engram
    id until a tokenizer's compression map is installed."""
    from .config import yarn_inv_freq

    cfg = model.cfg
    model = model.to_empty(device=device)
    for m in model.modules():
        if hasattr(m, "inv_freq"):
            m.inv_freq = torch.tensor(yarn_inv_freq(cfg, m.ratio), dtype=torch.float32, device=device)
    model.set_engram_vocab(torch.arange(cfg.vocab_size, device=device), cfg.vocab_size)
    return model


def build_model(cfg, seed: int = 0, device: str | torch.device = "cpu", state_dict=None,
                engram_offload: bool = False) -> Transformer:
    """A model on `device` with seeded random weights (or `state_dict`); with
    `engram_offload`, the Engram tables in host memory (`Transformer.offload_engram`)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if engram_offload:
        model.offload_engram(device)
    model = materialize(model, device)
    sd = state_dict if state_dict is not None else random_state_dict(model, seed)
    return load_into(model, sd)
