"""Sparse QSA attention in Triton: one program per (row t, kv head h, chunk of the row's key list).

The key list of row t is its chosen blocks' cells (blocks[t, j] * R + i) followed by the tail cells
tail_lo[t] + i up to pos[t] (see sparse_attention.py). A program holds the G query heads that share kv
head h as a [GP, D] f32 tile, walks its chunk BN keys at a time (gathered rows, q8_0 scaled in registers),
and keeps an online softmax (running max m, sum l, accumulator acc). Chunks are combined afterwards
(flash-decoding, triton_masked_attention.combine_chunks): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.

For 16-bit q the products run on tensor cores with K, V and the probabilities in q's dtype, f32 accumulation, as in
triton_masked_attention (whose first design, IEEE f32 products on the FMA units, was as slow as this kernel's was:
BENCHMARKS.md §5, the sparse attention row). f32 q keeps IEEE f32 products.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype

BN = 32  # keys per inner step
TARGET_PROGRAMS = 264  # two per H200 SM: split the key list into chunks until the grid reaches this

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start
    from qspec.kernels.triton_masked_attention import (
        combine_chunks,
        new_partials,
        online_step,
        plan_chunks,
        start_heads,
        store_partials,
    )

    @triton.jit
    def _sparse_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, blocks_ptr, tail_ptr, pos_ptr,
                            acc_ptr, m_ptr, l_ptr, NB, L, CHUNK, scale,
                            q_t, q_h, k_c, k_h, s_c, s_h, b_t, a_t, a_h, a_s, ml_t, ml_h,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            R: tl.constexpr, BLOCK_N: tl.constexpr, Q8: tl.constexpr, DT: tl.constexpr,
                            UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        q, m_i, l_i, acc = start_heads(q_ptr, t, t + 1, h, q_t, q_h, G, GP, 1, D, DP)
        pos = tl.load(pos_ptr + t)
        tail = tl.load(tail_ptr + t)
        nbr = NB * R
        for j0 in range(s * CHUNK, s * CHUNK + CHUNK, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            inl = j < L
            inb = j < nbr
            blk = tl.load(blocks_ptr + t * b_t + j // R, mask=inb & inl, other=-1)
            cell_t = tail + (j - nbr)
            valid = inl & tl.where(inb, blk >= 0, cell_t <= pos)
            cell = tl.where(valid, tl.where(inb, blk * R + j % R, cell_t), 0).to(tl.int64)
            m_i, l_i, acc = online_step(q, cell, valid, valid[None, :], m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, h,
                                        k_c, k_h, s_c, s_h, scale, GP, DP, D, BLOCK_N, Q8, DT, UPCAST)
        store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, t, t + 1, h, s, a_t, a_h, a_s, ml_t, ml_h, G, GP, 1, D,
                       DP)


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                            v_scale: torch.Tensor | None, blocks: torch.Tensor, tail_lo: torch.Tensor,
                            pos: torch.Tensor, r: int) -> torch.Tensor:
    """Launch the kernel and combine its chunks; arguments as `sparse_attention` (already checked)."""
    T, H, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    NB = blocks.shape[1]
    L = NB * r + r
    for name, x in (("q", q), ("k", k), ("v", v), ("blocks", blocks)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if k.stride() != v.stride() or (k_scale is not None and (k_scale.stride() != v_scale.stride()
                                                             or k_scale.stride(-1) != 1)):
        raise ValueError("k and v (and their scales) need the same layout")
    # enough chunks to fill the GPU, each a whole number of BN-key steps
    chunk, splits = plan_chunks(T, Hkv, L, BN, TARGET_PROGRAMS)
    acc, m, lsum = new_partials(T, H, splits, d, q.device)  # L is fixed by the budget: so is splits
    q8 = k_scale is not None
    ks = k_scale if q8 else k  # unused pointers when not q8_0
    vs = v_scale if q8 else v
    _sparse_attn_kernel[(T, Hkv, splits)](
        q, k, v, ks, vs, blocks, tail_lo, pos, acc, m, lsum, NB, L, chunk, d ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), ks.stride(0) if q8 else 0, ks.stride(1) if q8 else 0,
        blocks.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        G=G, GP=max(16, next_pow2(G)), D=d, DP=max(16, next_pow2(d)), R=r, BLOCK_N=BN, Q8=q8,
        DT=tl_dtype(q.dtype), UPCAST=INTERPRET, num_warps=4, **pdl_launch(q))
    return combine_chunks(acc, m, lsum, splits, q.dtype)
