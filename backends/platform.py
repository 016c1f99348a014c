"""Per-backend device facts behind one interface, so callers need no `if cuda / if npu` branches.

`platform_for(device)` returns a `Platform`: device kind, worker count for persistent kernels
(SM count on CUDA; vector-core and AI-core counts on Ascend, read at run time), streams and
events, the graph-capture class (`torch.cuda.CUDAGraph` / `torch.npu.NPUGraph`), pinned host
allocation and synchronize, and the storage dtype of float8 data (`storage_dtype`: Atlas A2/A3
hold FP8 / E8M0 bytes in uint8 tensors). The CPU platform implements streams and graphs as no-ops.

torch_npu is imported lazily, only by the Ascend platform; `import dsv41` never touches it.
The Ascend platform is written against torch_npu's documented API and is unverified on
hardware (no NPU was available to this project yet).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def capture_without_gc(capture):
    """`capture` (a graph-capture context) with Python's cyclic garbage collector run just before
    it and kept off inside it. A collection inside a capture frees whatever old engines' cycles
    held (their graphs, pools, page-locked buffers), and that release invalidates the capture:
    on the H200 a collection forced inside each capture failed the graph tests' captures, and
    without this guard one test failed so now and then, when an automatic collection fell inside
    its third engine's capture (torch collects on entry only under `force_cudagraph_gc`)."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        with capture:
            yield
    finally:
        if was_on:
            gc.enable()


def freeze_host_objects() -> None:
    """Take every Python object alive now out of the cyclic garbage collector's view (one
    collection, then `gc.freeze`), as vLLM does after start-up. A full (generation-2) collection
    walks every tracked object: with the mini model loaded and its kernels compiled that is about
    0.2 M objects, and one such collection took 111 ms of host time inside a warm CED prefill
    on the H200 machine (a 0.10 s prefill read 0.22 s). Called once the long-lived state exists
    (model, engine, compiled kernels, captured graphs); later objects are collected as before.
    Frozen objects are never freed by the collector, so this is for serving processes, not
    for test sessions that build many models."""
    gc.collect()
    gc.freeze()


_SWITCHES: dict[str, bool] = {}  # env_switch's memo (tests reset it)


def env_switch(name: str, default: bool) -> bool:
    """A "0" / "1" environment switch (a kernel path's A/B choice), read once per process; any
    other value is one clear error naming the variable."""
    if name not in _SWITCHES:
        v = os.environ.get(name, "").strip() or ("1" if default else "0")
        if v not in ("0", "1"):
            raise ValueError(f"{name}: expected 0 or 1, got {v!r}")
        _SWITCHES[name] = v == "1"
    return _SWITCHES[name]


def mhc_coef_lane_on(kind: str) -> bool:
    """Whether the mHC coefficient launch goes to the side lane MHC_COEF_LANE on a `kind` device:
    CUDA only (Ascend keeps it on the calling stream: unmeasured there), unless
    DSV41_MHC_COEF_LANE=0. H100 (session forty-eight, mini decode graph at 4K, three alternated
    rounds): batch 1 / 8 / 64 1.873 / 2.852 / 4.272 -> 1.820 / 2.810 / 4.216 ms."""
    return kind == "cuda" and env_switch("DSV41_MHC_COEF_LANE", True)


_COEF_LANE_SCOPE = threading.local()  # how deep this thread is in `mhc_coef_lane_scope`s


@contextlib.contextmanager
def mhc_coef_lane_scope():
    """Where the mHC coefficient launch may be forked on MHC_COEF_LANE: inside this scope, whose
    code joins the lane (`join_mhc_coef`) before it reads coefficients (`Transformer.forward`).
    Outside it (an op called on its own: tests, benchmarks, any caller that reads the outputs
    at once) the launch stays on the calling stream, so `ops.mhc_mix` / `ops.mhc_mixes` return
    coefficients that are ready in stream order. Nests; per thread. Usable as a decorator."""
    depth = getattr(_COEF_LANE_SCOPE, "depth", 0)
    _COEF_LANE_SCOPE.depth = depth + 1
    try:
        yield
    finally:
        _COEF_LANE_SCOPE.depth = depth


def mhc_coef_lane_forks(kind: str) -> bool:
    """Whether an mHC coefficient launch on a `kind` device goes to MHC_COEF_LANE now: the lane is
    on there (`mhc_coef_lane_on`) and the caller is inside `mhc_coef_lane_scope`."""
    return getattr(_COEF_LANE_SCOPE, "depth", 0) > 0 and mhc_coef_lane_on(kind)


def join_mhc_coef(plat: "Platform", coef) -> None:
    """Before reading mHC coefficients: join the lane their epilogue may have been forked on
    (MHC_COEF_LANE, where `mhc_coef_lane_forks`: inside `mhc_coef_lane_scope`; nothing to do
    otherwise, and nothing may be done: inside a graph capture, a wait on a lane that nothing in
    the capture forked is a dependency on uncaptured work, which invalidates the capture)."""
    if mhc_coef_lane_forks(plat.kind):
        plat.join(lane=MHC_COEF_LANE, out=coef)


HOST_THREADS_ENV = "DSV41_HOST_THREADS"


def serving_host_threads() -> int:
    """torch's intra-op CPU threads for a process that computes on a device, once its model is
    loaded: `DSV41_HOST_THREADS` (a positive integer), default 1. torch sizes that pool to the
    machine's cores, ignoring affinity and container CPU quotas, and its OpenMP workers spin after
    every parallel CPU op; while serving, the host's work is one Python thread launching kernels
    and building small step tensors, which those spinning workers only slow (and in a container
    they can use up the CPU quota, throttling the whole process). vLLM's workers serve with one
    thread for the same reason. The CPU reference computes on the host and keeps its threads."""
    raw = os.environ.get(HOST_THREADS_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{HOST_THREADS_ENV} must be a positive integer (intra-op CPU threads while "
                         f"serving on a device), got {raw!r}")
    return n


def limit_host_threads() -> int:
    """Set torch's intra-op threads to `serving_host_threads()`; returns the count before, for a
    caller that restores it (a benchmark whose later phases compute on the CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(serving_host_threads())
    return before


def host_cpus() -> str:
    """The host CPUs this process may use, for reports: the affinity count and, where the cgroup
    (v2) sets one, the CPU quota ("16 CPUs (affinity), quota 8.0")."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{n} CPUs (affinity)"
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            text += f", quota {int(quota) / int(period):.1f}"
    except (OSError, ValueError):
        pass
    return text


def cuda_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


def npu_unavailable_reason() -> str | None:
    """None when an Ascend NPU is usable through torch_npu, else one sentence saying why not."""
    try:
        import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
    except Exception as e:  # ImportError, or CANN's shared libraries missing (OSError)
        return f"torch_npu not importable: {type(e).__name__}: {e}".strip()
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        return "torch_npu is installed but no NPU is visible"
    return None


def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"triton not importable: {type(e).__name__}: {e}"
    return None


# The 8-bit float formats a device may lack (checkpoint weights, KV pools, scales).
FLOAT8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")
                          if hasattr(torch, n))
_SIMULATED_BYTE_STORAGE: set[str] = set()  # device kinds told to store float8 as bytes (tests)


@contextlib.contextmanager
def simulate_float8_as_bytes(kind: str = "cpu"):
    """Inside, devices of `kind` store float8 data as uint8 bytes, as an NPU does: lets a CPU
    test run the NPU storage choice (loader, pools, ops) and compare with the float8 run."""
    fresh = kind not in _SIMULATED_BYTE_STORAGE
    _SIMULATED_BYTE_STORAGE.add(kind)
    try:
        yield
    finally:
        if fresh:
            _SIMULATED_BYTE_STORAGE.discard(kind)


def storage_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a tensor of logical dtype `dtype` is held in on `device`: uint8 for the float8
    formats where the device has no float8 tensors (Ascend), else `dtype` itself. Cheap (no
    device query): core code allocates through it and so needs no device branch."""
    if dtype not in FLOAT8_DTYPES:
        return dtype
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind in _SIMULATED_BYTE_STORAGE or _PLATFORM_CLASSES.get(kind, Platform).float8_as_bytes:
        return torch.uint8
    return dtype


def as_storage(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` (a logical float8 tensor) as the bytes a `dtype` buffer holds: a uint8 view where the
    storage is bytes, `t` unchanged otherwise (a copy then moves the bits, never the values)."""
    if t.dtype in FLOAT8_DTYPES and dtype == torch.uint8:
        return t.view(torch.uint8)
    return t


def overlap(device: torch.device | str, side, main):
    """(side(), main()) for two pieces of independent work on `device`. On Ascend, `side` runs on
    an auxiliary stream while `main` runs on the current one: the vector / cube overlap
    vllm-ascend's DeepSeek-V4 indexer uses (its weights projection, a matmul, beside the query
    path); see `AscendPlatform.overlap`. Everywhere else side() then main(), on the calling
    stream, so CPU and CUDA compute exactly what sequential code computes."""
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind == "npu":  # (this runs in every indexer layer's forward: the platform is made once)
        return cached_platform(device).overlap(side, main)
    return side(), main()


_PLATFORMS: dict = {}  # str(device) -> its Platform, for `cached_platform`


def cached_platform(device: torch.device | str) -> "Platform":
    """`platform_for(device)`, made once per device name: for hot paths with no module to keep it
    on (the indexer's `overlap`, the mHC coefficient launch's side lane)."""
    plat = _PLATFORMS.get(str(device))
    if plat is None:
        plat = _PLATFORMS[str(device)] = platform_for(device)
    return plat


def _no_join() -> None:
    """The join of work that ran in order on one stream: nothing to wait for."""


def _tensors(out):
    """The tensors of a result (a tensor, or a tuple / list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


_AUX_STREAMS: dict = {}  # (device, lane) -> the auxiliary stream `fork` uses there
# The lane the mHC coefficient epilogue is forked on (`npu_ops/triton/mega_mhc.py`; CUDA, unless
# DSV41_MHC_COEF_LANE=0: `mhc_coef_lane_on`; only inside `mhc_coef_lane_scope`): its outputs are
# read only by the next mHC step, so the model joins this lane before it reads coefficients
# (`core.model.Block.mix`, and before the CED row selection in `Transformer.forward`). Lanes 0 and 1
# are the indexer's and the compressor's.
MHC_COEF_LANE = 2
# The lane Engram values (lookup + `wkv`: they read only the step's token ids) are forked on at a
# step's start (`Transformer.forward`, `overlap_streams`' "engram"); `core.engram.EngramValues`
# joins it before the layer's gate.
ENGRAM_LANE = 3
_CAPTURE_STREAMS: dict = {}  # device -> the stream its graphs are captured (and warmed up) on


def _device_stream(table: dict, plat: "Platform", key=None):
    """The platform's device's stream in `table` (under `key`, default the device), made on first use."""
    key = plat.device if key is None else key
    s = table.get(key)
    if s is None:
        s = table[key] = plat.stream()
    return s


def _capture_stream(plat: "Platform"):
    """The device's capture stream (`Platform.capture_stream`)."""
    return _device_stream(_CAPTURE_STREAMS, plat)


def aux_fork(plat: "Platform", fn, lane: int = 0, reads=()):
    """fn() on the device's auxiliary stream `lane`, after the work queued so far on the calling
    stream (side work forked off it: the lane waits for the calling stream, no host sync).
    Returns fn's result; the caller joins the lane (`aux_join`) before it reads that result.
    `reads`: tensors fn reads that the calling stream made and may free before the join; they are
    marked as used on the lane, so the caching allocator does not hand their memory to the calling
    stream's next tensor before the lane has read them."""
    cur = plat.current_stream()
    aux = _device_stream(_AUX_STREAMS, plat, (plat.device, lane))
    aux.wait_stream(cur)
    for t in reads:
        t.record_stream(aux)
    with plat.use_stream(aux):
        return fn()


def aux_join(plat: "Platform", lane: int = 0, out=None) -> None:
    """The calling stream waits for everything queued on auxiliary stream `lane`, and the tensors
    of `out` (what was forked there) are marked as used on the calling stream, so the caching
    allocator does not hand their memory back to the lane while the caller still reads them.
    A stream wait, no host sync: the pattern can sit inside a captured graph."""
    cur = plat.current_stream()
    cur.wait_stream(_device_stream(_AUX_STREAMS, plat, (plat.device, lane)))
    for t in _tensors(out):
        t.record_stream(cur)


def aux_stream_overlap(plat: "Platform", side, main, joined: bool = False):
    """`side` on the device's auxiliary stream (`aux_fork`), `main` on the current one, then
    joined (`aux_join`: the caller reads side's results after it). `joined`: main is called as
    main(side_out, join) and reads side's results only after calling join() (the join, done
    once: main's last kernel can take side's output while its earlier ones overlap side)."""
    side_out = aux_fork(plat, side)
    done = []

    def join() -> None:
        if not done:
            done.append(True)
            aux_join(plat, 0, side_out)

    main_out = main(side_out, join) if joined else main()
    join()
    return side_out, main_out


class _NoStream:
    """CPU stand-in for a device stream: work runs in order on the calling thread."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoGraph:
    """CPU stand-in for a captured graph: `replay` must re-run the captured callable, so the
    CPU graph runner keeps the callable and this class only marks the capture region."""

    def replay(self) -> None:
        raise RuntimeError("CPU has no graph capture; the graph runner runs eagerly on CPU")


@dataclass
class Platform:
    """What a backend's device offers; `kind` is 'cpu', 'cuda' or 'npu'."""

    kind: str
    device: torch.device
    # True where the device has no float8 tensors: FP8 / E8M0 data are held as uint8 bytes and
    # decoded inside kernels / integer codecs (see `storage_dtype`)
    float8_as_bytes = False
    # how Engram rows of host-held tables reach the device by default (`Transformer.offload_engram`):
    # gathered on the host and copied ahead of their layers
    engram_fetch = "ahead"
    # the MoE's shared expert runs on a second stream beside the routed experts by default at up
    # to this many tokens (`Transformer.overlap_streams`); 0: never by default
    overlap_shared_tokens = 0
    # a Full / Reindex layer's compressor and top-k run on a second stream beside its query and
    # KV projections by default at up to this many tokens (`Transformer.overlap_streams`)
    overlap_indexer_tokens = 0
    # Engram values (lookup + wkv) forked at the step's start beside the layers before theirs by
    # default at up to this many tokens (`Transformer.overlap_streams`' "engram"); 0: never. Off
    # everywhere: on CUDA (H100 2026-12-07, mini at 4K, graph ms, processes alternated, the other
    # defaults kept) it cost time at batch 1 (1.817 / 1.819 -> 1.845 / 1.852) and gained ~5 us at
    # batch 8 (2.849 / 2.851 -> 2.842 / 2.846); in the mini preset only one Engram layer can move
    overlap_engram_tokens = 0

    @property
    def backend(self) -> str:
        return {"cpu": "reference", "cuda": "cuda", "npu": "ascend"}[self.kind]

    def num_workers(self) -> int:
        """Programs for a persistent kernel: SMs, vector cores, or 1 on CPU."""
        return 1

    def cube_workers(self) -> int:
        """Programs for a matmul-heavy (cube) kernel; equal to num_workers outside Ascend."""
        return self.num_workers()

    def stream(self):
        return _NoStream()

    def current_stream(self):
        return _NoStream()

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def event(self):
        return _NoEvent()

    def graph_class(self):
        return None

    def graph_capture(self, graph, pool=None):
        """Context manager capturing the work issued inside it into `graph`, on `capture_stream`."""
        raise RuntimeError("this device has no graph capture")

    def capture_stream(self):
        """The stream every graph capture on this device runs on (None where there are no graphs)."""
        return None

    def on_capture_stream(self):
        """Context manager running eager work on the capture stream: a graph's warm-up runs there
        so that per-stream state (the zeroed `tile_counters`) is made eagerly, not inside the
        capture, where its zero fill would only be recorded and its first replay would read
        whatever the memory held."""
        cs = self.capture_stream()
        if cs is None:
            return contextlib.nullcontext()
        cs.wait_stream(self.current_stream())
        return self.use_stream(cs)

    def graph_pool(self):
        """A memory pool handle the graphs of one runner share (None where there is none)."""
        return None

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory the device can read directly (page-locked where a device exists)."""
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (host waits are not allowed then)."""
        return False

    def stream_key(self) -> int:
        """An integer naming the current stream (state kept per stream, e.g. `tile_counters`, is
        keyed by it); 0 where the device has no streams."""
        return 0

    def overlap(self, side, main, joined: bool = False):
        """(side(), main()), in order, on the calling stream (see the module's `overlap`;
        `joined`: main(side_out, join) as in `aux_stream_overlap`, join doing nothing here)."""
        side_out = side()
        return side_out, (main(side_out, _no_join) if joined else main())

    def fork(self, fn, lane: int = 0, reads=()):
        """fn() as side work beside the caller's (`aux_fork` on devices with streams; here it
        runs at once, on the calling stream). Join it (`join`) before reading its results.
        `reads`: the calling stream's tensors fn reads that nobody may hold until the join."""
        return fn()

    def join(self, lane: int = 0, out=None) -> None:
        """The calling stream waits for side work forked on `lane` (`aux_join`); nothing here."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype `dtype` data are held in on this device (`storage_dtype`)."""
        return storage_dtype(dtype, self.device)


class _StreamPlatform(Platform):
    """A platform with device streams: side work runs on auxiliary streams beside the caller's
    (`aux_stream_overlap`, `aux_fork` / `aux_join`). Only callers that ask the platform directly
    get it (the MoE's shared expert and the indexer under `Transformer.overlap_streams`); the
    module's `overlap` stays sequential on CUDA. On Ascend UNVERIFIED on hardware (the pattern of
    vllm-ascend's `multistream_dsv4_dsa_overlap`)."""

    def overlap(self, side, main, joined: bool = False):
        return aux_stream_overlap(self, side, main, joined)

    def fork(self, fn, lane: int = 0, reads=()):
        return aux_fork(self, fn, lane, reads)

    def join(self, lane: int = 0, out=None) -> None:
        aux_join(self, lane, out)


class CudaPlatform(_StreamPlatform):
    # the lookup kernel reads page-locked host tables in place (no host gather, no sync): on the
    # H200 (2026-11-30, mini) +0.1-0.2% decode step time against +4.5-6.1% for the fetch-ahead,
    # whose graph replays with page-locked tables also failed a GPU test (tests/test_engram_offload.py)
    engram_fetch = "in_place"

    # measured on the H200 (2026-12-01, mini, decode graphs): -2.1% step at batch 1, -8.1% at 64;
    # prefill sizes unmeasured, so they stay on one stream. The shared expert beside the routed
    # ones stops at 32 tokens since the gate/up kernel takes its scale bytes a K step ahead at 33-64
    # (`moe_fold.AHEAD_UP_MAX_SLOTS`): beside that faster kernel it cost time (H100 2026-12-06, 4K,
    # graph ms, ahead at 33-64: shared expert on the main stream / beside: batch 33 4.05 / 4.14,
    # 40 4.17 / 4.24, 48 4.27 / 4.23, 56 4.44 / 4.59, 64 4.57 / 4.87); at 8-32 tokens it still pays
    # (batch 24 3.61 against 3.86 with it on the main stream, 32 3.75 against 3.97)
    overlap_shared_tokens = 32
    overlap_indexer_tokens = 64

    def num_workers(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def graph_class(self):
        return torch.cuda.CUDAGraph

    def graph_capture(self, graph, pool=None):
        return capture_without_gc(torch.cuda.graph(graph, pool=pool, stream=self.capture_stream()))

    def capture_stream(self):
        return _capture_stream(self)

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def stream_key(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream



class AscendPlatform(_StreamPlatform):
    """torch_npu's device API (unverified on hardware). Vector-core and AI-core counts come from
    the device properties at run time; Atlas A2 parts have 20-24 AI cores with 2 vector cores
    each, which is what the fallback assumes when a property is missing. Atlas A2/A3 have no
    float8 tensors: FP8 / E8M0 data live in uint8 (`float8_as_bytes`)."""

    float8_as_bytes = True

    def _props(self):
        return torch.npu.get_device_properties(self.device)  # type: ignore[attr-defined]

    def num_workers(self) -> int:
        props = self._props()
        for name in ("vector_core_num", "num_vector_cores"):
            if hasattr(props, name):
                return int(getattr(props, name))
        try:  # triton-ascend's driver reports the core counts too
            import triton

            info = triton.runtime.driver.active.utils.get_device_properties(self.device.index or 0)
            if info.get("num_vectorcore"):
                return int(info["num_vectorcore"])
        except Exception:  # noqa: BLE001  (no triton-ascend: fall back to the A2 layout)
            pass
        return 2 * self.cube_workers()

    def cube_workers(self) -> int:
        props = self._props()
        for name in ("cube_core_num", "ai_core_num", "multi_processor_count"):
            if hasattr(props, name):
                return int(getattr(props, name))
        return 24

    def stream(self):
        return torch.npu.Stream(self.device)  # type: ignore[attr-defined]

    def current_stream(self):
        return torch.npu.current_stream(self.device)  # type: ignore[attr-defined]

    def use_stream(self, stream):
        return torch.npu.stream(stream)  # type: ignore[attr-defined]

    def event(self):
        return torch.npu.Event()  # type: ignore[attr-defined]

    def graph_class(self):
        return torch.npu.NPUGraph  # type: ignore[attr-defined]

    def graph_capture(self, graph, pool=None):
        return capture_without_gc(torch.npu.graph(graph, pool=pool, stream=self.capture_stream()))  # type: ignore[attr-defined]

    def capture_stream(self):
        return _capture_stream(self)

    def graph_pool(self):
        return torch.npu.graph_pool_handle()  # type: ignore[attr-defined]

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def is_capturing(self) -> bool:
        return bool(torch.npu.is_current_stream_capturing())  # type: ignore[attr-defined]

    def stream_key(self) -> int:
        # torch's generic stream id (every torch.Stream subclass has one); each NPU stream,
        # the aux and capture streams included, gets its own
        return int(torch.npu.current_stream(self.device).stream_id)  # type: ignore[attr-defined]



_PLATFORM_CLASSES = {"cpu": Platform, "meta": Platform, "cuda": CudaPlatform, "npu": AscendPlatform}


def host_to_device(dst: torch.Tensor, src: torch.Tensor, platform: Platform | None = None) -> None:
    """`dst.copy_(src)` without a host wait. A host `src` is staged in page-locked memory first:
    a copy from pageable memory makes the host wait for everything queued before it on the
    stream, so the host could not prepare the next step while the device runs this one. The
    caching host allocator keeps the staging block until the copy has run."""
    if src.device.type == "cpu" and dst.device.type != "cpu":
        platform = platform or platform_for(dst.device)
        src = platform.pinned_empty(src.shape, src.dtype).copy_(src)
    dst.copy_(src, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied without a host wait (`host_to_device`); `t` itself on
    the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    host_to_device(out, t)
    return out


def platform_for(device: torch.device | str) -> Platform:
    """The platform of a device; raises with the reason when its backend is unavailable. A device
    named without an index gets the current one's, so the streams kept per device (side lanes,
    capture stream) are the same for "cuda" and "cuda:0" (a fork keyed by one and a join by the
    other waited on a stream outside the capture: cudaErrorStreamCaptureIsolation, H100
    2026-12-07)."""
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind == "npu":
        why = npu_unavailable_reason()
        if why:
            raise RuntimeError(f"npu: {why}")
        dev = torch.device(device)
        if dev.index is None:  # (see the CUDA case)
            dev = torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        return AscendPlatform("npu", dev)
    dev = torch.device(device)
    if dev.type == "cuda":
        why = cuda_unavailable_reason()
        if why:
            raise RuntimeError(f"cuda: {why}")
        if dev.index is None:  # "cuda" and "cuda:0" name one device: one key for its streams
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaPlatform("cuda", dev)
    return Platform("cpu", dev)
