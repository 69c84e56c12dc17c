"""QSA attention: gated GQA attention whose keys are restricted by a block-pooled indexer.

Indexer (transformers semantics): each token's raw key is cached; a pooled block key is the mean
of r raw keys (f32, rounded to the raw-key dtype), RMS-normed, roped at the block start. A query
scores every complete block visible to it (sum over heads of relu(q.K) / sqrt(d)), keeps the top
budget/r blocks and always the incomplete tail. Up to budget + r - 1 tokens it is exactly dense.
Tied scores (exact zeros are common) are broken as transformers breaks them: torch.topk over the row's
visible blocks alone (kernels/top_blocks.py says why that is the only way to match it); the masked and
the sparse paths, prefill and decode, all take their blocks from that one mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qspec.config import ModelConfig
from qspec.kernels import attention_seqs
from qspec.kernels.masked_attention import masked_attention
from qspec.kernels.pooled import materialize_pooled_fast, materialize_pooled_seqs
from qspec.kernels.sparse_attention import sparse_attention
from qspec.kernels.top_blocks import top_blocks_mask
from qspec.model.fuse import fused
from qspec.model.hyper import stream_mean
from qspec.model.ops import apply_rope, bmm_rows, linear, rms_norm, row_exact, sigmoid, stack_rows
from qspec.state.indexer_cache import IndexerCache
from qspec.state.kv_cache import KVCache
from qspec.state.tables import SequenceTables


class PooledUpdate:
    """Device tensors of one step's pooled-key update list (shared by all QSA layers)."""

    def __init__(self, cells: torch.Tensor, start: torch.Tensor, dest: torch.Tensor) -> None:
        self.cells, self.start, self.dest = cells, start, dest


Rope = tuple[torch.Tensor, torch.Tensor]
# A sequence's indexer cache, pooled-key update and its rope tables, as a batched step's QSA layer takes them
Selection = tuple[IndexerCache | None, PooledUpdate | None, Rope | None]


class StepUpdates:
    """A step's pooled-key update lists (each segment's, by ratio) with their rope tables at the blocks' starts.

    In a batched step whose sequences' lists of a ratio share one shape (the padded lists of the steady state), the
    lists are also `joined` (sequence b's rows after b - 1's): one rope gather a ratio, each sequence's tables a
    slice of it, and one pooled-key launch a QSA layer for every sequence (QSAAttention.select_seqs)."""

    def __init__(self, upds: list[dict[int, PooledUpdate]], rope: Callable[[torch.Tensor], Rope]) -> None:
        self.upds = upds
        self.ropes: list[dict[int, Rope]] = [{} for _ in upds]
        self.joined: dict[int, tuple[PooledUpdate, Rope]] = {}
        for r in upds[0] if len(upds) > 1 else ():
            parts = [u.get(r) for u in upds]
            if all(u is not None and u.cells.shape == parts[0].cells.shape for u in parts):
                self._join(r, parts, rope)  # type: ignore[arg-type]
        for k, u in enumerate(upds):
            for r, x in u.items():
                if r not in self.ropes[k]:
                    self.ropes[k][r] = rope(x.start)

    def _join(self, r: int, parts: list[PooledUpdate], rope: Callable[[torch.Tensor], Rope]) -> None:
        joined = PooledUpdate(*(torch.cat([getattr(u, f) for u in parts]) for f in ("cells", "start", "dest")))
        cos, sin = rope(joined.start)
        self.joined[r] = (joined, (cos, sin))
        C = parts[0].dest.shape[0]
        for k in range(len(parts)):
            self.ropes[k][r] = (cos[k * C:(k + 1) * C], sin[k * C:(k + 1) * C])

    def selection(self, k: int, r: int, idx: IndexerCache | None) -> Selection:
        """Segment k's indexer cache `idx` with its update list of ratio r and that list's rope tables."""
        return idx, self.upds[k].get(r), self.ropes[k].get(r)


def materialize_pooled(idx: IndexerCache, upd: PooledUpdate, k_norm: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Seed Algorithm 2's batched body: gather r raw keys per row, mean, type round trip, norm, RoPE, scatter.

    cos/sin are the tables at the rows' block-start positions."""
    if idx.raw.is_cuda:
        materialize_pooled_fast(idx.raw, upd.cells, upd.dest, k_norm, eps, cos, sin, idx.pooled)
        return
    x = idx.raw[upd.cells].float().mean(1).to(idx.raw.dtype)
    z = rms_norm(x, k_norm, eps)
    z = apply_rope(z.unsqueeze(1), cos, sin).squeeze(1)
    idx.pooled.index_copy_(0, upd.dest, z.float())


class QSAAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], b: str, ratio: int) -> None:
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        self.wo = w[f"{b}.attn_output.weight"]
        self.q_norm, self.k_norm = w[f"{b}.attn_q_norm.weight"], w[f"{b}.attn_k_norm.weight"]
        # q (with its gate), k, v and the indexer's q and k all read h: one product
        ins = [w[f"{b}.attn_q.weight"], w[f"{b}.attn_k.weight"], w[f"{b}.attn_v.weight"]]
        if ratio:
            ins += [w[f"{b}.indexer.q_proj.weight"], w[f"{b}.indexer.k_proj.weight"]]
            self.iq_norm = w[f"{b}.indexer.q_norm.weight"]
            self.ik_norm = w[f"{b}.indexer.k_norm.weight"]
        self.w_in, _ = stack_rows(*ins)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache,
                idx: IndexerCache | None, upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None,
                key_lo: int = 0, kv_len: int | None = None, sparse: bool = False) -> torch.Tensor:
        """h [T, D] at positions pos [T]; key_lo: first position that holds a key (the MTP head has none at 0).

        kv_len: cells to attend over (a bucket above the last position; the whole cache by default).
        sparse: attend over the indexer's chosen blocks and the tail directly (kernels/sparse_attention.py)
        instead of a mask over the kv_len cells; the same cells, so the same result up to rounding."""
        proj = self.project(h, cos, sin)
        o = self.attend_rows(proj, pos, cos, sin, kv, idx, upd, upd_rope, key_lo, kv_len, sparse)
        return self.output(o, proj)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows' projections (roped, normed q; the output gate; roped, normed k; v; the indexer's): row by row, so
        a batched step makes them for every sequence's rows in one product (Model.forward_batch)."""
        c = self.cfg
        return qsa_qkv(h, self.w_in, self.q_norm, self.k_norm, cos, sin, c.n_heads, c.n_kv_heads, c.head_dim,
                       c.rms_eps)

    def output(self, o: torch.Tensor, proj: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layer's output from the attention's o [T, H, d] and the rows' projections (their output gate)."""
        return gated_out(o, proj[1], self.wo)

    def attend_rows(self, proj: tuple[torch.Tensor, ...], pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv: KVCache, idx: IndexerCache | None, upd: PooledUpdate | None,
                    upd_rope: tuple[torch.Tensor, torch.Tensor] | None, key_lo: int = 0, kv_len: int | None = None,
                    sparse: bool = False) -> torch.Tensor:
        """One sequence's rows (their projections) written to its caches and attending over them -> o [T, H, d]."""
        q, _, k, v, rest = proj
        kv.write(pos, k, v)
        n = kv.capacity if kv_len is None else kv_len
        if self.ratio and idx is not None:
            if sparse:  # read only the chosen blocks' cells and the tail
                if key_lo:
                    raise ValueError("sparse attention needs every cell to hold a key (key_lo = 0)")
                blocks, tail_lo = self.select(rest, pos, cos, sin, idx, upd, upd_rope, n, sparse=True)
                ks, vs = kv.scales()
                return sparse_attention(q, kv.k, kv.v, ks, vs, blocks, tail_lo, pos, self.ratio)
            mask = self.select(rest, pos, cos, sin, idx, upd, upd_rope, n, key_lo)
        else:
            mask = causal_mask(pos, n, key_lo)
        if kv.fused_attention:  # one pass over the stored cells (q8_0 scaled in registers)
            ks, vs = kv.scales()
            return masked_attention(q, kv.k[:n], kv.v[:n], None if ks is None else ks[:n],
                                    None if vs is None else vs[:n], mask)
        K, V = kv.read(n)
        return attend(q, K, V, mask)

    def attend_seqs(self, proj: tuple[torch.Tensor, ...], pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kvs: list[KVCache], selections: list[Selection], tables: SequenceTables | None, key: object,
                    key_lo: int = 0, kv_len: int | None = None, sparse: bool = False,
                    joined: tuple[PooledUpdate, Rope] | None = None) -> torch.Tensor | None:
        """`attend_rows` for every sequence of a batched step at once (T rows each, in order; `selections`: each
        one's indexer cache and pooled-key update with its rope tables; `joined`: those updates joined, where they
        share a shape, StepUpdates): the K/V writes in one launch, the cell
        masks (the indexer's choice for all rows in one call, `select_seqs`; or causal), the attention over
        every sequence's cache in one pass (kernels/attention_seqs.py) -> o [rows, H, d]; None where those kernels do
        not take the step (`tables` lack the caches of layer `key`, the sparse path, no Triton)."""
        q, _, k, v, rest = proj
        kv_tables = None if tables is None else tables.kv(key)
        if kv_tables is None or not attention_seqs.seqs_take(q, kvs, kv_tables, sparse):
            return None
        attention_seqs.write_seqs(kvs, kv_tables, pos, k, v)
        n = kvs[0].capacity if kv_len is None else kv_len
        if self.ratio and all(idx is not None for idx, _, _ in selections):
            if not row_exact() and key in tables.pooled:
                mask = self.select_seqs(rest, pos, cos, sin, selections, tables, key, n, key_lo, joined)
            else:
                T = q.shape[0] // len(kvs)
                rows = [slice(b * T, (b + 1) * T) for b in range(len(kvs))]
                mask = torch.cat([self.select(rest[r], pos[r], cos[r], sin[r], idx, upd, upd_rope, n, key_lo)
                                  for r, (idx, upd, upd_rope) in zip(rows, selections, strict=True)])
        else:
            mask = causal_mask(pos, n, key_lo)
        return attention_seqs.attention_seqs_triton(q, kvs, kv_tables, n, mask)

    def write_keys(self, proj: torch.Tensor, pos: torch.Tensor, idx: IndexerCache, upd: PooledUpdate | None,
                   upd_rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The rows' raw indexer keys (proj: their indexer projections) to their cells, and the pooled keys of the
        step's update list (seed Algorithm 2)."""
        idx.raw.index_copy_(0, pos, self._raw_keys(proj).to(idx.raw.dtype))
        self._pool(idx, upd, upd_rope)

    def _raw_keys(self, proj: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        qd = c.indexer_heads * c.indexer_head_dim
        return proj[:, qd:qd + c.indexer_head_dim]

    def _pool(self, idx: IndexerCache, upd: PooledUpdate | None,
              upd_rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if upd is not None and upd_rope is not None:
            materialize_pooled(idx, upd, self.ik_norm, self.cfg.rms_eps, *upd_rope)

    def select_seqs(self, proj: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    selections: list[Selection], tables: SequenceTables, key: object, n: int, key_lo: int = 0,
                    joined: tuple[PooledUpdate, Rope] | None = None) -> torch.Tensor:
        """`select` for every sequence of a batched step (T rows each, in order): every sequence's raw keys written to
        its indexer cache (one launch) and its pooled keys updated (one launch where the update lists are `joined`),
        then every row's block scores against its sequence's pooled keys (gathered in one launch) and the choice in
        one compiled call -> bool [rows, n]. The scores are one batched product, not each sequence's own: equal up
        to rounding, so a near tie may choose another block than alone (row-exact mode selects per sequence)."""
        c, r = self.cfg, self.ratio
        raws = [idx.raw for idx, _, _ in selections]
        raw_at, pooled_at = tables.raw_keys(key), tables.pooled_keys(key)
        attention_seqs.write_rows_seqs(raws, raw_at, pos, self._raw_keys(proj))
        if joined is not None and raw_at is not None and pooled_at is not None:
            upd, (ucos, usin) = joined
            materialize_pooled_seqs(raws, upd.cells, upd.dest, self.ik_norm, c.rms_eps, ucos, usin,
                                    [idx.pooled for idx, _, _ in selections], (raw_at, pooled_at))
        else:
            for idx, upd, upd_rope in selections:
                self._pool(idx, upd, upd_rope)
        nbmax = min(selections[0][0].n_blocks, n // r)
        qd = c.indexer_heads * c.indexer_head_dim
        return block_mask(proj[:, :qd], pos, cos, sin, self.iq_norm, tables.pooled_rows(key, nbmax), r,
                          c.indexer_heads, min(c.indexer_budget // r, nbmax), c.rms_eps, n, key_lo)

    def select(self, proj: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               idx: IndexerCache, upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None, n: int,
               key_lo: int = 0, sparse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Which of the first n cells each row may attend to (top blocks + incomplete tail): a boolean [T, n],
        or with `sparse` (block ids [T, n_top] with -1 for none, first tail cell [T]).

        proj [T, heads*di + di]: the indexer's query and raw key projections of the rows."""
        c, r = self.cfg, self.ratio
        qd = c.indexer_heads * c.indexer_head_dim
        self.write_keys(proj, pos, idx, upd, upd_rope)
        nbmax = min(idx.n_blocks, n // r)
        args = (proj[:, :qd], pos, cos, sin, self.iq_norm, idx.pooled[:nbmax], r, c.indexer_heads,
                min(c.indexer_budget // r, nbmax), c.rms_eps)
        if sparse:
            return select_blocks(*args)
        return block_mask(*args, n, key_lo)


@fused
def qsa_qkv(h: torch.Tensor, w_in: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, H: int, Hkv: int, d: int, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_in = [q+gate ; k ; v ; indexer q ; indexer k] -> roped, normed q [T, H, d], output gate [T, H, d],
    roped, normed k and v [T, Hkv, d], and the remaining (indexer) projections [T, *]."""
    y = linear(h, w_in)
    nq, nk = 2 * H * d, Hkv * d
    qg = y[:, :nq].unflatten(-1, (H, 2 * d))
    q, gate = qg[..., :d], qg[..., d:]
    q = apply_rope(rms_norm(q, q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(y[:, nq:nq + nk].unflatten(-1, (Hkv, d)), k_norm, eps), cos, sin)
    return q, gate, k, y[:, nq + nk:nq + 2 * nk].unflatten(-1, (Hkv, d)), y[:, nq + 2 * nk:]


@fused(context_sized=True)
def causal_mask(pos: torch.Tensor, n: int, key_lo: int) -> torch.Tensor:
    """Boolean [T, n]: cells key_lo..pos of each row."""
    key_pos = torch.arange(n, device=pos.device)
    return (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= key_lo)


def _block_scores(qi: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, iq_norm: torch.Tensor,
                  Kb: torch.Tensor, r: int, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores [T, nb], -inf where not visible; visible [T, nb]; complete blocks visible to each row [T]).

    qi [T, heads*di]: the rows' indexer query projections; Kb [nb, di]: the blocks' pooled keys (or [B, nb, di]:
    each of B sequences' keys, for its T / B rows)."""
    T, nb, di = qi.shape[0], Kb.shape[-2], Kb.shape[-1]
    qi = apply_rope(rms_norm(qi.unflatten(-1, (heads, di)), iq_norm, eps), cos, sin)
    if Kb.dim() == 3:  # a batched step: each sequence's pooled keys [B, nb, di], its T / B rows in order
        prod = torch.bmm(qi.float().reshape(Kb.shape[0], -1, di), Kb.transpose(1, 2))
    else:
        prod = linear(qi.float().reshape(T * heads, di), Kb)
    s = torch.relu(prod.reshape(T, heads, nb))
    s = stream_mean(s) * (heads / di ** 0.5)  # sum over heads / sqrt(d), in a fixed order
    nb_vis = (pos + 1) // r
    vis = torch.arange(nb, device=qi.device)[None, :] < nb_vis[:, None]
    return s.masked_fill(~vis, float("-inf")), vis, nb_vis


@fused(context_sized=True)
def block_mask(qi: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, iq_norm: torch.Tensor,
               Kb: torch.Tensor, r: int, heads: int, n_top: int, eps: float, n: int, key_lo: int) -> torch.Tensor:
    """Indexer selection as a boolean [T, n] over the first n cells: the n_top best-scoring complete blocks
    visible to each row plus the incomplete tail up to the row itself."""
    s, vis, nb_vis = _block_scores(qi, pos, cos, sin, iq_norm, Kb, r, heads, eps)
    T, nb = vis.shape
    chosen = top_blocks_mask(s, n_top) & vis
    key_pos = torch.arange(n, device=qi.device)
    kblk = (key_pos // r).clamp(max=nb - 1)
    in_blocks = chosen.gather(1, kblk[None, :].expand(T, -1)) & (key_pos[None, :] < (nb_vis * r)[:, None])
    tail = (key_pos[None, :] >= (nb_vis * r)[:, None]) & (key_pos[None, :] <= pos[:, None])
    return (in_blocks | tail) & (key_pos[None, :] >= key_lo)


@fused(context_sized=True)
def select_blocks(qi: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, iq_norm: torch.Tensor,
                  Kb: torch.Tensor, r: int, heads: int, n_top: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection as block ids [T, n_top] (-1 where fewer blocks are visible) and each row's first
    tail cell [T]."""
    s, vis, nb_vis = _block_scores(qi, pos, cos, sin, iq_norm, Kb, r, heads, eps)
    return mask_to_ids(top_blocks_mask(s, n_top) & vis, n_top), nb_vis * r


def mask_to_ids(chosen: torch.Tensor, n_top: int) -> torch.Tensor:
    """bool [T, nb] with at most n_top True per row -> their block ids in increasing order [T, n_top], -1 after.

    The sparse path takes its blocks from the mask (not from a second top-k) so both paths keep the same tied
    blocks; a prefix count places each chosen block, the unchosen ones land in a dropped extra column."""
    T, nb = chosen.shape
    slot = torch.where(chosen, chosen.long().cumsum(1) - 1, n_top)
    ids = torch.arange(nb, device=chosen.device).expand(T, nb)
    out = torch.full((T, n_top + 1), -1, dtype=torch.long, device=chosen.device)
    return out.scatter(1, slot, torch.where(chosen, ids, -1))[:, :n_top]


@fused(context_sized=True)
def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked GQA softmax attention of q [T, H, d] over K, V [n, Hkv, d] -> o [T, H, d]."""
    T, H, d = q.shape
    Hkv = K.shape[1]
    G = H // Hkv
    qh = q.view(T, Hkv, G, d).permute(1, 0, 2, 3).reshape(Hkv, T * G, d)
    scores = bmm_rows(qh, K.permute(1, 2, 0)) * d ** -0.5  # [Hkv, T*G, n]
    m = mask.unsqueeze(1).expand(T, G, -1).reshape(1, T * G, -1)
    scores = scores.float().masked_fill(~m, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    o = bmm_rows(p, V.permute(1, 0, 2))  # [Hkv, T*G, d]
    return o.view(Hkv, T, G, d).permute(1, 0, 2, 3)


@fused
def gated_out(o: torch.Tensor, gate: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """wo (o * sigmoid(gate)) for attention outputs o and gates [T, H, d]."""
    T = o.shape[0]
    return linear(o.reshape(T, -1) * sigmoid(gate.reshape(T, -1)), wo)

