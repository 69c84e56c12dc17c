"""Configuration sweeps and A/B timings of the Triton kernels on CUDA (`python -m qspec.bench.kernels --NAME`).

Each sweep checks every configuration it times against a reference first (a wrong configuration is reported, never
timed as a winner), and times calls as CUDA graphs of back-to-back calls over copies of the weights that exceed the
H200's 50 MB L2, so every call reads HBM as inside a real step. Rows go to the runner's variants table.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qspec.bench.kernels import (
    GEMV_SHAPES,
    TOL,
    Row,
    Runner,
    check_gdn,
    check_moe,
    dense_attention_path,
    masked_attn_inputs,
    moe_inputs,
    rel_err,
)
from qspec.kernels.masked_attention import masked_attention_torch
from qspec.kernels.moe_few import moe_few_torch, sum_slots
from qspec.kernels.q4 import Q4Weight, q4_q8_matvec_torch
from qspec.kernels.triton_argmax import argmax_rows_triton
from qspec.kernels.triton_common import pdl_mode
from qspec.kernels.triton_gemv import TUNED_FEW, gemm_few_triton, gemv_triton
from qspec.kernels.triton_hc_mix import hc_out_triton
from qspec.kernels.triton_masked_attention import masked_attention_triton
from qspec.kernels.triton_moe import moe_slots_grouped_triton, moe_slots_triton
from qspec.kernels.triton_q4 import q4_q8_matvec_triton


def graph_per_call(fn: Callable[[int], object], repeat: int = 24) -> float:
    """µs per call of fn(i), i = 0..repeat-1 recorded back to back in one CUDA graph (the kernel plus its node
    latency, as inside a step's graph)."""
    import triton.testing

    g = torch.cuda.CUDAGraph()
    fn(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(repeat):
            fn(i)
    return float(triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median")) * 1e3 / repeat


def ranked(times: list[tuple[float, tuple]], spec: str = ".2f") -> tuple[float, tuple | None, str]:
    """A sweep's timed (µs, config) pairs, sorted in place fastest first -> (the fastest µs, inf when none was timed;
    its config or None; the five fastest as text)."""
    times.sort()
    t_best, best = times[0] if times else (float("inf"), None)
    return t_best, best, ", ".join(f"{cfg} {format(t, spec)}" for t, cfg in times[:5])


def weight_copies(n_bytes: int, most: int = 24) -> int:
    """How many copies of an n_bytes matrix a timed graph cycles through so that its calls read HBM, not the 50 MB
    L2: at least 160 MB of them, at most `most` (one call each), at least one."""
    return max(1, min(most, -(-(160 << 20) // n_bytes)))


def attention_sweep(R: Runner, copies: int = 12) -> None:
    """The masked attention kernel at the real geometry (24/2 heads of 256, a 4,608-cell q8_0 bucket) over a grid of
    configs (rows per program, cells per step, warps, stages, programs), for a draft step's causal row, a decode's
    QSA row and a verify's six QSA rows: each checked against the f32 reference and timed in a CUDA graph over
    `copies` caches (58 MB, more than the 50 MB L2), beside the model's default path on the same inputs."""
    from qspec.kernels.triton_masked_attention import FEW_ROWS_CONFIG, ONE_ROW_CONFIG

    print(f"\nmasked attention sweep: us per call in a graph over {copies} caches (bf16 q, q8_0 cells)")
    for T, keep in ((1, 1.0), (1, 0.45), (6, 0.45)):
        sets = [masked_attn_inputs(T, 24, 2, 256, 4608, "q8_0", torch.bfloat16, keep, "cuda") for _ in range(copies)]
        ref = masked_attention_torch(*sets[0])
        t_path = graph_per_call(lambda i, s=sets: dense_attention_path(*s[i % copies]), copies)
        # fewer programs than the SM count too: a one-row program over a 64-cell chunk is mostly fixed cost (q load,
        # partials store), and longer chunks trade it against the GPU's width
        grid = [(rp, bn, w, st, tg) for rp in (1, 2, 4) if rp <= T for bn in (32, 64) for w in (4, 8)
                for st in (1, 3) for tg in (33, 66, 132, 264, 528)]
        times, bad = [], []
        for cfg in grid:
            try:
                e = rel_err(masked_attention_triton(*sets[0], config=cfg), ref)
            except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                bad.append((cfg, type(exc).__name__))
                continue
            if e >= TOL[torch.bfloat16]:
                bad.append((cfg, f"{e:.1e}"))
                continue
            times.append((graph_per_call(lambda i, c=cfg, s=sets: masked_attention_triton(*s[i % copies], config=c),
                                         copies), cfg))
        _, _, top = ranked(times, ".1f")
        chosen = ONE_ROW_CONFIG if T == 1 else FEW_ROWS_CONFIG
        dflt = next((t for t, c in times if c == chosen), None)
        print(f"  T={T} keep={keep}: default path {t_path:.1f} us; kernel's config {chosen} "
              f"{'-' if dflt is None else f'{dflt:.1f}'} us; best: "
              + top + (f"; failed: {bad}" if bad else ""), flush=True)
        best = times[0] if times else None
        R.add(Row(f"masked attention sweep T={T} keep={keep}", best is not None and not bad,
                  f"default path {t_path:.1f} us, default config {dflt} us, best {best}; {len(grid)} configs, "
                  f"failed: {bad}"), variant=True)


def q4_sweep(R: Runner, N: int = 248320, K: int = 2560, repeat: int = 8) -> None:
    """The draft's Q4_0 LM head at the real geometry, one bf16 row, over a grid of configs: each checked against
    its reference and timed (with the x quantize kernel) as a CUDA graph of `repeat` calls (the 357 MB head far
    exceeds the 50 MB L2, so every call reads it from HBM). Earlier f32-FMA and tensor-core designs were swept
    beside it: benchmarks/results/gpu_kernels_q4_sweep_s8.txt and gpu_kernels_q4_sweep_s8b.txt."""
    W = Q4Weight.from_dense(0.02 * torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    ref = q4_q8_matvec_torch(x, W)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    nbytes = N * K // 2 + N * K // 32 * 2
    grid = [(bn, nb, w, st) for bn in (16, 32, 64) for nb in (8, 16) for w in (1, 2, 4) for st in (1, 2, 3)]
    print(f"\nq4 head sweep: us per call in a graph of {repeat} calls (M=1, bf16, {nbytes / 1e6:.0f} MB)")
    best, t_best, bad = None, float("inf"), []
    for cfg in grid:
        def call(_: int, cfg: tuple[int, int, int, int] = cfg) -> None:
            q4_q8_matvec_triton(x, W.packed, W.scales, config=cfg, out=out)
        try:
            call(0)
        except Exception as exc:  # a config the compiler rejects (registers, shared memory)
            bad.append((cfg, type(exc).__name__))
            continue
        e = rel_err(out, ref)
        if e >= 8e-3:
            bad.append((cfg, f"{e:.1e}"))
            continue
        t = graph_per_call(call, repeat)
        print(f"  {cfg}: {t:.1f} us ({nbytes / t / 1e6:.2f} TB/s)", flush=True)
        if t < t_best:
            best, t_best = cfg, t
    R.add(Row(f"q4 head sweep N={N} K={K}", best is not None,
              f"best {t_best:.1f} us ({nbytes / t_best / 1e6:.2f} TB/s) cfg={best}; {len(grid)} configs, "
              f"failed: {bad}"), variant=True)


def moe_sweep(R: Runner, repeat: int = 8) -> None:
    """Routed experts at the real geometry (E=512, D=2560, F=640, k=10, bf16) for a verify's 6 and 4 rows and a
    decode's 1: the per-pair kernels against the grouped ones (each distinct expert read once), default configs
    and a grid, each timed as a CUDA graph of `repeat` calls (the ~60 chosen experts, ~390 MB, exceed the L2)."""
    grid = [(bf1, bd1, bd2, bf2, w, st) for bf1, bd1 in ((32, 128), (64, 64), (16, 256), (64, 128))
            for bd2, bf2 in ((64, 128), (32, 128), (128, 64)) for w in (4, 8) for st in (3, 4)]
    inputs_all = moe_inputs(16, 2560, 640, 512, 10, torch.bfloat16, "cuda")
    print(f"\nMoE sweep: us per call in a graph of {repeat} calls (E=512, bf16)")
    for M in (6, 4, 1):
        h, top_i, top_w, gate, up, down = inputs_all
        inputs = (h[:M].contiguous(), top_i[:M].contiguous(), top_w[:M].contiguous(), gate, up, down)
        ref = moe_few_torch(*inputs)
        nbytes = int(torch.unique(inputs[1]).numel()) * 3 * 640 * 2560 * 2
        t_pair = graph_per_call(lambda i, a=inputs: moe_slots_triton(*a), repeat)
        t_group = graph_per_call(lambda i, a=inputs: moe_slots_grouped_triton(*a), repeat)
        best, t_best, bad = None, float("inf"), []
        for cfg in grid:
            e = rel_err(sum_slots(moe_slots_grouped_triton(*inputs, config=cfg)), ref)
            if e >= TOL[torch.bfloat16]:
                bad.append((cfg, e))
                continue
            t = graph_per_call(lambda i, a=inputs, cfg=cfg: moe_slots_grouped_triton(*a, config=cfg), repeat)
            if t < t_best:
                best, t_best = cfg, t
        R.add(Row(f"moe sweep M={M}", not bad,
                  f"per pair {t_pair:.1f} us ({nbytes / t_pair / 1e6:.2f} TB/s of distinct experts), grouped default "
                  f"{t_group:.1f}, best {t_best:.1f} us ({nbytes / t_best / 1e6:.2f} TB/s) cfg={best}; "
                  f"{len(grid)} configs, wrong: {bad}"), variant=True)


def pdl_ab(R: Runner, repeat: int = 24, rounds: int = 3) -> None:
    """Programmatic dependent launch against the default launch, in one process: step-sized kernels as CUDA graphs of
    `repeat` back-to-back calls (weights and caches cycled through copies that exceed the 50 MB L2), each timed with
    PDL off and on, alternated `rounds` times (medians). The outputs must be identical: PDL changes when a kernel is
    scheduled, not what it computes."""
    bf = torch.bfloat16
    cases: list[tuple[str, Callable[[int], torch.Tensor]]] = []
    shapes = (("gemv 1 x 2560x6144 (GDN/QSA out)", 1, 2560, 6144), ("gemv 1 x 1800x2560 (router)", 1, 1800, 2560),
              ("few rows 6 x 2560x6144", 6, 2560, 6144))
    for name, M, N, K in shapes:
        c = weight_copies(N * K * 2, repeat)
        Ws = [(0.02 * torch.randn(N, K, device="cuda")).to(bf) for _ in range(c)]
        x = torch.randn(M, K, device="cuda").to(bf)
        kern = gemv_triton if M == 1 else gemm_few_triton
        cases.append((name, lambda i, Ws=Ws, x=x, kern=kern, c=c: kern(x, Ws[i % c])))
    for T in (1, 6):
        sets = [masked_attn_inputs(T, 24, 2, 256, 4608, "q8_0", bf, 1.0 if T == 1 else 0.45, "cuda") for _ in range(12)]
        cases.append((f"masked attention {T} row(s), 4608 q8_0 cells",
                      lambda i, s=sets: masked_attention_triton(*s[i % len(s)])))
    logits = [torch.randn(1, 248320, device="cuda").to(bf) for _ in range(4)]
    cases.append(("argmax 1 x 248320", lambda i: argmax_rows_triton(logits[i % 4])))
    print(f"\nPDL A/B: us per call in a graph of {repeat} calls, off / on, median of {rounds} alternations")
    for name, fn in cases:
        with pdl_mode(False):
            ref = fn(0).clone()
        with pdl_mode(True):
            same = torch.equal(fn(0), ref)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for on in (False, True):
                with pdl_mode(on):
                    times[on].append(graph_per_call(fn, repeat))
        off, on = (sorted(times[b])[len(times[b]) // 2] for b in (False, True))
        R.add(Row(f"PDL A/B {name}", same, f"off {off:.2f} us, on {on:.2f} us, on/off x{on / off:.3f}; outputs "
                                           f"{'identical' if same else 'DIFFER'}"), variant=True)


def hc_out_sweep(R: Runner, D: int = 2560, S: int = 4, rank: int = 320, N: int = 328) -> None:
    """The mixer's output kernel alone at the real geometry, for 1 and 6 rows: every config checked against the
    same inputs through the output math in f64, and timed in a CUDA graph of 24 calls over copies of `up` that
    exceed the 50 MB L2, beside the plain `up` mat-vec (the same bytes, no epilogue) for one row."""
    copies = 24
    ups = [(torch.randn(S * D, rank, device="cuda") / rank ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    print("\nmixer output kernel: us per call in a graph of 24 calls (bf16)")
    for M in (1, 6):
        Xn = torch.randn(M, S * D, device="cuda").to(torch.bfloat16)
        y = torch.randn(M, N, device="cuda").to(torch.bfloat16)
        # the same inputs through the mixer's output math in f64
        gate = torch.sigmoid(F.silu(y[:, :rank].double() / S) @ ups[0].double().t()).unflatten(-1, (S, D))
        ref = (gate * Xn.double().unflatten(-1, (S, D))).sum(-2) / S
        if M == 1:
            a = F.silu(y[:, :rank] / S)
            t = graph_per_call(lambda i, a=a: gemv_triton(a, ups[i % copies]))
            R.add(Row(f"hc out floor: the up mat-vec alone M=1 {S * D}x{rank}", True, f"{t:.2f} us"), variant=True)
        # BK 256 / 512: the whole rank in two steps / one (every load of a program in flight at once)
        grid = [(bd, bk, w) for bd in (2, 4, 8, 16) for bk in (64, 128, 256, 512) for w in (4, 8)]
        times, bad = [], []
        for cfg in grid:
            e = rel_err(hc_out_triton(y, Xn, ups[0], rank, D, S, cfg), ref)
            if e >= TOL[torch.bfloat16]:
                bad.append((cfg, e))
                continue
            times.append((graph_per_call(lambda i, y=y, Xn=Xn, cfg=cfg: hc_out_triton(y, Xn, ups[i % copies], rank, D,
                                                                                       S, cfg)), cfg))
        t_best, _, top = ranked(times)
        t_default = graph_per_call(lambda i, y=y, Xn=Xn: hc_out_triton(y, Xn, ups[i % copies], rank, D, S))
        gb = S * D * rank * 2 / 1e3
        R.add(Row(f"hc out sweep M={M} D={D} S={S} rank={rank}", not bad,
                  f"default {t_default:.2f} us, best {t_best:.2f} us ({gb / t_best:.0f} GB/s); fastest: {top}; "
                  f"{len(grid)} configs, wrong: {bad}"), variant=True)


def _shapes(only: str | None) -> tuple[tuple[str, int, int], ...]:
    """GEMV_SHAPES whose name contains `only` (all without it)."""
    picked = tuple(s for s in GEMV_SHAPES if only is None or only in s[0])
    if not picked:
        raise SystemExit(f"--shapes {only!r} matches none of: {', '.join(s[0] for s in GEMV_SHAPES)}")
    return picked


def gemv_sweep(R: Runner, repeat: int = 24, only: str | None = None) -> None:
    """One-row products of the model's shapes: cuBLAS, the default plan and a grid of configs, each timed as a CUDA
    graph of `repeat` back-to-back calls (per call: the kernel plus its node latency, as inside a step's graph).
    The calls cycle through copies of the matrix that together exceed the 50 MB L2, so every call reads its
    weights from HBM as in a real step. Prints the best config per shape; each config is checked against f64."""
    def per_call(fn: Callable[[int], object]) -> float:
        return graph_per_call(fn, repeat)

    grid = [(bn, tile, w, ps) for bn, tile in ((32, 8192), (32, 4096), (16, 16384), (8, 8192), (4, 16384), (1, 16384),
                                                (1, 8192), (1, 4096), (1, 2048), (2, 4096)) for w in (4, 8)
            for ps in (2, 4, 8, 16)]
    print(f"\ngemv sweep: us per call in a graph of {repeat} calls (M=1, bf16)")
    for name, N, K in _shapes(only):
        _sweep_shape(R, name, N, K, grid, per_call)


def few_sweep(R: Runner, rows: tuple[int, ...] = (6, 4), repeat: int = 24, only: str | None = None) -> None:
    """The few-rows tensor-core kernel on the model's shapes for a verify step's rows (MTP5: 6, MTP3: 4): cuBLAS,
    the default config and a grid, timed as gemv_sweep times them."""
    grid = [(bn, bk, w, st, ps) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)
            for st in (3, 4) for ps in (1, 2, 4) if bn * bk <= 16384]
    for M in rows:
        print(f"\nfew-rows sweep: us per call in a graph of {repeat} calls (M={M}, bf16)")
        for name, N, K in _shapes(only):
            _sweep_shape(R, name, N, K, grid, lambda fn: graph_per_call(fn, repeat), M=M, kernel=gemm_few_triton)


def few_ab(R: Runner, M: int = 6, repeat: int = 24) -> None:
    """The few-row products still on cuBLAS (GEMV_SHAPES not in TUNED_FEW) against the tensor-core kernel launched
    with PDL, which shortens the kernel's graph-node gap where cuBLAS keeps its own: cuBLAS, the kernel's default
    config with PDL off and on, and a short grid with PDL on, each a graph of `repeat` calls over weight copies that
    exceed the L2. Each config is checked against f64 first."""
    grid = [(bn, bk, 4, 4, ps) for bn in (16, 32, 64) for bk in (64, 128) for ps in (1, 2)]
    print(f"\nfew rows on cuBLAS vs the kernel with PDL: us per call in a graph of {repeat} calls (M={M}, bf16)")
    for name, N, K in GEMV_SHAPES:
        if (N, K) in TUNED_FEW:
            continue
        copies = weight_copies(N * K * 2)
        Ws = [(0.02 * torch.randn(N, K, device="cuda")).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = x.double() @ Ws[0].double().t()
        t_cublas = graph_per_call(lambda i, x=x, Ws=Ws, c=copies: F.linear(x, Ws[i % c]), repeat)
        t_pdl: dict[bool, float] = {}
        for on in (False, True):
            with pdl_mode(on):
                t_pdl[on] = graph_per_call(lambda i, x=x, Ws=Ws, c=copies: gemm_few_triton(x, Ws[i % c]), repeat)
        best, t_best, bad = None, float("inf"), 0
        with pdl_mode(True):
            for cfg in grid:
                if rel_err(gemm_few_triton(x, Ws[0], cfg), ref) >= TOL[torch.bfloat16]:
                    bad += 1
                    continue
                t = graph_per_call(lambda i, x=x, Ws=Ws, c=copies, cfg=cfg: gemm_few_triton(x, Ws[i % c], cfg), repeat)
                if t < t_best:
                    best, t_best = cfg, t
        R.add(Row(f"few-rows A/B M={M} {name} {N}x{K}", bad == 0,
                  f"cuBLAS {t_cublas:.2f}, kernel default {t_pdl[False]:.2f} (PDL {t_pdl[True]:.2f}), best with PDL "
                  f"{t_best:.2f} us cfg={best}, best/cuBLAS x{t_best / t_cublas:.3f}; {bad} configs wrong"),
              variant=True)


def _sweep_shape(R: Runner, name: str, N: int, K: int, grid: list[tuple[int, ...]],
                 per_call: Callable[[Callable[[int], object]], float], M: int = 1,
                 kernel: Callable[..., torch.Tensor] = gemv_triton) -> None:
    copies = weight_copies(N * K * 2)
    Ws = [(0.02 * torch.randn(N, K, device="cuda")).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = x.double() @ Ws[0].double().t()
    t_cublas = per_call(lambda i: F.linear(x, Ws[i % copies]))
    t_default = per_call(lambda i: kernel(x, Ws[i % copies]))
    times, bad = [], 0
    for cfg in grid:
        if rel_err(kernel(x, Ws[0], cfg), ref) >= TOL[torch.bfloat16]:
            bad += 1
            continue
        times.append((per_call(lambda i, cfg=cfg: kernel(x, Ws[i % copies], cfg)), cfg))
    t_best, best, top = ranked(times)
    gb = N * K * 2 / 1e3
    R.add(Row(f"{kernel.__name__} sweep M={M} {name} {N}x{K}", bad == 0,
              f"cuBLAS {t_cublas:.2f} ({gb / t_cublas:.0f} GB/s), default {t_default:.2f}, best {t_best:.2f} us "
              f"({gb / t_best:.0f} GB/s) cfg={best}; fastest: {top}; {copies} copies; {bad} configs wrong"),
          variant=True)


def gdn_block_sweep(R: Runner) -> None:
    """The gated delta rule's value-block size and warps at the real geometry (T=6), each checked and timed."""
    for bv in (16, 32, 64):
        for w in (2, 4, 8):
            check_gdn(R, 6, 16, 48, 128, 128, 6, timed=True, block_v=bv, warps=w)


def moe_config_sweep(R: Runner) -> None:
    """The per-pair MoE kernels' configs for a verify's 6 rows and a decode's 1 (E=64), each checked and timed."""
    grids = {6: ((32, 256, 32, 128, 8), (16, 256, 32, 128, 4), (32, 128, 64, 128, 4), (32, 128, 16, 128, 4),
                 (64, 64, 32, 64, 4), (32, 128, 32, 64, 4), (32, 256, 64, 64, 8)),
             1: ((32, 128, 32, 128, 4), (16, 256, 16, 128, 4), (16, 256, 64, 128, 4), (16, 256, 32, 64, 4),
                 (16, 256, 16, 256, 4), (16, 256, 64, 64, 8), (16, 256, 128, 64, 8), (16, 256, 32, 256, 8),
                 (8, 256, 32, 128, 4), (16, 256, 8, 128, 4))}
    for M, grid in grids.items():
        inputs = moe_inputs(M, 2560, 640, 64, 10, torch.bfloat16, R.device)
        for cfg in grid:
            check_moe(R, M, 2560, 640, 64, 10, torch.bfloat16, timed=True, config=cfg, inputs=inputs)


SWEEPS: dict[str, tuple[Callable[..., None], str]] = {
    "gemv_sweep": (gemv_sweep, "the one-row mat-vec's configs on the model's shapes"),
    "few_sweep": (few_sweep, "the few-rows (verify) product's configs"),
    "few_ab": (few_ab, "the few-row products still on cuBLAS against the tensor-core kernel with PDL (Hopper)"),
    "q4_sweep": (q4_sweep, "the Q4 draft head's configs"),
    "moe_sweep": (moe_sweep, "the routed experts' kernels and configs at E=512"),
    "moe_config_sweep": (moe_config_sweep, "the per-pair MoE kernels' configs (E=64)"),
    "gdn_block_sweep": (gdn_block_sweep, "the gated delta rule's block sizes and warps"),
    "attention_sweep": (attention_sweep, "the masked attention kernel's configs"),
    "hc_out_sweep": (hc_out_sweep, "the mixer's output kernel's configs"),
    "pdl_ab": (pdl_ab, "programmatic dependent launch against launches without it, step-sized kernels (Hopper)"),
}


def run_sweep(R: Runner, name: str, shapes: str | None) -> None:
    """Sweep `name` of SWEEPS; `shapes` narrows the gemv and few-rows sweeps to the GEMV_SHAPES whose name has it."""
    fn = SWEEPS[name][0]
    if fn in (gemv_sweep, few_sweep):
        fn(R, only=shapes)
    else:
        fn(R)
