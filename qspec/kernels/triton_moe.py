"""Routed MoE for a few tokens in Triton: each (token, slot) pair reads only its chosen expert's rows.

Kernel 1, grid (F / BF, M * k): pair (m, j) with expert e = top_i[m, j] computes
    act[m, j, f] = silu(gate_e[f] . h_m) * (up_e[f] . h_m)   for BF rows f
Kernel 2, grid (D / BD, M): for each of token m's k slots, in slot order,
    out[m, d] += top_w[m, j] * (down_e[d] . act[m, j])
so the sum over slots is a fixed-order loop inside one program (deterministic, no atomics, no
[M, k, D] buffer). Expert weights are addressed in place (e * stride); nothing is gathered or copied.

Rounding follows the torch reference (`MoE._per_token`) op by op: every linear output, the silu,
the product, each weighted slot output is rounded to the activation dtype, and the slot sum is
accumulated in f32 and rounded once, so results differ only by f32 accumulation order.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype

# Swept on the H200 (python -m qspec.bench.kernels; benchmarks/results/gpu_kernels_h200_s3.txt and
# gpu_kernels_h200_fused.txt).
DEFAULT_CONFIG = (32, 256, 32, 128, 8)  # kernel 1: BF, BD; kernel 2: BD, BF; warps
# One or two rows launch few programs, so they take narrower row tiles: 40 gate/up and 160 down
# programs per (token, slot) pair at F = 640, D = 2560.
FEW_ROWS_CONFIG = (16, 256, 16, 128, 4)


# The grouped kernels (a verify step's rows): tensor-core columns hold up to 16 rows.
GROUPED_MAX_ROWS = 16
# Configs (kernel 1: BF, BD; kernel 2: BD, BF; warps; pipeline stages) by row count, the best of 48 at E=512,
# D=2560, F=640, k=10 on the H200 (python -m qspec.bench.kernels --moe-sweep ->
# benchmarks/results/gpu_kernels_moe_sweep_h200_s9.txt, a graph of 8 calls): faster than the per-pair kernels at
# 6, 4 and 1 rows, near bandwidth on the distinct experts at 6 (BENCHMARKS.md §5, the routed experts row).
GROUPED_CONFIGS = ((1, (64, 128, 128, 64, 4, 4)), (4, (64, 128, 128, 64, 4, 3)), (16, (32, 128, 128, 64, 4, 4)))


def grouped_config_for(M: int) -> tuple[int, int, int, int, int, int]:
    return next(cfg for rows, cfg in GROUPED_CONFIGS if M <= rows)


def config_for(M: int) -> tuple[int, int, int, int, int]:
    return FEW_ROWS_CONFIG if M <= 2 else DEFAULT_CONFIG

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import dot_acc, pdl_start, round_to

    @triton.jit(do_not_specialize=["KS"])
    def _moe_gate_up_kernel(h_ptr, ti_ptr, gate_ptr, up_ptr, act_ptr, D, F, KS,
                            h_m, ti_m, g_e, g_f, u_e, u_f, a_m, a_k,
                            DT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pair = tl.program_id(1)
        m = pair // KS
        j = pair % KS
        e = tl.load(ti_ptr + m * ti_m + j).to(tl.int64)
        f = tl.program_id(0) * BF + tl.arange(0, BF)
        fmask = f < F
        f64 = f.to(tl.int64)
        grow = gate_ptr + e * g_e + f64[:, None] * g_f  # [BF, 1] row starts of the chosen expert
        urow = up_ptr + e * u_e + f64[:, None] * u_f
        accg = tl.zeros([BF, BD], dtype=tl.float32)
        accu = tl.zeros([BF, BD], dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dmask = d < D
            x = tl.load(h_ptr + m * h_m + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            wm = fmask[:, None] & dmask[None, :]
            accg += tl.load(grow + d[None, :], mask=wm, other=0.0).to(tl.float32) * x
            accu += tl.load(urow + d[None, :], mask=wm, other=0.0).to(tl.float32) * x
        g = round_to(tl.sum(accg, axis=1), DT)
        u = round_to(tl.sum(accu, axis=1), DT)
        a = round_to(g / (1.0 + tl.exp(-g)), DT)
        act = round_to(a * u, DT)
        tl.store(act_ptr + m * a_m + j * a_k + f, act.to(act_ptr.dtype.element_ty), mask=fmask)

    @triton.jit(do_not_specialize=["KS"])
    def _moe_down_kernel(act_ptr, ti_ptr, tw_ptr, down_ptr, slot_ptr, D, F, KS,
                         a_m, a_k, ti_m, tw_m, d_e, d_d, s_m, s_k,
                         DT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pair = tl.program_id(1)
        m = pair // KS
        j = pair % KS
        d = tl.program_id(0) * BD + tl.arange(0, BD)
        dmask = d < D
        e = tl.load(ti_ptr + m * ti_m + j).to(tl.int64)
        w = tl.load(tw_ptr + m * tw_m + j).to(tl.float32)
        drow = down_ptr + e * d_e + d.to(tl.int64)[:, None] * d_d
        acc = tl.zeros([BD, BF], dtype=tl.float32)
        for f0 in range(0, F, BF):
            f = f0 + tl.arange(0, BF)
            fmask = f < F
            a = tl.load(act_ptr + m * a_m + j * a_k + f, mask=fmask, other=0.0).to(tl.float32)
            wd = tl.load(drow + f[None, :], mask=dmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
            acc += wd * a[None, :]
        y = round_to(tl.sum(acc, axis=1), DT)
        tl.store(slot_ptr + m * s_m + j * s_k + d, round_to(y * w, DT).to(slot_ptr.dtype.element_ty), mask=dmask)


    @triton.jit
    def _expert_rows(ti_ptr, pair, M, KS, ti_m, KP: tl.constexpr):
        """For the pair's expert e: whether the pair is the first (in row-major pair order) that chose e, the 16 rows
        r, for each row the slot j with top_i[r, j] == e or -1 (a row chooses an expert at most once), and whether the
        row chose e."""
        e = tl.load(ti_ptr + (pair // KS) * ti_m + pair % KS)
        r = tl.arange(0, 16)
        jj = tl.arange(0, KP)
        tile = tl.load(ti_ptr + r[:, None] * ti_m + jj[None, :], mask=(r[:, None] < M) & (jj[None, :] < KS), other=-1)
        hit = tile == e
        earlier = tl.sum(tl.sum((hit & ((r[:, None] * KS + jj[None, :]) < pair)).to(tl.int32), axis=1), axis=0)
        jm = tl.max(tl.where(hit, jj[None, :], -1), axis=1)
        return e.to(tl.int64), earlier == 0, r, jm, jm >= 0

    @triton.jit
    def _tile_rows(w_ptr, e, w_e, w_n, N, BN: tl.constexpr):
        """This program's BN output rows of expert e's [N, *] matrix: (their indices, which exist, their row pointers
        [BN, 1])."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        return n, n < N, w_ptr + e * w_e + n.to(tl.int64)[:, None] * w_n

    @triton.jit(do_not_specialize=["KS"])
    def _moe_gate_up_grouped_kernel(h_ptr, ti_ptr, gate_ptr, up_ptr, act_ptr, M, D, F, KS,
                                    h_m, ti_m, g_e, g_f, u_e, u_f, a_m, a_k,
                                    DT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr,
                                    STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        # one program per (F tile, pair), but only the first pair of each distinct expert works: it reads the
        # expert's rows once for every row that chose it (rows as 16 tensor-core columns, the others masked)
        pdl_start(PDL)
        e, first, r, jm, member = _expert_rows(ti_ptr, tl.program_id(1), M, KS, ti_m, KP)
        if first:
            f, fmask, grow = _tile_rows(gate_ptr, e, g_e, g_f, F, BF)
            urow = up_ptr + e * u_e + f.to(tl.int64)[:, None] * u_f
            accg = tl.zeros([BF, 16], dtype=tl.float32)
            accu = tl.zeros([BF, 16], dtype=tl.float32)
            for d0 in tl.range(0, D, BD, num_stages=STAGES):
                d = d0 + tl.arange(0, BD)
                dmask = d < D
                xt = tl.load(h_ptr + r[None, :] * h_m + d[:, None], mask=member[None, :] & dmask[:, None], other=0.0)
                wm = fmask[:, None] & dmask[None, :]
                g = tl.load(grow + d[None, :], mask=wm, other=0.0)
                u = tl.load(urow + d[None, :], mask=wm, other=0.0)
                accg = dot_acc(g, xt, accg, UPCAST)
                accu = dot_acc(u, xt, accu, UPCAST)
            g = round_to(accg, DT)
            u = round_to(accu, DT)
            a = round_to(g / (1.0 + tl.exp(-g)), DT)
            act = round_to(a * u, DT)
            out = act_ptr + r[None, :] * a_m + jm[None, :] * a_k + f[:, None]
            tl.store(out, act.to(act_ptr.dtype.element_ty), mask=member[None, :] & fmask[:, None])

    @triton.jit(do_not_specialize=["KS"])
    def _moe_down_grouped_kernel(act_ptr, ti_ptr, tw_ptr, down_ptr, slot_ptr, M, D, F, KS,
                                 a_m, a_k, ti_m, tw_m, d_e, d_d, s_m, s_k,
                                 DT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, KP: tl.constexpr,
                                 STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        e, first, r, jm, member = _expert_rows(ti_ptr, tl.program_id(1), M, KS, ti_m, KP)
        if first:
            d, dmask, drow = _tile_rows(down_ptr, e, d_e, d_d, D, BD)
            arow = act_ptr + r[None, :] * a_m + jm[None, :] * a_k  # [1, 16]: each member row's act slot
            acc = tl.zeros([BD, 16], dtype=tl.float32)
            for f0 in tl.range(0, F, BF, num_stages=STAGES):
                f = f0 + tl.arange(0, BF)
                fmask = f < F
                at = tl.load(arow + f[:, None], mask=member[None, :] & fmask[:, None], other=0.0)  # [BF, 16]
                wd = tl.load(drow + f[None, :], mask=dmask[:, None] & fmask[None, :], other=0.0)
                acc = dot_acc(wd, at, acc, UPCAST)
            w = tl.load(tw_ptr + r * tw_m + jm, mask=member, other=0.0).to(tl.float32)
            y = round_to(round_to(acc, DT) * w[None, :], DT)
            out = slot_ptr + r[None, :] * s_m + jm[None, :] * s_k + d[:, None]
            tl.store(out, y.to(slot_ptr.dtype.element_ty), mask=member[None, :] & dmask[:, None])


def _check_last_dims(**tensors: torch.Tensor) -> None:
    """Both launchers address each tensor's last dim with unit stride."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")


def moe_slots_grouped_triton(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: torch.Tensor,
                             up: torch.Tensor, down: torch.Tensor,
                             config: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """As `moe_slots_triton`, but each distinct expert's weights are read once for all rows that chose it, through
    tensor cores (1..16 rows). config: (BF, BD of kernel 1; BD, BF of kernel 2; warps; stages)."""
    M, D = h.shape
    k = top_i.shape[1]
    F = gate.shape[1]
    if M > GROUPED_MAX_ROWS:
        raise ValueError(f"grouped MoE kernels take at most {GROUPED_MAX_ROWS} rows, got {M}")
    _check_last_dims(h=h, top_i=top_i, top_w=top_w, gate=gate, up=up, down=down)
    bf1, bd1, bd2, bf2, warps, stages = config or grouped_config_for(M)
    dt = tl_dtype(h.dtype)
    kp = max(2, next_pow2(k))
    # no element stays unwritten: every (row, slot) pair is in its expert's group, whose first pair writes it
    act = torch.empty(M, k, F, dtype=h.dtype, device=h.device)
    slots = torch.empty(M, k, D, dtype=h.dtype, device=h.device)
    _moe_gate_up_grouped_kernel[(triton.cdiv(F, bf1), M * k)](
        h, top_i, gate, up, act, M, D, F, k, h.stride(0), top_i.stride(0), gate.stride(0), gate.stride(1),
        up.stride(0), up.stride(1), act.stride(0), act.stride(1), DT=dt, BF=bf1, BD=bd1, KP=kp, STAGES=stages,
        UPCAST=INTERPRET, num_warps=warps, **pdl_launch(h))
    _moe_down_grouped_kernel[(triton.cdiv(D, bd2), M * k)](
        act, top_i, top_w, down, slots, M, D, F, k, act.stride(0), act.stride(1), top_i.stride(0), top_w.stride(0),
        down.stride(0), down.stride(1), slots.stride(0), slots.stride(1), DT=dt, BD=bd2, BF=bf2, KP=kp,
        STAGES=stages, UPCAST=INTERPRET, num_warps=warps, **pdl_launch(act))
    return slots


def moe_slots_triton(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: torch.Tensor,
                     up: torch.Tensor, down: torch.Tensor,
                     config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Launch both kernels -> the weighted slot outputs [M, k, D]; shapes as in `moe_few` (already checked)."""
    M, D = h.shape
    k = top_i.shape[1]
    F = gate.shape[1]
    _check_last_dims(h=h, top_i=top_i, top_w=top_w, gate=gate, up=up, down=down)
    bf1, bd1, bd2, bf2, warps = config or config_for(M)
    dt = tl_dtype(h.dtype)
    act = torch.empty(M, k, F, dtype=h.dtype, device=h.device)
    slots = torch.empty(M, k, D, dtype=h.dtype, device=h.device)
    _moe_gate_up_kernel[(triton.cdiv(F, bf1), M * k)](
        h, top_i, gate, up, act, D, F, k, h.stride(0), top_i.stride(0), gate.stride(0), gate.stride(1),
        up.stride(0), up.stride(1), act.stride(0), act.stride(1), DT=dt, BF=bf1, BD=bd1, num_warps=warps,
        **pdl_launch(h))
    _moe_down_kernel[(triton.cdiv(D, bd2), M * k)](
        act, top_i, top_w, down, slots, D, F, k, act.stride(0), act.stride(1), top_i.stride(0), top_w.stride(0),
        down.stride(0), down.stride(1), slots.stride(0), slots.stride(1), DT=dt, BD=bd2, BF=bf2, num_warps=warps,
        **pdl_launch(act))
    return slots
