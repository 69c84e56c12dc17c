"""qspec.weights.gguf_open: split GGUF files (llama-gguf-split's layout, as large downloads come) are written in
parts, loaded from any part, and refused with one error naming the part when one is missing, out of place or renamed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from qspec.cli import main
from qspec.config import ModelConfig, preset
from qspec.weights import WeightsError, read_gguf
from qspec.weights.gguf_io import HostRowTable, write_gguf
from qspec.weights.gguf_open import open_gguf
from qspec.weights.qweight import QuantWeight
from qspec.weights.random_model import random_weights


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return preset("tiny", vocab_size=512)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cfg: ModelConfig) -> tuple[Path, list[Path]]:
    """(the whole file, the same weights in parts of at most a quarter of the tensor bytes)."""
    d = tmp_path_factory.mktemp("split")
    w = random_weights(cfg, seed=5)
    whole = d / "whole.gguf"
    assert write_gguf(whole, cfg, w) == [whole]
    tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(whole).tensors)
    parts = write_gguf(d / "m.gguf", cfg, w, split_max_bytes=tensor_bytes // 4)
    return whole, parts


def _equal(a: object, b: object) -> bool:
    if isinstance(a, QuantWeight):
        return isinstance(b, QuantWeight) and torch.equal(a.raw, b.raw)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    assert isinstance(a, HostRowTable) and isinstance(b, HostRowTable)  # the n-gram table, rows from its part's map
    return torch.equal(a.materialize(), b.materialize())


def test_parts_are_named_and_numbered_as_llama_cpp_does(files: tuple[Path, list[Path]]) -> None:
    _, parts = files
    n = len(parts)
    assert n >= 4 and [p.name for p in parts] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert not (parts[0].parent / "m.gguf").exists()
    total = sum(len(GGUFReader(p).tensors) for p in parts)
    for i, p in enumerate(parts):
        f = GGUFReader(p).fields
        assert (f["split.no"].contents(), f["split.count"].contents(), f["split.tensors.count"].contents()) == (
            i, n, total)
        assert ("qwen4exp.block_count" in f) == (i == 0)  # the model's metadata lives in the first part


def test_any_part_loads_the_whole_model(files: tuple[Path, list[Path]]) -> None:
    whole, parts = files
    cfg0, w0 = read_gguf(whole)
    for p in (parts[0], parts[2], parts[-1]):
        cfg, w = read_gguf(p)
        assert cfg == cfg0 and list(w) == list(w0)
        assert all(_equal(w[n], w0[n]) for n in w0), p


def _copy(parts: list[Path], d: Path) -> list[Path]:
    d.mkdir()
    return [Path(shutil.copy(p, d / p.name)) for p in parts]


def test_a_missing_or_misplaced_part_is_one_error(files: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _, parts = files
    n = len(parts)
    gone = _copy(parts, tmp_path / "gone")
    gone[1].unlink()
    for p in (gone[0], gone[-1]):
        with pytest.raises(WeightsError, match=rf"part 2 of this {n}-part split GGUF is missing: .*{gone[1].name}"):
            read_gguf(p)
    swapped = _copy(parts, tmp_path / "swapped")
    swapped[2].unlink()
    shutil.copy(swapped[3], swapped[2])  # part 4's file under part 3's name
    with pytest.raises(WeightsError, match=rf"{swapped[2].name}: not part 3 of {n}"):
        read_gguf(swapped[0])
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(WeightsError, match=rf"does not end in -00001-of-{n:05d}.gguf"):
        read_gguf(renamed)


def test_make_model_writes_parts_that_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", str(tmp_path / "m.gguf"), "--vocab-size", "512", "--split-max-size", "200K"]) == 0
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) >= 2 and f"({len(parts)} parts)" in capsys.readouterr().err
    assert main(["run", "def f(x):", "--model", str(parts[-1]), "--max-tokens", "4", "--device", "cpu"]) == 0
    assert f"read from the {len(parts)} parts of a split GGUF" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["make-model", str(tmp_path / "x.gguf"), "--split-max-size", "12Q"]) == 2
    assert "not a size: '12Q'" in capsys.readouterr().err


def _arrays_file(path: Path) -> None:
    w = GGUFWriter(str(path), "qwen4exp")
    w.add_array("a.ints", [3, -1, 7])
    w.add_array("a.floats", [0.5, -2.25])
    w.add_array("a.bools", [True, False, True])
    w.add_array("a.strings", ["", "x", "\u00e9t\u00e9 \U0001f600", "ab" * 300])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_key_value("a.u8s", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    w.add_key_value("a.f64s", [1.5, 2.5], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
    w.add_string("a.after", "the fields after the arrays parse too")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def test_fast_array_parsing_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    p = tmp_path / "arrays.gguf"
    _arrays_file(p)
    ours, ref = open_gguf(p).fields, GGUFReader(p).fields
    assert list(ours) == list(ref)
    for k in ref:
        assert ours[k].types == ref[k].types and ours[k].contents() == ref[k].contents(), k
    assert ours["a.strings"].contents()[2] == "\u00e9t\u00e9 \U0001f600"
    raw = p.read_bytes()
    at = raw.index(b"a.strings") + len("a.strings") + 4 + 4 + 8  # the key, its type, the element type, the count
    (tmp_path / "cut.gguf").write_bytes(raw[:at + 20])  # the file ends inside the string array
    with pytest.raises(WeightsError, match="corrupt or truncated GGUF header.*runs past the end"):
        open_gguf(tmp_path / "cut.gguf")
