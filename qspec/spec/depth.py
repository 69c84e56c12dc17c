"""The draft-depth controller of `--draft auto`: before every round, the depth 0..N that maximises expected tokens
per second.

With conditional acceptance a_i of draft position i (the probability that draft i is accepted once drafts 1..i-1
were), a round at depth d commits E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i tokens, and costs cost(d) seconds (draft
chain of d steps, verify of d+1 rows, rollback, extend; for d = 0, one plain decoding step). The controller picks
argmax_d E(d) / cost(d).

- Acceptance: per position, decaying counts of rounds that reached the position and of rounds that accepted it
  (each new round multiplies the old counts by `decay`), blended with a prior of `prior_weight` pseudo-rounds. The
  prior mean of position 1 is `prior`; that of a deeper position is the estimate of the one before it, so a depth
  never drafted is judged by its shallower neighbours instead of an optimistic constant. The counts outlive a
  request (the engine serves one kind of text more often than not), capped at `carry` pseudo-rounds per position
  when a request starts: a request's first rounds, which often accept less than its later ones, do not stop drafting
  on their own, and a request of another kind outweighs the carried counts within about `carry` rounds.
- Cost: the median of the last seconds measured per round at each depth (robust to a graph capture's outlier), and
  for the drafting depths a line through those medians (robust to one depth's noise; `cost_slope` per draft relative
  to a single measured depth). Costs outlive a request: the engine measures them in its warm-up and refreshes them from
  every round's wall time, which costs a clock read. A depth next to the best one whose cost is older than
  `stale_after` choices is chosen for two rounds ("refresh"; depth 0: a short plain stretch, when its rate is close to
  the best), so a warm-up taken in a loaded moment does not decide for good.
- Depth 0: when no depth pays, the engine decodes `plain_tokens` tokens plainly, then drafts one probe round (the
  best depth >= 1) to measure again. Each trial that finds drafting still does not pay doubles the plain stretch
  (up to `off_max`; a request inherits at most START_FAILS doublings, being maybe of another kind of text), so a
  profile where drafting never pays spends little on probes; the counts decay over the stretch, so a probe on text
  that became predictable is believed quickly. (The decay also lets drafting resume for a few rounds after a probe;
  stopping again within SUSTAIN rounds counts as a failed trial too.) The engine keeps
  the draft head's cache current over a plain stretch, so a probe drafts as a round that never stopped would.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

# What a round's cost is relative to a plain step, per draft, before anything is measured: H200, flash-next at MTP3
# and MTP5 (README: the depths' tok/s at a replayed acceptance of 0.85 against plain decoding) gives ~0.42.
COST_SLOPE = 0.45
# Drafting rounds after a plain stretch that count as a recovery: stopping sooner doubles the next stretch.
SUSTAIN = 8
# Depth 0's rate relative to the best depth's above which a stale depth-0 cost is measured again: further below, a
# plain step would have to have become that much cheaper to matter.
REFRESH_PLAIN_WITHIN = 0.8
# The most failed trials a request inherits: its first plain stretch is at most off_min << START_FAILS tokens (a new
# request may be of another kind of text).
START_FAILS = 2


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

    def as_dict(self) -> dict[str, object]:
        return {"depth_histogram": {str(d): n for d, n in sorted(self.depths.items())},
                "reasons": dict(self.reasons), "plain_tokens": self.plain_tokens, "choices": self.log}


class DepthController:
    def __init__(self, max_depth: int, *, prior: float = 0.7, prior_weight: float = 4.0, decay: float = 0.97,
                 cost_slope: float = COST_SLOPE, off_min: int = 8, off_max: int = 128, window: int = 8,
                 carry: float = 16.0, stale_after: int = 48) -> None:
        if not 1 <= max_depth <= 8:
            raise ValueError(f"the automatic draft depth needs a maximum depth in 1..8, got {max_depth}")
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior <= 1.0 or prior_weight <= 0 or carry < 0:
            raise ValueError(f"depth controller: decay in (0, 1], prior in [0, 1], prior_weight > 0, carry >= 0 "
                             f"(got {decay}, {prior}, {prior_weight}, {carry})")
        self.max_depth, self.prior, self.prior_weight, self.decay = max_depth, prior, prior_weight, decay
        self.cost_slope, self.off_min, self.off_max = cost_slope, off_min, off_max
        self.carry, self.stale_after = carry, stale_after
        self.samples: list[deque[float]] = [deque(maxlen=window) for _ in range(max_depth + 1)]
        self.measured_at = [0] * (max_depth + 1)  # the choice count at each depth's last cost sample
        self.tick = 0  # choices made (plain stretches and rounds), over all requests
        self.force: int | None = None  # a fixed depth (calibration), still measured
        self.calibrated = False  # the engine measures every depth's cost before its first request
        self.renew = [False] * (max_depth + 1)  # a refresh is under way: its sample replaces the old ones
        self._version = 0  # counts the changes to the samples (the cost table's cache key)
        self._cost_key: tuple[object, ...] | None = None
        self._cost_table: list[float] = []
        self.forget_acceptance()
        self.start_request()

    def forget_acceptance(self) -> None:
        """Back to the prior (the calibration's rounds say what a round costs, not what the requests accept)."""
        self.reached = [0.0] * self.max_depth
        self.accepted = [0.0] * self.max_depth
        # plain stretches in a row after which drafting did not last, and rounds since the last stretch: carried
        # across requests like the acceptance
        self.fails, self.since_plain = 0, SUSTAIN

    def start_request(self) -> None:
        """Keep the measured costs (of the device) and the acceptance counts (of the text the engine serves), the
        latter capped at `carry` pseudo-rounds per position, so that the new request's own rounds soon dominate."""
        for i, n in enumerate(self.reached):
            if n > self.carry:
                f = self.carry / n
                self.reached[i] *= f
                self.accepted[i] *= f
        self.fails = min(self.fails, START_FAILS)
        self.probe_next = False
        self.refresh_left = 0  # rounds still to run at the depth being re-measured
        self.refresh_depth = 0
        self.last_reason = ""
        self.stats = DepthStats()

    # ---- estimates ----
    def acceptance(self) -> list[float]:
        """Conditional acceptance per draft position 1..N: decayed counts over the hierarchical prior."""
        out, mean = [], self.prior
        for i in range(self.max_depth):
            mean = (self.prior_weight * mean + self.accepted[i]) / (self.prior_weight + self.reached[i])
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
        """Seconds per round at `depth`. Depth 0 (a plain step): its measured median. Drafting depths: a line
        a + b * d (b >= 0) through the measured depths' medians (only the recently measured ones when there are two),
        which smooths one depth's noisy samples (a loaded host) with its neighbours'; one measured depth, or only the
        plain step, scales by 1 + cost_slope * d.
        Relative units (1 + cost_slope * d) before anything is measured."""
        return self.costs()[depth]

    def costs(self) -> list[float]:
        """cost(d) for every depth, kept until a sample comes or a depth turns stale (a choice is made every round:
        recomputing the medians and the line for it would cost ~40 us a round in Python)."""
        key = (self._version, tuple(self.tick - m <= self.stale_after for m in self.measured_at))
        if key != self._cost_key:
            med = {d: statistics.median(s) for d, s in enumerate(self.samples) if s}
            self._cost_table = [self._cost(d, med) for d in range(self.max_depth + 1)]
            self._cost_key = key
        return self._cost_table

    def _cost(self, depth: int, med: dict[int, float]) -> float:
        if depth == 0 and 0 in med:
            return med[0]
        known = [(d, c) for d, c in med.items() if d > 0]
        fresh = [(d, c) for d, c in known if self.tick - self.measured_at[d] <= self.stale_after]
        if len(fresh) >= 2:  # the host's speed drifts: stale depths would hold the line where it was
            known = fresh
        if len(known) >= 2:
            n = len(known)
            mx = sum(d for d, _ in known) / n
            my = sum(c for _, c in known) / n
            slope = max(0.0, sum((d - mx) * (c - my) for d, c in known) / sum((d - mx) ** 2 for d, _ in known))
            if depth > 0:
                return max(my + slope * (depth - mx), 1e-9)
            known = [(mx, my)]  # depth 0 not measured: read off the mean point by the prior slope
        d0, c0 = known[0] if known else (0, med.get(0, 1.0))
        return c0 * (1.0 + self.cost_slope * depth) / (1.0 + self.cost_slope * d0)

    def rates(self, acc: list[float] | None = None) -> list[float]:
        """Expected tokens per second at every depth 0..N."""
        acc = self.acceptance() if acc is None else acc
        return [self.expected_tokens(d, acc) / c for d, c in enumerate(self.costs())]

    # ---- decisions ----
    def choose(self) -> DepthChoice:
        acc = self.acceptance()
        rates = self.rates(acc)
        best = max(range(self.max_depth + 1), key=lambda d: (rates[d], -d))
        self.tick += 1
        plain = 0
        if self.force is not None:
            depth, reason = self.force, "forced"
        elif self.probe_next:
            self.probe_next = False
            depth, reason = max(range(1, self.max_depth + 1), key=lambda d: (rates[d], -d)), "probe"
        elif self.refresh_left:
            self.refresh_left -= 1
            depth, reason = self.refresh_depth, "refresh"
        elif best == 0:
            # drafting that stops again soon after a stretch was a failed trial: the next stretch is longer
            self.fails = self.fails + 1 if self.since_plain < SUSTAIN else 0
            depth, reason = 0, "off"
            plain = min(self.off_max, self.off_min << self.fails)
        elif (stale := self._stale(best, rates)) is not None:
            depth, reason = stale, "refresh"
            # a drafting depth: two rounds, the first one's time being a clean sample (see observe)
            self.refresh_depth, self.refresh_left = stale, int(stale > 0)
            # not stale any more whether or not the sample comes (a round that starts a run is not timed)
            self.measured_at[stale], self.renew[stale] = self.tick, True
            plain = self.off_min if stale == 0 else 0
        else:
            depth, reason = best, "best"
        if depth == 0 and not plain:
            plain = min(self.off_max, self.off_min << self.fails)
        self.last_reason = reason
        choice = DepthChoice(depth, reason, tuple(acc), rates[depth], plain)
        self.stats.depths[depth] += 1
        self.stats.reasons[reason] += 1
        self.stats.log.append({"depth": depth, "reason": reason, "acceptance": [round(a, 3) for a in acc],
                               "tokens_per_s": [round(r, 3) for r in rates]})
        return choice

    def _stale(self, best: int, rates: list[float]) -> int | None:
        """A depth next to `best` whose cost was last measured more than `stale_after` choices ago (depth 0 only
        when its rate is within REFRESH_PLAIN_WITHIN of the best), or None."""
        for d in (best + 1, best - 1):
            if not 0 <= d <= self.max_depth or self.tick - self.measured_at[d] <= self.stale_after:
                continue
            if d > 0 or rates[0] >= REFRESH_PLAIN_WITHIN * rates[best]:
                return d
        return None

    def observe(self, depth: int, accepted: int, seconds: float | None = None) -> None:
        """A round at `depth` accepted `accepted` drafts (and took `seconds`, when it was a clean measurement)."""
        if not 0 <= accepted <= depth <= self.max_depth:
            raise ValueError(f"observe: {accepted} accepted of a depth-{depth} round (maximum {self.max_depth})")
        self._decay(1)
        self.since_plain += 1
        for i in range(min(accepted + 1, depth)):
            self.reached[i] += 1.0
            self.accepted[i] += float(i < accepted)
        if seconds is not None:
            self.observe_cost(depth, seconds)

    def forget_cost(self, depth: int) -> None:
        self.samples[depth].clear()
        self._version += 1

    def observe_cost(self, depth: int, seconds: float) -> None:
        """A round at `depth` took `seconds` (depth 0: seconds per plainly decoded token). A stale depth's old
        samples go: the host's load may have changed since."""
        if seconds <= 0:
            return
        if self.renew[depth]:
            self.samples[depth].clear()
            self.renew[depth] = False
        self.samples[depth].append(seconds)
        self._version += 1
        self.measured_at[depth] = self.tick

    def plain_done(self, tokens: int, seconds: float | None) -> None:
        """A plain stretch decoded `tokens` tokens in `seconds`: the next choice is a probe."""
        self.stats.plain_tokens += tokens
        self._decay(tokens)
        self.probe_next = True
        if self.last_reason != "refresh":  # a re-measuring stretch is no trial of drafting
            self.since_plain = 0
        if seconds is not None and tokens:
            self.observe_cost(0, seconds / tokens)

    def _decay(self, rounds: int) -> None:
        f = self.decay ** rounds
        self.reached = [x * f for x in self.reached]
        self.accepted = [x * f for x in self.accepted]
