"""Loading a large quantized GGUF, as a user's first run does: load time, host memory, first token.

Writing: the flash-next preset's tensors (`--layers`, the n-gram table shrunk as the benchmarks' is) are drawn one at
a time on `--device`, quantized there in llama.cpp's `--quant` per-tensor types, and written as a GGUF (the model
never sits in host memory). Then a fresh process loads the file with its pages dropped from the page cache (read
from the disk, as on a first run) and reports: the load's wall time, the process's peak resident memory (the load's
host footprint; the file's pages are not kept), the device memory after it, then the first token of a 64-token
prompt (compilation and graph capture included) and the decode speed of the next 128 tokens (plain, greedy). A
second fresh process then loads it again (pages dropped again) with the compilation caches the first one left on
the disk: the first token a user sees on a later start. Both use compilation caches of their own (a new directory,
removed at the end), so the first is cold on any machine; `--compile-prefill` compiles the prompt's steps,
`--reuse-file` skips the write when the file is there.

    PYTHONPATH=. python scripts/gguf_load.py --layers 32 --quant q4_k_m --file /tmp/fn32.gguf --out RESULT_PREFIX

On the CPU (`--device cpu --layers 1 --preset tiny`) it is a smoke run of itself.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from qspec.bench.device_model import bench_config, device_random_model, device_tensor
from qspec.compile_ahead import load_compiling_ahead
from qspec.compile_clock import CompileClock
from qspec.config import ModelConfig
from qspec.weights.gguf_io import write_gguf
from qspec.weights.names import tensor_shapes
from qspec.weights.quant_mix import MIXES, mix_plan

RESULT = "gguf_load result: "


class DrawnTensors(Mapping[str, torch.Tensor]):
    """The config's tensors, each drawn on the device when the writer asks for it (one at a time)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.shapes = tensor_shapes(cfg)

    def __getitem__(self, name: str) -> torch.Tensor:
        return device_tensor(self.cfg, name, self.shapes[name], device=self.device, dtype=self.dtype, seed=0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write(a: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_config(a.preset, layers=a.layers)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    write_gguf(a.file, cfg, DrawnTensors(cfg, dev, torch.bfloat16), qtypes=mix_plan(a.quant, cfg))
    return {"layers": cfg.n_layers, "quant": a.quant, "file_bytes": os.path.getsize(a.file),
            "write_s": time.perf_counter() - t0}


def drop_cached_pages(path: str) -> None:
    """The file's pages out of the page cache (written pages flushed first), so the load reads the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _report_so_far(out: dict[str, Any]) -> None:
    """The child's results so far, one line each time (a time limit that cuts the run keeps what was measured)."""
    print(RESULT + json.dumps(out), flush=True)


def _measure_in_child(a: argparse.Namespace, tokens: int, env: dict[str, str], profile: Path | None = None
                      ) -> dict[str, Any] | None:
    """load() in a fresh process, its lines echoed as they come; the last result it reported (None: none, or a
    failed child, whose output then goes to stderr). profile: where the child writes its first request's profile."""
    cmd = [sys.executable, __file__, "--load-only", "--device", a.device, "--tokens", str(tokens)]
    cmd += ["--drawn", "--preset", a.preset, "--layers", str(a.layers), "--quant", a.quant] if a.drawn else [
        "--file", a.file]
    cmd += ["--profile-first", str(profile)] if profile else []
    cmd += ["--compile-prefill"] if a.compile_prefill else []
    cmd += ["--no-compile"] if not a.compile else []
    cmd += ["--no-precompile"] if not a.precompile else []
    cmd += ["--compile-ahead"] if a.compile_ahead else []
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as child:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            if line.startswith(RESULT):
                print(line, end="", flush=True)
    results = [x for x in lines if x.startswith(RESULT)]
    if child.returncode or not results:
        print("".join(lines), file=sys.stderr)
        return None
    return json.loads(results[-1][len(RESULT):])


def load(a: argparse.Namespace) -> dict[str, Any]:
    from qspec.engine import Engine, EngineOptions
    from qspec.loader import load_model

    dev = torch.device(a.device)
    opts = EngineOptions(draft=0, capacity=1024, prefix_cache=False, compile=a.compile,
                         compile_prefill=a.compile_prefill, precompile=a.precompile)

    def prompt_for(cfg: ModelConfig) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()

    alone: list[float] = []

    def timed_load() -> Any:
        t = time.perf_counter()
        if a.drawn:
            m = device_random_model(bench_config(a.preset, layers=a.layers), device=dev, dtype=torch.bfloat16,
                                    quant=a.quant)
        else:
            m = load_model(a.file, device=dev, progress=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        alone.append(time.perf_counter() - t)
        return m

    rss0 = peak_rss()
    said: list[str] = []
    t0 = time.perf_counter()
    with CompileClock() as clock:
        model = (load_compiling_ahead(Path(a.file), timed_load, opts, prompt_for, device=dev, dtype=torch.bfloat16,
                                      with_mtp=False, say=said.append)
                 if a.compile_ahead else timed_load())
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "load_alone_s": alone[0], "rss_before_load": rss0,
                           "peak_rss": peak_rss(), "weights": model.weights_summary}
    if a.compile_ahead:
        out["stand_in"] = " ".join(said)
        out["stand_in_compile"] = clock.times().as_dict()
    if dev.type == "cuda":
        out["device_bytes"] = torch.cuda.memory_allocated()
    _report_so_far(out)
    eng = Engine(model, opts)
    prompt = prompt_for(model.cfg)
    stamps: list[float] = []
    t1 = time.perf_counter()
    prof = cProfile.Profile() if a.profile_first else None
    so_far: list[dict[str, Any]] = []  # what had compiled by each token (the prefill's, each step's)

    def on_token(_t: int) -> None:
        stamps.append(time.perf_counter())
        so_far.append(clock.times().as_dict())

    with CompileClock() as clock, prof or contextlib.nullcontext():
        first = eng.generate(prompt, 3, on_token=on_token)
    if prof is not None:
        _write_profile(prof, a.profile_first)
    # the first token ends the prefill; the second is the first decode step (its shape's compilation), the third
    # the first replay of what that step compiled
    out["first_token_s"], out["second_token_s"], out["third_token_s"] = (x - t1 for x in stamps)
    out["first_prefill_s"] = first.prefill_s
    out["first_request_compile"] = clock.times().as_dict()
    out["compiled_by_token"] = so_far
    _report_so_far(out)
    if a.tokens:
        with CompileClock() as clock:
            out["decode_tps_second_request"] = eng.generate(prompt, a.tokens).decode_tps
        out["second_request_compile"] = clock.times().as_dict()
    out["peak_rss_end"] = peak_rss()
    return out


def _write_profile(prof: cProfile.Profile, path: Path) -> None:
    """The functions that took the most time: by cumulative time, then by their own time."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())


def report(res: dict[str, Any]) -> str:
    gib = 2 ** 30
    if res.get("drawn"):
        lines = [f"# First tokens of a {res['layers']}-layer {res['quant']} model built on the device (no file)", "",
                 "| step | result |", "|---|---:|",
                 f"| the weights drawn and quantized on the device | {res['load_alone_s']:.1f} s |"]
    else:
        lines = [f"# Loading a {res['layers']}-layer {res['quant']} GGUF ({res['file_bytes'] / gib:.2f} GiB)", "",
                 "| step | result |", "|---|---:|",
                 f"| write (drawn and quantized on the device) | {res['write_s']:.1f} s |",
                 f"| load, pages dropped from the cache first | {res['load_alone_s']:.1f} s "
                 f"({res['file_bytes'] / gib / max(res['load_alone_s'], 1e-9):.2f} GiB/s) |"]
    if not res.get("compile", True):
        lines[0] += ", the steps' small ops not compiled (--no-compile)"
    lines += [f"| peak resident host memory after the load (before it) | {res['peak_rss'] / gib:.2f} GiB "
              f"({res['rss_before_load'] / gib:.2f}) |"]
    if "device_bytes" in res:
        lines.append(f"| device memory after the load | {res['device_bytes'] / gib:.2f} GiB |")
    if res.get("compile_ahead"):
        lines.append(f"| the load alone; with a stand-in compiling beside it, until both ended | "
                     f"{res['load_alone_s']:.1f} s; {res['load_s']:.1f} s ({res['stand_in_compile']['described']}) |")
    lines += [f"| first / second / third token of a 64-token prompt after the load (compilation, graph capture) | "
              f"{res['first_token_s']:.1f} / {res['second_token_s']:.1f} / {res['third_token_s']:.1f} s |"]
    if "warm" in res:
        w = res["warm"]
        lines += [f"| again in a fresh process, the compilation caches warm: load; first / second / third token | "
                  f"{w['load_s']:.1f} s; **{w['first_token_s']:.1f}** / {w['second_token_s']:.1f} / "
                  f"{w['third_token_s']:.1f} s |"]
    lines += [
              f"| plain decoding, second request, {res['tokens']} tokens | {res['decode_tps_second_request']:.2f} "
              f"tok/s |", f"| peak resident host memory at the end | {res['peak_rss_end'] / gib:.2f} GiB |",
              "", f"Weights as loaded: {res['weights']}", "", "Compiled in the first process's first request: "
              + res["first_request_compile"]["described"]]
    if res.get("compiled_by_token"):
        lines += ["", "Compiled by the first / second / third token (torch.compile s, Triton s, Triton variants): "
                  + " / ".join(f"{c['torch_s'] or 0:.1f}, {c['triton_s']:.1f}, {c['triton_kernels']}"
                               for c in res["compiled_by_token"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quant", default="q4_k_m", choices=sorted(MIXES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--file", help="the GGUF to write, then load (required unless --drawn)")
    ap.add_argument("--drawn", action="store_true",
                    help="no file: each process builds the model on the device (random weights quantized there in "
                         "--quant's types), for first tokens of a model whose file does not fit the disk")
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens of the second request")
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="the prompt's steps compile their small ops too (EngineOptions.compile_prefill on)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="no torch.compile of the steps' small ops (EngineOptions.compile off): nothing to trace "
                         "before the first decode steps, slower steady decoding")
    ap.add_argument("--no-precompile", dest="precompile", action="store_false",
                    help="no compiling of the decode step's products beside the prefill (EngineOptions.precompile off)")
    ap.add_argument("--compile-ahead", action="store_true",
                    help="compile on a stand-in while the weights load (qspec/compile_ahead.py), as `qspec run` does")
    ap.add_argument("--reuse-file", action="store_true", help="load --file as it is when it exists (no write)")
    ap.add_argument("--profile-warm", type=Path, metavar="FILE",
                    help="profile the warm process's first request (cProfile, which slows it) into FILE")
    ap.add_argument("--profile-cold", type=Path, metavar="FILE",
                    help="profile the cold process's first request (cProfile, which slows it) into FILE")
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)  # the measuring child process
    ap.add_argument("--profile-first", type=Path, help=argparse.SUPPRESS)  # the child: profile its first request
    a = ap.parse_args()
    if a.file is None and not a.drawn:
        ap.error("--file is required unless --drawn")
    torch.set_grad_enabled(False)
    if a.load_only:
        _report_so_far(load(a))
        return 0
    if a.drawn:
        if a.compile_ahead:
            ap.error("--drawn builds the model on the device: there is no file load for --compile-ahead to overlap")
        res = {"layers": a.layers, "quant": a.quant, "file_bytes": 0, "write_s": 0.0, "drawn": True}
    elif a.reuse_file and os.path.exists(a.file):
        res = {"layers": a.layers, "quant": a.quant, "file_bytes": os.path.getsize(a.file), "write_s": 0.0}
    else:
        res = write(a)
    res |= {"tokens": a.tokens, "device": a.device, "compile_prefill": a.compile_prefill, "precompile": a.precompile,
            "compile_ahead": a.compile_ahead, "compile": a.compile}
    if not a.drawn:
        print(f"{'reused' if not res['write_s'] else 'wrote'} {res['file_bytes'] / 2 ** 30:.2f} GiB "
              f"in {res['write_s']:.1f} s", flush=True)
    # compilation caches of their own, empty at first, whatever earlier runs left on this machine
    caches = tempfile.mkdtemp(prefix="gguf_load-caches-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
    for i in range(2):  # a fresh process each time: the first compiles into empty caches, the second reuses them
        if not a.drawn:
            drop_cached_pages(a.file)
        run = _measure_in_child(a, a.tokens if i == 0 else 0, env, a.profile_warm if i else a.profile_cold)
        if run is None:
            return 1
        res |= run if i == 0 else {"warm": run}
    shutil.rmtree(caches, ignore_errors=True)
    text = report(res)
    print(text)
    if a.out:
        a.out.with_suffix(".md").write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
