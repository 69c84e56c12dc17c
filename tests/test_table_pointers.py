"""Kernels that find each sequence's caches through address tables (state/tables.SequenceTables) load and store
through those addresses as widely as through tensor arguments.

Triton assumes nothing about the alignment of an address it loads from memory, so without the hint that
triton_common.table_pointer gives, an int8 K row was read one byte a load. Compiled ahead of time for sm_90 (no GPU
needed), each kernel's global loads and stores by width, launched for several sequences, must equal those of its
launch for one sequence (but for the 64-bit loads of the tables themselves). The launches are the real launchers'
own, at the flash-next geometry, with JITFunction.run replaced so that nothing runs. The tables refuse a buffer that
is not 16-byte aligned.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from qspec.kernels.row_gather import RowPieces
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.state.kv_cache import KVCache
from qspec.state.tables import SequenceTables

compiled = pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="compiles Triton kernels for sm_90")
_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}
_OPTIONS = ("num_warps", "num_stages")


def _launched(monkeypatch: pytest.MonkeyPatch, call: Callable[[], object]) -> tuple:
    """The first kernel launch that `call` makes: (kernel, positional args, keyword args); nothing runs."""
    from triton.runtime.jit import JITFunction

    seen: list[tuple] = []
    with monkeypatch.context() as m:
        m.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: seen.append((self, a, kw)))
        try:
            call()
        except Exception:  # after the launch, the launcher may read what nothing wrote
            pass
    assert seen, "no kernel launched"
    return seen[0]


def _widths(launch: tuple) -> Counter:
    """The launch compiled for sm_90 as Triton would specialize it (tensors 16-byte aligned, integers by their
    divisibility by 16) -> its global loads and stores by width, the 64-bit loads (the tables' own) left out."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn, args, kw = launch
    bound = dict(zip(fn.arg_names, args, strict=False)) | kw
    sig, attrs, consts = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound.get(p.name, p.default)
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name], attrs[(i,)] = _PTR[v.dtype], [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32" if isinstance(v, float) else "i32"
            if isinstance(v, int) and v and v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                options={o: kw[o] for o in _OPTIONS if o in kw})
    census = Counter(m.group(0) for m in re.finditer(r"\b(?:ld|st)\.global(?:\.\w+)*", k.asm["ptx"]))
    census.pop("ld.global.b64", None)
    return census


def _caches(B: int, cap: int, Hkv: int, d: int) -> list[KVCache]:
    return [KVCache(cap, Hkv, d, cache_type="q8_0", dtype=torch.bfloat16, device="cpu", fused_attention=True,
                    write_kernel=True) for _ in range(B)]


@compiled
def test_attention_through_tables_loads_as_widely(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels.triton_masked_attention import masked_attention_seqs_triton, masked_attention_triton

    B, n = 4, 4608
    kvs = _caches(B, n, 2, 256)
    tables = SequenceTables([], {0: kvs}).kv(0)
    q, mask = torch.zeros(B, 24, 256, dtype=torch.bfloat16), torch.ones(B, n, dtype=torch.bool)
    one = _widths(_launched(monkeypatch, lambda: masked_attention_triton(q[:1], *kvs[0].buffers(), mask[:1])))
    seqs = _widths(_launched(monkeypatch, lambda: masked_attention_seqs_triton(q, tuple(kvs[0].buffers()), tables,
                                                                               n, mask)))
    assert seqs == one and one["ld.global.v4.b32"] > 0, (seqs, one)


@compiled
def test_kv_write_through_tables_stores_as_widely(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels.triton_kv_write import write_q8_0_seqs_triton, write_q8_0_triton

    B = 4
    kvs = _caches(B, 512, 2, 256)
    tables = SequenceTables([], {0: kvs}).kv(0)
    k = v = torch.zeros(B, 2, 256, dtype=torch.bfloat16)
    pos = torch.arange(B)
    one = _widths(_launched(monkeypatch, lambda: write_q8_0_triton(*kvs[0].buffers(), pos[:1], k[:1], v[:1])))
    seqs = _widths(_launched(monkeypatch, lambda: write_q8_0_seqs_triton(tuple(kvs[0].buffers()), tables, pos, k, v)))
    assert seqs == one, (seqs, one)


@compiled
def test_gdn_recurrence_through_tables_loads_as_widely(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels.triton_gdn import gdn_conv_recurrent_seqs_triton, gdn_conv_recurrent_triton

    B, Hk, Hv, dk, dv, taps = 4, 16, 48, 128, 128, 4
    C = 2 * Hk * dk + Hv * dv
    X, conv_w = torch.zeros(B, C, taps), torch.zeros(C, taps)
    g = beta = torch.zeros(B, Hv, dtype=torch.bfloat16)
    ssm = torch.zeros(2, Hv, dk, dv)
    live, base = torch.zeros((), dtype=torch.int64), torch.ones((), dtype=torch.int64)
    gates = (torch.zeros(Hv), torch.zeros(Hv))
    tables = tuple(torch.full((B,), t.data_ptr(), dtype=torch.int64) for t in (ssm, live, base))
    dims = (Hk, Hv, dk, dv)
    one = _widths(_launched(monkeypatch, lambda: gdn_conv_recurrent_triton(X[0], conv_w, *dims, g[:1], beta[:1], ssm,
                                                                           live, base, gates)))
    seqs = _widths(_launched(monkeypatch, lambda: gdn_conv_recurrent_seqs_triton(X, conv_w, *dims, g, beta, ssm,
                                                                                 tables, gates)))
    assert seqs == one and one["ld.global.v4.b32"] > 0, (seqs, one)


@compiled
def test_pooled_keys_through_tables_load_as_widely(monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels.triton_pooled import pooled_seqs_triton, pooled_triton

    B, C, r, d, rope, cap = 4, 8, 4, 128, 64, 8192
    raws = [torch.zeros(cap, d, dtype=torch.bfloat16) for _ in range(B)]
    pooleds = [torch.zeros(cap // r + 1, d) for _ in range(B)]
    cells, dest = torch.zeros(B * C, r, dtype=torch.int64), torch.zeros(B * C, dtype=torch.int64)
    cos = sin = torch.zeros(B * C, rope, dtype=torch.bfloat16)
    tables = tuple(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64) for ts in (raws, pooleds))
    one = _widths(_launched(monkeypatch, lambda: pooled_triton(raws[0], cells[:C], dest[:C], torch.ones(d), 1e-6,
                                                               cos[:C], sin[:C], pooleds[0])))
    seqs = _widths(_launched(monkeypatch, lambda: pooled_seqs_triton(raws[0], cells, dest, torch.ones(d), 1e-6, cos,
                                                                     sin, pooleds[0], tables)))
    assert seqs == one, (seqs, one)


@compiled
def test_gather_reads_aligned_rows_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a multiple of 16 bytes in aligned pieces (a batch's pooled indexer keys) are read without byte loads;
    the n-gram table's rows of 170 bytes are read as bytes."""
    from qspec.kernels.triton_row_gather import gather_rows_triton

    keys = RowPieces.of([torch.zeros(64, 512, dtype=torch.uint8) for _ in range(4)], 64, "cpu")
    ngram = RowPieces.of([torch.zeros(64, 170, dtype=torch.uint8) for _ in range(4)], 64, "cpu")
    assert keys.aligned and not ngram.aligned
    assert "ld.global.b8" not in _widths(_launched(monkeypatch, lambda: gather_rows_triton(keys, None, leading=8)))
    assert "ld.global.b8" in _widths(_launched(monkeypatch, lambda: gather_rows_triton(ngram, torch.zeros(4).long())))


def test_pieces_off_a_16_byte_address_are_not_aligned() -> None:
    raw = torch.zeros(65, 512, dtype=torch.uint8).view(-1)
    assert not RowPieces.of([raw[8:8 + 64 * 512].view(64, 512)], 64, "cpu").aligned


def test_tables_refuse_a_buffer_off_a_16_byte_address() -> None:
    kvs = _caches(2, 64, 2, 32)
    kvs[1].k = torch.zeros(64 * 2 * 32 + 8, dtype=torch.int8)[8:].view(64, 2, 32)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        SequenceTables([], {0: kvs})
