"""A chat reply's reasoning apart from its answer (`--reasoning-parser qwen3`, vLLM's name): Qwen3 models think in a
`<think>...</think>` block before they answer. The block's text becomes the message's `reasoning_content`, the rest
its `content` (the blank lines after the block dropped), as vLLM, SGLang and llama.cpp's server return them.

A reply thinks when its text starts with `<think>`, or when its prompt opened the block in the reply's own turn (a
template that thinks by default, as Qwen3.5's; qspec's with `enable_thinking: true`; grammar.think_state_of): then
everything up to `</think>` is reasoning, all of it if the reply stops before the block closes. A reply that does
neither is all content.

Streamed text arrives in pieces that may cut a tag anywhere, so a piece's end that could begin a tag is held back
until the next piece tells.
"""

from __future__ import annotations

from qspec.tokenizer import THINK_CLOSE as CLOSE
from qspec.tokenizer import THINK_OPEN as OPEN


class ReasoningSplit:
    """One reply's text, piece by piece -> (reasoning, content) pieces."""

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning" if opened else "start"  # start: nothing but blanks seen yet
        self.held = ""

    def push(self, piece: str) -> tuple[str, str]:
        """The reasoning and content that `piece` adds (either may be empty)."""
        text, self.held = self.held + piece, ""
        reasoning = ""
        if self.state == "start":
            stripped = text.lstrip()
            if OPEN.startswith(stripped):  # blanks, or the start of the tag: wait for more
                self.held = text
                return "", ""
            if stripped.startswith(OPEN):
                self.state, text = "reasoning", stripped[len(OPEN):]
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = tag_start(text, CLOSE)
                self.held = text[keep:]
                return text[:keep], ""
            reasoning, text, self.state = text[:end], text[end + len(CLOSE):], "after"
        if self.state == "after":  # the blank lines between the block and the answer are dropped
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.state = "content"
        return reasoning, text

    def flush(self) -> tuple[str, str]:
        """What is held at the reply's end: reasoning inside an unclosed block, else content."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held

    def whole(self, text: str) -> tuple[str, str]:
        """A whole reply -> (reasoning, content)."""
        r1, c1 = self.push(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2


def tag_start(text: str, tag: str) -> int:
    """Where a suffix of `text` that is a proper prefix of `tag` starts (len(text) when none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return len(text) - n
    return len(text)
