"""Acceptance: greedy prefix match, speculative sampling (accept/reject + residual), and forced acceptance."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qspec.kernels.argmax import argmax_rows
from qspec.spec.grammar import AfterThinking, Grammar
from qspec.spec.logit_rules import LogitRules

# (round index, number of drafts) -> accepted count; a test/benchmark hook that overrides acceptance. A hook with
# `by_position = True` is asked with the request's token position at the round instead of its index.
AcceptHook = Callable[[int, int], int]


@dataclass
class Sampler:
    """How a request picks its tokens from the target's logits: `target` applies the request's logit rules
    (qspec/spec/logit_rules.py) and grammar (qspec/spec/grammar.py), then greedy argmax or a draw under temperature,
    top-k, top-p and min-p. Drafts are drawn from the draft head's own logits under the same warping but without the
    rules or the grammar: a draft is any proposal, and only the target's rows decide what is emitted."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are dropped (0: none)
    # the request's seeded generator; draws on another device use one generator seeded from it (see _generator)
    generator: torch.Generator | None = None
    rules: LogitRules | None = None
    grammar: Grammar | AfterThinking | None = None  # follows the emitted tokens: the engine feeds it (Engine.generate)
    _derived: dict[str, torch.Generator] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.grammar is not None and self.grammar.ends and self.rules is not None and self.rules.min_tokens:
            # the rules would refuse the end tokens that a complete grammar allows alone
            raise ValueError("min_tokens cannot be used with a grammar: the grammar decides where the output ends")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: every token), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks the rows from here on (a thinking budget's alone does not once its block closed)."""
        return self.grammar is not None and not self.grammar.unconstrained

    @property
    def ruled(self) -> bool:
        """Whether the request has logit rules (else `count` does nothing)."""
        return self.rules is not None and self.rules.active

    def begin(self, prompt: list[int], vocab: int, device: torch.device) -> None:
        """Start a request (LogitRules.begin; ValueError for a bias outside the vocabulary; the grammar at the start
        of the output)."""
        if self.ruled:
            self.rules.begin(prompt, vocab, device)  # type: ignore[union-attr]
        if self.grammar is not None:
            self.grammar.reset()

    def target(self, logits: torch.Tensor, drafts: torch.Tensor | None = None, host_drafts: list[int] | None = None
               ) -> torch.Tensor:
        """The target's rows [R, V] under the request's rules (LogitRules.apply) and grammar (Grammar.constrain, on
        the drafts as the host has them: `host_drafts`, else read from `drafts`), or as they are."""
        if self.ruled:
            logits = self.rules.apply(logits, drafts)  # type: ignore[union-attr]
        if self.constrained:
            if host_drafts is None and drafts is not None:
                host_drafts = drafts.tolist()
            logits = self.grammar.constrain(logits, host_drafts)
        return logits

    def count(self, tokens: torch.Tensor | list[int], weight: torch.Tensor | None = None) -> None:
        """Generated tokens, for the rules' penalties (LogitRules.count); nothing without them."""
        if self.ruled:
            self.rules.count(tokens, weight)  # type: ignore[union-attr]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution [..., V]: temperature, then top-k, top-p and min-p (vLLM's order)."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_k and self.top_k < p.shape[-1]:
            kth = p.topk(self.top_k, dim=-1).values[..., -1:]
            p = torch.where(p >= kth, p, 0.0)  # ties with the k-th all stay
        if self.top_p < 1.0:
            p = p / p.sum(-1, keepdim=True)
            sp, si = torch.sort(p, dim=-1, descending=True)
            keep = sp.cumsum(-1) - sp < self.top_p
            sp = sp * keep
            p = torch.zeros_like(p).scatter_(-1, si, sp)
        if self.min_p > 0.0:
            p = torch.where(p >= self.min_p * p.amax(-1, keepdim=True), p, 0.0)
        if self.top_k or self.top_p < 1.0 or self.min_p > 0.0:
            p = p / p.sum(-1, keepdim=True)
        return p

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return argmax_rows(logits) if logits.dim() == 2 else logits.argmax(-1)
        return self.sample_probs(self.probs(logits))

    def sample_probs(self, p: torch.Tensor) -> torch.Tensor:
        """One draw from each distribution p [..., V] -> [...] int64 on p's device, without a host round trip (so a
        decode step can consume it before the host reads it): the exponential race argmax_i p_i / E_i with
        E_i ~ Exp(1) i.i.d. picks i with probability p_i (vLLM's sampler draws the same way)."""
        e = torch.empty(p.shape, dtype=torch.float32, device=p.device).exponential_(generator=self._generator(p.device))
        return (p.float() / e.clamp_min(1e-30)).argmax(-1)

    def _generator(self, dev: torch.device) -> torch.Generator | None:
        """The generator for draws on `dev`: the request's own when it lives there, else one generator per device
        seeded once from it (deterministic for a seeded request; None: torch's default generators)."""
        g = self.generator
        if g is None or (g.device.type == dev.type and (g.device.index or 0) == (dev.index or 0)):
            return g
        key = str(dev)
        if key not in self._derived:
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=g))
            self._derived[key] = torch.Generator(device=dev).manual_seed(seed)
        return self._derived[key]


def greedy_accept(drafts: list[int], target: list[int]) -> int:
    """Length of the prefix of drafts equal to the target's predictions (target has len(drafts)+1 entries)."""
    k = 0
    while k < len(drafts) and drafts[k] == target[k]:
        k += 1
    return k


def speculative_accept_on_device(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, sampler: Sampler
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling, every draw on the tensors' device and nothing read by the host: drafts [N]
    int64, q [N, V] draft distributions, p [N+1, V] target distributions -> (accepted count [1], next token [1]).

    Draft i is accepted when u_i * q_i(d_i) < p_i(d_i) (u_i uniform on [0, 1)); k is the length of the accepted
    prefix; the next token is drawn from max(0, p_k - q_k) (from p_k if that is all zero), where q_N = 0 makes it
    the bonus draw from p_N."""
    N, V = q.shape
    dev = p.device
    rows = torch.arange(N, device=dev)
    u = torch.rand(N, device=dev, generator=sampler._generator(dev))
    ok = u * q[rows, drafts].float() < p[rows, drafts].float()
    k = torch.cumprod(ok.long(), 0).sum().view(1)
    resid = (p.float() - torch.cat([q.float(), q.new_zeros(1, V, dtype=torch.float32)])).clamp_min(0)
    r = resid.index_select(0, k)
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p.float().index_select(0, k))
    return k, sampler.sample_probs(r)  # the race needs no normalisation
