"""GPU parity checks: the test suite's correctness claims, re-run on CUDA.

  * CUDA f32 logits vs the CPU f32 model (same weights), bf16 vs f32 (relative tolerance);
  * greedy speculative == plain decoding on CUDA, bf16 and f32, with CUDA graphs, for N = 1..8,
    with oracle drafts so every acceptance length occurs; without hooks (drafts chained on the device);
    and with a stop token;
  * every combination of the seed's optimizations gives the baseline's tokens on CUDA;
  * the torch.compile-fused steps (the default on CUDA) against the same functions run eagerly.
Prints a table and exits non-zero on a failure. Run from the repo root: PYTHONPATH=. python scripts/gpu_check.py
(`--only-fused`: the CPU logits rows and the fused-vs-unfused rows only).
"""

from __future__ import annotations

import itertools
import random
import sys
import time

import torch

from qspec.config import preset
from qspec.engine import Engine, EngineOptions
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights.random_model import random_weights

torch.set_grad_enabled(False)
rows: list[tuple[str, str, str]] = []
failed = False


def report(name: str, ok: bool, detail: str) -> None:
    global failed
    failed |= not ok
    rows.append((name, "ok" if ok else "FAIL", detail))
    print(f"{name:55s} {'ok' if ok else 'FAIL':5s} {detail}", flush=True)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(device: str, dtype: torch.dtype) -> Model:
    cfg = preset("tiny", vocab_size=512)
    w = {k: (v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v)
         for k, v in random_weights(cfg, seed=0).items()}
    return Model(cfg, w)


def oracle(reference: list[int], rng: random.Random):  # noqa: ANN201
    def hook(n_out: int, drafts: list[int]) -> list[int]:
        good = reference[n_out:n_out + len(drafts)] + [0] * len(drafts)
        good = good[:len(drafts)]
        cut = rng.randint(0, len(drafts))
        if cut < len(drafts):
            good[cut] = (good[cut] + 1 + rng.randrange(511)) % 512
        return good
    return hook


def main() -> int:
    only_fused = "--only-fused" in sys.argv  # just the fused-vs-unfused rows (a short device run)
    cpu = build("cpu", torch.float32)
    ids = torch.randint(0, 511, (60,), generator=torch.Generator().manual_seed(0))
    ref = Runner(cpu, CacheOptions(capacity=128)).step(ids)[0]
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        gpu = build("cuda", dtype)
        got = Runner(gpu, CacheOptions(capacity=128, kv_type="bf16" if dtype == torch.bfloat16 else "f32")
                     ).step(ids)[0].float().cpu()
        rel = ((got - ref).norm() / ref.norm()).item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        report(f"logits cuda {str(dtype)[6:]} vs cpu f32", rel < tol, f"rel err {rel:.2e}, argmax agree {agree:.3f}")
        prompt = ids[:25].tolist()
        kv = "bf16" if dtype == torch.bfloat16 else "f32"
        if not only_fused:
            plain = Engine(gpu, EngineOptions(draft=0, capacity=256, kv_type=kv)).generate(prompt, 48)
            report(f"graphs used, plain decode {str(dtype)[6:]}", plain.graphs["replays"] > 0, str(plain.graphs))
        for n in (0, 3):  # torch.compile-fused steps vs the same functions run eagerly
            opts = dict(draft=n, capacity=256, kv_type="q8_0", record_logits=True)
            f = Engine(gpu, EngineOptions(**opts)).generate(prompt, 24)
            u = Engine(gpu, EngineOptions(compile=False, **opts)).generate(prompt, 24)
            # Rows whose context is the emitted tokens alone: every decode row, row 0 of each verify step and
            # each round's first draft step. Later verify rows follow the round's drafts, and one draft that
            # flips between the two builds (a near-tie in bf16) gives those rows a different context.
            rel_first = max(rel_diff(a[:1], b[:1]) for a, b in zip(f.logits, u.logits, strict=True))
            rel_draft = max((rel_diff(a, b) for a, b in zip(f.draft_logits, u.draft_logits, strict=True)), default=0.0)
            rel_all = max(rel_diff(a, b) for a, b in zip(f.logits, u.logits, strict=True))
            ok = f.tokens == u.tokens and rel_first < tol and rel_draft < tol
            report(f"fused == unfused steps, cuda {str(dtype)[6:]}, N={n}", ok,
                   f"tokens {'equal' if f.tokens == u.tokens else 'DIFFER'}, logits rel diff {rel_first:.2e}, "
                   f"first draft step {rel_draft:.2e} ({len(f.draft_logits)} rounds); all verify rows {rel_all:.2e}")
        if not only_fused:  # no hooks: drafts chained on the device, one read-back per round; a stop token
            for n in (0, 1, 5):  # ends plain decoding with a queued step discarded
                g = Engine(gpu, EngineOptions(draft=n, capacity=256, kv_type=kv)).generate(prompt, 48)
                stop = plain.tokens[20]
                s = Engine(gpu, EngineOptions(draft=n, capacity=256, kv_type=kv)).generate(prompt, 48, stop_ids={stop})
                want = plain.tokens[:plain.tokens.index(stop) + 1]
                report(f"device-chained greedy == plain, cuda {str(dtype)[6:]}, N={n}",
                       g.tokens == plain.tokens and s.tokens == want,
                       f"accepted {g.spec.accepted}/{g.spec.drafted}; with a stop token: {len(s.tokens)} tokens, "
                       f"{'as plain' if s.tokens == want else 'DIFFER'}")
        for n in range(1, 9) if not only_fused else ():
            rng = random.Random(n)
            t0 = time.perf_counter()
            g = Engine(gpu, EngineOptions(draft=n, capacity=256, kv_type=kv,
                                          draft_hook=oracle(plain.tokens, rng))).generate(prompt, 48)
            same = g.tokens == plain.tokens
            first = next((i for i, (a, b) in enumerate(zip(g.tokens, plain.tokens, strict=False)) if a != b), None)
            report(f"greedy spec == plain, cuda {str(dtype)[6:]}, N={n}", same,
                   f"accepted {g.spec.accepted}/{g.spec.drafted}, first diff {first}, "
                   f"graphs {g.graphs['captures']} captures / {g.graphs['replays']} replays, "
                   f"{time.perf_counter() - t0:.1f}s")
    gpu = build("cuda", torch.float32)
    prompt = ids[:40].tolist()
    base = None
    for combo in itertools.product([False, True], repeat=4) if not only_fused else ():
        p, inc, pad, fused = combo
        rng = random.Random(5)
        g = Engine(gpu, EngineOptions(draft=4, capacity=256, preserve_pooled=p, incremental_pooled=inc,
                                      pad_target=8 if pad else None, fused_snapshots=fused,
                                      accept_hook=lambda r, n, rng=rng: rng.randint(0, n))).generate(prompt, 40)
        base = base or g.tokens
        report(f"seed opts {combo} == baseline tokens (cuda f32)", g.tokens == base,
               str(g.graphs["graphs_by_shape"])[:90])
    print("\nsummary:", sum(r[1] == "ok" for r in rows), "ok,", sum(r[1] != "ok" for r in rows), "failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
