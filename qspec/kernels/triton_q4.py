"""Q4_0 matrix-vector product in Triton for the draft's LM head: y [M, N] = x [M, K] @ W^T, llama.cpp's MMVQ
scheme: x is first quantized to int8 per 32-element block (scale amax / 127, like ggml's q8_1), then every block
dot is an exact integer sum computed four products at a time with `dp4a`.

W is stored as ggml Q4_0 split in two planes: `packed` uint8 [N, K/2] (block b of row n is bytes
16b .. 16b+15; byte i holds element 32b + i in its low nibble and 32b + 16 + i in its high
nibble) and `scales` f16 [N, K/32]. Read as int32 words, word j of a block holds the low nibbles of elements
4j..4j+3 and the high nibbles of 16+4j..16+4j+3, so one mask (and one shift) yields four unsigned 4-bit values
lined up with four int8 x values: per 8 weights, three integer ops and two dp4a. The (q - 8) offset is applied
per block through the x block's sum: dot(q - 8, x) = dot(q, x) - 8 * sum(x).

On the H200 (benchmarks/results/gpu_kernels_q4_sweep_s8b.txt, one bf16 row of the 248,320 x 2,560 head, in a
CUDA graph; BENCHMARKS.md §5, the Q4_0 draft head row) this kernel with its quantize kernel runs near bandwidth,
well ahead of the best config of the previous f32-FMA kernel (nibbles turned into floats with the 2^23 trick), which
was bound by its ALU work.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype

# rows per program, blocks per K step, warps (the s8b sweep's best), pipeline stages of the K loop (1: none, as
# measured; `python -m qspec.bench.kernels --q4-sweep` times 2 and 3)
DEFAULT_CONFIG = (32, 16, 2, 1)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import dp4a, pdl_start, round_q8, round_to

    @triton.jit
    def _quantize_q8_kernel(x_ptr, q_ptr, d_ptr, s_ptr, x_m, KB: tl.constexpr, KBP: tl.constexpr,
                            PDL: tl.constexpr = False):
        """One x row per program: int8 q = floor(x * 127 / amax + 0.5) per 32-element block, its scale amax / 127
        and the block's sum of q."""
        pdl_start(PDL)
        m = tl.program_id(0)
        b = tl.arange(0, KBP)
        i = tl.arange(0, 32)
        bmask = b < KB
        x = tl.load(x_ptr + m * x_m + b[:, None] * 32 + i[None, :], mask=bmask[:, None], other=0.0).to(tl.float32)
        q, d = round_q8(x)
        tl.store(q_ptr + m * (KB * 32) + b[:, None] * 32 + i[None, :], q.to(tl.int8), mask=bmask[:, None])
        tl.store(d_ptr + m * KB + b, d, mask=bmask)
        tl.store(s_ptr + m * KB + b, tl.sum(q, axis=1).to(tl.int32), mask=bmask)

    @triton.jit
    def _q4_q8_matvec_kernel(xq_ptr, xd_ptr, xs_ptr, q_ptr, s_ptr, o_ptr, N, o_m, KB: tl.constexpr,
                             BN: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr, EVEN_N: tl.constexpr,
                             ASM: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
        """Grid (N / BN, M). Weights and x both as int32 words: word j of block b holds nibbles 4j..4j+3 (low)
        and 16+4j..16+4j+3 (high), and x words 8b+j and 8b+4+j hold the matching int8 x. Per word: two masks
        and two dp4a, four multiply-adds each; per block: (sum - 8 * sum(qx)) * d_w * d_x in f32."""
        pdl_start(PDL)
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
        for b0 in tl.range(0, KB, NB, num_stages=STAGES):
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
            d = dp4a(hi, xh[None, :, :], dp4a(lo, xl[None, :, :], tl.zeros_like(lo), ASM), ASM)
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
    _quantize_q8_kernel[(M,)](x, q, d, sums, x.stride(0), KB=KB, KBP=next_pow2(KB), num_warps=4,
                              enable_fp_fusion=False, **pdl_launch(x))
    return q, d, sums


def q4_q8_matvec_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        config: tuple[int, int, int, int] = DEFAULT_CONFIG, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T with x quantized to int8 per 32-element block (quantize_q8_triton), W's planes
    packed [N, K/2] uint8 and scales [N, K/32] f16 (contiguous). Each x row has its own programs, so a row's result
    does not depend on the others and W is read once per row."""
    M, K = x.shape
    N = packed.shape[0]
    if K % 32 or packed.shape != (N, K // 2) or scales.shape != (N, K // 32):
        raise ValueError(f"q4_q8_matvec: x {tuple(x.shape)} packed {tuple(packed.shape)} scales {tuple(scales.shape)}")
    if x.stride(1) != 1 or not packed.is_contiguous() or not scales.is_contiguous():
        raise ValueError("q4_q8_matvec needs x rows, packed and scales contiguous")
    bn, nb, warps, stages = config
    out = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must be [M, N] in x.dtype with a contiguous last dim")
    xq, xd, xs = quantize_q8_triton(x)
    _q4_q8_matvec_kernel[(triton.cdiv(N, bn), M)](xq.view(torch.int32), xd, xs, packed.view(torch.int32), scales,
                                                  out, N, out.stride(0), KB=K // 32, BN=bn, NB=nb, STAGES=stages,
                                                  EVEN_N=N % bn == 0, ASM=not INTERPRET, OUT_DT=tl_dtype(x.dtype),
                                                  num_warps=warps, **pdl_launch(xq.view(torch.int32)))
    return out
