"""The hyper-connection mixer of a step of 1..8 rows as three launches (reference: kernels/hc_mix.py).

Compiled, a mixer step is ~7 kernels (the combine, the norm's reduction and apply, the `w_in` product, the silu,
the `up` product, the gated stream sum), each short, plus a CUDA-graph node apiece: 17 mixers make
~120 launches of an 8-layer decode step. Here:

`_hc_prep_kernel`, one program per (row, stream): adds the pending block output into the stream
(X_s += 2 sigmoid(l_s / S) y) and writes the normed stream rounded to the weights' dtype (the product's input);
the `w_in` product of the normed rows (`ops.linear`: the tuned mat-vec for one row, cuBLAS for several);
`_hc_out_kernel`, one program per BD features: the gate logits of those features in every stream and row
(`up` [S*D, R] against silu(y[:R] / S)), sigmoid, and the gated mean of the normed streams. Its tile is the `up`
rows of all S streams at once, walked along R in BK steps as the mat-vec walks K (triton_gemv.py).

A first version did the combine and norm inside the product's kernel (every program recomputing the row's
norm) and the rows' products in one kernel: on the H200 it was slower than the compiled functions, both in the
decode step and in the verify step, likely its recomputation and [rows x K] tiles. The second version's output
kernel looped over the streams with the whole rank in one padded tile, far slower than the plain `up`
mat-vec; this one walks the rank in steps and comes close to that mat-vec (`python -m qspec.bench.kernels
--hc-out-sweep`; BENCHMARKS.md §5, the hyper-connection mixer output kernel row), and made the decode step faster
than the compiled mixers in one process (what the kernels buy MTP5 end to end: §4, the verify/extend mixers row).

With the mixer's matrices held as GGUF blocks (llama-quantize quantizes them; weights/quant_mix.py), `w_in` is a
block product (qmatmul.py) and, for one row, the output kernel decodes the `up` rows in registers: 32-weight blocks
in planes (Q4_K_M's Q5_0 up, Q8_0's, Q4_0's: CUDA's layout) as whole 32-bit words of a row's every block at once
(in two power-of-two tiles, `plane_tiles`), other types by triton_qmatmul's `expand_step` (byte loads, 256-weight
steps), then gates and averages as the 16-bit kernel does. Compiled for sm_90 (Triton 3.6; `scripts/kernel_layouts.py
--mixer`, benchmarks/results/kernel_layouts_mixer_cpu-*.txt) the words cost 18.8-23.2 thread instructions an `up`
weight at the real geometry, `expand_step` 56-75 and the 16-bit kernel 19.85; at six rows `expand_step` took 255
registers and spilled, so several rows with a block `up` run the compiled mixer (hc_mix.step_eligible). On an H100
the whole one-row block mixer was slower than the 16-bit one (BENCHMARKS.md §5c).

Intermediates that the compiled path stores in 16 bits are rounded where it stores them (the product
inputs and outputs); the rest stays in f32, as inductor keeps it.
"""

import torch

from qspec.kernels.qmatmul import int8_product
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype
from qspec.kernels.triton_qdot import qdot_quantized_triton, quantized_x_buffers
from qspec.kernels.triton_qmatmul import qmatmul_geometry
from qspec.model.ops import Weight, linear
from qspec.weights.qweight import QuantWeight

MAX_ROWS = 8
MAX_STREAM = 16384  # one prep program holds a whole stream
# (features per program, rank elements per K step, warps) of the output kernel, for one row and for several: the
# fastest of 24 configs on the H200 at the real geometry (at six rows clearly ahead of (8, 64, 4);
# benchmarks/results/gpu_kernels_h200_s7.txt, BENCHMARKS.md §5)
OUT_CONFIG = (8, 128, 8)
OUT_CONFIG_ROWS = (16, 128, 4)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import (
        QT_PLANES,
        QT_Q5_0_PLANES,
        QT_Q6_K_PLANES,
        QT_Q8_0_PLANES,
        b32_parts,
        dot_acc,
        pdl_start,
        round_to,
    )
    from qspec.kernels.triton_qdot import quantized_store
    from qspec.kernels.triton_qmatmul import expand_step

    @triton.jit
    def _silu_act(y_ptr, e, emask, S: tl.constexpr, DT: tl.constexpr):
        """silu(y[e] / S) rounded to DT as the 16-bit kernel rounds the up product's input (zero where not emask)."""
        a = tl.load(y_ptr + e, mask=emask, other=0.0).to(tl.float32) / S
        return round_to(a * tl.sigmoid(a), DT)

    @triton.jit
    def _up_logits_blocks(y_ptr, wb_ptr, wh_ptr, rowb, fmask, R, S: tl.constexpr, BN: tl.constexpr,
                          QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr, DT: tl.constexpr):
        """[1, BN] f32 gate logits of one row for the BN `up` rows held as blocks of type QT at byte offsets rowb:
        each 256-weight step expanded to f32 [BN, G, L] in registers (the type's groups, triton_qmatmul.expand_step),
        times silu(y[:R] / S) as the 16-bit kernel rounds it, the products summed once at the end."""
        prod = tl.zeros([BN, G, L], dtype=tl.float32)
        for kb in range(0, tl.cdiv(R, 256)):
            w, koff, kmask = expand_step(wb_ptr, wh_ptr, rowb, fmask, kb, R, QT, G, L)
            prod += w * _silu_act(y_ptr, koff, kmask, S, DT)[None, :, :]
        return tl.sum(tl.sum(prod, axis=2), axis=1)[None, :]

    @triton.jit
    def _small_f32(q):
        """f32 of integers 0 <= q < 2^23 by their bits (an OR and a subtraction, not the slow I2F conversion)."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _up_logits_planes(y_ptr, ww_ptr, wh_ptr, rowb, fmask, R, S: tl.constexpr, BN: tl.constexpr,
                          NBP: tl.constexpr, QT: tl.constexpr, W: tl.constexpr, DT: tl.constexpr,
                          B0: tl.constexpr = 0):
        """[1, BN] f32 gate logits of one row for `up` rows of a 32-weight type in planes (QT 108 / 106 / 102) at
        byte offsets rowb: all NBP >= R / 32 blocks of a row at once, their quants loaded as 32-bit words and
        decoded in registers (Q4_0 / Q5_0: byte b of word j holds elements 4j + b and 16 + 4j + b in its nibbles;
        Q8_0: word j holds elements 4j ..; W words a block), each block d * (sum q a - offset * sum a)."""
        blk = B0 + tl.arange(0, NBP)
        bmask = blk < R // 32
        d_at, qh_at, qs_at = b32_parts(blk, R, QT)
        j = tl.arange(0, W)[None, :, None]
        b = tl.arange(0, 4)[None, None, :]
        e = blk[:, None, None] * 32 + 4 * j + b  # [NBP, W, 4]: the elements of the words' bytes (low nibbles)
        at = (rowb // 4)[:, None, None] + (qs_at // 4)[None, :, None] + tl.arange(0, W)[None, None, :]
        words = tl.load(ww_ptr + at, mask=fmask[:, None, None] & bmask[None, :, None], other=0)[:, :, :, None]
        d = tl.load(wh_ptr + (rowb // 2)[:, None] + (d_at // 2)[None, :], mask=fmask[:, None] & bmask[None, :],
                    other=0.0).to(tl.float32)
        emask = bmask[:, None, None] & (e < R)
        a_lo = _silu_act(y_ptr, e, emask, S, DT)
        if QT == QT_Q8_0_PLANES:
            q = _small_f32(((words >> (8 * b[None])) & 255) ^ 128) - 128.0  # the signed byte, offset by 128
            t = d * tl.sum(tl.sum(q * a_lo[None], axis=3), axis=2)
        else:
            a_hi = _silu_act(y_ptr, e + 16, emask, S, DT)
            lo = (words >> (8 * b[None])) & 15
            hi = (words >> (8 * b[None] + 4)) & 15
            if QT == QT_Q5_0_PLANES:  # bit i of the block's qh word is element i's 5th bit
                qh = tl.load(ww_ptr + (rowb // 4)[:, None] + (qh_at // 4)[None, :],
                             mask=fmask[:, None] & bmask[None, :], other=0)[:, :, None, None]
                lo = lo | (((qh >> (4 * j + b)[None]) & 1) << 4)
                hi = hi | (((qh >> (16 + 4 * j + b)[None]) & 1) << 4)
            dot = tl.sum(tl.sum(_small_f32(lo) * a_lo[None] + _small_f32(hi) * a_hi[None], axis=3), axis=2)
            asum = tl.sum(tl.sum(a_lo + a_hi, axis=2), axis=1)  # [NBP]
            t = d * (dot - (16.0 if QT == QT_Q5_0_PLANES else 8.0) * asum[None, :])
        return tl.sum(t, axis=1)[None, :]

    @triton.jit
    def _hc_prep_kernel(x_ptr, yp_ptr, ip_ptr, norm_ptr, xo_ptr, xn_ptr, q_ptr, d_ptr, s_ptr, g_ptr, D, eps, yp_m,
                        ip_m, S: tl.constexpr, HAS_PENDING: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr,
                        QUANT: tl.constexpr = False, PDL: tl.constexpr = False):
        # QUANT: the normed stream also rounded to int8 per 32 for the w_in block product, as triton_qdot's
        # activation quantizer does (D a multiple of 32; launched without FMA fusion, as that one is)
        pdl_start(PDL)
        m = tl.program_id(0)
        s = tl.program_id(1)
        d = tl.arange(0, BD)
        dmask = d < D
        f = m * S * D + s * D + d
        x = tl.load(x_ptr + f, mask=dmask, other=0.0).to(tl.float32)
        if HAS_PENDING:
            inj = 2.0 * tl.sigmoid(tl.load(ip_ptr + m * ip_m + s).to(tl.float32) / S)
            y = tl.load(yp_ptr + m * yp_m + d, mask=dmask, other=0.0).to(tl.float32)
            x = round_to(x + y * inj, DT)
            tl.store(xo_ptr + f, x.to(xo_ptr.dtype.element_ty), mask=dmask)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        g = tl.load(norm_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        xn = round_to(x * r * g, DT)
        tl.store(xn_ptr + f, xn.to(xn_ptr.dtype.element_ty), mask=dmask)
        if QUANT:
            nb: tl.constexpr = BD // 32
            j = tl.arange(0, nb)
            quantized_store(tl.reshape(tl.where(dmask, xn, 0.0), [nb, 32]), q_ptr, d_ptr, s_ptr, g_ptr, m,
                            s * (D // 32) + j, j < D // 32, S * (D // 32), nb)

    @triton.jit
    def _hc_out_kernel(y_ptr, xn_ptr, up_ptr, uh_ptr, uw_ptr, h_ptr, N, D, R, u_n,
                       M: tl.constexpr, MP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                       BK: tl.constexpr, DT: tl.constexpr, TC: tl.constexpr, UPCAST: tl.constexpr,
                       QT: tl.constexpr = 0, G: tl.constexpr = 8, L: tl.constexpr = 32, NBP: tl.constexpr = 1,
                       NBP2: tl.constexpr = 0,
                       PDL: tl.constexpr = False):
        # tile rows are the `up` rows of BD features in every stream, stream-major: row i = (stream i // BD,
        # feature d0 + i % BD); all streams' tiles load in one wave, and K (the rank) is walked in BK steps as the
        # mat-vec does (triton_gemv.py). QT > 0 (one row): `up` rows of u_n bytes of blocks (up_ptr the bytes, uh_ptr
        # and uw_ptr their f16 and, in planes, int32 views): 32-weight types in planes decoded from words, a row at
        # once; other types walked in 256-weight steps (expand_step).
        pdl_start(PDL)
        i = tl.arange(0, SP * BD)
        s = i // BD
        d = tl.program_id(0) * BD + i % BD
        fmask = (s < S) & (d < D)
        f = s * D + d
        urow = up_ptr + f.to(tl.int64)[:, None] * R
        kk = tl.arange(0, BK)
        mi = tl.arange(0, MP)
        if QT > QT_PLANES and QT != QT_Q6_K_PLANES:  # one row (hc_out_triton) of 32-weight blocks in planes
            logits = _up_logits_planes(y_ptr, uw_ptr, uh_ptr, f.to(tl.int64) * u_n, fmask, R, S, SP * BD, NBP, QT,
                                       8 if QT == QT_Q8_0_PLANES else 4, DT)
            if NBP2 > 0:  # the blocks past the first NBP (a power of two), in a tile of their own
                logits += _up_logits_planes(y_ptr, uw_ptr, uh_ptr, f.to(tl.int64) * u_n, fmask, R, S, SP * BD, NBP2,
                                            QT, 8 if QT == QT_Q8_0_PLANES else 4, DT, NBP)
        elif QT > 0:  # one row of other blocks
            logits = _up_logits_blocks(y_ptr, up_ptr, uh_ptr, f.to(tl.int64) * u_n, fmask, R, S, SP * BD, QT, G, L,
                                       DT)
        elif M == 1:
            prod = tl.zeros([SP * BD, BK], dtype=tl.float32)
            for k0 in range(0, R, BK):
                k = k0 + kk
                kmask = k < R
                u = tl.load(urow + k[None, :], mask=fmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                a = tl.load(y_ptr + k, mask=kmask, other=0.0).to(tl.float32) / S
                a = round_to(a * tl.sigmoid(a), DT)  # silu(y / S), the up product's input
                prod += u * a[None, :]
            logits = tl.sum(prod, axis=1)[None, :]  # [1, SP*BD]
        elif TC:  # several 16-bit rows: one tensor-core product per K step, the rows as MP = 16 columns
            acc = tl.zeros([SP * BD, MP], dtype=tl.float32)
            for k0 in range(0, R, BK):
                k = k0 + kk
                kmask = k < R
                u = tl.load(urow + k[None, :], mask=fmask[:, None] & kmask[None, :], other=0.0)
                a = tl.load(y_ptr + mi[None, :] * N + k[:, None], mask=(mi[None, :] < M) & kmask[:, None],
                            other=0.0).to(tl.float32) / S  # [BK, MP]
                a = round_to(a * tl.sigmoid(a), DT).to(u.dtype)
                acc = dot_acc(u, a, acc, UPCAST)
            logits = tl.trans(acc)  # [MP, SP*BD]
        else:
            logits = tl.zeros([MP, SP * BD], dtype=tl.float32)
            for k0 in range(0, R, BK):
                k = k0 + kk
                kmask = k < R
                u = tl.load(urow + k[None, :], mask=fmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                for m in tl.static_range(M):
                    a = tl.load(y_ptr + m * N + k, mask=kmask, other=0.0).to(tl.float32) / S
                    a = round_to(a * tl.sigmoid(a), DT)
                    p = tl.sum(u * a[None, :], axis=1)
                    logits = tl.where(mi[:, None] == m, logits + p[None, :], logits)
        gate = tl.sigmoid(round_to(logits, DT))  # the up product's output is stored in 16 bits when compiled
        rmask = (mi[:, None] < M) & fmask[None, :]
        xn = tl.load(xn_ptr + mi[:, None] * S * D + f[None, :], mask=rmask, other=0.0).to(tl.float32)
        h = tl.sum(tl.reshape(gate * xn, [MP, SP, BD]), axis=1) / S  # the gated mean over the streams
        dd = tl.program_id(0) * BD + tl.arange(0, BD)
        out = h_ptr + mi[:, None] * D + dd[None, :]
        tl.store(out, round_to(h, DT).to(h_ptr.dtype.element_ty), mask=(mi[:, None] < M) & (dd < D)[None, :])


def hc_mix_step_triton(X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                       w_in: Weight, up: torch.Tensor | QuantWeight, rank: int, hidden: int, count: int, eps: float,
                       out_config: tuple[int, int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M <= MAX_ROWS rows: X [M, S*D] contiguous, pending (y [M, D], injection logits [M, S], each with contiguous
    rows) or None -> (combined X, h [M, D], w_in's outputs [M, N]: the columns past `rank` are the injection logits).
    w_in and up: 16-bit tensors of X's dtype or GGUF blocks."""
    S, D = count, hidden
    M = X.shape[0]
    if (not 0 < M <= MAX_ROWS or X.shape[1] != S * D or not X.is_contiguous() or w_in.shape[1] != S * D
            or D > MAX_STREAM):
        raise ValueError(f"hc mixer: X {tuple(X.shape)} (contiguous: {X.is_contiguous()}), w_in {tuple(w_in.shape)}, "
                         f"{S} streams of {D} (at most {MAX_STREAM}), at most {MAX_ROWS} rows")
    quant = isinstance(w_in, QuantWeight) and D % 32 == 0 and int8_product(X, w_in.code, w_in.shape[0])
    Xo, Xn, xquant = hc_prep_triton(X, pending, norm, D, S, eps, quant)
    if xquant is not None:  # the w_in product reads the row quantized by the prep kernel (one launch fewer)
        y = qdot_quantized_triton(xquant, [(w_in.raw.contiguous(), w_in.code)], X.dtype)
    else:
        y = linear(Xn, w_in)
    return Xo, hc_out_triton(y, Xn, up, rank, D, S, out_config), y


def hc_prep_triton(X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                   hidden: int, count: int, eps: float, quant: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The prep kernel alone -> (combined X, the normed streams Xn in X's dtype, Xn quantized as
    triton_qdot.quantize_x_triton returns it where `quant` (hidden a multiple of 32), else None)."""
    M, S, D = X.shape[0], count, hidden
    Xo = torch.empty_like(X) if pending is not None else X
    Xn = torch.empty_like(X)
    yp, ip = pending if pending is not None else (X, X)
    bd = next_pow2(D)
    xq = quantized_x_buffers(M, S * D, X.device) if quant else (X, X, X, X)
    # 256 features a warp (8 a thread, one 16-byte load of 16-bit X): at the real width 16 warps, where 4 left each
    # thread 32 features of every row it loads (BENCHMARKS.md §5c, the prep kernel)
    _hc_prep_kernel[(M, S)](X, yp, ip, norm, Xo, Xn, *xq, D, eps, yp.stride(0), ip.stride(0), S=S,
                            HAS_PENDING=pending is not None, BD=bd, DT=tl_dtype(X.dtype), QUANT=quant,
                            num_warps=min(16, max(4, bd // 256)), **({"enable_fp_fusion": False} if quant else {}),
                            **pdl_launch(X))
    return Xo, Xn, (xq[0].view(torch.int32), *xq[1:]) if quant else None


def hc_out_triton(y: torch.Tensor, Xn: torch.Tensor, up: torch.Tensor | QuantWeight, rank: int, hidden: int,
                  count: int, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The output kernel alone: y [M, N] (w_in's outputs, the first `rank` columns feed the gate), Xn [M, S*D]
    the normed streams, up [S*D, rank] (16 bits or blocks) -> h [M, D]. config: (features per program, K step,
    warps; blocks take 256-weight steps)."""
    M, D, S = Xn.shape[0], hidden, count
    blocks = isinstance(up, QuantWeight)
    if blocks and M > 1:
        raise ValueError(f"hc mixer: an `up` of GGUF blocks takes one row, got {M} (hc_mix.step_eligible)")
    h = torch.empty(M, D, dtype=Xn.dtype, device=Xn.device)
    bd, bk, warps = config or (OUT_CONFIG if M == 1 else OUT_CONFIG_ROWS)
    # several 16-bit rows on tensor cores when the tile is at least 16 x 16; f32 keeps FMA products (tl.dot would
    # round them to tf32)
    tc = not blocks and M > 1 and Xn.dtype in (torch.bfloat16, torch.float16) and next_pow2(S) * bd >= 16 and bk >= 16
    mp = 16 if tc else triton.next_power_of_2(M)
    raw = up.raw if blocks else up
    g, length = qmatmul_geometry(up.code) if blocks else (8, 32)
    half = raw.view(torch.float16) if blocks else raw
    words = raw.view(torch.int32) if blocks and up.planes else half  # planes: rows of whole 16-byte runs
    nbp, nbp2 = plane_tiles(rank)
    _hc_out_kernel[(triton.cdiv(D, bd),)](y, Xn, raw, half, words, h, y.stride(0), D, rank, raw.shape[-1], M=M, MP=mp,
                                          S=S, SP=next_pow2(S), BD=bd, BK=bk, DT=tl_dtype(Xn.dtype), TC=tc,
                                          UPCAST=INTERPRET, QT=up.code if blocks else 0, G=g, L=length,
                                          NBP=nbp, NBP2=nbp2, num_warps=warps, **pdl_launch(y))
    return h


def plane_tiles(rank: int) -> tuple[int, int]:
    """The output kernel's two tiles of a row's 32-weight blocks in planes: the largest power of two of them, then the
    rest padded to a power of two (0: none). Q4_K_M's 320-wide `up` rows (10 blocks) as 8 + 2, where one tile of 16
    decoded 6 blocks of padding: compiled for sm_90, 14-22% fewer instructions an `up` weight and fewer registers
    (benchmarks/results/kernel_layouts_mixer_cpu-*.txt)."""
    nb = max(rank // 32, 1)
    first = 1 << (nb.bit_length() - 1)
    return first, next_pow2(nb - first) if nb > first else 0
