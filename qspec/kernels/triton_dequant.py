"""q8_0 K and V dequantisation in one Triton launch: grid (cdiv(numel, BLOCK), 2), axis 1 picks K or V.

Each program converts BLOCK consecutive int8 values: value (f32) * its block's f16 scale (f32), rounded
once to the output dtype, as `dequant_q8_0_torch` does op by op, so the result is bit-identical.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, pdl_launch, tl_dtype

BLOCK = 2048

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, round_to

    @triton.jit
    def _dequant_q8_0_kernel(kq_ptr, ks_ptr, ko_ptr, vq_ptr, vs_ptr, vo_ptr, numel,
                             QB: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < numel
        if tl.program_id(1) == 0:
            q_ptr, s_ptr, o_ptr = kq_ptr, ks_ptr, ko_ptr
        else:
            q_ptr, s_ptr, o_ptr = vq_ptr, vs_ptr, vo_ptr
        q = tl.load(q_ptr + i, mask=mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + i // QB, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + i, round_to(q * s, DT).to(o_ptr.dtype.element_ty), mask=mask)


def dequant_kv_triton(k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous int8 k, v [..., D] with f16 scales [..., D/32] (checked by `dequant_kv`) -> k, v in dtype."""
    ko = torch.empty(k.shape, dtype=dtype, device=k.device)
    vo = torch.empty(v.shape, dtype=dtype, device=v.device)
    n = k.numel()
    if n:
        _dequant_q8_0_kernel[(triton.cdiv(n, BLOCK), 2)](k, k_scale, ko, v, v_scale, vo, n, QB=32,
                                                         DT=tl_dtype(dtype), BLOCK=BLOCK, num_warps=8, **pdl_launch(k))
    return ko, vo
