"""`dsv41 convert`: a checkpoint (native or Hugging Face-style names) -> model-parallel shards
`model{i}-mp{mp}.safetensors` (MODEL.md section 5), streamed.

Streaming. Every source header is parsed first, so every output tensor's name, dtype and shape
(and so every shard's safetensors header) is known before any data moves. Each shard is created
with its full header, then each output tensor's bytes are written at their final offset as they
are produced. Source data is read with plain positioned reads (`readinto` into one buffer) in
row chunks of at most `chunk_bytes` (64 MiB by default), never a whole tensor at once and never
through a memory map (mapped pages would count towards the resident set), so peak memory is
about one chunk plus its conversion temporaries, whatever the size of the largest tensor.
`safetensors.safe_open` is used to validate each source file and, in the tests, to read the
outputs back.

Splits (rank i of mp gets):
* dim 0, in mp equal pieces: `embed`, `head`, attention and indexer `wq_b` (+ their block
  scales), `wo_a`, `attn_sink`, indexer `weights_proj`, the Markov head's `embed` / `head`;
* dim 1, in mp equal pieces: `wo_b` (+ its block scale);
* routed experts `layers.N.ffn.experts.E.*` (n_routed_experts) and `mtp.N.ffn.experts.E.*`
  (dspark_n_routed_experts): rank i holds the contiguous range E in [i*E/mp, (i+1)*E/mp), under
  their GLOBAL expert ids (names are not renumbered; a loader maps id -> local slot);
* Engram `engram.embed.{weight,scale}`: rows in pieces of ceil(rows/mp), rank i gets rows
  [i*c, min(rows, (i+1)*c)) (the last piece may be shorter, possibly empty);
* everything else (including `vision.*`, `aligner.*`, `image_*`) replicated on every rank.
Split FP8 block-scaled weights must split on 32-row/column block boundaries (checked).

The released file form of `attn.wo_a` (FP8 E4M3 + `.scale`, E8M0 per 32x32 block; see
`names.RELEASED_FP8_BF16`) is dequantised to the bf16 weight the model holds, as the official
convert.py does (exact: an E4M3 value times a power of two), then split on dim 0 like `wo_a`.

Optional re-encodings: `expert_dtype='fp8'` turns FP4 routed experts (int8 pairs + E8M0 per 32)
into FP8 E4M3 with E8M0 32x32 block scales (via fp32, exactly what `fp8_block_quant` does);
`engram_dtype='int8'` re-quantises the FP8 Engram rows to int8 with one fp32 scale per row
(`scale` becomes F32 [rows, 1]; scale = amax/127, round half to even, clamp to +-127) and
reports the error against the FP8 rows.

`linear_dtype='int8'` (W8A8 for Atlas A2/A3, which have no FP8 matmul) turns every FP8
block-scaled linear and every FP4 routed expert into an int8 weight [N, K] with one fp32 scale
per output channel (`scale` F32 [N, 1]; amax/127 per row of the dequantised weight, round half to
even) -- the per-channel weight of vllm-ascend's W8A8_DYNAMIC scheme, whose activations are
quantised per token at run time -- writes `quant_model_description.json` (W8A8_DYNAMIC per int8
weight, FLOAT for the rest) and reports the quantisation error per tensor kind.

Output: the shards, a nested Hugging Face `config.json` (the source config, `expert_dtype` set in
`quantization_config` together with `engram_dtype`, and a top-level `model_parallel`), and the
tokenizer files. Written into a temporary directory beside the destination and renamed at the
end; any failure (including KeyboardInterrupt) removes it and leaves no destination.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SHARD_NAME = "model{i}-mp{mp}.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEFAULT_CHUNK_BYTES = 64 << 20

# safetensors dtype names <-> torch dtypes
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in ST_TO_TORCH.items()}


class ConvertError(ValueError):
    """A conversion that cannot proceed (bad arguments, bad source, unwritable destination)."""


# ---- source side --------------------------------------------------------------------------

@dataclass
class SrcTensor:
    name: str          # name in the source file
    native: str        # native name
    file: Path
    dtype: str         # safetensors dtype string
    shape: tuple
    start: int         # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, absolute offset of the data section) of a safetensors file, validated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > min(size - 8, 1 << 30):
            raise ConvertError(f"{path}: not a safetensors file or truncated (header length {hlen}, file {size} bytes)")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConvertError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + hlen
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dt, shape, (s, t) = e.get("dtype"), e.get("shape"), e.get("data_offsets", (None, None))
        if dt not in ST_TO_TORCH:
            raise ConvertError(f"{path}: tensor {name} has unsupported dtype {dt!r}")
        want = math.prod(shape) * ITEMSIZE[dt]
        if t - s != want:
            raise ConvertError(f"{path}: tensor {name} has {t - s} bytes, its shape {shape} x {dt} needs {want}")
        if base + t > size:
            raise ConvertError(f"{path}: truncated: tensor {name} ends at byte {base + t}, the file has {size}")
    return header, base


def _read_into(f, offset: int, nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        f.seek(offset)
        got = f.readinto(memoryview(buf.numpy()))
        if got != nbytes:
            raise ConvertError(f"{f.name}: short read at byte {offset} ({got} of {nbytes} bytes): truncated?")
    return buf


def read_rows(f, t: SrcTensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of `t` as a tensor of its dtype, shape [b - a, *shape[1:]]."""
    buf = _read_into(f, t.start + a * t.row_bytes, (b - a) * t.row_bytes)
    out = buf.view(ST_TO_TORCH[t.dtype])
    return out.reshape((b - a, *t.shape[1:])) if t.shape else out.reshape(())


def _hf_to_native():
    try:
        from .names import hf_to_native
        return hf_to_native
    except ImportError:  # names.py not available: native names only
        return lambda n: n


def discover(src: Path) -> list[SrcTensor]:
    """Every tensor of the source checkpoint (index + shards, or all *.safetensors)."""
    index = src / "model.safetensors.index.json"
    to_native = _hf_to_native()
    if index.exists():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{index}: unreadable index ({e})") from None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ConvertError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
        files = sorted(set(wmap.values()))
        outside = [f for f in files if Path(f).name != f or f in (".", "..")]
        if outside:  # as the loader: shards are plain names inside the checkpoint directory
            raise ConvertError(f"{index}: shard {outside[0]!r} is not a plain file name in the checkpoint directory")
    else:
        wmap = None
        files = sorted(p.name for p in src.glob("*.safetensors"))
        if not files:
            from .checkpoint import no_weights_message

            raise ConvertError(no_weights_message(src))
    out: list[SrcTensor] = []
    seen: dict[str, Path] = {}
    for fn in files:
        path = src / fn
        if not path.exists():
            raise ConvertError(f"{index}: lists {fn}, which does not exist")
        header, base = read_header(path)
        try:  # second opinion from the safetensors library itself
            from safetensors import safe_open
            with safe_open(str(path), "pt") as sf:
                lib_keys = set(sf.keys())
        except Exception as e:  # noqa: BLE001 - the library's own message is the useful part
            raise ConvertError(f"{path}: safetensors cannot open it ({e})") from None
        names = [k for k in header if k != "__metadata__"]
        if set(names) != lib_keys:
            raise ConvertError(f"{path}: header and safetensors disagree on the tensor list")
        for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
            e = header[name]
            if wmap is not None and wmap.get(name) != fn:
                raise ConvertError(f"{path}: tensor {name} is not indexed to this file in {index.name} "
                                   f"(index says {wmap.get(name)!r})")
            native = to_native(name)
            if native in seen:
                raise ConvertError(f"tensor {native} appears twice ({seen[native]} and {path})")
            seen[native] = path
            s, t = e["data_offsets"]
            out.append(SrcTensor(name, native, path, e["dtype"], tuple(e["shape"]), base + s, t - s))
    if wmap is not None:
        missing = sorted(set(wmap) - {t.name for t in out})
        if missing:
            raise ConvertError(f"{index}: {len(missing)} indexed tensor(s) not found in their files, e.g. {missing[:5]}")
    return out


# ---- plan -------------------------------------------------------------------------------

_NONMODEL = re.compile(r"^(vision\.|aligner\.|image_(start|newline|end)\b|mtp\.\d+\.)")
_DIM0 = re.compile(
    r"^(embed\.weight|head\.weight)$"
    r"|^(layers|mtp)\.\d+\.attn\.(wq_b|wo_a|indexer\.wq_b|indexer\.weights_proj)\.(weight|scale)$"
    r"|^(layers|mtp)\.\d+\.attn\.attn_sink$"
    r"|^mtp\.\d+\.markov_head\.(embed|head)(\.weight|\.scale)?$"
)
_DIM1 = re.compile(r"^(layers|mtp)\.\d+\.attn\.wo_b\.(weight|scale)$")
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_ENGRAM = re.compile(r"^layers\.\d+\.engram\.embed\.(weight|scale)$")


@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple
    offset: int = 0    # within the data section, filled when the header is built
    written: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass
class Unit:
    """Source tensors consumed together and what each rank gets from them."""
    # replicate | dim0 | dim1 | expert | engram | expert_fp8 | engram_int8 | linear_int8 | dequant_dim0
    kind: str
    src: list[SrcTensor]
    outs: dict[int, list[OutTensor]] = field(default_factory=dict)   # rank -> outputs
    split: str = "expert"           # linear_int8: how the int8 weight is split (dim0 | dim1 | replicate | expert)


def expected_tensors(cfg) -> dict[str, tuple[tuple, torch.dtype]]:
    """name -> (shape, dtype) of every buffer the model loads (built on the meta device)."""
    from ..core.model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def check_parallel(cfg, mp: int) -> None:
    if not isinstance(mp, int) or mp < 1:
        raise ConvertError(f"--model-parallel must be a positive integer, got {mp!r}")
    checks = [("n_routed_experts", cfg.n_routed_experts), ("num_attention_heads", cfg.num_attention_heads),
              ("o_groups", cfg.o_groups), ("index_n_heads", cfg.index_n_heads), ("vocab_size", cfg.vocab_size)]
    if cfg.num_nextn_predict_layers > 0 and cfg.dspark_n_routed_experts:
        checks.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts))
    bad = [f"{k} = {v}" for k, v in checks if v % mp]
    if bad:
        raise ConvertError(f"--model-parallel {mp} does not divide " + ", ".join(bad))


def _split_shape(shape: tuple, dim: int, mp: int, name: str) -> tuple:
    if len(shape) <= dim or shape[dim] % mp:
        raise ConvertError(f"{name}: shape {list(shape)} cannot be split in {mp} on dim {dim}")
    s = list(shape)
    s[dim] //= mp
    return tuple(s)


def _int8_outs(kind: str, name: str, shape: tuple, mp: int, rank: int | None) -> dict[int, list[OutTensor]]:
    """Per rank, the int8 weight [N, K] and fp32 scale [N, 1] pieces of a W8A8 linear split as
    `kind` (dim0: rows, dim1: columns -- every rank keeps the full per-row scale)."""
    owner = name.rsplit(".", 1)[0]
    n, k = shape
    if kind == "expert":
        return {rank: [OutTensor(owner + ".weight", "I8", (n, k)), OutTensor(owner + ".scale", "F32", (n, 1))]}
    if kind == "dim0":
        n = _split_shape(shape, 0, mp, name)[0]
    if kind == "dim1":
        k = _split_shape(shape, 1, mp, name)[1]
    return {i: [OutTensor(owner + ".weight", "I8", (n, k)), OutTensor(owner + ".scale", "F32", (n, 1))]
            for i in range(mp)}


def plan(cfg, tensors: list[SrcTensor], mp: int, expert_dtype: str, engram_dtype: str,
         linear_dtype: str = "native") -> list[Unit]:
    from .names import released_fp8_bf16

    expected = expected_tensors(cfg)
    by_native = {t.native: t for t in tensors}
    released, problems = released_fp8_bf16({t.native: (t.shape, ST_TO_TORCH[t.dtype]) for t in tensors}, expected)
    released_names = {f"{o}.{leaf}" for o in released for leaf in ("weight", "scale")}
    for t in tensors:
        if t.native in released_names:
            continue
        if t.native in expected:
            shape, dt = expected[t.native]
            if t.shape != shape or ST_TO_TORCH[t.dtype] != dt:
                problems.append(f"{t.name}: {t.dtype} {list(t.shape)}, the config expects "
                                f"{TORCH_TO_ST.get(dt, dt)} {list(shape)}")
        elif not _NONMODEL.match(t.native):
            problems.append(f"unknown tensor {t.name}" + (f" (native {t.native})" if t.native != t.name else ""))
    missing = sorted(set(expected) - set(by_native))
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the source, e.g. {missing[:5]}")
    if problems:
        raise ConvertError(f"{len(problems)} problem(s) with the source tensors:\n  - " + "\n  - ".join(problems))
    if expert_dtype == "fp4" and cfg.expert_dtype == "fp8":
        raise ConvertError("the source's experts are FP8; converting them to FP4 is not supported")

    n_experts = {"layers": cfg.n_routed_experts, "mtp": cfg.dspark_n_routed_experts}
    units: list[Unit] = []
    paired: set[str] = set()
    for owner in released:  # FP8 wo_a of the release -> the model's bf16, split on dim 0
        w, s = by_native[owner + ".weight"], by_native[owner + ".scale"]
        shape = _split_shape(w.shape, 0, mp, w.name)
        paired.update((w.native, s.native))
        units.append(Unit("dequant_dim0", [w, s], {i: [OutTensor(w.native, "BF16", shape)] for i in range(mp)}))
    if linear_dtype == "int8":  # the scales travel with their weights, whichever comes first
        for t in tensors:
            if t.native.endswith(".weight") and (t.dtype == "F8_E4M3" or (t.dtype == "I8" and _EXPERT.match(t.native))) \
                    and not _ENGRAM.match(t.native):
                paired.add(t.native[: -len(".weight")] + ".scale")
    for t in tensors:
        if t.native in paired:
            continue
        n = t.native
        m = _EXPERT.match(n)
        if m and not n.startswith(("vision.", "aligner.")):
            total = n_experts[m.group(1)]
            e = int(m.group(3))
            if e >= total:
                raise ConvertError(f"{t.name}: expert id {e} >= {total}")
            rank = e // (total // mp)
            owner = n.rsplit(".", 1)[0]
            w, s = by_native.get(owner + ".weight"), by_native.get(owner + ".scale")
            if linear_dtype == "int8" and w is not None and s is not None and w.dtype in ("I8", "F8_E4M3"):
                paired.update((w.native, s.native))
                k = w.shape[1] * (2 if w.dtype == "I8" else 1)
                units.append(Unit("linear_int8", [w, s], _int8_outs("expert", w.native, (w.shape[0], k), mp, rank)))
                continue
            if expert_dtype == "fp8" and w is not None and w.dtype == "I8":
                if w is None or s is None or s.dtype != "F8_E8M0" or len(w.shape) != 2:
                    raise ConvertError(f"{owner}: an FP4 expert needs an int8 weight and an E8M0 scale")
                nrow, k = w.shape[0], w.shape[1] * 2
                paired.update((w.native, s.native))
                units.append(Unit("expert_fp8", [w, s], {rank: [
                    OutTensor(w.native, "F8_E4M3", (nrow, k)),
                    OutTensor(s.native, "F8_E8M0", (-(-nrow // 32), -(-k // 32)))]}))
            else:
                units.append(Unit("expert", [t], {rank: [OutTensor(n, t.dtype, t.shape)]}))
            continue
        if _ENGRAM.match(n):
            rows = t.shape[0]
            c = -(-rows // mp)
            ranges = [(min(rows, i * c), min(rows, (i + 1) * c)) for i in range(mp)]
            owner = n.rsplit(".", 1)[0]
            w, s = by_native.get(owner + ".weight"), by_native.get(owner + ".scale")
            if engram_dtype == "int8" and w is not None and w.dtype == "F8_E4M3":
                if w is None or s is None or s.shape[0] != rows:
                    raise ConvertError(f"{owner}: FP8 Engram rows need a scale per row")
                paired.update((w.native, s.native))
                units.append(Unit("engram_int8", [w, s], {i: [
                    OutTensor(w.native, "I8", (b - a, *w.shape[1:])),
                    OutTensor(s.native, "F32", (b - a, 1))] for i, (a, b) in enumerate(ranges)}))
            else:
                units.append(Unit("engram", [t], {i: [OutTensor(n, t.dtype, (b - a, *t.shape[1:]))]
                                                  for i, (a, b) in enumerate(ranges)}))
            continue
        if linear_dtype == "int8" and n.endswith(".weight") and t.dtype == "F8_E4M3":
            s = by_native.get(n[: -len(".weight")] + ".scale")
            if s is None or s.dtype != "F8_E8M0":
                raise ConvertError(f"{t.name}: an FP8 linear needs an E8M0 block scale")
            kind = "dim0" if _DIM0.match(n) else "dim1" if _DIM1.match(n) else "replicate"
            paired.update((t.native, s.native))
            units.append(Unit("linear_int8", [t, s], _int8_outs(kind, n, t.shape, mp, None)))
            units[-1].split = kind
            continue
        for kind, rx, dim in (("dim0", _DIM0, 0), ("dim1", _DIM1, 1)):
            if rx.match(n):
                shape = _split_shape(t.shape, dim, mp, t.name)
                if n.endswith(".weight") and t.dtype == "F8_E4M3" and mp > 1 and shape[dim] % 32:
                    raise ConvertError(f"{t.name}: FP8 32x32 blocks would straddle ranks "
                                       f"({t.shape[dim]} / {mp} = {shape[dim]} is not a multiple of 32)")
                units.append(Unit(kind, [t], {i: [OutTensor(n, t.dtype, shape)] for i in range(mp)}))
                break
        else:
            units.append(Unit("replicate", [t], {i: [OutTensor(n, t.dtype, t.shape)] for i in range(mp)}))
    consumed = [s.native for u in units for s in u.src]
    if sorted(consumed) != sorted(t.native for t in tensors):
        left = sorted({t.native for t in tensors} - set(consumed))
        raise ConvertError(f"{len(left)} source tensor(s) not consumed by any rule: {left[:5]}")
    return units


def shard_of(cfg, native: str, t: torch.Tensor, rank: int, mp: int) -> torch.Tensor | None:
    """Rank `rank`'s piece of one full tensor under the same rules as `plan` (for loaders that
    receive whole tensors, e.g. the vLLM plugin under tensor parallelism); None when the rank
    holds none of it (another rank's routed expert)."""
    if mp == 1:
        return t
    m = _EXPERT.match(native)
    if m:
        total = {"layers": cfg.n_routed_experts, "mtp": cfg.dspark_n_routed_experts}[m.group(1)]
        return t if int(m.group(3)) // (total // mp) == rank else None
    if _ENGRAM.match(native):
        c = -(-t.shape[0] // mp)
        return t[min(t.shape[0], rank * c):min(t.shape[0], (rank + 1) * c)]
    for rx, dim in ((_DIM0, 0), (_DIM1, 1)):
        if rx.match(native):
            n = _split_shape(tuple(t.shape), dim, mp, native)[dim]
            return t.narrow(dim, rank * n, n)
    return t


# ---- writer -------------------------------------------------------------------------------

class ShardWriter:
    """A safetensors file whose header is written first; tensor bytes go to known offsets."""

    def __init__(self, path: Path, outs: list[OutTensor], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.outs = {o.name: o for o in outs}
        if len(self.outs) != len(outs):
            raise ConvertError(f"{path}: duplicate tensor names")
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        off = 0
        for o in outs:
            o.offset = off
            header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [off, off + o.nbytes]}
            off += o.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.base = 8 + len(raw)
        self.size = self.base + off
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
        self._write_all(struct.pack("<Q", len(raw)) + raw, 0)

    def _write_all(self, data, pos: int) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.pwrite(self.fd, mv, pos)
            mv, pos = mv[n:], pos + n

    def write(self, name: str, t: torch.Tensor, at: int | None = None) -> int:
        """Write `t`'s bytes into tensor `name` at byte `at` (default: after what was written)."""
        o = self.outs[name]
        at = o.written if at is None else at
        b = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if at + b.numel() > o.nbytes:
            raise ConvertError(f"{self.path.name}: {name} overflows its {o.nbytes} bytes")
        if b.numel():
            self._write_all(b.numpy(), self.base + o.offset + at)
        o.written += b.numel()
        return b.numel()

    def close(self, check: bool = True) -> None:
        if self.fd is None:
            return
        try:
            if check:
                short = [f"{o.name} ({o.written}/{o.nbytes})" for o in self.outs.values() if o.written != o.nbytes]
                if short:
                    raise ConvertError(f"{self.path.name}: incompletely written: {short[:5]}")
                os.ftruncate(self.fd, self.size)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None


# ---- conversion kernels -------------------------------------------------------------------

def _chunk_rows(t: SrcTensor, chunk_bytes: int, multiple: int = 1) -> int:
    r = max(1, chunk_bytes // max(1, t.row_bytes))
    return max(multiple, r // multiple * multiple)


def _engram_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 rows [r, D] -> (int8 [r, D], fp32 scale [r, 1], per-row max rel err, per-row mean rel err)."""
    from ..backends.reference.quant import int8_row_quant

    q, scale = int8_row_quant(x)
    amax = scale * 127.0
    err = (q.float() * scale - x).abs() / torch.where(amax > 0, amax, torch.ones_like(amax))
    return q, scale, err.amax(-1), err.mean(-1)


def _run_unit(u: Unit, writers: list[ShardWriter], files: dict, chunk: int, report: dict, bar) -> None:
    from ..backends.reference import quant

    def fh(t: SrcTensor):
        if t.file not in files:
            files[t.file] = open(t.file, "rb")  # noqa: SIM115 - closed by convert()
        return files[t.file]

    def tick(n):
        report["bytes_read"] += n
        if bar is not None:
            bar.update(n)

    if u.kind in ("replicate", "dim0", "dim1", "expert", "engram"):
        t = u.src[0]
        f = fh(t)
        if u.kind == "engram":
            c = -(-t.shape[0] // len(writers))
        step = _chunk_rows(t, chunk)
        for a in range(0, t.rows, step):
            b = min(t.rows, a + step)
            x = read_rows(f, t, a, b)
            tick(x.numel() * x.element_size())
            if u.kind in ("replicate", "expert"):
                for r in u.outs:
                    writers[r].write(t.native, x)
            elif u.kind == "dim0":
                per = t.shape[0] // len(writers)
                for r in range(len(writers)):
                    lo, hi = max(a, r * per), min(b, (r + 1) * per)
                    if lo < hi:
                        writers[r].write(t.native, x[lo - a:hi - a])
            elif u.kind == "dim1":
                per = t.shape[1] // len(writers)
                for r in range(len(writers)):
                    writers[r].write(t.native, x[:, r * per:(r + 1) * per])
            else:  # engram rows
                for r in range(len(writers)):
                    lo, hi = max(a, r * c), min(b, (r + 1) * c)
                    if lo < hi:
                        writers[r].write(t.native, x[lo - a:hi - a])
            del x
        return

    w, s = u.src
    fw, fs = fh(w), fh(s)
    if u.kind == "dequant_dim0":
        per = w.shape[0] // len(writers)
        step = _chunk_rows(w, max(1, chunk // 8), 32)  # whole 32-row scale blocks per chunk
        for a in range(0, w.rows, step):
            b = min(w.rows, a + step)
            xw, xs = read_rows(fw, w, a, b), read_rows(fs, s, a // 32, -(-b // 32))
            tick(xw.numel() + xs.numel())
            x = quant.fp8_block_dequant(xw, xs).to(torch.bfloat16)
            for r in range(len(writers)):
                lo, hi = max(a, r * per), min(b, (r + 1) * per)
                if lo < hi:
                    writers[r].write(w.native, x[lo - a:hi - a])
        report["counts"]["fp8_dequantised"] += 1
        return
    if u.kind == "expert_fp8":
        (r,) = u.outs
        step = _chunk_rows(w, max(1, chunk // 16), 32)   # fp32 temporaries are ~16x the packed bytes
        for a in range(0, w.rows, step):
            b = min(w.rows, a + step)
            xw, xs = read_rows(fw, w, a, b), read_rows(fs, s, a, b)
            tick(xw.numel() + xs.numel())
            q, sc = quant.fp8_block_quant(quant.fp4_weight_dequant(xw, xs))
            writers[r].write(w.native, q)
            writers[r].write(s.native, sc)
        report["counts"]["expert_fp8_converted"] += 1
        return

    if u.kind == "linear_int8":
        _run_linear_int8(u, w, s, fw, fs, writers, chunk, report, tick)
        return

    # engram_int8
    rows = w.shape[0]
    c = -(-rows // len(writers))
    worst, total_mean, n = 0.0, 0.0, 0
    step = _chunk_rows(w, max(1, chunk // 8))
    for r in range(len(writers)):
        lo, hi = min(rows, r * c), min(rows, (r + 1) * c)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            xw, xs = read_rows(fw, w, a, b), read_rows(fs, s, a, b)
            tick(xw.numel() + xs.numel() * xs.element_size())
            x = quant.fp8_dequant(xw, xs.reshape(b - a, -1))
            q, sc, emax, emean = _engram_int8(x)
            writers[r].write(w.native, q)
            writers[r].write(s.native, sc)
            if emax.numel():
                worst = max(worst, float(emax.max()))
                total_mean += float(emean.sum())
                n += emax.numel()
    report["engram_int8_error"][w.native] = {"rows": rows, "max_rel": worst, "mean_rel": total_mean / max(n, 1)}
    report["counts"]["engram_int8_converted"] += 1


def tensor_kind(native: str) -> str:
    """The kind of a tensor for error reports: its name with layer / expert numbers as '*'."""
    return re.sub(r"\.\d+(?=\.)", ".*", native.rsplit(".", 1)[0])


def _run_linear_int8(u: Unit, w: SrcTensor, s: SrcTensor, fw, fs, writers, chunk: int, report: dict, tick) -> None:
    """FP8 (32x32 block scales) or FP4 (E8M0 per 32) weight rows -> int8 + fp32 scale per row,
    written split as `u.split`; the relative error of the dequantised int8 weight (per row, of
    the row's amax) goes to the report under the tensor's kind."""
    from ..backends.reference import quant

    fp4 = w.dtype == "I8"
    step = _chunk_rows(w, max(1, chunk // 16), 32)  # whole 32-row scale blocks; fp32 temporaries
    worst, err_sum, n_rows = 0.0, 0.0, 0
    owner = w.native.rsplit(".", 1)[0]
    for a in range(0, w.rows, step):
        b = min(w.rows, a + step)
        xw = read_rows(fw, w, a, b)
        xs = read_rows(fs, s, a, b) if fp4 else read_rows(fs, s, a // 32, -(-b // 32))
        tick(xw.numel() + xs.numel())
        x = quant.fp4_weight_dequant(xw, xs) if fp4 else quant.fp8_block_dequant(xw, xs)[: b - a]
        q, sc = quant.int8_row_quant(x)
        amax = (sc * 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        err = ((q.float() * sc - x).abs() / amax).amax(-1)
        worst, err_sum, n_rows = max(worst, float(err.max())), err_sum + float(err.sum()), n_rows + err.numel()
        mp = len(writers)
        if u.split == "dim0":
            per = w.shape[0] // mp
            for r in range(mp):
                lo, hi = max(a, r * per), min(b, (r + 1) * per)
                if lo < hi:
                    writers[r].write(owner + ".weight", q[lo - a:hi - a])
                    writers[r].write(owner + ".scale", sc[lo - a:hi - a])
        elif u.split == "dim1":
            per = q.shape[1] // mp
            for r in range(mp):
                writers[r].write(owner + ".weight", q[:, r * per:(r + 1) * per])
                writers[r].write(owner + ".scale", sc)
        else:
            for r in u.outs:
                writers[r].write(owner + ".weight", q)
                writers[r].write(owner + ".scale", sc)
    e = report["linear_int8_error"].setdefault(tensor_kind(w.native), {"tensors": 0, "rows": 0, "max_rel": 0.0, "sum_rel": 0.0})
    e["tensors"] += 1
    e["rows"] += n_rows
    e["max_rel"] = max(e["max_rel"], worst)
    e["sum_rel"] += err_sum
    report["counts"]["linear_int8_converted"] += 1


def quant_description(units: list[Unit]) -> dict[str, str]:
    """vllm-ascend's `quant_model_description.json` for a W8A8 conversion: W8A8_DYNAMIC for each
    int8 weight, FLOAT for every other weight (names as written, i.e. native)."""
    desc = {"model_quant_type": "W8A8_DYNAMIC"}
    for u in units:
        for o in next(iter(u.outs.values()), []):
            if o.name.endswith(".weight"):
                desc[o.name] = "W8A8_DYNAMIC" if u.kind == "linear_int8" else "FLOAT"
    return desc


# ---- driver -------------------------------------------------------------------------------

def _check_destination(dst: Path) -> None:
    if dst.exists():
        raise ConvertError(f"{dst}: the destination already exists (choose a new --save-path)")
    parent = dst.parent
    if not parent.exists():
        raise ConvertError(f"{dst}: cannot write: its parent directory {parent} does not exist")
    if not parent.is_dir():
        raise ConvertError(f"{dst}: cannot write: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConvertError(f"{dst}: cannot write: no write permission on {parent}")


def convert(src_dir, dst_dir, model_parallel: int, expert_dtype: str = "fp4", engram_dtype: str = "fp8",
            tokenizer_path=None, progress: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            linear_dtype: str = "native") -> dict:
    """Convert `src_dir` into `model_parallel` shards in `dst_dir`; returns a report dict."""
    from ..core.config import ConfigError, load_config

    t0 = time.perf_counter()
    src, dst = Path(src_dir), Path(dst_dir)
    if expert_dtype not in ("fp4", "fp8"):
        raise ConvertError(f"--expert-dtype must be fp4 or fp8, got {expert_dtype!r}")
    if engram_dtype not in ("fp8", "int8"):
        raise ConvertError(f"--engram-dtype must be fp8 or int8, got {engram_dtype!r}")
    if linear_dtype not in ("native", "int8"):
        raise ConvertError(f"--linear-dtype must be native or int8, got {linear_dtype!r}")
    if not src.is_dir():
        raise ConvertError(f"{src}: the source checkpoint directory does not exist")
    _check_destination(dst)
    try:
        cfg = load_config(src)
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    mp = model_parallel
    check_parallel(cfg, mp)
    tok_dir = Path(tokenizer_path) if tokenizer_path else src
    tok_files = [tok_dir / n for n in TOKENIZER_FILES if (tok_dir / n).exists()]
    if tokenizer_path and not tok_files:
        raise ConvertError(f"{tok_dir}: no {' or '.join(TOKENIZER_FILES)} found")

    tensors = discover(src)
    units = plan(cfg, tensors, mp, expert_dtype, engram_dtype, linear_dtype)
    counts = {k: 0 for k in ("replicate", "dim0", "dim1", "expert", "engram", "expert_fp8", "engram_int8", "linear_int8",
                             "dequant_dim0")}
    for u in units:
        counts[u.kind] += 1
    report: dict[str, Any] = {
        "src": str(src), "dst": str(dst), "model_parallel": mp, "expert_dtype": expert_dtype,
        "engram_dtype": engram_dtype, "config_format": "nested",
        "source_tensors": len(tensors), "source_bytes": sum(t.nbytes for t in tensors),
        "consumed_tensors": sum(len(u.src) for u in units),
        "units": counts,
        "counts": {"expert_fp8_converted": 0, "engram_int8_converted": 0, "linear_int8_converted": 0,
                   "fp8_dequantised": 0},
        "bytes_read": 0, "engram_int8_error": {}, "linear_dtype": linear_dtype, "linear_int8_error": {},
        "largest_source_tensor_bytes": max((t.nbytes for t in tensors), default=0),
    }

    from .outdir import DestinationBusy, clean_stale_temps, destination_lock

    try:
        with destination_lock(dst):
            _check_destination(dst)  # again, now that no other writer can create it
            for p in clean_stale_temps(dst):
                print(f"dsv41: note: removed {p}, left by an interrupted run", file=sys.stderr)
            return _convert_into(dst, cfg, units, report, mp, tok_files, progress, chunk_bytes, t0)
    except DestinationBusy as e:
        raise ConvertError(str(e)) from None
    except OSError as e:  # disk full, a read-only or special destination: the temp dir is gone
        raise ConvertError(f"{dst}: cannot write the converted checkpoint ({e.filename + ': ' if e.filename else ''}"
                           f"{e.strerror or e}); nothing was written") from None


def _convert_into(dst: Path, cfg, units: list[Unit], report: dict, mp: int, tok_files: list[Path],
                  progress: bool, chunk_bytes: int, t0: float) -> dict:
    """`convert`'s writing half (holding the destination lock): the shards, config and
    tokenizer into a temporary folder beside `dst`, renamed to `dst` at the end; any failure
    removes the temporary folder."""
    from .outdir import temp_dir_beside

    tmp = temp_dir_beside(dst)
    writers: list[ShardWriter] = []
    files: dict = {}
    bar = None
    try:
        per_rank = [[o for u in units for o in u.outs.get(r, [])] for r in range(mp)]
        for r in range(mp):
            writers.append(ShardWriter(tmp / SHARD_NAME.format(i=r, mp=mp), per_rank[r],
                                       {"format": "pt", "model_parallel": str(mp), "rank": str(r)}))
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=report["source_bytes"], unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"convert mp={mp}", dynamic_ncols=True)
        for u in units:
            _run_unit(u, writers, files, chunk_bytes, report, bar)
        for w in writers:
            w.close()
        if report["bytes_read"] != report["source_bytes"]:
            raise ConvertError(f"read {report['bytes_read']} of {report['source_bytes']} source bytes")
        out_cfg = cfg.replace(expert_dtype=report["expert_dtype"]).to_hf_dict()
        out_cfg["model_parallel"] = mp
        out_cfg.setdefault("quantization_config", {})["engram_dtype"] = report["engram_dtype"]
        if report["linear_dtype"] == "int8":
            out_cfg["quantization_config"].update(linear_dtype="int8", expert_dtype="int8")
            (tmp / "quant_model_description.json").write_text(json.dumps(quant_description(units), indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
        for p in tok_files:
            shutil.copyfile(p, tmp / p.name)
        os.rename(tmp, dst)
    except BaseException:
        for w in writers:
            try:
                w.close(check=False)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for f in files.values():
            f.close()
        if bar is not None:
            bar.close()
    dt = time.perf_counter() - t0
    report["written_tensors"] = [len(p) for p in per_rank]
    report["bytes_written"] = sum(w.size for w in writers)
    report["files"] = [SHARD_NAME.format(i=r, mp=mp) for r in range(mp)] + ["config.json"] + [p.name for p in tok_files]
    if report["linear_dtype"] == "int8":
        report["files"].append("quant_model_description.json")
    for e in report["linear_int8_error"].values():
        e["mean_rel"] = e.pop("sum_rel") / max(e["rows"], 1)
    report["seconds"] = dt
    report["mb_per_s"] = report["source_bytes"] / 1e6 / dt if dt > 0 else float("inf")
    return report


def format_report(rep: dict) -> str:
    u = rep["units"]
    lines = [
        (
            f"converted {rep['src']} -> {rep['dst']} (mp={rep['model_parallel']}, experts {rep['expert_dtype']}, "
            f"engram {rep['engram_dtype']}, config.json nested)"
        ),
        (
            f"  source tensors {rep['source_tensors']}, consumed {rep['consumed_tensors']}; written per rank "
            f"{rep['written_tensors']}"
        ),
        (
            f"  replicated {u['replicate']}, split dim0 {u['dim0']}, split dim1 {u['dim1']}, experts "
            f"{u['expert'] + 2 * u['expert_fp8']} ({u['expert_fp8']} FP4->FP8 pairs), engram {u['engram'] + 2 * u['engram_int8']}"
        ),
        (
            f"  {rep['source_bytes'] / 1e6:.1f} MB read, {rep['bytes_written'] / 1e6:.1f} MB written in "
            f"{rep['seconds']:.2f} s ({rep['mb_per_s']:.1f} MB/s)"
        ),
    ]
    if rep["counts"]["fp8_dequantised"]:
        lines.append(f"  {rep['counts']['fp8_dequantised']} released-form FP8 wo_a weight(s) dequantised to bf16")
    for kind, e in sorted(rep.get("linear_int8_error", {}).items()):
        lines.append(f"  int8 {kind}: {e['tensors']} tensor(s), {e['rows']} rows, relative error vs the release "
                     f"weight (of row amax): max {e['max_rel']:.3e}, mean {e['mean_rel']:.3e}")
    for name, e in rep["engram_int8_error"].items():
        lines.append(f"  engram int8 {name}: {e['rows']} rows, relative error vs FP8 (of row amax): "
                     f"max {e['max_rel']:.3e}, mean {e['mean_rel']:.3e}")
    return "\n".join(lines)


def add_convert_args(p) -> None:
    p.add_argument("--hf-ckpt-path", required=True, metavar="DIR", help="source checkpoint directory")
    p.add_argument("--save-path", required=True, metavar="DIR", help="destination directory (must not exist)")
    p.add_argument("--model-parallel", required=True, type=int, metavar="N", help="number of shards")
    p.add_argument("--expert-dtype", choices=["fp4", "fp8"], default="fp4", help="routed-expert storage")
    p.add_argument("--engram-dtype", choices=["fp8", "int8"], default="fp8", help="Engram row storage")
    p.add_argument("--linear-dtype", choices=["native", "int8"], default="native",
                   help="int8: W8A8 per-output-channel INT8 linears and experts (Atlas A2/A3)")
    p.add_argument("--tokenizer-path", metavar="DIR", help="where tokenizer.json/tokenizer_config.json are "
                   "(default: the source directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_convert(args) -> int:
    """CLI entry: raises ConvertError on user errors (the CLI prints it as one line)."""
    rep = convert(args.hf_ckpt_path, args.save_path, args.model_parallel, args.expert_dtype,
                  args.engram_dtype, args.tokenizer_path, progress=not getattr(args, "no_progress", False),
                  linear_dtype=getattr(args, "linear_dtype", "native"))
    print(format_report(rep))
    return 0
