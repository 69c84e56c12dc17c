"""The rule scripts/gpu_check.py applies to bf16 greedy equality on the GPU: equal tokens, or a first difference at a
near tie of the reference run's logits, found through the step and verify row that predicted that token."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import load_script


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])


def test_plain_decoding_difference_at_a_near_tie_only() -> None:
    gc = load_script("gpu_check")
    # plain decoding: logits[i] predicted token i + 1; token 2 was a near tie (0.57%), token 1 was not
    logits = [_row(1.0, 0.5, 0.1), _row(1.36, 1.3522, 0.1), _row(1.0, 0.2, 0.1)]
    ref = SimpleNamespace(tokens=[5, 0, 1, 0], logits=logits, rounds_log=[])
    assert gc.same_or_tie([5, 0, 1, 0], ref, 0, 0.03) == (True, "equal")
    ok, why = gc.same_or_tie([5, 0, 0, 1], ref, 0, 0.03)
    assert ok and "first diff 2, a near tie" in why
    ok, why = gc.same_or_tie([5, 1, 1, 0], ref, 0, 0.03)
    assert not ok and "NOT a near tie" in why
    assert not gc.same_or_tie([5, 0, 0, 1], ref, 0, 0.0)[0]  # f32 and row-exact rows allow no tie
    assert not gc.same_or_tie([5, 0, 1], ref, 0, 0.03)[0]  # a shorter output is a difference, not a tie


def test_rows_of_speculative_rounds() -> None:
    gc = load_script("gpu_check")
    # round 0 accepted 1 draft: its verify rows 0 and 1 predicted tokens 1 and 2; round 1's row 0 token 3
    r0 = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.01, 0.0], [0.0, 0.0, 1.0]])
    r1 = torch.tensor([[1.0, 0.0, 0.0]])
    g = SimpleNamespace(tokens=[5, 1, 1, 0], logits=[r0, r1], rounds_log=[{"accepted": 1}, {"accepted": 0}])
    assert torch.equal(gc._predicting_row(g, 3, 1), r0[0])
    assert torch.equal(gc._predicting_row(g, 3, 2), r0[1])
    assert torch.equal(gc._predicting_row(g, 3, 3), r1[0])
    assert gc._predicting_row(g, 3, 4) is None
    assert gc._steps_before(g, 3, 3) == 1 and gc._steps_before(g, 3, 2) == 0 and gc._steps_before(g, 0, 3) == 2
    ok, why = gc.same_or_tie([5, 1, 0, 0], g, 3, 0.03)  # token 2 came from the near-tied row r0[1]
    assert ok and "first diff 2" in why
