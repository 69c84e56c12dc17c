"""The bytes of weights a decoding step reads: the numerator of the bandwidth limits in BENCHMARKS.md (Method).

A step of `rows` tokens reads every trunk matrix and vector once, the routed experts its rows chose (for uniformly
routed rows, E * (1 - (1 - k/E)^rows) distinct experts of E), the LM head, one embedding row per token and the
n-gram table's rows per token; the MTP block is the draft's and is counted apart. Sizes are the weights as held
(blocks for packed tensors, 16 bits otherwise), so the same count serves bf16 and quantized models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from qspec.config import ModelConfig
from qspec.weights.qweight import QuantWeight

_LAYER = re.compile(r"^blk\.(\d+)\.")
_PER_TOKEN_ROWS = ("token_embd.weight", "per_layer_token_embd.weight")


def held_bytes(v: Any) -> int:
    """Bytes of a weight as held: blocks, a tensor, or a row table (its `nbytes` / table)."""
    if isinstance(v, QuantWeight):
        return v.nbytes
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    table = getattr(v, "table", None)
    return held_bytes(table) if table is not None else int(getattr(v, "nbytes", 0))


def distinct_experts(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct experts touched by `rows` tokens routed uniformly."""
    E, k = cfg.n_experts, cfg.n_experts_used
    return E * (1 - (1 - k / E) ** rows) if E else 0.0


def step_bytes(w: Mapping[str, Any], cfg: ModelConfig, rows: int = 1) -> dict[str, float]:
    """Weight bytes read by a trunk step of `rows` tokens ("trunk"), and by one MTP-block step of one row
    ("mtp_block", without the LM head it shares), from the weights `w` as held."""
    out = {"trunk": 0.0, "mtp_block": 0.0}
    for name, v in w.items():
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else -1
        part = "mtp_block" if layer >= cfg.n_layers else "trunk"
        b = float(held_bytes(v))
        if name in _PER_TOKEN_ROWS:
            shape = getattr(v, "shape", (1, 1))
            heads = cfg.ple_heads if name.startswith("per_layer") else 1
            b = b / max(int(shape[0]), 1) * heads * rows
        elif "_exps." in name:
            b *= distinct_experts(cfg, rows if part == "trunk" else 1) / cfg.n_experts
        out[part] += b
    return out
