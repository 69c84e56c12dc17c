"""A server's warm-up without the server (GPU): `qspec serve`'s warm-up (qspec/cli.py `_warm_up`: a request alone,
then every batch size's steps) on a flash-next-geometry model drawn on the device in `--quant`'s types, each part's
line naming its seconds, torch.compile's seconds and the Triton variants it compiled. Skips writing a GGUF and the
HTTP side, so a fresh machine's warm-up is measured within one command's time.

    PYTHONPATH=. python scripts/warmup_gpu.py --layers 8 --quant q4_k_m --max-batch 8
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
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    t = time.perf_counter()
    model = device_random_model(bench_config("flash-next", layers=a.layers), device="cuda", dtype=torch.bfloat16,
                                quant=a.quant)
    engine = Engine(model, EngineOptions(draft=0, capacity=a.ctx, kv_type="q8_0"))
    batcher = Batcher(engine, a.max_batch) if a.max_batch > 1 else None
    print(f"model drawn and engine made in {time.perf_counter() - t:.1f} s", flush=True)
    _warm_up(engine, batcher, list(range(1000, 1008)), 8)  # the server's prompt is "Hello": 8 tokens


if __name__ == "__main__":
    main()
