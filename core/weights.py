"""Seeded random weights, produced directly in the checkpoint's storage formats, and loading a
state dict into a model with one error listing every mismatch.

Two draws (`init`):
* "realistic" (the default): the released checkpoint's statistics (MODEL.md section 8), so a
  random tiny model is about as well conditioned as the real one and numerics comparisons
  between backends mean something: embedding rows of RMS 0.12; RMSNorm weights around the
  measured means of the text backbone and the drafter (`attn_norm` 0.025, `ffn_norm` 0.2,
  `q_norm` 0.97, `kv_norm` 0.4, compressor `norm` 0.6, indexer `k_norm` 0.5, other norms 1) with
  a spread of 10% of the mean; projections drawn at std = gain * fan_in^-0.5 with the measured
  gains of the attention (`wq_a` 1.6, `wq_b` 0.95, `wkv` 1.8, `wo_a` 1.6, `wo_b` 1.9), the router
  `gate` (2.9) and the expert projections (routed and shared: `w1` 1.5, `w3` 1.5, `w2` 1.05),
  gain 1 for every other projection (the names are matched on the attention / FFN module, so
  the compressor's `wkv`, the indexer's `wq_b` and Engram's `wkv` take gain 1: the measurements
  name the attention projections). FP4 expert weights are rescaled until their decoded RMS equals
  the target std (E2M1 rounding shifts it by up to a few percent). Parameters the measurements
  do not cover (mHC, sinks, router biases, Engram rows and gate weights, the vision tower) are
  drawn as in "unit".
* "unit": the earlier draw: embeddings and norm weights around 1, every projection at
  fan_in^-0.5. Tiny models drawn this way are chaotic (one ulp flips routing and top-k).
"""

from __future__ import annotations

import math
import re

import torch

from ..backends.fused import scale_rows_line_up
from ..backends.platform import as_storage, storage_dtype
from ..backends.reference import quant
from .model import Linear, RMSNorm, Transformer

INITS = ("realistic", "unit")
DEFAULT_INIT = "realistic"

# MODEL.md section 8: statistics of the released checkpoint.
EMBED_RMS = 0.12
NORM_SPREAD = 0.1  # of the mean
# Mean RMSNorm weight by the norm module's name (text backbone and drafter only).
NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
              "k_norm": 0.5}
# Projection gain (std = gain * fan_in^-0.5) by the Linear's name within its block.
PROJECTION_GAINS = {"attn.wq_a": 1.6, "attn.wq_b": 0.95, "attn.wkv": 1.8, "attn.wo_a": 1.6, "attn.wo_b": 1.9,
                    "w1": 1.5, "w3": 1.5, "w2": 1.05}
ROUTER_GAIN = 2.9
_BACKBONE = re.compile(r"^(layers|mtp)\.\d+\.")
_EXPERT_PROJ = re.compile(r"\.ffn\.(experts\.\d+|shared_experts)\.(w[123])$")


def _randn(gen: torch.Generator, shape, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device) * std


def projection_gain(owner: str) -> float:
    """The measured gain of the Linear named `owner` (1 where section 8 names none)."""
    m = _BACKBONE.match(owner)
    if not m:
        return 1.0
    rest = owner[m.end():]
    e = _EXPERT_PROJ.search("." + rest)
    if e:
        return PROJECTION_GAINS[e.group(2)]
    return PROJECTION_GAINS.get(rest, 1.0) if rest.startswith("attn.") else 1.0


def norm_mean(owner: str) -> float:
    """The measured mean RMSNorm weight of the norm named `owner` (1 where none is given)."""
    m = _BACKBONE.match(owner)
    if not m:
        return 1.0
    rest = owner[m.end():]
    for key, mean in NORM_MEANS.items():
        if rest == key or rest.endswith("." + key):
            return mean
    return 1.0


def fp4_at_rms(w: torch.Tensor, target: float, tol: float = 1e-3, steps: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert storage of `w` times a factor c chosen so the decoded weight's RMS equals `target`
    (to `tol`): fixed-point steps c *= target / rms, kept inside the bracket found so far and
    bisected when a step leaves it (E2M1 rounding makes rms(c) a staircase the plain iteration
    can circle around)."""
    c, lo, hi = 1.0, 0.0, math.inf
    for _ in range(steps):
        packed, scale = quant.fp4_weight_quant(w * c)
        rms = float(quant.fp4_weight_dequant(packed, scale).pow(2).mean().sqrt())
        if rms == 0 or abs(rms / target - 1) < tol:
            break
        if rms > target:
            hi = min(hi, c)
        else:
            lo = max(lo, c)
        c = c * target / rms
        if not lo < c < hi:
            c = (lo + hi) / 2
    return packed, scale


def random_state_dict(model: Transformer, seed: int, init: str = DEFAULT_INIT, *, prefix: str = "",
                      cfg=None, draw_device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A full state dict of seeded random weights in storage formats (CPU tensors), drawn
    with the released checkpoint's statistics (`init="realistic"`) or the earlier unit draw
    (`init="unit"`; see the module docstring).

    Each tensor gets its own generator seeded from (seed, name), so the values of a name do not
    depend on which other tensors exist (model-parallel shards and partial loads agree). With
    `prefix` (and the model's `cfg`), `model` is the submodule at that name: its tensors get
    their full names and the values they have in the whole model (`iter_random_state`).

    `draw_device` draws and quantises on that device with its own generator (benchmarks on an
    accelerator: minutes of CPU work become seconds). The statistics are the same; the values
    differ from the CPU draw, which stays the reproducible default.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    real = init == "realistic"
    cfg = cfg or model.cfg
    out: dict[str, torch.Tensor] = {}
    modules = list(model.named_modules(prefix=prefix.rstrip(".")))
    linears = {name: m for name, m in modules if isinstance(m, Linear)}
    norms = {name for name, m in modules if isinstance(m, RMSNorm)}
    for name, buf in model.state_dict(prefix=prefix).items():
        gen = torch.Generator(device=draw_device).manual_seed(_name_seed(seed, name))
        owner, _, leaf = name.rpartition(".")
        if owner in linears and leaf in ("weight", "scale", "bias"):
            if leaf == "scale":
                continue  # produced together with the weight
            if leaf == "bias":  # the vision tower's biased linears
                out[name] = _randn(gen, tuple(buf.shape), 0.02).to(buf.dtype)
                continue
            lin = linears[owner]
            std = (projection_gain(owner) if real else 1.0) / math.sqrt(lin.in_features)
            w = _randn(gen, (lin.out_features, lin.in_features), std)
            if lin.storage == "fp8":
                out[name], out[owner + ".scale"] = quant.fp8_block_quant(w)
            elif lin.storage == "fp4":
                out[name], out[owner + ".scale"] = fp4_at_rms(w, std) if real else quant.fp4_weight_quant(w)
            elif lin.storage == "int8":  # W8A8: per-output-channel scales, as `convert --linear-dtype int8`
                out[name], out[owner + ".scale"] = quant.int8_row_quant(w)
            else:
                out[name] = w.to(buf.dtype)
            continue
        if name.endswith("engram.embed.weight"):
            out[name], out[owner + ".scale"] = _engram_rows(gen, tuple(buf.shape), 1.0, buf.dtype == torch.int8)
        elif name.endswith("engram.embed.scale"):
            continue
        elif name in ("embed.weight", "image_start", "image_newline", "image_end"):  # embedding rows
            out[name] = _randn(gen, tuple(buf.shape), EMBED_RMS if real else 1.0).to(buf.dtype)
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
        elif leaf == "weight" and owner.endswith("gate"):  # the router
            gain = ROUTER_GAIN if real else 1.0
            out[name] = _randn(gen, tuple(buf.shape), gain / math.sqrt(cfg.hidden_size)).to(buf.dtype)
        else:  # norm weights (measured means), Engram q/k weights (one row per stream): around 1
            mean = norm_mean(owner) if real and owner in norms else 1.0
            out[name] = (mean * (1.0 + NORM_SPREAD * _randn(gen, tuple(buf.shape), 1.0))).to(buf.dtype)
    return out


def _engram_rows(gen: torch.Generator, shape: tuple, std: float, int8: bool,
                 chunk_bytes: int = 64 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows `quant.fp8_quant(_randn(gen, shape, std))` (INT8 storage: those re-quantised
    per row, as convert does), drawn and quantised a row chunk at a time so the fp32
    temporaries are one chunk, not the whole table (the largest tensors of the model). The
    values are those of the whole draw: torch's CPU normal draw is sequential in blocks of 16
    values, a row holds a multiple of 32, and both quantisations are row-local."""
    rows, dim = shape
    step = max(1, chunk_bytes // (4 * max(dim, 1)))
    q_out = sc_out = None
    for a in range(0, max(rows, 1), step):
        b = min(rows, a + step)
        q, sc = quant.fp8_quant(_randn(gen, (b - a, dim), std))
        if int8:
            q, sc = quant.int8_row_quant(quant.fp8_dequant(q, sc))
        if q_out is None:  # the outputs' dtypes and row shapes come from the first chunk
            q_out = torch.empty((rows, *q.shape[1:]), dtype=q.dtype, device=q.device)
            sc_out = torch.empty((rows, *sc.shape[1:]), dtype=sc.dtype, device=sc.device)
        q_out[a:b], sc_out[a:b] = q, sc
    return q_out, sc_out


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class WeightError(ValueError):
    """Missing, unexpected, misshapen or wrongly typed tensors, all listed in one message."""


def checkpoint_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """State-dict name -> the dtype a checkpoint holds for it: the float8 format of a buffer that
    holds its bytes in uint8 on this device (`materialize`), else the buffer's own dtype."""
    held = getattr(model, "float8_storage", {})
    return {k: held.get(k, v.dtype) for k, v in model.state_dict().items()}


def check_state_dict(model: Transformer, sd: dict[str, torch.Tensor]) -> None:
    """Compare `sd` with what `model` expects; raise one `WeightError` listing every problem."""
    expected = model.state_dict()
    dtypes = checkpoint_dtypes(model)
    problems = []
    for k in sorted(set(expected) - set(sd)):
        e = expected[k]
        problems.append(f"missing: {k} (expected shape {list(e.shape)}, dtype {dtypes[k]})")
    for k in sorted(set(sd) - set(expected)):
        problems.append(f"unexpected: {k} (shape {list(sd[k].shape)})")
    for k in sorted(set(sd) & set(expected)):
        e, g = expected[k], sd[k]
        if tuple(g.shape) != tuple(e.shape):
            problems.append(f"wrong shape: {k} is {list(g.shape)}, expected {list(e.shape)}")
        elif g.dtype != dtypes[k]:
            problems.append(f"wrong dtype: {k} is {g.dtype}, expected {dtypes[k]}")
    if problems:
        raise WeightError(f"{len(problems)} problem(s) with the weights:\n  - " + "\n  - ".join(problems))


def load_into(model: Transformer, sd: dict[str, torch.Tensor]) -> Transformer:
    """Validate, then copy every tensor into the model's buffers (on the model's device; float8
    tensors as their bytes where the buffers hold bytes)."""
    check_state_dict(model, sd)
    held = model.state_dict()
    model.load_state_dict({k: as_storage(t, held[k].dtype) for k, t in sd.items()}, strict=True, assign=False)
    return model


def materialize(model: Transformer, device: str | torch.device = "cpu") -> Transformer:
    """A meta-device model moved to `device` with uninitialised storage; the non-persistent
    buffers (not in any checkpoint) are recomputed there and every token id is its own Engram
    id until a tokenizer's compression map is installed.

    Float8 buffers get the device's storage dtype for them (`backends.platform.storage_dtype`:
    uint8 bytes on an NPU, which has no float8 tensors; unchanged on CPU / CUDA); the model's
    `float8_storage` names them with their checkpoint dtype, and the loaders copy float8 data in
    as bytes (`as_storage`). Offloaded Engram tables follow the model's device too: their rows
    reach it as bytes."""
    from .config import yarn_inv_freq

    cfg = model.cfg
    model.float8_storage = {}
    for mname, m in model.named_modules():
        for bname, buf in m._buffers.items():
            if buf is not None and buf.is_meta and storage_dtype(buf.dtype, device) != buf.dtype:
                m._buffers[bname] = torch.empty(buf.shape, dtype=storage_dtype(buf.dtype, device), device="meta")
                model.float8_storage[f"{mname}.{bname}" if mname else bname] = buf.dtype
    model = model.to_empty(device=device)
    stack_linears(model)
    for m in model.modules():
        if hasattr(m, "inv_freq"):
            m.inv_freq = torch.tensor(yarn_inv_freq(cfg, m.ratio), dtype=torch.float32, device=device)
    model.set_engram_vocab(torch.arange(cfg.vocab_size, device=device), cfg.vocab_size)
    return model


def stack_linears(model: torch.nn.Module) -> None:
    """Give each pair of linears a module names in `stacked_linears` (two projections of one
    input: the attention's wq_a and wkv, the shared expert's w1 and w3, the compressor's wkv and
    wgate) one allocation, the second weight's rows right after the first's and their scales
    likewise, so that `ops.linear_pair` runs them as ONE linear (one launch, the input quantised
    once; `backends.fused.stacked_pair`). The two buffers become views of it: names, shapes and
    the state dict are unchanged, and the loaders copy into them as before. Pairs of different
    storage or width, or whose scale rows would not line up (`backends.fused.scale_rows_line_up`),
    stay apart (two linears, as before). Run on uninitialised storage (`materialize`): the old
    buffers are dropped, not copied."""
    for m in model.modules():
        for name_a, name_b in getattr(m, "stacked_linears", ()):
            a, b = getattr(m, name_a), getattr(m, name_b)
            wa, wb, sa, sb = a.weight, b.weight, a.scale, b.scale
            if (wa.dtype != wb.dtype or wa.shape[1:] != wb.shape[1:] or (sa is None) != (sb is None)
                    or (sa is not None and (sa.dtype != sb.dtype or sa.shape[1:] != sb.shape[1:]
                                            or not scale_rows_line_up(wa, sa, wb, sb)))):
                continue
            for attr, ta, tb in (("weight", wa, wb), ("scale", sa, sb)):
                if ta is None:
                    continue
                both = torch.empty((ta.shape[0] + tb.shape[0], *ta.shape[1:]), dtype=ta.dtype, device=ta.device)
                a._buffers[attr], b._buffers[attr] = both[:ta.shape[0]], both[ta.shape[0]:]


def build_model(cfg, seed: int = 0, device: str | torch.device = "cpu", state_dict=None,
                engram_offload: bool = False, init: str = DEFAULT_INIT, *, with_drafter: bool = True,
                progress: bool = False, draw_device: str | torch.device = "cpu") -> Transformer:
    """A model on `device` with seeded random weights drawn by `init` (or `state_dict`); with
    `engram_offload`, the Engram tables in host memory (`Transformer.offload_engram`).

    Random weights are drawn and copied in one unit at a time (`iter_random_state`), so the
    peak memory is the model plus one unit's temporaries, not a second copy of the weights;
    `progress` shows a bar over the bytes. Without `with_drafter` the DSpark stages are not built.
    `draw_device`: where the random values are drawn (`random_state_dict`; CPU by default)."""
    with torch.device("meta"):
        model = Transformer(cfg, with_drafter=with_drafter)
    if engram_offload:
        model.offload_engram(device)
    model = materialize(model, device)
    if state_dict is not None:
        return load_into(model, state_dict)
    expected = model.state_dict()
    dtypes = checkpoint_dtypes(model)
    filled: set[str] = set()
    with torch.no_grad(), progress_bar(storage_bytes(model), "random weights", progress) as bar:
        for sd in iter_random_state(model, seed, init, draw_device=draw_device):
            check_state_dict_part(expected, sd, dtypes)
            for name, t in sd.items():
                expected[name].copy_(as_storage(t, expected[name].dtype))
                bar.update(t.numel() * t.element_size())
            filled.update(sd)
    if filled != set(expected):  # pragma: no cover - the units cover the state dict by construction
        raise WeightError(f"random weights left {len(set(expected) - filled)} tensor(s) unset")
    return model


# ---- streaming: bounded memory for random weights and checkpoint writing --------------------

UNIT_BYTES = 256 << 20  # storage bytes per streamed unit (its fp32 temporaries are a few times this)


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s checkpoint tensors in their storage dtypes (works on meta)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def weight_units(module: torch.nn.Module, prefix: str = "", max_bytes: int = UNIT_BYTES):
    """(prefix, module) pieces covering `module`'s state dict, each at most `max_bytes` unless
    it is a single module without children (a Linear, an Engram table). A split module's own
    tensors go into a holder module of their own (`prefix` stays that of the split module)."""
    if storage_bytes(module) <= max_bytes or not any(True for _ in module.children()):
        yield prefix, module
        return
    own = {k: v for k, v in module.state_dict().items() if "." not in k}
    if own:
        holder = torch.nn.Module()
        for k, v in own.items():
            holder.register_buffer(k, v)
        yield prefix, holder
    for name, child in module.named_children():
        yield from weight_units(child, f"{prefix}{name}.", max_bytes)


def iter_random_state(model: Transformer, seed: int, init: str = DEFAULT_INIT, max_bytes: int = UNIT_BYTES,
                      draw_device: str | torch.device = "cpu"):
    """`random_state_dict(model, seed, init)` in pieces (dicts of full names -> tensors), one
    `weight_units` unit at a time: the same values, bounded memory."""
    for prefix, unit in weight_units(model, "", max_bytes):
        yield random_state_dict(unit, seed, init, prefix=prefix, cfg=model.cfg, draw_device=draw_device)


def check_state_dict_part(expected: dict[str, torch.Tensor], part: dict[str, torch.Tensor],
                          dtypes: dict[str, torch.dtype] | None = None) -> None:
    """A streamed piece against the model's state dict: names, shapes and dtypes (`dtypes`: the
    checkpoint dtypes where they differ from the buffers', `checkpoint_dtypes`)."""
    dtypes = dtypes or {}
    bad = [k for k, t in part.items()
           if k not in expected or tuple(t.shape) != tuple(expected[k].shape)
           or t.dtype != dtypes.get(k, expected[k].dtype)]
    if bad:
        raise WeightError(f"{len(bad)} streamed tensor(s) do not match the model, e.g. {bad[:3]}")


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over bytes on stderr (a no-op bar when disabled or when stderr is not a
    terminal and DSV41_PROGRESS is unset, so logs and tests stay clean)."""
    import os
    import sys

    from tqdm import tqdm

    show = enabled and (sys.stderr.isatty() or os.environ.get("DSV41_PROGRESS") == "1")
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not show,
                dynamic_ncols=True, file=sys.stderr)


# ---- non-finite values -------------------------------------------------------------------------

# Bit masks of the NaN / Inf encodings of the 8-bit float formats (all exponent bits set).
_FP8_SPECIAL = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C),
                torch.float8_e8m0fnu: (0xFF, 0xFF)}


def count_nonfinite(t: torch.Tensor) -> int:
    """How many NaN / Inf values `t` holds (0 for integer tensors: packed FP4 has neither)."""
    if t.dtype in _FP8_SPECIAL:
        mask, special = _FP8_SPECIAL[t.dtype]
        return int(((t.view(torch.uint8) & mask) == special).sum())
    if t.is_floating_point():
        return int((~torch.isfinite(t)).sum())
    return 0
