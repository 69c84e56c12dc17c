"""Routed experts kept in host memory (qspec/weights/host_experts.py, `--host-experts N`): which tensors go, the fit
check that names the fewest layers, the load that places them (the same bytes, in the arena, the MTP block's
left on the device), a corrupt scale named as it is placed; on the GPU, decoding with them equals decoding without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from gguf import GGMLQuantizationType as Q

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.loader import load_model, write_model
from qspec.model.model import block_layout
from qspec.weights import WeightsError, read_gguf
from qspec.weights.dequant import quantize_q8_0
from qspec.weights.gguf_io import check_weights_fit
from qspec.weights.host_experts import HostExperts, expert_layer, fewest_layers, host_expert_names
from qspec.weights.qweight import QuantWeight

CFG = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)  # rows of whole K-quant super-blocks


@pytest.fixture(scope="module")
def q4km(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("host") / "m.gguf"
    write_model(path, CFG, quant="q4_k_m")
    return path


def test_which_tensors_go_to_the_host() -> None:
    names = host_expert_names(2, 4)
    assert names == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down")}
    assert host_expert_names(0, 4) == frozenset()
    for bad in (-1, 5):
        with pytest.raises(WeightsError, match=f"--host-experts {bad}: the model has 4 layers"):
            host_expert_names(bad, 4)
    assert expert_layer("blk.12.ffn_down_exps.weight") == 12
    assert expert_layer("blk.12.ffn_down_shexp.weight") is None and expert_layer("output.weight") is None
    assert fewest_layers([3, 3, 3], 5) == 2 and fewest_layers([3, 3], 7) is None and fewest_layers([3], 0) == 0


def test_the_fit_check_names_the_fewest_host_layers(tmp_path: Path) -> None:
    """Weights that do not fit: the error names the fewest first layers whose experts, in host memory, make them fit
    with two layers' worth kept free on the device; with that many the check passes."""
    cuda, by_layer = torch.device("cuda"), [10, 10, 10, 10]
    with pytest.raises(WeightsError, match=r"or --host-experts 3 \(the routed experts of the first 3 layers"):
        check_weights_fit(tmp_path / "m.gguf", 100, cuda, free=90, experts_by_layer=by_layer)
    check_weights_fit(tmp_path / "m.gguf", 100, cuda, free=90, experts_by_layer=by_layer, host_layers=3)
    with pytest.raises(WeightsError, match=r"with the first layer's routed experts in host memory .*--host-experts 3"):
        check_weights_fit(tmp_path / "m.gguf", 100, cuda, free=90, experts_by_layer=by_layer, host_layers=1)
    with pytest.raises(WeightsError, match=r"a GPU with more memory$"):  # even all of them would not do
        check_weights_fit(tmp_path / "m.gguf", 100, cuda, free=50, experts_by_layer=by_layer)


def test_the_fit_check_counts_each_layers_experts(q4km: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's fit check gets each trunk layer's routed-expert bytes (the MTP block's left out) and the layers
    asked for the host."""
    from qspec.weights import gguf_io

    seen: dict[str, object] = {}
    monkeypatch.setattr(gguf_io, "check_weights_fit", lambda path, need, device, **kw: seen.update(kw))
    _, w = read_gguf(q4km, host=HostExperts(1, block_layout, pin=False))
    want = [sum(w[f"blk.{i}.ffn_{p}_exps.weight"].nbytes for p in ("gate", "up", "down"))
            for i in range(CFG.n_layers)]
    assert seen == {"experts_by_layer": want, "host_layers": 1} and all(want)


def test_a_load_places_the_first_layers_experts(q4km: Path) -> None:
    """The first layer's routed experts load into the arena as the same bytes (layout unchanged on the CPU); every
    other tensor, the MTP block's experts among them, loads as before."""
    _, plain = read_gguf(q4km)
    host = HostExperts(1, block_layout, pin=False)
    _, w = read_gguf(q4km, host=host)
    assert set(w) == set(plain)
    arena = {p.untyped_storage().data_ptr() for p in host.pieces}
    placed = {n for n, v in w.items() if isinstance(v, QuantWeight) and v.raw.untyped_storage().data_ptr() in arena}
    assert placed == host_expert_names(1, CFG.n_layers) and len(host.pieces) == 1
    assert host.nbytes == sum(w[n].nbytes for n in placed)
    for n, v in w.items():
        if isinstance(v, QuantWeight):
            assert (v.qtype, v.shape, v.planes) == (plain[n].qtype, plain[n].shape, plain[n].planes)
            assert torch.equal(v.raw, plain[n].raw), n
    assert "routed experts of layer 0 in page-locked host memory" in host.describe()
    with pytest.raises(WeightsError, match=f"the model has {CFG.n_layers} layers"):
        read_gguf(q4km, host=HostExperts(CFG.n_layers + 1, block_layout, pin=False))


def test_a_nan_scale_is_named_as_it_is_placed() -> None:
    host = HostExperts(1, block_layout, pin=False)
    host.bind(2)
    raw = quantize_q8_0(torch.randn(2, 32, 64) / 8).reshape(2, 32, 68)
    raw[1, 3, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # a Q8_0 block's f16 scale: NaN
    w = QuantWeight.from_blocks(raw, Q.Q8_0, (2, 32, 64))
    assert host.place("blk.1.ffn_up_exps.weight", w, "m.gguf") is w  # not a host layer: left as it is
    with pytest.raises(WeightsError, match=r"m\.gguf: tensor 'blk\.0\.ffn_up_exps\.weight' holds NaN"):
        host.place("blk.0.ffn_up_exps.weight", w, "m.gguf")
    with pytest.raises(WeightsError, match="keeps GGUF block experts"):
        host.place("blk.0.ffn_gate_exps.weight", torch.zeros(2, 32, 64), "m.gguf")


def test_too_little_host_memory_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a page-locked piece is asked for, the host's available memory is checked: too little is an OSError
    (one line from the CLI) naming both sizes, not an allocator's failure."""
    from qspec.weights import host_experts

    monkeypatch.setattr(host_experts, "available_host_bytes", lambda: 2 << 30)
    host = HostExperts(1, block_layout)
    host.bind(2)
    w = QuantWeight.from_blocks(quantize_q8_0(torch.randn(2, 32, 64) / 8).reshape(2, 32, 68), Q.Q8_0, (2, 32, 64))
    with pytest.raises(host_experts.HostMemoryError, match=r"--host-experts 1: another 1\.1 GB of page-locked host "
                                                           r"memory is needed beside 9 GB to spare; 2\.1 GB"):
        host.place("blk.0.ffn_down_exps.weight", w, "m.gguf")


def test_host_experts_need_cuda(q4km: Path) -> None:
    with pytest.raises(WeightsError, match="--host-experts 1: applies to GGUF block experts on CUDA"):
        load_model(q4km, host_experts=1)


@pytest.mark.cuda
def test_cuda_host_experts_decode_as_device_experts(q4km: Path) -> None:
    """On the GPU, in CUDA graphs, with the first layer's routed experts in page-locked memory read over PCIe (and
    copied in for the prefill): plain decoding's logits are bit-equal to the all-device model's (both with the
    shared expert apart, which a host layer keeps: its experts cannot take it in), MTP3 keeps plain's tokens, and
    in row-exact mode MTP3, plain decoding and the all-device model give the same tokens."""
    from test_gpu_engine import NEAR_TIE, same_or_tie

    model = load_model(q4km, device="cuda", host_experts=1)
    ref = load_model(q4km, device="cuda")
    first = model.moe[0]
    assert first.gate.raw.is_pinned() and first.down.raw.is_pinned() and first.merged is None
    assert not model.moe[1].gate.raw.is_pinned() and model.graph_safe
    assert "routed experts of layer 0 in page-locked host memory" in model.weights_summary
    prompt = list(range(3, 40))  # a prefill step of more rows than the few-token kernels take
    runs = [Engine(m, EngineOptions(draft=0, capacity=128, shared_pair=False), EngineHooks(record_logits=True))
            .generate(prompt, 16) for m in (model, ref)]
    assert runs[0].tokens == runs[1].tokens and runs[0].graphs["replays"] > 0
    for a, b in zip(runs[0].logits, runs[1].logits, strict=True):
        assert torch.equal(a, b)
    spec = Engine(model, EngineOptions(draft=3, capacity=128)).generate(prompt, 16)
    plain = Engine(model, EngineOptions(draft=0, capacity=128), EngineHooks(record_logits=True)).generate(prompt, 16)
    ok, why = same_or_tie(spec.tokens, plain, 3, NEAR_TIE)
    assert ok, why
    # row-exact mode (each verify row computed as a decode row, the host's experts read one token at a time): MTP3's
    # tokens are plain decoding's, and both are the all-device model's
    exact = [Engine(m, EngineOptions(draft=d, capacity=128, exact=True)).generate(prompt, 16).tokens
             for m, d in ((model, 3), (model, 0), (ref, 0))]
    assert exact[0] == exact[1] == exact[2], exact
