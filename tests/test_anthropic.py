"""Anthropic's Messages API (qspec/server/anthropic.py) on a tiny random model: a message is the chat endpoint's
reply to the conversation it means, whole and streamed as Anthropic's events; tool use and results go both ways;
bad requests are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from conftest import named_events  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

TOOLS = [{"name": "rain", "description": "rain in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}]


@pytest.fixture(scope="module")
def client(tiny_api: TestClient) -> TestClient:
    return tiny_api


def _events(client: TestClient, payload: dict) -> list[tuple[str, dict]]:
    return named_events(client, "/v1/messages", payload)


def test_a_message_is_the_chat_reply(client: TestClient) -> None:
    """System and user text: the message's text, usage and stop reason are the chat endpoint's, and streamed
    text deltas add up to it in one text block."""
    payload = {"model": "tiny", "max_tokens": 12, "temperature": 0, "system": "Be brief.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "fn main"}, {
                   "type": "text", "text": "() {"}]}]}
    chat = client.post("/v1/chat/completions", json={"max_tokens": 12, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "fn main() {"}]}).json()
    msg = client.post("/v1/messages", json=payload).json()
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    assert msg["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert msg["stop_reason"] == "max_tokens" and msg["stop_sequence"] is None
    assert msg["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] and msg["usage"]["output_tokens"] == 12
    count = client.post("/v1/messages/count_tokens", json={k: payload[k] for k in ("model", "system", "messages")})
    assert count.json() == {"input_tokens": chat["usage"]["prompt_tokens"]}
    events = _events(client, payload)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"] and set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["usage"]["input_tokens"] == msg["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text == msg["content"][0]["text"] and events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    # a stop sequence: its reason and the sequence
    stop = msg["content"][0]["text"][3:5]
    ended = client.post("/v1/messages", json=payload | {"stop_sequences": [stop]}).json()
    assert ended["stop_reason"] == "stop_sequence" and ended["stop_sequence"] == stop
    assert ended["content"][0]["text"] == msg["content"][0]["text"][:3]


def test_tool_use_and_its_result(client: TestClient) -> None:
    """tool_choice any: a tool_use block whose input follows the schema, stop reason tool_use; streamed, its input
    as input_json_delta pieces; the call and a tool_result go back as the chat endpoint's tool messages."""
    user = {"role": "user", "content": "Rain?"}
    payload = {"max_tokens": 160, "temperature": 0, "messages": [user], "tools": TOOLS,
               "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    msg = client.post("/v1/messages", json=payload).json()
    (use,) = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert use["name"] == "rain" and use["input"]["city"] in ("Oslo", "Rome") and msg["stop_reason"] == "tool_use"
    events = _events(client, payload)
    starts = [d["content_block"] for k, d in events if k == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "rain" and starts[-1]["id"].startswith("call_")
    pieces = [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"
              and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(pieces)) == use["input"] and len(pieces) >= 1
    # the next turn: the call and its result, as the chat endpoint's assistant and tool messages
    turn = [user, {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": [
                {"type": "text", "text": "dry"}]}, {"type": "text", "text": "So?"}]}]
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": turn, "tools": TOOLS})
    assert r.status_code == 200, r.text
    chat = client.post("/v1/chat/completions", json={"max_tokens": 2, "tools": [
        {"type": "function", "function": {"name": "rain", "description": "rain in a city",
                                          "parameters": TOOLS[0]["input_schema"]}}], "messages": [
        user, {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": use["id"], "type": "function",
             "function": {"name": "rain", "arguments": json.dumps(use["input"])}}]},
        {"role": "tool", "tool_call_id": use["id"], "content": "dry"}, {"role": "user", "content": "So?"}]}).json()
    assert r.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_a_final_assistant_message_is_the_replys_start(client: TestClient) -> None:
    """A prefill: the reply goes on from the last assistant message's text (not in the reply), as the chat endpoint
    does with continue_final_message; the prompt is the assistant's turn opened, then that text."""
    messages = [{"role": "user", "content": "fn main"}, {"role": "assistant", "content": "() {"}]
    msg = client.post("/v1/messages", json={"max_tokens": 6, "temperature": 0, "messages": messages}).json()
    chat = client.post("/v1/chat/completions", json={"max_tokens": 6, "messages": messages,
                                                     "continue_final_message": True}).json()
    assert msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    opened = client.post("/tokenize", json={"messages": messages[:1]}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": opened}).json()["prompt"] + "() {"
    want = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]
    assert chat["usage"]["prompt_tokens"] == want == msg["usage"]["input_tokens"]
    r = client.post("/v1/chat/completions", json={"messages": messages[:1], "continue_final_message": True})
    assert r.status_code == 400 and "the last message to be the assistant's" in r.json()["error"]["message"]


def test_max_tokens_past_the_context_is_what_it_leaves(client: TestClient) -> None:
    """Claude Code asks for 32,000 tokens: the reply gets the rest of the context (1,024 cells here), and stops
    there with max_tokens; a prompt that does not fit is still a 400."""
    msg = client.post("/v1/messages", json={"max_tokens": 32000, "temperature": 0, "stop_sequences": ["\n\n\n\n"],
                                            "messages": [{"role": "user", "content": "hi"}], "system": "x " * 490})
    assert msg.status_code == 200, msg.text
    used = msg.json()["usage"]
    assert used["input_tokens"] + used["output_tokens"] <= 1024 and used["output_tokens"] > 0
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x " * 1100}]})
    assert r.status_code == 400 and "capacity 1024" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' is not supported"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"temperature": 1.5}, "temperature"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice must be"),
    ({"tools": [{"description": "no name"}]}, "tools.0: a tool needs a name"),
    ({"system": [{"type": "image"}]}, "system must be a string or a list of text blocks"),
    ({"model": "claude"}, "'claude' is not served here"),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens must be an integer >= 0"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type must be enabled, adaptive or disabled"),
    # the budget reaches the chat request, whose model has no think tokens to close a block with
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "a thinking budget needs <think> and </think> tokens"),
])
def test_bad_messages_are_a_4xx(client: TestClient, change: dict, words: str) -> None:
    payload = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | change
    r = client.post("/v1/messages", json={k: v for k, v in payload.items() if v is not None})
    assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text
