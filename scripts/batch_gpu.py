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
import datetime as _dt
import statistics
import threading
import time
from pathlib import Path

import torch

from qspec.batch import Batcher
from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.report import print_report
from qspec.bench.run import git_commit
from qspec.engine import Engine, EngineOptions


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def batch_arm(b: Batcher, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate decode tok/s of the prompts started together, over the window in which all of them decode: from
    the last request's first token to the first request's last token (the tokens each emitted in it, over its
    length). Outside it a prefill stalls the steps or fewer rows are left."""
    stamps: list[list[float]] = [[] for _ in prompts]
    gens: list[object] = [None] * len(prompts)

    def one(i: int) -> None:
        gens[i] = b.generate(prompts[i], tokens, on_token=lambda _t: stamps[i].append(time.perf_counter()))
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
    return emitted / (end - start)


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
    ap.add_argument("--profile", action="store_true",
                    help="then the largest batch's requests once more under torch.profiler: its busiest kernels")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    batches = [int(x) for x in a.batches.split(",")]
    cfg = bench_config(a.preset, layers=a.layers)
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32,
                                quant=a.quant)
    engine = Engine(model, EngineOptions(draft=0, capacity=a.prompt + a.tokens + 64, kv_type="q8_0",
                                         prefix_cache=False))
    batcher = Batcher(engine, max(batches))
    arms = ["engine"] + [f"batch {b}" for b in batches]
    results: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for r in range(a.reps + 1):  # the first: warm-up (compilation, graph captures), not reported
            for arm in arms if r % 2 else arms[::-1]:
                seed = 1000 * r + len(results[arm])
                if arm == "engine":
                    tps = engine_arm(engine, prompts_of(1, a.prompt, cfg.vocab_size, seed)[0], a.tokens)
                else:
                    n = int(arm.split()[1])
                    tps = batch_arm(batcher, prompts_of(n, a.prompt, cfg.vocab_size, seed), a.tokens)
                if r:
                    results[arm].append(tps)
        if a.profile:
            profile(batcher, prompts_of(max(batches), a.prompt, cfg.vocab_size, 99), a.tokens)
    finally:
        batcher.close()
    steady = {n: statistics.median(t) for n, t in batcher.steps.seconds.items()}
    g = batcher.runners[0].graph_stats
    graphs = f"{g.replays} replays, {g.captures} captures, {g.eager} eager steps"
    report(a, results, model.weights_summary, batcher.steps.rows / max(1, batcher.steps.steps), steady, graphs)


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


def report(a: argparse.Namespace, results: dict[str, list[float]], summary: str, mean_rows: float,
           steady: dict[int, float], graphs: str) -> None:
    commit = git_commit() or "unknown commit"
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    base = statistics.median(results["engine"])
    lines = [f"# Continuous batching on {where}, {a.preset} geometry with {a.layers} layers "
             f"({a.quant or ('bf16' if a.device == 'cuda' else 'f32')}), {commit}, {_dt.date.today()}", "",
             f"`python scripts/batch_gpu.py --layers {a.layers} --batches {a.batches} --prompt {a.prompt} --tokens "
             f"{a.tokens} --reps {a.reps}{' --quant ' + a.quant if a.quant else ''}`: greedy, {a.prompt}-token "
             f"prompts, {a.tokens} generated per request; decode tok/s of all a batch's requests together (while "
             f"all decode), median [min-max] of {a.reps} runs after a warm-up, arms alternated; ratio over the "
             f"engine's plain decoding of one request (truncated). Steady: the median time of every batched step of "
             f"that many rows in the process, a step's rows over it (tok/s). Rows per batched step over the process: "
             f"{mean_rows:.2f}; batched steps' graphs: {graphs}. Model: {summary}.", "",
             "| arm | decode tok/s, all requests | per request | ratio | steady step, ms | steady tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm, v in results.items():
        n = 1 if arm == "engine" else int(arm.split()[1])
        med = statistics.median(v)
        step = "—" if arm == "engine" or n not in steady else f"{steady[n] * 1e3:.3f} | {n / steady[n]:.2f}"
        lines.append(f"| {arm} | {med:.2f} [{min(v):.2f}-{max(v):.2f}] | {med / n:.2f} | "
                     f"×{int(med / base * 1000) / 1000:.3f} | {step if step != '—' else '— | —'} |")
    print_report(lines, a.out)


if __name__ == "__main__":
    main()
