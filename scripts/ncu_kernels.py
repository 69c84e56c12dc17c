"""The decode step's main kernels at the real geometry, each launched once inside a profiler range, for Nsight Compute
(GPU). Everything is compiled and warmed up first, so only the launches between cudaProfilerStart and Stop count:

    ncu --profile-from-start off --clock-control none --cache-control all \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --log-file ncu.txt python scripts/ncu_kernels.py
    python scripts/ncu_kernels.py --summarize ncu.txt     # one line per kernel: the figures that say what bounds it

Shapes (one token unless named): the int8 block products of a GDN layer's input (16,480 x 2,560, Q4_K) and output
(2,560 x 6,144, Q4_K) and of the Q6_K LM head (248,320 x 2,560) with their quantize and partial-sum launches; the
routed experts of 1 and 6 tokens (Q4_K gate/up, Q5_0 down, 512 x 640 x 2,560, top-10); a hyper-connection mixer
(the 16-bit w_in mat-vec, 328 x 10,240, and the output kernel); the bf16 LM head mat-vec for scale.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from qspec.bench.qkernels import HIDDEN, _quantized, expert_blocks, expert_routes
from qspec.kernels.gemv import gemv
from qspec.kernels.triton_hc_mix import hc_out_triton
from qspec.kernels.triton_qdot import qdot_matmul_triton, qdot_moe_few_triton

PRODUCTS = {"gdn_in": (16480, 2560, T.Q4_K), "gdn_out": (2560, 6144, T.Q4_K), "lm_head": (248320, 2560, T.Q6_K)}
MIX_RANK, MIX_STREAMS = 324, 4


def _calls(which: set[str]) -> list:
    """(name, zero-argument call) of each kernel group asked for, its inputs made here."""
    calls = []
    for name, (n, k, qt) in PRODUCTS.items():
        if name in which:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            raw = _quantized(qt, n, k, seed=1)
            calls.append((name, lambda x=x, raw=raw, qt=qt, n=n: qdot_matmul_triton(x, raw, int(qt), n)))
    tokens = [t for t in (1, 6) if f"experts{t}" in which]
    if tokens:  # one set of expert blocks for every token count
        gate, up, down = expert_blocks(T.Q4_K, T.Q5_0)
        parts = ((gate, int(T.Q4_K)), (up, int(T.Q4_K)), (down, int(T.Q5_0)))
    for t in tokens:
        ti, tw = expert_routes(t)[0]
        h = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        calls.append((f"experts{t}", lambda h=h, ti=ti, tw=tw: qdot_moe_few_triton(h, ti, tw, *parts)))
    if "mixer" in which:
        sd = MIX_STREAMS * HIDDEN
        xn = torch.randn(1, sd, device="cuda", dtype=torch.bfloat16)
        w_in = torch.randn(MIX_RANK + MIX_STREAMS, sd, device="cuda", dtype=torch.bfloat16) * 0.01
        up = torch.randn(sd, MIX_RANK, device="cuda", dtype=torch.bfloat16) * 0.05
        calls.append(("mixer", lambda: hc_out_triton(gemv(xn, w_in), xn, up, MIX_RANK, HIDDEN, MIX_STREAMS)))
    if "bf16_head" in which:
        x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(248320, HIDDEN, device="cuda", dtype=torch.bfloat16)
        calls.append(("bf16_head", lambda: gemv(x, w)))
    return calls


# the Nsight Compute metrics of the summary, as its text log names them, and their columns
SUMMARY = {"Duration": "µs", "DRAM Throughput": "DRAM %", "L1/TEX Cache Throughput": "L1 %",
           "Achieved Occupancy": "occ. %", "Registers Per Thread": "regs"}


def summarize(log: Path) -> str:
    """One markdown row per kernel launch of an `ncu --log-file` text: its grid and the SUMMARY metrics."""
    launches: list[tuple[str, dict[str, str]]] = []
    for line in log.read_text().splitlines():
        head = re.match(r"  (\S+) (\([\d, ]+\))x\([\d, ]+\), Context", line)
        if head:
            launches.append((f"{head[1]} {head[2]}", {}))
            continue
        for metric in SUMMARY:
            m = re.match(rf"\s+{re.escape(metric)}\s+\S+\s+([\d.,]+)$", line)
            if m and launches and metric not in launches[-1][1]:
                launches[-1][1][metric] = m[1]
    rows = ["| kernel (grid) | " + " | ".join(SUMMARY.values()) + " |", "|---|" + "---:|" * len(SUMMARY)]
    rows += [f"| {name} | " + " | ".join(vals.get(k, "-") for k in SUMMARY) + " |" for name, vals in launches]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="gdn_in,gdn_out,lm_head,experts1,experts6,mixer,bf16_head")
    p.add_argument("--summarize", type=Path, metavar="NCU_LOG", help="print the summary of an ncu text log and exit")
    args = p.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    calls = _calls(set(args.only.split(",")))
    for _, c in calls:  # compile and warm up outside the profiled range
        c()
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, c in calls:
        torch.cuda.nvtx.range_push(name)
        c()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(name for name, _ in calls))


if __name__ == "__main__":
    main()
