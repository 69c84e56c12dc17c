"""A conversation's turns with and without prefix reuse (EngineOptions.prefix_cache), on the trained demo model on the
CPU: per turn, the prompt tokens, how many the caches held, and the time to the first token of each engine.

The first user turn carries a long document (a standard-library module's source, which the demo model was trained on)
and a question; each later turn adds a short question. Both engines see the same conversation (the replies are the
reusing engine's, greedy) and run each turn back to back, in alternating order; the table gives medians of `--reps`
runs of the whole conversation, each from fresh engines. Then the same prompt again (a regenerated reply) and a
prompt whose last reply is re-rendered with other text (a reply edited by the client).

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

from qspec.engine import Engine, EngineOptions
from qspec.loader import DEMO_MODEL, load_model, load_tokenizer
from qspec.model.model import Model
from qspec.tokenizer import Tokenizer

QUESTIONS = ["What does this module do?", "Which function is the most important?", "Show how to call it.",
             "What could go wrong?", "Summarise in one line."]


def document(tok: Tokenizer, tokens: int) -> str:
    """The first `tokens` tokens of a standard-library module, as text."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    return tok.decode(tok.encode(src, add_special=False)[:tokens])


def first_token_s(eng: Engine, ids: list[int]) -> tuple[float, object]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    g = eng.generate(ids, 24, stop_ids=set(), on_token=lambda _: stamps.append(time.perf_counter()))
    return stamps[0] - t0, g


def conversation(model: Model, tok: Tokenizer, doc: str, ctx: int, flip: bool) -> list[tuple[str, int, int, float,
                                                                                             float]]:
    """One conversation on fresh engines -> per turn (label, prompt tokens, reused, first token s off, on)."""
    engines = {on: Engine(model, EngineOptions(draft=3, capacity=ctx, prefix_cache=on)) for on in (False, True)}
    messages: list[dict[str, str]] = []
    rows = []

    def turn(label: str, msgs: list[dict[str, str]]) -> str:
        ids = tok.encode(tok.apply_chat_template(msgs), add_special=True)
        times, gens = {}, {}
        for on in ((True, False) if flip else (False, True)):
            times[on], gens[on] = first_token_s(engines[on], ids)
        rows.append((label, len(ids), gens[True].cached_tokens, times[False], times[True]))
        return tok.decode(gens[True].tokens, skip_special=True)

    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": (doc + "\n\n" + q) if i == 0 else q})
        messages.append({"role": "assistant", "content": turn(f"turn {i + 1}", messages)})
    turn("the last turn again (regenerate)", messages[:-1])
    edited = [{"role": "assistant", "content": "An edited reply."}, {"role": "user", "content": "Go on."}]
    turn("the last reply edited, then a turn", messages[:-1] + edited)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(DEMO_MODEL), load_tokenizer(DEMO_MODEL)
    doc = document(tok, a.doc_tokens)
    conversation(model, tok, doc, a.ctx, False)  # warm-up: first calls, allocations
    runs = [conversation(model, tok, doc, a.ctx, bool(r % 2)) for r in range(a.reps)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Prefix reuse on the demo model, CPU ({torch.get_num_threads()} threads), {commit}, "
             f"{_dt.date.today()}", "",
             f"`python scripts/prefix_reuse_cpu.py --doc-tokens {a.doc_tokens} --ctx {a.ctx} --reps {a.reps}`: "
             "MTP3, greedy, time to the first token (prefill and the first token), median of the runs.", "",
             "| turn | prompt tokens | reused | first token, whole prefill (s) | reusing (s) | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, (label, n, reused, _, _) in enumerate(runs[0]):
        off = statistics.median(r[i][3] for r in runs)
        on = statistics.median(r[i][4] for r in runs)
        ratio = math.floor(off / on * 100) / 100  # truncated, not rounded up
        lines.append(f"| {label} | {n:,} | {reused:,} | {off:.4f} | {on:.4f} | ×{ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
