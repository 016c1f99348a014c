"""The allocator-trace replay of `benchmarks/prefill_memory.py` on a synthetic trace."""
import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "prefill_memory.py"
_spec = importlib.util.spec_from_file_location("prefill_memory", _PATH)
prefill_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prefill_memory)


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_live_at_peak_replays_to_the_peak():
    """The live set is taken at the highest point, frees shrink it, a block freed before the
    peak is not in it, and each block is named by its innermost project frame."""
    torch_frame = frame("/site/torch/nn/functional.py", 10, "linear")
    mlp = frame("/x/dsv41/core/model.py", 120, "forward")
    moe = frame("/x/dsv41/npu_ops/triton/moe_experts.py", 400, "moe_experts")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame, mlp]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [moe, mlp]},
        {"action": "free_requested", "addr": 1, "size": 100},  # not freed until completed
        {"action": "alloc", "addr": 3, "size": 70, "frames": [moe]},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": [torch_frame]},
    ]
    peak, live = prefill_memory.live_at_peak(trace, base=1000)
    assert peak == 1220 and set(live) == {1, 2, 3}
    rows = prefill_memory.grouped(live)
    assert rows[0] == ("npu_ops/triton/moe_experts.py:400 (moe_experts)", 120, 2)
    assert rows[1] == ("core/model.py:120 (forward)", 100, 1)
    assert prefill_memory.project_frame([torch_frame]) == "(outside the project)"
