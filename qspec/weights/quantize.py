"""Block quantizers for the GGUF types qspec keeps packed: `quantize(x, qtype)` -> ggml's bytes.

Q8_0, Q4_0, Q5_0 and Q5_1 are dequant.py's (ggml's rules, in torch, so they run on the GPU); Q4_1 the gguf
package's. Q4_K, Q5_K and
Q6_K are written here: the gguf package quantizes only the 32-element types, and qspec needs K-quant files of the
full geometry for its tests and benchmarks. The bytes follow llama.cpp's block structs (block_q4_K, block_q5_K,
block_q6_K in ggml-common.h), so the gguf package's dequantizer, dequant.dequantize and llama.cpp all read them back
alike; the tests check the first two bit for bit.

The K-quant search is simpler than llama.cpp's make_qkx2_quants / make_qx_quants (which try many scales per
sub-block): per 32-element sub-block of Q4_K/Q5_K, min/max, one least-squares refit of (scale, min) to the rounded
levels, then the super-block's 6-bit scale and min codes; per 16-element sub-block of Q6_K, the signed value of
largest magnitude maps to -32 (as Q4_0 maps its to -8) and the 16 scales share an 8-bit code. The error stays close
to llama.cpp's: tests/test_quantize.py states the bound (RMS error relative to the RMS of Gaussian rows).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from qspec.weights.dequant import (
    QK_K,
    WeightsError,
    _roundf,
    quantize_q4_0,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
)

# Super-blocks per step: the K-quant search holds ~30 float temporaries per weight, so a step stays ~0.5 GiB.
_CHUNK_SUPER = 1 << 14


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[n] float -> [n, 2] little-endian f16 bytes."""
    return v.half().reshape(-1, 1).view(torch.uint8)


def _as_f16(v: torch.Tensor) -> torch.Tensor:
    """v rounded to f16 and back: the scale the decoder will see."""
    return v.half().float()


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


def _scale_min_subblocks(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, 8, 32] -> per sub-block (scale >= 0, mn >= 0) with x ~ scale * q - mn, q in 0..nmax.

    Start from min/max (the min clamped to <= 0, as ggml's levels start at -mn <= 0), round, then refit scale and
    min by least squares to those levels (a Lloyd step), keeping mn >= 0."""
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    scale = (hi - lo) / nmax
    q = _roundf(_safe_div(x - lo[..., None], scale[..., None])).clamp(0, nmax)
    # least squares for x ~ a * q + b over the sub-block's 32 points
    n = x.shape[-1]
    sq, sx = q.sum(-1), x.sum(-1)
    sqq, sqx = (q * q).sum(-1), (q * x).sum(-1)
    det = n * sqq - sq * sq
    a = _safe_div(n * sqx - sq * sx, det)
    b = _safe_div(sqq * sx - sq * sqx, det)
    ok = (det > 0) & (a > 0) & (b <= 0)
    scale = torch.where(ok, a, scale)
    lo = torch.where(ok, b, lo)
    return scale, -lo


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [n, 8] (uint8) -> ggml's 12-byte field (get_scale_min_k4 reads it back)."""
    lo_s, hi_s, lo_m, hi_m = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    b0 = lo_s | ((hi_s >> 4) << 6)
    b1 = lo_m | ((hi_m >> 4) << 6)
    b2 = (hi_s & 0x0F) | ((hi_m & 0x0F) << 4)
    return torch.cat([b0, b1, b2], dim=1)


def _k_codes(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, 256] -> (d, dmin as f16 bytes [n, 4], 12 scale bytes, levels [n, 256] uint8 in 0..nmax)."""
    xb = x.reshape(-1, 8, 32)
    scale, mn = _scale_min_subblocks(xb, nmax)
    d = _as_f16(scale.amax(-1) / 63)
    dmin = _as_f16(mn.amax(-1) / 63)
    sc = _roundf(_safe_div(scale, d[:, None])).clamp(0, 63)
    mc = _roundf(_safe_div(mn, dmin[:, None])).clamp(0, 63)
    eff_scale = (d[:, None] * sc)[..., None]
    eff_min = (dmin[:, None] * mc)[..., None]
    q = _roundf(_safe_div(xb + eff_min, eff_scale.expand_as(xb))).clamp(0, nmax).to(torch.uint8)
    head = torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc.to(torch.uint8), mc.to(torch.uint8))], 1)
    return head, q.reshape(-1, QK_K)


def _low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 256] levels -> [n, 128]: each 64-element chunk's first 32 in the low nibbles, its last 32 in the high."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k_blocks(x: torch.Tensor) -> torch.Tensor:
    head, q = _k_codes(x, 15)
    return torch.cat([head, _low_nibbles(q)], dim=1)


def _q5_k_blocks(x: torch.Tensor) -> torch.Tensor:
    head, q = _k_codes(x, 31)
    bits = (q >> 4).reshape(-1, 8, 32).to(torch.int32)  # bit j of qh[l]: the 5th bit of sub-block j, element l
    shifts = torch.arange(8, dtype=torch.int32, device=x.device).view(1, 8, 1)
    qh = (bits << shifts).sum(1).to(torch.uint8)
    return torch.cat([head, qh, _low_nibbles(q)], dim=1)


def _q6_k_blocks(x: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(-1, 16, 16)
    mx = xb.gather(-1, xb.abs().argmax(-1, keepdim=True)).squeeze(-1)  # signed value of largest magnitude
    scale = mx / -32
    big = scale.gather(-1, scale.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = _as_f16(big / -128)
    sc = _roundf(_safe_div(scale, d[:, None])).clamp(-128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = (_roundf(_safe_div(xb, eff.expand_as(xb))).clamp(-32, 31) + 32).to(torch.uint8).reshape(-1, QK_K)
    lo = (q & 0x0F).reshape(-1, 2, 2, 64)  # element h*128 + s*64 + l: nibble s of ql[h*64 + l]
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # element h*128 + t*32 + l: bits 2t, 2t+1 of qh[h*32 + l]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)


_K_BLOCKS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_K: _q4_k_blocks,
    GGMLQuantizationType.Q5_K: _q5_k_blocks,
    GGMLQuantizationType.Q6_K: _q6_k_blocks,
}
# The 32-weight types in torch (on x's device)
_TORCH_32 = {GGMLQuantizationType.Q8_0: quantize_q8_0, GGMLQuantizationType.Q4_0: quantize_q4_0,
             GGMLQuantizationType.Q5_0: quantize_q5_0, GGMLQuantizationType.Q5_1: quantize_q5_1}
# Q4_1 through the gguf package's numpy quantizer (on the CPU; the result moves to x's device)
_GGUF_QUANTIZED = frozenset({GGMLQuantizationType.Q4_1})
QUANTIZERS: frozenset[GGMLQuantizationType] = frozenset(_K_BLOCKS) | _GGUF_QUANTIZED | frozenset(_TORCH_32)


def quantize(x: torch.Tensor, qtype: GGMLQuantizationType | int | str) -> torch.Tensor:
    """The bytes of `x` (float, last dim a multiple of the block size) in `qtype` (a GGMLQuantizationType, its
    value or its name): uint8 [..., last // block * block_bytes], on x's device. Each row is whole blocks, as
    QuantWeight.from_blocks and the GGUF writer take them."""
    qt = _qtype(qtype)
    if qt not in QUANTIZERS:
        raise WeightsError(f"no quantizer for {qt.name} (quantizers: {', '.join(sorted(q.name for q in QUANTIZERS))})")
    block, size = GGML_QUANT_SIZES[qt]
    if x.dim() == 0 or x.shape[-1] % block:
        raise WeightsError(f"{qt.name}: row length {tuple(x.shape)[-1:]} is not a multiple of the block size {block}")
    if qt in _TORCH_32:
        return _TORCH_32[qt](x)
    if qt in _GGUF_QUANTIZED:
        return _gguf_quantize(x, qt)
    if not x.is_floating_point():
        raise WeightsError(f"{qt.name}: quantize takes a float tensor, got {x.dtype}")
    b = x.detach().reshape(-1, block)
    out = torch.empty(b.shape[0], size, dtype=torch.uint8, device=x.device)
    fn = _K_BLOCKS[qt]
    step = _CHUNK_SUPER * (8 if x.is_cuda else 1)  # 4 GiB of scratch is small on a GPU, and launches fewer kernels
    for i in range(0, b.shape[0], step):
        out[i:i + step] = fn(b[i:i + step].float())
    return out.reshape(*x.shape[:-1], x.shape[-1] // block * size)


def _gguf_quantize(x: torch.Tensor, qt: GGMLQuantizationType) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[qt]
    raw = gq.quantize(np.ascontiguousarray(x.detach().float().cpu().numpy()), qt)
    return torch.from_numpy(raw).to(x.device).reshape(*x.shape[:-1], x.shape[-1] // block * size)


def _qtype(qtype: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    if isinstance(qtype, str):
        try:
            return GGMLQuantizationType[qtype.upper()]
        except KeyError:
            raise WeightsError(f"unknown quant type {qtype!r}") from None
    return GGMLQuantizationType(qtype)
