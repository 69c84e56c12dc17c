"""MoE routing: softmax over all experts, the top k renormalised.

`route_top_k_torch` is the reference (torch softmax in f32, `torch.topk`, renormalise, cast). On CUDA,
`route_top_k` runs it as one Triton program per token (triton_route.py): softmax and k rounds of
arg-max in registers, instead of torch's softmax, sort-based top-k and normalisation kernels (BENCHMARKS.md
§5, the expert routing row).
"""

from __future__ import annotations

import torch

from qspec.kernels.triton_common import use_triton

MAX_EXPERTS = 4096  # one program holds a token's whole row of expert logits in registers


def route_top_k_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64), best expert first."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def route_top_k_shared_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E + 1]: the router's E logits and the shared expert's gate logit -> route_top_k_torch's k slots
    over the E experts and a last slot [T, k + 1]: expert id E, weight sigmoid(gate logit) (the shared expert run as
    one more routed pair)."""
    E = logits.shape[1] - 1
    top_w, top_i = route_top_k_torch(logits[:, :E], k)
    gate = torch.sigmoid(logits[:, E:].float()).to(logits.dtype)
    return torch.cat([top_w, gate], 1), torch.cat([top_i, torch.full_like(top_i[:, :1], E)], 1)


def route_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `route_top_k_torch`; the Triton kernel on CUDA. Equal probabilities go to the lower expert id."""
    top_w, top_i, _ = route_top_k_quantized(logits, k, None)
    return top_w, top_i


def route_top_k_quantized(logits: torch.Tensor, k: int, h: torch.Tensor | None, shared: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """route_top_k (shared: route_top_k_shared_torch's k + 1 slots), and where the Triton kernel runs the token rows
    h [T, D] (16-bit, D a multiple of 32) quantized per 32 for the routed experts' int8 kernels in the same launch
    (as triton_qdot.quantize_x_triton returns them; qmatmul.qmoe_few's hquant); None without h or elsewhere."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1] - shared:
        raise ValueError(f"routing needs logits [T, E{' + 1' if shared else ''}] and 0 < k <= E: "
                         f"{tuple(logits.shape)}, k={k}")
    if use_triton(logits) and logits.shape[1] <= MAX_EXPERTS and logits.stride(1) == 1:
        from qspec.kernels.triton_route import route_top_k_triton

        if h is not None and h.stride(1) != 1:
            h = h.contiguous()
        return route_top_k_triton(logits, k, h, shared)
    return (*(route_top_k_shared_torch if shared else route_top_k_torch)(logits, k), None)
