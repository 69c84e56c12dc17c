"""Triton kernels of the int8-activation products with GGUF blocks (llama.cpp's "mmvq"); references in qdot.py.

x rows are first quantized per 32 elements (`_quant_x_kernel`: int8 q stored as 32-bit words [M, K/4], f32 d and
s = d * sum(q) [M, K/32], and q's integer sums per 16 [M, K/16]); the weights are then read as 32-bit words of four
byte-sized integers and multiplied with x's words by `dp4a` (four int8 multiply-adds in one instruction), so a weight
costs a fraction of an instruction instead of the 5-10 f32 operations of the expansion in triton_qmatmul.py. Integer
sums per 32 weights (Q6_K: 16) are exact; the f32 scale math runs once per sub-block (qdot.py's docstring has the
formulas).

Word layouts (a word of the weights pairs with the x word of the same four elements):
- Q4_K / Q5_K (144 / 176-byte blocks, rows whole 32-bit words): qs word w of 32-byte chunk c holds in its low
  nibbles elements 4w..4w+3 of sub-block 2c and in its high nibbles those of sub-block 2c+1; Q5_K's 5th bits are
  bit j of qh word w's bytes for sub-block j. A super-block step is two [BN, 4, 4] runs of words (with K lanes,
  QdotConfig.lanes = KL: KL super-blocks side by side, [BN, 4 KL, 4]).
- Q6_K (210 bytes, 2-byte aligned: words from two 16-bit loads, or one 32-bit load in the even-numbered blocks of
  rows of whole words, which start on a word): ql word (h, tt, w) gives in its low nibbles
  elements h*128 + 32*tt + 4w.. and in its high ones those at + 64; qh word (h, w) the two high bits of each at
  bit 2t of its bytes. dp4a takes the unsigned 6-bit q; 32 * (x's integer sum over the 16-weight group) turns the
  integer dot into that of q - 32.
- Q8_0 / Q4_0 / Q5_0 (34 / 18 / 22-byte blocks, 2-byte aligned): a step is 8 blocks, its even and its odd ones
  apart (in rows of whole words an odd block's words start on a word: 32-bit loads); Q8_0's 8 words per block are
  signed bytes; Q4_0/Q5_0's 4 words give elements 4w.. (low nibbles) and 16 + 4w.. (high); Q5_0's 4-bit groups of
  qh are spread to bit 4 of four bytes by one multiply (the shifted copies do not overlap, so nothing carries).
  Rows in planes (type 100 + GGML's, qweight.py; CUDA's default): a block's quants are 16-byte runs (Q8_0 two),
  the step's eight d one 16-byte run and Q5_0's qh one per four blocks (`_b32p_step`).

`_qdot_rows` walks K for BN weight rows and M <= MAX_ROWS x rows: each step's weight words are decoded once, then
every x row takes its dot products; row m's sum is built by the same operations for any M (row-exact mode computes
one row at a time and must get the same numbers). `_qdot_mv_kernel` is the product (split over K when the row
blocks leave SMs idle: f32 partial sums added in a fixed order by the block's last program to finish, or by
`_sum_parts_kernel` a launch later); `_qdot_gate_up_kernel` and
`_qdot_down_kernel` are the routed experts (h quantized once, the f32 silu(g) * u quantized again before down; with
MoeConfig.splits > 1 gate/up's K runs in shares, a program each, whose partial sums `_act_quant_kernel` adds in a
fixed order before the silu and the quantization).
A product is thus two launches (quantize x, the product; three with the partial sums apart); the products of one x
(`qdot_stacked_triton`) share its quantize launch, and two of them of different types share the product's launch
and the sum's if apart (each part keeps its own split of K, so its numbers do not change).

Register layout: a thread holds whole 32-weight runs where the loads allow it (Q4_K/Q5_K: two 16-byte vector loads
per sub-block pair; Q6_K in planes: 16-byte loads of four words), so the integer sums need no shuffles and the f32
per-run terms are summed once at the end. The 2-byte-aligned types keep a block's words on the tensor's first axis,
but Triton 3.6 spreads that axis over 4-8 threads (the odd blocks' word loads are contiguous along it): their sums
take shuffles and each step's terms move to the accumulators' layout (`scripts/kernel_layouts.py` counts such moves);
in planes a thread holds whole runs and nothing moves.
Static counts of the compiled K loop for sm_90 at one row, 32 rows per program, 4 warps (ptxas SASS, instructions
per weight per thread): Q4_K 2.5, Q4_0 2.7, Q8_0 3.2, Q5_0 3.8, Q6_K 4.0; the H200 issues about 33 T instructions
a second, i.e. 3.9 (Q4_K), 5.7 (Q6_K), 7.4 (Q8_0) per weight at 4.8 TB/s. Several rows cost about two dp4a per 8
weights per row more. Triton 3.6 moves a step's terms through shared memory (a barrier per step) when they do not
have the accumulators' layout: Q6_K's accumulators put the x row axis first for that (_add_row); the 32-weight block
types' still meet it with the x row axis last, and lost more with it first (BENCHMARKS.md §5b).

dp4a is PTX (`tl.inline_asm_elementwise`); the interpreter runs no PTX, so there (and on the GPU with DP4A_ASM off,
for A/B runs and debugging) `dp4a` (triton_common) computes the same sum byte by byte.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.kernels.triton_common import (
    HAS_TRITON,
    INTERPRET,
    arrival_counters,
    module_flag,
    next_pow2,
    pdl_launch,
    sums_in_product,
    tl_dtype,
)

DP4A_ASM = True  # dp4a by the PTX instruction on the GPU (False: the shift-and-multiply emulation, as interpreted)
# Rows per call: up to 8 a row's numbers do not depend on the row count; at 16 the compiled reduction of the
# 32-weight-block types changes order on the GPU (sm_90) and a row can differ in its last bits.
MAX_ROWS = 8


class QdotConfig(NamedTuple):
    """How the product runs. K splits into shares when the row blocks alone give fewer programs than wanted."""

    rows: int  # weight rows per program
    warps: int
    per_sm: int  # programs wanted per SM (0: never split K)
    unroll: int  # 256-weight steps per loop iteration
    lanes: int = 1  # Q4_K/Q5_K only: super-blocks side by side per row and step (threads along K in a program)


# The GPU benchmark (`python -m qspec.bench.qkernels --qdot-one-row`) times the grid: this config was the fastest over
# the decode shapes and block types, and every one without a split was slower, the narrow matrices most (BENCHMARKS.md
# §5b).
QDOT_CONFIG = QdotConfig(16, 2, 8, 2)
# A Q6_K matrix of a vocabulary's rows (the LM head) takes 32-row programs, two rows per thread: the x words a thread
# loads serve both rows, and the grid still fills the GPU many times over. On the H200 the Q6_K LM head ran x1.100
# faster so; the GDN-sized Q6_K products x0.938-1.052 and the Q4_K ones x0.885-0.917 (BENCHMARKS.md §5b).
# Held in planes (the LM head on CUDA, qweight.Q6_K_PLANES), the head takes QDOT_CONFIG: 16-row programs were x1.035
# faster than 32-row ones there (BENCHMARKS.md §5b).
QDOT_CONFIG_Q6K_HEAD = QdotConfig(32, 2, 8, 2)
HEAD_ROWS = 1 << 16
K_LANE_TYPES = frozenset({int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q5_K)})  # QdotConfig.lanes > 1
# Q4_K/Q5_K products by their K lanes (K_LANES, KernelOptions.k_lanes): a row's super-blocks 2, 4 or 8 side by
# side (8: a warp a row, as llama.cpp's mat-vec), one thread per row, lane and chunk, so a row's short K (the model
# width: 10 super-blocks) takes a half to an eighth of the serial steps, and a warp's 16-byte loads fall in fewer
# 128-byte lines (the default's 32 threads read 8 rows' chunks: on the H200 its loads were bound by L1 wavefronts,
# BENCHMARKS.md §5b). Compiled for sm_90 their K loops issue the default's instructions per weight byte, with no
# layout moves (`scripts/kernel_layouts.py --config`); programs of 4 rows moved every step's terms through shared
# memory, so rows stay at 8.
K_LANE_CONFIGS = {1: QDOT_CONFIG, 2: QdotConfig(8, 2, 8, 2, 2), 4: QdotConfig(8, 4, 8, 2, 4),
                  8: QdotConfig(8, 8, 8, 2, 8)}
K_LANES = 0  # 0: by the matrices' shape (lanes_by_shape); else every Q4_K/Q5_K product takes this many
# lanes_by_shape's bounds. On an H100 (BENCHMARKS.md §5c): the mixers' w_in (324 rows of 40 super-blocks) was fastest
# with 4 or 8 lanes at one row, alone and in the whole mixer; the GDN and QSA inputs (14-16 K rows of the model width)
# with 2, at one row and at four; GDN's output (2,560 rows of 24) and the router stack (1,800 of 10) gained little
# with 2 at one row and lost at four, so they keep one.
FEW_ROWS, MANY_ROWS = 1024, 8192
LONG_K = 16  # super-blocks a row (the model width: 10)


class MoeConfig(NamedTuple):
    """How the routed experts' kernels run (programs: row blocks x (token, slot) pairs)."""

    rows: int  # weight rows per program
    warps: int
    unroll: int = 1  # 256-weight steps per loop iteration (gate's and up's steps alternate: twice the bytes in flight)
    down_rows: int = 0  # down's weight rows per program (0: rows)
    down_unroll: int = 0  # down's steps per loop iteration (0: unroll; its K, the experts' width, is a few steps)
    splits: int = 1  # gate/up's K (the model width) in this many shares, a program each; the act quantizer adds
    # their partial sums in share order (more, shorter programs for a few-token step; the split depends on the
    # matrices only, so a row's numbers do not depend on the token count)
    lanes: int = 1  # Q4_K/Q5_K gate/up only: super-blocks side by side per row and step (QdotConfig.lanes)


# `python -m qspec.bench.qkernels --qdot-moe` times the grid (BENCHMARKS.md §5b): five gate/up steps per loop and down
# in 16-row programs were the fastest at 1 and 6 tokens (and alternating gate's and up's steps in one loop beat two
# loops, which are gone since). Since the super-block headers take one load, 4-row one-warp programs (twice the
# programs of 8-row two-warp ones: a one-token step fills under a wave) beat 8 rows by x1.090 at 1 token, x1.076 at 6.
QDOT_MOE_CONFIG = MoeConfig(4, 1, 5, 16, 3)
# Q4_K gate/up (every layer of a Q4_K_M file): 8-row one-warp programs with K in two shares (the act quantizer adds
# them) were faster still, at 1 token and at 6 (BENCHMARKS.md §5b); with Q6_K gate/up they lost at 6 tokens.
QDOT_MOE_CONFIG_Q4K = MoeConfig(8, 1, 5, 16, 3, 2)
QUANT_BLOCKS = 32  # 32-element blocks per program of the activation quantizer
# Stacked products whose parts differ in type (GDN's input projections in a Q4_K_M file's more-bits layers: qkv in
# Q6_K, the rest Q4_K) run two parts per launch, each with its own split of K, and one partial-sum launch for both;
# False: one product and one sum launch per part (A/B runs). The numbers are the same either way.
PAIR_PARTS = True

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import (
        QT_PLANES,
        QT_Q4_0,
        QT_Q4_0_PLANES,
        QT_Q4_K,
        QT_Q5_0,
        QT_Q5_0_PLANES,
        QT_Q5_K,
        QT_Q6_K,
        QT_Q6_K_PLANES,
        QT_Q8_0,
        QT_Q8_0_PLANES,
        b32_parts,
        dp4a,
        expert_pair,
        pdl_start,
        q6_parts,
        round_q8,
        round_to,
        sum_if_last,
    )

    @triton.jit
    def quant_x_blocks(x_ptr, q_ptr, d_ptr, s_ptr, g_ptr, m, chunk, x_m, KB, BB: tl.constexpr):
        """Blocks chunk*BB .. of x's row m (row stride x_m, KB blocks of 32 a row): per 32 elements
        q = floor(x * (127 / amax) + 0.5), d = amax / 127 and s = d * sum(q), and the integer sums of q per 16
        (its kernel is launched without FMA fusion: qdot.quantize_x_torch's roundings)."""
        b = chunk * BB + tl.arange(0, BB)
        i = tl.arange(0, 32)
        bmask = b < KB
        x = tl.load(x_ptr + m * x_m + b[:, None] * 32 + i[None, :], mask=bmask[:, None], other=0.0).to(tl.float32)
        quantized_store(x, q_ptr, d_ptr, s_ptr, g_ptr, m, b, bmask, KB, BB)

    @triton.jit
    def quantized_store(x, q_ptr, d_ptr, s_ptr, g_ptr, m, b, bmask, KB, BB: tl.constexpr):
        """f32 blocks x [BB, 32] (blocks b of row m, those in bmask stored) quantized as quant_x_blocks says."""
        i = tl.arange(0, 32)
        q, d = round_q8(x)
        tl.store(q_ptr + m * KB * 32 + b[:, None] * 32 + i[None, :], q.to(tl.int8), mask=bmask[:, None])
        tl.store(d_ptr + m * KB + b, d, mask=bmask)
        tl.store(s_ptr + m * KB + b, d * tl.sum(q, axis=1), mask=bmask)
        g16 = tl.sum(tl.reshape(q.to(tl.int32), [BB, 2, 16]), axis=2)
        j = tl.arange(0, 2)[None, :]
        tl.store(g_ptr + m * KB * 2 + b[:, None] * 2 + j, g16, mask=bmask[:, None])

    @triton.jit
    def _quant_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, g_ptr, x_m, KB, BB: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row m, block chunk): quant_x_blocks."""
        pdl_start(PDL)
        quant_x_blocks(x_ptr, q_ptr, d_ptr, s_ptr, g_ptr, tl.program_id(0), tl.program_id(1), x_m, KB, BB)

    @triton.jit
    def _w16(wi_ptr, hoff, mask):
        """The 32-bit word at 2-byte-aligned halfword offset hoff, from two 16-bit loads."""
        lo = tl.load(wi_ptr + hoff, mask=mask, other=0).to(tl.int32)
        hi = tl.load(wi_ptr + hoff + 1, mask=mask, other=0).to(tl.int32)
        return (lo & 0xFFFF) | (hi << 16)

    @triton.jit
    def _byte(word, j):
        return (word >> (8 * j)) & 0xFF

    @triton.jit
    def _i8(b):
        """A byte 0..255 read as int8."""
        return b - ((b >> 7) << 8)

    @triton.jit
    def _add_col(acc, t, m, MP: tl.constexpr):
        """acc [BN, C, MP] with t [BN, C] added to column m."""
        im = tl.arange(0, MP)[None, None, :]
        return tl.where(im == m, acc + t[:, :, None], acc)

    @triton.jit
    def _add_row(acc, t, m, MP: tl.constexpr):
        """acc [MP, BN, 2, 2] with t [BN, 2, 2] added to x row m's slice (Q6_K's accumulators: with the x row axis
        first, t has the layout of acc's slices; with it last, Triton 3.6 moved every step's terms through shared
        memory, a barrier each, and the LM head's one-row product ran x1.03 slower, six rows x1.37; BENCHMARKS.md
        §5b. The 32-weight block types lost with it first, so they keep it last)."""
        return tl.where(tl.arange(0, MP)[:, None, None, None] == m, acc + t[None, :, :, :], acc)

    @triton.jit
    def _add_col4(acc, t, m, MP: tl.constexpr):
        """acc [BN, A, B, MP] with t [BN, A, B] added to column m (the experts' gate/up, _qdot_rows_paired: with the x
        row axis first a Q6_K gate's sums changed in their last bits with the unroll on the GPU)."""
        return tl.where(tl.arange(0, MP)[None, None, None, :] == m, acc + t[:, :, :, None], acc)

    @triton.jit
    def _load_if(ptr, mask, MASKED: tl.constexpr):
        """tl.load of ptr, masked (zeros where mask is off) only where MASKED: the unmasked load stays plain."""
        if MASKED:
            val = tl.load(ptr, mask=mask, other=0)
        else:
            val = tl.load(ptr)
        return val

    @triton.jit
    def _k45_header(ww_ptr, base, mask):
        """Q4_K/Q5_K: the first 16 bytes of the super-blocks at byte offsets base [BN, C] (d, dmin, the 12 scale
        bytes) as its four words, each [BN, C] (the same for the four chunks of a super-block): every chunk's thread
        loads its row's words with one 16-byte load. (Loaded word by word, and d and dmin as halfwords, they were
        eight loads per step, each a sector of its own per row: on the H200 the products were bound by L1
        wavefronts, BENCHMARKS.md §5b.)"""
        v = tl.arange(0, 4)[None, None, :]
        hdr = tl.load(ww_ptr + (base // 4)[:, :, None] + v, mask=mask[:, :, None], other=0)
        # the word axis is inside each thread: these sums are register picks
        return (tl.sum(tl.where(v == 0, hdr, 0), axis=2), tl.sum(tl.where(v == 1, hdr, 0), axis=2),
                tl.sum(tl.where(v == 2, hdr, 0), axis=2), tl.sum(tl.where(v == 3, hdr, 0), axis=2))

    @triton.jit
    def _k45_scales(w0, w1, w2, w3, c, S: tl.constexpr):
        """(d * sc_j, dmin * m_j) [BN, C] for the sub-blocks j = 2c + S (c [C]: each lane's chunk in its
        super-block), from the header's words (_k45_header)."""
        j = 2 * c[None, :] + S
        a = _byte(w1, j % 4)
        b = _byte(w2, j % 4)
        e = _byte(w3, j % 4)
        sc = tl.where(j < 4, a & 63, (e & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, b & 63, (e >> 4) | ((b >> 6) << 4)).to(tl.float32)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return d * sc, dmin * mn

    @triton.jit
    def _k45_nibbles(ww_ptr, base, mask, c, WO: tl.constexpr, QT: tl.constexpr):
        """Q4_K/Q5_K: words WO..WO+3 of each lane's 32-byte chunk c [C] of the super-blocks at byte offsets base
        [BN, C] -> (low, high) nibble words [BN, C, 4] (sub-blocks 2c and 2c + 1), 5th bits OR-ed in for Q5_K."""
        c3 = c[None, :, None]
        v = tl.arange(0, 4)[None, None, :]
        m3 = mask[:, :, None]
        words = tl.load(ww_ptr + ((base + (16 if QT == QT_Q4_K else 48)) // 4)[:, :, None] + c3 * 8 + WO + v,
                        mask=m3, other=0)
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        if QT == QT_Q5_K:  # bit j of each qh byte is the 5th bit of sub-block j's element
            # loaded per chunk too (the same 16 bytes for the 4 chunks: L1 hits), so qh has the words' layout and no
            # exchange between threads is needed
            qh = tl.load(ww_ptr + ((base + 16) // 4)[:, :, None] + WO + v, mask=m3, other=0)
            lo = lo | (((qh >> (2 * c3)) & 0x01010101) << 4)
            hi = hi | (((qh >> (2 * c3 + 1)) & 0x01010101) << 4)
        return lo, hi

    @triton.jit
    def _k45_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, ww_ptr, rowb, nmask, kb, kb_hi,
                  M: tl.constexpr, MP: tl.constexpr, QT: tl.constexpr, ASM: tl.constexpr, KL: tl.constexpr = 1,
                  KMASK: tl.constexpr = False):
        """Q4_K / Q5_K super-blocks kb .. kb + KL - 1 of BN rows, for every x row; acc [BN, 4 KL, MP] (per row,
        lane, x row: summed over lanes at the end). Lane cc holds chunk cc % 4 of super-block kb + cc // 4 (KL > 1:
        threads side by side along K, so a row's short K is walked in fewer, wider steps); its x words and scales
        are then at kb * 64 + 16 cc and kb * 8 + 2 cc, as one super-block's chunks. A thread holds whole sub-blocks
        (two runs of four words), so the integer sums need no exchange between threads. KMASK: the lanes past
        kb_hi (the last, partial step of a row) read nothing and add zeros."""
        cc = tl.arange(0, 4 * KL)
        c = cc % 4
        kmask = kb + cc // 4 < kb_hi  # used only where KMASK
        mask = nmask[:, None] & kmask[None, :] if KMASK else nmask[:, None]
        base = rowb[:, None] + (kb + cc // 4)[None, :] * (144 if QT == QT_Q4_K else 176)
        lo_a, hi_a = _k45_nibbles(ww_ptr, base, mask, c, 0, QT)
        lo_b, hi_b = _k45_nibbles(ww_ptr, base, mask, c, 4, QT)
        w0, w1, w2, w3 = _k45_header(ww_ptr, base, mask)
        dsl, dml = _k45_scales(w0, w1, w2, w3, c, 0)
        dsh, dmh = _k45_scales(w0, w1, w2, w3, c, 1)
        c3 = cc[None, :, None]
        v = tl.arange(0, 4)[None, None, :]
        xm3 = kmask[None, :, None]
        xm2 = kmask[None, :]
        for m in tl.static_range(M):
            xw = xq_ptr + m * x_m + kb * 64 + c3 * 16 + v  # x words of the lane's sub-block 2c; + 8: of 2c + 1
            il = dp4a(lo_b, _load_if(xw + 4, xm3, KMASK), dp4a(lo_a, _load_if(xw, xm3, KMASK), tl.zeros_like(lo_a),
                                                               ASM), ASM)
            ih = dp4a(hi_b, _load_if(xw + 12, xm3, KMASK), dp4a(hi_a, _load_if(xw + 8, xm3, KMASK),
                                                                tl.zeros_like(hi_a), ASM), ASM)
            xb = m * xd_m + kb * 8 + 2 * cc[None, :]
            t = (dsl * (_load_if(xd_ptr + xb, xm2, KMASK) * tl.sum(il, axis=2).to(tl.float32))
                 - dml * _load_if(xs_ptr + xb, xm2, KMASK)
                 + (dsh * (_load_if(xd_ptr + xb + 1, xm2, KMASK) * tl.sum(ih, axis=2).to(tl.float32))
                    - dmh * _load_if(xs_ptr + xb + 1, xm2, KMASK)))
            acc = _add_col(acc, t, m, MP)
        return acc

    @triton.jit
    def _q6_step(acc, xq_ptr, xd_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr, rowb, nmask, K, kb,
                 M: tl.constexpr, MP: tl.constexpr, QT: tl.constexpr, ASM: tl.constexpr, XFIRST: tl.constexpr):
        """Q6_K super-block kb of BN rows (QT 14, or 114: rows in planes), for every x row; acc [MP, BN, 2, 2] (XFIRST)
        or [BN, 2, 2, MP] per (x row, row, half h, 16-weight group g of each 32-weight run). Words on the first axis
        (v), which the halfword loads leave inside each thread: word 4g + v of run t of half h pairs ql word
        (h, t % 2) (nibble t // 2) with the bit pair 2t of qh word h. The unsigned 6-bit q's dot is corrected to
        q - 32's by x's integer sum over the group (xg)."""
        v = tl.arange(0, 4)[:, None, None, None]
        h = tl.arange(0, 2)[None, None, :, None]
        g = tl.arange(0, 2)[None, None, None, :]
        m4 = nmask[None, :, None, None]
        ql_at, qh_at, sc_at, d_at = q6_parts(kb, K, QT)
        h3 = tl.arange(0, 2)[None, :, None]
        g3 = tl.arange(0, 2)[None, None, :]
        m3 = nmask[:, None, None]
        if QT == QT_Q6_K_PLANES:  # every run starts 16-byte aligned: one 16-byte load per run of four words
            rw = (rowb // 4)[None, :, None, None]
            ql0 = tl.load(ww_ptr + rw + ql_at // 4 + h * 16 + 4 * g + v, mask=m4, other=0)
            ql1 = tl.load(ww_ptr + rw + ql_at // 4 + 8 + h * 16 + 4 * g + v, mask=m4, other=0)
            qh = tl.load(ww_ptr + rw + qh_at // 4 + h * 8 + 4 * g + v, mask=m4, other=0)
            sw = ww_ptr + ((rowb + sc_at) // 4)[:, None, None] + 2 * h3  # scale bytes 8h .. 8h + 7
            lo = tl.load(sw, mask=m3, other=0)
            hi = tl.load(sw + 1, mask=m3, other=0)
            s0, s1, s2, s3 = _i8(_byte(lo, g3)), _i8(_byte(lo, g3 + 2)), _i8(_byte(hi, g3)), _i8(_byte(hi, g3 + 2))
        else:
            hw = ((rowb + ql_at) // 2)[None, :, None, None] + h * 32 + (4 * g + v) * 2
            ql0, ql1, qh = _q6_words(wi_ptr, ww_ptr, hw, hw + 64 - h * 16, m4, kb % 2 == 0)
            sb = (rowb + sc_at)[:, None, None] + h3 * 8 + g3  # + 2t: run t's scale
            s0 = _i8(tl.load(wb_ptr + sb, mask=m3, other=0).to(tl.int32))
            s1 = _i8(tl.load(wb_ptr + sb + 2, mask=m3, other=0).to(tl.int32))
            s2 = _i8(tl.load(wb_ptr + sb + 4, mask=m3, other=0).to(tl.int32))
            s3 = _i8(tl.load(wb_ptr + sb + 6, mask=m3, other=0).to(tl.int32))
        q0 = (ql0 & 0x0F0F0F0F) | ((qh << 4) & 0x30303030)
        q1 = (ql1 & 0x0F0F0F0F) | ((qh << 2) & 0x30303030)
        q2 = ((ql0 >> 4) & 0x0F0F0F0F) | (qh & 0x30303030)
        q3 = ((ql1 >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030)
        d = tl.load(wh_ptr + (rowb + d_at) // 2, mask=nmask, other=0.0).to(tl.float32)[:, None, None]
        for m in tl.static_range(M):
            xw = xq_ptr + m * x_m + kb * 64 + h * 32 + 4 * g + v  # + 8t: run t
            xg = xg_ptr + m * xg_m + kb * 16 + h3 * 8 + g3  # + 2t
            xb = xd_ptr + m * xd_m + kb * 8 + h3 * 4  # + t
            t = _q6_run(q0, xw, xg, xb, s0, ASM) + _q6_run(q1, xw + 8, xg + 2, xb + 1, s1, ASM)
            t += _q6_run(q2, xw + 16, xg + 4, xb + 2, s2, ASM) + _q6_run(q3, xw + 24, xg + 6, xb + 3, s3, ASM)
            if XFIRST:
                acc = _add_row(acc, d * t, m, MP)
            else:
                acc = _add_col4(acc, d * t, m, MP)
        return acc

    @triton.jit
    def _q6_words(wi_ptr, ww_ptr, hql, hqh, mask, even):
        """Q6_K's ql words at even halfword offsets hql (runs t = 0 and 2) and hql + 16 (t = 1 and 3), qh's at hqh:
        32-bit loads where the rows are whole words (ww_ptr the int32 view: an even block count) and the block's
        index is even (its 210 bytes then start on a word), else pairs of 16-bit loads."""
        if ww_ptr.dtype.element_ty == tl.int32:
            if even:  # not _word's loads: one word index for both ql loads (ptxas counts 9% more instructions)
                ql0 = tl.load(ww_ptr + hql // 2, mask=mask, other=0)
                ql1 = tl.load(ww_ptr + hql // 2 + 8, mask=mask, other=0)
                qh = tl.load(ww_ptr + hqh // 2, mask=mask, other=0)
            else:
                ql0, ql1, qh = _w16(wi_ptr, hql, mask), _w16(wi_ptr, hql + 16, mask), _w16(wi_ptr, hqh, mask)
        else:
            ql0, ql1, qh = _w16(wi_ptr, hql, mask), _w16(wi_ptr, hql + 16, mask), _w16(wi_ptr, hqh, mask)
        return ql0, ql1, qh

    @triton.jit
    def _q6_run(q, xw, xg, xb, sc, ASM: tl.constexpr):
        """One run of 32 weights per (row, h, g): dx * (sc * (dot(q, x) - 32 * sum(x))) [BN, 2, 2]."""
        isum = tl.sum(dp4a(q, tl.load(xw), tl.zeros_like(q), ASM), axis=0) - 32 * tl.load(xg)
        return tl.load(xb) * (sc * isum).to(tl.float32)

    @triton.jit
    def _spread5(v):
        """Bits 0..3 of v to bit 4 of bytes 0..3 (v * 0x2040810 puts copies of v at 4, 11, 18, 25: disjoint)."""
        return ((v & 15) * 0x2040810) & 0x10101010

    @triton.jit
    def _b32_load(wh_ptr, wi_ptr, ww_ptr, rowb, nmask, blk, bmask, QT: tl.constexpr, ODD: tl.constexpr):
        """Q8_0 / Q4_0 / Q5_0 blocks blk [1, 4] (all odd when ODD, all even otherwise) of BN rows -> (d [BN, 4],
        words [W, BN, 4] for dp4a: Q8_0's signed bytes twice; Q4_0/Q5_0's elements 4w.. and 16 + 4w..). A block's
        words lie on the first axis, which the halfword loads leave inside each thread (no exchange for the sums).
        The three sizes are 2 mod 4 bytes, so in rows of whole words (ww_ptr the int32 view) an odd block's words
        (qs and Q5_0's qh, at bytes 2 and 6) start on a word: one 32-bit load each instead of two 16-bit ones."""
        W: tl.constexpr = 8 if QT == QT_Q8_0 else 4  # words per block
        bs: tl.constexpr = 34 if QT == QT_Q8_0 else (18 if QT == QT_Q4_0 else 22)
        qs_at: tl.constexpr = 1 if QT != QT_Q5_0 else 3  # halfwords
        WORDS: tl.constexpr = ODD and ww_ptr.dtype.element_ty == tl.int32
        w = tl.arange(0, W)[:, None, None]
        m2 = nmask[:, None] & bmask
        hb = (rowb[:, None] + blk * bs) // 2  # [BN, 4] halfword offset of each block
        d = tl.load(wh_ptr + hb, mask=m2, other=0.0).to(tl.float32)
        words = _word(wi_ptr, ww_ptr, hb[None, :, :] + qs_at + 2 * w, m2[None, :, :], WORDS)
        if QT == QT_Q8_0:
            lo = words
            hi = words
        else:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
            if QT == QT_Q5_0:
                qh = _word(wi_ptr, ww_ptr, hb + 1, m2, WORDS)[None, :, :]
                lo = lo | _spread5(qh >> (4 * w))
                hi = hi | _spread5(qh >> (16 + 4 * w))
        return d, lo, hi

    @triton.jit
    def _word(wi_ptr, ww_ptr, hoff, mask, WORDS: tl.constexpr):
        """The 32-bit word at halfword offset hoff: one 32-bit load where WORDS says it starts on a word (ww_ptr the
        int32 view), else two 16-bit loads."""
        if WORDS:
            w = tl.load(ww_ptr + hoff // 2, mask=mask, other=0)
        else:
            w = _w16(wi_ptr, hoff, mask)
        return w

    @triton.jit
    def _b32_dot(d, lo, hi, xq_ptr, xd_ptr, xs_ptr, blk, bmask, QT: tl.constexpr, ASM: tl.constexpr):
        """The f32 terms [BN, 4] of blocks blk for one x row (xq_ptr .. at that row)."""
        W: tl.constexpr = 8 if QT == QT_Q8_0 else 4
        xw = xq_ptr + blk[None, :, :] * 8 + tl.arange(0, W)[:, None, None]
        xmask = bmask[None, :, :]
        dx = tl.load(xd_ptr + blk, mask=bmask, other=0.0)
        if QT == QT_Q8_0:
            isum = tl.sum(dp4a(lo, tl.load(xw, mask=xmask, other=0), tl.zeros_like(lo), ASM), axis=0)
            t = d * (dx * isum.to(tl.float32))
        else:
            isum = dp4a(lo, tl.load(xw, mask=xmask, other=0), tl.zeros_like(lo), ASM)
            isum = tl.sum(dp4a(hi, tl.load(xw + 4, mask=xmask, other=0), isum, ASM), axis=0)
            sx = tl.load(xs_ptr + blk, mask=bmask, other=0.0)
            t = d * (dx * isum.to(tl.float32) - (8.0 if QT == QT_Q4_0 else 16.0) * sx)
        return t

    @triton.jit
    def _b32_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, wh_ptr, wi_ptr, ww_ptr, rowb, nmask, kb, K,
                  M: tl.constexpr, MP: tl.constexpr, QT: tl.constexpr, ASM: tl.constexpr):
        """Q8_0 / Q4_0 / Q5_0: blocks kb*8 .. kb*8 + 7 of BN rows (the four even ones and the four odd ones), for
        every x row; acc [BN, 4, MP]."""
        blk = kb * 8 + 2 * tl.arange(0, 4)[None, :]
        ma = blk < K // 32
        mb = blk + 1 < K // 32
        da, loa, hia = _b32_load(wh_ptr, wi_ptr, ww_ptr, rowb, nmask, blk, ma, QT, False)
        db, lob, hib = _b32_load(wh_ptr, wi_ptr, ww_ptr, rowb, nmask, blk + 1, mb, QT, True)
        for m in tl.static_range(M):
            xq, xd, xs = xq_ptr + m * x_m, xd_ptr + m * xd_m, xs_ptr + m * xd_m
            t = (_b32_dot(da, loa, hia, xq, xd, xs, blk, ma, QT, ASM)
                 + _b32_dot(db, lob, hib, xq, xd, xs, blk + 1, mb, QT, ASM))
            acc = _add_col(acc, t, m, MP)
        return acc

    @triton.jit
    def _b32p_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, ww_ptr, rowb, nmask, kb, K,
                   M: tl.constexpr, MP: tl.constexpr, QT: tl.constexpr, ASM: tl.constexpr):
        """Q8_0 / Q5_0 / Q4_0 rows in planes (QT 108 / 106 / 102): blocks kb*8 .. kb*8 + 7 of BN rows, for every x
        row; acc [BN, 8, MP]. The quants come as 16-byte runs of four words [BN, 8, 4] with the word axis inside each
        thread (the integer sums need no exchange); the step's eight d (16 bytes) and Q5_0's qh (16 bytes for four
        blocks) are loaded in that layout by every thread of a row and the block's word picked in registers, so no
        value moves between threads (in the file's order Triton 3.6 moved each step's terms through shared memory)."""
        j = tl.arange(0, 8)[None, :, None]
        v = tl.arange(0, 4)[None, None, :]
        blk = kb * 8 + j
        bmask = blk < K // 32
        m3 = nmask[:, None, None] & bmask
        rw = (rowb // 4)[:, None, None]
        _, qh_at, qs_at = b32_parts(blk, K, QT)
        lo = tl.load(ww_ptr + rw + qs_at // 4 + v, mask=m3, other=0)
        if QT == QT_Q8_0_PLANES:  # signed bytes: elements 0..15, then 16..31
            hi = tl.load(ww_ptr + rw + qs_at // 4 + 4 + v, mask=m3, other=0)
        else:  # low nibbles: elements 4v.., high: 16 + 4v..
            hi = (lo >> 4) & 0x0F0F0F0F
            lo = lo & 0x0F0F0F0F
            if QT == QT_Q5_0_PLANES:  # bit i of the block's qh word is element i's 5th bit
                qh4 = tl.load(ww_ptr + rw + qh_at // 16 * 4 + v, mask=m3, other=0)
                qh = tl.sum(tl.where(v == blk % 4, qh4, 0), axis=2)[:, :, None]
                lo = lo | _spread5(qh >> (4 * v))
                hi = hi | _spread5(qh >> (16 + 4 * v))
        d_at, _, _ = b32_parts(kb * 8 + j * 0, K, QT)  # the step's eight d: one 16-byte run
        d4 = tl.load(ww_ptr + rw + d_at // 4 + v, mask=nmask[:, None, None] & (j >= 0), other=0)
        dw = tl.sum(tl.where(v == j // 2, d4, 0), axis=2)
        j2 = tl.arange(0, 8)[None, :]
        d = ((dw >> (16 * (j2 % 2))) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        b2 = kb * 8 + j2
        # x's words at the weights' shape (each row's threads load the same words): loaded as [1, 8, 4], a one-warp
        # program (the experts' down) gave them a layout of their own and moved the weights to it every step
        xoff = tl.broadcast_to(blk * 8 + v, lo.shape)
        for m in tl.static_range(M):
            xw = xq_ptr + m * x_m + xoff
            isum = dp4a(lo, tl.load(xw, mask=bmask, other=0), tl.zeros_like(lo), ASM)
            isum = tl.sum(dp4a(hi, tl.load(xw + 4, mask=bmask, other=0), isum, ASM), axis=2)
            dx = tl.load(xd_ptr + m * xd_m + b2, mask=b2 < K // 32, other=0.0)
            if QT == QT_Q8_0_PLANES:
                t = d * (dx * isum.to(tl.float32))
            else:
                sx = tl.load(xs_ptr + m * xd_m + b2, mask=b2 < K // 32, other=0.0)
                t = d * (dx * isum.to(tl.float32) - (8.0 if QT == QT_Q4_0_PLANES else 16.0) * sx)
            acc = _add_col(acc, t, m, MP)
        return acc

    @triton.jit
    def _qdot_step(acc, xq_ptr, xd_ptr, xs_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr, rowb, nmask,
                   K, kb, M: tl.constexpr, MP: tl.constexpr, QT: tl.constexpr, ASM: tl.constexpr,
                   XFIRST: tl.constexpr = True, KL: tl.constexpr = 1, kb_hi=0, KMASK: tl.constexpr = False):
        """acc plus the 256-weight step kb of the BN weight rows, for every x row (the step function of QT; Q4_K and
        Q5_K take KL steps kb.. side by side, those from kb_hi on masked off where KMASK)."""
        if QT == QT_Q4_K or QT == QT_Q5_K:
            acc = _k45_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, ww_ptr, rowb, nmask, kb, kb_hi, M, MP, QT, ASM,
                            KL, KMASK)
        elif QT == QT_Q6_K or QT == QT_Q6_K_PLANES:
            acc = _q6_step(acc, xq_ptr, xd_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr, rowb, nmask,
                           K, kb, M, MP, QT, ASM, XFIRST)
        elif QT > QT_PLANES:  # 32-weight blocks in planes (Q6_K's are taken above)
            acc = _b32p_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, ww_ptr, rowb, nmask, kb, K, M, MP, QT, ASM)
        else:
            acc = _b32_step(acc, xq_ptr, xd_ptr, xs_ptr, x_m, xd_m, wh_ptr, wi_ptr, ww_ptr, rowb, nmask, kb, K, M, MP,
                            QT, ASM)
        return acc

    @triton.jit
    def _qdot_rows(xq_ptr, xd_ptr, xs_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr, rowb, nmask, K,
                   kb_lo, kb_hi, M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr,
                   ASM: tl.constexpr, UNROLL: tl.constexpr = 1, KL: tl.constexpr = 1):
        """[MP, BN] f32: x rows 0..M-1 (quantized: words, d, s, 16-sums; strides x_m, xd_m, xg_m) times the BN weight
        rows at byte offsets rowb, over the 256-weight steps kb_lo .. kb_hi - 1. The accumulators keep a column per
        x row (MP, innermost: where() on it resolves at compile time) and are summed over their other axes once.
        UNROLL steps per loop iteration put that many steps' loads in one basic block (more bytes in flight per
        thread); the steps are added in the same order whatever UNROLL is, so the result does not depend on it.
        KL (Q4_K/Q5_K only): each step is KL super-blocks side by side in the lanes of _k45_step (the last one of a
        row masked where K runs out), so a row's KL lanes each add every KL-th super-block and the lanes' sums are
        added at the end (another order than KL = 1's)."""
        acc = _acc_zeros(MP, BN, QT, True, KL)
        kb_main = kb_lo + (kb_hi - kb_lo) // (UNROLL * KL) * (UNROLL * KL)
        for kb0 in range(kb_lo, kb_main, UNROLL * KL):
            for u in tl.static_range(UNROLL):
                acc = _qdot_step(acc, xq_ptr, xd_ptr, xs_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr,
                                 rowb, nmask, K, kb0 + u * KL, M, MP, QT, ASM, True, KL)
        for kb in range(kb_main, kb_hi, KL):
            acc = _qdot_step(acc, xq_ptr, xd_ptr, xs_ptr, xg_ptr, x_m, xd_m, xg_m, wb_ptr, wh_ptr, wi_ptr, ww_ptr,
                             rowb, nmask, K, kb, M, MP, QT, ASM, True, KL, kb_hi, KL > 1)
        return _acc_rows(acc, QT, True, KL)

    @triton.jit
    def _acc_zeros(MP: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, XFIRST: tl.constexpr = True,
                   KL: tl.constexpr = 1):
        """The accumulators of _qdot_rows for type QT (a slice per x row: Q6_K's first where XFIRST, else innermost;
        Q4_K/Q5_K: 4 KL lanes a row)."""
        if QT > QT_PLANES and QT != QT_Q6_K_PLANES:  # 32-weight blocks in planes
            acc = tl.zeros([BN, 8, MP], dtype=tl.float32)
        elif QT != QT_Q6_K and QT != QT_Q6_K_PLANES:
            acc = tl.zeros([BN, 4 * KL, MP], dtype=tl.float32)
        elif XFIRST:
            acc = tl.zeros([MP, BN, 2, 2], dtype=tl.float32)
        else:
            acc = tl.zeros([BN, 2, 2, MP], dtype=tl.float32)
        return acc

    @triton.jit
    def _acc_rows(acc, QT: tl.constexpr, XFIRST: tl.constexpr = True, KL: tl.constexpr = 1):
        """[MP, BN]: the accumulators summed over their other axes (Q4_K/Q5_K's 4 KL lanes: a super-block's four
        chunks, then the KL super-blocks, in groups of at most four: the interpreter's numpy adds fewer than 8 terms
        in order whatever the x row count, where it sums 8 or more pairwise along a contiguous axis only)."""
        if KL > 4:  # acc [BN, 4 KL, MP]
            lanes = tl.sum(tl.sum(tl.reshape(acc, (acc.shape[0], KL // 4, 4, 4, acc.shape[2])), axis=3), axis=2)
            out = tl.trans(tl.sum(lanes, axis=1))
        elif KL > 1:
            out = tl.trans(tl.sum(tl.sum(tl.reshape(acc, (acc.shape[0], KL, 4, acc.shape[2])), axis=2), axis=1))
        elif QT != QT_Q6_K and QT != QT_Q6_K_PLANES:
            out = tl.trans(tl.sum(acc, axis=1))
        elif XFIRST:
            out = tl.sum(tl.sum(acc, axis=3), axis=2)
        else:
            out = tl.trans(tl.sum(tl.sum(acc, axis=2), axis=1))
        return out

    @triton.jit
    def _qdot_rows_paired(xq_ptr, xd_ptr, xs_ptr, xg_ptr, ab_ptr, ah_ptr, ai_ptr, aw_ptr, arow, bb_ptr, bh_ptr, bi_ptr,
                          bw_ptr, brow, nmask, K, kb_lo, kb_hi, BN: tl.constexpr, QA: tl.constexpr, QB: tl.constexpr,
                          ASM: tl.constexpr, UNROLL: tl.constexpr = 1, KL: tl.constexpr = 1):
        """Two one-x-row products over the 256-weight steps kb_lo .. kb_hi - 1 in one loop, [1, BN] each: _qdot_rows
        of the weight rows a (type QA, byte offsets arow) and b (QB, brow), each step of a followed by the same step
        of b, so twice the bytes are in flight per iteration; each product adds its steps in _qdot_rows's order (Q6_K's
        accumulators with the x row axis last, XFIRST off: _add_col4; Q4_K/Q5_K in KL lanes as _qdot_rows)."""
        acc_a = _acc_zeros(1, BN, QA, False, KL)
        acc_b = _acc_zeros(1, BN, QB, False, KL)
        kb_main = kb_lo + (kb_hi - kb_lo) // (UNROLL * KL) * (UNROLL * KL)
        for kb0 in range(kb_lo, kb_main, UNROLL * KL):
            for u in tl.static_range(UNROLL):
                acc_a = _qdot_step(acc_a, xq_ptr, xd_ptr, xs_ptr, xg_ptr, 0, 0, 0, ab_ptr, ah_ptr, ai_ptr, aw_ptr,
                                   arow, nmask, K, kb0 + u * KL, 1, 1, QA, ASM, False, KL)
                acc_b = _qdot_step(acc_b, xq_ptr, xd_ptr, xs_ptr, xg_ptr, 0, 0, 0, bb_ptr, bh_ptr, bi_ptr, bw_ptr,
                                   brow, nmask, K, kb0 + u * KL, 1, 1, QB, ASM, False, KL)
        for kb in range(kb_main, kb_hi, KL):
            acc_a = _qdot_step(acc_a, xq_ptr, xd_ptr, xs_ptr, xg_ptr, 0, 0, 0, ab_ptr, ah_ptr, ai_ptr, aw_ptr, arow,
                               nmask, K, kb, 1, 1, QA, ASM, False, KL, kb_hi, KL > 1)
            acc_b = _qdot_step(acc_b, xq_ptr, xd_ptr, xs_ptr, xg_ptr, 0, 0, 0, bb_ptr, bh_ptr, bi_ptr, bw_ptr, brow,
                               nmask, K, kb, 1, 1, QB, ASM, False, KL, kb_hi, KL > 1)
        return _acc_rows(acc_a, QA, False, KL), _acc_rows(acc_b, QB, False, KL)

    @triton.jit
    def _qdot_mv_part(xq_ptr, xd_ptr, xs_ptr, xg_ptr, wb_ptr, wh_ptr, wi_ptr, ww_ptr, y_ptr, p_ptr, c_ptr, blk, N, K,
                      STEPS, S, w_n, p_s, p_m, y_m, M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
                      QT: tl.constexpr, ASM: tl.constexpr, OUT_DT: tl.constexpr, UNROLL: tl.constexpr,
                      PARTS: tl.constexpr, SUM_HERE: tl.constexpr, KL: tl.constexpr):
        """Row block blk, split program_id(1) (< S: a part with fewer splits than the grid leaves the rest idle) of
        one block matrix: steps split*STEPS .. of K for BN weight rows and all M x rows -> the output y, or (PARTS:
        the launch splits K) the split's f32 partial sums p [S, M, p_m] (p_s: a split's stride); y_ptr and p_ptr
        point at the part's first column. SUM_HERE: the split's program that arrives last at the block's counter
        c_ptr[0] adds the partial sums in split order into y and resets the counter (and a part not split writes y
        directly); else _sum_parts_kernel adds them, a launch later."""
        if tl.program_id(1) < S:
            n = blk * BN + tl.arange(0, BN)
            nmask = n < N
            k_lo = tl.program_id(1) * STEPS
            k_hi = tl.minimum(k_lo + STEPS, tl.cdiv(K, 256))
            acc = _qdot_rows(xq_ptr, xd_ptr, xs_ptr, xg_ptr, K // 4, K // 32, K // 16, wb_ptr, wh_ptr, wi_ptr, ww_ptr,
                             n.to(tl.int64) * w_n, nmask, K, k_lo, k_hi, M, MP, BN, QT, ASM, UNROLL, KL)
            im = tl.arange(0, MP)
            mask = (im[:, None] < M) & nmask[None, :]
            if not PARTS or (SUM_HERE and S == 1):
                tl.store(y_ptr + im[:, None] * y_m + n[None, :], round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty),
                         mask=mask)
            else:
                part = p_ptr + im[:, None] * p_m + n[None, :]
                tl.store(part + tl.program_id(1) * p_s, acc, mask=mask)
                if SUM_HERE:
                    sum_if_last(part, c_ptr, y_ptr + im[:, None] * y_m + n[None, :], mask, S, p_s, OUT_DT)

    @triton.jit
    def _qdot_mv_kernel(xq_ptr, xd_ptr, xs_ptr, xg_ptr, ab_ptr, ah_ptr, ai_ptr, aw_ptr, bb_ptr, bh_ptr, bi_ptr, bw_ptr,
                        y_ptr, p_ptr, c_ptr, K, NA, NB, BLOCKS_A, STEPS_A, STEPS_B, S_A, S_B, wa_n, wb_n, p_s, y_m,
                        M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, QA: tl.constexpr, QB: tl.constexpr,
                        TWO: tl.constexpr, ASM: tl.constexpr, OUT_DT: tl.constexpr, UNROLL: tl.constexpr = 1,
                        PARTS: tl.constexpr = False, SUM_HERE: tl.constexpr = False, KL: tl.constexpr = 1,
                        PDL: tl.constexpr = False):
        """Program (row block, split) of one block matrix A, or (TWO) of two that multiply the same x, each its own
        type, in one launch: row blocks 0 .. BLOCKS_A - 1 are A's (columns 0 .. NA - 1 of the output), the rest
        B's (columns NA ..); each part keeps the split of K it would have alone (S_A / S_B shares of STEPS_A /
        STEPS_B steps), so its numbers are those of its own launch. PARTS: partial sums p [S, M, NA + NB]; c_ptr: a
        zeroed arrival counter per row block (SUM_HERE)."""
        pdl_start(PDL)
        blk = tl.program_id(0)
        if TWO and blk >= BLOCKS_A:
            _qdot_mv_part(xq_ptr, xd_ptr, xs_ptr, xg_ptr, bb_ptr, bh_ptr, bi_ptr, bw_ptr, y_ptr + NA, p_ptr + NA,
                          c_ptr + blk, blk - BLOCKS_A, NB, K, STEPS_B, S_B, wb_n, p_s, NA + NB, y_m, M, MP, BN,
                          QB, ASM, OUT_DT, UNROLL, PARTS, SUM_HERE, KL)
        else:
            _qdot_mv_part(xq_ptr, xd_ptr, xs_ptr, xg_ptr, ab_ptr, ah_ptr, ai_ptr, aw_ptr, y_ptr, p_ptr, c_ptr + blk,
                          blk, NA, K, STEPS_A, S_A, wa_n, p_s, NA + NB, y_m, M, MP, BN, QA, ASM, OUT_DT, UNROLL,
                          PARTS, SUM_HERE, KL)

    @triton.jit
    def _sum_parts_kernel(p_ptr, y_ptr, S, total, N, y_m, NA, S_B, BLOCK: tl.constexpr, OUT_DT: tl.constexpr,
                          PDL: tl.constexpr = False):
        """y [M, N] (row stride y_m) = the sum of the partial sums p [S, M * N], added in split order (the same
        for any row count): S of them for the columns below NA, S_B for the rest (two parts of one launch)."""
        pdl_start(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        count = tl.where(i % N < NA, S, S_B)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, tl.maximum(S, S_B)):
            acc = tl.where(s < count, acc + tl.load(p_ptr + s * total + i, mask=mask & (s < count), other=0.0), acc)
        tl.store(y_ptr + (i // N) * y_m + i % N, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qdot_gate_up_kernel(xq_ptr, xd_ptr, xs_ptr, xg_ptr, ti_ptr, gb_ptr, gh_ptr, gi_ptr, gw_ptr, ub_ptr, uh_ptr,
                             ui_ptr, uw_ptr, act_ptr, D, F, KS, ti_m, g_e, g_f, u_e, u_f, STEPS, BN: tl.constexpr,
                             QG: tl.constexpr, QU: tl.constexpr, ASM: tl.constexpr, UNROLL: tl.constexpr = 1,
                             SPLIT: tl.constexpr = False, KL: tl.constexpr = 1, PDL: tl.constexpr = False):
        """act[pair, f] = silu(gate_e[f] . h_t) * (up_e[f] . h_t) in f32 with h_t quantized; pair = t * KS + j,
        e = top_i[t, j]; gate's and up's steps alternate in one loop. SPLIT: program_id(2) = share s takes STEPS
        steps of D and stores its partial sums of gate and up to act [S, pairs, 2, F] (_act_quant_kernel adds
        them)."""
        pdl_start(PDL)
        pair, t, _, e, f, fmask = expert_pair(ti_ptr, ti_m, KS, F, BN)
        xq, xd, xs = xq_ptr + t * (D // 4), xd_ptr + t * (D // 32), xs_ptr + t * (D // 32)
        xg = xg_ptr + t * (D // 16)
        grow, urow = e * g_e + f.to(tl.int64) * g_f, e * u_e + f.to(tl.int64) * u_f
        if SPLIT:
            kb_lo = tl.program_id(2) * STEPS
            kb_hi = tl.minimum(kb_lo + STEPS, tl.cdiv(D, 256))
        else:
            kb_lo = 0
            kb_hi = tl.cdiv(D, 256)
        g, u = _qdot_rows_paired(xq, xd, xs, xg, gb_ptr, gh_ptr, gi_ptr, gw_ptr, grow, ub_ptr, uh_ptr, ui_ptr, uw_ptr,
                                 urow, fmask, D, kb_lo, kb_hi, BN, QG, QU, ASM, UNROLL, KL)
        if SPLIT:
            row = (tl.program_id(2) * tl.num_programs(1) + pair) * 2
            tl.store(act_ptr + row * F + f[None, :], g, mask=fmask[None, :])
            tl.store(act_ptr + (row + 1) * F + f[None, :], u, mask=fmask[None, :])
        else:
            a = g / (1.0 + tl.exp(-g)) * u
            tl.store(act_ptr + pair * F + f[None, :], a, mask=fmask[None, :])

    @triton.jit
    def _act_quant_kernel(p_ptr, q_ptr, d_ptr, s_ptr, g_ptr, F, S, BB: tl.constexpr, PDL: tl.constexpr = False):
        """Program (pair, block chunk): act = silu(gate) * up from the S shares' partial sums p [S, pairs, 2, F]
        (added in share order), quantized as quant_x_blocks does (launched without FMA fusion, as it is)."""
        pdl_start(PDL)
        pair = tl.program_id(0)
        b = tl.program_id(1) * BB + tl.arange(0, BB)
        bmask = b < F // 32
        off = b[:, None] * 32 + tl.arange(0, 32)[None, :]
        g = tl.zeros([BB, 32], dtype=tl.float32)
        u = tl.zeros([BB, 32], dtype=tl.float32)
        for s in range(0, S):
            row = (s * tl.num_programs(0) + pair) * 2
            g += tl.load(p_ptr + row * F + off, mask=bmask[:, None], other=0.0)
            u += tl.load(p_ptr + (row + 1) * F + off, mask=bmask[:, None], other=0.0)
        quantized_store(g / (1.0 + tl.exp(-g)) * u, q_ptr, d_ptr, s_ptr, g_ptr, pair, b, bmask, F // 32, BB)

    @triton.jit
    def _qdot_down_kernel(xq_ptr, xd_ptr, xs_ptr, xg_ptr, ti_ptr, tw_ptr, db_ptr, dh_ptr, di_ptr, dw_ptr, y_ptr, D, F,
                          KS, ti_m, tw_m, d_e, d_d, BN: tl.constexpr, QD: tl.constexpr, ASM: tl.constexpr,
                          OUT_DT: tl.constexpr, UNROLL: tl.constexpr = 1, PDL: tl.constexpr = False):
        """y[t, j, :] = top_w[t, j] * down_e . act[pair] (act quantized) for BN output features, rounded once."""
        pdl_start(PDL)
        pair, t, j, e, dd, dmask = expert_pair(ti_ptr, ti_m, KS, D, BN)
        wt = tl.load(tw_ptr + t * tw_m + j).to(tl.float32)
        acc = _qdot_rows(xq_ptr + pair * (F // 4), xd_ptr + pair * (F // 32), xs_ptr + pair * (F // 32),
                         xg_ptr + pair * (F // 16), 0, 0, 0, db_ptr, dh_ptr, di_ptr, dw_ptr,
                         e * d_e + dd.to(tl.int64) * d_d, dmask, F, 0, tl.cdiv(F, 256), 1, 1, BN, QD, ASM, UNROLL)
        tl.store(y_ptr + pair * D + dd[None, :], round_to(acc * wt, OUT_DT).to(y_ptr.dtype.element_ty),
                 mask=dmask[None, :])


def _asm() -> bool:
    return DP4A_ASM and not INTERPRET


def quantized_x_buffers(M: int, K: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Empty outputs of the activation quantizer for x [M, K]: int8 q [M, K], f32 d and s [M, K/32], int32 sums per
    16 [M, K/16]."""
    KB = K // 32
    return (torch.empty(M, K, dtype=torch.int8, device=device), torch.empty(M, KB, dtype=torch.float32, device=device),
            torch.empty(M, KB, dtype=torch.float32, device=device),
            torch.empty(M, 2 * KB, dtype=torch.int32, device=device))


def quant_chunk(K: int) -> int:
    """32-element blocks per quantizing program for rows of K elements."""
    return min(QUANT_BLOCKS, next_pow2(K // 32))


def quantize_x_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32, last dim contiguous) -> (int8 words [M, K/4] int32, d [M, K/32] f32,
    s [M, K/32] f32, int32 sums per 16 [M, K/16]), as qdot.quantize_x_torch."""
    M, K = x.shape
    if K % 32 or x.stride(1) != 1:
        raise ValueError(f"quantize_x: x {tuple(x.shape)} stride {x.stride()}")
    q, d, s, g = quantized_x_buffers(M, K, x.device)
    bb = quant_chunk(K)
    _quant_x_kernel[(M, triton.cdiv(K // 32, bb))](x, q, d, s, g, x.stride(0), K // 32, BB=bb, num_warps=4,
                                                   enable_fp_fusion=False, **pdl_launch(x))
    return q.view(torch.int32), d, s, g


QuantizedX = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # quantize_x_triton's result


def _views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bytes and their f16, int16 and (rows of whole 32-bit words) int32 views, one storage."""
    wi = raw.view(torch.int16)
    return raw, raw.view(torch.float16), wi, raw.view(torch.int32) if raw.shape[-1] % 4 == 0 else wi


def _sm_count(x: torch.Tensor) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(x.device).multi_processor_count


def _split(n: int, k: int, bn: int, per_sm: int, x: torch.Tensor, lanes: int = 1) -> tuple[int, int]:
    """(splits, steps per split) of K: depends on the matrix and the GPU only, never on the row count. With K lanes
    a share is whole lane steps (a multiple of `lanes` steps, but the last), so no share ends in a masked one."""
    steps = triton.cdiv(k, 256)
    blocks = triton.cdiv(n, bn)
    want = per_sm * _sm_count(x)
    if want == 0:
        return 1, steps
    return _split_shares(steps, 1 if blocks >= want else min(steps, triton.cdiv(want, blocks)), lanes)


Part = tuple[torch.Tensor, int]  # a block matrix: (raw blocks [N, row_bytes], GGML type)


def _check_lanes(what: str, lanes: int, *types: int) -> None:
    """K lanes (more than one) only for Q4_K/Q5_K block matrices."""
    if lanes > 1 and not {int(t) for t in types} <= K_LANE_TYPES:
        raise ValueError(f"{what}: {lanes} K lanes a row for types {', '.join(str(int(t)) for t in types)} "
                         "(Q4_K/Q5_K only)")


def _qdot_into(y: torch.Tensor, xquant: QuantizedX, parts: list[Part], cfg: QdotConfig, asm: bool | None) -> None:
    """y [M, N_A (+ N_B)] (row stride free: columns of a wider output) = x @ [A; B]^T, x given quantized: one block
    matrix, or two (each its own type) in one launch and one partial-sum launch."""
    M, n = y.shape
    K = xquant[0].shape[1] * 4
    if (not 1 <= len(parts) <= 2 or any(r.dim() != 2 or r.stride(1) != 1 for r, _ in parts)
            or sum(r.shape[0] for r, _ in parts) != n or y.stride(1) != 1):
        raise ValueError(f"qdot_matmul: x [{M}, {K}], raw {[tuple(r.shape) for r, _ in parts]}, N {n}")
    (ra, qa), (rb, qb) = parts[0], parts[-1]
    _check_lanes("qdot_matmul", cfg.lanes, qa, qb)
    two = len(parts) == 2
    na, nb = ra.shape[0], rb.shape[0] if two else 0
    split_a, share_a = _split(na, K, cfg.rows, cfg.per_sm, y, cfg.lanes)
    split_b, share_b = _split(nb, K, cfg.rows, cfg.per_sm, y, cfg.lanes) if two else (split_a, share_a)
    splits = max(split_a, split_b)
    blocks_a = triton.cdiv(na, cfg.rows)
    blocks = blocks_a + triton.cdiv(nb, cfg.rows)
    parts = torch.empty(splits, M, n, dtype=torch.float32, device=y.device) if splits > 1 else y
    sum_here = splits > 1 and sums_in_product(blocks)
    _qdot_mv_kernel[(blocks, splits)](
        *xquant, *_views(ra), *_views(rb), y, parts, arrival_counters(y) if sum_here else parts, K, na, nb,
        blocks_a, share_a, share_b, split_a, split_b, ra.stride(0), rb.stride(0), parts.stride(0), y.stride(0),
        M=M, MP=next_pow2(M), BN=cfg.rows, QA=int(qa), QB=int(qb), TWO=two, ASM=_asm() if asm is None else asm,
        OUT_DT=tl_dtype(y.dtype), UNROLL=cfg.unroll, PARTS=splits > 1, SUM_HERE=sum_here, num_warps=cfg.warps,
        KL=cfg.lanes, **pdl_launch(y))
    if splits > 1 and not sum_here:
        block = 1024
        _sum_parts_kernel[(triton.cdiv(M * n, block),)](parts, y, split_a, M * n, n, y.stride(0), na, split_b,
                                                         BLOCK=block, OUT_DT=tl_dtype(y.dtype), num_warps=4,
                                                         **pdl_launch(y))


def _check_x(x: torch.Tensor) -> torch.Tensor:
    M, K = x.shape
    if not 0 < M <= MAX_ROWS or K % 32:
        raise ValueError(f"qdot_matmul: x {tuple(x.shape)} (at most {MAX_ROWS} rows, K a multiple of 32)")
    return x if x.stride(1) == 1 else x.contiguous()


def _stacked(x: torch.Tensor, parts: list[Part], config: tuple | None, asm: bool | None) -> torch.Tensor:
    """The parts' products of one x into the columns of one output, x quantized once; the parts go two by two to
    one launch each (PAIR_PARTS; else one by one)."""
    x = _check_x(x)
    return qdot_quantized_triton(quantize_x_triton(x), parts, x.dtype, config, asm)


def qdot_quantized_triton(xquant: QuantizedX, parts: list[Part], dtype: torch.dtype, config: tuple | None = None,
                          asm: bool | None = None) -> torch.Tensor:
    """_stacked's products for x given quantized (as quantize_x_triton returns it) -> [M, sum N_i] in dtype."""
    cfg = QdotConfig(*config) if config else _default_config(parts)
    y = torch.empty(xquant[0].shape[0], sum(r.shape[0] for r, _ in parts), dtype=dtype, device=xquant[0].device)
    o, step = 0, 2 if PAIR_PARTS else 1
    for i in range(0, len(parts), step):
        group = parts[i:i + step]
        n = sum(r.shape[0] for r, _ in group)
        _qdot_into(y[:, o:o + n], xquant, group, cfg, asm)
        o += n
    return y


def _default_config(parts: list[Part]) -> QdotConfig:
    """The config of a product by its matrices alone (never by x's row count, which row-exact mode varies)."""
    if len(parts) == 1 and parts[0][1] == GGMLQuantizationType.Q6_K and parts[0][0].shape[0] >= HEAD_ROWS:
        return QDOT_CONFIG_Q6K_HEAD
    if all(int(qt) in K_LANE_TYPES for _, qt in parts):
        n = sum(r.shape[0] for r, _ in parts)
        raw, qt = parts[0]  # a Q4_K/Q5_K block is a super-block: a row's bytes over the block's are its super-blocks
        blocks = raw.shape[-1] // GGML_QUANT_SIZES[GGMLQuantizationType(int(qt))][1]
        return K_LANE_CONFIGS[K_LANES or lanes_by_shape(n, blocks)]
    return QDOT_CONFIG


def lanes_by_shape(n: int, blocks: int) -> int:
    """The K lanes of Q4_K/Q5_K products of n rows of `blocks` super-blocks (a stack's rows together): a few rows of
    a long K take 4, many rows of a short K take 2, the rest 1. By the matrices alone, so a row's numbers never
    depend on x's row count (row-exact mode)."""
    if n < FEW_ROWS and blocks >= LONG_K:
        return 4
    return 2 if n >= MANY_ROWS and blocks < LONG_K else 1


def k_lanes_mode(lanes: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, Q4_K/Q5_K products take K_LANE_CONFIGS[lanes], or (0) the lanes of their shape (the runner
    sets it around every step)."""
    if lanes != 0 and lanes not in K_LANE_CONFIGS:
        raise ValueError(f"K lanes must be 0 (by shape) or one of {sorted(K_LANE_CONFIGS)}, got {lanes!r}")
    return module_flag(__name__, "K_LANES", lanes)


def qdot_matmul_triton(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, config: tuple | None = None,
                       asm: bool | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ W^T -> [M, N] in x.dtype with x quantized to int8 per 32
    (qdot.qdot_matmul_torch); W's blocks raw [N, row_bytes], rows contiguous. config: QdotConfig's fields (the
    leading ones; default QDOT_CONFIG); asm: dp4a by PTX (default DP4A_ASM off the interpreter)."""
    if raw.dim() != 2 or raw.shape[0] != n:
        raise ValueError(f"qdot_matmul: raw {tuple(raw.shape)}, N {n}")
    return _stacked(x, [(raw, qtype)], config, asm)


def qdot_stacked_triton(x: torch.Tensor, parts: list[Part],
                        config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ [W_0; W_1; ...]^T -> [M, sum N_i] in x.dtype: the products of several block matrices (each its
    own type) that multiply the same x, with x quantized once and each product written into its columns (no
    concatenation). Each part's columns equal qdot_matmul_triton(x, raw_i, qtype_i, N_i)."""
    return _stacked(x, parts, config, None)


def moe_config(gate_type: int) -> MoeConfig:
    """The routed experts' default config by the gate/up block type (never by the token count)."""
    return QDOT_MOE_CONFIG_Q4K if gate_type == GGMLQuantizationType.Q4_K else QDOT_MOE_CONFIG


def qdot_moe_few_triton(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: tuple[torch.Tensor, int],
                        up: tuple[torch.Tensor, int], down: tuple[torch.Tensor, int],
                        config: tuple | None = None, asm: bool | None = None,
                        hquant: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Weighted slot outputs [T, k, D] in h.dtype through int8 activations (qdot.qdot_moe_few_torch); gate/up/down
    as (raw [E, rows, row_bytes], qtype). config: MoeConfig's fields (the leading ones; default moe_config(gate's
    type)).
    Four launches: quantize h, gate/up, quantize the f32 act (with config.splits > 1: add gate's and up's partial
    sums, silu and quantize), down; three with hquant, h quantized already (as quantize_x_triton returns it)."""
    (gr, gq), (ur, uq), (dr, dq) = gate, up, down
    T_, D = h.shape
    k = top_i.shape[1]
    F = gr.shape[1]
    cfg = MoeConfig(*config) if config else moe_config(gate[1])
    _check_lanes("qdot_moe_few", cfg.lanes, gq, uq)
    kw = {"ASM": _asm() if asm is None else asm, "UNROLL": cfg.unroll, "num_warps": cfg.warps}
    top_i, top_w = top_i.contiguous(), top_w.contiguous()
    if hquant is None:
        hquant = quantize_x_triton(h if h.stride(1) == 1 else h.contiguous())
    elif hquant[0].shape != (T_, D // 4):
        raise ValueError(f"qdot_moe_few: h {tuple(h.shape)}, quantized h words {tuple(hquant[0].shape)}")
    splits, share = _split_shares(triton.cdiv(D, 256), cfg.splits, cfg.lanes)
    act = torch.empty(splits, T_ * k, 2, F, dtype=torch.float32, device=h.device) if splits > 1 else \
        torch.empty(T_ * k, F, dtype=torch.float32, device=h.device)
    y = torch.empty(T_, k, D, dtype=h.dtype, device=h.device)
    _qdot_gate_up_kernel[(triton.cdiv(F, cfg.rows), T_ * k, splits)](
        *hquant, top_i, *_views(gr), *_views(ur), act, D, F, k, top_i.stride(0), gr.stride(0), gr.stride(1),
        ur.stride(0), ur.stride(1), share, BN=cfg.rows, QG=int(gq), QU=int(uq), SPLIT=splits > 1, KL=cfg.lanes, **kw,
        **pdl_launch(h))
    down_rows = cfg.down_rows or cfg.rows
    kw["UNROLL"] = cfg.down_unroll or cfg.unroll
    _qdot_down_kernel[(triton.cdiv(D, down_rows), T_ * k)](
        *(_act_quantize(act) if splits > 1 else quantize_x_triton(act)), top_i, top_w, *_views(dr), y, D, F, k,
        top_i.stride(0), top_w.stride(0), dr.stride(0), dr.stride(1), BN=down_rows, QD=int(dq),
        OUT_DT=tl_dtype(h.dtype), **kw, **pdl_launch(h))
    return y


def _split_shares(steps: int, splits: int, multiple: int = 1) -> tuple[int, int]:
    """(shares, steps per share) of `steps` 256-weight steps in about `splits` shares, none empty, each a multiple of
    `multiple` steps (but the last)."""
    share = triton.cdiv(triton.cdiv(steps, max(1, splits)), multiple) * multiple
    return triton.cdiv(steps, share), share


def _act_quantize(partial: torch.Tensor) -> QuantizedX:
    """silu(gate) * up from the shares' partial sums [S, pairs, 2, F], quantized as quantize_x_triton quantizes."""
    S, pairs, _, F = partial.shape
    q, d, s, g = quantized_x_buffers(pairs, F, partial.device)
    bb = quant_chunk(F)
    _act_quant_kernel[(pairs, triton.cdiv(F // 32, bb))](partial, q, d, s, g, F, S, BB=bb, num_warps=4,
                                                         enable_fp_fusion=False, **pdl_launch(partial))
    return q.view(torch.int32), d, s, g
