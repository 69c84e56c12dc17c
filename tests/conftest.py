"""Shared fixtures: small random models with an MTP head, built once per session."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qspec.config import ModelConfig, preset
from qspec.model.model import Model
from qspec.weights.random_model import random_weights

torch.set_grad_enabled(False)


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


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    return build_model(tiny_config())
