"""GGUF blocks expanded to 16-bit (or f32) weights for the many-row products; reference: weights/dequant.dequantize
rounded once to the output dtype (kernels/qmatmul.py's `_expand` falls back to exactly that).

Every type is cut into runs of 32 consecutive weights that share their scale (and min): a Q*_0/Q*_1 block, a
K-quant sub-block (Q6_K's two 16-weight scales ride along as the run's two halves). A program expands BR rows times
one 256-weight step (8 runs) in two stages:

1. codes [8 // P, BR, 8 runs, P] of 32-bit words, word w = P * axis0 + axis3 of a run holding in byte i the
   unsigned code of element 4w + i; built with word-wide masks and shifts from the quantized bytes read as 32-bit
   words (Q4_K, Q5_K: their 144/176-byte blocks keep the qs 4-byte aligned; offsets computed in words so the
   compiler sees aligned pairs and issues 8-byte loads) or as pairs of 16-bit loads (every other block size is
   only even); Q5_0/Q5_1's 5th bits are spread into four bytes at once by one multiply (triton_qdot._spread5),
   Q5_K's and Q6_K's high bits by a mask and a shift per word.
2. per weight: its byte, the exponent trick (code | 0x4B000000 read as f32 is 2^23 + code, so subtracting
   2^23 + offset gives code - offset exactly: one FADD for dequant.py's int-to-float and subtraction), then the
   reference's f32 operations in its order (d * f; K-quants (d * sc) * f - dmin * m; Q*_1 d * f + m). Launched
   without FMA contraction, so the f32 value is the reference's on the GPU too; it is rounded once.

Layout: the stored tile is [8 // P, BR, 8, 4P] (P = 2 for 16-bit outputs, 1 for f32), its last axis 16 contiguous
bytes of a run. The compiler gives each thread 16 bytes of the last axis and spreads threads over (runs, rows)
first, so the leading axis stays inside the thread: a thread owns whole runs (the scale math once per 32 weights,
four 16-byte stores) and the codes' layout is the slice of the store's, with no exchange between threads for Q4_K
(sm_90 SASS, 16 rows x 4 warps: 9.7 instructions per weight, no shared memory; the 16-bit-loaded types move their
code words once through shared memory, 9.6-13 per weight).
Offsets inside a row are int32; each row's base is int64 once (stacked experts pass 2^31 bytes).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, pdl_launch
from qspec.weights.qweight import PLANES, PLANES_QTYPES

# Bytes of one block (32 weights, or a K-quant super-block of 256) by the kernels' type number (PLANES + the type:
# rows in planes, qweight.py).
_EXPANDED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
BLOCK_BYTES = ({int(t): GGML_QUANT_SIZES[t][1] for t in _EXPANDED}
               | {PLANES + int(t): GGML_QUANT_SIZES[t][1] for t in PLANES_QTYPES})
EXPAND_CONFIG = (16, 4)  # (rows per program, warps): 4096 weights a program, 32 per thread

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import (
        QT_Q4_0,
        QT_Q4_0_PLANES,
        QT_Q4_1,
        QT_Q4_K,
        QT_Q5_0,
        QT_Q5_0_PLANES,
        QT_Q5_1,
        QT_Q5_K,
        QT_Q6_K,
        QT_Q6_K_PLANES,
        QT_Q8_0,
        QT_Q8_0_PLANES,
        b32_parts,
        pdl_start,
        q6_parts,
        round_to,
    )
    from qspec.kernels.triton_qdot import _i8, _spread5

    @triton.jit
    def _word(rh, rw, boff, mask, WORDS: tl.constexpr):
        """The 32-bit word at byte offset boff (a multiple of 4 when WORDS, else of 2) of each row: row pointers rh
        (16-bit view) and rw (32-bit view, used when WORDS), offsets int32 (the row bases carry the int64 part)."""
        if WORDS:
            w = tl.load(rw + boff // 4, mask=mask, other=0)
        else:
            lo = tl.load(rh + boff // 2, mask=mask, other=0).to(tl.int32)
            hi = tl.load(rh + boff // 2 + 1, mask=mask, other=0).to(tl.int32)
            w = (lo & 0xFFFF) | (hi << 16)
        return w

    @triton.jit
    def _word4(rh, rw, woff, mask, WORDS: tl.constexpr):
        """The 32-bit word woff (in 4-byte units) of each row (see _word)."""
        if WORDS:
            w = tl.load(rw + woff, mask=mask, other=0)
        else:
            lo = tl.load(rh + 2 * woff, mask=mask, other=0).to(tl.int32)
            hi = tl.load(rh + 2 * woff + 1, mask=mask, other=0).to(tl.int32)
            w = (lo & 0xFFFF) | (hi << 16)
        return w

    @triton.jit
    def _f16(rh, boff, mask):
        """The f16 at even byte offset boff of each row, as f32."""
        return tl.load(rh + boff // 2, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k_runs(rh, rw, rm, kb, QT: tl.constexpr, WORDS: tl.constexpr, P: tl.constexpr):
        """Q4_K / Q5_K super-block kb of the rows at rh / rw (16- and 32-bit views, [BR]) -> (codes
        [8 // P, BR, 8, P], d * sc [1, BR, 8, 1], dmin * m [1, BR, 8, 1]). Run j's element l is nibble j % 2 of qs byte
        (j // 2) * 32 + l; for Q5_K bit j of qh byte l is its 5th bit."""
        sb: tl.constexpr = 144 if QT == QT_Q4_K else 176
        j = tl.arange(0, 8)[None, None, :, None]
        w = P * tl.arange(0, 8 // P)[:, None, None, None] + tl.arange(0, P)[None, None, None, :]
        m4 = rm[None, :, None, None]
        h4 = rh[None, :, None, None]
        w4 = rw[None, :, None, None]
        base = kb * sb
        wo = kb * (sb // 4) + (j // 2) * 8 + w  # in words: lets the compiler see 8-byte aligned pairs
        q = (_word4(h4, w4, wo + (4 if QT == QT_Q4_K else 12), m4, WORDS) >> (4 * (j % 2))) & 0x0F0F0F0F
        if QT == QT_Q5_K:
            qh = _word4(h4, w4, kb * (sb // 4) + 4 + w, m4, WORDS)
            q = q | (((qh >> j) & 0x01010101) << 4)
        # the 6-bit scales and mins (dequant._k_scale_min) of bytes 4..15: three words per row
        sh = 8 * (tl.arange(0, 8)[None, :] % 4)
        a = (_word(rh, rw, base + 4, rm, WORDS)[:, None] >> sh) & 255
        b = (_word(rh, rw, base + 8, rm, WORDS)[:, None] >> sh) & 255
        e = (_word(rh, rw, base + 12, rm, WORDS)[:, None] >> sh) & 255
        first = tl.arange(0, 8)[None, :] < 4
        sc = tl.where(first, a & 63, (e & 15) | ((a >> 2) & 0x30)).to(tl.float32)
        mn = tl.where(first, b & 63, (e >> 4) | ((b >> 2) & 0x30)).to(tl.float32)
        d = _f16(rh, base, rm)[:, None]
        dmin = _f16(rh, base + 2, rm)[:, None]
        return q, (d * sc)[None, :, :, None], (dmin * mn)[None, :, :, None]

    @triton.jit
    def _q6_runs(rb, rh, rm, kb, K, QT: tl.constexpr, P: tl.constexpr):
        """Q6_K super-block kb (QT 14 or, rows in planes, 114) of the rows at rb / rh (8- and 16-bit views, [BR]) ->
        (codes [8 // P, BR, 8, P],
        d * sc [8 // P, BR, 8, 1] (the scale of each word's half)). Run j = 4h + 2n + t (half h of the block,
        nibble n, 32-byte part t): element l is nibble n of ql byte 64h + 32t + l, its two high bits bits 2(j % 4)
        of qh byte 128 + 32h + l; each half of a run has its int8 scale (byte 192 + 2j + half)."""
        j = tl.arange(0, 8)[None, None, :, None]
        w = P * tl.arange(0, 8 // P)[:, None, None, None] + tl.arange(0, P)[None, None, None, :]
        s = w // 4
        v = w % 4
        m4 = rm[None, :, None, None]
        h4 = rh[None, :, None, None]
        ql_at, qh_at, sc_at, d_at = q6_parts(kb, K, QT)
        h = j // 4
        u = j % 4
        ql = _word(h4, h4, ql_at + 64 * h + 32 * (u % 2) + 16 * s + 4 * v, m4, False)
        qh = _word(h4, h4, qh_at + 32 * h + 16 * s + 4 * v, m4, False)
        q = ((ql >> (4 * (u // 2))) & 0x0F0F0F0F) | (((qh >> (2 * u)) & 0x03030303) << 4)
        j3 = tl.arange(0, 8)[None, :, None]
        s3 = tl.arange(0, 2)[None, None, :]
        m3 = rm[:, None, None]
        sc = _i8(tl.load(rb[:, None, None] + sc_at + 2 * j3 + s3, mask=m3, other=0).to(tl.int32))
        d = _f16(rh, d_at, rm)[:, None, None]
        ds = d * sc.to(tl.float32)
        lo, hi = tl.split(ds)
        return q, tl.where(s == 0, lo[None, :, :, None], hi[None, :, :, None])

    @triton.jit
    def _b32_runs(rh, rm, kb, K, QT: tl.constexpr, P: tl.constexpr):
        """Blocks kb * 8 .. + 7 (32 weights each) of the rows at rh (16-bit view, [BR]) -> (codes
        [8 // P, BR, 8, P], d [1, BR, 8, 1], m (Q4_1, Q5_1; else d again)). Element l = 16s + 4v + i (word
        w = 4s + v): nibble s of qs byte 4v + i (Q8_0: byte l); the 5th bit (Q5_*) is bit l of the little-endian
        qh word."""
        j = tl.arange(0, 8)[None, None, :, None]
        w = P * tl.arange(0, 8 // P)[:, None, None, None] + tl.arange(0, P)[None, None, None, :]
        s = w // 4
        v = w % 4
        jm = kb * 8 + j < K // 32
        m4 = rm[None, :, None, None] & jm
        h4 = rh[None, :, None, None]
        if QT == QT_Q4_1 or QT == QT_Q5_1:  # Q4_1 (20 bytes) / Q5_1 (24): d, m, Q5_1's qh, qs
            d_at = (kb * 8 + j) * (20 if QT == QT_Q4_1 else 24)
            qh_at = d_at + 4
            qs_at = d_at + (4 if QT == QT_Q4_1 else 8)
        else:  # Q4_0 / Q5_0 / Q8_0, in the file's order or in planes
            d_at, qh_at, qs_at = b32_parts(kb * 8 + j, K, QT)
        if QT == QT_Q8_0 or QT == QT_Q8_0_PLANES:
            q = _word(h4, h4, qs_at + 16 * s + 4 * v, m4, False) ^ -2139062144  # ^ 0x80808080: int8 + 128
        else:
            q = (_word(h4, h4, qs_at + 4 * v, m4, False) >> (4 * s)) & 0x0F0F0F0F
            if QT == QT_Q5_0 or QT == QT_Q5_1 or QT == QT_Q5_0_PLANES:
                qh = _word(h4, h4, qh_at, m4, False)
                q = q | _spread5(qh >> (16 * s + 4 * v))
        d = _f16(h4, d_at, m4)
        mn = _f16(h4, d_at + 2, m4) if (QT == QT_Q4_1 or QT == QT_Q5_1) else d
        return q, d, mn

    @triton.jit
    def _weights(q, OFF: tl.constexpr):
        """codes [8 // P, BR, 8, P] -> code - OFF as f32 [8 // P, BR, 8, P, 4], byte i of each word last."""
        i = tl.arange(0, 4)[None, None, None, None, :]
        qb = ((q[:, :, :, :, None] >> (8 * i)) & 255) | 0x4B000000
        return qb.to(tl.float32, bitcast=True) - (8388608.0 + OFF)

    @triton.jit
    def _expand_kernel(wb_ptr, wh_ptr, ww_ptr, y_ptr, N, K, w_n, y_n, BR: tl.constexpr, QT: tl.constexpr,
                       WORDS: tl.constexpr, RNE_INT: tl.constexpr, PDL: tl.constexpr = False):
        """y[n, kb*256 ..] for BR rows n and one 256-weight step kb (program (row block, kb)). RNE_INT: round to
        bf16 with integer operations (the interpreter's cast truncates)."""
        pdl_start(PDL)
        n = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = n < N
        kb = tl.program_id(1)
        DT: tl.constexpr = y_ptr.dtype.element_ty
        P: tl.constexpr = 2 if DT.primitive_bitwidth == 16 else 1  # words per 16-byte store
        rowb = n.to(tl.int64) * w_n  # the row's first byte: int64 once per row, int32 offsets after
        rh = wh_ptr + rowb // 2
        if QT == QT_Q4_K or QT == QT_Q5_K:
            q, a, b = _k_runs(rh, ww_ptr + rowb // 4, rm, kb, QT, WORDS, P)
            w = a[:, :, :, :, None] * _weights(q, 0) - b[:, :, :, :, None]
        elif QT == QT_Q6_K or QT == QT_Q6_K_PLANES:
            q, a = _q6_runs(wb_ptr + rowb, rh, rm, kb, K, QT, P)
            w = a[:, :, :, :, None] * _weights(q, 32)
        else:
            q, d, mn = _b32_runs(rh, rm, kb, K, QT, P)
            if QT == QT_Q4_1 or QT == QT_Q5_1:
                w = d[:, :, :, :, None] * _weights(q, 0) + mn[:, :, :, :, None]
            else:  # the stored integer minus 8 (Q4_0), 16 (Q5_0) or 128 (Q8_0's bytes read unsigned)
                q4: tl.constexpr = QT == QT_Q4_0 or QT == QT_Q4_0_PLANES
                q5: tl.constexpr = QT == QT_Q5_0 or QT == QT_Q5_0_PLANES
                w = d[:, :, :, :, None] * _weights(q, 8 if q4 else (16 if q5 else 128))
        if RNE_INT and DT == tl.bfloat16:
            w = round_to(w, DT)
        w = tl.reshape(w.to(DT), [8 // P, BR, 8, 4 * P])
        col = (kb * 256 + tl.arange(0, 8)[None, None, :, None] * 32 + tl.arange(0, 8 // P)[:, None, None, None] * 4 * P
               + tl.arange(0, 4 * P)[None, None, None, :])
        out = (y_ptr + n.to(tl.int64) * y_n)[None, :, None, None] + col
        tl.store(out, w, mask=rm[None, :, None, None] & (col < K))


def expand_triton(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype,
                  config: tuple[int, int] | None = None) -> torch.Tensor:
    """raw [N, row_bytes] blocks (rows contiguous) -> [N, k] weights in dtype: dequantize's f32 rounded once.
    config: (rows per program, warps)."""
    n, row_bytes = raw.shape
    qt = int(qtype)
    if qt not in BLOCK_BYTES or raw.stride(1) != 1 or raw.dtype != torch.uint8:
        raise ValueError(f"expand: qtype {qt}, raw {tuple(raw.shape)} {raw.dtype} stride {raw.stride()}")
    y = torch.empty(n, k, dtype=dtype, device=raw.device)
    if n == 0:
        return y
    wh = raw.view(torch.int16)
    # 32-bit loads where every word the kernel reads is 4-byte aligned (rows of whole words, aligned start)
    words = qt in (T.Q4_K, T.Q5_K) and raw.storage_offset() % 4 == 0 and raw.stride(0) % 4 == 0 and row_bytes % 4 == 0
    ww = raw.view(torch.int32) if words else wh
    br, warps = config or EXPAND_CONFIG
    _expand_kernel[(triton.cdiv(n, br), triton.cdiv(k, 256))](
        raw, wh, ww, y, n, k, raw.stride(0), y.stride(0), BR=br, QT=qt, WORDS=words,
        RNE_INT=INTERPRET and dtype == torch.bfloat16, num_warps=warps, enable_fp_fusion=False,
        **pdl_launch(raw))
    return y

