"""The host's bookkeeping of one speculative round, with the model stubbed out: `Runner.step` (cell table, pooled-key
update plan and its upload) and `Runner.keep` (recurrent commit, seq_rm, pooled-key retention) for an (N+1)-row
verify step after a prompt of P tokens, at the flash-next pooling ratio. No GPU and no model math: what the engine's
Python costs per round on this machine's CPU, which the GPU's queued work must cover (BENCHMARKS.md §3).

Run from the repo root: PYTHONPATH=. python scripts/host_round.py [--prompt 4096] [--draft 5] [--rounds 500]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from qspec.config import preset
from qspec.engine import EngineOptions
from qspec.model.model import Model
from qspec.runner import Runner
from qspec.weights.random_model import random_weights


class _NoMath(torch.nn.Module):
    """Stands in for the model's forward: the runner's host work runs, the model's math does not."""

    device = torch.device("cpu")

    def forward(self, tokens: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(tokens.shape[0], 1), torch.zeros(tokens.shape[0], 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=500)
    a = ap.parse_args()
    if a.prompt < 1 or not 1 <= a.draft <= 8 or a.rounds < 1:
        ap.error("--prompt >= 1, --draft in 1..8, --rounds >= 1")
    cfg = preset("tiny", vocab_size=512)  # its caches; the pooled-key layout has flash-next's ratio 4
    model = Model(cfg, dict(random_weights(cfg)))
    run = Runner(model, EngineOptions(draft=a.draft, capacity=a.prompt + 512, kv_type="q8_0").cache_options())
    run.model = _NoMath()  # after the caches exist
    for s in range(0, a.prompt, 512):
        n = min(512, a.prompt - s)
        run.step(torch.zeros(n, dtype=torch.long))
        run.keep(n, rollback=False)
    rows = torch.zeros(a.draft + 1, dtype=torch.long)

    def one_round(k: int) -> None:
        run.step(rows)
        run.keep(k + 1, rollback=True)
        if run.n_tokens > a.prompt + 256:  # stay inside the capacity: roll back to the prompt
            run.step(rows[:1])
            run.keep(1, rollback=True)
            run.cache.cells.seq_rm(0, a.prompt, -1)
            for lay in run.cache.layouts.values():
                lay.retain(run.cache.cells, 0, a.prompt, -1)
            run.n_tokens = a.prompt
    for i in range(50):
        one_round(i % (a.draft + 1))
    t = time.perf_counter()
    for i in range(a.rounds):
        one_round(i % (a.draft + 1))
    us = (time.perf_counter() - t) / a.rounds * 1e6
    print(f"host Runner.step + Runner.keep per round: {us:.1f} us ({a.draft + 1}-row steps after a {a.prompt}-token "
          f"prompt, accepted counts cycling 0..{a.draft}, {a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
