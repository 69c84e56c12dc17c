"""Gated DeltaNet layer: conv + silu, L2-normed q/k, gated delta rule, sigmoid-gated RMSNorm.

Value heads are in llama.cpp's tiled order: value head n reads key head n % k_heads.
"""

from __future__ import annotations

import torch

from qspec.config import ModelConfig
from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots
from qspec.kernels.gdn_recurrent import gdn_chunked_torch, gdn_recurrent_torch
from qspec.kernels.triton_gdn import gdn_recurrent_planes
from qspec.model.ops import causal_taps, l2_norm, linear, rms_norm, sigmoid, silu, softplus
from qspec.state.recurrent import GDNState, RecurrentCache


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule for prefill: fla's Triton kernel on CUDA when installed, torch otherwise."""
    if q.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            chunk_gated_delta_rule = None
        if chunk_gated_delta_rule is not None:
            # q/k are already L2-normalised, q scaled, and expanded to one head per value head
            o, Sf = chunk_gated_delta_rule(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                                           g[None].contiguous(), beta[None].contiguous(), scale=1.0,
                                           initial_state=S0[None].contiguous(), output_final_state=True)
            return o[0].float(), Sf[0].float()
    return gdn_chunked_torch(q, k, v, g, beta, S0)


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], b: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = w[f"{b}.attn_qkv.weight"]
        self.z = w[f"{b}.attn_gate.weight"]
        self.conv_w = w[f"{b}.ssm_conv1d.weight"].float()  # [C, K]
        self.dt_bias = w[f"{b}.ssm_dt.bias"].float()
        self.a = w[f"{b}.ssm_a"].float()
        self.beta = w[f"{b}.ssm_beta.weight"]
        self.alpha = w[f"{b}.ssm_alpha.weight"]
        self.norm = w[f"{b}.ssm_norm.weight"]
        self.out = w[f"{b}.ssm_out.weight"]

    def forward(self, h: torch.Tensor, st: GDNState, rc: RecurrentCache, fused_snapshots: bool,
                stats: SnapshotStats | None) -> torch.Tensor:
        c = self.cfg
        T = h.shape[0]
        Hk, Hv, d = c.gdn_k_heads, c.gdn_v_heads, c.gdn_head_dim
        qkv = linear(h, self.qkv).float()  # [T, C]
        z = linear(h, self.z).view(T, Hv, d)
        beta = sigmoid(linear(h, self.beta).float())
        g = self.a * softplus(linear(h, self.alpha).float() + self.dt_bias)

        # conv over [live window || new rows]; snapshots of the window after each row
        S = st.conv.index_select(0, rc.live.view(1))[0]
        last_only = T > rc.n_slots
        X = write_snapshots(S, qkv, st.conv, rc.base, rc.host_base, T, last_only, fused_snapshots, stats)
        conv = silu(causal_taps(X, self.conv_w, T)).t().contiguous()  # [T, C]

        q, k, v = torch.split(conv, [c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        rep = Hv // Hk
        q = l2_norm(q.reshape(T, Hk, d)) * d ** -0.5
        k = l2_norm(k.reshape(T, Hk, d))
        v = v.reshape(T, Hv, d).contiguous()
        if h.is_cuda and not last_only:
            # Triton: state tile in registers across the rows, each row's state to its rollback plane
            o = gdn_recurrent_planes(q, k, v, g, beta, st.ssm, rc.live, rc.base)
            return self._finish(o, z, h.dtype)
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)  # value head n reads key head n % Hk
        S0 = st.ssm.index_select(0, rc.live.view(1))[0]
        if last_only:
            o, Sf = gdn_chunked(q, k, v, g, beta, S0)
            st.ssm.index_copy_(0, rc.base.view(1), Sf.unsqueeze(0))
        else:
            o, states = gdn_recurrent_torch(q, k, v, g, beta, S0, keep_states=True)
            st.ssm.index_copy_(0, rc.base + torch.arange(T, device=h.device), states)

        return self._finish(o, z, h.dtype)

    def _finish(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sigmoid-gated RMSNorm per head, then the output projection."""
        o = rms_norm(o, self.norm, self.cfg.rms_eps) * sigmoid(z.float())
        return linear(o.reshape(o.shape[0], -1).to(dtype), self.out)
