"""Acceptance replay: drive a random-weight model's speculative rounds with a recorded or modelled acceptance.

A random model's drafts almost never match its target, so measured acceptance says nothing about a real
deployment. A profile overrides the accepted count of every round through `EngineHooks.accept_hook`, so the
engine does the full work of a round (draft N, verify N+1 rows, roll back the rejected suffix) with a realistic
accepted count. Every result produced this way is labelled "replayed acceptance".

Profiles (`AcceptProfile.parse`):
  model | none       the model's own greedy acceptance (no hook)
  p=0.85[,seed=S][,fresh=1]
                     draft i accepted with probability p given draft i-1 accepted (a seeded geometric chain:
                     position i is accepted in a fraction p^(i+1) of rounds); the stream restarts at every
                     generation, or with fresh=1 the k-th generation draws the k-th stream of the seed (every arm
                     the same k-th one): one stream's start, e.g. seed 0's first two rounds rejected at p <= 0.75,
                     then does not repeat in every request, where an adaptive depth would read it as the text's
  fixed=K            K drafts accepted every round (clamped to the draft depth)
  trace=FILE[,arm=A] accepted counts cycled from FILE: a JSON list of ints, {"accepted": [...]}, or a qspec
                     bench result (the `rounds.accepted` of its runs, optionally only arm A's)

p= and fixed= are drawn per round. A trace follows the text instead: greedy drafts accepted from a token position
depend on the text there, not on the depth or the rounds before, so a trace is replayed by the request's token
position. Recorded rounds at depth D (scripts/depth_cpu.py --traces writes one per prompt set at D = 8,
{"accepted": [...], "depth": 8, ...}) that accepted c_0, c_1, ... start at positions p_0, p_0 + c_0 + 1, ...; the
count at position p_r + j (j <= c_r) is the run of drafts that would match from there: c_r - j when the recorded
round was rejected (c_r < D); when it accepted all D drafts, the text was never tried past them, and the run goes on
through the round's own last token into the next round's run (c_r - j + 1 + count(p_{r+1})): a round that starts
inside a run of full rounds is not cut short by where the recording's rounds happened to end. A round at depth d
from position t then replays min(d, count(t)): every depth, and `--draft auto`, whose plain stretches move on
through the text as its rounds do, read the same text.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qspec.spec.accept import AcceptHook

REPLAYED_LABEL = "replayed acceptance"
MODEL_LABEL = "model acceptance"


class _GeometricHook:
    """Accepts draft i with probability p given i-1 accepted; restarts its RNG at round 0 of every generation, so
    every run (and every arm) replays the same random stream, or (`fresh`) seeds the k-th generation's stream with
    (seed, k). (A generation without a drafting round draws no stream: an adaptive arm's k-th stream can then be
    another arm's k+1-th, of the same distribution.)"""

    def __init__(self, p: float, seed: int, fresh: bool = False) -> None:
        self.p, self.seed, self.fresh, self.gen = p, seed, fresh, -1
        self.rng = random.Random(seed)

    def __call__(self, rnd: int, n_draft: int) -> int:
        if rnd == 0:
            self.gen += 1
            self.rng = random.Random(f"{self.seed}:{self.gen}" if self.fresh else self.seed)
        k = 0
        while k < n_draft and self.rng.random() < self.p:
            k += 1
        return k


def counts_by_position(trace: tuple[int, ...], depth: int | None = None) -> tuple[int, ...]:
    """Recorded rounds' accepted counts (at `depth`; None: unknown, every round taken as rejected) -> the count at
    every token position they covered (module docstring). The trace is cyclic, so the last round's run goes on into
    the first's; runs are cut at 4 * depth (a trace of full rounds only would be one endless run)."""
    n = len(trace)
    start = [0] * n  # the count at each recorded round's first position
    for _ in range(2):  # the second pass carries the first round's run into the last round's
        for r in reversed(range(n)):
            c = trace[r]
            start[r] = min(c + 1 + start[(r + 1) % n], 4 * depth) if depth is not None and c >= depth else c
    return tuple(start[r] - j for r, c in enumerate(trace) for j in range(c + 1))


class _TraceHook:
    by_position = True  # the engine passes the request's token position at the round, not the round's index

    def __init__(self, trace: tuple[int, ...], depth: int | None = None) -> None:
        self.counts = counts_by_position(trace, depth)

    def __call__(self, position: int, n_draft: int) -> int:
        return min(n_draft, self.counts[position % len(self.counts)])


class _FixedHook:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, rnd: int, n_draft: int) -> int:
        return min(n_draft, self.k)


def parse_kv(spec: str, what: str | None = None) -> dict[str, str]:
    """`a=1,b=2` -> {"a": "1", "b": "2"} (keys lower-cased); `what` names the spec in errors."""
    out: dict[str, str] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep:
            raise ValueError(f"{what or f'accept profile {spec!r}'}: expected key=value, got {part!r}")
        out[key.strip().lower()] = val.strip()
    return out


def load_trace(path: str | Path, arm: str | None = None) -> tuple[tuple[int, ...], int | None]:
    """Accepted counts from a JSON list, {"accepted": [...], "depth": D}, or a qspec bench result's runs, and the
    depth they were recorded at (None where the file does not say)."""
    p = Path(path)
    depth: int | None = None
    try:
        data: Any = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"accept trace {p}: file not found") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"accept trace {p}: not JSON ({e})") from e
    if isinstance(data, dict) and "runs" in data:
        seq: list[Any] = []
        for run in data["runs"]:
            if arm is None or run.get("arm") == arm:
                seq.extend((run.get("rounds") or {}).get("accepted") or [])
    elif isinstance(data, dict) and "accepted" in data:
        seq = list(data["accepted"])
        depth = data.get("depth")
        if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
            raise ValueError(f"accept trace {p}: depth must be a positive integer, got {depth!r}")
    elif isinstance(data, list):
        seq = data
    else:
        raise ValueError(f"accept trace {p}: expected a list of accepted counts, {{'accepted': [...]}} or a "
                         "qspec bench result")
    if not seq:
        raise ValueError(f"accept trace {p}: no accepted counts" + (f" for arm {arm!r}" if arm else ""))
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seq):
        raise ValueError(f"accept trace {p}: accepted counts must be non-negative integers")
    if depth is not None and max(seq) > depth:
        raise ValueError(f"accept trace {p}: a count of {max(seq)} above the recorded depth {depth}")
    return tuple(seq), depth


@dataclass(frozen=True)
class AcceptProfile:
    kind: str = "model"  # model | p | fixed | trace
    p: float = 0.0
    k: int = 0
    seed: int = 0
    fresh: bool = False  # p=: a new stream per generation (see _GeometricHook)
    trace: tuple[int, ...] = field(default=(), repr=False)
    trace_depth: int | None = None  # the depth the trace was recorded at (its full rounds' runs go on)
    spec: str = "model"  # the string it was parsed from

    @classmethod
    def parse(cls, spec: str | None) -> AcceptProfile:
        s = (spec or "").strip()
        if s.lower() in ("", "model", "none"):
            return cls()
        kv = parse_kv(s)
        kinds = [k for k in ("p", "fixed", "trace") if k in kv]
        if len(kinds) != 1:
            raise ValueError(f"accept profile {s!r}: give exactly one of p=, fixed=, trace= (or 'model')")
        kind = kinds[0]
        allowed = {"p": {"p", "seed", "fresh"}, "fixed": {"fixed"}, "trace": {"trace", "arm"}}[kind]
        extra = set(kv) - allowed
        if extra:
            raise ValueError(f"accept profile {s!r}: unknown key(s) {', '.join(sorted(extra))} for {kind}=")
        try:
            if kind == "p":
                p = float(kv["p"])
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"p must be in [0, 1], got {p}")
                fresh = kv.get("fresh", "0")
                if fresh not in ("0", "1"):
                    raise ValueError(f"fresh must be 0 or 1, got {fresh!r}")
                return cls("p", p=p, seed=int(kv.get("seed", 0)), fresh=fresh == "1", spec=s)
            if kind == "fixed":
                k = int(kv["fixed"])
                if k < 0:
                    raise ValueError(f"fixed must be >= 0, got {k}")
                return cls("fixed", k=k, spec=s)
        except ValueError as e:
            raise ValueError(f"accept profile {s!r}: {e}") from e
        trace, depth = load_trace(kv["trace"], kv.get("arm"))
        return cls("trace", trace=trace, trace_depth=depth, spec=s)

    @property
    def replayed(self) -> bool:
        return self.kind != "model"

    @property
    def label(self) -> str:
        return f"{REPLAYED_LABEL} ({self.spec})" if self.replayed else MODEL_LABEL

    def hook(self) -> AcceptHook | None:
        """A fresh accept_hook for EngineHooks (None: the model's own acceptance)."""
        if self.kind == "p":
            return _GeometricHook(self.p, self.seed, self.fresh)
        if self.kind == "fixed":
            return _FixedHook(self.k)
        if self.kind == "trace":
            return _TraceHook(self.trace, self.trace_depth)
        return None

    def expected_by_position(self, n_draft: int) -> list[float] | None:
        """Expected acceptance rate of each draft position (None for the model's own, or a trace)."""
        if self.kind == "p":
            return [self.p ** (i + 1) for i in range(n_draft)]
        if self.kind == "fixed":
            return [1.0 if i < self.k else 0.0 for i in range(n_draft)]
        return None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": "replayed" if self.replayed else "model", "label": self.label,
                             "profile": self.spec, "kind": self.kind}
        if self.kind == "p":
            d |= {"p": self.p, "seed": self.seed, "fresh_streams": self.fresh}
        elif self.kind == "fixed":
            d["fixed"] = self.k
        elif self.kind == "trace":
            d |= {"trace_rounds": len(self.trace), "trace_mean": sum(self.trace) / len(self.trace),
                  "trace_depth": self.trace_depth}
        return d
