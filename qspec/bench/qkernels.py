"""GPU micro-benchmark of the kernels that read GGUF blocks, against the bf16 products on the same shapes.

    python -m qspec.bench.qkernels              # one table, a few minutes on an H200
    python -m qspec.bench.qkernels --quick      # fewer shapes and types
    python -m qspec.bench.qkernels --qdot-sweep # configs of the int8-activation kernels, dp4a against its emulation
    python -m qspec.bench.qkernels --qdot-one-row  # the one-row int8 product: loop unrolling, split-K, tiles
    python -m qspec.bench.qkernels --expand     # only the block expansion of prefill, step tiles against runs
    python -m qspec.bench.qkernels --shared-launches  # split products' partial sums, two types of a GDN input
                                                      # stack, the routing with h's quantization: in one launch
                                                      # each or two
    python -m qspec.bench.qkernels --head-planes  # the Q6_K LM head in planes against the file's order
    python -m qspec.bench.qkernels --b32-planes   # Q8_0 / Q5_0 / Q4_0 in planes against the file's order

Every call is timed as a CUDA-graph replay (no launch overhead, as the engine's steps run) over enough copies of the
weights to exceed the L2, so each call reads its weights from HBM. GB/s counts the bytes a call must read (the
weights in their stored type, x, and the output written); "bf16 GB/s" is the bf16 product's on the same shape (the
mat-vec of kernels/gemv.py for 1..8 rows, moe_few.moe_slots for the experts, torch.matmul for prefill), so a
quantized kernel at the same GB/s takes time in proportion to its bytes. Each 1..16-row product and expert step is
timed twice: "f32 ..." rows are the f32-expansion kernels (qmatmul.INT8_DOT off), "int8 ..." rows the int8-activation
kernels of triton_qdot.py (x quantized per 32, dp4a; their time includes the quantize launch, whose own cost the
"quantize" rows give).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.kernels import triton_common
from qspec.weights.quantize import quantize

T = GGMLQuantizationType
# The flash-next step's matrices (N, K): hidden 2560, 48 GDN value heads of 128, 24 query heads of 256, 512 experts
# of 640, the 248,320-row LM head (names as in kernels/triton_gemv.TUNED).
SHAPES = {
    "gdn_in": (16480, 2560), "gdn_out": (2560, 6144), "qsa_in": (13952, 2560), "router_shared": (1800, 2560),
    "ple_kv": (12800, 2560), "lm_head": (248320, 2560),
}
QUICK_SHAPES = ("gdn_in", "gdn_out", "lm_head")
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0)
EXPERTS, EXPERT_FF, HIDDEN, TOP_K = 512, 640, 2560, 10
ROUTINGS = 8
L2_BYTES = 256 << 20  # copies of the weights per timed graph: at least this many bytes (the H200's L2 is 60 MB)


def _down_type(qt: GGMLQuantizationType) -> GGMLQuantizationType:
    """The experts' down projection has 640-weight rows, not whole 256-weight super-blocks: llama.cpp stores the
    K-quants' there as Q5_0 (Q4_K, Q5_K) or Q8_0 (Q6_K)."""
    return {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_0, T.Q6_K: T.Q8_0}.get(qt, qt)


def _quantized(qt: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """Raw blocks [n, row_bytes] on the GPU: 64 quantized random rows tiled (timing does not depend on values)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(min(n, 64), k, device="cuda", generator=g) * k ** -0.5
    if qt in (T.Q5_0, T.Q4_1):
        from gguf import quants as gq

        raw = torch.from_numpy(gq.quantize(src.cpu().numpy(), qt)).cuda()
    else:
        raw = quantize(src, qt)
    return raw.repeat(-(-n // raw.shape[0]), 1)[:n].contiguous()


def graph_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call of `calls` captured into one CUDA graph and replayed."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    return sorted(times)[len(times) // 2]


def _copies(nbytes: int) -> int:
    return max(2, min(32, -(-L2_BYTES // max(nbytes, 1))))


def _bf16_matvec(m: int, n: int, k: int) -> tuple[torch.Tensor, float]:
    """bf16 rows x [m, k] and the bf16 product's µs per call (qspec::gemv, weight copies beyond the L2), the baseline
    every block product is compared with."""
    from qspec.kernels.gemv import gemv

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(_copies(n * k * 2))]
    return x, graph_us([partial(gemv, x, w) for w in wb])


def _row(rows: list[tuple], name: str, qt: str, shape: str, us: float, nbytes: int, bf_us: float,
         bf_bytes: int, quiet: bool = False) -> None:
    rows.append((name, qt, shape, us, nbytes / us / 1e3, bf_us, bf_bytes / bf_us / 1e3))
    r = rows[-1]
    if quiet:
        return
    print(f"{r[0]:<12} {r[1]:<6} {r[2]:<22} {r[3]:>9.2f} {r[4]:>8.0f} {r[5]:>9.2f} {r[6]:>8.0f} {r[5] / r[3]:>6.2f}x",
          flush=True)


def bench_matvec(rows: list[tuple], shapes: list[str], types: tuple, m: int) -> None:
    """The mat-vec (decode, draft: m = 1; verify, extend: m = 2..8) against the bf16 one (qspec::gemv): the
    f32-expansion kernels, then the int8-activation ones where the type has them."""
    from qspec.kernels.qdot import QDOT_QTYPES
    from qspec.kernels.qmatmul import int8_dot_mode, qmatmul_op
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    for name in shapes:
        n, k = SHAPES[name]
        x, bf_us = _bf16_matvec(m, n, k)
        bf_bytes = n * k * 2 + m * (k + n) * 2
        for qt in types:
            raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
            nbytes = raws[0].numel() + m * (k + n) * 2
            with int8_dot_mode(False):
                us = graph_us([partial(qmatmul_op, x, r, int(qt), n, k) for r in raws])
            _row(rows, f"f32 m={m}", qt.name, f"{n}x{k}", us, nbytes, bf_us, bf_bytes)
            if qt in QDOT_QTYPES:  # the kernel itself, whatever row count the dispatch gives it (INT8_MAX_ROWS)
                us = graph_us([partial(qdot_matmul_triton, x, r, int(qt), n) for r in raws])
                _row(rows, f"int8 m={m}", qt.name, f"{n}x{k}", us, nbytes, bf_us, bf_bytes)
            del raws


def bench_quantize(rows: list[tuple]) -> None:
    """The activation quantizer alone (bytes: x read, int8 words and two f32 per 32 written)."""
    from qspec.kernels.triton_qdot import quantize_x_triton

    for m in (1, 16):
        for k in (640, 2560, 6144):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
            us = graph_us([partial(quantize_x_triton, x) for x in xs])
            _row(rows, f"quantize m={m}", "bf16", f"{k}", us, m * k * 3 + m * k // 32 * 8, 1.0, 0)
def expert_routes(t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROUTINGS routings (top-k ids, bf16 weights) of t tokens, seeded by t: a different one per call of a graph, so
    the chosen experts come from HBM, not the L2."""
    g = torch.Generator(device="cuda").manual_seed(t)
    return [(torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(t)]),
             torch.rand(t, TOP_K, device="cuda", generator=g).bfloat16()) for _ in range(ROUTINGS)]


def expert_blocks(qt: GGMLQuantizationType, dq: GGMLQuantizationType) -> tuple[torch.Tensor, ...]:
    """Random gate, up (type qt) and down (type dq) blocks of all the experts: [E, rows, row_bytes] each."""
    return (_quantized(qt, EXPERTS * EXPERT_FF, HIDDEN, 1).view(EXPERTS, EXPERT_FF, -1),
            _quantized(qt, EXPERTS * EXPERT_FF, HIDDEN, 2).view(EXPERTS, EXPERT_FF, -1),
            _quantized(dq, EXPERTS * HIDDEN, EXPERT_FF, 3).view(EXPERTS, HIDDEN, -1))


def bench_moe(rows: list[tuple], types: tuple, t: int, quiet: bool = False,
              qdot_config: tuple | None = None) -> None:
    """The routed experts of a t-token step (E=512, top-10) against the bf16 moe_slots, f32-expansion then int8
    kernels; bytes: the distinct chosen experts' three matrices."""
    from qspec.kernels.moe_few import moe_slots
    from qspec.kernels.qdot import QDOT_QTYPES
    from qspec.kernels.triton_qdot import qdot_moe_few_triton
    from qspec.kernels.triton_qmatmul import qmoe_few_triton

    routes = expert_routes(t)
    h = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    distinct = sum(int(ti.unique().numel()) for ti, _ in routes) / ROUTINGS
    bf = [torch.randn(EXPERTS, EXPERT_FF, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    bf[2] = bf[2].transpose(1, 2).contiguous()
    bf_us = graph_us([partial(moe_slots, h, ti, tw, *bf) for ti, tw in routes])
    bf_bytes = int(distinct * 3 * EXPERT_FF * HIDDEN * 2)
    del bf
    for qt in types:
        dq = _down_type(qt)
        gate, up, down = expert_blocks(qt, dq)
        nbytes = int(distinct * (2 * gate[0].numel() + down[0].numel()))
        label = qt.name if dq == qt else f"{qt.name}/{dq.name}"
        parts = ((gate, int(qt)), (up, int(qt)), (down, int(dq)))
        us = graph_us([partial(qmoe_few_triton, h, ti, tw, *parts) for ti, tw in routes])
        _row(rows, f"f32 moe t={t}", label, f"{EXPERTS}x{EXPERT_FF}x{HIDDEN}", us, nbytes, bf_us, bf_bytes, quiet)
        if qt in QDOT_QTYPES and dq in QDOT_QTYPES:
            us = graph_us([partial(qdot_moe_few_triton, h, ti, tw, *parts, config=qdot_config) for ti, tw in routes])
            _row(rows, f"int8 moe t={t}", label, f"{EXPERTS}x{EXPERT_FF}x{HIDDEN}", us, nbytes, bf_us, bf_bytes,
                 quiet)
        del gate, up, down


def bench_prefill(rows: list[tuple], types: tuple, m: int = 4096) -> None:
    """Many rows (prefill): the weights expanded by bounded chunks + torch.matmul, against bf16 torch.matmul; GB/s
    here is only the weights' bytes over the time (the product is compute-bound)."""
    from qspec.kernels.qmatmul import qmatmul_op

    n, k = SHAPES["gdn_in"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf_us = graph_us([partial(torch.matmul, x, w.t())], reps=10)
    del w
    for qt in types:
        raw = _quantized(qt, n, k, 4)
        us = graph_us([partial(qmatmul_op, x, raw, int(qt), n, k)], reps=10)
        _row(rows, f"prefill m={m}", qt.name, f"{n}x{k}", us, raw.numel(), bf_us, n * k * 2)


# Prefill's expansions (N, K, type): a gdn_in matrix, a group of 109 experts' gate rows, the experts' 640-wide
# down rows, the LM head.
EXPAND_SHAPES = ((16480, 2560, T.Q4_K), (69760, 2560, T.Q4_K), (2560, 640, T.Q5_0), (2560, 640, T.Q8_0),
                 (248320, 2560, T.Q6_K), (16480, 2560, T.Q5_K), (16480, 2560, T.Q6_K), (16480, 2560, T.Q8_0),
                 (16480, 2560, T.Q4_0))


def bench_expand(rows: list[tuple]) -> None:
    """The block expansion alone (raw blocks -> bf16 [N, K]), the step-tile kernel (triton_qmatmul.dequant_triton)
    against the run kernel (triton_expand.expand_triton), and each run kernel config of EXPAND_SWEEP. Columns:
    µs, G weights/s, GB/s of bytes read (the blocks) and written (2 per weight)."""
    from qspec.kernels.triton_expand import EXPAND_CONFIG, expand_triton
    from qspec.kernels.triton_qmatmul import dequant_triton

    print(f"{'expand':<16} {'type':<6} {'shape':<14} {'µs':>9} {'Gw/s':>8} {'GB/s':>8}")
    for n, k, qt in EXPAND_SHAPES:
        raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k * 3))]
        nbytes = raws[0].numel() + n * k * 2
        kernels: list[tuple[str, Callable[..., torch.Tensor]]] = [("step tiles", dequant_triton)]
        kernels += [(f"runs {c[0]}/{c[1]}" + (" *" if c == EXPAND_CONFIG else ""),
                     partial(expand_triton, config=c)) for c in EXPAND_SWEEP]
        for label, fn in kernels:
            us = graph_us([partial(fn, r, int(qt), k, torch.bfloat16) for r in raws])
            rows.append((label, qt.name, f"{n}x{k}", us, nbytes / us / 1e3, 1.0, 0))
            print(f"{label:<16} {qt.name:<6} {f'{n}x{k}':<14} {us:>9.1f} {n * k / us / 1e3:>8.0f} "
                  f"{nbytes / us / 1e3:>8.0f}", flush=True)
        del raws


EXPAND_SWEEP = ((16, 4), (32, 4), (8, 2), (32, 8))


def moe_sweep(rows: list[tuple]) -> None:
    """Configs of the experts' kernels (rows per program, warps), Q4_K gate/up with Q5_0 down."""
    from qspec.kernels import triton_qmatmul

    for cfg in ((4, 4), (8, 4), (16, 4), (8, 2), (4, 2)):
        old = triton_qmatmul.MOE_CONFIG
        triton_qmatmul.MOE_CONFIG = cfg
        for t in (1, 6):
            r: list[tuple] = []
            bench_moe(r, (T.Q4_K,), t, quiet=True)
            rows.append(r[0])
            print(f"moe {cfg} t={t}: {r[0][3]:.2f} µs, {r[0][4]:.0f} GB/s (bf16 {r[0][5]:.2f} µs)", flush=True)
        triton_qmatmul.MOE_CONFIG = old


def sweep(rows: list[tuple]) -> None:
    """Configs of the tensor-core kernel (rows per program, warps, programs per SM) and the CUDA-core mat-vec."""
    from qspec.kernels.triton_qmatmul import dequant_triton, qmatvec_triton, qmm_triton

    n, k = SHAPES["gdn_in"]
    for qt in TYPES:
        raws = [_quantized(qt, n, k, seed=i) for i in range(4)]
        us = graph_us([partial(dequant_triton, r, int(qt), k, torch.bfloat16) for r in raws])
        _row(rows, "expand", qt.name, f"{n}x{k}", us, raws[0].numel() + n * k * 2, 1.0, 0)
    moe_sweep(rows)

    for name in QUICK_SHAPES:
        n, k = SHAPES[name]
        for m in (1, 6):
            x, bf_us = _bf16_matvec(m, n, k)
            for qt in (T.Q4_K, T.Q6_K, T.Q8_0):
                raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
                nbytes = raws[0].numel() + m * (k + n) * 2
                us = graph_us([partial(qmatvec_triton, x, r, int(qt), n) for r in raws])
                _row(rows, f"cc m={m}", qt.name, f"{n}x{k}", us, nbytes, bf_us, n * k * 2)
                for cfg in ((32, 4, 2), (64, 4, 1), (64, 4, 2)):
                    us = graph_us([partial(qmm_triton, x, r, int(qt), n, cfg) for r in raws])
                    _row(rows, f"tc{cfg[0]}/{cfg[1]}/{cfg[2]}", qt.name, f"m={m} {n}x{k}", us, nbytes, bf_us,
                         n * k * 2)
                del raws


QDOT_CONFIGS = ((16, 4, 4, 1), (32, 4, 4, 1), (32, 4, 8, 1), (64, 4, 2, 1), (16, 2, 8, 1), (16, 2, 8, 2),
                (128, 8, 1, 1))
# the one-row product's loop unrolling and split-K rule (rows, warps, programs per SM or 0 for no split, steps per
# iteration), on every decode shape and the model's block types
QDOT_ONE_ROW_CONFIGS = ((32, 4, 4, 1), (16, 2, 8, 2), (32, 2, 8, 2), (8, 2, 8, 2), (64, 4, 0, 2), (8, 2, 0, 2))
QDOT_ONE_ROW_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0)


def qdot_one_row_sweep(rows: list[tuple]) -> None:
    """The one-row int8 product (decode) over QDOT_ONE_ROW_CONFIGS, each shape and type; the row marked * is the
    default. The experts' 640-wide down rows (Q5_0/Q8_0) are the 2,560 x 640 shape."""
    from qspec.kernels.triton_qdot import QDOT_CONFIG, QdotConfig, qdot_matmul_triton

    shapes = dict(SHAPES, expert_down=(2560, 640))
    del shapes["ple_kv"]
    for name, (n, k) in shapes.items():
        x, bf_us = _bf16_matvec(1, n, k)
        for qt in QDOT_ONE_ROW_TYPES:
            if qt.name.endswith("_K") and k % 256:
                continue
            raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
            nbytes = raws[0].numel() + (k + n) * 2
            for cfg in QDOT_ONE_ROW_CONFIGS:
                us = graph_us([partial(qdot_matmul_triton, x, r, int(qt), n, cfg) for r in raws])
                mark = "*" if QdotConfig(*cfg) == QDOT_CONFIG else ""
                _row(rows, "int8 " + "/".join(map(str, cfg)) + mark, qt.name, f"{name} {n}x{k}", us, nbytes, bf_us,
                     n * k * 2)
            del raws
# the experts' (rows, warps[, gate/up steps per iteration, down's rows, down's steps per iteration]): around the
# default (8, 2, 5, 16, 3): narrower and wider blocks, fewer and more steps per iteration, down unrolled over its whole
# K (640: three steps) in 8 to 32 rows
# MoeConfig's fields: the default, its neighbours, and gate/up's K (2,560: ten steps) in 2, 5 or 10 shares (the
# earlier grids' other configs lost to these: BENCHMARKS.md §5b)
QDOT_MOE_CONFIGS = ((4, 1, 5, 16, 3), (8, 2, 5, 16, 3), (8, 1, 5, 16, 3), (4, 1, 5, 16, 3, 2), (8, 1, 5, 16, 3, 2),
                    (8, 2, 5, 16, 3, 2), (4, 1, 2, 16, 3, 5), (8, 2, 2, 16, 3, 5), (4, 1, 1, 16, 3, 10))
# Q4_K gate/up with K lanes (MoeConfig.lanes: 2, 4, 8 super-blocks side by side per row), whole or in two shares
QDOT_MOE_LANES_CONFIGS = ((8, 2, 5, 16, 3, 1, 2), (8, 4, 2, 16, 3, 1, 4), (8, 2, 2, 16, 3, 2, 2),
                          (8, 8, 1, 16, 3, 1, 8))


def qdot_sweep(rows: list[tuple]) -> None:
    """Configs of the int8-activation kernels (rows per program, warps, programs per SM; the experts' rows per
    program, warps), and dp4a's shift-and-multiply emulation (asm=False) against the instruction."""
    from qspec.kernels.triton_qdot import QDOT_CONFIG, qdot_matmul_triton

    bench_quantize(rows)
    for name in QUICK_SHAPES:
        n, k = SHAPES[name]
        for m in (1, 2, 4, 8):
            x, bf_us = _bf16_matvec(m, n, k)
            for qt in (T.Q4_K, T.Q6_K, T.Q8_0):
                raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
                nbytes = raws[0].numel() + m * (k + n) * 2
                for cfg in QDOT_CONFIGS:
                    us = graph_us([partial(qdot_matmul_triton, x, r, int(qt), n, cfg) for r in raws])
                    _row(rows, "int8 " + "/".join(map(str, cfg)), qt.name, f"m={m} {n}x{k}", us, nbytes, bf_us,
                         n * k * 2)
                us = graph_us([partial(qdot_matmul_triton, x, r, int(qt), n, QDOT_CONFIG, False) for r in raws])
                _row(rows, "int8 emul", qt.name, f"m={m} {n}x{k}", us, nbytes, bf_us, n * k * 2)
                del raws
    qdot_moe_sweep(rows)


# A two-type stack at the shapes of GDN's input projections (flash-next geometry, one x of 2,560): qkv (10,240 rows)
# in Q5_K, the output gate (6,144) and the beta / alpha logits (2 x 48) in Q4_K, as qspec's Q4_K_M mix had them
# before it followed llama.cpp's (weights/quant_mix.py: qkv Q6_K in the more-bits layers, else Q4_K like the rest)
GDN_IN_Q4KM = ((T.Q5_K, 10240), (T.Q4_K, 6240))


def bench_stacked(rows: list[tuple], reps: int = 5) -> None:
    """One-row stacked products whose parts differ in type: both parts in one product launch and one sum launch
    (triton_qdot.PAIR_PARTS) against a launch pair per part, alternated `reps` times in this process (same x, the
    same weight copies)."""
    from qspec.kernels import triton_qdot
    from qspec.kernels.triton_common import module_flag

    k = HIDDEN
    n = sum(r for _, r in GDN_IN_Q4KM)
    x, bf_us = _bf16_matvec(1, n, k)
    one = [_quantized(qt, r, k, seed=i) for i, (qt, r) in enumerate(GDN_IN_Q4KM)]
    nbytes = sum(r.numel() for r in one) + (k + n) * 2
    copies = [[(_quantized(qt, r, k, seed=10 * c + i), int(qt)) for i, (qt, r) in enumerate(GDN_IN_Q4KM)]
              for c in range(_copies(nbytes))]
    shape = "+".join(f"{qt.name}:{r}" for qt, r in GDN_IN_Q4KM) + f"x{k}"
    for rep in range(reps):
        for paired in (True, False):
            with module_flag(triton_qdot.__name__, "PAIR_PARTS", paired):
                us = graph_us([partial(triton_qdot.qdot_stacked_triton, x, parts) for parts in copies])
            _row(rows, f"{'pair' if paired else 'apart'} r{rep}", "mix", shape, us, nbytes, bf_us, n * k * 2)


# K-quant products' configs with K lanes (rows, warps, programs per SM, steps per iteration, super-blocks side by side
# per row and step): the default first, then a row's K over 2, 4 or 8 lanes
QDOT_LANES_CONFIGS = ((16, 2, 8, 2, 1), (8, 2, 8, 2, 2), (16, 4, 8, 2, 2), (8, 4, 8, 2, 4), (8, 4, 8, 1, 4),
                      (16, 4, 8, 1, 2), (8, 4, 4, 2, 4), (8, 4, 0, 2, 4), (16, 4, 0, 2, 2), (16, 8, 8, 2, 4),
                      (8, 8, 8, 2, 8), (8, 8, 0, 2, 8), (8, 8, 8, 1, 8))
LANES_SHAPES = ("gdn_in", "gdn_out", "qsa_in", "router_shared")


def qdot_lanes_sweep(rows: list[tuple], ms: tuple[int, ...], reps: int = 2) -> None:
    """Q4_K/Q5_K products, and the Q4_K_M GDN input stack (two types, one launch), over QDOT_LANES_CONFIGS at each
    x row count, the configs alternated `reps` times in this process (same x, same weight copies)."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton, qdot_stacked_triton

    k = HIDDEN
    n = sum(r for _, r in GDN_IN_Q4KM)
    for m in ms:
        x, bf_us = _bf16_matvec(m, n, k)
        copies = [[(_quantized(qt, r, k, seed=10 * c + i), int(qt)) for i, (qt, r) in enumerate(GDN_IN_Q4KM)]
                  for c in range(_copies(n * k))]
        nbytes = sum(r.numel() for r, _ in copies[0]) + m * (k + n) * 2
        for rep, cfg in itertools.product(range(reps), QDOT_LANES_CONFIGS):
            us = graph_us([partial(qdot_stacked_triton, x, parts, cfg) for parts in copies])
            _row(rows, "/".join(map(str, cfg)) + f" r{rep}", "mix", f"m={m} gdn_in stack", us, nbytes, bf_us,
                 n * k * 2)
        del copies
        for name, qt in itertools.product(LANES_SHAPES, (T.Q4_K, T.Q5_K)):
            n2, k2 = SHAPES[name]
            x2, bf2 = _bf16_matvec(m, n2, k2)
            raws = [_quantized(qt, n2, k2, seed=i) for i in range(_copies(n2 * k2))]
            nbytes = raws[0].numel() + m * (k2 + n2) * 2
            for rep, cfg in itertools.product(range(reps), QDOT_LANES_CONFIGS):
                us = graph_us([partial(qdot_matmul_triton, x2, r, int(qt), n2, cfg) for r in raws])
                _row(rows, "/".join(map(str, cfg)) + f" r{rep}", qt.name, f"m={m} {name} {n2}x{k2}", us, nbytes,
                     bf2, n2 * k2 * 2)
            del raws


# one-row products that split K at the model's shapes (shares on the H200: 6, 10, 3, 2) and their Q4_K_M types
SPLIT_SUM_SHAPES = (("gdn_out", T.Q4_K), ("router_shared", T.Q4_K), ("expert_down", T.Q5_0), ("qsa_in", T.Q4_K))


def bench_split_sums(rows: list[tuple], reps: int = 5) -> None:
    """One-row products that split K with their partial sums added in the product's launch
    (triton_common.SUM_IN_PRODUCT) against a sum launch of their own, alternated `reps` times in this process (the
    same x and weight copies)."""
    from qspec.kernels import triton_qdot
    from qspec.kernels.triton_common import module_flag

    shapes = dict(SHAPES, expert_down=(HIDDEN, EXPERT_FF))
    for name, qt in SPLIT_SUM_SHAPES:
        n, k = shapes[name]
        x, bf_us = _bf16_matvec(1, n, k)
        raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
        nbytes = raws[0].numel() + (k + n) * 2
        for rep in range(reps):
            for here in (True, False):
                with module_flag(triton_common.__name__, "SUM_IN_PRODUCT", here):
                    us = graph_us([partial(triton_qdot.qdot_matmul_triton, x, r, int(qt), n) for r in raws])
                _row(rows, f"{'here' if here else 'apart'} r{rep}", qt.name, f"{name} {n}x{k}", us, nbytes, bf_us,
                     n * k * 2)


# the verify's tensor-core products at the model's shapes and their Q4_K_M types
TC_SHAPES = (("gdn_in", T.Q5_K), ("gdn_out", T.Q4_K), ("qsa_in", T.Q4_K), ("router_shared", T.Q4_K),
             ("gdn_out", T.Q6_K))


def bench_tensor_cores(rows: list[tuple], reps: int = 3) -> None:
    """The tensor-core block product at 2-8 rows, alternated `reps` times in this process (the same x and weight
    copies): K-quants expanded two weights a register ("pairs", triton_qmatmul.PAIRS) or in f32 ("f32"), its
    split sums in its launch ("here", triton_common.SUM_IN_PRODUCT) or a launch apart ("apart"); the int8 kernel
    beside them."""
    from qspec.kernels import triton_qmatmul
    from qspec.kernels.triton_common import module_flag
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    arms = (("pairs here", True, True), ("f32 here", False, True), ("pairs apart", True, False))
    for name, qt in TC_SHAPES:
        n, k = SHAPES[name]
        raws = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
        for m in (2, 4, 6, 8):
            x, bf_us = _bf16_matvec(m, n, k)
            nbytes = raws[0].numel() + m * (k + n) * 2
            for rep in range(reps):
                for label, pairs, here in arms:
                    with triton_qmatmul.pairs_mode(pairs), \
                            module_flag(triton_common.__name__, "SUM_IN_PRODUCT", here):
                        us = graph_us([partial(triton_qmatmul.qmm_triton, x, r, int(qt), n) for r in raws])
                    _row(rows, f"{label} m={m} r{rep}", qt.name, f"{name} {n}x{k}", us, nbytes, bf_us, n * k * 2)
                us = graph_us([partial(qdot_matmul_triton, x, r, int(qt), n) for r in raws])
                _row(rows, f"int8 m={m} r{rep}", qt.name, f"{name} {n}x{k}", us, nbytes, bf_us, n * k * 2)
        del raws


# the Q6_K LM head's one-row configs timed in planes besides the default (rows, warps, programs per SM, unroll)
HEAD_PLANES_CONFIGS = ((16, 2, 8, 2), (32, 4, 8, 2), (32, 2, 8, 4), (64, 4, 8, 2))


def bench_head_planes(rows: list[tuple], reps: int = 3) -> None:
    """The Q6_K LM head (248,320 x 2,560) with its rows in planes (QuantWeight.to_planes) against the file's order,
    alternated `reps` times in this process: one row through the int8 kernel (the head's default config, and
    HEAD_PLANES_CONFIGS in planes), 2-8 rows through the tensor-core kernel ("tc") and the int8 kernel ("int8")."""
    from qspec.kernels.triton_qdot import QDOT_CONFIG_Q6K_HEAD, qdot_matmul_triton
    from qspec.kernels.triton_qmatmul import qmm_triton
    from qspec.weights.qweight import Q6_K_PLANES, QuantWeight

    n, k = SHAPES["lm_head"]
    blocks = [_quantized(T.Q6_K, n, k, seed=i) for i in range(_copies(n * k))]
    planes = [QuantWeight(r, T.Q6_K, (n, k)).to_planes().raw for r in blocks]
    layouts = (("file", blocks, int(T.Q6_K)), ("planes", planes, Q6_K_PLANES))

    def kernels(m: int, code: int) -> list[tuple[str, Callable[..., torch.Tensor]]]:
        """(label, product) of what is timed for m rows of a layout."""
        if m > 1:
            return [("tc", qmm_triton), ("int8", qdot_matmul_triton)]
        cfgs = (QDOT_CONFIG_Q6K_HEAD, *HEAD_PLANES_CONFIGS) if code == Q6_K_PLANES else (QDOT_CONFIG_Q6K_HEAD,)
        return [("/".join(map(str, c)), partial(qdot_matmul_triton, config=c)) for c in cfgs]

    for m in (1, 2, 4, 6, 8):
        x, bf_us = _bf16_matvec(m, n, k)
        for rep in range(reps):
            for name, raws, code in layouts:
                nbytes = raws[0].numel() + m * (k + n) * 2
                for label, fn in kernels(m, code):
                    us = graph_us([partial(fn, x, r, code, n) for r in raws])
                    _row(rows, f"{name} {label} r{rep}", "Q6_K", f"m={m} {n}x{k}", us, nbytes, bf_us, n * k * 2)


def bench_q6k_planes(rows: list[tuple], reps: int = 3, ms: tuple[int, ...] = (1, 2, 6, 8)) -> None:
    """Dense Q6_K matrices at the model's shapes with their rows in planes (model.block_layouts) against the file's
    order, alternated `reps` times in this process: `ms` rows through the int8 kernel, and through the tensor cores
    past one row."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton
    from qspec.kernels.triton_qmatmul import qmm_triton
    from qspec.weights.qweight import Q6_K_PLANES, QuantWeight

    for shape in ("gdn_in", "gdn_out", "qsa_in"):
        n, k = SHAPES[shape]
        blocks = [_quantized(T.Q6_K, n, k, seed=i) for i in range(_copies(n * k))]
        planes = [QuantWeight(r, T.Q6_K, (n, k)).to_planes().raw for r in blocks]
        layouts = (("file", blocks, int(T.Q6_K)), ("planes", planes, Q6_K_PLANES))
        for m in ms:
            x, bf_us = _bf16_matvec(m, n, k)
            kernels = (("int8", qdot_matmul_triton),) + ((("tc", qmm_triton),) if m > 1 else ())
            for rep in range(reps):
                for (name, raws, code), (label, fn) in itertools.product(layouts, kernels):
                    us = graph_us([partial(fn, x, r, code, n) for r in raws])
                    _row(rows, f"{name} {label} m={m} r{rep}", "Q6_K", f"{shape} {n}x{k}", us, raws[0].numel(),
                         bf_us, n * k * 2)
        del blocks, planes


# the routed experts timed with their 32-weight-block matrices in planes against the file's order: (gate/up, down)
PLANES_EXPERTS = ((T.Q4_K, T.Q5_0), (T.Q4_K, T.Q8_0), (T.Q8_0, T.Q8_0))


def _in_planes(raw: torch.Tensor, qt: GGMLQuantizationType, k: int) -> torch.Tensor:
    from qspec.weights.qweight import QuantWeight

    return QuantWeight(raw, qt, (*raw.shape[:-1], k)).to_planes().raw


def bench_b32_planes(rows: list[tuple], reps: int = 2) -> None:
    """Q8_0, Q5_0 and Q4_0 matrices with their rows in planes (QuantWeight.to_planes) against the file's order,
    alternated `reps` times in this process: 1-8 rows through the int8 kernel and 2-8 through the tensor cores at
    the step's shapes, the expansion of prefill, and the routed experts (PLANES_EXPERTS) at 1 and 6 tokens."""
    from qspec.kernels.triton_expand import expand_triton
    from qspec.kernels.triton_qdot import qdot_matmul_triton
    from qspec.kernels.triton_qmatmul import qmm_triton
    from qspec.weights.qweight import PLANES

    for qt in (T.Q8_0, T.Q5_0, T.Q4_0):
        for shape in ("gdn_in", "gdn_out", "router_shared"):
            n, k = SHAPES[shape]
            blocks = [_quantized(qt, n, k, seed=i) for i in range(_copies(n * k))]
            layouts = (("file", blocks, int(qt)), ("planes", [_in_planes(r, qt, k) for r in blocks], PLANES + qt))
            for m in (1, 2, 4, 6, 8):
                x, bf_us = _bf16_matvec(m, n, k)
                kernels = (("int8", qdot_matmul_triton),) + ((("tc", qmm_triton),) if m > 1 else ())
                for rep in range(reps):
                    for (name, raws, code), (label, fn) in itertools.product(layouts, kernels):
                        us = graph_us([partial(fn, x, r, code, n) for r in raws])
                        _row(rows, f"{name} {label} m={m} r{rep}", qt.name, f"{shape} {n}x{k}", us, raws[0].numel(),
                             bf_us, n * k * 2)
            for name, raws, code in layouts:
                us = graph_us([partial(expand_triton, r, code, k, torch.bfloat16) for r in raws])
                _row(rows, f"{name} expand", qt.name, f"{shape} {n}x{k}", us, raws[0].numel() + n * k * 2, 1.0, 0)
            del blocks, layouts
    for t in (1, 6):
        for gq, dq in PLANES_EXPERTS:
            _planes_experts_ab(rows, gq, dq, t, reps)


def _planes_experts_ab(rows: list[tuple], gq: GGMLQuantizationType, dq: GGMLQuantizationType, t: int,
                       reps: int) -> None:
    """The routed experts of a t-token step (int8 kernels), their Q8_0/Q5_0/Q4_0 matrices in planes or not."""
    from qspec.kernels.triton_qdot import qdot_moe_few_triton
    from qspec.weights.qweight import PLANES, PLANES_BLOCK32

    routes = expert_routes(t)
    h = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    distinct = sum(int(ti.unique().numel()) for ti, _ in routes) / ROUTINGS
    gate, up, down = expert_blocks(gq, dq)
    nbytes = int(distinct * (2 * gate[0].numel() + down[0].numel()))

    def held(raw: torch.Tensor, qt: GGMLQuantizationType, k: int) -> tuple[torch.Tensor, int]:
        return (_in_planes(raw, qt, k), PLANES + qt) if qt in PLANES_BLOCK32 else (raw, int(qt))

    layouts = (("file", ((gate, int(gq)), (up, int(gq)), (down, int(dq)))),
               ("planes", (held(gate, gq, HIDDEN), held(up, gq, HIDDEN), held(down, dq, EXPERT_FF))))
    for rep in range(reps):
        for name, parts in layouts:
            us = graph_us([partial(qdot_moe_few_triton, h, ti, tw, *parts) for ti, tw in routes])
            _row(rows, f"{name} moe t={t} r{rep}", f"{gq.name}/{dq.name}", f"{EXPERTS}x{EXPERT_FF}x{HIDDEN}", us,
                 nbytes, 1.0, 0)


def bench_route_quantize(rows: list[tuple], reps: int = 5) -> None:
    """The routing of t tokens (512 experts, top-10) with h's quantization for the routed experts in its launch
    (route.route_top_k_quantized) against the routing then the quantizer's own launch, alternated in this process;
    each row's comparison columns ("bf16 µs") hold the two launches' time."""
    from qspec.kernels.route import route_top_k, route_top_k_quantized
    from qspec.kernels.triton_qdot import quantize_x_triton

    for t in (1, 6):
        calls = []
        for i in range(ROUTINGS):
            g = torch.Generator(device="cuda").manual_seed(i)
            logits = torch.randn(t, EXPERTS, device="cuda", generator=g).bfloat16()
            h = torch.randn(t, HIDDEN, device="cuda", generator=g).bfloat16()
            calls.append((logits, h))
        nbytes = t * (EXPERTS + HIDDEN) * 2
        for rep in range(reps):
            one = graph_us([partial(route_top_k_quantized, lg, TOP_K, h) for lg, h in calls])
            two = graph_us([c for lg, h in calls for c in (partial(route_top_k, lg, TOP_K),
                                                            partial(quantize_x_triton, h))]) * 2
            _row(rows, f"one r{rep}", "bf16", f"route+quant t={t}", one, nbytes, two, nbytes)


def qdot_moe_sweep(rows: list[tuple]) -> None:
    """The routed experts' int8 kernels (all four launches) over QDOT_MOE_CONFIGS (Q4_K and Q6_K gate/up) and
    QDOT_MOE_LANES_CONFIGS (Q4_K), 1 and 6 tokens."""
    from qspec.kernels.triton_qdot import MoeConfig

    for cfg in QDOT_MOE_CONFIGS + QDOT_MOE_LANES_CONFIGS:
        for t in (1, 6):
            r: list[tuple] = []
            bench_moe(r, (T.Q4_K,) if MoeConfig(*cfg).lanes > 1 else (T.Q4_K, T.Q6_K), t, quiet=True, qdot_config=cfg)
            for row in r[1::2]:
                rows.append(row)
                print(f"int8 moe {cfg} t={t} {row[1]}: {row[3]:.2f} µs, {row[4]:.0f} GB/s (bf16 {row[5]:.2f} µs)",
                      flush=True)


def _x_rows(text: str) -> tuple[int, ...]:
    """--x-rows: `3,4,5` -> (3, 4, 5), each a row count the int8 kernel takes."""
    from qspec.kernels.triton_qdot import MAX_ROWS

    ms = tuple(int(m) for m in text.split(","))  # argparse reports a ValueError as an invalid --x-rows value
    if not all(1 <= m <= MAX_ROWS for m in ms):
        raise argparse.ArgumentTypeError(f"row counts must be 1..{MAX_ROWS}, got {text!r}")
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qspec.bench.qkernels", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="three shapes, Q4_K and Q8_0 only")
    ap.add_argument("--sweep", action="store_true", help="only the kernel configs, three shapes")
    ap.add_argument("--qdot-sweep", action="store_true", help="only the int8-activation kernels' configs")
    ap.add_argument("--qdot-one-row", action="store_true", help="only the one-row int8 product's unroll/split grid")
    ap.add_argument("--qdot-moe", action="store_true", help="only the routed experts' int8 kernel configs")
    ap.add_argument("--expand", action="store_true", help="only the block expansion (step tiles against runs)")
    ap.add_argument("--shared-launches", action="store_true", help="only work that shares a launch against its own "
                    "launches: split products' partial sums, a Q4_K_M GDN input stack's two types, the routing and "
                    "h's quantization")
    ap.add_argument("--head-planes", action="store_true", help="only the Q6_K LM head with its rows in planes "
                    "against the file's order")
    ap.add_argument("--b32-planes", action="store_true", help="only Q8_0, Q5_0 and Q4_0 rows in planes against the "
                    "file's order: products, expansion, routed experts")
    ap.add_argument("--q6k-planes", action="store_true", help="only dense Q6_K matrices in planes against the "
                    "file's order (int8 and tensor-core products)")
    ap.add_argument("--tensor-cores", action="store_true", help="only the tensor-core product at 2-8 rows: K-quants "
                    "expanded in pairs or in f32, split sums in its launch or apart, the int8 kernel beside them")
    ap.add_argument("--qdot-lanes", action="store_true", help="only Q4_K/Q5_K products with K lanes (super-blocks "
                    "side by side per row) against the default config, at --x-rows")
    ap.add_argument("--x-rows", type=_x_rows, default=(1, 2, 6, 8),
                    help="--q6k-planes, --qdot-lanes: the x row counts timed, comma-separated (1-8: the int8 "
                    "kernel's)")
    ap.add_argument("--pdl", action="store_true", help="kernels launched with programmatic dependent launch (as the "
                    "engine does on Hopper and later)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("qspec: error: qkernels needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    with triton_common.pdl_mode(args.pdl and triton_common.pdl_supported(torch.device("cuda"))):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    shapes = list(QUICK_SHAPES if args.quick else SHAPES)
    types = (T.Q4_K, T.Q8_0) if args.quick else TYPES
    print(f"# {torch.cuda.get_device_name()}; µs per call (CUDA-graph replay, weights from HBM); GB/s = bytes read "
          f"/ time; bytes per weight: " + ", ".join(f"{q.name} {GGML_QUANT_SIZES[q][1] / GGML_QUANT_SIZES[q][0]:.3f}"
                                                    for q in types))
    print(f"{'kernel':<12} {'type':<6} {'shape':<22} {'µs':>9} {'GB/s':>8} {'bf16 µs':>9} {'bf16GB/s':>8} {'speed':>7}")
    rows: list[tuple] = []
    if args.sweep:
        sweep(rows)
        return 0
    if args.qdot_sweep:
        qdot_sweep(rows)
        return 0
    if args.qdot_one_row:
        qdot_one_row_sweep(rows)
        return 0
    if args.qdot_moe:
        qdot_moe_sweep(rows)
        return 0
    if args.expand:
        bench_expand(rows)
        return 0
    if args.head_planes:
        bench_head_planes(rows)
        return 0
    if args.b32_planes:
        bench_b32_planes(rows)
        return 0
    if args.tensor_cores:
        bench_tensor_cores(rows)
        return 0
    if args.q6k_planes:
        bench_q6k_planes(rows, ms=args.x_rows)
        return 0
    if args.qdot_lanes:
        qdot_lanes_sweep(rows, args.x_rows)
        return 0
    if args.shared_launches:
        bench_split_sums(rows)
        bench_stacked(rows)
        bench_route_quantize(rows)
        return 0
    bench_quantize(rows)
    bench_matvec(rows, shapes, types, 1)
    bench_matvec(rows, shapes[:3] if not args.quick else shapes, types, 6)
    bench_matvec(rows, [s for s in shapes if s in QUICK_SHAPES], types, 8)
    bench_moe(rows, types, 1)
    bench_moe(rows, types, 6)
    bench_prefill(rows, types)
    bench_expand(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
