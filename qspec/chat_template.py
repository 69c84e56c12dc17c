"""A model's own chat template: the Jinja text its file carries (a GGUF's `tokenizer.chat_template`, an HF dir's
tokenizer_config.json or chat_template.jinja), rendered as transformers renders it: a sandbox, `trim_blocks` and
`lstrip_blocks`, the `break`/`continue` extension, and the globals and filters chat templates use (`tojson` as
json.dumps with non-ASCII kept, `raise_exception`, `strftime_now`).

Tokenizer.apply_chat_template renders through here when the model's template is not qspec's own (QWEN_CHAT_TEMPLATE,
which it writes in Python); `--chat-template builtin` uses qspec's own whatever the file carries.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the variables the renderer sets itself (a request's own variables may not replace them)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})


class ChatTemplateError(ValueError):
    """A chat template that does not parse, fails while rendering, or refuses the conversation
    (its `raise_exception`)."""


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compiled(source: str) -> jinja2.Template:
    """`source` parsed once (ChatTemplateError naming the line where it does not parse)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: line {e.lineno}: {e.message}") from None


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           enable_thinking: bool | None, tools: Sequence[Mapping[str, Any]] | None,
           special_tokens: Mapping[str, str], variables: Mapping[str, Any] | None = None) -> str:
    """The conversation through template `source`. enable_thinking None leaves the variable undefined, as a client
    that does not set it does; special_tokens (bos_token, eos_token) are variables too, as transformers passes them;
    `variables`: the caller's own (a request's chat_template_kwargs; none of TEMPLATE_VARIABLES)."""
    extra = {**(variables or {}), **({} if enable_thinking is None else {"enable_thinking": enable_thinking})}
    try:
        return compiled(source).render(messages=list(messages), tools=list(tools) if tools else None,
                                       add_generation_prompt=add_generation_prompt, **special_tokens, **extra)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None
