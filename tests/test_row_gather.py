"""The n-gram table gathered by the device from page-locked host memory (kernels/row_gather.py, weights/pinned.py).

On the CPU: the reference against plain indexing, the piece split, `PinnedRowTable` against `HostRowTable` for every
row type, and a model with each table giving the same logits. The Triton kernel runs through the interpreter:
`test_interpreted` runs this file's `interp` tests in a subprocess with TRITON_INTERPRET=1 (read when kernels are
decorated). The `cuda` tests capture the gather from a pinned table in a CUDA graph and run a host-table model with
graphs against the device-table model.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_interp_tests, tiny_config
from gguf import GGMLQuantizationType as Q

from qspec.kernels.row_gather import RowPieces, gather_leading_rows, gather_rows, gather_rows_torch
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.model import model as model_mod
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights.gguf_io import PLE_TABLE, HostRowTable
from qspec.weights.pinned import PinnedRowTable, pin_segments
from qspec.weights.quantize import quantize
from qspec.weights.random_model import random_weights

interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")
# every type a table may have; a Q8_0 row of 160 is 170 bytes and a Q4_0 row 90, neither a multiple of 4
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0]
_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def raw_table(qt: Q, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A random [rows, cols] table as its raw GGML row bytes (uint8 [rows, row_bytes])."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    if qt in _TORCH:
        t = x.to(_TORCH[qt])
        return (t.view(torch.int16) if qt == Q.BF16 else t).view(torch.uint8).reshape(rows, -1)
    return quantize(x, qt).reshape(rows, -1)


def split(raw: torch.Tensor, *cuts: int) -> list:
    """The table as numpy segments cut at `cuts` (as HF shards stack), views of raw."""
    bounds = [0, *cuts, raw.shape[0]]
    return [raw[a:b].numpy() for a, b in zip(bounds, bounds[1:], strict=False)]


def some_rows(n: int, count: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(seed))


# ---- in this process ---------------------------------------------------------------------------------------------

def test_reference_indexes_across_pieces_and_zeroes_rows_out_of_range() -> None:
    raw = raw_table(Q.Q8_0, 23, 160)
    t = RowPieces.of(list(raw.split(5)), 5, "cpu")
    assert t.n_rows == 23 and t.row_bytes == 170
    rows = torch.tensor([0, 4, 5, 9, 10, 22, 13, -1, 23, 1 << 40])
    got = gather_rows_torch(t, rows)
    assert torch.equal(got[:7], raw[rows[:7]])
    assert not got[7:].any()


def test_pieces_must_be_whole_and_uniform() -> None:
    raw = raw_table(Q.F16, 10, 32)
    with pytest.raises(ValueError, match="piece 0"):
        RowPieces.of([raw[:3], raw[3:]], 4, "cpu")
    with pytest.raises(ValueError, match="at least one piece"):
        RowPieces.of([], 4, "cpu")


def test_pin_segments_cuts_pieces_across_segment_boundaries() -> None:
    raw = raw_table(Q.Q4_0, 50, 64)  # 36-byte rows
    pieces, per = pin_segments(split(raw, 7, 8, 31), raw.shape[1], pin=False, piece_bytes=36 * 12 + 5)
    assert per == 12 and [p.shape[0] for p in pieces] == [12, 12, 12, 12, 2]
    assert torch.equal(torch.cat(pieces), raw)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_pinned_table_equals_the_host_table(qt: Q) -> None:
    raw = raw_table(qt, 41, 160)
    segs = split(raw, 17)
    host = HostRowTable(segs, qt, 160)
    pinned = PinnedRowTable.from_segments(segs, qt, 160, "cpu", piece_bytes=raw.shape[1] * 8)
    rows = some_rows(41, 48).reshape(3, 16)
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(pinned.gather(rows, torch.device("cpu"), dt), host.gather(rows, "cpu", dt))


def test_pinned_table_checks_its_row_size() -> None:
    raw = raw_table(Q.Q8_0, 4, 160)
    with pytest.raises(ValueError, match="170"):
        PinnedRowTable(RowPieces.of([raw[:, :160].contiguous()], 4, "cpu"), Q.Q8_0, 160)


def quantized_table_model(qt: Q, pinned: bool) -> Model:
    """The tiny model (with heads of 32, a block) with its n-gram table stored as `qt`, held as a HostRowTable or a
    PinnedRowTable."""
    cfg = tiny_config().with_(ple_embed_dim=16 * 32)
    w = dict(random_weights(cfg, seed=0))
    raw = raw_table(qt, cfg.ple_rows, cfg.ple_head_dim, seed=3)
    segs = split(raw, cfg.ple_rows // 3)
    w[PLE_TABLE] = PinnedRowTable.from_segments(segs, qt, cfg.ple_head_dim, "cpu", piece_bytes=raw.shape[1] * 1000) \
        if pinned else HostRowTable(segs, qt, cfg.ple_head_dim)
    m = Model(cfg, w)
    m._keep = raw  # the segments are views of raw
    return m


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.BF16], ids=lambda q: q.name)
def test_model_logits_equal_with_either_table(qt: Q) -> None:
    ids = torch.randint(0, 511, (24,), generator=torch.Generator().manual_seed(2))
    ref = Runner(quantized_table_model(qt, pinned=False), CacheOptions(capacity=64)).step(ids)[0]
    got = Runner(quantized_table_model(qt, pinned=True), CacheOptions(capacity=64)).step(ids)[0]
    assert torch.equal(got, ref)


# ---- through the interpreter -------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


@interp
@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_interp_kernel_equals_the_reference(qt: Q) -> None:
    cols = 160 if qt != Q.F32 else 288  # an F32 row of 288 is 1152 bytes: two programs per row
    raw = raw_table(qt, 37, cols)
    t = RowPieces.of(list(raw.split(10)), 10, "cpu")
    rows = torch.cat([some_rows(37, 40), torch.tensor([36, 0, -5, 37, 1 << 35])])
    got = gather_rows(t, rows)
    assert torch.equal(got, gather_rows_torch(t, rows))
    assert torch.equal(got[:42], raw[rows[:42]]) and not got[42:].any()


@interp
def test_interp_leading_rows_of_every_piece() -> None:
    """The first n rows of every piece in one launch (a batch's sequences' pooled keys): the pieces' own rows, in
    piece order, and n past a piece's rows is refused."""
    pieces = [raw_table(Q.F32, 12, 96, seed=s) for s in range(3)]
    t = RowPieces.of(pieces, 12, "cpu")
    for n in (1, 7, 12):
        assert torch.equal(gather_leading_rows(t, n), torch.cat([p[:n] for p in pieces]))
    with pytest.raises(ValueError, match="first 13 rows"):
        gather_leading_rows(t, 13)


@interp
def test_interp_pinned_table_gathers_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels import row_gather

    def refuse(*a: object) -> torch.Tensor:
        raise AssertionError("the reference ran")

    raw = raw_table(Q.Q8_0, 30, 160)
    table = PinnedRowTable.from_segments(split(raw, 11), Q.Q8_0, 160, "cpu", piece_bytes=170 * 7)
    rows = some_rows(30, 32).reshape(2, 16)
    want = HostRowTable(split(raw, 11), Q.Q8_0, 160).gather(rows, "cpu", torch.float32)
    monkeypatch.setattr(row_gather, "gather_rows_torch", refuse)
    assert torch.equal(table.gather(rows, torch.device("cpu"), torch.float32), want)


# ---- on a GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("qt", [Q.Q8_0, Q.BF16], ids=lambda q: q.name)
def test_gather_from_a_pinned_table_in_a_cuda_graph(qt: Q) -> None:
    raw = raw_table(qt, 5000, 160)
    table = PinnedRowTable.from_segments(split(raw, 1234), qt, 160, "cuda", piece_bytes=raw.shape[1] * 700)
    assert all(p.is_pinned() for p in table.table.pieces) and len(table.table.pieces) == 8
    host = HostRowTable(split(raw, 1234), qt, 160)
    dev = torch.device("cuda")
    rows = some_rows(5000, 6 * 16).reshape(6, 16).to(dev)
    table.gather(rows, dev, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = table.gather(rows, dev, torch.bfloat16)
    for seed in range(3):
        rows.copy_(some_rows(5000, 6 * 16, seed=seed + 5).reshape(6, 16))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), host.gather(rows, "cpu", torch.bfloat16))


@pytest.mark.cuda
def test_host_table_model_runs_graphs_and_equals_the_device_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.engine import Engine, EngineHooks, EngineOptions

    cfg = tiny_config()
    w = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in random_weights(cfg, seed=0).items()}
    device_model = Model(cfg, w)
    assert device_model.graph_safe and type(device_model.ple.table).__name__ == "DeviceRowTable"
    monkeypatch.setattr(model_mod, "DEVICE_TABLE_MAX_BYTES", 0)  # the tiny table now counts as too large
    pinned_model = Model(cfg, w)
    assert isinstance(pinned_model.ple.table, PinnedRowTable) and pinned_model.graph_safe
    host_model = Model(cfg, w, pin_table=False)
    assert isinstance(host_model.ple.table, HostRowTable) and not host_model.graph_safe
    prompt = torch.randint(0, 511, (25,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(m: Model, draft: int):  # type: ignore[no-untyped-def]
        return Engine(m, EngineOptions(draft=draft, capacity=256, kv_type="f32"),
                      EngineHooks(record_logits=True)).generate(prompt, 32)

    for draft in (0, 3):
        ref, got, old = run(device_model, draft), run(pinned_model, draft), run(host_model, draft)
        assert got.graphs["replays"] > 0, got.graphs
        assert got.tokens == ref.tokens == old.tokens
        # the same rows reach the same kernels; the bound only spares a run-to-run reordering of a reduction
        assert all((a - b).abs().max() <= 1e-6 * b.abs().max() for a, b in zip(got.logits, ref.logits, strict=True))
