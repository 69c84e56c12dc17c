"""Row gather in Triton: program (i, j) copies bytes [j*BLOCK, (j+1)*BLOCK) of table row rows[i] into out[i].

The table's pieces are passed as int64 addresses (a device tensor, one per piece) and turned into pointers in the
kernel with an integer-to-pointer cast. Why addresses rather than tensor arguments: a table is tens of pieces (one
host allocation each, see weights/pinned.py), and a kernel takes a fixed argument list; a single-piece table could be
passed as a pinned CPU tensor (Triton's launcher accepts one since it asks the driver for its device address), but
one code path for every table is simpler. The cast works the same under the CPU interpreter, whose pointers are host
addresses, so CI runs this very kernel.

Rows are read as bytes: a row is not a multiple of 4 bytes in general (170 for a Q8_0 row of 160) and its start is
not aligned, and the traffic of a step (16 rows of 170 bytes per token) is latency-bound, not width-bound. A table of
16-byte rows in 16-byte aligned pieces (a batch's pooled indexer keys, RowPieces.aligned) is read 16 bytes a load.
"""

import torch

from qspec.kernels.row_gather import RowPieces
from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch

MAX_BLOCK = 1024  # bytes one program copies; longer rows take several programs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, table_pointer

    @triton.jit
    def _gather_rows_kernel(bases_ptr, rows_ptr, out_ptr, n_rows, rows_per_piece, R: tl.constexpr,
                            BLOCK: tl.constexpr, LEADING: tl.constexpr = 0, ALIGNED: tl.constexpr = False,
                            PDL: tl.constexpr = False):
        pdl_start(PDL)
        i = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if LEADING:  # output row i: row i % LEADING of piece i // LEADING (rows_ptr unread)
            row = (i // LEADING).to(tl.int64) * rows_per_piece + i % LEADING
        else:
            row = tl.load(rows_ptr + i).to(tl.int64)
        ok = (row >= 0) & (row < n_rows)
        row = tl.where(ok, row, 0)  # an out-of-range row reads nothing (masked below) and writes zeros
        piece = row // rows_per_piece
        base = table_pointer(bases_ptr, piece, tl.uint8, ALIGNED)  # aligned: 16-byte loads
        x = tl.load(base + (row - piece * rows_per_piece) * R + c, mask=c < tl.where(ok, R, 0), other=0)
        tl.store(out_ptr + i.to(tl.int64) * R + c, x, mask=c < R)


def gather_rows_triton(table: RowPieces, rows: torch.Tensor | None, leading: int = 0) -> torch.Tensor:
    """rows [N] on table.bases' device -> uint8 [N, row_bytes] there (checked in row_gather.gather_rows); with
    `leading` (rows None), the first `leading` rows of every piece, piece by piece."""
    R = table.row_bytes
    N = len(table.pieces) * leading if leading else rows.shape[0]
    out = torch.empty(N, R, dtype=torch.uint8, device=table.bases.device)
    block = min(MAX_BLOCK, next_pow2(R))
    _gather_rows_kernel[(N, triton.cdiv(R, block))](
        table.bases, table.bases if rows is None else rows, out, table.n_rows, table.rows_per_piece, R=R,
        BLOCK=block, num_warps=1 if block <= 256 else 4, LEADING=leading, ALIGNED=table.aligned, **pdl_launch(out))
    return out
