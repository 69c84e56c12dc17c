"""Tool calls in chat replies (OpenAI's `tools`): the request's tools go into the prompt through the chat template
(Tokenizer.apply_chat_template), and the model calls one by writing, in Qwen's format,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each such block of the reply becomes an entry of the message's `tool_calls` (arguments as JSON text, as OpenAI
returns them) and leaves its content; a reply with a call finishes with "tool_calls". A block that is not a JSON
object with a string name and object arguments stays in the content as the model wrote it, as vLLM's hermes parser
keeps it. `tool_choice` "auto" (the default with tools) parses the calls, "none" leaves the reply as text (the
prompt offers no tools), and "required" or a named function forces a call: the reply is held to a grammar of
`<tool_call>` blocks whose JSON calls one of those tools with arguments that match its parameters' schema.

Streamed text arrives in pieces that may cut a tag anywhere, so a piece's end that could begin `<tool_call>` is held
back until the next piece tells, and a block's text is held until it closes: a call is sent whole, in one delta.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from qspec.server.reasoning import tag_start
from qspec.spec.grammar import JSON_LAYOUT

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


def call_grammar(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, its JSON laid out as json.dumps writes it) of a reply that is one or more
    `<tool_call>` blocks (one, not `parallel`), each a call of one of `tools` with arguments that match its
    parameters' schema."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": JSON_LAYOUT, "anyOf": calls}
    more = ' ("\\n" block)*' if parallel else ""
    return (f'start: block{more}\nblock: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f"call: %json {json.dumps(schema)}\n")


def parse_call(block: str) -> dict[str, Any] | None:
    """A `<tool_call>` block's text -> OpenAI's tool call (a fresh id; arguments as JSON text), None when it is not a
    JSON object with a string name and object arguments."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallSplit:
    """One reply's content, piece by piece -> (content, tool calls) pieces."""

    def __init__(self, most: int | None = None) -> None:
        self.held = ""  # text that may begin a block's tag, or (inside) a block's text while it is not closed
        self.inside = False
        self.calls = 0  # tool calls found so far
        self.most = most  # the calls returned (parallel_tool_calls false: 1); the blocks of later ones are dropped

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the whole tool calls that `piece` adds."""
        text, self.held = self.held + piece, ""
        content, calls = [], []
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
                self.held = text  # the block's text so far, until it closes (or the reply ends: then it is content)
                break
            call = parse_call(text[:end])
            if call is None:
                content.append(OPEN + text[:end + len(CLOSE)])
            elif self.most is None or self.calls + len(calls) < self.most:
                calls.append(call)
            text, self.inside = text[end + len(CLOSE):], False
        self.calls += len(calls)
        return _between_calls("".join(content), bool(self.calls)), calls

    def flush(self) -> str:
        """What is held at the reply's end (a tag's start, or a block never closed), as content."""
        held = (OPEN if self.inside else "") + self.held
        self.held, self.inside = "", False
        return held

    def whole(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """A whole reply -> (content, tool calls)."""
        content, calls = self.push(text)
        return (content + self.flush()).strip() if calls else content + self.flush(), calls


def _between_calls(content: str, after_a_call: bool) -> str:
    """Content after a call: the newlines the model writes between blocks are not content."""
    return content.strip("\n") if after_a_call and not content.strip() else content

