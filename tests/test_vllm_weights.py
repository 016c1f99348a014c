"""`Dsv41ForCausalLM.load_weights` (vLLM's weight stream) accepts the released file form of
`attn.wo_a`, FP8 E4M3 + an E8M0 `.scale` per 32x32 block, and dequantises it to the model's bf16
weight exactly as the checkpoint loader and `dsv41 convert` do (same function); half a pair is
one clear error. Runs the method on a stand-in holding a tiny model (vLLM installed only)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from dsv41.backends.reference.quant import fp8_block_dequant, fp8_block_quant  # noqa: E402
from dsv41.core.parallel import SINGLE  # noqa: E402
from dsv41.core.weights import WeightError, build_model  # noqa: E402
from dsv41.deploy.names import RELEASED_FP8_BF16  # noqa: E402
from dsv41.deploy.vllm.model import Dsv41ForCausalLM  # noqa: E402


def _loader(cfg, seed):
    """A stand-in `self` for load_weights: a fresh model (other weights), no tokenizer step."""
    model = build_model(cfg, seed=seed + 1)
    return types.SimpleNamespace(model=model, cfg=cfg, group=SINGLE, _install_engram_vocab=lambda: None), model


def _released_stream(sd):
    """The checkpoint's tensors with every wo_a in the released FP8 form (scale after the weight
    for one layer, before it for the others: vLLM streams files in any order)."""
    out, want, first = [], {}, True
    for name, t in sd.items():
        owner = name[: -len(".weight")]
        if name.endswith(".weight") and RELEASED_FP8_BF16.match(owner):
            q, s = fp8_block_quant(t.float())
            want[name] = fp8_block_dequant(q, s).to(torch.bfloat16)
            out += [(name, q), (owner + ".scale", s)] if first else [(owner + ".scale", s), (name, q)]
            first = False
        else:
            out.append((name, t))
    return out, want


def test_released_fp8_wo_a_is_dequantised(tiny_cfg, fresh_seed):
    src = build_model(tiny_cfg, seed=fresh_seed).state_dict()
    stream, want = _released_stream(src)
    assert len(want) >= tiny_cfg.num_hidden_layers
    self, model = _loader(tiny_cfg, fresh_seed)
    loaded = Dsv41ForCausalLM.load_weights(self, stream)
    got = model.state_dict()
    for name, t in src.items():
        expect = want.get(name, t)
        assert got[name].dtype == expect.dtype, name
        assert torch.equal(got[name].view(torch.uint8), expect.view(torch.uint8)), name
    assert any(not torch.equal(want[n], src[n]) for n in want)  # the FP8 form really is lossy
    assert not any(n.endswith("wo_a.scale") for n in loaded)


def test_half_a_released_pair_is_an_error(tiny_cfg, fresh_seed):
    src = build_model(tiny_cfg, seed=fresh_seed).state_dict()
    stream, _ = _released_stream(src)
    stream = [(n, t) for n, t in stream if n != "layers.0.attn.wo_a.scale"]
    self, _ = _loader(tiny_cfg, fresh_seed)
    with pytest.raises(WeightError, match="layers.0.attn.wo_a.weight"):
        Dsv41ForCausalLM.load_weights(self, stream)
