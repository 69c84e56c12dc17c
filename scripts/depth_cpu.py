"""The automatic draft depth (`--draft auto`) against fixed depths, with the trained demo model on the CPU.

Profiles: the demo model's own greedy acceptance on code (held-out standard-library modules, as
scripts/draft_vocab_demo.py picks them) and on English prose (README paragraphs), then replayed geometric acceptance
(`--accept-profile p=...`) on the code prompts. For each profile and arm: decoded tokens over decode seconds, summed
over the prompts, the median of the repetitions (every prompt on every arm back to back, in alternating order), and
auto's tok/s over each arm's as the median of the repetitions' ratios. With `--traces DIR` it also
writes each model profile's per-round accepted counts at depth 8 (the `--accept-profile trace=FILE` format; a replay at
depth d takes min(d, count)).

    PYTHONPATH=. python scripts/depth_cpu.py --out benchmarks/results/depth-auto-cpu-DATE.md --traces benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import statistics
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from qspec.bench.accept import AcceptProfile
from qspec.bench.report import print_report
from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.loader import DEMO_MODEL, load_model, load_tokenizer
from qspec.model.model import Model
from qspec.spec.accept import AcceptHook
from qspec.tokenizer import Tokenizer

HELD_OUT_EVERY = 20  # scripts/train_demo.py's split
ROOT = Path(__file__).resolve().parents[1]


def code_prompts(tok: Tokenizer, V: int, n: int, length: int) -> list[list[int]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    for f in (f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0):
        ids = [t for t in tok.encode(f.read_text(encoding="utf-8", errors="replace")) if t < V]
        if len(ids) >= 2 * length:  # a stretch past the module's header
            out.append(ids[length:2 * length])
        if len(out) == n:
            break
    return out


def prose_prompts(tok: Tokenizer, V: int, n: int, length: int) -> list[list[int]]:
    """README paragraphs of plain English (no code blocks, no lists)."""
    text = (ROOT / "README.md").read_text()
    paras = [p.replace("\n", " ") for p in text.split("\n\n") if not p.lstrip().startswith(("```", "-", "#", "|"))]
    ids = [t for t in tok.encode(" ".join(paras)) if t < V]
    return [ids[i * length:(i + 1) * length] for i in range(min(n, len(ids) // length))]


def replay_hook(profile: AcceptProfile, fresh: bool) -> AcceptHook | None:
    """The profile's hook; `fresh`: geometric streams seeded anew per generation (AcceptProfile's fresh=1)."""
    return dataclasses.replace(profile, fresh=True).hook() if fresh and profile.kind == "p" else profile.hook()


def arms(fixed: list[int], auto_max: int) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {"plain": {"draft": 0}}
    for d in fixed:
        out[f"MTP{d}"] = {"draft": d}
    out[f"auto(0..{auto_max})"] = {"draft": auto_max, "draft_auto": True}
    return out


def measure(model: Model, prompts: list[list[int]], profile: AcceptProfile, arm_opts: dict[str, dict[str, object]],
            reps: int, gen: int, fresh: bool) -> dict[str, object]:
    engines = {name: Engine(model, EngineOptions(capacity=1024, prefix_cache=False, **kw),  # type: ignore[arg-type]
                            EngineHooks(accept_hook=replay_hook(profile, fresh) if kw["draft"] else None))
               for name, kw in arm_opts.items()}
    for e in engines.values():  # warm-up (the auto engine calibrates its per-depth costs here)
        e.generate(prompts[0], 16)
    tps: dict[str, list[float]] = {n: [] for n in engines}
    tpr: dict[str, float] = {}
    depths: Counter = Counter()
    plain_tokens = 0
    for rep in range(reps):
        # every prompt runs on every arm back to back (in alternating order), so that a rep's arms see the same load
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        toks = dict.fromkeys(engines, 0)
        secs = dict.fromkeys(engines, 0.0)
        rounds = dict.fromkeys(engines, 0)
        committed = dict.fromkeys(engines, 0)
        for p in prompts:
            for name in order:
                g = engines[name].generate(p, gen)
                toks[name] += len(g.tokens)
                secs[name] += g.decode_s
                rounds[name] += g.spec.rounds
                committed[name] += g.spec.tokens
                if g.depth and rep == 0:
                    depths.update({int(k): v for k, v in g.depth["depth_histogram"].items()})
                    plain_tokens += int(g.depth["plain_tokens"])
        for name in engines:
            tps[name].append(toks[name] / secs[name])
            tpr[name] = committed[name] / rounds[name] if rounds[name] else 1.0
    return {"tps": {n: statistics.median(v) for n, v in tps.items()}, "runs": tps, "tokens_per_round": tpr,
            "auto_depths": dict(sorted(depths.items())), "auto_plain_tokens": plain_tokens}


def paired_ratio(runs: dict[str, list[float]], a: str, b: str) -> float:
    """The median over the repetitions of a's tok/s over b's in the same repetition (the host's load drifts between
    repetitions more than between arms of one)."""
    return statistics.median(x / y for x, y in zip(runs[a], runs[b], strict=True))


def record_trace(model: Model, prompts: list[list[int]], gen: int, path: Path, what: str) -> float:
    eng = Engine(model, EngineOptions(draft=8, capacity=1024, prefix_cache=False))
    acc: list[int] = []
    for p in prompts:
        acc.extend(r["accepted"] for r in eng.generate(p, gen).rounds_log)
    path.write_text(json.dumps({"accepted": acc, "depth": 8, "model": "qspec demo-q8_0.gguf (greedy, own drafts)",
                                "prompts": what, "gen_tokens_per_prompt": gen}) + "\n")
    return sum(acc) / len(acc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fixed", default="1,2,3,5", help="the fixed depths to compare with")
    ap.add_argument("--auto-max", type=int, default=6)
    ap.add_argument("--profiles", default="p=0.3,p=0.5,p=0.7,p=0.85,p=0.95")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--restart-streams", action="store_true",
                    help="replay p=... as AcceptProfile does (one stream, restarted at every generation) instead of a "
                         "fresh stream per generation")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--traces", type=Path, help="a folder for the model profiles' acceptance traces")
    ap.add_argument("--traces-only", action="store_true", help="record the traces, measure nothing")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEMO_MODEL)
    model = load_model(DEMO_MODEL, device=torch.device("cpu"))
    V = model.cfg.vocab_size
    sets = {"code": code_prompts(tok, V, a.prompts, a.prompt_tokens),
            "prose": prose_prompts(tok, V, a.prompts, a.prompt_tokens)}
    profiles = [(f"{k} (model)", sets[k], AcceptProfile()) for k in sets]
    profiles += [(f"{s} (replayed, code)", sets["code"], AcceptProfile.parse(s)) for s in a.profiles.split(",") if s]
    arm_opts = arms([int(x) for x in a.fixed.split(",")], a.auto_max)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    lines = [f"# `--draft auto` against fixed depths: demo model, CPU ({_dt.date.today().isoformat()})", "",
             f"commit {commit.strip()}; {a.prompts} prompts of {a.prompt_tokens} tokens per profile, {a.gen} generated "
             f"each, greedy, {a.reps} repetitions (median of decoded tokens / decode seconds over the prompts; ratios "
             f"paired within a repetition), "
             f"torch threads {a.threads}, on a shared 2-core machine; replayed p: "
             f"{'one stream restarted at every generation' if a.restart_streams else 'a fresh stream per generation'}. "
             f"`scripts/depth_cpu.py`.", "",
             "| profile | " + " | ".join(arm_opts) + " | auto / best fixed | auto / plain | auto / MTP3 | auto / MTP5 "
             "| auto's depths (rounds; 0: plain stretches) |",
             "|---|" + "---:|" * (len(arm_opts) + 4) + "---|"]
    auto = list(arm_opts)[-1]
    for name, prompts, prof in [] if a.traces_only else profiles:
        r = measure(model, prompts, prof, arm_opts, a.reps, a.gen, not a.restart_streams)
        tps = r["tps"]
        best = max((n for n in tps if n != auto), key=tps.__getitem__)
        cells = [f"{tps[n]:.1f}" + (f" ({r['tokens_per_round'][n]:.2f})" if n != "plain" else "") for n in arm_opts]
        ratio = [f"{paired_ratio(r['runs'], auto, x):.3f}" if x in tps else "-"
                 for x in (best, "plain", "MTP3", "MTP5")]
        ratio[0] += f" ({best})"
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratio) +
                     f" | {r['auto_depths']}, {r['auto_plain_tokens']} plain tokens |")
        print(lines[-1], flush=True)
    lines += ["", "Cells: tok/s, the median of the repetitions (tokens per round, of the last repetition). Ratios: "
              "the median over the repetitions of auto's tok/s over the arm's in the same repetition; best fixed: the "
              "arm (plain included) with the highest median. auto's depths: the rounds at each depth in the first "
              "repetition, with depth 0 the plain stretches the controller chose, and the tokens they decoded."]
    if a.traces:
        for k, prompts in sets.items():
            path = a.traces / f"demo-accept-trace-{k}.json"
            mean = record_trace(model, prompts, a.gen, path, f"{k}: {len(prompts)} prompts of {a.prompt_tokens}")
            lines.append(f"\nAcceptance trace ({k}, greedy MTP8, mean accepted {mean:.2f}): `{path.name}` "
                         f"(`--accept-profile trace={path}`)")
    print_report(lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
