"""qspec.weights.finite: a NaN or an infinity in a loaded weight is one WeightsError naming the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from qspec.loader import load_model, write_model
from qspec.weights import WeightsError
from qspec.weights import finite as fin
from qspec.weights.finite import F16_FIELDS, check_finite, nonfinite_blocks, nonfinite_floats
from qspec.weights.quantize import QUANTIZERS, quantize
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight

INF, NAN, LARGEST = 0x7C00, 0x7E00, 0x7BFF  # f16 bit patterns


def _weight(qt: Q, rows: int = 6, k: int = 512) -> QuantWeight:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(int(qt)))
    return QuantWeight.from_blocks(quantize(x, qt), qt, (rows, k))


def _set_f16(w: QuantWeight, row: int, block: int, field: int, bits: int) -> None:
    at = block * GGML_QUANT_SIZES[w.qtype][1] + field
    w.raw[row, at], w.raw[row, at + 1] = bits & 0xFF, bits >> 8


@pytest.mark.parametrize("qt", sorted(PACKED_QTYPES & QUANTIZERS), ids=lambda q: q.name)
def test_every_f16_field_of_every_packed_type_is_read(qt: Q) -> None:
    assert not bool(nonfinite_blocks(_weight(qt)))
    for field in F16_FIELDS[qt]:
        for bits in (INF, NAN, INF | 0x8000):
            w = _weight(qt)
            _set_f16(w, 4, 1, field, bits)
            assert bool(nonfinite_blocks(w)), (field, hex(bits))
            assert bool(nonfinite_blocks(w.rows(3, 6))) and not bool(nonfinite_blocks(w.rows(0, 3)))  # row views
        w = _weight(qt)
        _set_f16(w, 4, 1, field, LARGEST)  # large but finite
        assert not bool(nonfinite_blocks(w))


def test_float_tensors_checked_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fin, "_CHUNK", 7)
    t = torch.randn(5, 9)
    assert not bool(nonfinite_floats(t))
    for v in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[4, 8] = v  # in the last part
        assert bool(nonfinite_floats(u))
    assert bool(nonfinite_floats(torch.full((3,), float("nan"), dtype=torch.bfloat16)))


def test_check_names_the_first_bad_tensor_once_per_storage() -> None:
    good, bad = torch.ones(4, 4), torch.ones(4, 4)
    bad[1, 2] = float("nan")
    check_finite({"a": good, "b": good, "ids": torch.arange(3)}, "x.gguf")
    with pytest.raises(WeightsError, match=r"x.gguf: tensor 'b' holds NaN or infinite numbers"):
        check_finite({"a": good, "b": bad, "c": bad}, "x.gguf")
    w = _weight(Q.Q4_K)
    _set_f16(w, 0, 0, 2, NAN)  # dmin
    with pytest.raises(WeightsError, match=r"tensor 'q' holds NaN or infinite Q4_K block scales"):
        check_finite({"a": good, "q": w}, "x.gguf")


def _corrupt_gguf(path: Path, name: str, byte: int, bits: int) -> None:
    """Write f16 `bits` at byte offset `byte` of tensor `name`'s data in the file."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    at = int(t.data_offset) + byte
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.array([bits], dtype=np.uint16).tobytes())


@pytest.mark.parametrize("mix", ["q4_k_m", None], ids=["q4_k_m", "f32"])
def test_a_corrupt_gguf_is_refused_at_load(mix: str | None, tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256), quant=mix)
    load_model(p, dequantize_all=False)  # the intact file loads
    name = "blk.1.ffn_down_exps.weight"
    qt = next(t.tensor_type for t in GGUFReader(p).tensors if t.name == name)
    assert qt == (Q.Q4_K if mix else Q.F32)
    # Q4_K: the second super-block's d; F32: the upper half of the 3rd number (an f32 NaN's top 16 bits)
    _corrupt_gguf(p, name, 144 if mix else 10, NAN if mix else 0x7FC0)
    for expand in (False, True):  # as blocks (their scales read) and expanded to floats
        with pytest.raises(WeightsError, match=f"tensor '{name}' holds NaN or infinite"):
            load_model(p, dequantize_all=expand)


def test_a_nan_in_an_hf_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    write_model(d, tiny_config(), fmt="hf")
    f = d / "model.safetensors"
    sd = load_file(f)
    key = "model.layers.0.linear_attn.in_proj_z.weight"
    sd[key][3, 5] = float("inf")
    save_file(sd, f)
    with pytest.raises(WeightsError, match="tensor 'blk.0.attn_gate.weight' holds NaN or infinite numbers"):
        load_model(d)
