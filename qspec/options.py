"""Engine and sampling options, each declared once.

An option is a dataclass field whose metadata holds, besides its name, type and default, a one-line help, where it
applies, how its value is checked and its short benchmark-arm alias. Everything else is derived from these fields:
the `run` / `serve` flags (`add_arguments`, `from_args`), the benchmark arm keys (`arm_keys`, used by
qspec/bench/arms.py) and the checks (`validate`, run when an options object is made, so the Python API, the CLI and
the server refuse the same values with the same words).

The groups are separate classes:
  KernelOptions    kernel and fast-path switches: how a step runs, not what it computes (beyond rounding)
  EngineOptions    what a user chooses (draft depth, context, cache type, the seed's optimizations), plus the
                   kernel switches (it extends KernelOptions, so `EngineOptions(draft=3, pdl=False)` works)
  SamplingOptions  per request: max tokens, temperature, top-k/p, min-p, seed, penalties, grammar
  ServerOptions    `qspec serve`: where it listens, its queue, its key, how replies are parsed (server/app.py)
Test and benchmark hooks (callables, logs) are not options: they are `qspec.engine.EngineHooks`.
"""

from __future__ import annotations

import argparse
import math
import re
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

from qspec.model.fuse import MAX_ROWS as MAX_FUSED_ROWS
from qspec.model.fuse import STATIC_MAX_ROWS
from qspec.model.model import CacheOptions
from qspec.spec.depth import FIRST_STRETCH, STRETCH_GROWTH
from qspec.spec.logit_rules import MAX_PENALTY
from qspec.tokenizer import THINK_CLOSE, THINK_OPEN

MAX_DRAFT = 8
MAX_MIXER_ROWS = 8  # kernels/triton_hc_mix.MAX_ROWS (a test checks they agree; importing it here would load Triton)
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits

Check = Callable[[Any], str | None]


class OptionError(ValueError):
    """A bad option value. `fragment` may name other options as {name}; `render` spells every name (the option's
    own first) as the caller's interface does: a field name (str), a flag (the CLI), a request field (the server)."""

    def __init__(self, name: str, fragment: str) -> None:
        self.name, self.fragment = name, fragment
        super().__init__(self.render(lambda n: n))

    def render(self, spell: Callable[[str], str]) -> str:
        names = {f: spell(f) for f in _placeholders(self.fragment)}
        return f"{spell(self.name)} {self.fragment.format(**names)}"


def _placeholders(text: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def flag_name(name: str) -> str:
    """The CLI flag of option `name`: --draft-before-readback for draft_before_readback."""
    return "--" + name.replace("_", "-")


def option(default: Any, help: str, *, applies: str = "", check: Check | None = None, choices: Sequence[Any] = (),
           aliases: Sequence[str] = (), arm: str | None = None, flag: bool = True, metavar: str | None = None,
           none_flag: bool = False, cli_type: type | None = None, kind: type | None = None,
           cli_parse: Callable[[str], dict[str, Any]] | None = None) -> Any:
    """One option's declaration.

    applies: where it has an effect ("CUDA", "with draft", ... ; "" everywhere). check: value -> error fragment or
    None. aliases: extra flags (`--ctx`; a `--no-...` alias belongs to the off side). arm: the short arm key kept as
    an alias. flag: False keeps it off the command line. none_flag: a `--no-NAME` flag sets it to None (off).
    cli_type: the flag's value type when it differs from the option's (the caller converts, unless cli_parse does:
    flag text -> the option values it sets). kind: the value type when the default (None) does not tell it."""
    meta = {"help": help, "applies": applies, "check": check, "choices": tuple(choices), "aliases": tuple(aliases),
            "arm": arm, "flag": flag, "metavar": metavar, "none_flag": none_flag, "cli_type": cli_type,
            "cli_parse": cli_parse,
            "type": kind or (type(default) if default is not None else None)}
    return field(default=default, metadata=meta)


# `--draft auto` without a maximum: deep enough for code-like text, whose drafts get accepted far ahead
AUTO_DRAFT_DEPTH = 6


def _parse_draft(text: str) -> dict[str, Any]:
    """--draft N | auto | auto:N -> the depth (the most the engine may choose, with auto) and draft_auto."""
    if text.isdigit():
        return {"draft": int(text)}
    auto, colon, most = text.partition(":")
    if auto == "auto" and (not colon or most.isdigit()):
        return {"draft": int(most) if colon else AUTO_DRAFT_DEPTH, "draft_auto": True}
    raise OptionError("draft", f"must be a depth 0..{MAX_DRAFT}, auto or auto:N, got {text!r}")


def in_range(lo: float, hi: float, note: str = "") -> Check:
    def check(v: Any) -> str | None:
        return None if lo <= v <= hi else f"must be in {lo}..{hi}{note}, got {v}"
    return check


def _multiple_of_4(v: int) -> str | None:
    return None if v >= 4 and v % 4 == 0 else f"must be a positive multiple of 4, got {v}"


def _finite_at_least(lo: float, note: str) -> Check:
    def check(v: float) -> str | None:
        return None if math.isfinite(v) and v >= lo else f"must be a finite number >= {lo}{note}, got {v}"
    return check


def _positive_finite(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else f"must be a finite number > 0, got {v}"


def _top_p(v: float) -> str | None:
    return None if math.isfinite(v) and 0 < v <= 1 else f"must be in (0, 1], got {v}"


def _at_least(lo: int) -> Check:
    def check(v: int) -> str | None:
        return None if v >= lo else f"must be >= {lo}, got {v}"
    return check


def _no_think_tag(text: str) -> str | None:
    return f"must not hold a think tag, got {text!r}" if THINK_OPEN in text or THINK_CLOSE in text else None


# `qspec run` (one request per process) compiles the steps' small ops only for requests of at least this many
# tokens unless told: compiling costs a fresh process seconds to tens of seconds before its second token and a warm
# one several, and pays back only over thousands of tokens (BENCHMARKS.md §5c).
RUN_COMPILE_MIN_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class KernelOptions:
    """Kernel and fast-path switches (how a step runs, not what it computes). Each one changes which kernels a step
    runs, not its result beyond the rounding of each path; each is on by default where the device has it. The engine
    resolves them against its device once (qspec.runner.KernelSwitches)."""

    cuda_graphs: bool = option(True, "capture the decode/verify/draft steps as CUDA graphs", applies="CUDA")
    compile: bool = option(True, "fuse the steps' small ops with torch.compile (the first steps compile; "
                           f"`qspec run` compiles only requests of at least {RUN_COMPILE_MIN_TOKENS} --max-tokens "
                           "unless this flag, --no-compile or --compile-ahead is given: a shorter run ends sooner "
                           "without, BENCHMARKS.md §5c)", applies="CUDA")
    compile_prefill: bool = option(False, f"compile prefill steps' small ops too (steps of up to {MAX_FUSED_ROWS} "
                                   "rows: longer ones run eagerly anyway): shapes that plain decoding never runs "
                                   "again, so a fresh process's first token then waits for their compilation too "
                                   "(BENCHMARKS.md §5c)", applies="CUDA, --compile", arm="cpre")
    compile_ahead: bool = option(False, "while a GGUF loads, compile the first request's steps on a stand-in of a "
                                 "few layers with random weights in the file's types (when the device has room for "
                                 "both); off by default: with warm caches it recompiled Triton's kernels "
                                 "(BENCHMARKS.md §5c)", applies="CUDA, --compile, GGUF")
    static_rows: int = option(STATIC_MAX_ROWS, "steps of up to this many rows compile their small ops with static "
                              "sizes, one graph per row count and quick to trace; larger steps one graph with "
                              "symbolic sizes for every row count (a server's warm-up then traces one graph for all "
                              "batch sizes instead of one per size, each slower to trace: BENCHMARKS.md §9)",
                              check=in_range(0, MAX_FUSED_ROWS), applies="CUDA, --compile", arm="static",
                              metavar="ROWS")
    precompile: bool = option(True, "on a model's first request, compile the decode and verify steps' block products "
                              "in threads while the prompt prefills (off: each kernel compiles at its first launch, "
                              "one after another)", applies="CUDA, block weights", arm="precomp")
    compile_backend: str = option("inductor", "torch.compile backend; another one also applies on the CPU (tests: "
                                  "aot_eager)", flag=False)
    gemv: bool = option(True, "one-row 16-bit products through the Triton mat-vec and one-row hyper-connection mixers "
                        "through their Triton kernels (off: cuBLAS and the compiled mixers)", applies="CUDA")
    mixer_step_rows: int = option(6, "the most rows of a step whose hyper-connection mixers take the Triton kernels "
                                  "(6 also sends MTP5's verify and extend steps there; BENCHMARKS.md)",
                                  applies="CUDA", check=in_range(1, MAX_MIXER_ROWS), arm="hcrows", metavar="ROWS")
    pdl: bool = option(True, "launch the Triton and compiled kernels with programmatic dependent launch (each kernel "
                       "is scheduled while the one before it runs)", applies="CUDA, Hopper and later")
    grouped_mm: bool = option(True, "prefill's routed experts as three grouped GEMMs per layer (torch._grouped_mm, "
                              "bf16; off: a loop over the experts)", applies="CUDA, sm_90/sm_100", arm="gmm")
    gdn_conv_kernel: bool = option(True, "GDN steps' causal conv, silu and q/k norms in one Triton launch per layer "
                                   "(off: compiled)", applies="CUDA", arm="gconv")
    gdn_seqs: bool = option(True, "a batched step runs every sequence's GDN conv snapshots and recurrence in two "
                            "launches a layer, and the n-gram layer's contexts and conv snapshots in one each (off: "
                            "each sequence's own launches)", applies="CUDA, batches", arm="gseqs")
    attention_seqs: bool = option(True, "a batched step writes every sequence's K/V rows and raw indexer keys in "
                                  "one launch each, updates every sequence's pooled keys in one more, makes every "
                                  "sequence's QSA block choice in one call and attends "
                                  "over every sequence's cache in one pass, per attention layer (QSA and the draft "
                                  "head; off: each sequence's own launches; BENCHMARKS.md §9)",
                                  applies="CUDA, batches, fused attention", arm="aseqs")
    int8_dot: bool = option(True, "one-row products with GGUF block weights (and the few-token experts) with the "
                            "row rounded to int8 per 32 and dp4a on the blocks, as llama.cpp's mat-vec (off: the "
                            "blocks expanded to f32 in registers)", applies="CUDA, block weights",
                            arm="int8")
    fuse_blocks: bool = option(True, "compile the step functions that multiply GGUF block weights too, each block "
                               "product one custom op among the generated kernels (off: those functions run "
                               "eagerly, small ops and all)", applies="CUDA, block weights, --compile", arm="fblk")
    shared_stream: bool = option(True, "few-token steps run a block-typed shared expert on a second CUDA stream beside "
                                 "the routing and the routed experts (the same kernels, overlapped)",
                                 applies="CUDA, block weights", arm="shst")
    shared_pair: bool = option(True, "few-token steps run a shared expert of the routed experts' block types as one "
                               "more routed pair, weighted by its sigmoid gate (off: its own products)",
                               applies="CUDA, block weights", arm="shpair")
    sums_in_product: bool = option(True, "a block product that splits K adds the shares' partial sums in its own "
                                   "launch (each row block's last program to finish adds them; off: a second "
                                   "launch)", applies="CUDA, block weights", arm="ssum")
    tc_pairs: bool = option(True, "the tensor-core block products (several rows: verify, extend) expand Q4_K, Q5_K "
                            "and Q6_K two weights a 32-bit register in 16-bit arithmetic, the scales and mins rounded "
                            "to 16 bits first (off: each weight in f32, rounded once)", applies="CUDA, block weights",
                            arm="pairs")
    k_lanes: int = option(0, "Q4_K/Q5_K products of 1-4 rows walk each row's K this many super-blocks side by side "
                          "(threads along K in a program: fewer serial steps a row); 0: by the matrix's shape (a few "
                          "rows of a long K 4, many rows of the model width 2, others 1)",
                          choices=(0, 1, 2, 4, 8), applies="CUDA, block weights", arm="klanes", metavar="N")
    norm_quant: bool = option(True, "one-row GDN steps norm, gate and round to int8 for the output product in "
                              "one launch (off: compiled, then the product's quantizer)", applies="CUDA, block weights",
                              arm="nq")
    kv_write_kernel: bool = option(True, "q8_0 KV writes in one Triton launch per layer and step (off: the compiled "
                                   "quantization and four index copies)", applies="CUDA, --kv-type q8_0", arm="kvw")
    fused_attention: bool | None = option(None, "masked attention (QSA's dense path, the MTP head) in one pass over "
                                          "the KV cache, q8_0 dequantized in registers (on the CPU: its torch "
                                          "reference)", arm="fattn", kind=bool)
    sparse_attention: bool = option(False, "QSA reads only the indexer's chosen blocks and the tail instead of "
                                    "masking every cell of a KV bucket", arm="sparse")
    draft_before_readback: bool = option(True, "greedy speculation queues each round's next draft chain before the "
                                         "host reads the round, so the GPU does not wait for the read-back",
                                         applies="with draft", arm="early")
    prefill_chunk: int | None = option(None, "prompt tokens per prefill step (default 512; 4,096 when the routed "
                                       "experts are GGUF blocks, which a step expands once whatever its rows)",
                                       check=_at_least(1), metavar="TOKENS", kind=int)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True, kw_only=True)
class EngineOptions(KernelOptions):
    """Engine options. The draft depth, the cache, the seed's optimizations and the draft head, plus the kernel
    switches this class inherits. Checked when made (OptionError); never changed by the engine."""

    draft: int = option(0, "MTP draft depth (0: plain decoding), or auto[:N] on the command line: --draft-auto with "
                        "depth N (6 when not given)", check=in_range(0, MAX_DRAFT, " (0 = plain decoding)"),
                        metavar="N|auto[:N]", cli_type=str, cli_parse=_parse_draft)
    draft_auto: bool = option(False, "choose each round's depth in 0..--draft, the one with the most expected tokens "
                              "per second from this request's acceptance and the measured round costs (spec/depth.py; "
                              "the CLI's --draft auto[:N] sets it)", applies="with draft", arm="auto")
    draft_auto_stretch: int = option(FIRST_STRETCH, "tokens decoded plainly when the automatic depth stops drafting, "
                                     "before it drafts again to measure; each such trial that finds drafting still "
                                     f"does not pay doubles it, up to {STRETCH_GROWTH}x", check=in_range(1, 4096),
                                     applies="with draft auto", arm="stretch", metavar="TOKENS")
    capacity: int = option(4096, "context capacity in tokens (a multiple of 4)", check=_multiple_of_4,
                           aliases=("--ctx",), metavar="TOKENS")
    kv_type: str = option("f32", "KV cache type", choices=("f32", "f16", "bf16", "q8_0"))
    exact: bool = option(False, "row-exact products: verify rows equal decode rows bit for bit (slow, no CUDA graphs; "
                         "for tests)")
    preserve_pooled: bool = option(True, "keep the pooled indexer keys of still-valid blocks across a rollback (off: "
                                   "rebuild them)", applies="with draft", arm="preserve")
    incremental_pooled: bool = option(True, "materialize only new or changed pooled blocks each step (off: every "
                                      "complete block)", aliases=("--no-incremental",), arm="incremental")
    pad_target: int | None = option(8, "rows the pooled-key updates pad to, so every step has one shape",
                                    choices=(8, 16), none_flag=True, aliases=("--no-pad",), arm="pad")
    fused_snapshots: bool = option(True, "write the conv rollback snapshots with one fused kernel (off: separate "
                                   "copies)", arm="fused")
    prefix_cache: bool = option(True, "reuse the caches across requests: a prompt that goes on from the last "
                                "completed request's prompt and output (a chat's next turn) prefills only its new "
                                "tokens; one that starts with a recent prompt (the same prompt again, a turn whose "
                                "earlier reply tokenizes differently) only the tokens after it")
    prefix_offloaded: int = option(4, "completed sequences moved to host memory when another request takes the caches "
                                  "(--prefix-cache): a prompt that goes on from one of them (a server's users taking "
                                  "turns) loads it back instead of prefilling", check=in_range(0, 256),
                                  applies="--prefix-cache", metavar="N")
    prefix_checkpoints: int = option(4, "prompt ends kept for --prefix-cache: a copy of the recurrent state after each "
                                     "prompt, with its last logits (the attention caches keep every position)",
                                     check=in_range(0, 64), applies="--prefix-cache", metavar="N")
    draft_head: str = option("full", "LM head the drafts read (q4: a Q4_0-rounded copy; the target verifies with its "
                             "own, so only the acceptance can change)", choices=("full", "q4"), applies="with draft")
    draft_vocab: Sequence[int] | torch.Tensor | None = option(
        None, "let the draft propose only these token ids, so its head reads only their rows (CLI: N, the first N ids "
        "and the stop tokens, or FILE from `qspec draft-vocab`); the output is unchanged, the acceptance may drop",
        applies="with draft", arm="dvocab", metavar="N|FILE", cli_type=str)

    def __post_init__(self) -> None:
        validate(self)
        if self.draft_vocab is not None and not self.draft:
            raise OptionError("draft_vocab", "restricts the drafts: it needs {draft} N (N >= 1)")
        if self.draft_auto and not self.draft:
            raise OptionError("draft_auto", "chooses depths in 0..{draft}: it needs {draft} N (N >= 1)")

    def cache_options(self) -> CacheOptions:
        """The cache's share of the options."""
        return CacheOptions(capacity=self.capacity, n_slots=self.draft + 1, kv_type=self.kv_type,
                            preserve_pooled=self.preserve_pooled, pad_target=self.pad_target,
                            incremental_pooled=self.incremental_pooled, fused_snapshots=self.fused_snapshots,
                            sparse_attention=self.sparse_attention, fused_attention=self.fused_attention,
                            kv_write_kernel=self.kv_write_kernel)


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """Sampling options. One request's sampling; the CLI's flags and the server's request checks use these
    declarations."""

    max_tokens: int = option(128, "tokens to generate at most", check=_at_least(1), metavar="N")
    temperature: float = option(0.0, "sampling temperature (0 = greedy)", check=_finite_at_least(0, " (0 = greedy)"))
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches this",
                          check=_top_p)
    top_k: int = option(0, "sample among the k likeliest tokens only (0: all)", check=_at_least(0))
    min_p: float = option(0.0, "drop tokens less likely than this times the likeliest (0: none)", check=in_range(0, 1))
    seed: int = option(0, "sampling seed", check=in_range(0, SEED_MAX))
    presence_penalty: float = option(0.0, "subtracted from the logit of each token generated so far",
                                     check=in_range(-MAX_PENALTY, MAX_PENALTY))
    frequency_penalty: float = option(0.0, "subtracted from a token's logit once per time it was generated",
                                      check=in_range(-MAX_PENALTY, MAX_PENALTY))
    repetition_penalty: float = option(1.0, "a prompt's or output's token's logit: divided by this if positive, "
                                       "multiplied if not (1: off)", check=_positive_finite)
    json_schema: str | None = option(None, "hold the output to a JSON schema: a file, or the schema's JSON text",
                                     metavar="SCHEMA", kind=str)
    regex: str | None = option(None, "hold the output to a regular expression (matched whole)", metavar="RE",
                               kind=str)
    grammar: str | None = option(None, "hold the output to a grammar in this file: Lark (llguidance's) or GBNF",
                                 metavar="FILE", kind=str)

    def __post_init__(self) -> None:
        validate(self)
        given = self.grammar_options()
        if len(given) > 1:
            raise OptionError(given[1], f"and {{{given[0]}}} both constrain the output: give one of them")

    def grammar_options(self) -> list[str]:
        """The options given that constrain the output (one at most, once checked)."""
        return [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]


# the formats tool calls are read in (qspec/server/call_formats.py) and the reasoning parsers (server/reasoning.py)
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
REASONING_PARSERS = ("qwen3",)


@dataclass(frozen=True, kw_only=True)
class ThinkingOptions:
    """A reply's think block (`<think> ... </think>`, Qwen3's reasoning) held to a budget: `run`, `chat` and `batch`
    hold every reply to it, `serve` the chat replies whose request sets no thinking_token_budget."""

    reasoning_budget: int | None = option(None, "tokens a reply may think (its <think> block) before the block is "
                                          "closed for it (0: at once); unset: no limit", check=_at_least(0),
                                          metavar="N", kind=int)
    reasoning_budget_message: str | None = option(None, "text forced before </think> when a think block reaches its "
                                                  "budget, telling the model to answer now; unset: the tag alone",
                                                  check=_no_think_tag, metavar="TEXT", kind=str)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True, kw_only=True)
class ServerOptions(ThinkingOptions):
    """The server. `qspec serve`'s flags; create_app takes them (host, port and warmup are the command's)."""

    host: str = option("127.0.0.1", "the address to listen on", kind=str)
    port: int = option(8000, "the port to listen on", check=in_range(1, 65535))
    served_name: str | None = option(None, "the model name the API reports (unset: the file's stem)", metavar="NAME",
                                     kind=str)
    max_waiting: int = option(64, "requests that may wait for the engine before more are refused with a 503",
                              check=_at_least(0), metavar="N")
    api_key: str | None = option(None, "requests need `Authorization: Bearer KEY` or `x-api-key: KEY` (all but "
                                 "/health and /metrics; unset: $QSPEC_API_KEY, else no key)", metavar="KEY", kind=str)
    reasoning_parser: str | None = option(None, "chat replies' <think> blocks come back apart, as the message's "
                                          "reasoning_content", choices=REASONING_PARSERS, kind=str)
    tool_call_parser: str | None = option(None, "how replies write tool calls: hermes (Qwen's JSON) or qwen3_coder "
                                          "(<function=...> tags); unset: the one the chat template asks for",
                                          choices=TOOL_CALL_PARSERS, kind=str)
    warmup: bool = option(True, "a short generation at startup that compiles the steps and captures their graphs "
                          "before the first request")
    allowed_origins: str | None = option(None, "web pages from these origins (comma-separated, or *) may call the "
                                         "API from a browser (CORS); unset: none", metavar="ORIGINS", kind=str)

    def origins(self) -> list[str]:
        """allowed_origins as a list ([] when unset)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    def __post_init__(self) -> None:
        validate(self)


def declared(cls: type) -> list[Field]:
    """The option fields of a dataclass (every field declared with `option`)."""
    return [f for f in fields(cls) if "help" in f.metadata]


def validate(opts: Any) -> None:
    """Raise OptionError for the first field whose value has the wrong type, is not one of its choices, or fails its
    check."""
    for f in declared(type(opts)):
        v, m = getattr(opts, f.name), f.metadata
        if v is None and (f.default is None or m["none_flag"]):
            continue
        want = m["type"]
        if want is bool and not isinstance(v, bool):
            raise OptionError(f.name, f"must be true or false, got {v!r}")
        if want is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise OptionError(f.name, f"must be an integer, got {v!r}")
        if want is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise OptionError(f.name, f"must be a number, got {v!r}")
        if m["choices"] and v not in m["choices"]:
            raise OptionError(f.name, f"must be one of {', '.join(map(str, m['choices']))}, got {v!r}")
        if m["check"] is not None and (msg := m["check"](v)) is not None:
            raise OptionError(f.name, msg)


def _help(f: Field) -> str:
    m = f.metadata
    where = f" [{m['applies']}]" if m["applies"] else ""
    if m["type"] is bool:
        dflt = {True: "on", False: "off", None: "on CUDA, off on the CPU"}[f.default]
    else:
        dflt = "%(default)s" if f.default is not None else "none"
    return f"{m['help'].replace('%', '%%')}{where} (default: {dflt})"


def _groups(cls: type) -> list[tuple[type, list[Field]]]:
    """The option fields of `cls` by the class that declares them, the most derived class first."""
    out = []
    for c in cls.__mro__:
        own = set(c.__dict__.get("__annotations__", {}))
        fs = [f for f in declared(cls) if f.name in own]
        if fs:
            out.append((c, fs))
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = ()) -> None:
    """Add a flag for every option of `cls` (booleans: --NAME and --no-NAME, mutually exclusive), one argument group
    per declaring class. Flags take the option's name, so `from_args` reads them back by name."""
    skip = set(skip)
    for c, fs in _groups(cls):
        title, _, about = (c.__doc__ or c.__name__).strip().partition(". ")
        _add_group(parser.add_argument_group(title), [f for f in fs if f.metadata["flag"] and f.name not in skip])


def _add_group(group: Any, fs: list[Field]) -> None:
    for f in fs:
        m = f.metadata
        name, on_alias = flag_name(f.name), [a for a in m["aliases"] if not a.startswith("--no-")]
        off_alias = [a for a in m["aliases"] if a.startswith("--no-")]
        if m["type"] is bool:
            g = group.add_mutually_exclusive_group()
            g.add_argument(name, *on_alias, dest=f.name, action="store_const", const=True, default=f.default,
                           help=_help(f))
            g.add_argument("--no-" + name[2:], *off_alias, dest=f.name, action="store_const", const=False,
                           help=f"the opposite of {name}")
            continue
        kind = m["cli_type"] or m["type"]
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "type": kind, "help": _help(f)}
        if m["choices"]:
            kw["choices"] = m["choices"]
        if m["metavar"]:
            kw["metavar"] = m["metavar"]
        if m["none_flag"]:
            g = group.add_mutually_exclusive_group()
            g.add_argument(name, *on_alias, **kw)
            g.add_argument("--no-" + name[2:], *off_alias, dest=f.name, action="store_const", const=None,
                           help=f"turn {name} off")
        else:
            group.add_argument(name, *on_alias, **kw)


def from_args(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """An options object from parsed flags (`add_arguments`); `overrides` replace values the caller converted (a
    `cli_type` option) or options without a flag."""
    kw = {f.name: getattr(ns, f.name) for f in declared(cls) if f.metadata["flag"] and hasattr(ns, f.name)}
    for f in declared(cls):
        if f.metadata["cli_parse"] and isinstance(kw.get(f.name), str):
            kw |= f.metadata["cli_parse"](kw[f.name])
    return cls(**(kw | overrides))


def arm_keys(cls: type = EngineOptions) -> dict[str, str]:
    """Benchmark arm keys -> option names: every option by its own name, and its short alias where it has one."""
    out = {f.name: f.name for f in declared(cls) if f.metadata["flag"]}
    out |= {f.metadata["arm"]: f.name for f in declared(cls) if f.metadata["arm"]}
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def prompt_text_error(text: str) -> str | None:
    """Why `text` cannot be a prompt (a phrase to follow "the prompt"), or None. Prompts are refused, not repaired,
    when they are not Unicode text: a command-line argument whose bytes are not UTF-8 arrives with each bad byte as a
    lone surrogate (Python's surrogateescape), and JSON can carry a lone surrogate escape; replacing them with U+FFFD
    would silently change what the model reads."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    o, at = ord(m.group()), m.start()
    if 0xDC80 <= o <= 0xDCFF:
        return f"is not valid UTF-8: byte 0x{o - 0xDC00:02x} at character {at} (convert it to UTF-8 first)"
    return f"has a lone surrogate U+{o:04X} at character {at}, which is not text (surrogates only come in pairs)"
