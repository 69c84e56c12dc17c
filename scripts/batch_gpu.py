"""Continuous batching's throughput (qspec/batch.py): B requests decoded together against the engine's own plain
decoding of one, in one process, the arms alternated.

A random-weight model made on the device (qspec/bench/device_model.py; `--quant q4_k_m` for GGUF blocks), prompts of
random ids (a different one per request), greedy, q8_0 KV cache. An arm of batch B starts B requests at once: the
batch thread prefills them a chunk at a time between steps, then steps all B together. Its decode speed counts the
tokens emitted while all B decode (the last request's first token to the first one's last) over that window; a
request's own speed is that over B. "engine" is Engine.generate's plain decoding of one request (pipelined: the
next step is queued before the host reads a token), "batch 1" the batch path with one request.

    PYTHONPATH=. python scripts/batch_gpu.py --layers 8 --batches 1,2,4,8 --out benchmarks/results/h200-fn8-batch-C.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import statistics
import threading
import time
from pathlib import Path

import torch

from qspec.batch import Batcher
from qspec.bench.accept import AcceptProfile
from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.report import print_report
from qspec.bench.run import git_commit
from qspec.engine import Engine, EngineHooks, EngineOptions, Generation


def switch_values(spec: str) -> dict[str, bool | int]:
    """`NAME=VALUE,...` as EngineOptions fields: 0|1 for a boolean field, an integer for an integer one."""
    kinds = {f.name: f.type for f in dataclasses.fields(EngineOptions)}
    out: dict[str, bool | int] = {}
    for item in spec.split(","):
        name, value = item.split("=")
        if name not in kinds:
            raise SystemExit(f"--switches: {name!r} is no EngineOptions field")
        out[name] = value == "1" if kinds[name] in (bool, "bool") else int(value)
    return out


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def batch_arm(b: Batcher, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Aggregate decode tok/s of the prompts started together, over the window in which all of them decode: from
    the last request's first token to the first request's last token (the tokens each emitted in it, over its
    length). Outside it a prefill stalls the steps or fewer rows are left. -> (that tok/s, tokens a speculative
    round committed on average, 1 without drafting)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    gens: list[Generation] = []

    def one(i: int) -> None:
        gens.append(b.generate(prompts[i], tokens, on_token=lambda _t: stamps[i].append(time.perf_counter())))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(s) == tokens for s in stamps), [len(s) for s in stamps]
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    emitted = sum(start < t <= end for s in stamps for t in s)
    if end <= start or emitted < len(prompts):
        raise SystemExit(f"batch {len(prompts)}: no window in which all requests decode (raise --tokens)")
    rounds = sum(g.spec.rounds for g in gens)
    return emitted / (end - start), sum(g.spec.tokens for g in gens) / rounds if rounds else 1.0


def engine_arm(e: Engine, prompt: list[int], tokens: int) -> float:
    g = e.generate(prompt, tokens)
    assert len(g.tokens) == tokens
    return g.decode_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-next", help="flash-next; tiny (with --device cpu) tries the script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default=None, help="a GGUF block mix (q4_k_m, q8_0) instead of bf16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft", type=int, default=0,
                    help="also the arms that draft this deep: the engine's rounds and the batch's (mtpN)")
    ap.add_argument("--modes", default="on", help="the drafting batch's modes, one set of arms each (on, auto: "
                    "Batcher(draft=...)); the auto arms are named 'mtpN auto'")
    ap.add_argument("--draft-head", default="full", choices=("full", "q4"),
                    help="the LM head the drafts read (q4: the engine's Q4_0 copy, as the `ours` arms use)")
    ap.add_argument("--accept-profile", default="p=0.85", help="the drafting arms' replayed acceptance "
                    "(qspec/bench/accept.py; the random model's own drafts are almost never accepted)")
    ap.add_argument("--profile", action="store_true",
                    help="then the largest batch's requests once more under torch.profiler: its busiest kernels")
    ap.add_argument("--switches", default=None, metavar="NAME=VALUE,...",
                    help="also every batch arm with these EngineOptions fields set so (a boolean as 0|1), named "
                    "'... NAME=VALUE,...' (a same-process A/B, e.g. gdn_seqs=0 or static_rows=1)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    batches = [int(x) for x in a.batches.split(",")]
    cfg = bench_config(a.preset, layers=a.layers)
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32,
                                quant=a.quant)
    variants = {"": 0} | ({f" mtp{a.draft}": a.draft} if a.draft else {})
    hooks = EngineHooks(accept_hook=AcceptProfile.parse(a.accept_profile).hook())
    off = {"": {}} | ({f" {a.switches}": switch_values(a.switches)} if a.switches else {})
    engines = {v + o: Engine(model, EngineOptions(draft=d, capacity=a.prompt + a.tokens + 64, kv_type="q8_0",
                                                  prefix_cache=False, draft_head=a.draft_head, **kw),
                             hooks if d else None)
               for v, d in variants.items() for o, kw in off.items()}
    modes = {v: (v, "on") if v else (v, "off") for v in variants}  # a batch's arms' name -> (variant, its mode)
    if a.draft:
        del modes[f" mtp{a.draft}"]
        modes |= {f" mtp{a.draft}" + ("" if m == "on" else f" {m}"): (f" mtp{a.draft}", m) for m in a.modes.split(",")}
    modes = {k + o: (v + o, m) for k, (v, m) in modes.items() for o in off}
    batchers = {k: Batcher(engines[v], max(batches), draft=m) for k, (v, m) in modes.items()}
    arms = [f"engine{v}" for v in variants] + [f"batch {b}{k}" for k in modes for b in batches]
    results: dict[str, list[float]] = {arm: [] for arm in arms}
    per_round: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for r in range(a.reps + 1):  # the first: warm-up (compilation, graph captures), not reported
            for arm in arms if r % 2 else arms[::-1]:
                # the arm's variant: what follows "engine" or "batch N"
                seed, k = 1000 * r + len(results[arm]), arm[len(" ".join(arm.split()[:1 if arm[0] == "e" else 2])):]
                if arm.startswith("engine"):
                    tps, tpr = engine_arm(engines[k], prompts_of(1, a.prompt, cfg.vocab_size, seed)[0], a.tokens), 1.0
                else:
                    n = int(arm.split()[1])
                    tps, tpr = batch_arm(batchers[k], prompts_of(n, a.prompt, cfg.vocab_size, seed), a.tokens)
                print(f"{'run' if r else 'warm-up'} {r}, {arm}: {tps:.2f} tok/s", flush=True)  # kept if cut short
                if r:
                    results[arm].append(tps)
                    per_round[arm].append(tpr)
        if a.profile:
            profile(batchers[list(batchers)[-1]], prompts_of(max(batches), a.prompt, cfg.vocab_size, 99), a.tokens)
    finally:
        for b in batchers.values():
            b.close()
    steady = {arm: v for k, b in batchers.items() for arm, v in steady_steps(b, k, per_round).items()}
    notes = [f"batch{v or ' (plain)'}: rows per step {b.steps.rows / max(1, b.steps.steps):.2f}, {b.rounds} "
             f"rounds, graphs "
             f"{b.runners[0].graph_stats.replays} replays, {b.runners[0].graph_stats.captures} captures, "
             f"{b.runners[0].graph_stats.eager} eager steps" for v, b in batchers.items()]
    report(a, results, model.weights_summary, steady, "; ".join(notes))


def steady_steps(b: Batcher, name: str, per_round: dict[str, list[float]]) -> dict[str, tuple[float, float, int]]:
    """Per batch size, the median time of the batch's steps or rounds in the process and the tokens a sequence
    commits in one -> {arm: (seconds, tokens, depth)}. An auto batch times several depths: its steady step is the
    depth it ran most, its tokens the ones its choice expects at that depth."""
    out: dict[str, tuple[float, float, int]] = {}
    for (n, d), t in sorted(b.steps.seconds.items(), key=lambda e: len(e[1])):
        arm = f"batch {n}{name}"
        if arm in per_round:
            expected = b.choice.tokens(d) if b.choice is not None and d else None
            tokens = 1.0 if not d else expected or statistics.mean(per_round[arm])
            out[arm] = (statistics.median(t), tokens, d)
    return out


def profile(b: Batcher, prompts: list[list[int]], tokens: int) -> None:
    """The batch's requests under torch.profiler: the kernels' busy time and the steps' wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    before = b.steps.steps
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        b.generate_all(prompts, tokens)
        wall = time.perf_counter() - t0
    steps = b.steps.steps - before
    print(f"profiled: {steps} batched steps, {wall:.3f} s wall (prefills in)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))


def report(a: argparse.Namespace, results: dict[str, list[float]], summary: str,
           steady: dict[str, tuple[float, float, int]], notes: str) -> None:
    commit = git_commit() or "unknown commit"
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    base = statistics.median(results["engine"])
    drafting = (f" --draft {a.draft} --modes {a.modes} --draft-head {a.draft_head} --accept-profile "
                f"{a.accept_profile}" if a.draft
                else "")
    lines = [f"# Continuous batching on {where}, {a.preset} geometry with {a.layers} layers "
             f"({a.quant or ('bf16' if a.device == 'cuda' else 'f32')}), {commit}, {_dt.date.today()}", "",
             f"`python scripts/batch_gpu.py --layers {a.layers} --batches {a.batches} --prompt {a.prompt} --tokens "
             f"{a.tokens} --reps {a.reps}{' --quant ' + a.quant if a.quant else ''}{drafting}`: greedy, "
             f"{a.prompt}-token prompts, {a.tokens} generated per request; decode tok/s of all a batch's requests "
             f"together (while all decode), median [min-max] of {a.reps} runs after a warm-up, arms alternated; "
             f"ratio over the engine's plain decoding of one request (truncated). mtpN: drafting N deep at "
             f"{'replayed acceptance ' + a.accept_profile if a.draft else '-'}. Steady: the median time of every "
             f"batched step (or round) of that many requests in the process, and their tokens over it (a round's: "
             f"the mean it committed; auto: at the depth it ran most, the tokens its choice expects there). {notes}. "
             f"Model: {summary}.", "",
             "| arm | decode tok/s, all requests | per request | ratio | steady step, ms (depth) | steady tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm, v in results.items():
        n = 1 if arm.startswith("engine") else int(arm.split()[1])
        med = statistics.median(v)
        sec, tokens, depth = steady.get(arm, (0.0, 0.0, 0))
        step = "— | —" if not sec else f"{sec * 1e3:.3f}{f' (mtp{depth})' if depth else ''} | {n * tokens / sec:.2f}"
        lines.append(f"| {arm} | {med:.2f} [{min(v):.2f}-{max(v):.2f}] | {med / n:.2f} | "
                     f"×{int(med / base * 1000) / 1000:.3f} | {step} |")
    print_report(lines, a.out)


if __name__ == "__main__":
    main()
