"""Continuous batching (qspec/batch.py): requests decoded together give each the engine's own plain output."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch
from conftest import build_model, tiny_config

from qspec.batch import Batcher
from qspec.engine import Engine, EngineHooks, EngineOptions, Generation, prefill_chunks
from qspec.model.model import Model, Segment
from qspec.runner import EAGER_AT_LIMIT, Runner
from qspec.spec.accept import Sampler
from qspec.spec.depth import BatchDraftChoice
from qspec.spec.logprobs import Logprobs
from qspec.spec.stats import SpecStats

CAP = 128


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(511) for _ in range(n)]


def engine(model: Model, **kw: object) -> Engine:
    kw = {"draft": 0, "capacity": CAP, "exact": True, **kw}
    return Engine(model, EngineOptions(**kw))  # type: ignore[arg-type]


def together(b: Batcher, calls: list[dict]) -> list[Generation | BaseException]:
    """b.generate(**call) for every call, each from its own thread, all started at once."""
    out: list[Generation | BaseException] = [RuntimeError("not run")] * len(calls)
    start = threading.Barrier(len(calls))

    def one(i: int) -> None:
        start.wait()
        try:
            out[i] = b.generate(**calls[i])
        except BaseException as e:  # noqa: BLE001 - compared by the test
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def batched_and_alone(b: Batcher, alone: Engine, call: Callable[[int], dict], n: int
                      ) -> list[tuple[Generation, dict, Generation, dict]]:
    """call(0..n-1) through `alone` one at a time, then again (fresh log-probabilities and samplers) through the
    batcher all at once (closed after); each batched request's tokens and log-probabilities are its alone ->
    (batched, its call, alone, its call) for each."""
    want = [(alone.generate(**c), c) for c in (call(i) for i in range(n))]
    calls = [call(i) for i in range(n)]
    try:
        got = together(b, calls)
    finally:
        b.close()
    out = []
    for g, c, (w, wc) in zip(got, calls, want, strict=True):
        assert isinstance(g, Generation), g
        assert g.tokens == w.tokens
        assert [x.logprob for x in c["logprobs"].entries] == pytest.approx(
            [x.logprob for x in wc["logprobs"].entries], abs=1e-5)
        out.append((g, c, w, wc))
    return out


@pytest.fixture(scope="module")
def no_ple_model() -> Model:
    """The tiny geometry without the n-gram embedding (the tiny preset has one: its history and conv state are per
    sequence too), other weights."""
    return build_model(tiny_config(ple_layer=-1), seed=3)


@pytest.mark.parametrize("ple", [True, False])
def test_forward_batch_rows_equal_each_sequence_alone(tiny_model: Model, no_ple_model: Model, ple: bool) -> None:
    """One step over three sequences (one, two and one rows) gives each, bit for bit in exact mode, the logits and
    caches of its own step."""
    model = tiny_model if ple else no_ple_model
    e = engine(model)
    with e.runner.switches.apply():
        check_forward_batch(model, e)


def check_forward_batch(tiny_model: Model, e: Engine) -> None:
    alone, runs = [], []
    prompts = [prompt_of(n, s) for n, s in ((9, 1), (14, 2), (5, 3))]
    new = [[7], [8, 9], [10]]
    for p, t in zip(prompts, new, strict=True):
        r = e.runner.__class__(tiny_model, e.opts.cache_options())
        r.step(torch.tensor(p)), r.keep(len(p), rollback=False)
        ref = e.runner.__class__(tiny_model, e.opts.cache_options())
        ref.step(torch.tensor(p)), ref.keep(len(p), rollback=False)
        logits, _ = ref.step(torch.tensor(t))
        ref.keep(len(t), rollback=False)
        alone.append((logits, ref.committed_state()))
        runs.append(r)
    tokens = torch.tensor([x for t in new for x in t])
    at, segs, pos = 0, [], []
    for r, t in zip(runs, new, strict=True):
        seg, p = r.begin_rows(slice(at, at + len(t)))
        segs.append(seg), pos.append(p)
        at += len(t)
    logits, _ = tiny_model.forward_batch(tokens, torch.cat(pos), segs)
    at = 0
    for r, t, seg, (want, state) in zip(runs, new, segs, alone, strict=True):
        r.end_rows(tokens[seg.rows])
        r.keep(len(t), rollback=False)
        torch.testing.assert_close(logits[seg.rows], want, atol=0, rtol=0)
        got = r.committed_state()
        for k, v in state.items():
            torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)
    assert isinstance(segs[0], Segment)


@pytest.mark.parametrize(("slots", "draft", "mode"), [(1, 0, "on"), (2, 0, "on"), (4, 0, "on"), (1, 3, "on"),
                                                      (3, 3, "on"), (3, 3, "auto")])
def test_batched_greedy_equals_plain_decoding(tiny_model: Model, slots: int, draft: int, mode: str) -> None:
    """More requests than slots, of different lengths and stop rules: each gets the engine's plain output, also
    when the batch drafts (its sequences' speculative rounds verified in one step: bit for bit in exact mode), in
    every step or where the measured rates say it pays."""
    e = engine(tiny_model)
    calls = [dict(prompt=prompt_of(6 + 5 * i, i), max_tokens=4 + 3 * i) for i in range(6)]
    want = [e.generate(**c).tokens for c in calls]
    stop = want[2][1]  # a stop id the third request meets at its second token
    calls[2]["stop_ids"], want[2] = {stop}, want[2][:want[2].index(stop) + 1]
    b = Batcher(engine(tiny_model, draft=draft), slots, draft=mode)
    try:
        got = together(b, calls)
    finally:
        b.close()
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, Generation), g
        assert g.tokens == w
    # several requests a step when there are slots for them
    assert (b.steps.rows > b.steps.steps * (draft + 1)) == (slots > 1)
    assert got[2].stop_reason == "stop token" and got[0].stop_reason == "max tokens"
    if draft and mode == "on":
        assert all(isinstance(g, Generation) and g.spec.drafted for g in got)


def test_batched_rounds_equal_the_engines_at_every_accepted_count(no_ple_model: Model) -> None:
    """The batch's speculative rounds are the engine's: with acceptance forced by a hook (each round's count in
    turn, so that every count 0..d is rolled back to), greedy and sampled requests with log-probabilities, one of
    them waiting for a slot, give the tokens and log-probabilities the engine gives each alone under the same hook,
    round by round."""
    d = 3
    hooks = EngineHooks(accept_hook=lambda r, n: (r + 1) % (n + 1))

    def call(i: int) -> dict:
        return dict(prompt=prompt_of(7 + 3 * i, 70 + i), max_tokens=13 + i, logprobs=Logprobs(1),
                    sampler=Sampler(temperature=0.9, generator=torch.Generator().manual_seed(i)) if i == 2 else None)
    e = Engine(no_ple_model, EngineOptions(draft=d, capacity=CAP, exact=True), hooks)
    b = Batcher(Engine(no_ple_model, EngineOptions(draft=d, capacity=CAP, exact=True), hooks), 3, draft="on")
    for g, _, w, _ in batched_and_alone(b, e, call, 4):
        assert g.spec.rounds == w.spec.rounds and g.spec.accepted == w.spec.accepted
    assert b.steps.rows > b.steps.steps * (d + 1)  # rounds of several sequences


def test_batched_sampling_and_logprobs_equal_the_engines(no_ple_model: Model) -> None:
    """Seeded sampling, log-probabilities and a scored prompt in a batch: what the engine gives each request alone."""
    def call(i: int) -> dict:
        return dict(prompt=prompt_of(8 + i, 10 + i), max_tokens=6,
                    sampler=Sampler(temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(i)),
                    logprobs=Logprobs(2), prompt_logprobs=Logprobs(1) if i == 1 else None)
    for _, c, _, wc in batched_and_alone(Batcher(engine(no_ple_model), 3), engine(no_ple_model), call, 3):
        if wc["prompt_logprobs"] is not None:
            assert len(c["prompt_logprobs"].entries) == len(c["prompt"])


def test_a_failing_request_ends_alone_and_a_next_turn_reuses_its_slot(tiny_model: Model) -> None:
    """An exception from one request's callback ends that request only; a prompt that goes on from a finished one
    prefills only its new tokens and decodes as the engine does from scratch."""
    class Gone(Exception):
        pass

    def leave(_t: int) -> None:
        raise Gone

    e = engine(tiny_model)
    first = dict(prompt=prompt_of(10, 5), max_tokens=5)
    b = Batcher(engine(tiny_model), 2)
    try:
        got = together(b, [first, dict(prompt=prompt_of(7, 6), max_tokens=5, on_token=leave)])
        assert isinstance(got[1], Gone)
        g = got[0]
        assert isinstance(g, Generation) and g.tokens == e.generate(**first).tokens
        turn = first["prompt"] + g.tokens + prompt_of(4, 7)
        again = b.generate(turn, 5)
        assert again.cached_tokens == len(first["prompt"]) + len(g.tokens) - 1
        assert again.tokens == e.generate(turn, 5).tokens
    finally:
        b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.generate(prompt_of(4, 1), 2)


def test_bad_requests_are_refused_before_they_queue(tiny_model: Model) -> None:
    b = Batcher(engine(tiny_model), 1)
    try:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            b.generate([5, 600], 3)
        with pytest.raises(ValueError, match="context capacity"):
            b.generate(prompt_of(100, 1), 64)
    finally:
        b.close()
    with pytest.raises(ValueError, match="at least 1 slot"):
        Batcher(engine(tiny_model), 0)


def beside_a_free_request(model: Model, draft: int, call: dict) -> list[int]:
    """The tokens of the request `call` (Batcher.generate's arguments) decoded in a batch of two beside a request
    with no rules."""
    b = Batcher(engine(model, draft=draft), 2)
    try:
        got = together(b, [call, dict(prompt=prompt_of(12, 8), max_tokens=30)])
    finally:
        b.close()
    assert isinstance(got[0], Generation)
    return got[0].tokens


@pytest.mark.parametrize("draft", [0, 3])
def test_a_grammar_in_a_batch_picks_what_plain_decoding_under_it_picks(tiny_model: Model, draft: int) -> None:
    """A regular expression on one request of a batch (beside a free one): its masks follow its own tokens."""
    import re

    from conftest import tiny_tokenizer

    from qspec.spec.grammar import GrammarCompiler, GrammarSpec

    tok, regex = tiny_tokenizer(), "[a-z]{3,12}( [0-9]{1,3}){2}"
    compiler = GrammarCompiler(tok, tiny_model.cfg.vocab_size)

    def call() -> dict:
        return dict(prompt=prompt_of(9, 4), max_tokens=40, stop_ids=set(tok.stop_ids),
                    sampler=Sampler(grammar=compiler.compile(GrammarSpec("regex", regex))))
    want = engine(tiny_model).generate(**call()).tokens
    assert re.fullmatch(regex, tok.decode(want, skip_special=True)) and want[-1] in tok.stop_ids
    assert beside_a_free_request(tiny_model, draft, call()) == want


@pytest.mark.parametrize("draft", [0, 3])
def test_a_thinking_budget_in_a_batch_closes_where_plain_decoding_closes(tiny_model: Model, draft: int) -> None:
    """A think block held to a budget on one request of a batch: forced closed after the same tokens as alone."""
    from qspec.spec.grammar import AfterThinking, FreeText, ThinkingBudget

    prompt = prompt_of(9, 4) + [7]  # 7 stands for <think>
    free = engine(tiny_model).generate(prompt, 24).tokens
    close = next(t for t in range(20, 500) if t not in free and t != 7)  # stands for </think>

    def call() -> dict:
        budget = ThinkingBudget(5, (free[0], close))
        return dict(prompt=prompt, max_tokens=24, sampler=Sampler(grammar=AfterThinking(
            FreeText(tiny_model.cfg.vocab_size), 7, close, prompt, budget=budget)))
    want = engine(tiny_model).generate(**call()).tokens
    assert want[:5] == free[:5] and want[5:7] == [free[0], close] and want != free
    assert beside_a_free_request(tiny_model, draft, call()) == want


@pytest.mark.parametrize("draft", [0, 2])
def test_sequences_in_different_kv_buckets_decode_together(tiny_model: Model, draft: int) -> None:
    """Fast mode (KV buckets, not the whole cache): a batch attends over its largest sequence's bucket, the cells past
    each shorter sequence masked, and each request still gets the engine's output."""
    prompts = [prompt_of(n, 20 + n) for n in (30, 600, 100)]  # buckets of 512 and 1,024 cells
    e = engine(tiny_model, capacity=1024, exact=False, kv_type="q8_0")
    want = [e.generate(p, 20).tokens for p in prompts]
    b = Batcher(engine(tiny_model, capacity=1024, exact=False, kv_type="q8_0", draft=draft), 3)
    try:
        assert [g.tokens for g in b.generate_all(prompts, 20)] == want
    finally:
        b.close()


def test_a_turn_after_a_stop_token_goes_on_from_its_slot(tiny_model: Model) -> None:
    """A request that ends on a stop token while the step after it is under way: that step's row is dropped, so the
    slot holds the prompt and the output but its last token, and a next turn prefills only what follows."""
    e = engine(tiny_model)
    prompt = prompt_of(11, 30)
    free = e.generate(prompt, 12).tokens
    stop = free[5]
    assert stop not in free[:5]
    b = Batcher(engine(tiny_model), 2)
    try:
        first, _ = b.generate_all([prompt, prompt_of(9, 31)], 12, stop_ids={stop})
        assert first.tokens == free[:6] and first.stop_reason == "stop token"
        turn = prompt + first.tokens + prompt_of(3, 32)
        again = b.generate(turn, 6)
        assert again.cached_tokens == len(prompt) + 5 and again.tokens == e.generate(turn, 6).tokens
    finally:
        b.close()


@pytest.mark.parametrize(("draft", "batch_draft", "temperature"), [(2, "on", 0.0), (2, "off", 0.0), (0, "off", 0.0),
                                                                   (0, "off", 0.9)])
def test_a_request_alone_decodes_with_the_engine_and_hands_over_when_another_arrives(
        tiny_model: Model, draft: int, batch_draft: str, temperature: float) -> None:
    """A greedy request alone decodes with the engine (its speculative rounds with an engine that drafts, its plain
    steps without), and so does a sampled one when the engine does not draft; when a second request arrives, the
    first goes on in the batch after its next token (its prompt and output so far prefilled in a slot). Both
    outputs are the engine's (greedy speculation equals plain decoding; the sampled draws go on where the engine's
    stopped)."""
    first, second = prompt_of(10, 40), prompt_of(8, 41)
    plain = engine(tiny_model)

    def sampler() -> Sampler:
        return Sampler(temperature=temperature, generator=torch.Generator().manual_seed(7))
    want = [plain.generate(first, 30, sampler=sampler()).tokens, plain.generate(second, 12).tokens]
    b = Batcher(engine(tiny_model, draft=draft), 2, draft=batch_draft)
    try:
        assert b.depth == (2 if batch_draft == "on" else 0)
        alone = b.generate(first, 30, sampler=sampler())
        assert alone.tokens == want[0] and (alone.spec.drafted > 0) == (draft > 0)  # the engine's rounds or steps
        assert b.steps.steps == 0  # none of the batch's
        got: dict[str, Generation] = {}
        seen: list[int] = []
        other = threading.Thread(target=lambda: got.update(second=b.generate(second, 12)))

        def arrive(t: int) -> None:  # at the first request's 5th token, the second one queues
            seen.append(t)
            if len(seen) == 5:
                other.start()
                while not b._waiting:
                    time.sleep(0.001)
        got["first"] = b.generate(first, 30, on_token=arrive, sampler=sampler())
        other.join()
        assert got["first"].tokens == want[0] == seen and got["second"].tokens == want[1]
        assert b.steps.rows > b.steps.steps  # they decoded together
    finally:
        b.close()


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_batch_switching_between_rounds_and_plain_steps_keeps_outputs_and_draft_heads(tiny_model: Model,
                                                                                        logprobs: bool) -> None:
    """A batch that drafts in some passes (1 or 2 deep) and decodes plainly in others (the choice forced to a
    pattern): each
    request's output is its plain decoding, and each slot's draft head holds the K/V cells of every
    position it committed, whichever step decoded it (a plain step writes its rows' cells, a round's extend its
    committed rows', a prefill the prompt's), as a prefill of the same tokens writes them. Plain greedy steps are
    pipelined; with log-probabilities they are not."""
    e = engine(tiny_model, draft=2)
    calls = [dict(prompt=prompt_of(7 + 4 * i, 90 + i), max_tokens=14 + 3 * i) for i in range(3)]
    want = [engine(tiny_model).generate(**c).tokens for c in calls]
    b = Batcher(e, 3, draft="auto")
    pattern = itertools.cycle([2, 0, 0, 2, 1, 0, 1, 2])
    b.choice.choose = lambda n: next(pattern)  # type: ignore[union-attr, method-assign]
    b._alone_ok = lambda job: False  # type: ignore[method-assign]  # every request in the batch
    try:
        got = together(b, [dict(c, logprobs=Logprobs(1) if logprobs else None) for c in calls])
    finally:
        b.close()
    assert [g.tokens for g in got] == want  # type: ignore[union-attr]
    assert {k[1] for k in b.steps.seconds} == {0, 1, 2}  # plain steps and rounds of both depths ran
    for g, c in zip(got, calls, strict=True):
        ids = c["prompt"] + g.tokens[:-1]  # type: ignore[union-attr]
        slot = next(r for r in b.runners if r.history == ids)
        ref = Runner(tiny_model, e.opts.cache_options())
        with e.runner.switches.apply():
            prefill_chunks(ref, torch.tensor(ids), 64, 0, None, draft=True)
        n = len(ids)
        # up to rounding: the head's products are not row-exact (steps of other row counts round differently)
        torch.testing.assert_close(slot.cache.mtp_kv.k[1:n], ref.cache.mtp_kv.k[1:n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(slot.cache.mtp_kv.v[1:n], ref.cache.mtp_kv.v[1:n], atol=1e-5, rtol=1e-4)


def test_the_batch_draft_choice_learns_each_draft_positions_acceptance(no_ple_model: Model) -> None:
    """With acceptance forced to one draft a round, the batch's choice (auto) learns from every sequence's rounds,
    whatever their depth, that draft 1 is accepted and draft 2 is not: a round 2 deep commits 2 tokens, as one 1
    deep does."""
    hooks = EngineHooks(accept_hook=lambda r, n: min(1, n))
    b = Batcher(Engine(no_ple_model, EngineOptions(draft=2, capacity=CAP, exact=True), hooks), 3, draft="auto")
    b._alone_ok = lambda job: False  # type: ignore[method-assign]  # every request in the batch
    try:
        together(b, [dict(prompt=prompt_of(8 + i, 40 + i), max_tokens=24) for i in range(3)])
    finally:
        b.close()
    c = b.choice
    assert c is not None and b.rounds > 0 and len(c.hits[1]) > 0
    assert all(c.hits[0]) and not any(c.hits[1]) and c.tokens(2) == c.tokens(1) == 2.0


def test_the_batch_draft_choice_measures_each_depth_at_each_size() -> None:
    """BatchDraftChoice: a depth not measured at a batch size is tried first, deepest first (its first uses, which
    compile and capture, not counted); then the one with the most tokens a second wins: a round against the tokens
    a sequence is expected to commit at its depth (each draft position's acceptance, from every round that drafted
    it), a plain step against one; after `recheck` choices the losing depths are measured again in turn."""
    c = BatchDraftChoice(2, measure=2, skip=1, recheck=5)
    times = {2: 0.010, 1: 0.005, 0: 0.004}  # seconds a step at each depth, 4 sequences
    accepted = {2: [2, 2, 1, 0], 1: [1, 1, 1, 0]}  # drafts 1 and 2 accepted with 3/4 and 2/3

    def run(n: int) -> int:
        d = c.choose(n)
        c.observe(n, d, times[d], accepted.get(d, ()))
        return d
    assert [run(4) for _ in range(9)] == [2] * 3 + [1] * 3 + [0] * 3  # each depth: one skipped, two measured
    assert c.tokens(1) == pytest.approx(1 + 15 / 20) and c.tokens(2) == pytest.approx(1 + 15 / 20 + 6 / 12)
    assert c.rate(4, 1) == pytest.approx(350.0) and c.rate(4, 2) == pytest.approx(225.0)
    assert c.rate(4, 0) == pytest.approx(250.0)
    assert [c.choose(4) for _ in range(4)] == [1] * 4
    assert c.choose(4) == 2  # the 5th choice: a losing depth measured afresh, the deepest first
    assert c.rate(4, 2) is None and c.rate(2, 1) is None  # and another batch size is measured on its own
    for _ in range(2):
        c.observe(4, 2, 0.004, [2, 2, 2, 2])  # rounds 2 deep got faster, and their drafts accepted: they win now
    assert c.choose(4) == 2
    c.since[4] = 10**6
    assert c.choose(4) == 0  # the next recheck: the next losing depth in turn (1 and 0 lose to 2 now)
    with pytest.raises(ValueError, match="batch draft choice"):
        BatchDraftChoice(0)
    with pytest.raises(ValueError, match="batch drafting must be one of"):
        Batcher(engine(build_model(tiny_config(), seed=1), draft=1), 1, draft="sometimes")


def test_a_pass_that_compiles_or_captures_is_no_sample_of_its_depths_time(tiny_model: Model) -> None:
    """A pass in which a batch step ran eagerly for a passing reason (a shape's first use, its capture: the lead
    runner's eager count outside the graph limit's) gives the draft choice its acceptance but not its time; a step
    eager at the graph limit stays so, and is a sample."""
    def run(b: Batcher) -> BatchDraftChoice:
        try:
            b.generate_all([prompt_of(8 + k, 90 + k) for k in range(3)], 12)
        finally:
            b.close()
        assert b.choice is not None and len(b.choice.hits[0]) > 0  # acceptance counted in any case
        return b.choice
    assert sum(map(len, run(Batcher(engine(tiny_model, draft=2), 3)).times.values())) > 0
    b = Batcher(engine(tiny_model, draft=2), 3)
    st = b.runners[0].graph_stats

    def first_use(*_a: object) -> torch.Tensor:  # every batch step "eager for the first time"
        st.eager += 1
        return real(*_a)
    real, b.steps.run = b.steps.run, first_use  # type: ignore[method-assign]
    choice = run(b)
    assert not choice.times and sum(choice.seen.values()) == 0
    b = Batcher(engine(tiny_model, draft=2), 3)
    st = b.runners[0].graph_stats

    def at_limit(*_a: object) -> torch.Tensor:
        st.eager += 1
        st.eager_reasons[EAGER_AT_LIMIT] += 1
        return real(*_a)
    real, b.steps.run = b.steps.run, at_limit  # type: ignore[method-assign]
    assert sum(map(len, run(b).times.values())) > 0


def test_a_request_handed_over_keeps_its_rounds_counts(tiny_model: Model) -> None:
    """The engine records a request's rounds in the counters it is given (Engine.generate's `counters`), and they
    keep the rounds done before an exception from on_token hands the request elsewhere (as the batcher's hand-over
    does): the request's Generation reports the rounds of both parts."""
    e = engine(tiny_model, draft=2)
    mine = SpecStats()
    g = e.generate(prompt_of(9, 80), 12, counters=mine)
    assert g.spec is mine and mine.rounds > 0
    seen: list[int] = []

    def leave(t: int) -> None:
        seen.append(t)
        if len(seen) == 8:
            raise KeyError("handed over")
    kept = SpecStats()
    with pytest.raises(KeyError):
        e.generate(prompt_of(9, 81), 30, on_token=leave, counters=kept)
    assert kept.rounds > 0 and kept.drafted == 2 * kept.rounds  # the rounds before the 8th token


@pytest.mark.parametrize("draft", [0, 2])
def test_a_request_that_fails_midway_leaves_the_others_and_its_slot_clean(tiny_model: Model, draft: int) -> None:
    """A callback that raises at a request's 4th token (a client gone while the next step is under way): that
    request ends with the error, the others decode on, and a request later given its slot decodes as the engine."""
    class Gone(Exception):
        pass

    seen: list[int] = []

    def leave(t: int) -> None:
        seen.append(t)
        if len(seen) == 4:
            raise Gone

    e = engine(tiny_model)
    calls = [dict(prompt=prompt_of(9, 50), max_tokens=12), dict(prompt=prompt_of(7, 51), max_tokens=12, on_token=leave)]
    b = Batcher(engine(tiny_model, draft=draft), 2)
    try:
        got = together(b, calls)
        assert isinstance(got[1], Gone) and len(seen) == 4
        assert isinstance(got[0], Generation) and got[0].tokens == e.generate(**calls[0]).tokens
        later = prompt_of(6, 52)
        assert [g.tokens for g in b.generate_all([later, prompt_of(5, 53)], 8)][0] == e.generate(later, 8).tokens
    finally:
        b.close()


def test_a_long_prompt_prefills_a_chunk_a_step_while_others_decode(tiny_model: Model) -> None:
    """A prompt of 8 prefill chunks that arrives while another request decodes: that request emits a token after
    each chunk instead of waiting for the whole prompt, and both outputs are the engine's."""
    log: list[str] = []
    first, second = prompt_of(9, 60), prompt_of(64, 61)
    plain = engine(tiny_model, prefill_chunk=8)
    want = [plain.generate(first, 30).tokens, plain.generate(second, 4).tokens]
    b = Batcher(engine(tiny_model, prefill_chunk=8), 2)
    got: dict[str, Generation] = {}
    other = threading.Thread(target=lambda: got.update(
        second=b.generate(second, 4, on_token=lambda t: log.append("b"))))

    def first_token(t: int) -> None:
        log.append("a")
        if log.count("a") == 3:
            other.start()
            while not b._waiting:
                time.sleep(0.001)
            log.append("queued")
    try:
        got["first"] = b.generate(first, 30, on_token=first_token)
        other.join()
    finally:
        b.close()
    assert got["first"].tokens == want[0] and got["second"].tokens == want[1]
    between = log[log.index("queued"):log.index("b")]
    assert between.count("a") >= 7, log  # a token of the first request after each of the chunks but the last
