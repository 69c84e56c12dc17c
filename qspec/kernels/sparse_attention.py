"""Attention over the indexer's chosen blocks and the incomplete tail (QSA's sparse read).

Row t attends to the cells of its chosen blocks (blocks[t, j] * r + 0..r-1 for every blocks[t, j] >= 0) and
to the tail cells tail_lo[t]..pos[t]: exactly the cells the dense path's mask allows, read directly instead of
masking a whole KV bucket, so the cost follows the indexer budget (budget + r - 1 keys) rather than the
context. `sparse_attention_torch` gathers those cells and runs f32 softmax attention; the Triton kernel
(triton_sparse_attention.py) does the same in one pass per (row, kv head, key chunk), dequantising q8_0
cells in registers, with a flash-decoding combine of the chunks.
"""

from __future__ import annotations

import torch

from qspec.kernels.dequant import dequant_q8_0_torch
from qspec.kernels.triton_common import use_triton


def key_cells(blocks: torch.Tensor, tail_lo: torch.Tensor, pos: torch.Tensor, r: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cells [T, NB*r + r] int64, valid [T, NB*r + r] bool): the chosen blocks' cells, then the tail's.

    Invalid entries (an unchosen block slot, a tail cell after the row's position) point at cell 0."""
    off = torch.arange(r, device=blocks.device)
    bc = (blocks[:, :, None] * r + off).flatten(1)
    bv = (blocks >= 0)[:, :, None].expand(-1, -1, r).flatten(1)
    tc = tail_lo[:, None] + off[None, :]
    tv = tc <= pos[:, None]
    cells, valid = torch.cat([bc, tc], 1), torch.cat([bv, tv], 1)
    return torch.where(valid, cells, torch.zeros_like(cells)), valid


def _rows(x: torch.Tensor, scale: torch.Tensor | None, cells: torch.Tensor) -> torch.Tensor:
    """Cache rows at `cells` as f32, dequantised when `scale` is given (q8_0)."""
    if scale is None:
        return x[cells].float()
    return dequant_q8_0_torch(x[cells], scale[cells], torch.float32)


def check_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> None:
    """An attention kernel's query and cache arguments: q [T, H, d]; k, v [cells, kv_heads, d] with H a multiple of
    kv_heads; both q8_0 scales [cells, kv_heads, d/32] or neither (also masked_attention's)."""
    if q.dim() != 3:
        raise ValueError(f"attention needs q [T, H, d], got {tuple(q.shape)}")
    H, d = q.shape[1], q.shape[2]
    if k.dim() != 3 or v.shape != k.shape or k.shape[2] != d or H % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} needs k/v [cells, kv_heads, {d}] with H % kv_heads == 0, "
                         f"got k {tuple(k.shape)} v {tuple(v.shape)}")
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and (
            k_scale.shape != (k.shape[0], k.shape[1], d // 32) or v_scale.shape != k_scale.shape)):
        raise ValueError("q8_0 caches need both scale tensors [cells, kv_heads, d/32]")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, blocks: torch.Tensor, tail_lo: torch.Tensor, pos: torch.Tensor) -> None:
    check_cache(q, k, v, k_scale, v_scale)
    T = q.shape[0]
    if blocks.dim() != 2 or blocks.shape[0] != T or tail_lo.shape != (T,) or pos.shape != (T,):
        raise ValueError(f"blocks {tuple(blocks.shape)}, tail_lo {tuple(tail_lo.shape)}, pos {tuple(pos.shape)} "
                         f"for {T} rows")


def sparse_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                           v_scale: torch.Tensor | None, blocks: torch.Tensor, tail_lo: torch.Tensor,
                           pos: torch.Tensor, r: int) -> torch.Tensor:
    """Reference: softmax(q K^T / sqrt(d)) V over each row's cells, in f32 -> [T, H, d] in q's dtype.

    q [T, H, d]; k, v [cells, Hkv, d] (float, or int8 with k_scale/v_scale [cells, Hkv, d/32] for q8_0);
    blocks [T, NB] int64 block ids (-1: none); tail_lo, pos [T]."""
    _check(q, k, v, k_scale, v_scale, blocks, tail_lo, pos)
    T, H, d = q.shape
    Hkv = k.shape[1]
    cells, valid = key_cells(blocks, tail_lo, pos, r)
    K, V = _rows(k, k_scale, cells), _rows(v, v_scale, cells)  # [T, L, Hkv, d]
    qh = q.float().view(T, Hkv, H // Hkv, d)
    s = torch.einsum("thgd,tlhd->thgl", qh, K) * d ** -0.5
    p = torch.softmax(s.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("thgl,tlhd->thgd", p, V).reshape(T, H, d).to(q.dtype)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None, blocks: torch.Tensor, tail_lo: torch.Tensor, pos: torch.Tensor,
                     r: int) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference otherwise (same arguments and result)."""
    if use_triton(q):
        from qspec.kernels.triton_sparse_attention import sparse_attention_triton

        _check(q, k, v, k_scale, v_scale, blocks, tail_lo, pos)
        return sparse_attention_triton(q, k, v, k_scale, v_scale, blocks, tail_lo, pos, r)
    return sparse_attention_torch(q, k, v, k_scale, v_scale, blocks, tail_lo, pos, r)
