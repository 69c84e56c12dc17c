"""What a request does with the engine, apart from HTTP: `CompletionServer` turns a validated request (requests.py)
into its prompt ids and max_tokens, its sampler (logit rules, grammar, thinking budget) and its choices decoded on the
engine or the batcher, each a `ChoiceRun` (its prompt, and its text, stop strings, reasoning and tool calls as its
tokens arrive); `BadRequest` is the error a route answers with (app.py turns it into OpenAI's error body).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qspec.batch import Batcher
from qspec.engine import Engine, Generation, cells_needed
from qspec.options import ServerOptions
from qspec.runner import ContextError
from qspec.server.bodies import ChatBodies, TextBodies, token_text
from qspec.server.call_formats import CallFormat, call_format, template_call_format
from qspec.server.metrics import ServerMetrics
from qspec.server.reasoning import ReasoningSplit
from qspec.server.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Sampling,
)
from qspec.server.tools import ToolCallSplit, calls_as_mappings
from qspec.spec.accept import Sampler
from qspec.spec.grammar import (
    AfterThinking,
    Grammar,
    GrammarCompiler,
    GrammarError,
    ThinkingBudget,
    think_state_of,
    thinking_budget,
    with_thinking,
)
from qspec.spec.logit_rules import LogitRules
from qspec.spec.logprobs import Logprobs, TokenLogprob
from qspec.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str = "invalid_value", kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


class _Stopped(Exception):
    """Raised from the token callback to end a generation at once (the client left)."""


class _StopIds(set[int]):
    """The tokenizer's stop ids, and every id once `ended` is set. The engine asks after each token it emits
    whether that token ends the request, so setting `ended` (a stop string was met) ends the generation cleanly
    at the end of the current speculative round, and the engine still returns its Generation (timings, drafted
    and accepted counts). Tokens emitted after that point are not shown or counted."""

    def __init__(self, ids: set[int], ended: threading.Event) -> None:
        super().__init__(ids)
        self.ended = ended

    def __contains__(self, t: object) -> bool:
        return self.ended.is_set() or super().__contains__(t)

    def __bool__(self) -> bool:
        return True


@dataclass
class ChoiceRun:
    """One choice: its prompt, and its text as the worker thread's token callback decodes it."""
    stops: list[str]
    ids: list[int] = field(default_factory=list)  # the prompt's tokens
    max_tokens: int = 0
    choice: int = 0  # among its prompt's choices (its sampling seed is the request's + this)
    text: str = ""
    sent: int = 0  # text[:sent] has been handed out
    n_tokens: int = 0
    finish: str = "length"
    cancelled: threading.Event = field(default_factory=threading.Event)  # the client left
    ended: threading.Event = field(default_factory=threading.Event)  # a stop string was met
    logprobs: list[TokenLogprob] | None = None  # the counted tokens' entries, when the request asks for them
    lp_sent: int = 0  # logprobs[:lp_sent] have been handed out
    lp_chars: int = 0  # characters of the handed-out entries' token texts (the completions' text_offset)
    echo: str = ""  # the prompt's text, which the choice's text starts with (`echo`)
    echoed: bool = False  # the echo has been handed out, with the prompt's entries
    mean_logprob: float = -math.inf  # over its tokens, when candidates are ranked (best_of)
    arrived: float | None = None  # the request's arrival (its first choice only: the time to the first token)
    split: ReasoningSplit | None = None  # a chat reply's reasoning apart from its content (--reasoning-parser)
    tools: ToolCallSplit | None = None  # a chat reply's tool calls apart from its content (the request's tools)
    stop_hit: str | None = None  # the stop string that ended the choice (vLLM's `stop_reason`)

    def whole_parts(self) -> tuple[str, str, list[dict]]:
        """The choice's (reasoning, text, tool calls): the reasoning is "" without a split, and the text starts with
        the echo."""
        reasoning, text = ("", self.echo + self.text) if self.split is None else self.split.whole(self.text)
        if self.tools is None:
            return reasoning, text, []
        return reasoning, *self.tools.whole(text)

    def piece_parts(self, piece: str | None) -> tuple[str, str, list[dict]]:
        """A streamed piece's (reasoning, text, tool call deltas, each with its call's index in the reply), or (piece
        None) what the splits held at the choice's end."""
        if self.split is None:
            reasoning, text = "", piece or ""
        else:
            reasoning, text = self.split.flush() if piece is None else self.split.push(piece)
        if self.tools is None:
            return reasoning, text, []
        text, calls = self.tools.push(text)
        if piece is None:
            rest, more = self.tools.flush()
            text, calls = text + rest, calls + more
        return reasoning, text, calls

    def ended_choice(self, choice: dict) -> dict:
        """A choice body that ends the choice, with vLLM's `stop_reason`: the stop string that ended it, or null."""
        return choice | {"stop_reason": self.stop_hit}

    def finish_reason(self) -> str:
        """How the choice ended: "tool_calls" when it stopped after calling a tool, else stop, length, ..."""
        return "tool_calls" if self.tools is not None and self.tools.calls and self.finish == "stop" else self.finish

    def new_logprobs(self) -> list[TokenLogprob] | None:
        """The entries not handed out yet (None when the request asks for none)."""
        if self.logprobs is None:
            return None
        out, self.lp_sent = self.logprobs[self.lp_sent:], len(self.logprobs)
        return out

    def add(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """Append decoded text -> (the text that may be shown now, whether a stop string ended the request).

        While stop strings are set, the last (longest stop - 1) characters are held back: they may be the start
        of a stop string that the next tokens complete, and streamed text cannot be taken back."""
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, len(self.text) - longest + 1)
        self.text += piece
        hits = sorted((i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0)
        if hits:
            self.text, self.stop_hit = self.text[:hits[0][0]], hits[0][1]
        hold = 0 if final or hits else max(0, longest - 1)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, bool(hits)


class CompletionServer:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, opts: ServerOptions,
                 batcher: Batcher | None = None) -> None:
        self.engine, self.tok, self.model_name, self.max_waiting = engine, tokenizer, model_name, opts.max_waiting
        self.reasoning_parser = opts.reasoning_parser
        self.reasoning_budget, self.reasoning_budget_message = opts.reasoning_budget, opts.reasoning_budget_message
        if opts.reasoning_budget is not None:  # ValueError where the tokenizer has no think tags
            thinking_budget(tokenizer, opts.reasoning_budget, opts.reasoning_budget_message)
        # how replies write tool calls: as the chat template asks, unless told
        self.tool_call_parser = opts.tool_call_parser or template_call_format(tokenizer.chat_template)
        # one request at a time on the engine (speculative rounds), or up to the batcher's slots decoded together
        self.batcher = batcher
        self.lock = asyncio.Semaphore(1 if batcher is None else batcher.slots)
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name)
        self._grammars: GrammarCompiler | None = None  # built at the first structured request (~1 s)
        self._grammars_lock = threading.Lock()
        # what the warm-up is doing while the server already listens (its part, "a batch of 3"); None: serving
        self.warming: str | None = None

    def grammar(self, req: Sampling) -> Grammar | None:
        """Blocking: the request's grammar at the start of its output, or None; a 400 naming the field when it does
        not compile."""
        try:
            spec = req.grammar_spec(self.call_format(req))  # a forced call's tools may not fit their format
            if spec is None:
                return None
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tok, self.engine.model.cfg.vocab_size)
            return self._grammars.compile(spec)
        except GrammarError as e:
            raise BadRequest(str(e), param=req.grammar_fields()[0]) from None

    def answer_grammar(self, req: Sampling, ids: list[int]) -> Grammar | AfterThinking | None:
        """Blocking: the grammar for a choice of the request whose prompt is `ids`: under --reasoning-parser, or with a
        thinking budget, the request's grammar holds only the reply's answer, after the think block, and the budget
        the block (AfterThinking, where the tokenizer has the tags); else the request's grammar (or None)."""
        g, budget = self.grammar(req), self.thinking_budget(req)
        if budget is None and (g is None or not self._splits_reasoning(req)):
            return g
        return with_thinking(g, self.tok, ids, self.engine.model.cfg.vocab_size, budget)

    def thinking_budget(self, req: Sampling) -> ThinkingBudget | None:
        """The request's thinking_token_budget, else --reasoning-budget for a chat request (None: no limit); a 400
        when the tokenizer has no think tags to close a block with."""
        tokens = req.thinking_token_budget
        if tokens is None and isinstance(req, ChatRequest):
            tokens = self.reasoning_budget
        if tokens is None:
            return None
        try:
            return thinking_budget(self.tok, tokens, self.reasoning_budget_message)
        except ValueError as e:
            raise BadRequest(str(e), param="thinking_token_budget") from None

    def call_format(self, req: Sampling) -> CallFormat:
        """How the request's reply writes its tool calls (qspec/server/call_formats.py)."""
        return call_format(self.tool_call_parser, getattr(req, "tools", None))

    def admit(self) -> None:
        """A 503 when the engine is busy and `max_waiting` requests already wait for it (the client may retry)."""
        if self.metrics.running and self.metrics.waiting >= self.max_waiting:
            self.metrics.queue(rejected=1)
            raise BadRequest(f"the server is overloaded: {self.metrics.waiting} requests are waiting (at most "
                             f"{self.max_waiting}); retry later", 503, None, "server_overloaded", "server_error")

    def _splits_reasoning(self, req: Sampling) -> bool:
        return self.reasoning_parser is not None and isinstance(req, ChatRequest)

    def reasoning_split(self, req: Sampling, ids: list[int]) -> ReasoningSplit | None:
        """A chat reply's think block apart from its answer, under --reasoning-parser (None: completions, or none);
        the reply starts inside the block where its prompt (`ids`) opened it: a template that thinks by default, or
        enable_thinking (the request's word where the tokenizer has no think tokens)."""
        if not self._splits_reasoning(req):
            return None
        tags = self.tok.think_tags()
        if tags is None:
            return ReasoningSplit(opened=req.enable_thinking() is True)
        return ReasoningSplit(opened=think_state_of(ids, *tags) == "thinking")

    def check_model(self, model: str | None) -> None:
        """A 404 for a request naming another model."""
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here (this server has {self.model_name!r})", 404,
                             "model", "model_not_found")

    def chat_text(self, messages: list[ChatMessage], enable_thinking: bool | None = None,
                  tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                  continue_final: bool = False) -> str:
        """A conversation through the chat template, offering `tools`, with a request's own template `variables`
        (a 400 naming `messages` when the template refuses it, `chat_template_kwargs` when it takes no variables).
        `continue_final`: the last message is the reply's start, after the assistant's turn opens, as the model
        would have written it."""
        try:
            self.tok.check_template_variables(variables)
        except ValueError as e:
            raise BadRequest(str(e), param="chat_template_kwargs") from None
        turns = [m.model_dump() for m in (messages[:-1] if continue_final else messages)]
        if self.tok.chat_template != QWEN_CHAT_TEMPLATE:  # qspec's own format writes a call's text as it came
            turns = [calls_as_mappings(m) for m in turns]
        try:
            text = self.tok.apply_chat_template(turns,
                                                enable_thinking=enable_thinking, tools=tools, variables=variables)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), param="messages") from None
        return text + (messages[-1].content or "") if continue_final else text

    def request_text(self, req: ChatRequest) -> str:
        """A chat request's conversation through the chat template, as its fields ask."""
        return self.chat_text(req.messages, req.enable_thinking(), req.prompt_tools(), req.template_variables(),
                              req.continue_final_message)

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], int]:
        """Blocking: a chat request's (prompt ids, max_tokens), its grammar compiled (a 400 when it does not)."""
        out = self.prompt_ids(req, self.request_text(req))
        self.grammar(req)
        return out

    def prompt_ids(self, req: Sampling, prompt: str | list[int]) -> tuple[list[int], int]:
        """Blocking (a worker thread: a long prompt tokenizes for seconds) -> (prompt ids, max_tokens)."""
        self.check_model(req.model)
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, and a long prompt
        # tokenizes for seconds that the event loop needs
        ids = prompt if isinstance(prompt, list) else self.tok.encode_batch([prompt], add_special=True)[0]
        suffix = getattr(req, "suffix", None)
        if suffix:
            try:
                ids = self.tok.fill_in_middle(ids, self.tok.encode_batch([suffix])[0])
            except ValueError as e:
                raise BadRequest(str(e), param="suffix") from None
        try:
            LogitRules(**req.logit_rules()).check_vocab(self.engine.model.cfg.vocab_size)
        except ValueError as e:
            raise BadRequest(str(e), param="logit_bias") from None
        max_tokens = req.max_tokens
        if max_tokens == 0 and not req.echoes():
            raise BadRequest("max_tokens must be >= 1 (0 only with echo: the prompt alone, scored)", param="max_tokens")
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
        if max_tokens is None:
            o = self.engine.opts
            rest = o.capacity - cells_needed(len(ids), 0, o.draft)
            max_tokens = COMPLETION_DEFAULT_TOKENS if isinstance(req, CompletionRequest) else max(1, rest)
        try:
            # the engine's own rules, before the request queues
            self.engine.check_request(ids, max_tokens, scoring=req.scores_prompt(max_tokens))
        except ContextError as e:
            raise BadRequest(str(e), param="max_tokens", code="context_length_exceeded") from None
        except ValueError as e:
            raise BadRequest(str(e), param="prompt") from None
        return ids, max_tokens

    def generate(self, req: Sampling, run: ChoiceRun,
                 emit: Callable[[str, list[TokenLogprob] | None], None] | None = None) -> Generation | None:
        """Blocking: decode a choice with the engine (its sampling seed the request's + run.choice), passing visible
        text pieces, with the log-probabilities of the tokens since the last piece, to `emit` (worker thread). None
        when the client left before the end."""
        ids, max_tokens = run.ids, run.max_tokens
        seed = (req.seed if req.seed is not None else 0) + run.choice
        stops = req.stop_ids(self.tok.stop_ids)
        sampler = Sampler(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          generator=torch.Generator().manual_seed(seed % (1 << 64)),
                          rules=LogitRules(**req.logit_rules(), stop_ids=frozenset(stops)),
                          grammar=self.answer_grammar(req, ids))
        stream = self.tok.stream(skip_special=True)
        top = req.logprob_top()
        ranked = req.candidates() > req.n  # best_of: each candidate's log-probabilities rank it
        lp = Logprobs(top or 0) if top is not None or ranked else None
        scored = Logprobs(top or 0) if req.scores_prompt(max_tokens) else None
        run.logprobs = None if top is None else []

        def show(piece: str) -> None:
            if piece and emit is not None:
                emit(piece, run.new_logprobs())

        def echo() -> None:
            """The prompt's text, with its entries when log-probabilities are asked for, before the completion's."""
            if run.echoed:
                return
            run.echoed = True
            if run.logprobs is not None and scored is not None:
                run.logprobs[:0] = scored.entries
            show(run.echo)

        def on_token(t: int) -> None:
            if run.cancelled.is_set():
                raise _Stopped
            if run.arrived is not None:
                self.metrics.first_token(time.perf_counter() - run.arrived)
                run.arrived = None
            echo()
            if run.ended.is_set():
                return  # the rest of the round that met a stop string
            run.n_tokens += 1
            if run.logprobs is not None:
                run.logprobs.append(lp.entries[-1])
            if t in stops:
                run.finish = "stop"  # the engine ends on it by itself
            piece, hit = run.add(stream.push(t))
            show(piece)
            if hit:
                run.finish = "stop"
                run.ended.set()

        try:
            decode = self.engine.generate if self.batcher is None else self.batcher.generate
            g = decode(ids, max_tokens, sampler=sampler, logprobs=lp, prompt_logprobs=scored,
                       stop_ids=_StopIds(stops, run.ended), on_token=on_token)
        except _Stopped:
            return None
        echo()  # no token was emitted (max_tokens 0)
        if ranked and run.n_tokens:
            run.mean_logprob = sum(e.logprob for e in lp.entries[:run.n_tokens]) / run.n_tokens
        if not run.ended.is_set():  # after a stop string, the text ends where it began
            piece, hit = run.add(stream.flush(), final=True)
            show(piece)
            if hit:
                run.finish = "stop"
        return g

    def format_logprobs(self, fmt: type[TextBodies] | type[ChatBodies], run: ChoiceRun,
                        entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's (or a chunk's) logprobs object for `entries`, the next of `run`'s; None when not asked for."""
        if entries is None:
            return None
        out = fmt.logprobs(entries, self.tok, run.lp_chars)
        run.lp_chars += sum(len(token_text(self.tok, e.token)) for e in entries)
        return out

    def count(self, runs: list[ChoiceRun], gens: list[Generation], finish: str) -> None:
        """A request that ended, for /metrics (`finish`: its first choice's reason, or cancelled or error)."""
        self.metrics.add_request([finish], sum(len(r.ids) for r in runs if not r.choice),
                                 sum(r.n_tokens for r in runs), gens)

    def echo_text(self, req: Sampling, prompt: str | list[int], ids: list[int]) -> str:
        """The text a choice starts with: the prompt as sent (its token ids decoded) when it is echoed, else none."""
        if not req.echoes():
            return ""
        return prompt if isinstance(prompt, str) else self.tok.decode(ids)

    def usage(self, runs: list[ChoiceRun], gens: list[Generation]) -> dict[str, Any]:
        """OpenAI's usage object, each prompt counted once; `cached_tokens`: the prompt tokens the engine's caches held
        before each prompt's first choice (EngineOptions.prefix_cache), which were not prefilled (the other choices
        find it all)."""
        done = sum(r.n_tokens for r in runs)
        prompt = sum(len(r.ids) for r in runs if not r.choice)
        cached = sum(g.cached_tokens for r, g in zip(runs, gens, strict=False) if not r.choice)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}


