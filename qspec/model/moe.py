"""Mixture of experts: softmax over all experts, top-k renormalised, plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qspec.model.ops import bmm_rows, linear

# Up to this many tokens, the chosen experts are applied token by token (gathered weights, M=1
# products): a verify step touches few tokens, and per-token products keep rows independent.
FEW_TOKENS = 16


class MoE(torch.nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], b: str, n_used: int) -> None:
        super().__init__()
        self.n_used = n_used
        self.router = w[f"{b}.ffn_gate_inp.weight"]
        self.gate = w[f"{b}.ffn_gate_exps.weight"]  # [E, F, D]
        self.up = w[f"{b}.ffn_up_exps.weight"]  # [E, F, D]
        self.down = w[f"{b}.ffn_down_exps.weight"]  # [E, D, F]
        self.sh_gate_inp = w[f"{b}.ffn_gate_inp_shexp.weight"]  # [D]
        self.sh_gate = w[f"{b}.ffn_gate_shexp.weight"]
        self.sh_up = w[f"{b}.ffn_up_shexp.weight"]
        self.sh_down = w[f"{b}.ffn_down_shexp.weight"]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.n_used, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        return top_w.to(h.dtype), top_i

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        T, D = h.shape
        top_w, top_i = self.route(h)
        if T <= FEW_TOKENS:
            routed = self._few_tokens(h, top_w, top_i)
        else:
            routed = self._grouped(h, top_w, top_i)
        sh = linear(F.silu(linear(h, self.sh_gate)) * linear(h, self.sh_up), self.sh_down)
        sh_gate = torch.sigmoid(linear(h, self.sh_gate_inp[None, :]))
        return routed + sh * sh_gate

    def _few_tokens(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        T, D = h.shape
        k = self.n_used
        idx = top_i.reshape(-1)
        x = h.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, D]
        g = bmm_rows(x, self.gate[idx].transpose(1, 2))  # [T*k, 1, F]
        u = bmm_rows(x, self.up[idx].transpose(1, 2))
        y = bmm_rows(F.silu(g) * u, self.down[idx].transpose(1, 2)).reshape(T, k, D)
        return (y * top_w.unsqueeze(-1)).sum(1)

    def _grouped(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            x = h[tok]
            y = F.linear(F.silu(F.linear(x, self.gate[e])) * F.linear(x, self.up[e]), self.down[e])
            out.index_add_(0, tok, y * top_w[tok, slot, None])
        return out

