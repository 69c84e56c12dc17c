"""Hyper-connections: 4 residual streams mixed into one block input, and the block output injected back."""

from __future__ import annotations

import torch

from qspec.kernels.hc_mix import combine_torch, mix_step_triton, mix_torch, step_eligible
from qspec.model.fuse import fused
from qspec.model.ops import stack_rows


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
        _, h, inj = self.combine_mix(X, None)
        return h, inj

    def combine_mix(self, X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`hc_combine(X, *pending)` (the previous block's output, not yet added), then this mixer, as one fused
        function: the combined residual is written by the kernel that computes its norm, one kernel fewer per
        block in a decode step; a one-row step runs both on Triton kernels (kernels/hc_mix.py).
        -> (combined X, h, injection logits or None)."""
        args = (self.norm, self.w_in, self.up, self.rank, self.hidden, self.count, self.eps)
        if step_eligible(X, self.w_in, self.up):
            X, h, y = mix_step_triton(X, pending, *args)
        elif pending is None:
            h, y = hc_mix(X, *args)
        else:
            X, h, y = hc_combine_mix(X, pending[0], pending[1], *args)
        return X, h, y[..., self.rank:self.rank + self.count] if self.has_inject else None


# The math lives with its Triton kernels (kernels/hc_mix.py); steps of several rows run it compiled.
hc_mix = fused(mix_torch)
hc_combine = fused(combine_torch)


@fused
def hc_combine_mix(X: torch.Tensor, y: torch.Tensor, inj_prev: torch.Tensor, norm: torch.Tensor, w_in: torch.Tensor,
                   up: torch.Tensor, rank: int, hidden: int, count: int, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """combine followed by mix -> (combined X, h, w_in's outputs): the same ops in the same order."""
    X = combine_torch(X, y, inj_prev)
    return (X, *mix_torch(X, norm, w_in, up, rank, hidden, count, eps))


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the stream axis [..., S, D] as explicit adds: a fixed order whatever the row count
    (torch's reduction kernels may reorder a strided reduction depending on the shape)."""
    acc = x[..., 0, :]
    for s in range(1, x.shape[-2]):
        acc = acc + x[..., s, :]
    return acc / x.shape[-2]
