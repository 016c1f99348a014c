"""`benchmarks/e2e.py`'s phase order on the CPU dry run: every timed phase before any profiler
session (a torch.profiler session leaves the process's later eager launches slower), the
decode kernel table at the last context, `--skip kernels` without it."""
import gc
import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e.py"
_spec = importlib.util.spec_from_file_location("e2e_bench", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


@pytest.fixture
def events(monkeypatch):
    """The order of the timed prefills, decode graph timings and profiler sessions of a run."""
    seen: list[str] = []

    def wrap(name, fn):
        def inner(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return inner

    # e2e narrows the captured buckets for its run (a process-wide setting): restored after the test
    monkeypatch.setattr(e2e.decode_graphs, "BUCKETS", e2e.decode_graphs.BUCKETS)
    monkeypatch.setattr(e2e, "run_prefill", wrap("prefill", e2e.run_prefill))
    monkeypatch.setattr(e2e, "run_decode", wrap("decode", e2e.run_decode))
    monkeypatch.setattr(e2e, "kernel_table", wrap("kernel_table", e2e.kernel_table))
    monkeypatch.setattr(e2e, "profile_kernels", wrap("profile_kernels", e2e.profile_kernels))
    monkeypatch.setattr(e2e.Clock, "per_call", wrap("per_call", e2e.Clock.per_call))
    yield seen
    gc.unfreeze()  # the run froze the test process's objects, as a serving process would


def run(monkeypatch, tmp_path, *extra) -> str:
    out = tmp_path / "e2e.md"
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--preset", "tiny", "--device", "cpu", "--dry-run", "--batches", "1",
                                      "--reps", "1", "--engine-steps", "1", "--out", str(out), *extra])
    assert e2e.main() == 0
    return out.read_text()


def test_timed_phases_come_before_the_profiler(monkeypatch, tmp_path, events):
    """Prefill first, then every decode context's timings (`Clock.per_call`, also used by the
    ceilings before), then the kernel table (one profiler session, at the last context)."""
    text = run(monkeypatch, tmp_path, "--contexts", "128,256", "--prefill", "256")
    names = events
    assert names.index("prefill") < names.index("decode"), names
    assert names.index("decode") < max(i for i, n in enumerate(names) if n == "per_call"), names
    assert names.count("kernel_table") == 1, names
    assert names.index("kernel_table") > max(i for i, n in enumerate(names) if n == "per_call"), names
    assert "## Kernels per decode step (batch 1, context 256" in text
    assert "## Prefill (one sequence)" in text and "## Decode" in text


def test_skip_kernels_leaves_out_the_table(monkeypatch, tmp_path, events):
    text = run(monkeypatch, tmp_path, "--contexts", "128", "--skip", "prefill,kernels")
    names = events
    assert "kernel_table" not in names and "prefill" not in names, names
    assert "## Decode" in text and "Kernels per decode step" not in text


def test_report_names_the_environment_settings(monkeypatch):
    """The report's header lists the process's DSV41_* choices (what a run measured), or says
    there are none."""
    for k in [k for k in e2e.os.environ if k.startswith("DSV41_")]:
        monkeypatch.delenv(k)
    assert e2e.env_settings() == "none (the defaults)"
    monkeypatch.setenv("DSV41_SPARSE_KV_X2", "0")
    monkeypatch.setenv("DSV41_FP8_DECODE", "fold")
    assert e2e.env_settings() == "`DSV41_FP8_DECODE=fold`, `DSV41_SPARSE_KV_X2=0`"


def test_span_charges_add_up_to_the_busy_time():
    """`span_charges`: a launch overlapped by an earlier one on another stream is charged
    nothing, one that starts early (its programmatic-launch wait) only the part past the one
    before, one after an idle gap its whole duration; the charges sum to the busy time."""
    launches = [(0.0, 10.0, "a"), (2.0, 5.0, "b"), (8.0, 4.0, "c"), (15.0, 3.0, "d"), (16.0, 1.0, "b")]
    charged = e2e.span_charges(launches)
    assert charged == {"a": 10.0, "b": 0.0, "c": 2.0, "d": 3.0}
    assert sum(charged.values()) == 12.0 + 3.0
    assert e2e.span_charges(list(reversed(launches))) == charged  # (walked by start, whatever the order)


def test_step_variants_are_captured_first_then_timed_interleaved(monkeypatch, tmp_path, events):
    """`--streams`: every variant's decode step is captured (its engine built) before any is timed,
    and then timed in VARIANT_ROUNDS round-robin rounds, so no variant alone carries the process's
    drift; the report keeps one row per batch with every variant."""
    engines = []
    real_engine = e2e.Engine

    def engine(*args, **kwargs):
        events.append("engine")
        made = real_engine(*args, **kwargs)
        engines.append(made)
        return made

    monkeypatch.setattr(e2e, "Engine", engine)
    timed = []
    real_run = e2e.Clock.per_call

    def per_call(self, fn, reps, warmup=1):
        events.append("per_call")
        timed.append(fn.__defaults__[0] if fn.__defaults__ else None)  # the engine a variant's lambda times
        return real_run(self, fn, reps, warmup)

    monkeypatch.setattr(e2e.Clock, "per_call", per_call)
    text = run(monkeypatch, tmp_path, "--contexts", "128", "--skip", "prefill,kernels", "--streams")
    variants = 4
    streams = engines[-variants:]  # the streams phase's engines, after the decode phase's
    assert timed[-variants * e2e.VARIANT_ROUNDS:] == streams * e2e.VARIANT_ROUNDS, timed
    last_engine = max(i for i, n in enumerate(events) if n == "engine")
    assert "per_call" not in events[last_engine - variants + 1:last_engine + 1], events
    assert "## Second stream" in text and "| 128 | 1 |" in text.split("## Second stream")[1], text
