"""Kernel-level profile of the steps of a round at flash-next geometry (issue: GPU fast path): the target's
one-row decode step and (N+1)-row verify step, and the draft head's one-row chained step and (N+1)-row extend
step (both with the Q4 draft LM head, as the `ours` arm runs them; the extend computes one row's logits).

Runs the steps eagerly under torch.profiler and prints, per step kind: kernels launched, the sum of their
GPU times, and the kernels that take the most time; then the CUDA-graph replay time of the same step.
Run from the repo root: PYTHONPATH=. python scripts/profile_step.py --layers 8 --prompt 4096
(`--quant q4_k_m --layers 48 --kinds decode,prefill`: the quantized model's decode and prefill-chunk breakdown)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from qspec.bench.accept import AcceptProfile
from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.prompt import build_prompt
from qspec.compile_clock import CompileClock
from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.kernels import gdn_conv, gemv, hc_mix
from qspec.model import fuse
from qspec.spec.accept import AcceptHook
from qspec.weights.quant_mix import MIXES


def kernel_table(prof: profile, steps: int, top: int) -> str:
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    n = sum(e.count for e in rows) / steps
    busy = sum(e.device_time_total for e in rows) / steps / 1e3
    lines = [f"  kernels per step {n:.0f}, GPU busy {busy:.3f} ms per step"]
    for e in rows[:top]:
        lines.append(f"  {e.device_time_total / steps:9.1f} us  x{e.count / steps:6.1f}  {e.key[:110]}")
    return "\n".join(lines)


@torch.inference_mode()  # as the engine runs: its graphs' static buffers are inference tensors, written in place
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="small ops unfused")
    ap.add_argument("--kinds", default="decode,verify",
                    help="comma-separated step kinds among " + ", ".join(KINDS) + " (each pays its own first-request "
                         "compilation)")
    ap.add_argument("--no-gemv", dest="gemv", action="store_false", help="one-row products on cuBLAS")
    ap.add_argument("--no-fused-attention", dest="fused_attention", action="store_const", const=False, default=None,
                    help="masked attention through a dequantized copy of the KV cache instead of the default Triton "
                         "one-pass read (kernels/masked_attention.py)")
    for flag, (_, _, over, what) in AB_SWITCHES.items():  # an arm with engine overrides applies to --e2e too
        e2e = " (and --e2e)" if over else ""
        ap.add_argument(f"--{flag}", action="store_true",
                        help=f"also time the graphed step{e2e} with {what}, in the same process")
    ap.add_argument("--mixer-rows", type=int, default=EngineOptions.mixer_step_rows, metavar="N",
                    help="mixers of steps with up to N rows take the Triton kernels (default: the engine's, "
                         f"{EngineOptions.mixer_step_rows}, which puts MTP5's verify and extend on them; 1: only "
                         "decode and draft steps)")
    ap.add_argument("--e2e", type=int, default=0, metavar="N",
                    help="after the decode kind: plain greedy decoding of N tokens through the engine (graphs, the "
                         "host pipelined as in the benchmarks), timed, then again under the profiler: wall time per "
                         "token against the GPU's kernel time per token; after the verify kind: the same for MTP "
                         "rounds (--draft, Q4 draft head, replayed acceptance p=0.85), per round")
    ap.add_argument("--e2e-stretch", action="store_true",
                    help="with --e2e, after the decode kind: the same N tokens through an automatic-depth engine (up "
                         "to --draft) held at depth 0, one plain stretch (the draft head kept current), against "
                         "plain decoding")
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--quant", choices=sorted(MIXES), help="matrices as blocks in this llama.cpp file type's mix")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no kernel rows)")
    a = ap.parse_args()
    if not 1 <= a.mixer_rows <= hc_mix.MAX_ROWS:
        ap.error(f"--mixer-rows: 1..{hc_mix.MAX_ROWS}, got {a.mixer_rows}")
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--kinds: unknown {unknown} (known: {', '.join(KINDS)})")
    with hc_mix.step_rows_mode(a.mixer_rows):
        return profile_kinds(a, kinds)


def profile_kinds(a: argparse.Namespace, kinds: list[str]) -> int:
    """Each step kind: its eager kernel table, its graph time, and with --e2e whole requests (see main)."""
    cfg = bench_config(a.preset, layers=a.layers)
    t = time.perf_counter()
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16, quant=a.quant)
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    prompt = list(build_prompt(None, a.prompt, vocab_size=cfg.vocab_size))
    for kind in kinds:
        def engine(graphs: bool, kind: str = kind, hook: AcceptHook | None = None, **over: bool | int) -> Engine:
            opts = EngineOptions(capacity=8192, kv_type="q8_0", prefix_cache=False,
                                 draft=0 if kind == "decode" else a.draft, draft_head="q4", cuda_graphs=graphs,
                                 compile=a.compile, gemv=a.gemv, fused_attention=a.fused_attention, **over)
            return Engine(model, opts, EngineHooks(accept_hook=hook))
        eng = engine(False)
        t = time.perf_counter()
        with CompileClock() as clock:
            eng.generate(prompt, 4)
        print(f"{kind}: first request (prefill, compilation) {time.perf_counter() - t:.1f} s; compiling: "
              f"{clock.times().describe(slowest=8)}", flush=True)
        one = step_fn(eng, kind, a.draft)
        with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv):
            for _ in range(1 if kind == "prefill" else 3):  # warm kernels (a prefill step grows the context)
                one()
            sync()
            t = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    one()
                sync()
        print(f"{kind} step, eager launches ({(time.perf_counter() - t) / a.steps * 1e3:.1f} ms per step profiled):")
        print(kernel_table(prof, a.steps, a.top), flush=True)
        if kind == "prefill":  # prefill steps are not graphed
            del eng, one
            continue
        # the same step through a CUDA graph, for each A/B arm, then with the defaults (the engine left in g)
        for label, arm, over in ab_arms(a):
            with arm():
                g = engine(True, **over)
                g.generate(prompt, 2)
                one = step_fn(g, kind, a.draft)
                with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv):
                    for _ in range(3):
                        one()
                    sync()
                    t = time.perf_counter()
                    n = 50
                    for _ in range(n):
                        one()
                    sync()
            st = g.runner.graph_stats
            print(f"{kind} step through a CUDA graph{f' ({label})' if label else ''}: "
                  f"{(time.perf_counter() - t) / n * 1e3:.3f} ms "
                  f"(captures {st.captures}, replays {st.replays}); "
                  f"{replay_alone(g, 'target' if kind in ('decode', 'verify') else 'mtp')}", flush=True)
        if a.e2e and kind in ("decode", "verify"):  # plain decoding, or MTP rounds at the benchmarks' acceptance
            # each A/B arm timed only, then the defaults, also profiled
            arms = ab_arms(a)
            for i, (label, arm, over) in enumerate(arms):
                with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv), arm():
                    print((f"{label}: " if label else "") + end_to_end(
                        engine(True, hook=AcceptProfile.parse("p=0.85").hook(), **over), prompt, a.e2e, a.top,
                        profiled=i == len(arms) - 1), flush=True)
        if a.e2e and a.e2e_stretch and kind == "decode":
            with fuse.fused_mode(a.compile), gemv.enabled_mode(a.gemv):
                s = engine(True, kind="stretch", draft_auto=True, draft_auto_stretch=4096)
                s.calibrate_depths(prompt)  # a request would calibrate, forcing each depth in turn
                assert s.depth is not None
                s.depth.force = 0  # then every choice is a plain stretch, as long as the request
                print("plain stretch: " + end_to_end(s, prompt, a.e2e, a.top), flush=True)
            del s
        del eng, g, one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


KINDS = ("decode", "verify", "draft", "extend", "prefill")


ABArm = tuple[str, Callable[[], contextlib.AbstractContextManager], dict[str, bool]]


# --FLAG-ab: (the arm's label, the context for the steps called directly, engine option overrides for those run by
# `generate`, the help's description of the variant)
AB_SWITCHES: dict[str, tuple[str, Callable[[], contextlib.AbstractContextManager], dict[str, bool], str]] = {
    "mixer-ab": ("mixers compiled", lambda: hc_mix.enabled_mode(False), {},
                 "one-row hyper-connection mixers compiled instead of on their Triton kernels (kernels/hc_mix.py)"),
    "gdn-conv-ab": ("GDN conv compiled", lambda: gdn_conv.conv_kernel_mode(False), {"gdn_conv_kernel": False},
                    "GDN's step conv, silu and q/k norms compiled instead of in their Triton kernel "
                    "(kernels/gdn_conv.py, the default)"),
    "fuse-blocks-ab": ("blocks eager", lambda: fuse.blocks_mode(False), {"fuse_blocks": False},
                       "the functions around GGUF block products run eagerly (--no-fuse-blocks) instead of compiled "
                       "(the default)"),
}


def ab_arms(a: argparse.Namespace) -> list[ABArm]:
    """The variants to time in one process, each as (label, a context manager factory for the steps called
    directly, engine option overrides for those run by `generate`), the defaults last; the label is empty when there
    is nothing to compare."""
    arms: list[ABArm] = [(label, ctx, over) for flag, (label, ctx, over, _) in AB_SWITCHES.items()
                         if getattr(a, flag.replace("-", "_"))]
    return arms + [("defaults" if arms else "", contextlib.nullcontext, {})]


def end_to_end(eng: Engine, prompt: list[int], n: int, top: int, profiled: bool = True) -> str:
    """n tokens as the benchmarks run them (plain decoding, or MTP rounds when the engine drafts): tok/s with the
    host's time inside the runner's calls per token or round (the rest of the host's time is mostly waiting for
    the read-back), the last graph replayed alone, then a request profiled from its first token (after the
    prefill): kernel time per token or round and the host calls that take most."""
    eng.generate(prompt, n)  # every KV bucket's graph captured
    run = eng.runner
    host = {"step": 0.0, "keep": 0.0, "mtp_step": 0.0, "mtp_chain": 0.0, "mtp_write_kv": 0.0}
    decoding = []  # set at the first token: the prefill's steps are not counted

    def timed(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kw: object) -> object:
            t = time.perf_counter()
            out = fn(*args, **kw)
            if decoding:
                host[name] += time.perf_counter() - t
            return out
        return call
    for name in host:
        setattr(run, name, timed(name, getattr(run, name)))
    gen = eng.generate(prompt, n, on_token=lambda _: decoding.append(True))
    for name in host:
        delattr(run, name)  # the instance attributes: back to the methods
    unit, per_unit = ("round", gen.spec.rounds) if gen.spec.rounds else ("token", n)
    per = ", ".join(f"runner.{k} {v / per_unit * 1e3:.3f} ms" for k, v in host.items() if v)
    lines = [f"end to end, {n} tokens after a {len(prompt)}-token prompt, draft {eng.opts.draft}: "
             f"{gen.decode_tps:.2f} tok/s, {gen.decode_s / per_unit * 1e3:.3f} ms per {unit} ({per_unit} {unit}s); "
             f"host inside {per} per {unit}; graphs {gen.graphs}"]
    if run.graphs:  # the last graphs captured (for the KV bucket the request ended in) alone
        times: dict[tuple, float] = {}
        lines.append(replay_alone(eng, "target", times=times))
        if eng.opts.draft:
            lines.append(replay_alone(eng, "mtp", times=times))
            lines.append(replay_alone(eng, "chain", times=times))
        alone = graphs_per_unit(times, eng.opts.draft if gen.spec.rounds else 0)  # a plain stretch: per token
        if alone is not None:
            wall = gen.decode_s / per_unit * 1e3
            lines.append(f"the graphs one {unit} replays, alone: {alone:.3f} ms; end to end {wall:.3f} ms, so "
                         f"{wall - alone:.3f} ms per {unit} is GPU idle or host-bound (an upper bound: the eager "
                         f"ops between graphs count here too)")
    if not profiled:
        return "\n".join(lines)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    started = []

    def start(_: int) -> None:
        if not started:
            started.append(True)
            prof.start()
    gen = eng.generate(prompt, n, on_token=start)
    prof.stop()
    per_unit = gen.spec.rounds or n
    lines.append(f"profiled: {gen.decode_s / per_unit * 1e3:.3f} ms per {unit} (profiler overhead included)")
    lines.append(kernel_table(prof, per_unit, top).replace("per step", f"per {unit}"))
    lines.append(gap_table(prof, per_unit, top, unit))
    lines.append(span_table(prof, per_unit, top, unit))
    cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    cpu.sort(key=lambda e: -e.self_cpu_time_total)
    lines.append(f"  host calls by self time per {unit}:")
    lines += [f"  {e.self_cpu_time_total / per_unit:9.1f} us  x{e.count / per_unit:6.1f}  {e.key[:100]}"
              for e in cpu[:top]]
    return "\n".join(lines)


def gap_table(prof: profile, per_unit: int, top: int, unit: str) -> str:
    """Where the GPU idles: the union of the kernels' intervals (with PDL a kernel starts before the one ahead of it
    ends, so summed kernel times overcount), and the gaps between one kernel's end and the next start, summed by the
    pair of kernel names around them: a gap before a graph's first kernel is the host's launch arriving late, gaps
    between small eager kernels are their launches."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:
        return "  no GPU events"
    gaps: dict[tuple[str, str], list[float]] = {}
    busy = idle = 0.0
    end, last = ev[0].time_range.start, ev[0].name
    for e in ev:
        t0, t1 = e.time_range.start, e.time_range.end
        if t0 > end:
            idle += t0 - end
            gaps.setdefault((last[:40], e.name[:40]), []).append(t0 - end)
            busy += t1 - t0
        else:
            busy += max(0.0, t1 - end)
        if t1 >= end:
            end, last = t1, e.name
    lines = [f"  GPU busy (union of kernel intervals) {busy / per_unit / 1e3:.3f} ms per {unit}, idle between kernels "
             f"{idle / per_unit / 1e3:.3f} ms per {unit} (first kernel to last)", "  largest gaps (us per "
             f"{unit}, count per {unit}, median us: kernel before -> kernel after):"]
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        g.sort()
        lines.append(f"  {sum(g) / per_unit:9.1f} us  x{len(g) / per_unit:5.1f}  {g[len(g) // 2]:7.1f}  {a} -> {b}")
    return "\n".join(lines)


def span_table(prof: profile, per_unit: int, top: int, unit: str) -> str:
    """What each kernel adds to the GPU's busy time: kernels taken by end time, each credited with the part of its
    interval that no kernel ending before it covers. With PDL a kernel starts while the one ahead runs and waits, so
    its own duration overcounts; here it is credited from the end of the one ahead. Overlapping kernels of two
    streams: the overlap goes to the one that ends first. The credits add up to `gap_table`'s busy time."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.end)
    added: dict[str, list[float]] = {}
    merged: list[list[float]] = []  # the union of the intervals so far, in order
    for e in ev:
        t0, t1 = e.time_range.start, e.time_range.end
        covered, lo = 0.0, t0
        while merged and merged[-1][1] >= t0:  # the union's pieces that reach into [t0, t1], merged into one
            s0, s1 = merged.pop()
            covered += max(0.0, s1 - max(s0, t0))
            lo = min(lo, s0)
        merged.append([lo, t1])
        added.setdefault(e.name[:90], []).append(t1 - t0 - covered)
    total = sum(sum(v) for v in added.values())
    lines = [f"  busy time added per kernel (by end time): {total / per_unit / 1e3:.3f} ms per {unit}; "
             f"us per {unit}, launches per {unit}, median us added: kernel"]
    for name, v in sorted(added.items(), key=lambda kv: -sum(kv[1]))[:top]:
        v.sort()
        lines.append(f"  {sum(v) / per_unit:9.1f} us  x{len(v) / per_unit:6.1f}  {v[len(v) // 2]:7.2f}  {name}")
    return "\n".join(lines)


def replay_alone(eng: Engine, kind: str, n: int = 50, times: dict[tuple, float] | None = None) -> str:
    """The GPU time of the last graph of `kind` ("target", "mtp" or "chain") captured for each row count: its
    replays back to back, with no host work between (the graphs for the KV bucket the last request ended in).
    `times` collects ms per replay by key."""
    last = {}  # by the key without its KV length: the latest bucket's graph of each shape
    for key, g in eng.runner.graphs.items():
        if key[0] == kind:
            last[key[1:2] + key[3:]] = (key, g)
    if not last:
        return f"no {kind} graph captured"
    out = []
    for key, g in last.values():
        sync()
        t = time.perf_counter()
        for _ in range(n):
            g.graph.replay()
        sync()
        ms = (time.perf_counter() - t) / n * 1e3
        if times is not None:
            times[key] = ms
        out.append(f"{key}: {ms:.3f} ms")
    return f"{kind} graphs replayed alone, per replay: " + "; ".join(out)


def graphs_per_unit(times: dict[tuple, float], draft: int) -> float | None:
    """GPU time of the graphs one token (plain decoding) or one round replays: the target step, and with drafts
    the (N + 1)-row extend and the chain of N - 1 one-row draft steps (one graph; N - 1 replays of the one-row
    step's graph before the chain was captured whole)."""
    target = [ms for k, ms in times.items() if k[0] == "target"]
    if not draft:
        return target[-1] if target else None
    chain = [ms for k, ms in times.items() if k[0] == "chain" and k[1] == draft - 1]
    extend = [ms for k, ms in times.items() if k[0] == "mtp" and k[1] == draft + 1 and k[4]]
    if not (target and extend and (chain or draft == 1)):
        return None
    return target[-1] + (chain[-1] if chain else 0.0) + extend[-1]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_fn(eng: Engine, kind: str, draft: int) -> Callable[[], object]:
    """One step of `kind` after the engine's last request, repeatable: target steps are kept and rolled back to
    one row; draft-head steps rewrite the same cells of the head's cache (they own no rollback)."""
    run, dev = eng.runner, eng.model.device
    if kind == "prefill":  # one prompt chunk, kept (a chunk's rows cannot be rolled back)
        n = min(eng.prefill_chunk, 1024)  # the profiled steps must fit the capacity after the prompt
        rows = torch.arange(1, n + 1)

        def chunk() -> object:
            run.step(rows, logit_rows=torch.tensor([n - 1], device=dev))
            run.keep(n, rollback=False)
        return chunk
    if kind in ("decode", "verify"):
        toks = torch.arange(1, (1 if kind == "decode" else draft + 1) + 1)

        def target() -> object:
            run.step(toks)
            run.keep(1, rollback=kind == "verify")
        return target
    T = 1 if kind == "draft" else draft + 1
    toks = torch.arange(1, T + 1, device=dev)
    H = torch.randn(T, eng.model.cfg.hc_dim, device=dev, dtype=eng.model.dtype)
    row = None if kind == "draft" else T - 1
    return lambda: run.mtp_step(toks, H, run.n_tokens, eng.draft_lm_head, row=row)


if __name__ == "__main__":
    sys.exit(main())
