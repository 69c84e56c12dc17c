"""Shared fixtures: small random models with an MTP head, built once per session."""

from __future__ import annotations

import pytest
import torch

from qspec.config import ModelConfig, preset
from qspec.model.model import Model
from qspec.weights.random_model import random_weights

torch.set_grad_enabled(False)


def tiny_config(**kw: object) -> ModelConfig:
    """The tiny preset with a 512-token vocabulary (EOS = 511) so CPU tests run in seconds."""
    return preset("tiny", vocab_size=512, **kw)  # type: ignore[arg-type]


def build_model(cfg: ModelConfig, seed: int = 0) -> Model:
    w = dict(random_weights(cfg, seed=seed))
    return Model(cfg, w)


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    return build_model(tiny_config())
