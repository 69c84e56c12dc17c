"""qspec.loader as the Python API meets it: `"demo"` names the demo model as `--model demo` does, a path that is not
a regular file or directory is refused instead of blocking, and writing a random model checks the memory and disk
it needs before allocating anything."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import qspec
from qspec import loader
from qspec.cli import main
from qspec.config import preset
from qspec.weights import WeightsError


def test_demo_names_the_demo_model() -> None:
    tok = qspec.load_tokenizer("demo")
    assert tok.encode("def f():") == loader.load_tokenizer(loader.DEMO_MODEL).encode("def f():")
    model = qspec.load_model("demo")
    assert model.cfg == loader.load_model(loader.DEMO_MODEL).cfg and model.mtp is not None


def test_a_file_named_demo_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("demo").write_bytes(b"not a model")
    with pytest.raises(WeightsError, match="not a GGUF"):
        qspec.load_tokenizer("demo")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def load() -> None:
        for fn in (qspec.load_model, qspec.load_tokenizer):
            try:
                fn(fifo)
            except BaseException as e:  # noqa: BLE001 - collected for the main thread
                errors.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader so the thread can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("loading a FIFO blocked")
    assert len(errors) == 2 and all(isinstance(e, WeightsError) for e in errors), errors
    assert "not a regular file" in str(errors[0])


def test_missing_model_is_one_error() -> None:
    with pytest.raises(WeightsError, match="file not found"):
        qspec.load_model("/nonexistent/model.gguf")


def test_write_needs_follow_the_largest_tensor() -> None:
    big = preset("flash-next", layers=4, experts=16)
    peak, file_bytes, name = loader.write_needs(big, "gguf", torch.float32)
    assert name == "per_layer_token_embd.weight"
    table = 320_001_536 * 160 * 4
    assert table <= peak <= 2 * table + (1 << 30) and file_bytes > table
    small = preset("flash-next", layers=4, experts=16, ngram_vocab_base=1000)
    peak_small, file_small, _ = loader.write_needs(small, "gguf", torch.float32)
    assert peak_small < 24e9 and file_small < 24e9  # the README's example with a small n-gram table
    q4 = loader.write_needs(small, "gguf", torch.float32, loader.GGMLQuantizationType.Q4_0)[1]
    assert q4 < file_small / 4


def test_check_write_resources_names_the_shortfall(tmp_path: Path) -> None:
    big = preset("flash-next", layers=4, experts=16)
    with pytest.raises(loader.ResourceError, match=r"needs about 409\.6 GB of memory and 24\.0 GB .*ngram-vocab-base"):
        loader.check_write_resources(tmp_path / "m.gguf", big, memory=24 * 10**9, disk=10**15)
    with pytest.raises(loader.ResourceError, match=r"about 213\.2 GB on disk and 1\.0 GB is free"):
        loader.check_write_resources(tmp_path / "m.gguf", big, memory=10**15, disk=10**9)
    loader.check_write_resources(tmp_path / "m.gguf", preset("tiny"), memory=10**9, disk=10**9)


def test_make_model_refuses_before_allocating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """README's `make-model fn --preset flash-next --layers 4 --experts 16` on a 24 GB machine: one error line."""
    monkeypatch.setattr(loader, "available_memory", lambda: 24 * 10**9)
    out = tmp_path / "fn.gguf"
    assert main(["make-model", str(out), "--preset", "flash-next", "--layers", "4", "--experts", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qspec: error: ") and "GB of memory" in err[-1], err
    assert not out.exists()
