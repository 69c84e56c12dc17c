"""The n-gram layer's contexts for several sequences of a batch in one launch (model/ple.PLE.contexts_seqs).

A step's n-gram contexts (token, previous, one before; the EOS cut: a missing or EOS predecessor ends the context)
come from each sequence's rows and its token history, the two tokens before them in plane `live` of its history
planes; the history after each row j goes to plane `base + j` (the recurrent cache's rollback layout). One program
per (row, sequence) reads the history through tables of every sequence's addresses (state/tables.SequenceTables).
The reference is each sequence's own `PLE.table_rows` contexts (model/ple.ngram_contexts and its history writes);
integers only, so the results are the same.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, pdl_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, table_pointer

    @triton.jit
    def _ngram_contexts_kernel(tok_ptr, hist_ptr, live_ptr, base_ptr, ctx_ptr, T, eos, PDL: tl.constexpr = False):
        # program (row t, sequence b): row b T + t's context from the rows before it and the sequence's history
        pdl_start(PDL)
        t = tl.program_id(0)
        seq = tl.program_id(1)
        hist = table_pointer(hist_ptr, seq, tl.int64)  # [planes, 2]: (one before, previous) of the next row
        live = tl.load(table_pointer(live_ptr, seq, tl.int64, False))
        base = tl.load(table_pointer(base_ptr, seq, tl.int64, False))
        row = seq * T + t
        h0 = tl.load(hist + live * 2)
        h1 = tl.load(hist + live * 2 + 1)
        c0 = tl.load(tok_ptr + row)
        c1 = tl.where(t >= 1, tl.load(tok_ptr + row - 1, mask=t >= 1, other=0), h1)
        c2 = tl.where(t >= 2, tl.load(tok_ptr + row - 2, mask=t >= 2, other=0), tl.where(t == 1, h1, h0))
        c2 = tl.where(c1 == eos, eos, c2)
        tl.store(ctx_ptr + row * 3, c0)
        tl.store(ctx_ptr + row * 3 + 1, c1)
        tl.store(ctx_ptr + row * 3 + 2, c2)
        tl.store(hist + (base + t) * 2, c1)  # the history after this row: (previous, this token)
        tl.store(hist + (base + t) * 2 + 1, c0)


def ngram_contexts_seqs_triton(tokens: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                               eos: int) -> torch.Tensor:
    """Rows b T .. (b + 1) T - 1 of tokens [B T] (int64) are sequence b's: their contexts -> [B T, 3] int64, and each
    row's history written to plane base_b + t of sequence b's history planes. tables: int64 [B] device tensors of
    every sequence's history planes ([planes, 2] int64, contiguous), `live` and `base` addresses. The caller keeps
    T <= the sequences' slots (every row's history has a plane)."""
    B = tables[0].shape[0]
    T, rem = divmod(tokens.shape[0], B)
    if rem or T < 1 or tokens.dtype != torch.int64 or any(t.shape != (B,) or t.dtype != torch.int64 for t in tables):
        raise ValueError(f"n-gram contexts of {B} sequences: {tokens.shape[0]} {tokens.dtype} tokens, 3 tables of "
                         f"{B} int64 addresses")
    tokens = tokens.contiguous()
    ctx = torch.empty(tokens.shape[0], 3, dtype=torch.int64, device=tokens.device)
    _ngram_contexts_kernel[(T, B)](tokens, *tables, ctx, T, eos, num_warps=1, **pdl_launch(tokens))
    return ctx
