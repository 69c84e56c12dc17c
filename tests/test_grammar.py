"""Structured output (qspec/spec/grammar.py): the masks a verify step's rows get, and every path that picks a token
(plain decoding, rounds on the device, rounds on the host with oracle drafts) emitting only what the grammar allows,
greedy speculation equal to plain decoding under a grammar token for token."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from conftest import tiny_tokenizer
from llguidance import LLMatcher
from test_spec import CAP, oracle_hook

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model.model import Model
from qspec.spec.accept import Sampler
from qspec.spec.grammar import (
    AfterThinking,
    FreeText,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    ThinkingBudget,
    allowed_tokens,
    check_grammar,
    think_state_of,
)
from qspec.spec.logit_rules import LogitRules
from qspec.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
GBNF = 'root ::= item (", " item){3}\nitem ::= "on" | "off" | [0-9]'  # llama.cpp's grammar format
GRAMMARS = {"json": GrammarSpec("json", SCHEMA), "regex": GrammarSpec("regex", REGEX),
            "choice": GrammarSpec("choice", ["alpha", "beta gamma", "del\"ta"]), "gbnf": GrammarSpec("lark", GBNF)}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, 512)


def follows(compiler: GrammarCompiler, spec: GrammarSpec, tokens: list[int]) -> bool:
    """Whether a fresh matcher takes every token (the end token included)."""
    m = LLMatcher(compiler._ll, check_grammar(spec), log_level=0)
    return m.validate_tokens(tokens) == len(tokens)


def test_a_rows_mask_follows_the_drafts_before_it(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    """Row i's mask is what a matcher that consumed drafts[:i] allows; after a refused draft the rows repeat its row;
    the matcher is left where it was."""
    g = compiler.compile(GRAMMARS["regex"])
    good = tok.encode("ab-12")
    masks = g.masks(good, len(good) + 1)
    for i in range(len(good) + 1):
        one = compiler.compile(GRAMMARS["regex"])
        for t in good[:i]:
            one.consume(t)
        assert torch.equal(masks[i], one.masks([], 1)[0]), i
    bad = good[:2] + tok.encode("!") + good[3:]
    refused = g.masks(bad, len(bad) + 1)
    assert torch.equal(refused[:3], masks[:3]) and all(torch.equal(r, refused[2]) for r in refused[3:])
    assert torch.equal(g.masks([], 1)[0], masks[0])  # nothing consumed


def test_bit_masks_expand_to_tokens() -> None:
    words = torch.tensor([[5, -(1 << 31)]], dtype=torch.int32)  # bits 0 and 2; bit 31 of the second word
    assert allowed_tokens(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert allowed_tokens(words, 40).shape == (1, 40)


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
@pytest.mark.parametrize("draft, hook", [(3, False), (2, True), (5, True)])
def test_greedy_speculation_equals_plain_decoding_under_a_grammar(tiny_model: Model, tok: Tokenizer,
                                                                  compiler: GrammarCompiler, kind: str, draft: int,
                                                                  hook: bool) -> None:
    """Plain decoding under the grammar emits only what it allows and differs from unconstrained decoding; rounds
    on the device (the head's own drafts) and on the host (oracle drafts, some refused by the grammar: every
    acceptance length) emit the same tokens."""
    spec, stops = GRAMMARS[kind], set(tok.stop_ids)
    prompt = tok.encode("Answer: ")
    plain = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP, exact=True))
    want = plain.generate(prompt, 40, sampler=Sampler(grammar=compiler.compile(spec)), stop_ids=stops).tokens
    assert follows(compiler, spec, want) and want != plain.generate(prompt, 40, stop_ids=stops).tokens
    rng = random.Random(draft)
    hooks = EngineHooks(draft_hook=oracle_hook(want, rng, 512)) if hook else EngineHooks()
    eng = Engine(tiny_model, EngineOptions(draft=draft, capacity=CAP, exact=True), hooks)
    g = eng.generate(prompt, 40, sampler=Sampler(grammar=compiler.compile(spec)), stop_ids=stops)
    assert g.tokens == want
    if hook:
        assert 0 < g.spec.accepted < g.spec.drafted


def test_the_automatic_depth_under_a_grammar(tiny_model: Model, tok: Tokenizer, compiler: GrammarCompiler) -> None:
    """--draft auto (plain stretches and rounds, its calibration before the request) emits plain decoding's tokens."""
    spec, stops, prompt = GRAMMARS["json"], set(tok.stop_ids), tok.encode("Answer: ")
    plain = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP, exact=True))
    want = plain.generate(prompt, 40, sampler=Sampler(grammar=compiler.compile(spec)), stop_ids=stops).tokens
    auto = Engine(tiny_model, EngineOptions(draft=3, draft_auto=True, capacity=CAP, exact=True))
    assert auto.generate(prompt, 40, sampler=Sampler(grammar=compiler.compile(spec)), stop_ids=stops).tokens == want


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_a_finished_output_matches_its_grammar(tiny_model: Model, tok: Tokenizer, compiler: GrammarCompiler,
                                               kind: str) -> None:
    """Sampled with speculation, to its end: the text parses (JSON against the schema), matches the regular
    expression whole, or is one of the choices; it ends on a stop token."""
    eng = Engine(tiny_model, EngineOptions(draft=3, capacity=CAP))
    for seed in range(3):
        sampler = Sampler(temperature=1.0, top_k=8, grammar=compiler.compile(GRAMMARS[kind]),
                          generator=torch.Generator().manual_seed(seed))
        g = eng.generate(tok.encode("Q"), 100, sampler=sampler, stop_ids=set(tok.stop_ids))
        if g.stop_reason != "stop token":
            continue  # a long (valid) prefix: the greedy test checks those
        text = tok.decode(g.tokens, skip_special=True)
        if kind == "json":
            doc = json.loads(text)
            assert set(doc) == {"ok", "n", "tag"} and isinstance(doc["ok"], bool) and doc["tag"] in ("red", "green")
        elif kind == "regex":
            assert re.fullmatch(REGEX, text)
        elif kind == "gbnf":
            assert re.fullmatch(r"(on|off|[0-9])(, (on|off|[0-9])){3}", text)
        else:
            assert text in GRAMMARS["choice"].value
        return
    pytest.fail("no sampled output finished in 100 tokens")


@pytest.mark.parametrize("spec, words", [
    (("regex", "a(b"), "invalid regex grammar"),
    (("lark", "start: x"), "invalid lark grammar"),
    (("lark", "root ::= (x"), "invalid GBNF grammar"),
    (("lark", ""), "invalid grammar: No 'root' rule found (a Lark grammar starts from a `start:` rule"),
    (("lark", 'value ::= "a"'), "invalid grammar: No 'root' rule found"),
    (("json", {"type": 7}), "invalid json grammar"),
    (("yaml", "a: 1"), "unknown grammar kind 'yaml'"),
    (("json", "{}"), "a json grammar must be a dict, got str"),
    (("choice", []), "choices must be a non-empty list"),
    (("choice", ["a", 3]), "choices must be a non-empty list of non-empty strings"),
])
def test_a_bad_grammar_is_named(compiler: GrammarCompiler, spec: tuple, words: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(words)):
        compiler.compile(GrammarSpec(*spec))


def test_min_tokens_and_a_grammar_are_refused_together(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match="min_tokens cannot be used with a grammar"):
        Sampler(grammar=compiler.compile(GRAMMARS["choice"]), rules=LogitRules(min_tokens=3, stop_ids=frozenset({5})))


def test_a_grammar_needs_its_end_tokens_as_stop_ids(tiny_model: Model, tok: Tokenizer,
                                                    compiler: GrammarCompiler) -> None:
    eng = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP))
    sampler = Sampler(grammar=compiler.compile(GRAMMARS["choice"]))
    with pytest.raises(ValueError, match=r"ends on token ids \[509, 511\]: they must be stop ids"):
        eng.generate(tok.encode("Q"), 8, sampler=sampler, stop_ids={511})


def test_after_thinking_masks_follow_the_think_block(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    """Free rows while the reply thinks, the grammar's rows (from its start) after `</think>`; `<think>` allowed
    beside the grammar at the start; the prompt's last tag decides where a reply starts."""
    spec, OPEN, CLOSE = GRAMMARS["regex"], 7, 8  # two ids standing for the tags
    word = tok.encode("ab-12")

    def fresh(after: list[int], rows: int) -> torch.Tensor:
        g = compiler.compile(spec)
        return g.masks(after, rows)
    every = torch.full((1, 16), -1, dtype=torch.int32)
    g = AfterThinking(compiler.compile(spec), OPEN, CLOSE, [1, 2, OPEN])
    assert g.state == "thinking"
    m = g.masks([5, CLOSE] + word, 2 + len(word) + 1)
    assert torch.equal(m[:2], every.expand(2, -1)) and torch.equal(m[2:], fresh(word, len(word) + 1))
    for t in [5, 6, CLOSE, *word[:2]]:
        g.consume(t)
    assert g.state == "answer" and torch.equal(g.masks(word[2:], 2), fresh(word, 4)[2:])
    assert AfterThinking(compiler.compile(spec), OPEN, CLOSE, [OPEN, 3, CLOSE, 4]).state == "answer"
    start = AfterThinking(compiler.compile(spec), OPEN, CLOSE, [1, 2])
    assert start.state == "start"
    want = allowed_tokens(fresh([], 1), 512)[0]
    want[OPEN] = True
    assert torch.equal(allowed_tokens(start.masks([], 1), 512)[0], want)
    m = start.masks([OPEN, 5, CLOSE] + word[:1], 5)
    assert torch.equal(m[1:3], every.expand(2, -1)) and torch.equal(m[3:], fresh(word[:1], 2))
    start.consume(word[0])  # no think block: the grammar from the first token
    assert start.state == "answer"
    start.reset()
    assert start.state == "start"


def test_a_thinking_budget_forces_the_block_closed(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    """Past the budget's tokens of thinking, each row allows only the next closing token (a message, then
    `</think>`), counted across the drafts; the answer after it is free (FreeText) or the grammar's; a block that
    closes earlier is not touched; a token against the budget is an error."""
    OPEN, CLOSE, MSG = 7, 8, (20, 21)
    every = torch.full((16,), -1, dtype=torch.int32)

    def only(t: int) -> torch.Tensor:
        return allowed_tokens(torch.full((1, 16), 0, dtype=torch.int32), 512)[0].index_fill(0, torch.tensor(t), True)
    budget = ThinkingBudget(3, (*MSG, CLOSE))
    g = AfterThinking(FreeText(512), OPEN, CLOSE, [1, OPEN], budget=budget)
    assert g.ends == [] and g.state == "thinking"
    m = g.masks([5, 6, 7, *MSG, CLOSE, 9], 8)
    assert all(torch.equal(m[i], every) for i in (0, 1, 2, 6, 7))
    for i, t in ((3, 20), (4, 21), (5, CLOSE)):
        assert torch.equal(allowed_tokens(m[i:i + 1], 512)[0], only(t)), i
    g.consume(5)
    m2 = g.masks([6, CLOSE, 4, 4], 5)  # closed within the budget: free rows, then the answer's
    assert all(torch.equal(r, every) for r in m2)
    for t in (6, 7):
        g.consume(t)
    assert torch.equal(allowed_tokens(g.masks([], 1), 512)[0], only(20))
    with pytest.raises(GrammarError, match="past the thinking budget"):
        g.consume(9)
    assert Sampler(grammar=g).constrained
    for t in (*MSG, CLOSE, 9):
        g.consume(t)
    assert g.state == "answer" and not Sampler(grammar=g).constrained  # the engine decodes as without a grammar
    g.reset()
    assert g.state == "thinking" and g.thought == 0
    # from the start, with a grammar after the block and a budget of 1: `<think>` or the grammar, one token of
    # thinking, the tag alone, the grammar's rows from its start
    spec, word = GRAMMARS["regex"], tok.encode("ab-12")
    start = AfterThinking(compiler.compile(spec), OPEN, CLOSE, [1, 2], budget=ThinkingBudget(1, (CLOSE,)))
    m = start.masks([OPEN, 5, CLOSE, *word[:1]], 5)
    assert torch.equal(m[1], every) and torch.equal(allowed_tokens(m[2:3], 512)[0], only(CLOSE))
    assert torch.equal(m[3:], compiler.compile(spec).masks(word[:1], 2))
    for t in (OPEN, 5, CLOSE):
        start.consume(t)
    assert start.state == "answer" and Sampler(grammar=start).constrained  # the grammar's answer
    zero = AfterThinking(FreeText(512), OPEN, CLOSE, [OPEN], budget=ThinkingBudget(0, (CLOSE,)))
    assert torch.equal(allowed_tokens(zero.masks([], 1), 512)[0], only(CLOSE))
    with pytest.raises(ValueError, match="must end with </think>"):
        AfterThinking(FreeText(512), OPEN, CLOSE, [OPEN], budget=ThinkingBudget(2, (CLOSE, 20)))
    with pytest.raises(ValueError, match="integer >= 0"):
        ThinkingBudget(-1, (CLOSE,))


def test_a_replys_think_state_comes_from_its_own_turn() -> None:
    """think_state_of: the last think tag after the last turn start decides; a history's tags in earlier turns do
    not (a tool loop's earlier reasoning, closed, before a turn that opens a new block or none)."""
    open_, close, turn = 7, 8, 9
    assert think_state_of([1, turn, 2, open_], open_, close, turn) == "thinking"
    assert think_state_of([1, turn, 2, open_, 3, close, 4], open_, close, turn) == "answer"
    assert think_state_of([turn, open_, 3, close, 4, turn, 5], open_, close, turn) == "start"
    assert think_state_of([turn, open_, 3, close, 4, turn, 5], open_, close) == "answer"  # no turns: the last tag
    assert think_state_of([turn, open_, close, turn, 2, open_, 1], open_, close, turn) == "thinking"
    assert think_state_of([], open_, close, turn) == "start"


def test_a_grammar_after_thinking_through_the_engine(tiny_model: Model, tok: Tokenizer,
                                                     compiler: GrammarCompiler) -> None:
    """The think block is decoded freely (as without a grammar) up to `</think>`, the answer after it under the
    grammar; greedy speculation, with oracle drafts across the block's end, emits the same tokens."""
    spec, stops, prompt = GRAMMARS["regex"], set(tok.stop_ids), tok.encode("Think: ")
    plain = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP, exact=True))
    free = plain.generate(prompt + [7], 12, stop_ids=stops).tokens  # 7 stands for <think>
    close = free[3]  # the reply's fourth token stands for </think>
    assert close not in free[:3]

    def grammar() -> AfterThinking:
        return AfterThinking(compiler.compile(spec), 7, close, prompt + [7])
    want = plain.generate(prompt + [7], 40, sampler=Sampler(grammar=grammar()), stop_ids=stops).tokens
    assert want[:4] == free[:4] and follows(compiler, spec, want[4:])
    hooks = EngineHooks(draft_hook=oracle_hook(want, random.Random(1), 512))
    eng = Engine(tiny_model, EngineOptions(draft=3, capacity=CAP, exact=True), hooks)
    g = eng.generate(prompt + [7], 40, sampler=Sampler(grammar=grammar()), stop_ids=stops)
    assert g.tokens == want and g.spec.accepted > 0


def test_a_thinking_budget_through_the_engine(tiny_model: Model, tok: Tokenizer) -> None:
    """A think block decoded freely up to the budget, then its closing tokens, then the answer as without a budget;
    greedy speculation (oracle drafts that run past the budget, and the MTP head's own drafts) emits the same
    tokens."""
    stops, prompt = set(tok.stop_ids), tok.encode("Think: ") + [7]  # 7 stands for <think>
    plain = Engine(tiny_model, EngineOptions(draft=0, capacity=CAP, exact=True))
    free = plain.generate(prompt, 30, stop_ids=stops).tokens
    close = next(t for t in range(20, 500) if t not in free and t != 7)  # stands for </think>
    closing = (*free[:2], close)  # a message the model would not write at that point: forced

    def budget() -> AfterThinking:
        return AfterThinking(FreeText(512), 7, close, prompt, budget=ThinkingBudget(4, closing))
    want = plain.generate(prompt, 30, sampler=Sampler(grammar=budget()), stop_ids=stops).tokens
    assert want[:4] == free[:4] and tuple(want[4:7]) == closing and want != free
    for hooks in (EngineHooks(draft_hook=oracle_hook(free, random.Random(2), 512)), None):
        eng = Engine(tiny_model, EngineOptions(draft=3, capacity=CAP, exact=True), hooks)
        g = eng.generate(prompt, 30, sampler=Sampler(grammar=budget()), stop_ids=stops)
        assert g.tokens == want
