"""An OpenAI-style HTTP server over one Engine: `/v1/completions` and `/v1/chat/completions` (whole or streamed as
server-sent events; chat messages go through the tokenizer's Qwen chat template), `/v1/models`, `/health`.

The engine decodes one sequence at a time, so requests wait their turn on a lock; each generation runs in a
worker thread and the event loop stays free to stream tokens and answer health checks. A streamed request
whose client goes away, or any request that meets one of its stop strings, ends at the next token: the
engine resets every cache at the start of the next request, so stopping mid-round leaves nothing behind.
Bad requests (an empty prompt, a token id outside the vocabulary, a request longer than the context, a wrong
model name, out-of-range numbers) get a 4xx with an OpenAI-style error body that names the problem.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from qspec.engine import Engine, Generation
from qspec.runner import ContextError
from qspec.spec.accept import Sampler
from qspec.tokenizer import Tokenizer


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    # OpenAI options this engine cannot honour: accepted only at values that change nothing, so a client that
    # asks for more gets a 400 instead of a silently different answer
    n: int = Field(1, ge=1, le=1, description="one sequence per request")
    logprobs: None = None
    echo: bool = Field(False, le=False)
    best_of: int | None = Field(None, ge=1, le=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


class _Stopped(Exception):
    """Raised from the token callback to end a generation early (a stop string, or the client left)."""


@dataclass
class _Run:
    """One request's text as the worker thread's token callback decodes it."""
    stops: list[str]
    text: str = ""
    sent: int = 0  # text[:sent] has been handed out
    n_tokens: int = 0
    finish: str = "length"
    cancelled: threading.Event = field(default_factory=threading.Event)

    def add(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """Append decoded text -> (the text that may be shown now, whether a stop string ended the request).

        While stop strings are set, the last (longest stop - 1) characters are held back: they may be the start
        of a stop string that the next tokens complete, and streamed text cannot be taken back."""
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, len(self.text) - longest + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        hold = 0 if final or hits else max(0, longest - 1)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, bool(hits)


class CompletionServer:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str) -> None:
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.lock = asyncio.Lock()

    def prompt_ids(self, req: _Sampling, prompt: str | list[int]) -> list[int]:
        if req.model is not None and req.model != self.model_name:
            raise BadRequest(f"model {req.model!r} is not served here (this server has {self.model_name!r})", 404,
                             "model")
        ids = prompt if isinstance(prompt, list) else self.tok.encode(prompt, add_special=True)
        try:
            self.engine.check_request(ids, req.max_tokens)  # the engine's own rules, before the request queues
        except ContextError as e:
            raise BadRequest(str(e), param="max_tokens") from None
        except ValueError as e:
            raise BadRequest(str(e), param="prompt") from None
        return ids

    def generate(self, req: _Sampling, ids: list[int], run: _Run,
                 emit: Callable[[str], None] | None = None) -> Generation | None:
        """Blocking: decode with the engine, passing visible text pieces to `emit` (worker thread)."""
        sampler = Sampler(temperature=req.temperature, top_p=req.top_p,
                          generator=torch.Generator().manual_seed(req.seed if req.seed is not None else 0))
        stream = self.tok.stream(skip_special=True)

        def show(piece: str) -> None:
            if piece and emit is not None:
                emit(piece)

        def on_token(t: int) -> None:
            if run.cancelled.is_set():
                raise _Stopped
            run.n_tokens += 1
            if t in self.tok.stop_ids:
                run.finish = "stop"
            piece, hit = run.add(stream.push(t))
            show(piece)
            if hit:
                run.finish = "stop"
                raise _Stopped

        try:
            g = self.engine.generate(ids, req.max_tokens, sampler=sampler, stop_ids=set(self.tok.stop_ids),
                                     on_token=on_token)
        except _Stopped:
            return None
        piece, hit = run.add(stream.flush(), final=True)
        show(piece)
        if hit:
            run.finish = "stop"
        return g

    def usage(self, ids: list[int], run: _Run) -> dict:
        return {"prompt_tokens": len(ids), "completion_tokens": run.n_tokens,
                "total_tokens": len(ids) + run.n_tokens}


def _stats(g: Generation | None) -> dict:
    if g is None:
        return {}
    return {"qspec": {"decode_tokens_per_s": g.decode_tps, "prefill_s": g.prefill_s,
                      "drafted": g.spec.drafted, "accepted": g.spec.accepted}}


class _Text:
    """/v1/completions bodies: text_completion objects."""
    prefix, whole, chunk = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, first: bool) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


class _Chat:
    """/v1/chat/completions bodies: chat.completion objects, and chunks with deltas when streamed."""
    prefix, whole, chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, first: bool) -> dict:
        if not streamed:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish}


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str = "qspec") -> FastAPI:
    srv = CompletionServer(engine, tokenizer, model_name)
    app = FastAPI(title="qspec", description="MTP speculative decoding for Qwen3.8-Flash-Next")
    app.state.server = srv

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc), where or None)

    @app.exception_handler(BadRequest)
    async def bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.status, str(exc), exc.param)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "qspec"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):  # noqa: ANN202
        return await _respond(srv, req, srv.prompt_ids(req, req.prompt), _Text)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):  # noqa: ANN202
        try:
            text = tokenizer.apply_chat_template([m.model_dump() for m in req.messages])
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), param="messages") from None
        return await _respond(srv, req, srv.prompt_ids(req, text), _Chat)

    return app


async def _respond(srv: CompletionServer, req: _Sampling, ids: list[int], fmt: type[_Text] | type[_Chat]):  # noqa: ANN202
    """Generate for one request: a whole JSON body, or a stream of server-sent events ending with `[DONE]`."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty", param="stop")
    run = _Run(stops)
    head = {"id": f"{fmt.prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": srv.model_name}

    def body(obj: str, choice: dict, g: Generation | None = None, done: bool = False) -> dict:
        return head | {"object": obj, "choices": [choice]} | (
            {"usage": srv.usage(ids, run)} | _stats(g) if done else {})

    if not req.stream:
        async with srv.lock:
            g = await asyncio.to_thread(srv.generate, req, ids, run)
        return body(fmt.whole, fmt.choice(run.text, run.finish, False, True), g, done=True)

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    def emit(piece: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, piece)

    def work() -> Generation | None:
        try:
            return srv.generate(req, ids, run, emit)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    async def events() -> AsyncIterator[str]:
        async with srv.lock:
            task = asyncio.create_task(asyncio.to_thread(work))
            try:
                first = True
                while (piece := await queue.get()) is not None:
                    yield f"data: {json.dumps(body(fmt.chunk, fmt.choice(piece, None, True, first)))}\n\n"
                    first = False
                g = await task
                yield f"data: {json.dumps(body(fmt.chunk, fmt.choice('', run.finish, True, first), g, True))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                run.cancelled.set()  # the client left mid-stream: the worker stops at its next token
                if not task.done():
                    await asyncio.wait([task])

    return StreamingResponse(events(), media_type="text/event-stream")
