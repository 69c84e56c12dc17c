"""A server's warm-up without the server: `qspec serve`'s warm-up (qspec/cli.py `_warm_up`: a request alone, then
every batch size's steps) on a model of random weights drawn on the device in `--quant`'s types, each part's line
naming its seconds, torch.compile's seconds and graphs, and the Triton variants it compiled. Skips writing a GGUF and
the HTTP side, so a fresh GPU machine's warm-up fits one command's time. On the CPU (`--device cpu --preset tiny
--backend aot_eager`) it counts the graphs each part traces. `--static-rows 1` (EngineOptions.static_rows) compiles
every step of more than one row with symbolic sizes: one graph for all batch sizes instead of one per size, each
traced several times slower.

    PYTHONPATH=. python scripts/serve_warmup.py --layers 8 --quant q4_k_m --max-batch 8
    PYTHONPATH=. python scripts/serve_warmup.py --device cpu --preset tiny --layers 4 --backend aot_eager
"""

from __future__ import annotations

import argparse
import time

import torch

from qspec.batch import Batcher
from qspec.bench.device_model import bench_config, device_random_model
from qspec.cli import _warm_up
from qspec.engine import Engine, EngineOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend (the CPU compiles with another)")
    ap.add_argument("--static-rows", type=int, default=EngineOptions.static_rows)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    t = time.perf_counter()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = device_random_model(bench_config(a.preset, layers=a.layers), device=a.device, dtype=dtype, quant=a.quant)
    engine = Engine(model, EngineOptions(draft=0, capacity=a.ctx, kv_type="q8_0", compile_backend=a.backend,
                                         static_rows=a.static_rows))
    batcher = Batcher(engine, a.max_batch) if a.max_batch > 1 else None
    print(f"model drawn and engine made in {time.perf_counter() - t:.1f} s", flush=True)
    _warm_up(engine, batcher, list(range(1000, 1008)), 8)  # the server's prompt is "Hello": 8 tokens


if __name__ == "__main__":
    main()
