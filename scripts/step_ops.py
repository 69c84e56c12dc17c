"""How many operations a decode step launches outside compiled graphs, on the CPU: a structural count that needs no
GPU, from the profiler's op events. Each compiled function call counts as one region (inductor turns one into a few
kernels), each custom op (qspec::qmatmul, qspec::gemv, ...) as one launch, every other aten op run eagerly as one
launch unless it is a view or a copy that copies nothing.

The counts are the CPU's: steps that run a Triton kernel on CUDA (mixers, KV writes, the GDN conv) run their torch
references here, so the absolute numbers exceed the GPU's; the difference between two settings of the same model is
what carries over (the same functions run compiled or eagerly on both).

    PYTHONPATH=. python scripts/step_ops.py            # tiny geometry: f32 weights, Q4_K_M blocks, blocks compiled
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import build_model, tiny_config  # noqa: E402

from qspec.engine import Engine, EngineOptions  # noqa: E402
from qspec.loader import load_model, write_model  # noqa: E402

# Ops that launch no kernel: views, metadata, allocation.
NO_KERNEL = {"select", "slice", "view", "unsqueeze", "squeeze", "transpose", "t", "expand", "permute", "as_strided",
             "resolve_conj", "resolve_neg", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk",
             "narrow", "diagonal", "flatten", "unflatten", "view_as", "_unsafe_view", "lift_fresh", "empty",
             "empty_strided", "expand_as", "_reshape_alias", "item", "_local_scalar_dense", "is_nonzero"}
# Ops that launch a kernel only when they copy (a dtype change, a non-contiguous source).
MAYBE_COPY = {"to", "contiguous", "reshape", "type_as"}
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone"}


def _launches(events: list[Any]) -> tuple[Counter, int, int]:
    """(eager aten launches by name, custom ops, compiled regions) among the profiler's events: a region or custom
    op counts once, with nothing inside it; an aten op counts when no aten op, region or custom op encloses it."""
    eager: Counter = Counter()
    custom = regions = 0
    for ev in events:
        outer = ev.cpu_parent
        enclosed = False
        while outer is not None:
            if outer.name.startswith(("aten::", "qspec::", "Torch-Compiled Region")):
                enclosed = True
                break
            outer = outer.cpu_parent
        if enclosed:
            continue
        if ev.name.startswith("Torch-Compiled Region"):
            regions += 1
            custom += sum(1 for c in _descendants(ev) if c.name.startswith("qspec::") and not _in_custom(c, ev))
        elif ev.name.startswith("qspec::"):
            custom += 1
        elif ev.name.startswith("aten::"):
            op = ev.name[6:]
            if op in NO_KERNEL or (op in MAYBE_COPY and not any(c.name in COPIES for c in _descendants(ev))):
                continue
            eager[op] += 1
    return eager, custom, regions


def _descendants(ev: Any) -> list[Any]:
    out, todo = [], list(ev.cpu_children)
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.cpu_children)
    return out


def _in_custom(ev: Any, stop: Any) -> bool:
    p = ev.cpu_parent
    while p is not None and p is not stop:
        if p.name.startswith("qspec::"):
            return True
        p = p.cpu_parent
    return False


def per_step(model: Any, fuse_blocks: bool, tokens: int) -> tuple[float, float, float, Counter]:
    """(eager launches, custom ops, compiled regions) per plain decoding step, and the eager launches by op."""
    eng = Engine(model, EngineOptions(draft=0, capacity=256, compile_backend="aot_eager", fuse_blocks=fuse_blocks,
                                      prefix_cache=False))
    prompt = list(range(3, 40))
    counts = []
    for n in (1, 1 + tokens):
        eng.generate(prompt, n)  # traces outside the count
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.generate(prompt, n)
        counts.append(_launches(list(prof.events())))
    (ea, ca, ra), (eb, cb, rb) = counts
    return (sum(eb.values()) - sum(ea.values())) / tokens, (cb - ca) / tokens, (rb - ra) / tokens, eb - ea


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8, help="decode steps counted")
    ap.add_argument("--top", type=int, default=8, help="eager ops listed per setting")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg = tiny_config(mtp=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q4km.gguf"
        write_model(path, cfg, quant="q4_k_m")
        blocks = load_model(path, dequantize_all=False)
    dense = build_model(cfg)
    print(f"tiny geometry, {cfg.n_layers} layers; per plain decoding step (CPU dispatch counts)")
    print(f"{'model':<34} {'eager ops':>10} {'custom ops':>11} {'compiled':>9}")
    for name, model, fb in (("f32 weights", dense, False), ("Q4_K_M blocks", blocks, False),
                            ("Q4_K_M blocks, --fuse-blocks", blocks, True)):
        eager, custom, regions, ops = per_step(model, fb, a.tokens)
        top = ", ".join(f"{k} {v / a.tokens:.0f}" for k, v in ops.most_common(a.top))
        print(f"{name:<34} {eager:>10.1f} {custom:>11.1f} {regions:>9.1f}   {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
