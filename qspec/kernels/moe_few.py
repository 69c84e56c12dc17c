"""Routed experts for a few tokens (decode / verify, M <= 16), reading only the chosen experts' weights.

`moe_slots` is the routed half of `MoE.forward` (the shared expert stays there), up to the sum over
each token's k slots: Triton kernels (triton_moe.py) on CUDA, gathered batched products otherwise.
`moe_few` adds the slot sum; `moe_few_torch`, the per-(token, expert) loop, is its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qspec.kernels.qmatmul import qmatmul
from qspec.kernels.triton_common import use_triton
from qspec.weights.qweight import QuantWeight

MAX_ROWS = 16
# 16-bit steps take the grouped kernels (each distinct expert read once for all its rows, tensor cores): on the
# H200 they beat the per-pair kernels at 1, 4 and 6 rows (triton_moe.GROUPED_CONFIGS). f32 keeps the per-pair
# kernels: its tiles would exceed the shared memory, and tl.dot would round f32 products to tf32.
GROUPED_DTYPES = (torch.bfloat16, torch.float16)


def _check(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: ExpertWeight, up: ExpertWeight,
           down: ExpertWeight) -> None:
    M, D = h.shape
    E, Fd, D2 = gate.shape
    if D2 != D or up.shape != gate.shape or down.shape != (E, D, Fd):
        raise ValueError(f"expert shapes: h {tuple(h.shape)} gate {tuple(gate.shape)} up {tuple(up.shape)} "
                         f"down {tuple(down.shape)}")
    if top_i.dim() != 2 or top_i.shape[0] != M or top_w.shape != top_i.shape or top_i.dtype != torch.int64:
        raise ValueError(f"routing: top_i {tuple(top_i.shape)} {top_i.dtype}, top_w {tuple(top_w.shape)}")


ExpertWeight = torch.Tensor | QuantWeight


def _product(x: torch.Tensor, w: ExpertWeight) -> torch.Tensor:
    return qmatmul(x, w) if isinstance(w, QuantWeight) else F.linear(x, w)


def expert_ffn(x: torch.Tensor, gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight) -> torch.Tensor:
    """One expert over the rows x: down(silu(gate x) * up x), its matrices [out, in] as stored: 16-bit tensors, or
    GGUF blocks (QuantWeight: each product a kernels/qmatmul.qmatmul, rounded to x.dtype), or a mix of both."""
    return _product(F.silu(_product(x, gate)) * _product(x, up), down)


def moe_few_torch(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: ExpertWeight,
                  up: ExpertWeight, down: ExpertWeight) -> torch.Tensor:
    """Reference (and MoE._per_token, row-exact mode): each (token, expert) pair as its own product, slot outputs
    weighted and summed."""
    _check(h, top_i, top_w, gate, up, down)
    rows = []
    for t, experts in enumerate(top_i.tolist()):
        x = h[t:t + 1]
        ys = [expert_ffn(x, gate[e], up[e], down[e]) for e in experts]
        rows.append((torch.cat(ys) * top_w[t, :, None]).sum(0, keepdim=True))
    return torch.cat(rows)


def sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """[M, k, D] weighted slot outputs -> [M, D]: summed in f32 slot by slot, rounded once to their dtype.

    Explicit adds in slot order, not a reduction: the same bits whatever the row count, eager or compiled (one
    pointwise kernel then, BENCHMARKS.md §5c)."""
    acc = slots[:, 0].float()
    for j in range(1, slots.shape[1]):
        acc = acc + slots[:, j].float()
    return acc.to(slots.dtype)


def moe_slots(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """top_w[m, j] * down_e (silu(gate_e h_m) * up_e h_m), e = top_i[m, j]: the weighted slot outputs [M, k, D].

    h [M, D]; top_i [M, k] int64; top_w [M, k] (h.dtype, as MoE.route returns it); gate/up [E, F, D],
    down [E, D, F]. Two Triton launches on CUDA for M <= 16 (per distinct expert for 16-bit weights, per
    (token, slot) pair for f32), no host sync; otherwise the chosen
    experts' matrices are gathered (extra copies, but no data-dependent host control flow either)."""
    _check(h, top_i, top_w, gate, up, down)
    if use_triton(h) and h.shape[0] <= MAX_ROWS:
        from qspec.kernels.triton_moe import moe_slots_grouped_triton, moe_slots_triton

        if h.dtype in GROUPED_DTYPES:
            return moe_slots_grouped_triton(h, top_i, top_w, gate, up, down)
        return moe_slots_triton(h, top_i, top_w, gate, up, down)
    M, k = top_i.shape
    idx = top_i.reshape(-1)
    x = h.repeat_interleave(k, dim=0).unsqueeze(1)  # [M*k, 1, D]
    act = F.silu(torch.bmm(x, gate[idx].transpose(1, 2))) * torch.bmm(x, up[idx].transpose(1, 2))
    return torch.bmm(act, down[idx].transpose(1, 2)).view(M, k, -1) * top_w.unsqueeze(-1)


def moe_few(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """sum_j top_w[m, j] * down_e (silu(gate_e h_m) * up_e h_m): out [M, D] in h.dtype (see `moe_slots`)."""
    return sum_slots(moe_slots(h, top_i, top_w, gate, up, down))
