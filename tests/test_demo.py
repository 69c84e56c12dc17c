"""The trained demo model shipped with qspec (`--model demo`, made by scripts/train_demo.py): it loads from the
package, its MTP head's own drafts are accepted (no replayed acceptance), and greedy speculative decoding equals
plain decoding token for token at every draft depth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import counters, run

from qspec.engine import Engine, EngineOptions
from qspec.loader import DEMO_MODEL, demo_model_path, load_model, load_tokenizer

PROMPT = "import os\n\n\ndef read_lines(path):\n"
# The head's first-draft acceptance on PROMPT is 0.81 (MTP1 and MTP3) and 0.76 (MTP5) with the shipped model; a
# head that stopped working (a wrong residual, wrong positions, a broken load) falls to ~0.
ACCEPTED_MIN = 0.5


@pytest.fixture(scope="module")
def demo() -> tuple:
    path = demo_model_path()
    return load_model(path, with_mtp=True), load_tokenizer(path)


def test_demo_model_is_packaged() -> None:
    assert DEMO_MODEL.is_file() and DEMO_MODEL.suffix == ".gguf"
    assert DEMO_MODEL.stat().st_size < 16 << 20  # small enough to ship in the repository


def test_demo_drafts_are_accepted_and_output_equals_plain(demo: tuple) -> None:
    model, tok = demo
    prompt = tok.encode(PROMPT)
    plain = Engine(model, EngineOptions(draft=0, capacity=512)).generate(prompt, 96)
    assert len(plain.tokens) == 96
    for n in (1, 3, 5):
        g = Engine(model, EngineOptions(draft=n, capacity=512)).generate(prompt, 96)
        assert g.tokens == plain.tokens, f"MTP{n} differs from plain decoding"
        assert g.spec.acceptance_by_position()[0] >= ACCEPTED_MIN, g.spec.as_dict()
        assert g.spec.tokens_per_round > 1.3
    # the seed's optimizations off (the baseline arm) give the same tokens with the same acceptance
    base = Engine(model, EngineOptions(draft=3, capacity=512, preserve_pooled=False, incremental_pooled=False,
                                       pad_target=None, fused_snapshots=False)).generate(prompt, 96)
    assert base.tokens == plain.tokens


def test_demo_text_is_python_like(demo: tuple) -> None:
    model, tok = demo
    g = Engine(model, EngineOptions(draft=3, capacity=512)).generate(tok.encode(PROMPT), 96)
    text = tok.decode(g.tokens)
    assert "\n" in text and any(w in text for w in ("return", "self", "if ", "for ", "def ", "import "))


def test_cli_runs_the_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "run", "def add(a, b):\n", "--model", "demo", "--draft", "3", "--max-tokens", "24")
    assert rc == 0, err
    c = counters(err)
    assert c["draft"] == 3 and c["accepted"] > 0 and out.strip()


def test_demo_sampling_is_seeded(demo: tuple) -> None:
    from qspec.spec.accept import Sampler

    model, tok = demo
    prompt = tok.encode(PROMPT)
    a = Engine(model, EngineOptions(draft=3, capacity=512)).generate(
        prompt, 32, sampler=Sampler(temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(1)))
    b = Engine(model, EngineOptions(draft=3, capacity=512)).generate(
        prompt, 32, sampler=Sampler(temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(1)))
    assert a.tokens == b.tokens and a.spec.accepted > 0


def test_train_demo_script_end_to_end(tmp_path: Path) -> None:
    """scripts/train_demo.py for a few seconds: transformers trains, the HF checkpoint with its `mtp.*` head goes
    through qspec's reader to a Q8_0 GGUF, and its checks run (qspec vs transformers, speculative vs plain)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "demo.gguf"
    r = subprocess.run([sys.executable, str(root / "scripts" / "train_demo.py"), "--out", str(out),
                        "--trunk-minutes", "0.05", "--mtp-minutes", "0.03", "--batch", "2", "--length", "64"],
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert out.is_file() and "argmax agree" in r.stdout
    assert r.stdout.count("same tokens as plain: True") == 3, r.stdout[-2000:]
    model = load_model(out, with_mtp=True)
    assert model.mtp is not None and model.cfg.vocab_size == 8192
