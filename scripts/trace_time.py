"""How long dynamo takes to trace a first request's fused functions, static sizes against symbolic ones (CPU).

A tiny model in llama.cpp's Q4_K_M mix, written to a temporary GGUF, runs one request per arm in a fresh process
with torch.compile's "aot_eager" backend (dynamo's tracing and functionalisation, no code generation), so the
seconds are the tracing a warm GPU process also pays before it reads inductor's cache. Arms: the default (static
sizes for steps of up to fuse.STATIC_MAX_ROWS rows) and every function with symbolic sizes (STATIC_MAX_ROWS = 0).

    PYTHONPATH=. python scripts/trace_time.py --out benchmarks/results/trace-time-cpu.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def child(path: str, draft: int, symbolic: bool, tokens: int) -> dict[str, float]:
    from qspec.compile_clock import CompileClock
    from qspec.engine import Engine
    from qspec.loader import load_model
    from qspec.model import fuse
    from qspec.options import EngineOptions

    if symbolic:
        fuse.STATIC_MAX_ROWS = 0
    model = load_model(path, dequantize_all=False)
    eng = Engine(model, EngineOptions(compile_backend="aot_eager", draft=draft, capacity=256, kv_type="q8_0",
                                      prefix_cache=False))
    t = time.perf_counter()
    with CompileClock() as clock:
        eng.generate(list(range(3, 45)), tokens)
    return {"request_s": time.perf_counter() - t, "torch_s": clock.times().torch_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--out", type=Path, help="write the table to OUT")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # path draft symbolic
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.child[2] == "1", a.tokens)))
        return 0
    from qspec.config import preset
    from qspec.loader import write_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tiny-q4_k_m.gguf"
        write_model(path, preset("tiny", vocab_size=512, mtp=True), quant="q4_k_m")
        rows = []
        for draft in (0, 3):
            res = {}
            for symbolic in (False, True):
                out = subprocess.run([sys.executable, __file__, "--tokens", str(a.tokens), "--child", path,
                                      str(draft), "1" if symbolic else "0"], check=True, capture_output=True, text=True)
                res[symbolic] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(f"| {'plain' if not draft else f'MTP{draft}'} | {res[False]['torch_s']:.1f} s | "
                        f"{res[True]['torch_s']:.1f} s | ×{res[True]['torch_s'] / res[False]['torch_s']:.2f} |")
    text = "\n".join([f"# dynamo's tracing of a first request ({a.tokens} tokens), tiny Q4_K_M model, CPU", "",
                      "| decoding | static sizes (default) | symbolic sizes | symbolic ÷ static |",
                      "|---|---:|---:|---:|",
                      *rows, ""])
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
