"""Recurrent state (GDN conv window, GDN SSM state, PLE conv window, n-gram history) with rollback slots.

Layout: every recurrent buffer has 2 * n_slots planes. A step reads the live plane and writes the
state after each of its rows j into plane `base + j`, where `base` is the half that does not hold
the live plane (ping-pong). Accepting row k of a verify is then `live = base + k`: an index
change on the device, no state copy and no host round trip. Keeping reads and writes in different
halves also makes every snapshot destination disjoint from the state it is computed from, which
the fused snapshot kernel requires (seed Algorithm 4).

A step with more rows than slots (prefill) keeps only its final state, in plane `base + 0`.

Invariant: plane `live` holds the state after the last committed token; planes of the other
half hold the states after each row of the last step (some of them rejected).

A checkpoint (`save`) is a copy of the live plane of every buffer; `restore` makes it the live state, in plane 0 as
after `reset`, so that it is valid whatever step was under way (a request stopped midway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qspec.config import ModelConfig


@dataclass
class GDNState:
    conv: torch.Tensor  # [2S, C, K-1] f32: pre-activation qkv of the last K-1 tokens
    ssm: torch.Tensor  # [2S, Hv, dk, dv] f32 (key and value head sizes)


@dataclass
class PLEState:
    conv: torch.Tensor  # [2S, hc_dim, (K-1)*ngram] f32: normed gated values of the last 9 tokens
    hist: torch.Tensor  # [2S, ngram-1] int64: previous tokens (EOS before the sequence start)


class RecurrentCache:
    def __init__(self, cfg: ModelConfig, n_slots: int, device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.cfg, self.n_slots = cfg, n_slots
        planes = 2 * n_slots
        self.gdn: dict[int, GDNState] = {}
        for i in cfg.gdn_layers():
            self.gdn[i] = GDNState(
                conv=torch.zeros(planes, cfg.gdn_conv_dim, cfg.gdn_conv_kernel - 1, device=device, dtype=torch.float32),
                ssm=torch.zeros(planes, cfg.gdn_v_heads, cfg.gdn_head_dim, cfg.gdn_v_head_dim, device=device,
                                dtype=torch.float32),
            )
        self.ple: PLEState | None = None
        if cfg.has_ple:
            self.ple = PLEState(
                conv=torch.zeros(planes, cfg.hc_dim, cfg.ple_conv_state, device=device, dtype=torch.float32),
                hist=torch.full((planes, cfg.ngram_size - 1), cfg.eos_token_id, device=device, dtype=torch.long),
            )
        self.live = torch.zeros((), dtype=torch.long, device=device)
        self.base = torch.full((), n_slots, dtype=torch.long, device=device)
        # The live plane is always in the half the previous step wrote, so the host knows the
        # half to write next without reading `live` back from the device.
        self.host_base = 0

    def begin_step(self) -> None:
        """Pick the half that the coming step writes: the one without the live plane."""
        self._other_half()

    def abandon_step(self) -> None:
        """Forget the step begun last (none of its rows is kept): the live plane stays, and the next step
        writes the half that step wrote."""
        self._other_half()

    def _other_half(self) -> None:
        self.host_base = self.n_slots if self.host_base == 0 else 0
        self.base.fill_(self.host_base)

    def commit(self, row: torch.Tensor | int) -> None:
        """Make the state after `row` of the last step live (row 0 after a step longer than n_slots)."""
        self.live.copy_(self.base + row)

    def step_planes(self, n_rows: int) -> torch.Tensor:
        """Planes base .. base + n_rows - 1 that a step's rows write (for one row, `base` itself: no kernel to
        build the index, which in a graphed decode step is a node of its own)."""
        if n_rows == 1:
            return self.base.view(1)
        return self.base + torch.arange(n_rows, device=self.base.device)

    def last_row(self, n_rows: int) -> int:
        return n_rows - 1 if n_rows <= self.n_slots else 0

    def reset(self) -> None:
        for st in self.gdn.values():
            st.conv.zero_()
            st.ssm.zero_()
        if self.ple is not None:
            self.ple.conv.zero_()
            self.ple.hist.fill_(self.cfg.eos_token_id)
        self.live.zero_()
        self.base.fill_(self.n_slots)
        self.host_base = 0

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, each indexed by plane along its first axis: each GDN layer's conv and SSM, then the n-gram
        layer's conv and token history if there is one."""
        bufs = [t for st in self.gdn.values() for t in (st.conv, st.ssm)]
        return bufs + ([self.ple.conv, self.ple.hist] if self.ple is not None else [])

    def save(self) -> list[torch.Tensor]:
        """A copy of the committed state (one plane of every buffer)."""
        return [b.index_select(0, self.live.view(1)) for b in self.buffers()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Make a `save`d state the committed one: plane 0 holds it and is live, as after `reset` (the other planes
        are written before they are read)."""
        for b, s in zip(self.buffers(), saved, strict=True):
            b[:1].copy_(s)
        self.live.zero_()
        self.base.fill_(self.n_slots)
        self.host_base = 0

    def plane_bytes(self) -> int:
        """Bytes of one plane of every buffer: what `save` copies."""
        return sum(b[0].numel() * b.element_size() for b in self.buffers())

    def live_view(self) -> dict[str, torch.Tensor]:
        """The committed state, gathered (for tests and debugging)."""
        out: dict[str, torch.Tensor] = {}
        for i, st in self.gdn.items():
            out[f"gdn{i}.conv"] = st.conv[self.live].clone()
            out[f"gdn{i}.ssm"] = st.ssm[self.live].clone()
        if self.ple is not None:
            out["ple.conv"] = self.ple.conv[self.live].clone()
            out["ple.hist"] = self.ple.hist[self.live].clone()
        return out

