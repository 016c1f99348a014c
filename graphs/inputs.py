"""A captured step's persistent inputs in one device buffer, filled by one host-to-device copy.

`fill_static` writes every input field of a replay: row padding, table columns past the batch,
then the batch's rows, each a fill and a copy, so about twenty small device operations (and
their host launch costs) ran before every decode replay. Here the static batch's tensors are
views of one device byte buffer: a replay's inputs are written on the host into a page-locked
twin of that buffer (plain CPU tensor operations) and cross in ONE non-blocking copy, as
nano-vllm and vLLM stage their step inputs.

Two host twins alternate, each guarded by an event recorded after its copy, so the host never
rewrites a twin whose copy has not run yet (in the overlapped decode loop the next step's
inputs are written while the device still runs the step before).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from ..core.batch import StepBatch

ALIGN = 16  # bytes: every field starts at an address any element type may be read from

# fields `fill_static` never writes: `seq` keeps its captured arange, `ngram_host` is host-side
_UNPACKED = ("seq", "ngram_host")


def _slots(batch: StepBatch) -> list[tuple[str, int | None, torch.Tensor]]:
    """(field, tuple index or None, tensor) of every tensor input `fill_static` writes."""
    out = []
    for f in fields(StepBatch):
        v = getattr(batch, f.name)
        if f.name in _UNPACKED or v is None:
            continue
        if isinstance(v, tuple):
            out += [(f.name, i, t) for i, t in enumerate(v)]
        elif isinstance(v, torch.Tensor):
            out.append((f.name, None, v))
    return out


class PackedInputs:
    """The tensors of `static` (a captured step's input batch) moved into one device buffer;
    `self.static` is the same batch over views of it. `fill(batch)` = `fill_static(static,
    batch)` with one host-to-device copy."""

    def __init__(self, static: StepBatch, platform):
        self.platform = platform
        slots = _slots(static)
        self.layout, off = [], 0
        for name, i, t in slots:
            self.layout.append((name, i, off, tuple(t.shape), t.dtype))
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)
        device = slots[0][2].device if slots else torch.device("cpu")
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.static = self._over(self.buffer, static)
        for (_, _, t), (name, i, *_rest) in zip(slots, self.layout):  # the captured values
            self._field(self.static, name, i).copy_(t)
        self._host = [platform.pinned_empty((self.nbytes,), torch.uint8) for _ in range(2)]
        self._twins = [self._over(h, self.static) for h in self._host]
        self._copied = [None, None]  # event after each twin's last copy
        self._next = 0

    @staticmethod
    def _field(batch: StepBatch, name: str, i: int | None) -> torch.Tensor:
        v = getattr(batch, name)
        return v if i is None else v[i]

    def _over(self, buf: torch.Tensor, template: StepBatch) -> StepBatch:
        """`template` with its packed tensors replaced by views of `buf`."""
        views: dict[str, list] = {}
        for name, i, off, shape, dtype in self.layout:
            n = 1
            for s in shape:
                n *= s
            view = buf[off:off + n * dtype.itemsize].view(dtype).view(shape)
            if i is None:
                views[name] = view
            else:
                views.setdefault(name, list(getattr(template, name)))[i] = view
        return replace(template, **{k: tuple(v) if isinstance(v, list) else v for k, v in views.items()})

    def fill(self, batch: StepBatch) -> None:
        """Write `batch` (host tensors) into the static inputs: padding and rows on the host
        twin, then one copy. A batch with device tensors takes the per-field path."""
        from .decode import fill_static

        if any(t.device.type != "cpu" for _, _, t in _slots(batch)):
            fill_static(self.static, batch, self.platform)
            return
        k = self._next
        self._next = 1 - k
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # (two steps back: long done in practice)
        fill_static(self._twins[k], batch, self.platform)  # (CPU tensor operations only)
        self.buffer.copy_(self._host[k], non_blocking=True)
        ev = self.platform.event()
        ev.record()
        self._copied[k] = ev
