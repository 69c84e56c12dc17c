"""Small numeric building blocks shared by every layer.

`row_exact` mode: every matrix product is computed one row at a time (a batch of M=1 products),
so a row's result never depends on how many rows were computed together. Plain decoding (1 row)
and speculative verification (N+1 rows) then produce bit-identical numbers on the CPU, which is
what lets the tests demand bit-exact state equality.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

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


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T."""
    if not _ROW_EXACT:
        return F.linear(x, w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, 1, x.shape[-1])
    out = torch.bmm(x2, w.t().unsqueeze(0).expand(x2.shape[0], -1, -1))
    return out.reshape(*lead, w.shape[0])


def bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; in row-exact mode each of the M rows is its own product."""
    if not _ROW_EXACT or a.shape[1] == 1:
        return torch.bmm(a, b)
    B, M, K = a.shape
    out = torch.bmm(a.reshape(B * M, 1, K), b.unsqueeze(1).expand(B, M, K, b.shape[-1]).reshape(B * M, K, -1))
    return out.reshape(B, M, -1)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor | None, eps: float, group: int | None = None) -> torch.Tensor:
    """RMSNorm in f32 over the last dim (or over groups of `group` features), times the stored gamma.

    Gammas are in llama.cpp's convention (already 1+w), so the multiply is direct."""
    xf = x.float()
    if group is not None:
        xf = xf.unflatten(-1, (-1, group))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        y = y.flatten(-2)
    if gamma is not None:
        y = y * gamma.float()
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rope_tables(pos: torch.Tensor, rope_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim] for NeoX-paired partial RoPE at text positions.

    Text tokens carry equal t/h/w M-RoPE components, so the interleaved sections collapse to
    plain RoPE on the first rope_dim dims."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=pos.device) / rope_dim))
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, r] rotate x[..., :r] (pairs i, i + r/2)."""
    r = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    xr, xp = x[..., :r], x[..., r:]
    h = r // 2
    rot = torch.cat([-xr[..., h:], xr[..., :h]], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def inv_sqrt(n: int) -> float:
    return 1.0 / math.sqrt(n)
