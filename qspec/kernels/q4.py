"""The draft's Q4 LM head: ggml Q4_0 weights kept packed on the device, and a matvec that reads them as is.

`Q4Weight` holds the two planes of a Q4_0 tensor (nibbles and f16 block scales, ggml's layout and
rounding via `quantize_q4_0`); `q4_matvec` multiplies a few rows by it, with the Triton kernel
(triton_q4.py) on CUDA and dequantize-then-matmul otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qspec.kernels.qdot import quantize_x_torch
from qspec.kernels.triton_common import use_triton
from qspec.weights.dequant import nibbles, quantize_q4_0

QK = 32  # elements per Q4_0 block
BLOCK_BYTES = 18  # f16 scale + 16 bytes of nibbles


@dataclass
class Q4Weight:
    packed: torch.Tensor  # [N, K/2] uint8: per block, byte i = element i (low nibble) | element i + 16 (high)
    scales: torch.Tensor  # [N, K/32] f16

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @classmethod
    def from_ggml(cls, raw: torch.Tensor, shape: tuple[int, int]) -> Q4Weight:
        """From a GGUF Q4_0 tensor's raw bytes ([N * K/32 * 18] uint8, row-major blocks), on raw's device."""
        N, K = shape
        if K % QK or raw.dtype != torch.uint8 or raw.numel() != N * (K // QK) * BLOCK_BYTES:
            raise ValueError(f"not a Q4_0 tensor of shape {shape}: {raw.numel()} bytes of {raw.dtype}")
        blocks = raw.reshape(N, K // QK, BLOCK_BYTES)
        scales = blocks[..., :2].contiguous().view(torch.float16).reshape(N, K // QK)
        packed = blocks[..., 2:].reshape(N, K // 2).contiguous()
        return cls(packed, scales)

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> Q4Weight:
        """Quantize w [N, K] (K a multiple of 32) exactly as ggml's quantize_row_q4_0, on w's device."""
        if w.dim() != 2:
            raise ValueError(f"expected a matrix, got shape {tuple(w.shape)}")
        return cls.from_ggml(quantize_q4_0(w).reshape(-1), (w.shape[0], w.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: d * (q - 8), computed in f32 (exact), as ggml's dequantize_row_q4_0."""
        N, K = self.shape
        q = nibbles(self.packed.view(N, K // QK, QK // 2)).float() - 8.0
        return (self.scales.float()[..., None] * q).reshape(N, K).to(dtype)

    def to(self, device: torch.device | str) -> Q4Weight:
        return Q4Weight(self.packed.to(device), self.scales.to(device))


def q4_matvec_torch(x: torch.Tensor, W: Q4Weight) -> torch.Tensor:
    """Reference: x [..., K] @ dequantize(W)^T in f32, returned in x.dtype."""
    return (x.float() @ W.dequantize(torch.float32).t()).to(x.dtype)


def quantize_q8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 q [M, K], f32 scales d [M, K/32] and int32 block sums [M, K/32]: per 32-element block,
    q = floor(x * (127 / amax) + 0.5) and d = amax / 127 (llama.cpp's q8_1 activations, rounding half up), with the
    block products' roundings (qdot.quantize_x_torch: correctly rounded divisions, as the kernels')."""
    M, K = x.shape
    q, d, _, g16 = quantize_x_torch(x)
    return q, d, g16.view(M, K // QK, 2).sum(-1, dtype=torch.int32)


def q4_q8_matvec_torch(x: torch.Tensor, W: Q4Weight) -> torch.Tensor:
    """Reference of the CUDA kernel: x [M, K] quantized by quantize_q8_torch, exact integer block dots with the
    nibbles, then per block (dot - 8 * sum(q)) * (d_w * d_x), summed in f32 -> [M, N] in x.dtype."""
    N, K = W.shape
    M = x.shape[0]
    q, d, sums = quantize_q8_torch(x)
    nib = nibbles(W.packed.view(N, K // QK, QK // 2)).float()  # [N, KB, 32], 0..15
    dots = torch.einsum("mbi,nbi->mnb", q.float().view(M, K // QK, QK), nib)  # exact: |dot| < 2^24
    y = ((dots - 8 * sums[:, None, :].float()) * (W.scales.float()[None] * d[:, None, :])).sum(-1)
    return y.to(x.dtype)


def q4_matvec(x: torch.Tensor, W: Q4Weight) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T, output in x.dtype.

    On CUDA the Triton kernel (triton_q4.py), which quantizes x to int8 blocks as llama.cpp's CUDA backend does for
    its Q4_0 mat-vec (reference: q4_q8_matvec_torch); elsewhere the exact dequantize-then-matmul (q4_matvec_torch).
    The draft head only proposes tokens, which the target verifies with its own head, so the int8 x changes at
    most which drafts are proposed, never the output."""
    if not use_triton(x):
        return q4_matvec_torch(x, W)
    from qspec.kernels.triton_q4 import q4_q8_matvec_triton

    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return q4_q8_matvec_triton(x2, W.packed, W.scales).reshape(*lead, W.shape[0])
