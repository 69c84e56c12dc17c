"""GDN's step for several sequences of a batch at once: every sequence's conv snapshots in one launch, then every
sequence's conv and gated delta rule in one more, per layer.

A batched step (Model.forward_batch) computes its rows' projections once for every sequence, but each sequence's
recurrence runs on its own cache: run one by one, a layer launches the snapshot kernel and the recurrence (and, for
several rows, the step conv) for every sequence, so a batch of B sequences makes 2B-3B launches a GDN layer where one
sequence makes 2. Here each launch takes a sequence axis and finds each sequence's planes and `live` / `base` scalars
through tables of their addresses (state/tables.SequenceTables), so a layer makes 2 launches whatever B.

The n-gram layer's conv snapshots take the same launch for all sequences (model/ple.PLE.mix_seqs, under the same
conditions: `snapshots_take`, which plans each sequence's snapshots once), and its contexts one more
(PLE.table_rows_seqs), under the same switch.

`gdn_step_seqs_torch` is the reference: each sequence's step as the model runs it alone (the snapshot reference, the
step conv, the recurrence over its planes). The Triton path computes every row's conv inside the recurrence's
launch, as a one-row step does alone (triton_gdn.gdn_conv_recurrent_triton), also for the rows of a verify.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from qspec.kernels.conv_snapshot import MAX_SNAPSHOTS, ROW_DTYPES, ROW_WORDS, SnapshotStats, count_fused_step, plan_step
from qspec.kernels.gdn_conv import gdn_conv_qkv_torch, kernel_takes
from qspec.kernels.triton_common import module_flag, use_triton
from qspec.state.recurrent import GDNState, RecurrentCache
from qspec.state.tables import SequenceTables

# A module flag (EngineOptions.gdn_seqs through runner.KernelSwitches); off: each sequence's step alone (A/B runs).
_ON = True


def enabled_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, batched steps run every sequence's GDN step in two launches a layer (on) or one by one."""
    return module_flag(__name__, "_ON", on)


def enabled() -> bool:
    """Whether batched steps run every sequence's recurrent mixers in launches for all of them (the switch)."""
    return _ON


@dataclass
class SnapshotPlan:
    """Each sequence's snapshot plan for a batched step (`plan_step` run once a sequence): its accepted planes and
    the counters its planning touched, kept aside until the launch for all sequences is taken (`count` then adds
    them to each sequence's stats as its step alone would have)."""

    accepted: list[list[int] | None]
    seen: list[SnapshotStats]
    row_words: int
    channels: int

    def count(self, stats: list[SnapshotStats | None]) -> None:
        """Each sequence's snapshot counters as its step alone counts them (write_snapshots' fused launch)."""
        for sc, accepted, seen in zip(stats, self.accepted, self.seen, strict=True):
            if sc is not None:
                sc.fallbacks.update(seen.fallbacks)
                count_fused_step(sc, accepted, self.row_words, self.channels)


def seqs_take(qkv: torch.Tensor, conv_w: torch.Tensor, recs: list[RecurrentCache], states: list[GDNState],
              fused_snapshots: list[bool], dims: tuple[int, int, int, int]) -> SnapshotPlan | None:
    """The snapshot plan when `gdn_step_seqs_triton` runs a batched step of these sequences' rows (qkv: T rows each,
    in order): the snapshot launch for all sequences takes it (`snapshots_take`) and so does the conv kernel (not
    row-exact mode); else None."""
    Hk, Hv, dk, dv = dims
    plan = snapshots_take(qkv, recs, [st.conv for st in states], fused_snapshots)
    if plan is None:
        return None
    T = qkv.shape[0] // len(recs)
    X = torch.empty(2 * Hk * dk + Hv * dv, states[0].conv.shape[2] + T, dtype=torch.float32, device=qkv.device)
    return plan if kernel_takes(X, conv_w, T, Hk, Hv, dk, dv) else None


def snapshots_take(rows: torch.Tensor, recs: list[RecurrentCache], planes: list[torch.Tensor],
                   fused_snapshots: list[bool]) -> SnapshotPlan | None:
    """The snapshot plan when one conv-snapshot launch for all the sequences
    (triton_conv_snapshot.conv_snapshot_seqs_triton) takes a batched step of their rows (T each, in order) on their
    conv planes (a GDN layer's, the n-gram layer's; one tensor a sequence), else None: switched on, the Triton kernels
    (CUDA or the interpreter), fused snapshots for every sequence, a step short enough to keep every row's state
    (T <= slots, every window in the one launch) and each sequence's windows accepted by Algorithm 4 as alone
    (`plan_step`)."""
    B = len(recs)
    T, rem = divmod(rows.shape[0], B)
    C, s = planes[0].shape[1:]
    if (not _ON or B < 2 or rem or T < 1 or not use_triton(rows) or not all(fused_snapshots)
            or rows.dtype not in ROW_DTYPES or s + T > ROW_WORDS or T > MAX_SNAPSHOTS or T > recs[0].n_slots):
        return None
    X = torch.empty(C, s + T, dtype=torch.float32, device=rows.device)  # a fresh buffer, as write_snapshots' X
    plan = SnapshotPlan([], [], s + T, C)
    for b, (rc, P) in enumerate(zip(recs, planes, strict=True)):
        seen = SnapshotStats()
        accepted = plan_step(P, rows[b * T:(b + 1) * T], X, P, rc.host_base, T, seen, rc.live)
        if (accepted is None and T > 1) or (accepted is not None and len(accepted) < T):
            return None
        plan.accepted.append(accepted)
        plan.seen.append(seen)
    return plan


def gdn_step_seqs_torch(qkv: torch.Tensor, a_logit: torch.Tensor, b_logit: torch.Tensor, recs: list[RecurrentCache],
                        states: list[GDNState], conv_w: torch.Tensor, dims: tuple[int, int, int, int],
                        gates: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Reference: each sequence's step alone (T = rows / sequences each) -> o [rows, Hv, dv] f32; every sequence's
    windows and states written to its planes."""
    from qspec.kernels.triton_conv_snapshot import conv_snapshot_torch
    from qspec.kernels.triton_gdn import gdn_recurrent_planes_torch

    T = qkv.shape[0] // len(recs)
    out = []
    for b, (rc, st) in enumerate(zip(recs, states, strict=True)):
        rows = slice(b * T, (b + 1) * T)
        X = conv_snapshot_torch(st.conv, qkv[rows], st.conv, rc.base, T, live=rc.live)
        q, k, v = gdn_conv_qkv_torch(X, conv_w, T, *dims)
        out.append(gdn_recurrent_planes_torch(q, k, v, a_logit[rows], b_logit[rows], st.ssm, rc.live, rc.base, gates))
    return torch.cat(out)


def gdn_step_seqs_triton(qkv: torch.Tensor, a_logit: torch.Tensor, b_logit: torch.Tensor, tables: SequenceTables,
                         layer: int, conv_w: torch.Tensor, dims: tuple[int, int, int, int],
                         gates: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The two launches, for the sequences of `tables` in order (`seqs_take` said yes) -> o [rows, Hv, dv] f32."""
    from qspec.kernels.triton_conv_snapshot import conv_snapshot_seqs_triton
    from qspec.kernels.triton_gdn import gdn_conv_recurrent_seqs_triton

    first = tables.recurrent[0].gdn[layer]
    B = len(tables.recurrent)
    C, s = first.conv.shape[1:]
    X = torch.empty(B, C, s + qkv.shape[0] // B, dtype=torch.float32, device=qkv.device)
    conv_snapshot_seqs_triton(first.conv, tables.conv(layer), qkv, X)
    return gdn_conv_recurrent_seqs_triton(X, conv_w, *dims, a_logit, b_logit, first.ssm, tables.ssm(layer), gates)
