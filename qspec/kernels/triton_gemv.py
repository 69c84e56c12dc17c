"""Matrix-vector products in Triton for step-sized inputs: y [M, N] = x [M, K] @ W[N, K]^T, M <= 8.

A decode step multiplies one row by ~80 weight matrices, most of them a few MB: cuBLAS picks GEMM
tiles for them that reach about half of the H200's bandwidth, plus split-K reductions (BENCHMARKS.md §5, the
one-row mat-vec row). This kernel streams W once: a program owns BN output rows and walks K in BK steps; for one
row it keeps a [BN, BK] f32 accumulator of products (no reduction inside the loop), for 2..8 rows it
reduces each row's products per step. Products accumulate in f32 and round once to x's dtype.

`plan` keeps every SM busy (a set number of programs per SM) by narrowing BN (down to 1 row per program)
before it splits K: a split needs a second kernel (`_sum_splits_kernel`, adding f32 partial sums in split
order, deterministic), and on the H200 that launch cost more than the split saved. BK grows as BN shrinks, so each step
still loads ~TILE elements. The plan depends on N and K only, never on M.
"""

import functools
from collections.abc import Callable

import torch

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype

# (most rows per program, elements per K step (TILE), warps, programs wanted per SM)
DEFAULT_CONFIG = (32, 8192, 4, 2)
MAX_ROWS = 8
# Configs measured best for the flash-next step's (N, K) on the H200, weights read from HBM, each shape as a graph
# of 24 calls (python -m qspec.bench.kernels --gemv-sweep -> benchmarks/results/gemv_sweep_h200_s5.txt, each
# shape's default config, tuned config and cuBLAS; BENCHMARKS.md §5, the one-row mat-vec row). Every shape listed beat
# cuBLAS, so ops.linear routes its one-row products here (gemv.eligible); 16480 x 2560 (GDN in: cuBLAS was as fast
# as the best config) is not listed and stays on cuBLAS.
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (328, 10240): (32, 4096, 8, 2),  # hyper-connection mixer in
    (10240, 320): (32, 4096, 8, 2),  # mixer up
    (320, 10240): (32, 4096, 8, 2),  # output mixer in
    (1800, 2560): (32, 4096, 4, 2),  # router + shared expert in
    (2560, 640): (16, 16384, 4, 8),  # shared expert down
    (2560, 6144): (32, 4096, 8, 4),  # GDN / QSA out
    (13952, 2560): (32, 4096, 4, 4),  # QSA in
    (12800, 2560): (32, 4096, 4, 4),  # PLE key/value
    (2560, 5120): (32, 4096, 8, 4),  # MTP eh
    (13312, 2560): (32, 4096, 4, 4),  # MTP attention in (gpu_kernels_mtp_in_sweep_h200_s13.txt)
    (248320, 2560): (32, 8192, 8, 8),  # LM head
}

# Few rows (the tensor-core kernel): (BN, BK, warps, pipeline stages, programs wanted per SM).
DEFAULT_FEW_CONFIG = (64, 128, 4, 4, 1)
# The shapes where its best config beat cuBLAS at 6 rows and at 4 (MTP5's and MTP3's verify), each as a graph of
# 24 calls over copies exceeding the L2 (python -m qspec.bench.kernels --few-sweep ->
# benchmarks/results/gpu_kernels_few_sweep_h200_s9.txt; BENCHMARKS.md §5, the few-row product row). The mixers'
# 328 x 10240 and 320 x 10240 products, the router's 1800 x 2560 and the shared expert's 2560 x 640 stay on cuBLAS
# (it won, or this kernel was within noise of it).
TUNED_FEW: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (16480, 2560): (64, 128, 4, 4, 1),  # GDN in
    (2560, 6144): (64, 128, 4, 4, 1),  # GDN / QSA out
    (13952, 2560): (64, 128, 4, 4, 1),  # QSA in
    (12800, 2560): (64, 128, 4, 4, 1),  # PLE key/value
    (2560, 5120): (64, 128, 4, 4, 1),  # MTP eh
    (13312, 2560): (64, 128, 4, 4, 1),  # MTP attention in (extend; gpu_kernels_mtp_in_sweep_h200_s13.txt)
    (10240, 320): (64, 64, 4, 4, 1),  # mixer up
    (248320, 2560): (64, 128, 4, 3, 1),  # LM head
}
# Shapes where the kernel beats cuBLAS only when launched with PDL (the engine's default on Hopper): PDL shortens the
# kernel's graph-node gap and leaves cuBLAS's as it was. Each shape won at 6, 4 and 2 rows with PDL
# (python -m qspec.bench.kernels --few-ab -> benchmarks/results/gpu_kernels_few_ab_h200_s14.txt; BENCHMARKS.md §5,
# the router + shared-in row); without PDL the kernel loses (the router at 6 rows). The hyper-connection mixers'
# 328 x 10240 stays on cuBLAS (it won at 6 and 4 rows).
TUNED_FEW_PDL: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (1800, 2560): (64, 128, 4, 4, 1),  # router + shared expert in
    (2560, 640): (16, 128, 4, 4, 1),  # shared expert down
    (320, 10240): (32, 128, 4, 4, 1),  # output mixer in
}

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import dot_acc, pdl_start, round_to

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, K_SPLIT, x_m, w_n, y_s, y_m,
                     M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        wrow = w_ptr + n.to(tl.int64)[:, None] * w_n  # [BN, 1]
        kk = tl.arange(0, BK)
        im = tl.arange(0, MP)
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        if M == 1:
            prod = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                k = k0 + kk
                kmask = k < k_hi
                w = tl.load(wrow + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
                prod += w * x[None, :]
            acc = tl.sum(prod, axis=1)[None, :]  # [1, BN]
        else:
            acc = tl.zeros([MP, BN], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                k = k0 + kk
                kmask = k < k_hi
                w = tl.load(wrow + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                for m in tl.static_range(M):
                    x = tl.load(x_ptr + m * x_m + k, mask=kmask, other=0.0).to(tl.float32)
                    p = tl.sum(w * x[None, :], axis=1)
                    acc = tl.where(im[:, None] == m, acc + p[None, :], acc)
        out = y_ptr + tl.program_id(1) * y_s + im[:, None] * y_m + n[None, :]
        tl.store(out, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=(im[:, None] < M) & nmask[None, :])

    @triton.jit
    def _gemm_few_kernel(x_ptr, w_ptr, y_ptr, N, K, K_SPLIT, x_m, w_n, y_s, y_m,
                         M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                         OUT_DT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        # 2..8 rows: x^T padded to 16 columns, so each K step is one tensor-core product [BN, BK] @ [BK, 16]
        # and the loop does no per-row reductions (the mat-vec kernel's M > 1 path spent its time on those).
        pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        wrow = w_ptr + n.to(tl.int64)[:, None] * w_n  # [BN, 1]
        kk = tl.arange(0, BK)
        im = tl.arange(0, 16)
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        acc = tl.zeros([BN, 16], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
            k = k0 + kk
            kmask = k < k_hi
            w = tl.load(wrow + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_ptr + im[None, :] * x_m + k[:, None], mask=(im[None, :] < M) & kmask[:, None], other=0.0)
            acc = dot_acc(w, xt, acc, UPCAST)
        out = y_ptr + tl.program_id(1) * y_s + im[None, :] * y_m + n[:, None]
        tl.store(out, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=nmask[:, None] & (im[None, :] < M))

    @triton.jit
    def _sum_splits_kernel(p_ptr, y_ptr, MN, S, p_s, OUT_DT: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        pdl_start(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(S):
            acc += tl.load(p_ptr + s * p_s + i, mask=mask, other=0.0)
        tl.store(y_ptr + i, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan(N: int, K: int, max_bn: int, tile: int, programs: int) -> tuple[int, int, int, int]:
    """(BN, BK, SPLIT, K_SPLIT): at least `programs` programs where the rows allow, each K share a whole
    number of BK steps."""
    bn = max_bn
    while bn > 1 and cdiv(N, bn) < programs:
        bn //= 2
    return (bn, *plan_k(N, K, bn, tile // bn, programs))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_k(N: int, K: int, bn: int, bk: int, programs: int) -> tuple[int, int, int]:
    """(BK, SPLIT, K_SPLIT) for BN rows per program (`plan` narrows BN first; the few-rows kernel keeps it, as its
    tensor-core tile needs >= 16 rows): K splits until there are about `programs` programs, each share a whole
    number of BK steps."""
    bk = max(16, min(bk, next_pow2(K)))
    blocks = cdiv(N, bn)
    split = 1 if blocks >= programs else min(cdiv(programs, blocks), cdiv(K, bk))
    k_split = cdiv(cdiv(K, split), bk) * bk
    return bk, cdiv(K, k_split), k_split


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    M, K = x.shape
    if not 0 < M <= MAX_ROWS or w.shape != (w.shape[0], K) or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} stride {x.stride()}, w {tuple(w.shape)} stride {w.stride()}")


def gemv_triton(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= 8, last dim contiguous) @ w [N, K]^T (rows contiguous) -> [M, N] in x.dtype, by the
    mat-vec kernel (any M; the one the engine uses for one row).
    config: (max rows per program, TILE, warps, programs per SM); default: TUNED for (N, K), else DEFAULT_CONFIG."""
    _check(x, w)
    M, K = x.shape
    N = w.shape[0]
    max_bn, tile, warps, per_sm = config or TUNED.get((N, K), DEFAULT_CONFIG)
    bn, bk, split, k_split = plan(N, K, max_bn, tile, per_sm * _sm_count(x.device.index or 0))
    mp = 1 if M == 1 else triton.next_power_of_2(M)

    def launch(y: torch.Tensor, y_s: int, dt: object) -> None:
        _gemv_kernel[(triton.cdiv(N, bn), split)](x, w, y, N, K, k_split, x.stride(0), w.stride(0), y_s, y.stride(-2),
                                                  M=M, MP=mp, BN=bn, BK=bk, OUT_DT=dt, num_warps=warps, **pdl_launch(x))
    return _with_splits(x, N, split, launch)


def gemm_few_triton(x: torch.Tensor, w: torch.Tensor,
                    config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (2 <= M <= 8 in practice) @ w [N, K]^T -> [M, N] in x.dtype through tensor cores (a verify step's
    rows). config: (BN, BK, warps, pipeline stages, programs per SM); default: TUNED_FEW or TUNED_FEW_PDL for
    (N, K), else DEFAULT_FEW_CONFIG."""
    _check(x, w)
    M, K = x.shape
    N = w.shape[0]
    bn, bk, warps, stages, per_sm = config or TUNED_FEW.get((N, K)) or TUNED_FEW_PDL.get((N, K), DEFAULT_FEW_CONFIG)
    bk, split, k_split = plan_k(N, K, bn, bk, per_sm * _sm_count(x.device.index or 0))

    def launch(y: torch.Tensor, y_s: int, dt: object) -> None:
        _gemm_few_kernel[(triton.cdiv(N, bn), split)](x, w, y, N, K, k_split, x.stride(0), w.stride(0), y_s,
                                                      y.stride(-2), M=M, BN=bn, BK=bk, STAGES=stages, OUT_DT=dt,
                                                      UPCAST=INTERPRET, num_warps=warps, **pdl_launch(x))
    return _with_splits(x, N, split, launch)


def _with_splits(x: torch.Tensor, N: int, split: int,
                 launch: Callable[[torch.Tensor, int, object], None]) -> torch.Tensor:
    """Run `launch` into y directly, or into f32 partial sums per K share that a second kernel adds in order."""
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    dt = tl_dtype(x.dtype)
    if split == 1:
        launch(y, 0, dt)
        return y
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    launch(part, part.stride(0), tl.float32)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(M * N, block),)](part, y, M * N, split, part.stride(0), OUT_DT=dt, BLOCK=block,
                                                     **pdl_launch(part))
    return y
