"""GGML block formats in pure torch: dequantize raw GGUF bytes on any device, quantize Q8_0/Q4_0.

Every function takes/returns torch tensors and uses only elementwise/bitwise torch ops, so the same code
runs on CPU and CUDA: the loader can ship the raw (smaller) bytes to the GPU and expand them there.
The block layouts follow ggml-quants.c; `tests/test_weights.py` checks each against `gguf.quants`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # super-block size of the K-quants
# Blocks expanded per step: bounds the float32 temporaries of one huge tensor to a few hundred MiB.
_CHUNK_BLOCKS = 1 << 20


class WeightsError(ValueError):
    """A model file that cannot be loaded as asked; the message names the file, key or tensor at fault.

    Defined in this lowest-level module so every loader can raise it; re-exported by `qspec.weights`."""


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] packed bytes -> [n, 2m]: all low nibbles first, then all high nibbles (ggml's Q4 layout)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (nibbles(b[:, 2:]).float() - 8.0)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    # qh is a little-endian uint32: bit i (byte i // 8, bit i % 8) is the 5th bit of element i.
    qh = ((b[:, 2:6, None] >> shifts) & 1).reshape(-1, 32)
    q = nibbles(b[:, 6:]) | (qh << 4)
    return _f16(b[:, :2]) * (q.float() - 16.0)


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    qh = ((b[:, 4:8, None] >> shifts) & 1).reshape(-1, 32)  # as Q5_0's, after the f16 scale and min
    q = nibbles(b[:, 8:]) | (qh << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte field of Q4_K/Q5_K into eight 6-bit scales and eight 6-bit mins."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: each 32-byte chunk gives sub-block 2j (low nibbles) and 2j+1 (high)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def _k_weights(b: torch.Tensor, q: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.Tensor:
    """A Q4_K / Q5_K super-block's weights d*sc*q - dmin*m from its quants q [n, 8, 32]; scale_dtype: d*sc and
    dmin*m rounded to it first (what the tensor-core product's pair expansion multiplies with,
    triton_qmatmul._tile_k_pairs)."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    ds, dm = d * sc, dmin * mn
    if scale_dtype is not None:
        ds, dm = ds.to(scale_dtype).float(), dm.to(scale_dtype).float()
    return (ds[..., None] * q - dm[..., None]).reshape(-1, QK_K)


def _deq_q4_k(b: torch.Tensor, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _k_weights(b, _k_low_nibbles(b[:, 16:144]).float(), scale_dtype)


def _deq_q5_k(b: torch.Tensor, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    qh = (b[:, None, 16:48] >> shifts) & 1  # bit j of qh[l] is the 5th bit of sub-block j, element l
    return _k_weights(b, (_k_low_nibbles(b[:, 48:176]) | (qh << 4)).float(), scale_dtype)


def _deq_q6_k(b: torch.Tensor, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    ql = ql.reshape(-1, 2, 1, 64)
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    hi = ((qh.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((lo | (hi << 4)).float() - 32.0).reshape(-1, 16, 16)
    ds = d * scales
    if scale_dtype is not None:  # as _k_weights
        ds = ds.to(scale_dtype).float()
    return (ds[..., None] * q).reshape(-1, QK_K)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _deq_q8_0,
    GGMLQuantizationType.Q4_0: _deq_q4_0,
    GGMLQuantizationType.Q4_1: _deq_q4_1,
    GGMLQuantizationType.Q5_0: _deq_q5_0,
    GGMLQuantizationType.Q5_1: _deq_q5_1,
    GGMLQuantizationType.Q4_K: _deq_q4_k,
    GGMLQuantizationType.Q5_K: _deq_q5_k,
    GGMLQuantizationType.Q6_K: _deq_q6_k,
}
_K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
_PLAIN = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(_PLAIN) | frozenset(_BLOCK_DEQUANT)


def qtype_nbytes(qtype: GGMLQuantizationType, shape: Sequence[int]) -> int:
    """Bytes ggml uses for a tensor of `shape` (torch order); the last dim must hold whole blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= int(s)
    if shape and int(shape[-1]) % block:
        raise WeightsError(f"{qtype.name}: row length {shape[-1]} is not a multiple of the block size {block}")
    return n // block * size


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: Sequence[int],
               dtype: torch.dtype = torch.float32, round_scales: bool = False) -> torch.Tensor:
    """Expand the raw uint8 bytes of one GGML tensor to `shape` (torch order) in `dtype`, on raw's device.
    round_scales (the K-quants): each sub-block's scale (and min) rounded to `dtype` before they multiply, as the
    tensor-core product expands such weights for 16-bit rows."""
    qtype = GGMLQuantizationType(qtype)
    if round_scales and qtype not in _K_QUANTS:
        raise WeightsError(f"round_scales applies to Q4_K, Q5_K and Q6_K, not {qtype.name}")
    if raw.dtype != torch.uint8:
        raise WeightsError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    if qtype not in SUPPORTED_QTYPES:
        raise WeightsError(f"unsupported quant type {qtype.name}")
    shape = tuple(int(s) for s in shape)
    need = qtype_nbytes(qtype, shape)
    raw = raw.reshape(-1)
    if raw.numel() != need:
        raise WeightsError(f"{qtype.name} tensor of shape {shape} needs {need} bytes, got {raw.numel()}")
    if qtype in _PLAIN:
        return raw.view(_PLAIN[qtype]).reshape(shape).to(dtype)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, size)
    fn = _BLOCK_DEQUANT[qtype]
    if round_scales:
        fn = functools.partial(fn, scale_dtype=dtype)
    if blocks.shape[0] <= _CHUNK_BLOCKS:
        return fn(blocks).to(dtype).reshape(shape)
    out = torch.empty(blocks.shape[0], block, dtype=dtype, device=raw.device)
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = fn(blocks[i:i + _CHUNK_BLOCKS])
    return out.reshape(shape)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf (torch.round rounds half to even)."""
    a = x.abs()
    f = a.floor()
    return torch.sign(x) * (f + (2 * (a - f)).floor())


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % block:
        raise WeightsError(f"row length {tuple(x.shape)[-1:]} is not a multiple of the block size {block}")
    return x.reshape(-1, block).float()


def _quantize_chunked(x: torch.Tensor, block: int, size: int,
                      fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    b = _blocks(x, block)
    out = torch.empty(b.shape[0], size, dtype=torch.uint8, device=x.device)
    for i in range(0, b.shape[0], _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = fn(b[i:i + _CHUNK_BLOCKS])
    return out.reshape(*x.shape[:-1], x.shape[-1] // block * size)


def _q8_0_blocks(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(b * inv).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)


def _q4_0_blocks(b: torch.Tensor) -> torch.Tensor:
    mx = b.gather(1, b.abs().argmax(dim=1, keepdim=True))  # signed value of largest magnitude
    d = mx / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([d.half().view(torch.uint8), packed], dim=1)


def _q5_bits(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes [B, 32] -> qh (the 5th bits, a little-endian 32-bit word) and qs (low nibbles of j and j + 16)."""
    hi = (q >> 4).to(torch.int64)
    qh = (hi << torch.arange(32, device=q.device)).sum(dim=1, keepdim=True)
    qh_bytes = ((qh >> torch.arange(0, 32, 8, device=q.device)) & 255).to(torch.uint8)
    lo = q & 15
    return torch.cat([qh_bytes, lo[:, :16] | (lo[:, 16:] << 4)], dim=1)


def _q5_0_blocks(b: torch.Tensor) -> torch.Tensor:
    mx = b.gather(1, b.abs().argmax(dim=1, keepdim=True))  # signed value of largest magnitude, as ggml
    d = mx / -16
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([d.half().view(torch.uint8), _q5_bits(q)], dim=1)


def _q5_1_blocks(b: torch.Tensor) -> torch.Tensor:
    lo = b.amin(dim=1, keepdim=True)
    d = (b.amax(dim=1, keepdim=True) - lo) / 31
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((b - lo) * inv + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([d.half().view(torch.uint8), lo.half().view(torch.uint8), _q5_bits(q)], dim=1)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes for `x` (last dim a multiple of 32), shape [..., last // 32 * 34]; bit-exact with ggml."""
    return _quantize_chunked(x, 32, 34, _q8_0_blocks)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """Q4_0 bytes for `x` (last dim a multiple of 32), shape [..., last // 32 * 18]; bit-exact with ggml."""
    return _quantize_chunked(x, 32, 18, _q4_0_blocks)


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    """Q5_0 bytes for `x` (last dim a multiple of 32), shape [..., last // 32 * 22]; ggml's rule."""
    return _quantize_chunked(x, 32, 22, _q5_0_blocks)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    """Q5_1 bytes for `x` (last dim a multiple of 32), shape [..., last // 32 * 24]; ggml's rule."""
    return _quantize_chunked(x, 32, 24, _q5_1_blocks)
