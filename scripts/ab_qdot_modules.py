"""The int8 block products of qspec/kernels/triton_qdot.py against another version of that file, in one process (GPU).

    git show d16d186:qspec/kernels/triton_qdot.py > /tmp/qdot_before.py
    python scripts/ab_qdot_modules.py /tmp/qdot_before.py --types Q6_K,Q8_0,Q5_0,Q4_0

Both modules' kernels run alternately (3 times per shape, the median kept) as CUDA-graph replays over weight copies
larger than the L2: the one-row and four-row products at the decode shapes, then the routed experts of 1 and 6
tokens (Q4_K gate/up with Q5_0 down, Q6_K with Q8_0). Columns: µs of each, their ratio, GB/s of this tree's kernel,
and the relative difference (max |a - b| / max |b|) from the int8 reference and from the other module.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from functools import partial
from types import ModuleType

import torch
from gguf import GGMLQuantizationType as T

from qspec.bench.qkernels import HIDDEN, _copies, _quantized, expert_blocks, expert_routes, graph_us
from qspec.kernels import qdot
from qspec.kernels import triton_qdot as new

SHAPES = {"lm_head": (248320, 2560), "gdn_in": (16480, 2560), "gdn_out": (2560, 6144), "down": (2560, 640)}


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("qdot_other", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["qdot_other"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _ab(old: ModuleType, fn: str, calls: list[tuple]) -> tuple[float, float]:
    """Median µs of the other module's function `fn` over the argument tuples `calls` and of this tree's,
    alternated three times."""
    ts: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(3):
        for label, mod in (("old", old), ("new", new)):
            ts[label].append(graph_us([partial(getattr(mod, fn), *args) for args in calls]))
    return sorted(ts["old"])[1], sorted(ts["new"])[1]


def products(old: ModuleType, types: list[T]) -> None:
    print(f"{'type':<6} {'shape':<8} {'M':>2} {'old us':>9} {'new us':>9} {'old/new':>8} {'GB/s new':>9} "
          f"{'relerr ref':>11} {'relerr old':>11}")
    for qt in types:
        for name, (n, k) in SHAPES.items():
            if qt.name.endswith("_K") and k % 256:
                continue
            raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
            for m in (1, 4):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                yn = new.qdot_matmul_triton(x.float(), raws[0], int(qt), n)
                e_ref = _rel(yn, qdot.qdot_matmul_torch(x.float(), raws[0], int(qt), n, k))
                e_old = _rel(yn, old.qdot_matmul_triton(x.float(), raws[0], int(qt), n))
                o, nw = _ab(old, "qdot_matmul_triton", [(x, r, int(qt), n) for r in raws])
                print(f"{qt.name:<6} {name:<8} {m:>2} {o:>9.2f} {nw:>9.2f} {o / nw:>8.3f} "
                      f"{raws[0].numel() / nw / 1e3:>9.0f} {e_ref:>11.2e} {e_old:>11.2e}", flush=True)
            del raws


def experts(old: ModuleType) -> None:
    print(f"{'experts':<14} {'t':>2} {'old us':>9} {'new us':>9} {'old/new':>8} {'relerr old':>11}")
    for gq, dq in ((T.Q4_K, T.Q5_0), (T.Q6_K, T.Q8_0)):
        gate, up, down = expert_blocks(gq, dq)
        parts = ((gate, int(gq)), (up, int(gq)), (down, int(dq)))
        for t in (1, 6):
            routes = expert_routes(t)
            h = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
            y_old = old.qdot_moe_few_triton(h, *routes[0], *parts)
            e_old = _rel(new.qdot_moe_few_triton(h, *routes[0], *parts), y_old)
            o, nw = _ab(old, "qdot_moe_few_triton", [(h, ti, tw, *parts) for ti, tw in routes])
            print(f"{gq.name + '/' + dq.name:<14} {t:>2} {o:>9.2f} {nw:>9.2f} {o / nw:>8.3f} {e_old:>11.2e}",
                  flush=True)
        del gate, up, down


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="another version of qspec/kernels/triton_qdot.py (the 'old' columns)")
    ap.add_argument("--types", default="Q6_K", help="comma-separated block types of the products")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_qdot_modules: error: needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    old = _load(args.other)
    products(old, [T[name] for name in args.types.split(",")])
    experts(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
