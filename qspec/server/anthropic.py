"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat endpoint, for clients that
speak it (Claude Code and the anthropic SDK, pointed at this server with ANTHROPIC_BASE_URL).

A request becomes the chat request it means (`chat_body`): `system` the first message, content blocks the OpenAI
message parts (`text`; an assistant's `tool_use` its `tool_calls` and `thinking` its `reasoning_content`; a user's
`tool_result` blocks `tool` messages before its text), `tools` functions (`input_schema` their parameters),
`tool_choice` auto / any / tool / none as auto / required / the named function / none, `thinking` enabled (or
adaptive) or disabled as enable_thinking (its budget_tokens as thinking_token_budget: the think block is closed past
it). The reply is the chat reply's, written as a message (`message_body`) or as Anthropic's stream of events
(`message_events`): a think block, text and each tool call are content blocks in the order the model wrote them, a
call's input streamed as `input_json_delta` pieces as the chat stream sends its arguments.
A last assistant message is the reply's start (a prefill), which the reply goes on from. `max_tokens` past what the
context leaves is what it leaves. Images and documents are refused (a 400); fields this server has no use for
(metadata, cache_control) are ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qspec.server.bodies import chat_chunks

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _blocks(cls, content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        for i, block in enumerate([] if isinstance(content, str) else content):
            kind = block.get("type")
            if kind not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                raise ValueError(f"block {i}: type {kind!r} is not supported (text, tool_use, tool_result and "
                                 "thinking are)")
        return content


class MessagesRequest(BaseModel):
    """Anthropic's request body; unknown fields are ignored, as clients send ones of other features."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(ge=1, strict=True)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)  # Anthropic's default and range
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, strict=True)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountRequest(BaseModel):
    """/v1/messages/count_tokens: the prompt part of a request."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None


def chat_body(req: MessagesRequest | CountRequest) -> dict[str, Any]:
    """The chat completions request (its JSON body) that an Anthropic request means; ValueError naming a field
    that has no such meaning."""
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req)}
    if req.messages[-1].role == "assistant":  # a prefill: the reply goes on from its text
        body["continue_final_message"] = True
    if req.tools:
        body["tools"] = [_function(t, i) for i, t in enumerate(req.tools)]
    thinking = (req.thinking or {}).get("type")
    if thinking is not None and thinking not in ("enabled", "adaptive", "disabled"):
        raise ValueError(f"thinking.type must be enabled, adaptive or disabled, got {thinking!r}")
    if thinking is not None:  # adaptive: the model thinks as it sees fit, which a thinking template's model does
        body["chat_template_kwargs"] = {"enable_thinking": thinking != "disabled"}
    if isinstance(req, MessagesRequest):
        # no max_tokens: the rest of the context, which the route bounds by the request's (Claude Code asks for
        # 32,000, more than many a context leaves)
        body |= {"temperature": req.temperature, "stream": req.stream}
        body |= {k: v for k, v in (("stop", req.stop_sequences), ("top_p", req.top_p), ("top_k", req.top_k))
                 if v is not None}
        body |= _tool_choice(req.tool_choice, bool(req.tools))
        if thinking == "enabled" and "budget_tokens" in (req.thinking or {}):
            body["thinking_token_budget"] = _budget(req.thinking["budget_tokens"])  # type: ignore[index]
    return body


def _budget(tokens: Any) -> int:
    """thinking.budget_tokens: the reply's think block is closed for it past this many tokens."""
    if type(tokens) is not int or tokens < 0:
        raise ValueError(f"thinking.budget_tokens must be an integer >= 0, got {tokens!r}")
    return tokens


def message_body(chat: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A whole chat completion -> Anthropic's message."""
    choice = chat["choices"][0]
    msg, blocks = choice["message"], []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": blocks,
            "stop_reason": _stop_reason(choice), "stop_sequence": choice.get("stop_reason"),
            "usage": _usage(chat["usage"])}


async def message_events(chunks: AsyncGenerator[str | bytes, None], message_id: str, model: str,
                         input_tokens: int) -> AsyncIterator[str]:
    """The chat stream's server-sent events -> Anthropic's: message_start, each content block's start, deltas and
    stop, then message_delta (the stop reason and usage) and message_stop; an error event stays an error."""
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
    blocks, parsed = _Blocks(), chat_chunks(chunks)
    try:
        async for chunk in parsed:
            if "error" in chunk:
                yield _event("error", {"error": {"type": "api_error", "message": chunk["error"]["message"]}})
                return
            for event in blocks.add(chunk["choices"][0]) + (blocks.close() if "usage" in chunk else []):
                yield event
            if "usage" in chunk:
                choice = chunk["choices"][0]
                yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(choice),
                                                         "stop_sequence": choice.get("stop_reason")},
                                               "usage": _usage(chunk["usage"])})
        yield _event("message_stop", {})
    finally:  # a client that left: the chat stream stops its worker when it is closed
        await parsed.aclose()


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class _Blocks:
    """The content blocks of a streamed reply: a block opens when the kind of what the chat deltas carry changes
    (thinking, text, a tool call), and the one before it stops."""

    def __init__(self) -> None:
        self.count, self.kind = 0, None  # blocks opened; the open one's kind ("thinking", "text", a call's index)

    def add(self, choice: dict[str, Any]) -> list[str]:
        delta, out = choice.get("delta", {}), []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function", {})
            if "id" in call:
                out += self._open(f"call {call['index']}", {"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                            "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.count - 1})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind, self.count = kind, self.count + 1
        return out + [_event("content_block_start", {"index": self.count - 1, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.count - 1, "delta": delta})


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data)}\n\n"


def _stop_reason(choice: dict[str, Any]) -> str:
    if choice.get("stop_reason") is not None:
        return "stop_sequence"
    return STOP_REASONS.get(choice["finish_reason"], "end_turn")


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached}


def _input(arguments: str) -> Any:
    """A call's arguments text as the tool_use block's input (its text, under `arguments`, where it is not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise ValueError(f"{where} must be a string or a list of text blocks")


def _chat_messages(req: MessagesRequest | CountRequest) -> list[dict[str, Any]]:
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "user":
            out += [{"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                     "content": _text(b.get("content", ""), f"messages.{i}: a tool_result's content")}
                    for b in blocks if b["type"] == "tool_result"]
            text = "".join(str(b.get("text", "")) for b in blocks if b["type"] == "text")
            if text or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
            continue
        calls = [{"id": str(b.get("id", "")), "type": "function",
                  "function": {"name": str(b.get("name", "")), "arguments": json.dumps(b.get("input", {}))}}
                 for b in blocks if b["type"] == "tool_use"]
        thought = "".join(str(b.get("thinking", "")) for b in blocks if b["type"] == "thinking")
        out.append({"role": "assistant", "content": "".join(str(b.get("text", "")) for b in blocks
                                                            if b["type"] == "text")}
                   | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": thought} if thought else {}))
    return out


def _function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ValueError(f"tools.{i}: a tool needs a name (and an input_schema)")
    described = {"description": tool["description"]} if "description" in tool else {}
    return {"type": "function", "function": {"name": tool["name"]} | described | {
        "parameters": tool.get("input_schema") or {"type": "object"}}}  # OpenAI's order, as its clients send it


def _tool_choice(choice: dict[str, Any] | None, tools: bool) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type")
    single = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") is True else {}
    if kind == "auto":
        return single | ({"tool_choice": "auto"} if tools else {})
    if kind == "any":
        return single | {"tool_choice": "required"}
    if kind == "none":
        return {"tool_choice": "none"} if tools else {}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return single | {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise ValueError(f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": \"tool\", "
                     f"\"name\": ...}}, got {json.dumps(choice)}")
