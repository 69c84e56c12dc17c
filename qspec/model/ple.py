"""PLE: hashed n-gram per-layer embedding, gated per hyper-connection stream, plus a dilated causal conv.

The n-gram rows are hashed on the device from the token and its (EOS-cut) predecessors; only the
gathered rows of the table move to the compute device (the real table is ~100 GB in BF16, 54 GB in Q8_0, and stays
on the host unless it fits on the device: on CUDA in page-locked memory the GPU reads itself, weights/pinned.py,
elsewhere memory-mapped and gathered through the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from qspec.config import ModelConfig
from qspec.kernels import gdn_seqs
from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots
from qspec.kernels.triton_common import use_triton
from qspec.model.fuse import fused
from qspec.model.ops import causal_taps, linear, rms_norm, sigmoid, silu, stack_rows
from qspec.state.recurrent import PLEState, RecurrentCache
from qspec.state.tables import SequenceTables

if TYPE_CHECKING:
    from qspec.model.model import ModelCache


class RowTable(Protocol):
    def gather(self, rows: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor: ...


class DeviceRowTable:
    """An n-gram table held as one tensor (on the compute device when it fits)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.shape = tuple(table.shape)

    def gather(self, rows: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.table[rows.to(self.table.device)].to(device=device, dtype=dtype)


@fused
def ngram_contexts(tokens: torch.Tensor, hist: torch.Tensor, eos: int) -> torch.Tensor:
    """[T, 3] (token, previous, one before) with the EOS cut: a missing or EOS predecessor ends the context."""
    full = torch.cat([hist, tokens])
    T = tokens.shape[0]
    c0 = full[2:2 + T]
    c1 = full[1:1 + T]
    c2 = torch.where(c1 == eos, torch.full_like(c1, eos), full[0:T])
    return torch.stack([c0, c1, c2], dim=-1)


@fused
def ngram_rows(ctx: torch.Tensor, cfg: ModelConfig, mult: torch.Tensor, vocab: torch.Tensor,
               off: torch.Tensor) -> torch.Tensor:
    """[T, heads] table rows: for n = 2..ngram, XOR of token*multiplier, mod each head's prime, + offset."""
    mixed = ctx[:, 0] * mult[0]
    blocks = []
    hpn = cfg.heads_per_ngram
    for n in range(2, cfg.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, ctx[:, n - 1] * mult[n - 1])
        sl = slice((n - 2) * hpn, (n - 1) * hpn)
        blocks.append(torch.remainder(mixed[:, None], vocab[None, sl]) + off[None, sl])
    return torch.cat(blocks, dim=-1)


class PLE(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], b: str, table: RowTable) -> None:
        super().__init__()
        self.cfg, self.table = cfg, table
        self.w_kv, _ = stack_rows(w[f"{b}.ple_key.weight"], w[f"{b}.ple_value.weight"])
        self.norm_key, self.norm_query = w[f"{b}.ple_norm_key.weight"], w[f"{b}.ple_norm_query.weight"]
        self.norm_conv = w[f"{b}.ple_norm_conv.weight"]
        self.conv_w = w[f"{b}.ple_conv1d.weight"].float()  # [hc_dim, K]
        dev = self.conv_w.device
        self.mult = torch.tensor(cfg.ple_multipliers, dtype=torch.long, device=dev)
        self.vocab = torch.tensor(cfg.ple_head_vocab[:cfg.ple_heads], dtype=torch.long, device=dev)
        self.off = torch.tensor(cfg.ple_head_offsets[:cfg.ple_heads], dtype=torch.long, device=dev)

    def table_rows(self, tokens: torch.Tensor, st: PLEState, rc: RecurrentCache) -> torch.Tensor:
        """One sequence's rows: their n-gram contexts from its token history (which the step advances) -> the table
        rows they read."""
        c = self.cfg
        T = tokens.shape[0]
        hist = st.hist.index_select(0, rc.live.view(1))[0]
        ctx = ngram_contexts(tokens, hist, c.eos_token_id)
        if T > rc.n_slots:
            st.hist.index_copy_(0, rc.base.view(1), ctx[-1:, :2].flip(-1))
        else:
            st.hist.index_copy_(0, rc.step_planes(T), ctx[:, :2].flip(-1))
        return ngram_rows(ctx, c, self.mult, self.vocab, self.off)

    def table_rows_seqs(self, tokens: torch.Tensor, caches: list[ModelCache], tables: SequenceTables | None
                        ) -> torch.Tensor | None:
        """`table_rows` for every sequence of a batched step (T rows each, in order): every row's context and every
        sequence's history in one launch (kernels/triton_ngram.py), the table rows of all the contexts at once; None
        where that launch does not take the step (switched off with gdn_seqs, no Triton, more rows than slots)."""
        hist = None if tables is None else tables.ple("hist")
        B = len(caches)
        T = tokens.shape[0] // B
        if hist is None or not gdn_seqs.enabled() or B < 2 or not use_triton(tokens) or T > caches[0].rec.n_slots:
            return None
        from qspec.kernels.triton_ngram import ngram_contexts_seqs_triton

        ctx = ngram_contexts_seqs_triton(tokens.long(), hist, self.cfg.eos_token_id)
        return ngram_rows(ctx, self.cfg, self.mult, self.vocab, self.off)

    def gate(self, X: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row by row (a batched step: every sequence's rows at once): the table rows gathered, the gated value G and
        the conv input N (ple_gate)."""
        c = self.cfg
        T, D, S = X.shape[0], c.hidden, c.hc_count
        E = self.table.gather(rows, X.device, X.dtype).reshape(T, -1)
        return ple_gate(E, X, self.w_kv, self.norm_key, self.norm_query, self.norm_conv, S, D, c.rms_eps)

    def mix(self, X: torch.Tensor, G: torch.Tensor, N: torch.Tensor, st: PLEState, rc: RecurrentCache,
            fused_snapshots: bool, stats: SnapshotStats | None) -> torch.Tensor:
        """One sequence's rows: the dilated causal conv over [9 columns of history || its rows], with rollback
        snapshots -> X + G + conv."""
        T = X.shape[0]
        Xc = write_snapshots(st.conv, N, st.conv, rc.base, rc.host_base, T, T > rc.n_slots, fused_snapshots, stats,
                             live=rc.live)
        return ple_out(X, G, Xc, self.conv_w, self.cfg.ngram_size)

    def mix_seqs(self, X: torch.Tensor, G: torch.Tensor, N: torch.Tensor, caches: list[ModelCache],
                 tables: SequenceTables | None) -> torch.Tensor | None:
        """`mix` for every sequence of a batched step (T rows each, in order): every sequence's conv snapshots in one
        launch through the tables, the conv over all the windows at once; None where that launch does not take the
        step (gdn_seqs.snapshots_take; the caller then mixes each sequence alone)."""
        recs = [mc.rec for mc in caches]
        planes = [rc.ple.conv for rc in recs if rc.ple is not None]
        ple_tables = None if tables is None else tables.ple("conv")
        plan = None if ple_tables is None or len(planes) != len(recs) else gdn_seqs.snapshots_take(
            N, recs, planes, [mc.opts.fused_snapshots for mc in caches])
        if plan is None:
            return None
        from qspec.kernels.triton_conv_snapshot import conv_snapshot_seqs_triton

        plan.count([mc.snap_stats for mc in caches])
        C, s = planes[0].shape[1:]
        Xc = torch.empty(len(recs), C, s + N.shape[0] // len(recs), dtype=torch.float32, device=N.device)
        conv_snapshot_seqs_triton(planes[0], ple_tables, N, Xc)
        return ple_out(X, G, Xc, self.conv_w, self.cfg.ngram_size)


@fused
def ple_gate(E: torch.Tensor, X: torch.Tensor, w_kv: torch.Tensor, norm_key: torch.Tensor, norm_query: torch.Tensor,
             norm_conv: torch.Tensor, S: int, D: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """n-gram rows E [T, heads*dh] and residual X [T, S*D] -> (gated value G [T, S*D], conv input N [T, S*D] f32).

    w_kv = [key (S*D rows) ; value (D rows)]."""
    T = E.shape[0]
    kv = linear(E, w_kv)
    key = rms_norm(kv[:, :S * D], norm_key, eps, group=D).view(T, S, D)
    value = kv[:, S * D:(S + 1) * D]
    query = rms_norm(X, norm_query, eps, group=D).view(T, S, D)
    gate = (key * query).sum(-1, keepdim=True) / D ** 0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    G = (sigmoid(gate) * value.unsqueeze(1)).flatten(-2)
    return G, rms_norm(G, norm_conv, eps, group=D).float()


@fused
def ple_out(X: torch.Tensor, G: torch.Tensor, Xc: torch.Tensor, conv_w: torch.Tensor, dilation: int) -> torch.Tensor:
    """X + G + silu(dilated causal conv over Xc = [history || rows] [C, s+T]); or over B sequences' windows
    Xc [B, C, s+T], their rows of X and G in order (T each)."""
    n = X.shape[0] // (Xc.shape[0] if Xc.dim() == 3 else 1)
    conv = silu(causal_taps(Xc, conv_w, n, dilation=dilation)).transpose(-1, -2).reshape(X.shape[0], -1)
    return X + G + conv.to(X.dtype)
