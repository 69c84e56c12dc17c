"""One-row products at the model's decode shapes, each launched a few times, for Nsight Compute to read.

    ncu --clock-control none -k regex:'_qdot_mv|_gemv' --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python scripts/ncu_products.py CASE

Cases: the GDN input stack (16,480 x 2,560; Q4_K with K lanes by shape, one lane, and bf16), the hyper-connection
mixer's w_in (324 x 10,240, Q4_K with its 4 lanes and with one), GDN's output (2,560 x 6,144, Q4_K). Hardware counters
say what bounds each (DRAM, L1 or instruction issue) where timing variants only say how long it took.
"""

from __future__ import annotations

import sys

import torch
from gguf import GGMLQuantizationType as T

from qspec.bench.qkernels import _quantized
from qspec.kernels.gemv import gemv
from qspec.kernels.triton_common import sums_in_product_mode
from qspec.kernels.triton_qdot import K_LANE_CONFIGS, qdot_matmul_triton

CASES = {  # name: (rows, K, type or None for bf16, forced K lanes or 0 for the default)
    "gdn_in_q4k": (16480, 2560, T.Q4_K, 0),
    "gdn_in_q4k_l1": (16480, 2560, T.Q4_K, 1),
    "gdn_in_bf16": (16480, 2560, None, 0),
    "w_in_q4k": (324, 10240, T.Q4_K, 0),
    "w_in_q4k_l1": (324, 10240, T.Q4_K, 1),
    "gdn_out_q4k": (2560, 6144, T.Q4_K, 0),
}


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in CASES:
        print(f"usage: ncu_products.py CASE; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    n, k, qt, lanes = CASES[name]
    torch.set_grad_enabled(False)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if qt is None:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        calls = [lambda: gemv(x, w)] * 4
    else:
        raw = _quantized(qt, n, k, seed=0)
        cfg = K_LANE_CONFIGS[lanes] if lanes else None
        calls = [lambda: qdot_matmul_triton(x, raw, int(qt), n, cfg)] * 4
    with sums_in_product_mode(True):  # as the engine's steps run them
        for call in calls:
            call()
    torch.cuda.synchronize()
    print(f"{name}: {n} x {k} {qt.name if qt is not None else 'bf16'}, lanes {lanes or 'by shape'}: 4 launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
