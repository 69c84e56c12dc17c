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
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qspec.batch import Batcher
from qspec.engine import Engine, Generation
from qspec.options import ServerOptions
from qspec.server.anthropic import (
    CountRequest,
    MessagesRequest,
    chat_body,
    message_body,
    message_events,
    new_message_id,
)
from qspec.server.bodies import ChatBodies, TextBodies, qspec_stats
from qspec.server.completions import BadRequest, ChoiceRun, CompletionServer
from qspec.server.errors import ErrorBoundary, describe_validation, error_body, log
from qspec.server.requests import (
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
from qspec.server.tools import ToolCallSplit
from qspec.tokenizer import Tokenizer

# The largest request body read: a prompt that fits the context is far smaller (a 262,144-token context holds
# about 1 MB of text), and bounding the body keeps one client from tying up a tokenizer thread for seconds.
MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
WARMING_PATHS = ("/health", "/metrics", "/v1/models")  # answered while the warm-up runs; others get a 503
T = TypeVar("T")


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, kind, param, code))


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


def _refuse_while_warming(app: FastAPI, srv: CompletionServer) -> None:
    """A 503 for every request but WARMING_PATHS while the warm-up runs (the server listens from the start, so that
    a client learns it is there and when it will serve, as llama.cpp's does while it loads)."""
    @app.middleware("http")
    async def refuse(request: Request, call_next: Callable) -> Any:  # noqa: ANN401
        part = srv.warming
        if part is None or request.url.path in WARMING_PATHS:
            return await call_next(request)
        return _error(503, f"the server is warming up ({part}): it compiles its steps before the first request; "
                      "retry when GET /health answers 200", code="server_warming_up", kind="server_error")


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
    _refuse_while_warming(app, srv)
    if opts.api_key:
        _require_key(app, opts.api_key)
    if opts.origins():  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=opts.origins(), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(ErrorBoundary, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Any:  # noqa: ANN401
        part = srv.warming
        if part is not None:
            return JSONResponse(status_code=503, content={"status": "warming up", "part": part})
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
            before, turn = conversation(req, kept)
        except LookupError as e:
            raise BadRequest(str(e), param="previous_response_id") from None
        except ValueError as e:
            raise BadRequest(str(e), param="input") from None
        as_chat = _as_chat(req, before + turn)
        ids, rest = await asyncio.to_thread(srv.chat_prompt, as_chat)  # rest: what the context leaves
        n = min(rest, req.max_output_tokens or rest)
        out = await _respond(srv, as_chat, [(ids, ids, n)], ChatBodies, request)
        shell = response_shell(req, new_response_id(), srv.model_name)

        def done(body: dict[str, Any]) -> None:
            if req.store:
                kept.put(body, req.previous_response_id, turn)
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
        return found

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


async def _watch_disconnect(request: Request, run: ChoiceRun) -> None:
    """Set `run.cancelled` when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.cancelled.set()


async def _in_worker(srv: CompletionServer, run: ChoiceRun, fn: Callable[[], T]) -> T | None:
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
    runs = [ChoiceRun(stops, ids, max_tokens, j, cancelled=cancelled, echo=srv.echo_text(req, prompt, ids),
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


def _whole_choice(srv: CompletionServer, fmt: type[TextBodies] | type[ChatBodies], run: ChoiceRun, index: int) -> dict:
    reasoning, text, calls = run.whole_parts()
    return run.ended_choice(fmt.choice(text, run.finish_reason(), False, True, index,
                                       srv.format_logprobs(fmt, run, run.logprobs), reasoning, calls))


def _best(runs: list[ChoiceRun], n: int, candidates: int) -> list[ChoiceRun]:
    """Each prompt's n choices: its first n candidates, or (best_of) the n with the highest mean log-probability per
    token, best first."""
    if candidates == n:
        return runs
    groups = [runs[i:i + candidates] for i in range(0, len(runs), candidates)]
    return [r for g in groups for r in sorted(g, key=lambda r: -r.mean_logprob)[:n]]


async def _events(srv: CompletionServer, runs: list[ChoiceRun], all_choices: Callable, body: Callable,
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


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning", sock: socket.socket | None = None,
          beside: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Serve `app` until interrupted. The socket is bound first (or given: `listen_socket` before loading the model
    fails fast), so a bad --host or --port is one ServeError rather than uvicorn's log line and exit status 1.
    `beside(stop)` runs in a thread while the server listens (the warm-up); calling `stop()` ends serving."""
    import uvicorn

    sock = sock if sock is not None else listen_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    if beside is not None:
        def stop() -> None:
            server.should_exit = True

        threading.Thread(target=beside, args=(stop,), name="qspec-warm-up", daemon=True).start()
    server.run(sockets=[sock])
