"""The seed's measurement protocol, run in one process over several arms.

Protocol ("Measurement details" of the seed): greedy decoding, one sequence, q8_0 K/V caches, an 8K context
capacity, a 32-token warmup generation per arm before measuring, no prompt caching (every run is a fresh
`generate`, which resets all caches), and decode speed = generated tokens / decode seconds with prefill timed
separately. Generation ignores stop tokens so every run produces exactly the requested count (the seed's logs
record 512 generated tokens for every scored run). Arms alternate within the process (A B C, C B A, ...) so slow
drift (clocks, thermals, allocator state) lands on every arm alike; each arm's runs are summarized by their median
and range.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qspec.bench.accept import AcceptProfile
from qspec.bench.arms import Arm
from qspec.bench.prompt import BenchPrompt, build_prompt
from qspec.engine import Engine, EngineHooks, Generation, cells_needed
from qspec.model.model import Model
from qspec.runner import ContextError

SCHEMA = "qspec-bench/1"
MERGE_PROMPT_TOKENS = 4096
MERGE_GEN_TOKENS = 512
MERGE_REPS = 3
SWEEP_CONTEXTS = (512, 1024, 2048, 4096, 6144)
SWEEP_GEN_TOKENS = 128
SWEEP_REPS = 5
CAPACITY = 8192
WARMUP_TOKENS = 32
KV_TYPE = "q8_0"


@dataclass
class Protocol:
    benchmark: str  # merge | sweep
    prompt_tokens: list[int]
    gen_tokens: int
    reps: int
    arms: list[Arm]
    accept: AcceptProfile = field(default_factory=AcceptProfile)
    capacity: int = CAPACITY
    warmup: int = WARMUP_TOKENS
    kv_type: str = KV_TYPE

    def as_dict(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark, "prompt_tokens": list(self.prompt_tokens), "gen_tokens": self.gen_tokens,
            "reps": self.reps, "warmup_tokens": self.warmup, "capacity": self.capacity, "kv_type": self.kv_type,
            "greedy": True, "sequences": 1, "prompt_caching": False, "stop_tokens": "ignored",
            "order": "arms alternate within one process (A B C, C B A, ...); warmup per arm and prompt length",
            "decode_speed": "generated tokens / decode seconds (prefill excluded, measured separately)",
        }


def check_capacity(proto: Protocol) -> None:
    """Raise ContextError, before anything runs, for any (arm, prompt) that would not fit the cache.

    Same rule as Engine.generate: prompt + generated + draft rows (depth + 1) <= capacity."""
    if proto.capacity % 4:
        raise ContextError(f"context capacity must be a multiple of 4, got {proto.capacity}")
    gen = max(proto.gen_tokens, proto.warmup)
    bad = []
    for p in proto.prompt_tokens:
        for arm in proto.arms:
            need = cells_needed(p, gen, arm.draft)
            if need > proto.capacity:
                bad.append(f"{arm.name} at {p} prompt tokens needs {need}")
    if bad:
        raise ContextError(f"prompt + generated ({gen}) + draft rows exceed the context capacity "
                           f"{proto.capacity}: {'; '.join(bad)} (raise --ctx or shorten the prompt)")


# ---- environment ---------------------------------------------------------------------------------------------------
def git_commit() -> str | None:
    """HEAD of the checkout qspec runs from, with "-dirty" when tracked files differ from it (a copied
    working tree, uncommitted edits), or None (not a checkout, no git, ...)."""
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                           check=False)
        if r.returncode != 0 or not r.stdout.strip():
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True, timeout=30,
                               check=False).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "device_memory_bytes": props.total_memory}
    else:
        env["device_name"] = env["cpu"]
    return env


# ---- progress ------------------------------------------------------------------------------------------------------
class _LineProgress:
    """Fallback when tqdm is missing: one rewritten stderr line."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.end = "\x1b[K" if sys.stderr.isatty() else "\n"  # logs get one line per run, not \r soup

    def set_postfix_str(self, s: str) -> None:
        self.post = s

    def update(self, n: int = 1) -> None:
        self.n += n
        sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {getattr(self, 'post', '')}{self.end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.end != "\n":
            sys.stderr.write("\n")
            sys.stderr.flush()


class _NoProgress:
    def set_postfix_str(self, s: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="run", dynamic_ncols=True)


# ---- one run -------------------------------------------------------------------------------------------------------
def _run_record(arm: Arm, rep: int, prompt: BenchPrompt, gen: Generation, n_requested: int,
                peak_mem: int | None) -> dict[str, Any]:
    n = len(gen.tokens)
    cols: dict[str, list[int]] = {}
    for r in gen.rounds_log:
        for k, v in r.items():
            cols.setdefault(k, []).append(int(v))
    return {
        "arm": arm.name, "rep": rep,
        "prompt_tokens": gen.prompt_tokens, "prompt_sha256": prompt.sha256,
        "generated_tokens": n, "requested_tokens": n_requested, "stop_reason": gen.stop_reason,
        "prefill_s": gen.prefill_s, "decode_s": gen.decode_s,
        "decode_tps": n / gen.decode_s if gen.decode_s > 0 else 0.0,
        "prefill_tps": gen.prefill_tps,
        "acceptance_by_position": [round(x, 6) for x in gen.spec.acceptance_by_position()],
        "spec": gen.spec.as_dict(),
        "pooled": gen.pooled,
        "snapshots": gen.snapshots,
        "rounds": cols,
        "depth": gen.depth,  # an automatic-depth arm's choices (spec/depth.py)
        "output_sha256": hashlib.sha256(",".join(map(str, gen.tokens)).encode()).hexdigest(),
        "peak_memory_bytes": peak_mem,
        # CUDA graphs captured during this run: step shapes the warm-up did not meet, compiled and captured inside
        # the timed decode (the report names such runs)
        "graph_captures": int(gen.graphs.get("captures", 0)),
    }


def summarize(runs: list[dict[str, Any]], prompt_tokens: Sequence[int], arms: Sequence[str], ref: str,
              replayed: bool) -> list[dict[str, Any]]:
    """Per (prompt length, arm): median and range of decode tok/s, change vs the reference arm, acceptance."""
    out = []
    for p in prompt_tokens:
        ref_runs = [r for r in runs if r["arm"] == ref and r["prompt_tokens"] == p]
        ref_med = statistics.median(r["decode_tps"] for r in ref_runs) if ref_runs else None
        ref_out = {r["output_sha256"] for r in ref_runs}
        for name in arms:
            rs = [r for r in runs if r["arm"] == name and r["prompt_tokens"] == p]
            if not rs:
                continue
            tps = [r["decode_tps"] for r in rs]
            med = statistics.median(tps)
            rounds = sum(r["spec"]["rounds"] for r in rs)
            accepted = sum(r["spec"]["accepted"] for r in rs)
            drafted_at: list[int] = []
            accepted_at: list[float] = []
            for r in rs:  # pooled per-position acceptance over all runs, weighted by rounds
                for i, a in enumerate(r["acceptance_by_position"]):
                    while len(drafted_at) <= i:
                        drafted_at.append(0)
                        accepted_at.append(0.0)
                    drafted_at[i] += r["spec"]["rounds"]
                    accepted_at[i] += a * r["spec"]["rounds"]
            outs = {r["output_sha256"] for r in rs}
            out.append({
                "arm": name, "prompt_tokens": p, "n": len(rs),
                "decode_tps_median": med, "decode_tps_min": min(tps), "decode_tps_max": max(tps),
                "decode_tps_runs": tps,
                "prefill_tps_median": statistics.median(r["prefill_tps"] for r in rs),
                "vs_reference": (med / ref_med - 1.0) if ref_med else None,
                "mean_accepted": accepted / rounds if rounds else None,
                "tokens_per_round": (sum(r["spec"]["tokens"] for r in rs) / rounds) if rounds else None,
                "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at, strict=True)],
                "distinct_outputs": len(outs),
                # replayed acceptance commits whatever was drafted: outputs differ by design, so no verdict
                "same_output_as_reference": (outs == ref_out) if ref_out and name != ref and not replayed
                else None,
            })
    return out


def _check_protocol(proto: Protocol) -> None:
    """A protocol that can run: reps and generated tokens >= 1, some arms, every request within the capacity."""
    if proto.reps < 1:
        raise ValueError(f"reps must be >= 1, got {proto.reps}")
    if proto.gen_tokens < 1:
        raise ValueError(f"generated tokens must be >= 1, got {proto.gen_tokens}")
    if not proto.arms:
        raise ValueError("no arms to run")
    check_capacity(proto)


def run_protocol(model: Model, tokenizer: Any | None, proto: Protocol, *, model_info: dict[str, Any] | None = None,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every arm over every prompt length; returns the result dict (see `SCHEMA`).

    tokenizer: for the prompt (None: Qwen ids modulo the model vocabulary). checkpoint: called with the partial
    result (`complete: False`) after every measured run, so a process killed by a time limit keeps what it
    measured. Raises ContextError before any run when a request would not fit, ValueError for arms the model
    cannot run (drafting without MTP weights)."""
    _check_protocol(proto)
    say = log or (lambda s: print(s, file=sys.stderr))
    dev = model.device
    started = time.time()

    prompts = {p: build_prompt(tokenizer, p, vocab_size=model.cfg.vocab_size) for p in proto.prompt_tokens}
    engines: dict[str, Engine] = {}
    for arm in proto.arms:
        # a fresh hook per arm: each restarts its stream at round 0 of every generation
        hooks = EngineHooks(accept_hook=proto.accept.hook() if arm.draft else None)
        engines[arm.name] = Engine(model, arm.options(capacity=proto.capacity, kv_type=proto.kv_type), hooks)

    ref = "baseline" if any(a.name == "baseline" for a in proto.arms) else proto.arms[0].name
    env = environment(dev)
    names = [a.name for a in proto.arms]
    runs: list[dict[str, Any]] = []

    def result(complete: bool) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "benchmark": proto.benchmark,
            "label": proto.accept.label,
            "complete": complete,
            "acceptance": proto.accept.as_dict(),
            "protocol": proto.as_dict(),
            "model": model_info or {},
            "environment": env,
            "prompts": {str(p): prompts[p].meta for p in proto.prompt_tokens},
            "arms": [a.as_dict() for a in proto.arms],
            "reference_arm": ref,
            "runs": runs,
            "summary": summarize(runs, proto.prompt_tokens, names, ref, proto.accept.replayed),
            "started_at": _dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(timespec="seconds"),
            "wall_s": time.time() - started,
        }

    n_warm = len(proto.arms) if proto.warmup > 0 else 0
    total = len(proto.prompt_tokens) * (n_warm + proto.reps * len(proto.arms))
    if progress:
        say(f"bench {proto.benchmark}: {len(proto.arms)} arms x {proto.reps} reps x prompts {proto.prompt_tokens}, "
            f"{proto.gen_tokens} generated tokens, {proto.accept.label}")
    bar = _progress(total, f"bench {proto.benchmark}", progress)
    try:
        for p in proto.prompt_tokens:
            ids = list(prompts[p])
            if proto.warmup > 0:
                for arm in proto.arms:
                    bar.set_postfix_str(f"warmup {arm.name} @{p}")
                    engines[arm.name].generate(ids, proto.warmup)
                    bar.update()
            for rep in range(proto.reps):
                order = proto.arms if rep % 2 == 0 else proto.arms[::-1]
                for arm in order:
                    bar.set_postfix_str(f"{arm.name} @{p} rep {rep + 1}/{proto.reps}")
                    if dev.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(dev)
                    gen = engines[arm.name].generate(ids, proto.gen_tokens)
                    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
                    rec = _run_record(arm, rep, prompts[p], gen, proto.gen_tokens, peak)
                    runs.append(rec)
                    bar.set_postfix_str(f"{arm.name} @{p}: {rec['decode_tps']:.2f} tok/s")
                    bar.update()
                    if rec["generated_tokens"] != proto.gen_tokens:
                        say(f"warning: {arm.name} generated {rec['generated_tokens']} of {proto.gen_tokens} tokens")
                    if checkpoint is not None:
                        checkpoint(result(complete=False))
    finally:
        bar.close()
    return result(complete=True)


def prompt_lengths(values: Sequence[int] | str) -> list[int]:
    """`512,1024,2K,4k` -> [512, 1024, 2048, 4096]."""
    items = values.split(",") if isinstance(values, str) else [str(v) for v in values]
    out = []
    for it in items:
        s = it.strip().lower()
        if not s:
            continue
        mult = 1024 if s.endswith("k") else 1
        try:
            n = int(s[:-1] if mult > 1 else s) * mult
        except ValueError as e:
            raise ValueError(f"prompt length {it!r} is not an integer (or NK)") from e
        if n < 1:
            raise ValueError(f"prompt length must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise ValueError("no prompt lengths given")
    return out
