"""Greedy token choice: the index of each row's largest logit, the first one when several are equal.

`argmax_rows_torch` is the reference (`Tensor.argmax`). On CUDA `argmax_rows` runs two Triton kernels
(triton_argmax.py): chunks of every row in parallel, then one small program per row over the chunks' winners.
Why: torch's argmax of a [1, 248320] row is one block of 512 threads, which leaves most of the H200 idle, and an
MTP5 round takes six of them (benchmarks/results/profile_step_fn8_s10b_mixer_ab.txt; BENCHMARKS.md §5, the greedy
argmax row).
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def argmax_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> int64 [M]: the first index of each row's maximum (NaN counts as the largest, as in torch)."""
    return x.argmax(-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """As `argmax_rows_torch`; the Triton kernels on CUDA for a float matrix with a contiguous last dim."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows needs a non-empty [M, V] matrix, got {tuple(x.shape)}")
    if use_triton(x) and x.dtype in DTYPES and x.stride(1) == 1 and x.shape[0] > 0:
        from qspec.kernels.triton_argmax import argmax_rows_triton

        return argmax_rows_triton(x)
    return argmax_rows_torch(x)
