"""Whether a second process finds the Triton kernels a first one compiled (GPU): the same model and steps in two
fresh processes, one after the other, each recording every Triton compilation through Triton's compile listener
(`knobs.compilation.listener`: the kernel, its cache key and whether the disk cache had it).

Each process draws a flash-next-geometry model of `--layers` in `--quant` on the device, runs a first request
(its steps' block products compiled ahead: qspec/precompile.py) and then compiles the block products of `--rows`
ahead (Engine.compile_ahead, as a server's batch sizes would). The report counts each process's compilations, the
second's disk-cache hits, and its misses whose cache key the first process had compiled: those should be none.

    PYTHONPATH=. python scripts/compile_cache.py --layers 8 --quant q4_k_m --rows 1,2,3,4,5,6,7,8 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def record(log: Path) -> None:
    """Every Triton compilation of this process appended to `log` as a JSON line (name, key, disk-cache hit)."""
    from triton import knobs

    lock = threading.Lock()

    def listener(*, src: Any, metadata: dict, cache_hit: bool, **_: Any) -> None:
        line = json.dumps({"name": src.name, "key": metadata.get("hash"), "hit": cache_hit,
                           "dir": os.environ.get("TRITON_CACHE_DIR")})
        with lock, log.open("a") as f:
            f.write(line + "\n")

    knobs.compilation.listener = listener


def child(a: argparse.Namespace) -> None:
    """One process: the model drawn, a first request, the rows' products compiled ahead; times printed."""
    import torch

    from qspec.bench.device_model import bench_config, device_random_model
    from qspec.engine import Engine, EngineOptions

    record(a.log)
    torch.set_grad_enabled(False)
    model = device_random_model(bench_config("flash-next", layers=a.layers), device="cuda", dtype=torch.bfloat16,
                                quant=a.quant)
    eng = Engine(model, EngineOptions(draft=0, capacity=512, kv_type="q8_0", prefix_cache=False))
    t = time.perf_counter()
    eng.generate(list(range(1000, 1008)), 8)
    first = time.perf_counter() - t
    ahead = eng.compile_ahead([int(r) for r in a.rows.split(",")])
    if ahead is not None:
        ahead.result()
    print(f"first request {first:.1f} s, then the rows' products {time.perf_counter() - t - first:.1f} s", flush=True)


def compare(first: list[dict], second: list[dict]) -> list[str]:
    """The report's lines: each process's compilations and disk-cache hits, and the second's misses of keys the
    first compiled."""
    known = {r["key"] for r in first}
    again = [r for r in second if not r["hit"] and r["key"] in known]
    lines = ["| process | compilations | disk-cache hits | misses of keys the first process compiled |",
             "|---|---:|---:|---:|"]
    for name, recs, missed in (("first", first, "—"), ("second", second, str(len(again)))):
        lines.append(f"| {name} | {len(recs)} | {sum(r['hit'] for r in recs)} | {missed} |")
    dirs = sorted({str(r["dir"]) for r in first + second})
    lines += ["", f"TRITON_CACHE_DIR seen at compilations: {', '.join(dirs)}"]
    if again:
        lines.append("compiled again: " + ", ".join(sorted({r["name"] for r in again})))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8", help="row counts whose products compile ahead")
    ap.add_argument("--out", type=Path, required=True, help="OUT.md and OUT-{first,second}.jsonl")
    ap.add_argument("--log", type=Path, help=argparse.SUPPRESS)  # set: this is a child process
    a = ap.parse_args()
    if a.log is not None:
        child(a)
        return
    recs, codes = {}, []
    for name in ("first", "second"):
        log = a.out.with_name(f"{a.out.name}-{name}.jsonl")
        log.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.run([sys.executable, __file__, "--layers", str(a.layers), "--quant", a.quant, "--rows",
                             a.rows, "--out", str(a.out), "--log", str(log)], env=env).returncode
        codes.append(f"{name} process exited with {rc}")
        recs[name] = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    lines = [f"# Triton's disk cache across two processes ({a.layers} layers, {a.quant}, rows {a.rows})", "",
             *compare(recs["first"], recs["second"]), "", "; ".join(codes)]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
