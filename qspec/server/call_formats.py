"""How a model writes one tool call inside a `<tool_call>` block: the two formats of Qwen's chat templates.

- "hermes" (Qwen2.5, Qwen3, qspec's own template): a JSON object,
      {"name": "get_weather", "arguments": {"city": "Paris"}}
- "qwen3_coder" (Qwen3-Coder, Qwen3.5 and the templates after it): tags, a parameter's value as plain text,
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>

A format reads a block's text as it grows (`read`): once the text names the function the call is known, and its
arguments (OpenAI's JSON text) grow only by text that the rest of the block cannot change, so that a streamed call's
pieces add up to the whole reply's arguments however the text was cut. hermes passes the model's JSON through as it
is written; qwen3_coder adds a parameter when its closing tag arrives, its text turned into the JSON value its
parameter's schema type asks for (a string otherwise). A block that never names a function is, once closed, parsed
whole (hermes: its keys in any order) or left as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from qspec.options import TOOL_CALL_PARSERS
from qspec.spec.grammar import JSON_LAYOUT, GrammarError


@dataclass(frozen=True)
class CallText:
    """A call read from its block so far: the function's name and its arguments' JSON text (complete only when the
    block is)."""
    name: str
    arguments: str


class HermesCalls:
    """{"name": ..., "arguments": {...}} blocks."""
    name = "hermes"
    # the call's head: its name, then the arguments' opening brace (where their text starts)
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

    def read(self, text: str, closed: bool) -> CallText | None:
        """The call in a block's `text` so far (all of it when `closed`), or None when it does not name one yet."""
        head = self._HEAD.match(text)
        if head is None:
            return _whole_json_call(text) if closed else None
        try:
            name = json.loads(head.group(1))
        except ValueError:  # an escape JSON has not: no call, now or once closed
            return None
        return CallText(name, text[head.end():_json_value_end(text, head.end())])

    def grammar(self, tools: list[dict[str, Any]]) -> str:
        """Lark rules (llguidance's) whose `call` is a call of one of `tools`, its arguments held to the tool's
        parameters' schema (JSON laid out as json.dumps writes it)."""
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return f"call: %json {json.dumps({'x-guidance': JSON_LAYOUT, 'anyOf': calls})}\n"


class Qwen3CoderCalls:
    """<function=NAME> blocks of <parameter=KEY> values."""
    name = "qwen3_coder"
    _HEAD = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # each function's parameters' schemas, which say what JSON a parameter's text becomes
        self.schemas = {t["function"]["name"]: _parameters(t).get("properties") or {} for t in tools or []}

    def read(self, text: str, closed: bool) -> CallText | None:
        """The call in a block's `text` so far; a parameter counts once its closing tag arrives (text between
        parameters is skipped), and the arguments close at `</function>` (or the block's end)."""
        head = self._HEAD.match(text)
        if head is None:
            return None
        name, at, pairs, ended = head.group(1).strip(), head.end(), [], closed
        schema = self.schemas.get(name, {})
        while True:
            start, end = text.find("<parameter=", at), text.find("</function>", at)
            if end >= 0 and (start < 0 or end < start):  # no parameter can start before the end any more
                ended = True
                break
            param = self._PARAM.match(text, start) if start >= 0 else None
            if param is None:  # none, or one still open
                break
            key = param.group(1).strip()
            value = _typed_value(param.group(2), schema.get(key) if isinstance(schema, dict) else None)
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            at = param.end()
        return CallText(name, ("{" + ", ".join(pairs) + ("}" if ended else "")) if pairs or ended else "")

    def grammar(self, tools: list[dict[str, Any]]) -> str:
        """Lark rules whose `call` is a call of one of `tools`: its parameters in the schema's order, the required
        ones always, a string's text free of the closing tag, other types JSON that matches their schema."""
        rules, calls = [], []
        for i, t in enumerate(tools):
            properties, required = _checked_parameters(t)
            parts = []
            for j, (key, schema) in enumerate(properties.items()):
                opener = json.dumps(f"<parameter={key}>\n")
                rules.append(f"p{i}_{j}: {opener} {_value_rule(schema)}")
                parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
            head = json.dumps(f"<function={t['function']['name']}>\n")
            rules.append(f'f{i}: {head} {" ".join(parts)} "</function>"')
            calls.append(f"f{i}")
        return "\n".join([f"call: {' | '.join(calls)}", *rules, _TEXT_RULE]) + "\n"


CallFormat = HermesCalls | Qwen3CoderCalls
# a string parameter's text: anything without a closing tag, up to its own (a lazy lexeme, ended by its suffix)
_TEXT_RULE = r'text[suffix="\n</parameter>\n"]: /(?s:.*)/ & ~/(?s:.*)<\/parameter>(?s:.*)/'
_CLOSE_PARAM = '"\\n</parameter>\\n"'


def call_format(name: str, tools: list[dict[str, Any]] | None = None) -> CallFormat:
    """The format `name` (one of options.TOOL_CALL_PARSERS) for a request offering `tools`."""
    if name == "hermes":
        return HermesCalls()
    if name == "qwen3_coder":
        return Qwen3CoderCalls(tools)
    raise ValueError(f"the tool call format must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")


def template_call_format(template: str) -> str:
    """The format a chat template asks the model to call tools in: qwen3_coder where it shows `<function=` tags."""
    return "qwen3_coder" if "<function=" in template and "<parameter=" in template else "hermes"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def _checked_parameters(tool: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A tool's parameters' (properties, required names) for qwen3_coder's grammar, or GrammarError naming what its
    tags cannot write."""
    params, name = _parameters(tool), tool["function"]["name"]
    properties, required = params.get("properties") or {}, params.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list) or \
            not all(isinstance(k, str) for k in required):
        raise GrammarError(f"tool {name!r}: its parameters' properties must be an object and required a list of "
                           "names")
    bad = next((k for k in properties if not re.fullmatch(r"[^>\s](?:[^>\n]*[^>\s])?", k)), None)
    if bad is not None:
        raise GrammarError(f"tool {name!r}: the parameter name {bad!r} cannot be written in a <parameter=...> tag "
                           "(empty, '>', a line break, or blanks at its ends)")
    return properties, set(required)


def _json_value_end(text: str, start: int) -> int:
    """Where the JSON object starting at text[start] ends (past its closing brace), or len(text) while it is open:
    braces and brackets counted outside strings."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _whole_json_call(text: str) -> CallText | None:
    """A closed block that is a JSON object with a string name and object arguments (keys in any order)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return CallText(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema names ("type": one or a list), [] where it names none."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, str):
        return [kind]
    return [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []


def _typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for: a string unless the schema names another
    type and the text is JSON of that type (as qwen3_coder's parsers in vLLM and SGLang convert it)."""
    kinds = _types(schema)
    if not kinds or "string" in kinds:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    fits = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    return value if any(fits.get(k, lambda v: False)(value) for k in kinds) else text


def _value_rule(schema: Any) -> str:
    """A parameter value's grammar: free text for a string (its enum's words where it has one), else JSON that
    matches the schema."""
    if not isinstance(schema, dict) or not _types(schema):
        return "text"
    if "string" in _types(schema):
        words = schema.get("enum")
        if isinstance(words, list) and words and all(isinstance(w, str) for w in words):
            return "(" + " | ".join(json.dumps(w) for w in words) + f") {_CLOSE_PARAM}"
        return "text"
    return f"%json {json.dumps({'x-guidance': JSON_LAYOUT} | schema)} {_CLOSE_PARAM}"
