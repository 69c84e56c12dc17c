"""Convolution rollback snapshots (seed Algorithms 4 and 5).

A causal conv step concatenates its state S (width s, one row per channel) with the step's new
activations T (n columns) into X = S || T, and rollback needs the state as it stood after each
row j: the window X[:, j+1 : j+1+s]. The ordinary path writes X, then each window by its own
copy (1 + k dispatches, s + n + k*s source reads per row). The fused path loads each row once and
writes X and every window from that load (1 dispatch, s + n reads per row).

Eligibility follows Algorithm 4: f32 rows (new activations may arrive in 16 bits, widened exactly on
load), 1 <= n <= 8, 1 <= s, s + n <= 16 (the 16-word row buffer; the seed also states s <= 8, which would
exclude the PLE conv's s = 9 rows, so qspec keeps only the buffer bound), at most 8
snapshot candidates scanned, at least 2 accepted, destinations in bounds and disjoint from S, T, X and each
other; the first unsupported candidate ends the scan. Otherwise the ordinary copies run, and the reason is
counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from qspec.kernels.triton_common import use_triton

MAX_SNAPSHOTS = 8
ROW_WORDS = 16
# New activations may come in 16-bit: widening to f32 is exact, so the rows the kernel moves are still f32 words
# (the step's projection then needs no separate cast kernel).
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SnapshotStats:
    fused: int = 0  # dispatches taken by the fused path
    ordinary: int = 0  # groups written by separate copies
    dispatches: int = 0
    source_reads: int = 0  # logical element reads (per the seed's accounting)
    fallbacks: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {"fused_groups": self.fused, "ordinary_groups": self.ordinary, "dispatches": self.dispatches,
                "source_reads": self.source_reads, "fallbacks": dict(self.fallbacks)}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) that a (possibly strided) view touches."""
    if t.numel() == 0:
        return (0, 0)
    lo = t.data_ptr()
    extent = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride(), strict=True))
    hi = lo + (extent + 1) * t.element_size()
    return lo, hi


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def plan_snapshots(S: torch.Tensor, T: torch.Tensor, X: torch.Tensor, planes: torch.Tensor, dest_planes: list[int],
                   stats: SnapshotStats | None) -> list[int] | None:
    """Algorithm 4: the accepted snapshot destinations, or None for the ordinary path."""
    def no(reason: str) -> None:
        if stats is not None:
            stats.fallbacks[reason] += 1
        return None

    s, n = S.shape[-1], T.shape[0]
    if S.dtype != torch.float32 or T.dtype not in ROW_DTYPES or planes.dtype != torch.float32:
        return no("not f32")
    if not (1 <= n <= 8 and s >= 1 and s + n <= ROW_WORDS):
        return no(f"shape s={s} n={n}")
    taken: list[tuple[int, int]] = [_span(S), _span(T), _span(X)]
    accepted: list[int] = []
    for j, p in enumerate(dest_planes[:MAX_SNAPSHOTS]):
        if not 0 <= p < planes.shape[0] or j + 1 + s > s + n:
            break
        span = _span(planes[p])
        if any(_overlaps(span, o) for o in taken):
            break
        taken.append(span)
        accepted.append(p)
    if len(accepted) < 2:
        return no("fewer than 2 snapshots")
    return accepted


def _count(stats: SnapshotStats | None, fused: bool, dispatches: int, reads: int) -> None:
    if stats is not None:
        stats.fused += fused
        stats.ordinary += not fused
        stats.dispatches += dispatches
        stats.source_reads += reads


def write_snapshots(S: torch.Tensor, T: torch.Tensor, planes: torch.Tensor, base: torch.Tensor, host_base: int,
                    n_write: int, last_only: bool, fused: bool, stats: SnapshotStats | None,
                    live: torch.Tensor | None = None) -> torch.Tensor:
    """Return X = S || T^T ([C, s+n]) and store the rollback windows into `planes`.

    S: the [C, s] state; or, with `live` (an int64 device scalar), S is `planes` and the state is its plane
    `live`, which lies in the half that `host_base` does not (the recurrent cache's ping-pong invariant): the
    kernel reads it in place, where a gather would be a launch of its own. T: [n, C] new activations.
    Windows for rows j < n_write go to plane base + j; with `last_only`, just the final window goes to plane base.

    With `fused` on the GPU, a one-row step (plain decoding) also goes through the kernel: one window is not
    Algorithm 4's fused group (it needs two, and the step is counted as ordinary), but one launch replaces the
    gather, cat and copy, each a node of a graphed decode step."""
    s, n = S.shape[-1], T.shape[0]
    C = S.shape[-2]
    if last_only:
        X = torch.cat([_state(S, live), T.t().to(S.dtype)], dim=1)
        planes.index_copy_(0, base.view(1), X[:, n:n + s].unsqueeze(0))
        _count(stats, False, 2, (s + n + s) * C)
        return X
    kernel = (use_triton(S) and S.dtype == planes.dtype == torch.float32 and T.dtype in ROW_DTYPES
              and s + n <= ROW_WORDS)
    X = torch.empty(C, s + n, dtype=S.dtype, device=S.device)
    accepted = plan_step(S, T, X, planes, host_base, n_write, stats, live) if fused else None
    if fused and kernel and (accepted is not None or n_write == 1):
        from qspec.kernels.triton_conv_snapshot import conv_snapshot

        k = len(accepted) if accepted is not None else 1
        conv_snapshot(S, T, planes, base, k, out=X, live=live)  # Algorithm 5: one load per row
        count_fused_step(stats, accepted, s + n, C)
        rest = range(k, n_write)
    elif fused and accepted is not None:  # the reference of the fused path (CPU)
        torch.cat([_state(S, live), T.t().to(S.dtype)], dim=1, out=X)
        k = len(accepted)
        windows = X.unfold(1, s, 1)[:, 1:k + 1]  # [C, k, s]: every window from the one load of X
        planes.index_copy_(0, base + torch.arange(k, device=planes.device), windows.permute(1, 0, 2))
        _count(stats, True, 1, (s + n) * C)
        rest = range(k, n_write)
    else:
        torch.cat([_state(S, live), T.t().to(S.dtype)], dim=1, out=X)
        _count(stats, False, 1, (s + n) * C)
        rest = range(n_write)
    for j in rest:
        # plane base itself needs no index arithmetic: one kernel fewer
        planes.index_copy_(0, (base if j == 0 else base + j).view(1), X[:, j + 1:j + 1 + s].unsqueeze(0))
        if stats is not None:
            stats.dispatches += 1
            stats.source_reads += s * C
    return X


def plan_step(S: torch.Tensor, T: torch.Tensor, X: torch.Tensor, planes: torch.Tensor, host_base: int, n_write: int,
              stats: SnapshotStats | None, live: torch.Tensor | None = None) -> list[int] | None:
    """`plan_snapshots` for a step's windows, planes host_base + j for j < n_write, as `write_snapshots` takes them
    (S, live: its state; with `live`, the state is a plane of the half of `planes` that host_base is not in)."""
    if live is None:
        state_span = S
    else:  # the half holding the live plane
        half = planes.shape[0] // 2
        state_span = planes[half:] if host_base < half else planes[:half]
    return plan_snapshots(state_span, T, X, planes, [host_base + j for j in range(n_write)], stats)


def count_fused_step(stats: SnapshotStats | None, accepted: list[int] | None, row_words: int, channels: int) -> None:
    """Count a step whose windows one fused launch wrote (a fused group where `plan_step` accepted one, else a
    one-row step's single window) as `write_snapshots` counts it."""
    _count(stats, accepted is not None, 1, row_words * channels)


def _state(S: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """The [C, s] state: S itself, or plane `live` of S [P, C, s] (gathered on the device)."""
    if live is None:
        return S
    if S.dim() != 3 or live.dtype != torch.int64 or live.dim() != 0:
        raise ValueError("with `live`, S must be [P, C, s] and live an int64 device scalar")
    return S.index_select(0, live.view(1))[0]
