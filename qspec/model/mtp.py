"""The MTP (nextn) draft head: one attention + MoE + hyper-connection block fed by [embedding ; target residual].

e = rms(embed[x]) * enorm; Hn = rms(H) * hnorm (over the whole 4-stream bundle, as SGLang does, or
per stream as llama.cpp does: `hnorm_per_stream`); X_s = eh_proj [e ; Hn_s]; then the block; the
head's own mixer; the shared LM head. Its output residual X feeds the next chained draft step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig
from qspec.kernels.q4 import Q4Weight
from qspec.model.fuse import fused
from qspec.model.hyper import HyperMixer
from qspec.model.moe import MoE
from qspec.model.ops import Weight, linear, rms_norm
from qspec.model.qsa import QSAAttention
from qspec.state.kv_cache import KVCache
from qspec.state.tables import SequenceTables, even_rows
from qspec.weights.dequant import quantize_q4_0
from qspec.weights.qweight import QuantWeight

_Q4_CHUNK_ROWS = 16384  # rows expanded at a time when a block head is requantized (bounded scratch)


def q4_head(head: Weight) -> Q4Weight:
    """The LM head as Q4_0 for drafting (`--draft-head q4`): a Q4_0 file's head as it is (no second rounding);
    a head of another block type expanded and requantized a chunk of rows at a time; a 16-bit head quantized."""
    if isinstance(head, QuantWeight):
        if head.qtype == GGMLQuantizationType.Q4_0:
            return Q4Weight.from_ggml(head.to_blocks().raw.reshape(-1), (head.shape[0], head.shape[1]))
        N = head.shape[0]
        raw = torch.cat([quantize_q4_0(head.rows(i, min(i + _Q4_CHUNK_ROWS, N)).dequantize(torch.float32))
                         for i in range(0, N, _Q4_CHUNK_ROWS)])
        return Q4Weight.from_ggml(raw.reshape(-1), (N, head.shape[1]))
    if not isinstance(head, torch.Tensor):
        raise TypeError(f"--draft-head q4 needs one LM head matrix, got {type(head).__name__}")
    return Q4Weight.from_dense(head)


@dataclass(frozen=True)
class DraftHead:
    """An LM head over part of the vocabulary, for drafting (spec/draft_vocab.py): `weight` holds the rows of `ids`
    only, so a draft step reads len(ids) / vocab of the full head's bytes. Its logits are spread back over the whole
    vocabulary with -inf elsewhere: argmax, sampling and speculative acceptance then see ordinary [T, vocab] logits,
    whose drafts lie in `ids`."""

    weight: torch.Tensor | Q4Weight | QuantWeight
    ids: torch.Tensor  # [n] int64, sorted, once each, on the head's device
    vocab: int

    @classmethod
    def rows_of(cls, head: torch.Tensor | Q4Weight | QuantWeight, ids: torch.Tensor) -> DraftHead:
        """The rows `ids` of a full head (a Q4_0 head's rows are quantized independently: the same as quantizing
        the rows alone; so are a GGUF block head's)."""
        weight: torch.Tensor | Q4Weight | QuantWeight
        if isinstance(head, Q4Weight):
            weight = Q4Weight(head.packed[ids].contiguous(), head.scales[ids].contiguous())
        elif isinstance(head, QuantWeight):
            weight = head.select_rows(ids)
        else:
            weight = head[ids].contiguous()
        return cls(weight, ids, head.shape[0])


@fused
def spread_logits(sub: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits of the rows `ids` [T, n] -> [T, vocab] with -inf at every other id."""
    return sub.new_full((sub.shape[0], vocab), float("-inf")).index_copy(1, ids, sub)


@fused
def mtp_in(emb: torch.Tensor, H: torch.Tensor, enorm: torch.Tensor, hnorm: torch.Tensor, eh: torch.Tensor, S: int,
           D: int, eps: float, per_stream: bool) -> torch.Tensor:
    """X_s = eh_proj [rms(emb) * enorm ; rms(H)_s * hnorm] for each stream s -> [T, S*D]."""
    e = rms_norm(emb, enorm, eps)
    Hn = rms_norm(H, hnorm, eps, group=D if per_stream else None).view(-1, S, D)
    return linear(torch.cat([e.unsqueeze(1).expand(-1, S, -1), Hn], dim=-1), eh).flatten(-2)


class MTPHead(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], hnorm_per_stream: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        b = f"blk.{cfg.mtp_layer}"
        self.hnorm_per_stream = hnorm_per_stream
        self.eh = w[f"{b}.nextn.eh_proj.weight"]  # [D, 2D]: columns [embedding | hidden]
        self.enorm, self.hnorm = w[f"{b}.nextn.enorm.weight"], w[f"{b}.nextn.hnorm.weight"]
        self.mix_head = HyperMixer(w, f"{b}.nextn.hc_head", cfg.hidden, cfg.hc_count, cfg.rms_eps, inject=False)
        self.mix_attn = HyperMixer(w, f"{b}.hc_attn", cfg.hidden, cfg.hc_count, cfg.rms_eps)
        self.mix_ffn = HyperMixer(w, f"{b}.hc_ffn", cfg.hidden, cfg.hc_count, cfg.rms_eps)
        self.attn = QSAAttention(cfg, w, b, ratio=0)  # llama.cpp's converter marks the MTP block dense
        self.moe = MoE(w, b, cfg.n_experts_used)

    def attend(self, emb: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kvs: list[tuple[slice, KVCache]], kv_len: int | None = None, tables: SequenceTables | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The block up to its attention, which writes every row's K/V cells -> (X [T, S*D], the attention output
        y [T, D], the injection logits): all a row needs for the rows after it to attend to it. `kvs`: each
        sequence's rows and its head's cache (several in a batched step: the row-wise work runs once over all, and
        with `tables` holding the head's caches ("mtp") the attention too, where its kernels take the step)."""
        c, a = self.cfg, self.attn
        X = mtp_in(emb, H, self.enorm, self.hnorm, self.eh, c.hc_count, c.hidden, c.rms_eps, self.hnorm_per_stream)
        h, inj = self.mix_attn(X)
        proj = a.project(h, cos, sin)
        o = None
        if len(kvs) > 1 and even_rows([r for r, _ in kvs]):
            o = a.attend_seqs(proj, pos, cos, sin, [kv for _, kv in kvs], [(None, None, None)] * len(kvs), tables,
                              "mtp", key_lo=1, kv_len=kv_len)
        if o is None:
            parts = [a.attend_rows(tuple(p[r] for p in proj) if len(kvs) > 1 else proj, pos[r], cos[r], sin[r], kv,
                                   None, None, None, key_lo=1, kv_len=kv_len) for r, kv in kvs]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
        return X, a.output(o, proj), inj

    def forward(self, emb: torch.Tensor, H: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kvs: list[tuple[slice, KVCache]], kv_len: int | None = None, row: torch.Tensor | None = None,
                tables: SequenceTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """emb [T, D] token embeddings, H [T, S*D] residual of the previous position -> (h [T, D], X [T, S*D]).

        row (device indices [B], one per sequence in `kvs`): every row writes its K/V cells, but only those rows go
        on through the MoE and the mixers after the attention -> (h [B, D], X [B, S*D]). The draft extend needs one
        row's output a sequence, and the other rows' MoE would read ~47 more experts (for 6 rows) for nothing."""
        X, y, inj = self.attend(emb, H, pos, cos, sin, kvs, kv_len, tables)
        if row is not None:
            X, y = X.index_select(0, row), y.index_select(0, row)
            inj = None if inj is None else inj.index_select(0, row)
        X, h, inj = self.mix_ffn.combine_mix(X, (y, inj))
        X, out, _ = self.mix_head.combine_mix(X, (self.moe(h), inj))
        return out, X
