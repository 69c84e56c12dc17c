"""Hyper-connections: 4 residual streams mixed into one block input, and the block output injected back."""

from __future__ import annotations

import torch

from qspec.model.fuse import fused
from qspec.model.ops import linear, rms_norm, sigmoid, silu, stack_rows


class HyperMixer(torch.nn.Module):
    """`hc_*` tensors: grouped norm, low-rank gate, stream mean, optional inject weights."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, hidden: int, count: int, eps: float,
                 inject: bool = True) -> None:
        super().__init__()
        self.hidden, self.count, self.eps = hidden, count, eps
        self.norm = w[f"{prefix}_norm.weight"]
        self.up = w[f"{prefix}_up.weight"]
        self.rank = w[f"{prefix}_down.weight"].shape[0]
        self.has_inject = inject
        # down and inject both read the normed residual: one product
        self.w_in, _ = stack_rows(w[f"{prefix}_down.weight"], *([w[f"{prefix}_inject.weight"]] if inject else []))

    def forward(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """X [T, S*D] -> (block input h [T, D], injection logits [T, S] or None: hc_combine turns them into weights)."""
        h, inj = hc_mix(X, self.norm, self.w_in, self.up, self.rank, self.hidden, self.count, self.eps)
        return h, inj if self.has_inject else None

    def combine_mix(self, X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`hc_combine(X, *pending)` (the previous block's output, not yet added), then this mixer, as one fused
        function: the combined residual is written by the kernel that computes its norm, one kernel fewer per
        block in a decode step. -> (combined X, h, injection logits or None)."""
        if pending is None:
            return (X, *self(X))
        X, h, inj = hc_combine_mix(X, pending[0], pending[1], self.norm, self.w_in, self.up, self.rank, self.hidden,
                                   self.count, self.eps)
        return X, h, inj if self.has_inject else None


@fused
def hc_mix(X: torch.Tensor, norm: torch.Tensor, w_in: torch.Tensor, up: torch.Tensor, rank: int, hidden: int,
           count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_in = [down ; inject] -> (h [T, D], injection logits [T, S]; meaningless without inject rows).

    The logits stay raw: hc_combine, which reads them, applies their sigmoid, so no kernel of this function
    computes them. The gated streams are summed slice by slice (the values and order of stream_mean over their
    product): inductor would write a product read 4 times to memory with a kernel of its own."""
    Xn = rms_norm(X, norm, eps, group=hidden)
    y = linear(Xn, w_in)
    gate = sigmoid(linear(silu(y[..., :rank] / count), up)).unflatten(-1, (count, hidden))
    xs = Xn.unflatten(-1, (count, hidden))
    acc = gate[..., 0, :] * xs[..., 0, :]
    for s in range(1, count):
        acc = acc + gate[..., s, :] * xs[..., s, :]
    return acc / count, y[..., rank:rank + count]


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the stream axis [..., S, D] as explicit adds: a fixed order whatever the row count
    (torch's reduction kernels may reorder a strided reduction depending on the shape)."""
    acc = x[..., 0, :]
    for s in range(1, x.shape[-2]):
        acc = acc + x[..., s, :]
    return acc / x.shape[-2]


@fused
def hc_combine(X: torch.Tensor, y: torch.Tensor, inj_logits: torch.Tensor) -> torch.Tensor:
    """X_s += inj_s * y for every stream s, inj = 2 sigmoid(logits / S); X [T, S*D], y [T, D], logits [T, S]."""
    inj = 2 * sigmoid(inj_logits / inj_logits.shape[-1])
    return X + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)


@fused
def hc_combine_mix(X: torch.Tensor, y: torch.Tensor, inj_prev: torch.Tensor, norm: torch.Tensor, w_in: torch.Tensor,
                   up: torch.Tensor, rank: int, hidden: int, count: int, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_combine followed by hc_mix -> (combined X, h, injection logits): the same ops in the same order."""
    X = hc_combine.eager(X, y, inj_prev)  # type: ignore[attr-defined]
    return (X, *hc_mix.eager(X, norm, w_in, up, rank, hidden, count, eps))  # type: ignore[attr-defined]
