"""Q4_0 matrix-vector product in Triton for the draft's LM head: y [M, N] = x [M, K] @ W^T, M <= 8.

W is stored as ggml Q4_0 split in two planes: `packed` uint8 [N, K/2] (block b of row n is bytes
16b .. 16b+15; byte i holds element 32b + i in its low nibble and 32b + 16 + i in its high
nibble) and `scales` f16 [N, K/32]. A program owns BN output rows and walks K in steps of NB
blocks: it loads the [BN, NB, 16] bytes (16 contiguous bytes per block: vector loads), turns each
nibble into (q - 8) as f32 with the 2^23 trick (bits 0x4B00000q are exactly 8388608 + q, so one
OR and one subtraction, no int-to-float conversion), dots each block with x, then applies the
block scale once per block. Bytes read: a quarter of bf16's, plus 1/16 for the scales.
M < 16 leaves tensor cores idle (they need M >= 16), so the products are FMAs.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, tl_dtype

DEFAULT_CONFIG = (64, 4, 4)  # rows per program, blocks per K step, warps

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import round_to

    @triton.jit
    def _q4_matvec_kernel(x_ptr, q_ptr, s_ptr, o_ptr, N, KB, row_bytes, x_m, o_m,
                          M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                          OUT_DT: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        n64 = n.to(tl.int64)  # N * K / 2 bytes can pass 2^31 for large heads
        ib = tl.arange(0, NB)
        ii = tl.arange(0, 16)
        im = tl.arange(0, MP)
        # KB = K / 32 and row_bytes = K / 2 come as arguments so that Triton sees their divisibility
        # by 16 and can use 16-byte loads
        qrow = q_ptr + n64[:, None, None] * row_bytes  # [BN, 1, 1]
        srow = s_ptr + n64[:, None] * KB  # [BN, 1]
        acc = tl.zeros([MP, BN], dtype=tl.float32)
        for b0 in range(0, KB, NB):
            blk = b0 + ib
            bmask = blk < KB
            wmask = nmask[:, None, None] & bmask[None, :, None]
            byte = tl.load(qrow + blk[None, :, None] * 16 + ii[None, None, :], mask=wmask, other=0x88)
            byte = byte.to(tl.int32)
            wlo = ((byte & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q_lo - 8
            whi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q_hi - 8
            sc = tl.load(srow + blk[None, :], mask=nmask[:, None] & bmask[None, :], other=0.0).to(tl.float32)
            xoff = blk[:, None] * 32 + ii[None, :]  # [NB, 16]: x index of each low nibble
            for m in tl.static_range(M):
                xl = tl.load(x_ptr + m * x_m + xoff, mask=bmask[:, None], other=0.0).to(tl.float32)
                xh = tl.load(x_ptr + m * x_m + xoff + 16, mask=bmask[:, None], other=0.0).to(tl.float32)
                part = tl.sum(wlo * xl[None, :, :] + whi * xh[None, :, :], axis=2)  # [BN, NB] block dots
                p = tl.sum(part * sc, axis=1)
                acc = tl.where(im[:, None] == m, acc + p[None, :], acc)
        out = o_ptr + im[:, None] * o_m + n[None, :]
        tl.store(out, round_to(acc, OUT_DT).to(o_ptr.dtype.element_ty), mask=(im[:, None] < M) & nmask[None, :])


def q4_matvec_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     config: tuple[int, int, int] = DEFAULT_CONFIG, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel: x [M, K] (M <= 8, last dim contiguous), packed [N, K/2] uint8, scales [N, K/32] f16."""
    M, K = x.shape
    N = packed.shape[0]
    if M > 8 or K % 32 or packed.shape != (N, K // 2) or scales.shape != (N, K // 32):
        raise ValueError(f"q4_matvec: x {tuple(x.shape)} packed {tuple(packed.shape)} scales {tuple(scales.shape)}")
    if x.stride(1) != 1 or not packed.is_contiguous() or not scales.is_contiguous():
        raise ValueError("q4_matvec needs x rows, packed and scales contiguous")
    bn, nb, warps = config
    out = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must be [M, N] in x.dtype with a contiguous last dim")
    _q4_matvec_kernel[(triton.cdiv(N, bn),)](x, packed, scales, out, N, K // 32, K // 2, x.stride(0),
                                             out.stride(0),
                                             M=M, MP=max(next_pow2(M), 2), BN=bn, NB=nb, OUT_DT=tl_dtype(x.dtype),
                                             num_warps=warps)
    return out
