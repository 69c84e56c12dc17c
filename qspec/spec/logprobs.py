"""Log-probabilities of the emitted tokens (OpenAI's `logprobs`): each token's log-probability under the model's own
distribution at its position (the target's logits, before temperature and top-p; in a speculative round, the verify
row that emitted it) and the most likely ids there.

The engine queues the rows of each step or round as it runs them (`queue`: evaluated on the device, copied to the
host behind the step, so reading them waits for nothing more than the token read-back does) and takes one row per
emitted token (`take`, which checks that the row is that token's); rows of rejected drafts are dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP = 20  # OpenAI's limit for top_logprobs
SCORE_ROWS = 128  # rows `score` turns into log-probabilities at once: 127 MB of f32 at a 248,320-token vocabulary


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: nothing predicts it (a prompt's first token)
    top: tuple[tuple[int, float], ...]  # (id, log-probability), most likely first


@dataclass
class Logprobs:
    """Ask Engine.generate for log-probabilities: `entries` gets one TokenLogprob per emitted token, before the
    token callback sees the token, each with the `top` most likely ids."""
    top: int = 0
    entries: list[TokenLogprob] = field(default_factory=list)
    _pending: list[list] = field(default_factory=list)  # [values [R, 1 + top], ids [R, 1 + top], next row]

    def __post_init__(self) -> None:
        if not 0 <= self.top <= MAX_TOP:
            raise ValueError(f"top log-probabilities must be in 0..{MAX_TOP}, got {self.top}")

    def queue(self, logits: torch.Tensor, tokens: torch.Tensor, wait: bool) -> None:
        """Rows [R, V] of a step and the tokens [R] they emit, in emission order. Without `wait`, the copy to the host
        is queued behind the step and must have landed before `take` (the engine takes them after a read-back that
        was queued after this)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = tokens.reshape(-1, 1).to(lp.device)
        vals = lp.gather(1, ids)
        if self.top:
            best = lp.topk(self.top, dim=-1)
            vals, ids = torch.cat([vals, best.values], 1), torch.cat([ids, best.indices], 1)
        self._pending.append([_to_host(vals, wait), _to_host(ids, wait), 0])

    def score(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """An entry for each of `tokens` from its row of `logits` [len(tokens), V] (a prompt's rows as it prefills:
        no step waits behind them), SCORE_ROWS rows at a time (their f32 log-softmax is the transient memory)."""
        for i in range(0, len(tokens), SCORE_ROWS):
            part = tokens[i:i + SCORE_ROWS]
            self.queue(logits[i:i + len(part)], torch.tensor(part), wait=True)
            for t in part:
                self.take(t)

    def take(self, token: int) -> None:
        """The next queued row, for the emitted `token`."""
        batch = self._pending[0]
        vals, ids, r = batch
        batch[2] += 1
        if batch[2] == len(vals):
            self._pending.pop(0)
        v, i = vals[r].tolist(), ids[r].tolist()
        if i[0] != token:
            raise RuntimeError(f"log-probability row of token {i[0]} taken for token {token}")
        self.entries.append(TokenLogprob(token, v[0], tuple(zip(i[1:], v[1:], strict=True))))

    def drop_pending(self) -> None:
        """Forget the rows not taken (a round's rejected drafts)."""
        self._pending.clear()


def _to_host(t: torch.Tensor, wait: bool) -> torch.Tensor:
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=not wait)
    return out
