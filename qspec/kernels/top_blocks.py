"""The indexer's block choice as a mask: which n_top of a row's block scores are the largest.

The rule is transformers' (`Qwen4ExpTextQSAIndexer`): `torch.topk(scores, min(n_top, m))` over the 1-D
vector of the m blocks the row may choose, in block order; -inf marks the others, never chosen; +0 and -0
are one score. Exact ties are common (a block scores exactly 0 when relu(q.K) is 0 for every indexer head)
and torch.topk has no tie rule of its own:
- on the CPU it returns what libstdc++'s `nth_element` (or `partial_sort`, when 64 n_top <= m) leaves in
  front, which depends on the vector's length and contents (of [0, -0, 0, 0] it keeps blocks 2 and 3);
- on CUDA its radix select gathers the ties at the threshold in block order, so the lower block ids win
  (seen on an H200, torch 2.11, rows of 7 to 70,000 blocks). It ranks -0 below +0, which never matters
  in transformers there (relu on CUDA turns -0 into +0); on the CPU -0 and +0 compare equal.
So the tied blocks kept are torch.topk's on the device the scores live on, and on the CPU only a call on
the very same vector reproduces them: a row padded with -inf blocks (its future, the bucket past its
blocks) is another vector and can keep other ties. `top_blocks_mask_torch` therefore runs torch.topk on
each row's choosable blocks alone on the CPU; on CUDA the padding cannot change the choice.

On CUDA the custom op `qspec::top_blocks_mask` runs one Triton program per row (triton_top_blocks.py): a
radix select finds the n_top-th largest score in 32 counting passes over the row held in registers, and
equal scores at the threshold go to the lower block ids, as torch.topk's on CUDA. Why: torch's top-k of
512 out of ~1,100 blocks is a radix sort plus a gather, several kernels for a row of 4 KB (BENCHMARKS.md §5, the
indexer top-512 row). Registered as a custom op so the compiled step functions
(model/fuse.py) call it as one opaque kernel, as they call the mat-vec.
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton

MAX_BLOCKS = 8192  # one program holds a row of scores in registers; longer rows take the reference


def top_blocks_mask_torch(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """s [T, nb] f32 scores (-inf for blocks a row must not choose) -> bool [T, nb]: per row, the blocks
    torch.topk(choosable, min(n_top, m)) picks from the row's m choosable scores, taken in block order.

    Rows with the same m share one batched torch.topk (it treats every row as its own 1-D vector). On CUDA,
    where torch.topk keeps ties in block order and -inf padding cannot change which, it is one call with no
    host sync, so the fallback for rows beyond MAX_BLOCKS stays inside a CUDA graph."""
    out = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    ok = s > float("-inf")
    if s.is_cuda:  # its radix order puts -0 below +0: make every zero +0, as relu's on CUDA are in transformers
        top = torch.topk(torch.where(s == 0, 0.0, s), n_top, dim=-1).indices
        return out.scatter_(1, top, True) & ok
    m = ok.sum(1)
    for mv in m.unique().tolist():
        if mv == 0 or n_top == 0:
            continue
        rows = (m == mv).nonzero().squeeze(1)
        cols = ok[rows].nonzero()[:, 1].view(-1, mv)  # each row's choosable blocks, in block order
        top = s[rows].gather(1, cols).topk(min(n_top, mv), dim=1).indices
        out[rows] = out[rows].scatter(1, cols.gather(1, top), True)
    return out


@torch.library.custom_op("qspec::top_blocks_mask", mutates_args=())
def top_blocks_mask(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """As `top_blocks_mask_torch`; the Triton kernel on CUDA (equal scores go to the lower block id, as
    torch.topk's on CUDA)."""
    if s.dim() != 2 or not 0 <= n_top <= s.shape[1]:
        raise ValueError(f"top_blocks_mask needs scores [T, nb] and 0 <= n_top <= nb: {tuple(s.shape)}, {n_top}")
    if use_triton(s) and s.dtype == torch.float32 and s.shape[1] <= MAX_BLOCKS and s.stride(1) == 1:
        from qspec.kernels.triton_top_blocks import top_blocks_mask_triton

        return top_blocks_mask_triton(s, n_top)
    return top_blocks_mask_torch(s, n_top)


@top_blocks_mask.register_fake
def _top_blocks_mask_shape(s: torch.Tensor, n_top: int) -> torch.Tensor:
    return s.new_empty(s.shape, dtype=torch.bool)
