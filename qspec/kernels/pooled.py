"""Pooled indexer-key materialization for one step's update list (seed Algorithm 2's batched body).

`materialize_pooled_torch` is the explicit-argument twin of `qspec.model.qsa.materialize_pooled`;
`materialize_pooled_fast` runs the one-launch Triton kernel (triton_pooled.py) on CUDA.
The block-start positions enter only through cos/sin, the RoPE tables gathered at them.
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton
from qspec.model.ops import apply_rope, rms_norm


def _check(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, pooled: torch.Tensor) -> None:
    C = cells.shape[0]
    d = raw.shape[1]
    if cells.dim() != 2 or dest.shape != (C,) or cos.shape != sin.shape or cos.shape[0] != C:
        raise ValueError(f"update list shapes: cells {tuple(cells.shape)} dest {tuple(dest.shape)} "
                         f"cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
    rope = cos.shape[1]
    if rope % 2 or rope > d or gamma.shape != (d,) or pooled.shape[1] != d or pooled.dtype != torch.float32:
        raise ValueError(f"raw {tuple(raw.shape)} gamma {tuple(gamma.shape)} rope {rope} pooled "
                         f"{tuple(pooled.shape)} {pooled.dtype}")
    if cells.dtype != torch.int64 or dest.dtype != torch.int64:
        raise ValueError("cells and dest must be int64")


def materialize_pooled_torch(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor,
                             eps: float, cos: torch.Tensor, sin: torch.Tensor, pooled: torch.Tensor) -> None:
    """Reference: pooled[dest[u]] = RoPE(RMSNorm(round(mean(raw[cells[u]])))) as f32, in place.

    raw [cap, d] (the cache dtype); cells [C, r], dest [C] int64; gamma [d]; cos/sin [C, rope_dim] at
    the rows' block starts; pooled [nb + 1, d] f32."""
    _check(raw, cells, dest, gamma, cos, sin, pooled)
    x = raw[cells].float().mean(1).to(raw.dtype)
    z = rms_norm(x, gamma, eps)
    z = apply_rope(z.unsqueeze(1), cos, sin).squeeze(1)
    pooled.index_copy_(0, dest, z.float())


def materialize_pooled_fast(raw: torch.Tensor, cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor, pooled: torch.Tensor) -> None:
    """Dispatch: the Triton kernel on CUDA (one launch instead of ~20 small ops), the reference otherwise.

    Destinations must be distinct (Algorithm 3 guarantees it); the results then match the reference
    up to f32 reduction order in the RMS (occasionally one ulp of the raw dtype)."""
    if use_triton(raw):
        from qspec.kernels.triton_pooled import pooled_triton

        _check(raw, cells, dest, gamma, cos, sin, pooled)
        pooled_triton(raw, cells, dest, gamma, eps, cos, sin, pooled)
        return
    materialize_pooled_torch(raw, cells, dest, gamma, eps, cos, sin, pooled)


def materialize_pooled_seqs_torch(raws: list[torch.Tensor], cells: torch.Tensor, dest: torch.Tensor,
                                  gamma: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                  pooleds: list[torch.Tensor]) -> None:
    """Reference for a batched step's update lists joined (C rows each, in order: rows b C .. (b + 1) C - 1 are
    sequence b's): each sequence's rows through `materialize_pooled_torch` on its own raw and pooled keys."""
    C, rem = divmod(cells.shape[0], len(raws))
    if rem or len(pooleds) != len(raws):
        raise ValueError(f"{cells.shape[0]} update rows for {len(raws)} sequences' raw and {len(pooleds)} pooled keys")
    for b, (raw, pooled) in enumerate(zip(raws, pooleds, strict=True)):
        rows = slice(b * C, (b + 1) * C)
        materialize_pooled_torch(raw, cells[rows], dest[rows], gamma, eps, cos[rows], sin[rows], pooled)


def materialize_pooled_seqs(raws: list[torch.Tensor], cells: torch.Tensor, dest: torch.Tensor, gamma: torch.Tensor,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor, pooleds: list[torch.Tensor],
                            tables: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Dispatch: every sequence's update list in one Triton launch, each row finding its sequence's raw and pooled
    keys through `tables` (their address tables, state/tables.SequenceTables); the reference without Triton. Equal to
    each sequence's `materialize_pooled_fast` (the same program for each row)."""
    if use_triton(raws[0]):
        from qspec.kernels.triton_pooled import pooled_seqs_triton

        _check(raws[0], cells, dest, gamma, cos, sin, pooleds[0])
        pooled_seqs_triton(raws[0], cells, dest, gamma, eps, cos, sin, pooleds[0], tables)
        return
    materialize_pooled_seqs_torch(raws, cells, dest, gamma, eps, cos, sin, pooleds)
