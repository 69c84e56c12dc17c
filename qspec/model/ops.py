"""Small numeric building blocks shared by every layer.

`row_exact` mode: every matrix product is computed one row at a time (a batch of M=1 products),
so a row's result never depends on how many rows were computed together. Plain decoding (1 row)
and speculative verification (N+1 rows) then produce bit-identical numbers on the CPU, which is
what lets the tests demand bit-exact state equality.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qspec.kernels import gemv
from qspec.kernels.qmatmul import qmatmul, qmatmul_stacked
from qspec.weights.qweight import QuantWeight

_ROW_EXACT = False


def row_exact() -> bool:
    return _ROW_EXACT


@contextlib.contextmanager
def row_exact_mode(on: bool = True) -> Iterator[None]:
    global _ROW_EXACT
    old, _ROW_EXACT = _ROW_EXACT, on
    try:
        yield
    finally:
        _ROW_EXACT = old


def set_row_exact(on: bool) -> None:
    global _ROW_EXACT
    _ROW_EXACT = on


# Row-exact products loop over rows only for step-sized inputs; a long prefill is the same for every
# decoding mode, so it keeps the batched product.
EXACT_MAX_ROWS = 64


@dataclass(frozen=True, eq=False)
class StackedWeight:
    """Matrices that multiply the same input but cannot be one: parts of different GGUF types or row lengths in
    blocks (a router kept F32 beside Q4_K shared-expert projections, an attention-V at Q6_K beside Q4_K q/k).
    Consecutive parts of one kind are already concatenated; the product is the concatenation of each part's
    product, so callers slice its columns exactly as for one stacked matrix."""

    parts: tuple[torch.Tensor | QuantWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(int(p.shape[0]) for p in self.parts), int(self.parts[0].shape[-1])

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dim(self) -> int:
        return 2


Weight = torch.Tensor | QuantWeight | StackedWeight


def is_quantized(w: object) -> bool:
    """Whether a weight is (or holds) GGUF blocks, which torch.compile'd functions and 16-bit kernels cannot take."""
    return isinstance(w, (QuantWeight, StackedWeight))


def _by_rows(x2: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """product(x2), or in row-exact mode, for step-sized inputs, product of each row alone, concatenated."""
    if _ROW_EXACT and 1 < x2.shape[0] <= EXACT_MAX_ROWS:
        return torch.cat([product(x2[i:i + 1]) for i in range(x2.shape[0])])
    return product(x2)


def _qlinear(x2: torch.Tensor, w: QuantWeight | StackedWeight) -> torch.Tensor:
    """x2 [M, K] @ w^T for block weights; in row-exact mode one product per row (for step-sized M)."""
    if isinstance(w, StackedWeight):
        return torch.cat([_stacked_run(x2, run) for run in _block_runs(w.parts)], dim=-1)
    return _by_rows(x2, lambda x: qmatmul(x, w))


def _block_runs(parts: Sequence[torch.Tensor | QuantWeight]) -> list[list[torch.Tensor | QuantWeight]]:
    """A StackedWeight's parts as runs: consecutive block parts together (one product with x quantized once), each
    16-bit part alone."""
    runs: list[list[torch.Tensor | QuantWeight]] = []
    for p in parts:
        if runs and isinstance(p, QuantWeight) and isinstance(runs[-1][-1], QuantWeight):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _stacked_run(x2: torch.Tensor, run: list[torch.Tensor | QuantWeight]) -> torch.Tensor:
    if len(run) == 1:
        return linear(x2, run[0])
    return _by_rows(x2, lambda x: qmatmul_stacked(x, run))  # type: ignore[arg-type]


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T. Step-sized 16-bit products on CUDA go to the Triton mat-vec (kernels/gemv.py);
    GGUF block weights to kernels/qmatmul.py."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not isinstance(w, torch.Tensor):
        return _qlinear(x2, w).reshape(*lead, w.shape[0])
    if not _ROW_EXACT:
        if gemv.eligible(x, w, x2.shape[0]):
            return gemv.gemv(x2, w).view(*lead, w.shape[0])
        return F.linear(x, w)
    if x2.shape[0] <= 1 or x2.shape[0] > EXACT_MAX_ROWS:
        return F.linear(x, w)
    return torch.cat([F.linear(x2[i:i + 1], w) for i in range(x2.shape[0])]).reshape(*lead, w.shape[0])


# Stacked matrices get zero rows up to a multiple of this: a product's output row stride is the matrix's
# row count, and cuBLAS picks slow kernels for odd strides (on the H200 odd row counts ran "align1" CUTLASS and
# WMMA kernels at several times the time of aligned ones: benchmarks/results/profile_step_fn8_s4.txt).
ROW_ALIGN = 8


def stack_rows(*ws: Weight) -> tuple[Weight, list[Weight]]:
    """One matrix holding the rows of several that multiply the same input (one product instead of several,
    which matters when each is a launch of its own), and views of it in place of the originals, so the
    originals can be dropped (no extra memory). Zero rows pad it to a multiple of ROW_ALIGN: callers slice
    the product's columns by the parts' sizes and never read past the last part.

    GGUF block weights (`QuantWeight`) are concatenated by rows when they share a type and row length; parts that
    differ (type, or a 16-bit part such as a kept-F32 router) make a `StackedWeight` of the runs of one kind: each
    part stays in its file format, nothing is expanded (`_stack_mixed`)."""
    if any(isinstance(w, QuantWeight) for w in ws):
        return _stack_mixed(ws)
    W = _pad_rows(torch.cat([w.reshape(-1, w.shape[-1]) for w in ws]))
    views, o = [], 0
    for w in ws:
        n = w.numel() // w.shape[-1]
        views.append(W[o:o + n].view(w.shape))
        o += n
    return W, views


def _pad_rows(W: torch.Tensor) -> torch.Tensor:
    """W with zero rows up to a multiple of ROW_ALIGN."""
    pad = -W.shape[0] % ROW_ALIGN
    return torch.cat([W, W.new_zeros(pad, W.shape[1])]) if pad else W


def _kind(w: torch.Tensor | QuantWeight) -> tuple[object, ...]:
    """What parts of a stack share one run: block matrices of one kernel type (type and layout) and row length."""
    if isinstance(w, QuantWeight):
        return ("q", w.code, w.shape[-1])
    return ("t", w.dtype, w.shape[-1])


def _stack_mixed(ws: Sequence[Weight]) -> tuple[Weight, list[Weight]]:
    """stack_rows for parts of which some are GGUF blocks: runs of one kind concatenated, then a StackedWeight."""
    runs: list[list[torch.Tensor | QuantWeight]] = []
    for w in ws:
        if isinstance(w, StackedWeight):
            raise TypeError("stack_rows: a StackedWeight cannot be stacked again")
        if w.dim() == 1:
            w = w[None, :]  # a single row (shared-expert gate_inp); always a float tensor
        if runs and _kind(runs[-1][-1]) == _kind(w):
            runs[-1].append(w)
        else:
            runs.append([w])
    parts: list[torch.Tensor | QuantWeight] = []
    views: list[Weight] = []
    for i, run in enumerate(runs):
        if isinstance(run[0], QuantWeight):
            W = run[0] if len(run) == 1 else QuantWeight.cat_rows(run)  # type: ignore[arg-type]
        else:
            W = run[0] if len(run) == 1 else torch.cat(run)  # type: ignore[arg-type]
            if i == len(runs) - 1:  # a float last part is padded as stack_rows pads (its rows past every column read)
                W = _pad_rows(W)  # type: ignore[arg-type]
        parts.append(W)
        o = 0
        for w in run:
            n = w.shape[0]
            views.append(_row_view(W, o, o + n))
            o += n
    out = parts[0] if len(parts) == 1 else StackedWeight(tuple(parts))
    return out, [v if w.dim() != 1 else v[0] for v, w in zip(views, ws, strict=True)]  # type: ignore[index]


def _row_view(W: torch.Tensor | QuantWeight, start: int, stop: int) -> torch.Tensor | QuantWeight:
    return W.rows(start, stop) if isinstance(W, QuantWeight) else W[start:stop]


def embed_rows(table: torch.Tensor | QuantWeight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of an embedding table [V, D]: for GGUF blocks only those rows' blocks are gathered and
    expanded (the table itself stays packed)."""
    if isinstance(table, QuantWeight):
        sub = table.raw.index_select(0, tokens.reshape(-1))
        return QuantWeight(sub, table.qtype, (sub.shape[0], table.shape[-1]), table.planes).dequantize(dtype).view(
            *tokens.shape, table.shape[-1])
    return table[tokens]


def bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; in row-exact mode each of the M rows is its own product."""
    M = a.shape[1]
    if not _ROW_EXACT or M == 1 or M > EXACT_MAX_ROWS:
        return torch.bmm(a, b)
    return torch.cat([torch.bmm(a[:, i:i + 1], b) for i in range(M)], dim=1)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor | None, eps: float, group: int | None = None) -> torch.Tensor:
    """RMSNorm in f32 over the last dim (or over groups of `group` features), times the stored gamma.

    Gammas are in llama.cpp's convention (already 1+w), so the multiply is direct."""
    xf = x.float().contiguous()  # a reduction's order can depend on the layout; keep it fixed
    if group is not None:
        xf = xf.unflatten(-1, (-1, group))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        y = y.flatten(-2)
    if gamma is not None:
        y = y * gamma.float()
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.contiguous()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rope_tables(pos: torch.Tensor, rope_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim] for NeoX-paired partial RoPE at text positions.

    Text tokens carry equal t/h/w M-RoPE components, so the interleaved sections collapse to
    plain RoPE on the first rope_dim dims."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=pos.device) / rope_dim))
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return _elementwise(torch.cos, emb).to(dtype), _elementwise(torch.sin, emb).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, r] rotate x[..., :r] (pairs i, i + r/2)."""
    r = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    xr, xp = x[..., :r], x[..., r:]
    h = r // 2
    rot = torch.cat([-xr[..., h:], xr[..., :h]], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


# Vectorised transcendental math (exp, sigmoid, silu, cos, ...) on the CPU takes a scalar path for
# the tail of a tensor, with slightly different rounding. In row-exact mode these functions run on
# a copy padded to a whole number of vector blocks, so every element takes the vector path.
_PAD = 256


def _elementwise(fn, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if not _ROW_EXACT:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, (-n) % _PAD + _PAD))
    return fn(padded)[:n].view(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.softplus, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.exp, x)



def causal_taps(X: torch.Tensor, w: torch.Tensor, n: int, dilation: int = 1) -> torch.Tensor:
    """Depthwise causal conv outputs [..., C, n] of windows X [..., C, s + n]: out[..., t] = sum_k w[:, k] *
    X[..., t + k*dilation], added tap by tap."""
    acc = X[..., 0:n] * w[:, 0:1]
    for k in range(1, w.shape[1]):
        acc = acc + X[..., k * dilation:k * dilation + n] * w[:, k:k + 1]
    return acc
