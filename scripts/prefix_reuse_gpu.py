"""Prefix reuse (EngineOptions.prefix_cache) on the GPU at the flash-next geometry: the time to the first token of
conversation turns with and without reuse, and what moving a sequence to host memory and back costs.

A random-weight model made on the device (qspec/bench/device_model.py), random prompt ids (the weights are random,
so text would mean nothing), MTP3, greedy, q8_0 KV cache. Per repetition, on fresh engines: user A's first turn
(a `--prompt`-token prompt), A's next turn (A's prompt, its reply and 64 new tokens), A's last turn again, user B's
first turn (which moves A's sequence to host memory), A's next turn (loaded back). The whole-prefill engine runs the
same prompts. Then `ModelCache.save_prefix` / `load_prefix` of A's sequence alone, timed with synchronisation.

    PYTHONPATH=. python scripts/prefix_reuse_gpu.py --layers 8 --out benchmarks/results/h200-fn8-prefix-COMMIT.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import subprocess
import time
from pathlib import Path

import torch

from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.report import print_report
from qspec.engine import Engine, EngineOptions, Generation

REPLY, TURN = 32, 64  # tokens generated a turn, new user tokens a later turn


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token_s(eng: Engine, ids: list[int]) -> tuple[float, Generation]:
    sync()
    t0, stamps = time.perf_counter(), []
    g = eng.generate(ids, REPLY, stop_ids=set(), on_token=lambda _: stamps.append(time.perf_counter()))
    return stamps[0] - t0, g


def conversation(engines: dict[str, Engine], a: list[int], b: list[int], more: list[list[int]]
                 ) -> list[tuple[str, int, int, dict[str, float]]]:
    """The turns (module docstring) on every engine, each turn's engines back to back in the dict's order ->
    (label, prompt tokens, reused by the reusing engine, first-token seconds by engine); the replies are the reusing
    engine's."""
    rows = []
    prompts: dict[str, list[int]] = {}

    def turn(label: str, ids: list[int]) -> list[int]:
        times, gens = {}, {}
        for name, eng in engines.items():
            times[name], gens[name] = first_token_s(eng, ids)
        rows.append((label, len(ids), gens["reusing"].cached_tokens, times))
        return gens["reusing"].tokens

    out = turn("A, turn 1", a)
    prompts["A2"] = a + out + more[0]
    out = turn("A, turn 2 (goes on from turn 1)", prompts["A2"])
    turn("A, turn 2 again (regenerate)", prompts["A2"])
    turn("B, turn 1 (A's sequence to host memory)", b)
    turn("A, turn 3 (A's sequence back from host memory)", prompts["A2"] + out + more[1])
    return rows


def offload_times(eng: Engine, reps: int) -> tuple[float, float, int, int]:
    """Median seconds of save_prefix and load_prefix of the engine's committed sequence, its bytes and tokens."""
    cache, n = eng.runner.cache, eng.runner.n_tokens
    saves, loads, saved = [], [], None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        saved = cache.save_prefix(n)
        t1 = time.perf_counter()
        cache.load_prefix(saved)
        sync()
        saves.append(t1 - t0)
        loads.append(time.perf_counter() - t1)
    return statistics.median(saves), statistics.median(loads), saved.nbytes if saved else 0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-next", help="flash-next; tiny (with --device cpu) tries the script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default=None, help="a quantization mix (q4_k_m, q8_0); default bf16")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg = bench_config(a.preset, layers=a.layers)
    t0 = time.perf_counter()
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32,
                                quant=a.quant)
    build_s = time.perf_counter() - t0
    opts = dict(draft=3, capacity=8192, kv_type="q8_0")
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    runs, offload = [], []
    for r in range(a.reps + 1):  # the first: warm-up (compilation, graph captures), not reported
        engines = {"reusing": Engine(model, EngineOptions(**opts)),
                   "whole prefill": Engine(model, EngineOptions(prefix_cache=False, **opts))}
        if r % 2:
            engines = dict(reversed(list(engines.items())))
        rows = conversation(engines, ids(a.prompt), ids(a.prompt), [ids(TURN), ids(TURN)])
        if r:
            runs.append(rows)
            offload.append(offload_times(engines["reusing"], 3))
        del engines
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report(a, runs, offload, build_s, model.weights_summary)


def report(a: argparse.Namespace, runs: list, offload: list, build_s: float, summary: str) -> None:
    names = ["reusing", "whole prefill"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    lines = [f"# Prefix reuse on {where}, {a.preset} geometry with {a.layers} layers "
             f"({a.quant or 'bf16'}), {commit}, {_dt.date.today()}", "",
             f"`python scripts/prefix_reuse_gpu.py --layers {a.layers}{f' --quant {a.quant}' if a.quant else ''} "
             f"--prompt {a.prompt} --reps {a.reps}`: MTP3, greedy, q8_0 KV cache, capacity 8,192; time to the first "
             f"token by engine, median of {a.reps} runs after a warm-up; reused: the reusing engine's prompt tokens "
             f"not prefilled; ratio: the whole prefill's time over the reusing engine's (truncated). Model made in "
             f"{build_s:.1f} s: {summary}.", "",
             "| turn | prompt tokens | reused | reusing (s) | whole prefill (s) | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, (label, n, reused, _) in enumerate(runs[0]):
        med = {k: statistics.median(run[i][3][k] for run in runs) for k in names}
        ratio = math.floor(med["whole prefill"] / med["reusing"] * 100) / 100
        lines.append(f"| {label} | {n:,} | {reused:,} | {med['reusing']:.4f} | {med['whole prefill']:.4f} | "
                     f"×{ratio:.2f} |")
    save = statistics.median(o[0] for o in offload)
    load = statistics.median(o[1] for o in offload)
    nbytes, n = offload[0][2], offload[0][3]
    lines += ["", f"A's sequence ({n:,} tokens committed) in host memory: {nbytes / 1e6:.1f} MB; "
              f"`save_prefix` {save * 1e3:.1f} ms ({nbytes / save / 1e9:.2f} GB/s), `load_prefix` {load * 1e3:.1f} ms "
              f"({nbytes / load / 1e9:.2f} GB/s); medians of {3 * len(offload)} calls."]
    print_report(lines, a.out)


if __name__ == "__main__":
    main()
