"""Gated DeltaNet layer: conv + silu, L2-normed q/k, gated delta rule, sigmoid-gated RMSNorm.

Value heads are in llama.cpp's tiled order: value head n reads key head n % k_heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qspec.config import ModelConfig
from qspec.kernels import fla_configs, gated_norm, gdn_seqs
from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots
from qspec.kernels.gdn_conv import gdn_conv_qkv_torch, kernel_takes
from qspec.kernels.gdn_recurrent import gdn_chunked_torch, gdn_gates, gdn_recurrent_torch
from qspec.kernels.triton_common import use_triton
from qspec.kernels.triton_gdn import FINAL_MAX_ROWS, gdn_conv_recurrent_triton, gdn_recurrent_planes
from qspec.model.fuse import fused
from qspec.model.ops import Weight, linear, stack_rows
from qspec.state.recurrent import GDNState, RecurrentCache
from qspec.state.tables import SequenceTables

if TYPE_CHECKING:
    from qspec.model.model import ModelCache


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule for prefill: fla's Triton kernel on CUDA when installed, torch otherwise."""
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        # before fla's first import reads them
        fla_configs.use_shipped(torch.cuda.get_device_name(q.device), f"{major}.{minor}")
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
        # the four input projections read the same h: one product
        self.w_in, _ = stack_rows(
            w[f"{b}.attn_qkv.weight"], w[f"{b}.attn_gate.weight"], w[f"{b}.ssm_beta.weight"],
            w[f"{b}.ssm_alpha.weight"])
        self.conv_w = w[f"{b}.ssm_conv1d.weight"].float()  # [C, K]
        self.dt_bias = w[f"{b}.ssm_dt.bias"].float()
        self.a = w[f"{b}.ssm_a"].float()
        self.norm = w[f"{b}.ssm_norm.weight"]
        self.out = w[f"{b}.ssm_out.weight"]

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' input projections (qkv, z, beta logits, alpha logits): row by row, so a batched step makes them
        for every sequence's rows in one product (Model.forward_batch)."""
        c = self.cfg
        return gdn_in(h, self.w_in, c.gdn_conv_dim, c.gdn_value_dim, c.gdn_v_heads)

    def output(self, o: torch.Tensor, proj: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layer's output from the recurrence's o [T, Hv, dv] and the rows' projections (their gate z)."""
        return gdn_output(o, proj[1], self.norm, self.out, self.cfg.rms_eps)

    def recur(self, proj: tuple[torch.Tensor, ...], st: GDNState, rc: RecurrentCache, fused_snapshots: bool,
              stats: SnapshotStats | None) -> torch.Tensor:
        """One sequence's rows (their projections) through the conv and the recurrence on its state -> o [T, Hv, dv]."""
        c = self.cfg
        qkv, _, b_logit, a_logit = proj
        T = qkv.shape[0]
        Hk, Hv, dk, dv = c.gdn_k_heads, c.gdn_v_heads, c.gdn_head_dim, c.gdn_v_head_dim
        # conv over [live window || new rows]; snapshots of the window after each row
        last_only = T > rc.n_slots
        X = write_snapshots(st.conv, qkv, st.conv, rc.base, rc.host_base, T, last_only, fused_snapshots, stats,
                            live=rc.live)
        conv_kernel = kernel_takes(X, self.conv_w, T, Hk, Hv, dk, dv)  # on unless conv_kernel_mode(False)
        if conv_kernel and qkv.is_cuda and T == 1:
            # a one-row step's conv inside the recurrence's launch, each program computing its own q, k and v (at six
            # rows the rows' convs in the recurrence's serial loop cost more than the launch: BENCHMARKS.md §5c)
            return gdn_conv_recurrent_triton(X, self.conv_w, Hk, Hv, dk, dv, a_logit, b_logit, st.ssm, rc.live,
                                             rc.base, (self.a, self.dt_bias))
        if conv_kernel:
            from qspec.kernels.triton_gdn_conv import gdn_conv_qkv_triton

            q, k, v = gdn_conv_qkv_triton(X, self.conv_w, T, Hk, Hv, dk, dv)
        else:
            q, k, v = gdn_conv_qkv(X, self.conv_w, T, Hk, Hv, dk, dv)
        if qkv.is_cuda and (not last_only or (use_triton(qkv) and T <= FINAL_MAX_ROWS)):
            # Triton: state tile in registers across the rows, each row's state to its rollback plane (a short
            # prompt: only the last one, so its prefill compiles none of fla's chunked kernels); the kernel
            # computes the gates from the raw logits
            return gdn_recurrent_planes(q, k, v, a_logit, b_logit, st.ssm, rc.live, rc.base, (self.a, self.dt_bias),
                                        final_only=last_only)
        beta, g = gdn_gates(b_logit, a_logit, self.a, self.dt_bias)
        rep = Hv // Hk
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)  # value head n reads key head n % Hk
        S0 = st.ssm.index_select(0, rc.live.view(1))[0]
        if last_only:
            o, Sf = gdn_chunked(q, k, v, g, beta, S0)
            st.ssm.index_copy_(0, rc.base.view(1), Sf.unsqueeze(0))
        else:
            o, states = gdn_recurrent_torch(q, k, v, g, beta, S0, keep_states=True)
            st.ssm.index_copy_(0, rc.step_planes(T), states)
        return o

    def recur_seqs(self, proj: tuple[torch.Tensor, ...], caches: list[ModelCache], tables: SequenceTables | None,
                   layer: int) -> torch.Tensor | None:
        """Every sequence's rows (T each, in order; their projections) through the conv and the recurrence in two
        launches (kernels/gdn_seqs.py) -> o [rows, Hv, dv]; None where the batched kernels do not take the step (the
        caller then runs `recur` per sequence)."""
        c = self.cfg
        qkv, _, b_logit, a_logit = proj
        recs = [mc.rec for mc in caches]
        states = [rc.gdn[layer] for rc in recs]
        dims = (c.gdn_k_heads, c.gdn_v_heads, c.gdn_head_dim, c.gdn_v_head_dim)
        plan = None if tables is None else gdn_seqs.seqs_take(qkv, self.conv_w, recs, states,
                                                              [mc.opts.fused_snapshots for mc in caches], dims)
        if plan is None:
            return None
        plan.count([mc.snap_stats for mc in caches])
        return gdn_seqs.gdn_step_seqs_triton(qkv, a_logit, b_logit, tables, layer, self.conv_w, dims,
                                             (self.a, self.dt_bias))


@fused
def gdn_in(h: torch.Tensor, w_in: torch.Tensor, C: int, Cv: int, Hv: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_in = [qkv ; z ; beta ; alpha] -> (conv input [T, C], output gate z [T, Cv], beta logits [T, Hv], alpha
    logits [T, Hv]), all in h's dtype and raw: the snapshot kernel widens the conv input as it loads it and the
    gates come from `gdn_gates` (inside the recurrence kernel on CUDA), so no kernel here computes them."""
    y = linear(h, w_in)
    return y[:, :C], y[:, C:C + Cv], y[:, C + Cv:C + Cv + Hv], y[:, C + Cv + Hv:C + Cv + 2 * Hv]


# causal conv + silu over [window || rows] -> L2-normed, scaled q, k and v (kernels/gdn_conv.py), compiled
gdn_conv_qkv = fused(gdn_conv_qkv_torch)


def gdn_output(o: torch.Tensor, z: torch.Tensor, norm: torch.Tensor, w_out: Weight, eps: float) -> torch.Tensor:
    """The layer's output from the recurrence's o [T, Hv, dv] and the gate z: a one-row step with block weights
    norms and quantizes its row in one launch for the product (kernels/gated_norm.py), anything else `gdn_out`."""
    if gated_norm.kernel_takes(o, z, norm, w_out):
        return gated_norm.gated_norm_product(o, z, norm, w_out, eps)  # type: ignore[arg-type]
    return gdn_out(o, z, norm, w_out, eps)


@fused
def gdn_out(o: torch.Tensor, z: torch.Tensor, norm: torch.Tensor, w_out: torch.Tensor, eps: float) -> torch.Tensor:
    """Sigmoid-gated RMSNorm per value head (o [T, Hv, dv] f32), then the output projection."""
    return linear(gated_norm.gated_norm_torch(o, z, norm, eps), w_out)
