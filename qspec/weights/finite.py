"""A loaded model's numbers must be finite: one NaN or infinity in a weight spreads to every logit a few layers on,
and greedy decoding would then print token 0 forever with no error. A corrupt or badly converted file is caught at
load instead, with the tensor named.

Float tensors are checked whole; a block tensor's integer quants cannot be NaN, so only its f16 fields (the scales
and mins every weight of a block is multiplied by) are read. The checks run where the weights are (on the GPU, a
small fraction of the load's time), each tensor's verdict stays on the device, and one read-back at the end names
the first tensor at fault. The n-gram table's rows (a host-memory table of up to tens of GB, read 16 rows a token) are
not checked.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from qspec.weights.dequant import WeightsError
from qspec.weights.qweight import QuantWeight

# Each packed type's f16 fields, as byte offsets in its block (in the file's order): d (and the min's scale, dmin or m).
F16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
_CHUNK = 1 << 26  # elements per isfinite pass over a float tensor (bounds the temporary mask)


def nonfinite_floats(t: torch.Tensor) -> torch.Tensor:
    """Whether float tensor t holds a NaN or an infinity, as a 0-dim bool on t's device (no read-back)."""
    flat = t.reshape(-1)
    bad = torch.zeros((), dtype=torch.bool, device=t.device)
    for part in flat.split(_CHUNK):
        bad |= ~torch.isfinite(part).all()
    return bad


def nonfinite_blocks(w: QuantWeight) -> torch.Tensor:
    """Whether a block weight in the file's order has a NaN or infinite f16 scale, as a 0-dim bool on its device."""
    if w.planes:
        raise ValueError("nonfinite_blocks reads blocks in the file's order, not in planes")
    size = GGML_QUANT_SIZES[w.qtype][1]
    blocks = w.raw.unflatten(-1, (-1, size))  # a view even of a row slice (no copy of the weight)
    bad = torch.zeros((), dtype=torch.bool, device=blocks.device)
    for at in F16_FIELDS[Q(w.qtype)]:
        h = blocks[..., at].to(torch.int32) | (blocks[..., at + 1].to(torch.int32) << 8)
        bad |= ((h & 0x7C00) == 0x7C00).any()  # exponent all ones: an infinity or a NaN
    return bad


def nonfinite_error(source: object, name: str, what: str) -> WeightsError:
    """The error for tensor `name` of `source` holding NaN or infinite `what` (check_finite's, host_experts')."""
    return WeightsError(f"{source}: tensor {name!r} holds NaN or infinite {what}: the file is corrupt or was "
                        f"converted wrongly")


def check_finite(weights: Mapping[str, object], source: object) -> None:
    """Raise WeightsError naming the first tensor of `weights` (in order) that holds a NaN or an infinity (a block
    tensor: in a scale); `source` names the file in the message. Tensors shared by several names are checked once."""
    verdicts: list[tuple[str, str, torch.Tensor]] = []
    seen: set[tuple[int, int]] = set()
    for name, t in weights.items():
        if isinstance(t, QuantWeight) and t.raw.is_pinned():
            continue  # routed experts in host memory, checked on the device as they were placed (host_experts.py)
        if isinstance(t, QuantWeight):
            key, what = (t.raw.data_ptr(), t.raw.numel()), f"{Q(t.qtype).name} block scales"
            check = nonfinite_blocks
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            key, what = (t.data_ptr(), t.numel()), "numbers"
            check = nonfinite_floats
        else:
            continue
        if key not in seen:
            seen.add(key)
            verdicts.append((name, what, check(t)))  # type: ignore[operator]
    if not verdicts:
        return
    bad = torch.stack([v for _, _, v in verdicts]).cpu()  # the one read-back
    if bool(bad.any()):
        name, what, _ = verdicts[int(bad.nonzero()[0])]
        raise nonfinite_error(source, name, what)
