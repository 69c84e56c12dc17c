"""Which GGUF type each tensor gets in a quantized file, and which tensors the loader keeps as blocks.

Writing: `mix_qtype` gives every tensor the type llama.cpp's quantizer (`llama_tensor_get_type`, src/llama-quant.cpp)
gives it in the file types users download: Q4_K_M and Q5_K_M (Q4_K / Q5_K matrices; the output head Q6_K; Q6_K for
the "more bits" layers' attention V, GDN's fused qkv, which llama.cpp counts with them, and every FFN down projection,
the mixers' `hc_ffn_down` among them since llama.cpp matches "ffn_down" anywhere in a name), Q6_K, Q8_0 and Q4_0
(the output head Q6_K below Q8_0); an 8-expert model's attention K/V/qkv Q8_0 and, in Q4_K_M, its attention output
Q5_K. Never quantized: 1-D tensors, the routers (`ffn_gate_inp`), GDN's conv kernels, the QSA indexer's
projections. Rows that are not whole 256-weight super-blocks (the experts' 640-wide down projections, the mixers'
320-wide up projections) fall back as llama.cpp's do: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0; rows that are not
whole 32-weight blocks (the n-gram conv's 4 taps) to F16. tests/test_llama_cpp.py checks every tensor's type against
llama.cpp's own quantizer (llama-cpp-python's) for each mix; an 8-layer flash-next Q4_K_M file of llama-quantize's
holds 13.69 GiB at 5.34 bits per weight, and this rule gives 13.73 GiB, 5.348 bits (the MTP block and the n-gram
table left out, as there).

Loading: `keep_packed` says which tensors of a packed type stay as blocks (`QuantWeight`); the rest are expanded.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from qspec.config import ModelConfig
from qspec.weights.dequant import WeightsError
from qspec.weights.names import tensor_shapes

Q = GGMLQuantizationType
MIXES: dict[str, Q] = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
# `--quantize` (an HF checkpoint quantized at load) also takes a K-quant mix by its matrices' type
MIX_ALIASES = {"q4_k": "q4_k_m", "q5_k": "q5_k_m"}
QUANTIZE_NAMES = (*MIX_ALIASES, *MIXES)  # what --quantize accepts
_MORE_BITS_MIXES = frozenset({"q4_k_m", "q5_k_m"})
# the file type llama-quantize records for each mix (general.file_type)
_FILE_TYPES = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M,
               "q6_k": LlamaFileType.MOSTLY_Q6_K, "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0}
_K_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _exempt(name: str) -> bool:
    """Matrices llama.cpp leaves unquantized: the routers, GDN's convolution kernels and the QSA indexer's
    projections. (The n-gram conv kernel is not exempt: its 4-tap rows fall back to F16.)"""
    return name.endswith(".ffn_gate_inp.weight") or "ssm_conv1d" in name or ".indexer." in name


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
        return Q.F16
    return q


def mix_qtype(mix: str, name: str, shape: tuple[int, ...], n_layers: int, n_experts: int = 0) -> Q:
    """The type of tensor `name` [*, K] in a file of type `mix` (one of MIXES). n_layers: the trunk's layer count
    (the MTP block, blk.{n_layers}, counts as a last layer); n_experts: the routed experts a layer (llama.cpp gives
    8-expert models' attention K/V/qkv Q8_0, and Q4_K_M's attention output Q5_K)."""
    _check_mix(mix)
    if len(shape) == 1 or _exempt(name):
        return Q.F32
    base = MIXES[mix]
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else -1
    q = base
    if name == "output.weight":
        q = Q.Q8_0 if base == Q.Q8_0 else Q.Q6_K
    elif n_experts == 8 and name.endswith((".attn_k.weight", ".attn_v.weight", ".attn_qkv.weight")):
        q = Q.Q8_0
    elif n_experts == 8 and mix == "q4_k_m" and name.endswith(".attn_output.weight"):
        q = Q.Q5_K
    elif mix in _MORE_BITS_MIXES and layer >= 0 and _more_bits_kind(name) and use_more_bits(layer, n_layers):
        q = Q.Q6_K
    return _fits(q, shape[-1])


def _more_bits_kind(name: str) -> bool:
    """The matrices whose "more bits" layers get Q6_K in the _M mixes: attention V and GDN's fused qkv (one per
    layer, counted by layer), and every FFN down projection, the mixers' `hc_ffn_down` included (llama.cpp matches
    the name's "ffn_down" anywhere)."""
    return name.endswith((".attn_v.weight", ".attn_qkv.weight")) or "ffn_down" in name


def _check_mix(mix: str) -> None:
    if mix not in MIXES:
        raise WeightsError(f"unknown quantization mix {mix!r} (known: {', '.join(MIXES)})")


def mix_metadata(mix: str) -> dict[str, Any]:
    """The metadata llama-quantize adds to a file of type `mix`: its file type and the block formats' version."""
    _check_mix(mix)
    return {Keys.General.FILE_TYPE: (int(_FILE_TYPES[mix]), GGUFValueType.UINT32),
            Keys.General.QUANTIZATION_VERSION: (GGML_QUANT_VERSION, GGUFValueType.UINT32)}


def mix_plan(mix: str, cfg: ModelConfig) -> dict[str, Q]:
    """mix_qtype for every tensor of `cfg`'s weight set (MTP block included when the config has one)."""
    return {n: mix_qtype(mix, n, s, cfg.n_layers, cfg.n_experts) for n, s in tensor_shapes(cfg).items()}
