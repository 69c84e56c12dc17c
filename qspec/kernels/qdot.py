"""Products with GGUF blocks through int8 activations (llama.cpp's "mmvq" scheme): the torch references of
triton_qdot.py's kernels.

x is quantized per 32 elements as ggml's q8_1 (`quantize_x_torch`: d = max|x| / 127, q = floor(x / d + 0.5), and
s = d * sum(q)); every block dot is then an exact integer sum of the weights' small integers (the ones the block
stores: Q4_K/Q4_0 nibbles, Q5_K/Q5_0 5-bit values, Q6_K's q - 32, Q8_0's int8) times the int8 x, and only the
scales are f32, once per 32 (Q6_K: 16) weights:

    Q4_K, Q5_K   y += (d * sc_j) * (dx_b * isum_j) - (dmin * m_j) * s_b     (sub-block j = x block b)
    Q6_K         y += d * (dx_b * (sc_g * isum_g))     (per 16-weight group g; isum of q - 32, int8 scale sc_g)
    Q8_0         y += d * (dx_b * isum)
    Q4_0, Q5_0   y += d * (dx_b * isum - 8 * s_b)   (16 for Q5_0: the weights' offset folded into x's block sum)

`qdot_matmul_torch` computes exactly that (integer sums in f64, which holds them exactly, the scale math in f32):
the kernels equal it up to the order of the f32 sums. Against the f32 product with the expanded weights
(qmatmul.qmatmul_torch) the difference is x's rounding to 8 bits per 32 elements, a few 1e-3 of the output's scale.
`qdot_moe_few_torch` is the routed experts' reference: h quantized once, the f32 intermediate silu(g) * u quantized
again per 32 before the down product, as llama.cpp does.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from qspec.weights.dequant import _k_low_nibbles, _k_scale_min, nibbles
from qspec.weights.qweight import base_type, weight_of

T = GGMLQuantizationType
# The block types with an int8 kernel (llama.cpp's Q4_K_M, Q5_K_M, Q6_K and Q8_0 files, and the Q5_0/Q4_0 of rows
# that are not whole super-blocks); Q4_1/Q5_1 keep the f32 kernels.
QDOT_QTYPES = frozenset({T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
_BLOCK_BYTES = {T.Q4_0: (32, 18), T.Q5_0: (32, 22), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q5_K: (256, 176),
                T.Q6_K: (256, 210)}
_OFFSET = {T.Q4_0: 8.0, T.Q5_0: 16.0}  # the stored integer minus this is the weight over d


def quantize_x_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (int8 q [M, K], f32 d [M, K/32], f32 s = d * sum(q) [M, K/32], int32 sums
    of q per 16 [M, K/16] (Q6_K's offset)):
    q = floor(x * (127 / amax) + 0.5), d = amax / 127. Both divisions are tensor by tensor: torch computes a scalar
    divided by a tensor, and on CUDA a tensor divided by a scalar, through a reciprocal, which the kernel's
    correctly rounded division would not match."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    amax = xb.abs().amax(-1)
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, c127), torch.zeros_like(amax))
    q = torch.floor(xb * inv[..., None] + 0.5).clamp(-127, 127)
    d = amax / c127
    g16 = q.view(M, K // 16, 16).sum(-1).to(torch.int32)
    return q.to(torch.int8).reshape(M, K), d, d * q.sum(-1), g16


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _five(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's 32-bit qh bytes [n, 4] -> the 5th bits [n, 32] (bit i of the little-endian word is element i's)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32).int()


def int_weights(raw: torch.Tensor, qtype: int, n: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks raw [n, row_bytes] (qtype: the kernels' type number, rows in planes too) -> (the integers q [n, k] the
    kernels feed to dp4a, the f32 scale of each block's integer sum [n, k/32], a third part): for Q4_K/Q5_K the
    sub-blocks' d * sc and dmin * m; for Q6_K the int8 scales of the 16-weight groups [n, k/16] (as f32) and
    d [n, k/256]; for Q8_0/Q4_0/Q5_0 d and None (Q4_0/Q5_0's offset is _OFFSET)."""
    w = weight_of(raw, qtype, k).to_blocks()  # rows in planes: back in the file's order
    qt = w.qtype
    bk, bs = _BLOCK_BYTES[qt]
    b = w.raw.reshape(-1, bs)
    if qt in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        q = _k_low_nibbles(b[:, 16:144] if qt == T.Q4_K else b[:, 48:176]).int()
        if qt == T.Q5_K:
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
            q = q | (((b[:, None, 16:48] >> shifts) & 1).int() << 4)
        return q.reshape(n, k), (d * sc).reshape(n, k // 32), (dmin * mn).reshape(n, k // 32)
    if qt == T.Q6_K:
        ql, qh = b[:, 0:128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        lo = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        hi = ((qh >> shifts) & 3).reshape(-1, 8, 32)
        q = (lo | (hi << 4)).int() - 32
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        return q.reshape(n, k), sc.reshape(n, k // 16), _f16(b[:, 208:210]).reshape(n, k // 256)
    d = _f16(b[:, 0:2]).reshape(n, k // 32)
    if qt == T.Q8_0:
        return b[:, 2:].contiguous().view(torch.int8).int().reshape(n, k), d, None
    if qt == T.Q4_0:
        return nibbles(b[:, 2:]).int().reshape(n, k), d, None
    return (nibbles(b[:, 6:]).int() | (_five(b[:, 2:6]) << 4)).reshape(n, k), d, None  # Q5_0


def _isums(xq: torch.Tensor, q: torch.Tensor, group: int) -> torch.Tensor:
    """Exact integer dots [M, N, K/group] of x's int8 [M, K] with the weights' integers [N, K] per group (f64 holds
    every partial sum exactly: |sum| < 2^22)."""
    M, K = xq.shape
    N = q.shape[0]
    a = xq.double().view(M, K // group, group).transpose(0, 1)  # [G, M, group]
    b = q.double().view(N, K // group, group).permute(1, 2, 0)  # [G, group, N]
    return torch.bmm(a, b).permute(1, 2, 0)


def _scale_terms(isum: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, qt: T, a: torch.Tensor,
                 c: torch.Tensor | None) -> torch.Tensor:
    """The f32 terms [M, N, K/32] (Q6_K: K/16) of the int sums (the formulas of the module docstring)."""
    dx, sx = xd[:, None, :], xs[:, None, :]
    if qt == T.Q6_K:  # per 16-weight group: d * (dx * (sc * isum))
        d = c.repeat_interleave(16, dim=1)[None]  # type: ignore[union-attr]
        return d * (dx.repeat_interleave(2, dim=2) * (a[None] * isum).float())
    isum = isum.float()
    if qt in (T.Q4_K, T.Q5_K):
        return a[None] * (dx * isum) - c[None] * sx  # type: ignore[index]
    if qt == T.Q8_0:
        return a[None] * (dx * isum)
    return a[None] * (dx * isum - _OFFSET[qt] * sx)


def qdot_matmul_torch(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int,
                      chunk: int = 16384) -> torch.Tensor:
    """Reference of the int8 product: x [M, K] @ W^T -> [M, N] in x.dtype, W's blocks raw [N, row_bytes]
    (rows taken `chunk` at a time, so the real shapes fit)."""
    qt = base_type(qtype)
    xq, xd, xs, _ = quantize_x_torch(x)
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for r in range(0, n, chunk):
        q, a, c = int_weights(raw[r:r + chunk], qtype, min(chunk, n - r), k)
        isum = _isums(xq, q, 16 if qt == T.Q6_K else 32)
        out[:, r:r + q.shape[0]] = _scale_terms(isum, xd, xs, qt, a, c).sum(-1)
    return out.to(x.dtype)


def qdot_moe_few_torch(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, g: tuple[torch.Tensor, int],
                       u: tuple[torch.Tensor, int], d: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Reference of the int8 routed experts: weighted slot outputs [T, k, D] in h.dtype; g/u/d as (raw blocks
    [E, rows, row_bytes], qtype)."""
    T_, D = h.shape
    k = top_i.shape[1]
    Fd = g[0].shape[1]
    out = torch.empty(T_, k, D, dtype=h.dtype, device=h.device)
    for t, experts in enumerate(top_i.tolist()):
        for j, e in enumerate(experts):
            x = h[t:t + 1]
            gx = qdot_matmul_torch(x.float(), g[0][e], g[1], Fd, D)
            act = gx / (1.0 + torch.exp(-gx)) * qdot_matmul_torch(x.float(), u[0][e], u[1], Fd, D)  # the kernel's silu
            y = qdot_matmul_torch(act, d[0][e], d[1], D, Fd)
            out[t, j] = (y[0] * top_w[t, j].float()).to(h.dtype)
    return out
