"""Structured output's cost on the GPU at the flash-next geometry: decode tok/s with and without a grammar, for plain
decoding and MTP3, in one process, the arms alternated.

A random-weight model made on the device (qspec/bench/device_model.py), the Qwen tokenizer, a 512-token random
prompt, greedy, q8_0 KV cache. The weights are random, so the drafts are (almost) never accepted, with or without a
grammar (the table counts them): MTP3's rounds emit one token each, and its comparison prices what a grammar adds to
a round (the drafts' read-back, overlapped with the verify step, the masks and their upload). The grammar, a JSON
array of at least 1,000 strings, cannot end within the generated tokens, so every run generates them all.

    PYTHONPATH=. python scripts/grammar_gpu.py --layers 8 --out benchmarks/results/h200-fn8-grammar-COMMIT.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import time
from pathlib import Path

import torch

from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.report import print_report
from qspec.bench.run import git_commit
from qspec.engine import Engine, EngineOptions
from qspec.spec.accept import Sampler
from qspec.spec.grammar import GrammarCompiler, GrammarSpec
from qspec.tokenizer import Tokenizer

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1000}


def run_arm(eng: Engine, prompt: list[int], tokens: int, grammars: GrammarCompiler | None
            ) -> tuple[float, int, int]:
    """(decode tok/s, tokens generated, drafts accepted) of one greedy generation."""
    grammar = None if grammars is None else grammars.compile(GrammarSpec("json", SCHEMA))
    g = eng.generate(prompt, tokens, sampler=Sampler(grammar=grammar), stop_ids=set(grammars.ends if grammars else ()))
    return g.decode_tps, len(g.tokens), g.spec.accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-next", help="flash-next; tiny (with --device cpu) tries the script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg = bench_config(a.preset, layers=a.layers)
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    tok = Tokenizer.from_qwen_package()
    t0 = time.perf_counter()
    grammars = GrammarCompiler(tok, cfg.vocab_size)
    table_s = time.perf_counter() - t0
    prompt = torch.randint(0, tok.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {d: Engine(model, EngineOptions(draft=d, capacity=2048, kv_type="q8_0", prefix_cache=False))
               for d in (0, 3)}
    arms = [(d, g) for d in (0, 3) for g in (False, True)]
    results: dict[tuple[int, bool], list[float]] = {arm: [] for arm in arms}
    accepted = dict.fromkeys(arms, 0)
    for r in range(a.reps + 1):  # the first: warm-up (compilation, graph captures), not reported
        for d, g in arms if r % 2 else arms[::-1]:
            tps, n, acc = run_arm(engines[d], prompt, a.tokens, grammars if g else None)
            assert n == a.tokens, f"an arm generated {n} of {a.tokens} tokens"
            if r:
                results[(d, g)].append(tps)
                accepted[(d, g)] += acc
    report(a, results, accepted, table_s, model.weights_summary)


def report(a: argparse.Namespace, results: dict[tuple[int, bool], list[float]], accepted: dict[tuple[int, bool], int],
           table_s: float, summary: str) -> None:
    commit = git_commit() or "unknown commit"
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    lines = [f"# Structured output on {where}, {a.preset} geometry with {a.layers} layers "
             f"({'bf16' if a.device == 'cuda' else 'f32'}), {commit}, "
             f"{_dt.date.today()}", "",
             f"`python scripts/grammar_gpu.py --layers {a.layers} --tokens {a.tokens} --reps {a.reps}`: greedy, "
             f"512-token prompt, {a.tokens} generated; decode tok/s, median [min-max] of {a.reps} runs after a "
             f"warm-up, arms alternated; the grammar a JSON array of >= 1,000 strings (token table built in "
             f"{table_s:.2f} s); ratio: with the grammar over without (truncated). Model: {summary}.", "",
             "| decoding | without a grammar | with the grammar | ratio | drafts accepted (without / with) |",
             "|---|---:|---:|---:|---:|"]
    for d in (0, 3):
        off, on = results[(d, False)], results[(d, True)]
        ratio = int(statistics.median(on) / statistics.median(off) * 1000) / 1000
        lines.append(f"| {'plain' if d == 0 else f'MTP{d}'} | {statistics.median(off):.2f} "
                     f"[{min(off):.2f}-{max(off):.2f}] | {statistics.median(on):.2f} [{min(on):.2f}-{max(on):.2f}] "
                     f"| ×{ratio:.3f} | {accepted[(d, False)]} / {accepted[(d, True)]} |")
    print_report(lines, a.out)


if __name__ == "__main__":
    main()
