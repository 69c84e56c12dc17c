"""The hyper-connection mixer's math: the pending block output added into the residual streams (`combine_torch`),
and the mixer (`mix_torch`): grouped RMSNorm, the low-rank gate, the gated mean of the streams.

These are the torch references; model/hyper.py runs them compiled (@fused). For a step of a few rows (decode, draft,
verify) on CUDA, with the matrices 16-bit or GGUF blocks, `mix_step` runs the whole mixer as a prep kernel, the `w_in`
product and an output kernel (triton_hc_mix.py) instead of the ~7 kernels the compiled functions make.
"""

from __future__ import annotations

import contextlib

import torch

from qspec.kernels import gemv
from qspec.kernels.triton_common import module_flag, use_triton
from qspec.kernels.triton_hc_mix import MAX_ROWS
from qspec.model.ops import StackedWeight, Weight, linear, rms_norm, row_exact, sigmoid, silu
from qspec.weights.qweight import QuantWeight

DTYPES = (torch.bfloat16, torch.float16)
_ON = True  # off: one-row mixers run compiled too (A/B timing: scripts/profile_step.py --mixer-ab)
# Most rows of a step whose mixers take the kernels; the engine sets it per request (EngineOptions.mixer_step_rows,
# through runner.KernelSwitches), and this default is that option's (tests/test_options.py checks they agree).
_STEP_ROWS = 6


def enabled_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Let one-row mixers take the Triton kernels (on, the default) or not, inside the block."""
    return module_flag(__name__, "_ON", on)


def step_rows_mode(rows: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, mixers of steps with up to `rows` rows (at most the kernels' MAX_ROWS) take the kernels."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"mixer step rows: 1..{MAX_ROWS}, got {rows}")
    return module_flag(__name__, "_STEP_ROWS", rows)


def combine_torch(X: torch.Tensor, y: torch.Tensor, inj_logits: torch.Tensor) -> torch.Tensor:
    """X_s += inj_s * y for every stream s, inj = 2 sigmoid(logits / S); X [T, S*D], y [T, D], logits [T, S]."""
    inj = 2 * sigmoid(inj_logits / inj_logits.shape[-1])
    return X + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)


def mix_torch(X: torch.Tensor, norm: torch.Tensor, w_in: Weight, up: Weight, rank: int, hidden: int,
              count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_in = [down ; inject] -> (h [T, D], w_in's outputs [T, N]: the rows past `rank` are the injection logits).

    The logits stay raw: combine, which reads them, applies their sigmoid. The gated streams are summed slice by
    slice (a fixed order whatever the row count; compiled, no kernel of its own writes the product)."""
    Xn = rms_norm(X, norm, eps, group=hidden)
    y = linear(Xn, w_in)
    gate = sigmoid(linear(silu(y[..., :rank] / count), up)).unflatten(-1, (count, hidden))
    xs = Xn.unflatten(-1, (count, hidden))
    acc = gate[..., 0, :] * xs[..., 0, :]
    for s in range(1, count):
        acc = acc + gate[..., s, :] * xs[..., s, :]
    return acc / count, y


def _kernel_weight(w: Weight, X: torch.Tensor) -> bool:
    """A mixer matrix the step kernels read: 16 bits of X's dtype, contiguous, or GGUF blocks (any stack of them
    for w_in, whose product is ops.linear's)."""
    if isinstance(w, torch.Tensor):
        return w.dtype == X.dtype and w.is_contiguous()
    return isinstance(w, (QuantWeight, StackedWeight))


def step_eligible(X: torch.Tensor, w_in: Weight, up: Weight) -> bool:
    """Whether `mix_step` takes this mixer: a one-row step (decode, draft; more rows under `step_rows_mode`),
    16-bit, CUDA (or the interpreter), the step kernels switched on (gemv.enabled_mode: the A/B arm `gemv=0`
    measures the compiled path), not row-exact mode; the matrices in X's dtype or as GGUF blocks (an `up` of blocks
    at one row only: triton_hc_mix.py says why).

    The kernels are correct for up to 8 rows (`python -m qspec.bench.kernels` checks 1, 2, 4, 6 and 8). Without
    PDL only the one-row step measured faster than the compiled functions on the H200; with PDL (the default on
    Hopper) MTP5 with its 6-row verify and extend steps on the kernels ran faster end to end (BENCHMARKS.md §4, the
    verify/extend mixers row; benchmarks/results/h200-fn8-mixers-s15.md), so the engine's mixer_step_rows is 6."""
    rows = X.shape[0]
    return (_ON and 1 <= rows <= _STEP_ROWS and X.dtype in DTYPES and gemv.is_on() and use_triton(X)
            and not row_exact() and X.is_contiguous() and _kernel_weight(w_in, X) and not isinstance(up, StackedWeight)
            and _kernel_weight(up, X) and (rows == 1 or isinstance(up, torch.Tensor)))


def mix_step_triton(X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                    w_in: Weight, up: torch.Tensor | QuantWeight, rank: int, hidden: int, count: int, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernels for a mixer `step_eligible` takes -> (combined X, h, w_in's outputs)."""
    from qspec.kernels.triton_hc_mix import hc_mix_step_triton

    p = None if pending is None else tuple(t if t.stride(-1) == 1 else t.contiguous() for t in pending)
    return hc_mix_step_triton(X, p, norm, w_in, up, rank, hidden, count, eps)


def mix_step(X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
             w_in: Weight, up: Weight, rank: int, hidden: int, count: int, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """combine (when a block output is pending) then mix -> (combined X, h, w_in's outputs).
    The Triton kernels where `step_eligible`, else the references."""
    if step_eligible(X, w_in, up):
        return mix_step_triton(X, pending, norm, w_in, up, rank, hidden, count, eps)
    if pending is not None:
        X = combine_torch(X, *pending)
    return (X, *mix_torch(X, norm, w_in, up, rank, hidden, count, eps))
