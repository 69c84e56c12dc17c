"""Kernel-level profile of one decode step and one verify step at flash-next geometry (issue: GPU fast path).

Runs the steps eagerly under torch.profiler and prints, per step kind: kernels launched, the sum of their
GPU times, and the kernels that take the most time; then the CUDA-graph replay time of the same step.
Run from the repo root: PYTHONPATH=. python scripts/profile_step.py --layers 8 --prompt 4096
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.prompt import build_prompt
from qspec.engine import Engine, EngineOptions
from qspec.kernels import gemv
from qspec.model import fuse
from qspec.runner import Runner


def kernel_table(prof: profile, steps: int, top: int) -> str:
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    n = sum(e.count for e in rows) / steps
    busy = sum(e.device_time_total for e in rows) / steps / 1e3
    lines = [f"  kernels per step {n:.0f}, GPU busy {busy:.3f} ms per step"]
    for e in rows[:top]:
        lines.append(f"  {e.device_time_total / steps:9.1f} us  x{e.count / steps:6.1f}  {e.key[:110]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="small ops unfused")
    ap.add_argument("--steps-kind", choices=("both", "decode", "verify"), default="both",
                    help="profile only one kind of step (each pays its own first-request compilation)")
    ap.add_argument("--no-gemv", dest="gemv", action="store_false", help="one-row products on cuBLAS")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg = bench_config("flash-next", layers=a.layers)
    t = time.perf_counter()
    model = device_random_model(cfg, device="cuda", dtype=torch.bfloat16)
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    prompt = list(build_prompt(None, a.prompt, vocab_size=cfg.vocab_size))
    kinds = [(k, T) for k, T in (("decode", 1), ("verify", a.draft + 1)) if a.steps_kind in ("both", k)]
    for kind, T in kinds:
        eng = Engine(model, EngineOptions(capacity=8192, kv_type="q8_0", draft=a.draft if T > 1 else 0,
                                          cuda_graphs=False, compile=a.compile, gemv=a.gemv))
        t = time.perf_counter()
        eng.generate(prompt, 4)
        print(f"{kind}: first request (prefill, compilation) {time.perf_counter() - t:.1f} s", flush=True)
        run = eng.runner
        toks = torch.arange(1, T + 1)
        with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv):
            for _ in range(3):  # warm kernels
                run.step(toks)
                run.keep(1, rollback=T > 1)
            torch.cuda.synchronize()
            prof = profiled(run, toks, a.steps)
        print(f"{kind} step, T={T}, eager launches:")
        print(kernel_table(prof, a.steps, a.top), flush=True)
        # the same step through a CUDA graph
        g = Engine(model, EngineOptions(capacity=8192, kv_type="q8_0", draft=a.draft if T > 1 else 0,
                                        compile=a.compile, gemv=a.gemv))
        g.generate(prompt, 2)
        gr = g.runner
        with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv):
            for _ in range(3):
                gr.step(toks)
                gr.keep(1, rollback=T > 1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            n = 50
            for _ in range(n):
                gr.step(toks)
                gr.keep(1, rollback=T > 1)
            torch.cuda.synchronize()
        print(f"{kind} step through a CUDA graph: {(time.perf_counter() - t) / n * 1e3:.3f} ms "
              f"(captures {gr.graph_stats.captures}, replays {gr.graph_stats.replays})", flush=True)
        del eng, g
        torch.cuda.empty_cache()
    return 0


def profiled(run: Runner, toks: torch.Tensor, steps: int) -> profile:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.step(toks)
            run.keep(1, rollback=toks.shape[0] > 1)
        torch.cuda.synchronize()
    return prof


if __name__ == "__main__":
    sys.exit(main())
