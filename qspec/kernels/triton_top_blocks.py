"""The indexer's top-n_top block mask in Triton: one program per row, grid (T,).

Scores map to order-preserving unsigned 32-bit keys (held in int64; +0 and -0 merged first, padding
lanes -1, below every key). A radix select builds the n_top-th largest key bit by bit from the top:
keep bit b if at least n_top keys are >= the threshold with it set (32 counting passes over registers).
Keys above the threshold are chosen; of the keys equal to it, as many as are still needed, in order of
block id (a prefix count): the set torch.topk picks on CUDA, ties included. Lanes scoring -inf are never
set, so a row with m < n_top choosable blocks gets those m (top_blocks.py: torch.topk over the choosable ones).
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start

    @triton.jit
    def _top_blocks_kernel(s_ptr, o_ptr, NB, n_top, s_t, o_t, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        valid = i < NB
        x = tl.load(s_ptr + t * s_t + i, mask=valid, other=0.0) + 0.0  # -0 + 0 = +0: one key for zero
        b = x.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(b >= 0, b + 2147483648, -1 - b)  # float order as unsigned 32-bit order
        key = tl.where(valid, key, -1)
        thr = tl.zeros([1], dtype=tl.int64).sum(axis=0)
        for bit in tl.static_range(31, -1, -1):
            cand = thr | (1 << bit)
            cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
            thr = tl.where(cnt >= n_top, cand, thr)
        above = key > thr
        need = n_top - tl.sum(above.to(tl.int32), axis=0)
        tie = key == thr
        rank = tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among the ties, in block order
        chosen = (above | (tie & (rank <= need))) & (x > float("-inf"))  # -inf: a block the row may not choose
        tl.store(o_ptr + t * o_t + i, chosen, mask=valid)


def top_blocks_mask_triton(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """s [T, nb] f32 with a contiguous last dim (checked by `top_blocks_mask`) -> bool [T, nb]."""
    T, nb = s.shape
    out = torch.empty(T, nb, dtype=torch.bool, device=s.device)
    if T and nb:
        BLOCK = max(next_pow2(nb), 16)
        _top_blocks_kernel[(T,)](s, out, nb, n_top, s.stride(0), out.stride(0), BLOCK=BLOCK,
                                 num_warps=4 if BLOCK <= 1024 else 8, **pdl_launch(s))
    return out
