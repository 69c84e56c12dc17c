"""Structured output: a request's tokens held to a JSON schema, a regular expression, a Lark (or GBNF) grammar or a
list of choices, by llguidance (the token-level grammar matcher vLLM and llama.cpp also use).

A `GrammarCompiler` (one per tokenizer: building its token table takes about a second at the Qwen vocabulary) turns a
`GrammarSpec` into a `Grammar`, one request's matcher. The matcher lives on the host and follows the emitted tokens
(`consume`). Before a token is picked, `constrain` masks the target's rows to the tokens the grammar allows there. In
a verify step, row i follows drafts[:i]: its mask is the one after those drafts, so each row sees what plain decoding
would see at that position, and greedy speculation equals plain decoding under a grammar. A draft the grammar
refuses ends the round's acceptance (the target's row cannot pick it), so the rows after it are never used; they get
that draft's row's mask. Drafts themselves are not constrained: the draft chain stays on the device, and a refused
draft costs only its round's later rows.

A reply that thinks first (Qwen3's `<think>...</think>`) can keep its grammar for the answer: `AfterThinking` lets
the think block through and starts the grammar after it (the server does so under --reasoning-parser). It also holds
a think block to a budget (`ThinkingBudget`): past that many tokens of thinking, only the tokens that close the block
are allowed, so a reply that would think on until max_tokens gives an answer (vLLM's thinking_token_budget,
llama.cpp's --reasoning-budget).

Costs (BENCHMARKS.md §7): a mask is host time, a fraction of a millisecond a row. On the GPU the round's drafts reach
the host while its verify step runs (Engine._round_on_device), so the masks overlap the step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from qspec.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json", "regex", "lark", "choice")
# JSON as json.dumps writes it: with free whitespace, a weak model can fill its tokens with blanks
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be compiled (its message says where), or a token that the grammar refuses."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. kind "json": `value` is a JSON schema (a dict; {} takes any JSON value,
    {"type": "object"} any object); "regex": a regular expression (Rust's syntax, matched whole); "lark": a Lark
    grammar (llguidance's dialect) or one in llama.cpp's GBNF; "choice": a list of strings, exactly one of which is the
    output."""
    kind: str
    value: Any

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(GRAMMAR_KINDS)})")
        want = {"json": dict, "regex": str, "lark": str, "choice": list}[self.kind]
        if not isinstance(self.value, want):
            raise GrammarError(f"a {self.kind} grammar must be a {want.__name__}, got {type(self.value).__name__}")
        if self.kind == "choice" and (not self.value or not all(isinstance(c, str) and c for c in self.value)):
            raise GrammarError("choices must be a non-empty list of non-empty strings")

    def text(self) -> str:
        """The grammar in llguidance's terms (checked only when compiled)."""
        if self.kind == "json":
            try:
                return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "lark":
            try:  # llama.cpp's GBNF (`root ::= ...`) converted
                return LLMatcher.grammar_from_lark(any_to_lark(self.value))
            except GbnfToLarkError as e:
                raise GrammarError(f"invalid GBNF grammar: {e}") from None
            except Exception as e:  # noqa: BLE001 - the converter raises a bare Exception for a missing root rule
                raise GrammarError(f"invalid grammar: {e} (a Lark grammar starts from a `start:` rule, GBNF from "
                                   "`root ::=`)") from None
        # each choice a Lark string literal (JSON's escapes are Lark's)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))


class _TokenTable:
    """The tokenizer as llguidance's TokenizerWrapper reads it: every id's bytes (b"" past the tokenizer's ids, up
    to the model's vocabulary), the end tokens, the control tokens, and an encoder."""

    def __init__(self, tok: Tokenizer, vocab_size: int, ends: list[int]) -> None:
        self._tok = tok
        self.eos_token_id, self.bos_token_id = ends[0], None
        self.tokens = [tok.id_to_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(min(vocab_size, tok.vocab_size)) if tok.is_control(i)]

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text)


class GrammarCompiler:
    """Grammars for one tokenizer and model vocabulary. The end tokens (the tokenizer's stop ids) are what the grammar
    allows once its text is complete: a request held to a grammar must stop on one of them."""

    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        self.ends = sorted(tok.stop_ids)
        if not self.ends:
            raise GrammarError("the tokenizer has no stop token, which a grammar needs to end the output")
        self.vocab_size = vocab_size
        self._ll = LLTokenizer(TokenizerWrapper(_TokenTable(tok, vocab_size, self.ends)), n_vocab=vocab_size,
                               eos_token=self.ends)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """A request's matcher, at the start of its output (GrammarError naming what is wrong with the grammar)."""
        return Grammar(self._ll, check_grammar(spec, self._ll), self.vocab_size, self.ends)


def check_grammar(spec: GrammarSpec, ll: LLTokenizer | None = None) -> str:
    """The spec's llguidance grammar, or GrammarError naming what is wrong with it (without a tokenizer: what can be
    checked before the model loads)."""
    text = spec.text()
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text, ll)
    if is_error:
        raise GrammarError(f"invalid {spec.kind} grammar: {_one_line(messages[0])}")
    return text


class Grammar:
    """One request's matcher: `consume` the emitted tokens, `constrain` the target's rows."""

    unconstrained = False  # (AfterThinking's answer without a grammar is)

    def __init__(self, ll: LLTokenizer, text: str, vocab_size: int, ends: list[int]) -> None:
        self._ll, self._text, self.vocab_size, self.ends = ll, text, vocab_size, ends
        self._m = LLMatcher(ll, text, log_level=0)
        self._words = allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32, one bit a token

    def reset(self) -> None:
        """Back to the start of the output (a generate() call starts there), out of any error state (a matcher never
        leaves one: it is made again)."""
        if self._m.is_error():
            self._m = LLMatcher(self._ll, self._text, log_level=0)
        else:
            self._m.reset()

    def consume(self, token: int) -> None:
        """An emitted token (GrammarError when the grammar refuses it: a token picked without its mask)."""
        if not self._m.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self._m.get_error() or 'refused'}")

    def masks(self, drafts: list[int], rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32 bit masks: row i allows what may follow the emitted tokens and drafts[:i]. Rows
        after the first draft the grammar refuses, or the first end token, repeat that draft's row (they are never
        used: the target's row refuses the draft, or the output ends on it)."""
        out = torch.empty(rows, self._words.shape[1], dtype=torch.int32)
        # up to the first end token: the output ends there, and llguidance's rollback does not count an end token
        drafts = drafts[:rows - 1]
        drafts = drafts[:next((i for i, t in enumerate(drafts) if t in self.ends), len(drafts))]
        valid = self._m.validate_tokens(drafts) if drafts else 0
        for i in range(rows):
            if i <= valid:
                if i:
                    self._m.consume_token(drafts[i - 1])
                fill_next_token_bitmask(self._m, self._words)
                if self._m.is_error():
                    raise GrammarError(f"the grammar failed: {self._m.get_error()}")
            out[i] = self._words[0]
        self._m.rollback(valid)
        return out

    def constrain(self, logits: torch.Tensor, drafts: list[int] | None = None) -> torch.Tensor:
        """The target's rows [R, V] with every token the grammar refuses at -inf (a new tensor)."""
        return masked(logits, self.masks(drafts or [], logits.shape[0]))


class FreeText:
    """No grammar: every token allowed, anywhere (the answer after a think block held only to a budget)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ends: list[int] = []  # no grammar of its own ends the output

    def reset(self) -> None:
        pass

    def consume(self, token: int) -> None:
        pass

    def masks(self, drafts: list[int], rows: int) -> torch.Tensor:
        return torch.full((rows, _words(self.vocab_size)), -1, dtype=torch.int32)  # every bit set


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens of thinking in a reply, then `closing` forced, one token a step: ids that end with
    `</think>` (the tag alone, or after a message telling the model to answer now: llama.cpp's
    --reasoning-budget-message). A block that closes earlier by itself is not touched."""
    tokens: int
    closing: tuple[int, ...]

    def __post_init__(self) -> None:
        if type(self.tokens) is not int or self.tokens < 0:
            raise ValueError(f"a thinking budget must be an integer >= 0, got {self.tokens!r}")
        if not self.closing:
            raise ValueError("a thinking budget needs the tokens that close the think block")


class AfterThinking:
    """A grammar that holds only the answer of a reply that may think first (`<think>...</think>`, Qwen3's reasoning):
    free while the reply thinks, the inner grammar from the token after `</think>` on (vLLM applies structured output
    after the reasoning parser's end the same way). With a `budget`, the think block's tokens past budget.tokens are
    its closing tokens, forced. It is what `Grammar` is to the engine (reset, consume, masks, constrain, ends).

    States: "start" (the reply may open a think block: `<think>` or what the grammar allows), "thinking" (every token,
    until `</think>`; `thought` counts them), "answer" (the inner grammar). The start state comes from the prompt
    (think_state_of)."""

    def __init__(self, inner: Grammar | FreeText, open_id: int, close_id: int, prompt: list[int],
                 turn_id: int | None = None, budget: ThinkingBudget | None = None) -> None:
        if budget is not None and (budget.closing[-1] != close_id or close_id in budget.closing[:-1]
                                   or open_id in budget.closing):
            raise ValueError(f"a thinking budget's closing tokens {list(budget.closing)} must end with </think> "
                             f"({close_id}) and hold no other think tag")
        self.inner, self.open_id, self.close_id, self.budget = inner, open_id, close_id, budget
        self.vocab_size, self.ends = inner.vocab_size, inner.ends
        self.first = think_state_of(prompt, open_id, close_id, turn_id)
        self.state, self.thought = self.first, 0

    def reset(self) -> None:
        self.inner.reset()
        self.state, self.thought = self.first, 0

    @property
    def unconstrained(self) -> bool:
        """Whether nothing is masked from here on: the answer, with no grammar (the engine then decodes as without)."""
        return self.state == "answer" and isinstance(self.inner, FreeText)

    def consume(self, token: int) -> None:
        if self.state == "answer":
            self.inner.consume(token)
        elif self.state == "thinking":
            forced = self._forced(self.thought)
            if forced is not None and token != forced:
                raise GrammarError(f"token {token} past the thinking budget (only {forced} may follow there)")
            self.state, self.thought = ("answer", self.thought) if token == self.close_id else ("thinking",
                                                                                                self.thought + 1)
        elif token == self.open_id:
            self.state, self.thought = "thinking", 0
        else:
            self.state = "answer"
            self.inner.consume(token)

    def masks(self, drafts: list[int], rows: int) -> torch.Tensor:
        """As Grammar.masks: row i allows what may follow the emitted tokens and drafts[:i]."""
        if self.state == "thinking":
            return self._thinking_masks(self.thought, drafts, rows)
        if self.state == "answer":
            return self.inner.masks(drafts, rows)
        if drafts[:rows - 1] and drafts[0] == self.open_id:  # row 0 of "start", then a think block
            return torch.cat([self._with_open(self.inner.masks([], 1)), self._thinking_masks(0, drafts[1:], rows - 1)])
        out = self.inner.masks(drafts, rows)
        out[0] = self._with_open(out[:1])[0]
        return out

    def _thinking_masks(self, thought: int, drafts: list[int], rows: int) -> torch.Tensor:
        """Rows from inside the think block, `thought` tokens into it: each row by its count (every token, or past the
        budget its forced closing token) up to the row after a draft `</think>`, the inner grammar's rows from there
        (drafts past one the mask refuses are never used: their rows follow them as if allowed)."""
        out = torch.full((rows, _words(self.vocab_size)), -1, dtype=torch.int32)
        for i in range(rows):
            forced = self._forced(thought + i)
            if forced is not None:
                out[i] = 0
                out[i, forced // 32] = _bit(forced % 32)
            if i < rows - 1 and i < len(drafts) and drafts[i] == self.close_id:
                out[i + 1:] = self.inner.masks(drafts[i + 1:], rows - i - 1)
                break
        return out

    def _forced(self, thought: int) -> int | None:
        """The one token allowed `thought` tokens into the think block: past the budget its closing tokens in turn,
        else None (any)."""
        b = self.budget
        if b is None or thought < b.tokens:
            return None
        return b.closing[min(thought - b.tokens, len(b.closing) - 1)]

    def _with_open(self, words: torch.Tensor) -> torch.Tensor:
        """A mask row [1, W] that allows `<think>` as well."""
        words = words.clone()
        words[0, self.open_id // 32] |= _bit(self.open_id % 32)
        return words

    def constrain(self, logits: torch.Tensor, drafts: list[int] | None = None) -> torch.Tensor:
        return masked(logits, self.masks(drafts or [], logits.shape[0]))


def thinking_budget(tok: Tokenizer, tokens: int, message: str | None = None) -> ThinkingBudget:
    """`tokens` of thinking, then `message` (if any) and `</think>` forced; ValueError where the tokenizer has no
    think tags."""
    tags = tok.think_tags()
    if tags is None:
        raise ValueError("a thinking budget needs <think> and </think> tokens, which this model's tokenizer lacks")
    return ThinkingBudget(tokens, (*tok.encode(message or ""), tags[1]))


def with_thinking(grammar: Grammar | None, tok: Tokenizer, prompt: list[int], vocab_size: int,
                  budget: ThinkingBudget | None) -> Grammar | AfterThinking | None:
    """A reply's rules for the prompt `prompt`: `grammar` (or none) for its answer after a think block, the block held
    to `budget` (AfterThinking); `grammar` as it is where the tokenizer has no think tags."""
    tags = tok.think_tags()
    if tags is None:
        return grammar
    inner = grammar if grammar is not None else FreeText(vocab_size)
    return AfterThinking(inner, tags[0], tags[1], prompt, tags[2], budget)


def think_state_of(prompt: list[int], open_id: int, close_id: int, turn_id: int | None = None) -> str:
    """How a reply to `prompt` starts, by the prompt's last think tag in the reply's own turn (after the last
    `turn_id`, the chat template's `<|im_start|>`): "thinking" where the template opened the block (Qwen3.5's do
    by default, qspec's with enable_thinking), "answer" where it closed an empty one (thinking off), else "start"
    (the reply may open one). A history's reasoning, in earlier turns, says nothing of this one."""
    for t in reversed(prompt):
        if t == open_id:
            return "thinking"
        if t == close_id:
            return "answer"
        if t == turn_id:
            break
    return "start"


def _words(vocab_size: int) -> int:
    """int32 words of a vocabulary's bit mask."""
    return (vocab_size + 31) // 32


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _one_line(message: str) -> str:
    """llguidance's multi-line report in one line: its text lines, without the source echo and the carets."""
    lines = (ln.strip() for ln in message.splitlines())
    return " ".join(ln for ln in lines if ln and not set(ln) <= {"^", " "} and not re.match(r"\d+ \|", ln))


def masked(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is clear in its row of `words` [R, W] (on the host) at -inf."""
    words = words.to(logits.device, non_blocking=True)
    return logits.masked_fill(~allowed_tokens(words, logits.shape[1]), float("-inf"))


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bit masks [R, W] int32 -> [R, V] bool: token t is bit t % 32 of word t // 32."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab_size].bool()
