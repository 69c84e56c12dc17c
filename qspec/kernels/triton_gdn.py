"""The gated delta rule for decode / verify rows in Triton, writing the state after every row to its slot.

Per value head h and token t (q, k L2-normalised, q already scaled):
    S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t;  ssm[base + t, h] = S

One program owns head h and a block of BV value columns: its [dk, BV] slice of the state stays in
registers across all T tokens. Columns of S never mix (every product above is per column), so
programs are independent: each loads its own slice of plane `live` before it writes anything,
and no other program touches that slice. The reads and writes may therefore share one buffer
(the recurrent cache's ping-pong planes). The matrix-vector products are broadcast-multiply +
reductions: with one token at a time there is no M >= 16 operand for tensor cores.

With `final_only` (a short prompt's prefill) only the state after the last row is written, to plane `base`, so
the row count is not bounded by the planes: the model runs prompts of up to `FINAL_MAX_ROWS` rows here instead of
in fla's chunked kernels, whose compilation is most of a fresh process's first request (BENCHMARKS.md §5c).
"""

import torch

from qspec.kernels.gdn_recurrent import gdn_gates, gdn_recurrent_torch
from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch, use_triton

MAX_ROWS = 16
# The most rows of a final-state-only call: its rows run one after another, so past a few hundred the chunked form
# is faster (a 128-row prompt takes the loop ~128 times a decode row's recurrence, still under a prefill's products)
FINAL_MAX_ROWS = 128
DEFAULT_BV = 32

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, table_pointer
    from qspec.kernels.triton_gdn_conv import conv_silu

    @triton.jit
    def _add_pair(a, b, c, d):
        return a + c, b + d

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for every row count
    def _gdn_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, a_ptr, dtb_ptr, ssm_ptr, live_ptr, base_ptr, o_ptr, T, HQ,
                    q_t, q_h, k_t, k_h, v_t, v_h, g_t, g_h, b_t, b_h, o_t, o_h, s_p, s_h, s_k,
                    x_ptr, cw_ptr, x_c, scale, eps, x_seq,
                    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATES: tl.constexpr,
                    FINAL: tl.constexpr = False, CONV: tl.constexpr = False, KT: tl.constexpr = 1,
                    SEQS: tl.constexpr = False, PDL: tl.constexpr = False):
        # CONV: q, k and v come from the conv window X [2 HQ DK + Hv DV, KT - 1 + T] and the taps cw [C, KT]
        # (triton_gdn_conv's math: conv, silu, the q/k L2 norms, q's scale), computed here (q_ptr .. v_ptr unread);
        # the two norms' sums are one reduction (compiled for sm_90: 13 barriers in the kernel, where two took 16).
        # SEQS (with CONV): sequence program_id(2), whose T rows follow the previous sequence's in g, b and o, whose
        # window is x_seq words further on, and whose state, live and base come from tables of their addresses
        pdl_start(PDL)
        if SEQS:
            seq = tl.program_id(2)
            ssm_ptr = table_pointer(ssm_ptr, seq, tl.float32)
            live_ptr = table_pointer(live_ptr, seq, tl.int64, False)
            base_ptr = table_pointer(base_ptr, seq, tl.int64, False)
            row0 = seq * T
            g_ptr += row0 * g_t
            b_ptr += row0 * b_t
            o_ptr += row0 * o_t
            x_ptr += seq.to(tl.int64) * x_seq
        h = tl.program_id(1)
        hq = h % HQ  # tiled head order: value head h reads key head h % HQ (HQ == Hv when pre-expanded)
        ik = tl.arange(0, BK)
        iv = tl.program_id(0) * BV + tl.arange(0, BV)
        kmask = ik < DK
        vmask = iv < DV
        tmask = kmask[:, None] & vmask[None, :]
        tile = ik.to(tl.int64)[:, None] * s_k + iv[None, :]
        head = h.to(tl.int64) * s_h
        live = tl.load(live_ptr)
        base = tl.load(base_ptr)
        S = tl.load(ssm_ptr + live * s_p + head + tile, mask=tmask, other=0.0)
        for t in range(T):
            if CONV:
                qt = conv_silu(x_ptr, cw_ptr, hq * DK + ik, kmask, t, x_c, KT)
                kt = conv_silu(x_ptr, cw_ptr, (HQ + hq) * DK + ik, kmask, t, x_c, KT)
                qq, kk = tl.reduce((qt * qt, kt * kt), 0, _add_pair)  # both norms' sums in one reduction
                qt = qt * tl.math.rsqrt(qq + eps) * scale
                kt = kt * tl.math.rsqrt(kk + eps)
                vt = conv_silu(x_ptr, cw_ptr, 2 * HQ * DK + h * DV + iv, vmask, t, x_c, KT)
            else:
                qt = tl.load(q_ptr + t * q_t + hq * q_h + ik, mask=kmask, other=0.0).to(tl.float32)
                kt = tl.load(k_ptr + t * k_t + hq * k_h + ik, mask=kmask, other=0.0).to(tl.float32)
                vt = tl.load(v_ptr + t * v_t + h * v_h + iv, mask=vmask, other=0.0).to(tl.float32)
            gt = tl.load(g_ptr + t * g_t + h * g_h).to(tl.float32)
            bt = tl.load(b_ptr + t * b_t + h * b_h).to(tl.float32)
            if GATES:  # g and b hold the projection's raw logits: the gates are computed here (`gdn_gates`)
                x = gt + tl.load(dtb_ptr + h)
                gt = tl.load(a_ptr + h) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
                bt = 1.0 / (1.0 + tl.exp(-bt))
            S = S * tl.exp(gt)
            kv = tl.sum(S * kt[:, None], axis=0)  # [BV]: S^T k
            u = (vt - kv) * bt
            S = S + kt[:, None] * u[None, :]
            ot = tl.sum(S * qt[:, None], axis=0)
            tl.store(o_ptr + t * o_t + h * o_h + iv, ot, mask=vmask)
            if not FINAL:
                tl.store(ssm_ptr + (base + t) * s_p + head + tile, S, mask=tmask)
        if FINAL:
            tl.store(ssm_ptr + base * s_p + head + tile, S, mask=tmask)


def _most_rows(final_only: bool) -> int:
    return FINAL_MAX_ROWS if final_only else MAX_ROWS


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, final_only: bool = False) -> None:
    T, Hq, dk = q.shape
    if k.shape != q.shape or v.shape[0] != T:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    _check_state(T, Hq, dk, v.shape[1], v.shape[2], g, beta, ssm, final_only)


def _check_state(T: int, Hq: int, dk: int, Hv: int, dv: int, g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor,
                 final_only: bool) -> None:
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"shape mismatch: {T} rows of {Hv} value heads, g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if Hv % Hq or ssm.dim() != 4 or tuple(ssm.shape[1:]) != (Hv, dk, dv):
        raise ValueError(f"ssm {tuple(ssm.shape)} does not fit Hv={Hv} dk={dk} dv={dv} (q heads {Hq})")
    if ssm.dtype != torch.float32:
        raise ValueError("the state must be f32")
    if T < 1 or (not final_only and T > ssm.shape[0]):
        raise ValueError(f"{T} rows do not fit {ssm.shape[0]} planes")


def _check_gates(gates: tuple[torch.Tensor, torch.Tensor], Hv: int) -> None:
    if any(t.shape != (Hv,) or t.dtype != torch.float32 or not t.is_contiguous() for t in gates):
        raise ValueError(f"gates: a and dt_bias must be contiguous f32 [Hv={Hv}]")


def gdn_recurrent_planes_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, ssm: torch.Tensor, live: torch.Tensor,
                               base: torch.Tensor, gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                               final_only: bool = False) -> torch.Tensor:
    """Reference: what GatedDeltaNet.recur does today for a short step (gather, recurrence, scatter)."""
    if gates is not None:
        beta, g = gdn_gates(beta, g, *gates)
    _check(q, k, v, g, beta, ssm, final_only)
    T, Hq = q.shape[:2]
    rep = v.shape[1] // Hq
    if rep > 1:
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
    S0 = ssm.index_select(0, live.view(1))[0]
    o, states = gdn_recurrent_torch(q, k, v, g, beta, S0, keep_states=not final_only)
    ssm.index_copy_(0, base.view(1) if final_only else base + torch.arange(T, device=ssm.device), states)
    return o


def gdn_recurrent_planes_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, ssm: torch.Tensor, live: torch.Tensor, base: torch.Tensor,
                                gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                                block_v: int = DEFAULT_BV, num_warps: int = 4,
                                out: torch.Tensor | None = None, final_only: bool = False) -> torch.Tensor:
    """The Triton kernel; same contract as `gdn_recurrent_planes`."""
    _check(q, k, v, g, beta, ssm, final_only)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    T, Hq, dk = q.shape
    rows = (q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    return _launch(rows, (q, q, 0, 1.0, 0.0), T, Hq, v.shape[1], dk, v.shape[2], g, beta, ssm, live, base, gates,
                   block_v, num_warps, out, final_only, conv_taps=0)  # no conv window: its pointers unread


def gdn_conv_recurrent_triton(X: torch.Tensor, conv_w: torch.Tensor, Hk: int, Hv: int, dk: int, dv: int,
                              g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor, live: torch.Tensor,
                              base: torch.Tensor, gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                              block_v: int = DEFAULT_BV, num_warps: int = 4, out: torch.Tensor | None = None,
                              final_only: bool = False) -> torch.Tensor:
    """GDN's step conv (triton_gdn_conv.gdn_conv_qkv_triton's math) and the recurrence in one launch: each program
    computes its rows' q, k (key head h % Hk, normed, q scaled) and v slice from the conv window X [C, KT - 1 + T]
    (the snapshot kernel's output, C = 2 Hk dk + Hv dv, f32, contiguous last dim) and the taps conv_w [C, KT] f32.
    The other arguments as `gdn_recurrent_planes`'s. -> o [T, Hv, dv] f32."""
    from qspec.kernels.triton_gdn_conv import L2_EPS

    C, taps = conv_w.shape
    T = X.shape[1] - taps + 1
    if (X.dim() != 2 or X.shape[0] != C or C != 2 * Hk * dk + Hv * dv or T < 1 or X.stride(1) != 1
            or X.dtype != torch.float32 or conv_w.dtype != torch.float32 or not conv_w.is_contiguous()):
        raise ValueError(f"gdn conv + recurrence: X {tuple(X.shape)} {X.dtype}, taps {tuple(conv_w.shape)} "
                         f"{conv_w.dtype} for {Hk} key heads of {dk} and {Hv} value heads of {dv}")
    _check_state(T, Hk, dk, Hv, dv, g, beta, ssm, final_only)
    rows = (X, X, X, 0, 0, 0, 0, 0, 0)  # unread: q, k, v come from the window
    return _launch(rows, (X, conv_w, X.stride(0), dk ** -0.5, L2_EPS), T, Hk, Hv, dk, dv, g, beta, ssm, live, base,
                   gates, block_v, num_warps, out, final_only, conv_taps=taps)


def _launch(rows: tuple, window: tuple, T: int, Hq: int, Hv: int, dk: int, dv: int, g: torch.Tensor,
            beta: torch.Tensor, ssm: torch.Tensor, live: torch.Tensor, base: torch.Tensor,
            gates: tuple[torch.Tensor, torch.Tensor] | None, block_v: int, num_warps: int, out: torch.Tensor | None,
            final_only: bool, conv_taps: int) -> torch.Tensor:
    """_gdn_kernel's launch; rows: q, k, v and their row and head strides; window: the conv window, its taps, the
    window's row stride, q's scale and the norms' eps (read where conv_taps > 0: q, k, v computed from it)."""
    a, dt_bias = gates if gates is not None else (g, g)  # unread without gates
    if gates is not None:
        _check_gates(gates, Hv)
    most = _most_rows(final_only)
    if T > most:
        raise ValueError(f"{T} rows: the per-row kernel is for at most {most} (use the chunked form)")
    if ssm.stride(3) != 1 or live.dtype != torch.int64 or base.dtype != torch.int64:
        raise ValueError("ssm needs a contiguous last dim; live/base must be int64 device scalars")
    o = out if out is not None else torch.empty(T, Hv, dv, dtype=torch.float32, device=ssm.device)
    if o.shape != (T, Hv, dv) or o.dtype != torch.float32 or o.stride(2) != 1:
        raise ValueError("out must be f32 [T, Hv, dv] with a contiguous last dim")
    bv = min(block_v, next_pow2(dv))
    q, k, v, *strides = rows
    _gdn_kernel[(triton.cdiv(dv, bv), Hv)](
        q, k, v, g, beta, a, dt_bias, ssm, live, base, o, T, Hq, *strides,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), *window, 0,
        DK=dk, DV=dv, BK=next_pow2(dk), BV=bv, GATES=gates is not None, FINAL=final_only, CONV=conv_taps > 0,
        KT=max(conv_taps, 1), num_warps=num_warps, **pdl_launch(ssm))
    return o


def gdn_conv_recurrent_seqs_triton(X: torch.Tensor, conv_w: torch.Tensor, Hk: int, Hv: int, dk: int, dv: int,
                                   g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor,
                                   tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                   gates: tuple[torch.Tensor, torch.Tensor], block_v: int = DEFAULT_BV,
                                   num_warps: int = 4) -> torch.Tensor:
    """`gdn_conv_recurrent_triton` for B sequences of T rows each in one launch: sequence b's window X[b]
    ([B, C, KT - 1 + T], contiguous), its rows g, beta[b T : (b + 1) T], its state S_b (plane live_b read, row t's
    state to plane base_b + t). ssm: sequence 0's S (every S_b has its shape and strides); tables: int64 [B] device
    tensors of the addresses of every S_b, live_b and base_b (state/tables.SequenceTables).
    -> o [B T, Hv, dv] f32."""
    from qspec.kernels.triton_gdn_conv import L2_EPS

    B, C, width = X.shape
    taps = conv_w.shape[1]
    T = width - taps + 1
    if (X.dtype != torch.float32 or not X.is_contiguous() or C != 2 * Hk * dk + Hv * dv or T < 1
            or conv_w.shape[0] != C or conv_w.dtype != torch.float32 or not conv_w.is_contiguous()
            or any(t.shape != (B,) or t.dtype != torch.int64 for t in tables)):
        raise ValueError(f"gdn conv + recurrence of {B} sequences: X {tuple(X.shape)} {X.dtype}, taps "
                         f"{tuple(conv_w.shape)} {conv_w.dtype}, tables of {B} int64 addresses each")
    _check_state(B * T, Hk, dk, Hv, dv, g, beta, ssm, final_only=True)
    if T > MAX_ROWS or T > ssm.shape[0] // 2:
        raise ValueError(f"{T} rows a sequence: at most {MAX_ROWS} and half of its {ssm.shape[0]} planes")
    a, dt_bias = gates
    _check_gates(gates, Hv)
    if ssm.stride(3) != 1:
        raise ValueError("ssm needs a contiguous last dim")
    o = torch.empty(B * T, Hv, dv, dtype=torch.float32, device=X.device)
    bv = min(block_v, next_pow2(dv))
    addresses, live, base = tables
    _gdn_kernel[(triton.cdiv(dv, bv), Hv, B)](
        X, X, X, g, beta, a, dt_bias, addresses, live, base, o, T, Hk, 0, 0, 0, 0, 0, 0,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), X, conv_w, X.stride(1), dk ** -0.5, L2_EPS, X.stride(0),
        DK=dk, DV=dv, BK=next_pow2(dk), BV=bv, GATES=True, CONV=True, KT=taps, SEQS=True, num_warps=num_warps,
        **pdl_launch(X))
    return o


def gdn_recurrent_planes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         ssm: torch.Tensor, live: torch.Tensor, base: torch.Tensor,
                         gates: tuple[torch.Tensor, torch.Tensor] | None = None, final_only: bool = False
                         ) -> torch.Tensor:
    """Gated delta rule over T <= 16 rows, reading plane `live` and writing row t's state to plane base + t
    (final_only: T <= FINAL_MAX_ROWS rows, only the last row's state, to plane base).

    q, k [T, Hq, dk] f32 (L2-normed, q scaled; Hq = Hv when the caller expanded the key heads, or the
    k-head count, value head h then reading key head h % Hq, llama.cpp's tiled order); v [T, Hv, dv];
    g, beta [T, Hv] f32; or, with gates = (a, dt_bias) [Hv] f32, g and beta are the projection's raw alpha and
    beta logits (any float dtype) and the kernel computes the gates itself (`gdn_gates`: two kernels fewer per
    step); ssm [P, Hv, dk, dv] f32; live, base: int64 device scalars.
    Returns o [T, Hv, dv] f32. Triton on CUDA, the torch reference otherwise."""
    if use_triton(q) and q.shape[0] <= _most_rows(final_only):
        return gdn_recurrent_planes_triton(q, k, v, g, beta, ssm, live, base, gates, final_only=final_only)
    return gdn_recurrent_planes_torch(q, k, v, g, beta, ssm, live, base, gates, final_only)
