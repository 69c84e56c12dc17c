"""Tool calls in chat replies (OpenAI's `tools`): the request's tools go into the prompt through the chat template
(Tokenizer.apply_chat_template), and the model calls one by writing a `<tool_call>` block in the format its
template asks for (qspec/server/call_formats.py: Qwen's JSON, "hermes", or Qwen3-Coder's tags, "qwen3_coder"):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each such block of the reply becomes an entry of the message's `tool_calls` (arguments as JSON text, as OpenAI
returns them) and leaves its content; a reply with a call finishes with "tool_calls". A block in which the format
finds no call stays in the content as the model wrote it, as vLLM's parsers keep it. `tool_choice` "auto" (the
default with tools) parses the calls, "none" leaves the reply as text (the prompt offers no tools), and "required" or
a named function forces a call: the reply is held to a grammar of `<tool_call>` blocks that call one of those tools
with arguments that match its parameters' schema.

Streamed text arrives in pieces that may cut a tag anywhere, so a piece's end that could begin `<tool_call>` is held
back until the next piece tells. A call is streamed as OpenAI streams one: a first delta with its id and name once the
block names the function, then its arguments' text as it grows (call_formats.py says when text is final); a block
that names no function is held until it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from qspec.server.call_formats import CallFormat, HermesCalls
from qspec.server.reasoning import tag_start

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools`, each {"type": "function", "function": {"name", "description"?, "parameters"?}}, or
    ValueError naming the first bad one."""
    if not isinstance(tools, list):
        raise ValueError(f"must be a list of tools, got {type(tools).__name__}")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tool {i}: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tool {i}: the function name must be 1-64 letters, digits, '_', '.' or '-', got "
                             f"{name!r}")
        if name in names:
            raise ValueError(f"tool {i}: the function name {name!r} is given twice")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise ValueError(f"tool {i} ({name}): the description must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tool {i} ({name}): the parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """`tool_choice`: "auto", "none", "required", {"type": "function", "function": {"name": ...}} or None (not
    given), else ValueError."""
    if choice is None or choice in TOOL_CHOICES:
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict) and choice.get("type") == "function" and isinstance(fn.get("name"), str):
        return choice
    raise ValueError(f"must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {choice!r}")


def forced_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    """The tools one of which the reply must call ("required": any; a named function: that one), or None (the
    model chooses); ValueError when the choice names no tool of the request."""
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise ValueError(f"tool_choice {json.dumps(choice)} needs tools")
    if choice == "required":
        return tools
    named = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    if not named:
        raise ValueError(f"tool_choice names {choice['function']['name']!r}, which is not one of the tools")
    return named


def call_grammar(fmt: CallFormat, tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's) of a reply that is one or more `<tool_call>` blocks (one, not `parallel`), each
    a call of one of `tools` in the format `fmt`, with arguments that match its parameters' schema."""
    more = ' ("\\n" block)*' if parallel else ""
    return f'start: block{more}\nblock: "{OPEN}\\n" call "\\n{CLOSE}"\n' + fmt.grammar(tools)


class ToolCallSplit:
    """One reply's content, piece by piece -> (content, tool call deltas) pieces.

    Invariant: the deltas of a call, their `arguments` joined, are the call whole, whatever the pieces were."""

    def __init__(self, fmt: CallFormat | None = None, most: int | None = None) -> None:
        self.fmt = fmt or HermesCalls()
        self.held = ""  # text that may begin a block's tag, or (inside) the open block's text
        self.inside = False
        self.calls = 0  # tool calls found so far (announced, or whole)
        self.most = most  # the calls returned (parallel_tool_calls false: 1); the blocks of later ones are dropped
        self.sent: int | None = None  # the open block's call: characters of its arguments sent (None: no call yet)
        self.dropped = False  # the open block's call is past `most`

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool call deltas that `piece` adds."""
        text, self.held = self.held + piece, ""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while text:
            if not self.inside:
                start = text.find(OPEN)
                if start < 0:
                    keep = tag_start(text, OPEN)
                    content.append(text[:keep])
                    self.held = text[keep:]
                    break
                content.append(text[:start])
                text, self.inside = text[start + len(OPEN):], True
            end = text.find(CLOSE)
            if end < 0:
                self.held = text  # the block's text so far, until it closes (or the reply ends)
                deltas += self._block_deltas(text[:tag_start(text, CLOSE)], closed=False)  # not a tag's start
                break
            new = self._block_deltas(text[:end], closed=True)
            if self.sent is None and not new and not self.dropped:  # no call in it: the block as the model wrote it
                content.append(OPEN + text[:end + len(CLOSE)])
            deltas += new
            text, self.inside, self.sent, self.dropped = text[end + len(CLOSE):], False, None, False
        return _between_calls("".join(content), bool(self.calls)), deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the reply's end: a tag's start, or a block never closed, as content, unless the block
        named a call: then the rest of that call's arguments."""
        held, inside = self.held, self.inside
        self.held, self.inside = "", False
        if not inside:
            return held, []
        deltas = self._block_deltas(held, closed=True)
        named = self.sent is not None or self.dropped
        self.sent, self.dropped = None, False
        return ("" if named else OPEN + held), deltas

    def whole(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """A whole reply -> (content, tool calls)."""
        content, deltas = self.push(text)
        rest, more = self.flush()
        calls = merged_calls(deltas + more)
        return ((content + rest).strip() if calls else content + rest), calls

    def _block_deltas(self, text: str, closed: bool) -> list[dict[str, Any]]:
        """The open block's call deltas that its text so far adds: the call's first (id, name and the arguments so
        far), then its arguments' new text."""
        if self.dropped:
            return []
        call = self.fmt.read(text, closed)
        if call is None:
            return []
        if self.sent is None:
            if self.most is not None and self.calls >= self.most:
                self.dropped = True
                return []
            self.calls, self.sent = self.calls + 1, len(call.arguments)
            return [{"index": self.calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]
        new, self.sent = call.arguments[self.sent:], len(call.arguments)
        return [{"index": self.calls - 1, "function": {"arguments": new}}] if new else []


def calls_as_mappings(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a chat template: its tool calls' arguments, which OpenAI's clients send as JSON text, as the
    mapping that templates iterate (Qwen3-Coder's `arguments|items`; transformers documents them so, and vLLM passes
    them so); text that is not a JSON object stays text, for the template to take or refuse."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        out.append(call | {"function": fn | {"arguments": parsed}} if isinstance(parsed, dict) else call)
    return message | {"tool_calls": out}


def merged_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool call deltas -> the whole calls (OpenAI's message `tool_calls`), their arguments joined."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": d["type"], "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def _between_calls(content: str, after_a_call: bool) -> str:
    """Content after a call: the newlines the model writes between blocks are not content."""
    return content.strip("\n") if after_a_call and not content.strip() else content
