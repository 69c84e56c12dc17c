"""GDN's gated RMSNorm in Triton, quantized for the int8 product in the same launch: grid (T, Hv), one program per
(row, value head): the head's RMS, times the norm weight and sigmoid(z), rounded to z's dtype, then each 32 of it
rounded to int8 as triton_qdot's activation quantizer does (launched without FMA fusion, as that one is).
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import HAS_TRITON, pdl_launch, tl_dtype

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start
    from qspec.kernels.triton_qdot import quantized_store

    @triton.jit
    def _gated_norm_quant_kernel(o_ptr, z_ptr, w_ptr, y_ptr, q_ptr, d_ptr, s_ptr, g_ptr, z_m, eps, DV: tl.constexpr,
                                 OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        m = tl.program_id(0)
        h = tl.program_id(1)
        width = tl.num_programs(1) * DV
        i = tl.arange(0, DV)
        x = tl.load(o_ptr + m * width + h * DV + i)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / DV + eps) * tl.load(w_ptr + i).to(tl.float32)
        z = tl.load(z_ptr + m * z_m + h * DV + i).to(tl.float32)
        y = (y * (1.0 / (1.0 + tl.exp(-z)))).to(OUT_DT)
        tl.store(y_ptr + m * width + h * DV + i, y)
        nb: tl.constexpr = DV // 32
        b = h * nb + tl.arange(0, nb)
        quantized_store(tl.reshape(y.to(tl.float32), [nb, 32]), q_ptr, d_ptr, s_ptr, g_ptr, m, b, b < width // 32,
                        width // 32, nb)


def gated_norm_quantized_triton(o: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """As gated_norm.gated_norm_torch (arguments checked by gated_norm.kernel_takes) -> (the row [T, Hv * dv] in z's
    dtype, that row quantized as triton_qdot.quantize_x_triton returns it)."""
    from qspec.kernels.triton_qdot import quantized_x_buffers

    T, Hv, dv = o.shape
    y = torch.empty(T, Hv * dv, dtype=z.dtype, device=z.device)
    q, d, s, g = quantized_x_buffers(T, Hv * dv, z.device)
    _gated_norm_quant_kernel[(T, Hv)](o, z, gamma, y, q, d, s, g, z.stride(0), eps, DV=dv, OUT_DT=tl_dtype(z.dtype),
                                      num_warps=1, enable_fp_fusion=False, **pdl_launch(z))
    return y, (q.view(torch.int32), d, s, g)
