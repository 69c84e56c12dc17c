"""Row argmax in Triton, two launches: grid (M, chunks) finds each chunk's largest key and its first index, then
grid (M,) picks the largest of a row's chunk winners, the lowest index among equal keys.

Values map to order-preserving int32 keys: the float's bits, with the low 31 bits flipped for negative numbers;
-0 is first turned into +0 (torch compares them equal) and every NaN into the largest key (torch's argmax
returns the first NaN). So equal keys are exactly torch's equal values and the first index wins, as in torch.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch

CHUNK = 2048  # elements per program of the first pass: a 248,320-entry row spreads over 122 programs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, key_ptr, idx_ptr, V, x_m, NC, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        m = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        valid = i < V
        x = tl.load(x_ptr + m * x_m + i, mask=valid, other=0.0).to(tl.float32) + 0.0  # -0 + 0 = +0
        b = x.to(tl.int32, bitcast=True)
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        key = tl.where(x != x, 0x7FFFFFFF, key)
        key = tl.where(valid, key, -2147483648)
        best = tl.max(key, axis=0)
        first = tl.min(tl.where(valid & (key == best), i, 2147483647), axis=0)
        tl.store(key_ptr + m * NC + c, best)
        tl.store(idx_ptr + m * NC + c, first)

    @triton.jit
    def _argmax_rows_kernel(key_ptr, idx_ptr, o_ptr, NC, NCP: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        m = tl.program_id(0)
        c = tl.arange(0, NCP)
        valid = c < NC
        key = tl.load(key_ptr + m * NC + c, mask=valid, other=-2147483648)
        idx = tl.load(idx_ptr + m * NC + c, mask=valid, other=2147483647)
        best = tl.max(key, axis=0)
        first = tl.min(tl.where(valid & (key == best), idx, 2147483647), axis=0)
        tl.store(o_ptr + m, first.to(tl.int64))


def argmax_rows_triton(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """x [M, V] float, last dim contiguous (checked by argmax.argmax_rows) -> int64 [M]."""
    M, V = x.shape
    nc = triton.cdiv(V, chunk)
    keys = torch.empty(M, nc, dtype=torch.int32, device=x.device)
    idx = torch.empty(M, nc, dtype=torch.int32, device=x.device)
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(M, nc)](x, keys, idx, V, x.stride(0), nc, BLOCK=chunk, num_warps=4, **pdl_launch(x))
    _argmax_rows_kernel[(M,)](keys, idx, out, nc, NCP=max(next_pow2(nc), 2), num_warps=1, **pdl_launch(keys))
    return out
