"""GDN's output for a decode step: the sigmoid-gated RMSNorm per value head, then the output product.

`gated_norm_torch` is the model's math (model/gdn.py runs it compiled, with the product, as `gdn_out`). Where the
output product takes its row rounded to int8 (a one-row step on CUDA, qmatmul.int8_product), one Triton program per
(row, value head) norms, gates and quantizes the row in one launch (triton_gated_norm.py), and the product reads it
quantized: two launches instead of the compiled function's two kernels, the quantizer's and the product's. Its bf16
row is the reference's up to the order of the norm's sum; the quantized row is exactly `quantize_x_torch` of that
bf16 row, as the product's own quantizer would give it.
"""

from __future__ import annotations

import contextlib

import torch

from qspec.kernels.qmatmul import int8_product
from qspec.kernels.triton_common import module_flag
from qspec.model.ops import rms_norm, row_exact, sigmoid
from qspec.weights.qweight import QuantWeight

# A module flag (EngineOptions.norm_quant through runner.KernelSwitches); off: the compiled function (A/B runs).
_ON = True


def kernel_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, one-row GDN outputs norm and quantize in one launch (on) or run compiled (off)."""
    return module_flag(__name__, "_ON", on)


def gated_norm_torch(o: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """o [T, Hv, dv] f32, z [T, Hv * dv] -> rms_norm(o) * gamma * sigmoid(z) [T, Hv * dv] in z's dtype."""
    T = o.shape[0]
    y = rms_norm(o, gamma, eps) * sigmoid(z.reshape(o.shape).float())
    return y.reshape(T, -1).to(z.dtype)


def kernel_takes(o: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, w_out: object) -> bool:
    """Whether `gated_norm_product` runs this output: switched on, not row-exact mode, block weights whose product
    takes these rows in int8, f32 heads of a power-of-two width that is a multiple of 32 (whole quantizer blocks per
    head), the gate's rows contiguous."""
    if not (_ON and isinstance(w_out, QuantWeight) and w_out.dim() == 2 and not row_exact() and o.dim() == 3):
        return False
    T, Hv, dv = o.shape
    return (int8_product(z, w_out.code, w_out.shape[0]) and o.dtype == torch.float32 and o.is_contiguous()
            and dv % 32 == 0 and dv & (dv - 1) == 0 and z.shape == (T, Hv * dv) and z.stride(1) == 1
            and gamma.shape == (dv,) and gamma.is_contiguous() and w_out.shape[1] == Hv * dv)


def gated_norm_product(o: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, w_out: QuantWeight,
                       eps: float) -> torch.Tensor:
    """gated_norm_torch(o, z, gamma, eps) @ w_out^T [T, N] in z's dtype, the row normed and quantized in one launch
    (for calls `kernel_takes` accepts)."""
    from qspec.kernels.triton_gated_norm import gated_norm_quantized_triton
    from qspec.kernels.triton_qdot import qdot_quantized_triton

    _, xquant = gated_norm_quantized_triton(o, z, gamma, eps)
    return qdot_quantized_triton(xquant, [(w_out.raw.contiguous(), w_out.code)], z.dtype)
