"""Tool call formats (qspec/server/call_formats.py) and the reply splitter over them (qspec/server/tools.py): a call
read from its block's text as it grows only ever adds to its arguments, and ends where the whole block's reading
does; qwen3_coder's parameters take their schema's JSON types; the forced-call grammars take what they should and
refuse what they should."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from qspec.server.call_formats import (
    CallText,
    HermesCalls,
    Qwen3CoderCalls,
    call_format,
    template_call_format,
)
from qspec.server.tools import ToolCallSplit, call_grammar, calls_as_mappings, merged_calls
from qspec.spec.grammar import GrammarCompiler, GrammarError, GrammarSpec, check_grammar
from tests.conftest import tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string", "enum": ["C", "F"]},
        "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
        "ratio": {"type": ["number", "null"]}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "noop"}}]

XML_CALL = ("\n<function=weather>\n<parameter=city>\nNew\nYork </parameter>\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=detail>\n{\"hourly\": true}\n</parameter>\n<parameter=ratio>\nnull\n</parameter>"
            "\n<parameter=units>\nKelvin\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n")
JSON_CALL = '\n{"name": "weather", "arguments": {"city": "a \\"}{\\" b", "n": [1, {"x": "]"}]}}\n'


def _reads_grow(fmt: HermesCalls | Qwen3CoderCalls, block: str) -> CallText:
    """Every prefix of `block` reads as a call whose arguments start the next prefix's (and the closed block's)."""
    final = fmt.read(block, closed=True)
    assert final is not None
    seen = ""
    for end in range(len(block) + 1):
        call = fmt.read(block[:end], closed=False)
        if call is None:
            assert not seen
            continue
        assert call.name == final.name and call.arguments.startswith(seen)
        assert final.arguments.startswith(call.arguments)
        seen = call.arguments
    return final


def test_hermes_passes_the_arguments_through_as_written() -> None:
    call = _reads_grow(HermesCalls(), JSON_CALL)
    assert call.name == "weather" and call.arguments == '{"city": "a \\"}{\\" b", "n": [1, {"x": "]"}]}'
    assert json.loads(call.arguments) == {"city": 'a "}{" b', "n": [1, {"x": "]"}]}
    # other key orders are read once the block is closed, their arguments as json.dumps writes them
    other = '{"arguments": {"k":1}, "name": "f"}'
    assert HermesCalls().read(other, closed=False) is None
    assert HermesCalls().read(other, closed=True) == CallText("f", '{"k": 1}')
    for bad in ("not json", '{"name": 3, "arguments": {}}', '{"name": "f", "arguments": [1]}',
                '{"name": "\\q", "arguments": {}}'):
        assert HermesCalls().read(bad, closed=True) is None


def test_qwen3_coder_types_each_parameter_by_its_schema() -> None:
    call = _reads_grow(Qwen3CoderCalls(TOOLS), XML_CALL)
    assert call.name == "weather"
    # the first closing tag ends a value; a string keeps its inner newlines; JSON of the schema's type is parsed;
    # text that is not (an enum's word or not) stays a string, and so does a parameter the schema does not name
    assert json.loads(call.arguments) == {"city": "New\nYork ", "days": 3, "detail": {"hourly": True},
                                          "ratio": None, "units": "Kelvin", "extra": "7"}
    assert list(json.loads(call.arguments)) == ["city", "days", "detail", "ratio", "units", "extra"]
    assert json.loads(Qwen3CoderCalls(TOOLS).read("<function=weather>\n<parameter=days>\nthree\n</parameter>\n"
                                                  "</function>", closed=False).arguments) == {"days": "three"}
    # no parameters; a block cut before its end closes what it has; no function tag: no call
    assert Qwen3CoderCalls().read("<function=noop>\n</function>", closed=False) == CallText("noop", "{}")
    assert Qwen3CoderCalls().read("<function=f>\n<parameter=a>\n1\n</parameter>\n<param", closed=False) == \
        CallText("f", '{"a": "1"')
    assert Qwen3CoderCalls().read("<function=f>\n<parameter=a>\n1\n</parameter>\n<param", closed=True) == \
        CallText("f", '{"a": "1"}')
    assert Qwen3CoderCalls().read('{"name": "f", "arguments": {}}', closed=True) is None


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("fmt_name, block", [("hermes", JSON_CALL), ("qwen3_coder", XML_CALL)])
def test_a_streamed_call_adds_up_to_the_whole_one(fmt_name: str, block: str, cut: int) -> None:
    """The deltas of a reply cut anywhere: the call's id and name once, then pieces of its arguments that join into
    the whole reply's; text around the calls is content; a block cut off by the reply's end keeps what it had."""
    fmt = call_format(fmt_name, TOOLS)
    text = f"So:\n<tool_call>{block}</tool_call>\n<tool_call>{block}</tool_call>\n<tool_call>nothing</tool_call>" \
           f"\n<tool_call>{block[:len(block) // 2]}"
    content, calls = ToolCallSplit(fmt).whole(text)
    assert len(calls) == 3 and content.replace("\n", "") == "So:<tool_call>nothing</tool_call>"
    assert calls[0]["function"] == calls[1]["function"] == {"name": "weather", "arguments": fmt.read(
        block, closed=True).arguments} and calls[0]["id"] != calls[1]["id"]
    assert calls[2]["function"]["arguments"] == fmt.read(block[:len(block) // 2], closed=True).arguments
    split, got, deltas = ToolCallSplit(fmt), "", []
    for i in range(0, len(text), cut):
        piece, new = split.push(text[i:i + cut])
        got, deltas = got + piece, deltas + new
    rest, more = split.flush()
    deltas += more
    assert (got + rest).replace("\n", "") == content.replace("\n", "") and len(deltas) > 3
    assert [c["function"] for c in merged_calls(deltas)] == [c["function"] for c in calls]
    assert [d["index"] for d in deltas if "id" in d] == [0, 1, 2]
    # parallel_tool_calls false: the first call only
    assert [c["function"]["name"] for c in ToolCallSplit(fmt, most=1).whole(text)[1]] == ["weather"]


@pytest.mark.parametrize("cut", range(1, 14))
def test_a_closing_tag_cut_apart_is_not_arguments(cut: int) -> None:
    """A block that closes before its arguments do: the start of `</tool_call>` that a piece ends with is held back,
    not sent as arguments that the whole reply does not have."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>\n<tool_call>\n<function=g>\n<parameter=b>\nx'
    for fmt in (HermesCalls(), Qwen3CoderCalls()):
        split, deltas = ToolCallSplit(fmt), []
        for i in range(0, len(text), cut):
            deltas += split.push(text[i:i + cut])[1]
        deltas += split.flush()[1]
        assert [c["function"] for c in merged_calls(deltas)] == [c["function"] for c in ToolCallSplit(fmt).whole(
            text)[1]]


def test_the_qwen3_coder_grammar_refuses_what_its_tags_cannot_write() -> None:
    def tool(params: dict) -> list[dict]:
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for params, words in (({"properties": [1]}, "must be an object"), ({"properties": {}, "required": "a"}, "a list"),
                          ({"properties": {"a>b": {}}}, "'a>b' cannot be written"),
                          ({"properties": {" a": {}}}, "blanks at its ends")):
        with pytest.raises(GrammarError, match=words):
            Qwen3CoderCalls(tool(params)).grammar(tool(params))


def test_the_template_says_which_format() -> None:
    assert template_call_format("... <tool_call>\\n<function=example>\\n<parameter=x>\\n...") == "qwen3_coder"
    assert template_call_format('<tool_call>\\n{"name": <function-name>, "arguments": ...}') == "hermes"
    with pytest.raises(ValueError, match="one of hermes, qwen3_coder"):
        call_format("xml")


def test_a_historys_arguments_reach_a_template_as_a_mapping() -> None:
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}
    out = calls_as_mappings(msg)
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": [1]}
    assert out["tool_calls"][1] == msg["tool_calls"][1]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": [1]}'  # the request's message is left as it was
    assert calls_as_mappings({"role": "user", "content": "x"}) == {"role": "user", "content": "x"}


@pytest.fixture(scope="module")
def matcher_for():  # noqa: ANN201
    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, 512)

    def follows(grammar: str, text: str) -> bool:
        tokens = tok.encode(text) + [tok.eos_id]
        m = LLMatcher(compiler._ll, check_grammar(GrammarSpec("lark", grammar)), log_level=0)
        return m.validate_tokens(tokens) == len(tokens)
    return follows


def test_the_qwen3_coder_grammar_holds_a_call_to_its_schema(matcher_for) -> None:  # noqa: ANN001
    g = call_grammar(Qwen3CoderCalls(TOOLS), TOOLS)
    ok = ("<tool_call>\n<function=weather>\n<parameter=city>\nSt. <parameter> Paul\n\n</parameter>\n<parameter=days>"
          "\n2\n</parameter>\n<parameter=units>\nF\n</parameter>\n</function>\n</tool_call>")
    assert matcher_for(g, ok)
    assert matcher_for(g, ok + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    assert not matcher_for(call_grammar(Qwen3CoderCalls(TOOLS), TOOLS, parallel=False),
                           ok + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    assert not matcher_for(g, ok.replace("<parameter> Paul", "</parameter> Paul"))  # a closing tag in a string
    assert not matcher_for(g, ok.replace("\n2\n", "\ntwo\n"))  # an integer's text
    assert not matcher_for(g, ok.replace("\nF\n", "\nK\n"))  # not one of the enum's words
    assert not matcher_for(g, ok.replace("<parameter=days>\n2\n</parameter>\n", ""))  # a required one missing
    assert not matcher_for(g, ok.replace("weather", "rain"))
    hermes = call_grammar(HermesCalls(), TOOLS)
    assert matcher_for(hermes, '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not matcher_for(hermes, ok)
