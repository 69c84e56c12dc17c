"""GDN's short convolution for a step: causal depthwise conv over [window || rows], silu, then the L2-normed (and for
q scaled) query and key heads and the value heads.

`gdn_conv_qkv_torch` is the reference (the model's math: taps added in order, silu, split, l2 norm). On CUDA, unless
switched off (`conv_kernel_mode(False)`, `EngineOptions(gdn_conv_kernel=False)`), a GDN step runs one Triton program
per (row, head) that does all of it (triton_gdn_conv.py); a one-row step does it inside the recurrence's launch
(triton_gdn.gdn_conv_recurrent_triton). Why: the compiled function is five generated kernels
per GDN layer of a step, the largest writing the transposed conv output, for ~0.5 MB of data; the one kernel takes
far less (BENCHMARKS.md §5, the GDN step conv row), and with the one-launch KV write it made plain
decoding faster end to end (§4, the q8_0 KV write + GDN conv row).
"""

from __future__ import annotations

import contextlib

import torch

from qspec.kernels.triton_common import module_flag, use_triton
from qspec.model.ops import causal_taps, l2_norm, row_exact, silu

# A module flag (EngineOptions.gdn_conv_kernel sets it around generate): dynamo guards on its value, like hc_mix's
# step-rows switch.
_ON = True


def conv_kernel_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, GDN steps run their conv, silu and q/k norms in the Triton kernel (on) or compiled (off)."""
    return module_flag(__name__, "_ON", on)


def gdn_conv_qkv_torch(X: torch.Tensor, conv_w: torch.Tensor, T: int, Hk: int, Hv: int, dk: int,
                       dv: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal conv + silu over X = [window || rows] [C, s+T] -> L2-normed, scaled q, k [T, Hk, dk] and
    v [T, Hv, dv] (C = 2 Hk dk + Hv dv; dv defaults to dk)."""
    dv = dk if dv is None else dv
    conv = silu(causal_taps(X, conv_w, T)).t().contiguous()  # [T, C]
    kd = Hk * dk
    q, k, v = torch.split(conv, [kd, kd, Hv * dv], dim=-1)
    q = l2_norm(q.reshape(T, Hk, dk)) * dk ** -0.5
    k = l2_norm(k.reshape(T, Hk, dk))
    return q, k, v.reshape(T, Hv, dv).contiguous()


def kernel_takes(X: torch.Tensor, conv_w: torch.Tensor, T: int, Hk: int, Hv: int, dk: int,
                 dv: int | None = None) -> bool:
    """Whether `gdn_conv_qkv_triton` runs this call: switched on, CUDA (or the interpreter), f32 window and taps of
    the model's shape, not row-exact mode."""
    dv = dk if dv is None else dv
    C = 2 * Hk * dk + Hv * dv
    return (_ON and use_triton(X) and not row_exact() and X.dtype == torch.float32 and conv_w.dtype == torch.float32
            and X.dim() == 2 and X.shape[0] == C and conv_w.shape[0] == C and X.shape[1] == T + conv_w.shape[1] - 1
            and X.stride(1) == 1 and conv_w.is_contiguous() and T > 0)
