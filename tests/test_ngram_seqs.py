"""The n-gram layer's contexts for several sequences in one launch (kernels/triton_ngram.py) against each sequence's
own `PLE.table_rows` (model/ple.ngram_contexts and its history writes), through Triton's interpreter
(`test_interpreted` runs this file's `interp` tests in a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, run_interp_tests, tiny_config

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.state.recurrent import RecurrentCache
from qspec.state.tables import SequenceTables

interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


def _caches(cfg: object, B: int, n_slots: int, eos: int) -> list[RecurrentCache]:
    """B recurrent caches with random token histories, live in either half, an EOS in some, each begun on a step."""
    g = torch.Generator().manual_seed(3)
    out = []
    for b in range(B):
        rc = RecurrentCache(cfg, n_slots, "cpu")  # type: ignore[arg-type]
        assert rc.ple is not None
        rc.ple.hist.copy_(torch.randint(0, 50, rc.ple.hist.shape, generator=g))
        rc.ple.hist[b % n_slots, b % 2] = eos
        for _ in range(1 + b % 2):  # a step, committed: live in the upper half, then (odd b) in the lower
            rc.begin_step()
            rc.commit(b % n_slots)
        rc.begin_step()
        out.append(rc)
    return out


@interp
@pytest.mark.parametrize("T", [1, 2, 5])
def test_interp_contexts_and_histories_are_each_sequences_own(T: int) -> None:
    """Every row's table rows and every sequence's history planes equal its own table_rows' (EOS tokens among the
    rows and in the histories, so the cut is taken at every place it can be)."""
    from qspec.kernels.triton_ngram import ngram_contexts_seqs_triton
    from qspec.model.ple import ngram_rows

    model = build_model(tiny_config(), seed=2)
    ple, cfg = model.ple, model.cfg
    assert ple is not None
    B, eos = 4, cfg.eos_token_id
    alone, mine = _caches(cfg, B, 6, eos), _caches(cfg, B, 6, eos)
    tokens = torch.randint(0, 50, (B * T,), generator=torch.Generator().manual_seed(4))
    tokens[1::3] = eos
    want = torch.cat([ple.table_rows(tokens[b * T:(b + 1) * T], rc.ple, rc) for b, rc in enumerate(alone)])
    tables = SequenceTables(mine, {}).ple("hist")
    assert tables is not None
    got = ngram_rows(ngram_contexts_seqs_triton(tokens, tables, eos), cfg, ple.mult, ple.vocab, ple.off)
    assert torch.equal(got, want)
    assert all(torch.equal(a.ple.hist, m.ple.hist) for a, m in zip(alone, mine, strict=True))


def test_the_kernel_refuses_rows_that_do_not_divide() -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from qspec.kernels.triton_ngram import ngram_contexts_seqs_triton

    tables = tuple(torch.zeros(3, dtype=torch.int64) for _ in range(3))
    with pytest.raises(ValueError, match="n-gram contexts of 3 sequences"):
        ngram_contexts_seqs_triton(torch.zeros(4, dtype=torch.int64), tables, 0)  # type: ignore[arg-type]
