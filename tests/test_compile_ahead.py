"""Compiling on a stand-in while the weights load (qspec/compile_ahead.py): which layers stand in, with which types,
and that the real model's request then compiles nothing and decodes as it would have."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from torch._dynamo.utils import counters

from qspec import compile_ahead as ca
from qspec.engine import Engine, EngineOptions
from qspec.loader import load_model, write_model
from qspec.model import fuse
from qspec.weights.gguf_io import read_gguf_layout
from qspec.weights.names import tensor_shapes
from qspec.weights.qweight import QuantWeight

PROMPT = list(range(3, 40))
OPTS = EngineOptions(draft=2, capacity=256, compile_backend="aot_eager")


@pytest.fixture(scope="module")
def q4km_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers in llama.cpp's Q4_K_M mix: GDN and QSA layers, the n-gram layer, and layers whose tensors take
    more bits than the others'."""
    path = tmp_path_factory.mktemp("ahead") / "tiny8-q4_k_m.gguf"
    write_model(path, tiny_config(layers=8, mtp=True), quant="q4_k_m")
    return path


def _layer_types(types: dict, i: int) -> dict:
    return {n.split(".", 2)[2]: q for n, q in types.items() if n.startswith(f"blk.{i}.")}


def test_stand_in_has_one_layer_of_each_kind(q4km_file: Path) -> None:
    cfg, types, nbytes = read_gguf_layout(q4km_file)
    layers = ca.stand_in_layers(cfg, types)
    kinds = {(cfg.layer_recurrent[i], i == cfg.ple_layer, tuple(sorted(_layer_types(types, i).items())))
             for i in range(cfg.n_layers)}
    assert len(layers) == len(kinds) < cfg.n_layers  # every kind once, and fewer layers than the file
    assert {0, cfg.ple_layer} <= set(layers) and not all(cfg.layer_recurrent[i] for i in layers)
    small = ca.stand_in_config(cfg, layers, with_mtp=True)
    plan, stand_in_bytes = ca.stand_in_plan(cfg, layers, types, nbytes)
    assert set(tensor_shapes(small)) - set(plan) <= {"per_layer_token_embd.weight"}
    for new, old in enumerate(layers):  # each stand-in layer has its source layer's types
        assert _layer_types(plan, new) == _layer_types(types, old)
    assert _layer_types(plan, small.n_layers) == _layer_types(types, cfg.n_layers)  # the MTP block
    assert 0 < stand_in_bytes < sum(nbytes.values())
    assert ca.stand_in_config(cfg, layers, with_mtp=False).n_mtp_layers == 0


def test_stand_in_model_holds_the_file_types(q4km_file: Path) -> None:
    cfg, types, nbytes = read_gguf_layout(q4km_file)
    layers = ca.stand_in_layers(cfg, types)
    plan, _ = ca.stand_in_plan(cfg, layers, types, nbytes)
    small, w = ca.stand_in_weights(cfg, layers, plan, device=torch.device("cpu"), dtype=torch.float32,
                                   with_mtp=True)
    assert set(w) == set(tensor_shapes(small))
    packed = {n: v.qtype for n, v in w.items() if isinstance(v, QuantWeight)}
    assert len(packed) > 10 and all(plan[n] == q for n, q in packed.items())


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _load(path: Path):  # type: ignore[no-untyped-def]
    return load_model(path, dequantize_all=False)


def test_real_request_compiles_nothing_after_the_stand_in(q4km_file: Path) -> None:
    """The stand-in's request compiles every graph the real model's first request needs, and the loaded model
    decodes as a plain load's does (aot_eager changes no bit: tests/test_fuse.py)."""
    ref = Engine(_load(q4km_file), replace(OPTS, compile=False)).generate(PROMPT, 12).tokens
    for f in fuse.REGISTRY:
        f.compiled.clear()
    torch._dynamo.reset()
    said: list[str] = []
    before = _graphs()
    model = ca.load_compiling_ahead(q4km_file, lambda: _load(q4km_file), OPTS, lambda cfg: PROMPT,
                                    device=torch.device("cpu"), dtype=torch.float32, with_mtp=True, say=said.append)
    assert said and "stand-in while the weights loaded" in said[-1], said
    assert _graphs() > before  # the stand-in compiled what a cold request would
    before = _graphs()
    assert Engine(model, OPTS).generate(PROMPT, 12).tokens == ref
    assert _graphs() == before


def test_a_failing_stand_in_leaves_the_load(q4km_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("stand-in broke")

    monkeypatch.setattr(ca, "warm_on_stand_in", broken)
    said: list[str] = []
    model = ca.load_compiling_ahead(q4km_file, lambda: _load(q4km_file), OPTS, lambda cfg: PROMPT,
                                    device=torch.device("cpu"), dtype=torch.float32, with_mtp=True, say=said.append)
    assert model.cfg.n_layers == 8
    assert len(said) == 1 and "stand-in broke" in said[0] and "first request compiles" in said[0]


def test_load_errors_and_prompt_errors_are_the_callers(q4km_file: Path) -> None:
    def failing_load():  # type: ignore[no-untyped-def]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        ca.load_compiling_ahead(q4km_file, failing_load, OPTS, lambda cfg: PROMPT, device=torch.device("cpu"),
                                dtype=torch.float32, with_mtp=True, say=lambda m: None)
    loads: list[int] = []

    def bad_prompt(cfg):  # type: ignore[no-untyped-def]
        raise ValueError("prompt too long")

    with pytest.raises(ValueError, match="prompt too long"):
        ca.load_compiling_ahead(q4km_file, lambda: loads.append(1), OPTS, bad_prompt, device=torch.device("cpu"),
                                dtype=torch.float32, with_mtp=True, say=lambda m: None)
    assert not loads  # nothing started


def test_block_weights_own_their_storage_without_copying_what_already_does() -> None:
    """Compiled functions guard on a view's base, so a QuantWeight's blocks never are a view; blocks that already
    have their shape and storage are kept as they are (a load does not copy each tensor twice on the device)."""
    from gguf import GGMLQuantizationType as Q

    from qspec.weights.qweight import row_bytes

    shaped = torch.zeros(4, row_bytes(Q.Q8_0, 64), dtype=torch.uint8)
    assert QuantWeight.from_blocks(shaped, Q.Q8_0, (4, 64)).raw is shaped
    for raw in (shaped.reshape(-1), shaped.reshape(-1).clone(), shaped[:, :]):
        w = QuantWeight.from_blocks(raw, Q.Q8_0, (4, 64))
        assert w.raw._base is None and tuple(w.raw.shape) == tuple(shaped.shape)
