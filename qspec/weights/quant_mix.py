"""Which GGUF type each tensor gets in a quantized file, and which tensors the loader keeps as blocks.

Writing: `mix_qtype` follows llama.cpp's per-tensor rule (`llama_tensor_get_type` in src/llama-quant.cpp) for the
file types users download: Q4_K_M and Q5_K_M (Q4_K / Q5_K matrices; the output head Q6_K; attention-V and FFN-down
of the "more bits" layers Q6_K; GDN's fused attn_qkv one step up), Q6_K, Q8_0 and Q4_0 (the output head Q6_K, as
llama.cpp does for every type below Q8_0). Never quantized, as in llama.cpp: 1-D tensors, the routers
(`ffn_gate_inp`), convolution kernels. The hyper-connection mixers' matrices (`hc_*_down`, `hc_*_up`, `hc_*_inject`)
are quantized like any other matrix, as llama.cpp's llama-quantize does: an 8-layer flash-next Q4_K_M file of
llama-quantize's holds 13.69 GiB at 5.34 bits per weight, which this rule reproduces (13.72 GiB, 5.345 bits without
the MTP block and the n-gram table; with the mixers kept F32 it would be 14.07 GiB, 5.48 bits). Rows that are not
whole 256-weight super-blocks (the experts' 640-wide down projections, the mixers' 320-wide up projections) fall back
as llama.cpp's do: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0; rows that are not whole 32-weight blocks to F32.

Loading: `keep_packed` says which tensors of a packed type stay as blocks (`QuantWeight`); the rest are expanded.
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.config import ModelConfig
from qspec.weights.dequant import WeightsError
from qspec.weights.names import tensor_shapes

Q = GGMLQuantizationType
MIXES: dict[str, Q] = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
# llama.cpp's one-step-up for GDN's fused qkv projection (attn_qkv) in the _M mixes
_QKV_UP = {"q4_k_m": Q.Q5_K, "q5_k_m": Q.Q6_K}
_K_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _exempt(name: str) -> bool:
    """Matrices llama.cpp leaves unquantized: the routers and the convolution kernels."""
    return name.endswith(".ffn_gate_inp.weight") or "conv1d" in name


def keep_packed(name: str) -> bool:
    """Whether a matrix of a packed type stays as its blocks at load: every one the model multiplies through
    ops.linear / the expert paths / the mixers' kernels or gathers rows of; the conv kernels (read tap by tap) are
    expanded."""
    return "conv1d" not in name


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama.cpp's fallback for a K-quant tensor whose rows are not whole super-blocks
_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _fits(q: Q, k: int) -> Q:
    if q in _K_TYPES and k % GGML_QUANT_SIZES[q][0]:
        q = _K_FALLBACK[q]
    if k % GGML_QUANT_SIZES[q][0]:
        return Q.F32
    return q


def mix_qtype(mix: str, name: str, shape: tuple[int, ...], n_layers: int, attn_layers: tuple[int, ...] = ()) -> Q:
    """The type of tensor `name` [*, K] in a file of type `mix` (one of MIXES).

    n_layers: the trunk's layer count (the MTP block, blk.{n_layers}, counts as a last layer);
    attn_layers: the attention (QSA) layers in order, for attention-V's "more bits" count."""
    if mix not in MIXES:
        raise WeightsError(f"unknown quantization mix {mix!r} (known: {', '.join(MIXES)})")
    if len(shape) == 1 or _exempt(name):
        return Q.F32
    base = MIXES[mix]
    k = shape[-1]
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else -1
    q = base
    if name == "output.weight":
        q = Q.Q8_0 if base == Q.Q8_0 else Q.Q6_K
    elif mix in _QKV_UP and name.endswith(".attn_qkv.weight"):
        q = _QKV_UP[mix]
    elif mix in _QKV_UP and name.endswith(".attn_v.weight"):
        order = list(attn_layers)
        i = order.index(layer) if layer in order else len(order)
        if use_more_bits(i, max(len(order), 1)):
            q = Q.Q6_K
    elif mix in _QKV_UP and ".ffn_down" in name and layer >= 0 and use_more_bits(layer, n_layers):
        q = Q.Q6_K
    return _fits(q, k)


def mix_plan(mix: str, cfg: ModelConfig) -> dict[str, Q]:
    """mix_qtype for every tensor of `cfg`'s weight set (MTP block included when the config has one)."""
    attn = tuple(cfg.qsa_layers()) + ((cfg.mtp_layer,) if cfg.has_mtp else ())
    return {n: mix_qtype(mix, n, s, cfg.n_layers, attn) for n, s in tensor_shapes(cfg).items()}
