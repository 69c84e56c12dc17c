"""GDN's step conv in Triton: grid (T, 2 Hk + Hv), one program per (row t, head j) of the conv channels
[q heads | k heads | v heads] (key heads DK channels wide, value heads DV): the K taps of its channels over the
window X [C, s+T], added in the reference's order, silu, then for a q or k head the L2 norm (and the q scale),
written straight into q, k [T, Hk, DK] or v [T, Hv, DV].
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch

L2_EPS = 1e-6  # the q/k L2 norms' epsilon (ops.l2_norm's)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start

    @triton.jit
    def conv_silu(x_ptr, w_ptr, c, cmask, t, x_c, KT: tl.constexpr):
        """silu of row t's causal conv for channels c (zero where not cmask): the KT taps w [C, KT] over the window
        X [C, KT - 1 + T] (row stride x_c), added in the reference's order. Shared with triton_gdn's kernel."""
        acc = tl.load(x_ptr + c * x_c + t, mask=cmask, other=0.0) * tl.load(w_ptr + c * KT, mask=cmask, other=0.0)
        for tap in tl.static_range(1, KT):
            acc = acc + tl.load(x_ptr + c * x_c + t + tap, mask=cmask, other=0.0) * tl.load(w_ptr + c * KT + tap,
                                                                                            mask=cmask, other=0.0)
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit
    def l2_normed(y, eps):
        return y * tl.math.rsqrt(tl.sum(y * y, axis=0) + eps)

    @triton.jit
    def _gdn_conv_kernel(x_ptr, w_ptr, q_ptr, k_ptr, v_ptr, x_c, Hk, scale, eps, DK: tl.constexpr,
                         DV: tl.constexpr, DP: tl.constexpr, KT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0)
        j = tl.program_id(1)
        dd = tl.arange(0, DP)
        qk = j < 2 * Hk
        dm = dd < tl.where(qk, DK, DV)
        c = tl.where(qk, j * DK, 2 * Hk * DK + (j - 2 * Hk) * DV) + dd  # value heads start after 2 Hk key heads
        y = conv_silu(x_ptr, w_ptr, c, dm, t, x_c, KT)
        if qk:
            y = l2_normed(y, eps)
            if j < Hk:
                tl.store(q_ptr + (t * Hk + j) * DK + dd, y * scale, mask=dm)
            else:
                tl.store(k_ptr + (t * Hk + j - Hk) * DK + dd, y, mask=dm)
        else:
            Hv = tl.num_programs(1) - 2 * Hk
            tl.store(v_ptr + (t * Hv + j - 2 * Hk) * DV + dd, y, mask=dm)


def gdn_conv_qkv_triton(X: torch.Tensor, conv_w: torch.Tensor, T: int, Hk: int, Hv: int, dk: int,
                        dv: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As gdn_conv.gdn_conv_qkv_torch (arguments checked by gdn_conv.kernel_takes): f32 q, k and v."""
    dv = dk if dv is None else dv
    q = torch.empty(T, Hk, dk, dtype=torch.float32, device=X.device)
    k = torch.empty_like(q)
    v = torch.empty(T, Hv, dv, dtype=torch.float32, device=X.device)
    _gdn_conv_kernel[(T, 2 * Hk + Hv)](X, conv_w, q, k, v, X.stride(0), Hk, dk ** -0.5, L2_EPS, DK=dk, DV=dv,
                                       DP=max(16, next_pow2(max(dk, dv))), KT=conv_w.shape[1], num_warps=4,
                                       **pdl_launch(X))
    return q, k, v
