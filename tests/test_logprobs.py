"""Log-probabilities of emitted tokens (qspec/spec/logprobs.py): each token's entry is the model's distribution at the
position that emitted it, on every path (prefill, plain decoding, plain stretches, rounds on the device and on the
host, greedy and sampled)."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec import CAP, oracle_hook, plain

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model.model import CacheOptions, Model
from qspec.runner import ContextError, Runner
from qspec.spec.accept import Sampler
from qspec.spec.logprobs import Logprobs

TOP = 5


def reference(model: Model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log-softmax rows [len(out), V]: row i is the distribution that emitted out[i] (one forward, teacher-forced)."""
    ids = prompt + out[:-1]
    logits, _ = Runner(model, CacheOptions(capacity=-(-len(ids) // 4) * 4)).step(torch.tensor(ids))
    return torch.log_softmax(logits[len(prompt) - 1:].float(), -1)


def check(model: Model, prompt: list[int], out: list[int], lp: Logprobs) -> None:
    want = reference(model, prompt, out)
    assert [e.token for e in lp.entries] == out and not lp._pending
    got = torch.tensor([e.logprob for e in lp.entries])
    torch.testing.assert_close(got, want[torch.arange(len(out)), torch.tensor(out)], atol=1e-4, rtol=0)
    for e, row in zip(lp.entries, want, strict=True):
        best = row.topk(TOP)
        assert [i for i, _ in e.top] == best.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), best.values, atol=1e-4, rtol=0)


def sampler(temperature: float) -> Sampler:
    return Sampler(temperature=temperature, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("draft, hook, temperature", [(0, None, 0.0), (0, None, 0.8), (3, None, 0.0),
                                                      (3, None, 0.8), (4, "oracle", 0.0), (2, "own", 0.8)])
def test_every_token_has_its_rows_log_probability(tiny_model: Model, draft: int, hook: str | None,
                                                   temperature: float) -> None:
    """Rounds on the device (no hook) and on the host (a draft hook: oracle drafts, so every acceptance length
    occurs, or the head's own), plain decoding; greedy and sampled."""
    rng = random.Random(draft)
    prompt = [rng.randrange(511) for _ in range(19)]
    hooks = EngineHooks()
    if hook == "oracle":
        hooks = EngineHooks(draft_hook=oracle_hook(plain(tiny_model, prompt, 30), rng, 512))
    elif hook == "own":
        hooks = EngineHooks(draft_hook=lambda _n, d: d)
    eng = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True), hooks)
    lp = Logprobs(TOP)
    g = eng.generate(prompt, 30, sampler=sampler(temperature), logprobs=lp)
    check(tiny_model, prompt, g.tokens, lp)
    if hook == "oracle":
        assert 0 < g.spec.accepted < g.spec.drafted


def test_plain_stretches_and_a_stop_token(tiny_model: Model) -> None:
    """The automatic depth's plain stretches (depth 0), and a request that a stop token ends mid-round."""
    eng = Engine(tiny_model, EngineOptions(draft=2, draft_auto=True, capacity=CAP, exact=True))
    eng.depth.calibrated, eng.depth.force = True, 0
    prompt = list(range(7, 30))
    lp = Logprobs(TOP)
    g = eng.generate(prompt, 20, logprobs=lp)
    check(tiny_model, prompt, g.tokens, lp)
    stop = g.tokens[9]
    eng.depth.force = 2
    lp = Logprobs(TOP)
    g = eng.generate(prompt, 20, stop_ids={stop}, logprobs=lp)
    assert g.tokens[-1] == stop and len(g.tokens) < 20
    check(tiny_model, prompt, g.tokens, lp)


def test_rows_are_taken_for_their_own_tokens() -> None:
    lp = Logprobs(2)
    lp.queue(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), torch.tensor([2, 1]), wait=True)
    lp.take(2)
    assert lp.entries[0].top[0][0] == 2 and lp.entries[0].logprob == pytest.approx(lp.entries[0].top[0][1])
    with pytest.raises(RuntimeError, match="token 1 taken for token 0"):
        lp.take(0)
    with pytest.raises(ValueError, match="0..20"):
        Logprobs(21)


def prompt_reference(model: Model, prompt: list[int]) -> torch.Tensor:
    """log-softmax rows [len(prompt) - 1, V]: row j is the distribution that predicts prompt[j + 1]."""
    logits, _ = Runner(model, CacheOptions(capacity=-(-len(prompt) // 4) * 4)).step(torch.tensor(prompt))
    return torch.log_softmax(logits[:-1].float(), -1)


def check_prompt(model: Model, prompt: list[int], lp: Logprobs) -> None:
    want = prompt_reference(model, prompt)
    assert [e.token for e in lp.entries] == prompt and not lp._pending
    assert lp.entries[0].logprob is None and lp.entries[0].top == ()
    got = torch.tensor([e.logprob for e in lp.entries[1:]])
    torch.testing.assert_close(got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)
    for e, row in zip(lp.entries[1:], want, strict=True):
        assert [i for i, _ in e.top] == row.topk(TOP).indices.tolist()


@pytest.mark.parametrize("draft", [0, 3])
def test_a_prompt_is_scored_whatever_the_caches_hold(tiny_model: Model, draft: int) -> None:
    """Every prompt token's entry from the row before it, over several prefill steps; the output is a plain
    request's. A prompt the caches already hold (live, or at a checkpoint) prefills again, so that every row is
    scored; max_tokens 0 scores the prompt alone and leaves a checkpoint the same prompt reuses."""
    rng = random.Random(5 + draft)
    prompt = [rng.randrange(511) for _ in range(37)]
    want = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True)).generate(prompt, 12).tokens
    eng = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True, prefill_chunk=8))
    for _ in range(2):  # the second time, the caches hold the prompt at a checkpoint
        lp = Logprobs(TOP)
        g = eng.generate(prompt, 12, prompt_logprobs=lp)
        assert g.tokens == want and g.cached_tokens == 0
        check_prompt(tiny_model, prompt, lp)
    lp = Logprobs(TOP)
    g = eng.generate(prompt + want, 0, prompt_logprobs=lp)  # the live sequence's tokens, prefilled again
    assert g.tokens == [] and g.cached_tokens == 0 and g.stop_reason == "max tokens"
    check_prompt(tiny_model, prompt + want, lp)
    g = eng.generate(prompt + want, 5)
    assert g.cached_tokens == len(prompt + want)  # the checkpoint of the scored prompt
    assert g.tokens == Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True)).generate(
        prompt + want, 5).tokens


def test_scoring_rules(tiny_model: Model) -> None:
    eng = Engine(tiny_model, EngineOptions(draft=2, capacity=32))
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        eng.generate([1, 2, 3], 0)
    eng.check_request(list(range(32)), 0, scoring=True)  # the prompt alone: one cell a token
    with pytest.raises(ContextError, match=r"prompt \(33 tokens\).*capacity 32"):
        eng.check_request(list(range(33)), 0, scoring=True)


def test_scoring_in_parts_equals_scoring_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
    tokens = [3, 1, 4, 1, 5, 9, 2]
    whole = Logprobs(3)
    whole.score(logits, tokens)
    monkeypatch.setattr("qspec.spec.logprobs.SCORE_ROWS", 3)
    parts = Logprobs(3)
    parts.score(logits, tokens)
    assert parts.entries == whole.entries and [e.token for e in parts.entries] == tokens
