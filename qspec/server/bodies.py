"""The JSON bodies the server answers with: OpenAI's text_completion and chat.completion objects (whole, and chunks
when streamed), their log-probability objects, and qspec's own statistics; `chat_chunks` reads a chat stream's
chunks back (the Messages and Responses APIs rewrite them as their own events)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from qspec.engine import Generation
from qspec.spec.logprobs import TokenLogprob
from qspec.spec.stats import SpecStats
from qspec.tokenizer import Tokenizer


def qspec_stats(gens: list[Generation]) -> dict[str, Any]:
    """The `qspec` object over the choices: each choice's first token comes from its prefill, so the decode rate
    counts the tokens after it (null when there are none); prefill_s: every choice's (those that find their prompt
    in the caches add little)."""
    if not gens:
        return {}
    after_first, seconds = sum(max(len(g.tokens) - 1, 0) for g in gens), sum(g.decode_s for g in gens)
    tps = after_first / seconds if after_first > 0 and seconds > 0 else None
    spec = SpecStats()
    for g in gens:
        spec.merge(g.spec)
    # rounds: the verify steps, so that the mean acceptance length (accepted / rounds + 1) and each draft position's
    # rate can be read per request, not only from /metrics
    return {"qspec": {"decode_tokens_per_s": tps, "prefill_s": sum(g.prefill_s for g in gens),
                      "drafted": spec.drafted, "accepted": spec.accepted, "rounds": spec.rounds,
                      "acceptance_by_position": [round(x, 4) for x in spec.acceptance_by_position()]}}


class TextBodies:
    """/v1/completions bodies: text_completion objects."""
    prefix, whole, chunk = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, first: bool, index: int = 0,
               logprobs: dict | None = None, reasoning: str = "", tool_calls: list[dict] | None = None) -> dict:
        """A choice; `reasoning` and `tool_calls` are chat's alone (completions have neither: "" and none)."""
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(entries: list[TokenLogprob], tok: Tokenizer, offset: int) -> dict:
        """OpenAI's legacy completion logprobs; `offset`: the characters of the text before these tokens."""
        texts = [token_text(tok, e.token) for e in entries]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {token_text(tok, i): v for i, v in e.top}
                                 for e in entries],
                "text_offset": offsets}


class ChatBodies:
    """/v1/chat/completions bodies: chat.completion objects, and chunks with deltas when streamed."""
    prefix, whole, chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, first: bool, index: int = 0,
               logprobs: dict | None = None, reasoning: str = "", tool_calls: list[dict] | None = None) -> dict:
        """A choice; `reasoning`: the reply's think block apart (--reasoning-parser), as `reasoning_content`;
        `tool_calls`: the calls the reply made (a streamed chunk's carry their index in the reply)."""
        calls = {"tool_calls": tool_calls} if tool_calls else {}
        if not streamed:
            thought = {"reasoning_content": reasoning} if reasoning else {}
            content = None if calls and not text else text  # OpenAI's: no content beside the calls
            return {"index": index, "message": {"role": "assistant", "content": content} | thought | calls,
                    "logprobs": logprobs, "finish_reason": finish}
        delta = (({"role": "assistant"} if first else {}) | ({"reasoning_content": reasoning} if reasoning else {})
                 | ({"content": text} if text else {}) | calls)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(entries: list[TokenLogprob], tok: Tokenizer, offset: int) -> dict:
        """OpenAI's chat logprobs: each token's text, log-probability and UTF-8 bytes, with its top alternatives."""
        def one(i: int, v: float) -> dict:
            return {"token": token_text(tok, i), "logprob": v, "bytes": list(tok.id_to_bytes(i))}
        return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(i, v) for i, v in e.top]}
                            for e in entries], "refusal": None}


def token_text(tok: Tokenizer, token: int) -> str:
    """A token's text (its bytes as UTF-8, a partial character replaced)."""
    return tok.id_to_bytes(token).decode("utf-8", "replace")


async def chat_chunks(stream: AsyncGenerator[str | bytes, None]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a chat stream's server-sent events (blank lines and `[DONE]` skipped). Closing this
    generator closes the stream: a client that left stops the chat stream's worker."""
    try:
        async for raw in stream:
            line = raw.decode() if isinstance(raw, bytes) else raw
            if line.startswith("data: {"):
                yield json.loads(line[len("data: "):])
    finally:
        await stream.aclose()
