"""Masked softmax attention over a KV cache, read once: the dense path of QSA (the indexer's block mask over a KV
bucket) and the MTP head's causal attention.

`masked_attention_torch` is the reference: the cache rows dequantized to f32 (q8_0) or widened, f32 scores, the mask,
softmax, f32 output. On CUDA `masked_attention` runs the Triton kernels (triton_masked_attention.py): one program per
(row, kv head, chunk of cells) keeps an online softmax over its cells with q8_0 scaled in registers, and a second
kernel combines the chunks (flash-decoding). Why: the model's step path dequantizes the whole bucket to a bf16 copy,
then runs two batched products and a softmax over it, four launches and the copy's traffic per attention layer
(BENCHMARKS.md §5, the masked attention row).
"""

from __future__ import annotations

import torch

from qspec.kernels.dequant import dequant_q8_0_torch
from qspec.kernels.sparse_attention import check_cache
from qspec.kernels.triton_common import use_triton


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, mask: torch.Tensor) -> None:
    check_cache(q, k, v, k_scale, v_scale)
    T = q.shape[0]
    if mask.shape != (T, k.shape[0]) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{T}, {k.shape[0]}], got {mask.dtype} {tuple(mask.shape)}")


def _rows(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.float() if scale is None else dequant_q8_0_torch(x, scale, torch.float32)


def masked_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                           v_scale: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d), cells where mask is False left out) V, in f32 -> [T, H, d] in q's dtype.

    q [T, H, d]; k, v [n, Hkv, d] (float, or int8 with k_scale/v_scale [n, Hkv, d/32] for q8_0); mask bool [T, n].
    Every row needs at least one True cell."""
    _check(q, k, v, k_scale, v_scale, mask)
    T, H, d = q.shape
    Hkv = k.shape[1]
    K, V = _rows(k, k_scale), _rows(v, v_scale)  # [n, Hkv, d]
    qh = q.float().view(T, Hkv, H // Hkv, d)
    s = torch.einsum("thgd,nhd->thgn", qh, K) * d ** -0.5
    p = torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("thgn,nhd->thgd", p, V).reshape(T, H, d).to(q.dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernels on CUDA (and under the interpreter), the reference otherwise."""
    _check(q, k, v, k_scale, v_scale, mask)
    if use_triton(q) and q.shape[0] > 0:
        from qspec.kernels.triton_masked_attention import masked_attention_triton

        return masked_attention_triton(q, k, v, k_scale, v_scale, mask)
    return masked_attention_torch(q, k, v, k_scale, v_scale, mask)
