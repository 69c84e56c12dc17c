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
from qspec.model.hyper import stream_mean
from qspec.model.ops import apply_rope, bmm_rows, linear, rms_norm, sigmoid
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
        self.wq, self.wk, self.wv = w[f"{b}.attn_q.weight"], w[f"{b}.attn_k.weight"], w[f"{b}.attn_v.weight"]
        self.wo = w[f"{b}.attn_output.weight"]
        self.q_norm, self.k_norm = w[f"{b}.attn_q_norm.weight"], w[f"{b}.attn_k_norm.weight"]
        if ratio:
            self.iq = w[f"{b}.indexer.q_proj.weight"]
            self.ik = w[f"{b}.indexer.k_proj.weight"]
            self.iq_norm = w[f"{b}.indexer.q_norm.weight"]
            self.ik_norm = w[f"{b}.indexer.k_norm.weight"]

    def forward(self, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache,
                idx: IndexerCache | None, upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None,
                key_lo: int = 0, kv_len: int | None = None) -> torch.Tensor:
        """h [T, D] at positions pos [T]; key_lo: first position that holds a key (the MTP head has none at 0).

        kv_len: cells to attend over (a bucket above the last position; the whole cache by default)."""
        c = self.cfg
        T = h.shape[0]
        H, Hkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        qg = linear(h, self.wq).view(T, H, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        q = rms_norm(q, self.q_norm, c.rms_eps)
        k = rms_norm(linear(h, self.wk).view(T, Hkv, d), self.k_norm, c.rms_eps)
        v = linear(h, self.wv).view(T, Hkv, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(pos, k, v)
        n = kv.capacity if kv_len is None else kv_len
        K, V = kv.read(n)
        key_pos = torch.arange(n, device=h.device)
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= key_lo)
        if self.ratio and idx is not None:
            mask &= self.select(h, pos, cos, sin, idx, upd, upd_rope, n)
        G = H // Hkv
        qh = q.view(T, Hkv, G, d).permute(1, 0, 2, 3).reshape(Hkv, T * G, d)
        scores = bmm_rows(qh, K.permute(1, 2, 0)) * d ** -0.5  # [Hkv, T*G, L]
        m = mask.unsqueeze(1).expand(T, G, -1).reshape(1, T * G, -1)
        scores = scores.float().masked_fill(~m, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(h.dtype)
        o = bmm_rows(p, V.permute(1, 0, 2))  # [Hkv, T*G, d]
        o = o.view(Hkv, T, G, d).permute(1, 0, 2, 3).reshape(T, H * d)
        o = o * sigmoid(gate.reshape(T, H * d))
        return linear(o, self.wo)

    def select(self, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: IndexerCache,
               upd: PooledUpdate | None, upd_rope: tuple[torch.Tensor, torch.Tensor] | None, n: int) -> torch.Tensor:
        """Boolean [T, n]: which of the first n cells each row may attend to (top blocks + incomplete tail)."""
        c, r = self.cfg, self.ratio
        T = h.shape[0]
        di = c.indexer_head_dim
        qi = rms_norm(linear(h, self.iq).view(T, c.indexer_heads, di), self.iq_norm, c.rms_eps)
        qi = apply_rope(qi, cos, sin)
        idx.raw.index_copy_(0, pos, linear(h, self.ik).to(idx.raw.dtype))
        if upd is not None and upd_rope is not None:
            materialize_pooled(idx, upd, self.ik_norm, c.rms_eps, *upd_rope)
        nbmax = min(idx.n_blocks, n // r)
        Kb = idx.pooled[:nbmax]
        s = torch.relu(linear(qi.float().reshape(T * c.indexer_heads, di), Kb).view(T, c.indexer_heads, nbmax))
        s = stream_mean(s) * (c.indexer_heads / di ** 0.5)  # sum over heads / sqrt(d), in a fixed order
        nb_vis = (pos + 1) // r  # complete blocks visible to each row
        blk = torch.arange(nbmax, device=h.device)
        vis = blk[None, :] < nb_vis[:, None]
        s = s.masked_fill(~vis, float("-inf"))
        n_top = min(c.indexer_budget // r, nbmax)
        top = torch.topk(s, n_top, dim=-1).indices
        chosen = torch.zeros(T, nbmax, dtype=torch.bool, device=h.device).scatter_(1, top, True) & vis
        key_pos = torch.arange(n, device=h.device)
        kblk = (key_pos // r).clamp(max=nbmax - 1)
        in_blocks = chosen.gather(1, kblk[None, :].expand(T, -1)) & (key_pos[None, :] < (nb_vis * r)[:, None])
        tail = (key_pos[None, :] >= (nb_vis * r)[:, None]) & (key_pos[None, :] <= pos[:, None])
        return in_blocks | tail
