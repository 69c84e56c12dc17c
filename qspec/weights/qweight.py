"""A GGUF-quantized weight kept as its raw blocks: what the loader hands the model instead of a 16-bit tensor.

`QuantWeight.raw` holds each row's ggml blocks as stored in the file (uint8, [*lead, N, row_bytes]); `shape` is the
logical torch shape (*lead, N, K). Rows are independent runs of whole blocks, so row slices, expert slices and
row-wise concatenation need no re-encoding. The products that read the blocks live in kernels/qmatmul.py; this
module only describes and reshapes the bytes, and expands them (`dequantize`, the kernels' reference).
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


def row_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    """Bytes of one row of k weights; k must hold whole blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise WeightsError(f"{qtype.name}: row length {k} is not a multiple of the block size {block}")
    return k // block * size


@dataclass(frozen=True, eq=False)
class QuantWeight:
    raw: torch.Tensor  # uint8 [*lead, N, row_bytes(qtype, K)]
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # (*lead, N, K)

    def __post_init__(self) -> None:
        qt = GGMLQuantizationType(self.qtype)
        if qt not in PACKED_QTYPES:
            raise WeightsError(f"{qt.name} is not kept packed (packed types: "
                               f"{', '.join(sorted(q.name for q in PACKED_QTYPES))})")
        want = (*self.shape[:-1], row_bytes(qt, self.shape[-1]))
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
    def nbytes(self) -> int:
        return self.raw.numel()

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights expanded to `dtype` (the products' reference, and the fallback for small parts)."""
        return dequantize(self.raw, self.qtype, self.shape, dtype)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.raw.to(device), self.qtype, self.shape)

    def __getitem__(self, i: int) -> QuantWeight:
        """Expert i of a stacked [E, N, K] weight (a view: no copy)."""
        if len(self.shape) < 3:
            raise IndexError("only stacked (expert) weights are indexed")
        return QuantWeight(self.raw[i], self.qtype, self.shape[1:])

    def experts(self, start: int, stop: int) -> QuantWeight:
        """Experts start:stop of a stacked [E, N, K] weight (a view: no copy)."""
        if len(self.shape) < 3:
            raise IndexError("only stacked (expert) weights have experts")
        return QuantWeight(self.raw[start:stop], self.qtype, (stop - start, *self.shape[1:]))

    def rows(self, start: int, stop: int) -> QuantWeight:
        """Rows start:stop of the second-to-last dim (the halves of a fused gate_up tensor), contiguous."""
        return QuantWeight(self.raw[..., start:stop, :].contiguous(), self.qtype,
                           (*self.shape[:-2], stop - start, self.shape[-1]))

    @staticmethod
    def cat_rows(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Matrices of one type and row length stacked by rows (one product instead of several)."""
        qt, k = parts[0].qtype, parts[0].shape[-1]
        if any(p.qtype != qt or p.shape[-1] != k or p.dim() != 2 for p in parts):
            raise WeightsError("cat_rows needs 2-D weights of one type and row length")
        raw = torch.cat([p.raw for p in parts])
        return QuantWeight(raw, qt, (raw.shape[0], k))

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype.name}, shape={self.shape}, device={self.device})"
