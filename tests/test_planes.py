"""Rows held in planes (weights/qweight.py: QuantWeight.planes) and the kernels that read them: Q6_K (the LM head)
and Q8_0 / Q5_0 / Q4_0 (every such matrix on CUDA but the token table, model.block_layouts).

A planes row holds the same bytes as the file's row, regrouped part by part (Q6_K: every block's ql, then qh,
scales, d; the 32-weight blocks: qs, Q5_0's qh, d), each plane padded to 16 bytes. For Q6_K the kernels decode the
same integers and scales from either layout and add them in the same order, so interpreted (`test_interpreted`, in a
subprocess) every product and expansion of a planes weight is the file-order weight's bit for bit; the 32-weight
blocks' int8 kernel adds a step's eight blocks in another order (f32 summation error). Compiled, the wider loads can
give the tensors another thread layout and with it another order of the cross-thread sums: the `cuda` tests hold the
products to the file order's within f32 summation error (bf16 outputs: one rounding) and the expansion, which sums
nothing, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_interp_tests
from gguf import GGMLQuantizationType

from qspec.kernels.qmatmul import INT8_MAX_ROWS_FEW, expand, int8_dot_mode, qmatmul, qmatmul_op
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.kernels.triton_qdot import HEAD_ROWS
from qspec.model.model import Model, block_layouts, head_layout
from qspec.weights.dequant import WeightsError
from qspec.weights.quantize import quantize
from qspec.weights.qweight import PLANES, Q6_K_PLANES, QuantWeight, row_bytes, weight_of

T = GGMLQuantizationType
CUDA = torch.cuda.is_available() and HAS_TRITON
interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


def q6k(n: int, k: int, seed: int, device: str = "cpu") -> QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    return QuantWeight.from_blocks(quantize(w.to(device), T.Q6_K), T.Q6_K, (n, k))


def test_planes_hold_the_same_bytes_regrouped() -> None:
    """Row bytes padded to 16; block kb's ql, qh, scales and d at their planes; back to the file's order exactly;
    the same values; rows, row selections and row concatenation keep the layout."""
    for k in (512, 768):  # 420 -> 432 and 630 -> 640 bytes a row
        w = q6k(9, k, seed=k)
        p = w.to_planes()
        nb = k // 256
        assert p.planes and p.code == Q6_K_PLANES and p.raw.shape == (9, row_bytes(T.Q6_K, k, True))
        assert p.raw.shape[1] % 16 == 0 and p.raw.shape[1] - nb * 210 < 16
        blk = w.raw.view(9, nb, 210)
        for kb in range(nb):
            assert torch.equal(p.raw[:, kb * 128:(kb + 1) * 128], blk[:, kb, :128])
            assert torch.equal(p.raw[:, nb * 128 + kb * 64:nb * 128 + (kb + 1) * 64], blk[:, kb, 128:192])
            assert torch.equal(p.raw[:, nb * 192 + kb * 16:nb * 192 + (kb + 1) * 16], blk[:, kb, 192:208])
            assert torch.equal(p.raw[:, nb * 208 + kb * 2:nb * 208 + (kb + 1) * 2], blk[:, kb, 208:210])
        assert not p.raw[:, nb * 210:].any()
        assert torch.equal(p.to_blocks().raw, w.raw) and p.to_planes() is p and w.to_blocks() is w
        assert torch.equal(p.dequantize(), w.dequantize())
        ids = torch.tensor([7, 0, 3])
        assert torch.equal(p.select_rows(ids).to_blocks().raw, w.raw[ids])
        assert torch.equal(p.rows(2, 5).to_blocks().raw, w.raw[2:5])
        both = QuantWeight.cat_rows([p.rows(0, 4), p.rows(4, 9)])
        assert both.planes and torch.equal(both.raw, p.raw)
        assert torch.equal(weight_of(p.raw, Q6_K_PLANES, k).dequantize(), w.dequantize())


def test_planes_errors_name_the_problem() -> None:
    w = q6k(4, 512, seed=1)
    q4 = QuantWeight.from_blocks(quantize(torch.randn(4, 512), T.Q4_K), T.Q4_K, (4, 512))
    with pytest.raises(WeightsError, match="only Q6_K, Q8_0, Q5_0, Q4_0 rows are held in planes, not Q4_K"):
        q4.to_planes()
    with pytest.raises(WeightsError, match="needs uint8 raw"):
        QuantWeight(w.raw, T.Q6_K, (4, 512), True)  # file-order bytes are not planes rows
    with pytest.raises(WeightsError, match="one type, layout and row length"):
        QuantWeight.cat_rows([w, w.to_planes()])


def test_only_a_cuda_q6k_head_of_its_own_goes_to_planes() -> None:
    w = q6k(4, 512, seed=2)
    assert head_layout(w, object()) is w  # on the CPU the products expand the file's blocks
    dense = torch.randn(4, 512)
    assert head_layout(dense, object()) is dense


def test_head_note_names_a_head_that_head_layout_put_in_planes() -> None:
    """The weights summary counts w's tensors, block_layouts' planes among them (a Q8_0 head too); head_note adds the
    head only where head_layout held it otherwise than w, naming its type."""
    from types import SimpleNamespace

    p = q6k(4, 512, seed=2).to_planes()
    assert Model.head_note(SimpleNamespace(_head_relaid=True, lm_head=p)) == (  # type: ignore[arg-type]
        "; LM head's Q6_K rows in planes (16-byte-aligned runs)")
    assert Model.head_note(SimpleNamespace(_head_relaid=False, lm_head=p)) == ""  # type: ignore[arg-type]


def test_cpu_products_of_planes_equal_the_file_order_ones() -> None:
    """On the CPU (no kernels) a planes weight's products and expansion are the file-order weight's."""
    w = q6k(6, 768, seed=3)
    p = w.to_planes()
    x = torch.randn(3, 768)
    assert torch.equal(qmatmul(x, p), qmatmul(x, w))
    assert torch.equal(expand(p, torch.float32), expand(w, torch.float32))


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


def _close_products(w: QuantWeight, p: QuantWeight, int8: bool, rows: tuple[int, ...]) -> None:
    """The products of w and its planes p agree within f32 summation error (bf16: plus one rounding of the output)."""
    for m in rows:
        for dt, tol in ((torch.bfloat16, 2.0 ** -8), (torch.float32, 1e-5)):
            x = torch.randn(m, w.shape[1], device=w.device).to(dt)
            with int8_dot_mode(int8):
                got = qmatmul_op(x, p.raw, Q6_K_PLANES, w.shape[0], w.shape[1]).float()
                want = qmatmul_op(x, w.raw, int(T.Q6_K), w.shape[0], w.shape[1]).float()
            assert (got - want).abs().max() <= tol * want.abs().max(), (m, dt, int8)


@interp
def test_interp_kernels_read_planes_as_the_file_order() -> None:
    """The int8 one-row kernel (the Q6_K head's 32-row config and the default), the tensor-core and f32 mat-vec
    kernels, the run expansion and the step-tile expansion: planes give the file order's bits."""
    from qspec.kernels.qdot import qdot_matmul_torch
    from qspec.kernels.triton_expand import expand_triton
    from qspec.kernels.triton_qdot import QDOT_CONFIG_Q6K_HEAD, qdot_matmul_triton
    from qspec.kernels.triton_qmatmul import dequant_triton, qmatvec_triton, qmm_triton

    for n, k in ((40, 768), (13, 512)):
        w = q6k(n, k, seed=n)
        p = w.to_planes()
        x = torch.randn(3, k)
        for cfg in (QDOT_CONFIG_Q6K_HEAD, None):
            got = qdot_matmul_triton(x, p.raw, Q6_K_PLANES, n, config=cfg)
            assert torch.equal(got, qdot_matmul_triton(x, w.raw, int(T.Q6_K), n, config=cfg))
            assert ((got - qdot_matmul_torch(x, w.raw, int(T.Q6_K), n, k)).abs().max() <= 1e-5 * got.abs().max())
        xb = x.bfloat16()
        assert torch.equal(qmm_triton(xb, p.raw, Q6_K_PLANES, n), qmm_triton(xb, w.raw, int(T.Q6_K), n))
        for m in (1, 2):
            assert torch.equal(qmatvec_triton(x[:m], p.raw, Q6_K_PLANES, n), qmatvec_triton(x[:m], w.raw, 14, n))
        ref = w.dequantize()
        assert torch.equal(expand_triton(p.raw, Q6_K_PLANES, k, torch.float32), ref)
        assert torch.equal(expand_triton(p.raw, Q6_K_PLANES, k, torch.bfloat16), ref.bfloat16())
        assert torch.equal(dequant_triton(p.raw, Q6_K_PLANES, k, torch.float32), ref)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_head_in_planes_gives_the_file_order_products() -> None:
    """The LM head's shape (248,320 x 2,560; random rows tiled), compiled: one row (int8 kernel, f32 mat-vec),
    2-6 rows (tensor cores), many rows (expansion) against the file order; head_layout makes the planes on CUDA."""
    n, k = 248320, 2560
    src = q6k(512, k, seed=5, device="cuda")
    w = QuantWeight(src.raw.repeat(n // 512, 1).contiguous(), T.Q6_K, (n, k))
    p = head_layout(w, object())
    assert p.planes and p.raw.shape == (n, 2112)
    _close_products(w, p, True, (1,))
    _close_products(w, p, False, (1, 2, 6, 40))
    assert torch.equal(expand(p, torch.bfloat16), expand(w, torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_q6k_planes_take_the_int8_kernel_up_to_their_row_limit() -> None:
    """bf16 rows of a Q6_K matrix in planes go to the int8 kernel (not the tensor cores) up to its limit: 8 rows for
    an LM head (HEAD_ROWS rows or more), INT8_MAX_ROWS_FEW for a dense matrix; every row of such a product is, bit for
    bit, its own one-row product."""
    k = 2560
    src = q6k(512, k, seed=7, device="cuda")
    x = torch.randn(8, k, device="cuda").bfloat16()
    for n, rows in ((HEAD_ROWS, (2, 6, 8)), (8192, tuple(range(2, INT8_MAX_ROWS_FEW + 1)))):
        p = QuantWeight(src.raw.repeat(n // 512, 1).contiguous(), T.Q6_K, (n, k)).to_planes()
        for m in rows:
            y = qmatmul(x[:m], p)
            for i in range(m):
                assert torch.equal(y[i:i + 1], qmatmul(x[i:i + 1], p)), (n, m, i)


# ---- 32-weight blocks (Q8_0, Q5_0, Q4_0) --------------------------------------------------------------------------

B32 = (T.Q8_0, T.Q5_0, T.Q4_0)
_PARTS = {T.Q8_0: ((2, 34), (0, 2)), T.Q5_0: ((6, 22), (2, 6), (0, 2)), T.Q4_0: ((2, 18), (0, 2))}


def b32(qt: T, n: int, k: int, seed: int, device: str = "cpu", experts: int = 0) -> QuantWeight:
    """Random rows of a 32-weight block type ([experts, n, k] when experts > 0)."""
    from gguf import quants as gq

    rows = n * max(experts, 1)
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    raw = torch.from_numpy(gq.quantize(w.numpy(), qt)) if qt == T.Q5_0 else quantize(w, qt)
    return QuantWeight.from_blocks(raw.to(device), qt, (experts, n, k) if experts else (n, k))


@pytest.mark.parametrize("qt", B32)
def test_b32_planes_hold_the_same_bytes_regrouped(qt: T) -> None:
    """Each plane (qs, Q5_0's qh, d) starts on 16 bytes and holds every block's part in block order; the padding is
    zero; back to the file's order exactly; rows, selections and concatenation keep the layout."""
    for k in (640, 352):
        w = b32(qt, 7, k, seed=k)
        p = w.to_planes()
        nb = k // 32
        size = _PARTS[qt][0][1] - _PARTS[qt][-1][0]
        assert p.planes and p.code == PLANES + int(qt) and p.raw.shape == (7, row_bytes(qt, k, True))
        blk = w.raw.view(7, nb, size)
        at = 0
        for lo, hi in _PARTS[qt]:
            plane = p.raw[:, at:at + nb * (hi - lo)].reshape(7, nb, hi - lo)
            assert torch.equal(plane, blk[:, :, lo:hi]), (qt, k, lo)
            pad = -(-nb * (hi - lo) // 16) * 16
            assert not p.raw[:, at + nb * (hi - lo):at + pad].any()
            at += pad
        assert at == p.raw.shape[1] and at % 16 == 0
        assert torch.equal(p.to_blocks().raw, w.raw) and torch.equal(p.dequantize(), w.dequantize())
        ids = torch.tensor([6, 0, 3])
        assert torch.equal(p.select_rows(ids).to_blocks().raw, w.raw[ids])
        assert torch.equal(QuantWeight.cat_rows([p.rows(0, 3), p.rows(3, 7)]).raw, p.raw)
        assert torch.equal(weight_of(p.raw, p.code, k).dequantize(), w.dequantize())


def test_block_layouts_leave_cpu_weights_in_the_files_order() -> None:
    w = {"token_embd.weight": b32(T.Q8_0, 4, 256, 1), "blk.0.ffn_down_exps.weight": b32(T.Q5_0, 4, 256, 2, experts=2)}
    before = dict(w)
    block_layouts(w)
    assert all(w[n] is before[n] for n in w)


def test_block_layouts_choose_the_32_weight_and_dense_q6_k_matrices(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (the weights' device faked here) every Q8_0 / Q5_0 / Q4_0 matrix goes to planes in place, experts
    included, and every dense Q6_K one; the token table and a head tied to it, a Q6_K head (head_layout's), the
    routed experts' and the shared expert's Q6_K (merged, moe.merge_shared_expert), other block types and 16-bit
    tensors stay; B32_PLANES and Q6K_PLANES off leave their types."""
    from qspec.model import model as model_mod

    monkeypatch.setattr(QuantWeight, "device", property(lambda self: torch.device("cuda")))
    embed = b32(T.Q8_0, 4, 256, 1)
    dense = torch.randn(4, 256)
    q6_experts = QuantWeight(torch.stack([q6k(4, 256, seed=4).raw] * 2), T.Q6_K, (2, 4, 256))

    def weights() -> dict[str, object]:
        return {"token_embd.weight": embed, "blk.0.attn_qkv.weight": b32(T.Q4_0, 4, 256, 3),
                "blk.0.ffn_down_exps.weight": b32(T.Q5_0, 4, 256, 2, experts=2),
                "blk.0.ffn_gate_exps.weight": q6_experts, "blk.0.ffn_gate_inp.weight": dense,
                "blk.0.attn_v.weight": q6k(4, 256, seed=5), "blk.0.ffn_gate_shexp.weight": q6k(4, 256, seed=6),
                "output.weight": q6k(4, 256, seed=7), "blk.0.attn_output.weight": b32(T.Q4_K, 4, 256, 8)}

    w = weights()
    before = dict(w)
    block_layouts(w)
    assert w["token_embd.weight"] is embed
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_shexp.weight",
                 "output.weight", "blk.0.attn_output.weight"):
        assert w[name] is before[name], name
    for name in ("blk.0.attn_qkv.weight", "blk.0.ffn_down_exps.weight", "blk.0.attn_v.weight"):
        assert w[name].planes and torch.equal(w[name].to_blocks().raw, before[name].raw), name
    w = dict(before, **{"output.weight": embed})
    block_layouts(w)
    assert w["output.weight"] is embed  # a head tied to the token table
    for flag, types in (("B32_PLANES", (T.Q8_0, T.Q5_0, T.Q4_0)), ("Q6K_PLANES", (T.Q6_K,))):
        with monkeypatch.context() as m:
            m.setattr(model_mod, flag, False)
            w = weights()
            before = dict(w)
            block_layouts(w)
            off = [n for n, t in before.items() if isinstance(t, QuantWeight) and t.qtype in types]
            assert off and all(w[n] is before[n] for n in off), flag
            assert any(w[n] is not before[n] for n in before), flag  # the other switch's types still move


@interp
def test_interp_b32_planes_products_experts_and_expansion() -> None:
    """Interpreted: the int8 product of b32 rows in planes equals the reference (f32 summation order aside) and the
    file order's; the tensor-core, f32 mat-vec, run and step-tile expansions give the file order's bits; the int8
    routed experts with planes equal the file order's and the reference."""
    from qspec.kernels.qdot import qdot_matmul_torch, qdot_moe_few_torch
    from qspec.kernels.triton_expand import expand_triton
    from qspec.kernels.triton_qdot import qdot_matmul_triton, qdot_moe_few_triton
    from qspec.kernels.triton_qmatmul import dequant_triton, qmatvec_triton, qmm_triton

    for qt in B32:
        n, k = 20, 352  # a partial 256-weight step
        w = b32(qt, n, k, seed=int(qt))
        p = w.to_planes()
        x = torch.randn(3, k)
        got = qdot_matmul_triton(x, p.raw, p.code, n)
        ref = qdot_matmul_torch(x, p.raw, p.code, n, k)
        assert (got - ref).abs().max() <= 1e-6 * ref.abs().max(), qt
        assert (got - qdot_matmul_triton(x, w.raw, int(qt), n)).abs().max() <= 1e-6 * ref.abs().max(), qt
        xb = x.bfloat16()
        assert torch.equal(qmm_triton(xb, p.raw, p.code, n), qmm_triton(xb, w.raw, int(qt), n))
        assert torch.equal(qmatvec_triton(x[:1], p.raw, p.code, n), qmatvec_triton(x[:1], w.raw, int(qt), n))
        assert torch.equal(expand_triton(p.raw, p.code, k, torch.float32), w.dequantize())
        assert torch.equal(dequant_triton(p.raw, p.code, k, torch.float32), w.dequantize())
    E, F, D = 4, 64, 256
    gate, up = (b32(T.Q8_0, F, D, seed=s, experts=E) for s in (1, 2))
    down = b32(T.Q5_0, D, F, seed=3, experts=E)
    h, ti, tw = torch.randn(2, D), torch.tensor([[0, 3], [2, 3]]), torch.rand(2, 2)
    planes = [(m.to_planes().raw, PLANES + int(m.qtype)) for m in (gate, up, down)]
    got = qdot_moe_few_triton(h, ti, tw, *planes)
    ref = qdot_moe_few_torch(h, ti, tw, *planes)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    file_order = [(m.raw, int(m.qtype)) for m in (gate, up, down)]
    assert (got - qdot_moe_few_triton(h, ti, tw, *file_order)).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_b32_planes_at_the_models_shapes() -> None:
    """Compiled, at the flash-next shapes: block_layouts puts a CUDA Q5_0 / Q8_0 matrix in planes (not the token
    table); its 1-8-row products (the int8 kernel: each row its one-row product's bits) and the routed experts
    (512 x 2560 x 640 down, 1 and 6 tokens) agree with the int8 reference and the file order's within f32
    summation error (bf16: one rounding); the expansion is bit-equal."""
    from qspec.kernels.qmatmul import qmoe_few

    for qt in (T.Q8_0, T.Q5_0):
        src = b32(qt, 512, 2560, seed=int(qt), device="cuda")
        w = QuantWeight(src.raw.repeat(32, 1).contiguous(), qt, (16384, 2560))
        held = {"token_embd.weight": w, "blk.0.attn_qkv.weight": w.rows(0, 16384)}
        block_layouts(held)
        p = held["blk.0.attn_qkv.weight"]
        assert held["token_embd.weight"] is w and p.planes
        _close_b32(w, p, (1, 2, 6, 8))
        assert torch.equal(expand(p, torch.bfloat16), expand(w, torch.bfloat16))
        x = torch.randn(8, 2560, device="cuda").bfloat16()
        for m in (2, 6, 8):  # the int8 kernel: each row its one-row product's bits
            y = qmatmul(x[:m], p)
            assert all(torch.equal(y[i:i + 1], qmatmul(x[i:i + 1], p)) for i in range(m)), (qt, m)
    down = b32(T.Q5_0, 2560, 640, seed=9, device="cuda", experts=4)
    down = QuantWeight(down.raw.repeat(128, 1, 1).contiguous(), T.Q5_0, (512, 2560, 640))
    gate, up = (b32(T.Q4_K, 640, 2560, seed=s, device="cuda", experts=0) for s in (10, 11))
    gate, up = (QuantWeight(g.raw.repeat(512, 1).view(512, 640, -1).contiguous(), T.Q4_K, (512, 640, 2560))
                for g in (gate, up))
    for t in (1, 6):
        h = torch.randn(t, 2560, device="cuda").bfloat16()
        ti = torch.stack([torch.randperm(512, device="cuda")[:10] for _ in range(t)])
        tw = torch.rand(t, 10, device="cuda").bfloat16()
        want = qmoe_few(h, ti, tw, gate, up, down).float()
        got = qmoe_few(h, ti, tw, gate, up, down.to_planes()).float()
        assert (got - want).abs().max() <= 2.0 ** -7 * want.abs().max(), t


def _close_b32(w: QuantWeight, p: QuantWeight, rows: tuple[int, ...]) -> None:
    """p's products (the int8 kernel up to 8 rows) against the int8 reference, and one row against the file order's
    (the int8 kernel too), within f32 summation error and one bf16 rounding."""
    from qspec.kernels.qdot import qdot_matmul_torch

    n, k = w.shape
    for m in rows:
        x = torch.randn(m, k, device=w.device).bfloat16()
        got = qmatmul(x, p).float()
        want = qdot_matmul_torch(x, w.raw, int(w.qtype), n, k).float() if m > 1 else qmatmul(x, w).float()
        assert (got - want).abs().max() <= 2.0 ** -7 * want.abs().max(), (w.qtype, m)
