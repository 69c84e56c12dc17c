"""Writing step rows into a q8_0 KV cache: quantize K and V per 32-element block and scatter them to their cells.

`quantize_q8_0_torch` is ggml's Q8_0 (scale amax / 127, values rounded to nearest with halves to even as its AVX path
does, where its scalar and CUDA paths round halves away from zero; clamped to ±127);
`write_q8_0_torch` quantizes K and V and writes values and scales with four `index_copy_`s. On CUDA `write_q8_0` does
the whole write in one Triton launch (triton_kv_write.py), bit-identical to the reference on the CPU (eager torch on
CUDA divides by a CPU scalar as a product with its reciprocal: one ulp off in a few scales in a thousand). Why: the
step path spent two generated kernels per quantization and four index copies per attention layer, eight launches for
a few KB (BENCHMARKS.md §5, the q8_0 KV write row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qspec.kernels.dequant import Q8_BLOCK
from qspec.kernels.triton_common import use_triton


def quantize_q8_0_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (d % 32 == 0) -> int8 values and f16 scales [..., d/32] (round-to-nearest like ggml)."""
    xb = x.float().unflatten(-1, (-1, Q8_BLOCK))
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), d.squeeze(-1).to(torch.float16)


def _check(kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> None:
    if kq.dim() != 3 or kq.dtype != torch.int8 or vq.shape != kq.shape or vq.dtype != torch.int8:
        raise ValueError(f"q8_0 KV write: values must be int8 [cells, heads, d], got {tuple(kq.shape)}, "
                         f"{tuple(vq.shape)}")
    shape = (kq.shape[0], kq.shape[1], kq.shape[2] // Q8_BLOCK)
    if kq.shape[2] % Q8_BLOCK or ks.shape != shape or vs.shape != shape:
        raise ValueError(f"q8_0 KV write: scales must be [cells, heads, d/32] = {shape}, got {tuple(ks.shape)}, "
                         f"{tuple(vs.shape)}")
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != kq.shape[1:] or pos.shape != (k.shape[0],):
        raise ValueError(f"q8_0 KV write: rows k, v [T, heads, d] and pos [T], got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(pos.shape)}")


def write_q8_0_torch(kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor,
                     quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_q8_0_torch
                     ) -> None:
    """Quantize k, v [T, heads, d] and write them to cells pos [T] of the cache's values kq, vq [cells, heads, d]
    (int8) and scales ks, vs [cells, heads, d/32] (f16). `quantize`: the same rounding, compiled (the KV cache's
    default write passes its fused copy)."""
    _check(kq, vq, ks, vs, pos, k, v)
    for x, q, s in ((k, kq, ks), (v, vq, vs)):
        xq, xs = quantize(x)
        q.index_copy_(0, pos, xq)
        s.index_copy_(0, pos, xs)


def write_q8_0(kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, kernel: bool = True,
               quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_q8_0_torch) -> None:
    """As `write_q8_0_torch`; with `kernel`, one Triton launch on CUDA (and under the interpreter), else (and where
    the kernel does not apply) `write_q8_0_torch` with `quantize`."""
    _check(kq, vq, ks, vs, pos, k, v)
    if kernel and use_triton(k) and k.shape[0] > 0 and all(t.is_contiguous() for t in (kq, vq, ks, vs)) \
            and k.stride(-1) == 1 and v.stride(-1) == 1:
        from qspec.kernels.triton_kv_write import write_q8_0_triton

        write_q8_0_triton(kq, vq, ks, vs, pos, k, v)
        return
    write_q8_0_torch(kq, vq, ks, vs, pos, k, v, quantize=quantize)
