"""OpenAI's Responses API (POST /v1/responses) over the chat endpoint, for clients that speak it (the openai SDK's
`client.responses`, agents such as Codex CLI with `wire_api = "responses"`).

A request becomes the chat request it means (`chat_body`): `instructions` the system message, `input` the
conversation (text, or items: messages of role user / system / developer / assistant with text parts,
`function_call` items an assistant's tool calls, `function_call_output` items tool messages, `reasoning` items an
assistant's reasoning_content), function `tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
`temperature`, `top_p`, `text.format` as response_format, `reasoning.effort` "none" as thinking off. The reply
becomes the response's output items (`response_body`): a reasoning item (under --reasoning-parser), a message with
its output_text, a function_call item per tool call; whole, or as the Responses stream of events
(`response_events`: response.created, each item added, its text, reasoning or arguments deltas and done events,
response.completed). A reply cut by its token limit is `incomplete` (reason max_output_tokens).

A stored response (`store`, true unless told) is kept in memory with its turn and the response it went on from
(ResponseStore, the last 1,024), so a later request can go on from it by `previous_response_id` (its input after that
chain's conversation, whose tokens the engine's prefix reuse finds in its caches) and `GET /v1/responses/{id}` returns
it (`DELETE` forgets it); a restart forgets them all. Images and files are refused (the model reads text); built-in
tools (web search, file search, ...) too.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from qspec.server.bodies import chat_chunks

TEXT_PARTS = ("input_text", "output_text", "text")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponsesRequest(BaseModel):
    """The Responses request body; unknown fields are ignored, as clients send ones of other features."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = Field(True, strict=True)
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = Field(True, strict=True)  # kept for a later request's previous_response_id (ResponseStore)
    metadata: dict[str, Any] | None = None


@dataclass
class _Kept:
    previous: str | None  # the response this one went on from
    turn: list[dict[str, Any]]  # its input and its output, as chat messages
    body: dict[str, Any]


class ResponseStore:
    """The last `most` stored responses (the least recently used leave first), each with its own turn as chat
    messages (its input and its output) and the response it went on from: a request naming one as
    previous_response_id goes on from the chain of turns back to the first (instructions are not carried over, as
    OpenAI's are not). A turn is kept once, so a long conversation takes memory in proportion to its length. In memory
    only: a restart forgets them."""

    def __init__(self, most: int = 1024) -> None:
        self.most = most
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict[str, Any], previous: str | None, turn_input: list[dict[str, Any]]) -> None:
        """Keep a finished response: its input (chat messages), its output, and the response it went on from."""
        with self._lock:
            self._kept[body["id"]] = _Kept(previous, turn_input + _messages(body["output"]), body)
            while len(self._kept) > self.most:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            kept = self._kept.get(response_id)
            return None if kept is None else kept.body

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the chain of turns that ends with that response (LookupError: a link not kept)."""
        turns, rid = [], response_id
        with self._lock:
            while rid is not None:
                kept = self._kept.get(rid)
                if kept is None:
                    after = "" if rid == response_id else f", which {response_id!r} goes on from,"
                    raise LookupError(f"previous_response_id: no response {rid!r}{after} is kept here (the last "
                                      f"{self.most} stored ones are, until the server restarts)")
                self._kept.move_to_end(rid)
                turns.append(kept.turn)
                rid = kept.previous
        return [m for turn in reversed(turns) for m in turn]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None


def conversation(req: ResponsesRequest, store: ResponseStore) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the conversation before the request's input: its previous response's chain; its input) as chat messages,
    its instructions apart (LookupError: a previous response not kept; ValueError: an input item that has no such
    meaning)."""
    before = [] if req.previous_response_id is None else store.conversation(req.previous_response_id)
    return before, [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _messages(req.input)


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request (its JSON body) that a Responses request whose conversation is `messages` means,
    without max_tokens (the route bounds the reply by what the context leaves); ValueError naming a field that has
    no such meaning here."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + messages
    if not messages:
        raise ValueError("input: the conversation is empty")
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead > 1:  # instructions and developer messages before the conversation: one system message, as chat takes it
        messages[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "temperature": req.temperature,
                            "top_p": req.top_p, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [_function(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = _response_format((req.text or {}).get("format"))
    if fmt is not None:
        body["response_format"] = fmt
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    if effort in ("none", "minimal"):
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat messages: a run of function_call items (and reasoning before them) is one assistant
    message's calls, each function_call_output a tool message."""
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            thought += _reasoning_text(item)
        elif kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise ValueError(f"input.{i}: role must be user, system, developer or assistant, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content", ""), f"input.{i}")}
                       | ({"reasoning_content": thought} if thought and role == "assistant" else {}))
            thought = "" if role == "assistant" else thought
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or thought:  # else the calls of the message before
                last = {"role": "assistant", "content": ""} | ({"reasoning_content": thought} if thought else {})
                out.append(last)
                thought = ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(item.get("output", ""), f"input.{i}: a function_call_output's output")})
        else:
            raise ValueError(f"input.{i}: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output and reasoning are)")
    return out


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined; an image or a file is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        bad = next((p.get("type") for p in content if p.get("type") not in TEXT_PARTS), None)
        if bad is None:
            return "".join(str(p.get("text", "")) for p in content)
        raise ValueError(f"{where}: content parts of type {bad!r} are not supported (the model reads text)")
    raise ValueError(f"{where}: content must be a string or a list of text parts")


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def _function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ValueError(f"tools.{i}: tools of type {kind!r} are not supported (function tools are)")
    if not isinstance(tool.get("name"), str):
        raise ValueError(f"tools.{i}: a function tool needs a name")
    fn = {"name": tool["name"]} | {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, got "
                     f"{json.dumps(choice)}")


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format -> chat's response_format (None: plain text)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        named = {k: fmt[k] for k in ("name", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": named | {"schema": fmt["schema"]}}
    raise ValueError("text.format must be {\"type\": \"text\" | \"json_object\"} or {\"type\": \"json_schema\", "
                     f"\"schema\": {{...}}}}, got {json.dumps(fmt)}")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex[:24]}"


def response_shell(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object's fields that echo the request, with no output yet (status in_progress)."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None}, "store": req.store, "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": req.top_p, "metadata": req.metadata or {}, "usage": None}


def response_body(chat: dict[str, Any], shell: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion -> the response: its output items, status and usage."""
    choice = chat["choices"][0]
    msg = choice["message"]
    parts = [("reasoning", msg.get("reasoning_content"), None, ""), ("message", msg.get("content"), None, "")]
    parts += [("function_call", c["function"]["arguments"], c["id"], c["function"]["name"])
              for c in msg.get("tool_calls") or []]
    output = [_finished_item(_open_item(kind, call_id, name), text or "") for kind, text, call_id, name in parts
              if text or call_id]
    return _finished(shell, output, choice, chat["usage"])


def _open_item(kind: str, call_id: str | None = None, name: str = "") -> dict[str, Any]:
    """A new output item of `kind` (reasoning, message, function_call), in progress and empty."""
    ident = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind] + "_" + uuid.uuid4().hex[:24]
    return {"type": kind, "id": ident} | {
        "reasoning": {"summary": [], "content": []},
        "message": {"status": "in_progress", "role": "assistant", "content": []},
        "function_call": {"call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}}[kind]


def _finished_item(item: dict[str, Any], text: str) -> dict[str, Any]:
    """The item done with its whole text (a function call's: its arguments)."""
    if item["type"] == "reasoning":
        return item | {"content": [{"type": "reasoning_text", "text": text}]}
    if item["type"] == "message":
        return item | {"status": "completed", "content": [_text_part(text)]}
    return item | {"arguments": text, "status": "completed"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _finished(shell: dict[str, Any], output: list[dict[str, Any]], choice: dict[str, Any], usage: dict[str, Any]
              ) -> dict[str, Any]:
    cut = choice.get("finish_reason") == "length"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return shell | {"status": "incomplete" if cut else "completed", "output": output,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                    "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {
                        "cached_tokens": cached}, "output_tokens": usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}}


async def response_events(chunks: AsyncGenerator[str | bytes, None], shell: dict[str, Any],
                          done: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The chat stream's server-sent events -> the Responses stream: response.created and response.in_progress, each
    output item added, its deltas and done events, then response.completed (or response.incomplete) with the whole
    response, which `done` gets first; an error event stays an error."""
    items, parsed = _Items(), chat_chunks(chunks)
    yield items.event("response.created", {"response": shell})
    yield items.event("response.in_progress", {"response": shell})
    try:
        async for chunk in parsed:
            if "error" in chunk:
                yield items.event("error", {"code": chunk["error"].get("code"), "message": chunk["error"]["message"],
                                            "param": chunk["error"].get("param")})
                return
            for event in items.add_delta(chunk["choices"][0].get("delta", {})):
                yield event
            if "usage" in chunk:
                for event in items.close():
                    yield event
                body = _finished(shell, items.done, chunk["choices"][0], chunk["usage"])
                done(body)
                yield items.event(f"response.{body['status']}", {"response": body})
    finally:  # a client that left: the chat stream stops its worker when it is closed
        await parsed.aclose()


class _Items:
    """A reply's output items as they are written: an item opens when the kind of what arrives changes (reasoning,
    message text, a function call) and the one before it is done. Each change returns its stream events (an event
    per step, numbered); `done` holds the finished items."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open item
        self.key: str | None = None  # what it holds: "reasoning", "message" or a call's id
        self.text, self.seq = "", 0

    def event(self, kind: str, data: dict[str, Any]) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1} | data)}\n\n"

    def add_delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self.open("reasoning") + self.add_text(delta["reasoning_content"])
        if delta.get("content"):
            out += self.open("message") + self.add_text(delta["content"])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function", {})
            if "id" in call:
                out += self.open("function_call", call["id"], fn.get("name", ""))
            if fn.get("arguments"):
                out += self.add_text(fn["arguments"])
        return out

    def open(self, kind: str, call_id: str | None = None, name: str = "") -> list[str]:
        key = call_id or kind
        if self.key == key:
            return []
        out = self.close()
        self.key, self.text, self.item = key, "", _open_item(kind, call_id, name)
        out.append(self.event("response.output_item.added", {"output_index": len(self.done), "item": self.item}))
        if kind == "message":
            out.append(self.event("response.content_part.added", self._at() | {"part": _text_part("")}))
        return out

    def add_text(self, text: str) -> list[str]:
        assert self.item is not None
        self.text += text
        kind = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta",
                "function_call": "response.function_call_arguments.delta"}[self.item["type"]]
        scores = {"logprobs": []} if self.item["type"] == "message" else {}
        return [self.event(kind, self._at() | {"delta": text} | scores)]

    def close(self) -> list[str]:
        if self.item is None:
            return []
        item, text, out = _finished_item(self.item, self.text), self.text, []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", self._at() | {"text": text}))
        elif item["type"] == "message":
            out.append(self.event("response.output_text.done", self._at() | {"text": text, "logprobs": []}))
            out.append(self.event("response.content_part.done", self._at() | {"part": _text_part(text)}))
        else:
            out.append(self.event("response.function_call_arguments.done", self._at() | {"arguments": text}))
        out.append(self.event("response.output_item.done", {"output_index": len(self.done), "item": item}))
        self.done.append(item)
        self.item, self.key = None, None
        return out

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        where = {"item_id": self.item["id"], "output_index": len(self.done)}
        return where if self.item["type"] == "function_call" else where | {"content_index": 0}
