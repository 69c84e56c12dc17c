"""Pooled indexer keys in Triton (seed Algorithm 2's batched body): one program per update row; for a batched step,
one launch for every sequence's update list, each row finding its sequence's caches through address tables.

Row u: gather raw[cells[u, :]] (r rows), mean in f32, round to the raw dtype (the cache-type round
trip), RMSNorm * gamma in f32 rounded to the raw dtype (ops.rms_norm), NeoX RoPE on the first
rope_dim dims in the promoted dtype of (raw, cos) with torch's per-op rounding, f32 store to
pooled[dest[u]]. The head is handled as three segments, [0, h), [h, 2h) and [2h, d) with h =
rope_dim / 2, so the RoPE pairs (i, i + h) are element-wise between two register vectors.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch, tl_dtype

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, round_to, table_pointer

    @triton.jit
    def _pooled_kernel(raw_ptr, cells_ptr, dest_ptr, gamma_ptr, cos_ptr, sin_ptr, pooled_ptr, eps,
                       raw_row, cells_row, cells_col, dest_s, cs_row, pooled_row, rows,
                       D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr,
                       BP: tl.constexpr, RAW_DT: tl.constexpr, ROPE_DT: tl.constexpr, SEQS: tl.constexpr = False,
                       PDL: tl.constexpr = False):
        pdl_start(PDL)
        u = tl.program_id(0)
        if SEQS:  # row u is sequence u // rows's; raw_ptr and pooled_ptr are tables of its caches' addresses
            raw_ptr = table_pointer(raw_ptr, u // rows, RAW_DT)
            pooled_ptr = table_pointer(pooled_ptr, u // rows, tl.float32)
        ih = tl.arange(0, BH)
        ip = tl.arange(0, BP)
        mh = ih < HALF
        mp = ip < D - 2 * HALF
        xa = tl.zeros([BH], dtype=tl.float32)
        xb = tl.zeros([BH], dtype=tl.float32)
        xp = tl.zeros([BP], dtype=tl.float32)
        for j in tl.static_range(R):  # in order, as torch's mean over r accumulates
            cell = tl.load(cells_ptr + u * cells_row + j * cells_col).to(tl.int64)
            row = raw_ptr + cell * raw_row
            xa += tl.load(row + ih, mask=mh, other=0.0).to(tl.float32)
            xb += tl.load(row + HALF + ih, mask=mh, other=0.0).to(tl.float32)
            xp += tl.load(row + 2 * HALF + ip, mask=mp, other=0.0).to(tl.float32)
        inv_r = 1.0 / R
        xa = round_to(xa * inv_r, RAW_DT)  # the cache-type round trip
        xb = round_to(xb * inv_r, RAW_DT)
        xp = round_to(xp * inv_r, RAW_DT)
        ms = (tl.sum(xa * xa, axis=0) + tl.sum(xb * xb, axis=0) + tl.sum(xp * xp, axis=0)) * (1.0 / D)
        rs = tl.rsqrt(ms + eps)
        za = round_to((xa * rs) * tl.load(gamma_ptr + ih, mask=mh, other=0.0).to(tl.float32), RAW_DT)
        zb = round_to((xb * rs) * tl.load(gamma_ptr + HALF + ih, mask=mh, other=0.0).to(tl.float32), RAW_DT)
        zp = round_to((xp * rs) * tl.load(gamma_ptr + 2 * HALF + ip, mask=mp, other=0.0).to(tl.float32), RAW_DT)
        ca = tl.load(cos_ptr + u * cs_row + ih, mask=mh, other=0.0).to(tl.float32)
        cb = tl.load(cos_ptr + u * cs_row + HALF + ih, mask=mh, other=0.0).to(tl.float32)
        sa = tl.load(sin_ptr + u * cs_row + ih, mask=mh, other=0.0).to(tl.float32)
        sb = tl.load(sin_ptr + u * cs_row + HALF + ih, mask=mh, other=0.0).to(tl.float32)
        # apply_rope: x * cos + rot * sin with rot = (-x_b, x_a), each op rounded to the rope dtype
        oa = round_to(round_to(za * ca, ROPE_DT) + round_to(-zb * sa, ROPE_DT), ROPE_DT)
        ob = round_to(round_to(zb * cb, ROPE_DT) + round_to(za * sb, ROPE_DT), ROPE_DT)
        out = pooled_ptr + tl.load(dest_ptr + u * dest_s) * pooled_row
        tl.store(out + ih, oa, mask=mh)
        tl.store(out + HALF + ih, ob, mask=mh)
        tl.store(out + 2 * HALF + ip, zp, mask=mp)


def pooled_triton(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, pooled: torch.Tensor) -> None:
    """Launch the kernel (shapes already checked by the caller)."""
    _launch(raw, cells, dest, gamma, eps, cos, sin, pooled, None)


def pooled_seqs_triton(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, pooled: torch.Tensor,
                       tables: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Every sequence's update list in one launch: rows b C .. (b + 1) C - 1 of cells, dest, cos and sin (C = rows /
    B) are sequence b's, read from and written to its caches, whose addresses `tables` (raw keys, pooled keys: int64
    [B] each, state/tables.SequenceTables) hold. raw, pooled: sequence 0's caches (every one shares their dtype and
    layout; shapes already checked by the caller)."""
    if cells.shape[0] % tables[0].shape[0] or tables[0].shape != tables[1].shape:
        raise ValueError(f"{cells.shape[0]} update rows for {tables[0].shape[0]} sequences")
    _launch(raw, cells, dest, gamma, eps, cos, sin, pooled, tables)


def _launch(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor, eps: float,
            cos: torch.Tensor, sin: torch.Tensor, pooled: torch.Tensor,
            tables: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    C, r = cells.shape
    d = raw.shape[1]
    rope = cos.shape[1]
    rope_dt = torch.promote_types(raw.dtype, cos.dtype)
    for name, t in (("raw", raw), ("gamma", gamma), ("cos", cos), ("sin", sin), ("pooled", pooled)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if cos.stride() != sin.stride():
        raise ValueError("cos and sin need the same layout")
    raw_at, pooled_at = (raw, pooled) if tables is None else tables
    _pooled_kernel[(C,)](raw_at, cells, dest, gamma, cos, sin, pooled_at, float(eps),
                         raw.stride(0), cells.stride(0), cells.stride(1), dest.stride(0), cos.stride(0),
                         pooled.stride(0), C if tables is None else C // tables[0].shape[0],
                         D=d, R=r, HALF=rope // 2, BH=max(next_pow2(rope // 2), 2), BP=max(next_pow2(d - rope), 2),
                         RAW_DT=tl_dtype(raw.dtype), ROPE_DT=tl_dtype(rope_dt), SEQS=tables is not None,
                         num_warps=1, **pdl_launch(raw))
