"""Random-weight benchmark models generated directly on the target device.

`qspec.weights.random_model` draws every tensor on the CPU (bit-reproducible, for files and tests). At the real
geometry that is tens of GB (flash-next with 8 layers: about 24.7 B parameters with the MTP block, ~49 GB of
bf16), which must not pass through host memory, so here each canonical tensor is drawn with torch.randn /
torch.rand on the device, in fixed-size float32 chunks written into a tensor of the target dtype, with the same
per-tensor scaling as `random_tensor` (fan-in std, residual writers shrunk by 1/sqrt(2L), gammas near 1, decays
in [-16, -1]). Values differ from the CPU generator's; timing does not depend on them.

The n-gram table stays small through `ngram_vocab_base` (default 1000 rows per head instead of ~20 M) and is
held in a `DeviceRowTable` on the device.
"""

from __future__ import annotations

import math
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig, preset
from qspec.loader import host_experts_for
from qspec.model.model import Model
from qspec.model.ple import DeviceRowTable
from qspec.weights.gguf_io import PLE_TABLE, quantize_blocks, weights_summary
from qspec.weights.host_experts import HostExperts
from qspec.weights.names import tensor_shapes
from qspec.weights.quant_mix import keep_packed, mix_plan
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight
from qspec.weights.random_model import _RESIDUAL_WRITERS, is_centred_gamma

_CHUNK_ELEMS = 1 << 26  # float32 scratch per draw: 256 MiB, small next to the H200's memory
DEFAULT_NGRAM_VOCAB_BASE = 1000


def bench_config(name: str, *, layers: int | None = None, experts: int | None = None, vocab_size: int | None = None,
                 ngram_vocab_base: int | None = DEFAULT_NGRAM_VOCAB_BASE) -> ModelConfig:
    """The preset with an MTP head and a small n-gram table (benchmarks never need the 100 GB one)."""
    return preset(name, layers=layers, experts=experts, vocab_size=vocab_size, ngram_vocab_base=ngram_vocab_base,
                  mtp=True)


def param_count(cfg: ModelConfig, with_mtp: bool | None = None) -> dict[str, int]:
    """Parameters of `cfg` by the canonical shapes: total, and the part outside the n-gram table."""
    shapes = tensor_shapes(cfg, with_mtp)
    total = sum(math.prod(s) for s in shapes.values())
    table = math.prod(shapes[PLE_TABLE]) if PLE_TABLE in shapes else 0
    return {"total": total, "ngram_table": table, "excluding_ngram_table": total - table}


def _transform(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[bool, Callable[[torch.Tensor], Any]]:
    """(uniform draw?, value transform) for a canonical tensor: the scaling rules of `random_tensor`."""
    if name in (PLE_TABLE, "token_embd.weight"):
        return False, lambda x: x
    if is_centred_gamma(name):
        return False, lambda x: (1 + 0.1 * x).clamp_(0.5, 1.5)
    if name.endswith("ssm_norm.weight"):
        return False, lambda x: 1 + 0.02 * x
    if name.endswith(".ssm_a"):
        return True, lambda u: -(1 + 15 * u)
    if name.endswith(".ssm_dt.bias"):
        return True, lambda u: u
    if name.endswith("conv1d.weight"):
        return False, lambda x: 0.5 * x
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return False, lambda x: x / math.sqrt(cfg.hidden)
    std = 1 / math.sqrt(shape[-1])
    if name.endswith(_RESIDUAL_WRITERS):
        std /= math.sqrt(2 * (cfg.n_layers + cfg.n_mtp_layers))
    return False, lambda x: std * x


def device_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], *, device: torch.device,
                  dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """One canonical tensor drawn on `device` from its own generator (seed + crc32(name))."""
    uniform, fn = _transform(cfg, name, shape)
    g = torch.Generator(device=device)
    g.manual_seed((seed + zlib.crc32(name.encode())) % (1 << 63))
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1, shape[-1]) if len(shape) > 1 else out.view(1, -1)
    step = max(1, _CHUNK_ELEMS // flat.shape[1])
    for i in range(0, flat.shape[0], step):
        n = min(step, flat.shape[0] - i)
        draw = torch.rand if uniform else torch.randn
        x = draw(n, flat.shape[1], generator=g, device=device, dtype=torch.float32)
        flat[i:i + n] = fn(x)
    return out


def device_random_weights(cfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype,
                          seed: int = 0, quant: str | None = None, progress: bool = False,
                          plan: Mapping[str, GGMLQuantizationType] | None = None,
                          with_mtp: bool | None = None, host: HostExperts | None = None) -> dict[str, Any]:
    """Every canonical tensor of `cfg` (the MTP block's per `with_mtp`, see tensor_shapes) on `device` in `dtype`;
    the n-gram table as a DeviceRowTable.

    `quant` (quant_mix.MIXES: q4_k_m, q5_k_m, q6_k, q8_0, q4_0): the matrices a GGUF of that llama.cpp file type
    holds as blocks become `QuantWeight`s of their types, quantized on the device as each tensor is drawn (one
    16-bit tensor at a time), as a loaded GGUF of that type would hold them. `plan` gives each tensor's type
    instead (a file's own, for instance). `progress`: counts on stderr. `host`: the routed experts it wants go to
    page-locked host memory as each one is drawn, as a GGUF's load places them (weights/host_experts.py)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine (use --device cpu)")
    if plan is None:
        plan = mix_plan(quant, cfg) if quant is not None else {}
    w: dict[str, Any] = {}
    shapes = tensor_shapes(cfg, with_mtp)
    t0 = time.perf_counter()
    for i, (name, shape) in enumerate(shapes.items()):
        t = device_tensor(cfg, name, shape, device=dev, dtype=dtype, seed=seed)
        q = plan.get(name, GGMLQuantizationType.F32)
        if name == PLE_TABLE:
            w[name] = DeviceRowTable(t)
        elif q in PACKED_QTYPES and keep_packed(name):
            w[name] = QuantWeight.from_blocks(quantize_blocks(t, q), q, shape)  # the quantizer works by chunks
            del t
        else:
            w[name] = t
        if host is not None:
            w[name] = host.place(name, w[name], "the drawn model")
        if progress and ((i + 1) % 64 == 0 or i + 1 == len(shapes)):
            print(f"qspec: generated {i + 1}/{len(shapes)} tensors in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    return w


def device_random_model(cfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype,
                        seed: int = 0, quant: str | None = None, progress: bool = False,
                        host_experts: int = 0) -> Model:
    """A `Model` of random weights built on `device` (nothing of model size touches host memory, but the routed
    experts of the first `host_experts` layers, kept there); `quant`: see `device_random_weights`."""
    host = host_experts_for(host_experts, torch.device(device))
    if host is not None:
        host.bind(cfg.n_layers)
    w = device_random_weights(cfg, device=device, dtype=dtype, seed=seed, quant=quant, progress=progress, host=host)
    model = Model(cfg, w)
    model.weights_summary = weights_summary(w) + model.head_note() + (host.describe() if host else "")
    return model
