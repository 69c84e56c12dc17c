"""Model runner: one forward step of the target or the draft head on the device, plus the host-side
bookkeeping that goes with it (cell table, pooled-key update list, rollback slot).

Rollback order (llama.cpp's hybrid memory): the recurrent state first (a slot index), then the
attention/indexer cells, then the pooled-key descriptors (seed Algorithm 1).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from qspec.kernels import (
    attention_seqs,
    gated_norm,
    gdn_conv,
    gdn_seqs,
    gemv,
    hc_mix,
    qmatmul,
    triton_common,
    triton_qdot,
    triton_qmatmul,
)
from qspec.kernels.argmax import argmax_rows
from qspec.kernels.conv_snapshot import SnapshotStats
from qspec.kernels.q4 import Q4Weight
from qspec.model import fuse, moe, ops
from qspec.model.model import CacheOptions, Model, ModelCache, SavedPrefix, Segment
from qspec.model.mtp import DraftHead
from qspec.model.qsa import PooledUpdate
from qspec.options import EngineOptions
from qspec.state.tables import SequenceTables

# Steps up to this many rows (decode, verify, draft) are captured as CUDA graphs.
GRAPH_MAX_ROWS = 16
# The draft head's write-only steps over a plain stretch (engine.CATCH_UP_ROWS rows) are captured up to this many rows.
GRAPH_MAX_WRITE_ROWS = 32
# Attention and indexer scoring read the cells below a bucket of this many tokens above the last
# position, so their cost follows the context, while shapes (and graphs) change only per bucket.
KV_BUCKET = 512
# At the graph limit, a graph not replayed in this many graphed steps makes room for a new one: a server's batches
# come in ever new sets of slots and KV buckets, and the graphs of those gone by would otherwise keep every later
# shape eager. Those replayed within the window stay (a working set above the limit runs its excess eagerly
# rather than capturing again and again).
GRAPH_STALE_STEPS = 2048


# held around every block that runs the model under KernelSwitches (re-entrant: a batcher's thread runs an engine)
MODEL_LOCK = threading.RLock()


class ContextError(ValueError):
    """The request does not fit the cache capacity."""


@dataclass(frozen=True)
class KernelSwitches:
    """The kernel switches of one engine, resolved for its device, and the one place that sets them (`apply`).

    The kernels read module globals rather than arguments: they run inside torch.compile'd functions and dynamo
    guards on the globals they read, so a switch flipped between requests recompiles instead of misrunning. The
    defaults here are the modules' own values outside any engine (tests/test_options.py checks they agree)."""

    row_exact: bool = False  # ops._ROW_EXACT: products row by row (EngineOptions.exact)
    fused: bool = False  # fuse._ON: torch.compile the steps' small ops
    compile_prefill: bool = False  # fuse._ON inside Runner.prefill_scope too
    compile_backend: str = "inductor"  # fuse._BACKEND
    static_rows: int = 16  # fuse.STATIC_MAX_ROWS
    gemv: bool = True  # gemv._ON (where Triton is enabled): one-row products and mixers on the Triton kernels
    gdn_conv_kernel: bool = True  # gdn_conv._ON
    gdn_seqs: bool = True  # gdn_seqs._ON: a batched step's GDN layers in two launches for all sequences
    attention_seqs: bool = True  # attention_seqs._ON: a batched step's attention layers in one pass for all
    pdl: bool = False  # triton_common._PDL: programmatic dependent launch
    grouped_mm: bool = False  # moe._GROUPED_MM: prefill experts as grouped GEMMs
    mixer_step_rows: int = 6  # hc_mix._STEP_ROWS
    int8_dot: bool = True  # qmatmul.INT8_DOT: one-row block products (and few-token experts) through int8 rows
    fuse_blocks: bool = True  # fuse._BLOCKS: functions called with block weights compile too
    shared_stream: bool = True  # moe._SHARED_STREAM: block shared experts of few-token steps on a side stream
    sums_in_product: bool = True  # triton_common.SUM_IN_PRODUCT: split products add their shares in their launch
    tc_pairs: bool = True  # triton_qmatmul.PAIRS: tensor-core products expand K-quants two weights a register
    norm_quant: bool = True  # gated_norm._ON: one-row GDN outputs normed and quantized in one launch
    shared_pair: bool = True  # moe._SHARED_PAIR: a merged block shared expert as one more routed pair
    k_lanes: int = 0  # triton_qdot.K_LANES: Q4_K/Q5_K products' super-blocks side by side a row (0: by shape)

    @classmethod
    def resolve(cls, opts: EngineOptions, device: torch.device) -> KernelSwitches:
        """The switches `opts` asks for, less what `device` lacks (compiling applies on CUDA, or on any device with
        a backend other than inductor; PDL and grouped GEMMs need their GPUs)."""
        return cls(row_exact=opts.exact,
                   fused=opts.compile and (device.type == "cuda" or opts.compile_backend != "inductor"),
                   compile_prefill=opts.compile_prefill,
                   compile_backend=opts.compile_backend, static_rows=opts.static_rows, gemv=opts.gemv,
                   gdn_conv_kernel=opts.gdn_conv_kernel,
                   gdn_seqs=opts.gdn_seqs, attention_seqs=opts.attention_seqs,
                   pdl=opts.pdl and triton_common.pdl_supported(device),
                   grouped_mm=opts.grouped_mm and moe.grouped_mm_supported(device),
                   mixer_step_rows=opts.mixer_step_rows, int8_dot=opts.int8_dot, fuse_blocks=opts.fuse_blocks,
                   shared_stream=opts.shared_stream, sums_in_product=opts.sums_in_product,
                   tc_pairs=opts.tc_pairs, norm_quant=opts.norm_quant, shared_pair=opts.shared_pair,
                   k_lanes=opts.k_lanes)

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """Every switch set inside the block, and restored after it. The switches are module-level modes, one set
        for the process: a block holds MODEL_LOCK, so another thread's block (a batcher's thread and an engine
        used elsewhere, say) waits for it instead of saving and restoring the modes in between."""
        with MODEL_LOCK, ops.row_exact_mode(self.row_exact), fuse.fused_mode(self.fused, self.compile_backend), \
                fuse.static_rows_mode(self.static_rows), \
                gemv.enabled_mode(self.gemv), gdn_conv.conv_kernel_mode(self.gdn_conv_kernel), \
                gdn_seqs.enabled_mode(self.gdn_seqs), attention_seqs.enabled_mode(self.attention_seqs), \
                triton_common.pdl_mode(self.pdl), moe.grouped_mm_mode(self.grouped_mm), \
                hc_mix.step_rows_mode(self.mixer_step_rows), qmatmul.int8_dot_mode(self.int8_dot), \
                fuse.blocks_mode(self.fuse_blocks), moe.shared_stream_mode(self.shared_stream), \
                triton_common.sums_in_product_mode(self.sums_in_product), gated_norm.kernel_mode(self.norm_quant), \
                moe.shared_pair_mode(self.shared_pair), triton_qmatmul.pairs_mode(self.tc_pairs), \
                triton_qdot.k_lanes_mode(self.k_lanes):
            yield


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: tuple[torch.Tensor, torch.Tensor]
    snap: SnapshotStats  # what one replay adds to the snapshot counters (host logic runs only at capture)
    used: int = 0  # the graphed step (Runner._clock) that last replayed or captured it


# GraphStats.eager_reasons' key for a step run eagerly because no graph may be captured (the limit, none stale)
EAGER_AT_LIMIT = "graph limit reached"


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    evicted: int = 0  # graphs dropped at the limit, stale (GRAPH_STALE_STEPS)
    eager_reasons: Counter = field(default_factory=Counter)
    shapes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {"captures": self.captures, "replays": self.replays, "eager_steps": self.eager, "evicted": self.evicted,
                "eager_reasons": dict(self.eager_reasons),
                "graphs_by_shape": {str(k): v for k, v in self.shapes.items()}}


class Runner:
    def __init__(self, model: Model, opts: CacheOptions, *, cuda_graphs: bool = False, max_graphs: int = 128,
                 switches: KernelSwitches | None = None) -> None:
        self.model, self.opts = model, opts
        self.switches = switches or KernelSwitches()  # the engine enters them around each request
        self.cache: ModelCache = model.new_cache(opts)
        self.n_tokens = 0  # committed tokens in the target caches
        self._history: list[int] = []  # the committed tokens, by position (see `history`)
        self._unread: list[torch.Tensor] = []  # kept rows of steps whose tokens came from the device, not yet read
        self.last_plan_rows: dict[int, tuple[int, int]] = {}
        self.use_graphs = cuda_graphs and model.device.type == "cuda" and model.graph_safe
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self._clock = 0  # graphed steps run (replayed, captured or eager): the graphs' ages
        self._seen: Counter = Counter()
        self._families: set[tuple] = set()  # captured keys without their KV bucket (see _run)
        self.graph_stats = GraphStats()
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def device(self) -> torch.device:
        return self.model.device

    def prefill_scope(self) -> contextlib.AbstractContextManager[None]:
        """Around a prompt's steps: unless KernelSwitches.compile_prefill, their small ops run eagerly (a step of up
        to fuse.MAX_ROWS rows would otherwise compile shapes that plain decoding never runs again)."""
        if self.switches.compile_prefill:
            return contextlib.nullcontext()
        return fuse.fused_mode(False, self.switches.compile_backend)

    def reset(self) -> None:
        """Forget the sequence. Buffers are cleared in place, so captured graphs stay valid."""
        self.cache.clear()
        self.n_tokens = 0
        self._history, self._unread = [], []

    def begin_request(self, kept: int) -> None:
        """Start a request after the first `kept` committed tokens, which must be all of them (a prompt that goes on
        from the sequence), or none: 0 forgets the sequence. The request's counters start from zero either way."""
        if not kept:
            self.reset()
            return
        if kept != self.n_tokens:
            raise ValueError(f"a request can go on only after all {self.n_tokens} committed tokens, not {kept}")
        self.cache.new_counters()

    def rewind(self, n: int, state: list[torch.Tensor]) -> None:
        """Go back to the first n committed tokens, `state` (RecurrentCache.save after them) their recurrent state:
        as a rollback, the attention and indexer cells past them are removed and the pooled-key records still valid
        kept (seed Algorithm 1); valid after any step, kept or not (a request stopped midway)."""
        if not 0 < n <= self.n_tokens:
            raise ValueError(f"rewind to {n} of {self.n_tokens} committed tokens")
        c = self.cache
        c.rec.restore(state)
        c.cells.seq_rm(0, n, -1)
        for lay in c.layouts.values():
            lay.retain(c.cells, 0, n, -1)
        self.n_tokens = n
        self._history = self.history[:n]

    def load_sequence(self, tokens: list[int], saved: SavedPrefix) -> None:
        """Make a saved sequence (ModelCache.save_prefix of these committed tokens) the cache's."""
        if len(tokens) != saved.n:
            raise ValueError(f"{len(tokens)} tokens for a saved sequence of {saved.n}")
        self.cache.load_prefix(saved)
        self.n_tokens, self._history, self._unread = saved.n, list(tokens), []

    @property
    def history(self) -> list[int]:
        """The committed tokens, by position. Steps may take their tokens from the device (an argmax the
        host has not read), so reading them is deferred to here instead of stalling every step."""
        for t in self._unread:
            self._history.extend(t.tolist())
        self._unread.clear()
        return self._history

    def _run(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """fn(*inputs) eagerly, or through a CUDA graph captured for this shape (`key`).

        All graphs share one memory pool, so a graph's outputs may lie in memory that a graph captured before it
        uses for its intermediates: read (or copy, or queue the ops that read) a step's outputs before replaying
        another graph. The engine's order does so (a graph's inputs are copied into its buffers before it replays)."""
        if not self.use_graphs:
            return fn(*inputs)
        # a graph records the kernels of its capture: a shape run fused and unfused (prefill_scope) keeps two
        key = (*key, fuse.enabled())
        st = self.graph_stats
        self._clock += 1
        g = self.graphs.get(key)
        if g is not None:
            g.used = self._clock
            for buf, x in zip(g.inputs, inputs, strict=True):
                buf.copy_(x, non_blocking=True)
            g.graph.replay()
            st.replays += 1
            _add_snap(self.cache.snap_stats, g.snap)
            return g.outputs
        # A shape runs eagerly until it recurs: capturing costs about two eager steps, so a shape
        # seen once (the update list of a round without Pad8, say) is not worth a graph. On its
        # second use the eager run is the real step, then the capture records without executing.
        # A shape captured before for another KV bucket (key[2]) recurs for sure, every step until the
        # next bucket: it is captured on its first use.
        self._seen[key] += 1
        st.eager += 1
        family = key[:2] + key[3:]
        recurs = self._seen[key] >= 2 or family in self._families
        capture = recurs and self._room_for_a_graph()
        st.eager_reasons[("second use: captured" if self._seen[key] >= 2 else "new KV bucket: captured") if capture
                         else "first use of a shape" if not recurs else EAGER_AT_LIMIT] += 1
        # The real step of a capture runs on the graph's own input buffers: the compiled step functions then
        # meet, inside the capture, exactly the tensors (strides, storage offsets, alignment) they were just
        # run with, so nothing recompiles or autotunes there (inductor's autotuning synchronises, which a
        # capture forbids; a view into the update lists' shared upload would otherwise differ from its clone).
        bufs = [x.clone() for x in inputs] if capture else inputs
        before = copy.deepcopy(self.cache.snap_stats)
        out = fn(*bufs)
        snap = _diff_snap(self.cache.snap_stats, before)
        if not capture:
            return out
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        saved = copy.deepcopy(self.cache.snap_stats)
        # thread_local: a capture forbids this thread's unsafe calls only, so a weight load in another thread
        # (qspec/compile_ahead.py) may allocate and copy meanwhile. No garbage collection on this thread meanwhile:
        # a collection can free pinned host memory (a read-back buffer held by a reference cycle), whose event
        # bookkeeping a capture forbids (the capture fails with "operation not permitted when stream is capturing").
        with _no_gc(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outs = fn(*bufs)
        self.cache.snap_stats = saved
        self.graphs[key] = _Graph(graph, bufs, outs, snap, self._clock)
        self._families.add(family)
        st.captures += 1
        st.shapes[key] += 1
        return out

    def _room_for_a_graph(self) -> bool:
        """Whether a graph may be captured now: under the limit, or once the least recently used graph, if stale,
        is dropped (its memory goes back to the pool; a tensor of its outputs still held keeps its own)."""
        if len(self.graphs) < self.max_graphs:
            return True
        if not self.graphs:
            return False
        oldest = min(self.graphs, key=lambda k: self.graphs[k].used)
        if self._clock - self.graphs[oldest].used <= GRAPH_STALE_STEPS:
            return False
        del self.graphs[oldest]
        self.graph_stats.evicted += 1
        return True

    def step(self, tokens: torch.Tensor, logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run rows `tokens` after the committed ones. Call `keep` afterwards."""
        T = int(tokens.shape[0])
        seg, pos = self.begin_rows(slice(0, T))
        if self.use_graphs and T <= GRAPH_MAX_ROWS and logit_rows is None:
            logits, X = self.forward_segments(("target", T), [seg], tokens.to(self.device), pos)
        else:
            logits, X = self.model(tokens.to(self.device), pos, self.cache, seg.upd, logit_rows, seg.kv_len)
        self.end_rows(tokens)
        return logits, X

    def forward_segments(self, kind: tuple[str, object], segs: list[Segment], tokens: torch.Tensor, pos: torch.Tensor,
                         tables: SequenceTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Model.forward_batch over `segs` (one KV bucket for all; `tables`: their recurrent caches' addresses, which
        `kind` must tell apart), through a CUDA graph of this runner's when graphs are on: the pooled-key updates'
        tensors are its inputs beside the tokens and positions, and its key is `kind` (a name and what tells its
        steps apart), the bucket and the updates' shapes; eagerly for more than GRAPH_MAX_ROWS rows."""
        ratios = [sorted(s.upd) for s in segs]
        key = (*kind, segs[0].kv_len,
               tuple(tuple((r, s.upd[r].dest.shape[0]) for r in rs) for s, rs in zip(segs, ratios, strict=True)))
        flat = [tokens, pos] + [t for s, rs in zip(segs, ratios, strict=True) for r in rs
                                for t in (s.upd[r].cells, s.upd[r].start, s.upd[r].dest)]

        def fwd(tok: torch.Tensor, p: torch.Tensor, *u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            at, parts = 0, []
            for s, rs in zip(segs, ratios, strict=True):
                parts.append(Segment(s.rows, s.cache, {r: PooledUpdate(*u[at + 3 * i:at + 3 * i + 3])
                                                       for i, r in enumerate(rs)}, s.kv_len))
                at += 3 * len(rs)
            return self.model.forward_batch(tok, p, parts, tables)

        if int(tokens.shape[0]) > GRAPH_MAX_ROWS:
            return fwd(*flat)
        return self._run(key, fwd, flat)

    def draft_segments(self, kind: tuple[str, object], segs: list[Segment], tokens: torch.Tensor, H: torch.Tensor,
                       pos: torch.Tensor, lm_head: torch.Tensor | Q4Weight | DraftHead | None, kv_len: int,
                       pick: torch.Tensor | None = None, write_only: bool = False,
                       tables: SequenceTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Model.mtp_forward_batch over `segs` (each sequence on its own head cache; `tables`: their caches'
        addresses, which `kind` must tell apart), or with `write_only` its K/V cells alone (Model.mtp_write_kv_batch),
        through a CUDA graph of this runner's keyed (kind, the KV bucket) when graphs are on; eagerly for more than
        GRAPH_MAX_ROWS rows."""
        inputs = [tokens.to(self.device), H, pos] + ([] if pick is None else [pick])

        def fwd(tok: torch.Tensor, h: torch.Tensor, p: torch.Tensor, *r: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
            if write_only:
                return self.model.mtp_write_kv_batch(tok, h, p, segs, kv_len, tables)
            return self.model.mtp_forward_batch(tok, h, p, segs, lm_head, kv_len, r[0] if r else None, tables)

        if int(tokens.shape[0]) > GRAPH_MAX_ROWS:
            return fwd(*inputs)
        return self._run((*kind, kv_len), fwd, inputs)

    def begin_rows(self, rows: slice) -> tuple[Segment, torch.Tensor]:
        """Book a step's rows after the committed ones (`rows`: where they lie in the step; a batched step holds
        several sequences'): the cells written, the recurrent half chosen, the pooled-key plans made and uploaded.
        -> (the rows' Segment, their positions on the device). `end_rows` follows the step."""
        L, T = self.n_tokens, rows.stop - rows.start
        if L + T > self.opts.capacity:
            raise ContextError(f"{L + T} tokens exceed the context capacity {self.opts.capacity}")
        c = self.cache
        c.rec.begin_step()
        c.cells.write(L, T)
        plans = {}
        for r, lay in c.layouts.items():
            plans[r] = plan = lay.plan(L + T, T)
            self.last_plan_rows[r] = (plan.n_real, plan.rows)
        pos = torch.arange(L, L + T, device=self.device)
        return Segment(rows, c, _upload_plans(plans, self.device), self.kv_len(L + T)), pos

    def end_rows(self, tokens: torch.Tensor) -> None:
        """After the step `begin_rows` booked (`tokens`: its rows' tokens): the pooled-key plans committed. Call
        `keep` next."""
        for lay in self.cache.layouts.values():
            lay.commit()
        self._pending = (self.n_tokens, int(tokens.shape[0]))
        self._rows = tokens

    def keep(self, n: int, rollback: bool) -> None:
        """Keep the first n rows of the last step; with `rollback`, remove the rest (seq_rm [L+n, end)).

        n = 0 (with rollback) discards the whole step: the engine launches a decode step before it has read
        the token that step consumes, and drops the step when that token turns out to end the request."""
        L, T = self._pending
        if not (0 if rollback else 1) <= n <= T:
            raise ValueError(f"keep {n} rows of a {T}-row step")
        rc = self.cache.rec
        if T > rc.n_slots and n not in (0, T):
            raise ValueError(f"a {T}-row step keeps only its final state; cannot keep {n} rows")
        if n:
            rc.commit(rc.last_row(T) if n == T else n - 1)
        else:
            rc.abandon_step()
        p0 = L + n
        if rollback:
            self.cache.cells.seq_rm(0, p0, -1)
            for lay in self.cache.layouts.values():
                lay.retain(self.cache.cells, 0, p0, -1)
        self.n_tokens = p0
        kept = self._rows[:n]
        if kept.is_cuda:
            self._unread.append(kept)
        else:
            self.history.extend(kept.tolist())

    def check_draft_end(self, end: int) -> None:
        """ContextError when draft-head rows would reach position `end` past the capacity."""
        if end > self.opts.capacity:
            raise ContextError(f"draft rows reach position {end} beyond the capacity {self.opts.capacity}")

    def mtp_step(self, tokens: torch.Tensor, H: torch.Tensor, start: int,
                 lm_head: torch.Tensor | Q4Weight | DraftHead | None = None, row: int | torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-head rows at positions start..; with `row` (an int, or a [1] index on the device that the host
        has not read), the logits and residual of that row only."""
        T = int(tokens.shape[0])
        if isinstance(row, int) and not 0 <= row < T:
            raise ValueError(f"row {row} of a {T}-row draft step")
        extra = [] if row is None else [upload([row], self.device) if isinstance(row, int)
                                         else row.to(self.device).view(1)]

        def body(kv_len: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
            def fwd(tok: torch.Tensor, h: torch.Tensor, p: torch.Tensor, *r: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
                return self.model.mtp_forward(tok, h, p, self.cache, lm_head, kv_len, r[0] if r else None)
            return fwd

        return self._draft_rows(("mtp", lm_head is not None, row is not None), tokens, H, start, extra, body)

    def mtp_write_kv(self, tokens: torch.Tensor, H: torch.Tensor, start: int) -> None:
        """Draft-head rows at positions start.. whose only effect is their K/V cells (model.mtp_write_kv)."""
        def body(kv_len: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
            return lambda tok, h, p: self.model.mtp_write_kv(tok, h, p, self.cache, kv_len)

        self._draft_rows(("mtp_kv",), tokens, H, start, [], body, GRAPH_MAX_WRITE_ROWS)

    def _draft_rows(self, kind: tuple, tokens: torch.Tensor, H: torch.Tensor, start: int, extra: list[torch.Tensor],
                    body: Callable[[int], Callable[..., tuple[torch.Tensor, torch.Tensor]]],
                    graph_rows: int = GRAPH_MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-head rows at positions start.. through body(kv_len)(tokens, H, positions, *extra): the capacity
        check, and one CUDA graph per shape, keyed (kind[0], rows, KV bucket, *kind[1:])."""
        T = int(tokens.shape[0])
        self.check_draft_end(start + T)
        dev = self.device
        inputs = [tokens.to(dev), H, torch.arange(start, start + T, device=dev), *extra]
        kv_len = self.kv_len(start + T)
        if self.use_graphs and T <= graph_rows:
            return self._run((kind[0], T, kv_len, *kind[1:]), body(kv_len), inputs)
        return body(kv_len)(*inputs)

    def mtp_chain(self, tok: torch.Tensor, H: torch.Tensor, start: int, n: int,
                  lm_head: torch.Tensor | Q4Weight | DraftHead | None = None, at: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """n greedy draft-head steps in one go: step i runs at position start + i on the previous step's argmax
        (step 0 on `tok` [1]) and residual (step 0 on H [1, D]) -> (the n argmax tokens [n], the last residual).
        `at`: the first position as a [1] device tensor the host has not read, at most `start`, which then only
        bounds it (the capacity check and the KV buckets use `start`; the causal mask hides cells past a row).

        The same steps as n calls of `mtp_step` each followed by an argmax, captured as one CUDA graph per chain
        length and KV bucket: the draft chain of a round is one replay instead of n replays with their input
        copies and argmax launches between them (issue 6: the MTP draft chain captured once per shape). Every step
        attends over the last step's bucket (the causal mask hides the extra cells of the earlier ones): a chain
        that straddles a bucket boundary then needs no graph of its own, so crossing into a new bucket captures
        one chain graph, not one per straddling position."""
        if n < 1:
            raise ValueError(f"a draft chain needs at least one step, got {n}")
        self.check_draft_end(start + n)
        kv_len = self.kv_len(start + n)
        dev = self.device

        def fwd(t: torch.Tensor, h: torch.Tensor, p0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            toks = []
            for i in range(n):
                logits, h = self.model.mtp_forward(t, h, p0 + i, self.cache, lm_head, kv_len, None)
                t = argmax_rows(logits[-1:])
                toks.append(t)
            return torch.cat(toks), h

        inputs = [tok.to(dev).view(1), H, upload([start], dev) if at is None else at.to(dev).view(1)]
        if self.use_graphs:
            return self._run(("chain", n, kv_len, lm_head is not None), fwd, inputs)
        return fwd(*inputs)

    def kv_len(self, end: int) -> int:
        """Cells a step ending at position `end` attends over: a KV_BUCKET multiple, or the whole cache
        in row-exact mode (a row's result must not depend on the step it was computed in)."""
        if ops.row_exact():
            return self.opts.capacity
        return min(self.opts.capacity, -(-end // KV_BUCKET) * KV_BUCKET)

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


class Readback:
    """Reads device token ids without waiting for the work queued after them. `.tolist()` / `.item()` would queue
    the copy behind everything already on the stream: the engine queues the next step before it reads a token, so
    the read would wait for that step too and the host's work would run with the GPU idle (plain decoding measured
    1.91 ms per token against 1.39 ms for the step's graph alone). Here `start` queues the copy into pinned host
    memory and records an event right after it; `result` waits for that event only."""

    def __init__(self, dev: torch.device, capacity: int = 64) -> None:
        self.cuda = dev.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.n = 0

    def start(self, ids: torch.Tensor) -> None:
        """Queue the read of a 1-D tensor of token ids (at most `capacity`)."""
        self.n = int(ids.shape[0])
        if self.n > self.host.shape[0]:
            raise ValueError(f"read back {self.n} ids into a buffer of {self.host.shape[0]}")
        self.host[:self.n].copy_(ids, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def result(self) -> list[int]:
        """The ids of the last `start`, once their copy has landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[:self.n].tolist()


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was outside."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def upload(values: list[int], dev: torch.device) -> torch.Tensor:
    """int64 token ids on `dev` (see _to_device)."""
    return _to_device(torch.tensor(values, dtype=torch.long), dev)


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A CPU tensor on `dev`. On CUDA through pinned memory and non-blocking: a plain `.to(device)` of a CPU
    tensor waits for the stream to drain, which would stop the engine from queueing a step behind the one
    still running."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _upload_plans(plans: dict, dev: torch.device) -> dict[int, PooledUpdate]:
    """The update lists' index arrays on the device, in one copy (_to_device)."""
    parts = [a for p in plans.values() for a in (p.cells.reshape(-1), p.start, p.dest)]
    if not parts:
        return {}
    flat = _to_device(torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)), dev)
    out, o = {}, 0
    for r, p in plans.items():
        nc, ns, nd = p.cells.size, p.start.size, p.dest.size
        cells = flat[o:o + nc].view(p.cells.shape)
        start = flat[o + nc:o + nc + ns]
        dest = flat[o + nc + ns:o + nc + ns + nd]
        out[r] = PooledUpdate(cells, start, dest)
        o += nc + ns + nd
    return out


def _diff_snap(a: SnapshotStats, b: SnapshotStats) -> SnapshotStats:
    return SnapshotStats(a.fused - b.fused, a.ordinary - b.ordinary, a.dispatches - b.dispatches,
                         a.source_reads - b.source_reads, a.fallbacks - b.fallbacks)


def _add_snap(a: SnapshotStats, d: SnapshotStats) -> None:
    a.fused += d.fused
    a.ordinary += d.ordinary
    a.dispatches += d.dispatches
    a.source_reads += d.source_reads
    a.fallbacks.update(d.fallbacks)
