"""An OpenAI-style HTTP server over one Engine: `/v1/completions` and `/v1/chat/completions` (whole or streamed as
server-sent events; chat messages go through the tokenizer's Qwen chat template), `/v1/responses` and `/v1/messages`
over the chat endpoint (responses.py, anthropic.py), `/v1/models`, `/health`.

The engine decodes one sequence at a time, so requests wait their turn on a lock; with a batcher its slots' requests
decode together instead (qspec/batch.py: each weight read once a step for all, each step a speculative round of
every request when the engine drafts), and the rest wait for a place. Tokenizing and each generation run in worker
threads, and the event loop stays free to stream tokens and answer health checks. A request whose client goes away
(streamed or not, queued or running) ends at the next token; one that meets a stop string ends at the end of that
round. The engine keeps its caches for the next request (a chat's next turn, which repeats the conversation, then
prefills only its new tokens; Engine.cached_prefix): one stopped mid-round leaves only its checkpoints (prompt
ends), valid whatever step was under way. Every error answers with OpenAI's error body (qspec/server/errors.py).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qspec.batch import Batcher
from qspec.engine import Engine, Generation, cells_needed
from qspec.options import ServerOptions
from qspec.runner import ContextError
from qspec.server.anthropic import (
    CountRequest,
    MessagesRequest,
    chat_body,
    message_body,
    message_events,
    new_message_id,
)
from qspec.server.bodies import ChatBodies, TextBodies, qspec_stats, token_text
from qspec.server.call_formats import CallFormat, call_format, template_call_format
from qspec.server.errors import ErrorBoundary, describe_validation, error_body, log
from qspec.server.metrics import ServerMetrics
from qspec.server.reasoning import ReasoningSplit
from qspec.server.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    stop_strings,
)
from qspec.server.responses import (
    ResponsesRequest,
    ResponseStore,
    conversation,
    new_response_id,
    response_body,
    response_events,
    response_shell,
)
from qspec.server.responses import chat_body as responses_chat_body
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

# The largest request body read: a prompt that fits the context is far smaller (a 262,144-token context holds
# about 1 MB of text), and bounding the body keeps one client from tying up a tokenizer thread for seconds.
MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
T = TypeVar("T")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str = "invalid_value", kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, kind, param, code))


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
class _Run:
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

    def generate(self, req: Sampling, run: _Run, emit: Callable[[str, list[TokenLogprob] | None], None] | None = None
                 ) -> Generation | None:
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

    def format_logprobs(self, fmt: type[TextBodies] | type[ChatBodies], run: _Run,
                        entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's (or a chunk's) logprobs object for `entries`, the next of `run`'s; None when not asked for."""
        if entries is None:
            return None
        out = fmt.logprobs(entries, self.tok, run.lp_chars)
        run.lp_chars += sum(len(token_text(self.tok, e.token)) for e in entries)
        return out

    def count(self, runs: list[_Run], gens: list[Generation], finish: str) -> None:
        """A request that ended, for /metrics (`finish`: its first choice's reason, or cancelled or error)."""
        self.metrics.add_request([finish], sum(len(r.ids) for r in runs if not r.choice),
                                 sum(r.n_tokens for r in runs), gens)

    def echo_text(self, req: Sampling, prompt: str | list[int], ids: list[int]) -> str:
        """The text a choice starts with: the prompt as sent (its token ids decoded) when it is echoed, else none."""
        if not req.echoes():
            return ""
        return prompt if isinstance(prompt, str) else self.tok.decode(ids)

    def usage(self, runs: list[_Run], gens: list[Generation]) -> dict[str, Any]:
        """OpenAI's usage object, each prompt counted once; `cached_tokens`: the prompt tokens the engine's caches held
        before each prompt's first choice (EngineOptions.prefix_cache), which were not prefilled (the other choices
        find it all)."""
        done = sum(r.n_tokens for r in runs)
        prompt = sum(len(r.ids) for r in runs if not r.choice)
        cached = sum(g.cached_tokens for r, g in zip(runs, gens, strict=False) if not r.choice)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _require_key(app: FastAPI, api_key: str) -> None:
    """A 401 in OpenAI's shape for a request without the key (/health and /metrics stay open to probes); the key
    comes as OpenAI's clients send it (`Authorization: Bearer`) or as Anthropic's do (`x-api-key`)."""
    want = api_key.encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable) -> Any:  # noqa: ANN401
        bearer = request.headers.get("authorization", "")
        given = (bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else request.headers.get(
            "x-api-key", "")).encode()
        if request.url.path in OPEN_PATHS or hmac.compare_digest(given, want):
            return await call_next(request)
        return _error(401, "a valid API key is needed: send the header `Authorization: Bearer <key>` (or "
                      "`x-api-key: <key>`)", code="invalid_api_key", kind="authentication_error")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = describe_validation(list(exc.errors()))
        return _error(400, message, param, code)

    @app.exception_handler(BadRequest)
    async def bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.status, str(exc), exc.param, exc.code, exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            return _error(404, f"no such endpoint: {where} (this server has POST /v1/completions, "
                          "POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, GET /v1/models, "
                          "GET /health)",
                          code="unknown_url")
        if exc.status_code == 405:
            return _error(405, f"method not allowed: {where}", code="method_not_allowed")
        return _error(exc.status_code, f"{where}: {exc.detail}")


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str = "qspec", options: ServerOptions | None = None,
               *, batcher: Batcher | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app serving `engine` as `model_name`, by `options` (qspec/options.py: the queue's length, the API key,
    the reasoning and tool call parsers); `batcher` (over `engine`): up to its slots' requests decode together
    (qspec/batch.py) instead of one at a time."""
    opts = options or ServerOptions()
    if batcher is not None and batcher.engine is not engine:
        raise ValueError("the batcher must decode with the served engine")
    srv = CompletionServer(engine, tokenizer, model_name, opts, batcher)
    app = FastAPI(title="qspec", description="MTP speculative decoding for Qwen3.8-Flash-Next")
    app.state.server = srv
    if opts.api_key:
        _require_key(app, opts.api_key)
    if opts.origins():  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=opts.origins(), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(ErrorBoundary, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        b = srv.batcher
        batch = None if b is None else (b.steps.steps, b.steps.rows, b.rounds, b.slots)
        return PlainTextResponse(srv.metrics.render(batch), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        # max_model_len as vLLM reports it: the context (--ctx) a prompt and its reply share
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": srv.created,
                                            "owned_by": "qspec", "max_model_len": engine.opts.capacity}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        srv.check_model(req.model)

        def ids() -> list[int]:
            text = req.prompt if req.messages is None else srv.chat_text(req.messages, tools=req.tools or None)
            return tokenizer.encode_batch([text], add_special=req.add_special_tokens)[0]

        tokens = await asyncio.to_thread(ids)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.opts.capacity}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        srv.check_model(req.model)
        vocab = tokenizer.padded_vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the tokenizer's {vocab} ids", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):  # noqa: ANN202
        def prompts() -> list[tuple[str | list[int], list[int], int]]:
            out = [(p, *srv.prompt_ids(req, p)) for p in req.prompts()]
            srv.grammar(req)  # compiles (a 400 when it does not), once for every prompt
            return out

        return await _respond(srv, req, await asyncio.to_thread(prompts), TextBodies, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):  # noqa: ANN202
        ids, n = await asyncio.to_thread(srv.chat_prompt, req)
        return await _respond(srv, req, [(ids, ids, n)], ChatBodies, request)

    _add_messages_routes(app, srv)
    _add_responses_routes(app, srv)
    return app


def _add_messages_routes(app: FastAPI, srv: CompletionServer) -> None:
    """Anthropic's Messages API over the chat endpoint (qspec/server/anthropic.py)."""
    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):  # noqa: ANN202
        as_chat = _as_chat(req)
        ids, rest = await asyncio.to_thread(srv.chat_prompt, as_chat)  # rest: what the context leaves
        n = min(rest, req.max_tokens)
        out, mid = await _respond(srv, as_chat, [(ids, ids, n)], ChatBodies, request), new_message_id()
        if isinstance(out, StreamingResponse):
            return StreamingResponse(message_events(out.body_iterator, mid, srv.model_name, len(ids)),
                                     media_type="text/event-stream")
        return message_body(out, mid)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountRequest) -> dict:
        as_chat = _as_chat(req)
        srv.check_model(as_chat.model)
        text = srv.request_text(as_chat)
        ids = await asyncio.to_thread(lambda: srv.tok.encode_batch([text], add_special=True)[0])
        return {"input_tokens": len(ids)}


def _add_responses_routes(app: FastAPI, srv: CompletionServer) -> None:
    """OpenAI's Responses API over the chat endpoint, the stored responses in memory (qspec/server/responses.py)."""
    kept = ResponseStore()

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):  # noqa: ANN202
        try:
            messages = conversation(req, kept)
        except LookupError as e:
            raise BadRequest(str(e), param="previous_response_id") from None
        except ValueError as e:
            raise BadRequest(str(e), param="input") from None
        as_chat = _as_chat(req, messages)
        ids, rest = await asyncio.to_thread(srv.chat_prompt, as_chat)  # rest: what the context leaves
        n = min(rest, req.max_output_tokens or rest)
        out = await _respond(srv, as_chat, [(ids, ids, n)], ChatBodies, request)
        shell = response_shell(req, new_response_id(), srv.model_name)

        def done(body: dict[str, Any]) -> None:
            if req.store:
                kept.put(body, messages)
        if isinstance(out, StreamingResponse):
            return StreamingResponse(response_events(out.body_iterator, shell, done), media_type="text/event-stream")
        body = response_body(out, shell)
        done(body)
        return body

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str) -> dict:
        found = kept.get(response_id)
        if found is None:
            raise BadRequest(f"no response {response_id!r} is kept here", 404, "response_id", "not_found")
        return found[1]

    @app.delete("/v1/responses/{response_id}")
    async def forget(response_id: str) -> dict:
        if not kept.delete(response_id):
            raise BadRequest(f"no response {response_id!r} is kept here", 404, "response_id", "not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _as_chat(req: MessagesRequest | CountRequest | ResponsesRequest, messages: list[dict[str, Any]] | None = None
             ) -> ChatRequest:
    """The chat request an Anthropic or a Responses one (whose conversation is `messages`) means
    (qspec/server/anthropic.py, responses.py), or a 400 naming what does not fit."""
    try:
        body = responses_chat_body(req, messages or []) if isinstance(req, ResponsesRequest) else chat_body(req)
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        message, param, code = describe_validation(e.errors())
        raise BadRequest(message, param=param, code=code) from None
    except ValueError as e:
        raise BadRequest(str(e)) from None


async def _watch_disconnect(request: Request, run: _Run) -> None:
    """Set `run.cancelled` when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.cancelled.set()


async def _in_worker(srv: CompletionServer, run: _Run, fn: Callable[[], T]) -> T | None:
    """Run `fn` in a worker thread holding a place on the engine (its lock, or one of the batch's slots); None when
    the client left while it queued. If this coroutine is cancelled, the worker is told to stop and awaited: the
    place must not be freed while it works."""
    m = srv.metrics
    m.queue(waiting=1)
    try:
        await srv.lock.acquire()
    finally:
        m.queue(waiting=-1)
    m.queue(running=1)
    try:
        if run.cancelled.is_set():
            return None
        task = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            run.cancelled.set()
            await asyncio.wait([task])
            raise
    finally:
        m.queue(running=-1)
        srv.lock.release()


async def _respond(srv: CompletionServer, req: Sampling, prompts: list[tuple[str | list[int], list[int], int]],
                   fmt: type[TextBodies] | type[ChatBodies], request: Request):  # noqa: ANN202
    """Generate for one request, each prompt's `n` choices one after the other (each after the first finds the prompt
    in the caches), or with a batcher together; prompts: (as sent, its ids, its max_tokens). A whole JSON body, or a
    stream of server-sent events ending with `[DONE]`."""
    srv.admit()
    cancelled = threading.Event()  # one for all: the client leaving stops the choice under way and the ones after it
    stops = stop_strings(req.stop)
    tools = isinstance(req, ChatRequest) and req.prompt_tools() is not None
    most = None if not isinstance(req, ChatRequest) or req.parallel_tool_calls else 1
    calls = srv.call_format(req) if tools else None
    runs = [_Run(stops, ids, max_tokens, j, cancelled=cancelled, echo=srv.echo_text(req, prompt, ids),
                 split=srv.reasoning_split(req, ids), tools=None if calls is None else ToolCallSplit(calls, most))
            for prompt, ids, max_tokens in prompts for j in range(req.candidates())]
    runs[0].arrived = time.perf_counter()
    head = {"id": f"{fmt.prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": srv.model_name}

    def body(obj: str, choices: list[dict], gens: list[Generation] | None = None) -> dict:
        done = {} if gens is None else {"usage": srv.usage(runs, gens)} | qspec_stats(gens)
        return head | {"object": obj, "choices": choices} | done

    def all_choices(emit: Callable[[int, str | None, list | None], None] | None = None) -> list[Generation] | None:
        """Blocking: every choice, in turn (with a batcher: together, a thread each); emit(index, piece,
        log-probabilities since the last piece), and emit(index, None, the rest) at each choice's end."""
        def one(i: int) -> Generation | None:
            g = srv.generate(req, runs[i], None if emit is None else partial(emit, i))
            if g is not None and emit is not None:
                emit(i, None, runs[i].new_logprobs())
            return g
        if srv.batcher is not None and len(runs) > 1:
            with ThreadPoolExecutor(len(runs)) as pool:
                gens = list(pool.map(one, range(len(runs))))
            return None if any(g is None for g in gens) else gens
        gens = []
        for i in range(len(runs)):
            g = one(i)
            if g is None:
                return None
            gens.append(g)
        return gens

    if not req.stream:
        watcher = asyncio.create_task(_watch_disconnect(request, runs[0]))
        try:
            gens = await _in_worker(srv, runs[0], all_choices) or []
        finally:
            watcher.cancel()
        best = _best(runs, req.n, req.candidates())
        choices = [_whole_choice(srv, fmt, r, i) for i, r in enumerate(best)]
        srv.count(runs, gens, "cancelled" if len(gens) < len(runs) else runs[0].finish)
        return body(fmt.whole, choices, gens)
    return StreamingResponse(_events(srv, runs, all_choices, body, fmt), media_type="text/event-stream")


def _whole_choice(srv: CompletionServer, fmt: type[TextBodies] | type[ChatBodies], run: _Run, index: int) -> dict:
    reasoning, text, calls = run.whole_parts()
    return run.ended_choice(fmt.choice(text, run.finish_reason(), False, True, index,
                                       srv.format_logprobs(fmt, run, run.logprobs), reasoning, calls))


def _best(runs: list[_Run], n: int, candidates: int) -> list[_Run]:
    """Each prompt's n choices: its first n candidates, or (best_of) the n with the highest mean log-probability per
    token, best first."""
    if candidates == n:
        return runs
    groups = [runs[i:i + candidates] for i in range(0, len(runs), candidates)]
    return [r for g in groups for r in sorted(g, key=lambda r: -r.mean_logprob)[:n]]


async def _events(srv: CompletionServer, runs: list[_Run], all_choices: Callable, body: Callable,
                  fmt: type[TextBodies] | type[ChatBodies]) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: each choice's pieces, then a chunk with its finish reason (the
    last one with the usage), or an error event; Starlette cancels this generator when the client leaves, and
    _in_worker then stops the worker."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, str | None, list | None] | None] = asyncio.Queue()

    def emit(index: int, piece: str | None, entries: list | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, piece, entries))

    def work() -> list[Generation] | None:
        try:
            return all_choices(emit)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task = asyncio.create_task(_in_worker(srv, runs[0], work))
    last, tail = len(runs) - 1, None
    try:
        started: set[int] = set()
        while (item := await queue.get()) is not None:
            i, piece, entries = item
            if piece is None and i == last:
                tail = entries  # the last choice's end comes with the usage, below
                continue
            reasoning, text, calls = runs[i].piece_parts(piece)
            choice = fmt.choice(text, None if piece is not None else runs[i].finish_reason(), True, i not in started,
                                i, srv.format_logprobs(fmt, runs[i], entries), reasoning, calls)
            if piece is None:
                choice = runs[i].ended_choice(choice)
            started.add(i)
            yield f"data: {json.dumps(body(fmt.chunk, [choice]))}\n\n"
        gens = await task
        srv.count(runs, gens or [], "cancelled" if gens is None else runs[0].finish)
        reasoning, text, calls = runs[last].piece_parts(None)
        end = runs[last].ended_choice(fmt.choice(
            text, runs[last].finish_reason(), True, last not in started, last,
            srv.format_logprobs(fmt, runs[last], tail if runs[last].logprobs is not None else None), reasoning, calls))
        yield f"data: {json.dumps(body(fmt.chunk, [end], gens or []))}\n\n"
    except Exception as e:  # the 200 has been sent: the error becomes the stream's last event
        log.error("error while streaming a response", exc_info=e)
        srv.count(runs, [], "error")
        err = error_body(f"internal error: {type(e).__name__}: {e}", "server_error", None, "internal_error")
        yield f"data: {json.dumps(err)}\n\n"
    finally:
        runs[0].cancelled.set()  # when the client left mid-stream: the worker stops at its next token
        if not task.done():
            await asyncio.wait([task])
    yield "data: [DONE]\n\n"


# ---- serving ------------------------------------------------------------------------------------------------------
class ServeError(OSError):
    """The server cannot listen where it was asked to (an OSError, so the CLI reports it as one line, exit 2)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or ServeError saying why not (an unknown host, a port in use...)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: cannot resolve this host name ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"--port {port}: {host}:{port} is already in use (another server is listening there; "
                             "pick another --port)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ServeError(f"--host {host}: not an address of this machine") from None
        if e.errno == errno.EACCES:
            raise ServeError(f"--port {port}: permission denied (ports below 1024 need privileges)") from None
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning", sock: socket.socket | None = None) -> None:
    """Serve `app` until interrupted. The socket is bound first (or given: `listen_socket` before loading the model
    fails fast), so a bad --host or --port is one ServeError rather than uvicorn's log line and exit status 1."""
    import uvicorn

    sock = sock if sock is not None else listen_socket(host, port)
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
