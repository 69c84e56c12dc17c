"""`--draft auto` against every fixed depth, several acceptance profiles, one process (the model built and its step
functions compiled once): the merge task (4,096-token prompt) at flash-next geometry on the GPU.

For each profile (replayed geometric acceptance p=..., or a recorded trace=FILE of the demo model's per-round
accepted counts, `scripts/depth_cpu.py --traces`): the arms plain decoding, MTP1..MTP{max} and auto:{max}, alternated
within each repetition; it writes PROFILE.json/.md per profile under --out and prints one summary line per profile:
auto over the best fixed depth, over MTP3 and MTP5 (the defaults a user would pick), over plain decoding.

    PYTHONPATH=. python scripts/gpu_depth.py --layers 8 --out benchmarks/results/depth-gpu \\
        --profile p=0.5 --profile p=0.85 --profile trace=benchmarks/results/demo-accept-trace-code.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from qspec.bench.accept import AcceptProfile
from qspec.bench.arms import parse_arms
from qspec.bench.cli import prepare_model
from qspec.bench.report import write_json, write_markdown
from qspec.bench.run import Protocol, run_protocol


def arms_spec(max_depth: int, depths: list[int] | None = None, stretches: list[int] | None = None) -> str:
    """Plain decoding, the fixed depths (default 1..max_depth), auto:max_depth and auto:max_depth with each other
    first plain stretch (arms auto-sN)."""
    fixed = "".join(f"mtp{d}:from=ours,draft={d}," for d in (depths or range(1, max_depth + 1)))
    others = "".join(f",auto-s{n}:from=ours,auto=1,draft={max_depth},stretch={n}" for n in stretches or [])
    return f"nospec,{fixed}auto:from=ours,auto=1,draft={max_depth}{others}"


def summary_line(label: str, result: dict[str, Any]) -> str:
    med = {r["arm"]: r["decode_tps_median"] for r in result["summary"]}
    fixed = {n: v for n, v in med.items() if not n.startswith("auto")}
    best = max(fixed, key=fixed.__getitem__)
    auto = med["auto"]
    hist: Counter[str] = Counter()  # the depths auto chose, over its measured runs
    for r in result["runs"]:
        if r["arm"] == "auto":
            hist.update(r["depth"].get("depth_histogram", {}))
    ratios = [f"auto/best({best}) {auto / fixed[best]:.3f}"]
    ratios += [f"auto/{n} {auto / fixed[n]:.3f}" for n in ("mtp3", "mtp5", "nospec") if n in fixed]
    ratios += [f"{n}/best {v / fixed[best]:.3f}, {n}/nospec {v / fixed['nospec']:.3f}" for n, v in med.items()
               if n.startswith("auto-")]
    return (f"{label}: " + " ".join(f"{n} {v:.1f}" for n, v in med.items()) + " | " + ", ".join(ratios)
            + f" | auto's depths {dict(sorted(hist.items()))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", required=True, metavar="SPEC",
                    help="an acceptance profile (--accept-profile syntax); repeat for several")
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --preset tiny)")
    ap.add_argument("--quant", default=None, help="the preset's matrices as blocks of this llama.cpp mix")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--fixed", type=lambda v: [int(d) for d in v.split(",")], default=None, metavar="D,D,...",
                    help="the fixed depths to time beside plain decoding and auto (default: 1..max-depth)")
    ap.add_argument("--stretches", type=lambda v: [int(n) for n in v.split(",")], default=None, metavar="N,N,...",
                    help="more auto arms, each with this first plain stretch (--draft-auto-stretch)")
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, required=True, help="directory for each profile's JSON and Markdown")
    a = ap.parse_args()
    profiles = [AcceptProfile.parse(s) for s in a.profile]  # a bad spec fails before the model is built
    arms = parse_arms(arms_spec(a.max_depth, a.fixed, a.stretches))
    a.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model, tok, info = prepare_model(preset=a.preset, layers=a.layers, device=a.device,
                                     dtype="bfloat16" if a.device == "cuda" else "float32", quant=a.quant)
    print(f"model built in {time.perf_counter() - t:.1f} s: {info['name']}", flush=True)
    lines = []
    for spec, prof in zip(a.profile, profiles, strict=True):
        name = re.sub(r"[^A-Za-z0-9.]+", "-", Path(spec.split("=", 1)[1]).stem if spec.startswith("trace=")
                      else spec).strip("-")
        proto = Protocol(benchmark="merge", prompt_tokens=[a.prompt_tokens], gen_tokens=a.gen_tokens, reps=a.reps,
                         arms=arms, accept=prof)
        t = time.perf_counter()
        result = run_protocol(model, tok, proto, model_info=info, progress=False,
                              checkpoint=lambda r, n=name: write_json(r, a.out / f"{n}.json"))
        write_json(result, a.out / f"{name}.json")
        write_markdown(result, a.out / f"{name}.md")
        lines.append(summary_line(spec, result))
        print(lines[-1] + f" ({time.perf_counter() - t:.0f} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (a.out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
