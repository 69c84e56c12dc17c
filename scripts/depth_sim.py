"""`--draft auto`'s controller (qspec/spec/depth.py) against fixed depths, simulated: no model runs and no clock, so
the result measures the controller's decisions alone, free of the timing noise of a shared machine.

A round at depth d costs a table's seconds (`COSTS`: per-depth round costs measured on a device, depth 0 a plain
token) and commits k + 1 tokens, k drawn from an acceptance source: geometric p (draft i accepted with probability p
once draft i-1 was), a shift between two p mid-way through every request, or a recorded trace (per-round accepted
counts at depth 8, `scripts/depth_cpu.py --traces`, replayed by token position as `--accept-profile trace=` is: a
round at depth d from position t takes min(d, count(t)), a plain stretch moves on through the text). The controller
gets each round's cost with multiplicative noise (`--noise`, lognormal sigma), as a clock on a loaded host would
give it; it chooses each round's successor before the round's outcome, as the engine does; its plain stretches may
cost more than plain decoding (`--plain-overhead` per token, `--plain-fixed` per stretch). Every arm replays the same
seeded stream per request.

    PYTHONPATH=. python scripts/depth_sim.py --out benchmarks/results/depth-sim-DATE.md
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from qspec.bench.accept import counts_by_position, load_trace
from qspec.spec.depth import DepthController

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Seconds per round at depths 0..6 (depth 0: one plain token). H200 rows: a line through the plain step and the
# MTP3 / MTP5 rounds of one same-process run (tokens per round / tok/s), extended to depths 1, 2, 4 and 6; CPU row:
# the demo model's calibrated costs on the 2-core development machine (depth_cpu's setting).
def _line(plain_tps: float, r3: tuple[float, float], r5: tuple[float, float]) -> list[float]:
    c3, c5 = r3[0] / r3[1], r5[0] / r5[1]
    slope = (c5 - c3) / 2
    return [1 / plain_tps] + [c3 + slope * (d - 3) for d in range(1, 7)]


COSTS = {
    # h200-q4km48-a5249a3: nospec 107.34 tok/s, MTP3 3.1739 tokens/round at 185.03, MTP5 4.0156 at 177.88
    "h200-q4km48": _line(107.34, (3.1739, 185.03), (4.0156, 177.88)),
    # h200-q4km48-m-6c35a27: nospec 145.82 tok/s, MTP3 3.20 tokens/round at 209.90, MTP5 4.15 at 236.28
    "h200-q4km48-6c35a27": _line(145.82, (3.2, 209.90), (4.1452, 236.28)),
    # h200-fn8-seed-s16: nospec 745.09, MTP3 3.17 at 1,024.63, MTP5 4.02 at 988.06
    "h200-fn8": _line(745.09, (3.17, 1024.63), (4.02, 988.06)),
    # depth-gpu-fn8-0aa1dbf-p-0.85: every depth measured (tokens per round / tok/s), ms
    "h200-fn8-measured": [x / 1e3 for x in (1.3401, 2.6559, 2.7893, 3.1719, 3.6973, 4.0736, 4.6619)],
    # the demo model's calibration on the CPU, ms
    "cpu-demo": [x / 1e3 for x in (3.80, 6.05, 7.61, 9.17, 10.74, 12.30, 13.87)],
}

class Geometric:
    def __init__(self, p: float, p_late: float | None = None, switch_at: int = 0) -> None:
        self.p, self.p_late, self.switch_at = p, p_late, switch_at
        self.tokens = 0

    def start(self) -> None:
        self.tokens = 0

    def draft(self, d: int, rng: random.Random) -> int:
        p = self.p if self.p_late is None or self.tokens < self.switch_at else self.p_late
        k = 0
        while k < d and rng.random() < p:
            k += 1
        self.tokens += k + 1
        return k

    def plain(self, n: int) -> None:
        self.tokens += n


class Trace:
    """A recorded trace replayed by token position (qspec.bench.accept): the text goes on over plain stretches."""

    def __init__(self, counts: list[int], depth: int | None, phase_seed: int | None = None) -> None:
        self.counts = counts_by_position(tuple(counts), depth)
        self.pos = 0
        self.phase = None if phase_seed is None else random.Random(phase_seed)

    def start(self) -> None:
        """The text goes on from request to request, or (a phase seed) each request starts at a random place of
        the cyclic trace, so no depth gains from how its rounds happen to line up with the cycle."""
        if self.phase is not None:
            self.pos = self.phase.randrange(len(self.counts))

    def draft(self, d: int, rng: random.Random) -> int:
        k = min(d, self.counts[self.pos % len(self.counts)])
        self.pos += k + 1
        return k

    def plain(self, n: int) -> None:
        self.pos += n


def calibrated(costs: list[float], flat: float) -> list[float]:
    """What a warm-up measures when its rounds' cost rises `flat` times as fast with depth as the requests' (around
    depth 3): a short warm-up prompt whose rows route to fewer distinct experts measures a flatter line."""
    return [costs[0]] + [costs[3] + flat * (c - costs[3]) for c in costs[1:]]


def run_arm(costs: list[float], source: Geometric | Trace, depth: int | None, requests: int, tokens: int,
            noise: float, seed: int, flat: float = 1.0, plain_overhead: float = 1.0,
            controller: dict[str, float] | None = None, plain_fixed: float = 0.0,
            per_request: list[float] | None = None) -> tuple[float, Counter]:
    """Simulated tokens per second of a fixed depth (None: the controller, max depth 6) over the requests, and the
    controller's depth histogram (depth 0 counted in plainly decoded tokens). As in the engine, the controller
    chooses a round's successor before the round's outcome is known (the next draft chain is queued before the
    read-back), and its plain stretches cost `plain_overhead` times plain decoding (the draft head kept current) plus
    `plain_fixed` plain tokens' time once per stretch (the pipeline's restart, the head's last catch-up). Each
    request's own tokens per second go to `per_request`, when given."""
    ctl = None
    if depth is None:
        ctl = DepthController(len(costs) - 1, **(controller or {}))
        for d, c in enumerate(calibrated(costs, flat)):  # the engine's calibration, before the first request
            ctl.force = d
            for _ in range(2):
                if d == 0:  # its plain stretches are the shortest ones
                    ctl.plain_done(ctl.off_min, c * (ctl.off_min * plain_overhead + plain_fixed))
                else:
                    ctl.observe_cost(d, c)
        ctl.force = None
        ctl.calibrated = True
        ctl.forget_acceptance()
    noise_rng = random.Random(seed ^ 0x5EED)
    hist: Counter = Counter()
    total_t, total_n = 0.0, 0
    for r in range(requests):
        rng = random.Random(seed * 1000 + r)
        source.start()
        if ctl is not None:
            ctl.start_request()
        n, t0 = 0, total_t
        d, plain = (depth, 1 if depth == 0 else 0) if ctl is None else _choice(ctl)
        while n < tokens:
            if d == 0:
                m = min(plain, tokens - n)
                source.plain(m)
                c = costs[0] * (m * plain_overhead + plain_fixed if ctl is not None else m)
                total_t += c
                n += m
                hist[0] += m
                if ctl is not None:
                    ctl.plain_done(m, c * math.exp(noise_rng.gauss(0, noise)))
                d, plain = (0, 1) if ctl is None else _choice(ctl)
                continue
            nxt = (depth, 0) if ctl is None else _choice(ctl)  # before this round's outcome
            k = source.draft(d, rng)
            total_t += costs[d]
            n += k + 1
            hist[d] += 1
            if ctl is not None:
                ctl.observe(d, k, costs[d] * math.exp(noise_rng.gauss(0, noise)))
            d, plain = nxt
        total_n += n
        if per_request is not None:
            per_request.append(n / (total_t - t0))
    return total_n / total_t, hist


def _choice(ctl: DepthController) -> tuple[int, int]:
    ch = ctl.choose()
    return ch.depth, ch.plain_tokens


def sources(names: list[str], phase: bool = False) -> dict[str, Callable[[int], Geometric | Trace]]:
    """Each source as a maker taking the run's seed (a trace's random phases come from it)."""
    out: dict[str, Callable[[int], Geometric | Trace]] = {}
    for name in names:
        if name.startswith("p="):
            p = float(name[2:])
            out[name] = lambda _s, p=p: Geometric(p)
        elif name.startswith("shift="):  # shift=0.9:0.3 -> p 0.9 for the first half of each request, then 0.3
            a, b = (float(x) for x in name[6:].split(":"))
            out[name] = lambda _s, a=a, b=b: Geometric(a, b, switch_at=128)
        else:  # a trace recorded by depth_cpu.py: benchmarks/results/demo-accept-trace-NAME.json
            counts, depth = load_trace(RESULTS / f"demo-accept-trace-{name}.json")
            out[name] = lambda s, c=counts, d=depth: Trace(list(c), d, s if phase else None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--costs", default=",".join(COSTS))
    ap.add_argument("--sources", default="p=0.3,p=0.5,p=0.7,p=0.85,p=0.95,shift=0.9:0.3,code,prose")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--noise", type=float, default=0.1, help="lognormal sigma of the measured round costs")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--flat", type=float, default=1.0,
                    help="the warm-up's cost slope over the requests' (the H200 48-layer run's warm-up: ~0.45)")
    ap.add_argument("--plain-overhead", type=float, default=1.0,
                    help="auto's plain stretches over plain decoding's cost (H200, 8 layers: 746 / 714 ~ 1.045)")
    ap.add_argument("--plain-fixed", type=float, default=0.0,
                    help="what each of auto's plain stretches costs once, in plain tokens' time")
    ap.add_argument("--trace-phase", action="store_true",
                    help="each request starts at a random place of a trace (else the trace goes on across requests)")
    ap.add_argument("--controller", default="", metavar="K=V,...",
                    help="DepthController keyword arguments for auto (e.g. regime_weight=4)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args()
    # integers stay integers (off_min and off_max shift and compare as stretch lengths)
    controller = {k: int(v) if v.lstrip("-").isdigit() else float(v)
                  for k, v in (kv.split("=") for kv in a.controller.split(",") if kv)}
    lines = ["| costs | acceptance | best fixed (tok/s) | plain | auto | auto / best "
             "| slowest tenth of requests / best | auto / plain | auto's depths |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    worst = 1.0
    for cname in a.costs.split(","):
        costs = COSTS[cname]
        for sname, make in sources(a.sources.split(","), a.trace_phase).items():
            fixed = {d: statistics.mean(run_arm(costs, make(s), d, a.requests, a.tokens, 0, s)[0]
                                        for s in range(a.seeds)) for d in range(7)}
            per_request: list[float] = []  # a GPU benchmark times single requests: their spread matters too
            autos = [run_arm(costs, make(s), None, a.requests, a.tokens, a.noise, s, a.flat, a.plain_overhead,
                             controller, a.plain_fixed, per_request)
                     for s in range(a.seeds)]
            tenth = sorted(per_request)[len(per_request) // 10]
            auto = statistics.mean(x for x, _ in autos)
            best = max(fixed, key=fixed.__getitem__)
            hist = autos[0][1]
            worst = min(worst, auto / fixed[best])
            lines.append(f"| {cname} | {sname} | MTP{best} ({fixed[best]:.4g}) | {fixed[0]:.4g} | {auto:.4g} | "
                         f"{auto / fixed[best]:.3f} | {tenth / fixed[best]:.3f} | {auto / fixed[0]:.3f} | "
                         f"{dict(sorted(hist.items()))} |")
    lines.append(f"\nworst auto / best fixed: {worst:.3f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        command = "PYTHONPATH=. python scripts/depth_sim.py " + " ".join(sys.argv[1:])
        Path(a.out).write_text(f"<!-- {command} -->\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
