"""The server's error contract: every error, whoever raises it, answers with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` and a message that names the problem in one line.

- request validation (pydantic) and malformed bodies: 400 `invalid_request_error`, the field in `param`;
- a request body over the size limit: 413, read no further; invalid UTF-8 in the body: 400 `invalid_json`;
- unknown paths and methods: 404 / 405;
- anything unexpected: 500 `server_error`, with the traceback in the server's log. The error is answered here,
  inside Starlette's outermost middleware, so that the connection stays usable: Starlette re-raises what reaches
  its outermost layer, and uvicorn then closes the client's keep-alive connection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("qspec.server")

# what each pydantic error type becomes: (code, how to say it; {p} is the field, {got} the value, {ctx} the limit)
_PYDANTIC = {
    "missing": ("missing_required_parameter", "{p} is required"),
    "extra_forbidden": ("unknown_parameter", "unknown parameter {p!r}: this server does not support it"),
    "greater_than_equal": ("invalid_value", "{p} must be >= {ge}, got {got}"),
    "greater_than": ("invalid_value", "{p} must be > {gt}, got {got}"),
    "less_than_equal": ("invalid_value", "{p} must be <= {le}, got {got}"),
    "less_than": ("invalid_value", "{p} must be < {lt}, got {got}"),
    "finite_number": ("invalid_value", "{p} must be a finite number, got {got}"),
    "too_short": ("invalid_value", "{p} must not be empty"),
    "int_parsing": ("invalid_value", "{p} must be an integer, got {got}"),
    "int_type": ("invalid_value", "{p} must be an integer, got {got}"),
    "int_from_float": ("invalid_value", "{p} must be an integer, got {got}"),
    "float_parsing": ("invalid_value", "{p} must be a number, got {got}"),
    "float_type": ("invalid_value", "{p} must be a number, got {got}"),
    "bool_parsing": ("invalid_value", "{p} must be true or false, got {got}"),
    "bool_type": ("invalid_value", "{p} must be true or false, got {got}"),
    "string_type": ("invalid_value", "{p} must be a string, got {got}"),
    "list_type": ("invalid_value", "{p} must be a list, got {got}"),
    "model_type": ("invalid_value", "{p} must be a JSON object, got {got}"),
    "model_attributes_type": ("invalid_value", "{p} must be a JSON object, got {got}"),
    "dict_type": ("invalid_value", "{p} must be a JSON object, got {got}"),
}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """pydantic/FastAPI validation errors -> (one-line message, param, code) for the first error."""
    if not errors:
        return "invalid request", None, "invalid_value"
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    ctx = e.get("ctx") or {}
    if e.get("type") == "json_invalid":
        where = f" (at character {e['loc'][-1]})" if len(e.get("loc", ())) > 1 else ""
        return f"the request body is not valid JSON: {ctx.get('error', 'cannot parse it')}{where}", None, "invalid_json"
    param = ".".join(loc) or None
    p = param or "the request body"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    kind = e.get("type", "")
    if kind in _PYDANTIC:
        code, fmt = _PYDANTIC[kind]
        return fmt.format(p=p, got=_short(e.get("input")), **ctx) + more, param, code
    if kind in ("value_error", "unsupported_value"):
        # our own validators: their message is already the explanation
        code = "unsupported_value" if kind == "unsupported_value" else "invalid_value"
        return f"{p}: {ctx.get('error', e.get('msg'))}" + more, param, code
    return f"{p}: {e.get('msg', 'invalid value')}" + more, param, "invalid_value"


class ErrorBoundary:
    """ASGI middleware: bounds the request body (413), refuses bodies that are not UTF-8, and turns an exception
    that escapes the app into a JSON 500 while the response has not started (after that, a streamed response
    reports its own errors as an event)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.max_body = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        body, problem = await self._read_body(scope, receive)
        if problem is not None:
            if problem[0] != 499:  # 499: the client left before sending its body; nobody to answer
                await _send_json(send, *problem)
            return
        try:
            await self.app(scope, _replay(body, receive), send_tracked)
        except Exception as e:
            log.exception("error while answering %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await _send_json(send, 500, error_body(f"internal error: {type(e).__name__}: {e}", "server_error",
                                                   None, "internal_error"))

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, tuple[int, dict, bool] | None]:
        """The whole body (bounded), or the error to answer instead: (status, body, close the connection)."""
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_body:
            return b"", (413, self._too_large(int(declared)), True)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (499, error_body("the client went away"), True)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", (413, self._too_large(None), True)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return b"", (400, error_body(f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at "
                                         f"offset {e.start} ({e.reason}); JSON text must be UTF-8", param=None,
                                         code="invalid_json"), False)
        return body, None

    def _too_large(self, declared: int | None) -> dict[str, Any]:
        size = f"{declared:,} bytes" if declared is not None else "more"
        return error_body(f"the request body is {size}, over this server's limit of {self.max_body:,} bytes",
                          param=None, code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive() that hands out the body already read, then waits on the connection (for its disconnect)."""
    sent = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send: Send, status: int, body: dict[str, Any], close: bool = False) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if close:  # the rest of the body was not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
