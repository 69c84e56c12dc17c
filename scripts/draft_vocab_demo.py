"""What a draft vocabulary costs in acceptance, measured with the trained demo model (CPU, its own drafts).

The demo model was trained on the Python standard library with every 20th module held out (scripts/train_demo.py).
Here the frequency-ranked sets are counted over the training modules, as a user would count their own text
(`qspec draft-vocab`), and the prompts come from the held-out modules. For each set: greedy MTP-N over the prompts,
the drafts' acceptance by position and tokens per round, against the whole vocabulary; every output must equal
plain decoding's (the target verifies with its full head). Speed on the CPU says nothing here: the head is small.

    PYTHONPATH=. python scripts/draft_vocab_demo.py [--draft 3] [--prompts 8] [--gen 64]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

from qspec.engine import Engine, EngineOptions
from qspec.loader import DEMO_MODEL, load_model, load_tokenizer
from qspec.spec.draft_vocab import first_ids, frequent_ids

HELD_OUT_EVERY = 20  # scripts/train_demo.py's split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts, one from each of the first held-out modules")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    tok = load_tokenizer(DEMO_MODEL)
    model = load_model(DEMO_MODEL, device=torch.device("cpu"))
    V = model.cfg.vocab_size
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    counted = [[t for t in tok.encode(f.read_text(encoding="utf-8", errors="replace")) if t < V] for f in train]
    prompts = []
    for f in held:
        ids = [t for t in tok.encode(f.read_text(encoding="utf-8", errors="replace")) if t < V]
        if len(ids) >= 2 * a.prompt_tokens:  # a stretch past the module's header
            prompts.append(ids[a.prompt_tokens:2 * a.prompt_tokens])
        if len(prompts) == a.prompts:
            break
    held_tokens = [t for f in held for t in tok.encode(f.read_text(encoding="utf-8", errors="replace")) if t < V]
    print(f"demo model, vocab {V}; {len(train)} training modules counted ({sum(map(len, counted))} tokens); "
          f"{len(prompts)} prompts of {a.prompt_tokens} tokens from held-out modules, {a.gen} generated, "
          f"greedy MTP{a.draft}, full-precision draft head")
    sets: list[tuple[str, list[int] | None]] = [("whole vocabulary", None)]
    for n in (int(s) for s in a.sizes.split(",")):
        sets.append((f"first {n} ids", first_ids(n, V, keep=tok.stop_ids)))
        sets.append((f"{n} most frequent", frequent_ids(counted, n, V, keep=tok.stop_ids)))
    plain = [Engine(model, EngineOptions(draft=0, capacity=512)).generate(p, a.gen).tokens for p in prompts]
    print("\n| draft vocabulary | ids | held-out tokens covered | tokens / round | acceptance by position | "
          "same output as plain |\n|---|---:|---:|---:|---|---|")
    for name, ids in sets:
        eng = Engine(model, EngineOptions(draft=a.draft, capacity=512, draft_vocab=ids))
        rounds = accepted = 0
        by_pos = [0] * a.draft
        same = True
        for p, want in zip(prompts, plain, strict=True):
            g = eng.generate(p, a.gen)
            same &= g.tokens == want
            rounds += g.spec.rounds
            accepted += g.spec.accepted
            for r in g.rounds_log:
                for i in range(r["accepted"]):
                    by_pos[i] += 1
        keep = set(range(V)) if ids is None else set(ids)
        cover = sum(t in keep for t in held_tokens) / len(held_tokens)
        print(f"| {name} | {len(keep)} | {cover:.1%} | {(accepted + rounds) / rounds:.2f} | "
              f"{', '.join(f'{c / rounds:.2f}' for c in by_pos)} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
