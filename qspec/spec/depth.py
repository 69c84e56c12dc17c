"""The draft-depth controller of `--draft auto`: before every round, the depth 0..N that maximises expected tokens
per second.

With conditional acceptance a_i of draft position i (the probability that draft i is accepted once drafts 1..i-1
were), a round at depth d commits E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i tokens, and costs cost(d) seconds (draft
chain of d steps, verify of d+1 rows, rollback, extend; for d = 0, one plain decoding step). The controller picks
argmax_d E(d) / cost(d).

- Acceptance: per position, decaying counts of the request's rounds that reached the position and of those that
  accepted it (each new round multiplies the old counts by `decay`), blended with a prior of `prior_weight`
  pseudo-rounds, plus up to `carry` more as the prior rests on more rounds. The prior is the engine's long-run
  acceptance: the same counts over all requests, decaying slowly (`prior_decay` per round), over a mean of `prior`
  for position 1 and, for a deeper position, the estimate of the one before it (a depth never drafted is judged by
  its shallower neighbours instead of an optimistic constant). So a
  request starts from what the engine's text accepted (its first rounds, which often accept less than its later
  ones, do not stop drafting on their own), and a long plain stretch, over which the request's counts decay, brings
  the estimate back to that, not to `prior`.
- Cost: the median of the last seconds measured per round at each depth (robust to a graph capture's outlier; depth 0:
  the last stretches' seconds over their tokens, so long stretches weigh as the tokens they decoded), and for
  the drafting depths a line through those medians, each depth's own median weighed in against the line as its samples
  count against `line_weight` pseudo-samples: the line tempers one depth's noise, the depth's own samples keep a real
  step in the costs (a verify of 5 rows reading many more experts than one of 4) that a line would smooth away
  (scripts/depth_sim.py). `cost_slope` per draft relative to a single measured depth. Costs outlive a request: the
  engine measures them in its warm-up and refreshes them from every round's wall time, which costs a clock read. A
  depth next to the best one whose cost is older than `stale_after` choices, and whose rate is within REFRESH_WITHIN
  of the best one's, is chosen for two rounds ("refresh"; depth 0: a short plain stretch), so a warm-up taken in a
  loaded moment, or a host that changed speed since, does not decide for good.
- Depth 0: when no depth pays, the engine decodes `plain_tokens` tokens plainly, then drafts a probe of two rounds
  (the best depth >= 1; two because a round's successor is chosen before its outcome is read) to measure again.
  Each trial that finds drafting still does not pay doubles the plain stretch (up to `off_max`; a request inherits
  at most START_FAILS doublings, being maybe of another kind of text), so a profile where drafting never pays
  spends little on probes; the counts decay over the stretch, so a probe on text that became predictable is
  believed quickly. (The decay also lets drafting resume for a few rounds after a probe; stopping again within
  SUSTAIN rounds counts as a failed trial too.) The engine keeps the draft head's cache current over a plain
  stretch, so a probe drafts as a round that never stopped would.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# What a round's cost is relative to a plain step, per draft, before anything is measured: H200, flash-next at MTP3
# and MTP5 (README: the depths' tok/s at a replayed acceptance of 0.85 against plain decoding) gives ~0.42.
COST_SLOPE = 0.45
# Drafting rounds after a plain stretch that count as a recovery: stopping sooner doubles the next stretch.
SUSTAIN = 8
# A depth's expected rate relative to the best depth's above which its stale cost is measured again: further below,
# the host would have to have changed that much for the depth to matter.
REFRESH_WITHIN = 0.8
# A refreshed cost replaces the old samples only within this factor of their median (else it is one more sample).
RENEW_RANGE = 2.0
# Refresh periods (`stale_after` choices) after which a depth's cost no longer counts, when others were measured since.
EXPIRE = 4
# Drafting stops only when its best depth's expected rate is this far below plain decoding's: a stop costs a whole
# plain stretch, and an estimate's noise alone would otherwise stop rounds that pay (scripts/depth_sim.py).
STOP_MARGIN = 0.05
# Plain stretches (depth 0): the first one's tokens, and how many times longer the longest is (each failed trial
# doubles the stretch). EngineOptions.draft_auto_stretch sets the first for the engine. 16 / 128 rather than 8 / 128:
# each stretch has a fixed cost (its start and its last head step), which shorter first stretches pay more often
# where drafting does not pay; a longest of 256 would also win there, but lose where acceptance rises mid-request,
# the stretch then outlasting the change (scripts/depth_sim.py and the H200's p = 0.5 runs, BENCHMARKS.md §8).
FIRST_STRETCH = 16
STRETCH_GROWTH = 8
# The most failed trials a request inherits: its first plain stretch is at most off_min << (START_FAILS + 1) tokens,
# the last doubling when the request before it stopped drafting again within SUSTAIN rounds of a stretch (a new
# request may be of another kind of text; where drafting does not pay, each probe costs ~1% of a 256-token request;
# without that doubling p = 0.3 lost 0.6% in scripts/depth_sim.py; BENCHMARKS.md §8).
START_FAILS = 3


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators: each run that falls becomes
    its mean)."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


@dataclass(frozen=True)
class DepthChoice:
    depth: int
    reason: str  # "best" | "probe" | "off" (drafting does not pay) | "refresh" (a stale cost) | "forced"
    acceptance: tuple[float, ...]  # the conditional acceptance estimate it used, per position
    rate: float  # the expected tokens per second at the chosen depth (by the cost table)
    plain_tokens: int = 0  # depth 0: how many tokens to decode plainly before the next choice


@dataclass
class DepthStats:
    """Counters: the depth chosen per round, why, and the estimates each choice used (`log`, one entry per choice)."""

    depths: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    plain_tokens: int = 0  # tokens decoded plainly because drafting did not pay
    log: list[dict[str, object]] = field(default_factory=list)
    stretches: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of each timed plain stretch

    def as_dict(self) -> dict[str, object]:
        return {"depth_histogram": {str(d): n for d, n in sorted(self.depths.items())},
                "reasons": dict(self.reasons), "plain_tokens": self.plain_tokens, "choices": self.log,
                "stretches": [(n, round(t, 6)) for n, t in self.stretches]}


class DepthController:
    def __init__(self, max_depth: int, *, prior: float = 0.7, prior_weight: float = 4.0, decay: float = 0.97,
                 cost_slope: float = COST_SLOPE, off_min: int = FIRST_STRETCH,
                 off_max: int = FIRST_STRETCH * STRETCH_GROWTH, window: int = 8,
                 prior_decay: float = 0.995, carry: float = 12.0, stale_after: int = 96,
                 line_weight: float = 2.0) -> None:
        if not 1 <= max_depth <= 8:
            raise ValueError(f"the automatic draft depth needs a maximum depth in 1..8, got {max_depth}")
        if (not 0.0 < decay <= 1.0 or not 0.0 < prior_decay <= 1.0 or not 0.0 <= prior <= 1.0 or prior_weight <= 0
                or carry < 0 or line_weight < 0):
            raise ValueError(f"depth controller: decay and prior_decay in (0, 1], prior in [0, 1], prior_weight > 0, "
                             f"carry >= 0, line_weight >= 0 (got {decay}, {prior_decay}, {prior}, {prior_weight}, "
                             f"{carry}, {line_weight})")
        self.max_depth, self.prior, self.prior_weight, self.decay = max_depth, prior, prior_weight, decay
        self.cost_slope, self.off_min, self.off_max = cost_slope, off_min, off_max
        self.prior_decay, self.carry, self.stale_after = prior_decay, carry, stale_after
        self.line_weight = line_weight
        self.samples: list[deque[float]] = [deque(maxlen=window) for _ in range(max_depth + 1)]
        # what each sample stands for: one round, or a plain stretch's tokens (depth 0 costs its samples' weighted mean)
        self.weights: list[deque[float]] = [deque(maxlen=window) for _ in range(max_depth + 1)]
        self.measured_at = [0] * (max_depth + 1)  # the choice count at each depth's last cost sample
        self.tick = 0  # choices made (plain stretches and rounds), over all requests
        self.force: int | None = None  # a fixed depth (calibration), still measured
        self.calibrated = False  # the engine measures every depth's cost before its first request
        self.renew = [False] * (max_depth + 1)  # a refresh is under way: its sample replaces the old ones
        self.warmup_only = [False] * (max_depth + 1)  # the depth's samples all come from the warm-up (forced depths)
        self._version = 0  # counts the changes to the samples (the cost table's cache key)
        self._cost_key: tuple[object, ...] | None = None
        self._cost_table: list[float] = []
        self.forget_acceptance()

    def forget_acceptance(self) -> None:
        """Back to the prior (the calibration's rounds say what a round costs, not what the requests accept)."""
        self.long_reached = [0.0] * self.max_depth  # the engine's counts, over all requests
        self.long_accepted = [0.0] * self.max_depth
        # plain stretches in a row after which drafting did not last, and rounds since the last stretch: carried
        # across requests like the acceptance
        self.fails, self.since_plain = 0, SUSTAIN
        self.start_request()

    def start_request(self) -> None:
        """Keep the measured costs (of the device) and the long-run acceptance (of the text the engine serves)."""
        self.reached = [0.0] * self.max_depth  # the request's counts
        self.accepted = [0.0] * self.max_depth
        self.fails = min(self.fails, START_FAILS)
        self.probe_next = False
        self.probe_depth: int | None = None  # the depth of a probe's first round, while its second is to come
        self.refresh_left = 0  # rounds still to run at the depth being re-measured
        self.refresh_depth = 0
        self.last_reason = ""
        self.stats = DepthStats()

    # ---- estimates ----
    def acceptance(self) -> list[float]:
        """Conditional acceptance per draft position 1..N: the request's decayed counts over the engine's long-run
        counts over the hierarchical prior."""
        out, mean, w = [], self.prior, self.prior_weight
        for i in range(self.max_depth):
            base = (w * mean + self.long_accepted[i]) / (w + self.long_reached[i])
            # the long-run estimate weighs more the more rounds it rests on (up to `carry` more pseudo-rounds)
            wb = w + min(self.long_reached[i], self.carry)
            mean = (wb * base + self.accepted[i]) / (wb + self.reached[i])
            out.append(mean)
        return out

    def expected_tokens(self, depth: int, acc: list[float] | None = None) -> float:
        """E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i."""
        acc = self.acceptance() if acc is None else acc
        total, run = 1.0, 1.0
        for a in acc[:depth]:
            run *= a
            total += run
        return total

    def cost(self, depth: int) -> float:
        """Seconds per round at `depth`. Depth 0 (a plain step): `plain_cost`. Drafting depths: a line
        a + b * d (b >= 0) through the measured depths' medians, which tempers one depth's noisy samples (a loaded
        host) with its neighbours', blended with the depth's own median (line_weight), never falling with depth; one
        measured depth, or only the plain step, scales by 1 + cost_slope * d. Relative units (1 + cost_slope * d)
        before anything is measured."""
        return self.costs()[depth]

    def costs(self) -> list[float]:
        """cost(d) for every depth, kept until a sample comes or a depth expires (a choice is made every round:
        recomputing the medians and the line for it would cost ~40 us a round in Python)."""
        live = [bool(self.samples[d]) and self.tick - self.measured_at[d] <= EXPIRE * self.stale_after
                for d in range(self.max_depth + 1)]
        key = (self._version, tuple(live))
        if key != self._cost_key:
            # a depth not measured for EXPIRE refresh periods drops out of the line (the host may have changed since,
            # and the refreshes keep only the depths near the best current), while two drafting depths remain
            keep = live if sum(live[1:]) >= 2 else [bool(s) for s in self.samples]
            # once two drafting depths were measured by requests, the warm-up's line drops out: its prompt and short
            # generations can measure a cost that rises differently with depth (scripts/depth_sim.py --flat)
            if sum(k and not self.warmup_only[d] for d, k in enumerate(keep) if d) >= 2:
                keep = [k and not (d and self.warmup_only[d]) for d, k in enumerate(keep)]
            med = {d: statistics.median(s) for d, s in enumerate(self.samples) if d and s and keep[d]}
            if self.samples[0] and keep[0]:
                med[0] = self.plain_cost()
            table = self._table(med)
            # a deeper round does more work: noise must not make it look cheaper than a shallower one
            self._cost_table = table[:1] + nondecreasing(table[1:])
            self._cost_key = key
        return self._cost_table

    def plain_cost(self) -> float:
        """Seconds per plainly decoded token: the kept stretches' total time over their total tokens. Not a median of
        per-stretch rates: a stretch's fixed cost (its last head step, the pipeline's restart) weighs on a short
        one's rate, and the warm-up's short stretches would otherwise price the requests' long ones (BENCHMARKS.md
        §8)."""
        w = self.weights[0]
        return sum(c * n for c, n in zip(self.samples[0], w, strict=True)) / sum(w)

    def _table(self, med: dict[int, float]) -> list[float]:
        """cost(d) for d = 0..N from the kept depths' medians (before the table is made non-decreasing)."""
        known = [(d, c) for d, c in med.items() if d > 0]
        if len(known) < 2:  # one point (a drafting depth, else the plain step), scaled by the prior slope
            d0, c0 = known[0] if known else (0, med.get(0, 1.0))
            return [med[0] if d == 0 and 0 in med else c0 * (1.0 + self.cost_slope * d) / (1.0 + self.cost_slope * d0)
                    for d in range(self.max_depth + 1)]
        n = len(known)
        mx = sum(d for d, _ in known) / n
        my = sum(c for _, c in known) / n
        slope = max(0.0, sum((d - mx) * (c - my) for d, c in known) / sum((d - mx) ** 2 for d, _ in known))
        # depth 0 not measured: read off the mean point by the prior slope
        table = [med.get(0, my / (1.0 + self.cost_slope * mx))]
        for d in range(1, self.max_depth + 1):
            line = max(my + slope * (d - mx), 1e-9)
            own = len(self.samples[d]) if d in med else 0  # the depth's own samples, against line_weight pseudo-ones
            table.append((own * med[d] + self.line_weight * line) / (own + self.line_weight) if own else line)
        return table

    def next_plain_tokens(self) -> int:
        """The length of the next plain stretch, were drafting to stop now."""
        return min(self.off_max, self.off_min << self.fails)

    def rates(self, acc: list[float] | None = None) -> list[float]:
        """Expected tokens per second at every depth 0..N."""
        acc = self.acceptance() if acc is None else acc
        return [self.expected_tokens(d, acc) / c for d, c in enumerate(self.costs())]

    # ---- decisions ----
    def choose(self) -> DepthChoice:
        acc = self.acceptance()
        rates = self.rates(acc)
        best = max(range(self.max_depth + 1), key=lambda d: (rates[d], -d))
        drafting = max(range(1, self.max_depth + 1), key=lambda d: (rates[d], -d))
        if best == 0 and rates[drafting] >= (1.0 - STOP_MARGIN) * rates[0]:
            best = drafting  # within the margin: keep drafting (stopping costs a whole plain stretch)
        self.tick += 1
        plain = 0
        if self.force is not None:
            depth, reason = self.force, "forced"
        elif self.probe_next:
            # a probe is two rounds: the engine chooses a round's successor before the round's outcome is known
            # (the next draft chain is queued before the read-back), so only the choice after the second round
            # sees the first one's acceptance (scripts/depth_sim.py models this)
            self.probe_next, self.probe_depth = False, drafting
            depth, reason = drafting, "probe"
        elif self.probe_depth is not None:
            depth, reason, self.probe_depth = self.probe_depth, "probe", None
        elif self.refresh_left:
            self.refresh_left -= 1
            depth, reason = self.refresh_depth, "refresh"
        elif best == 0:
            # drafting that stops again soon after a stretch was a failed trial: the next stretch is longer
            self.fails = self.fails + 1 if self.since_plain < SUSTAIN else 0
            depth, reason = 0, "off"
            plain = self.next_plain_tokens()
        elif (stale := self._stale(best, rates)) is not None:
            depth, reason = stale, "refresh"
            # a drafting depth: two rounds, the first one a clean sample (the engine times a round as its depth's
            # only when the next round drafts as deep)
            self.refresh_depth, self.refresh_left = stale, int(stale > 0)
            # not stale any more whether or not the sample comes (a round that starts a run is not timed)
            self.measured_at[stale], self.renew[stale] = self.tick, True
            plain = self.off_min if stale == 0 else 0
        else:
            depth, reason = best, "best"
        if depth == 0 and not plain:
            plain = self.next_plain_tokens()
        self.last_reason = reason
        choice = DepthChoice(depth, reason, tuple(acc), rates[depth], plain)
        self.stats.depths[depth] += 1
        self.stats.reasons[reason] += 1
        self.stats.log.append({"depth": depth, "reason": reason, "acceptance": [round(a, 3) for a in acc],
                               "tokens_per_s": [round(r, 3) for r in rates]})
        return choice

    def _stale(self, best: int, rates: list[float]) -> int | None:
        """A depth next to `best` (the one measured longer ago first) whose cost was last measured more than
        `stale_after` choices ago and whose rate is within REFRESH_WITHIN of the best, or None."""
        old = [d for d in (best - 1, best + 1) if 0 <= d <= self.max_depth
               and rates[d] >= REFRESH_WITHIN * rates[best] and self.tick - self.measured_at[d] > self.stale_after]
        return min(old, key=lambda d: (self.measured_at[d], d)) if old else None

    def observe(self, depth: int, accepted: int, seconds: float | None = None) -> None:
        """A round at `depth` accepted `accepted` drafts (and took `seconds`, when it was a clean measurement)."""
        if not 0 <= accepted <= depth <= self.max_depth:
            raise ValueError(f"observe: {accepted} accepted of a depth-{depth} round (maximum {self.max_depth})")
        self._decay(1, long=True)
        self.since_plain += 1
        for i in range(min(accepted + 1, depth)):
            for reached, acc in ((self.reached, self.accepted), (self.long_reached, self.long_accepted)):
                reached[i] += 1.0
                acc[i] += float(i < accepted)
        if seconds is not None:
            self.observe_cost(depth, seconds)

    def forget_cost(self, depth: int) -> None:
        self.samples[depth].clear()
        self.weights[depth].clear()
        self._version += 1

    def observe_cost(self, depth: int, seconds: float, tokens: int = 1) -> None:
        """A round at `depth` took `seconds` (depth 0: seconds per plainly decoded token, over a stretch of `tokens`).
        A stale depth's old samples go (the host's load may have changed since) when the new one is within
        RENEW_RANGE of their median; further off, it joins them: one hiccup (a collection pause, a capture the
        engine did not see) must not replace a depth's whole history."""
        if seconds <= 0 or tokens <= 0:
            return
        samples = self.samples[depth]
        self.warmup_only[depth] = self.force is not None
        if self.renew[depth]:
            if not samples or 1 / RENEW_RANGE <= seconds / statistics.median(samples) <= RENEW_RANGE:
                samples.clear()
                self.weights[depth].clear()
            self.renew[depth] = False
        samples.append(seconds)
        self.weights[depth].append(float(tokens))
        self._version += 1
        self.measured_at[depth] = self.tick

    def plain_done(self, tokens: int, seconds: float | None) -> None:
        """A plain stretch decoded `tokens` tokens in `seconds`: the next choice is a probe."""
        self.stats.plain_tokens += tokens
        self._decay(tokens)  # the long-run counts age by rounds only: a stretch is no evidence against them
        self.probe_next = True
        if self.last_reason != "refresh":  # a re-measuring stretch is no trial of drafting
            self.since_plain = 0
        if seconds is not None and tokens and seconds > 0:
            self.observe_cost(0, seconds / tokens, tokens)
            self.stats.stretches.append((tokens, seconds))

    def _decay(self, rounds: int, long: bool = False) -> None:
        """Age the request's counts by `rounds` rounds (and the long-run counts, with `long`)."""
        f = self.decay ** rounds
        self.reached = [x * f for x in self.reached]
        self.accepted = [x * f for x in self.accepted]
        if long:
            g = self.prior_decay ** rounds
            self.long_reached = [x * g for x in self.long_reached]
            self.long_accepted = [x * g for x in self.long_accepted]


class BatchDraftChoice:
    """The depth at which a batch of B sequences decodes: speculative rounds d deep (1..`depth`) or plain steps (0),
    the one with the most tokens per second by the times measured at B. A round's time is set against the tokens a
    sequence is expected to commit at that depth, 1 + sum_i P(draft i accepted), each position's acceptance over the
    recent rounds of any depth and batch size that drafted it (acceptance belongs to the text); a plain step's
    against one token.

    More sequences read more experts per step and verify more rows, so the depth that pays falls as the batch grows,
    and where drafting stops paying depends on the model and the device (BENCHMARKS.md §9): it is measured, not
    assumed. At each B every depth is tried, deepest first, until it has `measure` samples after its first `skip`
    (a shape's first uses compile and capture a graph); every `recheck` choices at B, one of the depths that lost,
    in turn, is measured afresh, so that a change of text or load is seen."""

    def __init__(self, depth: int, *, window: int = 16, measure: int = 3, skip: int = 2, recheck: int = 256,
                 accept_window: int = 256) -> None:
        if depth < 1 or measure < 1 or skip < 0 or recheck < 1 or accept_window < 1:
            raise ValueError(f"batch draft choice: depth, measure, recheck and accept_window >= 1, skip >= 0 (got "
                             f"{depth}, {measure}, {recheck}, {accept_window}, {skip})")
        self.depth, self.window, self.measure, self.skip, self.recheck = depth, window, measure, skip, recheck
        self.depths = tuple(range(depth, -1, -1))  # the candidates, deepest first
        self.times: dict[tuple[int, int], deque[float]] = {}
        self.seen: Counter = Counter()  # observations per (B, depth), skipped ones included
        # per draft position: whether it was accepted, in the recent rounds' sequences that drafted it
        self.hits: list[deque[bool]] = [deque(maxlen=accept_window) for _ in range(depth)]
        self.since: Counter = Counter()  # choices at B since a losing depth was last measured
        self.turn: Counter = Counter()  # rechecks at B so far: which losing depth is next

    def tokens(self, depth: int) -> float | None:
        """Tokens a sequence is expected to commit in a round `depth` deep (None: a position never drafted)."""
        if any(not self.hits[i] for i in range(depth)):
            return None
        return 1.0 + sum(sum(self.hits[i]) / len(self.hits[i]) for i in range(depth))

    def rate(self, n: int, depth: int) -> float | None:
        """A sequence's tokens per second at batch size n and `depth` (None until measured)."""
        t, tokens = self.times.get((n, depth)), self.tokens(depth)
        if not t or len(t) < self.measure or tokens is None:
            return None
        return tokens / statistics.median(t)

    def choose(self, n: int) -> int:
        for d in self.depths:
            if self.rate(n, d) is None:
                return d
        best = max(self.depths, key=lambda d: self.rate(n, d))  # type: ignore[arg-type, return-value]
        self.since[n] += 1
        if self.since[n] < self.recheck:
            return best
        # a losing depth measured afresh (its old samples may be of another load), its shapes compiled already
        losers = [d for d in self.depths if d != best]
        other = losers[self.turn[n] % len(losers)]
        self.since[n], self.turn[n] = 0, self.turn[n] + 1
        self.times[(n, other)].clear()
        self.seen[(n, other)] = self.skip
        return other

    def observe(self, n: int, depth: int, seconds: float | None, accepted: Sequence[int] = ()) -> None:
        """A plain step (depth 0) or round of n sequences took `seconds` (None: no sample of its time, a pass that
        compiled or captured); in a round, the sequences accepted `accepted` drafts (each of `depth`)."""
        for k in accepted:
            for i in range(depth):
                self.hits[i].append(k > i)
        if seconds is None:
            return
        key = (n, depth)
        self.seen[key] += 1
        if self.seen[key] > self.skip:
            self.times.setdefault(key, deque(maxlen=self.window)).append(seconds)
