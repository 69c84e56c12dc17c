"""Attention KV cache: static [capacity, kv_heads, head_dim] buffers, addressed by position.

One sequence; cell = position. Rollback (`seq_rm`) moves nothing: a query at position p only
reads cells <= p, and every cell in (accepted length, p] is rewritten by the step that computes
p before p reads it. Invariant: cells below the committed length hold the keys/values of the
committed tokens.

Types: float (bf16/f16/f32) or q8_0 (int8 in blocks of 32 along head_dim, one f16 scale each, as
llama.cpp's Q8_0), dequantized on read (kernels/dequant.py).
"""

from __future__ import annotations

import torch

from qspec.kernels.dequant import Q8_BLOCK, dequant_kv
from qspec.kernels.kv_write import quantize_q8_0_torch, write_q8_0
from qspec.model.fuse import fused

quantize_q8_0 = fused(quantize_q8_0_torch)  # x [..., d] -> int8 values, f16 scales [..., d/32] (ggml's Q8_0)


class KVCache:
    def __init__(self, capacity: int, kv_heads: int, head_dim: int, *, cache_type: str, dtype: torch.dtype,
                 device: torch.device | str, fused_attention: bool = False, write_kernel: bool = False) -> None:
        self.capacity, self.cache_type, self.dtype = capacity, cache_type, dtype
        # how attention reads the cells: in one pass over the stored cells (kernels/masked_attention.py) instead of
        # `read` (a dequantized copy) with separate products and softmax
        self.fused_attention = fused_attention
        # how a q8_0 cache is written: one kernel (kernels/kv_write.py) instead of the compiled quantization with four
        # index copies
        self.write_kernel = write_kernel
        shape = (capacity, kv_heads, head_dim)
        if cache_type == "q8_0":
            if head_dim % Q8_BLOCK:
                raise ValueError(f"cache type q8_0 needs head_dim % {Q8_BLOCK} == 0, got {head_dim}")
            self.k = torch.zeros(shape, dtype=torch.int8, device=device)
            self.v = torch.zeros(shape, dtype=torch.int8, device=device)
            sshape = (capacity, kv_heads, head_dim // Q8_BLOCK)
            self.k_scale = torch.zeros(sshape, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(sshape, dtype=torch.float16, device=device)
        else:
            store = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}.get(cache_type)
            if store is None:
                raise ValueError(f"unknown KV cache type {cache_type!r} (f32, f16, bf16, q8_0)")
            self.k = torch.zeros(shape, dtype=store, device=device)
            self.v = torch.zeros(shape, dtype=store, device=device)

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.cache_type == "q8_0":  # the kernel, or the compiled quantization and four index copies
            write_q8_0(self.k, self.v, self.k_scale, self.v_scale, pos, k, v, kernel=self.write_kernel,
                       quantize=quantize_q8_0)
        else:
            self.k.index_copy_(0, pos, k.to(self.k.dtype))
            self.v.index_copy_(0, pos, v.to(self.v.dtype))

    def read(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cells [0, n) (all cells by default) in the compute dtype."""
        n = self.capacity if n is None else n
        if self.cache_type == "q8_0":
            return dequant_kv(self.k[:n], self.k_scale[:n], self.v[:n], self.v_scale[:n], self.dtype)
        return self.k[:n].to(self.dtype), self.v[:n].to(self.dtype)

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The q8_0 block scales of k and v, or (None, None) for a float cache."""
        if self.cache_type == "q8_0":
            return self.k_scale, self.v_scale
        return None, None

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, each indexed by cell along its first axis."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.cache_type == "q8_0" else [])

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.buffers())
