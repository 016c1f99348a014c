"""Every failure of the `dsv41` command ends in one `dsv41: error:` line first (status 2, or 130
for Ctrl-C), leaves nothing behind, and is found before slow work. Run in-process (`cli.main`)
so each case costs milliseconds; tests/test_cli.py runs the console entry as a subprocess."""

import json
import os
import stat

import pytest
import torch
from dsv41.core.config import ConfigError, from_dict, preset
from dsv41.deploy import cli, outdir
from dsv41.deploy import convert as conv
from dsv41.deploy.checkpoint import (
    load_checkpoint_weights,
    make_checkpoint,
    read_config,
)

SEED = 0


def run_cli(capsys, *args):
    """(status, stdout, stderr lines) of `dsv41 ARGS` run in this process."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def listing(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def one_error(code, err, needle: str) -> None:
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("dsv41: error: ") and needle in err[0], err


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny random-weight checkpoint (read-only use)."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(preset("tiny"), d, seed=SEED)
    return d


def _config_file(tmp_path, edit) -> str:
    d = preset("tiny").to_hf_dict()
    edit(d)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(d))
    return str(f)


# ---- bad options and configs: one line, before anything is built ------------------------------

@pytest.mark.parametrize("args, needle", [
    (["run", "--temperature", "nan"], "--temperature must be a finite number"),
    (["run", "--temperature", "inf"], "--temperature must be a finite number"),
    (["run", "--top-p", "nan"], "--top-p must be a finite number"),
    (["run", "--max-new-tokens", "2048", "--prompt-ids", "5"], "leaves no room for a prompt"),
    (["run", "--max-new-tokens", "2040", "--prompt-ids", "5," * 9 + "5"], "exceeds max_position_embeddings"),
    (["run", "--prompt-ids", "5,4,6"], "holds the image token (id 4) but no image"),
    (["run", "--preset", "mini", "--prompt", "hi"], "the mini preset has no tokenizer"),
    (["run", "--speculative", "--spec-len", "9"], "--spec-len: spec_len must be in 0..5"),
    (["make-checkpoint", "--out", "{tmp}/x", "--max-shard-size", "infGB"], "finite number of bytes"),
    (["make-checkpoint", "--out", "{tmp}/x", "--max-shard-size", "nanMB"], "finite number of bytes"),
    (["profile-spec", "--out", "{tmp}"], "is a directory"),
])
def test_bad_options_one_line(capsys, tmp_path, args, needle):
    code, _, err = run_cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    one_error(code, err, needle)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["text_config"]["rope_scaling"].update(factor="x"), "rope_scaling.factor must be float, got 'x'"),
    (lambda d: d["text_config"].update(hidden_size="128"), "hidden_size must be int"),
    (lambda d: d["text_config"].update(compress_ratios="2"), "compress_ratios must be a list of integers"),
    (lambda d: d["text_config"].pop("vocab_size"), "does not state vocab_size"),
    (lambda d: d["quantization_config"].update(weight_block_size=[0, 0]), "weight_block_size must be [32, 32]"),
])
def test_bad_config_one_line(capsys, tmp_path, edit, needle):
    for command in ("info", "run"):
        code, _, err = run_cli(capsys, command, "--config", _config_file(tmp_path, edit))
        one_error(code, err, needle)


def test_empty_config_is_not_the_full_model(capsys, tmp_path):
    f = tmp_path / "empty.json"
    f.write_text("{}")
    code, _, err = run_cli(capsys, "run", "--config", f)
    one_error(code, err, "does not state vocab_size, hidden_size, num_hidden_layers")
    with pytest.raises(ConfigError, match="does not state vocab_size"):
        from_dict({"dim": 128, "n_layers": 2})


def test_problem_list_keeps_bullets_after_one_summary_line(capsys, tmp_path):
    def edit(d):
        d["text_config"].update(o_groups=3, hidden_size=100)

    code, _, err = run_cli(capsys, "info", "--config", _config_file(tmp_path, edit))
    assert code == 2
    assert err[0].startswith("dsv41: error: ") and "invalid model config: " in err[0] and "(and 1 more below)" in err[0]
    assert err[1:] == ["  - num_attention_heads (4) is not divisible by o_groups (3)",
                       "  - hidden_size (100) must be a multiple of 32 (FP8/FP4 block size)"]


def test_error_text_shapes():
    assert cli.error_text("plain") == "dsv41: error: plain"
    assert cli.error_text("head:\n  - only") == "dsv41: error: head: only"
    long = cli.error_text("head:\n" + "\n".join(f"  - p{i}" for i in range(30))).splitlines()
    assert long[0] == "dsv41: error: head: p0 (and 29 more below)"
    assert len(long) == 1 + cli.MAX_LISTED + 1 and long[-1] == "  ... and 10 more"


def test_memory_is_estimated_before_allocating(capsys, monkeypatch):
    from dsv41.deploy import preflight

    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 10**6)
    code, out, err = run_cli(capsys, "run", "--prompt-ids", "5,6")
    one_error(code, err, "needs about 0.")
    assert "of host memory but 0.0 GB is available" in err[0] and out == ""
    monkeypatch.setenv(preflight.SKIP_ENV, "1")  # the escape hatch skips it
    need = preflight.check_memory(preset("tiny"), "cpu", with_drafter=False, random_weights=True)
    assert need.host > 0


def test_memory_estimate_counts_the_drafter_only_when_built():
    from dsv41.deploy.preflight import weights_need

    cfg = preset("tiny")
    cpu = torch.device("cpu")
    with_d = weights_need(cfg, cpu, with_drafter=True, engram_offload=False, random_weights=False).host
    without = weights_need(cfg, cpu, with_drafter=False, engram_offload=False, random_weights=False).host
    assert with_d > without


# ---- faults while writing: one line, nothing left ---------------------------------------------

def _fail_second_shard(monkeypatch, exc):
    real = conv.ShardWriter._write_all
    seen = []

    def flaky(self, data, pos):
        if self.path.name not in seen:
            seen.append(self.path.name)
        if len(seen) == 2:
            raise exc
        return real(self, data, pos)

    monkeypatch.setattr(conv.ShardWriter, "_write_all", flaky)


def test_disk_full_during_make_checkpoint(capsys, tmp_path, monkeypatch):
    _fail_second_shard(monkeypatch, OSError(28, "No space left on device", "shard"))
    code, _, err = run_cli(capsys, "make-checkpoint", "--out", tmp_path / "ck")
    one_error(code, err, "No space left on device")
    assert "nothing was written" in err[0] and listing(tmp_path) == []


def test_ctrl_c_during_make_checkpoint(capsys, tmp_path, monkeypatch):
    _fail_second_shard(monkeypatch, KeyboardInterrupt())
    code, _, err = run_cli(capsys, "make-checkpoint", "--out", tmp_path / "ck")
    assert code == 130 and err == ["dsv41: error: interrupted"]
    assert listing(tmp_path) == []


def test_disk_full_during_convert(capsys, tmp_path, monkeypatch, tiny_ckpt):
    _fail_second_shard(monkeypatch, OSError(28, "No space left on device", "shard"))
    code, _, err = run_cli(capsys, "convert", "--hf-ckpt-path", tiny_ckpt, "--save-path", tmp_path / "mp",
                           "--model-parallel", "2", "--no-progress")
    one_error(code, err, "No space left on device")
    assert listing(tmp_path) == []


def test_convert_to_an_unwritable_place(capsys, tiny_ckpt):
    code, _, err = run_cli(capsys, "convert", "--hf-ckpt-path", tiny_ckpt, "--save-path", "/proc/dsv41-xx",
                           "--model-parallel", "1", "--no-progress")
    one_error(code, err, "/proc/dsv41-xx: cannot write")


def test_convert_rejects_paths_outside_the_checkpoint(capsys, tmp_path, tiny_ckpt):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../" + idx["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    code, _, err = run_cli(capsys, "convert", "--hf-ckpt-path", src, "--save-path", tmp_path / "mp",
                           "--model-parallel", "1", "--no-progress")
    one_error(code, err, "is not a plain file name in the checkpoint directory")
    assert not (tmp_path / "mp").exists()


# ---- files and leftovers ----------------------------------------------------------------------

def _modes(d) -> set[str]:
    return {oct(stat.S_IMODE(p.stat().st_mode)) for p in [d, *d.iterdir()]}


def test_outputs_follow_the_umask(tmp_path, tiny_ckpt):
    old = os.umask(0o022)
    try:
        make_checkpoint(preset("tiny"), tmp_path / "ck", seed=SEED)
        conv.convert(tiny_ckpt, tmp_path / "mp", 1, progress=False)
    finally:
        os.umask(old)
    for d in (tmp_path / "ck", tmp_path / "mp"):
        assert (d / "tokenizer.json").exists()
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in d.rglob("*") if p.is_file()} == {"0o644"}
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in [d, *d.rglob("*")] if p.is_dir()} == {"0o755"}


def test_rerun_removes_what_a_killed_run_left(capsys, tmp_path):
    for leftover in (".ck.tmp-1a2b3c4d", ".ck.old-5e6f7a8b"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    code, _, err = run_cli(capsys, "make-checkpoint", "--out", tmp_path / "ck")
    assert code == 0
    assert sum("left by an interrupted run" in line for line in err) == 2
    assert [p for p in listing(tmp_path) if "/" not in p] == ["ck"]


def test_two_writers_of_one_destination(capsys, tmp_path, tiny_ckpt):
    """A second make-checkpoint (or convert) to a destination another process is writing
    stops with one line; the lock file goes away with its holder."""
    dst = tmp_path / "ck"
    with outdir.destination_lock(dst):
        code, _, err = run_cli(capsys, "make-checkpoint", "--out", dst)
        one_error(code, err, "another dsv41 process is writing it")
        with pytest.raises(conv.ConvertError, match="another dsv41 process"):
            conv.convert(tiny_ckpt, dst, 1, progress=False)
    assert listing(tmp_path) == []
    assert run_cli(capsys, "make-checkpoint", "--out", dst)[0] == 0
    assert listing(tmp_path) == sorted(["ck"] + [f"ck/{p.relative_to(dst)}" for p in dst.rglob("*")])


def test_failed_replace_leaves_no_aside_folder(tmp_path, monkeypatch):
    from dsv41.deploy import checkpoint as ck

    dst = tmp_path / "ck"
    make_checkpoint(preset("tiny"), dst, seed=SEED)
    real = os.replace

    def refuse(a, b):
        if str(a) == str(dst):
            raise PermissionError(13, "Permission denied", str(a))
        return real(a, b)

    monkeypatch.setattr(ck.os, "replace", refuse)
    with pytest.raises(PermissionError):
        make_checkpoint(preset("tiny"), dst, seed=SEED + 1, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert read_config(dst) == preset("tiny")


def test_pickle_only_folder_says_how_to_convert(capsys, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    code, _, err = run_cli(capsys, "run", "--ckpt", d, "--prompt-ids", "5")
    one_error(code, err, "only PyTorch pickle files (pytorch_model.bin), which are never loaded")
    assert "save_file(torch.load('pytorch_model.bin', weights_only=True)" in err[0]
    code, _, err = run_cli(capsys, "convert", "--hf-ckpt-path", d, "--save-path", tmp_path / "mp",
                           "--model-parallel", "1", "--no-progress")
    one_error(code, err, "only PyTorch pickle files (pytorch_model.bin), which are never loaded")


def test_nan_weights_are_one_error(tmp_path, tiny_ckpt):
    import shutil

    from dsv41.core.weights import WeightError, count_nonfinite
    from safetensors.torch import load_file, save_file

    src = tmp_path / "nan"
    shutil.copytree(tiny_ckpt, src)
    shard = min(src.glob("model-*.safetensors"))
    sd = load_file(shard)
    name = next(k for k, v in sd.items() if v.dtype == torch.bfloat16)
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = float("nan")
    save_file(sd, shard, metadata={"format": "pt"})
    with pytest.raises(WeightError, match=f"tensor {name} holds 1 NaN/Inf value"):
        load_checkpoint_weights(src, preset("tiny"))
    fp8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
    fp8.view(torch.uint8)[1] = 0x7F  # E4M3 NaN
    e8m0 = torch.full((3,), 127, dtype=torch.uint8)
    e8m0[0] = 0xFF  # E8M0 NaN
    assert count_nonfinite(fp8) == 1 and count_nonfinite(e8m0.view(torch.float8_e8m0fnu)) == 1
    assert count_nonfinite(torch.tensor([1.0, float("inf"), float("nan")])) == 2


# ---- memory and presets -----------------------------------------------------------------------

def test_streamed_random_weights_equal_the_whole_draw():
    from dsv41.core.model import Transformer
    from dsv41.core.weights import iter_random_state, random_state_dict

    with torch.device("meta"):
        model = Transformer(preset("tiny"))
    whole = random_state_dict(model, SEED)
    parts: dict = {}
    n = 0
    for part in iter_random_state(model, SEED, max_bytes=20_000):  # forces splits below layers
        assert not set(part) & set(parts)
        parts.update(part)
        n += 1
    assert n > 50 and set(parts) == set(whole)
    for k, t in whole.items():
        assert torch.equal(parts[k].view(torch.uint8), t.view(torch.uint8)), k


def test_drafter_is_built_only_when_asked(tiny_ckpt):
    from dsv41.core.weights import build_model

    cfg = preset("tiny")
    plain = build_model(cfg, seed=SEED, with_drafter=False)
    assert plain.mtp is None and not any(k.startswith("mtp.") for k in plain.state_dict())
    loaded = load_checkpoint_weights(tiny_ckpt, cfg, with_drafter=False)
    assert loaded.mtp is None
    full = build_model(cfg, seed=SEED)
    for k, t in plain.state_dict().items():
        assert torch.equal(t.view(torch.uint8), full.state_dict()[k].view(torch.uint8)), k


def test_mini_drafter_in_proportion():
    from dsv41.core.info import model_info

    params = model_info(preset("mini"))["params"]
    assert params["dspark"] < 0.3 * params["backbone"]  # was 14.2B against a 6.0B backbone


# ---- images of a messages file ----------------------------------------------------------------

def test_messages_images_stay_in_their_folder(tmp_path):
    from dsv41.core.messages import MessagesError, encode_messages
    from dsv41.core.tokenizer import build_tiny_tokenizer
    from PIL import Image

    tok, cfg = build_tiny_tokenizer(), preset("tiny")
    inside, outside = tmp_path / "msgs", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    Image.new("RGB", (20, 20), (255, 0, 0)).save(inside / "ok.png")
    Image.new("RGB", (20, 20), (0, 255, 0)).save(outside / "secret.png")
    (inside / "link.png").symlink_to(outside / "secret.png")

    def msgs(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    roots = [inside]
    assert len(encode_messages(tok, cfg, msgs("ok.png"), base_dir=inside, image_roots=roots).images) == 1
    errors = []
    for url in ("../elsewhere/secret.png", str(outside / "secret.png"), "link.png", "missing.png",
                "file://" + str(outside / "secret.png")):
        with pytest.raises(MessagesError) as e:
            encode_messages(tok, cfg, msgs(url), base_dir=inside, image_roots=roots)
        errors.append(str(e.value).replace(repr(url), "URL"))
    assert len(set(errors)) == 1 and "--allow-local-images" in errors[0]  # missing == outside
    wider = encode_messages(tok, cfg, msgs("../elsewhere/secret.png"), base_dir=inside, image_roots=[inside, outside])
    assert len(wider.images) == 1


def test_messages_option_restricts_and_widens(capsys, tmp_path):
    from PIL import Image

    (tmp_path / "m").mkdir()
    (tmp_path / "img").mkdir()
    Image.new("RGB", (20, 20)).save(tmp_path / "img" / "a.png")
    f = tmp_path / "m" / "messages.json"
    f.write_text(json.dumps([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "img" / "a.png")}}]}]))
    code, _, err = run_cli(capsys, "run", "--messages", f, "--max-new-tokens", "2000")
    one_error(code, err, "is not a file inside")
    # widened: the image is read, and the next check (the context) is what fails
    code, _, err = run_cli(capsys, "run", "--messages", f, "--allow-local-images", tmp_path / "img",
                           "--max-new-tokens", "2047")
    one_error(code, err, "exceeds max_position_embeddings")


# ---- first contact ----------------------------------------------------------------------------

def test_run_help_shows_defaults_and_ced():
    text = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    flat = " ".join(text.split())
    for needle in ("(default: 16)", "(default: 0.0)", "(default: 1.0)", "(default: 0)", "(default: cpu)",
                   "(default: ced)", "an approximation of exact"):
        assert needle in flat, needle


def test_profile_spec_warns_when_the_curve_is_not_increasing(capsys, tmp_path, monkeypatch):
    from dsv41.core import spec_decode

    def fake(engine, **kw):
        kw["sync"]()
        return spec_decode.ThroughputProfile([1, 2, 3], [10.0, 18.0, 12.0], 0.01, "cpu", "tiny")

    monkeypatch.setattr(spec_decode, "measure_profile", fake)
    code, out, err = run_cli(capsys, "profile-spec", "--out", tmp_path / "p.json")
    assert code == 0 and "wrote" in out
    assert any(line.startswith("dsv41: warning: the measured curve is not increasing (tokens/s at 3 tokens <= "
                               "at 2)") for line in err)


def test_unforeseen_out_of_memory_is_one_line(capsys, monkeypatch):
    def alloc(args):
        torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator's RuntimeError

    monkeypatch.setattr(cli, "cmd_info", alloc)
    code, _, err = run_cli(capsys, "info")
    one_error(code, err, "out of memory (")
    assert "can't allocate memory" in err[0]


@pytest.mark.parametrize("int8", [False, True])
def test_engram_rows_drawn_in_chunks_equal_the_whole_draw(int8):
    """The Engram tables (the largest tensors) are drawn a row chunk at a time: same values."""
    from dsv41.backends.reference import quant
    from dsv41.core.weights import _engram_rows, _randn

    q, sc = quant.fp8_quant(_randn(torch.Generator().manual_seed(3), (1000, 64), 1.0))
    if int8:
        q, sc = quant.int8_row_quant(quant.fp8_dequant(q, sc))
    q2, sc2 = _engram_rows(torch.Generator().manual_seed(3), (1000, 64), 1.0, int8, chunk_bytes=64 * 4 * 33)
    assert q2.dtype == q.dtype and sc2.dtype == sc.dtype
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sc2.view(torch.uint8), sc.view(torch.uint8))


def test_memory_estimate_counts_the_reference_dequant_cache(monkeypatch):
    """On the reference backend every used Linear weight is also kept dequantised in fp64:
    the estimate counts 8 bytes per weight value there, nothing on other backends."""
    from dsv41.core.model import Linear, Transformer
    from dsv41.deploy.preflight import HEADROOM_FRACTION, weights_need

    cfg, cpu = preset("tiny"), torch.device("cpu")
    ref = weights_need(cfg, cpu, with_drafter=False, engram_offload=False, random_weights=False).host
    monkeypatch.setenv("DSV41_BACKEND", "cuda")  # ops would resolve elsewhere: no reference cache
    other = weights_need(cfg, cpu, with_drafter=False, engram_offload=False, random_weights=False).host
    with torch.device("meta"):
        model = Transformer(cfg, with_drafter=False)
    values = sum(m.out_features * m.in_features for n, m in model.named_modules()
                 if isinstance(m, Linear) and not n.startswith(("vision.", "aligner.")))
    assert abs((ref - other) - 8 * values * (1 + HEADROOM_FRACTION)) <= 1  # the headroom scales it too
