"""`qspec bench serve` (qspec/bench/serve.py) against a real server on a tiny model: every request is timed and
counted, failures are reported rather than raised, and the command writes its summary."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from qspec.batch import Batcher  # noqa: E402
from qspec.bench.serve import prompt_text, run_serve  # noqa: E402
from qspec.cli import main  # noqa: E402
from qspec.engine import Engine, EngineOptions  # noqa: E402
from qspec.loader import load_model, load_tokenizer  # noqa: E402
from qspec.server.app import create_app, listen_socket  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d: Path = tmp_path_factory.mktemp("bench-serve")
    assert main(["make-model", str(d / "tiny.gguf"), "--vocab-size", "512", "--seed", "3"]) == 0
    engine = Engine(load_model(d / "tiny.gguf", device="cpu"), EngineOptions(draft=2, capacity=256))
    app = create_app(engine, load_tokenizer(d / "tiny.gguf"), "tiny", batcher=Batcher(engine, 2))
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_every_request_is_timed(url: str) -> None:
    result = run_serve(url, requests=5, concurrency=2, prompt_tokens=30, max_tokens=6)
    assert result["completed"] == 5 and result["failed"] == 0 and result["output_tokens"] == 30
    for r in result["requests"]:
        assert r["output_tokens"] == 6 and r["prompt_tokens"] > 0 and 0 < r["ttft"] <= r["latency"]
        assert r["gaps"] and all(g >= 0 for g in r["gaps"])
    assert result["output_tok_per_s"] == pytest.approx(30 / result["seconds"])
    for key in ("ttft_ms", "tpot_ms", "gap_ms"):
        p = result[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    # each prompt its own slice of the merge task's text
    assert len({prompt_text(i, 30) for i in range(5)}) == 5


def test_failures_are_counted_with_their_reason(url: str) -> None:
    result = run_serve(url, requests=2, concurrency=2, prompt_tokens=30, max_tokens=6, model="other")
    assert result["completed"] == 0 and result["failed"] == 2 and "HTTP 404" in result["errors"][0]
    with pytest.raises(ValueError, match=">= 1"):
        run_serve(url, requests=0)


def test_the_command_writes_its_summary(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", url, "--requests", "2", "--concurrency", "1", "--prompt-tokens", "20",
                 "--max-tokens", "4", "--json", str(out)]) == 0
    assert "2 requests (0 failed) through 1 clients" in capsys.readouterr().out
    assert json.loads(out.read_text())["output_tokens"] == 8
    with socket.socket() as s:  # a port nothing listens on, once closed
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["bench", "serve", "--url", dead, "--requests", "1", "--max-tokens", "2"]) == 1
    assert "ConnectionRefusedError" in capsys.readouterr().out


def test_the_gpu_script_measures_each_server(tmp_path: Path) -> None:
    """scripts/serve_gpu.py at the tiny preset on the CPU: it writes the GGUF, starts `qspec serve` on it with each
    server's flags, loads it at each client count and reports every run (the GPU run: seed_protocol.sh
    gpu-serve-q4km8)."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "serve"
    r = subprocess.run([sys.executable, str(root / "scripts" / "serve_gpu.py"), "--preset", "tiny", "--layers", "2",
                        "--quant", "q8_0", "--device", "cpu", "--file", str(tmp_path / "t.gguf"), "--servers",
                        "plain=--draft 0|mtp2=--draft 2 --accept-profile p=0.85", "--concurrency", "1,2",
                        "--max-tokens", "6", "--prompt-tokens", "24", "--common", "--ctx 512", "--max-batch", "2",
                        "--port", str(port), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.with_suffix(".json").read_text())
    assert [s["server"] for s in res["servers"]] == ["plain", "mtp2"]
    for s in res["servers"]:
        assert [run["concurrency"] for run in s["runs"]] == [1, 2]
        assert all(run["failed"] == 0 and run["output_tokens"] == 6 * run["completed"] for run in s["runs"])
    table = out.with_suffix(".md").read_text()
    assert table.count("| plain |") == 2 and table.count("| mtp2 |") == 2
    assert all("qspec: serving" in (tmp_path / f"serve-{n}.log").read_text() for n in ("plain", "mtp2"))
