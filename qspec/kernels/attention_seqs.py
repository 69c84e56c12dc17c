"""Attention for several sequences of a batch at once: every sequence's K/V rows written to its cache in one launch,
and every sequence's rows attending over its own cache in one masked-attention pass (two launches), per layer.

A batched step computes its rows' projections once for every sequence (Model.forward_batch), but each sequence keeps
its own KV cache: run one by one, an attention layer (a QSA layer, the draft head's) launches the q8_0 write and the
masked attention's two kernels for every sequence. Here the q8_0 write and the first attention kernel take a sequence
axis and find each sequence's cache through tables of its buffers' addresses (state/tables.SequenceTables); the
combine kernel already runs over every row. QSA's raw indexer keys are written for every sequence in one launch too
(`write_rows_seqs`). The rows' masks are made before: QSA's indexer choice for every sequence in one call
(model/qsa.QSAAttention.select_seqs), or a causal mask over all rows at once (it depends on the rows' positions
only).

`attend_each` is the reference: each sequence's write and masked attention alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from qspec.kernels.masked_attention import masked_attention_torch
from qspec.kernels.triton_common import module_flag, use_triton
from qspec.model.ops import row_exact
from qspec.state.kv_cache import KVCache

# A module flag (EngineOptions.attention_seqs through runner.KernelSwitches); off: each sequence alone. On by default
# since batches of 8 decoded faster with it, plainly and in MTP3 rounds (an H100, BENCHMARKS.md §9)
_ON = True


def enabled_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, batched steps run every sequence's attention of a layer in one pass (on) or one by one."""
    return module_flag(__name__, "_ON", on)


def seqs_take(q: torch.Tensor, kvs: list[KVCache], tables: tuple[torch.Tensor, ...] | None, sparse: bool) -> bool:
    """Whether a batched step's attention runs here: switched on, the Triton kernels (CUDA or the interpreter), two
    sequences or more with their address tables, each cache read in one pass (fused attention, not the sparse path)."""
    return (_ON and tables is not None and len(kvs) > 1 and use_triton(q) and not sparse
            and all(kv.fused_attention for kv in kvs))


def write_seqs(kvs: list[KVCache], tables: tuple[torch.Tensor, ...], pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Every sequence's rows (T = rows / sequences each, in order) written to its cache: q8_0 caches with the write
    kernel in one launch, others each by its own `write`."""
    first = kvs[0]
    if first.cache_type == "q8_0" and first.write_kernel and k.stride(-1) == 1 and v.stride(-1) == 1:
        from qspec.kernels.triton_kv_write import write_q8_0_seqs_triton

        write_q8_0_seqs_triton(tuple(first.buffers()), tables, pos, k, v)
        return
    T = k.shape[0] // len(kvs)
    for b, kv in enumerate(kvs):
        rows = slice(b * T, (b + 1) * T)
        kv.write(pos[rows], k[rows], v[rows])


def write_rows_seqs(bufs: list[torch.Tensor], table: torch.Tensor | None, pos: torch.Tensor, src: torch.Tensor
                    ) -> None:
    """Rows b T .. (b + 1) T - 1 of src (T = rows / sequences) to cells pos[those rows] of bufs[b] (a QSA layer's
    raw indexer keys): one launch through the buffers' address table where Triton runs (CUDA, the interpreter),
    each buffer's index_copy_ otherwise."""
    if table is not None and use_triton(src) and src.stride(-1) == 1:
        from qspec.kernels.triton_kv_write import write_rows_seqs_triton

        write_rows_seqs_triton(bufs[0], table, pos, src)
        return
    T = src.shape[0] // len(bufs)
    for b, buf in enumerate(bufs):
        rows = slice(b * T, (b + 1) * T)
        buf.index_copy_(0, pos[rows], src[rows].to(buf.dtype))


def attention_seqs_triton(q: torch.Tensor, kvs: list[KVCache], tables: tuple[torch.Tensor, ...], n: int,
                          mask: torch.Tensor) -> torch.Tensor:
    """Every sequence's rows of q [rows, H, d] attending over the first n cells of its cache, where mask [rows, n]
    allows -> o [rows, H, d]. In row-exact mode each sequence's rows are summed as they would be alone (its bits);
    otherwise the cells are split into chunks for all the rows together (fewer programs and partial results)."""
    from qspec.kernels.triton_masked_attention import masked_attention_seqs_triton

    return masked_attention_seqs_triton(q, tuple(kvs[0].buffers()), tables, n, mask, alone=row_exact())


def attend_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, kvs: list[KVCache], n: int,
                mask: torch.Tensor, attention: Callable[..., torch.Tensor] = masked_attention_torch) -> torch.Tensor:
    """Each sequence's rows written to its cache, then attending over its first n cells alone with `attention` (the
    reference: masked_attention_torch; masked_attention: the sequences' own launches, as the model runs them)."""
    T = q.shape[0] // len(kvs)
    out = []
    for b, kv in enumerate(kvs):
        rows = slice(b * T, (b + 1) * T)
        kv.write(pos[rows], k[rows], v[rows])
        ks, vs = kv.scales()
        out.append(attention(q[rows], kv.k[:n], kv.v[:n], None if ks is None else ks[:n],
                             None if vs is None else vs[:n], mask[rows]))
    return torch.cat(out)
