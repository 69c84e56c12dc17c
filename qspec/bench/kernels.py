"""Every Triton kernel against its torch reference, and both timed at the real geometry.

The checks are the tests in `tests/test_gpu_kernels.py` (one per kernel: small shapes through Triton's interpreter on
the CPU, the real geometry with `-m cuda` on a GPU). This module holds them as groups (`CHECKS`), and its command
times them and sweeps the kernels' configurations:

    python -m qspec.bench.kernels                     # CUDA: checks with timings, block-size variants
    python -m qspec.bench.kernels --no-sweep          # CUDA: skip the variants
    python -m qspec.bench.kernels --only gdn,moe      # CUDA: some groups only
    TRITON_INTERPRET=1 python -m qspec.bench.kernels --interpret   # CPU: checks only, small shapes
    python -m qspec.bench.kernels --graph             # CUDA: time each call replayed from a CUDA graph
    python -m qspec.bench.kernels --gemv-sweep        # one sweep (see --help; qspec/bench/kernel_sweeps.py)

Every check draws fresh random inputs and fills the outputs with NaN first, so an element the kernel
never writes shows up as a mismatch. Conv snapshots must be bit-identical to `write_snapshots`
(inputs are random 32-bit patterns: NaN payloads, denormals, infinities); everything else is compared
by relative error, max |got - ref| / max |ref|, against a tolerance for its dtype. Exits 1 on any
mismatch. Times are medians of triton.testing.do_bench (L2 flushed between runs), in microseconds;
GB/s counts the bytes the kernel must move, against the H200's achievable copy bandwidth (BENCHMARKS.md, Method).
By default a timed call is one eager launch, Python launch overhead included, which hides the GPU time of
kernels shorter than their launches. `--graph` captures each call in a CUDA graph
and times its replay, as the engine's steps run; a call that cannot be captured (a host sync in a torch
reference) is timed eagerly, and the run says how many were (benchmarks/results/gpu_kernels_h200_s4_graph.txt).
"""

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig, preset
from qspec.kernels.argmax import argmax_rows_torch
from qspec.kernels.attention_seqs import attend_each, write_seqs
from qspec.kernels.conv_snapshot import write_snapshots
from qspec.kernels.dequant import dequant_q8_0_torch
from qspec.kernels.gdn_conv import gdn_conv_qkv_torch
from qspec.kernels.gdn_seqs import gdn_step_seqs_torch, gdn_step_seqs_triton
from qspec.kernels.hc_mix import combine_torch, mix_torch
from qspec.kernels.kv_write import write_q8_0_torch
from qspec.kernels.masked_attention import masked_attention, masked_attention_torch
from qspec.kernels.moe_few import moe_few_torch, sum_slots
from qspec.kernels.pooled import materialize_pooled_seqs_torch, materialize_pooled_torch
from qspec.kernels.q4 import Q4Weight, q4_matvec_torch, q4_q8_matvec_torch
from qspec.kernels.route import route_top_k_shared_torch, route_top_k_torch
from qspec.kernels.sparse_attention import sparse_attention_torch
from qspec.kernels.top_blocks import top_blocks_mask_torch
from qspec.kernels.triton_argmax import argmax_rows_triton
from qspec.kernels.triton_common import (
    HAS_TRITON,
    INTERPRET,
    pdl_mode,
    pdl_on,
    torch_references,
    use_triton,
)
from qspec.kernels.triton_conv_snapshot import conv_snapshot_torch, conv_snapshot_triton
from qspec.kernels.triton_dequant import dequant_kv_triton
from qspec.kernels.triton_gdn import (
    gdn_conv_recurrent_triton,
    gdn_recurrent_planes_torch,
    gdn_recurrent_planes_triton,
)
from qspec.kernels.triton_gdn_conv import gdn_conv_qkv_triton
from qspec.kernels.triton_gemv import gemm_few_triton, gemv_triton
from qspec.kernels.triton_hc_mix import hc_mix_step_triton
from qspec.kernels.triton_kv_write import write_q8_0_triton, write_rows_seqs_triton
from qspec.kernels.triton_masked_attention import SKIP_MIN_ROWS, masked_attention_seqs_triton, masked_attention_triton
from qspec.kernels.triton_moe import config_for as moe_config_for
from qspec.kernels.triton_moe import moe_slots_grouped_triton, moe_slots_triton
from qspec.kernels.triton_pooled import pooled_seqs_triton, pooled_triton
from qspec.kernels.triton_q4 import q4_q8_matvec_triton
from qspec.kernels.triton_route import route_top_k_triton
from qspec.kernels.triton_sparse_attention import sparse_attention_triton
from qspec.kernels.triton_top_blocks import top_blocks_mask_triton
from qspec.model.ops import Weight, rope_tables
from qspec.state.kv_cache import KVCache, quantize_q8_0
from qspec.state.recurrent import RecurrentCache
from qspec.state.tables import SequenceTables
from qspec.weights.quantize import quantize
from qspec.weights.qweight import PLANES_QTYPES, QuantWeight
from qspec.weights.traffic import held_bytes

PEAK_GBS = 4200.0
# max |got - ref| / max |ref|. In f32 that is accumulation order; in bf16 / f16 both sides round every op to the
# dtype, and an f32 difference of one ulp can flip a rounding: allow a few ulps (2^-8 is bf16's half-ulp) of the
# largest element. A wrong kernel misses these by orders of magnitude; the share of differing elements is printed.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Row:
    name: str
    ok: bool
    detail: str
    torch_us: float | None = None
    triton_us: float | None = None
    nbytes: int | None = None
    info: bool = False  # reported, but a difference does not fail the run


class Runner:
    def __init__(self, device: str, timing: bool, graph: bool = False) -> None:
        self.device, self.timing, self.graph = device, timing, graph
        self.rows: list[Row] = []
        self.variants: list[Row] = []
        self.log: list[Row] = []  # every row in the order added (run_group's slice of it)
        self.eager_fallbacks = 0

    def bench(self, fn: Callable[[], object]) -> float | None:
        if not self.timing:
            return None
        import triton.testing

        if self.graph:
            replay = self._captured(fn)
            if replay is not None:
                fn = replay
            else:
                self.eager_fallbacks += 1
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3

    @staticmethod
    def _captured(fn: Callable[[], object]) -> Callable[[], object] | None:
        """fn recorded in a CUDA graph (after a warm call on a side stream), or None if it cannot be captured."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return g.replay
        except RuntimeError:
            torch.cuda.synchronize()
            return None

    def add(self, row: Row, variant: bool = False) -> None:
        (self.variants if variant else self.rows).append(row)
        self.log.append(row)
        flag = "ok  " if row.ok else ("info" if row.info else "FAIL")
        print(f"[{flag}] {row.name}: {row.detail}", flush=True)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| in f64; inf when got has a non-finite value where ref has none."""
    g, r = got.double(), ref.double()
    if (~torch.isfinite(g) & torch.isfinite(r)).any():
        return float("inf")
    scale = r.abs().max().item()
    return (g - r).abs().max().item() / (scale if scale > 0 else 1.0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def random_bits(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """f32 tensors of uniformly random 32-bit patterns (NaN payloads, denormals, +-inf, -0 included)."""
    return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)


# ---- 1. conv snapshots (Algorithm 5) ---------------------------------------------------------------------------

def check_conv(R: Runner, C: int, s: int, n: int, k: int, scalar_dest: bool, timed: bool = False,
               from_live: bool = False, t_dtype: torch.dtype = torch.float32) -> None:
    """from_live: S is plane 3 of the planes tensor itself, selected on the device (`live`). t_dtype: the new
    activations' dtype (16-bit ones are finite values, widened exactly)."""
    dev = R.device
    S = random_bits((C, s + 3), dev)[:, 2:2 + s]  # a strided view, as a plane slice would be
    T = random_bits((n, C), dev) if t_dtype == torch.float32 else torch.randn(n, C, device=dev).to(t_dtype)
    P = 2 * 8
    planes = random_bits((P, C, s), dev)
    if scalar_dest:
        host_base = 8
        dest = torch.tensor(host_base, device=dev)
        targets = list(range(host_base, host_base + k))
    else:
        targets = torch.randperm(P)[:k].tolist()
        dest = torch.tensor(targets, dtype=torch.int64, device=dev)
    planes[targets] = float("nan")  # poison the destinations in both copies
    p_ref, p_tri = planes.clone(), planes.clone()
    live = torch.tensor(3, device=dev)
    with torch_references():
        if from_live:
            assert scalar_dest and 3 not in targets
            X_ref = write_snapshots(p_ref[3], T, p_ref, dest, host_base, k, False, True, None)
        elif scalar_dest:
            X_ref = write_snapshots(S, T, p_ref, dest, host_base, k, False, True, None)
        else:
            X_ref = conv_snapshot_torch(S, T, p_ref, dest)
    X_tri = torch.full((C, s + n), float("nan"), device=dev)
    if from_live:
        conv_snapshot_triton(p_tri, T, p_tri, dest, k, out=X_tri, live=live)
    else:
        conv_snapshot_triton(S, T, p_tri, dest, k, out=X_tri)
    ok = same_bits(X_ref, X_tri) and same_bits(p_ref, p_tri)
    name = f"conv_snapshot C={C} s={s} n={n} k={k} {'base' if scalar_dest else 'list'}" + (
        " S=planes[live]" if from_live else "") + ("" if t_dtype == torch.float32 else f" T {t_dtype}")
    row = Row(name, ok, "bit-identical (X and all planes)" if ok else "BITS DIFFER")
    if timed and R.timing:
        with torch_references():
            row.torch_us = R.bench(lambda: write_snapshots(S, T, p_ref, dest, host_base, k, False, True, None))
        if from_live:
            row.triton_us = R.bench(lambda: conv_snapshot_triton(p_tri, T, p_tri, dest, k, out=X_tri, live=live))
        else:
            row.triton_us = R.bench(lambda: conv_snapshot_triton(S, T, p_tri, dest, k, out=X_tri))
        row.nbytes = C * (s + n) * 4 * 2 + k * C * s * 4
    R.add(row)


def check_write_snapshots(R: Runner, C: int, s: int, n: int, fused: bool) -> None:
    """The model's call: the state read in place from plane `live` of the planes (no gather), every window of the
    step's rows written to planes base + j; against the torch path with the state gathered first."""
    dev = R.device
    n_slots = 8
    host_base, live = n_slots, torch.tensor(5, device=dev)  # live in the half the step does not write
    T = random_bits((n, C), dev)
    planes = random_bits((2 * n_slots, C, s), dev)
    p_ref, p_new = planes.clone(), planes.clone()
    base = torch.tensor(host_base, device=dev)
    with torch_references():
        X_ref = write_snapshots(p_ref[5], T, p_ref, base, host_base, n, False, False, None)
    X_new = write_snapshots(p_new, T, p_new, base, host_base, n, False, fused, None, live=live)
    ok = same_bits(X_ref, X_new) and same_bits(p_ref, p_new)
    R.add(Row(f"write_snapshots C={C} s={s} n={n} fused={fused} S=planes[live]", ok,
              "bit-identical (X and all planes) to the gathered, unfused path" if ok else "BITS DIFFER"))


# ---- 2. gated delta rule ---------------------------------------------------------------------------------------

def gdn_inputs(T: int, Hq: int, Hv: int, dk: int, dv: int, P: int, dev: str) -> tuple[torch.Tensor, ...]:
    q = F.normalize(torch.randn(T, Hq, dk, device=dev), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(T, Hq, dk, device=dev), dim=-1)
    v = torch.randn(T, Hv, dv, device=dev)
    g = -2.0 * torch.rand(T, Hv, device=dev)  # a * softplus(.) with a < 0
    beta = torch.rand(T, Hv, device=dev)
    ssm = 0.1 * torch.randn(P, Hv, dk, dv, device=dev)
    return q, k, v, g, beta, ssm


def check_gdn(R: Runner, T: int, Hq: int, Hv: int, dk: int, dv: int, n_slots: int, timed: bool = False,
              block_v: int | None = None, warps: int = 4, alias: bool = False, gates: bool = False) -> None:
    """alias: row 0's state overwrites the live plane itself (beyond the contract; each program's slice is
    read before it is written, so this must hold too). gates: pass the projection's raw bf16 logits and let the
    kernel compute beta and g (the model's call), against the reference computing them with `gdn_gates`."""
    dev = R.device
    P = 2 * n_slots
    q, k, v, g, beta, ssm = gdn_inputs(T, Hq, Hv, dk, dv, P, dev)
    gate_params = None
    if gates:  # logits spanning softplus's threshold (dt_bias + logit up to ~25) and both sigmoid tails
        g, beta = (8 * torch.randn(T, Hv, device=dev)).bfloat16(), (6 * torch.randn(T, Hv, device=dev)).bfloat16()
        gate_params = (-(1 + 15 * torch.rand(Hv, device=dev)), 4 * torch.rand(Hv, device=dev))
    live_i, base_i = n_slots - 1, n_slots  # live in one half, the rows' slots in the other (ping-pong)
    if alias:
        live_i = base_i
    live, base = torch.tensor(live_i, device=dev), torch.tensor(base_i, device=dev)
    ssm[base_i + int(alias):base_i + T] = float("nan")
    s_ref, s_tri = ssm.clone(), ssm.clone()
    o_ref = gdn_recurrent_planes_torch(q, k, v, g, beta, s_ref, live, base, gate_params)
    o_tri = torch.full((T, Hv, dv), float("nan"), device=dev)
    kw = {"num_warps": warps} | ({"block_v": block_v} if block_v else {})
    gdn_recurrent_planes_triton(q, k, v, g, beta, s_tri, live, base, gate_params, out=o_tri, **kw)
    rows = slice(base_i, base_i + T)
    eo, es = rel_err(o_tri, o_ref), rel_err(s_tri[rows], s_ref[rows])
    rest = torch.ones(P, dtype=torch.bool, device=dev)
    rest[rows] = False
    untouched = same_bits(s_tri[rest], ssm[rest])
    ok = eo < 1e-5 and es < 1e-5 and untouched
    name = (f"gdn T={T} Hq={Hq} Hv={Hv} dk={dk} dv={dv}" + (f" BV={block_v} w={warps}" if block_v else "")
            + (" live=base" if alias else "") + (" gates from bf16 logits" if gates else ""))
    row = Row(name, ok, f"rel err o {eo:.2e} states {es:.2e}, other planes {'untouched' if untouched else 'CHANGED'}")
    if timed and R.timing:
        if block_v is None:
            row.torch_us = R.bench(lambda: gdn_recurrent_planes_torch(q, k, v, g, beta, s_ref, live, base,
                                                                      gate_params))
        row.triton_us = R.bench(lambda: gdn_recurrent_planes_triton(q, k, v, g, beta, s_tri, live, base, gate_params,
                                                                    out=o_tri, **kw))
        row.nbytes = Hv * dk * dv * 4 * (1 + T) + T * (2 * Hq * dk + 2 * Hv * dv + 2 * Hv) * 4
    R.add(row, variant=block_v is not None)


# ---- 3. pooled indexer keys ------------------------------------------------------------------------------------

def check_pooled(R: Runner, dt: torch.dtype, cap: int, d: int, r: int, C: int, rope: int, timed: bool = False) -> None:
    dev = R.device
    nb = cap // r
    raw = torch.randn(cap, d, device=dev).to(dt)
    blocks = torch.randperm(nb, device=dev)[:C]
    cells = blocks[:, None] * r + torch.arange(r, device=dev)
    dest = torch.randperm(nb + 1, device=dev)[:C]  # distinct, as Algorithm 3 guarantees
    gamma = 1.0 + 0.1 * torch.randn(d, device=dev)
    cos, sin = rope_tables(blocks * r, rope, 1e7, dt)
    eps = 1e-6
    p_ref = torch.full((nb + 1, d), float("nan"), device=dev)
    p_tri = p_ref.clone()
    materialize_pooled_torch(raw, cells, dest, gamma, eps, cos, sin, p_ref)
    pooled_triton(raw, cells, dest, gamma, eps, cos, sin, p_tri)
    hit = torch.zeros(nb + 1, dtype=torch.bool, device=dev)
    hit[dest] = True
    e = rel_err(p_tri[hit], p_ref[hit])
    differ = (p_tri[hit] != p_ref[hit]).float().mean().item()
    untouched = same_bits(p_tri[~hit], p_ref[~hit])
    ok = e < TOL[dt] and untouched
    name = f"pooled {str(dt).removeprefix('torch.')} C={C} r={r} d={d} cap={cap}"
    row = Row(name, ok, f"rel err {e:.2e} ({differ:.1%} of elements differ), "
                        f"other rows {'untouched' if untouched else 'CHANGED'}")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: materialize_pooled_torch(raw, cells, dest, gamma, eps, cos, sin, p_ref))
        row.triton_us = R.bench(lambda: pooled_triton(raw, cells, dest, gamma, eps, cos, sin, p_tri))
        row.nbytes = C * r * d * raw.element_size() + C * d * 4 + 2 * C * rope * cos.element_size()
    R.add(row)


def check_pooled_seqs(R: Runner, dt: torch.dtype, B: int, cap: int, d: int, r: int, C: int, rope: int,
                      timed: bool = False) -> None:
    """A batched step's pooled-key updates in one launch (each row finding its sequence's raw and pooled keys through
    their address tables): every sequence's pooled keys bit-identical to its own launch alone and within the dtype's
    tolerance of the reference; timed against each sequence's launch."""
    dev = R.device
    nb = cap // r
    raws = [torch.randn(cap, d, device=dev).to(dt) for _ in range(B)]
    blocks = torch.cat([torch.randperm(nb, device=dev)[:C] for _ in range(B)])
    cells = blocks[:, None] * r + torch.arange(r, device=dev)
    dest = torch.cat([torch.randperm(nb + 1, device=dev)[:C] for _ in range(B)])
    gamma = 1.0 + 0.1 * torch.randn(d, device=dev)
    cos, sin = rope_tables(blocks * r, rope, 1e7, dt)
    got, alone, ref = ([torch.full((nb + 1, d), float("nan"), device=dev) for _ in range(B)] for _ in range(3))
    tables = tuple(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev) for ts in (raws, got))

    def each() -> None:
        for b in range(B):
            u = slice(b * C, (b + 1) * C)
            pooled_triton(raws[b], cells[u], dest[u], gamma, 1e-6, cos[u], sin[u], alone[b])
    each()
    materialize_pooled_seqs_torch(raws, cells, dest, gamma, 1e-6, cos, sin, ref)
    pooled_seqs_triton(raws[0], cells, dest, gamma, 1e-6, cos, sin, got[0], tables)
    same = all(same_bits(a, b) for a, b in zip(got, alone, strict=True))
    e = max(rel_err(a.nan_to_num(), b.nan_to_num()) for a, b in zip(got, ref, strict=True))  # rows never written: 0
    row = Row(f"pooled seqs B={B} {str(dt).removeprefix('torch.')} C={C} r={r} d={d}"
              + (" (torch: each sequence's launch)" if timed else ""), same and e < TOL[dt],
              f"{'bit-identical to each launch alone' if same else 'DIFFERS from each launch alone'}, "
              f"rel err {e:.2e} against the reference")
    if timed and R.timing:
        row.torch_us = R.bench(each)
        row.triton_us = R.bench(lambda: pooled_seqs_triton(raws[0], cells, dest, gamma, 1e-6, cos, sin, got[0],
                                                           tables))
    R.add(row)


def check_sparse_attn(R: Runner, T: int, H: int, Hkv: int, d: int, r: int, n_top: int, ctx: int, kv: str,
                      timed: bool = False) -> None:
    """QSA attention over chosen blocks + tail at context `ctx` (rows at the last T positions); every row
    has n_top - 1 chosen blocks and one empty slot (-1)."""
    dev = R.device
    cap = ctx + 64
    q = torch.randn(T, H, d, device=dev).bfloat16()
    kf, vf = torch.randn(cap, Hkv, d, device=dev), torch.randn(cap, Hkv, d, device=dev)
    if kv == "q8_0":
        (k, ks), (v, vs) = quantize_q8_0(kf), quantize_q8_0(vf)
    else:
        dt = {"bf16": torch.bfloat16, "f32": torch.float32}[kv]
        k, v, ks, vs = kf.to(dt), vf.to(dt), None, None
    pos = torch.arange(ctx - T, ctx, device=dev)
    nb_vis = (pos + 1) // r
    blocks = torch.stack([torch.randperm(int(nb_vis[t]), device=dev)[:n_top] for t in range(T)])
    blocks[:, -1] = -1
    args = (q, k, v, ks, vs, blocks, nb_vis * r, pos, r)
    ref = sparse_attention_torch(*args)
    got = sparse_attention_triton(*args)
    e = rel_err(got, ref)
    ok = e < TOL[torch.bfloat16]
    row = Row(f"sparse_attn T={T} H={H}/{Hkv} d={d} r={r} blocks={n_top} ctx={ctx} kv={kv}", ok, f"rel err {e:.2e}")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: sparse_attention_torch(*args))
        row.triton_us = R.bench(lambda: sparse_attention_triton(*args))
        per_cell = 2 * Hkv * (d * k.element_size() + (d // 32 * 2 if ks is not None else 0))
        row.nbytes = T * (n_top * r + r) * per_cell + 2 * T * H * d * 2
    R.add(row)


def dense_attention_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor | None,
                         vs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """The model's default path for the same attention (qsa.attend without its gate and output product): the
    cells dequantized to a bf16 copy, then batched products and a softmax, as eager torch ops."""
    T, H, d = q.shape
    Hkv = k.shape[1]
    K, V = dequant_kv_triton(k, ks, v, vs, q.dtype) if ks is not None else (k, v)
    qh = q.view(T, Hkv, H // Hkv, d).permute(1, 0, 2, 3).reshape(Hkv, -1, d)
    sc = torch.bmm(qh, K.permute(1, 2, 0)) * d ** -0.5
    m = mask.unsqueeze(1).expand(T, H // Hkv, -1).reshape(1, T * (H // Hkv), -1)
    p = torch.softmax(sc.float().masked_fill(~m, float("-inf")), dim=-1).to(q.dtype)
    return torch.bmm(p, V.permute(1, 0, 2)).view(Hkv, T, H // Hkv, d).permute(1, 0, 2, 3).reshape(T, H, d)


def masked_attn_inputs(T: int, H: int, Hkv: int, d: int, n: int, kv: str, dt: torch.dtype, keep: float,
                       dev: str, first: int | None = None) -> tuple[torch.Tensor | None, ...]:
    """(q, k, v, k_scale, v_scale, mask): rows at the last T positions of an n-cell bucket (causal; `first`: at
    positions first.. instead, as a prefill chunk), a share `keep` of each row's earlier cells left in the mask
    (QSA's block choice; 1.0: the MTP head's causal mask)."""
    q = torch.randn(T, H, d, device=dev).to(dt)
    kf, vf = torch.randn(n, Hkv, d, device=dev), torch.randn(n, Hkv, d, device=dev)
    if kv == "q8_0":
        (k, ks), (v, vs) = quantize_q8_0(kf), quantize_q8_0(vf)
    else:
        k, v, ks, vs = kf.to(dt), vf.to(dt), None, None
    empty = min(64, n // 4)  # a bucket's last cells are empty
    lo = n - empty - T if first is None else first
    pos = torch.arange(lo, lo + T, device=dev)
    cells = torch.arange(n, device=dev)[None, :]
    mask = (cells <= pos[:, None]) & ((torch.rand(T, n, device=dev) < keep) | (cells == pos[:, None]))
    return q, k, v, ks, vs, mask


def check_masked_attn(R: Runner, T: int, H: int, Hkv: int, d: int, n: int, kv: str, dt: torch.dtype = torch.bfloat16,
                      keep: float = 1.0, timed: bool = False, config: tuple[int, int, int, int, int] | None = None,
                      first: int | None = None) -> None:
    """Masked attention (masked_attn_inputs) against the f32 reference; config: the kernel's (rows per program,
    cells per step, warps, stages, programs), its default when None. From SKIP_MIN_ROWS rows on, the kernel skips
    the cell steps no row attends to: it must give the same bits as without (timed: both)."""
    args = masked_attn_inputs(T, H, Hkv, d, n, kv, dt, keep, R.device, first)
    q, k, v, ks, vs, mask = args
    ref = masked_attention_torch(*args)
    got = masked_attention_triton(*args, config=config)
    e = rel_err(got, ref)
    ok = e < TOL[dt]
    detail = f"rel err {e:.2e}"
    if dt != torch.float32:  # and against the model's path, which rounds K, V and p to the same 16-bit type
        e16 = rel_err(got, dense_attention_path(*args))
        ok, detail = ok and e16 < TOL[dt], detail + f" (f32 reference), {e16:.2e} (the model's 16-bit path)"
    skips = T >= SKIP_MIN_ROWS
    if skips:
        same = torch.equal(got, masked_attention_triton(*args, config=config, skip=False))
        ok, detail = ok and same, detail + f", {'same' if same else 'NOT the same'} bits without skipping"
        if timed and R.timing:
            detail += f" ({R.bench(lambda: masked_attention_triton(*args, config=config, skip=False)):.1f} us)"
    row = Row(f"masked_attn T={T} H={H}/{Hkv} d={d} n={n} kv={kv} keep={keep} {str(dt).removeprefix('torch.')}"
              + (f" first={first}" if first is not None else "") + (f" config={config}" if config else "")
              + (" (torch: the model's dequant + bmm/softmax path)" if timed else ""), ok, detail)
    if timed and R.timing:
        row.torch_us = R.bench(lambda: dense_attention_path(*args))
        row.triton_us = R.bench(lambda: masked_attention_triton(*args))
        per_cell = 2 * Hkv * (d * k.element_size() + (d // 32 * 2 if ks is not None else 0))
        row.nbytes = n * per_cell + T * n + 2 * T * H * d * 2
    R.add(row)


# ---- 4. Q4 LM head ---------------------------------------------------------------------------------------------

def check_q4(R: Runner, N: int, K: int, M: int, xdt: torch.dtype, timed: bool = False,
             W: Q4Weight | None = None, config: tuple[int, int, int, int] | None = None) -> Q4Weight:
    """The Q4 head kernel (x quantized to int8 blocks; config: its (rows, blocks per step, warps, stages), the
    default when None) against its reference (tight in f32: only the f32
    summation order differs), and how far the int8 x moves it from the exact dequantize-matmul (info)."""
    dev = R.device
    if W is None:
        W = Q4Weight.from_dense(0.02 * torch.randn(N, K, device=dev, dtype=torch.bfloat16))
    x = torch.randn(M, K, device=dev).to(xdt)
    ref = q4_q8_matvec_torch(x, W)
    out = torch.full((M, N), float("nan"), device=dev, dtype=xdt)
    q4_q8_matvec_triton(x, W.packed, W.scales, out=out, **({"config": config} if config else {}))
    e = rel_err(out, ref)
    # bf16/f16 outputs: rounding the same f32 value to the output dtype may differ by an ulp at ties of order
    ok = e < (TOL[torch.float32] if xdt == torch.float32 else 8e-3)
    name = f"q4_head N={N} K={K} M={M} x={str(xdt).removeprefix('torch.')}" + (f" config={config}" if config else "")
    row = Row(name, ok, f"rel err {e:.2e} vs its reference; {rel_err(out, q4_matvec_torch(x, W)):.2e} vs exact "
                        f"dequantize-matmul (int8 x)")
    if timed and R.timing:
        dense = W.dequantize(torch.bfloat16)  # the head it replaces: the same matrix dense in bf16
        xb = x.to(torch.bfloat16)
        row.torch_us = R.bench(lambda: F.linear(xb, dense))
        row.detail += " (torch column: dense bf16 F.linear)"
        del dense
        row.triton_us = R.bench(lambda: q4_q8_matvec_triton(x, W.packed, W.scales, out=out))
        row.nbytes = N * K // 2 + N * K // 32 * 2 + M * K * x.element_size() + M * N * x.element_size()
    R.add(row)
    return W


# ---- 5. MoE for a few tokens -----------------------------------------------------------------------------------

def moe_inputs(M: int, D: int, Fd: int, E: int, k: int, dt: torch.dtype, dev: str) -> tuple[torch.Tensor, ...]:
    h = torch.randn(M, D, device=dev).to(dt)
    gate = (0.02 * torch.randn(E, Fd, D, device=dev)).to(dt)
    up = (0.02 * torch.randn(E, Fd, D, device=dev)).to(dt)
    down = (0.02 * torch.randn(E, D, Fd, device=dev)).to(dt)
    top_i = torch.rand(M, E, device=dev).argsort(-1)[:, :k].contiguous()  # k distinct experts per token
    top_w = torch.softmax(torch.randn(M, k, device=dev), -1).to(dt)
    return h, top_i, top_w, gate, up, down


def check_moe(R: Runner, M: int, D: int, Fd: int, E: int, k: int, dt: torch.dtype, timed: bool = False,
              config: tuple[int, ...] | None = None, inputs: tuple[torch.Tensor, ...] | None = None,
              grouped: bool = False) -> tuple[torch.Tensor, ...]:
    """The per-pair kernels, or (grouped) the kernels that read each distinct expert once, against the
    per-(token, expert) reference; timed, the torch column is the reference loop."""
    dev = R.device
    if inputs is None:
        inputs = moe_inputs(M, D, Fd, E, k, dt, dev)
    h, top_i, top_w, gate, up, down = inputs
    ref = moe_few_torch(h, top_i, top_w, gate, up, down)
    kernel = moe_slots_grouped_triton if grouped else moe_slots_triton
    cfg = config or (None if grouped else moe_config_for(M))
    out = sum_slots(kernel(h, top_i, top_w, gate, up, down, config=cfg))
    e = rel_err(out, ref)
    differ = (out != ref).float().mean().item()
    ok = e < TOL[dt]
    distinct = int(torch.unique(top_i).numel())
    name = f"moe_few{' grouped' if grouped else ''} M={M} D={D} F={Fd} E={E} k={k} " \
           f"{str(dt).removeprefix('torch.')}" + (f" cfg={config}" if config else "")
    row = Row(name, ok, f"rel err {e:.2e} ({differ:.1%} of elements differ by rounding); {distinct} distinct "
                        f"experts of {M * k} pairs")
    if timed and R.timing:
        if config is None:
            row.torch_us = R.bench(lambda: moe_few_torch(h, top_i, top_w, gate, up, down))
        # the kernels alone: on the step path the slot sum is fused into the shared expert's add
        row.triton_us = R.bench(lambda: kernel(h, top_i, top_w, gate, up, down, config=cfg))
        row.nbytes = int(torch.unique(top_i).numel()) * 3 * Fd * D * gate.element_size()
    R.add(row, variant=config is not None)
    return inputs


# ---- 6. MoE routing ----------------------------------------------------------------------------------------------

def check_route(R: Runner, T: int, E: int, k: int, dt: torch.dtype, timed: bool = False, shared: bool = False) -> None:
    """Expert ids must match exactly (the random logits have no near-ties); weights by relative error. shared: one
    more logit column, the shared expert's gate, and its slot after the k picked (route_top_k_shared_torch)."""
    logits = torch.randn(T, E + 7, device=R.device).to(dt)[:, 3:3 + E + shared]  # a strided slice, as steps pass it
    w_ref, i_ref = (route_top_k_shared_torch if shared else route_top_k_torch)(logits, k)
    w, i, _ = route_top_k_triton(logits, k, shared=shared)
    e = rel_err(w, w_ref)
    # 16-bit logits tie often (512 draws, 8 mantissa bits); the two implementations may order equal experts
    # differently, so the picked experts must have the reference's probabilities, rank by rank
    probs = torch.softmax(logits[:, :E].float(), -1)
    same_p = torch.equal(probs.gather(1, i[:, :k]), probs.gather(1, i_ref[:, :k]))
    ok = same_p and e < TOL[dt] and i.shape == i_ref.shape and torch.equal(i[:, k:], i_ref[:, k:])
    ties = int((i != i_ref).sum())
    row = Row(f"route_top_k T={T} E={E} k={k} {str(dt).removeprefix('torch.')}{' +shared' if shared else ''}", ok,
              f"picked probabilities {'equal' if same_p else 'DIFFER'} ({ties} ids differ among ties), "
              f"weights rel err {e:.2e}")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: route_top_k_torch(logits, k))
        row.triton_us = R.bench(lambda: route_top_k_triton(logits, k))
        row.nbytes = logits.numel() * logits.element_size()
    R.add(row)
    if timed and R.timing and dt != torch.float32:
        route_warps_variants(R, logits, k, shared, (w, i))


def check_route_ties(R: Runner, E: int, k: int) -> None:
    """Equal probabilities go to the lower id: a row of equal logits, and one whose largest logit three experts share
    (the reference's torch.topk leaves their order unspecified)."""
    logits = torch.zeros(2, E, device=R.device).bfloat16()
    logits[1, [E - 1, E // 2, 3]] = 2.0
    _, i, _ = route_top_k_triton(logits, k)
    want = [list(range(k)), [3, E // 2, E - 1, *[j for j in range(k) if j != 3][:k - 3]]]
    R.add(Row(f"route_top_k ties E={E} k={k}", i.tolist() == want, f"ids {i.tolist()}"))


def route_warps_variants(R: Runner, logits: torch.Tensor, k: int, shared: bool, ref: tuple[torch.Tensor, ...]
                         ) -> None:
    """The launch of a step (routing beside the quantization of the hidden rows, 4,096 wide) at 1, 2 and 4 warps a
    program: the same outputs as the default's (ref), timed."""
    h = torch.randn(logits.shape[0], 4096, device=R.device).to(logits.dtype)
    for warps in (1, 2, 4):
        w, i, _ = route_top_k_triton(logits, k, h, shared, warps)
        row = Row(f"route_top_k T={logits.shape[0]} +h quantized, {warps} warps", torch.equal(w, ref[0])
                  and torch.equal(i, ref[1]), "the default's outputs" if torch.equal(i, ref[1]) else "DIFFER")
        row.triton_us = R.bench(lambda n=warps: route_top_k_triton(logits, k, h, shared, n))
        R.add(row, variant=True)


# ---- 7. step-sized matrix products --------------------------------------------------------------------------

# (name, N, K) of the flash-next step's products (stacked as the model stacks them)
# (the stacked matrices as the model pads them: ops.stack_rows; counted per decode step of 8 layers)
GEMV_SHAPES = (("hc mixer in (x16)", 328, 10240), ("hc mixer up (x17)", 10240, 320), ("output mixer in", 320, 10240),
               ("moe in (x8)", 1800, 2560), ("shared down (x8)", 2560, 640), ("gdn in (x6)", 16480, 2560),
               ("gdn/qsa out (x8)", 2560, 6144), ("qsa in (x2)", 13952, 2560), ("ple kv", 12800, 2560),
               ("mtp eh", 2560, 5120), ("mtp attn in", 13312, 2560), ("lm head", 248320, 2560))


def check_gemv(R: Runner, name: str, N: int, K: int, M: int, dt: torch.dtype, timed: bool = False,
               config: tuple[int, ...] | None = None, W: torch.Tensor | None = None, few: bool = False) -> torch.Tensor:
    """The mat-vec kernel (few=False) or the few-rows tensor-core kernel (few=True) against x @ W^T in f64."""
    dev = R.device
    W = (0.02 * torch.randn(N, K, device=dev)).to(dt) if W is None else W
    x = torch.randn(M, K, device=dev).to(dt)
    kernel, cfg = (gemm_few_triton if few else gemv_triton), config
    ref = x.double() @ W.double().t()
    got = kernel(x, W, cfg)
    e = rel_err(got, ref)
    ok = e < TOL[dt] and got.shape == (M, N) and got.dtype == dt
    row = Row(f"{'gemm few' if few else 'gemv'} {name} M={M} N={N} K={K} {str(dt).removeprefix('torch.')}"
              + (f" cfg={config}" if config else ""), ok,
              f"rel err {e:.2e} vs f64 (cuBLAS {rel_err(F.linear(x, W), ref):.2e})")
    if timed and R.timing:
        if config is None:
            row.torch_us = R.bench(lambda: F.linear(x, W))
        row.triton_us = R.bench(lambda: kernel(x, W, cfg))
        row.nbytes = W.numel() * W.element_size()
    R.add(row, variant=config is not None)
    return W


def _mixer_weights(w_in: torch.Tensor, up: torch.Tensor, blocks: tuple[str, str | None] | None, planes: bool
                   ) -> tuple[Weight, Weight]:
    """The mixer's matrices as the model holds them: 16-bit, or quantized to `blocks` (w_in's type, up's or None for
    a 16-bit up; up in planes where `planes` and its type has them, as on CUDA)."""
    if blocks is None:
        return w_in, up
    wq, uq = (t if q is None else QuantWeight.from_blocks(quantize(t.float(), q), GGMLQuantizationType[q], t.shape)
              for t, q in zip((w_in, up), blocks, strict=True))
    return wq, uq.to_planes() if planes and isinstance(uq, QuantWeight) and uq.qtype in PLANES_QTYPES else uq


def check_hc_mix(R: Runner, D: int, S: int, rank: int, N: int, dt: torch.dtype, pending: bool, timed: bool = False,
                 out_config: tuple[int, int, int] | None = None, M: int = 1,
                 blocks: tuple[str, str | None] | None = None, planes: bool = True) -> None:
    """The step-sized mixer (combine, grouped norm, w_in and up products, gated stream mean) against the same math in
    f64; the kernel may round differently from the torch path but must not be less accurate than it (2x slack).
    blocks: w_in and up as GGUF blocks of these types (the f64 math then takes their expanded values)."""
    dev = R.device
    X = torch.randn(M, S * D, device=dev).to(dt)
    y = torch.randn(M, D, device=dev).to(dt) if pending else None
    # the injection logits as the model passes them: a column slice of the previous mixer's w_in outputs
    inj = torch.randn(M, S + 5, device=dev).to(dt)[:, 2:2 + S] if pending else None
    norm = (1 + 0.1 * torch.randn(S * D, device=dev)).to(dt)
    w_in, up = _mixer_weights((torch.randn(N, S * D, device=dev) / (S * D) ** 0.5).to(dt),
                              (torch.randn(S * D, rank, device=dev) / rank ** 0.5).to(dt), blocks, planes)

    def reference(d: torch.dtype, held: bool = False) -> tuple[torch.Tensor, ...]:
        # held: the matrices as the model holds them (the torch path's products); else expanded to d
        ws = [w if held else (w if isinstance(w, torch.Tensor) else w.dequantize()).to(d) for w in (w_in, up)]
        a = [t.to(d) for t in (X, y, inj, norm) if t is not None] + ws
        x = a[0] if not pending else combine_torch(a[0], a[1], a[2])
        return (x, *mix_torch(x, *a[-3:], rank, D, S, 1e-6))

    with torch_references():
        ref, base = reference(torch.float64), reference(dt, held=True)
    got = hc_mix_step_triton(X, (y, inj) if pending else None, norm, w_in, up, rank, D, S, 1e-6, out_config=out_config)
    names = ("X", "h", "y")
    errs = [rel_err(g, r) for g, r in zip(got, ref, strict=True)]
    base_errs = [rel_err(b, r) for b, r in zip(base, ref, strict=True)]
    ok = all(e <= max(2 * b, TOL[torch.float32]) for e, b in zip(errs, base_errs, strict=True))
    detail = ", ".join(f"{n} {e:.2e} (torch {b:.2e})" for n, e, b in zip(names, errs, base_errs, strict=True))
    held = f" {blocks[0]}/{blocks[1] or 'bf16'}{' planes' if getattr(up, 'planes', False) else ''}" if blocks else ""
    row = Row(f"hc mixer M={M} D={D} S={S} rank={rank} N={N} {'+combine ' if pending else ''}"
              f"{str(dt).removeprefix('torch.')}{held}" + (f" cfg={out_config}" if out_config else ""), ok,
              f"rel err vs f64: {detail}")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: reference(dt, held=True))
        row.triton_us = R.bench(lambda: hc_mix_step_triton(X, (y, inj) if pending else None, norm, w_in, up, rank, D,
                                                           S, 1e-6, out_config=out_config))
        row.nbytes = held_bytes(w_in) + held_bytes(up)
    R.add(row, variant=out_config is not None)
    if timed and R.timing and blocks is not None and M == 1:
        mixer_launches(R, X, (y, inj) if pending else None, norm, (w_in, up), rank, D, S, blocks)


def mixer_launches(R: Runner, X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                   held: tuple[Weight, Weight], rank: int, D: int, S: int, blocks: tuple[str, str | None]) -> None:
    """A one-row block mixer's launches timed apart, each against the same launch with the matrices in 16 bits (the
    torch column): the prep kernel (with the w_in product's int8 row), the w_in product, the output kernel."""
    from qspec.kernels.triton_hc_mix import hc_out_triton, hc_prep_triton
    from qspec.kernels.triton_qdot import qdot_quantized_triton
    from qspec.model.ops import linear

    w_in, up = held
    w16, u16 = (w if isinstance(w, torch.Tensor) else w.dequantize().to(X.dtype) for w in held)
    _, xn, xq = hc_prep_triton(X, pending, norm, D, S, 1e-6, quant=True)
    y = linear(xn, w16)
    launches = (
        ("prep", lambda: hc_prep_triton(X, pending, norm, D, S, 1e-6), lambda: hc_prep_triton(X, pending, norm, D, S,
                                                                                             1e-6, quant=True)),
        ("w_in", lambda: linear(xn, w16), lambda: qdot_quantized_triton(xq, [(w_in.raw.contiguous(), w_in.code)],
                                                                        X.dtype)),
        ("out", lambda: hc_out_triton(y, xn, u16, rank, D, S), lambda: hc_out_triton(y, xn, up, rank, D, S)))
    for name, sixteen, block in launches:
        row = Row(f"hc mixer launch {name} {blocks[0]}/{blocks[1] or 'bf16'} (torch column: 16-bit)", True,
                  "timed only")
        row.torch_us, row.triton_us = R.bench(sixteen), R.bench(block)
        R.add(row, variant=True)
    if w_in.qtype.name in ("Q4_K", "Q5_K"):
        mixer_lanes(R, X, pending, norm, held, rank, D, S, xq)


def mixer_lanes(R: Runner, X: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                held: tuple[Weight, Weight], rank: int, D: int, S: int, xq: tuple[torch.Tensor, ...]) -> None:
    """A one-row block mixer with its K-quant w_in's rows in 1, 2, 4 or 8 K lanes (0: by its shape): the w_in
    launch alone (torch column) and the whole mixer (triton column)."""
    from qspec.kernels.triton_hc_mix import hc_mix_step_triton
    from qspec.kernels.triton_qdot import k_lanes_mode, qdot_quantized_triton

    w_in, up = held
    for lanes in (0, 1, 2, 4, 8):
        with k_lanes_mode(lanes):
            row = Row(f"hc mixer {w_in.qtype.name} w_in in {lanes or 'shape'} K lanes (torch column: w_in alone)",
                      True, "timed only")
            row.torch_us = R.bench(lambda: qdot_quantized_triton(xq, [(w_in.raw.contiguous(), w_in.code)], X.dtype))
            row.triton_us = R.bench(lambda: hc_mix_step_triton(X, pending, norm, w_in, up, rank, D, S, 1e-6))
        R.add(row, variant=True)


# ---- 8. KV q8_0 dequantisation and the indexer's block choice ------------------------------------------------

def check_dequant(R: Runner, n: int, Hkv: int, d: int, dt: torch.dtype, timed: bool = False) -> None:
    """Bit-identical to the reference: one f32 product, rounded once."""
    dev = R.device
    kq, ks = quantize_q8_0(torch.randn(n, Hkv, d, device=dev))
    vq, vs = quantize_q8_0(3 * torch.randn(n, Hkv, d, device=dev))
    ko, vo = dequant_kv_triton(kq, ks, vq, vs, dt)
    ok = torch.equal(ko, dequant_q8_0_torch(kq, ks, dt)) and torch.equal(vo, dequant_q8_0_torch(vq, vs, dt))
    row = Row(f"dequant_kv q8_0 n={n} Hkv={Hkv} d={d} -> {str(dt).removeprefix('torch.')}", ok,
              "bit-identical" if ok else "BITS DIFFER")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: (dequant_q8_0_torch(kq, ks, dt), dequant_q8_0_torch(vq, vs, dt)))
        row.triton_us = R.bench(lambda: dequant_kv_triton(kq, ks, vq, vs, dt))
        row.nbytes = 2 * (kq.numel() * (1 + torch.empty(0, dtype=dt).element_size()) + ks.numel() * 2)
    R.add(row)


def check_top_blocks(R: Runner, T: int, nb: int, n_top: int, visible: int, ties: bool = False,
                     timed: bool = False) -> None:
    """The chosen set must be the reference's exactly: the n_top largest visible scores, equal scores to the
    lower block id (a stable descending sort; with ties=True scores take 6 values, so most of them tie), never
    a -inf (invisible) block. On CUDA that is also torch.topk's set over the visible blocks, ties included (on the
    CPU torch.topk keeps other ties: kernels/top_blocks.py)."""
    dev = R.device
    s = torch.randint(0, 6, (T, nb), device=dev).float() if ties else torch.relu(torch.randn(T, nb, device=dev))
    if ties:
        s = torch.where(torch.rand(T, nb, device=dev) < 0.5, -s, s)  # -0 ties +0
    vis = torch.arange(nb, device=dev)[None, :] < torch.randint(visible // 2, visible + 1, (T, 1), device=dev)
    s = s.masked_fill(~vis, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :n_top]
    ref = torch.zeros(T, nb, dtype=torch.bool, device=dev).scatter_(1, order, True) & vis
    got = top_blocks_mask_triton(s, n_top)
    ok = torch.equal(got, ref)
    if not ties or str(dev).startswith("cuda"):
        ok = ok and torch.equal(got, top_blocks_mask_torch(s, n_top))
    row = Row(f"top_blocks_mask T={T} nb={nb} n_top={n_top}" + (" ties" if ties else ""), ok,
              f"{int((got != ref).sum())} lanes differ from the stable-sort choice")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: top_blocks_mask_torch(s, n_top))
        row.triton_us = R.bench(lambda: top_blocks_mask_triton(s, n_top))
        row.nbytes = s.numel() * 5
    R.add(row)


def check_argmax(R: Runner, M: int, V: int, dt: torch.dtype, ties: bool = False, chunk: int | None = None,
                 timed: bool = False) -> None:
    """The same index as torch's argmax, exactly: random rows, then (ties) rows of few distinct values, so the
    maximum recurs and the first occurrence must win across chunks, and rows with -0/+0, -inf and NaN."""
    dev = R.device
    x = (torch.randint(-3, 3, (M, V), device=dev).to(dt) if ties else torch.randn(M, V, device=dev).to(dt))
    if ties and M >= 3:
        x[1] = float("-inf")
        x[2, V // 2:] = float("nan")
        x[2, V // 3] = -torch.tensor(float("nan"))  # a NaN with its sign bit set (still torch's maximum)
    if ties and M >= 4:
        x[3] = 0.0
        x[3, :V // 3] = -0.0
    kw = {} if chunk is None else {"chunk": chunk}
    got, ref = argmax_rows_triton(x, **kw), argmax_rows_torch(x)
    ok = torch.equal(got, ref)
    row = Row(f"argmax_rows M={M} V={V} {str(dt).removeprefix('torch.')}" + (" ties" if ties else "")
              + (f" chunk={chunk}" if chunk else ""), ok, f"{int((got != ref).sum())} rows differ from torch")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: argmax_rows_torch(x))
        row.triton_us = R.bench(lambda: argmax_rows_triton(x))
        row.nbytes = x.numel() * x.element_size()
    R.add(row)


# ---- row independence ------------------------------------------------------------------------------------------

def check_row_independence(R: Runner, small: bool) -> None:
    """A row's result must not depend on how many rows share the launch (decode vs verify, row-exact mode):
    GDN rows 0..2 of a 6-row step vs a 3-row step, MoE and Q4 rows computed alone vs together. Bitwise, and
    informative only: the kernels' contracts do not promise it, but bit-exact decode-vs-verify tests on the GPU
    need it."""
    dev = R.device
    Hv, dk = (4, 32) if small else (48, 128)
    q, k, v, g, beta, ssm = gdn_inputs(6, Hv // 2, Hv, dk, dk, 12, dev)
    live, base = torch.tensor(0, device=dev), torch.tensor(6, device=dev)
    s6, s3 = ssm.clone(), ssm.clone()
    o6 = gdn_recurrent_planes_triton(q, k, v, g, beta, s6, live, base)
    o3 = gdn_recurrent_planes_triton(q[:3], k[:3], v[:3], g[:3], beta[:3], s3, live, base)
    ok = same_bits(o6[:3], o3) and same_bits(s6[6:9], s3[6:9])
    R.add(Row("rows: gdn 3 rows alone vs in a 6-row step", ok, "bit-identical" if ok else "BITS DIFFER", info=True))

    D, Fd, E = (64, 48, 8) if small else (2560, 640, 64)
    h, top_i, top_w, gate, up, down = moe_inputs(6, D, Fd, E, 3, torch.bfloat16, dev)
    all6 = moe_slots_triton(h, top_i, top_w, gate, up, down)
    alone = torch.cat([moe_slots_triton(h[i:i + 1], top_i[i:i + 1], top_w[i:i + 1], gate, up, down)
                       for i in range(6)])
    ok = same_bits(all6.float(), alone.float())
    R.add(Row("rows: moe_few 1 row at a time vs 6 rows", ok, "bit-identical" if ok else "BITS DIFFER", info=True))

    N, K = (100, 256) if small else (4096, 2560)
    W = Q4Weight.from_dense(0.02 * torch.randn(N, K, device=dev))
    x = torch.randn(5, K, device=dev)
    all5 = q4_q8_matvec_triton(x, W.packed, W.scales)
    alone = torch.cat([q4_q8_matvec_triton(x[i:i + 1], W.packed, W.scales) for i in range(5)])
    ok = same_bits(all5, alone)
    R.add(Row("rows: q4_head 1 row at a time vs 5 rows", ok, "bit-identical" if ok else "BITS DIFFER", info=True))


def check_kv_write(R: Runner, T: int, Hkv: int, d: int, cells: int, dt: torch.dtype, timed: bool = False) -> None:
    """The q8_0 KV write must leave the cache bit-identical to the reference's: random rows at scattered cells, one
    all-zero block (scale 0), and a block of exact halves (amax 127, so x * inv = x: 0.5, 1.5, 2.5 round to even).

    The reference runs on the CPU: CUDA's eager torch computes amax / 127 as amax * (1 / 127) (a CPU-scalar divisor),
    one ulp off the IEEE quotient in a few blocks in a thousand, and the kernel divides as ggml's C code does."""
    dev = R.device
    k = torch.randn(T, Hkv, d, device=dev).to(dt)
    v = (3 * torch.randn(T, Hkv, d, device=dev)).to(dt)
    k[0, 0, :32] = 0.0
    halves = torch.tensor([127.0] + [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4 + [-4.5, 5.5, 126.5], device=dev)
    v[-1, -1, :32] = halves.to(dt)
    pos = torch.randperm(cells, device=dev)[:T]
    caches = [torch.randint(-127, 128, (cells, Hkv, d), dtype=torch.int8, device=dev) for _ in range(2)]
    scales = [torch.randn(cells, Hkv, d // 32, device=dev).half() for _ in range(2)]
    want = [c.cpu() for c in caches + scales]
    got = [c.clone() for c in caches + scales]
    write_q8_0_torch(*want, pos.cpu(), k.cpu(), v.cpu())
    write_q8_0_triton(*got, pos, k, v)
    got_cpu = [c.cpu() for c in got]
    ok = all(torch.equal(a, b) for a, b in zip(got_cpu, want, strict=True))
    row = Row(f"kv_write q8_0 T={T} Hkv={Hkv} d={d} cells={cells} {str(dt).removeprefix('torch.')}", ok,
              "bit-identical" if ok else f"{sum(int((a != b).sum()) for a, b in zip(got_cpu, want, strict=True))} "
                                          "entries differ")
    want = [c.clone() for c in caches + scales]  # the torch write timed on the device
    if timed and R.timing:
        row.torch_us = R.bench(lambda: write_q8_0_torch(*want, pos, k, v))
        row.triton_us = R.bench(lambda: write_q8_0_triton(*got, pos, k, v))
        row.nbytes = 2 * T * Hkv * d * (k.element_size() + 1) + 2 * T * Hkv * d // 32 * 2
    R.add(row)


def check_write_rows_seqs(R: Runner, B: int, T: int, d: int, cells: int, src_dt: torch.dtype, dt: torch.dtype,
                          timed: bool = False) -> None:
    """Every sequence's rows written to its own buffer in one launch (a batched step's raw indexer keys) must leave
    each buffer bit-identical to its own index_copy_ of the rows cast to its dtype; timed against those copies."""
    dev = R.device
    src = torch.randn(B * T, d + 8, device=dev).to(src_dt)[:, 8:]  # a column slice, as the projections' keys are
    pos = torch.cat([torch.randperm(cells, device=dev)[:T] for _ in range(B)])
    bufs = [torch.randn(cells, d, device=dev).to(dt) for _ in range(B)]
    want = [b.clone() for b in bufs]
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)

    def each() -> None:
        for b, w in enumerate(want):
            w.index_copy_(0, pos[b * T:(b + 1) * T], src[b * T:(b + 1) * T].to(dt))
    each()
    write_rows_seqs_triton(bufs[0], table, pos, src)
    ok = all(torch.equal(a, b) for a, b in zip(bufs, want, strict=True))
    row = Row(f"row write seqs B={B} T={T} d={d} {str(src_dt).removeprefix('torch.')} -> "
              f"{str(dt).removeprefix('torch.')}" + (" (torch: each sequence's index_copy_)" if timed else ""),
              ok, "bit-identical" if ok else "buffers DIFFER")
    if timed and R.timing:
        row.torch_us = R.bench(each)
        row.triton_us = R.bench(lambda: write_rows_seqs_triton(bufs[0], table, pos, src))
    R.add(row)


def check_gdn_conv(R: Runner, T: int, Hk: int, Hv: int, d: int, taps: int = 4, timed: bool = False) -> None:
    """GDN's step conv + silu + q/k L2 norms against the reference (f32 throughout), on a window like the snapshot
    kernel's output [C, taps - 1 + T]."""
    dev = R.device
    C = (2 * Hk + Hv) * d
    X = torch.randn(C, taps - 1 + T, device=dev)
    w = torch.randn(C, taps, device=dev) * 0.5
    ref = gdn_conv_qkv_torch(X, w, T, Hk, Hv, d)
    got = gdn_conv_qkv_triton(X, w, T, Hk, Hv, d)
    e = max(rel_err(g, r) for g, r in zip(got, ref, strict=True))
    row = Row(f"gdn_conv T={T} Hk={Hk} Hv={Hv} d={d}" + (" (torch: the reference, eager)" if timed else ""),
              e < TOL[torch.float32], f"rel err {e:.2e} (max over q, k, v)")
    if timed and R.timing:
        row.torch_us = R.bench(lambda: gdn_conv_qkv_torch(X, w, T, Hk, Hv, d))
        row.triton_us = R.bench(lambda: gdn_conv_qkv_triton(X, w, T, Hk, Hv, d))
        row.nbytes = (X.numel() + w.numel() + T * C) * 4
    R.add(row)


def check_gdn_conv_recurrence(R: Runner, T: int, Hk: int, Hv: int, d: int, taps: int = 4, timed: bool = False,
                              final_only: bool = False) -> None:
    """The step conv inside the recurrence's launch (gdn_conv_recurrent_triton, the model's call: gates from bf16
    logits) against the references of both; timed against the two launches it replaces (the torch column)."""
    dev = R.device
    C, P = (2 * Hk + Hv) * d, 2 * max(T, 6)
    X = torch.randn(C, taps - 1 + T, device=dev)
    w = torch.randn(C, taps, device=dev) * 0.5
    _, _, _, _, _, ssm = gdn_inputs(T, Hk, Hv, d, d, P, dev)
    g, beta = (8 * torch.randn(T, Hv, device=dev)).bfloat16(), (6 * torch.randn(T, Hv, device=dev)).bfloat16()
    gates = (-(1 + 15 * torch.rand(Hv, device=dev)), 4 * torch.rand(Hv, device=dev))
    live, base = torch.tensor(P // 2 - 1, device=dev), torch.tensor(P // 2, device=dev)
    s_ref, s_tri, s_two = ssm.clone(), ssm.clone(), ssm.clone()
    o_ref = gdn_recurrent_planes_torch(*gdn_conv_qkv_torch(X, w, T, Hk, Hv, d), g, beta, s_ref, live, base, gates,
                                       final_only)
    o = gdn_conv_recurrent_triton(X, w, Hk, Hv, d, d, g, beta, s_tri, live, base, gates, final_only=final_only)
    eo, es = rel_err(o, o_ref), rel_err(s_tri, s_ref)
    row = Row(f"gdn conv + recurrence T={T} Hk={Hk} Hv={Hv} d={d}" + (" final only" if final_only else "")
              + (" (torch: the two kernels)" if timed else ""), eo < 1e-5 and es < 1e-5,
              f"rel err o {eo:.2e} states {es:.2e} (all planes)")

    def two_launches() -> None:
        gdn_recurrent_planes_triton(*gdn_conv_qkv_triton(X, w, T, Hk, Hv, d), g, beta, s_two, live, base, gates,
                                    final_only=final_only)

    if timed and R.timing:
        row.torch_us = R.bench(two_launches)
        row.triton_us = R.bench(lambda: gdn_conv_recurrent_triton(X, w, Hk, Hv, d, d, g, beta, s_tri, live, base,
                                                                  gates, final_only=final_only))
    R.add(row)


def _seqs_caches(B: int, n_slots: int, cfg: ModelConfig, dev: str) -> list[RecurrentCache]:
    """B recurrent caches of random states, their live planes in either half (so each sequence's base differs),
    each begun on a step."""
    recs = []
    for b in range(B):
        rc = RecurrentCache(cfg, n_slots, dev)
        for st in rc.gdn.values():
            st.conv.normal_()
            st.ssm.normal_(std=0.1)
        for _ in range(1 + b % 2):  # a step, committed: live in the upper half, then (odd b) in the lower
            rc.begin_step()
            rc.commit(b % n_slots)
        rc.begin_step()  # the step to check writes the half without the live plane
        recs.append(rc)
    return recs


def check_gdn_seqs(R: Runner, B: int, T: int, Hk: int, Hv: int, dk: int, dv: int, timed: bool = False) -> None:
    """A batched step's GDN (gdn_seqs: every sequence's snapshots, then every sequence's conv and recurrence, a launch
    each) against each sequence's step alone (gdn_step_seqs_torch); timed against the launches of the sequences one
    by one (the model's per-sequence path: snapshots, then conv and recurrence in one launch, for one-row steps)."""
    dev = R.device
    cfg = preset("tiny", layers=1, gdn_k_heads=Hk, gdn_v_heads=Hv, gdn_head_dim=dk, gdn_v_head_dim=dv)
    C, taps = cfg.gdn_conv_dim, cfg.gdn_conv_kernel
    n_slots = max(T, 6)
    ref, tri = _seqs_caches(B, n_slots, cfg, dev), _seqs_caches(B, n_slots, cfg, dev)
    for a, b in zip(ref, tri, strict=True):
        for x, y in zip(a.buffers(), b.buffers(), strict=True):
            y.copy_(x)
    qkv, logits = torch.randn(B * T, C, device=dev).bfloat16(), (4 * torch.randn(B * T, 2 * Hv, device=dev)).bfloat16()
    conv_w = torch.randn(C, taps, device=dev) * 0.5
    gates = (-(1 + 15 * torch.rand(Hv, device=dev)), 4 * torch.rand(Hv, device=dev))
    dims = (Hk, Hv, dk, dv)
    args = (qkv, logits[:, Hv:], logits[:, :Hv])
    o_ref = gdn_step_seqs_torch(*args, ref, [rc.gdn[0] for rc in ref], conv_w, dims, gates)
    tables = SequenceTables(tri, {})
    o = gdn_step_seqs_triton(*args, tables, 0, conv_w, dims, gates)
    conv_same = all(torch.equal(a.gdn[0].conv, b.gdn[0].conv) for a, b in zip(ref, tri, strict=True))
    es = max(rel_err(b.gdn[0].ssm, a.gdn[0].ssm) for a, b in zip(ref, tri, strict=True))
    eo = rel_err(o, o_ref)
    row = Row(f"gdn seqs B={B} T={T} Hk={Hk} Hv={Hv} dk={dk} dv={dv}" + (" (torch: the sequences' launches)"
                                                                           if timed else ""),
              eo < 1e-5 and es < 1e-5 and conv_same,
              f"rel err o {eo:.2e} states {es:.2e}; conv planes {'bit-identical' if conv_same else 'DIFFER'}")

    def one_by_one() -> None:
        for b, rc in enumerate(tri):
            rows = slice(b * T, (b + 1) * T)
            X = conv_snapshot_triton(rc.gdn[0].conv, qkv[rows], rc.gdn[0].conv, rc.base, T, live=rc.live)
            gdn_conv_recurrent_triton(X, conv_w, Hk, Hv, dk, dv, args[1][rows], args[2][rows], rc.gdn[0].ssm,
                                      rc.live, rc.base, gates)

    if timed and R.timing:
        row.torch_us = R.bench(one_by_one)
        row.triton_us = R.bench(lambda: gdn_step_seqs_triton(*args, tables, 0, conv_w, dims, gates))
    R.add(row)


def gdn_seqs_checks(R: Runner, small: bool) -> None:
    """A batched step's GDN over several sequences: 8 one-row sequences and 4 verifies of 4 rows at the real geometry,
    then ragged head sizes."""
    if small:
        check_gdn_seqs(R, 3, 1, 2, 4, 16, 16)
        check_gdn_seqs(R, 2, 3, 1, 2, 16, 24)
        return
    check_gdn_seqs(R, 8, 1, 16, 48, 128, 128, timed=True)
    check_gdn_seqs(R, 4, 4, 16, 48, 128, 128, timed=True)
    check_gdn_seqs(R, 2, 1, 16, 48, 128, 128, timed=True)
    check_gdn_seqs(R, 3, 2, 3, 6, 96, 80)


def gdn_conv_checks(R: Runner, small: bool) -> None:
    """GDN's step conv: a verify (6 rows) and a decode row at the real geometry, then ragged head dims."""
    if small:
        check_gdn_conv(R, 3, 2, 4, 16)
        check_gdn_conv(R, 1, 1, 2, 48)
        check_gdn_conv(R, 2, 2, 2, 32, taps=3)
        check_gdn_conv_recurrence(R, 3, 2, 4, 32)
        check_gdn_conv_recurrence(R, 1, 1, 3, 48, taps=3)
        check_gdn_conv_recurrence(R, 5, 2, 4, 32, final_only=True)
    else:
        check_gdn_conv(R, 6, 16, 48, 128, timed=True)
        check_gdn_conv(R, 1, 16, 48, 128, timed=True)
        check_gdn_conv(R, 4, 3, 6, 96)
        check_gdn_conv_recurrence(R, 1, 16, 48, 128, timed=True)
        check_gdn_conv_recurrence(R, 6, 16, 48, 128, timed=True)
        check_gdn_conv_recurrence(R, 4, 3, 6, 96)
        check_gdn_conv_recurrence(R, 100, 16, 48, 128, final_only=True)


# ---- the groups: one per kernel (tests/test_gpu_kernels.py runs each as one test) ------------------------------

def conv_snapshot_checks(R: Runner, small: bool) -> None:
    """Conv snapshots: the real GDN (s=3) and PLE (s=9) geometries, then edge shapes, the model's in-place call and
    16-bit activations."""
    C = 300 if small else 10240
    for s, n, k in ((3, 6, 6), (9, 6, 6)):
        check_conv(R, C, s, n, k, scalar_dest=True, timed=True)
        check_conv(R, C, s, n, k, scalar_dest=True, timed=True, from_live=True)
    for s, n, k in ((3, 1, 1), (3, 2, 2), (3, 5, 3), (9, 7, 7), (9, 1, 1), (1, 8, 8), (8, 8, 5), (15, 1, 1)):
        check_conv(R, 257, s, n, k, scalar_dest=True)
        check_conv(R, 130, s, n, k, scalar_dest=False)
    for s, n in ((3, 1), (9, 1), (3, 6), (9, 6)):
        for fused in (True, False):
            check_write_snapshots(R, C, s, n, fused)
    for s, n, k in ((3, 6, 6), (3, 1, 1), (9, 5, 3)):  # bf16 activations (the GDN projection's own dtype)
        check_conv(R, C, s, n, k, scalar_dest=True, from_live=True, t_dtype=torch.bfloat16)
        check_conv(R, 257, s, n, k, scalar_dest=False, t_dtype=torch.float16)


def gdn_checks(R: Runner, small: bool) -> None:
    """The gated delta rule: the real geometry (Hv=48, dk=dv=128, T=6), with and without pre-expanded key heads."""
    if small:
        check_gdn(R, 6, 2, 4, 128, 128, 6)
        check_gdn(R, 3, 4, 4, 32, 64, 4)
        check_gdn(R, 1, 1, 2, 48, 40, 1)
        check_gdn(R, 3, 2, 4, 64, 64, 3, alias=True)
        check_gdn(R, 4, 2, 4, 32, 32, 4, gates=True)
        return
    check_gdn(R, 6, 48, 48, 128, 128, 6, timed=True)
    check_gdn(R, 6, 16, 48, 128, 128, 6, timed=True)
    for T in (1, 2, 16):
        check_gdn(R, T, 16, 48, 128, 128, max(T, 6))
    check_gdn(R, 4, 3, 6, 96, 80, 4)  # non-power-of-2 head dims (masks)
    check_gdn(R, 6, 16, 48, 128, 128, 6, alias=True)
    check_gdn(R, 6, 16, 48, 128, 128, 6, timed=True, gates=True)  # the model's call
    check_gdn(R, 1, 16, 48, 128, 128, 6, gates=True)


def pooled_checks(R: Runner, small: bool) -> None:
    """Pooled keys: the real geometry (C=8, r=4, d=128, cap=8192, rope 64) in bf16, then the other cache types; then a
    batched step's updates in one launch for all its sequences."""
    check_pooled(R, torch.bfloat16, 512 if small else 8192, 128, 4, 8, 64, timed=True)
    check_pooled(R, torch.float16, 512, 128, 4, 16, 64)
    check_pooled(R, torch.float32, 512, 128, 4, 8, 64)
    check_pooled(R, torch.bfloat16, 384, 96, 3, 5, 32)  # non-power-of-2 head, odd ratio
    if small:
        check_pooled_seqs(R, torch.bfloat16, 3, 256, 64, 4, 2, 32)
        check_pooled_seqs(R, torch.float32, 2, 96, 96, 3, 5, 32)
        return
    check_pooled_seqs(R, torch.bfloat16, 8, 8192, 128, 4, 8, 64, timed=True)  # a QSA layer of a batch of 8
    check_pooled_seqs(R, torch.float16, 3, 384, 96, 3, 5, 32)


def sparse_attention_checks(R: Runner, small: bool) -> None:
    """Sparse QSA attention: the real geometry (24 query / 2 kv heads of 256, r=4, 512 blocks = the 2,048-token
    budget) at 4K and 32K contexts, then small shapes and every cache type."""
    if small:
        check_sparse_attn(R, 1, 4, 2, 32, 4, 3, 64, "f32")
        check_sparse_attn(R, 3, 12, 2, 64, 4, 5, 128, "q8_0")
        check_sparse_attn(R, 6, 8, 2, 48, 2, 4, 96, "bf16")  # head dim not a power of 2
        return
    for T in (1, 6):
        for ctx in (4096, 32768):
            check_sparse_attn(R, T, 24, 2, 256, 4, 512, ctx, "q8_0", timed=True)
    check_sparse_attn(R, 6, 24, 2, 256, 4, 512, 4096, "bf16")
    check_sparse_attn(R, 512, 24, 2, 256, 4, 512, 4096, "q8_0")  # a prefill chunk
    check_sparse_attn(R, 3, 12, 2, 64, 4, 5, 128, "f32")


def kv_write_checks(R: Runner, small: bool) -> None:
    """The q8_0 KV write of a decode, a verify and a prefill chunk's rows, then odd shapes."""
    if small:
        check_kv_write(R, 1, 2, 64, 40, torch.bfloat16)
        check_kv_write(R, 6, 2, 96, 50, torch.float32)
        check_kv_write(R, 3, 3, 32, 9, torch.float16)
        check_write_rows_seqs(R, 3, 2, 48, 20, torch.float32, torch.bfloat16)
        check_write_rows_seqs(R, 2, 1, 32, 9, torch.bfloat16, torch.bfloat16)
        return
    for T in (1, 6, 512):
        check_kv_write(R, T, 2, 256, 8192, torch.bfloat16, timed=True)
    check_kv_write(R, 5, 3, 96, 100, torch.float32)
    for T in (1, 4):  # a QSA layer's raw indexer keys (128 wide) of 8 sequences
        check_write_rows_seqs(R, 8, T, 128, 8192, torch.bfloat16, torch.bfloat16, timed=True)
    check_write_rows_seqs(R, 3, 3, 100, 64, torch.float32, torch.float16)


def check_attention_seqs(R: Runner, B: int, T: int, H: int, Hkv: int, d: int, cap: int, n: int, kv: str,
                         dt: torch.dtype = torch.bfloat16, keep: float = 1.0, timed: bool = False,
                         alone: bool = True) -> None:
    """A batched step's attention layer (attention_seqs: every sequence's K/V write in one launch, every sequence's
    masked attention over its own cache in one pass) against each sequence's write and attention alone
    (attend_each, f32); the caches must be bit-identical, and with `alone` (each sequence's chunks as alone, the
    row-exact mode's plan) each sequence's rows the bits of its kernel alone. Timed against the sequences' launches
    one by one."""
    dev = R.device
    ref, tri = ([KVCache(cap, Hkv, d, cache_type=kv, dtype=dt, device=dev, fused_attention=True, write_kernel=True)
                 for _ in range(B)] for _ in range(2))
    for a, b in zip(ref, tri, strict=True):
        for x, y in zip(a.buffers(), b.buffers(), strict=True):
            x.copy_((torch.randn(x.shape, device=dev) * (20 if x.dtype == torch.int8 else 0.01)).to(x.dtype))
            y.copy_(x)
    q, k, v = (torch.randn(B * T, h, d, device=dev).to(dt) for h in (H, Hkv, Hkv))
    ends = [n - 1 - 7 * b for b in range(B)]  # each sequence's last row at its own position in the bucket
    pos = torch.tensor([e - T + 1 + j for e in ends for j in range(T)], device=dev)
    cells = torch.arange(n, device=dev)[None, :]
    mask = (cells <= pos[:, None]) & ((torch.rand(B * T, n, device=dev) < keep) | (cells == pos[:, None]))
    o_ref = attend_each(q, k, v, pos, ref, n, mask)
    tables = SequenceTables([], {0: tri}).kv(0)
    assert tables is not None

    def together() -> torch.Tensor:
        write_seqs(tri, tables, pos, k, v)
        return masked_attention_seqs_triton(q, tuple(tri[0].buffers()), tables, n, mask, alone=alone)
    o = together()
    same = all(torch.equal(x, y) for a, b in zip(ref, tri, strict=True) for x, y in zip(a.buffers(), b.buffers(),
                                                                                           strict=True))

    def one_by_one() -> torch.Tensor:
        return attend_each(q, k, v, pos, tri, n, mask, masked_attention)
    bits = torch.equal(o, one_by_one())
    err = rel_err(o, o_ref)
    row = Row(f"attention seqs B={B} T={T} H={H}/{Hkv} d={d} n={n} {kv} keep={keep} "
              f"{'chunks as alone' if alone else 'chunks for all'}" + (" (torch: the sequences' launches)" if timed
                                                                      else ""),
              err < TOL[dt] and same and (bits or not alone),
              f"rel err {err:.2e} (f32 reference); caches {'bit-identical' if same else 'DIFFER'}; each sequence's "
              f"rows {'the bits of its kernel alone' if bits else 'unlike its kernel alone'}")

    if timed and R.timing:
        row.torch_us = R.bench(one_by_one)
        row.triton_us = R.bench(together)
    R.add(row)


def attention_seqs_checks(R: Runner, small: bool) -> None:
    """A batched step's attention: 8 one-row sequences and 4 verifies of 4 rows over a 4,608-cell q8_0 bucket (the
    draft head's causal mask, QSA's block mask), then other cache types and ragged shapes."""
    if small:
        check_attention_seqs(R, 3, 1, 4, 2, 32, 128, 96, "q8_0")
        check_attention_seqs(R, 2, 3, 4, 2, 64, 96, 64, "q8_0", keep=0.5)
        check_attention_seqs(R, 2, 2, 2, 1, 32, 64, 64, "f32", dt=torch.float32, keep=0.5)
        # enough cells that the chunks planned for all rows are fewer (and longer) than each sequence's alone
        check_attention_seqs(R, 3, 1, 4, 2, 32, 3072, 2944, "q8_0", alone=False)
        return
    for B, T in ((8, 1), (4, 4)):
        for alone in (True, False):
            check_attention_seqs(R, B, T, 24, 2, 256, 8192, 4608, "q8_0", timed=True, alone=alone)
            check_attention_seqs(R, B, T, 24, 2, 256, 8192, 4608, "q8_0", keep=0.45, timed=True, alone=alone)
    check_attention_seqs(R, 3, 2, 24, 2, 256, 2048, 1536, "bf16", keep=0.45)
    check_attention_seqs(R, 3, 3, 12, 2, 128, 1024, 1000, "f32", dt=torch.float32, keep=0.5)


def masked_attention_checks(R: Runner, small: bool) -> None:
    """Masked attention: the MTP head's causal read of a 4,608-cell q8_0 bucket (1 row, 6 rows) and QSA's block mask
    (~half the cells), then small and ragged shapes and every cache type."""
    if not small:
        for T in (1, 6):
            check_masked_attn(R, T, 24, 2, 256, 4608, "q8_0", timed=True)
            check_masked_attn(R, T, 24, 2, 256, 4608, "q8_0", keep=0.45, timed=True)
        check_masked_attn(R, 6, 24, 2, 256, 4608, "bf16", keep=0.45)
        check_masked_attn(R, 3, 12, 2, 128, 1000, "f32", dt=torch.float32, keep=0.5)
        # prefill chunks of 512: the first (causal), and one past the QSA budget (~45% of the earlier cells)
        check_masked_attn(R, 512, 24, 2, 256, 4608, "q8_0", first=0, timed=True)
        check_masked_attn(R, 512, 24, 2, 256, 4608, "q8_0", keep=0.45, first=4096 - 512, timed=True)
        return
    check_masked_attn(R, 1, 12, 2, 64, 100, "q8_0")
    check_masked_attn(R, 3, 4, 2, 32, 70, "f32", dt=torch.float32, keep=0.5)
    check_masked_attn(R, 6, 6, 2, 96, 200, "q8_0", dt=torch.float16, keep=0.4)
    check_masked_attn(R, 2, 2, 1, 48, 5, "bf16", keep=0.5)
    check_masked_attn(R, 1, 4, 1, 32, 1000, "q8_0", keep=0.3)  # 32 chunks: the combine loops
    # several rows per program (a ragged last group), other step sizes, warps and pipeline stages
    check_masked_attn(R, 6, 12, 2, 64, 100, "q8_0", keep=0.5, config=(4, 16, 4, 2, 8))
    check_masked_attn(R, 5, 6, 2, 96, 200, "q8_0", dt=torch.float16, keep=0.4, config=(2, 64, 8, 3, 264))
    check_masked_attn(R, 3, 4, 2, 32, 70, "f32", dt=torch.float32, keep=0.5, config=(4, 32, 4, 1, 264))
    # prefill-sized calls (steps with no attended cell skipped): a first chunk, a later one, a ragged last group
    check_masked_attn(R, 40, 6, 2, 64, 160, "q8_0", keep=0.5, first=0)
    check_masked_attn(R, 18, 4, 2, 32, 128, "bf16", first=70)
    check_masked_attn(R, 17, 4, 1, 48, 96, "f32", dt=torch.float32, keep=0.4, first=8)
    check_masked_attn(R, 20, 4, 2, 32, 64, "q8_0", keep=0.5, first=0, config=(4, 16, 4, 1, 8))  # one chunk, unpadded


def q4_checks(R: Runner, small: bool) -> None:
    """The Q4 draft head: the real geometry (N=248320, K=2560, M=1), then row counts and ragged shapes."""
    if small:
        check_q4(R, 200, 256, 1, torch.float32)
        check_q4(R, 130, 96, 3, torch.bfloat16)
        check_q4(R, 64, 64, 8, torch.float16)
        check_q4(R, 100, 160, 2, torch.float32, config=(16, 2, 1, 3))  # a pipelined K loop, a ragged last step
        return
    W = check_q4(R, 248320, 2560, 1, torch.bfloat16, timed=True)
    check_q4(R, 248320, 2560, 1, torch.float32, W=W)
    del W
    for M in (2, 6, 8):
        check_q4(R, 4099, 2560, M, torch.float32)
    check_q4(R, 1000, 96, 3, torch.bfloat16)


def moe_checks(R: Runner, small: bool) -> None:
    """Routed experts for a few tokens: M=6, D=2560, F=640, k=10 (E=64 instead of 512 to save memory), then other
    row counts; the per-pair kernels and the grouped ones (each distinct expert read once)."""
    if small:
        check_moe(R, 3, 64, 48, 8, 3, torch.bfloat16)
        check_moe(R, 2, 96, 40, 6, 2, torch.float32)
        # grouped: few experts, so rows share them; ragged F and D; one row; all 16 rows
        check_moe(R, 6, 64, 48, 5, 3, torch.bfloat16, grouped=True, config=(16, 32, 32, 16, 4, 2))
        check_moe(R, 5, 96, 40, 4, 2, torch.float16, grouped=True, config=(16, 32, 32, 16, 4, 2))
        check_moe(R, 1, 64, 48, 8, 3, torch.bfloat16, grouped=True, config=(16, 32, 16, 32, 4, 2))
        check_moe(R, 16, 64, 32, 12, 4, torch.bfloat16, grouped=True, config=(32, 64, 64, 32, 4, 2))
        return
    inputs = check_moe(R, 6, 2560, 640, 64, 10, torch.bfloat16, timed=True)
    check_moe(R, 6, 2560, 640, 64, 10, torch.bfloat16, timed=True, inputs=inputs, grouped=True)
    del inputs
    check_moe(R, 16, 2560, 640, 12, 10, torch.bfloat16, grouped=True)  # rows share most experts
    check_moe(R, 1, 2560, 640, 64, 10, torch.bfloat16, timed=True)
    check_moe(R, 16, 2560, 640, 64, 10, torch.bfloat16)
    check_moe(R, 3, 1000, 300, 16, 4, torch.float32)


def gemv_checks(R: Runner, small: bool) -> None:
    """Step-sized products: the model's shapes for a decode (M=1) and a verify (M=6) step, one-row and few-row
    kernels."""
    if not small:
        for name, N, K in GEMV_SHAPES:
            W = check_gemv(R, name, N, K, 1, torch.bfloat16, timed=True)
            check_gemv(R, name, N, K, 6, torch.bfloat16, W=W)
            check_gemv(R, name, N, K, 6, torch.bfloat16, W=W, few=True, timed=True)
            del W
        check_gemv(R, "odd", 1001, 2560, 3, torch.float16)
        for M in (2, 3, 8):
            check_gemv(R, "odd", 1001, 2565, M, torch.float16, few=True)
        return
    check_gemv(R, "small", 100, 96, 1, torch.bfloat16)
    check_gemv(R, "small", 100, 96, 3, torch.float16)
    # fewer rows than programs and a short K step: K split over programs
    check_gemv(R, "split", 5, 1000, 1, torch.bfloat16, config=(32, 256, 4, 2))
    check_gemv(R, "split", 6, 700, 8, torch.bfloat16, config=(32, 256, 4, 2))
    # the few-rows kernel: every row count, ragged N and K, a K split, both 16-bit types
    for M in (2, 5, 8):
        check_gemv(R, "small", 100, 96, M, torch.bfloat16, few=True, config=(16, 32, 4, 2, 1))
    check_gemv(R, "ragged", 50, 200, 6, torch.float16, few=True, config=(32, 64, 4, 2, 1))
    check_gemv(R, "split", 20, 1000, 3, torch.bfloat16, few=True, config=(16, 64, 4, 2, 8))


def hc_mix_checks(R: Runner, small: bool) -> None:
    """The hyper-connection mixer of a step: real geometry (D=2560, S=4, rank 320, w_in padded to 328 rows; the
    output mixer has no injection rows) at every row count a step sends (1: decode and draft; up to 6: MTP5's
    verify and extend, the engine's mixer_step_rows; 8: the edge), with and without the pending combine."""
    if not small:
        for M in (1, 2, 4, 6, 8):
            for pending in (True, False):
                check_hc_mix(R, 2560, 4, 320, 328, torch.bfloat16, pending=pending, timed=M in (1, 6), M=M)
        check_hc_mix(R, 2560, 4, 320, 320, torch.bfloat16, pending=True, timed=True)
        check_hc_mix(R, 2560, 4, 320, 328, torch.float32, pending=True)
        check_hc_mix(R, 2560, 4, 320, 328, torch.float32, pending=True, M=6)
        check_hc_mix(R, 1000, 3, 100, 107, torch.float16, pending=True)
        # llama-quantize's Q4_K_M: w_in Q4_K, up Q5_0 (in planes, as on CUDA); and Q8_0 (a block up: one row only)
        check_hc_mix(R, 2560, 4, 320, 324, torch.bfloat16, pending=True, timed=True, blocks=("Q4_K", "Q5_0"))
        check_hc_mix(R, 2560, 4, 320, 324, torch.bfloat16, pending=True, timed=True, blocks=("Q8_0", "Q8_0"))
        return
    for M in (1, 2, 6):
        check_hc_mix(R, 64, 4, 16, 24, torch.bfloat16, pending=True, M=M)
    check_hc_mix(R, 64, 4, 16, 20, torch.bfloat16, pending=False, M=6)
    check_hc_mix(R, 64, 4, 16, 24, torch.float32, pending=True)
    check_hc_mix(R, 96, 4, 24, 24, torch.float32, pending=False, out_config=(32, 16, 4))
    check_hc_mix(R, 96, 3, 20, 29, torch.float16, pending=True, out_config=(8, 8, 4))
    check_hc_mix(R, 96, 3, 20, 29, torch.float16, pending=True, M=5, out_config=(4, 32, 4))
    check_hc_mix(R, 64, 4, 16, 24, torch.float32, pending=True, M=6)
    check_hc_mix(R, 96, 4, 24, 24, torch.bfloat16, pending=True, M=3, out_config=(16, 16, 4))
    check_hc_mix(R, 64, 4, 16, 20, torch.float32, pending=False, M=8)
    # the matrices as GGUF blocks (llama-quantize's Q4_K_M: w_in Q4_K, up Q5_0 in planes; one row and a verify's)
    check_hc_mix(R, 64, 4, 32, 36, torch.bfloat16, pending=True, blocks=("Q4_K", "Q5_0"))
    check_hc_mix(R, 64, 4, 64, 68, torch.bfloat16, pending=False, blocks=("Q8_0", "Q8_0"), planes=False)
    check_hc_mix(R, 64, 4, 96, 100, torch.bfloat16, pending=True, blocks=("Q8_0", "Q8_0"))  # 3 of 4 blocks
    check_hc_mix(R, 64, 3, 160, 163, torch.float16, pending=False, blocks=("Q4_0", "Q4_0"))  # 5 of 8
    check_hc_mix(R, 64, 4, 256, 256, torch.float16, pending=True, blocks=("Q5_K", "Q6_K"))
    check_hc_mix(R, 64, 4, 32, 36, torch.bfloat16, pending=True, M=3, blocks=("Q8_0", None))  # several rows


def route_checks(R: Runner, small: bool) -> None:
    """Routing: the real 512 experts top-10 for a decode and a verify step, then odd sizes."""
    if small:
        check_route(R, 3, 64, 4, torch.float32)
        check_route(R, 2, 50, 3, torch.bfloat16)
        check_route(R, 3, 60, 7, torch.bfloat16, shared=True)
        check_route_ties(R, 64, 6)
        return
    check_route(R, 1, 512, 10, torch.bfloat16, timed=True)
    check_route(R, 6, 512, 10, torch.bfloat16, timed=True)
    check_route(R, 1, 512, 10, torch.bfloat16, shared=True)
    check_route(R, 6, 512, 10, torch.bfloat16, shared=True)
    check_route(R, 64, 512, 10, torch.float32)
    check_route(R, 5, 300, 7, torch.float16)
    check_route_ties(R, 512, 10)


def dequant_checks(R: Runner, small: bool) -> None:
    """KV dequantisation: a 4,608-cell bucket of the real geometry (2 kv heads of 256), then other dtypes/shapes."""
    if small:
        check_dequant(R, 40, 2, 64, torch.bfloat16)
        check_dequant(R, 33, 3, 32, torch.float32)
        return
    check_dequant(R, 4608, 2, 256, torch.bfloat16, timed=True)
    check_dequant(R, 4609, 2, 256, torch.float16)
    check_dequant(R, 4608, 2, 256, torch.float32)


def top_blocks_checks(R: Runner, small: bool) -> None:
    """The indexer's block choice: 512 of 1,152 blocks (4,608 cells, r=4) for a decode and a verify step, then ties,
    fewer visible blocks than n_top, and the 32K-context row."""
    if small:
        check_top_blocks(R, 3, 100, 20, 90)
        check_top_blocks(R, 2, 64, 30, 20)
        check_top_blocks(R, 4, 50, 10, 50, ties=True)
        return
    check_top_blocks(R, 1, 1152, 512, 1100, timed=True)
    check_top_blocks(R, 6, 1152, 512, 1100, timed=True)
    check_top_blocks(R, 6, 1152, 512, 400)
    check_top_blocks(R, 6, 1152, 512, 1100, ties=True)
    check_top_blocks(R, 2, 8192, 512, 8000, timed=True)


def argmax_checks(R: Runner, small: bool) -> None:
    """Greedy token choice over the vocabulary: a draft step (1 row) and MTP5's verify (6 rows), then ties."""
    if small:
        check_argmax(R, 3, 5000, torch.bfloat16, chunk=512)
        check_argmax(R, 4, 3001, torch.float32, ties=True, chunk=256)
        check_argmax(R, 2, 7, torch.float16, ties=True, chunk=16)
        return
    check_argmax(R, 1, 248320, torch.bfloat16, timed=True)
    check_argmax(R, 6, 248320, torch.bfloat16, timed=True)
    check_argmax(R, 6, 248320, torch.bfloat16, ties=True)
    check_argmax(R, 4, 248321, torch.float32, ties=True)


CHECKS: dict[str, Callable[[Runner, bool], None]] = {
    "conv_snapshot": conv_snapshot_checks, "gdn": gdn_checks, "gdn_conv": gdn_conv_checks, "pooled": pooled_checks,
    "sparse_attention": sparse_attention_checks, "kv_write": kv_write_checks,
    "masked_attention": masked_attention_checks, "q4": q4_checks, "moe": moe_checks, "gemv": gemv_checks,
    "hc_mix": hc_mix_checks, "route": route_checks, "dequant": dequant_checks, "top_blocks": top_blocks_checks,
    "argmax": argmax_checks, "row_independence": check_row_independence, "gdn_seqs": gdn_seqs_checks,
    "attention_seqs": attention_seqs_checks,
}


def run_group(R: Runner, name: str, small: bool) -> list[Row]:
    """The rows of check group `name` (small: the interpreter's shapes); an exception becomes a failed row that
    carries its traceback, so one broken kernel does not hide the others' results."""
    start = len(R.log)
    torch.manual_seed(0)
    try:
        CHECKS[name](R, small)
    except Exception:  # a kernel that fails to compile or launch fails its own group only
        R.add(Row(f"{name}: raised", False, traceback.format_exc(limit=8)))
    return R.log[start:]


# the sweeps a full run (no --no-sweep) adds after their check group
DEFAULT_SWEEPS = {"gdn_block_sweep": "gdn", "moe_config_sweep": "moe", "hc_out_sweep": "hc_mix"}


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(title: str, rows: list[Row]) -> None:
    if not rows:
        return
    print(f"\n{title}")
    head = (f"{'kernel':<58} | {'check':<5} | {'torch us':>9} | {'triton us':>9} | {'speedup':>7} | {'GB/s':>7} | "
            f"{'% 4.2TB/s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        speed = r.torch_us / r.triton_us if r.torch_us and r.triton_us else None
        gbs = r.nbytes / (r.triton_us * 1e3) if r.nbytes and r.triton_us else None
        pct = 100 * gbs / PEAK_GBS if gbs else None
        check = "ok" if r.ok else ("info" if r.info else "FAIL")
        print(f"{r.name:<58} | {check:<5} | {fmt(r.torch_us):>9} | {fmt(r.triton_us):>9} | "
              f"{fmt(speed, '.2f'):>7} | {fmt(gbs, '.0f'):>7} | {fmt(pct, '.1f'):>9}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, as the qspec command reports a bad option
        print(f"qspec: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from qspec.bench.kernel_sweeps import SWEEPS

    ap = _Parser(prog="python -m qspec.bench.kernels", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter (TRITON_INTERPRET=1 in the "
                    "environment), small shapes, no timing")
    ap.add_argument("--only", metavar="GROUPS", help=f"comma-separated check groups: {', '.join(CHECKS)}")
    ap.add_argument("--json", metavar="FILE", help="write every row (group, name, ok, info, detail, times) as JSON")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block-size variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager launches")
    ap.add_argument("--pdl", action="store_true", help="launch every kernel with programmatic dependent launch "
                    "(Hopper): the checks then cover the PDL variants, and graph timings show what it saves")
    ap.add_argument("--shapes", metavar="NAME", help="the gemv and few-rows sweeps: only shapes whose name has NAME")
    for name, (_, help_) in SWEEPS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=f"only this sweep: {help_}")
    args = ap.parse_args(argv)
    groups = [] if args.only is None else [g for g in args.only.split(",") if g]
    unknown = [g for g in groups if g not in CHECKS]
    if unknown or (args.only is not None and not groups):
        ap.error(f"--only: unknown group(s) {', '.join(unknown) or repr(args.only)}; groups: {', '.join(CHECKS)}")
    args.groups = groups or list(CHECKS)
    args.sweeps = [name for name in SWEEPS if getattr(args, name)]
    if args.shapes is not None and not {"gemv_sweep", "few_sweep"} & set(args.sweeps):
        ap.error("--shapes selects the shapes of --gemv-sweep and --few-sweep; give one of them")
    if args.shapes is not None and not any(args.shapes in name for name, _, _ in GEMV_SHAPES):
        ap.error(f"--shapes {args.shapes!r} matches none of: {', '.join(name for name, _, _ in GEMV_SHAPES)}")
    if args.interpret and not INTERPRET:
        ap.error("--interpret needs TRITON_INTERPRET=1 in the environment (Triton reads it when a kernel is defined)")
    if args.interpret and args.sweeps:
        ap.error("the sweeps time compiled kernels: they need CUDA, not --interpret")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not HAS_TRITON:
        print("qspec: error: triton is not installed", file=sys.stderr)
        return 2
    if not args.interpret and not torch.cuda.is_available():
        print("qspec: error: no CUDA device (TRITON_INTERPRET=1 ... --interpret runs the checks on the CPU)",
              file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 references must be real f32
    torch.backends.cudnn.allow_tf32 = False
    dev = "cpu" if args.interpret else "cuda"
    R = Runner(dev, timing=not args.interpret, graph=args.graph and not args.interpret)
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, device "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (interpreter)'}; "
          f"dispatch picks triton here: {use_triton(torch.empty(0, device=dev))}; PDL "
          f"{'on' if args.pdl and pdl_on(torch.empty(0, device=dev)) else 'off'}", flush=True)
    with pdl_mode(args.pdl):
        return _run(args, R)


def _run(args: argparse.Namespace, R: Runner) -> int:
    from qspec.bench.kernel_sweeps import SWEEPS, run_sweep

    by_group: dict[str, list[Row]] = {}
    if args.sweeps:
        for name in args.sweeps:
            run_sweep(R, name, args.shapes)
    else:
        for name in args.groups:
            by_group[name] = run_group(R, name, small=args.interpret)
        if not (args.interpret or args.no_sweep):
            for name, group in DEFAULT_SWEEPS.items():
                if group in args.groups and name in SWEEPS:
                    run_sweep(R, name, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({g: [asdict(r) for r in rows] for g, rows in by_group.items()}, f, indent=1)
    if R.graph:
        print(f"\ntimes are CUDA-graph replays; {R.eager_fallbacks} timed calls could not be captured and ran eagerly")
    print_table("kernels", R.rows)
    print_table("variants (block sizes and sweeps)", R.variants)
    bad = [r.name for r in R.rows + R.variants if not r.ok and not r.info]
    differ = [r.name for r in R.rows if not r.ok and r.info]
    print(f"\n{len(R.rows) + len(R.variants) - len(bad) - len(differ)} checks passed, {len(bad)} failed"
          + (": " + "; ".join(bad) if bad else "")
          + (f"; row independence does not hold for: {'; '.join(differ)}" if differ else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
