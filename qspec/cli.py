"""The `qspec` command: `run` (generate, streaming), `serve` (an HTTP completions API), `make-model` (random-weight
models), `logits` (one prefill forward, full-vocabulary logits), `draft-vocab` (the token ids the draft head may
propose, counted over text), and `bench` when `qspec.bench.cli` provides it.

Every user error (missing or bad model file, prompt too long, bad numbers) prints one line
`qspec: error: ...` on stderr and returns 2; only bugs show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
from gguf import GGMLQuantizationType

from qspec.config import ConfigError, preset
from qspec.engine import Engine, EngineOptions, Generation, cells_needed
from qspec.loader import (
    QWEN_VOCAB,
    default_model_file,
    default_model_path,
    load_model,
    load_tokenizer,
    model_path,
    tokenizer_for_vocab,
    write_model,
)
from qspec.model import ops
from qspec.model.model import CacheOptions
from qspec.runner import ContextError, Runner
from qspec.spec.accept import Sampler
from qspec.spec.draft_vocab import first_ids, frequent_ids, read_ids, write_ids
from qspec.tokenizer import Tokenizer
from qspec.weights import WeightsError

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
MAX_DRAFT = 8


class UsageError(Exception):
    """A bad command line; reported like every other user error (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    # argparse would print the usage block and exit; raise instead so main() reports one line and returns 2.
    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("qspec").strip()
        raise UsageError(f"{where}: {message}" if where else message)


def _say(msg: str, file: TextIO | None = None) -> None:
    print(msg, file=file or sys.stderr, flush=True)


def _write_text(out: TextIO, text: str) -> None:
    """Write streamed text even to a terminal whose encoding cannot hold it (random models emit any script)."""
    try:
        out.write(text)
    except UnicodeEncodeError:
        enc = getattr(out, "encoding", None) or "ascii"
        out.write(text.encode(enc, "replace").decode(enc))
    out.flush()


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    return torch.device(name)


def _model_path(arg: str | None) -> Path:
    if arg is not None:
        try:
            return model_path(arg)
        except FileNotFoundError as e:
            raise UsageError(f"--model {arg}: {e}") from e
    first = "" if default_model_file().is_file() else ", generating it once (about 10 s)"
    _say(f"qspec: using the embedded default model (random weights: the text is gibberish; "
         f"pass --model path.gguf for real weights, or --model demo for a small trained model){first}")
    return default_model_path()


# ---- qspec run -------------------------------------------------------------------------------------------------------
def _check_engine_args(a: argparse.Namespace) -> None:
    if not 0 <= a.draft <= MAX_DRAFT:
        raise UsageError(f"--draft must be in 0..{MAX_DRAFT} (0 = plain decoding), got {a.draft}")
    if a.ctx < 4 or a.ctx % 4:
        raise UsageError(f"--ctx must be a positive multiple of 4, got {a.ctx}")
    if a.draft_vocab is not None and not a.draft:
        raise UsageError("--draft-vocab restricts the drafts: it needs --draft N (N >= 1)")


def _draft_vocab(spec: str, vocab: int, tok: Tokenizer) -> list[int]:
    """--draft-vocab N: the first N ids and the stop tokens; --draft-vocab FILE: the ids of a `qspec draft-vocab`
    file (one per line)."""
    try:
        if spec.isdigit():
            return first_ids(int(spec), vocab, keep=[t for t in tok.stop_ids if t < vocab])
        return read_ids(spec, vocab)
    except (ValueError, OSError) as e:
        raise UsageError(f"--draft-vocab {spec}: {e}") from None


def _check_run_args(a: argparse.Namespace) -> None:
    _check_engine_args(a)
    if a.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")


def _prompt_ids(tok: Tokenizer, text: str, vocab_size: int, chat: bool) -> list[int]:
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    ids = tok.encode(text, add_special=True)
    if not ids:
        raise UsageError("the prompt is empty")
    bad = max(ids)
    if bad >= vocab_size:
        raise UsageError(f"the prompt has token id {bad}, outside the model's vocabulary of {vocab_size}: "
                         "the tokenizer does not belong to this model")
    return ids


def _jsonable(x: Any) -> Any:
    """Counter dicts may have tuple or int keys; JSON wants strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def generation_json(g: Generation, text: str, options: dict[str, Any]) -> dict[str, Any]:
    return _jsonable({
        "text": text, "tokens": g.tokens, "prompt_tokens": g.prompt_tokens, "generated_tokens": len(g.tokens),
        "stop_reason": g.stop_reason, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
        "prefill_tps": g.prefill_tps, "decode_tps": g.decode_tps, "spec": g.spec.as_dict(), "pooled": g.pooled,
        "snapshots": g.snapshots, "rounds_log": g.rounds_log, "options": options,
    })


def _print_summary(g: Generation, draft: int) -> None:
    _say(f"prompt: {g.prompt_tokens} tokens, prefill {g.prefill_s:.3f} s ({g.prefill_tps:.1f} tok/s)")
    _say(f"generated: {len(g.tokens)} tokens, decode {g.decode_s:.3f} s ({g.decode_tps:.1f} tok/s), "
         f"stop: {g.stop_reason}")
    if draft:
        s = g.spec
        rate = s.accepted / s.drafted if s.drafted else 0.0
        _say(f"speculative (draft {draft}): {s.rounds} rounds, {s.drafted} drafted, {s.accepted} accepted "
             f"({rate:.1%}), mean accepted length {s.mean_accepted:.2f}, {s.tokens_per_round:.2f} tokens/round")
        _say("acceptance by position: " + " ".join(f"{i + 1}:{p:.2f}" for i, p in
                                                   enumerate(s.acceptance_by_position())))


def _print_stats(g: Generation, draft: int) -> None:
    for ratio, c in g.pooled.items():
        _say(f"pooled keys {ratio}: " + ", ".join(f"{k}={v}" for k, v in c.items()))
    _say("conv snapshots: " + ", ".join(f"{k}={v}" for k, v in g.snapshots.items()))
    rounds = len(g.rounds_log)
    if rounds:
        for key in sorted(k for k in g.rounds_log[0] if k.startswith("pooled_") and k.endswith("_rows")):
            ratio = key.removeprefix("pooled_").removesuffix("_rows")
            rows = [r[key] for r in g.rounds_log]
            real = [r[f"pooled_{ratio}_real"] for r in g.rounds_log]
            _say(f"pooled keys {ratio} per round: {sum(rows) / rounds:.1f} rows materialized "
                 f"({sum(real) / rounds:.2f} real, {(sum(rows) - sum(real)) / rounds:.2f} filler), "
                 f"min {min(rows)} max {max(rows)}")
        snap = g.snapshots
        _say(f"conv snapshots per round: {snap.get('dispatches', 0) / rounds:.1f} dispatches, "
             f"{snap.get('source_reads', 0) / rounds:.0f} source reads (prefill included)")
    if draft:
        hist = Counter(r["accepted"] for r in g.rounds_log)
        _say("accepted per round: " + " ".join(f"{k}:{hist.get(k, 0)}" for k in range(draft + 1))
             + f" (rounds with k of {draft} drafts accepted)")


def _accept_hook(spec: str | None):  # noqa: ANN202
    if not spec:
        return None
    from qspec.bench.accept import AcceptProfile

    try:
        return AcceptProfile.parse(spec).hook()
    except (ValueError, OSError) as e:
        raise UsageError(f"--accept-profile: {e}") from None


def _load(a: argparse.Namespace) -> tuple[Path, Tokenizer, Engine]:
    """The model, its tokenizer and an engine from the options `run` and `serve` share."""
    dev = _device(a.device)
    path = _model_path(a.model)
    t0 = time.perf_counter()
    tok = load_tokenizer(path)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = load_model(path, device=dev, dtype=DTYPES[a.dtype] if a.dtype else None,
                       with_mtp=None if a.draft else False, hnorm_per_stream=a.hnorm_per_stream,
                       draft_path=a.draft_model if a.draft else None, quantize=a.quantize)
    load_s = time.perf_counter() - t0
    if a.draft and model.mtp is None:
        raise UsageError(f"--draft {a.draft} needs MTP weights and {path} has none (use --draft 0, "
                         "or a model with blk.N.nextn.* / mtp.* tensors)")
    draft_vocab = _draft_vocab(a.draft_vocab, model.cfg.vocab_size, tok) if a.draft_vocab is not None else None
    opts = EngineOptions(
        draft=a.draft, capacity=a.ctx, kv_type=a.kv_type, exact=a.exact, preserve_pooled=a.preserve_pooled,
        incremental_pooled=a.incremental, pad_target=None if a.no_pad else a.pad_target,
        fused_snapshots=a.fused_snapshots, cuda_graphs=a.cuda_graphs, compile=a.compile,
        sparse_attention=a.sparse_attention, fused_attention=a.fused_attention,
        kv_write_kernel=a.kv_write_kernel, gdn_conv_kernel=a.gdn_conv_kernel,
        draft_before_readback=a.draft_before_readback, pdl=a.pdl,
        draft_head=a.draft_head,  # q4: packed Q4_0 head + 4-bit kernel on CUDA, its dequantized copy on the CPU
        draft_vocab=draft_vocab, grouped_mm=a.grouped_mm,
        accept_hook=_accept_hook(a.accept_profile) if a.draft else None)
    engine = Engine(model, opts)
    _say(f"qspec: {path.name}: {model.cfg.n_layers} layers, vocab {model.cfg.vocab_size}, "
         f"{'MTP' if model.mtp is not None else 'no MTP'}, {dev.type} {str(model.dtype).removeprefix('torch.')}, "
         f"loaded in {load_s:.1f} s (tokenizer {tok_s:.1f} s)")
    _say(f"qspec: weights: {model.weights_summary}")
    if dev.type == "cuda" and a.compile:
        _say("qspec: the first steps compile the fused step kernels (up to a few minutes at the real geometry; "
             "cached on disk for later runs; --no-compile skips it)")
    return path, tok, engine


def cmd_run(a: argparse.Namespace) -> int:
    _check_run_args(a)
    path, tok, engine = _load(a)
    model = engine.model
    ids = _prompt_ids(tok, a.prompt, model.cfg.vocab_size, a.chat)
    need = cells_needed(len(ids), a.max_tokens, a.draft)
    if need > a.ctx:
        raise UsageError(f"the prompt ({len(ids)} tokens) + --max-tokens {a.max_tokens} + {a.draft + 1} draft rows "
                         f"need {need} cells, more than --ctx {a.ctx}")
    sampler = Sampler(temperature=a.temperature, top_p=a.top_p,
                      generator=torch.Generator().manual_seed(a.seed))

    out = sys.stdout
    stream = tok.stream(skip_special=True)  # stop tokens and other control tokens are not text
    g = engine.generate(ids, a.max_tokens, sampler=sampler, stop_ids=set(tok.stop_ids),
                        on_token=lambda t: _write_text(out, stream.push(t)))
    _write_text(out, stream.flush() + "\n")

    _print_summary(g, a.draft)
    if a.stats:
        _print_stats(g, a.draft)
    if a.json:
        options = {k: v for k, v in vars(a).items() if k != "func"} | {"model": str(path), "device": model.device.type}
        doc = generation_json(g, tok.decode(g.tokens, skip_special=True), options)
        Path(a.json).write_text(json.dumps(doc, indent=2, ensure_ascii=False), encoding="utf-8")
    return 0


# ---- qspec serve -----------------------------------------------------------------------------------------------------
def cmd_serve(a: argparse.Namespace) -> int:
    _check_engine_args(a)
    if not 0 < a.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {a.port}")
    try:
        import uvicorn

        from qspec.server.app import create_app
    except ImportError as e:
        raise UsageError(f"qspec serve needs fastapi and uvicorn ({e.name} is missing): "
                         "pip install 'qspec[server]'") from None
    path, tok, engine = _load(a)
    ids = tok.encode("Hello", add_special=True) or [0]
    n = min(8, a.ctx - cells_needed(len(ids), 0, a.draft))
    if a.warmup and n >= 1:
        # the first steps compile (CUDA) and capture graphs: pay that before the first client waits for it
        t0 = time.perf_counter()
        engine.generate(ids, n)
        _say(f"qspec: warmed up in {time.perf_counter() - t0:.1f} s")
    name = a.served_name or path.stem
    _say(f"qspec: serving {name!r} at http://{a.host}:{a.port} (POST /v1/completions, /v1/chat/completions; "
         "GET /v1/models, /health)")
    uvicorn.run(create_app(engine, tok, name), host=a.host, port=a.port, log_level="warning")
    return 0


# ---- qspec make-model ------------------------------------------------------------------------------------------------
def _outputs(out: Path, fmt: str) -> list[tuple[str, Path]]:
    if fmt != "both":
        return [(fmt, out)]
    stem = out.with_suffix("") if out.suffix == ".gguf" else out
    return [("gguf", stem.with_name(stem.name + ".gguf")), ("hf", stem.with_name(stem.name + "-hf"))]


def cmd_make_model(a: argparse.Namespace) -> int:
    for flag in ("layers", "experts", "ngram_vocab_base", "vocab_size"):
        v = getattr(a, flag)
        if v is not None and v <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    if (a.qtype or a.quant) and a.format == "hf":
        raise UsageError("--qtype/--quant apply to GGUF output only (--format gguf or both)")
    if a.qtype and a.quant:
        raise UsageError("--qtype and --quant are exclusive")
    cfg = preset(a.preset, layers=a.layers, experts=a.experts, ngram_vocab_base=a.ngram_vocab_base,
                 vocab_size=a.vocab_size, mtp=not a.no_mtp)
    tok, note = tokenizer_for_vocab(cfg.vocab_size)
    _say(f"qspec: {'tokenizer' if tok is not None and cfg.vocab_size == QWEN_VOCAB else 'warning'}: {note}")
    for fmt, path in _outputs(Path(a.out), a.format):
        if fmt == "hf" and path.exists() and not path.is_dir():
            raise UsageError(f"{path} exists and is not a directory")
        t0 = time.perf_counter()
        write_model(path, cfg, fmt=fmt, seed=a.seed, dtype=DTYPES[a.dtype],
                    qtype=QTYPES[a.qtype] if a.qtype and fmt == "gguf" else None, tokenizer=tok,
                    quant=a.quant if fmt == "gguf" else None)
        _say(f"qspec: wrote {path} ({fmt}, {a.preset}, {cfg.n_layers} layers, {cfg.n_experts} experts, "
             f"vocab {cfg.vocab_size}, {'MTP' if cfg.has_mtp else 'no MTP'}, seed {a.seed}) "
             f"in {time.perf_counter() - t0:.1f} s")
    return 0


# ---- qspec logits ----------------------------------------------------------------------------------------------------
def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"--ids: expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise UsageError("--ids: no token ids given")
    return ids


def cmd_logits(a: argparse.Namespace) -> int:
    dev = _device(a.device)
    path = Path(a.model)
    if a.ids is not None:
        ids = _parse_ids(a.ids)
    else:
        ids = load_tokenizer(path).encode(a.text, add_special=True)
        if not ids:
            raise UsageError("--text: the text encodes to no tokens")
    model = load_model(path, device=dev, dtype=DTYPES[a.dtype] if a.dtype else None, with_mtp=False)
    V = model.cfg.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise UsageError(f"token ids must be in [0, {V}), got {min(ids)}..{max(ids)}")
    runner = Runner(model, CacheOptions(capacity=-(-len(ids) // 4) * 4))
    with torch.inference_mode(), ops.row_exact_mode(a.exact):
        logits, _ = runner.step(torch.tensor(ids, dtype=torch.long))  # logit_rows=None: every position
    import numpy as np  # only this command writes numpy files

    arr = logits.float().cpu().numpy().astype(np.float32, copy=False)
    np.save(a.out, arr)
    _say(f"qspec: wrote {a.out}: logits [{arr.shape[0]}, {arr.shape[1]}] float32")
    return 0


# ---- qspec draft-vocab -----------------------------------------------------------------------------------------------
def cmd_draft_vocab(a: argparse.Namespace) -> int:
    if a.size < 1:
        raise UsageError(f"--size must be >= 1, got {a.size}")
    path = _model_path(a.model)
    tok = load_tokenizer(path)
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in a.corpus]
    counted = tok.encode_batch(texts)
    n_tokens = sum(map(len, counted))
    if not n_tokens:
        raise UsageError("the corpus encodes to no tokens")
    vocab = tok.padded_vocab_size
    try:
        ids = frequent_ids(counted, min(a.size, vocab), vocab, keep=tok.stop_ids)
    except ValueError as e:
        raise UsageError(str(e)) from None
    write_ids(a.out, ids, f"qspec draft-vocab: the most frequent (up to {a.size}) of {n_tokens} tokens in "
              f"{len(texts)} file(s), tokenizer of {path.name}, plus the stop tokens")
    keep = set(ids)
    covered = sum(t in keep for x in counted for t in x)
    _say(f"qspec: wrote {a.out}: {len(ids)} ids, {covered / n_tokens:.1%} of the corpus's {n_tokens} tokens")
    return 0


# ---- parser ----------------------------------------------------------------------------------------------------------
def _on_off(p: argparse.ArgumentParser, flag: str, dest: str, help: str) -> None:
    p.add_argument(flag, dest=dest, action="store_false", help=help)


def _switch(p: argparse.ArgumentParser, flag: str, default: bool | None, on: str, off: str) -> None:
    """--FLAG and --no-FLAG, mutually exclusive: True or False, `default` when neither is given."""
    g = p.add_mutually_exclusive_group()
    dest = flag.replace("-", "_")
    g.add_argument(f"--{flag}", dest=dest, action="store_const", const=True, default=default, help=on)
    g.add_argument(f"--no-{flag}", dest=dest, action="store_const", const=False, help=off)


def _add_engine_args(r: argparse.ArgumentParser) -> None:
    """The model and engine options `run` and `serve` share."""
    r.add_argument("--model", help="GGUF file, HF checkpoint dir, or `demo` (the small trained model shipped with "
                                    "qspec; default: the embedded random-weight model)")
    r.add_argument("--draft", type=int, default=0, metavar="N", help="MTP draft depth 0..8 (0: plain decoding)")
    r.add_argument("--ctx", type=int, default=4096, help="context capacity in tokens (a multiple of 4)")
    r.add_argument("--kv-type", choices=("f32", "f16", "bf16", "q8_0"), default="f32")
    r.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    r.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: f32 on cpu, bf16 on cuda)")
    r.add_argument("--quantize", choices=("q4_k", "q8_0", "q4_0"),
                   help="quantize an HF checkpoint's matrices at load (a GGUF keeps its file's types)")
    r.add_argument("--exact", action="store_true",
                   help="row-exact products: verify rows equal decode rows bit for bit (slow; for tests)")
    r.add_argument("--draft-vocab", metavar="N|FILE",
                   help="let the draft propose only these token ids, so its head reads only their rows: N, the "
                        "first N ids (BPE order, a rough frequency rank) and the stop tokens, or FILE from `qspec "
                        "draft-vocab`; the output is unchanged, the acceptance may drop")
    r.add_argument("--draft-head", choices=("full", "q4"), default="full",
                   help="LM head the drafts use (q4: Q4_0-rounded copy; the target always verifies with its own)")
    _on_off(r, "--no-preserve-pooled", "preserve_pooled", "rebuild pooled indexer keys after every rollback")
    _on_off(r, "--no-incremental", "incremental", "recompute every complete pooled block each step")
    r.add_argument("--no-pad", action="store_true", help="do not pad pooled-key updates to a fixed row count")
    r.add_argument("--pad-target", type=int, choices=(8, 16), default=8, help="rows pooled-key updates pad to")
    _on_off(r, "--no-fused-snapshots", "fused_snapshots", "write conv snapshots with separate copies")
    _on_off(r, "--no-cuda-graphs", "cuda_graphs", "run the CUDA decode/verify/draft steps eagerly")
    r.add_argument("--sparse-attention", action="store_true",
                   help="QSA reads only the indexer's chosen blocks and the tail (a Triton kernel on CUDA) instead of "
                        "masking every cell of a KV bucket")
    _switch(r, "fused-attention", None, "masked attention (QSA's dense path, the MTP head) in one pass over the KV "
            "cache, q8_0 dequantized in registers (default on CUDA; on the CPU this runs its torch reference)",
            "masked attention through a dequantized copy of the cache, batched products and a softmax")
    _on_off(r, "--no-kv-write-kernel", "kv_write_kernel", "write a q8_0 KV cache with the compiled quantization and "
            "four index copies instead of one Triton launch per layer and step (CUDA)")
    _on_off(r, "--no-gdn-conv-kernel", "gdn_conv_kernel", "run GDN steps' causal conv, silu and q/k norms compiled "
            "instead of in one Triton launch per layer (CUDA)")
    _switch(r, "draft-before-readback", True, "greedy speculation: queue each round's next draft chain before the "
            "host reads the round (its first position computed on the device), so the GPU does not wait for the "
            "read-back (the default)", "queue each round's draft chain after the host has read the round")
    _switch(r, "pdl", True, "launch the Triton and compiled kernels with programmatic dependent launch where the GPU "
            "has it (Hopper and later: each kernel is scheduled while the one before it runs; the default)",
            "launch every kernel only after the one before it has finished")
    _switch(r, "grouped-mm", True, "prefill's routed experts as three grouped GEMMs per layer (torch._grouped_mm, "
            "bf16) on GPUs with torch's CUTLASS kernels, Hopper and Blackwell (the default)",
            "prefill's routed experts in a loop over the experts")
    _on_off(r, "--no-compile", "compile", "do not fuse the CUDA steps' small ops with torch.compile "
            "(skips its warmup on the first steps)")
    r.add_argument("--draft-model", metavar="GGUF",
                   help="a draft-only GGUF holding the MTP block (llama.cpp's -md layout; it borrows the target's "
                        "token_embd/output)")
    r.add_argument("--hnorm-per-stream", action="store_true",
                   help="MTP hnorm per hyper-connection stream (llama.cpp) instead of over the bundle")
    r.add_argument("--accept-profile", metavar="SPEC",
                   help="force each round's accepted count (testing and benchmarking random-weight models): "
                        "fixed=K, p=0.85 (per position, conditional), or trace=FILE; the output then differs "
                        "from plain decoding")


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(prog="qspec", description="MTP speculative decoding for Qwen3.8-Flash-Next (qwen4exp).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    r = sub.add_parser("run", help="generate text from a prompt, streaming it to stdout")
    r.add_argument("prompt")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0, help="sampling seed")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (one user turn)")
    _add_engine_args(r)
    r.add_argument("--stats", action="store_true", help="print pooled-key, snapshot and per-round counters")
    r.add_argument("--json", metavar="FILE", help="write the generation (tokens, timings, counters) as JSON")
    r.set_defaults(func=cmd_run)

    sv = sub.add_parser("serve", help="serve an OpenAI-style completions API over HTTP (needs qspec[server])")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-name", metavar="NAME", help="the model name the API reports (default: the file's stem)")
    _on_off(sv, "--no-warmup", "warmup", "skip the short generation at startup that compiles the steps and "
            "captures their graphs before the first request")
    _add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    m = sub.add_parser("make-model", help="write a random-weight model (seed-deterministic)",
                       description="--format both writes OUT.gguf and the HF dir OUT-hf/.")
    m.add_argument("out", metavar="OUT")
    m.add_argument("--preset", choices=("tiny", "flash-next"), default="tiny")
    m.add_argument("--layers", type=int)
    m.add_argument("--experts", type=int)
    m.add_argument("--ngram-vocab-base", type=int)
    m.add_argument("--vocab-size", type=int, help="default 248320 (the Qwen vocabulary and tokenizer)")
    m.add_argument("--no-mtp", action="store_true", help="leave out the MTP draft head")
    m.add_argument("--format", choices=("gguf", "hf", "both"), default="gguf")
    m.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    m.add_argument("--qtype", choices=tuple(QTYPES), help="quantize GGUF matrices")
    m.add_argument("--quant", choices=("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"),
                   help="quantize GGUF matrices in llama.cpp's per-tensor type mix of this file type")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_model)

    lg = sub.add_parser("logits", help="full-vocabulary logits of every position (one prefill forward) to .npy")
    lg.add_argument("model", metavar="MODEL")
    src = lg.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="comma-separated token ids")
    src.add_argument("--text", help="text, tokenized with the model's tokenizer")
    lg.add_argument("--out", required=True, metavar="FILE.npy")
    lg.add_argument("--exact", action="store_true", help="row-exact products")
    lg.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    lg.add_argument("--dtype", choices=tuple(DTYPES))
    lg.set_defaults(func=cmd_logits)

    dv = sub.add_parser("draft-vocab", help="count the tokens of text files and write the most frequent ids as a "
                        "draft vocabulary (for run/serve --draft-vocab FILE)")
    dv.add_argument("corpus", nargs="+", metavar="TEXT", help="text files like the requests to expect")
    dv.add_argument("--size", type=int, required=True, help="how many ids (32768: EAGLE-3's and FR-Spec's choice)")
    dv.add_argument("--out", "-o", required=True, metavar="FILE")
    dv.add_argument("--model", help="whose tokenizer counts (default: the embedded model's)")
    dv.set_defaults(func=cmd_draft_vocab)

    # `qspec bench` belongs to qspec.bench.cli: add_parser(subparsers) registers it and sets `func`.
    if with_bench and importlib.util.find_spec("qspec.bench.cli") is not None:
        bench = importlib.import_module("qspec.bench.cli")
        if hasattr(bench, "add_parser"):
            bench.add_parser(sub)
    return parser


def _wants_bench(argv: list[str]) -> bool:
    """Only `qspec bench ...` and top-level help import the bench module (it may pull in matplotlib)."""
    first = next((x for x in argv if not x.startswith("-")), None)
    return first == "bench" or first is None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        # Loader warnings (fallback tokenizer, ignored tensors) become one plain line each.
        warnings.showwarning = lambda msg, *_a, **_k: _say(f"qspec: warning: {msg}")
        try:
            args = build_parser(with_bench=_wants_bench(argv)).parse_args(argv)
            return int(args.func(args) or 0)
        # Other exceptions (a ValueError from deep inside included) are bugs: the commands check their inputs
        # first, so those keep their traceback.
        except (UsageError, WeightsError, ConfigError, ContextError, OSError) as e:
            _say(f"qspec: error: {e}")
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        except KeyboardInterrupt:
            _say("qspec: interrupted")
            return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
