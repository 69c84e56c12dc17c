"""OpenAI's Responses API (qspec/server/responses.py) on a tiny random model: a response is the chat endpoint's reply
to the conversation it means, whole and streamed as the Responses events; function calls and their outputs go both
ways; bad requests are a 400 naming the problem."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from conftest import named_events  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

TOOL = {"type": "function", "name": "rain", "description": "rain in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def client(tiny_api: TestClient) -> TestClient:
    return tiny_api


def _events(client: TestClient, payload: dict) -> list[tuple[str, dict]]:
    out = named_events(client, "/v1/responses", payload)
    assert [data["sequence_number"] for _, data in out] == list(range(len(out)))
    return out


def test_a_response_is_the_chat_reply(client: TestClient) -> None:
    """Instructions and text input: the output message's text and the usage are the chat endpoint's; cut by
    max_output_tokens, the response is incomplete; streamed, the text deltas add up to it between the item's
    added and done events, and the last event carries the whole response."""
    payload = {"model": "tiny", "max_output_tokens": 12, "temperature": 0, "instructions": "Be brief.",
               "input": [{"role": "user", "content": [{"type": "input_text", "text": "fn main"}, {
                   "type": "input_text", "text": "() {"}]}]}
    chat = client.post("/v1/chat/completions", json={"max_tokens": 12, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "fn main() {"}]}).json()
    resp = client.post("/v1/responses", json=payload).json()
    assert resp["object"] == "response" and resp["id"].startswith("resp_") and resp["model"] == "tiny"
    (item,) = resp["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] and resp["usage"]["output_tokens"] == 12
    assert client.post("/v1/responses", json=payload | {"input": "fn main() {"}).json()["usage"][
        "input_tokens"] == resp["usage"]["input_tokens"]
    events = _events(client, payload)
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"] and set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert text == item["content"][0]["text"] == events[-4][1]["text"]
    final = events[-1][1]["response"]
    assert final["output"][0]["content"] == item["content"] and final["usage"] == resp["usage"]


def test_function_calls_and_their_outputs(client: TestClient) -> None:
    """tool_choice required: a function_call item whose arguments follow the schema; streamed, its arguments as
    deltas; the call and a function_call_output go back as the chat endpoint's assistant and tool messages."""
    user = {"role": "user", "content": "Rain?"}
    payload = {"max_output_tokens": 160, "temperature": 0, "input": [user], "tools": [TOOL],
               "tool_choice": "required", "parallel_tool_calls": False}
    resp = client.post("/v1/responses", json=payload).json()
    (call,) = [i for i in resp["output"] if i["type"] == "function_call"]
    assert call["name"] == "rain" and json.loads(call["arguments"])["city"] in ("Oslo", "Rome")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and resp["status"] == "completed"
    events = _events(client, payload)
    added = [d["item"] for k, d in events if k == "response.output_item.added"]
    assert added[-1]["type"] == "function_call" and added[-1]["name"] == "rain"
    pieces = [d["delta"] for k, d in events if k == "response.function_call_arguments.delta"]
    assert json.loads("".join(pieces)) == json.loads(call["arguments"])
    # the next turn, as the openai SDK sends it: the call item, then its output
    turn = [user, {"type": "function_call", "call_id": call["call_id"], "name": "rain",
                   "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "dry"},
            {"role": "user", "content": "So?"}]
    r = client.post("/v1/responses", json={"max_output_tokens": 2, "input": turn, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    chat = client.post("/v1/chat/completions", json={"max_tokens": 2, "tools": [CHAT_TOOL], "messages": [
        user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call["call_id"], "type": "function", "function": {"name": "rain", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "dry"}, {"role": "user", "content": "So?"}]})
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]


def test_a_json_schema_format_holds_the_text(client: TestClient) -> None:
    """text.format json_schema: the output text is JSON that follows the schema (chat's response_format)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = client.post("/v1/responses", json={"input": "Is it?", "max_output_tokens": 40, "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}).json()
    assert isinstance(json.loads(resp["output"][0]["content"][0]["text"])["ok"], bool), resp


@pytest.mark.parametrize("change, words", [
    ({"previous_response_id": "resp_1"}, "no response 'resp_1' is kept here"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "'input_image' are not supported"),
    ({"input": [{"type": "web_search_call"}]}, "items of type 'web_search_call' are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be user, system, developer or assistant"),
    ({"input": []}, "the conversation is empty"),
    ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported"),
    ({"tool_choice": "sometimes"}, "tool_choice must be"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format must be"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort must be one of"),
    ({"temperature": 3}, "temperature"),
    ({"model": "gpt-5"}, "'gpt-5' is not served here"),
])
def test_bad_requests_are_a_4xx(client: TestClient, change: dict, words: str) -> None:
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4} | change)
    assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text


def test_instructions_and_developer_messages_are_one_system_message(client: TestClient) -> None:
    """Instructions, then developer (or system) items before the conversation, as agents send them: the chat
    endpoint's one system message, their texts joined by a blank line (the chat template takes one, first)."""
    resp = client.post("/v1/responses", json={"instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0,
                                              "input": [{"role": "developer", "content": "Use Rust."},
                                                        {"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    chat = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief.\n\nUse Rust."}, {"role": "user", "content": "hi"}]}).json()
    assert resp.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp.json()["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_a_stored_response_goes_on_by_previous_response_id(client: TestClient) -> None:
    """A stored response (the default) is kept with its conversation: a request naming it as previous_response_id
    is the chat endpoint's reply to that conversation, the response's output and the new input (instructions not
    carried over); GET returns it, DELETE forgets it; `store: false` keeps nothing."""
    first = client.post("/v1/responses", json={"instructions": "Be brief.", "input": "fn main", "temperature": 0,
                                               "max_output_tokens": 4}).json()
    said = first["output"][0]["content"][0]["text"]
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    second = client.post("/v1/responses", json={"previous_response_id": first["id"], "input": "and?",
                                                "temperature": 0, "max_output_tokens": 4}).json()
    assert second["previous_response_id"] == first["id"]
    chat = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
        {"role": "user", "content": "fn main"}, {"role": "assistant", "content": said},
        {"role": "user", "content": "and?"}]}).json()
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    # streamed, the response is kept as well; then a third turn goes on from it
    with client.stream("POST", "/v1/responses", json={"previous_response_id": second["id"], "input": "ok",
                                                      "max_output_tokens": 2, "stream": True}) as r:
        last = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")][-1]["response"]
    assert client.get(f"/v1/responses/{last['id']}").json()["output"] == last["output"]
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404
    r = client.post("/v1/responses", json={"previous_response_id": first["id"], "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = client.post("/v1/responses", json={"previous_response_id": last["id"], "input": "x"})  # its chain is broken
    assert r.status_code == 400 and f"{first['id']!r}, which {last['id']!r} goes on from" in r.json()["error"][
        "message"]
    unkept = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1, "store": False}).json()
    assert unkept["store"] is False and client.get(f"/v1/responses/{unkept['id']}").status_code == 404
