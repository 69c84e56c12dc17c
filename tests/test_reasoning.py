"""A chat reply's reasoning apart from its answer (qspec/server/reasoning.py): whole replies, and streamed ones cut
into pieces anywhere (a tag split across pieces included) giving the same text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qspec.server.reasoning import ReasoningSplit


@pytest.mark.parametrize("text, opened, want", [
    ("<think>\nwhy\n</think>\n\nanswer", False, ("\nwhy\n", "answer")),
    ("  <think>a</think>b</think>c", False, ("a", "b</think>c")),
    ("plain answer <think>x</think>", False, ("", "plain answer <think>x</think>")),
    ("why not\n</think>\n\nyes", True, ("why not\n", "yes")),
    ("cut off while thin", True, ("cut off while thin", "")),
    ("<think>cut off", False, ("cut off", "")),
    ("<thi", False, ("", "<thi")),
    ("\n\n", False, ("", "\n\n")),
    ("<think></think>", False, ("", "")),
])
def test_whole_replies(text: str, opened: bool, want: tuple[str, str]) -> None:
    assert ReasoningSplit(opened).whole(text) == want


TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "\n", " ", "a", "b c"]),
                 max_size=12).map("".join)


@given(TEXTS, st.lists(st.integers(0, 40), max_size=8), st.booleans())
def test_streamed_pieces_add_up_to_the_whole(text: str, cuts: list[int], opened: bool) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    split = ReasoningSplit(opened)
    parts = [split.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [split.flush()]
    got = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
    assert got == ReasoningSplit(opened).whole(text)
