"""Acceptance: greedy prefix match, speculative sampling (accept/reject + residual), and forced acceptance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qspec.kernels.argmax import argmax_rows

# (round index, number of drafts) -> accepted count; a test/benchmark hook that overrides acceptance. A hook with
# `by_position = True` is asked with the request's token position at the round instead of its index.
AcceptHook = Callable[[int, int], int]


MAX_PENALTY, MAX_BIAS = 2.0, 100.0  # OpenAI's ranges: penalties in [-2, 2], biases in [-100, 100]


@dataclass
class Sampler:
    """How a request picks its tokens from the target's logits: `target` applies the request's logit rules (OpenAI's
    logit_bias, presence and frequency penalties over the generated tokens), then greedy argmax or a draw under
    temperature and top-p. Drafts are drawn from the draft head's own logits, unadjusted: a draft is any proposal,
    and only the target's rows decide what is emitted."""
    temperature: float = 0.0
    top_p: float = 1.0
    # the request's seeded generator; draws on another device use one generator seeded from it (see _generator)
    generator: torch.Generator | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # subtracted once per time the token was generated
    _derived: dict[str, torch.Generator] = field(default_factory=dict, repr=False, compare=False)
    _bias: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [V] f32, from `begin`
    _counts: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [V] f32: generated so far

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        for t, b in (self.logit_bias or {}).items():
            if type(t) is not int or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias of token {t} must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts(self) -> bool:
        """Whether `target` changes logits (else it returns them as they are, and `count` does nothing)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def begin(self, vocab: int, device: torch.device) -> None:
        """Start a request over a vocabulary of `vocab` ids: the bias row, and no token generated yet."""
        if not self.adjusts:
            return
        bad = next((t for t in self.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias has token id {bad}, outside the vocabulary of {vocab}")
        self._bias = torch.zeros(vocab, dtype=torch.float32)
        for t, b in (self.logit_bias or {}).items():
            self._bias[t] = b
        self._bias = self._bias.to(device)
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)

    def target(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The target's rows [R, V] under the request's rules (f32), row i's penalties counting drafts[:i] as
        generated (a verify step: drafts [R - 1], the tokens the rows after the first follow)."""
        if not self.adjusts:
            return logits
        assert self._bias is not None and self._counts is not None, "Sampler.begin first"
        x = logits.float() + self._bias
        if self.presence_penalty or self.frequency_penalty:
            c = self._counts.expand(x.shape)
            if drafts is not None and len(drafts):
                seen = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
                seen[1:].scatter_(1, drafts.view(-1, 1).to(x.device), 1.0)
                c = c + seen.cumsum(0)
            x = x - self.presence_penalty * (c > 0).float() - self.frequency_penalty * c
        return x

    def count(self, tokens: torch.Tensor | list[int], weight: torch.Tensor | None = None) -> None:
        """Count generated tokens (on the device or the host; `weight` [len(tokens)] 1/0 says which count) for the
        penalties."""
        if self._counts is None or not (self.presence_penalty or self.frequency_penalty):
            return
        ids = torch.as_tensor(tokens, dtype=torch.long).view(-1).to(self._counts.device)
        w = torch.ones(ids.shape, dtype=torch.float32, device=ids.device) if weight is None else weight.float()
        self._counts.index_add_(0, ids, w)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution [..., V] (temperature, then top-p)."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sp, si = torch.sort(p, dim=-1, descending=True)
            keep = sp.cumsum(-1) - sp < self.top_p
            sp = sp * keep
            p = torch.zeros_like(p).scatter_(-1, si, sp)
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
