"""A request's logit rules: OpenAI's logit_bias, presence and frequency penalties, and the repetition penalty and
min_tokens of llama.cpp and vLLM, applied to the target's rows before the token is picked (Sampler.target).

The penalties count the generated tokens on the device (`count`, fed by the engine without a host round trip), and
the repetition penalty the prompt's too. In a verify step, row i follows drafts[:i]: its penalties count them as
generated, so each row sees what plain decoding would see at that position, and greedy speculation equals plain
decoding under the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_PENALTY, MAX_BIAS = 2, 100  # OpenAI's ranges: penalties in [-2, 2], biases in [-100, 100]


@dataclass
class LogitRules:
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # subtracted once per time the token was generated
    # > 1 discourages every token of the prompt or the output: a positive logit divided by it, a negative one
    # multiplied (1: off)
    repetition_penalty: float = 1.0
    # the stop ids cannot be picked before this many tokens are generated (vLLM's min_tokens)
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    _bias: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [V] f32
    _counts: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [V] f32: generated so far
    _in_prompt: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [V] bool
    _generated: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [] f32: tokens so far
    _stops: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [S] int64: stop_ids

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        if type(self.min_tokens) is not int or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}")
        for t, b in (self.logit_bias or {}).items():
            if type(t) is not int or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias of token {t} must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b}")

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self._penalised or self._holds_stops

    @property
    def _holds_stops(self) -> bool:
        return self.min_tokens > 0 and bool(self.stop_ids)

    @property
    def _penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab: int) -> None:
        """ValueError for a biased token id outside a vocabulary of `vocab` ids."""
        bad = next((t for t in self.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias has token id {bad}, outside the vocabulary of {vocab}")

    def begin(self, prompt: list[int], vocab: int, device: torch.device) -> None:
        """Start a request after `prompt` over a vocabulary of `vocab` ids: the bias row, no token generated yet."""
        self.check_vocab(vocab)
        bias = torch.zeros(vocab, dtype=torch.float32)
        for t, b in (self.logit_bias or {}).items():
            bias[t] = b
        self._bias = bias.to(device)
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self._in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if self.repetition_penalty != 1.0 and prompt:
            self._in_prompt[torch.tensor(prompt, device=device)] = True
        self._generated = torch.zeros((), dtype=torch.float32, device=device)
        self._stops = torch.tensor(sorted(t for t in self.stop_ids if t < vocab), dtype=torch.long, device=device)

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [R, V] under the rules (f32): bias, repetition penalty, then presence and frequency penalties, row i
        counting drafts[:i] (a verify step: drafts [R - 1]) as generated."""
        if self._bias is None or self._counts is None or self._in_prompt is None:
            raise RuntimeError("LogitRules.begin must start the request first")
        x = logits.float() + self._bias
        if self._holds_stops:  # row i follows i drafts: the (generated + i + 1)-th token
            early = self._generated + torch.arange(x.shape[0], device=x.device) < self.min_tokens
            x[:, self._stops] = torch.where(early[:, None], float("-inf"), x[:, self._stops])
        if not self._penalised:
            return x
        c = self._counts.expand(x.shape)
        if drafts is not None and len(drafts):
            seen = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            seen[1:].scatter_(1, drafts.view(-1, 1).to(x.device), 1.0)
            c = c + seen.cumsum(0)
        if self.repetition_penalty != 1.0:
            r = self.repetition_penalty
            x = torch.where(self._in_prompt | (c > 0), torch.where(x > 0, x / r, x * r), x)
        return x - self.presence_penalty * (c > 0).float() - self.frequency_penalty * c

    def count(self, tokens: torch.Tensor | list[int], weight: torch.Tensor | None = None) -> None:
        """Count generated tokens (on the device or the host; `weight` [len(tokens)] 1/0 says which count)."""
        if self._counts is None or self._generated is None or not (self._penalised or self._holds_stops):
            return
        ids = torch.as_tensor(tokens, dtype=torch.long).view(-1).to(self._counts.device)
        w = torch.ones(ids.shape, dtype=torch.float32, device=ids.device) if weight is None else weight.float()
        self._counts.index_add_(0, ids, w)
        self._generated += w.sum()
