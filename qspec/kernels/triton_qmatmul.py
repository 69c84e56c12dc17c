"""Triton kernels that read GGUF blocks in place: y = x @ W^T for a few rows, the routed experts of a few-token step,
and block-to-16-bit expansion for the many-row products.

Every kernel walks K in steps of 256 weights (one K-quant super-block, or eight 32-weight blocks of the Q*_0/Q*_1
types) and expands a step of BN rows in registers with the f32 operations of weights/dequant.py, in the same order
(so a tile equals the reference's expansion up to FMA contraction); the type is a constexpr, one compiled kernel per
type. `expand_step` is the general decoder (byte loads, natural element order [BN, G, L]: 16 x 16 for Q6_K, whose scales
cover 16 weights, 8 x 32 for the others); `_tile_k_words` (Q4_K, Q5_K: 32-bit words, 8 nibbles a load) and
`_tile_q6_words` (Q6_K: 16-bit words) load fewer, wider words and return the step in a permuted order with the
matching element offsets, so x is gathered in the same order. f16 scales are read through an f16 view of the bytes
(every block type's size is even, so they are 2-byte aligned). Small integers become f32 by the exponent trick
(`_i2f`), which keeps the conversion off the slower int-to-float unit.

Tensor-core product (`_qmm_kernel`, 16-bit x, 1..16 rows; what the dispatch uses except for one row of a narrow
matrix): each step's [BN, 256] tile, cast to x's dtype, times x^T padded to 16 columns on tensor cores; K splits
into f32 partial sums when the row blocks alone leave SMs idle, added in the same launch by the last split of each
row block to finish (triton_common.sum_if_last, as the int8 products do; EngineOptions.sums_in_product). Its
rounding is that of a bf16 product with the expanded weights (the weights rounded to x's dtype, f32 accumulation);
K-quant weights are expanded two a register in x's 16-bit arithmetic (`_tile_k_pairs`, `_tile_q6_pairs`; PAIRS),
their scales and mins rounded to x's dtype first.

CUDA-core mat-vec (`_qmv_kernel`, f32 x, or one row of a matrix narrower than TC_MIN_ROWS): a program owns BN output
rows and streams their blocks along K once for all M <= 8 rows. For one row it keeps a [BN, G, L] f32 accumulator of
products (no reduction inside the loop, as triton_gemv's mat-vec), for several rows it reduces each row's products
per step; f32 weights, f32 products.

Routed experts (`_qmoe_gate_up_kernel`, `_qmoe_down_kernel`): one program per (row block, token-slot pair) reads the
chosen expert's rows in place (expert stride, nothing gathered); the intermediate silu(g) * u stays f32 in a
[pairs, F] scratch. Pairs that chose the same expert read its blocks separately (the second read usually hits the
L2); a decode step's single token reads each chosen expert once.

Measured on the H200 (benchmarks/results/qkernels_h200_v7.txt, `python -m qspec.bench.qkernels`): these kernels are
ALU-bound in the expansion, not yet at the bf16 mat-vec's bytes per second (Q4_K LM head, one row: 379 µs, 944 GB/s,
against bf16's 287 µs at 4.4 TB/s).
"""

from __future__ import annotations

import contextlib

import torch
from gguf import GGMLQuantizationType

from qspec.kernels.triton_common import (
    HAS_TRITON,
    INTERPRET,
    arrival_counters,
    module_flag,
    pdl_launch,
    sums_in_product,
    tl_dtype,
)
from qspec.weights.qweight import base_type

T = GGMLQuantizationType
# The block types the kernels decode, with (G, L) of their 256-weight step and the bytes of one step.
STEP = 256
KERNEL_QTYPES: dict[GGMLQuantizationType, tuple[int, int, int]] = {
    T.Q4_0: (8, 32, 8 * 18), T.Q4_1: (8, 32, 8 * 20), T.Q5_0: (8, 32, 8 * 22), T.Q5_1: (8, 32, 8 * 24),
    T.Q8_0: (8, 32, 8 * 34),
    T.Q4_K: (8, 32, 144), T.Q5_K: (8, 32, 176), T.Q6_K: (16, 16, 210),
}
MAX_ROWS = 8
# (rows per program, warps) of the mat-vec by row count; the GPU benchmark (qspec/bench/qkernels.py) measures them.
MV_CONFIG = {1: (4, 4), 8: (4, 4)}
MM_CONFIG = (64, 4, 2)  # the tensor-core kernel: (rows per program, warps, programs wanted per SM)
TC_MIN_ROWS = 4096  # one row of a narrower matrix goes to the CUDA-core mat-vec (tensor_cores_for)
# the experts' kernels: (rows per program, warps); on the H200 (4, 2) against (4, 4): 52.6 against 69.4 µs at one
# token, 238 against 333 at six (Q4_K gate/up, Q5_0 down, E=512, top-10)
MOE_CONFIG = (4, 2)
DEQ_CONFIG = (32, 4)  # block expansion: (rows per program, warps)
# The tensor-core product expands the K-quants two weights a 32-bit register in x's 16-bit arithmetic
# (`_tile_k_pairs`, `_tile_q6_pairs`: far fewer instructions per weight in the K loop, BENCHMARKS.md §5b); False: each
# weight in f32, rounded to x's dtype once (A/B runs). A module flag (KernelSwitches: EngineOptions.tc_pairs).
PAIRS = True
# _biased_pairs' PTX (LOP3's table 0xEA is (a & b) | c): $0, $1 <- the halves of ((word >> sh) & 0x000F000F) | magic,
# with HIGH bits also | (((qh >> sh_h) << 4) & high); tests/test_ptx_text.py runs these texts against the
# interpreter's expression (equal for sh_h <= 16 - HIGH: the PTX shifts in zeros, the int32 shift the sign bit)
PAIRS_PTX = "{ .reg .b32 t; shr.u32 t, $2, $3; lop3.b32 t, t, 0x000F000F, $4, 0xEA; mov.b32 {$0, $1}, t; }"
PAIRS_HIGH_PTX = ("{ .reg .b32 t, u; shr.u32 t, $2, $3; lop3.b32 t, t, 0x000F000F, $6, 0xEA; shr.u32 u, $4, $5; "
                  "shl.b32 u, u, 4; lop3.b32 t, u, $7, t, 0xEA; mov.b32 {$0, $1}, t; }")


def pairs_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, PAIRS is `on` (the runner sets it around every step)."""
    return module_flag(__name__, "PAIRS", on)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import (
        QT_PLANES,
        QT_Q4_0,
        QT_Q4_1,
        QT_Q4_K,
        QT_Q5_0,
        QT_Q5_0_PLANES,
        QT_Q5_K,
        QT_Q6_K,
        QT_Q6_K_PLANES,
        QT_Q8_0,
        QT_Q8_0_PLANES,
        b32_parts,
        dot_acc,
        expert_pair,
        pdl_start,
        q6_parts,
        round_to,
        sum_if_last,
    )

    _PAIRS_PTX, _PAIRS_HIGH_PTX = tl.constexpr(PAIRS_PTX), tl.constexpr(PAIRS_HIGH_PTX)

    @triton.jit
    def _f16_at(wh_ptr, byte_off, mask):
        """The f16 at an even byte offset (through the f16 view of the bytes), as f32."""
        return tl.load(wh_ptr + byte_off // 2, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _i2f(q):
        """int32 0 <= q < 2^23 -> f32 exactly, by the exponent trick (an OR and a subtraction on the FP32 pipe; the
        int-to-float conversion unit has a quarter of its throughput)."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _u8(wb_ptr, byte_off, mask):
        return tl.load(wb_ptr + byte_off, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _u16(wh_ptr, half_off, mask):
        """The 16-bit word at an f16-view offset, zero-extended to int32."""
        return tl.load(wh_ptr + half_off, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF

    @triton.jit
    def expand_step(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr):
        """Step kb (weights kb*256 ..) of the rows at byte offsets rowb [BN] -> (f32 weights [BN, G, L], their
        element offsets in K [G, L], which exist [G, L])."""
        g2 = tl.arange(0, G)[:, None]
        gr = tl.arange(0, G)[None, :]
        l2 = tl.arange(0, L)[None, :]
        g = g2[None, :, :]
        lo = l2[None, :, :]
        koff = kb * 256 + g2 * L + l2
        kmask = koff < K
        m2 = nmask[:, None]
        m3 = nmask[:, None, None] & kmask[None, :, :]
        r2 = rowb[:, None]
        r3 = rowb[:, None, None]
        if QT == QT_Q4_K or QT == QT_Q5_K:  # Q4_K (144 bytes) / Q5_K (176): d, dmin, 12 bytes of 6-bit scales, mins...
            sb = 144 if QT == QT_Q4_K else 176
            base = kb * sb
            qs_at = 16 if QT == QT_Q4_K else 48
            q = (_u8(wb_ptr, r3 + base + qs_at + (g // 2) * 32 + lo, m3) >> ((g % 2) * 4)) & 15
            if QT == QT_Q5_K:  # bit j of qh[l] is the 5th bit of sub-block j's element l
                q = q | (((_u8(wb_ptr, r3 + base + 16 + lo, m3) >> g) & 1) << 4)
            d = _f16_at(wh_ptr, rowb + base, nmask)
            dmin = _f16_at(wh_ptr, rowb + base + 2, nmask)
            j4 = gr % 4
            a = _u8(wb_ptr, r2 + base + 4 + j4, m2)
            b = _u8(wb_ptr, r2 + base + 8 + j4, m2)
            c = _u8(wb_ptr, r2 + base + 12 + j4, m2)
            first = gr < 4
            sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
            mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
            ds = d[:, None] * sc
            dm = dmin[:, None] * mn
            w = ds[:, :, None] * _i2f(q) - dm[:, :, None]
        elif QT == QT_Q6_K or QT == QT_Q6_K_PLANES:  # Q6_K: ql[128], qh[64], int8 scales[16], d (q6_parts); g*16 + l
            ql_at, qh_at, sc_at, d_at = q6_parts(kb, K, QT)
            h = g // 8
            ql = _u8(wb_ptr, r3 + ql_at + h * 64 + (g % 4) * 16 + lo, m3)
            qh = _u8(wb_ptr, r3 + qh_at + h * 32 + (g % 2) * 16 + lo, m3)
            q = ((ql >> (((g % 8) // 4) * 4)) & 15) | (((qh >> (((g % 8) // 2) * 2)) & 3) << 4)
            s = _u8(wb_ptr, r2 + sc_at + gr, m2)
            s = s - ((s >> 7) << 8)  # int8
            d = _f16_at(wh_ptr, rowb + d_at, nmask)
            ds = d[:, None] * s.to(tl.float32)
            w = ds[:, :, None] * (_i2f(q) - 32.0)
        elif QT == QT_Q4_0 or QT == QT_Q5_0 or QT == QT_Q8_0 or QT > QT_PLANES:  # 32-weight blocks (114 is taken above)
            w = _tile_b32(wb_ptr, wh_ptr, rowb, nmask, m3, kb, K, gr, lo, QT)
        else:  # Q4_1 / Q5_1 (d, m, ...): step kb holds blocks kb*8 + g; weight l is nibble l // 16 of byte l % 16
            bs = 20 if QT == QT_Q4_1 else 24
            blk = (kb * 8 + gr) * bs  # [1, G]
            bmask = m2 & (kb * 256 + gr * 32 < K)
            d = _f16_at(wh_ptr, r2 + blk, bmask)  # [BN, G]
            mn = _f16_at(wh_ptr, r2 + blk + 2, bmask)
            b3 = r3 + blk[:, :, None]
            if QT == QT_Q4_1:  # 16 bytes
                q = (_u8(wb_ptr, b3 + 4 + lo % 16, m3) >> ((lo // 16) * 4)) & 15
            else:  # qh (32 bits), 16 bytes
                q = (_u8(wb_ptr, b3 + 8 + lo % 16, m3) >> ((lo // 16) * 4)) & 15
                q = q | (((_u8(wb_ptr, b3 + 4 + lo // 8, m3) >> (lo % 8)) & 1) << 4)
            w = d[:, :, None] * _i2f(q) + mn[:, :, None]
        return w, koff, kmask

    @triton.jit
    def _tile_b32(wb_ptr, wh_ptr, rowb, nmask, m3, kb, K, gr, lo, QT: tl.constexpr):
        """expand_step's f32 weights [BN, 8, 32] of Q8_0 / Q5_0 / Q4_0 blocks in the file's order or in planes (QT 108 /
        106 / 102; b32_parts): gr [1, 8] the step's blocks, lo [1, 1, 32] the weights of a block, m3 which exist."""
        d_at, qh_at, qs_at = b32_parts(kb * 8 + gr, K, QT)  # [1, 8]
        d = _f16_at(wh_ptr, rowb[:, None] + d_at, nmask[:, None] & (kb * 256 + gr * 32 < K))  # [BN, 8]
        b3 = rowb[:, None, None]
        if QT == QT_Q8_0 or QT == QT_Q8_0_PLANES:
            q = _u8(wb_ptr, b3 + qs_at[:, :, None] + lo, m3)
            w = d[:, :, None] * (_i2f(q ^ 0x80) - 128.0)  # int8 from its byte
        else:  # weight l is nibble l // 16 of byte l % 16
            q = (_u8(wb_ptr, b3 + qs_at[:, :, None] + lo % 16, m3) >> ((lo // 16) * 4)) & 15
            if QT == QT_Q5_0 or QT == QT_Q5_0_PLANES:  # Q5_0's 5th bits: qh (32 bits, little-endian)
                q = q | (((_u8(wb_ptr, b3 + qh_at[:, :, None] + lo // 8, m3) >> (lo % 8)) & 1) << 4)
                w = d[:, :, None] * (_i2f(q) - 16.0)
            else:
                w = d[:, :, None] * (_i2f(q) - 8.0)
        return w

    @triton.jit
    def _tile_k_words(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
        """_k_words5's step as [BN, 256] in dtype DT (cast before the reshape: the reshape may move the tile through
        shared memory, half the bytes in 16 bits) and its offsets [256]."""
        wt, offs = _k_words5(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT)
        return tl.reshape(wt.to(DT), [BN, 256]), tl.reshape(offs, [256])

    @triton.jit
    def _k_scales(wb_ptr, wh_ptr, base, nmask):
        """(d * scale, dmin * min) in f32 of a Q4_K / Q5_K super-block's sub-blocks j = 2c + s, [BN, 4, 2] on the
        axes (c, s); base: [BN] byte offsets of the super-blocks. The 6-bit scales and mins as in expand_step."""
        c3 = tl.arange(0, 4)[None, :, None]
        s3 = tl.arange(0, 2)[None, None, :]
        j = 2 * c3 + s3
        j4 = j % 4
        m3 = nmask[:, None, None]
        b3 = base[:, None, None]
        a = _u8(wb_ptr, b3 + 4 + j4, m3)
        b = _u8(wb_ptr, b3 + 8 + j4, m3)
        e = _u8(wb_ptr, b3 + 12 + j4, m3)
        sc = tl.where(j < 4, a & 63, (e & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, b & 63, (e >> 4) | ((b >> 6) << 4)).to(tl.float32)
        d = _f16_at(wh_ptr, base, nmask)[:, None, None]
        dmin = _f16_at(wh_ptr, base + 2, nmask)[:, None, None]
        return d * sc, dmin * mn

    @triton.jit
    def _k_words(ww_ptr, rowb, nmask, kb, QT: tl.constexpr):
        """Q4_K / Q5_K step kb of the rows at byte offsets rowb [BN]: (the nibbles' 32-bit words [BN, 4, 8, 1, 1] on
        the axes (c, w): word w of 32-byte chunk c; Q5_K's high-bit words [BN, 1, 8, 1, 1] on w (Q4_K: the nibbles'
        words again); the super-block's byte offsets [BN])."""
        base = rowb + kb * (144 if QT == QT_Q4_K else 176)
        c = tl.arange(0, 4)[None, :, None, None, None]
        w = tl.arange(0, 8)[None, None, :, None, None]
        m5 = nmask[:, None, None, None, None]
        word = tl.load(ww_ptr + ((base + (16 if QT == QT_Q4_K else 48)) // 4)[:, None, None, None, None] + c * 8 + w,
                       mask=m5, other=0)
        qh = word
        if QT == QT_Q5_K:
            qh = tl.load(ww_ptr + ((base + 16) // 4)[:, None, None, None, None] + w, mask=m5, other=0)
        return word, qh, base

    @triton.jit
    def _k_words5(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT: tl.constexpr):
        """Q4_K / Q5_K step kb of BN rows, its nibbles read as 32-bit words (8 weights a load, no byte gathers)
        -> (f32 weights [BN, 4, 8, 2, 4] on the axes (c, w, s, i), their element offsets): weight i of word w of
        chunk c's low (s = 0) or high (s = 1) nibbles is element c*64 + s*32 + w*4 + i of sub-block 2c + s."""
        c = tl.arange(0, 4)[None, :, None, None, None]
        w = tl.arange(0, 8)[None, None, :, None, None]
        s = tl.arange(0, 2)[None, None, None, :, None]
        i = tl.arange(0, 4)[None, None, None, None, :]
        word, qh, base = _k_words(ww_ptr, rowb, nmask, kb, QT)
        q = (word >> (8 * i + 4 * s)) & 15
        if QT == QT_Q5_K:  # bit 2c + s of qh byte w*4 + i
            q = q | (((qh >> (8 * i + 2 * c + s)) & 1) << 4)
        ds, dm = _k_scales(wb_ptr, wh_ptr, base, nmask)
        wt = ds[:, :, None, :, None] * _i2f(q) - dm[:, :, None, :, None]
        offs = kb * 256 + c * 64 + s * 32 + w * 4 + i
        return wt, offs

    @triton.jit
    def _biased_pairs(word, sh, qh, sh_h, HIGH: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
        """The low nibbles of `word` >> sh at bits 0 and 16 (HIGH > 0: with HIGH more bits, from qh >> sh_h at bits 0
        and 16, as bits 4..) OR'd into the bits of 16-bit `bias` (128 in bf16, 1024 in f16, whose last 7 mantissa
        bits are zero): (bias + q of the low half, bias + q of the high half) in DT. ASM: one shift and one LOP3 for
        both halves of a 32-bit register (three more with HIGH), split without a move; else (the interpreter runs
        no PTX) the same bits per weight."""
        magic = tl.full(word.shape, 0x43004300 if DT == tl.bfloat16 else 0x64006400, tl.int32)
        high = tl.full(word.shape, ((1 << HIGH) - 1) * 0x00100010, tl.int32)  # the high bits' place in each half
        if ASM and HIGH > 0:
            lo, hi = tl.inline_asm_elementwise(_PAIRS_HIGH_PTX, "=h,=h,r,r,r,r,r,r", [word, sh, qh, sh_h, magic, high],
                                               dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        elif ASM:
            lo, hi = tl.inline_asm_elementwise(_PAIRS_PTX, "=h,=h,r,r,r", [word, sh, magic], dtype=(tl.int16, tl.int16),
                                               is_pure=True, pack=1)
        else:
            t = ((word >> sh) & 0x000F000F) | magic
            if HIGH > 0:
                t = t | (((qh >> sh_h) << 4) & high)
            lo = (t & 0xFFFF).to(tl.int16)
            hi = (t >> 16).to(tl.int16)
        return lo.to(DT, bitcast=True), hi.to(DT, bitcast=True)

    @triton.jit
    def _tile_k_pairs(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT: tl.constexpr, BN: tl.constexpr,
                      DT: tl.constexpr, ASM: tl.constexpr):
        """Q4_K / Q5_K step kb of BN rows as [BN, 256] in 16-bit DT, expanded two weights a 32-bit register
        (_biased_pairs), q = that - bias exactly, then q * scale - min in one 16-bit FMA (packed two a register)
        with the scale and min rounded to DT; and the offsets [256]. Against the f32 expansion rounded once
        (_tile_k_words) a weight also carries the scale's and the min's rounding to DT. Axes (c, w, s, h, p):
        element c*64 + s*32 + w*4 + h + 2p. ASM off (the interpreter): the same expansion in f32 of the rounded
        scale and min, rounded to DT once."""
        c = tl.arange(0, 4)[None, :, None, None, None]
        w = tl.arange(0, 8)[None, None, :, None, None]
        s = tl.arange(0, 2)[None, None, None, :, None]
        h = tl.arange(0, 2)[None, None, None, None, :]
        shape: tl.constexpr = [BN, 4, 8, 2, 2]
        word, qh, base = _k_words(ww_ptr, rowb, nmask, kb, QT)
        word = tl.broadcast_to(word, shape)
        qh = tl.broadcast_to(qh, shape)
        sh = tl.broadcast_to(8 * h + 4 * s, shape)
        sh5 = sh
        if QT == QT_Q5_K:  # bit 2c + s of qh byte w*4 + h (+ 2)
            sh5 = tl.broadcast_to(8 * h + 2 * c + s, shape)
        lo, hi = _biased_pairs(word, sh, qh, sh5, 1 if QT == QT_Q5_K else 0, DT, ASM)
        bias: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
        ds, dm = _k_scales(wb_ptr, wh_ptr, base, nmask)
        v = tl.join(lo, hi)
        if ASM:
            wt = (v - bias).to(DT) * ds.to(DT)[:, :, None, :, None, None] - dm.to(DT)[:, :, None, :, None, None]
        else:
            dsr = round_to(ds, DT)[:, :, None, :, None, None]
            dmr = round_to(dm, DT)[:, :, None, :, None, None]
            wt = round_to((v.to(tl.float32) - bias) * dsr - dmr, DT).to(DT)
        offs = (kb * 256 + c * 64 + s * 32 + w * 4 + h)[:, :, :, :, :, None] + 2 * tl.arange(0, 2)
        return tl.reshape(wt, [BN, 256]), tl.reshape(offs, [256])

    @triton.jit
    def _q6_scales(wb_ptr, wh_ptr, rowb, nmask, sc_at, d_at):
        """d * the int8 scale of a Q6_K super-block's sub-blocks h*8 + s*4 + g in f32, [BN, 2, 2, 4] on the axes
        (h, s, g); sc_at, d_at: q6_parts' offsets of the scales and d in rows at byte offsets rowb [BN]."""
        h4 = tl.arange(0, 2)[None, :, None, None]
        s4 = tl.arange(0, 2)[None, None, :, None]
        g4 = tl.arange(0, 4)[None, None, None, :]
        sc = _u8(wb_ptr, rowb[:, None, None, None] + sc_at + h4 * 8 + s4 * 4 + g4, nmask[:, None, None, None])
        sc = sc - ((sc >> 7) << 8)  # int8
        return _f16_at(wh_ptr, rowb + d_at, nmask)[:, None, None, None] * sc.to(tl.float32)

    @triton.jit
    def _tile_q6_pairs(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
                       ASM: tl.constexpr):
        """Q6_K step kb of BN rows (QT 14, or 114: in planes) as [BN, 256] in 16-bit DT, two weights a 32-bit
        register: the same 16-bit ql (qh) word of the step's two halves h side by side, so one shift and one LOP3
        take a nibble of both (three more their high bit pairs; _biased_pairs), q - 32 = that - (bias + 32)
        exactly, times the scale d * sc rounded to DT (one packed multiply: its one rounding is the f32 product's);
        and the offsets [256]. Axes (s, g, p, b, h) as in _q6_words6: element h*128 + s*64 + (g*8 + p)*2 + b."""
        s = tl.arange(0, 2)[None, :, None, None, None]
        g = tl.arange(0, 4)[None, None, :, None, None]
        p = tl.arange(0, 8)[None, None, None, :, None]
        b = tl.arange(0, 2)[None, None, None, None, :]
        m5 = nmask[:, None, None, None, None]
        ql_at, qh_at, sc_at, d_at = q6_parts(kb, K, QT)
        hb = (rowb // 2)[:, None, None, None, None]
        shape: tl.constexpr = [BN, 2, 4, 8, 2]
        ql = _u16(wh_ptr, hb + ql_at // 2 + g * 8 + p, m5) | (_u16(wh_ptr, hb + ql_at // 2 + 32 + g * 8 + p, m5) << 16)
        qh_w = hb + qh_at // 2 + (g % 2) * 8 + p
        qh = _u16(wh_ptr, qh_w, m5) | (_u16(wh_ptr, qh_w + 16, m5) << 16)
        lo, hi = _biased_pairs(tl.broadcast_to(ql, shape), tl.broadcast_to(8 * b + 4 * s, shape),
                               tl.broadcast_to(qh, shape), tl.broadcast_to(8 * b + 4 * s + 2 * (g // 2), shape), 2,
                               DT, ASM)
        bias: tl.constexpr = 160.0 if DT == tl.bfloat16 else 1056.0  # bias + 32
        ds = tl.permute(_q6_scales(wb_ptr, wh_ptr, rowb, nmask, sc_at, d_at), (0, 2, 3, 1))  # [BN, s, g, h]
        v = tl.join(lo, hi)
        if ASM:
            wt = (v - bias).to(DT) * ds.to(DT)[:, :, :, None, None, :]
        else:
            wt = round_to((v.to(tl.float32) - bias) * round_to(ds, DT)[:, :, :, None, None, :], DT).to(DT)
        offs = (kb * 256 + s * 64 + (g * 8 + p) * 2 + b)[:, :, :, :, :, None] + 128 * tl.arange(0, 2)
        return tl.reshape(wt, [BN, 256]), tl.reshape(offs, [256])

    @triton.jit
    def _tile_q6_words(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
        """_q6_words6's step as [BN, 256] in dtype DT and its offsets [256]."""
        wt, offs = _q6_words6(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT)
        return tl.reshape(wt.to(DT), [BN, 256]), tl.reshape(offs, [256])

    @triton.jit
    def _q6_words6(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT: tl.constexpr):
        """Q6_K step kb of BN rows (QT 14, or 114: rows in planes), its low nibbles and high bit pairs read as 16-bit
        words through the f16 view (every block is 2-byte aligned) -> (f32 weights [BN, 2, 2, 4, 8, 2], their
        element offsets).
        Axes (h, s, g, p, b): byte b of word g*8 + p of half h's ql holds, in nibble s, element
        h*128 + s*64 + (g*8 + p)*2 + b (of sub-block h*8 + s*4 + g); its two high bits sit in qh byte
        h*32 + ((g % 2)*8 + p)*2 + b at bit 4s + 2*(g // 2)."""
        h = tl.arange(0, 2)[None, :, None, None, None, None]
        s = tl.arange(0, 2)[None, None, :, None, None, None]
        g = tl.arange(0, 4)[None, None, None, :, None, None]
        p = tl.arange(0, 8)[None, None, None, None, :, None]
        b = tl.arange(0, 2)[None, None, None, None, None, :]
        m6 = nmask[:, None, None, None, None, None]
        ql_at, qh_at, sc_at, d_at = q6_parts(kb, K, QT)
        hb = (rowb // 2)[:, None, None, None, None, None]
        ql = tl.load(wh_ptr + hb + ql_at // 2 + h * 32 + g * 8 + p, mask=m6, other=0.0).to(tl.int16, bitcast=True)
        ql = ql.to(tl.int32)
        qh = tl.load(wh_ptr + hb + qh_at // 2 + h * 16 + (g % 2) * 8 + p, mask=m6, other=0.0).to(tl.int16,
                                                                                                bitcast=True)
        qh = qh.to(tl.int32)
        q = ((ql >> (8 * b + 4 * s)) & 15) | (((qh >> (8 * b + 4 * s + 2 * (g // 2))) & 3) << 4)
        ds = _q6_scales(wb_ptr, wh_ptr, rowb, nmask, sc_at, d_at)[:, :, :, :, None, None]
        wt = ds * (_i2f(q) - 32.0)
        offs = kb * 256 + h * 128 + s * 64 + (g * 8 + p) * 2 + b
        return wt, offs

    @triton.jit
    def _step(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, K, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
              BN: tl.constexpr, DT: tl.constexpr, PAIRS: tl.constexpr = False, ASM: tl.constexpr = False):
        """Step kb of BN rows as [BN, 256] weights in DT, their element offsets [256] and which exist [256], by the
        fastest decoder of the type (32-bit words for Q4_K/Q5_K, 16-bit words for Q6_K, bytes otherwise). PAIRS
        (16-bit DT): the K-quants expanded two weights a register in DT's arithmetic (_tile_k_pairs, _tile_q6_pairs)."""
        if PAIRS and (QT == QT_Q4_K or QT == QT_Q5_K):
            w, offs = _tile_k_pairs(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT, BN, DT, ASM)
            kmask = offs < K
        elif PAIRS and (QT == QT_Q6_K or QT == QT_Q6_K_PLANES):
            w, offs = _tile_q6_pairs(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT, BN, DT, ASM)
            kmask = offs < K
        elif QT == QT_Q4_K or QT == QT_Q5_K:
            w, offs = _tile_k_words(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, QT, BN, DT)
            kmask = offs < K
        elif QT == QT_Q6_K or QT == QT_Q6_K_PLANES:
            w, offs = _tile_q6_words(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT, BN, DT)
            kmask = offs < K
        else:
            w3, koff, kmask3 = expand_step(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT, G, L)
            w = tl.reshape(w3.to(DT), [BN, 256])
            offs = tl.reshape(koff, [256])
            kmask = tl.reshape(kmask3, [256])
        return w, offs, kmask

    @triton.jit
    def _qmm_kernel(x_ptr, wb_ptr, wh_ptr, ww_ptr, y_ptr, p_ptr, c_ptr, N, K, STEPS, S, x_m, w_n, p_s, y_m,
                    M: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
                    OUT_DT: tl.constexpr, UPCAST: tl.constexpr, SUM_HERE: tl.constexpr = False,
                    PAIRS: tl.constexpr = False, ASM: tl.constexpr = False, PDL: tl.constexpr = False):
        """16-bit x, 1..16 rows: each step's weights expanded to x's dtype in registers and multiplied on tensor
        cores with x^T padded to 16 columns ([BN, 256] @ [256, 16]), no per-row reductions. Program (row block,
        split) takes steps split*STEPS .. of K. One split (S == 1) writes the output y; several write f32 partial
        sums p [S, M, N] (p_s: a split's stride), and with SUM_HERE the split arriving last at its row block's
        counter c_ptr[blk] adds them in split order into y (as qmm_triton's sum would, a launch later). PAIRS,
        ASM: _step's."""
        pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        rowb = n.to(tl.int64) * w_n
        im = tl.arange(0, 16)
        acc = tl.zeros([BN, 16], dtype=tl.float32)
        k_lo = tl.program_id(1) * STEPS
        k_hi = tl.minimum(k_lo + STEPS, tl.cdiv(K, 256))
        for kb in range(k_lo, k_hi):
            w, offs, kmask = _step(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, K, QT, G, L, BN, x_ptr.dtype.element_ty,
                                   PAIRS, ASM)
            xt = tl.load(x_ptr + im[None, :] * x_m + offs[:, None], mask=(im[None, :] < M) & kmask[:, None],
                         other=0.0)
            acc = dot_acc(w, xt, acc, UPCAST)
        mask = nmask[:, None] & (im[None, :] < M)
        out = y_ptr + im[None, :] * y_m + n[:, None]
        if S == 1:
            tl.store(out, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            part = p_ptr + im[None, :] * N + n[:, None]
            tl.store(part + tl.program_id(1) * p_s, acc, mask=mask)
            if SUM_HERE:
                sum_if_last(part, c_ptr + tl.program_id(0), out, mask, S, p_s, OUT_DT)

    @triton.jit
    def _qdot(x_ptr, x_m, wb_ptr, wh_ptr, ww_ptr, rowb, nmask, K, M: tl.constexpr, MP: tl.constexpr,
              BN: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr):
        """[MP, BN] f32: rows 0..M-1 of x (stride x_m) times the BN weight rows at byte offsets rowb. One row of
        Q6_K keeps the 16-bit-word decoder's tile in its own shape (no reshape, nothing through shared memory): on
        the H200 that beat the byte decoder (Q6_K 1800 x 2560: 13.2 -> 11.0 µs; experts with Q6_K gate/up at one
        token: 87 -> 65 µs), while the 32-bit-word decoder lost to it for Q4_K/Q5_K here (2560 x 6144: 18.9 ->
        29.1 µs), so those keep `expand_step` (benchmarks/results/qkernels_h200_v8_words_cc.txt against _v7)."""
        im = tl.arange(0, MP)
        if M == 1 and (QT == QT_Q6_K or QT == QT_Q6_K_PLANES):
            prod6 = tl.zeros([BN, 2, 2, 4, 8, 2], dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, 256)):
                w6, o6 = _q6_words6(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT)
                prod6 += w6 * tl.load(x_ptr + o6).to(tl.float32)
            acc = tl.sum(tl.sum(tl.sum(tl.sum(tl.sum(prod6, axis=5), axis=4), axis=3), axis=2), axis=1)[None, :]
        elif M == 1:
            prod = tl.zeros([BN, G, L], dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, 256)):
                w, koff, kmask = expand_step(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT, G, L)
                x = tl.load(x_ptr + koff, mask=kmask, other=0.0).to(tl.float32)
                prod += w * x[None, :, :]
            acc = tl.sum(tl.sum(prod, axis=2), axis=1)[None, :]
        else:
            acc = tl.zeros([MP, BN], dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, 256)):
                w, koff, kmask = expand_step(wb_ptr, wh_ptr, rowb, nmask, kb, K, QT, G, L)
                for m in tl.static_range(M):
                    x = tl.load(x_ptr + m * x_m + koff, mask=kmask, other=0.0).to(tl.float32)
                    p = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
                    acc = tl.where(im[:, None] == m, acc + p[None, :], acc)
        return acc

    @triton.jit
    def _qmv_kernel(x_ptr, wb_ptr, wh_ptr, ww_ptr, y_ptr, N, K, x_m, w_n, y_m,
                    M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, G: tl.constexpr,
                    L: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        acc = _qdot(x_ptr, x_m, wb_ptr, wh_ptr, ww_ptr, n.to(tl.int64) * w_n, nmask, K, M, MP, BN, QT, G, L)
        im = tl.arange(0, MP)
        out = y_ptr + im[:, None] * y_m + n[None, :]
        tl.store(out, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=(im[:, None] < M) & nmask[None, :])

    @triton.jit
    def _qmoe_gate_up_kernel(h_ptr, ti_ptr, gb_ptr, gh_ptr, gw_ptr, ub_ptr, uh_ptr, uw_ptr, act_ptr, D, F, KS, h_m,
                             ti_m,
                             g_e, g_f, u_e, u_f, BN: tl.constexpr, QG: tl.constexpr, GG: tl.constexpr,
                             LG: tl.constexpr, QU: tl.constexpr, GU: tl.constexpr, LU: tl.constexpr,
                             PDL: tl.constexpr = False):
        """act[pair, f] = silu(gate_e[f] . h_t) * (up_e[f] . h_t) in f32, pair = t * KS + j, e = top_i[t, j]."""
        pdl_start(PDL)
        pair, t, _, e, f, fmask = expert_pair(ti_ptr, ti_m, KS, F, BN)
        xp = h_ptr + t * h_m
        g = _qdot(xp, 0, gb_ptr, gh_ptr, gw_ptr, e * g_e + f.to(tl.int64) * g_f, fmask, D, 1, 1, BN, QG, GG, LG)
        u = _qdot(xp, 0, ub_ptr, uh_ptr, uw_ptr, e * u_e + f.to(tl.int64) * u_f, fmask, D, 1, 1, BN, QU, GU, LU)
        a = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + pair * F + f[None, :], a, mask=fmask[None, :])

    @triton.jit
    def _qmoe_down_kernel(act_ptr, ti_ptr, tw_ptr, db_ptr, dh_ptr, dw_ptr, y_ptr, D, F, KS, ti_m, tw_m, d_e, d_d,
                          BN: tl.constexpr, QD: tl.constexpr, GD: tl.constexpr, LD: tl.constexpr,
                          OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
        """y[t, j, :] = top_w[t, j] * down_e . act[pair] for BN output features, rounded once to y's dtype."""
        pdl_start(PDL)
        pair, t, j, e, dd, dmask = expert_pair(ti_ptr, ti_m, KS, D, BN)
        wt = tl.load(tw_ptr + t * tw_m + j).to(tl.float32)
        acc = _qdot(act_ptr + pair * F, 0, db_ptr, dh_ptr, dw_ptr, e * d_e + dd.to(tl.int64) * d_d, dmask, F, 1, 1,
                    BN, QD, GD, LD)
        tl.store(y_ptr + pair * D + dd[None, :], round_to(acc * wt, OUT_DT).to(y_ptr.dtype.element_ty),
                 mask=dmask[None, :])

    @triton.jit
    def _dequant_kernel(wb_ptr, wh_ptr, ww_ptr, y_ptr, N, K, w_n, y_n, BN: tl.constexpr, QT: tl.constexpr,
                        G: tl.constexpr, L: tl.constexpr, PAIRS: tl.constexpr = False, ASM: tl.constexpr = False,
                        PDL: tl.constexpr = False):
        """y[n, k] = the weight, for BN rows and one 256-weight step (program (row block, step)); PAIRS, ASM:
        _step's (the tensor-core product's expansion, for its tests)."""
        pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        rowb = n.to(tl.int64) * w_n
        kb = tl.program_id(1)
        w, offs, kmask = _step(wb_ptr, wh_ptr, ww_ptr, rowb, nmask, kb, K, QT, G, L, BN, y_ptr.dtype.element_ty,
                               PAIRS, ASM)
        out = y_ptr + n.to(tl.int64)[:, None] * y_n + offs[None, :]
        tl.store(out, w.to(y_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def _views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bytes, their f16 view and (rows of whole 32-bit words: Q4_K, Q5_K) their int32 view, one storage."""
    wh = raw.view(torch.float16)
    return raw, wh, raw.view(torch.int32) if raw.shape[-1] % 4 == 0 else wh


def qmatmul_geometry(qtype: int) -> tuple[int, int]:
    """(G, L): the groups and their lengths in `expand_step`'s f32 expansion of a 256-weight step of type qtype."""
    g, length, _ = KERNEL_QTYPES[base_type(qtype)]
    return g, length


def qmatvec_triton(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int,
                   config: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= 8, last dim contiguous) @ W^T, W's blocks raw [N, row_bytes] (rows contiguous) -> [M, N] in
    x.dtype. config: (rows per program, warps)."""
    M, K = x.shape
    if not 0 < M <= MAX_ROWS or raw.dim() != 2 or raw.shape[0] != n or raw.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"qmatvec: x {tuple(x.shape)} stride {x.stride()}, raw {tuple(raw.shape)}, N {n}")
    bn, warps = config or next(c for rows, c in sorted(MV_CONFIG.items()) if M <= rows)
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    wb, wh, ww = _views(raw)
    g, length = qmatmul_geometry(qtype)
    mp = 1 if M == 1 else triton.next_power_of_2(M)
    _qmv_kernel[(triton.cdiv(n, bn),)](x, wb, wh, ww, y, n, K, x.stride(0), raw.stride(0), y.stride(0), M=M, MP=mp,
                                       BN=bn, QT=int(qtype), G=g, L=length, OUT_DT=tl_dtype(x.dtype),
                                       num_warps=warps, **pdl_launch(x))
    return y


def tensor_cores_for(x: torch.Tensor, n: int) -> bool:
    """Whether x [M, K] @ W^T (N = n rows) goes to the tensor-core kernel rather than the CUDA-core mat-vec: 16-bit
    x (f32 keeps f32 products), and either several rows or enough weight rows to fill the GPU with 64-row blocks;
    on the H200 the mat-vec won only on one row of the narrow matrices (benchmarks/results/qkernels_sweep_h200_v3.txt:
    Q4_K 2560 x 6144, 19.0 against 21.9 µs)."""
    return x.dtype in (torch.bfloat16, torch.float16) and (x.shape[0] > 1 or n >= TC_MIN_ROWS)


def _sm_count(x: torch.Tensor) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(x.device).multi_processor_count


def qmm_triton(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int,
               config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16/f16, M <= 16, last dim contiguous) @ W^T -> [M, N] in x.dtype through tensor cores, W's
    blocks raw [N, row_bytes]. config: (rows per program, warps, programs wanted per SM); K splits into shares
    (f32 partial sums added in order) when the row blocks alone leave SMs idle."""
    M, K = x.shape
    if not 0 < M <= 16 or x.dtype not in (torch.bfloat16, torch.float16) or raw.shape[0] != n or x.stride(1) != 1:
        raise ValueError(f"qmm: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, raw {tuple(raw.shape)}, N {n}")
    bn, warps, per_sm = config or MM_CONFIG
    steps = triton.cdiv(K, STEP)
    blocks = triton.cdiv(n, bn)
    want = per_sm * _sm_count(x)
    split = 1 if blocks >= want else min(steps, triton.cdiv(want, blocks))
    share = triton.cdiv(steps, split)
    split = triton.cdiv(steps, share)
    wb, wh, ww = _views(raw)
    g, length = qmatmul_geometry(qtype)
    dt = tl_dtype(x.dtype)
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    parts = y if split == 1 else torch.empty(split, M, n, dtype=torch.float32, device=x.device)
    sum_here = split > 1 and sums_in_product(blocks)
    _qmm_kernel[(blocks, split)](x, wb, wh, ww, y, parts, arrival_counters(y) if sum_here else parts, n, K, share,
                                 split, x.stride(0), raw.stride(0), parts.stride(0) if split > 1 else 0, y.stride(0),
                                 M=M, BN=bn, QT=int(qtype), G=g, L=length, OUT_DT=dt, UPCAST=INTERPRET,
                                 SUM_HERE=sum_here, PAIRS=PAIRS, ASM=not INTERPRET, num_warps=warps,
                                 **pdl_launch(x))
    if split > 1 and not sum_here:
        y.copy_(parts.sum(0))
    return y


def dequant_triton(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype, pairs: bool = False) -> torch.Tensor:
    """raw [N, row_bytes] blocks -> [N, K] weights in dtype (f32 expansion rounded once). pairs (16-bit dtype,
    K-quants): the tensor-core product's expansion instead (`_tile_k_pairs`, `_tile_q6_pairs`; the scales rounded
    to dtype first, weights.dequant.dequantize's round_scales)."""
    n = raw.shape[0]
    y = torch.empty(n, k, dtype=dtype, device=raw.device)
    wb, wh, ww = _views(raw)
    g, length = qmatmul_geometry(qtype)
    bn, warps = DEQ_CONFIG
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, STEP))](wb, wh, ww, y, n, k, raw.stride(0), y.stride(0),
                                                                BN=bn, QT=int(qtype), G=g, L=length, PAIRS=pairs,
                                                                ASM=not INTERPRET, num_warps=warps,
                                                                **pdl_launch(raw))
    return y


def qmoe_few_triton(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: tuple[torch.Tensor, int],
                    up: tuple[torch.Tensor, int], down: tuple[torch.Tensor, int],
                    config: tuple[int, int] | None = None) -> torch.Tensor:
    """Weighted slot outputs [T, k, D] in h.dtype; gate/up/down as (raw [E, rows, row_bytes], qtype)."""
    (gr, gq), (ur, uq), (dr, dq) = gate, up, down
    T_, D = h.shape
    k = top_i.shape[1]
    F = gr.shape[1]
    bn, warps = config or MOE_CONFIG
    h = h if h.stride(1) == 1 else h.contiguous()
    top_i, top_w = top_i.contiguous(), top_w.contiguous()  # the kernels index slot j at + j
    act = torch.empty(T_ * k, F, dtype=torch.float32, device=h.device)
    y = torch.empty(T_, k, D, dtype=h.dtype, device=h.device)
    gb, gh, gw = _views(gr)
    ub, uh, uw = _views(ur)
    db, dh, dw = _views(dr)
    (gg, lg), (gu, lu), (gd, ld) = qmatmul_geometry(gq), qmatmul_geometry(uq), qmatmul_geometry(dq)
    _qmoe_gate_up_kernel[(triton.cdiv(F, bn), T_ * k)](
        h, top_i, gb, gh, gw, ub, uh, uw, act, D, F, k, h.stride(0), top_i.stride(0), gr.stride(0), gr.stride(1),
        ur.stride(0), ur.stride(1), BN=bn, QG=int(gq), GG=gg, LG=lg, QU=int(uq), GU=gu, LU=lu, num_warps=warps,
        **pdl_launch(h))
    _qmoe_down_kernel[(triton.cdiv(D, bn), T_ * k)](
        act, top_i, top_w, db, dh, dw, y, D, F, k, top_i.stride(0), top_w.stride(0), dr.stride(0), dr.stride(1),
        BN=bn, QD=int(dq), GD=gd, LD=ld, OUT_DT=tl_dtype(h.dtype), num_warps=warps, **pdl_launch(h))
    return y
