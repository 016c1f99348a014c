"""`dsv41 run --prompts-file`: one continuous batch equals separate runs, in input order."""

import json

import pytest
import torch
from _util import rand_prompt

from dsv41.deploy.cli import main


def _run(capsys, *argv) -> list[dict]:
    assert main(["run", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_prompts_file_equals_separate_runs(tmp_path, capsys, tiny_cfg, rng):
    """Mixed prompt kinds, lengths, token budgets, temperatures and seeds in one batch (max batch
    5, so sequences are admitted while others decode): every result equals its own run."""
    reqs = []
    for i in range(8):
        ids = rand_prompt(tiny_cfg, int(torch.randint(1, 40, (1,), generator=rng)), rng).tolist()
        r = {"prompt_ids": ids, "max_new_tokens": 2 + i % 4}
        if i % 3 == 1:
            r = {"prompt": f"request number {i} about foxes", "max_new_tokens": 3}
        if i % 4 == 2:
            r.update(temperature=0.9, seed=100 + i)
        reqs.append(r)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in reqs) + "\n\n")
    rows = _run(capsys, "--prompts-file", str(f), "--max-batch", "5", "--ignore-eos")
    assert [r["line"] for r in rows[:-1]] == list(range(1, 9))
    summary = rows[-1]
    assert summary["requests"] == 8 and summary["generated_tokens"] == sum(len(r["token_ids"]) for r in rows[:-1])
    assert summary["total_tokens_per_s"] > 0
    for r, got in zip(reqs, rows):
        assert len(got["token_ids"]) == r["max_new_tokens"]
        if "temperature" in r:  # (`run --seed` would also reseed the weights: see test_engine's sampled batch)
            continue
        argv = ["--ignore-eos", "--max-new-tokens", str(r["max_new_tokens"])]
        argv += ["--prompt-ids", ",".join(map(str, r["prompt_ids"]))] if "prompt_ids" in r else ["--prompt", r["prompt"]]
        alone = _run(capsys, *argv)[0]
        assert alone["token_ids"] == got["token_ids"], (r, got)
    # sampled requests: the request's seed decides, not the batch around it
    again = _run(capsys, "--prompts-file", str(f), "--max-batch", "2", "--ignore-eos")
    assert [r["token_ids"] for r in again[:-1]] == [r["token_ids"] for r in rows[:-1]]


@pytest.mark.parametrize("line, msg", [
    ("not json", "line 1: not valid JSON"),
    ('{"prompt": "a", "prompt_ids": [5]}', "exactly one of"),
    ('{"prompt_ids": []}', "non-empty list of integers"),
    ('{"prompt": "a", "max_new_tokens": "many"}', "'max_new_tokens' must be a number"),
    ('{"prompt": "a", "colour": 1}', "unknown keys"),
    ('{"prompt_ids": [5, 99999999]}', "outside the vocabulary"),
])
def test_bad_prompts_file_is_one_error(tmp_path, capsys, line, msg):
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    assert main(["run", "--prompts-file", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv41: error:") and msg in err[0]
