"""The hyper-connection mixer of a step of 1..8 rows as two Triton kernels (reference: kernels/hc_mix.py).

Compiled, a mixer step is ~6 kernels (the combine and the norm's reduction, the norm's apply, the `w_in`
product, the silu, the `up` product, the gated stream sum), each a few µs or less, plus a CUDA-graph node
apiece: 16 mixers make ~100 launches of an 8-layer decode step. The two products depend on each other
through a whole-vector result, so two kernels is the least:

`_hc_in_kernel`, one program per BN rows of `w_in` [N, S*D]: adds the pending block output into the
residual (X_s += 2 sigmoid(l_s / S) y), takes each stream's sum of squares, then streams its rows of
`w_in` against the normed residual, rounded to the weights' dtype as the product's input would be. Every
program reads the whole residual (40 KB per row, from L2) twice instead of waiting for a reduction kernel;
program 0 also writes the combined residual and the streams' rsqrt factors. Each weight tile is loaded once
for all rows (a verify step's 6 rows read the weights once, as for one).

`_hc_out_kernel`, one program per BD features: the gate logits of those features in every stream and row
(`up` [S*D, R] against silu(y[:R] / S)), sigmoid, and the gated mean of the normed streams.

Intermediates that the compiled path stores in 16 bits are rounded where it stores them (the product
inputs and outputs); the rest stays in f32, as inductor keeps it.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, tl_dtype

MAX_ROWS = 8
# (rows of w_in per program, K elements per step, warps) for the first kernel, one row and several;
# (features per program, warps) for the second
IN_CONFIG = (2, 2048, 8)
IN_CONFIG_ROWS = (4, 1024, 8)
OUT_CONFIG = (16, 4)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import round_to

    @triton.jit
    def _combined(x_ptr, yp_ptr, ip_ptr, k, kmask, s_of_k, D, S: tl.constexpr, SP: tl.constexpr,
                  HAS_PENDING: tl.constexpr, DT: tl.constexpr):
        """The residual at flat positions k (stream s_of_k), with the pending block output added."""
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        if HAS_PENDING:
            sp = tl.arange(0, SP)
            logit = tl.load(ip_ptr + sp, mask=sp < S, other=0.0).to(tl.float32)
            inj = 2.0 * tl.sigmoid(logit / S)  # [SP]
            inj_k = tl.sum(tl.where(s_of_k[None, :] == sp[:, None], inj[:, None], 0.0), axis=0)
            y = tl.load(yp_ptr + (k - s_of_k * D), mask=kmask, other=0.0).to(tl.float32)
            x = round_to(x + y * inj_k, DT)
        return x

    @triton.jit
    def _hc_in_kernel(x_ptr, yp_ptr, ip_ptr, norm_ptr, w_ptr, xo_ptr, y_ptr, r_ptr, N, D, eps, yp_m, ip_m,
                      M: tl.constexpr, MP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                      HAS_PENDING: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
        pid = tl.program_id(0)
        K = S * D
        kk = tl.arange(0, BK)
        sp = tl.arange(0, SP)
        mi = tl.arange(0, MP)
        # pass 1, row by row: per-stream sums of squares of the combined residual (program 0 stores the residual
        # and the rsqrt factors)
        r_all = tl.zeros([MP, SP], dtype=tl.float32)
        for m in tl.static_range(M):
            sq = tl.zeros([SP, BK], dtype=tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + kk
                kmask = k < K
                s_of_k = k // D
                x = _combined(x_ptr + m * K, yp_ptr + m * yp_m, ip_ptr + m * ip_m, k, kmask, s_of_k, D, S, SP,
                              HAS_PENDING, DT)
                if HAS_PENDING:
                    if pid == 0:
                        tl.store(xo_ptr + m * K + k, x.to(xo_ptr.dtype.element_ty), mask=kmask)
                sq += tl.where(s_of_k[None, :] == sp[:, None], (x * x)[None, :], 0.0)
            r = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / D + eps)  # [SP]
            if pid == 0:
                tl.store(r_ptr + m * S + sp, r, mask=sp < S)
            r_all = tl.where(mi[:, None] == m, r[None, :], r_all)
        # pass 2: this program's rows of w_in against every row's normed residual, each weight tile loaded once
        n = pid * BN + tl.arange(0, BN)
        nmask = n < N
        wrow = w_ptr + n.to(tl.int64)[:, None] * K
        prod = tl.zeros([BN, BK], dtype=tl.float32)  # one row: products summed once, after the loop
        acc = tl.zeros([MP, BN], dtype=tl.float32)  # several rows: each row's products summed per step
        for k0 in range(0, K, BK):
            k = k0 + kk
            kmask = k < K
            s_of_k = k // D
            g = tl.load(norm_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(wrow + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(M):
                x = _combined(x_ptr + m * K, yp_ptr + m * yp_m, ip_ptr + m * ip_m, k, kmask, s_of_k, D, S, SP,
                              HAS_PENDING, DT)
                r = tl.sum(tl.where(mi[:, None] == m, r_all, 0.0), axis=0)  # [SP]
                r_k = tl.sum(tl.where(s_of_k[None, :] == sp[:, None], r[:, None], 0.0), axis=0)
                xn = round_to(x * r_k * g, DT)
                if M == 1:
                    prod += w * xn[None, :]
                else:
                    acc = tl.where(mi[:, None] == m, acc + tl.sum(w * xn[None, :], axis=1)[None, :], acc)
        if M == 1:
            acc = tl.sum(prod, axis=1)[None, :]
        out = y_ptr + mi[:, None] * N + n[None, :]
        tl.store(out, round_to(acc, DT).to(y_ptr.dtype.element_ty), mask=(mi[:, None] < M) & nmask[None, :])

    @triton.jit
    def _hc_out_kernel(y_ptr, x_ptr, norm_ptr, up_ptr, r_ptr, h_ptr, N, D, R,
                       M: tl.constexpr, MP: tl.constexpr, S: tl.constexpr, BD: tl.constexpr, RP: tl.constexpr,
                       DT: tl.constexpr):
        d = tl.program_id(0) * BD + tl.arange(0, BD)
        dmask = d < D
        j = tl.arange(0, RP)
        jmask = j < R
        mi = tl.arange(0, MP)
        a = tl.load(y_ptr + mi[:, None] * N + j[None, :], mask=(mi[:, None] < M) & jmask[None, :],
                    other=0.0).to(tl.float32) / S
        a = round_to(a * tl.sigmoid(a), DT)  # silu(y / S) of every row [MP, RP], the up product's input
        acc = tl.zeros([MP, BD], dtype=tl.float32)
        for s in tl.static_range(S):
            f = s * D + d
            u = tl.load(up_ptr + f.to(tl.int64)[:, None] * R + j[None, :], mask=dmask[:, None] & jmask[None, :],
                        other=0.0).to(tl.float32)
            g = tl.load(norm_ptr + f, mask=dmask, other=0.0).to(tl.float32)
            for m in tl.static_range(M):
                a_m = tl.sum(tl.where(mi[:, None] == m, a, 0.0), axis=0)
                gate = tl.sigmoid(round_to(tl.sum(u * a_m[None, :], axis=1), DT))
                x = tl.load(x_ptr + m * S * D + f, mask=dmask, other=0.0).to(tl.float32)
                xn = round_to(x * tl.load(r_ptr + m * S + s) * g, DT)
                acc = tl.where(mi[:, None] == m, acc + (gate * xn)[None, :], acc)
        out = h_ptr + mi[:, None] * D + d[None, :]
        tl.store(out, round_to(acc / S, DT).to(h_ptr.dtype.element_ty), mask=(mi[:, None] < M) & dmask[None, :])


def hc_mix_step_triton(X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                       w_in: torch.Tensor, up: torch.Tensor, rank: int, hidden: int, count: int, eps: float,
                       in_config: tuple[int, int, int] | None = None, out_config: tuple[int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M <= MAX_ROWS rows: X [M, S*D] contiguous, pending (y [M, D], injection logits [M, S], each with contiguous
    rows) or None -> (combined X, h [M, D], w_in's outputs [M, N]: the columns past `rank` are the injection logits)."""
    S, D = count, hidden
    M, N = X.shape[0], w_in.shape[0]
    if not 0 < M <= MAX_ROWS or X.shape[1] != S * D or not X.is_contiguous() or w_in.shape[1] != S * D:
        raise ValueError(f"hc mixer: X {tuple(X.shape)} (contiguous: {X.is_contiguous()}), w_in {tuple(w_in.shape)}, "
                         f"{S} streams of {D}, at most {MAX_ROWS} rows")
    dev, dt = X.device, X.dtype
    bn, bk, in_warps = in_config or (IN_CONFIG if M == 1 else IN_CONFIG_ROWS)
    bd, out_warps = out_config or OUT_CONFIG
    Xo = torch.empty_like(X) if pending is not None else X
    y = torch.empty(M, N, dtype=dt, device=dev)
    r = torch.empty(M, S, dtype=torch.float32, device=dev)
    h = torch.empty(M, D, dtype=dt, device=dev)
    yp, ip = pending if pending is not None else (X, X)
    mp = triton.next_power_of_2(M)
    _hc_in_kernel[(triton.cdiv(N, bn),)](X, yp, ip, norm, w_in, Xo, y, r, N, D, eps, yp.stride(0), ip.stride(0),
                                         M=M, MP=mp, S=S, SP=next_pow2(S), HAS_PENDING=pending is not None, BN=bn,
                                         BK=bk, DT=tl_dtype(dt), num_warps=in_warps)
    _hc_out_kernel[(triton.cdiv(D, bd),)](y, Xo, norm, up, r, h, N, D, rank, M=M, MP=mp, S=S, BD=bd,
                                          RP=next_pow2(rank), DT=tl_dtype(dt), num_warps=out_warps)
    return Xo, h, y
