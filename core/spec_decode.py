"""Speculative decoding with the DSpark drafter in the reference engine.

One step: the drafter proposes B tokens after the last emitted token; the scheduler picks how
many (k) to verify; the main model runs ONE forward over [last token, k drafts]; the longest
agreeing prefix (a drafts) is accepted plus one token from the target (the correction, or a
bonus when all k agree); the sequence's length moves back over the k - a rejected tokens.

- Greedy: a draft is accepted when it equals the target's argmax. The CPU reference is
  batch-invariant (a chunked forward computes the same bits as token-by-token decode), so the
  output equals plain greedy decoding token for token.
- Sampling: standard speculative (rejection) sampling over the processed distributions
  (temperature, top-k, top-p applied to target and draft alike): accept draft x with
  probability min(1, p(x) / q(x)), else draw from normalise(max(p - q, 0)); after k acceptances
  draw the bonus from p. The output distribution is the target's; the token sequence is not
  the same as plain sampling with the same seed (the random stream is consumed differently).
- Scheduler: the confidence head's raw logits c_j give prefix survival S_j = prod_{i<=j}
  sigmoid(c_i) (all drafts 0..j accepted); verifying k drafts yields 1 + sum_{j<k} S_j tokens
  in expectation, in draft_s + step_s(k + 1) seconds, read from the engine throughput curve
  (tokens/s against tokens verified per step) that `dsv41 profile-spec` measures once per
  device and model. The k with the highest expected tokens per second wins; `spec_len` fixes k.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .dspark import DSpark
from .engine import Engine, GenerationResult, SamplingParams, sample, sampling_probs
from .tokenizer import atomic_write_text

PROFILE_ENV = "DSV41_SPEC_PROFILE"
PROFILE_VERSION = 1


# ---- throughput curve ---------------------------------------------------------------------------

@dataclass
class ThroughputProfile:
    """Engine throughput against tokens verified per step, and the draft step's time."""

    tokens: list[int]  # tokens fed per verification step: 1 (plain decode), 2, ...
    tokens_per_s: list[float]
    draft_s: float  # one draft block
    device: str = "unknown"
    model: str = "unknown"
    version: int = PROFILE_VERSION

    def step_seconds(self, n: int) -> float:
        """Seconds of one verification step over n tokens (beyond the curve: the last step
        time scaled linearly, i.e. compute-bound)."""
        if n in self.tokens:
            i = self.tokens.index(n)
            return n / self.tokens_per_s[i]
        last = self.tokens[-1]
        return self.step_seconds(last) * n / last

    def check(self, where: str = "profile") -> ThroughputProfile:
        """Raise ValueError naming the first problem."""
        if self.version != PROFILE_VERSION:
            raise ValueError(f"{where}: version {self.version}, expected {PROFILE_VERSION}")
        if not isinstance(self.tokens, list) or not isinstance(self.tokens_per_s, list):
            raise ValueError(f"{where}: 'tokens' and 'tokens_per_s' must be lists")
        if not self.tokens or self.tokens != list(range(1, len(self.tokens) + 1)):
            raise ValueError(f"{where}: 'tokens' must be 1, 2, ..., n, got {self.tokens}")
        if len(self.tokens_per_s) != len(self.tokens):
            raise ValueError(f"{where}: 'tokens_per_s' has {len(self.tokens_per_s)} values for "
                             f"{len(self.tokens)} entries of 'tokens'")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.tokens_per_s):
            raise ValueError(f"{where}: 'tokens_per_s' must be positive numbers")
        if not (isinstance(self.draft_s, (int, float)) and math.isfinite(self.draft_s) and self.draft_s >= 0):
            raise ValueError(f"{where}: 'draft_s' must be a number >= 0, got {self.draft_s!r}")
        return self

    def save(self, path: str | Path) -> Path:
        """Write as JSON atomically (temporary file in the same folder, fsync, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ThroughputProfile:
        """Read and validate a profile file (ValueError naming the file on any problem)."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"{path}: cannot read the throughput profile ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        keys = {"tokens", "tokens_per_s", "draft_s"}
        if not isinstance(d, dict) or not keys <= set(d):
            raise ValueError(f"{path}: a throughput profile needs the keys {sorted(keys)}")
        extra = set(d) - {f for f in cls.__dataclass_fields__}
        if extra:
            raise ValueError(f"{path}: unknown keys {sorted(extra)}")
        return cls(**d).check(str(path))


def flat_profile(max_tokens: int) -> ThroughputProfile:
    """The assumption without a measured curve: a verification step costs the same whatever
    the number of tokens (memory-bound decode) and drafting is free."""
    return ThroughputProfile(list(range(1, max_tokens + 1)), [float(n) for n in range(1, max_tokens + 1)], 0.0,
                             "assumed", "any")


def device_key(device: torch.device | str) -> str:
    """A file-name-safe name of the accelerator (the profile is measured once per device)."""
    device = torch.device(device)
    name = device.type
    if device.type == "cuda" and torch.cuda.is_available():
        name += "-" + torch.cuda.get_device_name(device)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def model_key(cfg) -> str:
    """A short hash of the model config (throughput depends on the model as well)."""
    text = json.dumps(cfg.to_hf_dict(), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def default_profile_path(device: torch.device | str, cfg) -> Path:
    """$DSV41_SPEC_PROFILE if set, else <cache>/dsv41/spec-profile-<device>-<model>.json with
    <cache> = $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get(PROFILE_ENV):
        return Path(os.environ[PROFILE_ENV])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dsv41" / f"spec-profile-{device_key(device)}-{model_key(cfg)}.json"


# ---- scheduler and acceptance ---------------------------------------------------------------------

def prefix_survival(conf_logits: torch.Tensor) -> torch.Tensor:
    """S_j = prod_{i<=j} sigmoid(c_i): probability that drafts 0..j are all accepted."""
    return torch.cumprod(torch.sigmoid(conf_logits.float()), 0)


def choose_verify_len(conf_logits: torch.Tensor, profile: ThroughputProfile, max_k: int) -> int:
    """Number of drafts to verify (0..max_k) maximising expected tokens per second."""
    surv = prefix_survival(conf_logits[:max_k]).tolist()
    best, best_rate, expected = 0, -1.0, 1.0
    for k in range(max_k + 1):
        if k:
            expected += surv[k - 1]
        rate = expected / (profile.draft_s + profile.step_seconds(k + 1))
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = k, rate
    return best


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted drafts a, the target's token after them) from logits [k+1, V]."""
    best = torch.argmax(target_logits, -1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling: target distributions p [k+1, V], draft distributions q [k, V] the
    drafts were drawn from. Returns (accepted drafts a, next token); the emitted tokens are
    distributed exactly as sampling from p one token at a time."""
    p, q = p.float().cpu(), q.float().cpu()
    for i, x in enumerate(drafts):
        u = float(torch.rand((), generator=gen))
        if u * float(q[i, x]) < float(p[i, x]):
            continue
        resid = (p[i] - q[i]).clamp_min(0)
        if float(resid.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
            resid = p[i]
        return i, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    k = len(drafts)
    return k, int(torch.multinomial(p[k] / p[k].sum(), 1, generator=gen))


# ---- the decoding loop ----------------------------------------------------------------------------

@dataclass
class SpecOptions:
    """`spec_len` fixes the drafts verified per step (0..block size); None lets the scheduler
    choose from the confidence head and `profile` (flat step time when None)."""

    spec_len: int | None = None
    profile: ThroughputProfile | None = None


@dataclass
class _Stats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # tokens emitted per verification step: accepted drafts + the target's own token
            "mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
            "mean_verify_len": self.drafted / self.steps if self.steps else 0.0,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }


def generate_speculative(engine: Engine, prompt: list[int], params: SamplingParams | None = None,
                         opts: SpecOptions | None = None, images: list[torch.Tensor] | None = None,
                         drafter=None) -> GenerationResult:
    """`Engine.generate` with DSpark speculation (statistics in `result.spec`). `drafter` may be
    any object with DSpark's `absorb` / `draft` / `block_size` (tests). The sequence runs by
    itself through the engine's batched forward; a rejected suffix is rolled back by moving
    the sequence's length back (every cache row is addressed by position)."""
    p = (params or SamplingParams()).validate()
    opts = opts or SpecOptions()
    cfg, model, pool = engine.cfg, engine.model, engine.pool
    drafter = drafter or DSpark(model)
    b = drafter.block_size
    if opts.spec_len is not None and not 0 <= opts.spec_len <= b:
        raise ValueError(f"spec_len must be in 0..{b} (dspark_block_size), got {opts.spec_len}")
    profile = opts.profile or flat_profile(b + 1)
    greedy = p.temperature == 0
    gen = None if greedy else torch.Generator().manual_seed(p.seed)
    choose = None if greedy else (
        lambda j, lg: int(torch.multinomial(sampling_probs(lg, p).cpu(), 1, generator=gen)))

    if greedy and isinstance(drafter, DSpark) and drafter.graph is None:
        drafter.graph = engine.draft_graph(drafter)  # replayed on devices (None: eager)

    t0 = time.perf_counter()
    seq, logits, feats = engine.prefill_alone(prompt, p, images, features=True)
    state = seq.state
    drafter.absorb(pool, state, feats, state.length - feats.shape[0])
    t1 = time.perf_counter()

    stats, out, reason = _Stats(), [], "length"
    stops = set(p.stop_token_ids)

    def emit(tok: int) -> bool:
        nonlocal reason
        out.append(tok)
        if tok in stops:
            reason = "stop"
            return True
        return len(out) >= p.max_new_tokens

    tok = sample(logits, p, gen)
    done = emit(tok)
    try:
        while not done:
            ta = time.perf_counter()
            draft = drafter.draft(pool, state, tok, choose)
            k = opts.spec_len if opts.spec_len is not None else choose_verify_len(draft.confidence, profile, b)
            k = min(k, p.max_new_tokens - len(out) - 1)  # never verify past the requested length
            drafts = draft.tokens[:k].tolist()
            tb = time.perf_counter()
            start = state.length
            logits, feats, counts = engine.verify(state, [tok] + drafts)  # (a graph replay on devices)
            if counts is not None:
                seq.add_counts(*counts)  # read once, with the result (no sync per verification)
            if greedy:
                a, nxt = accept_greedy(logits, drafts)
            else:
                q = torch.stack([sampling_probs(lg, p) for lg in draft.logits[:k]]) if k else logits[:0]
                a, nxt = accept_sampled(torch.stack([sampling_probs(lg, p) for lg in logits]), q, drafts, gen)
            state.length = start + 1 + a  # roll back the rejected drafts
            if isinstance(drafter, DSpark) and drafter.model is model:
                drafter.advance(state, start, a + 1)  # the verification wrote the accepted rows' context
            else:
                drafter.absorb(pool, state, feats[: a + 1], start)
            state.free_old_swa(pool, state.length - 2 * cfg.sliding_window)
            stats.steps, stats.drafted, stats.accepted = stats.steps + 1, stats.drafted + k, stats.accepted + a
            stats.draft_s += tb - ta
            stats.verify_s += time.perf_counter() - tb
            for t in drafts[:a] + [nxt]:
                done = emit(t)
                if done:
                    break
            tok = nxt
    finally:
        engine.finish(seq)
    t2 = time.perf_counter()
    return GenerationResult(out, len(prompt), t1 - t0, t2 - t1, seq.hit, reason, seq.read_counts(),
                            spec=stats.as_dict())


# ---- measuring the throughput curve ---------------------------------------------------------------

def measure_profile(engine: Engine, *, prompt_len: int = 32, repeats: int = 5, seed: int = 0,
                    sync=lambda: None) -> ThroughputProfile:
    """Time one verification step over n = 1 .. block size + 1 tokens (rolled back after each
    run, so every run sees the same cache) and one draft block; medians of `repeats` runs after
    a warm-up. `sync` waits for the device (the platform's synchronize)."""
    cfg, model = engine.cfg, engine.model
    drafter = DSpark(model)
    drafter.graph = engine.draft_graph(drafter)  # greedy drafts replay it, as in a run (None: eager)
    b = drafter.block_size
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not 1 <= prompt_len <= cfg.max_position_embeddings - b - 2:
        raise ValueError(f"prompt_len must be in 1..{cfg.max_position_embeddings - b - 2}, got {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    seq, logits, feats = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=b + 2), features=True)
    state, pool = seq.state, engine.pool
    drafter.absorb(pool, state, feats, state.length - feats.shape[0])
    tok = int(torch.argmax(logits))
    ids = [tok] + drafter.draft(pool, state, tok).tokens.tolist()

    def timed(fn) -> float:
        times = []
        for r in range(repeats + 1):  # the first run warms up
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if r:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def verify(n: int):
        start = state.length
        engine.verify(state, ids[:n])  # (replayed where a run would replay it)
        state.length = start  # every run sees the same cache

    tps = [n / timed(lambda n=n: verify(n)) for n in range(1, b + 2)]
    draft_s = timed(lambda: drafter.draft(pool, state, tok))
    engine.finish(seq)
    return ThroughputProfile(list(range(1, b + 2)), tps, draft_s, device_key(engine.device), model_key(cfg)).check()
