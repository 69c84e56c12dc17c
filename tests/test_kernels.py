"""Kernel references against independent implementations (CPU), the Triton kernels through Triton's interpreter,
and, where CUDA is present, the compiled Triton paths against their references."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots
from qspec.kernels.dequant import dequant_q8_0_torch
from qspec.kernels.gdn_recurrent import gdn_recurrent_torch
from qspec.kernels.moe_few import moe_few, moe_few_torch, moe_slots, sum_slots
from qspec.kernels.pooled import materialize_pooled_fast, materialize_pooled_torch
from qspec.kernels.q4 import Q4Weight, q4_matvec, q4_matvec_torch, q4_q8_matvec_torch, quantize_q8_torch
from qspec.kernels.route import route_top_k, route_top_k_torch
from qspec.kernels.sparse_attention import sparse_attention, sparse_attention_torch
from qspec.kernels.triton_common import HAS_TRITON
from qspec.kernels.triton_conv_snapshot import conv_snapshot, conv_snapshot_torch
from qspec.kernels.triton_gdn import gdn_recurrent_planes, gdn_recurrent_planes_torch
from qspec.model.model import Model
from qspec.model.moe import MoE, grouped_moe_reference
from qspec.model.ops import rope_tables
from qspec.model.qsa import PooledUpdate, materialize_pooled
from qspec.state.indexer_cache import IndexerCache
from qspec.state.kv_cache import quantize_q8_0
from qspec.weights.dequant import dequantize, quantize_q4_0
from qspec.weights.qweight import QuantWeight

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available() and HAS_TRITON


def random_bits(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """f32 tensors of random 32-bit patterns: NaN payloads, denormals, infinities and -0 included."""
    return torch.randint(-2 ** 31, 2 ** 31, shape, generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---- conv snapshots (Algorithms 4-5) ---------------------------------------------------------------------------

SNAPSHOT_SHAPES = sorted({(s, n, k) for s in (3, 9) for n in range(1, 17 - s if s == 9 else 9)
                          for k in (1, min(2, n), n)} | {(8, 8, 8), (1, 1, 1), (15, 1, 1), (12, 4, 3)})


@pytest.mark.parametrize("s,n,k", SNAPSHOT_SHAPES)
def test_snapshot_fused_equals_ordinary(s: int, n: int, k: int) -> None:
    """write_snapshots: fused and ordinary paths write bit-identical X and planes; conv_snapshot matches both."""
    g = torch.Generator().manual_seed(100 * s + 10 * n + k)
    C, n_slots = 37, 8
    S = random_bits((C, s + 2), g)[:, 1:1 + s]  # a strided view
    T = random_bits((n, C), g)
    planes = random_bits((2 * n_slots, C, s), g)
    base = torch.tensor(n_slots)
    outs = []
    for fused in (False, True):
        p = planes.clone()
        st = SnapshotStats()
        X = write_snapshots(S, T, p, base, n_slots, k, False, fused, st)
        outs.append((X, p, st))
    (X0, p0, st0), (X1, p1, st1) = outs
    assert same_bits(X0, X1) and same_bits(p0, p1)
    assert st1.fused == (1 if k >= 2 else 0)
    assert sum(st1.fallbacks.values()) == (0 if k >= 2 else 1)
    for dest in (base, base + torch.arange(k)):
        p2 = planes.clone()
        X2 = conv_snapshot(S, T, p2, dest, k)
        assert same_bits(X2, X0) and same_bits(p2, p0)
    # the state read from a plane chosen on the device (S = planes[live], live in the other half)
    p3 = planes.clone()
    p3[1, :, :] = S
    X3 = conv_snapshot(p3, T, p3, base, k, live=torch.tensor(1))
    expect = p0.clone()
    expect[1] = S
    assert same_bits(X3, X0) and same_bits(p3, expect)
    # the windows themselves, against plain slicing of the concatenation
    X_ref = torch.cat([S, T.t()], dim=1)
    assert same_bits(X0, X_ref)
    for j in range(k):
        assert same_bits(p0[n_slots + j], X_ref[:, j + 1:j + 1 + s])
    untouched = [i for i in range(2 * n_slots) if not n_slots <= i < n_slots + k]
    assert same_bits(p0[untouched], planes[untouched])


@pytest.mark.parametrize("s,n,reason", [(9, 8, "shape s=9 n=8"), (3, 9, "shape s=3 n=9"), (16, 1, "shape s=16 n=1")])
def test_snapshot_ineligible_shapes_fall_back(s: int, n: int, reason: str) -> None:
    g = torch.Generator().manual_seed(s * n)
    C = 11
    S, T = random_bits((C, s), g), random_bits((n, C), g)
    planes = random_bits((2 * n + 2, C, s), g)
    base = torch.tensor(n + 1)
    st = SnapshotStats()
    p_fused, p_plain = planes.clone(), planes.clone()
    X = write_snapshots(S, T, p_fused, base, n + 1, min(n, 3), False, True, st)
    X_plain = write_snapshots(S, T, p_plain, base, n + 1, min(n, 3), False, False, None)
    assert st.fallbacks == {reason: 1} and st.fused == 0 and st.ordinary == 1
    assert same_bits(X, X_plain) and same_bits(p_fused, p_plain)
    # the dispatch takes the torch path for such shapes and still writes the same windows
    p_disp = planes.clone()
    assert same_bits(conv_snapshot(S, T, p_disp, base, min(n, 3)), X_plain) and same_bits(p_disp, p_plain)


def test_snapshot_non_f32_falls_back() -> None:
    st = SnapshotStats()
    S, T = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    planes = torch.zeros(8, 5, 3, dtype=torch.float64)
    write_snapshots(S, T, planes, torch.tensor(4), 4, 4, False, True, st)
    assert st.fallbacks == {"not f32": 1}


def test_snapshot_bad_window_count() -> None:
    S, T, planes = torch.zeros(4, 3), torch.zeros(2, 4), torch.zeros(6, 4, 3)
    with pytest.raises(ValueError):
        conv_snapshot_torch(S, T, planes, torch.tensor(3), 3)  # k > n
    with pytest.raises(ValueError):
        conv_snapshot_torch(S, T, planes, torch.tensor(3))  # a base plane needs k


# ---- gated delta rule ------------------------------------------------------------------------------------------

def gdn_inputs(T: int, Hq: int, Hv: int, dk: int, dv: int, P: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, Hq, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(T, Hq, dk, generator=g), dim=-1)
    v = torch.randn(T, Hv, dv, generator=g)
    gate = -2 * torch.rand(T, Hv, generator=g)
    beta = torch.rand(T, Hv, generator=g)
    ssm = 0.1 * torch.randn(P, Hv, dk, dv, generator=g)
    return q, k, v, gate, beta, ssm


def gdn_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S0: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per head and token, in f64 with matrix products: the delta rule as written in the paper."""
    T, Hv = v.shape[:2]
    Hq = q.shape[1]
    S = S0.double().clone()
    o = torch.zeros(v.shape, dtype=torch.float64)
    states = []
    for t in range(T):
        for h in range(Hv):
            kt, qt = k[t, h % Hq].double(), q[t, h % Hq].double()
            S[h] = math.exp(g[t, h].item()) * S[h]
            u = beta[t, h].double() * (v[t, h].double() - S[h].t() @ kt)
            S[h] = S[h] + torch.outer(kt, u)
            o[t, h] = S[h].t() @ qt
        states.append(S.clone())
    return o, states


@pytest.mark.parametrize("T,Hq,Hv,dk,dv", [(6, 4, 4, 16, 16), (3, 2, 6, 8, 12), (1, 1, 2, 16, 8), (16, 2, 4, 8, 8)])
def test_gdn_planes_reference(T: int, Hq: int, Hv: int, dk: int, dv: int) -> None:
    n_slots = max(T, 2)
    P = 2 * n_slots
    q, k, v, g, beta, ssm = gdn_inputs(T, Hq, Hv, dk, dv, P, seed=T * 7 + Hv)
    live, base = torch.tensor(n_slots - 1), torch.tensor(n_slots)
    work = ssm.clone()
    o = gdn_recurrent_planes(q, k, v, g, beta, work, live, base)
    o_ref, states = gdn_simple(q, k, v, g, beta, ssm[n_slots - 1])
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-6)
    for t in range(T):
        torch.testing.assert_close(work[n_slots + t].double(), states[t], rtol=1e-5, atol=1e-6)
    assert torch.equal(work[:n_slots], ssm[:n_slots])  # the live half is untouched
    # the pre-expanded form (what gdn.py passes today) gives identical bits
    if Hv != Hq:
        work2 = ssm.clone()
        rep = Hv // Hq
        o2 = gdn_recurrent_planes_torch(q.repeat(1, rep, 1), k.repeat(1, rep, 1), v, g, beta, work2, live, base)
        assert torch.equal(o2, o) and torch.equal(work2, work)


@pytest.mark.parametrize("T,Hq,Hv", [(20, 2, 4), (1, 4, 4)])
def test_gdn_final_only_writes_the_last_state_alone(T: int, Hq: int, Hv: int) -> None:
    """A prompt's rows (more than the planes): the outputs of every row and the state after the last, in plane
    base, the other planes untouched."""
    q, k, v, g, beta, ssm = gdn_inputs(T, Hq, Hv, 8, 8, 4, seed=T + Hq)
    live, base = torch.tensor(1), torch.tensor(2)
    work = ssm.clone()
    o = gdn_recurrent_planes(q, k, v, g, beta, work, live, base, final_only=True)
    o_ref, states = gdn_simple(q, k, v, g, beta, ssm[1])
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(work[2].double(), states[-1], rtol=1e-5, atol=1e-6)
    keep = [0, 1, 3]
    assert torch.equal(work[keep], ssm[keep])
    if T > ssm.shape[0]:  # without final_only every row needs its plane
        with pytest.raises(ValueError, match="rows do not fit"):
            gdn_recurrent_planes(q, k, v, g, beta, ssm.clone(), live, base)


def test_gdn_planes_matches_model_path() -> None:
    """The reference is what GatedDeltaNet.recur does for a short step."""
    q, k, v, g, beta, ssm = gdn_inputs(4, 4, 4, 16, 16, 8, seed=3)
    live, base = torch.tensor(2), torch.tensor(4)
    o_model, states = gdn_recurrent_torch(q, k, v, g, beta, ssm[2], keep_states=True)
    work = ssm.clone()
    o = gdn_recurrent_planes_torch(q, k, v, g, beta, work, live, base)
    assert torch.equal(o, o_model) and torch.equal(work[4:8], states)


# ---- pooled indexer keys ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,rope,r,C", [(16, 8, 4, 8), (128, 64, 4, 8), (96, 32, 3, 5), (32, 32, 4, 16)])
def test_pooled_twin_equals_materialize_pooled(dtype: torch.dtype, d: int, rope: int, r: int, C: int) -> None:
    g = torch.Generator().manual_seed(d + rope + r + C)
    cap = 64 * r
    idx = IndexerCache(cap, r, d, dtype=dtype, device="cpu")
    idx.raw.copy_(torch.randn(cap, d, generator=g))
    idx.pooled.copy_(torch.randn(idx.pooled.shape, generator=g))
    blocks = torch.randperm(idx.n_blocks, generator=g)[:C]
    dest = torch.randperm(idx.n_blocks + 1, generator=g)[:C]  # distinct, the dump row included
    upd = PooledUpdate(blocks[:, None] * r + torch.arange(r), blocks * r, dest)
    gamma = 1 + 0.1 * torch.randn(d, generator=g)
    cos, sin = rope_tables(upd.start, rope, 1e6, dtype)
    before = idx.pooled.clone()
    twin = idx.pooled.clone()
    materialize_pooled(idx, upd, gamma, 1e-6, cos, sin)
    materialize_pooled_torch(idx.raw, upd.cells, upd.dest, gamma, 1e-6, cos, sin, twin)
    assert torch.equal(twin, idx.pooled)
    fast = before.clone()
    materialize_pooled_fast(idx.raw, upd.cells, upd.dest, gamma, 1e-6, cos, sin, fast)
    assert torch.equal(fast, idx.pooled)
    # independently, row by row in f64 (rounding to the cache dtype where the model rounds)
    for u in range(C):
        x = idx.raw[upd.cells[u]].double().mean(0).to(dtype).double()
        z = (x / (x.pow(2).mean() + 1e-6).sqrt() * gamma.double()).to(dtype).double()
        h = rope // 2
        c, s = cos[u].double(), sin[u].double()
        rot = torch.cat([-z[h:rope], z[:h]])
        ref = torch.cat([z[:rope] * c + rot * s, z[rope:]])
        tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
        torch.testing.assert_close(idx.pooled[upd.dest[u]].double(), ref, rtol=tol, atol=tol)
    untouched = torch.ones(idx.n_blocks + 1, dtype=torch.bool)
    untouched[upd.dest] = False
    assert torch.equal(idx.pooled[untouched], before[untouched])


# ---- Q4 head ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K", [(7, 32), (33, 96), (64, 256)])
def test_q4_reference(N: int, K: int) -> None:
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    W = Q4Weight.from_dense(w)
    assert W.packed.dtype == torch.uint8 and W.packed.shape == (N, K // 2)
    assert W.scales.dtype == torch.float16 and W.scales.shape == (N, K // 32)
    raw = quantize_q4_0(w)
    deq = dequantize(raw.reshape(-1), GGMLQuantizationType.Q4_0, (N, K))
    assert torch.equal(W.dequantize(), deq)
    assert torch.equal(Q4Weight.from_ggml(raw.reshape(-1), (N, K)).packed, W.packed)
    # ggml's nibble order (byte i of a block: element i low, element i + 16 high), read off by hand
    qs = W.packed.view(N, K // 32, 16).long()
    by_hand = torch.stack([qs & 15, qs >> 4], 2).reshape(N, K // 32, 32).float() - 8
    assert torch.equal(by_hand * W.scales.float()[..., None], deq.view(N, K // 32, 32))
    for M, dt in ((1, torch.float32), (5, torch.float32), (3, torch.bfloat16)):
        x = torch.randn(M, K, generator=g).to(dt)
        ref = (x.float() @ deq.t()).to(dt)
        assert torch.equal(q4_matvec_torch(x, W), ref)
        assert torch.equal(q4_matvec(x, W), ref)
    x3 = torch.randn(2, 3, K, generator=g)
    assert torch.equal(q4_matvec(x3, W), (x3 @ deq.t()))


def test_q4_q8_reference() -> None:
    """The CUDA kernel's reference (x quantized to int8 blocks, integer block dots, the -8 offset through the
    block sums) equals the plain product of the dequantized weights with the dequantized x."""
    g = torch.Generator().manual_seed(3)
    N, K = 37, 128
    W = Q4Weight.from_dense(torch.randn(N, K, generator=g))
    x = torch.randn(4, K, generator=g)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, q 0
    x[2, 5] = 1e3  # one large value: the rest of its block rounds to few levels
    q, d, sums = quantize_q8_torch(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(sums, q.view(4, K // 32, 32).sum(-1).int())
    assert torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8)) and d[1, 1] == 0
    xq = q.float().view(4, K // 32, 32) * d[..., None]
    assert ((xq.view(4, K) - x).abs() <= d.repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all()  # rounding to nearest
    ref = xq.view(4, K).double() @ W.dequantize(torch.float64).t()
    got = q4_q8_matvec_torch(x, W)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # int8 x moves the product by a fraction of a percent here (the first three rows: no outlier)
    exact = q4_matvec_torch(x, W)
    assert 0 < (got[:2] - exact[:2]).abs().max() <= 2e-2 * exact[:2].abs().max()


# ---- MoE for a few tokens --------------------------------------------------------------------------------------

def tiny_moe(dtype: torch.dtype, E: int = 8, D: int = 32, Fd: int = 24, k: int = 3, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    b = "blk.0"
    w = {f"{b}.ffn_gate_inp.weight": torch.randn(E, D, generator=g) / D ** 0.5,
         f"{b}.ffn_gate_exps.weight": torch.randn(E, Fd, D, generator=g) / D ** 0.5,
         f"{b}.ffn_up_exps.weight": torch.randn(E, Fd, D, generator=g) / D ** 0.5,
         f"{b}.ffn_down_exps.weight": torch.randn(E, D, Fd, generator=g) / Fd ** 0.5,
         f"{b}.ffn_gate_inp_shexp.weight": torch.randn(D, generator=g),
         f"{b}.ffn_gate_shexp.weight": torch.randn(Fd, D, generator=g),
         f"{b}.ffn_up_shexp.weight": torch.randn(Fd, D, generator=g),
         f"{b}.ffn_down_shexp.weight": torch.randn(D, Fd, generator=g)}
    return MoE({n: t.to(dtype) for n, t in w.items()}, b, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_sorted_equals_one_expert_at_a_time(dtype: torch.dtype) -> None:
    """Prefill's grouped MoE (pairs sorted by expert on the device, one host sync) computes the products and the
    additions of the per-expert loop it replaced, bit for bit: same rows per expert, same order of addition."""
    moe = tiny_moe(dtype, E=16, k=4, seed=7)
    h = torch.randn(200, 32, generator=torch.Generator().manual_seed(8)).to(dtype)
    top_w, top_i = moe.route(h)
    has3 = (top_i == 3).any(1)
    top_i[:60, 0] = torch.where(has3[:60], top_i[:60, 0], 3)  # one expert far more popular (once per token still)
    unused = set(range(16)) - set(top_i.flatten().tolist())
    ref = grouped_moe_reference(h, top_w, top_i, moe.gate, moe.up, moe.down)
    got = moe._grouped(h, top_w, top_i)
    assert got.dtype == h.dtype and torch.equal(got, ref), (unused, (got.float() - ref.float()).abs().max())


def test_grouped_mm_prefill_experts_match_the_loop(tiny_model: Model) -> None:
    """grouped_mm_mode: bf16 prefill experts as three grouped GEMMs (torch._grouped_mm; on the CPU torch's loop over
    the groups) give the per-expert loop's result up to bf16 rounding; other dtypes keep the loop."""
    from qspec.model import moe as moe_mod

    moe = tiny_moe(torch.bfloat16, E=16, k=4, seed=9)
    h = torch.randn(120, 32, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    top_w, top_i = moe.route(h)
    top_i[:, 0] = torch.where((top_i == 15).any(1), top_i[:, 0], 15)  # expert 15 in every token, some experts idle
    loop = moe._grouped(h, top_w, top_i)
    with moe_mod.grouped_mm_mode(True):
        assert moe_mod._GROUPED_MM
        got = moe._grouped(h, top_w, top_i)
        f32 = tiny_moe(torch.float32, E=16, k=4, seed=9)
        assert torch.equal(f32._grouped(h.float(), top_w, top_i),
                           grouped_moe_reference(h.float(), top_w, top_i, f32.gate, f32.up, f32.down))
    assert not moe_mod._GROUPED_MM and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), loop.float(), rtol=2e-2, atol=2e-2)


def test_engine_grouped_mm_only_where_the_gpu_has_it(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's grouped_mm (on by default) switches the grouped GEMMs on for its requests only, and only on a
    device where torch has CUTLASS kernels for them (sm_90, sm_100): the CPU keeps the loop over the experts."""
    from qspec.engine import Engine, EngineHooks, EngineOptions
    from qspec.model import moe as moe_mod

    assert EngineOptions().grouped_mm and not moe_mod.grouped_mm_supported(torch.device("cpu"))

    def seen_in_rounds(**opts: bool) -> list[bool]:
        seen: list[bool] = []
        Engine(tiny_model, EngineOptions(draft=1, capacity=64, **opts),
               EngineHooks(after_round=lambda run, k: seen.append(moe_mod._GROUPED_MM))).generate([1, 2, 3], 3)
        assert seen and not moe_mod._GROUPED_MM
        return seen

    assert not any(seen_in_rounds())  # the CPU: off
    monkeypatch.setattr(moe_mod, "grouped_mm_supported", lambda dev: True)
    assert all(seen_in_rounds())
    assert not any(seen_in_rounds(grouped_mm=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 6, 16])
def test_moe_few_reference(dtype: torch.dtype, M: int) -> None:
    moe = tiny_moe(dtype, seed=M)
    h = torch.randn(M, 32, generator=torch.Generator().manual_seed(M)).to(dtype)
    top_w, top_i = moe.route(h)
    args = (h, top_i, top_w, moe.gate, moe.up, moe.down)
    out = moe_few_torch(*args)
    assert torch.equal(out, moe._per_token(h, top_w, top_i))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    slots = moe_slots(*args)  # the gathered batched products (the CPU path of the few-token step)
    assert slots.shape == (M, 3, 32)
    torch.testing.assert_close(sum_slots(slots).float(), out.float(), rtol=tol, atol=tol)
    assert torch.equal(moe_few(*args), sum_slots(slots))
    torch.testing.assert_close(out.float(), moe._grouped(h, top_w, top_i).float(), rtol=tol, atol=tol)
    # independently: the dense mixture over all experts with zero weight off the top-k
    dense = torch.zeros(M, 8, dtype=torch.float64)
    dense.scatter_(1, top_i, top_w.double())
    x = h.double()
    ys = torch.stack([(F.silu(x @ moe.gate[e].double().t()) * (x @ moe.up[e].double().t())) @ moe.down[e].double().t()
                      for e in range(8)], 1)  # [M, E, D]
    torch.testing.assert_close(out.double(), (dense[..., None] * ys).sum(1), rtol=tol, atol=tol)


def test_shared_expert_add_sums_slots() -> None:
    """The few-token step hands add_shared_expert the [T, k, D] slot outputs; it must equal adding their sum."""
    from qspec.model.moe import add_shared_expert

    moe = tiny_moe(torch.bfloat16, seed=4)
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    top_w, top_i = moe.route(h)
    slots = moe_slots(h, top_i, top_w, moe.gate, moe.up, moe.down)
    act, gate = torch.randn(5, 24).bfloat16(), torch.rand(5, 1).bfloat16()
    assert torch.equal(add_shared_expert(slots, act, gate, moe.sh_down),
                       add_shared_expert(sum_slots(slots), act, gate, moe.sh_down))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_top_k_reference(dtype: torch.dtype) -> None:
    """Routing equals an f64 softmax, a full sort and renormalisation; the dispatch rejects bad shapes."""
    g = torch.Generator().manual_seed(7)
    logits = torch.stack([torch.randperm(64, generator=g) * 0.1 - 3.2 for _ in range(5)]).to(dtype)  # no ties
    w, i = route_top_k_torch(logits, 6)
    p = torch.softmax(logits.double(), -1)
    order = p.argsort(-1, descending=True)[:, :6]
    assert torch.equal(i, order)
    top = p.gather(1, order)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(w.double(), top / top.sum(-1, keepdim=True), rtol=tol, atol=tol)
    assert w.dtype == dtype and i.dtype == torch.int64
    assert torch.equal(route_top_k(logits, 6)[1], i)
    for bad, k in ((logits, 0), (logits, 65), (logits[0], 2)):
        with pytest.raises(ValueError, match="routing needs"):
            route_top_k(bad, k)


# ---- step-sized matrix products ------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K,programs", [(20, 1000, 8), (640, 10240, 264), (248320, 2560, 264), (2560, 640, 264),
                                         (5, 100, 264), (1793, 2560, 264)])
def test_gemv_plan(N: int, K: int, programs: int) -> None:
    """Rows per program shrink before K splits; a split covers K exactly once in whole BK steps."""
    from qspec.kernels.triton_gemv import plan

    bn, bk, split, k_split = plan(N, K, 32, 8192, programs)
    assert bn & (bn - 1) == 0 and 1 <= bn <= 32 and bk * bn <= max(8192, 16 * bn)
    assert k_split % bk == 0 and (split - 1) * k_split < K <= split * k_split
    blocks = -(-N // bn)
    assert (bn == 32 or bn == 1 or blocks >= programs) and (split == 1) == (blocks >= programs or K <= bk)


@pytest.mark.parametrize("N,K,bn,bk,programs", [(2560, 6144, 64, 128, 132), (16480, 2560, 64, 128, 132),
                                                 (20, 1000, 16, 64, 32), (100, 96, 16, 256, 4)])
def test_gemm_few_plan(N: int, K: int, bn: int, bk: int, programs: int) -> None:
    """The few-rows kernel keeps its row tile and splits K only while there are fewer row blocks than programs; the
    shares cover K exactly once in whole BK steps (BK no wider than K's power of two)."""
    from qspec.kernels.triton_gemv import plan_k

    bk2, split, k_split = plan_k(N, K, bn, bk, programs)
    blocks = -(-N // bn)
    assert 16 <= bk2 <= bk and k_split % bk2 == 0 and (split - 1) * k_split < K <= split * k_split
    assert (split == 1) == (blocks >= programs or K <= bk2)
    assert split == 1 or blocks * (split - 1) < programs  # no more shares than it takes to fill the programs


def test_gemv_rejects_bad_shapes() -> None:
    """Both product kernels name the shapes they cannot take instead of launching."""
    pytest.importorskip("triton")
    from qspec.kernels.triton_gemv import gemm_few_triton, gemv_triton

    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    for x in (torch.zeros(9, 32, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16),
              torch.zeros(32, 2, dtype=torch.bfloat16).t()):
        for fn in (gemv_triton, gemm_few_triton):
            with pytest.raises(ValueError, match="gemv: x"):
                fn(x, w)


def test_gemv_switch() -> None:
    """enabled_mode turns the routing of eligible products off and restores it; CPU tensors never qualify."""
    from qspec.kernels import gemv

    x, w = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    before = gemv._ON
    with gemv.enabled_mode(False):
        assert gemv._ON is False
    assert gemv._ON == before
    assert not gemv.eligible(x, w, 1)
    with gemv.few_rows_everywhere():
        assert gemv._FEW_EVERYWHERE is True
        assert not gemv.eligible(x.expand(3, 8), w, 3)  # still CUDA only
    assert gemv._FEW_EVERYWHERE is False


def test_few_rows_pdl_shapes_need_pdl() -> None:
    """TUNED_FEW_PDL's shapes beat cuBLAS only with PDL launches: routed inside pdl_mode alone."""
    from qspec.kernels import gemv, triton_common
    from qspec.kernels.triton_gemv import TUNED_FEW, TUNED_FEW_PDL

    assert TUNED_FEW_PDL and not set(TUNED_FEW) & set(TUNED_FEW_PDL)
    shape = next(iter(TUNED_FEW_PDL))
    assert not gemv.few_rows_routed(shape) and gemv.few_rows_routed(next(iter(TUNED_FEW)))
    with triton_common.pdl_mode(True):
        assert gemv.few_rows_routed(shape)
    assert not gemv.few_rows_routed(shape) and not gemv.few_rows_routed((7, 8))


def test_gemv_op_traces() -> None:
    """qspec::gemv is one graph node with symbolic rows under torch.compile (as the fused steps use it)."""
    from qspec.kernels.gemv import gemv

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g).bfloat16()
    f = torch.compile(lambda x, w: gemv(x, w) * 2, backend="aot_eager", fullgraph=True, dynamic=True)
    for M in (1, 3, 6):
        x = torch.randn(M, 64, generator=g).bfloat16()
        assert torch.equal(f(x, w), F.linear(x, w) * 2)



# ---- the indexer's block choice and the KV cache's dequantisation ---------------------------------------------

def test_top_blocks_mask_reference() -> None:
    """The mask marks the n_top largest scores (a full sort's first n_top); the op checks its arguments and traces
    as one node with a symbolic n_top, as the compiled block_mask calls it."""
    from qspec.kernels.top_blocks import top_blocks_mask, top_blocks_mask_torch

    g = torch.Generator().manual_seed(11)
    s = torch.stack([torch.randperm(300, generator=g).float() for _ in range(4)])  # no ties
    s[:, 250:] = float("-inf")
    for n_top in (1, 64, 250):
        ref = torch.zeros(4, 300, dtype=torch.bool).scatter_(1, s.argsort(-1, descending=True)[:, :n_top], True)
        assert torch.equal(top_blocks_mask_torch(s, n_top), ref)
        assert torch.equal(top_blocks_mask(s, n_top), ref)
    f = torch.compile(lambda s, n: top_blocks_mask(s, n) & (s > 10), backend="aot_eager", fullgraph=True,
                      dynamic=True)
    for T, n_top in ((1, 30), (6, 40)):
        x = s[:T].contiguous()
        assert torch.equal(f(x, n_top), top_blocks_mask_torch(x, n_top) & (x > 10))
    for bad, n_top in ((s, -1), (s, 301), (s[0], 2)):
        with pytest.raises(ValueError, match="top_blocks_mask needs"):
            top_blocks_mask(bad, n_top)


def test_dequant_kv_reference() -> None:
    """q8_0 dequantisation: each value times its block's f16 scale, against ggml's own Q8_0 reader (gguf)."""
    from gguf.quants import dequantize as ggml_dequantize

    from qspec.kernels.dequant import dequant_kv

    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(7, 2, 64, generator=g), 4 * torch.randn(7, 2, 64, generator=g)
    (kq, ks), (vq, vs) = quantize_q8_0(k), quantize_q8_0(v)
    ko, vo = dequant_kv(kq, ks, vq, vs, torch.float32)
    for q, d, out in ((kq, ks, ko), (vq, vs, vo)):
        raw = torch.cat([d.unsqueeze(-1).view(torch.uint8), q.unflatten(-1, (-1, 32)).view(torch.uint8)], -1)
        ref = ggml_dequantize(raw.flatten().numpy(), GGMLQuantizationType.Q8_0).reshape(out.shape)
        assert torch.equal(out, torch.from_numpy(ref).float())
    assert dequant_kv(kq, ks, vq, vs, torch.bfloat16)[1].dtype == torch.bfloat16

# ---- sparse QSA attention ---------------------------------------------------------------------------------

def attention_inputs(T: int, H: int, Hkv: int, d: int, n: int, kv: str, g: torch.Generator
                     ) -> tuple[torch.Tensor, tuple, tuple[torch.Tensor, torch.Tensor]]:
    """q [T, H, d] f32; the cache (k, v, k_scale, v_scale) of n cells stored as `kv` (f32, bf16 or q8_0, scales None
    unless q8_0); and the keys and values it holds, in f64."""
    q = torch.randn(T, H, d, generator=g)
    kf, vf = torch.randn(n, Hkv, d, generator=g), torch.randn(n, Hkv, d, generator=g)
    if kv == "q8_0":
        (k, ks), (v, vs) = quantize_q8_0(kf), quantize_q8_0(vf)
        return q, (k, v, ks, vs), (dequant_q8_0_torch(k, ks, torch.float64), dequant_q8_0_torch(v, vs, torch.float64))
    dt = torch.float32 if kv == "f32" else torch.bfloat16
    k, v = kf.to(dt), vf.to(dt)
    return q, (k, v, None, None), (k.double(), v.double())


@pytest.mark.parametrize("kv", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("T", [1, 5])
def test_sparse_attention_reference(kv: str, T: int) -> None:
    """The reference equals softmax attention over the full cache with a mask built independently from the
    block ids and the tail (f64), including empty block slots and tails shorter than r."""
    g = torch.Generator().manual_seed(T)
    cap, H, Hkv, d, r, NB = 96, 6, 2, 64, 4, 5
    q, (k, v, ks, vs), (K, V) = attention_inputs(T, H, Hkv, d, cap, kv, g)
    pos = torch.arange(cap - 9 - T, cap - 9)
    nb_vis = (pos + 1) // r
    blocks = torch.stack([torch.randperm(int(nb_vis[t]), generator=g)[:NB] for t in range(T)])
    blocks[:, 1] = -1
    got = sparse_attention_torch(q, k, v, ks, vs, blocks, nb_vis * r, pos, r)
    mask = torch.zeros(T, cap, dtype=torch.bool)
    for t in range(T):
        for b in blocks[t].tolist():
            if b >= 0:
                mask[t, b * r:(b + 1) * r] = True
        mask[t, int(nb_vis[t]) * r:int(pos[t]) + 1] = True
    G = H // Hkv
    s = torch.einsum("thd,chd->thc", q.double(), K.repeat_interleave(G, 1)) * d ** -0.5
    p = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), -1)
    ref = torch.einsum("thc,chd->thd", p, V.repeat_interleave(G, 1))
    assert (got.double() - ref).abs().max().item() < 1e-5
    assert torch.equal(sparse_attention(q, k, v, ks, vs, blocks, nb_vis * r, pos, r), got)  # CPU dispatch


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_masked_attention_reference(kv: str) -> None:
    """The reference equals per-row, per-head softmax attention in f64 over exactly the mask's cells (loops, no
    masking trick); bad shapes are refused by name."""
    from qspec.kernels.masked_attention import masked_attention, masked_attention_torch

    g = torch.Generator().manual_seed(11)
    T, H, Hkv, d, n = 3, 6, 2, 64, 40
    q, (k, v, ks, vs), (K, V) = attention_inputs(T, H, Hkv, d, n, kv, g)
    mask = torch.rand(T, n, generator=g) < 0.4
    mask[:, 3] = True
    got = masked_attention_torch(q, k, v, ks, vs, mask)
    for t in range(T):
        cells = mask[t].nonzero().squeeze(1)
        for h in range(H):
            kh = h // (H // Hkv)
            p = torch.softmax(K[cells, kh] @ q[t, h].double() * d ** -0.5, 0)
            assert (got[t, h].double() - p @ V[cells, kh]).abs().max().item() < 1e-5
    assert torch.equal(masked_attention(q, k, v, ks, vs, mask), got)  # CPU dispatch
    with pytest.raises(ValueError, match="mask must be bool"):
        masked_attention(q, k, v, ks, vs, mask[:, :-1])
    with pytest.raises(ValueError, match="needs k/v"):
        masked_attention(q, k[:, :1].repeat(1, 4, 1), v, ks, vs, mask)


def test_masked_attention_plan_and_config() -> None:
    """The kernel's chunk plan covers every cell in whole steps, with fewer chunks when a program takes several rows;
    a config whose rows per program or step is not a power of two is refused by name."""
    pytest.importorskip("triton")
    from qspec.kernels.triton_masked_attention import masked_attention_triton, plan_chunks

    for T, rp, n, bn, target in ((1, 1, 4608, 32, 264), (6, 1, 4608, 32, 264), (6, 4, 4608, 64, 264),
                                 (5, 2, 70, 16, 8)):
        chunk, splits = plan_chunks(T, 2, n, bn, target, rp)
        assert chunk % bn == 0 and chunk * splits >= n > chunk * (splits - 1)
    assert plan_chunks(6, 2, 4608, 32, 264, 4)[1] > plan_chunks(6, 2, 4608, 32, 264, 1)[1]
    q, k, v = torch.zeros(2, 4, 32), torch.zeros(8, 2, 32), torch.zeros(8, 2, 32)
    for bad in ((3, 32, 4, 1, 264), (1, 24, 4, 1, 264), (0, 32, 4, 1, 264)):
        with pytest.raises(ValueError, match="powers of two"):
            masked_attention_triton(q, k, v, None, None, torch.ones(2, 8, dtype=torch.bool), config=bad)


def test_masked_attention_compiles_once_for_every_kv_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton compiles a kernel again when an integer argument changes its divisibility by 16 (or its being 1). A
    request that crosses into the next KV bucket changes the cell and chunk counts; at the real geometry (24/2 heads
    of 256, q8_0 cells, buckets of 512 from 512 to 8,192 cells), one row (decode, draft) and six (verify, extend), every
    argument the two kernels specialize on must keep its class, so the crossing compiles nothing. Before the partial
    results' buffers were sized by the most chunks, their stride changed class between 4,608 and 5,120 cells."""
    pytest.importorskip("triton")
    import qspec.kernels.triton_masked_attention as tma

    specialized = {name: [not p.do_not_specialize for p in getattr(tma, name).params]
                   for name in ("_masked_attn_kernel", "_combine_kernel")}
    calls: list[tuple[str, tuple, dict]] = []

    class Recorder:  # stands in for a kernel: records its arguments instead of launching
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
            return lambda *args, **kw: calls.append((self.name, args, kw))

    for name in specialized:
        monkeypatch.setattr(tma, name, Recorder(name))

    def key(name: str, args: tuple, kw: dict) -> tuple:
        ints = tuple((a % 16 == 0, a == 1) for a, s in zip(args, specialized[name], strict=False)
                     if s and isinstance(a, int) and not isinstance(a, bool))
        return name, ints, tuple(sorted((k, v) for k, v in kw.items() if k != "DT"))

    for T in (1, 6):
        keys = set()
        for n in range(512, 8193, 512):
            calls.clear()
            q = torch.empty(T, 24, 256, dtype=torch.bfloat16)
            k, v = torch.empty(n, 2, 256, dtype=torch.int8), torch.empty(n, 2, 256, dtype=torch.int8)
            ks, vs = torch.empty(n, 2, 8, dtype=torch.float16), torch.empty(n, 2, 8, dtype=torch.float16)
            tma.masked_attention_triton(q, k, v, ks, vs, torch.ones(T, n, dtype=torch.bool))
            assert [c[0] for c in calls] == ["_masked_attn_kernel", "_combine_kernel"]
            keys |= {key(*c) for c in calls}
        assert len(keys) == 2, (T, sorted(keys))


# ---- compiled Triton paths (CUDA only; tests/test_gpu_kernels.py covers them at the real geometry) ----------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_conv_snapshot() -> None:
    g = torch.Generator().manual_seed(1)
    for s, n, k in ((3, 6, 6), (9, 6, 6), (9, 7, 3)):
        S, T = random_bits((300, s), g).cuda(), random_bits((n, 300), g).cuda()
        planes = random_bits((16, 300, s), g).cuda()
        p_ref, p_tri = planes.clone(), planes.clone()
        X_ref = write_snapshots(S, T, p_ref, torch.tensor(8, device="cuda"), 8, k, False, True, None)
        X = conv_snapshot(S, T, p_tri, torch.tensor(8, device="cuda"), k)
        assert same_bits(X, X_ref) and same_bits(p_tri, p_ref)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_gdn() -> None:
    q, k, v, g, beta, ssm = (t.cuda() for t in gdn_inputs(6, 16, 48, 128, 128, 12, seed=5))
    live, base = torch.tensor(5, device="cuda"), torch.tensor(6, device="cuda")
    s_ref, s_tri = ssm.clone(), ssm.clone()
    o_ref = gdn_recurrent_planes_torch(q, k, v, g, beta, s_ref, live, base)
    o = gdn_recurrent_planes(q, k, v, g, beta, s_tri, live, base)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_pooled_q4_moe() -> None:
    dev = "cuda"
    raw = torch.randn(1024, 128, device=dev).bfloat16()
    blocks = torch.randperm(256, device=dev)[:8]
    cells = blocks[:, None] * 4 + torch.arange(4, device=dev)
    dest = torch.randperm(257, device=dev)[:8]
    gamma = 1 + 0.1 * torch.randn(128, device=dev)
    cos, sin = rope_tables(blocks * 4, 64, 1e7, torch.bfloat16)
    p_ref, p_tri = torch.zeros(257, 128, device=dev), torch.zeros(257, 128, device=dev)
    materialize_pooled_torch(raw, cells, dest, gamma, 1e-6, cos, sin, p_ref)
    materialize_pooled_fast(raw, cells, dest, gamma, 1e-6, cos, sin, p_tri)
    assert (p_tri - p_ref).abs().max() <= 8e-3 * p_ref.abs().max()

    W = Q4Weight.from_dense(0.02 * torch.randn(1000, 512, device=dev))
    x = torch.randn(3, 512, device=dev)
    torch.testing.assert_close(q4_matvec(x, W), q4_q8_matvec_torch(x, W), rtol=1e-5, atol=1e-5)

    moe = tiny_moe(torch.bfloat16, E=16, D=256, Fd=96, k=4)
    moe = MoE({n: getattr(moe, a).to(dev) for n, a in (
        ("blk.0.ffn_gate_inp.weight", "router"), ("blk.0.ffn_gate_exps.weight", "gate"),
        ("blk.0.ffn_up_exps.weight", "up"), ("blk.0.ffn_down_exps.weight", "down"),
        ("blk.0.ffn_gate_inp_shexp.weight", "sh_gate_inp"), ("blk.0.ffn_gate_shexp.weight", "sh_gate"),
        ("blk.0.ffn_up_shexp.weight", "sh_up"), ("blk.0.ffn_down_shexp.weight", "sh_down"))}, "blk.0", 4)
    h = torch.randn(6, 256, device=dev).bfloat16()
    top_w, top_i = moe.route(h)
    ref = moe_few_torch(h, top_i, top_w, moe.gate, moe.up, moe.down)
    out = moe_few(h, top_i, top_w, moe.gate, moe.up, moe.down)
    assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    # distinct bf16 logits (0.02 apart; random bf16 ones tie often enough to make the ids' order torch.topk's
    # unspecified one), each row in its own order; then a row of equal logits: equal weights go to the lower id
    grid = torch.linspace(-3, 3, 300, device=dev).bfloat16()
    logits = torch.stack([grid[torch.randperm(300, device=dev)] for _ in range(6)])
    assert all(len(torch.unique(r)) == 300 for r in logits)
    (w_ref, i_ref), (w, i) = route_top_k_torch(logits, 7), route_top_k(logits, 7)
    assert torch.equal(i, i_ref) and (w.float() - w_ref.float()).abs().max() <= 8e-3
    _, i = route_top_k(torch.zeros(1, 300, device=dev).bfloat16(), 7)
    assert i.tolist() == [list(range(7))]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_top_blocks_dequant() -> None:
    from qspec.kernels.dequant import dequant_kv
    from qspec.kernels.top_blocks import top_blocks_mask, top_blocks_mask_torch

    s = torch.relu(torch.randn(6, 1152, device="cuda"))
    s[:, 1100:] = float("-inf")
    assert torch.equal(top_blocks_mask(s, 512), top_blocks_mask_torch(s, 512))
    (kq, ks), (vq, vs) = quantize_q8_0(torch.randn(300, 2, 256, device="cuda")), \
        quantize_q8_0(torch.randn(300, 2, 256, device="cuda"))
    ko, vo = dequant_kv(kq, ks, vq, vs, torch.bfloat16)
    assert torch.equal(ko, dequant_q8_0_torch(kq, ks, torch.bfloat16))
    assert torch.equal(vo, dequant_q8_0_torch(vq, vs, torch.bfloat16))



# ---- one-row hyper-connection mixer --------------------------------------------------------------------------

def test_hc_mix_step_dispatch() -> None:
    """On the CPU (no interpreter) mix_step is the references composed; the kernels never take several rows (unless
    step_rows_mode allows them), f32, row-exact mode or a switched-off run (the kernels themselves:
    tests/test_gpu_kernels.py)."""
    from qspec.kernels import hc_mix
    from qspec.model import ops

    g = torch.Generator().manual_seed(3)
    S, D, R, N = 4, 32, 8, 12
    X, y, inj = torch.randn(1, S * D, generator=g), torch.randn(1, D, generator=g), torch.randn(1, S, generator=g)
    norm = 1 + 0.1 * torch.randn(S * D, generator=g)
    w_in, up = torch.randn(N, S * D, generator=g), torch.randn(S * D, R, generator=g)
    Xc, h, out = hc_mix.mix_step(X, (y, inj), norm, w_in, up, R, D, S, 1e-6)
    want_X = hc_mix.combine_torch(X, y, inj)
    want_h, want_y = hc_mix.mix_torch(want_X, norm, w_in, up, R, D, S, 1e-6)
    assert torch.equal(Xc, want_X) and torch.equal(h, want_h) and torch.equal(out, want_y)
    assert not hc_mix.step_eligible(X, w_in, up)  # f32 (and the CPU without the interpreter)
    Xb, wb, ub = X.bfloat16(), w_in.bfloat16(), up.bfloat16()
    with hc_mix.step_rows_mode(1):
        assert not hc_mix.step_eligible(torch.cat([Xb, Xb]), wb, ub)
    with ops.row_exact_mode(True):
        assert not hc_mix.step_eligible(Xb, wb, ub)
    with hc_mix.enabled_mode(False):
        assert not hc_mix.step_eligible(Xb, wb, ub)
    with hc_mix.step_rows_mode(2):  # the engine's mixer_step_rows inside the block, 1..8 rows
        assert hc_mix._STEP_ROWS == 2
    assert hc_mix._STEP_ROWS == 6
    with pytest.raises(ValueError, match="mixer step rows"), hc_mix.step_rows_mode(9):
        pass


def test_hc_mix_step_rows_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels available, the step takes 1.._STEP_ROWS rows and never 0: a prefill chunk that computes
    no logits sends an empty batch through the final mixer (the kernels reject it; it crashed a session 10 run)."""
    from qspec.kernels import hc_mix

    monkeypatch.setattr(hc_mix, "use_triton", lambda t: True)
    X, w_in, up = torch.randn(8, 4 * 32).bfloat16(), torch.randn(12, 4 * 32).bfloat16(), torch.randn(4 * 32, 8)
    up16 = up.bfloat16()
    with hc_mix.step_rows_mode(1):
        assert hc_mix.step_eligible(X[:1], w_in, up16)
        assert not hc_mix.step_eligible(X[:0], w_in, up16) and not hc_mix.step_eligible(X[:2], w_in, up16)
    with hc_mix.step_rows_mode(6):
        assert hc_mix.step_eligible(X[:6], w_in, up16) and not hc_mix.step_eligible(X[:0], w_in, up16)
        assert not hc_mix.step_eligible(X[:7], w_in, up16)
    # matrices of another float dtype are not the kernels'; GGUF blocks are (the w_in product is ops.linear's)
    assert not hc_mix.step_eligible(X[:1], w_in, up) and not hc_mix.step_eligible(X[:1], w_in.float(), up16)
    blocks = QuantWeight.from_blocks(quantize_q4_0(w_in.float()), GGMLQuantizationType.Q4_0, w_in.shape)
    assert hc_mix.step_eligible(X[:1], blocks, up16)


# ---- greedy token choice -----------------------------------------------------------------------------------------

def test_argmax_rows_dispatch() -> None:
    """On the CPU argmax_rows is torch's argmax (the kernels: tests/test_gpu_kernels.py, ties and NaN
    included); a tensor that is not a non-empty matrix is refused by name."""
    from qspec.kernels.argmax import argmax_rows

    x = torch.randn(3, 50)
    x[1, 4] = x[1, 9] = x[1].max() + 1  # a tie: the first index wins
    assert torch.equal(argmax_rows(x), x.argmax(-1)) and int(argmax_rows(x)[1]) == 4
    for bad in (torch.randn(5), torch.randn(2, 0), torch.randn(1, 2, 3)):
        with pytest.raises(ValueError, match="argmax_rows needs"):
            argmax_rows(bad)


# ---- q8_0 KV write ---------------------------------------------------------------------------------------------

def test_kv_write_q8_0_dispatch() -> None:
    """On the CPU write_q8_0 is the reference: each row's values and scales at its cell (the rows quantized as the
    cache's own quantize_q8_0), every other cell untouched; bad shapes are refused by name (the kernel:
    tests/test_gpu_kernels.py, bit-identical)."""
    from qspec.kernels.kv_write import quantize_q8_0_torch, write_q8_0

    g = torch.Generator().manual_seed(5)
    kq, vq = torch.zeros(10, 2, 64, dtype=torch.int8), torch.zeros(10, 2, 64, dtype=torch.int8)
    ks, vs = torch.zeros(10, 2, 2, dtype=torch.float16), torch.zeros(10, 2, 2, dtype=torch.float16)
    k, v, pos = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g), torch.tensor([7, 2, 4])
    write_q8_0(kq, vq, ks, vs, pos, k, v)
    for x, q, s in ((k, kq, ks), (v, vq, vs)):
        xq, xs = quantize_q8_0_torch(x)
        assert torch.equal(q[pos], xq) and torch.equal(s[pos], xs)
        assert torch.equal(dequant_q8_0_torch(q[pos], s[pos], torch.float32), dequant_q8_0_torch(xq, xs, torch.float32))
    others = torch.tensor([i for i in range(10) if i not in (7, 2, 4)])
    assert not kq[others].any() and not vs[others].any()
    # without the kernel (or where it does not apply) the write quantizes with the `quantize` it is given
    seen = []
    write_q8_0(kq, vq, ks, vs, pos, k, v, kernel=False, quantize=lambda x: seen.append(x) or quantize_q8_0_torch(x))
    assert len(seen) == 2 and seen[0] is k and seen[1] is v
    with pytest.raises(ValueError, match="rows k, v"):
        write_q8_0(kq, vq, ks, vs, pos[:2], k, v)
    with pytest.raises(ValueError, match="scales must be"):
        write_q8_0(kq, vq, ks[:, :, :1], vs, pos, k, v)


# ---- GDN step conv ---------------------------------------------------------------------------------------------

def test_gdn_conv_kernel_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GDN conv kernel runs only while switched on (the default), for f32 windows of the model's shape and not in
    row-exact mode; the layer's result on the CPU is the reference's (the kernel itself: tests/test_gpu_kernels.py)."""
    from qspec.kernels import gdn_conv
    from qspec.model import ops

    monkeypatch.setattr(gdn_conv, "use_triton", lambda t: True)
    Hk, Hv, d, T = 2, 4, 16, 3
    X, w = torch.randn((2 * Hk + Hv) * d, 3 + T), torch.randn((2 * Hk + Hv) * d, 4)
    assert gdn_conv.kernel_takes(X, w, T, Hk, Hv, d)  # on by default
    with gdn_conv.conv_kernel_mode(False):
        assert not gdn_conv.kernel_takes(X, w, T, Hk, Hv, d)
    with gdn_conv.conv_kernel_mode(True):
        assert gdn_conv.kernel_takes(X, w, T, Hk, Hv, d)
        assert not gdn_conv.kernel_takes(X.bfloat16(), w, T, Hk, Hv, d)
        assert not gdn_conv.kernel_takes(X[:, 1:], w, T, Hk, Hv, d)  # window one column short
        assert not gdn_conv.kernel_takes(X, w, T, Hk, Hv + 1, d)
        with ops.row_exact_mode(True):
            assert not gdn_conv.kernel_takes(X, w, T, Hk, Hv, d)
    assert gdn_conv.kernel_takes(X, w, T, Hk, Hv, d)
    q, k, v = gdn_conv.gdn_conv_qkv_torch(X, w, T, Hk, Hv, d)
    assert q.shape == k.shape == (T, Hk, d) and v.shape == (T, Hv, d)
    assert torch.allclose(k.norm(dim=-1), torch.ones(T, Hk), atol=1e-4)
    assert torch.allclose(q.norm(dim=-1), torch.full((T, Hk), d ** -0.5), atol=1e-4)


def test_engine_sets_the_mixer_rows_for_its_requests(tiny_model: Model) -> None:
    """The engine's mixer_step_rows applies to its requests only, and a value the kernels cannot take is refused."""
    from qspec.engine import Engine, EngineHooks, EngineOptions
    from qspec.kernels import hc_mix

    seen: list[int] = []
    Engine(tiny_model, EngineOptions(draft=2, capacity=64, mixer_step_rows=2),
           EngineHooks(after_round=lambda run, k: seen.append(hc_mix._STEP_ROWS))).generate([1, 2, 3, 4], 4)
    assert seen and set(seen) == {2} and hc_mix._STEP_ROWS == 6
    with pytest.raises(ValueError, match="mixer_step_rows must be in 1..8, got 0"):
        EngineOptions(draft=2, capacity=64, mixer_step_rows=0)


@pytest.mark.parametrize("given,kept", [(None, "1"), ("0", "0")])
def test_kernels_keep_fma_contraction_unless_the_user_says(given: str | None, kept: str) -> None:
    """Importing the kernels sets Triton's default FMA contraction on (3.10 turns it off by default), unless the
    environment already chose."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if given is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = given
    code = "import os, qspec.kernels.triton_common; print(os.environ['TRITON_DEFAULT_FP_FUSION'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == kept


@pytest.mark.parametrize("given", [None, "/tmp/qspec-users-triton-cache"])
def test_kernels_pin_tritons_cache_directory_before_torch_compile_moves_it(given: str | None) -> None:
    """Importing the kernels sets TRITON_CACHE_DIR to where Triton keeps its kernels (unless the user set it), so
    torch.compile's first kernel, which points it at its own directory when it is unset, leaves it where it was."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    if given is not None:
        env["TRITON_CACHE_DIR"] = given
    code = ("from triton import knobs; before = str(knobs.cache.dir); import qspec.kernels.triton_common; "
            "from torch._inductor.runtime.cache_dir_utils import triton_cache_dir; "
            "print(before, triton_cache_dir(0), knobs.cache.dir)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    before, inductors, after = out.split()
    assert inductors == after == before == (given or before)
