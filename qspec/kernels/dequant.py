"""q8_0 -> 16/32-bit dequantisation of the KV cache's first n cells, read by masked attention every step.

`dequant_q8_0_torch` is the reference (llama.cpp's Q8_0: int8 values in blocks of 32 along the head
dim, one f16 scale each; value * scale in f32, rounded once to the compute dtype). On CUDA,
`dequant_kv` runs K and V through one Triton launch (triton_dequant.py). Why a kernel: inside the
torch.compile'd step inductor generated this cast with symbolic sizes, several times slower on the H200 than when
compiled with static sizes and far from what ~7 MB of traffic needs at the H200's bandwidth (BENCHMARKS.md §5, the
KV dequant row).
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton

Q8_BLOCK = 32


def dequant_q8_0_torch(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..., D], d f16 [..., D/32] -> [..., D] in dtype."""
    return (q.unflatten(-1, (-1, Q8_BLOCK)).float() * d.float().unsqueeze(-1)).flatten(-2).to(dtype)


def _kernel_takes(q: torch.Tensor, d: torch.Tensor) -> bool:
    return q.is_contiguous() and d.is_contiguous() and q.shape[:-1] == d.shape[:-1] \
        and q.shape[-1] == d.shape[-1] * Q8_BLOCK


def dequant_kv(k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of a q8_0 cache slice at once (one launch on CUDA); the reference elsewhere."""
    if use_triton(k) and dtype in (torch.float32, torch.float16, torch.bfloat16) \
            and _kernel_takes(k, k_scale) and _kernel_takes(v, v_scale) and k.shape == v.shape:
        from qspec.kernels.triton_dequant import dequant_kv_triton

        return dequant_kv_triton(k, k_scale, v, v_scale, dtype)
    return dequant_q8_0_torch(k, k_scale, dtype), dequant_q8_0_torch(v, v_scale, dtype)
