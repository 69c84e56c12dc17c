"""`--draft auto` on the GPU with the trained demo model (f32, CUDA graphs): greedy output equal to plain decoding's
whatever depths the controller picks, the graphs each depth captured, and tok/s against fixed depths on the model's
own acceptance (code prompts) and on replayed ones.

    python scripts/gpu_depth.py [--gen 256] [--prompts 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from depth_cpu import code_prompts  # noqa: E402

from qspec.bench.accept import AcceptProfile  # noqa: E402
from qspec.engine import Engine, EngineHooks, EngineOptions  # noqa: E402
from qspec.loader import DEMO_MODEL, load_model, load_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    tok = load_tokenizer(DEMO_MODEL)
    model = load_model(DEMO_MODEL, device=dev, dtype=torch.float32)
    prompts = code_prompts(tok, model.cfg.vocab_size, a.prompts, 96)
    plain = Engine(model, EngineOptions(draft=0, capacity=1024))
    auto = Engine(model, EngineOptions(draft=6, draft_auto=True, capacity=1024))
    same = 0
    for p in prompts:
        ref = plain.generate(p, a.gen).tokens
        g = auto.generate(p, a.gen)
        same += g.tokens == ref
        print(f"auto vs plain: equal={g.tokens == ref} depths={g.depth['depth_histogram']} "
              f"reasons={g.depth['reasons']} tokens/round={g.spec.tokens_per_round:.2f}", flush=True)
    print(f"greedy equal to plain: {same}/{len(prompts)}; graphs {g.graphs['captures']} captured, "
          f"{g.graphs['replays']} replays, {g.graphs['eager_steps']} eager steps in the last request")
    print("measured round cost by depth (ms):", [round(auto.depth.cost(d) * 1e3, 3) for d in range(7)])
    for spec in ("model", "p=0.3", "p=0.6", "p=0.85", "p=0.95"):
        prof = AcceptProfile.parse(spec)
        arms = {"plain": {"draft": 0}, **{f"MTP{d}": {"draft": d} for d in (1, 2, 3, 5)},
                "auto": {"draft": 6, "draft_auto": True}}
        engines = {n: Engine(model, EngineOptions(capacity=1024, **kw),  # type: ignore[arg-type]
                             EngineHooks(accept_hook=prof.hook() if kw["draft"] else None)) for n, kw in arms.items()}
        for e in engines.values():
            e.generate(prompts[0], 32)
        tps: dict[str, list[float]] = {n: [] for n in engines}
        for rep in range(a.reps):
            for n in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                toks = secs = 0.0
                for p in prompts:
                    g = engines[n].generate(p, a.gen)
                    toks += len(g.tokens)
                    secs += g.decode_s
                tps[n].append(toks / secs)
        med = {n: statistics.median(v) for n, v in tps.items()}
        best = max((n for n in med if n != "auto"), key=med.__getitem__)
        print(f"{spec}: " + " ".join(f"{n} {v:.0f}" for n, v in med.items())
              + f" | auto/best({best}) {med['auto'] / med[best]:.3f} auto/plain {med['auto'] / med['plain']:.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
