"""The `qspec` command: `run` (generate, streaming), `batch` (a file of prompts, decoded together), `serve` (an HTTP
completions API), `make-model` (random-weight models), `logits` (one prefill forward, full-vocabulary logits),
`perplexity` (over a text file), `chat` (a conversation on the terminal), `draft-vocab` (the token ids the draft head
may propose, counted over text), and `bench` when `qspec.bench.cli` provides it.

Every user error (missing or bad model file, prompt too long, bad numbers) prints one line
`qspec: error: ...` on stderr and returns 2; only bugs show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import torch
from gguf import GGMLQuantizationType

from qspec.batch import BATCH_DRAFT, Batcher
from qspec.cache import keep_compiled_graphs
from qspec.chat_template import ChatTemplateError
from qspec.compile_ahead import load_compiling_ahead
from qspec.compile_clock import CompileClock, CompileTimes
from qspec.config import ConfigError, ModelConfig, preset
from qspec.engine import Engine, EngineHooks, EngineOptions, Generation, cells_needed, context_error
from qspec.loader import (
    QWEN_VOCAB,
    default_dtype,
    default_model_file,
    default_model_path,
    demo_model_path,
    load_model,
    load_tokenizer,
    model_path,
    tokenizer_for_vocab,
    write_model,
)
from qspec.model.model import CacheOptions, Model
from qspec.options import (
    RUN_COMPILE_MIN_TOKENS,
    OptionError,
    SamplingOptions,
    ServerOptions,
    ThinkingOptions,
    add_arguments,
    flag_name,
    from_args,
    prompt_text_error,
)
from qspec.perplexity import perplexity
from qspec.runner import ContextError, KernelSwitches, Runner
from qspec.spec.accept import Sampler
from qspec.spec.draft_vocab import first_ids, frequent_ids, read_ids, write_ids
from qspec.spec.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    ThinkingBudget,
    check_grammar,
    thinking_budget,
    with_thinking,
)
from qspec.spec.logit_rules import LogitRules
from qspec.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer
from qspec.weights import WeightsError
from qspec.weights.host_experts import HOST_EXPERTS_HELP
from qspec.weights.quant_mix import MIXES, QUANTIZE_NAMES

if TYPE_CHECKING:  # the server's modules need fastapi, imported by `qspec serve` only
    from qspec.server.completions import CompletionServer

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


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


def _model_path(arg: str | None, default: str = "demo") -> Path:
    """The --model argument as a path; without one, the trained demo model (`run`, `serve`) or the embedded
    random-weight model with the whole Qwen vocabulary (`draft-vocab`, which counts Qwen token ids)."""
    if arg is not None:
        try:
            return model_path(arg)
        except FileNotFoundError as e:
            raise UsageError(f"--model {arg}: {e}") from e
    if default == "demo":
        _say("qspec: using the trained demo model (4 layers, trained on Python source, shipped with qspec); "
             "pass --model path.gguf for real weights")
        return demo_model_path()
    first = "" if default_model_file().is_file() else ", generating it once"
    _say(f"qspec: using the embedded default model (random weights, the Qwen vocabulary and tokenizer){first}")
    return default_model_path()


# ---- qspec run ---------------------------------------------------------------------------------------------------
def _checked(make):  # noqa: ANN001, ANN202
    """make() -> an options object; a bad value becomes one line naming its flag."""
    try:
        return make()
    except OptionError as e:
        raise UsageError(e.render(flag_name)) from None


def _engine_options(a: argparse.Namespace, **overrides: Any) -> EngineOptions:
    """The engine options of the command line (checked before any model is loaded); `--draft-vocab` stays the raw
    N|FILE until the tokenizer turns it into ids (overrides)."""
    return _checked(lambda: from_args(EngineOptions, a, **overrides))


def _draft_vocab(spec: str, vocab: int, tok: Tokenizer) -> list[int]:
    """--draft-vocab N: the first N ids and the stop tokens; --draft-vocab FILE: the ids of a `qspec draft-vocab`
    file (one per line)."""
    try:
        if spec.isdigit():
            return first_ids(int(spec), vocab, keep=[t for t in tok.stop_ids if t < vocab])
        return read_ids(spec, vocab)
    except (ValueError, OSError) as e:
        raise UsageError(f"--draft-vocab {spec}: {e}") from None


def _sampling_options(a: argparse.Namespace) -> SamplingOptions:
    return _checked(lambda: from_args(SamplingOptions, a))


def _thinking_options(a: argparse.Namespace) -> ThinkingOptions:
    return _checked(lambda: from_args(ThinkingOptions, a))


def _budget(think: ThinkingOptions, tok: Tokenizer) -> ThinkingBudget | None:
    """--reasoning-budget for this tokenizer (None: no limit); a usage error where it has no think tags."""
    try:
        if think.reasoning_budget is None:
            return None
        return thinking_budget(tok, think.reasoning_budget, think.reasoning_budget_message)
    except ValueError as e:
        raise UsageError(f"--reasoning-budget: {e}") from None


def _held_to_budget(sampler: Sampler, budget: ThinkingBudget | None, tok: Tokenizer, ids: list[int],
                    vocab_size: int) -> Sampler:
    """The sampler for the prompt `ids`: a reply's think block held to `budget`, its grammar (if any) then holding
    the answer after the block (spec/grammar.py: with_thinking); `sampler` as it is without a budget."""
    if budget is None:
        return sampler
    return replace(sampler, grammar=with_thinking(sampler.grammar, tok, ids, vocab_size, budget))


def _sampler(samp: SamplingOptions, spec: GrammarSpec | None, tok: Tokenizer, vocab_size: int,
             compiler: GrammarCompiler | None = None) -> Sampler:
    """The request's sampler; `spec`: its grammar as _grammar_spec read it, compiled here for the tokenizer (by
    `compiler` when given: its token table is built once for many requests)."""
    rules = LogitRules(presence_penalty=samp.presence_penalty, frequency_penalty=samp.frequency_penalty,
                       repetition_penalty=samp.repetition_penalty)
    try:
        grammar = None if spec is None else (compiler or GrammarCompiler(tok, vocab_size)).compile(spec)
    except GrammarError as e:
        raise UsageError(f"{_grammar_flag(samp)}: {e}") from None
    return Sampler(temperature=samp.temperature, top_p=samp.top_p, top_k=samp.top_k, min_p=samp.min_p,
                   generator=torch.Generator().manual_seed(samp.seed), rules=rules, grammar=grammar)


def _grammar_flag(samp: SamplingOptions) -> str:
    return flag_name(samp.grammar_options()[0])


def _grammar_spec(samp: SamplingOptions) -> GrammarSpec | None:
    """What --json-schema (a file, or JSON text when it starts with "{"), --regex or --grammar (a file) ask for;
    checked before the model loads."""
    spec = _read_grammar(samp)
    if spec is not None:
        try:
            check_grammar(spec)
        except GrammarError as e:
            raise UsageError(f"{_grammar_flag(samp)}: {e}") from None
    return spec


def _read_grammar(samp: SamplingOptions) -> GrammarSpec | None:
    if samp.regex is not None:
        return GrammarSpec("regex", samp.regex)
    if samp.json_schema is None and samp.grammar is None:
        return None
    text: str = samp.json_schema if samp.json_schema is not None else samp.grammar  # type: ignore[assignment]
    try:
        if samp.grammar is not None or not text.lstrip().startswith("{"):  # a file, not a schema's text
            text = Path(text).read_text(encoding="utf-8")
        if samp.grammar is not None:
            return GrammarSpec("lark", text)
        return GrammarSpec("json", json.loads(text))  # type: ignore[arg-type]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{_grammar_flag(samp)}: cannot read {text!r}: {e}") from None
    except ValueError as e:  # json's errors and GrammarSpec's
        raise UsageError(f"{_grammar_flag(samp)}: not a JSON schema ({e})") from None


def _prompt_ids(tok: Tokenizer, text: str, vocab_size: int, chat: bool) -> list[int]:
    bad_text = prompt_text_error(text)
    if bad_text is not None:
        raise UsageError(f"the prompt {bad_text}")
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


def _fitting_ids(tok: Tokenizer, text: str, vocab_size: int, chat: bool, max_tokens: int, opts: EngineOptions,
                 which: str = "") -> list[int]:
    """A prompt's ids (_prompt_ids), or UsageError (prefixed with `which`) when it and max_tokens do not fit the
    context."""
    ids = _prompt_ids(tok, text, vocab_size, chat)
    if cells_needed(len(ids), max_tokens, opts.draft) > opts.capacity:
        raise UsageError(which + context_error(len(ids), max_tokens, opts.draft, opts.capacity, names=_REQUEST_NAMES))
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
        "snapshots": g.snapshots, "rounds_log": g.rounds_log, "options": options, "depth": g.depth,
        "cached_tokens": g.cached_tokens,
    })


def steady_tps(stamps: list[float]) -> float | None:
    """Tokens per second over the second half of a request's tokens (their arrival times), or None for too few."""
    half = len(stamps) // 2
    if len(stamps) < 8 or stamps[-1] <= stamps[half]:
        return None
    return (len(stamps) - 1 - half) / (stamps[-1] - stamps[half])


def _print_summary(g: Generation, draft: int, stamps: list[float] | None = None) -> None:
    _say(f"prompt: {g.prompt_tokens} tokens, prefill {g.prefill_s:.3f} s ({g.prefill_tps:.1f} tok/s)")
    _say(f"generated: {len(g.tokens)} tokens, decode {g.decode_s:.3f} s ({g.decode_tps:.1f} tok/s), "
         f"stop: {g.stop_reason}")
    first_use = int(g.graphs.get("eager_steps", 0) or 0)
    steady = steady_tps(stamps or [])
    if first_use and steady is not None:
        # a step shape's first uses run eagerly, compile and capture its CUDA graph: the request's average includes
        # them, a later request with the same shapes does not
        _say(f"decode steady: {steady:.1f} tok/s over the second half of the tokens ({first_use} steps in this "
             f"request were first uses of their shapes: compiled and captured as CUDA graphs, which later requests "
             f"replay)")
    if draft:
        s = g.spec
        rate = s.accepted / s.drafted if s.drafted else 0.0
        _say(f"speculative (draft {draft}): {s.rounds} rounds, {s.drafted} drafted, {s.accepted} accepted "
             f"({rate:.1%}), mean accepted length {s.mean_accepted:.2f}, {s.tokens_per_round:.2f} tokens/round")
        _say("acceptance by position: " + " ".join(f"{i + 1}:{p:.2f}" for i, p in
                                                   enumerate(s.acceptance_by_position())))


def _print_first_token(t0: float, stamps: list[float], compiled: CompileTimes) -> None:
    """When the first token came, and how much of the request was compiling (a fresh process's first request)."""
    if not stamps:
        return
    line = f"first token {stamps[0] - t0:.2f} s after the request began"
    if compiled.total_s >= 0.05:
        line += f"; {compiled.total_s:.1f} s of the request compiled ({compiled.describe()}; cached for later runs)"
    _say(line)


# what the --stats counters mean (the pooled-key counters are per pooling ratio r: one key per r tokens)
_POOLED_HELP = ("updates: steps that rebuilt pooled keys; rows_real: keys materialized because their block is new "
                "or changed; rows_filler: padding rows that keep every update one shape (--pad-target); "
                "retained_blocks: blocks kept across rollbacks (--preserve-pooled); invalidations: blocks a rollback "
                "made stale")
_SNAP_HELP = ("fused_groups / ordinary_groups: conv rollback snapshots written by the fused kernel / by separate "
              "copies (--fused-snapshots); dispatches: their launches; source_reads: elements read to write them")


def _print_stats(g: Generation, draft: int) -> None:
    _say(f"pooled keys rN: the pooled indexer keys of pooling ratio N (one key per N tokens); {_POOLED_HELP}")
    _say(f"conv snapshots: {_SNAP_HELP}")
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
    if g.depth:  # --draft auto: the chosen depths (0: tokens decoded plainly) and why
        _say(f"draft depth chosen: {g.depth['depth_histogram']}, reasons {g.depth['reasons']}, "
             f"{g.depth['plain_tokens']} tokens decoded plainly")


def _accept_hook(spec: str | None, draft: int):  # noqa: ANN202
    """The hook of --accept-profile, refused where it could not act as written: without drafting (no rounds) or
    with a fixed count above the draft depth (it would be clamped)."""
    if not spec:
        return None
    from qspec.bench.accept import AcceptProfile

    try:
        profile = AcceptProfile.parse(spec)
    except (ValueError, OSError) as e:
        raise UsageError(f"--accept-profile: {e}") from None
    if not draft:
        raise UsageError("--accept-profile forces the accepted count of speculative rounds: it needs --draft N "
                         "(N >= 1)")
    if profile.kind == "fixed" and profile.k > draft:
        raise UsageError(f"--accept-profile fixed={profile.k} accepts more drafts than --draft {draft} makes")
    if profile.kind == "trace" and profile.trace and max(profile.trace) > draft:
        _say(f"qspec: warning: --accept-profile: the trace has counts up to {max(profile.trace)}, above --draft "
             f"{draft}; those rounds accept {draft}")
    return profile.hook()


def _mtp_label(model: Any, draft: int) -> str:
    if model.mtp is not None:
        return "MTP"
    return "MTP head not loaded (--draft 0)" if model.cfg.has_mtp and not draft else "no MTP"


def _choose_chat_template(tok: Tokenizer, choice: str | None, model: Path, chats: bool) -> None:
    """The chat template `--chat-template` names (`builtin`, a Jinja file) or the model file's own, parsed before the
    weights load when the command chats (`chats`), so that a broken one is one error up front."""
    if choice == "builtin":
        tok.use_chat_template(None)
        return
    if choice is not None:
        try:
            source, where = Path(choice).read_text(encoding="utf-8"), f"--chat-template {choice}"
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {choice}: cannot read it ({e})") from None
    elif chats:
        source, where = tok.chat_template, f"{model.name}'s chat template"
    else:
        return
    try:
        tok.use_chat_template(source)
    except ChatTemplateError as e:
        raise UsageError(f"{where}: {e} (--chat-template builtin uses qspec's own Qwen format)") from None
    if tok.chat_template != QWEN_CHAT_TEMPLATE:
        _say(f"qspec: chat turns go through {where} (Jinja)")


def _load(a: argparse.Namespace, opts: EngineOptions, prompt: Callable[[Tokenizer, ModelConfig], list[int]]
          ) -> tuple[Path, Tokenizer, Engine]:
    """The model, its tokenizer and an engine from the options `run` and `serve` share (`opts`: checked already).
    `prompt`: the first request's prompt, which a stand-in may compile for while the weights load."""
    hook = _accept_hook(a.accept_profile, opts.draft)
    dev = _device(a.device)
    path = _model_path(a.model)
    t0 = time.perf_counter()
    tok = load_tokenizer(path)
    _choose_chat_template(tok, a.chat_template, path, chats=getattr(a, "chat", True))
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dtype = DTYPES[a.dtype] if a.dtype else default_dtype(dev)

    def load() -> Model:
        return load_model(path, device=dev, dtype=dtype, with_mtp=None if opts.draft else False,
                          hnorm_per_stream=a.hnorm_per_stream, draft_path=a.draft_model if opts.draft else None,
                          quantize=a.quantize, host_experts=a.host_experts)
    if (dev.type == "cuda" and opts.compile and opts.compile_ahead and path.is_file()
            and not (opts.draft and a.draft_model)):
        # the stand-in drafts from the full head: a draft vocabulary's head compiles in the first request
        model = load_compiling_ahead(path, load, replace(opts, draft_vocab=None), partial(prompt, tok), device=dev,
                                     dtype=dtype, with_mtp=bool(opts.draft), hnorm_per_stream=a.hnorm_per_stream,
                                     say=_say)
    else:
        model = load()
    load_s = time.perf_counter() - t0
    if opts.draft and model.mtp is None:
        raise UsageError(f"--draft {opts.draft} needs MTP weights and {path} has none (use --draft 0, "
                         "or a model with blk.N.nextn.* / mtp.* tensors)")
    if opts.draft_vocab is not None:
        opts = replace(opts, draft_vocab=_draft_vocab(str(opts.draft_vocab), model.cfg.vocab_size, tok))
    # q4 draft head: packed Q4_0 head + 4-bit kernel on CUDA, its dequantized copy on the CPU
    engine = Engine(model, opts, EngineHooks(accept_hook=hook))
    _say(f"qspec: {path.name}: {model.cfg.n_layers} layers, vocab {model.cfg.vocab_size}, "
         f"{_mtp_label(model, opts.draft)}, {dev.type} {str(model.dtype).removeprefix('torch.')}, "
         f"loaded in {load_s:.1f} s (tokenizer {tok_s:.1f} s)")
    _say(f"qspec: weights: {model.weights_summary}")
    if dev.type == "cuda" and opts.compile:
        _say("qspec: the first steps compile the fused step kernels (up to a few minutes at the real geometry; "
             "cached on disk for later runs; --no-compile skips it)")
    return path, tok, engine


_REQUEST_NAMES = {"max_tokens": "--max-tokens", "capacity": "--capacity"}


def cmd_run(a: argparse.Namespace) -> int:
    samp, think = _sampling_options(a), _thinking_options(a)
    spec = _grammar_spec(samp)  # a bad --json-schema or --grammar before the model loads
    # --compile-ahead asks for compilation too
    uncompiled_short = a.compile is None and not a.compile_ahead and samp.max_tokens < RUN_COMPILE_MIN_TOKENS
    if a.compile is None:  # neither --compile nor --no-compile: compile where it pays (options.RUN_COMPILE_MIN_TOKENS)
        a.compile = not uncompiled_short
    opts = _engine_options(a)

    def request_ids(tok: Tokenizer, cfg: ModelConfig) -> list[int]:
        return _fitting_ids(tok, a.prompt, cfg.vocab_size, a.chat, samp.max_tokens, opts)

    path, tok, engine = _load(a, opts, request_ids)
    model = engine.model
    if uncompiled_short and model.device.type == "cuda":
        _say(f"qspec: the steps' small ops run uncompiled: a run of under {RUN_COMPILE_MIN_TOKENS} tokens ends "
             "sooner without the compilation (--compile compiles them: faster steady decoding after it)")
    budget = _budget(think, tok)
    ids = request_ids(tok, model.cfg)
    sampler = _held_to_budget(_sampler(samp, spec, tok, model.cfg.vocab_size), budget, tok, ids, model.cfg.vocab_size)

    out = sys.stdout
    stream = tok.stream(skip_special=True)  # stop tokens and other control tokens are not text
    stamps: list[float] = []

    def on_token(t: int) -> None:
        stamps.append(time.perf_counter())
        _write_text(out, stream.push(t))

    t0 = time.perf_counter()
    with CompileClock() as clock:
        g = engine.generate(ids, samp.max_tokens, sampler=sampler, stop_ids=set(tok.stop_ids), on_token=on_token)
    _write_text(out, stream.flush() + "\n")

    _print_summary(g, opts.draft, stamps)
    _print_first_token(t0, stamps, clock.times())
    if a.stats:
        _print_stats(g, opts.draft)
    if a.json:
        resolved = {k: v for k, v in vars(opts).items() if isinstance(v, (bool, int, float, str, type(None)))}
        options = {k: v for k, v in vars(a).items() if k != "func"} | resolved | {"model": str(path),
                                                                               "device": model.device.type}
        doc = generation_json(g, tok.decode(g.tokens, skip_special=True), options)
        doc["first_token_s"] = stamps[0] - t0 if stamps else None
        doc["compile"] = clock.times().as_dict()
        Path(a.json).write_text(json.dumps(doc, indent=2, ensure_ascii=False), encoding="utf-8")
    return 0


# ---- qspec chat ------------------------------------------------------------------------------------------------------
def cmd_chat(a: argparse.Namespace) -> int:
    """A conversation on the terminal: each line read from stdin is a user turn, the reply streams to stdout. Every
    turn renders the whole conversation through the chat template, and the engine prefills only what its caches do
    not hold (EngineOptions.prefix_cache): the new turn, and the last reply where it tokenizes differently."""
    samp, think = _sampling_options(a), _thinking_options(a)
    spec = _grammar_spec(samp)  # a bad --json-schema or --grammar before the model loads
    opts = _engine_options(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []

    def first_ids(tok: Tokenizer, cfg: ModelConfig) -> list[int]:  # what a stand-in compiles for while loading
        return tok.encode(tok.apply_chat_template(messages + [{"role": "user", "content": "Hello"}]), add_special=True)

    _, tok, engine = _load(a, opts, first_ids)
    budget = _budget(think, tok)
    vocab = engine.model.cfg.vocab_size
    sampler = _sampler(samp, spec, tok, vocab)
    tty = sys.stdin.isatty()
    while True:
        if tty:
            _say("> ", file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        bad = prompt_text_error(text)
        if bad is not None or not text.strip():
            if bad is not None:
                _say(f"qspec: the message {bad}; not sent")
            continue
        ids = tok.encode(tok.apply_chat_template(messages + [{"role": "user", "content": text}]), add_special=True)
        need = cells_needed(len(ids), samp.max_tokens, opts.draft)
        if need > opts.capacity:
            raise UsageError("the conversation no longer fits the context: "
                             + context_error(len(ids), samp.max_tokens, opts.draft, opts.capacity,
                                             names=_REQUEST_NAMES))
        reply = _chat_turn(engine, tok, ids, samp.max_tokens, _held_to_budget(sampler, budget, tok, ids, vocab))
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def _chat_turn(engine: Engine, tok: Tokenizer, ids: list[int], max_tokens: int, sampler: Sampler) -> str:
    """One reply, streamed to stdout, its counts to stderr -> its text."""
    stream = tok.stream(skip_special=True)
    g = engine.generate(ids, max_tokens, sampler=sampler, stop_ids=set(tok.stop_ids),
                        on_token=lambda t: _write_text(sys.stdout, stream.push(t)))
    _write_text(sys.stdout, stream.flush() + "\n")
    _say(f"[{g.prompt_tokens} prompt tokens, {g.cached_tokens} of them reused; prefill {g.prefill_s:.2f} s; "
         f"{len(g.tokens)} tokens at {g.decode_tps:.1f} tok/s; stop: {g.stop_reason}]")
    return tok.decode(g.tokens, skip_special=True)


# ---- qspec batch -----------------------------------------------------------------------------------------------------
def _read_prompts(path: str) -> list[str]:
    """The prompts of a file: one a line, or JSON lines each with a "prompt" string (blank lines skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the prompts in {path}: {e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompt = json.loads(line).get("prompt")
            except (ValueError, AttributeError) as e:
                raise UsageError(f"{path}:{n}: not a JSON object ({e})") from None
            if not isinstance(prompt, str):
                raise UsageError(f'{path}:{n}: a JSON line needs a "prompt" string')
            line = prompt
        bad = prompt_text_error(line)
        if bad is not None:
            raise UsageError(f"{path}:{n}: the prompt {bad}")
        prompts.append(line)
    if not prompts:
        raise UsageError(f"{path} has no prompt")
    return prompts


def cmd_batch(a: argparse.Namespace) -> int:
    """Every prompt of a file, up to --max-batch decoded together (qspec/batch.py); a JSON line per prompt, in the
    file's order. Sampled prompts take the seed --seed + their index."""
    samp, think = _sampling_options(a), _thinking_options(a)
    spec = _grammar_spec(samp)
    _check_max_batch(a.max_batch)
    texts = _read_prompts(a.prompts)
    opts = _engine_options(a)
    path, tok, engine = _load(a, opts, lambda t, cfg: _prompt_ids(t, texts[0], cfg.vocab_size, a.chat))
    budget = _budget(think, tok)
    vocab = engine.model.cfg.vocab_size
    prompts = [_fitting_ids(tok, t, vocab, a.chat, samp.max_tokens, opts, f"prompt {i}: ")
               for i, t in enumerate(texts)]
    compiler = GrammarCompiler(tok, vocab) if spec is not None else None
    batcher = Batcher(engine, min(_batch_slots(a, engine), len(prompts)), draft=a.batch_draft)
    _say(f"qspec: batch: {batcher.describe()}")

    def sampler(i: int, ids: list[int]) -> Sampler:  # prompt i's: its seed, and its own think block's budget
        own = _sampler(replace(samp, seed=(samp.seed + i) % 2**64), spec, tok, vocab, compiler)
        return _held_to_budget(own, budget, tok, ids, vocab)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=2 * batcher.slots) as pool:  # enough callers to keep the slots full
            futures = [pool.submit(batcher.generate, ids, samp.max_tokens, stop_ids=set(tok.stop_ids),
                                   sampler=sampler(i, ids)) for i, ids in enumerate(prompts)]
            out = open(a.out, "w", encoding="utf-8") if a.out else sys.stdout  # noqa: SIM115 - stdout or a file
            try:
                generated = sum(_write_generation(out, i, f.result(), tok) for i, f in enumerate(futures))
            finally:
                if a.out:
                    out.close()
    finally:
        batcher.close()
    wall = time.perf_counter() - t0
    _say(f"qspec: {len(prompts)} prompts, {generated} tokens generated in {wall:.2f} s ({generated / wall:.2f} tok/s, "
         f"up to {batcher.slots} at once)")
    return 0


def _write_generation(out: TextIO, index: int, g: Generation, tok: Tokenizer) -> int:
    """One prompt's JSON line -> its generated tokens."""
    doc = {"index": index, "text": tok.decode(g.tokens, skip_special=True), "tokens": g.tokens,
           "prompt_tokens": g.prompt_tokens, "generated_tokens": len(g.tokens), "stop_reason": g.stop_reason}
    out.write(json.dumps(doc, ensure_ascii=False) + "\n")
    out.flush()
    return len(g.tokens)


def _check_max_batch(n: int | str) -> None:
    if n != "auto" and int(n) < 1:
        raise UsageError(f"--max-batch must be >= 1 or auto, got {n}")


def _batch_slots(a: argparse.Namespace, engine: Engine) -> int:
    """--max-batch's slots: the count given, or with auto as many as fit (Batcher.slots_that_fit), said."""
    if a.max_batch != "auto":
        return int(a.max_batch)
    n = Batcher.slots_that_fit(engine, AUTO_MAX_BATCH, a.batch_draft)
    if n < 2:
        _say(f"qspec: batch: --max-batch auto: room for {n} slot(s) at --ctx {engine.opts.capacity:,} beside the "
             "engine's caches: one request at a time (a smaller --ctx leaves room for more)")
    return max(n, 1)


def _warmup_ids(tok: Tokenizer, cfg: ModelConfig) -> list[int]:
    """The server's warm-up prompt."""
    return tok.encode("Hello", add_special=True) or [0]


# ---- qspec serve -----------------------------------------------------------------------------------------------------
def _warm_up(engine: Engine, batcher: Batcher | None, ids: list[int], n: int,
             on_part: Callable[[str], None] = lambda part: None) -> None:
    """The server's warm-up: the first steps compile (CUDA) and capture graphs, paid before the first client waits
    for them: one request alone, then every batch size's steps; `on_part` told as each part starts, a line as each
    ends (on a fresh GPU machine this takes minutes: BENCHMARKS.md §9)."""
    t0 = time.perf_counter()
    with CompileClock() as clock:
        parts: list[tuple[str, Callable[[], object]]] = [("a request alone", lambda: engine.generate(ids, n))]
        if batcher is not None:
            parts += [(f"a batch of {b}", lambda b=b: batcher.generate_all([ids] * b, n))
                      for b in range(1, batcher.slots + 1)]
        for name, run in parts:  # each part's line says what it compiled: where a fresh machine's minutes go
            on_part(name)
            t, before = time.perf_counter(), clock.times().snapshot()
            run()
            _say(f"qspec: warm-up: {name} {time.perf_counter() - t:.1f} s "
                 f"({clock.times().since(before).describe(slowest=2)})")
    _say(f"qspec: warmed up in {time.perf_counter() - t0:.1f} s ({clock.times().describe(slowest=4)})")


def _warm_up_beside(srv: CompletionServer, batcher: Batcher | None, ids: list[int], n: int,
                    failed: list[BaseException]) -> Callable[[Callable[[], None]], None]:
    """The warm-up as the server runs it while it listens (`serve(beside=...)`): requests get a 503 naming the part
    until it ends; where it fails, the error is kept in `failed` and the server stops (cmd_serve raises it)."""
    def warm(stop: Callable[[], None]) -> None:
        def on_part(part: str) -> None:
            srv.warming = part

        try:
            _warm_up(srv.engine, batcher, ids, n, on_part)
        except BaseException as e:  # noqa: BLE001 (raised again by cmd_serve once the server has stopped)
            failed.append(e)
            stop()
            return
        srv.warming = None
        _say("qspec: ready")
    return warm


def cmd_serve(a: argparse.Namespace) -> int:
    opts = _engine_options(a)
    server = _checked(lambda: from_args(ServerOptions, a, api_key=a.api_key or os.environ.get("QSPEC_API_KEY")))
    _check_max_batch(a.max_batch)
    try:
        from qspec.server.app import create_app, listen_socket, serve
    except ImportError as e:
        raise UsageError(f"qspec serve needs fastapi and uvicorn ({e.name} is missing): "
                         "pip install 'qspec[server]'") from None
    sock = listen_socket(server.host, server.port)  # a busy port or unknown host fails before the model loads
    path, tok, engine = _load(a, opts, _warmup_ids)
    _budget(server, tok)  # a budget this tokenizer cannot hold: before the warm-up
    ids = _warmup_ids(tok, engine.model.cfg)
    slots = _batch_slots(a, engine)
    batcher = Batcher(engine, slots, draft=a.batch_draft) if slots > 1 else None
    if batcher is not None:
        _say(f"qspec: batch: {batcher.describe()}")
    n = min(8, opts.capacity - cells_needed(len(ids), 0, opts.draft))
    name = server.served_name or path.stem
    app = create_app(engine, tok, name, server, batcher=batcher)
    srv: CompletionServer = app.state.server
    told = "--tool-call-parser" if server.tool_call_parser else "the chat template"
    _say(f"qspec: tool calls read as {srv.tool_call_parser} ({told})")
    failed: list[BaseException] = []
    warm = None
    if server.warmup and n >= 1:
        srv.warming = "starting"
        warm = _warm_up_beside(srv, batcher, ids, n, failed)
    _say(f"qspec: serving {name!r} at http://{server.host}:{server.port} (POST /v1/completions, "
         "/v1/chat/completions, /v1/responses, /v1/messages, /tokenize, /detokenize; GET /v1/models, /health, "
         "/metrics)" + ("; warming up first: requests get a 503 until GET /health answers 200" if warm else ""))
    serve(app, server.host, server.port, sock=sock, beside=warm)
    if failed:
        raise failed[0]
    return 0


# ---- qspec make-model ------------------------------------------------------------------------------------------------
def _outputs(out: Path, fmt: str) -> list[tuple[str, Path]]:
    if fmt != "both":
        return [(fmt, out)]
    stem = out.with_suffix("") if out.suffix == ".gguf" else out
    return [("gguf", stem.with_name(stem.name + ".gguf")), ("hf", stem.with_name(stem.name + "-hf"))]


def _byte_size(s: str) -> int:
    """A size as bytes: a positive integer, optionally with K, M, G or T (powers of 1024, as llama-gguf-split)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = s.strip().upper().removesuffix("B")
    mult = units.get(t[-1:], 1)
    try:
        n = int(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 50G, 512M, 1000000)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a size must be > 0, got {s!r}")
    return n


def cmd_make_model(a: argparse.Namespace) -> int:
    for flag in ("layers", "experts", "ngram_vocab_base", "vocab_size"):
        v = getattr(a, flag)
        if v is not None and v <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    if (a.qtype or a.quant) and a.format == "hf":
        raise UsageError("--qtype/--quant apply to GGUF output only (--format gguf or both)")
    if a.qtype and a.quant:
        raise UsageError("--qtype and --quant are exclusive")
    if a.split_max_size and a.format == "hf":
        raise UsageError("--split-max-size applies to GGUF output only (HF checkpoints are written in 4 GiB shards)")
    cfg = preset(a.preset, layers=a.layers, experts=a.experts, ngram_vocab_base=a.ngram_vocab_base,
                 vocab_size=a.vocab_size, mtp=not a.no_mtp)
    tok, note = tokenizer_for_vocab(cfg.vocab_size)
    _say(f"qspec: {'tokenizer' if tok is not None and cfg.vocab_size == QWEN_VOCAB else 'warning'}: {note}")
    for fmt, path in _outputs(Path(a.out), a.format):
        if fmt == "hf" and path.exists() and not path.is_dir():
            raise UsageError(f"{path} exists and is not a directory")
        t0 = time.perf_counter()
        files = write_model(path, cfg, fmt=fmt, seed=a.seed, dtype=DTYPES[a.dtype],
                            qtype=QTYPES[a.qtype] if a.qtype and fmt == "gguf" else None, tokenizer=tok,
                            quant=a.quant if fmt == "gguf" else None, split_max_bytes=a.split_max_size or 0)
        where = path if len(files) == 1 else f"{files[0]} .. {files[-1].name} ({len(files)} parts)"
        _say(f"qspec: wrote {where} ({fmt}, {a.preset}, {cfg.n_layers} layers, {cfg.n_experts} experts, "
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


def _load_trunk(a: argparse.Namespace, path: Path, dev: torch.device) -> Model:
    """The model without its MTP block, its weights placed as the command's --dtype and --quantize say."""
    return load_model(path, device=dev, dtype=DTYPES[a.dtype] if a.dtype else None, with_mtp=False,
                      quantize=a.quantize)


def cmd_logits(a: argparse.Namespace) -> int:
    dev = _device(a.device)
    path = Path(a.model)
    if a.ids is not None:
        ids = _parse_ids(a.ids)
    else:
        ids = load_tokenizer(path).encode(a.text, add_special=True)
        if not ids:
            raise UsageError("--text: the text encodes to no tokens")
    model = _load_trunk(a, path, dev)
    V = model.cfg.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise UsageError(f"token ids must be in [0, {V}), got {min(ids)}..{max(ids)}")
    runner = Runner(model, CacheOptions(capacity=-(-len(ids) // 4) * 4))
    with torch.inference_mode(), KernelSwitches(row_exact=a.exact).apply():
        logits, _ = runner.step(torch.tensor(ids, dtype=torch.long))  # logit_rows=None: every position
    import numpy as np  # only this command writes numpy files

    arr = logits.float().cpu().numpy().astype(np.float32, copy=False)
    np.save(a.out, arr)
    _say(f"qspec: wrote {a.out}: logits [{arr.shape[0]}, {arr.shape[1]}] float32")
    return 0


# ---- qspec perplexity ------------------------------------------------------------------------------------------------
def cmd_perplexity(a: argparse.Namespace) -> int:
    dev = _device(a.device)
    path = _model_path(a.model)
    try:
        text = Path(a.file).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--file {a.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    tok = load_tokenizer(path)
    ids = tok.encode(text, add_special=False)
    model = _load_trunk(a, path, dev)
    _say(f"qspec: {path.name}: {model.weights_summary}")
    _say(f"qspec: {len(ids):,} tokens, {len(ids) // a.ctx:,} chunks of {a.ctx} (the second half of each scored)")
    try:
        r = perplexity(model, ids, a.ctx, a.chunks,
                       on_chunk=lambda i, p: _say(f"[{i + 1}] {p:.4f}"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"perplexity {r.ppl:.4f} +/- {r.stderr:.4f} over {r.tokens:,} tokens ({r.chunks} chunks of {a.ctx}), "
          f"{r.tokens / r.seconds:.1f} tokens scored/s", flush=True)
    if a.json:
        doc = {"model": str(path), "file": str(a.file), "ctx": a.ctx, "ppl": r.ppl, "stderr": r.stderr,
               "tokens": r.tokens, "chunks": r.chunks, "seconds": r.seconds, "running": r.running,
               "weights": model.weights_summary, "device": dev.type}
        Path(a.json).write_text(json.dumps(doc, indent=2), encoding="utf-8")
    return 0


# ---- qspec draft-vocab -----------------------------------------------------------------------------------------------
def cmd_draft_vocab(a: argparse.Namespace) -> int:
    if a.size < 1:
        raise UsageError(f"--size must be >= 1, got {a.size}")
    path = _model_path(a.model, default="embedded")
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
_MODEL_HELP = "GGUF file, HF checkpoint dir, or `demo` (default: the small trained model shipped with qspec)"


def _add_weight_args(g: argparse.ArgumentParser | argparse._ArgumentGroup, device: str | None = None) -> None:
    """Where and how a command places the model's weights: --device (default `device`, else cuda when available),
    --dtype, --quantize."""
    g.add_argument("--device", choices=("cpu", "cuda"), default=device,
                   help=f"default: {device or 'cuda when available'}")
    g.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: f32 on cpu, bf16 on cuda)")
    g.add_argument("--quantize", choices=QUANTIZE_NAMES,
                   help="quantize an HF checkpoint's matrices at load in llama.cpp's type mix of that name (a GGUF "
                        "keeps its file's types)")


def _add_engine_args(r: argparse.ArgumentParser) -> None:
    """The model and engine options `run` and `serve` share: the model's own flags here, the engine's from their
    declarations (qspec/options.py)."""
    m = r.add_argument_group("model")
    m.add_argument("--model", help=_MODEL_HELP)
    _add_weight_args(m)
    m.add_argument("--host-experts", type=int, default=0, metavar="N", help=HOST_EXPERTS_HELP)
    m.add_argument("--draft-model", metavar="GGUF",
                   help="a draft-only GGUF holding the MTP block (llama.cpp's -md layout; it borrows the target's "
                        "token_embd/output)")
    m.add_argument("--hnorm-per-stream", action="store_true",
                   help="MTP hnorm per hyper-connection stream (llama.cpp) instead of over the bundle")
    m.add_argument("--chat-template", metavar="FILE",
                   help="chat through this Jinja template, or `builtin` for qspec's own Qwen format (default: the "
                        "template the model's file carries, else qspec's own)")
    m.add_argument("--accept-profile", metavar="SPEC",
                   help="force each round's accepted count (testing and benchmarking random-weight models): "
                        "fixed=K, p=0.85 (per position, conditional), or trace=FILE; needs --draft N; the output "
                        "then differs from plain decoding")
    add_engine_arguments(r)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineOptions and its kernel switches), from their declarations; read them back with
    `qspec.options.from_args(EngineOptions, args)`."""
    add_arguments(parser, EngineOptions)


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(prog="qspec", description="MTP speculative decoding for Qwen3.8-Flash-Next (qwen4exp).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generation_commands(sub)
    _add_model_tools(sub)
    # `qspec bench` belongs to qspec.bench.cli: add_parser(subparsers) registers it and sets `func`.
    if with_bench and importlib.util.find_spec("qspec.bench.cli") is not None:
        bench = importlib.import_module("qspec.bench.cli")
        if hasattr(bench, "add_parser"):
            bench.add_parser(sub)
    return parser


# the most requests `--max-batch auto` decodes together (BENCHMARKS.md §9: what batches of 2-8 gain)
AUTO_MAX_BATCH = 8


def _max_batch_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or auto, got {text!r}") from None


def _add_max_batch(p: argparse.ArgumentParser, default: int | str) -> None:
    p.add_argument("--max-batch", type=_max_batch_arg, default=default, metavar="N",
                   help=f"decode up to N requests together, each weight read once a step for all of them; with "
                   f"--draft, each step is a speculative round of every request; auto: as many as the free memory "
                   f"holds at the context, up to {AUTO_MAX_BATCH} (default {default})")
    p.add_argument("--batch-draft", choices=BATCH_DRAFT, default="auto",
                   help="with --draft N, whether and how deep requests decoded together draft: as deep (0..N) as "
                   "pays at the batch's size, measured as they decode (auto; a batch with a sampled request always "
                   "drafts N deep), always N deep, or never (a request alone drafts in any case; BENCHMARKS.md §9)")


def _add_generation_commands(sub: argparse._SubParsersAction) -> None:
    """run, chat, batch, serve: the engine's flags, and sampling's for run, chat and batch."""
    r = sub.add_parser("run", help="generate text from a prompt, streaming it to stdout")
    r.add_argument("prompt")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (one user turn)")
    r.add_argument("--stats", action="store_true", help="print pooled-key, snapshot and per-round counters")
    r.add_argument("--json", metavar="FILE", help="write the generation (tokens, timings, counters) as JSON")
    add_arguments(r, SamplingOptions)
    add_arguments(r, ThinkingOptions)
    _add_engine_args(r)
    r.set_defaults(func=cmd_run, compile=None)  # None: decided by --max-tokens (cmd_run)

    ch = sub.add_parser("chat", help="a conversation on the terminal: each line of stdin is a user turn (the engine "
                                     "reuses the earlier turns' caches)")
    ch.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    add_arguments(ch, SamplingOptions)
    add_arguments(ch, ThinkingOptions)
    _add_engine_args(ch)
    ch.set_defaults(func=cmd_chat)

    b = sub.add_parser("batch", help="generate for every prompt of a file (one a line, or JSON lines with a "
                                     "\"prompt\"), up to --max-batch at once; a JSON line per prompt")
    b.add_argument("prompts", metavar="FILE")
    b.add_argument("--out", metavar="FILE", help="where the JSON lines go (default: stdout)")
    b.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template (one user turn)")
    _add_max_batch(b, "auto")
    add_arguments(b, SamplingOptions)
    add_arguments(b, ThinkingOptions)
    _add_engine_args(b)
    b.set_defaults(func=cmd_batch)

    sv = sub.add_parser("serve", help="serve an OpenAI-style completions API over HTTP (needs qspec[server])")
    add_arguments(sv, ServerOptions)
    _add_max_batch(sv, "auto")
    _add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)


def _add_model_tools(sub: argparse._SubParsersAction) -> None:
    """make-model, logits, perplexity, draft-vocab."""
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
    m.add_argument("--quant", choices=tuple(MIXES),
                   help="quantize GGUF matrices in llama.cpp's per-tensor type mix of this file type")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--split-max-size", type=_byte_size, metavar="SIZE",
                   help="write the GGUF in parts of at most SIZE tensor bytes (e.g. 50G, 512M), named as "
                        "llama-gguf-split names them: OUT-00001-of-0000N.gguf (load the first; qspec takes any part)")
    m.set_defaults(func=cmd_make_model)

    lg = sub.add_parser("logits", help="full-vocabulary logits of every position (one prefill forward) to .npy")
    lg.add_argument("model", metavar="MODEL")
    src = lg.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="comma-separated token ids")
    src.add_argument("--text", help="text, tokenized with the model's tokenizer")
    lg.add_argument("--out", required=True, metavar="FILE.npy")
    lg.add_argument("--exact", action="store_true", help="row-exact products")
    _add_weight_args(lg, device="cpu")
    lg.set_defaults(func=cmd_logits)

    pp = sub.add_parser("perplexity", help="perplexity over a text file, as llama-perplexity measures it (chunks of "
                                           "--ctx tokens, the second half of each scored)")
    pp.add_argument("--model", help=_MODEL_HELP)
    pp.add_argument("--file", required=True, help="UTF-8 text")
    pp.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default %(default)s, llama.cpp's)")
    pp.add_argument("--chunks", type=int, metavar="N", help="score the first N chunks only")
    _add_weight_args(pp)
    pp.add_argument("--json", metavar="FILE", help="write the result (and the estimate after each chunk) as JSON")
    pp.set_defaults(func=cmd_perplexity)

    dv = sub.add_parser("draft-vocab", help="count the tokens of text files and write the most frequent ids as a "
                        "draft vocabulary (for run/serve --draft-vocab FILE)")
    dv.add_argument("corpus", nargs="+", metavar="TEXT", help="text files like the requests to expect")
    dv.add_argument("--size", type=int, required=True, help="how many ids (32768: EAGLE-3's and FR-Spec's choice)")
    dv.add_argument("--out", "-o", required=True, metavar="FILE")
    dv.add_argument("--model", help="whose tokenizer counts (default: the embedded model's)")
    dv.set_defaults(func=cmd_draft_vocab)


def _wants_bench(argv: list[str]) -> bool:
    """Only `qspec bench ...` and top-level help import the bench module (it may pull in matplotlib)."""
    first = next((x for x in argv if not x.startswith("-")), None)
    return first == "bench" or first is None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_compiled_graphs()
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
        except torch.OutOfMemoryError as e:  # not a bug: a model, context or batch larger than the GPU
            first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
            _say(f"qspec: error: the GPU ran out of memory: {first} (a smaller --ctx or --max-batch, or a smaller "
                 "quantization of the model)")
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        except KeyboardInterrupt:
            _say("qspec: interrupted")
            return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
