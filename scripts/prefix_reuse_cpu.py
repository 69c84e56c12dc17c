"""Conversations' turns with and without prefix reuse (EngineOptions.prefix_cache), on the trained demo model on the
CPU: per turn, the prompt tokens, how many the caches held, and the time to the first token of each engine.

One conversation: the first user turn carries a long document (a standard-library module's source, which the demo
model was trained on) and a question, each later turn a short question; then the same prompt again (a regenerated
reply) and a turn after the last reply re-rendered with other text (a reply edited by the client). Two users taking
turns: two such conversations (two modules) interleaved on one engine, against an engine that keeps no displaced
sequence (`prefix_offloaded=0`) and one without reuse. Every engine sees the same prompts (the replies are the
reusing engine's, greedy) and runs each turn back to back, in alternating order; the tables give medians of `--reps`
runs, each from fresh engines.

    PYTHONPATH=. python scripts/prefix_reuse_cpu.py --out benchmarks/results/cpu-demo-prefix-COMMIT.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import subprocess
import sysconfig
import time
from pathlib import Path

import torch

from qspec.bench.report import print_report
from qspec.engine import Engine, EngineOptions, Generation
from qspec.loader import DEMO_MODEL, load_model, load_tokenizer
from qspec.model.model import Model
from qspec.tokenizer import Tokenizer

QUESTIONS = ["What does this module do?", "Which function is the most important?", "Show how to call it.",
             "What could go wrong?", "Summarise in one line."]
Row = tuple[str, int, int, dict[str, float]]  # label, prompt tokens, reused, first-token seconds by engine


def document(tok: Tokenizer, module: str, tokens: int) -> str:
    """The first `tokens` tokens of a standard-library module, as text."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text()
    return tok.decode(tok.encode(src, add_special=False)[:tokens])


class Turns:
    """Engines that run the same turns; the first engine's replies go on into the conversations."""

    def __init__(self, model: Model, tok: Tokenizer, ctx: int, engines: dict[str, dict[str, object]],
                 flip: bool) -> None:
        self.tok, self.flip, self.rows = tok, flip, []
        self.engines = {name: Engine(model, EngineOptions(draft=3, capacity=ctx, **kw))  # type: ignore[arg-type]
                        for name, kw in engines.items()}

    def turn(self, label: str, messages: list[dict[str, str]]) -> str:
        ids = self.tok.encode(self.tok.apply_chat_template(messages), add_special=True)
        names = list(self.engines)
        times, gens = {}, {}
        for name in reversed(names) if self.flip else names:
            times[name], gens[name] = first_token_s(self.engines[name], ids)
        self.rows.append((label, len(ids), gens[names[0]].cached_tokens, times))
        return self.tok.decode(gens[names[0]].tokens, skip_special=True)


def first_token_s(eng: Engine, ids: list[int]) -> tuple[float, Generation]:
    t0, stamps = time.perf_counter(), []
    g = eng.generate(ids, 24, stop_ids=set(), on_token=lambda _: stamps.append(time.perf_counter()))
    return stamps[0] - t0, g


def one_conversation(t: Turns, doc: str) -> list[Row]:
    messages: list[dict[str, str]] = []
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": (doc + "\n\n" + q) if i == 0 else q})
        messages.append({"role": "assistant", "content": t.turn(f"turn {i + 1}", messages)})
    t.turn("the last turn again (regenerate)", messages[:-1])
    edited = [{"role": "assistant", "content": "An edited reply."}, {"role": "user", "content": "Go on."}]
    t.turn("the last reply edited, then a turn", messages[:-1] + edited)
    return t.rows


def two_users(t: Turns, docs: dict[str, str]) -> list[Row]:
    messages: dict[str, list[dict[str, str]]] = {u: [] for u in docs}
    for i, q in enumerate(QUESTIONS[:3]):
        for u, doc in docs.items():
            messages[u].append({"role": "user", "content": (doc + "\n\n" + q) if i == 0 else q})
            messages[u].append({"role": "assistant", "content": t.turn(f"user {u}, turn {i + 1}", messages[u])})
    return t.rows


def table(runs: list[list[Row]], names: list[str]) -> list[str]:
    head = " | ".join(f"{n} (s)" for n in names)
    ratios = " | ".join(f"{n} ÷ {names[0]}" for n in names[1:])
    lines = [f"| turn | prompt tokens | reused | {head} | {ratios} |", "|---|" + "---:|" * (2 + 2 * len(names) - 1)]
    for i, (label, n, reused, _) in enumerate(runs[0]):
        med = {k: statistics.median(r[i][3][k] for r in runs) for k in names}
        # truncated, never rounded up
        cells = [f"{med[k]:.4f}" for k in names] + [f"×{math.floor(med[k] / med[names[0]] * 100) / 100:.2f}"
                                                    for k in names[1:]]
        lines.append(f"| {label} | {n:,} | {reused:,} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(DEMO_MODEL), load_tokenizer(DEMO_MODEL)
    docs = {"A": document(tok, "textwrap", a.doc_tokens), "B": document(tok, "shlex", a.doc_tokens)}
    one = {"reusing": {}, "whole prefill": {"prefix_cache": False}}
    two = {"reusing": {}, "no saved sequences": {"prefix_offloaded": 0}, "whole prefill": {"prefix_cache": False}}
    one_conversation(Turns(model, tok, a.ctx, one, False), docs["A"])  # warm-up: first calls, allocations
    runs1 = [one_conversation(Turns(model, tok, a.ctx, one, bool(r % 2)), docs["A"]) for r in range(a.reps)]
    runs2 = [two_users(Turns(model, tok, a.ctx, two, bool(r % 2)), docs) for r in range(a.reps)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Prefix reuse on the demo model, CPU ({torch.get_num_threads()} threads), {commit}, "
             f"{_dt.date.today()}", "",
             f"`python scripts/prefix_reuse_cpu.py --doc-tokens {a.doc_tokens} --ctx {a.ctx} --reps {a.reps}`: "
             "MTP3, greedy; time to the first token (prefill and the first token) by engine, median of the runs; "
             "reused: the reusing engine's prompt tokens not prefilled; ratios: the other engine's time over the "
             "reusing one's.", "", "## One conversation", ""]
    lines += table(runs1, list(one)) + ["", "## Two users taking turns", ""] + table(runs2, list(two))
    print_report(lines, a.out)


if __name__ == "__main__":
    main()
