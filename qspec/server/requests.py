"""The request bodies the server accepts, validated by pydantic so that a bad value is a 400 naming the field.

Unknown fields are refused (a typo or an option this server lacks must not be ignored silently). OpenAI options that
this engine cannot honour (the deprecated function calls) are accepted only at the value that changes nothing, so a
client that asks for more gets a 400 instead of a silently different answer. Text must be valid Unicode: a lone
surrogate (which JSON's `\\ud800` escapes can carry) is refused rather than replaced, so the model never sees text the
client did not send.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from qspec.chat_template import TEMPLATE_VARIABLES
from qspec.server.call_formats import CallFormat, HermesCalls
from qspec.server.tools import call_grammar, check_tool_choice, check_tools, forced_tools
from qspec.spec.grammar import GrammarError, GrammarSpec, check_grammar
from qspec.spec.logit_rules import MAX_PENALTY, LogitRules
from qspec.spec.logprobs import MAX_TOP

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
# the most choices a request may ask for: each is a generation of its own (the prompt's prefill is shared)
MAX_CHOICES = 16
# the most prompts one completions request may batch (answered one after the other, each with its `n` choices)
MAX_PROMPTS = 64

# option -> (the values that change nothing, why other values are refused)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "function calls are not supported (tools are)"),
    "function_call": ((None, "none"), "function calls are not supported (tools are)"),
}
# a request's `tools`, each checked (qspec/server/tools.py)
ToolList = Annotated[list[dict[str, Any]], AfterValidator(check_tools)]
# vLLM's names for a grammar (`structured_outputs`' keys, and the older `guided_*` fields) -> GrammarSpec's kinds
_GRAMMAR_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "lark"}
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", *(f"guided_{k}" for k in _GRAMMAR_KEYS))


def _unsupported(name: str, value: Any) -> Any:
    neutral, why = _NEUTRAL[name]
    # compared with their types: False == 0, but `logprobs: 0` asks for log-probabilities
    if any(type(value) is type(n) and value == n for n in neutral):
        return value
    shown = "true" if value is True else "false" if value is False else repr(value)
    raise PydanticCustomError("unsupported_value", "{error}", {"error": f"{shown} is not supported: {why}"})


def valid_unicode(text: str) -> str:
    """`text`, or ValueError naming the first lone surrogate (the tokenizer cannot encode one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start} "
                         "(text must be valid Unicode)") from None
    return text


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


class Sampling(BaseModel):
    """The options both endpoints share."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: only with `echo` (CompletionServer.prompt_ids)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # the last event carries `usage` whatever it says
    user: str | None = None  # names the caller in OpenAI's logs; nothing to do here
    n: int = Field(1, ge=1, le=MAX_CHOICES, strict=True)  # choices, generated one after the other
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> added to its logit
    # beyond OpenAI's API, as vLLM and llama.cpp's server take them
    stop_token_ids: list[StrictInt] | None = None  # token ids that end the generation, besides the tokenizer's
    ignore_eos: bool = Field(False, strict=True)  # the tokenizer's stop tokens do not end it (benchmarks)
    min_tokens: int = Field(0, ge=0, strict=True)  # the stop ids cannot end a choice before this many tokens
    top_k: int = Field(0, ge=0, strict=True)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    # vLLM's: tokens the reply may think before its think block is closed for it (serve --reasoning-budget otherwise)
    thinking_token_budget: int | None = Field(None, ge=0, strict=True)
    # structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (at most one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator(*_GRAMMAR_FIELDS)
    @classmethod
    def _grammar(cls, value: Any, info: Any) -> Any:
        try:
            spec = _grammar_of(info.field_name, value)
            if spec is not None:
                check_grammar(spec)  # all but what needs the tokenizer (CompletionServer.grammar)
        except GrammarError as e:
            raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _one_grammar(self) -> Sampling:
        given = self.grammar_fields()
        if len(given) > 1:
            raise PydanticCustomError("value_error", "{error}", {"error": f"{' and '.join(given)}: give one of them"})
        if given and (self.ignore_eos or self.min_tokens):
            raise PydanticCustomError("value_error", "{error}", {
                "error": f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be used with {given[0]}: a "
                         "structured output ends on a stop token where its grammar does"})
        return self

    def grammar_fields(self) -> list[str]:
        """The fields that ask for structured output (one at most, once validated)."""
        return [f for f in _GRAMMAR_FIELDS if getattr(self, f) not in (None, {"type": "text"})]

    def grammar_spec(self, calls: CallFormat | None = None) -> GrammarSpec | None:
        """What the output must match (qspec/spec/grammar.py), or None (free text); `calls`: the format of a chat
        reply's tool calls."""
        given = self.grammar_fields()
        return _grammar_of(given[0], getattr(self, given[0])) if given else None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((key for key in bias or {} if not key.isdecimal()), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (decimal integers), got {bad!r}")
        LogitRules(logit_bias={int(k): v for k, v in (bias or {}).items()})  # its check of the values' range
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        bad = next((t for t in ids or [] if t < 0), None)
        if bad is not None:
            raise ValueError(f"token ids must be >= 0, got {bad}")
        return ids

    def stop_ids(self, tokenizer_stops: frozenset[int] | set[int]) -> set[int]:
        """The ids that end a choice: the tokenizer's (unless ignore_eos) and stop_token_ids."""
        return (set() if self.ignore_eos else set(tokenizer_stops)) | set(self.stop_token_ids or [])

    def logit_rules(self) -> dict[str, Any]:
        """The LogitRules (qspec/spec/logit_rules.py) this request asks for, as keywords."""
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()} or None,
                "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens}

    @field_validator("functions", "function_call", check_fields=False)
    @classmethod
    def _neutral_only(cls, value: Any, info: Any) -> Any:
        return _unsupported(info.field_name, value)

    def logprob_top(self) -> int | None:
        """How many top alternatives each token's log-probability comes with, or None: no log-probabilities."""
        raise NotImplementedError

    def echoes(self) -> bool:
        """Whether each choice's text starts with the prompt (`echo`, completions only)."""
        return False

    def candidates(self) -> int:
        """Choices generated per prompt (CompletionRequest's best_of may ask for more than it returns)."""
        return self.n

    def scores_prompt(self, max_tokens: int) -> bool:
        """Whether the prompt's own log-probabilities are returned: an echoed prompt, with log-probabilities or
        alone (max_tokens 0, how evaluation harnesses score a text)."""
        return self.echoes() and (self.logprob_top() is not None or max_tokens == 0)

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int | None) -> int | None:
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(f"must fit in 64 bits ({SEED_MIN} .. {SEED_MAX}), got {seed}")
        return seed

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in stop_strings(stop)):
            raise ValueError("stop strings must not be empty")
        return stop


class CompletionRequest(Sampling):
    prompt: Any = Field(description="text, or a list of token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP, strict=True)  # the top alternatives to return
    echo: bool = Field(False, strict=True)  # the prompt before the completion, with its log-probabilities
    # candidates generated per prompt, of which the n with the highest mean log-probability per token are returned
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True)
    suffix: str | None = None  # fill in the middle: the completion goes between the prompt and this text

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, suffix: str | None) -> str | None:
        return None if suffix is None else valid_unicode(suffix)

    def logprob_top(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return self.echo

    def candidates(self) -> int:
        return self.best_of or self.n

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.suffix and self.echo:
            raise PydanticCustomError("value_error", "{error}", {
                "error": "echo cannot be used with suffix (the prompt is not the text before the completion)"})
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError("value_error", "{error}", {
                "error": f"best_of ({self.best_of}) must be >= n ({self.n})"})
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise PydanticCustomError("value_error", "{error}", {
                "error": "best_of > n cannot be streamed (the best are known only at the end)"})
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int] | list[str | list[int]]:
        """A prompt (a string or a list of token ids) or a batch of them (a list of either, at most MAX_PROMPTS)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"a batch of {len(prompt)} prompts: at most {MAX_PROMPTS} a request")
            return [_one_prompt(p, f"prompt {i}: ") for i, p in enumerate(prompt)]
        return _one_prompt(prompt, "")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch's."""
        one = isinstance(self.prompt, str) or all(type(t) is int for t in self.prompt)
        return [self.prompt] if one else list(self.prompt)


def _grammar_of(field: str, value: Any) -> GrammarSpec | None:
    """The GrammarSpec a structured-output field asks for (None: free text), or GrammarError."""
    if value is None or value == {"type": "text"}:
        return None
    if field == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return GrammarSpec("json", {"type": "object"})
        if kind != "json_schema":
            raise GrammarError(f"type must be text, json_object or json_schema, got {kind!r}")
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise GrammarError('json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return GrammarSpec("json", inner["schema"])
    if field == "structured_outputs":
        keys = [k for k in _GRAMMAR_KEYS if value.get(k) is not None]
        if len(keys) != 1 or set(value) - set(_GRAMMAR_KEYS):
            raise GrammarError(f"give exactly one of {', '.join(_GRAMMAR_KEYS)}, got {', '.join(value) or 'none'}")
        return _spec(_GRAMMAR_KEYS[keys[0]], value[keys[0]])
    return _spec(_GRAMMAR_KEYS[field.removeprefix("guided_")], value)


def _spec(kind: str, value: Any) -> GrammarSpec:
    """A GrammarSpec; a JSON schema may come as JSON text."""
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    return GrammarSpec(kind, value)


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return valid_unicode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list):
        bad = next(t for t in prompt if type(t) is not int)
        raise ValueError(f"{where}a list prompt must hold token ids (integers), got {bad!r}")
    raise ValueError(f"{where}must be a string or a list of token ids, got {type(prompt).__name__}")


class ChatMessage(BaseModel):
    # other keys are ignored: clients send back earlier replies whole (`refusal: null`, `tool_calls: null`, ...)
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Any = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls (qspec/server/tools.py)
    tool_call_id: str | None = None  # a tool message's answer to one
    # an assistant message's thinking, as --reasoning-parser returns it: a model's own template may write it back
    # (qspec's Qwen format leaves earlier turns' thinking out)
    reasoning_content: str | None = None

    @field_validator("reasoning_content")
    @classmethod
    def _reasoning(cls, text: str | None) -> str | None:
        return None if text is None else valid_unicode(text)

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str | None:
        """A string, or OpenAI's list of content parts of which only text parts are supported (joined)."""
        if content is None or isinstance(content, str):
            return None if content is None else valid_unicode(content)
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return valid_unicode("".join(str(p.get("text", "")) for p in content))
        raise ValueError("must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...}); "
                         "images and other parts are not supported")


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP, strict=True)
    tools: ToolList | None = None  # qspec/server/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool = Field(True, strict=True)  # false: one call at most (a forced one's grammar, the reply)
    functions: Any = None
    function_call: Any = None
    # vLLM's: {"enable_thinking": bool}, and for a model's own template (qspec/chat_template.py) its other variables
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reply goes on from the last message, the assistant's text so far (a prefill), not a new turn
    continue_final_message: bool = Field(False, strict=True)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kw: dict[str, Any] | None) -> dict[str, Any] | None:
        bad = next((k for k in kw or {} if k in TEMPLATE_VARIABLES), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is set by the server, not by chat_template_kwargs")
        if not isinstance((kw or {}).get("enable_thinking", False), bool | None):
            raise ValueError(f"enable_thinking must be true or false, got {kw['enable_thinking']!r}")  # type: ignore
        return kw

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any) -> str | dict[str, Any] | None:
        return check_tool_choice(choice)

    @model_validator(mode="after")
    def _tools_to_call(self) -> ChatRequest:
        try:
            forced_tools(self.tools, self.tool_choice)
        except ValueError as e:
            raise PydanticCustomError("value_error", "{error}", {"error": str(e)}) from None
        return self

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools one of which the reply must call (tool_choice "required" or a named function), or None."""
        return forced_tools(self.tools, self.tool_choice) if self.tools else None

    def grammar_fields(self) -> list[str]:
        """The fields that ask for structured output, tool_choice among them where it forces a call."""
        return super().grammar_fields() + (["tool_choice"] if self.forced_tools() else [])

    def grammar_spec(self, calls: CallFormat | None = None) -> GrammarSpec | None:
        """What the output must match: under a forced tool call, the tools' calls in the format `calls` (hermes
        unless given; qspec/server/tools.py)."""
        forced = self.forced_tools()
        if not forced:
            return super().grammar_spec()
        return GrammarSpec("lark", call_grammar(calls or HermesCalls(), forced, self.parallel_tool_calls))

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers the model, whose calls the reply is parsed for: none with tool_choice
        "none"."""
        return self.tools or None if self.tool_choice != "none" else None

    def enable_thinking(self) -> bool | None:
        """True opens the reply's think block in the prompt, False closes an empty one there, None: neither."""
        return (self.chat_template_kwargs or {}).get("enable_thinking")

    def template_variables(self) -> dict[str, Any]:
        """chat_template_kwargs but enable_thinking: variables for a model's own template."""
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "enable_thinking"}

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise PydanticCustomError("value_error", "{error}", {
                "error": f"max_tokens ({a}) and max_completion_tokens ({b}) disagree: give one of them"})
        if a is None:
            self.max_tokens = b
        if self.continue_final_message and (self.messages[-1].role != "assistant" or self.messages[-1].tool_calls):
            raise PydanticCustomError("value_error", "{error}", {
                "error": "continue_final_message needs the last message to be the assistant's text"})
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("value_error", "{error}", {
                "error": f"top_logprobs ({self.top_logprobs}) needs logprobs: true"})
        return self

    def logprob_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """/tokenize (vLLM's shape): a prompt's tokens, or a conversation's through the chat template (with `tools`, as
    a chat request offers them)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: ToolList | None = None
    add_special_tokens: bool = Field(True, strict=True)

    @field_validator("prompt")
    @classmethod
    def _text(cls, prompt: str | None) -> str | None:
        return None if prompt is None else valid_unicode(prompt)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("value_error", "{error}", {"error": "give one of prompt and messages"})
        return self


class DetokenizeRequest(BaseModel):
    """/detokenize (vLLM's shape): token ids -> text."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]
