"""Gated delta rule, token by token, keeping the state after every token (the rollback slots).

S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t
(per value head; q, k already L2-normalised, q scaled by 1/sqrt(dk)).
"""

from __future__ import annotations

import torch

from qspec.model.ops import sigmoid, softplus


def gdn_gates(b_logit: torch.Tensor, a_logit: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) [T, Hv] f32 from the projection's raw logits: beta = sigmoid(b), g = a * softplus(alpha + dt_bias)."""
    return sigmoid(b_logit.float()), a * softplus(a_logit.float() + dt_bias)


def gdn_recurrent_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        S0: torch.Tensor, keep_states: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; S0 [H, dk, dv] (f32).

    Returns (o [T, H, dv], states [T, H, dk, dv] if keep_states else the final state [1, H, dk, dv])."""
    S = S0
    T = q.shape[0]
    outs, states = [], []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv_mem = (S * k[t][:, :, None]).sum(-2)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append((S * q[t][:, :, None]).sum(-2))
        if keep_states:
            states.append(S)
    if not keep_states:
        states.append(S)
    return torch.stack(outs), torch.stack(states)


def gdn_chunked_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      S0: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence for long inputs (prefill), chunk by chunk in the WY/UT form.

    Inside a chunk the delta-rule updates are solved as one unit-triangular system; chunks then
    run sequentially through the state. Returns (o [T, H, dv], final state [H, dk, dv])."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (torch.nn.functional.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, Tp, d]
    g, beta = (torch.nn.functional.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, Tp]
    n = (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    lower_eq = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(0)
    decay = (G[..., :, None] - G[..., None, :])
    kb, vb = k * beta[..., None], v * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay.masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(A + eye, vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A + eye, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay.masked_fill(~lower_eq, float("-inf")).exp()
    qd = q * G.exp()[..., None]
    kd = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()
    S = S0.clone()
    out = torch.empty(H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for c in range(n):
        v_new = U[:, c] - W[:, c] @ S
        out[:, c] = qd[:, c] @ S + attn[:, c] @ v_new
        S = S * last[:, c, None, None] + kd[:, c].transpose(-1, -2) @ v_new
    o = out.reshape(H, n * chunk, dv)[:, :T].transpose(0, 1)
    return o, S
