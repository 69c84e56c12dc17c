"""The indexer's block choice as a mask: which n_top of a row's block scores are the largest.

`top_blocks_mask_torch` is the reference (`torch.topk`, then a scatter into a boolean mask). On CUDA the
custom op `qspec::top_blocks_mask` runs one Triton program per row (triton_top_blocks.py): a radix
select finds the n_top-th largest score in 32 counting passes over the row held in registers, and
equal scores at the threshold go to the lower block ids. Why: torch's top-k of 512 out of ~1,100 blocks
is a radix sort plus a gather, 34 µs per QSA layer of a decode step on the H200 (BENCHMARKS.md §3b),
for a row of 4 KB. Registered as a custom op so the compiled step functions (model/fuse.py) call it as
one opaque kernel, as they call the mat-vec.
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton

MAX_BLOCKS = 8192  # one program holds a row of scores in registers; longer rows take the reference


def top_blocks_mask_torch(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """s [T, nb] f32 scores (-inf for blocks a row must not choose) -> bool [T, nb], n_top True per row."""
    top = torch.topk(s, n_top, dim=-1).indices
    return torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(1, top, True)


@torch.library.custom_op("qspec::top_blocks_mask", mutates_args=())
def top_blocks_mask(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """As `top_blocks_mask_torch`; the Triton kernel on CUDA (equal scores go to the lower block id)."""
    if s.dim() != 2 or not 0 <= n_top <= s.shape[1]:
        raise ValueError(f"top_blocks_mask needs scores [T, nb] and 0 <= n_top <= nb: {tuple(s.shape)}, {n_top}")
    if use_triton(s) and s.dtype == torch.float32 and s.shape[1] <= MAX_BLOCKS and s.stride(1) == 1:
        from qspec.kernels.triton_top_blocks import top_blocks_mask_triton

        return top_blocks_mask_triton(s, n_top)
    return top_blocks_mask_torch(s, n_top)


@top_blocks_mask.register_fake
def _top_blocks_mask_shape(s: torch.Tensor, n_top: int) -> torch.Tensor:
    return s.new_empty(s.shape, dtype=torch.bool)
