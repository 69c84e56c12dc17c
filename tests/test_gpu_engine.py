"""The test suite's correctness claims re-run on CUDA with CUDA graphs (marked `cuda`: `python -m pytest -m cuda`),
and, on any machine, the rule they apply to bf16 greedy equality.

  * CUDA f32 logits against the CPU f32 model (same weights), bf16 against f32 (relative tolerance);
  * greedy speculative == plain decoding, bf16 and f32, for N = 1..8, with oracle drafts so every acceptance length
    occurs; without hooks (drafts chained on the device); with a stop token. In f32, and in bf16 with row-exact
    products (EngineOptions.exact: a verify row is computed as a decode row is), the tokens must be equal. bf16 with
    the fast kernels computes a 6-row verify with other kernels than a 1-row decode step, so two logits within bf16
    rounding of each other may swap: there the tokens must be equal up to the first difference, and that difference
    must sit at a near tie of plain decoding (top-2 gap <= NEAR_TIE of the row's largest |logit|);
  * every combination of the seed's optimizations gives the baseline's tokens;
  * a request that reuses the last one's caches (EngineOptions.prefix_cache) decodes as a fresh engine does; the
    emitted tokens' log-probabilities come from their own rows;
  * the torch.compile-fused steps (the default on CUDA) against the same functions run eagerly, and each default step
    kernel (PDL, masked attention, KV write, GDN conv, verify mixers, grouped-GEMM prefill) against what it replaces;
  * sampling on the device: draws and speculative sampling follow their distributions, sampled decoding is repeatable
    for a seed.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from qspec.config import preset
from qspec.engine import Engine, EngineHooks, EngineOptions, Generation
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights.random_model import random_weights

# bf16 rounding of a logit near 1 is 2^-7 ~ 0.8%, and a step accumulates several roundings
NEAR_TIE = 0.03
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


_HOOKS = {f.name for f in dataclasses.fields(EngineHooks)}


def engine(model: Model, **kw: Any) -> Engine:
    """An engine from options and test hooks given together (the checks set both in one call)."""
    return Engine(model, EngineOptions(**{k: v for k, v in kw.items() if k not in _HOOKS}),
                  EngineHooks(**{k: v for k, v in kw.items() if k in _HOOKS}))


# ---- the rules -------------------------------------------------------------------------------------------------

def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def first_diff(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def same_or_tie(got: list[int], ref: Any, n_ref: int, near_tie: float) -> tuple[bool, str]:
    """Equal to ref.tokens, or equal up to a first difference i at which the ref run's top two logits for token i
    are within `near_tie` of that row's largest |logit| (ref: a Generation with record_logits, n_ref drafts)."""
    want = ref.tokens
    i = first_diff(got, want)
    if i is None:
        return True, "equal"
    row = _predicting_row(ref, n_ref, i) if 0 < i < min(len(got), len(want)) else None
    if row is None:
        return False, f"first diff {i}"
    top = row.float().topk(2).values
    gap, scale = (top[0] - top[1]).item(), row.float().abs().max().item()
    tie = gap <= near_tie * scale
    return tie, f"first diff {i}, {'a near tie' if tie else 'NOT a near tie'}: top-2 gap {gap:.4f} = {gap / scale:.2%}"


def _predicting_row(g: Any, n: int, i: int) -> torch.Tensor | None:
    """The logits row from which run g (n drafts per round) took output token i (token 0 is the prefill's)."""
    if n == 0:
        return g.logits[i - 1][-1] if i - 1 < len(g.logits) else None
    done = 1
    for r, rnd in enumerate(g.rounds_log):
        if i <= done + rnd["accepted"]:
            return g.logits[r][i - done] if r < len(g.logits) else None
        done += rnd["accepted"] + 1
    return None


def _steps_before(g: Any, n: int, cut: int) -> int:
    """How many of g's steps (decode steps, or verify rounds of n drafts) ran entirely before output token `cut`."""
    if n == 0:
        return max(0, cut - 1)
    done, steps = 1, 0
    for rnd in g.rounds_log:
        done += rnd["accepted"] + 1
        if done > cut:
            break
        steps += 1
    return steps


def plain_against(run: Generation, ref: Generation, near_tie: float) -> tuple[bool, str, float]:
    """Plain decoding `run` against `ref` (both with record_logits): tokens equal, or equal up to a near tie; and the
    largest logits rel diff over the steps that predicted tokens 1 .. the first difference (logits[i - 1] predicts
    token i: the steps after it read a different token) -> (ok, detail, rel)."""
    cut = first_diff(run.tokens, ref.tokens)
    steps = len(run.logits) if cut is None else cut
    rel = max((rel_diff(a, b) for a, b in zip(run.logits[:steps], ref.logits[:steps], strict=False)), default=0.0)
    ok, why = same_or_tie(run.tokens, ref, 0, near_tie)
    return ok, f"tokens {why}; logits rel diff {rel:.2e} over {steps} steps", rel


def oracle(reference: list[int], rng: random.Random) -> Callable[[int, list[int]], list[int]]:
    """A draft hook: the reference's next tokens, cut at a random point by one wrong token."""
    def hook(n_out: int, drafts: list[int]) -> list[int]:
        good = (reference[n_out:n_out + len(drafts)] + [0] * len(drafts))[:len(drafts)]
        cut = rng.randint(0, len(drafts))
        if cut < len(drafts):
            good[cut] = (good[cut] + 1 + rng.randrange(511)) % 512
        return good
    return hook


def within(counts: torch.Tensor, target: torch.Tensor, sigmas: float = 5.0) -> tuple[bool, str]:
    """Whether the empirical frequencies of `counts` match the distribution `target` within `sigmas` standard
    errors per token (and tokens of probability 0 never occur)."""
    n = counts.sum()
    freq, target = counts.double() / n, target.double().cpu()
    ok = bool(((freq - target).abs() <= sigmas * (target * (1 - target) / n).sqrt() + 1e-12).all())
    return ok, f"{int(n)} draws, frequencies {freq.tolist()} vs {target.tolist()}"


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])


def test_rule_plain_decoding_difference_at_a_near_tie_only() -> None:
    # plain decoding: logits[i] predicted token i + 1; token 2 was a near tie (0.57%), token 1 was not
    logits = [_row(1.0, 0.5, 0.1), _row(1.36, 1.3522, 0.1), _row(1.0, 0.2, 0.1)]
    ref = SimpleNamespace(tokens=[5, 0, 1, 0], logits=logits, rounds_log=[])
    assert same_or_tie([5, 0, 1, 0], ref, 0, 0.03) == (True, "equal")
    ok, why = same_or_tie([5, 0, 0, 1], ref, 0, 0.03)
    assert ok and "first diff 2, a near tie" in why
    ok, why = same_or_tie([5, 1, 1, 0], ref, 0, 0.03)
    assert not ok and "NOT a near tie" in why
    assert not same_or_tie([5, 0, 0, 1], ref, 0, 0.0)[0]  # f32 and row-exact rows allow no tie
    assert not same_or_tie([5, 0, 1], ref, 0, 0.03)[0]  # a shorter output is a difference, not a tie


def test_rule_plain_logits_compared_up_to_the_first_difference() -> None:
    # token 2 differs at a tie of the row that predicted it (logits[1]); logits[2] read that other token
    tied = _row(1.0, 1.0, 0.0)
    ref = SimpleNamespace(tokens=[5, 0, 1, 0], logits=[_row(1.0, 0.0, 0.0), tied, _row(0.0, 1.0, 0.0)])
    run = SimpleNamespace(tokens=[5, 0, 0, 2], logits=[ref.logits[0], tied, _row(0.0, 0.0, 9.0)])
    ok, why, rel = plain_against(run, ref, 0.03)  # type: ignore[arg-type]
    assert ok and rel == 0.0 and "over 2 steps" in why
    run.logits[1] = _row(1.0, 1.0, 0.5)  # a step before the difference that does differ counts
    assert plain_against(run, ref, 0.03)[2] > 0.1  # type: ignore[arg-type]


def test_rule_rows_of_speculative_rounds() -> None:
    # round 0 accepted 1 draft: its verify rows 0 and 1 predicted tokens 1 and 2; round 1's row 0 token 3
    r0 = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.01, 0.0], [0.0, 0.0, 1.0]])
    r1 = torch.tensor([[1.0, 0.0, 0.0]])
    g = SimpleNamespace(tokens=[5, 1, 1, 0], logits=[r0, r1], rounds_log=[{"accepted": 1}, {"accepted": 0}])
    assert torch.equal(_predicting_row(g, 3, 1), r0[0])
    assert torch.equal(_predicting_row(g, 3, 2), r0[1])
    assert torch.equal(_predicting_row(g, 3, 3), r1[0])
    assert _predicting_row(g, 3, 4) is None
    assert _steps_before(g, 3, 3) == 1 and _steps_before(g, 3, 2) == 0 and _steps_before(g, 0, 3) == 2
    ok, why = same_or_tie([5, 1, 0, 0], g, 3, 0.03)  # token 2 came from the near-tied row r0[1]
    assert ok and "first diff 2" in why


def test_rule_within_a_distribution() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    assert within(torch.tensor([5000, 5000, 0]), p)[0]
    assert not within(torch.tensor([6000, 4000, 0]), p)[0]
    assert not within(torch.tensor([5000, 4999, 1]), p)[0]  # a token of probability 0 occurred


# ---- the GPU checks --------------------------------------------------------------------------------------------

def build(device: str, dtype: torch.dtype) -> Model:
    cfg = preset("tiny", vocab_size=512)
    w = {k: (v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v)
         for k, v in random_weights(cfg, seed=0).items()}
    return Model(cfg, w)


@dataclass
class Setup:
    """One dtype's model on the GPU, its prompt and its plain greedy decoding (logits recorded)."""
    gpu: Model
    prompt: list[int]
    plain: Generation
    kv: str
    tie: float  # the near-tie share allowed (0 in f32)
    tol: float  # logits' relative tolerance against another path

    def run(self, n: int, tokens: int = 48, **kw: Any) -> Generation:
        opts = {"capacity": 256, "kv_type": self.kv} | kw
        return engine(self.gpu, draft=n, **opts).generate(self.prompt, tokens)


IDS = torch.randint(0, 511, (60,), generator=torch.Generator().manual_seed(0))
_SETUPS: dict[torch.dtype, Setup] = {}


@pytest.fixture(params=DTYPES)
def setup(request: pytest.FixtureRequest) -> Setup:
    dtype = request.param
    if dtype not in _SETUPS:
        torch.set_grad_enabled(False)
        gpu = build("cuda", dtype)
        kv = "bf16" if dtype == torch.bfloat16 else "f32"
        prompt = IDS[:25].tolist()
        plain = engine(gpu, draft=0, capacity=256, kv_type=kv, record_logits=True).generate(prompt, 48)
        _SETUPS[dtype] = Setup(gpu, prompt, plain, kv, NEAR_TIE if dtype == torch.bfloat16 else 0.0,
                               5e-2 if dtype == torch.bfloat16 else 1e-3)
    return _SETUPS[dtype]


@pytest.mark.cuda
def test_logits_match_the_cpu(setup: Setup) -> None:
    ref = Runner(build("cpu", torch.float32), CacheOptions(capacity=128)).step(IDS)[0]
    got = Runner(setup.gpu, CacheOptions(capacity=128, kv_type=setup.kv)).step(IDS)[0].float().cpu()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < setup.tol, f"rel err {rel:.2e}, argmax agree {(got.argmax(-1) == ref.argmax(-1)).float().mean():.3f}"


@pytest.mark.cuda
def test_short_prompt_recurrence_equals_the_chunked_form(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of up to FINAL_MAX_ROWS rows prefills GDN through the per-row kernel (the last state kept), a longer
    one through the chunked form: the logits of every row agree, and so do those of a decode step after them."""
    import qspec.model.gdn as gdn

    def two_steps() -> tuple[torch.Tensor, torch.Tensor]:
        r = Runner(setup.gpu, CacheOptions(capacity=128, kv_type=setup.kv))
        return r.step(IDS)[0].float().cpu(), r.step(IDS[:1])[0].float().cpu()

    assert IDS.numel() <= gdn.FINAL_MAX_ROWS
    per_row = two_steps()
    monkeypatch.setattr(gdn, "FINAL_MAX_ROWS", 0)
    chunked = two_steps()
    for a, b in zip(per_row, chunked, strict=True):
        assert rel_diff(a, b) < setup.tol, rel_diff(a, b)


@pytest.mark.cuda
def test_plain_decoding_replays_graphs(setup: Setup) -> None:
    assert setup.plain.graphs["replays"] > 0, setup.plain.graphs


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 3])
def test_fused_steps_equal_unfused(setup: Setup, n: int) -> None:
    """torch.compile-fused steps against the same functions eagerly. Compared: rows whose context is the emitted tokens
    alone (every decode row, row 0 of each verify step, each round's first draft step) in the steps before the first
    token where the two builds part (bf16: only at a near tie). Later verify rows follow the round's drafts, and one
    draft that flips between the builds gives those rows a different context."""
    opts = dict(kv_type="q8_0", record_logits=True)
    ok, why = same_rows(setup.run(n, 24, **opts), setup.run(n, 24, compile=False, **opts), n, setup)
    assert ok, why


def same_rows(f: Generation, u: Generation, n: int, setup: Setup) -> tuple[bool, str]:
    """Run f against u (n drafts, logits recorded): tokens equal up to a near tie, and within setup.tol the logits of
    rows whose context is the emitted tokens alone (decode rows, row 0 of each verify step, each round's first draft
    step) in the steps before the first token where they part."""
    same, why = same_or_tie(f.tokens, u, n, setup.tie)
    cut = first_diff(f.tokens, u.tokens)
    steps = len(f.logits) if cut is None else _steps_before(f, n, cut)
    pairs = list(zip(f.logits[:steps], u.logits[:steps], strict=True))
    rel_first = max((rel_diff(a[:1], b[:1]) for a, b in pairs), default=0.0)
    rel_draft = max((rel_diff(a, b) for a, b in zip(f.draft_logits[:steps], u.draft_logits[:steps], strict=False)),
                    default=0.0)
    return (same and steps > 0 and rel_first < setup.tol and rel_draft < setup.tol,
            f"tokens {why}; over {steps} steps: logits rel diff {rel_first:.2e}, first draft step {rel_draft:.2e}")


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 3])
def test_log_probabilities_through_graphs(setup: Setup, n: int) -> None:
    """Each emitted token's log-probability row, copied to the host behind its step (no wait of its own): the row's
    token is the emitted one (Logprobs.take checks it), and greedy tokens are their rows' most likely."""
    from qspec.spec.logprobs import Logprobs

    lp = Logprobs(4)
    g = engine(setup.gpu, draft=n, capacity=256, kv_type=setup.kv).generate(setup.prompt, 40, logprobs=lp)
    assert [e.token for e in lp.entries] == g.tokens
    assert all(e.logprob == e.top[0][1] <= 0 for e in lp.entries)  # the most likely (or tied with it)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [2, 4])
def test_logit_rules_through_graphs(setup: Setup, n: int) -> None:
    """Penalties and a bias on the device's rounds (each verify row counting the drafts before it) pick what plain
    decoding under them picks; in bf16 a verify row and a decode row may round apart at a near tie."""
    from qspec.spec.accept import Sampler
    from qspec.spec.logit_rules import LogitRules

    rules = LogitRules(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={5: 2.0})
    want = engine(setup.gpu, draft=0, capacity=256, kv_type=setup.kv).generate(
        setup.prompt, 40, sampler=Sampler(rules=rules)).tokens
    assert want != setup.plain.tokens[:40]
    got = engine(setup.gpu, draft=n, capacity=256, kv_type=setup.kv).generate(
        setup.prompt, 40, sampler=Sampler(rules=rules)).tokens
    if setup.tie:
        assert first_diff(got, want) is None or first_diff(got, want) >= 8, (got, want)
    else:
        assert got == want


@pytest.mark.cuda
@pytest.mark.parametrize("n", [2, 4])
def test_a_grammar_through_graphs(setup: Setup, n: int) -> None:
    """A regular expression on the device's rounds (each verify row masked after the drafts before it) picks what
    plain decoding under it picks, and the text matches it."""
    import re

    from conftest import tiny_tokenizer

    from qspec.spec.accept import Sampler
    from qspec.spec.grammar import GrammarCompiler, GrammarSpec

    tok, regex = tiny_tokenizer(), "[a-z]{3,12}( [0-9]{1,3}){2}"
    compiler = GrammarCompiler(tok, setup.gpu.cfg.vocab_size)

    def run(draft: int) -> list[int]:
        sampler = Sampler(grammar=compiler.compile(GrammarSpec("regex", regex)))
        return engine(setup.gpu, draft=draft, capacity=256, kv_type=setup.kv).generate(
            setup.prompt, 40, sampler=sampler, stop_ids=set(tok.stop_ids)).tokens

    want, got = run(0), run(n)
    assert re.fullmatch(regex, tok.decode(want, skip_special=True)) and want[-1] in tok.stop_ids
    if setup.tie:
        assert first_diff(got, want) is None or first_diff(got, want) >= 8, (got, want)
    else:
        assert got == want


@pytest.mark.cuda
def test_graphs_dropped_at_the_limit_change_no_output(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for 3 graphs, a graph unused for 2 graphed steps dropped for a new one (Runner._room_for_a_graph): MTP3's
    shapes (draft chains, verify, extend, over KV buckets) take turns in the graphs and eagerly, and the tokens are
    still plain decoding's (up to a near tie in bf16)."""
    import qspec.runner as runner_module

    monkeypatch.setattr(runner_module, "GRAPH_STALE_STEPS", 2)
    e = engine(setup.gpu, draft=3, capacity=256, kv_type=setup.kv)
    e.runner.max_graphs = 3
    g = e.generate(setup.prompt, 48)
    ok, why = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
    assert ok, why
    assert e.runner.graph_stats.evicted > 0 and e.runner.graph_stats.replays > 0


@pytest.mark.cuda
@pytest.mark.parametrize(("draft", "mode", "seqs"), [(0, "on", True), (5, "on", True), (3, "auto", True),
                                                    (3, "on", False)])
def test_batched_requests_through_graphs(setup: Setup, draft: int, mode: str, seqs: bool) -> None:
    """Three requests decoded together (qspec/batch.py) through the batch's CUDA graphs, plainly or in speculative
    rounds (the draft chains, verify steps and extends of three slots through their graphs; 18 verify rows, run as
    two steps of at most GRAPH_MAX_ROWS), or at the depth the measured rates choose (auto: each depth is measured at
    each batch size first, so rounds of every depth and plain steps that write the draft heads' cells all run), with
    every attention layer's writes, block choice and attention in launches for all sequences (seqs, the default) or
    in each sequence's own (--no-attention-seqs): each gets its plain decoding alone, up to a near tie (bf16; the
    batch's products have more rows)."""
    from qspec.batch import Batcher

    prompts = [setup.prompt, IDS[25:40].tolist(), IDS[40:60].tolist()]
    refs = [setup.plain] + [engine(setup.gpu, draft=0, capacity=256, kv_type=setup.kv, record_logits=True)
                            .generate(p, 48) for p in prompts[1:]]
    b = Batcher(engine(setup.gpu, draft=draft, capacity=256, kv_type=setup.kv, attention_seqs=seqs), 3, draft=mode)
    try:
        gens = b.generate_all(prompts, 48)
    finally:
        b.close()
    for g, ref in zip(gens, refs, strict=True):
        ok, why = same_or_tie(g.tokens, ref, 0, setup.tie)
        assert ok, why
    assert b.steps.rows > b.steps.steps and b.runners[0].graph_stats.replays > 0
    if mode == "auto":
        assert {d for _, d in b.steps.seconds} == set(range(draft + 1))


@pytest.mark.cuda
def test_batched_rounds_equal_the_engines_through_graphs(setup: Setup) -> None:
    """Speculative rounds of three requests in a batch, acceptance forced round by round (every count 0..5, so every
    rollback; 18 verify rows, two steps), through the slots' graphs (the first slot's draft graphs share a memory
    pool with the batch's verify step): each request's tokens are those the engine's rounds give it alone under the
    same hook (f32: the batch's larger products may only move a near tie, which f32 random logits do not have)."""
    import threading

    from qspec.batch import Batcher
    from qspec.spec.logprobs import Logprobs

    if setup.tie:
        pytest.skip("bf16: a draft's near tie may differ between the batch and a sequence alone")
    hook = {"accept_hook": lambda r, n: (r + 1) % (n + 1)}
    prompts = [setup.prompt, IDS[25:40].tolist(), IDS[40:60].tolist()]
    refs = [engine(setup.gpu, draft=5, capacity=256, kv_type=setup.kv, **hook).generate(p, 40) for p in prompts]
    b = Batcher(engine(setup.gpu, draft=5, capacity=256, kv_type=setup.kv, **hook), 3, draft="on")
    def together() -> list[Generation]:  # log-probabilities: no request decodes alone with the engine (Batcher)
        out: dict[int, Generation] = {}
        threads = [threading.Thread(target=lambda i=i: out.update({i: b.generate(prompts[i], 40,
                                                                                  logprobs=Logprobs(1))}))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[i] for i in range(3)]
    try:
        gens = [together() for _ in range(2)][-1]  # the second: through the graphs captured by the first
    finally:
        b.close()
    assert [g.tokens for g in gens] == [r.tokens for r in refs]
    assert [g.spec.accepted for g in gens] == [r.spec.accepted for r in refs]
    assert b.runners[0].graph_stats.replays > 0


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 3])
def test_a_prompt_is_scored_as_it_prefills(setup: Setup, n: int) -> None:
    """Prompt log-probabilities over several prefill steps: each prompt token's from the row before it (against one
    step over the whole prompt), the output that of a request without them; max_tokens 0 scores the prompt alone."""
    from qspec.runner import Runner
    from qspec.spec.logprobs import Logprobs

    opts = dict(draft=n, capacity=256, kv_type=setup.kv, prefill_chunk=8)
    want = engine(setup.gpu, **opts).generate(setup.prompt, 24).tokens
    eng = engine(setup.gpu, **opts)
    logits, _ = Runner(setup.gpu, eng.opts.cache_options()).step(torch.tensor(setup.prompt))
    ref = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(setup.prompt[1:], device="cuda")[:, None])
    for max_tokens in (24, 0):
        lp = Logprobs(2)
        g = eng.generate(setup.prompt, max_tokens, prompt_logprobs=lp)
        assert g.tokens == want[:max_tokens] and [e.token for e in lp.entries] == setup.prompt
        assert lp.entries[0].logprob is None
        torch.testing.assert_close(torch.tensor([e.logprob for e in lp.entries[1:]]), ref[:, 0].cpu(),
                                   atol=2 * setup.tol, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 3])
def test_a_next_turn_reuses_the_caches(setup: Setup, n: int) -> None:
    """Through CUDA graphs: a request that goes on from the last one's prompt and output prefills only its new tokens,
    the same prompt again goes back to the checkpoint at its end, and one displaced by another conversation comes back
    from host memory; each decodes as a fresh engine given the whole prompt does (its drafts' logits too)."""
    opts = dict(capacity=256, kv_type=setup.kv, record_logits=True)
    eng = engine(setup.gpu, draft=n, **opts)
    first = eng.generate(setup.prompt, 20).tokens
    nxt = setup.prompt + first + IDS[30:36].tolist()
    ref = engine(setup.gpu, draft=n, **opts).generate(nxt, 24)
    for want in (len(setup.prompt) + len(first) - 1, len(nxt)):
        g = eng.generate(nxt, 24)
        ok, why = same_rows(g, ref, n, setup)
        assert g.cached_tokens == want and ok, f"cached {g.cached_tokens} (want {want}); {why}"
    # another conversation displaces this one to host memory; its next turn loads it back
    eng.generate(IDS[40:60].tolist(), 8)
    again = nxt + g.tokens + IDS[36:40].tolist()
    g = eng.generate(again, 16)
    ok, why = same_rows(g, engine(setup.gpu, draft=n, **opts).generate(again, 16), n, setup)
    assert g.cached_tokens == len(nxt) + len(ref.tokens) - 1 and ok, f"cached {g.cached_tokens}; {why}"


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 1, 5])
def test_device_chained_greedy_equals_plain(setup: Setup, n: int) -> None:
    """No hooks: drafts chained on the device, one read-back per round; a stop token ends plain decoding with a queued
    step discarded."""
    g = setup.run(n)
    ok_g, why_g = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
    stop = setup.plain.tokens[20]
    s = Engine(setup.gpu, EngineOptions(draft=n, capacity=256, kv_type=setup.kv)).generate(setup.prompt, 48,
                                                                                          stop_ids={stop})
    want = setup.plain.tokens[:setup.plain.tokens.index(stop) + 1]
    ok_s, why_s = (True, "as plain") if s.tokens == want else same_or_tie(s.tokens, setup.plain, 0, setup.tie)
    assert ok_g and ok_s, f"accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why_g}; with a stop token {why_s}"


@pytest.mark.cuda
def test_draft_chain_before_the_readback(setup: Setup) -> None:
    """The next round's draft chain queued before the read-back (its first position on the device): with replayed
    acceptance (every length occurs) the tokens and rounds of the chain queued after the read; greedy, plain's."""
    replay = dict(accept_hook=lambda r, n: (3 * r + 1) % (n + 1))
    after = setup.run(5, draft_before_readback=False, **replay)
    early = setup.run(5, draft_before_readback=True, **replay)
    assert early.tokens == after.tokens and early.rounds_log == after.rounds_log
    ok, why = same_or_tie(setup.run(5, draft_before_readback=True).tokens, setup.plain, 0, setup.tie)
    assert ok, why


@pytest.mark.cuda
def test_pdl_equals_launches_without_it(setup: Setup) -> None:
    """Programmatic dependent launch (the default) runs the same kernels, each waiting on the GPU for the one before
    it: the logits of launches without it bit for bit (a missing wait would race), and greedy MTP5 plain's tokens."""
    nopdl = setup.run(0, record_logits=True, pdl=False)
    assert nopdl.tokens == setup.plain.tokens and len(nopdl.logits) == len(setup.plain.logits)
    assert all(torch.equal(a, b) for a, b in zip(nopdl.logits, setup.plain.logits, strict=True))
    ok, why = same_or_tie(setup.run(5, pdl=False).tokens, setup.plain, 0, setup.tie)
    assert ok, why


@pytest.mark.cuda
def test_draft_vocabulary(setup: Setup) -> None:
    """A draft vocabulary (every third id): the Q4 head's rows alone through the 4-bit kernel, logits spread to -inf
    elsewhere inside the graphs. Greedy MTP5 gives plain's tokens; every draft row is -inf off the set."""
    ids = range(0, setup.gpu.cfg.vocab_size, 3)
    off = torch.ones(setup.gpu.cfg.vocab_size, dtype=torch.bool)
    off[list(ids)] = False
    g = setup.run(5, draft_head="q4", draft_vocab=ids, record_logits=True)
    ok, why = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
    assert ok, why
    assert g.draft_logits and all(bool(torch.isneginf(d[:, off]).all()) for d in g.draft_logits)


@pytest.mark.cuda
def test_grouped_mm_prefill_equals_the_loop(setup: Setup) -> None:
    """Prefill's routed experts as grouped GEMMs (the default on sm_90/sm_100; bf16 only, so the f32 model keeps its
    loop) against the loop over the experts; greedy MTP5 through the loop too."""
    g = setup.run(0, record_logits=True, grouped_mm=False)
    ok, why, rel = plain_against(setup.plain, g, setup.tie)
    assert ok and rel < setup.tol, why
    ok_s, why_s = same_or_tie(setup.run(5, grouped_mm=False).tokens, g, 0, setup.tie)
    assert ok_s, why_s


@pytest.mark.cuda
def test_verify_mixers_on_the_kernels(setup: Setup) -> None:
    """The mixers of verify and extend steps on the Triton kernels (mixer_step_rows 6, the default) against compiled
    mixers above one row: greedy MTP5 with oracle drafts gives plain's tokens with either, and the first round's
    verify logits (the same inputs) agree."""
    got = {rows: setup.run(5, mixer_step_rows=rows, record_logits=True,
                           draft_hook=oracle(setup.plain.tokens, random.Random(5))) for rows in (6, 1)}
    for g in got.values():
        ok, why = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
        assert ok, why
    assert rel_diff(got[6].logits[0], got[1].logits[0]) < setup.tol


@pytest.mark.cuda
def test_fused_attention_equals_the_dequantized_read(setup: Setup) -> None:
    """Masked attention in one Triton pass over a q8_0 cache (the default on CUDA) against the dequantized read; then
    greedy speculation against plain decoding on it."""
    q8 = dict(kv_type="q8_0", record_logits=True)
    dflt, fa = setup.run(0, fused_attention=False, **q8), setup.run(0, fused_attention=True, **q8)
    ok, why, rel = plain_against(fa, dflt, setup.tie)
    assert ok and rel < setup.tol, why
    for n in (1, 5):
        ok, why = same_or_tie(setup.run(n, fused_attention=True, **q8).tokens, fa, 0, setup.tie)
        assert ok, f"N={n}: {why}"


@pytest.mark.cuda
def test_kv_write_and_gdn_conv_kernels_equal_the_compiled_paths(setup: Setup) -> None:
    """The q8_0 KV write in one launch and GDN's step conv, silu and q/k norms in one launch (both defaults) against
    the compiled paths they replace."""
    q8 = dict(kv_type="q8_0", record_logits=True, fused_attention=False)
    ok, why, rel = plain_against(setup.run(0, **q8), setup.run(0, kv_write_kernel=False, **q8), setup.tie)
    assert ok and rel < setup.tol, f"KV write: {why}"
    ok, why, rel = plain_against(setup.plain, setup.run(0, record_logits=True, gdn_conv_kernel=False), setup.tie)
    assert ok and rel < setup.tol, f"GDN conv: {why}"


@pytest.mark.cuda
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "row-exact"])
def test_greedy_speculation_equals_plain(setup: Setup, exact: bool) -> None:
    """Oracle drafts cut at random points (every acceptance length); row-exact: a verify row is computed as a decode
    row is, so bf16 must be exact too."""
    ref = setup.plain if not exact else setup.run(0, exact=True, record_logits=True)
    for n in range(1, 9) if not exact else (1, 3, 5):
        g = setup.run(n, exact=exact, draft_hook=oracle(ref.tokens, random.Random(n)))
        ok, why = same_or_tie(g.tokens, ref, 0, 0.0 if exact else setup.tie)
        assert ok, f"N={n}: accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why}"


@pytest.mark.cuda
def test_auto_depth_equals_plain(setup: Setup) -> None:
    """`--draft auto` through CUDA graphs: a scripted sequence of depths 0..5 (plain stretches included), drafts chained
    on the device and oracle drafts; the tokens are plain decoding's (bf16: up to a near tie)."""
    from test_depth import Scripted

    for hook in (None, oracle(setup.plain.tokens, random.Random(2))):
        eng = engine(setup.gpu, draft=5, draft_auto=True, capacity=256, kv_type=setup.kv, draft_hook=hook)
        eng.depth = Scripted(5, 3)
        g = eng.generate(setup.prompt, 48)
        ok, why = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
        depths = sorted({r["depth"] for r in g.rounds_log})
        assert ok and len(depths) > 2, f"drafts {'oracle' if hook else 'device'}: {why}; depths {depths}"


@pytest.mark.cuda
def test_few_rows_products_everywhere(setup: Setup) -> None:
    """The few-rows tensor-core products run in steps only for flash-next's shapes; here every verify product that
    fits takes them (16-bit only), and greedy speculation must still reproduce plain decoding."""
    from qspec.kernels import gemv

    if setup.gpu.dtype != torch.bfloat16:
        pytest.skip("the few-rows kernels take 16-bit products only")
    with gemv.few_rows_everywhere():
        for n in (3, 5):
            g = setup.run(n, draft_hook=oracle(setup.plain.tokens, random.Random(n)))
            ok, why = same_or_tie(g.tokens, setup.plain, 0, setup.tie)
            assert ok, f"N={n}: {why}"


@pytest.mark.cuda
def test_seed_optimizations_give_the_baseline_tokens() -> None:
    gpu = build("cuda", torch.float32)
    prompt = IDS[:40].tolist()
    base = None
    for p, inc, pad, fused in itertools.product([False, True], repeat=4):
        rng = random.Random(5)
        g = engine(gpu, draft=4, capacity=256, preserve_pooled=p, incremental_pooled=inc,
                   pad_target=8 if pad else None, fused_snapshots=fused,
                   accept_hook=lambda r, n, rng=rng: rng.randint(0, n)).generate(prompt, 40)
        base = base or g.tokens
        assert g.tokens == base, (p, inc, pad, fused)


@pytest.mark.cuda
def test_device_sampling_follows_its_distributions() -> None:
    """The draw and speculative sampling's acceptance on CUDA (device generators seeded from the request's CPU
    generator)."""
    from qspec.spec.accept import Sampler, speculative_accept_on_device

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], device="cuda")
    s = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    draws = s.sample_probs(p.expand(200000, 5))
    ok, why = within(torch.bincount(draws, minlength=5).cpu(), p)
    assert ok and draws.device == p.device, why
    pt = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25] * 4], device="cuda")
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.3, 0.3, 0.2, 0.2]], device="cuda")
    first = torch.zeros(4)
    for _ in range(4000):
        d = torch.cat([s.sample_probs(q[0:1]), s.sample_probs(q[1:2])])
        k, nxt = speculative_accept_on_device(d, q, pt, s)
        first[int(nxt) if int(k) == 0 else int(d[0])] += 1
    ok, why = within(first, pt[0])
    assert ok, why


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 3, 5])
def test_sampled_decoding_is_repeatable(n: int) -> None:
    """Sampled plain and speculative decoding run through the graphs, the same tokens for a seed."""
    from qspec.spec.accept import Sampler

    gpu = build("cuda", torch.float32)

    def run(seed: int) -> Generation:
        sampler = Sampler(temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(seed))
        return Engine(gpu, EngineOptions(draft=n, capacity=256, kv_type="q8_0")).generate(IDS[:40].tolist(), 48,
                                                                                        sampler=sampler)
    a, b, c = run(1), run(1), run(2)
    assert a.tokens == b.tokens and len(a.tokens) == 48 and a.tokens != c.tokens and a.graphs["replays"] > 0
