"""A GGUF-quantized weight kept as its raw blocks: what the loader hands the model instead of a 16-bit tensor.

`QuantWeight.raw` holds each row's ggml blocks as stored in the file (uint8, [*lead, N, row_bytes]); `shape` is the
logical torch shape (*lead, N, K). Rows are independent runs of whole blocks, so row slices, expert slices and
row-wise concatenation need no re-encoding. The products that read the blocks live in kernels/qmatmul.py; this
module only describes and reshapes the bytes, and expands them (`dequantize`, the kernels' reference).

Q6_K, Q8_0, Q5_0 and Q4_0 rows may instead be held in planes (`planes`, `to_planes`): the same bytes of each row
regrouped part by part, every block's part after the other blocks' same part (Q6_K: ql, qh, scales, d; Q8_0 and
Q4_0: qs, d; Q5_0: qs, qh, d), each plane starting on 16 bytes and the row padded to a multiple of 16. In the
file's order these blocks (210, 34, 22, 18 bytes) leave their parts only 2-byte aligned; in planes every run of a
block's quants starts on 16 bytes and the kernels read it with 16-byte loads (BENCHMARKS.md §5b). Rows stay
independent runs, so row slices and row concatenation still need no re-encoding. The kernels know a weight in
planes by its type number, PLANES + the GGML type (`code`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.weights.dequant import WeightsError, dequantize

# The block types kept packed on the device (llama.cpp's Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold these; llama.cpp
# stores a K-quant tensor whose rows are not whole 256-weight super-blocks, such as the experts' 640-wide down
# projections, as Q5_0 / Q5_1 / Q8_0 instead, and older files use Q4_1); any other type is expanded to 16 bits at load.
PACKED_QTYPES: frozenset[GGMLQuantizationType] = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})


# The kernels' type number of rows held in planes: PLANES + the GGML type (GGML's numbers are below 64).
PLANES = 100
_Q6K = GGMLQuantizationType.Q6_K
Q6_K_PLANES = PLANES + int(_Q6K)
# Each type held in planes: its block's parts as byte ranges, in the order of the planes.
_PLANE_AT: dict[GGMLQuantizationType, tuple[tuple[int, int], ...]] = {
    _Q6K: ((0, 128), (128, 192), (192, 208), (208, 210)),  # ql, qh, int8 scales, d
    GGMLQuantizationType.Q8_0: ((2, 34), (0, 2)),  # qs, d
    GGMLQuantizationType.Q5_0: ((6, 22), (2, 6), (0, 2)),  # qs, qh, d
    GGMLQuantizationType.Q4_0: ((2, 18), (0, 2)),  # qs, d
}
PLANES_QTYPES = frozenset(_PLANE_AT)
PLANES_BLOCK32 = PLANES_QTYPES - {_Q6K}  # the 32-weight block types among them


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def row_bytes(qtype: GGMLQuantizationType, k: int, planes: bool = False) -> int:
    """Bytes of one row of k weights (in planes: each plane padded to a multiple of 16); k must hold whole blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise WeightsError(f"{qtype.name}: row length {k} is not a multiple of the block size {block}")
    if not planes:
        return k // block * size
    return sum(_pad16(k // block * (hi - lo)) for lo, hi in _plane_layout(qtype))


def _plane_layout(qtype: GGMLQuantizationType) -> tuple[tuple[int, int], ...]:
    if qtype not in _PLANE_AT:
        raise WeightsError(f"only {', '.join(q.name for q in _PLANE_AT)} rows are held in planes, not {qtype.name}")
    return _PLANE_AT[qtype]


def _plane_bytes(qtype: GGMLQuantizationType, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst): byte src[i] of a row in the file's order is byte dst[i] of the row in planes (every byte but the
    planes' padding)."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = k // block
    blk = torch.arange(nb, device=device)[:, None]
    src, dst, at = [], [], 0
    for lo, hi in _plane_layout(qtype):
        part = torch.arange(hi - lo, device=device)[None, :]
        src.append((blk * size + lo + part).reshape(-1))
        dst.append((at + blk * (hi - lo) + part).reshape(-1))
        at += _pad16(nb * (hi - lo))
    return torch.cat(src), torch.cat(dst)


def _regroup(raw: torch.Tensor, qtype: GGMLQuantizationType, k: int, into_planes: bool,
             chunk_rows: int = 1 << 14) -> torch.Tensor:
    """Rows raw [..., row bytes] between the file's order and planes, a chunk of rows at a time (bounded scratch)."""
    src, dst = _plane_bytes(qtype, k, raw.device)
    take, put = (src, dst) if into_planes else (dst, src)
    flat = raw.reshape(-1, raw.shape[-1])
    # a storage of its own in the weight's shape (not a view: compiled functions guard on a view's base)
    out = torch.zeros(*raw.shape[:-1], row_bytes(qtype, k, into_planes), dtype=torch.uint8, device=raw.device)
    rows = out.view(-1, out.shape[-1])
    for r in range(0, flat.shape[0], chunk_rows):
        rows[r:r + chunk_rows, put] = flat[r:r + chunk_rows][:, take]
    return out


@dataclass(frozen=True, eq=False)
class QuantWeight:
    raw: torch.Tensor  # uint8 [*lead, N, row_bytes(qtype, K, planes)]
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # (*lead, N, K)
    planes: bool = False  # rows held in planes (module docstring), else in the file's order

    def __post_init__(self) -> None:
        qt = GGMLQuantizationType(self.qtype)
        if qt not in PACKED_QTYPES:
            raise WeightsError(f"{qt.name} is not kept packed (packed types: "
                               f"{', '.join(sorted(q.name for q in PACKED_QTYPES))})")
        if self.planes:
            _plane_layout(qt)
        want = (*self.shape[:-1], row_bytes(qt, self.shape[-1], self.planes))
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != want:
            raise WeightsError(f"{qt.name} weight of shape {self.shape} needs uint8 raw {want}, "
                               f"got {self.raw.dtype} {tuple(self.raw.shape)}")

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: Sequence[int]) -> QuantWeight:
        """From a tensor's bytes in file order (any uint8 shape with the right number of bytes). The blocks get a
        storage of their own when `raw` had another shape: compiled functions guard on a view's base, so weights
        loaded, generated or quantized must all look alike to them (qspec/compile_ahead.py relies on it)."""
        shape = tuple(int(s) for s in shape)
        qt = GGMLQuantizationType(qtype)
        want = (*shape[:-1], row_bytes(qt, shape[-1]))
        blocks = raw if tuple(raw.shape) == want else raw.reshape(want)  # reshape to the same shape is a view too
        return cls(blocks.clone() if blocks._base is not None else blocks, qt, shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def code(self) -> int:
        """The kernels' type number: the GGML type, or PLANES + it for rows in planes."""
        return PLANES + int(self.qtype) if self.planes else int(self.qtype)

    def to_planes(self) -> QuantWeight:
        """The weight with its rows in planes (the same values; itself if already so)."""
        if self.planes:
            return self
        _plane_layout(self.qtype)
        return QuantWeight(_regroup(self.raw, self.qtype, self.shape[-1], True), self.qtype, self.shape, True)

    def to_blocks(self) -> QuantWeight:
        """The weight with its rows in the file's order (itself if already so)."""
        if not self.planes:
            return self
        return QuantWeight(_regroup(self.raw, self.qtype, self.shape[-1], False), self.qtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights expanded to `dtype` (the products' reference, and the fallback for small parts)."""
        blocks = self.to_blocks()
        return dequantize(blocks.raw, self.qtype, self.shape, dtype)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.raw.to(device), self.qtype, self.shape, self.planes)

    def __getitem__(self, i: int) -> QuantWeight:
        """Expert i of a stacked [E, N, K] weight (a view: no copy)."""
        if len(self.shape) < 3:
            raise IndexError("only stacked (expert) weights are indexed")
        return QuantWeight(self.raw[i], self.qtype, self.shape[1:], self.planes)

    def experts(self, start: int, stop: int) -> QuantWeight:
        """Experts start:stop of a stacked [E, N, K] weight (a view: no copy)."""
        if len(self.shape) < 3:
            raise IndexError("only stacked (expert) weights have experts")
        return QuantWeight(self.raw[start:stop], self.qtype, (stop - start, *self.shape[1:]), self.planes)

    def rows(self, start: int, stop: int) -> QuantWeight:
        """Rows start:stop of the second-to-last dim (the halves of a fused gate_up tensor), contiguous."""
        return QuantWeight(self.raw[..., start:stop, :].contiguous(), self.qtype,
                           (*self.shape[:-2], stop - start, self.shape[-1]), self.planes)

    def select_rows(self, ids: torch.Tensor) -> QuantWeight:
        """The rows `ids` of a matrix, in that order (a copy)."""
        if self.dim() != 2:
            raise WeightsError(f"select_rows takes a matrix, got {self!r}")
        return QuantWeight(self.raw[ids].contiguous(), self.qtype, (ids.numel(), self.shape[-1]), self.planes)

    @staticmethod
    def cat_rows(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Matrices of one type, layout and row length stacked by rows (one product instead of several)."""
        qt, k, planes = parts[0].qtype, parts[0].shape[-1], parts[0].planes
        if any(p.qtype != qt or p.shape[-1] != k or p.dim() != 2 or p.planes != planes for p in parts):
            raise WeightsError("cat_rows needs 2-D weights of one type, layout and row length")
        raw = torch.cat([p.raw for p in parts])
        return QuantWeight(raw, qt, (raw.shape[0], k), planes)

    def __repr__(self) -> str:
        layout = ", planes" if self.planes else ""
        return f"QuantWeight({self.qtype.name}{layout}, shape={self.shape}, device={self.device})"


def weight_of(raw: torch.Tensor, code: int, k: int) -> QuantWeight:
    """The weight of rows raw [*lead, N, row bytes] of k weights whose type is the kernels' number `code`
    (QuantWeight.code)."""
    return QuantWeight(raw, base_type(code), (*raw.shape[:-1], k), code > PLANES)


def base_type(code: int) -> GGMLQuantizationType:
    """The GGML type of the kernels' type number `code` (rows in planes or in the file's order)."""
    return GGMLQuantizationType(code - PLANES if code > PLANES else code)
