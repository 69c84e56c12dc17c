"""The Qwen3.8-Flash-Next trunk: embedding, 4 hyper-connection streams, GDN / QSA layers with MoE, final mixer.

`Model.forward` runs any number of rows against the caches in `ModelCache`; it is the one code
path for prefill, plain decoding and speculative verification.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig
from qspec.kernels.conv_snapshot import SnapshotStats
from qspec.kernels.q4 import Q4Weight, q4_matvec
from qspec.kernels.triton_common import triton_enabled
from qspec.model import fuse
from qspec.model.gdn import GatedDeltaNet
from qspec.model.hyper import HyperMixer, hc_combine
from qspec.model.moe import MoE
from qspec.model.mtp import DraftHead, MTPHead, spread_logits
from qspec.model.ops import Weight, embed_rows, linear, rope_tables
from qspec.model.ple import PLE, DeviceRowTable, RowTable
from qspec.model.qsa import PooledUpdate, QSAAttention, StepUpdates
from qspec.state.cells import CellTable
from qspec.state.indexer_cache import Descriptors, IndexerCache, PooledLayout
from qspec.state.kv_cache import KVCache
from qspec.state.recurrent import RecurrentCache
from qspec.state.tables import SequenceTables, even_rows
from qspec.weights.gguf_io import HostRowTable
from qspec.weights.pinned import PinError, PinnedRowTable
from qspec.weights.qweight import PLANES_BLOCK32, QuantWeight
from qspec.weights.traffic import step_bytes

# An n-gram table up to this size is copied to the GPU; the real ~100 GB one stays on the host.
DEVICE_TABLE_MAX_BYTES = 8 << 30
# A Q6_K LM head on CUDA is held in planes (head_layout); False: in the file's order (A/B runs of the kernels).
HEAD_PLANES = True
# Q8_0, Q5_0 and Q4_0 matrices on CUDA are held in planes (block_layouts); False: in the file's order (A/B runs).
B32_PLANES = True
# So are the dense Q6_K matrices on CUDA (block_layouts); False: in the file's order (A/B runs). Their one-row int8
# product's K loop in the file's order moves its terms through shared memory (BENCHMARKS.md §5b), as the head's did.
Q6K_PLANES = True


@dataclass
class Segment:
    """One sequence's rows of a step: `rows` of the step's rows, on `cache`, with its pooled-key updates (by ratio)
    and KV bucket (Model.forward_batch)."""
    rows: slice
    cache: ModelCache
    upd: dict[int, PooledUpdate]
    kv_len: int | None = None


def _per_segment_rows(segments: list[Segment], fn: Callable[[int, slice], torch.Tensor]) -> torch.Tensor:
    """fn(k, segment k's rows) for each segment, the results in row order (one segment: its result as it is)."""
    if len(segments) == 1:
        return fn(0, segments[0].rows)
    return torch.cat([fn(k, s.rows) for k, s in enumerate(segments)])


def _rows_of(parts: tuple[torch.Tensor, ...], rows: slice) -> tuple[torch.Tensor, ...]:
    """Those rows of each of a layer's row-wise projections (a single segment's: all of them, as they are)."""
    if rows.start == 0 and rows.stop == parts[0].shape[0]:
        return parts
    return tuple(p[rows] for p in parts)


def _nbytes(t: object) -> int:
    shape = getattr(t, "shape", (0, 0))
    return int(shape[0]) * int(shape[1]) * 2


def _pin_host_table(t: object, device: torch.device) -> object:
    """A host table too large for the device as a PinnedRowTable that `device` gathers from by itself; anything else,
    or a table that cannot be pinned here, unchanged (with a warning saying why: its steps then run without graphs)."""
    if not isinstance(t, HostRowTable):
        return t
    if not triton_enabled():
        reason = "Triton is not installed or is switched off (QSPEC_TRITON=0)"
    else:
        try:
            return PinnedRowTable.from_segments(t.segments, t.qtype, t.cols, device)
        except PinError as e:
            reason = str(e)
    warnings.warn(f"the n-gram table stays where it is and is gathered through the host, so steps cannot run as "
                  f"CUDA graphs: {reason}", stacklevel=3)
    return t


@dataclass
class CacheOptions:
    capacity: int = 4096
    n_slots: int = 1  # rollback slots: draft depth + 1
    kv_type: str = "f32"  # f32 | f16 | bf16 | q8_0
    preserve_pooled: bool = True  # seed Algorithm 1
    incremental_pooled: bool = True  # seed Algorithm 2 (off: recompute every complete block each step)
    pad_target: int | None = 8  # seed Algorithm 3 (None: off)
    fused_snapshots: bool = True  # seed Algorithms 4-5
    sparse_attention: bool = False  # QSA reads the chosen blocks' cells directly instead of masking a KV bucket
    # masked (dense) attention of QSA and the MTP head in one pass over the cache, q8_0 dequantized in registers
    # (kernels/masked_attention.py), instead of a dequantized copy, batched products and a softmax. None: on where
    # its Triton kernel runs (CUDA), off elsewhere; True on the CPU runs its torch reference (tests)
    fused_attention: bool | None = None
    # a q8_0 cache written in one launch per step and layer on CUDA (kernels/kv_write.py) instead of the compiled
    # quantization and four index copies
    kv_write_kernel: bool = True


@dataclass
class SavedPrefix:
    """Host copies of a sequence's first n tokens in every cache (ModelCache.save_prefix)."""
    n: int
    rows: list[torch.Tensor]  # the first rows of every cell-indexed buffer, pooled keys included
    rec: list[torch.Tensor]  # RecurrentCache.save
    retained: dict[int, Descriptors]  # each pooled-key layout's valid blocks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows + self.rec)


@dataclass
class ModelCache:
    """Every piece of state of one sequence: KV, indexer raw/pooled keys, recurrent slots, cell table."""
    opts: CacheOptions
    kv: dict[int, KVCache]
    idx: dict[int, IndexerCache]
    rec: RecurrentCache
    cells: CellTable
    layouts: dict[int, PooledLayout]  # per pooling ratio
    mtp_kv: KVCache | None
    snap_stats: SnapshotStats = field(default_factory=SnapshotStats)

    def clear(self) -> None:
        """Forget the sequence in place (tensors keep their addresses, so CUDA graphs stay valid).

        Attention and indexer entries need no zeroing: they are position-addressed and rewritten
        before any query can read them."""
        self.rec.reset()
        self.cells.clear()
        for lay in self.layouts.values():
            lay.reset()
        self.snap_stats = SnapshotStats()

    def _indexed(self, n: int) -> list[tuple[torch.Tensor, int]]:
        """(buffer, rows) of every buffer indexed by cell or by pooled block that describes the first n tokens: the
        attention and indexer cells, the complete blocks' pooled keys, and the draft head's cells up to n inclusive
        (its row at n belongs to the token after them)."""
        out = [(b, n) for kv in self.kv.values() for b in kv.buffers()]
        out += [(b, rows) for ix in self.idx.values() for b, rows in ((ix.raw, n), (ix.pooled, n // ix.ratio))]
        if self.mtp_kv is not None:
            out += [(b, min(n + 1, self.opts.capacity)) for b in self.mtp_kv.buffers()]
        return out

    def save_prefix(self, n: int) -> SavedPrefix:
        """Host copies of what describes the sequence's first n tokens (as committed: the recurrent state must be
        theirs), for `load_prefix` after other sequences have used the cache."""
        rows = [b[:k].to("cpu", copy=True) for b, k in self._indexed(n)]
        return SavedPrefix(n, rows, [t.to("cpu", copy=True) for t in self.rec.save()],
                           {r: copy.deepcopy(lay.retained) for r, lay in self.layouts.items()})

    def load_prefix(self, saved: SavedPrefix) -> None:
        """Make a saved prefix the sequence: every cache holds its n tokens again, and nothing after them."""
        self.clear()
        for (b, k), s in zip(self._indexed(saved.n), saved.rows, strict=True):
            b[:k].copy_(s)
        self.rec.restore(saved.rec)
        self.cells.write(0, saved.n)
        for r, lay in self.layouts.items():
            lay.retained = copy.deepcopy(saved.retained[r])

    def new_counters(self) -> None:
        """Zero the counters a request reports (pooled-key layouts, conv snapshots), keeping the sequence."""
        for lay in self.layouts.values():
            lay.new_counters()
        self.snap_stats = SnapshotStats()


_rope_tables = fuse.fused(rope_tables)


def head_layout(head: Weight, embed: object) -> Weight:
    """The LM head as the products read it: a Q6_K head on CUDA with its rows in planes (QuantWeight.planes: 16-byte
    loads instead of 2-byte-aligned ones; BENCHMARKS.md §5b), unless it is the embedding's tensor (a tied head
    would then be held twice); any other head as it is. The planes are made a chunk of rows at a time."""
    if (HEAD_PLANES and isinstance(head, QuantWeight) and head is not embed and head.qtype == GGMLQuantizationType.Q6_K
            and head.device.type == "cuda"):
        return head.to_planes()
    return head


def _in_planes(name: str, t: object, embed: object) -> bool:
    """Whether block_layouts holds w[name] in planes: a block matrix on CUDA in the file's order, not the token table
    (read by rows) nor a head tied to it; of the 32-weight types (B32_PLANES), or dense Q6_K (Q6K_PLANES) but for the
    head (head_layout's) and a shared expert's (merged with the routed experts, whose Q6_K stays in the file's order
    for their kernels)."""
    if not isinstance(t, QuantWeight) or t.planes or t.device.type != "cuda" or t is embed:
        return False
    if t.qtype in PLANES_BLOCK32:
        return B32_PLANES
    return (Q6K_PLANES and t.qtype == GGMLQuantizationType.Q6_K and t.dim() == 2 and name != "output.weight"
            and "_shexp." not in name)


def block_layout(name: str, t: QuantWeight) -> QuantWeight:
    """The layout block_layouts gives w[name] = t on its device (routed experts kept in host memory are laid out so
    on the device before they leave it: weights/host_experts.py)."""
    return t.to_planes() if _in_planes(name, t, None) else t


def block_layouts(w: dict[str, Any]) -> None:
    """Replace in w every Q8_0, Q5_0 and Q4_0 matrix on CUDA, and every dense Q6_K one, by its rows in planes
    (QuantWeight.to_planes: the int8 kernels read whole 16-byte runs and exchange nothing between threads;
    BENCHMARKS.md §5b), one tensor at a time: where w holds the only reference, as the loaders' dicts do, the device
    holds a second copy of one tensor at most (`_in_planes` says which)."""
    embed = w.get("token_embd.weight")
    converted = False
    for name, t in w.items():
        if _in_planes(name, t, embed):
            w[name] = t.to_planes()
            converted = True
    if converted:
        # the freed file-order tensors stay reserved by torch's allocator, where a kernel's own device memory (Triton
        # modules, autotuning buffers) cannot use them: a Q8_0 file of the whole model filled the H200 so
        torch.cuda.empty_cache()


class Model(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], ple_table: RowTable | None = None,
                 *, with_mtp: bool | None = None, hnorm_per_stream: bool = False, pin_table: bool = True) -> None:
        """pin_table: on CUDA, an n-gram table too large for the device is copied into page-locked host memory that
        the device reads by itself (weights/pinned.py), which keeps the steps graph-safe; off, it is gathered through
        the host (the fallback wherever pinning cannot be done). w's Q8_0, Q5_0 and Q4_0 matrices on CUDA are
        replaced in w by their planes (block_layouts)."""
        super().__init__()
        self.cfg = cfg
        block_layouts(w)
        self.embed: torch.Tensor | QuantWeight = w["token_embd.weight"]
        self.lm_head: Weight = head_layout(w["output.weight"], w["token_embd.weight"])
        self._head_relaid = self.lm_head is not w["output.weight"]  # held otherwise than w holds it (head_note)
        # the compute dtype: the loader's, which every expanded tensor (norms are never blocks) has
        self.dtype = w["output_hc_norm.weight"].dtype
        self.device = self.embed.device
        self.mixer = HyperMixer(w, "output_hc", cfg.hidden, cfg.hc_count, cfg.rms_eps, inject=False)
        self.mix_attn: list[HyperMixer] = []
        self.mix_ffn: list[HyperMixer] = []
        self.layers: list[torch.nn.Module] = []
        self.moe: list[MoE] = []
        for i in range(cfg.n_layers):
            b = f"blk.{i}"
            self.mix_attn.append(HyperMixer(w, f"{b}.hc_attn", cfg.hidden, cfg.hc_count, cfg.rms_eps))
            self.mix_ffn.append(HyperMixer(w, f"{b}.hc_ffn", cfg.hidden, cfg.hc_count, cfg.rms_eps))
            self.layers.append(GatedDeltaNet(cfg, w, b) if cfg.layer_recurrent[i] else
                               QSAAttention(cfg, w, b, cfg.ratio(i) if cfg.indexer_heads else 0))
            self.moe.append(MoE(w, b, cfg.n_experts_used))
        self.ple: PLE | None = None
        self.graph_safe = True
        if cfg.has_ple:
            t = ple_table if ple_table is not None else w["per_layer_token_embd.weight"]
            if hasattr(t, "materialize") and self.device.type == "cuda" and _nbytes(t) <= DEVICE_TABLE_MAX_BYTES:
                t = t.materialize(self.device, self.dtype)  # fits: gathers stay on the device
            elif self.device.type == "cuda" and pin_table:
                t = _pin_host_table(t, self.device)
            table = DeviceRowTable(t) if isinstance(t, torch.Tensor) else t
            # a table gathered through the host needs a round trip per step, which CUDA graphs cannot capture; a
            # device-resident or pinned one is read by the device itself
            self.graph_safe = (isinstance(table, DeviceRowTable) and table.table.device == self.device) or \
                (isinstance(table, PinnedRowTable) and table.table.bases.device == self.device)
            self.ple = PLE(cfg, w, f"blk.{cfg.ple_layer}", table)
        with_mtp = cfg.has_mtp if with_mtp is None else with_mtp
        self.mtp = MTPHead(cfg, w, hnorm_per_stream) if with_mtp else None
        # experts with some matrices as blocks and some in 16 bits run one expert at a time after a host-side list of
        # the chosen ones (moe.q_moe_slots), which a CUDA graph cannot capture; all-block experts have a kernel
        moes = [*self.moe, *([self.mtp.moe] if self.mtp is not None else [])]
        if any(m.quantized and not m.blocks_only for m in moes):
            self.graph_safe = False
        if any(m.merged is not None for m in moes) and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the merged experts' freed tensors back to the driver, as in block_layouts
        self.weights_summary = ""  # what the loader kept in which format (loader.load_model fills it in)
        self.has_blocks = any(isinstance(v, QuantWeight) for v in w.values())  # GGUF blocks kept packed
        # weight bytes a one-token step reads (bandwidth limits), the head as held
        self.step_bytes = step_bytes(w | {"output.weight": self.lm_head}, cfg)

    def head_note(self) -> str:
        """What the model holds otherwise than the loader's dict says, for the weights summary: a head that
        head_layout put in planes (block_layouts' planes replace w's entries, so the summary of w counts them)."""
        head = self.lm_head
        if not self._head_relaid or not isinstance(head, QuantWeight):
            return ""
        return f"; LM head's {GGMLQuantizationType(head.qtype).name} rows in planes (16-byte-aligned runs)"

    # ---- caches ----------------------------------------------------------------------------------
    def new_cache(self, opts: CacheOptions) -> ModelCache:
        c, dev = self.cfg, self.device
        if opts.capacity % 4:
            raise ValueError(f"cache capacity must be a multiple of 4, got {opts.capacity}")

        fused_attention = opts.fused_attention
        if fused_attention is None:
            fused_attention = dev.type == "cuda" and triton_enabled()

        def new_kv() -> KVCache:
            return KVCache(opts.capacity, c.n_kv_heads, c.head_dim, cache_type=opts.kv_type, dtype=self.dtype,
                           device=dev, fused_attention=fused_attention, write_kernel=opts.kv_write_kernel)

        kv = {i: new_kv() for i in c.qsa_layers()}
        idx, layouts = {}, {}
        for i in c.qsa_layers():
            r = c.ratio(i)
            if r and c.indexer_heads:
                idx[i] = IndexerCache(opts.capacity, r, c.indexer_head_dim, dtype=self.dtype, device=dev)
                if r not in layouts:
                    layouts[r] = PooledLayout(r, opts.capacity // r, preserve=opts.preserve_pooled,
                                              pad_target=opts.pad_target, incremental=opts.incremental_pooled)
        mtp_kv = new_kv() if self.mtp is not None else None
        return ModelCache(opts, kv, idx, RecurrentCache(c, opts.n_slots, dev), CellTable(opts.capacity), layouts,
                          mtp_kv)

    # ---- forward ---------------------------------------------------------------------------------
    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rope_tables(pos, self.cfg.rope_dim, self.cfg.rope_theta, self.dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: ModelCache,
                upd: dict[int, PooledUpdate] | None = None, logit_rows: torch.Tensor | None = None,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run rows `tokens` [T] at positions `pos` [T] (consecutive, after the cached ones).

        The recurrent cache must have had `begin_step()`; the caller commits the row to keep.
        Returns (logits [rows, V] of `logit_rows` (all rows by default), wide residual X [T, S*D])."""
        with fuse.step_rows(tokens.shape[0]):
            seg = Segment(slice(0, tokens.shape[0]), cache, upd or {}, kv_len)
            return self._forward(tokens, pos, [seg], logit_rows)

    def forward_batch(self, tokens: torch.Tensor, pos: torch.Tensor, segments: list[Segment],
                      tables: SequenceTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of several sequences in one step: `segments` say which rows are whose (each with its own caches, as
        `forward` takes them). Row-wise work (mixers, experts, the head) runs once over every row, so each weight is
        read once for the batch; the sequence mixers (GDN, QSA, the n-gram conv) run per segment on its caches, but
        with `tables` (the addresses of the segments' caches, in order) GDN and QSA step every segment in a few
        launches a layer where their kernels take the step (GatedDeltaNet.recur_seqs, QSAAttention.attend_seqs).
        -> (logits [T, V], X [T, S*D])."""
        with fuse.step_rows(tokens.shape[0]):
            return self._forward(tokens, pos, segments, None, tables)

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, segments: list[Segment],
                 logit_rows: torch.Tensor | None, tables: SequenceTables | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        cos, sin = self.rope(pos)
        updates = StepUpdates([s.upd for s in segments], self.rope)
        X = embed_rows(self.embed, tokens, self.dtype).repeat(1, c.hc_count)
        # Each block's output (y, injection weights) waits in `pending` and is added into X by the next mixer's
        # fused function (combine_mix), which saves a kernel per block.
        pending: tuple[torch.Tensor, torch.Tensor] | None = None
        for i in range(c.n_layers):
            if i == c.ple_layer and self.ple is not None:
                if pending is not None:
                    X, pending = hc_combine(X, *pending), None
                X = self._ple(segments, X, tokens, tables)
            X, h, inj = self.mix_attn[i].combine_mix(X, pending)
            y = self._mixer(i, segments, updates, h, pos, cos, sin, tables)
            X, h, inj = self.mix_ffn[i].combine_mix(X, (y, inj))
            pending = (self.moe[i](h), inj)
        if logit_rows is None:
            X, out, _ = self.mixer.combine_mix(X, pending)
        else:
            X = X if pending is None else hc_combine(X, *pending)
            out, _ = self.mixer(X[logit_rows])
        return linear(out, self.lm_head), X

    def _ple(self, segments: list[Segment], X: torch.Tensor, tokens: torch.Tensor,
             tables: SequenceTables | None = None) -> torch.Tensor:
        """X + the n-gram embedding: its table rows per segment from its history, the gather and gate over every row
        at once, the conv per segment on its recurrent cache; the rows and the conv for every segment at once where
        `tables` are given and the launches for all sequences take the step (PLE.table_rows_seqs, PLE.mix_seqs)."""
        ple = self.ple
        assert ple is not None
        batched = len(segments) > 1 and even_rows([s.rows for s in segments])
        caches = [s.cache for s in segments]
        rows = ple.table_rows_seqs(tokens, caches, tables) if batched else None
        if rows is None:
            rows = _per_segment_rows(segments, lambda k, r: ple.table_rows(tokens[r], segments[k].cache.rec.ple,
                                                                           segments[k].cache.rec))
        G, N = ple.gate(X, rows)
        if batched:
            out = ple.mix_seqs(X, G, N, caches, tables)
            if out is not None:
                return out

        def mix(k: int, r: slice) -> torch.Tensor:
            c = segments[k].cache
            return ple.mix(X[r], G[r], N[r], c.rec.ple, c.rec, c.opts.fused_snapshots, c.snap_stats)
        return _per_segment_rows(segments, mix)

    def _mixer(self, i: int, segments: list[Segment], updates: StepUpdates, h: torch.Tensor, pos: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, tables: SequenceTables | None = None) -> torch.Tensor:
        """Layer i's sequence mixer (GDN or QSA) over the step's rows h: the projections in and out over every row
        at once, the recurrence or the attention per segment on its caches (pos, cos, sin: every row's), or for
        every segment at once where `tables` are given and the kernels with a sequence axis take the step."""
        layer = self.layers[i]
        if isinstance(layer, GatedDeltaNet):
            proj = layer.project(h)
            if len(segments) > 1 and even_rows([s.rows for s in segments]):
                o = layer.recur_seqs(proj, [s.cache for s in segments], tables, i)
                if o is not None:
                    return layer.output(o, proj)

            def recur(k: int, rows: slice) -> torch.Tensor:
                c = segments[k].cache
                return layer.recur(_rows_of(proj, rows), c.rec.gdn[i], c.rec, c.opts.fused_snapshots, c.snap_stats)
            return layer.output(_per_segment_rows(segments, recur), proj)
        r = self.cfg.ratio(i)
        proj = layer.project(h, cos, sin)
        if len(segments) > 1 and even_rows([s.rows for s in segments]) and len({s.kv_len for s in segments}) == 1:
            chosen = [updates.selection(k, r, s.cache.idx.get(i)) for k, s in enumerate(segments)]
            sparse = any(s.cache.opts.sparse_attention for s in segments)
            o = layer.attend_seqs(proj, pos, cos, sin, [s.cache.kv[i] for s in segments], chosen, tables, i,
                                  kv_len=segments[0].kv_len, sparse=sparse, joined=updates.joined.get(r))
            if o is not None:
                return layer.output(o, proj)

        def attend(k: int, rows: slice) -> torch.Tensor:
            seg = segments[k]
            c = seg.cache
            return layer.attend_rows(_rows_of(proj, rows), pos[rows], cos[rows], sin[rows], c.kv[i],
                                     *updates.selection(k, r, c.idx.get(i)), kv_len=seg.kv_len,
                                     sparse=c.opts.sparse_attention)
        return layer.output(_per_segment_rows(segments, attend), proj)

    def mtp_forward(self, tokens: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, cache: ModelCache,
                    lm_head: Weight | Q4Weight | DraftHead | None = None, kv_len: int | None = None,
                    row: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows: token x at position p with the residual H of position p-1 -> (logits, residual X).

        lm_head: the draft's head (None: the model's own); a DraftHead reads only its rows and gives -inf logits
        at every other id. row (a device index [1]): logits and residual of that row only (the draft extend needs
        the accepted row's; the other rows stop after writing their K/V cells, see MTPHead.forward)."""
        return self.mtp_forward_batch(tokens, H, pos, [Segment(slice(0, tokens.shape[0]), cache, {})], lm_head,
                                      kv_len, row)

    def mtp_forward_batch(self, tokens: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, segments: list[Segment],
                          lm_head: Weight | Q4Weight | DraftHead | None = None, kv_len: int | None = None,
                          row: torch.Tensor | None = None, tables: SequenceTables | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """mtp_forward over several sequences' rows, each on its own head cache (`segments`; their pooled-key
        updates unused): the head's weights are read once for all (and with `tables`, the head's caches' addresses,
        its attention runs for all at once). row: one index a sequence into the step's rows."""
        with fuse.step_rows(tokens.shape[0]):
            emb, cos, sin = self._mtp_inputs(tokens, pos, [s.cache for s in segments])
            kvs = [(s.rows, s.cache.mtp_kv) for s in segments]
            out, X = self.mtp(emb, H, pos, cos, sin, kvs, kv_len, row, tables)
            if isinstance(lm_head, DraftHead):
                return spread_logits(_head(out, lm_head.weight), lm_head.ids, lm_head.vocab), X
        return _head(out, self.lm_head if lm_head is None else lm_head), X

    def mtp_write_kv(self, tokens: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, cache: ModelCache,
                     kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows whose outputs nobody reads: only their K/V cells are written (the rows a plain stretch commits,
        which later drafts attend to) -> (the attention output [T, D], X [T, S*D]), the same cells as mtp_forward's
        at a fraction of its work (no MoE, no mixers after the attention, no head)."""
        return self.mtp_write_kv_batch(tokens, H, pos, [Segment(slice(0, tokens.shape[0]), cache, {})], kv_len)

    def mtp_write_kv_batch(self, tokens: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, segments: list[Segment],
                           kv_len: int | None = None, tables: SequenceTables | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """mtp_write_kv over several sequences' rows, each on its own head cache (`segments`; `tables`: as
        mtp_forward_batch's)."""
        with fuse.step_rows(tokens.shape[0]):
            emb, cos, sin = self._mtp_inputs(tokens, pos, [s.cache for s in segments])
            X, y, _ = self.mtp.attend(emb, H, pos, cos, sin, [(s.rows, s.cache.mtp_kv) for s in segments], kv_len,
                                      tables)
        return y, X

    def _mtp_inputs(self, tokens: torch.Tensor, pos: torch.Tensor, caches: list[ModelCache]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft rows' embeddings and rotary tables (emb, cos, sin), once the model has an MTP head loaded (and
        each cache room for its rows)."""
        if self.mtp is None or any(c.mtp_kv is None for c in caches):
            raise RuntimeError("this model has no MTP head loaded")
        cos, sin = self.rope(pos)
        return embed_rows(self.embed, tokens, self.dtype), cos, sin


def _head(out: torch.Tensor, head: Weight | Q4Weight) -> torch.Tensor:
    if isinstance(head, Q4Weight):
        return q4_matvec(out, head)  # reads a quarter of the bf16 head's bytes
    return linear(out, head)
