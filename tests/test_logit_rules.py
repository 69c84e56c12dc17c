"""The request's logit rules (qspec/spec/logit_rules.py: logit_bias, presence, frequency and repetition penalties):
every path that picks a token from the target's rows applies them, a verify row counting the drafts before it as
generated, so greedy speculation still equals plain decoding token for token; and the sampler's top-k and min-p."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_spec import CAP, oracle_hook

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.spec.accept import Sampler
from qspec.spec.logit_rules import LogitRules

RULES = dict(presence_penalty=0.7, frequency_penalty=1.3, logit_bias={5: 4.0, 9: -100.0})
REPEAT = dict(repetition_penalty=3.0, logit_bias={9: -100.0})  # the prompt's tokens too


def reference(model: Model, prompt: list[int], n: int, rules: dict) -> list[int]:
    """Greedy decoding one token at a time, the rules written out: logit + bias, divided (positive) or multiplied by
    the repetition penalty for a token of the prompt or the output, - presence * [generated] - frequency * count."""
    run = Runner(model, CacheOptions(capacity=CAP))
    counts = torch.zeros(model.cfg.vocab_size)
    bias = torch.zeros(model.cfg.vocab_size)
    rep = rules.get("repetition_penalty", 1.0)
    for t, b in rules.get("logit_bias", {}).items():
        bias[t] = b
    out: list[int] = []
    rows = prompt
    with torch.inference_mode():
        while len(out) < n:
            logits, _ = run.step(torch.tensor(rows))
            run.keep(len(rows), rollback=False)
            x = logits[-1].float() + bias
            for t in set(prompt) | set(out):
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            x = x - rules.get("presence_penalty", 0.0) * (counts > 0).float() \
                - rules.get("frequency_penalty", 0.0) * counts
            out.append(int(x.argmax()))
            counts[out[-1]] += 1
            rows = out[-1:]
    return out


@pytest.mark.parametrize("draft, hook, rules", [(0, False, RULES), (3, False, RULES), (2, True, RULES),
                                               (5, True, RULES), (0, False, REPEAT), (4, True, REPEAT)])
def test_greedy_decoding_follows_the_rules(tiny_model: Model, draft: int, hook: bool, rules: dict) -> None:
    """Plain decoding, rounds on the device (the head's own drafts) and on the host (oracle drafts: every acceptance
    length) emit what the written-out rules pick; the rules change the output."""
    rng = random.Random(draft)
    prompt = [rng.randrange(511) for _ in range(21)]
    want = reference(tiny_model, prompt, 40, rules)
    assert want != reference(tiny_model, prompt, 40, {}) and 9 not in want
    hooks = EngineHooks(draft_hook=oracle_hook(want, rng, 512)) if hook else EngineHooks()
    eng = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True), hooks)
    g = eng.generate(prompt, 40, sampler=Sampler(rules=LogitRules(**rules)))
    assert g.tokens == want
    if hook:
        assert 0 < g.spec.accepted < g.spec.drafted
    assert eng.generate(prompt, 40).tokens == reference(tiny_model, prompt, 40, {})  # the rules were the request's


def test_a_strong_bias_decides_sampled_tokens(tiny_model: Model) -> None:
    sampler = Sampler(temperature=1.0, rules=LogitRules(logit_bias={17: 100.0}),
                      generator=torch.Generator().manual_seed(1))
    g = Engine(tiny_model, EngineOptions(draft=3, capacity=CAP)).generate(list(range(3, 12)), 12, sampler=sampler)
    assert g.tokens == [17] * 12


@pytest.mark.parametrize("kw, words", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=math.nan), "frequency_penalty must be in [-2, 2]"),
    (dict(logit_bias={3: 101.0}), "logit_bias of token 3 must be in [-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "token ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
])
def test_bad_rules_are_named(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        LogitRules(**kw)


def test_a_bias_outside_the_vocabulary_is_refused_before_any_work(tiny_model: Model) -> None:
    eng = Engine(tiny_model, EngineOptions(draft=2, capacity=CAP))
    with pytest.raises(ValueError, match="token id 512, outside the vocabulary of 512"):
        eng.generate([1, 2, 3], 4, sampler=Sampler(rules=LogitRules(logit_bias={512: 1.0})))
    assert eng.held == [] and eng.runner.n_tokens == 0


def test_top_k_and_min_p_keep_the_likeliest() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    p = Sampler(temperature=1.0, top_k=2).probs(logits)
    torch.testing.assert_close(p[0], torch.tensor([4 / 7, 3 / 7, 0, 0, 0]))
    assert (p[1] == 0.2).all()  # ties with the k-th all stay
    p = Sampler(temperature=1.0, min_p=0.5).probs(logits)
    torch.testing.assert_close(p[0], torch.tensor([4 / 7, 3 / 7, 0, 0, 0]))
    p = Sampler(temperature=1.0, top_k=3, top_p=0.6, min_p=0.1).probs(logits[:1])
    torch.testing.assert_close(p[0], torch.tensor([4 / 7, 3 / 7, 0, 0, 0]))
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        Sampler(top_k=-1)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        Sampler(min_p=math.nan)
    for bad in (math.nan, math.inf, -0.5):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            Sampler(temperature=bad)
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            Sampler(temperature=1.0, top_p=bad)


def test_top_k_1_samples_the_greedy_tokens(tiny_model: Model) -> None:
    prompt = list(range(4, 19))
    greedy = Engine(tiny_model, EngineOptions(draft=3, capacity=CAP, exact=True)).generate(prompt, 16).tokens
    sampler = Sampler(temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(2))
    assert Engine(tiny_model, EngineOptions(draft=3, capacity=CAP, exact=True)).generate(
        prompt, 16, sampler=sampler).tokens == greedy


@pytest.mark.parametrize("draft, hook", [(0, False), (3, False), (3, True)])
def test_min_tokens_holds_the_stop_ids_back(tiny_model: Model, draft: int, hook: bool) -> None:
    """A stop id that every row would pick (a bias) cannot be picked before min_tokens: in plain decoding, in the
    device's rounds and in the host's (each verify row counting the drafts before it)."""
    prompt = list(range(30, 47))
    rules = LogitRules(logit_bias={7: 100.0}, min_tokens=5, stop_ids=frozenset({7}))
    want = reference(tiny_model, prompt, 5, {"logit_bias": {7: -math.inf}})  # 5 tokens, then the stop
    rng = random.Random(1)
    hooks = EngineHooks(draft_hook=oracle_hook(want + [7], rng, 512)) if hook else EngineHooks()
    eng = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True), hooks)
    g = eng.generate(prompt, 12, sampler=Sampler(rules=rules), stop_ids={7})
    assert g.tokens == want + [7]
    with pytest.raises(ValueError, match="min_tokens must be an integer >= 0"):
        LogitRules(min_tokens=-1)
