"""Steps over several sequences at once, each in its own Runner (its own caches, the model shared): the target's
rows (Model.forward_batch) and the draft head's (Model.mtp_forward_batch), each weight read once for all of them,
through CUDA graphs in the first runner's store. qspec/batch.py's Batcher decides what each step carries."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from qspec.engine import DraftLMHead
from qspec.model.model import Segment
from qspec.runner import GRAPH_MAX_ROWS, Runner, upload
from qspec.state.kv_cache import KVCache
from qspec.state.tables import SequenceTables


class BatchSteps:
    """Steps over some runners' sequences at once: the target's rows (`run`: Model.forward_batch) and the draft
    head's (`draft`), each sequence's rows together, through a CUDA graph per set of slots, row count, KV bucket
    (and pooled-key update shapes) where graphs are on, in the first runner's store."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners
        self.steps, self.rows = 0, 0  # steps run and their rows: rows / steps is the mean batch
        # by (sequences, depth: 0 for a plain step): the last steps' or rounds' times to their tokens (benchmarks)
        self.seconds: dict[tuple[int, int], deque[float]] = {}
        # by set of slots: their caches' addresses (GDN's and attention's launches for all of them), made once outside
        # any graph capture and kept as long as the graphs that read them (the first runner's)
        self._tables: dict[tuple[int, ...], SequenceTables] = {}

    def timed(self, key: tuple[int, int], seconds: float) -> None:
        self.seconds.setdefault(key, deque(maxlen=4096)).append(seconds)

    def run(self, slots: list[int], tokens: torch.Tensor, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B * rows] (`rows` per slot, in `slots`' order) -> (logits, residuals) [B * rows, ...]; each
        runner's `keep` follows."""
        return self._in_steps(len(slots), rows, lambda i, j: self._step(slots[i:j], tokens[i * rows:j * rows], rows))

    def draft(self, slots: list[int], starts: list[int], tokens: torch.Tensor, H: torch.Tensor,
              lm_head: DraftLMHead, rows: int = 1, pick: torch.Tensor | None = None, write_only: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-head rows of several sequences in one step (Model.mtp_forward_batch), the head's weights read once
        for all: `rows` rows of each slot's at positions starts[k].. (tokens and the residuals H of the positions
        before them), on its own head cache; with `pick` ([B] device indices, one into each sequence's rows of the
        step), the logits and residual of those rows only -> (logits, X); with `write_only`, only their K/V cells are
        written (what a plain step's rows leave the head: the rows later drafts attend to)."""
        return self._in_steps(len(slots), rows, lambda i, j: self._draft_step(
            slots[i:j], starts[i:j], tokens[i * rows:j * rows], H[i * rows:j * rows], lm_head, rows,
            None if pick is None else pick[i:j] - i * rows, write_only))

    def _in_steps(self, n: int, rows: int, step: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """step(i, j) over sequences i..j-1, for all n in one step or in several (`_per_step`) -> their (logits,
        residuals) in order. The graphs of several steps share the first runner's memory pool, where a graph's
        outputs may lie in memory that another graph uses for its intermediates (Runner._run): each step's outputs
        are copied before the next step replays."""
        per = self._per_step(n, rows)
        if per >= n:
            return step(0, n)
        logits, X = [], []
        for i in range(0, n, per):
            out = step(i, min(i + per, n))
            logits.append(out[0].clone())
            X.append(out[1].clone())
        return torch.cat(logits), torch.cat(X)

    def _per_step(self, n: int, rows: int) -> int:
        """Sequences a step takes: all of them, but with graphs only as many as fit GRAPH_MAX_ROWS rows (a round's
        verify rows of many sequences), the few-token kernels that a graph can capture taking that many at most
        (the larger products synchronise with the host); a step of more rows is then several steps."""
        if self.runners[0].use_graphs and n * rows > GRAPH_MAX_ROWS:
            return max(1, GRAPH_MAX_ROWS // rows)
        return n

    def _step(self, slots: list[int], tokens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        lead = self.runners[0]
        booked = [self.runners[s].begin_rows(slice(k * rows, (k + 1) * rows)) for k, s in enumerate(slots)]
        # every sequence attends over the batch's largest KV bucket (the cells past its own are masked): a graph
        # per bucket of the batch, not per combination of its sequences' buckets
        kv_len = max(seg.kv_len or 0 for seg, _ in booked) or None
        segs = [Segment(seg.rows, seg.cache, seg.upd, kv_len) for seg, _ in booked]
        pos = torch.cat([p for _, p in booked])
        logits, X = lead.forward_segments(("batch", (tuple(slots), rows)), segs, tokens.to(lead.device), pos,
                                          self._sequence_tables(slots))
        for k, s in enumerate(slots):
            self.runners[s].end_rows(tokens[k * rows:(k + 1) * rows])
        self.steps, self.rows = self.steps + 1, self.rows + len(tokens)
        return logits, X

    def _sequence_tables(self, slots: list[int]) -> SequenceTables | None:
        """The address tables of the slots' caches (None for one slot)."""
        key = tuple(slots)
        if len(key) < 2:
            return None
        if key not in self._tables:
            caches = [self.runners[s].cache for s in key]
            kvs: dict[object, list[KVCache]] = {i: [c.kv[i] for c in caches] for i in caches[0].kv}
            if all(c.mtp_kv is not None for c in caches):
                kvs["mtp"] = [c.mtp_kv for c in caches]
            pooled = {i: [c.idx[i].pooled for c in caches] for i in caches[0].idx}
            raw = {i: [c.idx[i].raw for c in caches] for i in caches[0].idx}
            self._tables[key] = SequenceTables([c.rec for c in caches], kvs, pooled, raw)
        return self._tables[key]

    def _draft_step(self, slots: list[int], starts: list[int], tokens: torch.Tensor, H: torch.Tensor,
                    lm_head: DraftLMHead, rows: int, pick: torch.Tensor | None, write_only: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        lead = self.runners[0]
        for s, p0 in zip(slots, starts, strict=True):
            self.runners[s].check_draft_end(p0 + rows)
        segs = [Segment(slice(k * rows, (k + 1) * rows), self.runners[s].cache, {}) for k, s in enumerate(slots)]
        kv_len = max(self.runners[s].kv_len(p0 + rows) for s, p0 in zip(slots, starts, strict=True))
        pos = upload([p0 + j for p0 in starts for j in range(rows)], lead.device)
        kind = ("bdraft", (tuple(slots), rows, pick is not None, lm_head is not None, write_only))
        return lead.draft_segments(kind, segs, tokens, H, pos, lm_head, kv_len, pick, write_only,
                                   self._sequence_tables(slots))

