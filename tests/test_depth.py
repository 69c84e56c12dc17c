"""The automatic draft depth (`--draft auto`): the controller's choices, and output equal to plain decoding whatever
depths it picks."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
import torch
from test_spec import CAP, oracle_hook, plain, teacher_forced_state

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model import ops
from qspec.model.model import Model
from qspec.runner import Runner
from qspec.spec.depth import DepthChoice, DepthController


def controller(n: int = 5, slope: float = 0.45, **kw: object) -> DepthController:
    """A controller whose measured cost of a round at depth d is 1 + slope * d (seconds)."""
    c = DepthController(n, **kw)  # type: ignore[arg-type]
    for d in range(n + 1):
        c.observe_cost(d, 1.0 + slope * d)
    return c


def feed(c: DepthController, p: float, rounds: int, rng: random.Random) -> list[int]:
    """Rounds at the controller's own choices with every draft accepted with probability p (given the one before)
    -> each choice's plain stretch (0 for a drafting round)."""
    stretches = []
    for _ in range(rounds):
        ch = c.choose()
        stretches.append(ch.plain_tokens)
        if ch.depth == 0:
            c.plain_done(ch.plain_tokens, None)
            continue
        k = 0
        while k < ch.depth and rng.random() < p:
            k += 1
        c.observe(ch.depth, k)
    return stretches


def test_choice_is_the_argmax_of_expected_tokens_per_second() -> None:
    c = controller(slope=0.45)
    for _ in range(30):
        c.observe(5, 5)
        c.observe(5, 2)
    acc = c.acceptance()
    # positions 1-2 always accepted, 3 in half the rounds (the prior 0.7 keeps a little weight)
    assert acc[0] > 0.9 and acc[1] > 0.9 and 0.3 < acc[2] < 0.7
    want = [c.expected_tokens(d) / (1 + 0.45 * d) for d in range(6)]
    expect = 1.0
    run = 1.0
    for a in acc:
        run *= a
        expect += run
    assert c.expected_tokens(5) == pytest.approx(expect)
    ch = c.choose()
    assert ch.depth == max(range(6), key=want.__getitem__) and ch.reason == "best"
    assert ch.rate == pytest.approx(max(want)) and ch.acceptance == pytest.approx(tuple(acc))


@pytest.mark.parametrize("p, slope", [(0.95, 0.3), (0.8, 0.45), (0.6, 0.45), (0.3, 0.45), (0.85, 1.5)])
def test_depth_follows_acceptance_and_cost(p: float, slope: float) -> None:
    """On a geometric acceptance p, the controller's choices (probes and plain stretches included) reach 97% of the
    expected tokens per second of the best fixed depth for p and the cost line."""
    c = controller(8, slope)
    stretches = feed(c, p, 400, random.Random(1))
    true = [sum(p ** j for j in range(d + 1)) / (1 + slope * d) for d in range(9)]
    tokens = cost = 0.0
    for e, stretch in zip(c.stats.log[100:], stretches[100:], strict=True):
        d = int(e["depth"])
        tokens += stretch if d == 0 else true[d] * (1 + slope * d)
        cost += stretch if d == 0 else 1 + slope * d
    assert tokens / cost >= 0.97 * max(true), (tokens / cost, true)


def test_drafting_that_does_not_pay_stops_and_recovers() -> None:
    c = controller(5, 0.45, stale_after=10**9)  # costs never re-measured here (test_stale_costs_are_measured_again)
    for _ in range(10):
        c.observe(1, 0)
    ch = c.choose()
    assert ch.depth == 0 and ch.reason == "off" and ch.plain_tokens == c.off_min
    stretches = []
    for _ in range(4):
        c.plain_done(ch.plain_tokens, None)
        ch = c.choose()
        assert ch.reason == "probe" and ch.depth >= 1
        rounds = 0
        while ch.depth:  # every draft rejected: drafting stops again within a few rounds
            c.observe(ch.depth, 0)
            ch = c.choose()
            rounds += 1
        assert ch.reason == "off" and rounds < 8
        stretches.append(ch.plain_tokens)
    assert stretches == [2 * c.off_min, 4 * c.off_min, 8 * c.off_min, min(16 * c.off_min, c.off_max)]
    assert c.stats.plain_tokens == c.off_min * (1 + 2 + 4 + 8) and c.stats.depths[0] == 5
    assert c.stats.stretches == [] and c.next_plain_tokens() == ch.plain_tokens  # none of them timed
    # the text turns predictable: the probe sees it, and the controller drafts deep again
    c.plain_done(ch.plain_tokens, None)
    feed(c, 0.97, 50, random.Random(0))  # the long-run counts, all rejections so far, take a few more rounds
    assert c.stats.log[-1]["reason"] == "best" and int(c.stats.log[-1]["depth"]) >= 3
    # a long stretch of drafting before it stops again: the stretch starts short again
    for _ in range(40):
        ch = c.choose()
        if ch.depth == 0:
            break
        c.observe(ch.depth, 0)
    assert ch.reason == "off" and ch.plain_tokens == c.off_min


def test_timed_stretches_are_cost_samples_and_counters() -> None:
    """A timed plain stretch gives depth 0 a per-token sample and shows in the counters as (tokens, seconds)."""
    c = controller(3)
    c.plain_done(3, 0.006)
    c.plain_done(5, None)  # untimed (a step ran eagerly): counted as tokens only
    assert c.stats.stretches == [(3, 0.006)] and c.stats.as_dict()["stretches"] == [(3, 0.006)]
    assert c.samples[0][-1] == pytest.approx(0.002) and c.stats.plain_tokens == 8


def test_depth_0_costs_its_stretches_time_over_their_tokens() -> None:
    """Depth 0's cost is the kept stretches' seconds over their tokens: one long stretch outweighs several short ones
    (whose fixed cost per stretch raises their per-token rate), where a median of per-stretch rates would not."""
    c = controller(3)
    c.forget_cost(0)
    for _ in range(3):
        c.plain_done(8, 8 * 0.0015)  # short: 1.5 ms a token
    c.plain_done(128, 128 * 0.0010)  # long: 1.0 ms a token
    assert c.cost(0) == pytest.approx((3 * 8 * 0.0015 + 128 * 0.0010) / (3 * 8 + 128))
    c.forget_cost(0)
    c.plain_done(4, 0.004)
    assert c.cost(0) == pytest.approx(0.001) and list(c.weights[0]) == [4.0]


def test_a_probe_is_two_rounds_and_the_choice_after_sees_the_first() -> None:
    """The engine picks a round's successor before the round's outcome: the probe's second round is fixed, and the
    choice that follows it sees the first round's acceptance."""
    c = controller(5, 0.45, stale_after=10**9)
    for _ in range(10):
        c.observe(1, 0)
    ch = c.choose()
    assert ch.depth == 0
    c.plain_done(ch.plain_tokens, None)
    first = c.choose()
    second = c.choose()  # before the first probe round is observed
    assert (first.reason, second.reason) == ("probe", "probe") and first.depth == second.depth >= 1
    c.observe(first.depth, first.depth)  # all accepted
    third = c.choose()  # the engine's choice after the second round, made before the second's outcome
    assert third.acceptance[0] > second.acceptance[0]


def test_acceptance_carries_across_requests() -> None:
    """A request starts from the engine's long-run acceptance (not from the prior), and a request of another kind
    outweighs it within some 20 rounds; forget_acceptance (after the calibration) goes back to the prior."""
    c = controller(5, 0.45)
    feed(c, 0.95, 80, random.Random(2))
    c.start_request()
    assert c.reached == [0.0] * 5 and c.stats.depths == {}
    assert c.acceptance()[0] > 0.85 and c.choose().depth >= 3
    for _ in range(20):
        c.observe(2, 0)
    assert c.acceptance()[0] < 0.4
    # a long plain stretch ages the request's counts: the estimate goes back to the long-run one, not to the prior
    c2 = controller(5, 0.45)
    feed(c2, 0.3, 200, random.Random(3))
    c2.plain_done(128, None)
    assert c2.acceptance()[0] < 0.45 and c2.choose().reason == "probe"
    c2.forget_acceptance()
    assert c2.acceptance() == pytest.approx([c2.prior] * 5)


def test_stale_costs_are_measured_again() -> None:
    """Only the chosen depth's cost is measured; when deeper rounds become cheaper than their warm-up said, the
    refresh of the best depth's neighbours finds it and the choice moves deeper. Without refreshes it stays."""
    finals = []
    for stale_after in (24, 10**9):
        c = controller(8, 0.45, stale_after=stale_after)
        rng = random.Random(4)
        for _ in range(400):
            ch = c.choose()
            if ch.depth == 0:
                c.plain_done(ch.plain_tokens, ch.plain_tokens * 1.0)
                continue
            k = 0
            while k < ch.depth and rng.random() < 0.85:
                k += 1
            c.observe(ch.depth, k, 1.0 + 0.1 * ch.depth)  # the host now: a draft costs 0.1 plain steps, not 0.45
        finals.append(statistics.median(int(e["depth"]) for e in c.stats.log[-100:]))
        if stale_after < 10**9:
            assert c.stats.reasons["refresh"] > 0
    true = [sum(0.85 ** j for j in range(d + 1)) / (1 + 0.1 * d) for d in range(9)]
    assert finals[0] > finals[1] and abs(finals[0] - max(range(9), key=true.__getitem__)) <= 1, (finals, true)


def test_cost_table_fits_measured_depths() -> None:
    c = DepthController(6)
    assert c.cost(2) == pytest.approx(1 + 2 * c.cost_slope)  # nothing measured: the prior line
    c.observe_cost(1, 2.0)
    assert c.cost(3) == pytest.approx(2.0 * (1 + 3 * c.cost_slope) / (1 + c.cost_slope))
    assert c.cost(0) == pytest.approx(2.0 / (1 + c.cost_slope))
    c.observe_cost(5, 4.0)
    assert c.cost(3) == pytest.approx(3.0) and c.cost(6) == pytest.approx(4.5)
    assert c.cost(5) == pytest.approx(4.0)  # its own sample and the line agree
    for x in (2.5, 2.6, 40.0):  # a capture's outlier does not move the median; the line tempers depth 3's own
        c.observe_cost(3, x)
    line3 = (2.0 + 2.6 + 4.0) / 3  # the line through the medians at depths 1, 3, 5, at their mean depth
    assert c.cost(3) == pytest.approx((3 * 2.6 + c.line_weight * line3) / (3 + c.line_weight))
    c.observe_cost(0, 1.5)
    assert c.cost(0) == 1.5 and c.cost(1) < 2.0
    for x in (9.0, 9.0, 9.0):  # costs falling with depth (noise): the line is flat, the table never falls
        c.observe_cost(1, x)
    table = c.costs()
    assert all(a <= b for a, b in zip(table[1:-1], table[2:], strict=True)), table
    with pytest.raises(ValueError, match="accepted of a depth-2 round"):
        c.observe(2, 3)
    with pytest.raises(ValueError, match="maximum depth in 1..8"):
        DepthController(0)


def test_cost_table_keeps_a_step() -> None:
    """Costs that jump between two depths (a verify of one more row reading many more experts): each depth's own
    median keeps most of the jump that a line through all of them would spread over every depth."""
    c = DepthController(6)
    costs = {1: 2.0, 2: 2.2, 3: 2.4, 4: 3.4, 5: 3.6, 6: 3.8}
    for d, x in costs.items():
        for _ in range(6):
            c.observe_cost(d, x)
    slope = 0.40571  # the least-squares line through the six medians
    assert c.cost(4) - c.cost(3) > 2 * slope
    assert abs(c.cost(3) - 2.4) < 0.1 and abs(c.cost(4) - 3.4) < 0.1
    flat = DepthController(6, line_weight=1e9)  # the line alone
    for d, x in costs.items():
        flat.observe_cost(d, x)
    assert flat.cost(4) - flat.cost(3) == pytest.approx(slope, abs=1e-3)
    with pytest.raises(ValueError, match="line_weight"):
        DepthController(6, line_weight=-1)


def test_nondecreasing_pools_falling_runs() -> None:
    from qspec.spec.depth import nondecreasing

    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([5.0, 1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0, 2.0]
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and nondecreasing([]) == []


class Scripted(DepthController):
    """Depths from a random script (0 included), to check the engine against every sequence of depths."""

    def __init__(self, n: int, seed: int, stretch: tuple[int, int] = (1, 4)) -> None:
        super().__init__(n, off_min=3)
        self.calibrated = True
        self.rng = random.Random(seed)
        self.stretch = stretch

    def choose(self) -> DepthChoice:
        d = self.rng.choice([0, 0, *range(1, self.max_depth + 1)])
        self.stats.depths[d] += 1
        plain = self.rng.randint(*self.stretch) if d == 0 else 0
        return DepthChoice(d, "scripted", tuple(self.acceptance()), 0.0, plain)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_auto_equals_plain_for_any_depths(tiny_model: Model, seed: int) -> None:
    rng = random.Random(seed)
    N = 4
    prompt = [rng.randrange(511) for _ in range(5 + 9 * seed)]
    ref = plain(tiny_model, prompt, 30)
    for hook in (None, oracle_hook(ref, rng, 512)):  # drafts on the device; oracle drafts on the host
        eng = Engine(tiny_model, EngineOptions(draft=N, draft_auto=True, capacity=CAP, exact=True),
                     EngineHooks(draft_hook=hook))
        eng.depth = Scripted(N, seed)
        g = eng.generate(prompt, 30)
        assert g.tokens == ref
        hist = eng.depth.stats.depths
        assert hist[0] > 0 and sum(hist[d] for d in range(1, N + 1)) > 3
        if hook is not None:
            assert g.spec.accepted > 0
        depths = [r["depth"] for r in g.rounds_log]
        assert g.spec.drafted == sum(depths) and set(depths) <= set(range(1, N + 1))


def test_state_after_auto_rounds_equals_plain_decoding(tiny_model: Model) -> None:
    """Forced acceptance at changing depths, plain stretches and catch-ups leave every cache as plain decoding of
    the same tokens would, bit for bit."""
    rng = random.Random(5)
    N = 5
    eng = Engine(tiny_model, EngineOptions(draft=N, draft_auto=True, capacity=CAP, exact=True),
                 EngineHooks(accept_hook=lambda r, n: rng.randint(0, n)))
    eng.depth = Scripted(N, 7)
    prompt = [rng.randrange(511)]
    eng.generate(prompt, 40)
    hist = eng.runner.history
    want = teacher_forced_state(tiny_model, hist, N + 1)
    got = eng.runner.committed_state()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_draft_head_is_current_after_plain_stretches(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over plain stretches longer than a catch-up batch, the draft head's K/V cells end up as those of a head that
    ran every committed row (token j, the target's residual of position j - 1): a probe after a stretch
    drafts from the head a round that never stopped would have (up to rounding)."""
    import qspec.engine as engine_module

    monkeypatch.setattr(engine_module, "CATCH_UP_ROWS", 3)  # stretches of several batches and a remainder
    rng = random.Random(3)
    N = 4
    eng = Engine(tiny_model, EngineOptions(draft=N, draft_auto=True, capacity=CAP, exact=True),
                 EngineHooks(accept_hook=lambda r, n: rng.randint(0, n)))
    eng.depth = Scripted(N, 11, stretch=(5, 12))
    eng.generate([rng.randrange(511) for _ in range(6)], 100)
    assert eng.depth.stats.plain_tokens > 24
    hist = eng.runner.history
    ref = Runner(tiny_model, eng.opts.cache_options())
    X = []
    with ops.row_exact_mode(True):
        for j, t in enumerate(hist):
            X.append(ref.step(torch.tensor([t]))[1][-1:])
            ref.keep(1, rollback=False)
            if j:
                ref.mtp_step(torch.tensor([t]), X[j - 1], j)
    m = len(hist) - (N + 2 + 3)  # the last rows: the head has not run them when the request ends in a stretch
    got, want = eng.runner.cache.mtp_kv, ref.cache.mtp_kv
    # the head's rows are not row-exact (one row alone and in a batch round differently, ~1e-7); a cell the head
    # did not run over holds another row's values (differences of order 1)
    torch.testing.assert_close(got.k[1:m], want.k[1:m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.v[1:m], want.v[1:m], rtol=1e-5, atol=1e-5)


def test_stretch_option_sets_the_plain_stretches(tiny_model: Model) -> None:
    """--draft-auto-stretch is the first plain stretch's length, the longest STRETCH_GROWTH times it; out of range it
    is refused by name."""
    from qspec.options import OptionError
    from qspec.spec.depth import STRETCH_GROWTH

    eng = Engine(tiny_model, EngineOptions(draft=3, draft_auto=True, draft_auto_stretch=24, capacity=CAP))
    assert eng.depth is not None and (eng.depth.off_min, eng.depth.off_max) == (24, 24 * STRETCH_GROWTH)
    assert eng.depth.next_plain_tokens() == 24
    for bad in (0, 5000):
        with pytest.raises(OptionError, match="draft_auto_stretch"):
            EngineOptions(draft=3, draft_auto=True, draft_auto_stretch=bad)


def test_auto_engine_counters_and_calibration(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = list(range(3, 12))
    ref = plain(tiny_model, prompt, 20)
    eng = Engine(tiny_model, EngineOptions(draft=2, draft_auto=True, capacity=CAP, exact=True))
    g = eng.generate(prompt, 20)  # the first request calibrates every depth's cost
    assert g.tokens == ref
    assert all(eng.depth.samples[d] for d in range(3)) and eng.depth.calibrated
    d = g.depth
    assert set(d) == {"depth_histogram", "reasons", "plain_tokens", "choices", "stretches"}
    assert sum(d["depth_histogram"].values()) == len(d["choices"]) > 0
    first = d["choices"][0]
    assert len(first["acceptance"]) == 2 and len(first["tokens_per_s"]) == 3
    # a random head's drafts are rejected: drafting stops (and probes now and then). The costs are pinned (a round at
    # depth d costs 1 + 0.45 d plain steps): on a loaded host a draft round can measure cheaper than a plain step
    ctl = eng.depth
    for depth in range(3):
        ctl.forget_cost(depth)
        ctl.observe_cost(depth, 1.0 + 0.45 * depth)
    monkeypatch.setattr(ctl, "observe_cost", lambda *args: None)
    g = eng.generate(prompt, 20)
    assert g.tokens == ref
    assert g.depth["reasons"].get("off", 0) > 0 and g.depth["plain_tokens"] > 0
    with pytest.raises(ValueError, match="draft_auto chooses depths in 0..draft: it needs draft N"):
        EngineOptions(draft=0, draft_auto=True)


def test_calibration_fits_a_prompt_near_the_capacity(tiny_model: Model) -> None:
    """The calibration runs on the first request's prompt, cut so that its generations fit the cache: a prompt that
    leaves room for the request alone still measures every depth."""
    cap = 64
    prompt = [3 + i % 500 for i in range(cap - 12)]
    eng = Engine(tiny_model, EngineOptions(draft=2, draft_auto=True, capacity=cap, exact=True))
    g = eng.generate(prompt, 6)
    assert g.tokens == plain(tiny_model, prompt, 6)
    assert all(eng.depth.samples[d] for d in range(3))


def test_rounds_with_eager_steps_are_not_cost_samples(tiny_model: Model) -> None:
    """A round during which the runner ran a step eagerly (a graph capture at a new depth or context bucket) is
    no sample of its depth's cost: its time would price the depth out. The CPU runs no graphs, so the test bumps the
    runner's eager counter from the round hook on chosen rounds and checks which rounds came with seconds."""
    timed: list[tuple[int, bool]] = []

    class Fixed(Scripted):
        def choose(self) -> DepthChoice:
            self.stats.depths[2] += 1
            return DepthChoice(2, "scripted", tuple(self.acceptance()), 0.0, 0)

        def observe(self, depth: int, accepted: int, seconds: float | None = None) -> None:
            timed.append((len(timed), seconds is not None))
            super().observe(depth, accepted, seconds)

    def after_round(run: Runner, k: int) -> None:
        if len(timed) in (3, 6):  # rounds 3 and 6 "capture"
            run.graph_stats.eager += 1

    eng = Engine(tiny_model, EngineOptions(draft=2, draft_auto=True, capacity=CAP),
                 EngineHooks(accept_hook=lambda r, n: 0, after_round=after_round))
    eng.depth = Fixed(2, 0)
    eng.generate([5, 6, 7], 12)
    assert len(timed) >= 8
    assert [t for _, t in timed[:8]] == [False, True, True, False, True, True, False, True]


def test_sampled_auto_is_seeded(tiny_model: Model) -> None:
    from qspec.spec.accept import Sampler

    def run() -> list[int]:
        eng = Engine(tiny_model, EngineOptions(draft=3, draft_auto=True, capacity=CAP))
        eng.depth = Scripted(3, 2)
        s = Sampler(temperature=0.8, generator=torch.Generator().manual_seed(4))
        return eng.generate(list(range(1, 9)), 20, sampler=s).tokens

    a = run()
    assert a == run() and len(a) == 20


def test_cli_draft_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qspec.cli import main

    model = str(tmp_path / "tiny.gguf")
    assert main(["make-model", model, "--vocab-size", "512", "--seed", "3"]) == 0
    base = ["run", "fn main() {", "--model", model, "--max-tokens", "12", "--ctx", "64", "--exact"]
    capsys.readouterr()
    assert main([*base, "--draft", "0"]) == 0
    plain_text = capsys.readouterr().out
    assert main([*base, "--draft", "auto:2", "--stats", "--json", str(tmp_path / "g.json")]) == 0
    out, err = capsys.readouterr()
    assert out == plain_text and "draft depth chosen:" in err
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["options"]["draft_auto"] is True and doc["options"]["draft"] == 2
    assert sum(doc["depth"]["depth_histogram"].values()) == len(doc["depth"]["choices"]) > 0


def test_bench_arm_auto() -> None:
    from qspec.bench.arms import parse_arms

    plain_arm, auto, fixed = parse_arms("nospec,auto6:from=ours,auto=1,draft=6,mtp5:from=ours")
    opts = auto.options(capacity=256, kv_type="f32")
    assert auto.get("draft_auto") and opts.draft_auto and opts.draft == 6 and "MTP auto (0..6)" in auto.describe()
    assert not fixed.options(capacity=256, kv_type="f32").draft_auto
    assert not plain_arm.options(capacity=256, kv_type="f32").draft_auto
    with pytest.raises(ValueError, match="auto='maybe'"):
        parse_arms("a:draft=3,auto=maybe")


def test_drafting_stops_only_below_the_margin() -> None:
    """A stop costs a whole plain stretch: drafting whose best depth is expected within STOP_MARGIN of plain
    decoding's rate goes on; further below, it stops."""
    from qspec.spec.depth import STOP_MARGIN

    c = controller(3)
    for a in (0.43, 0.30):  # depth 1's rate / plain's = (1 + a) / 1.45: 0.986, 0.897
        c.acceptance = lambda a=a: [a, a, a]  # type: ignore[method-assign]
        ratio = (1 + a) / 1.45
        assert (c.choose().depth == 0) == (ratio < 1 - STOP_MARGIN), a


def test_depth_sim_script(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/depth_sim.py: the controller against fixed depths on simulated costs and acceptance."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import depth_sim

    monkeypatch.setattr(sys, "argv", ["depth_sim.py", "--costs", "cpu-demo", "--sources", "p=0.85,prose",
                                      "--requests", "2", "--tokens", "64", "--seeds", "1"])
    assert depth_sim.main() == 0
    out = capsys.readouterr().out
    assert "| cpu-demo | p=0.85 |" in out and "| cpu-demo | prose |" in out and "worst auto / best fixed" in out
    assert "slowest tenth of requests / best" in out
    # each request's own rate: plain decoding's is one token per plain step, whatever the request
    per: list[float] = []
    costs = depth_sim.COSTS["cpu-demo"]
    rate, _ = depth_sim.run_arm(costs, depth_sim.Geometric(0.5), 0, 3, 16, 0.0, 0, per_request=per)
    assert len(per) == 3 and all(r == pytest.approx(1 / costs[0]) for r in per) and rate == pytest.approx(per[0])
    # a trace with random phases: each request starts somewhere else, the same seed the same places
    a, b = (depth_sim.sources(["prose"], phase=True)["prose"](3) for _ in range(2))
    starts = []
    for t in (a, b):
        t.start()
        starts.append(t.pos)
    assert starts[0] == starts[1] and 0 <= starts[0] < len(a.counts)


def test_a_refresh_outlier_joins_the_old_samples() -> None:
    """A stale depth's refreshed cost replaces its old samples when it is within RENEW_RANGE of them (the host
    changed); a sample far off (a pause, a capture) only joins them, so the median barely moves."""
    from qspec.spec.depth import RENEW_RANGE

    c = controller(4)
    for d in range(5):  # three samples a depth, as the engine's calibration and rounds give
        for _ in range(2):
            c.observe_cost(d, 1.0 + 0.45 * d)
    old = c.cost(3)
    c.renew[3] = True
    c.observe_cost(3, old * 10)
    assert c.cost(3) < old * 2 and not c.renew[3]
    c.renew[3] = True
    c.observe_cost(3, old * RENEW_RANGE * 0.9)
    assert list(c.samples[3]) == [old * RENEW_RANGE * 0.9]


def test_requests_costs_replace_the_warm_up_line() -> None:
    """The warm-up (forced depths) measures every depth; once requests have measured two drafting depths, the depths
    only the warm-up measured drop out of the line (a short warm-up prompt can measure a flatter cost)."""
    c = DepthController(4)
    for d in range(5):
        c.force = d
        c.observe_cost(d, 1.0 + 0.2 * d)  # the warm-up's line: 0.2 per draft
    c.force = None
    assert c.cost(4) == pytest.approx(1.8)
    for _ in range(3):
        c.observe_cost(1, 1.5)  # the requests' line: 0.5 per draft
    assert c.cost(4) < 2.0  # one request-measured depth: the warm-up's depths 2-4 still hold the line
    for _ in range(3):
        c.observe_cost(2, 2.0)
    assert c.cost(4) == pytest.approx(3.0) and c.cost(0) == pytest.approx(1.0)
