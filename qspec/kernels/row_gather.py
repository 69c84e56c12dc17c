"""Gathering raw table rows from page-locked host memory into a device buffer (the PLE n-gram table).

The table is split into pieces of `rows_per_piece` rows (every piece but the last full), each one page-locked host
allocation; `bases` holds the pieces' addresses as int64 on the gathering device. `gather_rows_torch` is the
reference: it indexes the piece tensors on the host. On CUDA `gather_rows` runs one Triton launch
(triton_row_gather.py) that reads the rows straight from host memory over PCIe: with unified virtual addressing a
pinned allocation's host address is valid on the device, so nothing runs on the host per call and the gather can be
captured in a CUDA graph (the reference needs the row indices on the host, a synchronisation no graph can hold).

Rows outside [0, n_rows) come back as zero bytes in both (every supported type dequantizes zero bytes to zeros):
the kernel cannot raise without a host synchronisation, and an unchecked read would fault the device. The n-gram
rows (model/ple.ngram_rows) are in range by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qspec.kernels.triton_common import use_triton


@dataclass
class RowPieces:
    """A [n_rows, row_bytes] uint8 table held as consecutive pieces of `rows_per_piece` rows."""
    pieces: list[torch.Tensor]  # [rows, row_bytes] uint8 (page-locked on CUDA machines)
    rows_per_piece: int
    bases: torch.Tensor  # int64 [len(pieces)]: each piece's address, on the device that gathers

    def __post_init__(self) -> None:
        if not self.pieces:
            raise ValueError("row gather: a table needs at least one piece")
        rb = self.pieces[0].shape[1]
        for i, p in enumerate(self.pieces):
            full = i < len(self.pieces) - 1
            if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != rb or not p.is_contiguous() \
                    or (full and p.shape[0] != self.rows_per_piece) or p.shape[0] > self.rows_per_piece:
                raise ValueError(f"row gather: piece {i} is {tuple(p.shape)} {p.dtype}, expected contiguous uint8 "
                                 f"[{self.rows_per_piece}{'' if full else ' or fewer'}, {rb}]")
        if self.bases.dtype != torch.int64 or self.bases.shape != (len(self.pieces),):
            raise ValueError(f"row gather: bases must be int64 [{len(self.pieces)}], got {tuple(self.bases.shape)} "
                             f"{self.bases.dtype}")

    @property
    def row_bytes(self) -> int:
        return int(self.pieces[0].shape[1])

    @property
    def aligned(self) -> bool:
        """Whether every piece starts on a 16-byte address and rows are a multiple of 16 bytes (then every row is
        16-byte aligned, and the gather kernel reads it 16 bytes a load)."""
        return self.row_bytes % 16 == 0 and all(p.data_ptr() % 16 == 0 for p in self.pieces)

    @property
    def n_rows(self) -> int:
        return (len(self.pieces) - 1) * self.rows_per_piece + int(self.pieces[-1].shape[0])

    @classmethod
    def of(cls, pieces: list[torch.Tensor], rows_per_piece: int, device: torch.device | str) -> RowPieces:
        return cls(pieces, rows_per_piece, torch.tensor([p.data_ptr() for p in pieces], dtype=torch.int64,
                                                        device=device))


def gather_rows_torch(table: RowPieces, rows: torch.Tensor) -> torch.Tensor:
    """rows [N] (ints, any device) -> uint8 [N, row_bytes] on rows' device; out-of-range rows are zeros."""
    idx = rows.reshape(-1).to(device="cpu", dtype=torch.int64)
    ok = (idx >= 0) & (idx < table.n_rows)
    idx = torch.where(ok, idx, 0)
    piece, local = idx // table.rows_per_piece, idx % table.rows_per_piece
    out = torch.zeros(idx.shape[0], table.row_bytes, dtype=torch.uint8)
    for p in piece[ok].unique().tolist():
        m = ok & (piece == p)
        out[m] = table.pieces[p][local[m]]
    return out.to(rows.device)


def gather_rows(table: RowPieces, rows: torch.Tensor) -> torch.Tensor:
    """As `gather_rows_torch`; one Triton launch where rows are on CUDA (and under the interpreter), which needs
    `table.bases` on rows' device and the pieces page-locked (CUDA) or on the CPU (interpreter)."""
    if use_triton(rows) and rows.numel() > 0 and table.bases.device == rows.device:
        from qspec.kernels.triton_row_gather import gather_rows_triton

        return gather_rows_triton(table, rows.reshape(-1))
    return gather_rows_torch(table, rows)


def gather_leading_rows(table: RowPieces, n: int) -> torch.Tensor:
    """The first n rows of every piece, piece by piece -> uint8 [pieces * n, row_bytes] on table.bases' device: one
    Triton launch there (CUDA, the interpreter), the pieces' own rows otherwise. A batch's sequences each keep a
    table of their own (a piece each: state/tables.SequenceTables), and a step reads the first n of each."""
    if not 0 < n <= min(p.shape[0] for p in table.pieces):
        raise ValueError(f"row gather: the first {n} rows of pieces of {[p.shape[0] for p in table.pieces]}")
    if use_triton(table.bases):
        from qspec.kernels.triton_row_gather import gather_rows_triton

        return gather_rows_triton(table, None, leading=n)
    return torch.cat([p[:n] for p in table.pieces]).to(table.bases.device)
