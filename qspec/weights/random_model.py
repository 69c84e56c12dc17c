"""Deterministic random weights in the canonical layout, and writers for random GGUF / HF model files.

Each tensor draws from its own generator seeded with `seed + crc32(name)`, so adding or removing tensors
never changes the others, and values are generated in fixed row chunks straight into the output tensor
(no second full-size copy: the real geometry has 248320 x 2560 embeddings). Scales keep a deep random
stack numerically healthy: fan-in-scaled matrices, residual-writing projections shrunk by 1/sqrt(2L),
gammas near 1, and decays `ssm_a` in [-16, -1].
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig
from qspec.weights.gguf_io import PLE_TABLE, HostRowTable, Weights, write_gguf
from qspec.weights.hf import write_hf
from qspec.weights.names import tensor_shapes
from qspec.weights.quant_mix import mix_metadata, mix_plan

_CHUNK_ELEMS = 1 << 22  # elements drawn per generator call; part of the definition of the values
_RESIDUAL_WRITERS = (".attn_output.weight", ".ssm_out.weight", ".ffn_down_exps.weight", ".ffn_down_shexp.weight",
                     ".ple_value.weight")
_GGUF_TYPE = {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
              torch.bfloat16: GGMLQuantizationType.BF16}


def is_centred_gamma(name: str) -> bool:
    """Zero-centred RMSNorm gammas (stored as 1 + w): every `*norm*` tensor except the gated `ssm_norm`."""
    last = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    return "norm" in last and last != "ssm_norm"


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % (1 << 63))


def _fill(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, uniform: bool,
          fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Draw N(0,1) (or U[0,1)) in fixed row chunks into a preallocated tensor, applying `fn` per chunk."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1, shape[-1]) if len(shape) > 1 else out.view(1, -1)
    step = max(1, _CHUNK_ELEMS // flat.shape[1])
    for i in range(0, flat.shape[0], step):
        n = min(step, flat.shape[0] - i)
        x = torch.rand(n, flat.shape[1], generator=g) if uniform else torch.randn(n, flat.shape[1], generator=g)
        flat[i:i + n] = fn(x) if fn is not None else x
    return out


def random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One canonical tensor (llama.cpp value conventions) drawn from its own per-name generator."""
    g = _generator(seed, name)
    if name == PLE_TABLE or name == "token_embd.weight":
        return _fill(shape, dtype, g, uniform=False)
    if is_centred_gamma(name):
        return _fill(shape, dtype, g, False, lambda x: (1 + 0.1 * x).clamp_(0.5, 1.5))
    if name.endswith("ssm_norm.weight"):
        return _fill(shape, dtype, g, False, lambda x: 1 + 0.02 * x)
    if name.endswith(".ssm_a"):
        # -exp(log U(1, 16)) through float64, so writing A_log to HF and reading it back is bit-exact
        return _fill(shape, dtype, g, True, lambda u: (-(1 + 15 * u).log().double().exp()).float())
    if name.endswith(".ssm_dt.bias"):
        return _fill(shape, dtype, g, uniform=True)
    if name.endswith("conv1d.weight"):
        return _fill(shape, dtype, g, False, lambda x: 0.5 * x)
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return _fill(shape, dtype, g, False, lambda x: x / math.sqrt(cfg.hidden))
    std = 1 / math.sqrt(shape[-1])  # fan-in (routers too: continuous values make top-k ties vanishingly rare)
    if name.endswith(_RESIDUAL_WRITERS):
        std /= math.sqrt(2 * (cfg.n_layers + cfg.n_mtp_layers))
    return _fill(shape, dtype, g, False, lambda x: std * x)


class RandomWeights(Mapping[str, "torch.Tensor | HostRowTable"]):
    """The canonical weight set of `cfg`, generated lazily on each lookup (for streaming writers)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 with_mtp: bool | None = None) -> None:
        self.cfg, self.seed, self.dtype = cfg, seed, dtype
        self.shapes = tensor_shapes(cfg, with_mtp)

    def __getitem__(self, name: str) -> torch.Tensor | HostRowTable:
        if name not in self.shapes:
            raise KeyError(name)
        t = random_tensor(self.cfg, name, self.shapes[name], self.seed, self.dtype)
        return HostRowTable.from_tensor(t) if name == PLE_TABLE else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   with_mtp: bool | None = None) -> Weights:
    """All canonical tensors of `cfg` (the n-gram table as an in-memory `HostRowTable`, like the loaders)."""
    return dict(RandomWeights(cfg, seed, dtype, with_mtp).items())


def write_random_model(out: str | os.PathLike[str], cfg: ModelConfig, seed: int = 0,
                       fmt: Literal["gguf", "hf"] = "gguf", dtype: torch.dtype = torch.float32,
                       qtype: GGMLQuantizationType | None = None, with_mtp: bool | None = None,
                       quant: str | None = None, extra_kv: Mapping[str, object] | None = None,
                       split_max_bytes: int = 0) -> list[Path]:
    """Write a random model tensor by tensor (peak memory: about one tensor, or one HF shard of 4 GiB); returns the
    files written (a GGUF's parts) or the checkpoint directory.

    gguf: matrices as `qtype` (default: the GGUF type of `dtype`), or in the per-tensor types of the llama.cpp
    file type `quant` (quant_mix.MIXES: q4_k_m, q5_k_m, q6_k, q8_0, q4_0), whose metadata the file records;
    `extra_kv` adds metadata, `split_max_bytes` > 0 writes parts (write_gguf). hf: a checkpoint directory in `dtype`."""
    lazy = RandomWeights(cfg, seed, dtype, with_mtp)
    if fmt == "gguf":
        if quant is not None and qtype is not None:
            raise ValueError("--qtype and --quant are exclusive")
        qtypes = mix_plan(quant, cfg) if quant is not None else qtype if qtype is not None else _GGUF_TYPE[dtype]
        kv = dict(extra_kv or {}) | (mix_metadata(quant) if quant is not None else {})
        return write_gguf(out, cfg, lazy, qtypes=qtypes, extra_kv=kv, split_max_bytes=split_max_bytes)
    if fmt == "hf":
        if qtype is not None or quant is not None or extra_kv or split_max_bytes:
            raise ValueError("--qtype / --quant / metadata / parts apply to GGUF output only")
        write_hf(out, cfg, lazy, dtype=dtype, max_shard_bytes=4 << 30)
        return [Path(out)]
    raise ValueError(f"format: expected 'gguf' or 'hf', got {fmt!r}")
