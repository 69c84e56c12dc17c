"""GDN's step conv in Triton: grid (T, 2 Hk + Hv), one program per (row t, head j) of the conv channels
[q heads | k heads | v heads]: the K taps of its d channels over the window X [C, s+T], added in the reference's
order, silu, then for a q or k head the L2 norm (and the q scale), written straight into q, k or v [T, heads, d].
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start

    @triton.jit
    def _gdn_conv_kernel(x_ptr, w_ptr, q_ptr, k_ptr, v_ptr, x_c, Hk, scale, eps, D: tl.constexpr, DP: tl.constexpr,
                         KT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0)
        j = tl.program_id(1)
        dd = tl.arange(0, DP)
        dm = dd < D
        c = j * D + dd
        acc = tl.load(x_ptr + c * x_c + t, mask=dm, other=0.0) * tl.load(w_ptr + c * KT, mask=dm, other=0.0)
        for tap in tl.static_range(1, KT):
            acc = acc + tl.load(x_ptr + c * x_c + t + tap, mask=dm, other=0.0) * tl.load(w_ptr + c * KT + tap,
                                                                                            mask=dm, other=0.0)
        y = acc / (1.0 + tl.exp(-acc))  # silu
        if j < 2 * Hk:
            y = y * tl.math.rsqrt(tl.sum(y * y, axis=0) + eps)
            if j < Hk:
                tl.store(q_ptr + (t * Hk + j) * D + dd, y * scale, mask=dm)
            else:
                tl.store(k_ptr + (t * Hk + j - Hk) * D + dd, y, mask=dm)
        else:
            Hv = tl.num_programs(1) - 2 * Hk
            tl.store(v_ptr + (t * Hv + j - 2 * Hk) * D + dd, y, mask=dm)


def gdn_conv_qkv_triton(X: torch.Tensor, conv_w: torch.Tensor, T: int, Hk: int, Hv: int, d: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As gdn_conv.gdn_conv_qkv_torch (arguments checked by gdn_conv.kernel_takes): f32 q, k and v."""
    q = torch.empty(T, Hk, d, dtype=torch.float32, device=X.device)
    k = torch.empty_like(q)
    v = torch.empty(T, Hv, d, dtype=torch.float32, device=X.device)
    _gdn_conv_kernel[(T, 2 * Hk + Hv)](X, conv_w, q, k, v, X.stride(0), Hk, d ** -0.5, 1e-6, D=d,
                                       DP=max(16, next_pow2(d)), KT=conv_w.shape[1], num_warps=4, **pdl_launch(X))
    return q, k, v
