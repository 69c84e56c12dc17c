"""Step-sized matrix products: y = x @ W^T for one row of 16-bit activations and weights.

`gemv` launches the Triton kernel (triton_gemv.py) on CUDA and falls back to `gemv_torch`
(`F.linear`, the reference) elsewhere. It is registered as the custom op `qspec::gemv` so that the
fused step functions (torch.compile, model/fuse.py) call it as one opaque kernel instead of
lowering the product to cuBLAS; `ops.linear` routes eligible products to it (`eligible`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from qspec.kernels import triton_common
from qspec.kernels.triton_common import module_flag, triton_enabled, use_triton
from qspec.kernels.triton_gemv import TUNED, TUNED_FEW, TUNED_FEW_PDL

# One row goes to the mat-vec kernel; 2..8 rows (verify and extend steps) to the tensor-core kernel, on the
# shapes where it beat cuBLAS (triton_gemv.TUNED_FEW). The mat-vec's own 2..8-row path lost to cuBLAS (gdn in,
# 6 rows, in benchmarks/results/gpu_kernels_h200_s3b.txt) and is not routed to.
MAX_ROWS = 8
DTYPES = (torch.bfloat16, torch.float16)
# A module flag rather than an environment lookup inside traced code: dynamo guards on its value, so
# flipping it (`enabled_mode`, the engine's `gemv` option for A/B runs) recompiles instead of misrunning.
_ON = triton_enabled()


def enabled_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Route eligible products to the mat-vec (on) or leave them all to cuBLAS (off) inside the block."""
    return module_flag(__name__, "_ON", on and triton_enabled())


# Checks only (tests/test_gpu_engine.py): every 2..MAX_ROWS-row product that fits goes to the few-rows kernel, so that a
# small test model, none of whose shapes are in TUNED_FEW, runs it inside its steps. A module flag, as _ON.
_FEW_EVERYWHERE = False


def few_rows_everywhere() -> contextlib.AbstractContextManager[None]:
    """Inside the block, route every few-row product the kernel takes to it, not only TUNED_FEW's shapes."""
    return module_flag(__name__, "_FEW_EVERYWHERE", True)


def is_on() -> bool:
    """Whether one-row products (and the other one-row kernels that read weights: kernels/hc_mix.py) use Triton."""
    return _ON


def gemv_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _fits(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    """What the kernel takes: 1..MAX_ROWS rows, x and w in the same 16-bit dtype, w a matrix with contiguous rows."""
    return (0 < rows <= MAX_ROWS and x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2
            and w.stride(1) == 1)


# Which matrices the kernel beats cuBLAS on, from CUDA-graph replays on the H200 at one row
# (benchmarks/results/gpu_kernels_h200_s4_graph.txt; BENCHMARKS.md §5, the one-row mat-vec row): it wins on the small
# ones (640 x 10240, 1793 x 2560, 2560 x 640) and on the LM head (248320 x 2560), and loses on the mid-sized ones
# (2560 x 5120, 2560 x 6144, 14000 x 2560, 16480 x 2560), whose few hundred row blocks leave the last wave of
# programs short.
SMALL_ELEMENTS = 8 << 20
WIDE_ROWS = 1 << 16


def few_rows_routed(shape: tuple[int, int]) -> bool:
    """Whether a 2..MAX_ROWS-row product with a weight of this (N, K) goes to the few-rows kernel (on CUDA):
    TUNED_FEW's shapes, and TUNED_FEW_PDL's inside triton_common.pdl_mode (the engine enters it only on a GPU that
    has PDL)."""
    return _FEW_EVERYWHERE or shape in TUNED_FEW or (triton_common._PDL and shape in TUNED_FEW_PDL)


def eligible(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    """Whether ops.linear sends x [rows, K] @ w^T to the custom op: switched on, CUDA, a shape the kernel takes,
    and a matrix it is faster on than cuBLAS (small, as wide as an LM head, or a shape whose tuned config
    beat cuBLAS in the sweep: triton_gemv.TUNED, TUNED_FEW, and TUNED_FEW_PDL where the launches use PDL)."""
    if not (_ON and x.is_cuda and _fits(x, w, rows)):
        return False
    if rows > 1:
        return few_rows_routed((w.shape[0], w.shape[1]))
    return w.numel() <= SMALL_ELEMENTS or w.shape[0] >= WIDE_ROWS or (w.shape[0], w.shape[1]) in TUNED


@torch.library.custom_op("qspec::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x.dtype; on CUDA the mat-vec kernel for one row, the tensor-core kernel
    for 2..MAX_ROWS rows."""
    if use_triton(x) and _fits(x, w, x.shape[0]):
        from qspec.kernels.triton_gemv import gemm_few_triton, gemv_triton

        x = x if x.stride(1) == 1 else x.contiguous()
        return gemv_triton(x, w) if x.shape[0] == 1 else gemm_few_triton(x, w)
    return gemv_torch(x, w)


@gemv.register_fake
def _gemv_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])
