"""A draft vocabulary (spec/draft_vocab.py, model/mtp.py DraftHead): the head reads only the chosen rows, drafts
come only from them, and the output stays plain decoding's; bad sets are refused with a message that names them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.kernels.q4 import Q4Weight
from qspec.model.model import Model
from qspec.model.mtp import DraftHead
from qspec.runner import Runner
from qspec.spec.accept import Sampler
from qspec.spec.draft_vocab import check_ids, first_ids, frequent_ids, ids_tensor, read_ids, write_ids

PROMPT = list(range(3, 40))


def test_ids_are_checked_and_ranked(tmp_path: Path) -> None:
    assert check_ids([5, 1, 5, 3], 8) == [1, 3, 5]
    assert first_ids(3, 10, keep=[9]) == [0, 1, 2, 9]
    # most frequent first, ties to the lower id; the stop tokens kept whatever their count
    assert frequent_ids([[4, 4, 7, 7, 2], [2, 9]], 2, 10, keep=[0]) == [0, 2, 4]
    for bad, msg in (([], "empty"), ([3, 10], "id 10 is outside"), ([-1], "id -1 is outside")):
        with pytest.raises(ValueError, match=msg):
            check_ids(bad, 10)
    with pytest.raises(ValueError, match=r"expected 1\.\.10"):
        first_ids(0, 10)
    with pytest.raises(ValueError, match=r"expected 1\.\.10"):
        frequent_ids([[1]], 11, 10)
    with pytest.raises(ValueError, match="no tokens"):
        frequent_ids([[]], 2, 10)
    f = tmp_path / "ids.txt"
    write_ids(f, [1, 4, 6], "a comment\nover two lines")
    assert read_ids(f, 8) == [1, 4, 6]
    f.write_text("1\n  # note\n\n4  # four\n", encoding="utf-8")
    assert read_ids(f, 8) == [1, 4]
    f.write_text("1\nfour\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"ids.txt:2: expected one token id per line, got 'four'"):
        read_ids(f, 8)
    f.write_text("1\n9\n", encoding="utf-8")
    with pytest.raises(ValueError, match="ids.txt: draft vocabulary id 9 is outside"):
        read_ids(f, 8)
    assert ids_tensor(torch.tensor([3, 1]), 8, torch.device("cpu")).tolist() == [1, 3]


@pytest.mark.parametrize("q4", [False, True])
def test_draft_head_reads_its_rows_and_hides_the_rest(tiny_model: Model, q4: bool) -> None:
    """The logits at the chosen ids are the full head's (the same rows; a Q4_0 head's rows are quantized alone),
    every other id is -inf."""
    V = tiny_model.cfg.vocab_size
    full = Q4Weight.from_dense(tiny_model.lm_head) if q4 else tiny_model.lm_head
    ids = torch.tensor([0, 7, 8, 100, V - 1])
    head = DraftHead.rows_of(full, ids)
    assert head.vocab == V and head.weight.shape == (5, full.shape[1]) and isinstance(head.weight, Q4Weight) == q4
    run = Runner(tiny_model, EngineOptions(draft=2, capacity=64).cache_options())
    _, X = run.step(torch.tensor([5, 9, 2, 7]))
    run.keep(4, rollback=False)
    ref, Xr = run.mtp_step(torch.tensor([9, 2, 7]), X[:3], 1, full)
    got, Xg = run.mtp_step(torch.tensor([9, 2, 7]), X[:3], 1, head)
    assert got.shape == ref.shape == (3, V) and torch.equal(Xg, Xr)
    torch.testing.assert_close(got[:, ids], ref[:, ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(V, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(got[:, rest]).all()


def test_greedy_output_is_plain_decodings_and_drafts_stay_in_the_set(tiny_model: Model) -> None:
    plain = Engine(tiny_model, EngineOptions(draft=0, capacity=256)).generate(PROMPT, 24).tokens
    allowed = set(range(0, 512, 5))
    seen: list[int] = []

    def hook(_: int, drafts: list[int]) -> list[int]:  # the host path shows the drafts
        seen.extend(drafts)
        return drafts

    for opts, hooks in ((dict(draft=3), None), (dict(draft=3, draft_head="q4"), None),
                        (dict(draft=5), EngineHooks(draft_hook=hook))):
        g = Engine(tiny_model, EngineOptions(capacity=256, draft_vocab=sorted(allowed), **opts), hooks).generate(
            PROMPT, 24)
        assert g.tokens == plain, opts
    assert seen and set(seen) <= allowed
    # a one-id set: the head proposes that id at every position, and the output is still plain decoding's
    one = Engine(tiny_model, EngineOptions(draft=3, capacity=256, draft_vocab=[plain[1]])).generate(PROMPT, 24)
    assert one.tokens == plain


def test_sampling_with_a_draft_vocabulary_is_seeded(tiny_model: Model) -> None:
    def sample(seed: int) -> list[int]:
        s = Sampler(temperature=0.9, top_p=0.95, generator=torch.Generator().manual_seed(seed))
        eng = Engine(tiny_model, EngineOptions(draft=3, capacity=256, draft_vocab=range(0, 512, 2)))
        return eng.generate(PROMPT, 16, sampler=s).tokens

    a, b = sample(1), sample(1)
    assert a == b and len(a) == 16


def test_a_bad_draft_vocabulary_is_refused(tiny_model: Model) -> None:
    with pytest.raises(ValueError, match="id 512 is outside the model's vocabulary"):
        Engine(tiny_model, EngineOptions(draft=2, capacity=64, draft_vocab=[1, 512]))
    with pytest.raises(ValueError, match="empty"):
        Engine(tiny_model, EngineOptions(draft=2, capacity=64, draft_vocab=[]))
