"""The n-gram table in page-locked host memory, gathered by the GPU itself: a PLE step with no host work.

`HostRowTable.gather` (the fallback) moves the row indices to the host, indexes the mmap with numpy and copies the
rows back: a synchronisation per step, so a model with a host table cannot run its steps as CUDA graphs.
`PinnedRowTable` copies the table's raw rows once, at load, into page-locked memory; each step a Triton kernel
reads the requested rows straight from host memory over PCIe (kernels/row_gather.py) and the torch dequantizer
expands them on the device, both capturable.

Why a copy into allocations of our own rather than registering the file's mapping (cudaHostRegister with
cudaHostRegisterReadOnly): registering a read-only file mapping depends on the platform (the device must report
host-register-read-only support, and long-term pins of page-cache pages are refused by some kernels), a failed
cudaHostRegister leaves an error that the next unrelated CUDA call reports, and the pages stay page cache the
system may want back. Allocations from torch's page-locked allocator (cudaHostAlloc: mapped and portable under
unified addressing, so their host addresses are valid on the device) fail cleanly as a torch error.

Why pieces of at most 1 GiB rather than one buffer: torch's page-locked allocator rounds a request up to a power of
two, so the real table (320 M rows x 170 bytes, 54.4 GB at Q8_0) would take 64 GiB as one buffer; in 1 GiB pieces
of whole rows the loss is under a row per piece. The copy goes one piece at a time (bounded memory beyond the table
itself) and `pin_seconds` records how long it took.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from qspec.kernels.row_gather import RowPieces, gather_rows
from qspec.weights.dequant import SUPPORTED_QTYPES, WeightsError, dequantize, qtype_nbytes

PIECE_BYTES = 1 << 30
# host memory left to everything else after the copy (activations of the loader, the page cache of the other tensors)
HOST_MARGIN_BYTES = 8 << 30


class PinError(RuntimeError):
    """The table cannot be pinned here (no CUDA, too little host memory, allocation refused); the message says why."""


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (free plus reclaimable page cache); physical pages where there is no such file."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _copy_rows(dst: torch.Tensor, segments: Sequence[np.ndarray], starts: np.ndarray, first: int) -> None:
    """Rows [first, first + len(dst)) of the table stacked from `segments` (uint8 [rows, row_bytes]) into dst."""
    done = 0
    while done < dst.shape[0]:
        row = first + done
        s = int(np.searchsorted(starts, row, side="right")) - 1
        lo = row - int(starts[s])
        n = min(dst.shape[0] - done, segments[s].shape[0] - lo)
        with warnings.catch_warnings():  # a read-only mmap: torch warns that the array is not writable; it is read
            warnings.simplefilter("ignore", UserWarning)
            dst[done:done + n].copy_(torch.from_numpy(segments[s][lo:lo + n]))
        done += n


def pin_segments(segments: Sequence[np.ndarray], row_bytes: int, *, pin: bool = True,
                 piece_bytes: int = PIECE_BYTES) -> tuple[list[torch.Tensor], int]:
    """The rows of `segments` (uint8 [rows, row_bytes] each, stacked) copied into pieces of whole rows of at most
    `piece_bytes`, page-locked when `pin`. Returns (pieces, rows per piece). Raises PinError when the host memory
    (MemAvailable less HOST_MARGIN_BYTES) cannot hold the copy or the allocator refuses a piece."""
    starts = np.cumsum([0] + [s.shape[0] for s in segments])
    total = int(starts[-1])
    need = total * row_bytes
    if pin and need + HOST_MARGIN_BYTES > (free := available_host_bytes()):
        raise PinError(f"pinning the n-gram table needs {need / 1e9:.1f} GB of host memory and "
                       f"{HOST_MARGIN_BYTES / 1e9:.0f} GB to spare; {free / 1e9:.1f} GB is available")
    per = max(1, piece_bytes // row_bytes)
    pieces: list[torch.Tensor] = []
    try:
        for first in range(0, max(total, 1), per):
            p = torch.empty(min(per, total - first), row_bytes, dtype=torch.uint8, pin_memory=pin)
            _copy_rows(p, segments, starts, first)
            pieces.append(p)
    except RuntimeError as e:  # cudaHostAlloc refused (locked-memory limits, fragmentation)
        n = len(pieces)
        pieces.clear()
        _release_pinned()
        raise PinError(f"page-locked allocation of piece {n} of the n-gram table failed: {e}") from e
    return pieces, per


def _release_pinned() -> None:
    """Return the cached page-locked blocks to the system (torch keeps freed ones for reuse)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None)  # torch >= 2.9
    if empty is not None and torch.cuda.is_available():
        empty()


class PinnedRowTable:
    """A [rows, cols] n-gram table as raw GGML rows (F32/F16/BF16 or whole quant blocks per row) in host memory that
    the device reads directly; `gather` is a kernel and the dequantizer, with no host step (CUDA-graph safe)."""

    def __init__(self, table: RowPieces, qtype: GGMLQuantizationType, cols: int, pin_seconds: float = 0.0) -> None:
        self.qtype = GGMLQuantizationType(qtype)
        if self.qtype not in SUPPORTED_QTYPES:
            raise WeightsError(f"n-gram table: unsupported quant type {self.qtype.name}")
        self.cols = int(cols)
        self.row_bytes = qtype_nbytes(self.qtype, (self.cols,))
        if table.row_bytes != self.row_bytes:
            raise WeightsError(f"n-gram table: rows of {table.row_bytes} bytes, {self.qtype.name} x {self.cols} "
                               f"needs {self.row_bytes}")
        self.table = table
        self.shape = (table.n_rows, self.cols)
        self.pin_seconds = pin_seconds

    @classmethod
    def from_segments(cls, segments: Sequence[np.ndarray], qtype: GGMLQuantizationType, cols: int,
                      device: torch.device | str, *, pin: bool | None = None,
                      piece_bytes: int = PIECE_BYTES) -> PinnedRowTable:
        """Copy raw row segments (e.g. `HostRowTable.segments`, an mmap) into pieces gathered on `device`.
        pin (None: when `device` is CUDA) page-locks them; unpinned pieces serve the CPU (tests, the interpreter)."""
        device = torch.device(device)
        pin = device.type == "cuda" if pin is None else pin
        if pin and not torch.cuda.is_available():
            raise PinError("page-locked memory needs CUDA")
        t0 = time.perf_counter()
        pieces, per = pin_segments(segments, qtype_nbytes(GGMLQuantizationType(qtype), (int(cols),)), pin=pin,
                                   piece_bytes=piece_bytes)
        return cls(RowPieces.of(pieces, per, device), qtype, cols, time.perf_counter() - t0)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def gather(self, rows: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` (any shape of ints, on the gathering device) as `rows.shape + (cols,)` in dtype on `device`.
        A row outside the table reads as zeros (kernels/row_gather.py says why it does not raise)."""
        raw = gather_rows(self.table, rows.reshape(-1))
        out = dequantize(raw, self.qtype, (raw.shape[0], self.cols), dtype)
        return out.reshape(*rows.shape, self.cols).to(device)

    def __repr__(self) -> str:
        return (f"PinnedRowTable(shape={self.shape}, qtype={self.qtype.name}, pieces={len(self.table.pieces)}, "
                f"pinned in {self.pin_seconds:.1f} s)")
