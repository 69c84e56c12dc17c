"""Cell metadata shared by the attention KV cache and the indexer caches (host side, like llama.cpp).

qspec runs one sequence per cache and places position p in cell p, but it still records, per
cell, the logical position and the owning sequences: the pooled-key retention (seed Algorithm 1)
validates blocks against this table rather than trusting positions alone.
"""

from __future__ import annotations

import numpy as np


class CellTable:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pos = np.full(capacity, -1, dtype=np.int64)  # -1: free
        self.seq = np.zeros(capacity, dtype=np.uint64)  # bitmask of owning sequences
        self.pos4 = np.full((capacity, 4), -1, dtype=np.int64)  # M-RoPE components (text: all = pos)

    def write(self, start: int, n: int, seq: int = 0) -> None:
        if start < 0 or start + n > self.capacity:
            raise ValueError(f"cells [{start}, {start + n}) exceed the cache capacity {self.capacity}")
        self.pos[start:start + n] = np.arange(start, start + n)
        self.pos4[start:start + n] = np.arange(start, start + n)[:, None]
        self.seq[start:start + n] = np.uint64(1 << seq)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        """Remove positions [p0, p1) (p1 < 0: to the end) of `seq`. Cell c only ever holds position c (`write`),
        so only cells [p0, p1) are scanned, not the whole table: this runs at every speculative round."""
        lo, hi = max(p0, 0), self.capacity if p1 < 0 else min(p1, self.capacity)
        if lo >= hi:
            return
        bit = np.uint64(1 << seq)
        pos, owners = self.pos[lo:hi], self.seq[lo:hi]  # views
        sel = (pos >= 0) & ((owners & bit) != 0)
        owners[sel] &= ~bit
        free = sel & (owners == 0)
        pos[free] = -1
        self.pos4[lo:hi][free] = -1

    def clear(self) -> None:
        self.pos[:] = -1
        self.pos4[:] = -1
        self.seq[:] = 0

    def n_live(self) -> int:
        return int((self.pos >= 0).sum())
