"""Weight loading: GGUF files and HF checkpoints -> (ModelConfig, canonical weight dict).

Every loader returns the names and torch shapes of `names.tensor_shapes(cfg)` in llama.cpp's value
conventions (1+w gammas except `ssm_norm`, `ssm_a = -exp(A_log)`, GDN value heads in tiled order), with the
n-gram table `per_layer_token_embd.weight` as a host-resident `HostRowTable`. File formats end here: the
model never sees them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qspec.config import ConfigError, ModelConfig
from qspec.weights.dequant import WeightsError, dequantize, quantize_q4_0, quantize_q8_0
from qspec.weights.gguf_io import (
    HostRowTable,
    Weights,
    read_draft_gguf,
    read_gguf,
    read_gguf_metadata,
    write_gguf,
)
from qspec.weights.gguf_open import GGUF_MAGIC
from qspec.weights.hf import read_hf, write_hf
from qspec.weights.host_experts import HostExperts
from qspec.weights.random_model import random_weights, write_random_model

__all__ = [
    "ConfigError", "HostRowTable", "Weights", "WeightsError", "dequantize", "load_model_weights", "quantize_q4_0",
    "quantize_q8_0", "random_weights", "read_draft_gguf", "read_gguf", "read_gguf_metadata", "read_hf",
    "write_gguf", "write_hf", "write_random_model",
]


def load_model_weights(path: str | os.PathLike[str], *, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, with_mtp: bool | None = None,
                       dequantize_all: bool = False, progress: bool | None = None,
                       host: HostExperts | None = None) -> tuple[ModelConfig, Weights]:
    """Load a `.gguf` file or an HF checkpoint directory; raises WeightsError / ConfigError naming the fault.

    GGUF matrices of a packed block type stay blocks (`QuantWeight`) unless `dequantize_all`; `host`: routed
    experts kept in host memory (see read_gguf)."""
    p = Path(path)
    if not p.exists():
        raise WeightsError(f"{p}: file not found")
    if p.is_dir():
        if host is not None and host.layers:
            raise WeightsError(f"{p}: --host-experts applies to GGUF files (an HF checkpoint's experts are not blocks)")
        return read_hf(p, device, dtype, with_mtp)
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        hint = " (for safetensors pass the checkpoint directory)" if p.suffix == ".safetensors" else ""
        raise WeightsError(f"{p}: not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r}){hint}")
    return read_gguf(p, device, dtype, with_mtp, dequantize_all=dequantize_all, progress=progress, host=host)
