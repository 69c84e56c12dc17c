"""The HTTP server (qspec/server/app.py) on a tiny random model: the completions API returns what Engine.generate
returns, streams the same text, honours stop strings, and answers bad requests with a 4xx that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from qspec.cli import main  # noqa: E402
from qspec.engine import Engine, EngineOptions  # noqa: E402
from qspec.loader import load_model, load_tokenizer  # noqa: E402
from qspec.server.app import create_app  # noqa: E402
from qspec.spec.accept import Sampler  # noqa: E402

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
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _reference(engine, tok, PROMPT, 12)
    assert body["choices"][0]["text"] == want and want
    assert body["model"] == "tiny" and body["object"] == "text_completion"
    n_prompt = len(tok.encode(PROMPT, add_special=True))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["qspec"]["drafted"] > 0  # the engine drafted (draft=2)
    # token ids work as a prompt too
    r2 = client.post("/v1/completions", json={"prompt": tok.encode(PROMPT, add_special=True), "max_tokens": 12})
    assert r2.json()["choices"][0]["text"] == want


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
    assert choice["text"] == want and choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] < 24
    text, events = _stream(client, {"prompt": PROMPT, "max_tokens": 24, "stop": [stop, "\x00never"]})
    assert text == want and events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("payload,status,word", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 2, 9999]}, 400, "9999"),
    ({"prompt": PROMPT, "max_tokens": 500}, 400, "capacity 64"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": PROMPT, "model": "other"}, 404, "'other'"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": PROMPT, "n": 2}, 400, "n: "),
    ({"prompt": PROMPT, "logprobs": 5}, 400, "logprobs: "),
    ({"prompt": PROMPT, "echo": True}, 400, "echo: "),
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


def test_serve_cli_builds_the_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`qspec serve` loads the model and hands uvicorn an app that answers (uvicorn.run replaced by a catcher)."""
    import uvicorn

    assert main(["make-model", str(tmp_path / "m.gguf"), "--vocab-size", "512", "--seed", "5"]) == 0
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, log_level: seen.update(app=app, host=host, port=port))
    assert main(["serve", "--model", str(tmp_path / "m.gguf"), "--port", "8123", "--ctx", "64", "--draft", "1"]) == 0
    assert seen["port"] == 8123 and seen["host"] == "127.0.0.1"
    with TestClient(seen["app"]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


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
