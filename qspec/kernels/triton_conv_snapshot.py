"""Seed Algorithm 5 in Triton: X = S || T^T and every rollback window, from one load of each row.

One program owns BLOCK_C = 128 channel rows (the seed's groups of 128 threads). Each row's s + n
words are loaded once into a [BLOCK_C, W] register tile (W = 16, the seed's V[16]) and every output
is a masked store of that same tile: X at column w, window j at column w - (j + 1) of plane
dest_j. The tensors are passed as int32 views, so the kernel only ever moves 32-bit words and
every f32 bit pattern (NaN payloads, denormals, -0) survives unchanged.

The caller must have accepted the group with `plan_snapshots` (Algorithm 4): destinations in
bounds, pairwise disjoint and disjoint from S, T and X. Under that contract no program reads a
word that another program writes, so there is no ordering hazard between programs.
"""

import torch

from qspec.kernels.conv_snapshot import ROW_DTYPES, ROW_WORDS, _state
from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch, use_triton

BLOCK_C = 128

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, table_pointer

    @triton.jit(do_not_specialize=["k"])  # one compiled kernel per (s, n), whatever k
    def _conv_snapshot_kernel(s_ptr, live_ptr, t_ptr, x_ptr, planes_ptr, dest_ptr, C, k,
                              s_plane, s_row, s_col, t_tok, t_ch, p_plane, p_row, p_col,
                              SW: tl.constexpr, NT: tl.constexpr, W: tl.constexpr,
                              DEST_IS_BASE: tl.constexpr, LIVE: tl.constexpr, T_WORDS: tl.constexpr,
                              BLOCK: tl.constexpr, SEQS: tl.constexpr = False, PDL: tl.constexpr = False):
        pdl_start(PDL)
        if SEQS:  # sequence program_id(1): s_ptr, live_ptr, dest_ptr are tables of its planes' and scalars' addresses
            seq = tl.program_id(1)
            s_ptr = table_pointer(s_ptr, seq, tl.int32)
            planes_ptr = s_ptr
            live_ptr = table_pointer(live_ptr, seq, tl.int64, False)
            dest_ptr = table_pointer(dest_ptr, seq, tl.int64, False)
            t_ptr += seq * NT * t_tok
            x_ptr += seq * C * (SW + NT)
        if LIVE:  # S is plane `live` of a [P, C, s] tensor, chosen on the device (no gather launch)
            s_ptr += tl.load(live_ptr) * s_plane
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r64 = rows.to(tl.int64)[:, None]  # planes can exceed 2^31 words in total
        rmask = (rows < C)[:, None]
        c = tl.arange(0, W)[None, :]
        in_s = c < SW
        in_t = (c >= SW) & (c < SW + NT)
        # column c < s comes from S[row, c], column s + i from T[i, row]; masked lanes never touch memory
        sv = tl.load(s_ptr + r64 * s_row + c * s_col, mask=rmask & in_s, other=0)
        if T_WORDS:
            tv = tl.load(t_ptr + (c - SW) * t_tok + r64 * t_ch, mask=rmask & in_t, other=0)
        else:  # 16-bit activations, widened exactly to f32 and moved as its bits
            tv = tl.load(t_ptr + (c - SW) * t_tok + r64 * t_ch, mask=rmask & in_t, other=0.0)
            tv = tv.to(tl.float32).to(tl.int32, bitcast=True)
        v = tl.where(in_s, sv, tv)  # V[0 : s + n], the row's only load
        tl.store(x_ptr + r64 * (SW + NT) + c, v, mask=rmask & (c < SW + NT))
        for j in range(k):
            if DEST_IS_BASE:
                p = tl.load(dest_ptr) + j
            else:
                p = tl.load(dest_ptr + j)
            win = (c > j) & (c <= j + SW)  # window j = V[j + 1 : j + 1 + s]
            tl.store(planes_ptr + p * p_plane + r64 * p_row + (c - (j + 1)) * p_col, v, mask=rmask & win)


def _check(S: torch.Tensor, T: torch.Tensor, planes: torch.Tensor, dest: torch.Tensor, k: int | None) -> int:
    """Validate shapes (S as [C, s]) and return the window count k."""
    if S.dim() != 2 or T.dim() != 2 or planes.dim() != 3:
        raise ValueError(f"expected S [C, s], T [n, C], planes [P, C, s]; got {tuple(S.shape)}, "
                         f"{tuple(T.shape)}, {tuple(planes.shape)}")
    C, s = S.shape
    n = T.shape[0]
    if T.shape[1] != C or tuple(planes.shape[1:]) != (C, s):
        raise ValueError(f"shape mismatch: S {tuple(S.shape)}, T {tuple(T.shape)}, planes {tuple(planes.shape)}")
    if dest.dtype != torch.int64 or dest.dim() > 1:
        raise ValueError("dest must be an int64 scalar (base plane) or 1-D tensor of planes")
    if dest.dim() == 1:
        if k is not None and k != dest.numel():
            raise ValueError(f"k={k} but dest holds {dest.numel()} planes")
        k = dest.numel()
    elif k is None:
        raise ValueError("a scalar dest (base plane) needs k")
    if not 0 <= k <= n:
        raise ValueError(f"k={k} windows need 0 <= k <= n={n}")
    return k


def conv_snapshot_torch(S: torch.Tensor, T: torch.Tensor, planes: torch.Tensor, dest: torch.Tensor,
                        k: int | None = None, out: torch.Tensor | None = None,
                        live: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: exactly the fused branch of `write_snapshots` (cat, then one index_copy of all windows)."""
    S = _state(S, live)
    k = _check(S, T, planes, dest, k)
    s = S.shape[1]
    X = torch.cat([S, T.t().to(S.dtype)], dim=1, out=out) if out is not None else torch.cat([S, T.t().to(S.dtype)], 1)
    if k:
        idx = dest + torch.arange(k, device=dest.device) if dest.dim() == 0 else dest
        planes.index_copy_(0, idx, X.unfold(1, s, 1)[:, 1:k + 1].permute(1, 0, 2))
    return X


def conv_snapshot_triton(S: torch.Tensor, T: torch.Tensor, planes: torch.Tensor, dest: torch.Tensor,
                         k: int | None = None, out: torch.Tensor | None = None,
                         live: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (Algorithm 5); same contract as `conv_snapshot`."""
    if live is not None:
        if S.dim() != 3 or live.dtype != torch.int64 or live.dim() != 0:
            raise ValueError("with `live`, S must be [P, C, s] and live an int64 device scalar")
        k = _check(S[0], T, planes, dest, k)
        s_plane, S2 = S.stride(0), S[0]
    else:
        k = _check(S, T, planes, dest, k)
        s_plane, S2 = 0, S
    C, s = S2.shape
    n = T.shape[0]
    if S.dtype != torch.float32 or T.dtype not in ROW_DTYPES or planes.dtype != torch.float32:
        raise ValueError("the fused snapshot kernel moves f32 words (T may be 16-bit: widened exactly)")
    if s + n > ROW_WORDS:
        raise ValueError(f"s + n = {s + n} exceeds the {ROW_WORDS}-word row buffer")
    X = out if out is not None else torch.empty(C, s + n, dtype=torch.float32, device=S.device)
    if X.shape != (C, s + n) or X.dtype != torch.float32 or not X.is_contiguous():
        raise ValueError("out must be a contiguous f32 [C, s + n] tensor")
    Si, Xi, Pi = (t.view(torch.int32) for t in (S, X, planes))  # bit-preserving word copies
    Ti = T.view(torch.int32) if T.dtype == torch.float32 else T
    grid = (triton.cdiv(C, BLOCK_C),)
    _conv_snapshot_kernel[grid](
        Si, live if live is not None else dest, Ti, Xi, Pi, dest, C, k,
        s_plane, S2.stride(0), S2.stride(1), T.stride(0), T.stride(1),
        planes.stride(0), planes.stride(1), planes.stride(2),
        SW=s, NT=n, W=max(next_pow2(s + n), 2), DEST_IS_BASE=dest.dim() == 0, LIVE=live is not None,
        T_WORDS=T.dtype == torch.float32,
        BLOCK=BLOCK_C, num_warps=4, **pdl_launch(Si))
    return X


def conv_snapshot_seqs_triton(planes: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                              T: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`conv_snapshot(S=P_b, T_b, P_b, base_b, n, live=live_b)` for B sequences in one launch: sequence b's state is
    plane live_b of its planes P_b, its rows T[b n : (b + 1) n], its windows go to planes base_b + j (j < n) and its
    X to out[b]. planes: sequence 0's P (every P_b has its shape and strides); tables: int64 [B] device tensors of
    the addresses of every P_b, live_b and base_b (state/tables.SequenceTables). The caller guarantees each
    sequence's Algorithm 4 conditions (`plan_step`). -> out [B, C, s + n] f32."""
    B, C, width = out.shape
    s = planes.shape[2]
    n = width - s
    if (planes.dim() != 3 or planes.dtype != torch.float32 or planes.shape[1] != C or T.dim() != 2
            or T.shape != (B * n, C) or T.dtype not in ROW_DTYPES or out.dtype != torch.float32
            or not out.is_contiguous() or n < 1 or width > ROW_WORDS
            or any(t.shape != (B,) or t.dtype != torch.int64 for t in tables)):
        raise ValueError(f"snapshots of {B} sequences: planes {tuple(planes.shape)} {planes.dtype}, rows "
                         f"{tuple(T.shape)} {T.dtype}, out {tuple(out.shape)} {out.dtype}, tables {B} int64 each")
    addresses, live, base = tables
    _conv_snapshot_kernel[(triton.cdiv(C, BLOCK_C), B)](
        addresses, live, T.view(torch.int32) if T.dtype == torch.float32 else T, out.view(torch.int32), addresses,
        base, C, n, planes.stride(0), planes.stride(1), planes.stride(2), T.stride(0), T.stride(1),
        planes.stride(0), planes.stride(1), planes.stride(2),
        SW=s, NT=n, W=max(next_pow2(width), 2), DEST_IS_BASE=True, LIVE=True, T_WORDS=T.dtype == torch.float32,
        BLOCK=BLOCK_C, num_warps=4, SEQS=True, **pdl_launch(out))
    return out


def conv_snapshot(S: torch.Tensor, T: torch.Tensor, planes: torch.Tensor, dest: torch.Tensor,
                  k: int | None = None, out: torch.Tensor | None = None,
                  live: torch.Tensor | None = None) -> torch.Tensor:
    """X = S || T^T ([C, s+n] f32) and planes[dest_j] = X[:, j+1 : j+1+s] for j < k; returns X.

    S [C, s] f32 (any strides), or with `live` (an int64 device scalar) a [P, C, s] tensor whose plane
    `live` is the state (e.g. S = planes, live = rc.live: no index_select launch); T [n, C] f32, bf16 or f16
    (token-major); planes [P, C, s] f32; dest: either a 1-D int64 device tensor of the k destination
    planes, or an int64 device scalar `base` with `k` given (planes base + j, no index tensor to build).
    `out`: optional contiguous f32 [C, s+n] to receive X. The caller guarantees Algorithm 4's
    conditions (see `plan_snapshots`; the state plane must not be a destination). Triton on CUDA
    when s + n <= 16 and S, planes are f32, the torch reference otherwise; both are bit-identical."""
    s, n = S.shape[-1], T.shape[0]
    if use_triton(S) and S.dtype == planes.dtype == torch.float32 and T.dtype in ROW_DTYPES and s + n <= ROW_WORDS:
        return conv_snapshot_triton(S, T, planes, dest, k, out, live)
    return conv_snapshot_torch(S, T, planes, dest, k, out, live)
