"""Model runner: one forward step of the target or the draft head on the device, plus the host-side
bookkeeping that goes with it (cell table, pooled-key update list, rollback slot).

Rollback order (llama.cpp's hybrid memory): the recurrent state first (a slot index), then the
attention/indexer cells, then the pooled-key descriptors (seed Algorithm 1).
"""

from __future__ import annotations

import torch

from qspec.model.model import CacheOptions, Model, ModelCache
from qspec.model.qsa import PooledUpdate


class ContextError(ValueError):
    """The request does not fit the cache capacity."""


class Runner:
    def __init__(self, model: Model, opts: CacheOptions) -> None:
        self.model, self.opts = model, opts
        self.cache: ModelCache = model.new_cache(opts)
        self.n_tokens = 0  # committed tokens in the target caches
        self.history: list[int] = []  # the committed tokens, by position
        self.last_plan_rows: dict[int, tuple[int, int]] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        self.cache = self.model.new_cache(self.opts)
        self.n_tokens = 0
        self.history = []

    def step(self, tokens: torch.Tensor, logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run rows `tokens` after the committed ones. Call `keep` afterwards."""
        L, T = self.n_tokens, int(tokens.shape[0])
        if L + T > self.opts.capacity:
            raise ContextError(f"{L + T} tokens exceed the context capacity {self.opts.capacity}")
        c = self.cache
        c.rec.begin_step()
        c.cells.write(L, T)
        upd: dict[int, PooledUpdate] = {}
        dev = self.device
        for r, lay in c.layouts.items():
            plan = lay.plan(L + T, T)
            self.last_plan_rows[r] = (plan.n_real, plan.rows)
            upd[r] = PooledUpdate(torch.from_numpy(plan.cells).to(dev), torch.from_numpy(plan.start).to(dev),
                                  torch.from_numpy(plan.dest).to(dev))
        pos = torch.arange(L, L + T, device=dev)
        logits, X = self.model(tokens.to(dev), pos, c, upd, logit_rows)
        for lay in c.layouts.values():
            lay.commit()
        self._pending = (L, T)
        self._rows = tokens.tolist()
        return logits, X

    def keep(self, n: int, rollback: bool) -> None:
        """Keep the first n rows of the last step; with `rollback`, remove the rest (seq_rm [L+n, end))."""
        L, T = self._pending
        if not 1 <= n <= T:
            raise ValueError(f"keep {n} rows of a {T}-row step")
        rc = self.cache.rec
        if T > rc.n_slots and n != T:
            raise ValueError(f"a {T}-row step keeps only its final state; cannot keep {n} rows")
        rc.commit(rc.last_row(T) if n == T else n - 1)
        p0 = L + n
        if rollback:
            self.cache.cells.seq_rm(0, p0, -1)
            for lay in self.cache.layouts.values():
                lay.retain(self.cache.cells, 0, p0, -1)
        self.n_tokens = p0
        self.history.extend(self._rows[:n])

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        """llama.cpp-style removal entry point for the unsupported cases (other sequences, bounded ranges):
        the recurrent state cannot undo them, so the call is refused after invalidating pooled keys."""
        for lay in self.cache.layouts.values():
            lay.retain(self.cache.cells, seq, p0, p1)
        return seq == 0 and p1 < 0 and p0 == self.n_tokens

    def mtp_step(self, tokens: torch.Tensor, H: torch.Tensor, start: int,
                 lm_head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = int(tokens.shape[0])
        if start + T > self.opts.capacity:
            raise ContextError(f"draft rows reach position {start + T} beyond the capacity {self.opts.capacity}")
        pos = torch.arange(start, start + T, device=self.device)
        return self.model.mtp_forward(tokens.to(self.device), H, pos, self.cache, lm_head)

    def committed_state(self) -> dict[str, torch.Tensor]:
        """Every cache entry that describes the committed tokens (for equality checks)."""
        n, c = self.n_tokens, self.cache
        out = dict(c.rec.live_view())
        for i, kv in c.kv.items():
            if kv.cache_type == "q8_0":
                out[f"kv{i}.k"], out[f"kv{i}.v"] = kv.k[:n].clone(), kv.v[:n].clone()
                out[f"kv{i}.ks"], out[f"kv{i}.vs"] = kv.k_scale[:n].clone(), kv.v_scale[:n].clone()
            else:
                out[f"kv{i}.k"], out[f"kv{i}.v"] = kv.k[:n].clone(), kv.v[:n].clone()
        for i, ix in c.idx.items():
            out[f"idx{i}.raw"] = ix.raw[:n].clone()
            out[f"idx{i}.pooled"] = ix.pooled[:n // ix.ratio].clone()
        return out
