"""QSA indexer caches: raw key per token, pooled block keys (f32), and the pooled-key layout.

Raw keys live at their cell (= position) like the KV cache. Pooled keys live at row `block` of a
separate f32 array (one extra dump row at the end, the target of the fallback descriptor).

`PooledLayout` is the host-side record of which pooled rows are valid (the seed's descriptors)
and implements the rollback optimizations:
  * Algorithm 1 (`retain`): after a rollback, keep the longest prefix of descriptors that are
    still valid instead of clearing them all (the baseline);
  * Algorithm 2 (`plan`): only blocks that are absent or changed form the real delta;
  * Algorithm 3 (`plan`): pad a small delta to a fixed P rows with filler blocks whose
    recomputation rewrites identical values, so the update shape stays constant.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from qspec.state.cells import CellTable

_ROW_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def rows_all(x: np.ndarray) -> np.ndarray:
    """x.all(1) for a 2-D bool array. A row of 1, 2, 4 or 8 bools is read as one unsigned word (numpy bools are the
    bytes 0 and 1): numpy's general reduction over a short axis is slow for its size, and the layout's
    per-round checks (retain, plan) run three of them on the host between steps."""
    w = x.shape[1]
    if w in _ROW_WORDS and x.dtype == np.bool_:
        x = np.ascontiguousarray(x)
        return x.view(_ROW_WORDS[w]).reshape(-1) == int.from_bytes(b"\x01" * w, "little")
    return x.all(1)


class IndexerCache:
    def __init__(self, capacity: int, ratio: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.ratio = ratio
        self.n_blocks = capacity // ratio
        self.raw = torch.zeros(capacity, head_dim, dtype=dtype, device=device)
        self.pooled = torch.zeros(self.n_blocks + 1, head_dim, dtype=torch.float32, device=device)

    @property
    def dump_row(self) -> int:
        return self.n_blocks


@dataclass
class Descriptors:
    """Block descriptors in prefix order (block b is row b): source cells, positions, destination, stream."""
    cells: np.ndarray  # [nb, r] int64
    start: np.ndarray  # [nb] int64
    dest: np.ndarray  # [nb] int64
    stream: np.ndarray  # [nb] int64
    pos4: np.ndarray  # [nb, 4] int64

    @staticmethod
    def empty(r: int) -> Descriptors:
        z = np.zeros(0, dtype=np.int64)
        return Descriptors(np.zeros((0, r), np.int64), z, z.copy(), z.copy(), np.zeros((0, 4), np.int64))

    @staticmethod
    def current(nb: int, r: int) -> Descriptors:
        """The layout of the first nb complete blocks of sequence 0 (cell = position)."""
        start = np.arange(nb, dtype=np.int64) * r
        return Descriptors(start[:, None] + np.arange(r), start, np.arange(nb, dtype=np.int64),
                           np.zeros(nb, np.int64), np.repeat(start[:, None], 4, axis=1))

    def __len__(self) -> int:
        return len(self.start)

    def take(self, k: int) -> Descriptors:
        return Descriptors(self.cells[:k], self.start[:k], self.dest[:k], self.stream[:k], self.pos4[:k])


@dataclass
class UpdatePlan:
    """One round's pooled-key update rows: cells [C, r], start positions [C], destinations [C]."""
    cells: np.ndarray
    start: np.ndarray
    dest: np.ndarray
    n_real: int

    @property
    def rows(self) -> int:
        return len(self.dest)


@dataclass
class LayoutStats:
    rounds: int = 0
    rows_real: int = 0
    rows_filler: int = 0
    shapes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    retained_blocks: int = 0
    invalidations: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"updates": self.rounds, "rows_real": self.rows_real, "rows_filler": self.rows_filler,
                "update_shapes": dict(sorted(self.shapes.items())), "fallbacks": dict(self.fallbacks),
                "retained_blocks": self.retained_blocks, "invalidations": self.invalidations}


class PooledLayout:
    """Host record of valid pooled keys for one pooling ratio, shared by all QSA layers of that ratio."""

    def __init__(self, ratio: int, n_blocks: int, *, preserve: bool, pad_target: int | None,
                 incremental: bool = True, n_streams: int = 1) -> None:
        if pad_target not in (None, 8, 16):
            raise ValueError(f"pad target must be 8 or 16, got {pad_target}")
        self.r, self.n_blocks = ratio, n_blocks
        self.preserve, self.pad_target, self.n_streams = preserve, pad_target, n_streams
        self.incremental = incremental  # off: every step recomputes all complete blocks
        self.retained = Descriptors.empty(ratio)
        self.pending: Descriptors | None = None
        self.stats = LayoutStats()

    def reset(self) -> None:
        self.retained = Descriptors.empty(self.r)
        self.pending = None
        self.new_counters()

    def new_counters(self) -> None:
        self.stats = LayoutStats()

    # -- Algorithm 1 -----------------------------------------------------------------------------
    def retain(self, cells: CellTable, seq: int, p0: int, p1: int = -1) -> None:
        """Called after recurrent rollback was accepted and the attention/indexer cells were removed."""
        self.pending = None
        reason = None
        if not self.preserve:
            reason = "preservation off"
        elif self.n_streams != 1:
            reason = "several streams"
        elif seq != 0:
            reason = "sequence != 0"
        elif p0 < 0:
            reason = "p0 < 0"
        elif p1 >= 0:
            reason = "bounded removal"
        if reason is not None:
            self.invalidate(reason)
            return
        k = int(np.argmin(np.append(self.valid_blocks(cells, p0), False)))
        self.retained = self.retained.take(k)
        self.stats.retained_blocks = k

    def invalidate(self, reason: str) -> None:
        self.retained = Descriptors.empty(self.r)
        self.pending = None
        self.stats.invalidations += 1
        self.stats.fallbacks[reason] += 1

    def valid_blocks(self, cells: CellTable, p0: int) -> np.ndarray:
        """ValidBlock for every retained descriptor (vectorised)."""
        d, r = self.retained, self.r
        if len(d) == 0:
            return np.zeros(0, dtype=bool)
        ok = (d.cells.shape[1] == r) & (d.stream == 0) & (d.start >= 0) & (d.start + r <= p0)
        # qspec stores a pooled key in its own row, not in a source cell: the destination must be
        # the row of the block's first source cell.
        ok &= d.dest == d.cells[:, 0] // r
        ok &= rows_all(d.pos4 == d.start[:, None])
        in_bounds = (d.cells >= 0) & (d.cells < cells.capacity)
        c = np.clip(d.cells, 0, cells.capacity - 1)
        live = cells.pos[c] >= 0
        only_seq0 = cells.seq[c] == np.uint64(1)
        at_pos = cells.pos[c] == d.start[:, None] + np.arange(r)
        ok &= rows_all(in_bounds & live & only_seq0 & at_pos)
        return ok

    # -- Algorithms 2 and 3 ------------------------------------------------------------------------
    def plan(self, n_tokens_after: int, microbatch: int) -> UpdatePlan:
        """Update rows for a step after which the sequence holds n_tokens_after tokens."""
        r = self.r
        nb = min(n_tokens_after // r, self.n_blocks)
        cur = Descriptors.current(nb, r)
        old = self.retained
        k = min(len(old), nb) if self.incremental else 0
        same = np.zeros(nb, dtype=bool)
        if k:
            same[:k] = (rows_all(old.cells[:k] == cur.cells[:k]) & (old.start[:k] == cur.start[:k])
                        & (old.dest[:k] == cur.dest[:k]) & (old.stream[:k] == cur.stream[:k]))
        delta = np.nonzero(~same)[0]
        rows = list(delta)
        C = max(1, len(rows))
        P = self.pad_target
        padding = P is not None and microbatch <= 16 and self.n_streams == 1 and C <= P and nb >= P
        if padding:
            C = P
        fallback = False
        if not rows:
            if nb > 0:
                rows.append(0)
            else:
                fallback = True
        if padding:
            used = set(int(cur.dest[b]) for b in rows)
            for b in range(nb):
                if len(rows) == C:
                    break
                if int(cur.dest[b]) not in used:
                    rows.append(b)
                    used.add(int(cur.dest[b]))
            assert len(rows) == C, "Pad: not enough distinct filler destinations"
        if fallback:
            cells = np.arange(r, dtype=np.int64)[None, :]
            start = np.zeros(1, np.int64)
            dest = np.full(1, self.n_blocks, np.int64)  # the dump row: written, never read
        else:
            idx = np.array(rows, dtype=np.int64)
            cells, start, dest = cur.cells[idx], cur.start[idx], cur.dest[idx]
        self.pending = cur
        self._delta = delta
        st = self.stats
        st.rounds += 1
        st.rows_real += len(delta)
        st.rows_filler += len(dest) - len(delta)
        st.shapes[len(dest)] += 1
        return UpdatePlan(cells=cells, start=start, dest=dest, n_real=len(delta))

    def commit(self) -> None:
        """After the step ran: the descriptors now describe the current layout (Algorithm 2, last loop)."""
        if self.pending is None:
            return
        self.retained = self.pending
        self.pending = None
