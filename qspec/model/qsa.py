"""QSA attention: gated GQA attention whose keys are restricted by a block-pooled indexer.

Indexer (transformers semantics): each token's raw key is cached; a pooled block key is the mean
of r raw keys (f32, rounded to the raw-key dtype), RMS-normed, roped at the block start. A query
scores every complete block visible to it (sum over heads of relu(q.K) / sqrt(d)), keeps the top
budget/r blocks and always the incomplete tail. Up to budget + r - 1 tokens it is exactly dense.
"""

from __future__ import annotations

import torch

from qspec.config import ModelConfig
from qspec.kernels.pooled import materialize_pooled_fast
from qspec.model.fuse import fused
from qspec.model.hyper import stream_mean
from qspec.model.ops import apply_rope, bmm_rows, linear, rms_norm, sigmoid, stack_rows
from qspec.state.indexer_cache import IndexerCache
from qspec.state.kv_cache import KVCache


class PooledUpdate:
    """Device tensors of one step's pooled-key update list (shared by all QSA layers)."""

    def __init__(self, cells: torch.Tensor, start: torch.Tensor, dest: torch.Tensor) -> None:
        self.cells, self.start, self.dest = cells, start, dest


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
        self.w_in, views = stack_rows(*ins)
        self.wq, self.wk, self.wv = views[:3]
        if ratio:
            self.iq, self.ik = views[3:]

    def forward(self, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache,
                idx: IndexerCache | None, upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None,
                key_lo: int = 0, kv_len: int | None = None) -> torch.Tensor:
        """h [T, D] at positions pos [T]; key_lo: first position that holds a key (the MTP head has none at 0).

        kv_len: cells to attend over (a bucket above the last position; the whole cache by default)."""
        c = self.cfg
        q, gate, k, v, rest = qsa_qkv(h, self.w_in, self.q_norm, self.k_norm, cos, sin, c.n_heads, c.n_kv_heads,
                                      c.head_dim, c.rms_eps)
        kv.write(pos, k, v)
        n = kv.capacity if kv_len is None else kv_len
        K, V = kv.read(n)
        if self.ratio and idx is not None:
            mask = self.select(rest, pos, cos, sin, idx, upd, upd_rope, n, key_lo)
        else:
            mask = causal_mask(pos, n, key_lo)
        return attend(q, K, V, mask, gate, self.wo)

    def select(self, proj: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               idx: IndexerCache, upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None, n: int,
               key_lo: int = 0) -> torch.Tensor:
        """Boolean [T, n]: which of the first n cells each row may attend to (top blocks + incomplete tail).

        proj [T, heads*di + di]: the indexer's query and raw key projections of the rows."""
        c, r = self.cfg, self.ratio
        qd = c.indexer_heads * c.indexer_head_dim
        idx.raw.index_copy_(0, pos, proj[:, qd:].to(idx.raw.dtype))
        if upd is not None and upd_rope is not None:
            materialize_pooled(idx, upd, self.ik_norm, c.rms_eps, *upd_rope)
        nbmax = min(idx.n_blocks, n // r)
        return block_mask(proj[:, :qd], pos, cos, sin, self.iq_norm, idx.pooled[:nbmax], n, r, c.indexer_heads,
                          min(c.indexer_budget // r, nbmax), c.rms_eps, key_lo)


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


@fused
def causal_mask(pos: torch.Tensor, n: int, key_lo: int) -> torch.Tensor:
    """Boolean [T, n]: cells key_lo..pos of each row."""
    key_pos = torch.arange(n, device=pos.device)
    return (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= key_lo)


@fused
def block_mask(qi: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, iq_norm: torch.Tensor,
               Kb: torch.Tensor, n: int, r: int, heads: int, n_top: int, eps: float, key_lo: int) -> torch.Tensor:
    """Indexer selection as a boolean [T, n] over the first n cells: the n_top best-scoring complete blocks
    visible to each row (Kb [nb, di]: their pooled keys) plus the incomplete tail up to the row itself.

    qi [T, heads*di]: the rows' indexer query projections."""
    T, nb, di = qi.shape[0], Kb.shape[0], Kb.shape[1]
    qi = apply_rope(rms_norm(qi.unflatten(-1, (heads, di)), iq_norm, eps), cos, sin)
    s = torch.relu(linear(qi.float().reshape(T * heads, di), Kb).view(T, heads, nb))
    s = stream_mean(s) * (heads / di ** 0.5)  # sum over heads / sqrt(d), in a fixed order
    nb_vis = (pos + 1) // r  # complete blocks visible to each row
    vis = torch.arange(nb, device=qi.device)[None, :] < nb_vis[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    top = torch.topk(s, n_top, dim=-1).indices
    chosen = torch.zeros(T, nb, dtype=torch.bool, device=qi.device).scatter_(1, top, True) & vis
    key_pos = torch.arange(n, device=qi.device)
    kblk = (key_pos // r).clamp(max=nb - 1)
    in_blocks = chosen.gather(1, kblk[None, :].expand(T, -1)) & (key_pos[None, :] < (nb_vis * r)[:, None])
    tail = (key_pos[None, :] >= (nb_vis * r)[:, None]) & (key_pos[None, :] <= pos[:, None])
    return (in_blocks | tail) & (key_pos[None, :] >= key_lo)


@fused
def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor,
           wo: torch.Tensor) -> torch.Tensor:
    """Masked GQA softmax attention of q [T, H, d] over K, V [n, Hkv, d], gated by sigmoid(gate), projected by wo."""
    T, H, d = q.shape
    Hkv = K.shape[1]
    G = H // Hkv
    qh = q.view(T, Hkv, G, d).permute(1, 0, 2, 3).reshape(Hkv, T * G, d)
    scores = bmm_rows(qh, K.permute(1, 2, 0)) * d ** -0.5  # [Hkv, T*G, n]
    m = mask.unsqueeze(1).expand(T, G, -1).reshape(1, T * G, -1)
    scores = scores.float().masked_fill(~m, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    o = bmm_rows(p, V.permute(1, 0, 2))  # [Hkv, T*G, d]
    o = o.view(Hkv, T, G, d).permute(1, 0, 2, 3).reshape(T, H * d)
    return linear(o * sigmoid(gate.reshape(T, H * d)), wo)
