"""Prefix reuse (EngineOptions.prefix_cache): a prompt that goes on from the last request's prompt and output prefills
only its new tokens, and decodes as a fresh engine given the whole prompt does."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec import CAP, oracle_hook, plain

from qspec.engine import Engine, EngineHooks, EngineOptions, Generation
from qspec.model.model import Model

# The caches of a reused prefix were filled by decode and verify steps, a fresh engine's by one prefill: the same
# values up to the rounding of those paths (f32 on the CPU; prefill chunks alone differ by ~4e-7).
ATOL = 1e-4


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(511) for _ in range(n)]


def engine(model: Model, draft: int, hooks: EngineHooks | None = None, **kw: object) -> Engine:
    return Engine(model, EngineOptions(draft=draft, capacity=CAP, exact=True, **kw),
                  hooks or EngineHooks(record_logits=True))


def assert_same_decoding(got: Generation, want: Generation) -> None:
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    # the draft head's cache: a missing or stale row of the reused prefix changes the drafts' logits
    for a, b in zip(got.draft_logits, want.draft_logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def accept_all(_round: int, depth: int) -> int:
    """Every draft accepted: each round commits depth + 1 tokens, so a request can end at a draft."""
    return depth


def own_drafts(_n_out: int, drafts: list[int]) -> list[int]:
    """A draft hook that keeps the drafts: the rounds then run on the host (Engine._round_on_host)."""
    return drafts


@pytest.mark.parametrize("draft, max_tokens, replay, host", [
    (0, 9, False, False), (3, 9, False, False), (3, 10, True, False), (2, 1, False, False), (1, 7, True, False),
    (3, 9, False, True), (2, 10, True, True)])
def test_a_next_turn_prefills_only_its_new_tokens(tiny_model: Model, draft: int, max_tokens: int, replay: bool,
                                                  host: bool) -> None:
    """Requests that end after a plain step, in a round (after its next token, at an accepted draft; on the device
    and on the host) and at the prefill's token; the second request's logits and first drafts equal a fresh
    engine's."""
    hooks = lambda: EngineHooks(record_logits=True, accept_hook=accept_all if replay else None,  # noqa: E731
                                draft_hook=own_drafts if host else None)
    eng = engine(tiny_model, draft, hooks())
    first = prompt_of(21, draft)
    g1 = eng.generate(first, max_tokens)
    assert g1.cached_tokens == 0
    nxt = first + g1.tokens + prompt_of(6, 100 + draft)
    g2 = eng.generate(nxt, 12)
    assert g2.cached_tokens == len(first) + len(g1.tokens) - 1
    assert_same_decoding(g2, engine(tiny_model, draft, hooks()).generate(nxt, 12))
    # and again from the second request's end: the prompt may add only the last emitted token
    nxt3 = nxt + g2.tokens
    g3 = eng.generate(nxt3, 5)
    assert g3.cached_tokens == len(nxt3) - 1
    assert_same_decoding(g3, engine(tiny_model, draft, hooks()).generate(nxt3, 5))


@pytest.mark.parametrize("draft", [0, 2])
def test_a_prompt_goes_on_from_the_sequence_or_its_checkpoint(tiny_model: Model, draft: int) -> None:
    """The live sequence when the prompt goes on from the last request's prompt and output; else the furthest
    checkpoint (each prompt's end) within the prompt's common beginning with the sequence (no saved sequences here:
    those are test_displaced_sequences_are_loaded_back)."""
    eng = engine(tiny_model, draft, prefix_offloaded=0)
    first = prompt_of(17, 7)
    out = eng.generate(first, 6).tokens
    other = (out[-1] + 1) % 511
    P = len(first)
    cases = [(first + out + [5], P + 5),  # the live sequence
             (first, P),  # the same prompt again: nothing to prefill
             (first + out[:-1] + [other, 5], P),  # a turn whose earlier reply tokenized otherwise
             (first + [other], P),  # the head's row at the checkpoint, for another token than the first generated
             (first[:-1] + [other] + out + [5], 0), (first[:9], 0)]
    for prompt, want in cases:
        g = eng.generate(prompt, 4)
        assert g.cached_tokens == want, prompt
        assert_same_decoding(g, engine(tiny_model, draft).generate(prompt, 4))
        eng.generate(first, 6)  # the caches hold first + out again
    only_live = dict(prefix_checkpoints=0, prefix_offloaded=0)
    for opts, want in ((only_live, (P + 5, 0)), (dict(prefix_cache=False), (0, 0))):
        off = engine(tiny_model, draft, **opts)
        out = off.generate(first, 6).tokens
        assert off.generate(first + out + [5], 4).cached_tokens == want[0]
        assert off.generate(first, 4).cached_tokens == want[1]


def test_checkpoints_of_several_turns(tiny_model: Model) -> None:
    """A checkpoint per turn, the oldest dropped beyond prefix_checkpoints; going back to one drops those past it."""
    eng = engine(tiny_model, 2, prefix_checkpoints=2, prefix_offloaded=0)
    turns = [prompt_of(15, 20)]
    for i in range(3):  # three turns, each going on from the last
        out = eng.generate(turns[-1], 5).tokens
        turns.append(turns[-1] + out + prompt_of(4, 21 + i))
    P = [len(t) for t in turns[:3]]
    assert [c.pos for c in eng.prefix.checkpoints] == [P[1], P[2]]
    # a prompt that parts from the sequence inside turn 2's output: back to turn 2's prompt end
    back = turns[2][:P[2] + 2] + [7, 8]
    g = eng.generate(back, 4)
    assert g.cached_tokens == P[2] and [c.pos for c in eng.prefix.checkpoints] == [P[1], P[2], len(back)][-2:]
    assert_same_decoding(g, engine(tiny_model, 2).generate(back, 4))
    # turn 1 again: its checkpoint was dropped (two kept), so from the start; then again, from its end
    for want in (0, P[1]):
        g = eng.generate(turns[1], 4)
        assert g.cached_tokens == want and [c.pos for c in eng.prefix.checkpoints] == [P[1]]
        assert_same_decoding(g, engine(tiny_model, 2).generate(turns[1], 4))


def test_a_request_stopped_midway_leaves_nothing_to_reuse(tiny_model: Model) -> None:
    """A callback that raises ends a request mid-round: its caches describe no sequence the next prompt can go on
    from, so that one goes back to a checkpoint."""
    eng = engine(tiny_model, 3)
    first = prompt_of(19, 3)
    last = eng.generate(first, 20).tokens[-1]  # a request that completed, then one that does not
    seen: list[int] = []

    def leave(tok: int) -> None:
        seen.append(tok)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate(first, 20, on_token=leave)
    # the tokens the caches ran, then the last token of the request that completed: not the live sequence, but the
    # checkpoint at the prompt's end, whatever step was under way when the request stopped
    prompt = eng.runner.history + [last, 4]
    g = eng.generate(prompt, 8)
    assert g.cached_tokens == len(first)
    assert_same_decoding(g, engine(tiny_model, 3).generate(prompt, 8))


def test_speculation_on_a_reused_prefix_equals_plain_decoding(tiny_model: Model) -> None:
    """Greedy speculation (every acceptance length, through oracle drafts) still equals plain decoding when both
    engines reuse the first request's caches."""
    first = prompt_of(23, 11)
    ref1 = plain(tiny_model, first, 14)
    nxt = first + ref1 + prompt_of(5, 12)
    pe = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP, exact=True))
    assert pe.generate(first, 14).tokens == ref1
    ref2 = pe.generate(nxt, 30).tokens
    rng = random.Random(5)
    refs = iter([ref1, ref2])
    cur = [next(refs)]
    eng = Engine(tiny_model, EngineOptions(draft=4, capacity=CAP, exact=True),
                 EngineHooks(draft_hook=lambda n, d: oracle_hook(cur[0], rng, 512)(n, d)))
    assert eng.generate(first, 14).tokens == ref1
    cur[0] = next(refs)
    g = eng.generate(nxt, 30)
    assert g.cached_tokens == len(first) + len(ref1) - 1
    assert g.tokens == ref2
    assert 0 < g.spec.accepted < g.spec.drafted


def test_a_plain_stretch_at_the_end_keeps_the_draft_heads_rows(tiny_model: Model) -> None:
    """With the automatic depth, a request that ends inside a plain stretch (depth 0) writes the head's rows of the
    stretch's last tokens, which the next request's drafts read."""
    def auto() -> Engine:
        e = Engine(tiny_model, EngineOptions(draft=2, draft_auto=True, capacity=CAP, exact=True),
                   EngineHooks(record_logits=True))
        e.depth.calibrated = True  # no warm-up generations: the depths are forced below
        return e

    eng = auto()
    first = prompt_of(20, 13)
    eng.depth.force = 0
    out = eng.generate(first, 11).tokens
    nxt = first + out + prompt_of(4, 14)
    eng.depth.force = 2
    g = eng.generate(nxt, 9)
    assert g.cached_tokens == len(first) + len(out) - 1 and g.draft_logits
    fresh = auto()
    fresh.depth.force = 2
    assert_same_decoding(g, fresh.generate(nxt, 9))


@pytest.mark.parametrize("draft", [0, 3])
def test_displaced_sequences_are_loaded_back(tiny_model: Model, draft: int) -> None:
    """Users taking turns: each conversation's next turn goes on from its own last request, which another user's
    request displaced to host memory; the oldest beyond prefix_offloaded is dropped."""
    eng = engine(tiny_model, draft, prefix_offloaded=2)
    convs = {name: prompt_of(13 + i, 40 + i) for i, name in enumerate("abc")}
    for name in "abc":  # a first turn each: every one displaces the one before
        convs[name] += eng.generate(convs[name], 5).tokens
    assert [len(x.tokens) for x in eng.prefix.sessions] == [len(convs["a"]) - 1, len(convs["b"]) - 1]
    for name, want in (("b", True), ("a", True), ("c", True), ("b", True)):
        prompt = convs[name] + prompt_of(3, 50)
        g = eng.generate(prompt, 6)
        assert g.cached_tokens == (len(convs[name]) - 1 if want else 0), name
        assert_same_decoding(g, engine(tiny_model, draft).generate(prompt, 6))
        convs[name] = prompt + g.tokens
    # the live sequence is b's; a's and c's were displaced last (b's, displaced before them, was loaded back)
    assert [x.tokens[:5] for x in eng.prefix.sessions] == [convs["a"][:5], convs["c"][:5]]
    g = eng.generate(convs["a"] + [7], 3)
    assert g.cached_tokens == len(convs["a"]) - 1
    off = engine(tiny_model, draft, prefix_offloaded=0)
    first = off.generate(convs["a"][:13], 5).tokens
    off.generate(convs["b"][:14], 5)
    assert off.generate(convs["a"][:13] + first + [7], 3).cached_tokens == 0
