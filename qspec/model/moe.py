"""Mixture of experts: softmax over all experts, top-k renormalised, plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qspec.kernels.moe_few import moe_few
from qspec.kernels.triton_common import use_triton
from qspec.model.fuse import fused
from qspec.model.ops import EXACT_MAX_ROWS, linear, row_exact, sigmoid, silu, stack_rows

# Decode/verify steps on the GPU route a few tokens without a host round trip (CUDA-graph safe).
FEW_TOKENS = 16


def moe_few_tokens(h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """The chosen experts of a few tokens, with no data-dependent host control flow.

    Uses the Triton kernel when available (reads only the chosen experts' weights); the torch
    fallback gathers the chosen experts' matrices, which costs extra copies."""
    if use_triton(h):
        return moe_few(h, top_i, top_w, gate, up, down)
    T, k = top_i.shape
    idx = top_i.reshape(-1)
    x = h.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, D]
    a = torch.bmm(x, gate[idx].transpose(1, 2))
    b = torch.bmm(x, up[idx].transpose(1, 2))
    y = torch.bmm(F.silu(a) * b, down[idx].transpose(1, 2)).view(T, k, -1)
    return (y * top_w.unsqueeze(-1)).sum(1)


def top_k_experts(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, the top k renormalised -> (weights [T, k] in the logits' dtype, ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def route(h: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return top_k_experts(linear(h, router), k)


@fused
def moe_in(h: torch.Tensor, w_in: torch.Tensor, n_experts: int, ff: int, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_in = [router ; shared gate ; shared up ; shared gate_inp] -> (top_w, top_i, shared activation
    silu(gate h) * up h [T, ff], shared-expert gate sigmoid(gate_inp . h) [T, 1])."""
    y = linear(h, w_in)
    top_w, top_i = top_k_experts(y[:, :n_experts], k)
    g, u, gi = y[:, n_experts:n_experts + ff], y[:, n_experts + ff:n_experts + 2 * ff], y[:, n_experts + 2 * ff:]
    return top_w, top_i, silu(g) * u, sigmoid(gi)


@fused
def add_shared_expert(routed: torch.Tensor, act: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return routed + linear(act, down) * gate


class MoE(torch.nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], b: str, n_used: int) -> None:
        super().__init__()
        self.n_used = n_used
        # the router and the shared expert's gate, up and gate_inp all read h: one product
        self.w_in, (self.router, self.sh_gate, self.sh_up, sh_gate_inp) = stack_rows(
            w[f"{b}.ffn_gate_inp.weight"], w[f"{b}.ffn_gate_shexp.weight"], w[f"{b}.ffn_up_shexp.weight"],
            w[f"{b}.ffn_gate_inp_shexp.weight"][None, :])
        self.sh_gate_inp = sh_gate_inp[0]  # [D]
        self.gate = w[f"{b}.ffn_gate_exps.weight"]  # [E, F, D]
        self.up = w[f"{b}.ffn_up_exps.weight"]  # [E, F, D]
        self.down = w[f"{b}.ffn_down_exps.weight"]  # [E, D, F]
        self.sh_down = w[f"{b}.ffn_down_shexp.weight"]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.router, self.n_used)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        T, D = h.shape
        top_w, top_i, act, gate = moe_in(h, self.w_in, self.router.shape[0], self.sh_gate.shape[0], self.n_used)
        if row_exact() and T <= EXACT_MAX_ROWS:
            routed = self._per_token(h, top_w, top_i)
        elif h.is_cuda and T <= FEW_TOKENS:
            routed = moe_few_tokens(h, top_w, top_i, self.gate, self.up, self.down)
        else:
            routed = self._grouped(h, top_w, top_i)
        return add_shared_expert(routed, act, gate, self.sh_down)

    def _per_token(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair as its own M=1 product: a row never depends on its neighbours."""
        rows = []
        for t, experts in enumerate(top_i.tolist()):
            x = h[t:t + 1]
            ys = [F.linear(F.silu(F.linear(x, self.gate[e])) * F.linear(x, self.up[e]), self.down[e]) for e in experts]
            rows.append((torch.cat(ys) * top_w[t, :, None]).sum(0, keepdim=True))
        return torch.cat(rows)

    def _grouped(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            x = h[tok]
            y = F.linear(F.silu(F.linear(x, self.gate[e])) * F.linear(x, self.up[e]), self.down[e])
            out[tok] += y * top_w[tok, slot, None]  # a token picks an expert at most once
        return out

