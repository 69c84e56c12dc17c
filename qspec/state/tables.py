"""The device addresses of several sequences' caches, for kernels that step every sequence of a batch in one launch.

A batched step (Model.forward_batch) computes its rows' projections once for all its sequences, but each sequence
keeps its own caches. A kernel with a sequence axis finds sequence b's buffers through int64 tables of their
addresses: per GDN layer, each sequence's conv and SSM planes and its `live` / `base` scalars (kernels/gdn_seqs.py),
and the n-gram layer's conv and token history planes; per attention cache (a QSA layer's, the draft head's), each
sequence's K and V values and, for q8_0, their scales (kernels/attention_seqs.py); per QSA layer, each sequence's
pooled indexer keys (updated in one launch, gathered for the block choice) and raw indexer keys (written in one
launch).

Invariants: the caches' buffers are allocated once and only ever written in place (steps, `commit`, `reset`,
`restore`, prefix loads), so the addresses stay valid as long as the caches live; every recurrent plane and attention
buffer starts on a 16-byte address (checked here; allocations are), which the kernels declare
(triton_common.table_pointer), so that they load through these addresses as widely as through tensor arguments.
The tables hold the caches, which keeps them alive; a CUDA graph that captured a launch reading the tables stays
valid with them.
"""

from __future__ import annotations

import torch

from qspec.kernels.row_gather import RowPieces, gather_leading_rows
from qspec.state.kv_cache import KVCache
from qspec.state.recurrent import RecurrentCache


def even_rows(rows: list[slice]) -> bool:
    """Whether the sequences' row slices hold a step's rows in order, the same count each: the layout of the rows that
    the kernels with a sequence axis take."""
    T = rows[0].stop - rows[0].start
    return T > 0 and all(r == slice(k * T, (k + 1) * T) for k, r in enumerate(rows))


def _same_layout(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    return all((t.shape, t.stride(), t.dtype, t.device) == (first.shape, first.stride(), first.dtype, first.device)
               for t in tensors[1:])


class SequenceTables:
    """Address tables of B sequences' recurrent caches `recs` and attention caches `kvs` (key -> each sequence's
    cache of that layer), in the sequences' order; every table is an int64 [B] device tensor."""

    def __init__(self, recs: list[RecurrentCache], kvs: dict[object, list[KVCache]],
                 pooled: dict[object, list[torch.Tensor]] | None = None,
                 raw: dict[object, list[torch.Tensor]] | None = None) -> None:
        """recs may be empty (tables of attention caches alone); otherwise every list has one cache a sequence.
        pooled: a QSA layer's pooled indexer keys of each sequence (IndexerCache.pooled, contiguous f32), updated for
        every sequence in one launch (`pooled_keys`) and read as one gather of every sequence's first blocks
        (`pooled_rows`). raw: its raw indexer keys (IndexerCache.raw), written for every sequence in one launch
        (`raw_keys`)."""
        pooled, raw = pooled or {}, raw or {}
        self._check(recs, kvs, pooled, raw)
        self.pooled = {key: RowPieces.of([t.view(torch.uint8) for t in ts], ts[0].shape[0], ts[0].device)
                       for key, ts in pooled.items()}
        self.recurrent = tuple(recs)
        self.attention = {k: tuple(v) for k, v in kvs.items()}  # held: the addresses stay valid while the tables live
        layers = sorted(recs[0].gdn) if recs else []
        rows = [[rc.gdn[i].conv.data_ptr() for rc in recs] for i in layers]
        rows += [[rc.gdn[i].ssm.data_ptr() for rc in recs] for i in layers]
        rows += [[rc.live.data_ptr() for rc in recs], [rc.base.data_ptr() for rc in recs]] if recs else []
        self._ple_row = len(rows) if recs and recs[0].ple is not None else None
        rows += [[t.data_ptr() for t in ts] for ts in zip(*(rc.buffers()[-2:] for rc in recs), strict=True)] \
            if self._ple_row is not None else []
        self._kv_row: dict[object, int] = {}
        for key, caches in kvs.items():
            self._kv_row[key] = len(rows)
            rows += [[c.buffers()[j].data_ptr() for c in caches] for j in range(len(caches[0].buffers()))]
        self._raw_row = {key: len(rows) + k for k, key in enumerate(raw)}
        rows += [[t.data_ptr() for t in ts] for ts in raw.values()]
        self._pooled_row = {key: len(rows) + k for k, key in enumerate(pooled)}
        rows += [[t.data_ptr() for t in ts] for ts in pooled.values()]
        device = recs[0].live.device if recs else next(iter(kvs.values()))[0].k.device if kvs else \
            next(iter(self.pooled.values())).bases.device
        self._addresses = torch.tensor(rows, dtype=torch.int64).to(device)
        self._layers = {i: k for k, i in enumerate(layers)}

    @staticmethod
    def _check(recs: list[RecurrentCache], kvs: dict[object, list[KVCache]], pooled: dict[object, list[torch.Tensor]],
               raw: dict[object, list[torch.Tensor]]) -> None:
        if recs:
            first = recs[0]
            if any(rc.n_slots != first.n_slots or rc.gdn.keys() != first.gdn.keys()
                   or (rc.ple is None) != (first.ple is None) for rc in recs) or not all(
                    _same_layout(list(ts)) for ts in zip(*(rc.buffers() for rc in recs), strict=True)):
                raise ValueError("the sequences' recurrent caches differ in slots, layers or buffer shapes")
        if not recs and not kvs and not pooled:
            raise ValueError("no caches to make tables of")
        for key, ts in pooled.items():
            if not _same_layout(ts) or not ts[0].is_contiguous() or ts[0].dtype != torch.float32:
                raise ValueError(f"the sequences' pooled keys of layer {key} differ in shape or are not contiguous f32")
        for key, caches in kvs.items():
            if (recs and len(caches) != len(recs)) or not all(_same_layout([c.buffers()[j] for c in caches])
                                                              for j in range(len(caches[0].buffers()))):
                raise ValueError(f"the sequences' attention caches of layer {key} differ in type, shape or count")
        for key, ts in raw.items():
            if not _same_layout(ts) or not ts[0].is_contiguous() or (recs and len(ts) != len(recs)):
                raise ValueError(f"the sequences' raw indexer keys of layer {key} differ in shape or are not "
                                 "contiguous")
        planes = [t for rc in recs for t in rc.buffers()]
        planes += [x for cs in kvs.values() for c in cs for x in c.buffers()]
        planes += [t for ts in (*raw.values(), *pooled.values()) for t in ts]
        if any(t.data_ptr() % 16 for t in planes):
            raise ValueError("a cache buffer is not 16-byte aligned: the kernels read each one as aligned")

    def conv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv planes, live, base) address tables of GDN layer `layer`."""
        return self._with_scalars(self._layers[layer])

    def ssm(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(SSM planes, live, base) address tables of GDN layer `layer`."""
        return self._with_scalars(len(self._layers) + self._layers[layer])

    def ple(self, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(planes, live, base) address tables of the n-gram layer's "conv" or token "hist" planes, or None without
        that layer."""
        if self._ple_row is None:
            return None
        return self._with_scalars(self._ple_row + ("conv", "hist").index(part))

    def _with_scalars(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Planes' table `row` with the `live` and `base` tables (the rows after every GDN layer's two)."""
        live = 2 * len(self._layers)
        return self._addresses[row], self._addresses[live], self._addresses[live + 1]

    def kv(self, key: object) -> tuple[torch.Tensor, ...] | None:
        """The address tables of attention cache `key`'s buffers (KVCache.buffers' order: k, v and for q8_0 their
        scales), or None where the tables hold no such cache."""
        row = self._kv_row.get(key)
        if row is None:
            return None
        return tuple(self._addresses[row + j] for j in range(len(self.attention[key][0].buffers())))

    def raw_keys(self, key: object) -> torch.Tensor | None:
        """The address table of QSA layer `key`'s raw indexer keys, or None where the tables hold none."""
        return self._table_of(self._raw_row, key)

    def pooled_keys(self, key: object) -> torch.Tensor | None:
        """The address table of QSA layer `key`'s pooled indexer keys (written by the pooled-key update for all
        sequences), or None where the tables hold none."""
        return self._table_of(self._pooled_row, key)

    def _table_of(self, rows: dict[object, int], key: object) -> torch.Tensor | None:
        row = rows.get(key)
        return None if row is None else self._addresses[row]

    def pooled_rows(self, key: object, n: int) -> torch.Tensor:
        """The first n pooled keys of QSA layer `key` of every sequence -> f32 [B, n, d] (one gather launch)."""
        table = self.pooled[key]
        return gather_leading_rows(table, n).view(torch.float32).view(len(table.pieces), n, -1)
