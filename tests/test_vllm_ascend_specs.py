"""On vllm-ascend our cache layers declare its DeepSeek-V4 spec classes, and its runner's binding
gives the same record views as vLLM's (vLLM installed only; vllm-ascend stood in for).

vllm-ascend needs CANN and torch_npu, so `vllm_ascend.core.kv_cache_interface` is replaced by a
minimal stand-in of its v0.23.0 classes (same constructor fields, the `page_size_bytes` of the
branch our specs take; its global spec also as at main 182b75ea84, where block_size counts
tokens) and the platform by one whose device type is "npu". The runner's
allocation and binding are reproduced from its v0.23.0 `model_runner_v1.py`: one raw int8 tensor
per layer of `num_blocks * page_size_bytes`, viewed as `AscendMLABackend.get_kv_cache_shape`
[blocks, block_size, heads=1, head_size] with a page-sized block stride (`_adjust_kv_layout`),
bound as a one-tensor list (vLLM's `bind_kv_cache`; one more list for the `deepseek_v4` model
type, and in vLLM versions that still wrap per virtual engine).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

import vllm.platforms  # noqa: E402
from dsv41.core.config import ModelConfig, preset  # noqa: E402
from dsv41.deploy.vllm.layers import PagedLayer  # noqa: E402
from dsv41.deploy.vllm.paged_cache import PagedCaches, fields_of, record_rows, replay_length  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.utils.torch_utils import get_dtype_size  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec  # noqa: E402

N_BLOCKS = 6


def _ascend_module(version: str) -> types.ModuleType:
    """`vllm_ascend.core.kv_cache_interface` as at v0.23.0 (or its global spec as at main
    182b75ea84), reduced to what our specs reach."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AscendMLAAttentionSpec(MLAAttentionSpec):
        # vLLM 0.23's MLAAttentionSpec has `compress_ratio` (vllm-ascend passes it); the vLLM CI
        # installs has `tokens_per_state` instead, so the stand-in declares it
        compress_ratio: int = 1
        scale_dim: int = 0
        scale_dtype: torch.dtype = torch.int8
        sparse_head_dim: tuple[int, ...] | None = None
        cache_sparse_sfa_c8: bool = False
        cache_sparse_li_c8: bool = False
        c8_k_cache_dtype: torch.dtype = torch.int8  # (A2 / A3; A5: float8_e4m3fn)
        c8_k_scale_cache_dtype: torch.dtype = torch.float16
        sfa_dcp_replicated_indexer_size: int = 1

        @property
        def page_size_bytes(self) -> int:
            if self.cache_sparse_sfa_c8 or self.cache_sparse_li_c8 or self.sfa_dcp_replicated_indexer_size > 1:
                raise NotImplementedError("stand-in: only the plain MLA page is modelled")
            return self.block_size * self.num_kv_heads * (
                self.head_size * get_dtype_size(self.dtype) + self.scale_dim * get_dtype_size(self.scale_dtype))

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AscendSlidingWindowMLASpec(SlidingWindowMLASpec):
        cache_dtype_str: str | None = None
        alignment: int | None = None
        compress_ratio: int = 1
        model_version: str | None = None

        def __post_init__(self):
            pass

        @property
        def storage_block_size(self) -> int:
            return self.block_size

        @property
        def real_page_size_bytes(self) -> int:
            return self.storage_block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AscendMLAAttentionSpecMain(AscendMLAAttentionSpec):
        """main 182b75ea84: block_size counts tokens, the page holds `storage_block_size` records."""

        @property
        def storage_block_size(self) -> int:
            return self.block_size // self.compress_ratio

        @property
        def page_size_bytes(self) -> int:
            return self.storage_block_size * self.num_kv_heads * (
                self.head_size * get_dtype_size(self.dtype) + self.scale_dim * get_dtype_size(self.scale_dtype))

    mod = types.ModuleType("vllm_ascend.core.kv_cache_interface")
    mod.AscendMLAAttentionSpec = AscendMLAAttentionSpecMain if version == "main" else AscendMLAAttentionSpec
    mod.AscendSlidingWindowMLASpec = AscendSlidingWindowMLASpec
    return mod


@pytest.fixture(params=["v0.23.0", "main"])
def ascend(monkeypatch, request):
    """The stand-in module installed (its package parents too); the platform left to each test."""
    mod = _ascend_module(request.param)
    mod.version = request.param
    pkg, core = types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend.core")
    pkg.core, core.kv_cache_interface = core, mod
    for name, m in (("vllm_ascend", pkg), ("vllm_ascend.core", core), ("vllm_ascend.core.kv_cache_interface", mod)):
        monkeypatch.setitem(sys.modules, name, m)
    return mod


def _caches(monkeypatch, cfg: ModelConfig, block_size: int, npu: bool) -> PagedCaches:
    """Our cache layers built inside a vLLM config, with the platform's device type npu or not."""
    with set_current_vllm_config(VllmConfig()), monkeypatch.context() as patch:
        if npu:
            patch.setattr(vllm.platforms, "_current_platform", types.SimpleNamespace(device_type="npu"))
        return PagedCaches(cfg, block_size, "m", replay_length(cfg, "window"), PagedLayer)


def _layers(caches: PagedCaches):
    """Every cache layer: the global ones, then the window ones."""
    return [*caches.glob.values(), *caches.swa]


CONFIGS = [("tiny", 8), ("full", 128), ("full", 16)]


def _cfg(name: str) -> ModelConfig:
    """The tiny preset or the full model's config."""
    return preset("tiny") if name == "tiny" else ModelConfig()


@pytest.mark.parametrize(("name", "block_size"), CONFIGS)
def test_layers_declare_ascend_specs_with_our_pages(monkeypatch, ascend, name, block_size):
    """On vllm-ascend's platform every layer declares its class, with block_size counted as
    vllm-ascend counts it (records for the compressed cache, tokens for the window), and the
    page its runner allocates is the page our layout fills."""
    caches = _caches(monkeypatch, _cfg(name), block_size, npu=True)
    for lay in _layers(caches):
        q, spec = caches.requests[lay.prefix], lay.spec
        assert spec.page_size_bytes == q.page_bytes == caches.page_bytes
        assert (spec.num_kv_heads, spec.head_size, spec.dtype, spec.model_version) == (1, q.record_bytes, torch.uint8,
                                                                                       "deepseek_v4")
        if q.kind == "global":
            assert type(spec) is ascend.AscendMLAAttentionSpec
            records = q.block_size // q.ratio
            if ascend.version == "v0.23.0":  # records per block; its managers count block_size * ratio tokens
                assert (spec.block_size, spec.compress_ratio, spec.scale_dim) == (records, q.ratio, 0)
            else:  # tokens per block, records as storage_block_size
                assert (spec.block_size, spec.storage_block_size, spec.compress_ratio) == (q.block_size, records, q.ratio)
        else:
            assert type(spec) is ascend.AscendSlidingWindowMLASpec
            assert (spec.block_size, spec.compress_ratio, spec.sliding_window) == (q.block_size, 1, q.window)
            assert spec.bounded_replay  # (the class CI's vLLM gives the stand-in has the field)
    # vllm-ascend groups the compressed layers by ratio into one `UniformTypeKVCacheSpecs` each,
    # which needs one block size per group
    by_ratio: dict[int, set[int]] = {}
    for lay in caches.glob.values():
        by_ratio.setdefault(lay.spec.compress_ratio, set()).add(lay.spec.block_size)
    assert all(len(sizes) == 1 for sizes in by_ratio.values()), by_ratio


def test_vllm_platform_keeps_vllm_specs(monkeypatch, ascend, tiny_cfg):
    """vllm-ascend importable but vLLM on another platform (a CPU machine): vLLM's classes."""
    caches = _caches(monkeypatch, tiny_cfg, 8, npu=False)
    for lay in _layers(caches):
        assert type(lay.spec) in (FullAttentionSpec, SlidingWindowMLASpec)
        assert lay.spec.page_size_bytes == caches.page_bytes


def _ascend_binding(raw: torch.Tensor, spec) -> torch.Tensor:
    """vllm-ascend v0.23.0's view of a layer's raw int8 tensor (`_reshape_kv_cache_tensors` with
    `AscendMLABackend.get_kv_cache_shape` and `_adjust_kv_layout`)."""
    shape = (raw.numel() // spec.page_size_bytes, getattr(spec, "storage_block_size", spec.block_size),
             spec.num_kv_heads, spec.head_size)  # (main passes storage_block_size)
    assert shape[0] == N_BLOCKS
    page = spec.page_size_bytes // get_dtype_size(spec.dtype)
    return torch.as_strided(raw.view(spec.dtype), shape, (page, shape[2] * shape[3], shape[3], 1), raw.storage_offset())


def _vllm_binding(raw: torch.Tensor, q) -> torch.Tensor:
    """vLLM's view of the same pages: [blocks, heads=1, records, bytes] (tests/test_paged_cache.py)."""
    records = q.block_size // q.ratio
    return raw.view(torch.uint8).view(N_BLOCKS, q.page_bytes)[:, : records * q.record_bytes].unflatten(
        1, (1, records, q.record_bytes))


@pytest.mark.parametrize("nested", [False, True], ids=["deepseek_v41", "deepseek_v4"])
def test_ascend_binding_gives_vllm_field_views(monkeypatch, ascend, tiny_cfg, nested):
    """Each layer bound as vllm-ascend binds it reads the same record fields (same bytes, same
    addresses and strides) as bound as vLLM binds it, and the pool over it is built."""
    caches = _caches(monkeypatch, tiny_cfg, 8, npu=True)
    gen = torch.Generator().manual_seed(0)
    raws = {}
    for lay in _layers(caches):
        raw = torch.randint(-128, 128, (N_BLOCKS * lay.spec.page_size_bytes,), generator=gen, dtype=torch.int8)
        raws[lay.prefix] = raw
        q = caches.requests[lay.prefix]
        bound = [_ascend_binding(raw, lay.spec)]
        a_rows, a_stride = record_rows([bound] if nested else bound, q.record_bytes)
        v_rows, v_stride = record_rows(_vllm_binding(raw, q), q.record_bytes)
        assert a_stride == v_stride == q.block_size // q.ratio
        layout = caches.glob_recs[int(lay.prefix.rsplit(".", 1)[1])] if q.kind == "global" else \
            caches.swa_recs[int(lay.prefix.rsplit(".", 1)[1])]
        a_f, v_f = fields_of(a_rows, layout), fields_of(v_rows, layout)
        for f in a_f:
            assert a_f[f].shape == v_f[f].shape and a_f[f].stride() == v_f[f].stride(), (lay.prefix, f)
            assert a_f[f].data_ptr() == v_f[f].data_ptr(), (lay.prefix, f)
            assert torch.equal(a_f[f], v_f[f]), (lay.prefix, f)
        lay.kv_cache = [bound] if nested else bound
    swa_meta, glob_meta = object(), object()
    meta = {lay.prefix: (glob_meta if caches.requests[lay.prefix].kind == "global" else swa_meta)
            for lay in _layers(caches)}
    pool, _, req = caches.pool(meta)
    first = caches.swa[0]
    assert req["token"].data_ptr() == _vllm_binding(raws[first.prefix], caches.requests[first.prefix]).data_ptr()
    assert pool.swa[0].kv.shape[0] == N_BLOCKS * caches.requests[first.prefix].block_size


def test_ascend_binding_with_a_scale_tensor_is_refused(monkeypatch, ascend, tiny_cfg):
    """A layer bound to two tensors (vllm-ascend's cache + scale split, `scale_dim` != 0) is not
    our layout: one clear error."""
    caches = _caches(monkeypatch, tiny_cfg, 8, npu=True)
    lay = caches.swa[0]
    raw = torch.zeros(N_BLOCKS * lay.spec.page_size_bytes, dtype=torch.int8)
    with pytest.raises(ValueError, match="bound to 2 tensors"):
        record_rows([_ascend_binding(raw, lay.spec)] * 2, caches.requests[lay.prefix].record_bytes)
