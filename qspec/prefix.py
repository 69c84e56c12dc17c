"""Prefix reuse across requests (EngineOptions.prefix_cache): where a request's prompt starts in the caches.

Three sources, the one that holds the most of the prompt wins:
  live      a request that completed leaves the caches holding its prompt and output (the target every token but
            the last emitted one, the draft head that one's row too): a prompt that goes on from them by at least
            one token prefills only what follows.
  prompt end  the attention and indexer caches keep every position, but the recurrent state only the last: a copy of
            it is kept at the end of each prompt (`prefix_checkpoints`), with the prompt's last logits and residual.
            A prompt that shares at least that prompt's tokens with the sequence goes back there (a rollback past
            the checkpoint); the same prompt again needs no prefill at all.
  saved     a completed sequence that another request displaces moves to host memory (`prefix_offloaded`); a prompt
            that goes on from it loads it back.

Invariants: `held_last` is set only between a request that completed and the next request's start (a request
stopped midway leaves caches that describe no sequence); every checkpoint describes a prefix of the runner's
history; a saved sequence holds every buffer row of its tokens, so loading it needs nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qspec.model.model import SavedPrefix
from qspec.options import EngineOptions
from qspec.runner import Runner
from qspec.state.recurrent import RecurrentCache


@dataclass
class Checkpoint:
    """A prompt's end: the recurrent state after its `pos` tokens (RecurrentCache.save), the logits of its last row
    and (with drafting) that row's residual, from which the draft head's row at `pos` is written for the token that
    follows in a new prompt (or for the first generated one when the prompt is the same)."""
    pos: int
    state: list[torch.Tensor]
    logits: torch.Tensor
    h: torch.Tensor | None


@dataclass
class Session:
    """A completed request's sequence in host memory: its committed tokens, the last emitted token (whose draft-head
    row is saved too) and the caches' copy."""
    tokens: list[int]
    last: int
    saved: SavedPrefix


@dataclass
class Start:
    """Where a request starts: after `cached` tokens, of the live sequence, of `checkpoint` (the same prompt again
    when `cached` is the whole prompt: its logits and residual stand for the prefill) or of `session`."""
    cached: int
    checkpoint: Checkpoint | None = None
    session: Session | None = None


class PrefixCache:
    """What the engine keeps of earlier requests, and the moves that take the runner's caches to a prompt's start.
    It holds no reference to the engine (a cycle would leave engines, and their pinned read-back buffers, to the
    garbage collector, whose frees can land inside a CUDA-graph capture)."""

    def __init__(self, opts: EngineOptions, runner: Runner) -> None:
        self.opts, self.runner = opts, runner
        self.held_last: int | None = None  # the last emitted token of a request that completed (module docstring)
        self.checkpoints: list[Checkpoint] = []  # by position
        self.sessions: list[Session] = []  # the most recent last

    @staticmethod
    def checkpoint_bytes(opts: EngineOptions, cfg: object, vocab: int) -> int:
        """Device bytes the checkpoints may take (a recurrent state and a row of f32 logits each)."""
        if not (opts.prefix_cache and opts.prefix_checkpoints):
            return 0
        probe = RecurrentCache(cfg, 1, "meta")  # type: ignore[arg-type]  # shapes only, no memory
        return opts.prefix_checkpoints * (probe.plane_bytes() + 4 * vocab)

    @property
    def held(self) -> list[int]:
        """The tokens a prompt starts with to go on from the live sequence, or none."""
        return [] if self.held_last is None else self.runner.history + [self.held_last]

    def find(self, prompt: list[int]) -> Start:
        """Where `prompt` would start (nothing moves)."""
        if not self.opts.prefix_cache:
            return Start(0)
        hist, last = self.runner.history, self.held_last
        n = len(hist)
        if last is not None and len(prompt) > n and prompt[n] == last and prompt[:n] == hist:
            start = Start(n)
        else:
            seq = hist + ([] if last is None else [last])
            common = next((i for i, (a, b) in enumerate(zip(seq, prompt, strict=False)) if a != b),
                          min(len(seq), len(prompt)))
            usable = [cp for cp in self.checkpoints if cp.pos <= common]
            start = Start(usable[-1].pos, usable[-1]) if usable else Start(0)
        fits = [s for s in self.sessions if len(prompt) > len(s.tokens) > start.cached
                and prompt[len(s.tokens)] == s.last and prompt[:len(s.tokens)] == s.tokens]
        best = max(fits, key=lambda s: len(s.tokens), default=None)
        return start if best is None else Start(best.saved.n, session=best)

    def begin(self, prompt: list[int], write_head_row: Callable[[int, torch.Tensor, int], None],
              reuse: bool = True) -> Start:
        """Take the caches to `prompt`'s start: the live sequence goes to host memory when it is cut or replaced,
        then a saved one is loaded, or the runner goes back to a checkpoint, or the sequence starts over (always,
        without `reuse`: a prompt whose every row is needed). The runner's request begins there
        (Runner.begin_request). write_head_row(token, residual, position) writes the draft head's cells of one row
        (the engine's first draft step: its shape's graph)."""
        start = self.find(prompt) if reuse else Start(0)
        if start.session is not None:
            self.sessions.remove(start.session)  # before the live sequence takes its place in the list
        if start.session is not None or start.checkpoint is not None or not start.cached:
            self._park()
        self.held_last = None  # until this request completes
        if start.session is not None:
            self.runner.load_sequence(start.session.tokens, start.session.saved)
            self.checkpoints = []
        elif start.checkpoint is not None:
            self._rewind(start.checkpoint, prompt, write_head_row)
        elif not start.cached:
            self.checkpoints = []
        self.runner.begin_request(start.cached)
        return start

    def _park(self) -> None:
        """Move the live sequence to host memory if a request completed it (the oldest beyond prefix_offloaded
        dropped)."""
        if not (self.opts.prefix_cache and self.opts.prefix_offloaded) or self.held_last is None:
            return
        run = self.runner
        self.sessions.append(Session(run.history[:], self.held_last, run.cache.save_prefix(run.n_tokens)))
        del self.sessions[:-self.opts.prefix_offloaded]

    def _rewind(self, cp: Checkpoint, prompt: list[int],
                write_head_row: Callable[[int, torch.Tensor, int], None]) -> None:
        """Go back to `cp`: the tokens after it are forgotten, with the checkpoints past it, and the draft head's row
        at its position is written for the prompt's token there (when the prompt goes on past it: else the first
        draft step writes it for the first generated token)."""
        self.runner.rewind(cp.pos, cp.state)
        self.checkpoints = [c for c in self.checkpoints if c.pos <= cp.pos]
        if self.opts.draft and cp.h is not None and cp.pos < len(prompt):
            write_head_row(prompt[cp.pos], cp.h, cp.pos)

    def prompt_done(self, pos: int, logits: torch.Tensor, h: torch.Tensor | None) -> None:
        """After a prefill: keep the committed recurrent state (after the prompt's `pos` tokens) with the last row's
        logits and residual, dropping the oldest checkpoint beyond prefix_checkpoints."""
        if not (self.opts.prefix_cache and self.opts.prefix_checkpoints):
            return
        keep = [c for c in self.checkpoints if c.pos < pos]
        keep.append(Checkpoint(pos, self.runner.cache.rec.save(), logits[-1:].clone(),
                               None if h is None else h.clone()))
        self.checkpoints = keep[-self.opts.prefix_checkpoints:]

    def completed(self, last: int) -> None:
        """A request completed, its last emitted token `last` (the caches hold every token before it)."""
        self.held_last = last
