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

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, tl_dtype

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

    @triton.jit
    def _q4_row_fma_kernel(x_ptr, q_ptr, s_ptr, o_ptr, N, x_m, o_m, KB: tl.constexpr, BN: tl.constexpr,
                           NB: tl.constexpr, EVEN_N: tl.constexpr, OUT_DT: tl.constexpr):
        """One x row per program column (grid (N / BN, M)): every row is computed by the same code whatever M is.
        Block dots accumulate per (row, block lane) and are reduced once at the end, not at every K step."""
        m = tl.program_id(1)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        n64 = n.to(tl.int64)
        ib = tl.arange(0, NB)
        ii = tl.arange(0, 16)
        qrow = q_ptr + n64[:, None, None] * (KB * 16) + ii[None, None, :]  # [BN, 1, 16]
        srow = s_ptr + n64[:, None] * KB  # [BN, 1]
        xrow = x_ptr + m * x_m
        acc = tl.zeros([BN, NB], dtype=tl.float32)
        for b0 in range(0, KB, NB):
            blk = b0 + ib
            if EVEN_N and KB % NB == 0:
                byte = tl.load(qrow + blk[None, :, None] * 16)
                sc = tl.load(srow + blk[None, :])
                xl = tl.load(xrow + blk[:, None] * 32 + ii[None, :])
                xh = tl.load(xrow + blk[:, None] * 32 + 16 + ii[None, :])
            else:
                bmask = blk < KB
                wmask = nmask[:, None] & bmask[None, :]
                byte = tl.load(qrow + blk[None, :, None] * 16, mask=wmask[:, :, None], other=0x88)
                sc = tl.load(srow + blk[None, :], mask=wmask, other=0.0)
                xl = tl.load(xrow + blk[:, None] * 32 + ii[None, :], mask=bmask[:, None], other=0.0)
                xh = tl.load(xrow + blk[:, None] * 32 + 16 + ii[None, :], mask=bmask[:, None], other=0.0)
            byte = byte.to(tl.int32)
            wlo = ((byte & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q_lo - 8
            whi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q_hi - 8
            part = tl.sum(wlo * xl.to(tl.float32)[None, :, :] + whi * xh.to(tl.float32)[None, :, :], axis=2)
            acc += part * sc.to(tl.float32)
        y = tl.sum(acc, axis=1)
        tl.store(o_ptr + m * o_m + n, round_to(y, OUT_DT).to(o_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _q4_row_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, N, x_m, o_m, KB: tl.constexpr, BN: tl.constexpr,
                           NB: tl.constexpr, EVEN_N: tl.constexpr, OUT_DT: tl.constexpr):
        """The nibbles become exact f16 (q - 8) and each half block meets x, cast to f16 (exact for bf16 values
        in f16's normal range), on the tensor cores ([BN, 16] @ [16, 16] with x in column 0, the other columns
        zero); the block scale is applied in f32."""
        m = tl.program_id(1)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        n64 = n.to(tl.int64)
        ii = tl.arange(0, 16)
        col0 = ii[None, :] == 0  # [1, 16]: x's column of the dot's right operand
        qrow = q_ptr + n64[:, None] * (KB * 16) + ii[None, :]  # [BN, 16]
        srow = s_ptr + n64 * KB
        xrow = x_ptr + m * x_m
        acc = tl.zeros([BN, 16], dtype=tl.float32)
        for b0 in range(0, KB, NB):
            for j in tl.static_range(NB):
                b = b0 + j  # NB divides KB (the launcher's choice)
                byte = tl.load(qrow + b * 16, mask=nmask[:, None], other=0x88).to(tl.int32)
                wlo = ((byte & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # exact in f16
                whi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                xl = tl.load(xrow + b * 32 + ii)
                xh = tl.load(xrow + b * 32 + 16 + ii)
                Xl = tl.where(col0, xl[:, None], 0.0).to(tl.float16)
                Xh = tl.where(col0, xh[:, None], 0.0).to(tl.float16)
                d = tl.dot(wlo.to(tl.float16), Xl) + tl.dot(whi.to(tl.float16), Xh)
                sc = tl.load(srow + b, mask=nmask, other=0.0).to(tl.float32)
                acc += d * sc[:, None]
        y = tl.sum(tl.where(col0, acc, 0.0), axis=1)
        tl.store(o_ptr + m * o_m + n, round_to(y, OUT_DT).to(o_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """c + the dot product of a's four bytes (unsigned, < 128 here) with b's (signed int8)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:  # the interpreter runs no PTX: the same sum, byte by byte
            for k in tl.static_range(4):
                c += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
            return c

    @triton.jit
    def _quantize_q8_kernel(x_ptr, q_ptr, d_ptr, s_ptr, x_m, KB: tl.constexpr, KBP: tl.constexpr):
        """One x row per program: int8 q = floor(x * 127 / amax + 0.5) per 32-element block, its scale amax / 127
        and the block's sum of q."""
        m = tl.program_id(0)
        b = tl.arange(0, KBP)
        i = tl.arange(0, 32)
        bmask = b < KB
        x = tl.load(x_ptr + m * x_m + b[:, None] * 32 + i[None, :], mask=bmask[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q = tl.minimum(tl.maximum(tl.floor(x * inv[:, None] + 0.5), -127.0), 127.0)
        tl.store(q_ptr + m * (KB * 32) + b[:, None] * 32 + i[None, :], q.to(tl.int8), mask=bmask[:, None])
        tl.store(d_ptr + m * KB + b, amax / 127.0, mask=bmask)
        tl.store(s_ptr + m * KB + b, tl.sum(q, axis=1).to(tl.int32), mask=bmask)

    @triton.jit
    def _q4_q8_matvec_kernel(xq_ptr, xd_ptr, xs_ptr, q_ptr, s_ptr, o_ptr, N, o_m, KB: tl.constexpr,
                             BN: tl.constexpr, NB: tl.constexpr, EVEN_N: tl.constexpr, ASM: tl.constexpr,
                             OUT_DT: tl.constexpr):
        """Grid (N / BN, M). Weights and x both as int32 words: word j of block b holds nibbles 4j..4j+3 (low)
        and 16+4j..16+4j+3 (high), and x words 8b+j and 8b+4+j hold the matching int8 x. Per word: two masks
        and two dp4a, four multiply-adds each; per block: (sum - 8 * sum(qx)) * d_w * d_x in f32."""
        m = tl.program_id(1)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        n64 = n.to(tl.int64)
        ib = tl.arange(0, NB)
        jj = tl.arange(0, 4)
        wrow = q_ptr + n64[:, None, None] * (KB * 4) + jj[None, None, :]  # [BN, 1, 4] int32 words
        srow = s_ptr + n64[:, None] * KB
        xrow = xq_ptr + m * (KB * 8)
        acc = tl.zeros([BN, NB], dtype=tl.float32)
        for b0 in range(0, KB, NB):
            blk = b0 + ib
            if EVEN_N and KB % NB == 0:
                w = tl.load(wrow + blk[None, :, None] * 4)
                dw = tl.load(srow + blk[None, :])
                xl = tl.load(xrow + blk[:, None] * 8 + jj[None, :])
                xh = tl.load(xrow + blk[:, None] * 8 + 4 + jj[None, :])
                dx = tl.load(xd_ptr + m * KB + blk)
                sx = tl.load(xs_ptr + m * KB + blk)
            else:
                bmask = blk < KB
                wmask = nmask[:, None] & bmask[None, :]
                w = tl.load(wrow + blk[None, :, None] * 4, mask=wmask[:, :, None], other=0)
                dw = tl.load(srow + blk[None, :], mask=wmask, other=0.0)
                xl = tl.load(xrow + blk[:, None] * 8 + jj[None, :], mask=bmask[:, None], other=0)
                xh = tl.load(xrow + blk[:, None] * 8 + 4 + jj[None, :], mask=bmask[:, None], other=0)
                dx = tl.load(xd_ptr + m * KB + blk, mask=bmask, other=0.0)
                sx = tl.load(xs_ptr + m * KB + blk, mask=bmask, other=0)
            lo = w & 0x0F0F0F0F
            hi = (w >> 4) & 0x0F0F0F0F
            d = _dp4a(hi, xh[None, :, :], _dp4a(lo, xl[None, :, :], tl.zeros_like(lo), ASM), ASM)
            isum = tl.sum(d, axis=2) - 8 * sx[None, :]
            acc += isum.to(tl.float32) * (dw.to(tl.float32) * dx[None, :])
        y = tl.sum(acc, axis=1)
        tl.store(o_ptr + m * o_m + n, round_to(y, OUT_DT).to(o_ptr.dtype.element_ty), mask=nmask)


def quantize_q8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], f32 scales [M, K/32], int32 block sums [M, K/32]), as q4.quantize_q8_torch."""
    M, K = x.shape
    KB = K // 32
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    d = torch.empty(M, KB, dtype=torch.float32, device=x.device)
    sums = torch.empty(M, KB, dtype=torch.int32, device=x.device)
    _quantize_q8_kernel[(M,)](x, q, d, sums, x.stride(0), KB=KB, KBP=next_pow2(KB), num_warps=4)
    return q, d, sums


def q4_q8_matvec_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        config: tuple[int, int, int] = DEFAULT_CONFIG, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """x [M, K] quantized to int8 per 32-element block, then its integer products with the Q4_0 nibbles."""
    M, K = x.shape
    N = packed.shape[0]
    if K % 32 or packed.shape != (N, K // 2) or scales.shape != (N, K // 32) or x.stride(1) != 1:
        raise ValueError(f"q4_q8_matvec: x {tuple(x.shape)} packed {tuple(packed.shape)} scales {tuple(scales.shape)}")
    bn, nb, warps = config
    out = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    xq, xd, xs = quantize_q8_triton(x)
    _q4_q8_matvec_kernel[(triton.cdiv(N, bn), M)](xq.view(torch.int32), xd, xs, packed.view(torch.int32), scales,
                                                  out, N, out.stride(0), KB=K // 32, BN=bn, NB=nb,
                                                  EVEN_N=N % bn == 0, ASM=not INTERPRET, OUT_DT=tl_dtype(x.dtype),
                                                  num_warps=warps)
    return out


def q4_matvec_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     config: tuple[int, int, int] = DEFAULT_CONFIG, out: torch.Tensor | None = None,
                     kernel: str = "v1") -> torch.Tensor:
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
    if kernel == "v1":
        _q4_matvec_kernel[(triton.cdiv(N, bn),)](x, packed, scales, out, N, K // 32, K // 2, x.stride(0),
                                                 out.stride(0),
                                                 M=M, MP=max(next_pow2(M), 2), BN=bn, NB=nb,
                                                 OUT_DT=tl_dtype(x.dtype), num_warps=warps)
        return out
    if kernel == "dot" and x.dtype != torch.bfloat16:
        raise ValueError("the tensor-core Q4 kernel takes bf16 x only")
    fn = _q4_row_fma_kernel if kernel == "fma" else _q4_row_dot_kernel
    if kernel == "dot" and (K // 32) % nb:
        nb = 1
    fn[(triton.cdiv(N, bn), M)](x, packed, scales, out, N, x.stride(0), out.stride(0), KB=K // 32, BN=bn, NB=nb,
                                EVEN_N=N % bn == 0, OUT_DT=tl_dtype(x.dtype), num_warps=warps)
    return out
