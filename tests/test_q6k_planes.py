"""Q6_K rows held in planes (weights/qweight.py: QuantWeight.planes) and the kernels that read them.

A planes row holds the same bytes as the file's row, regrouped (every block's ql, then qh, scales, d) and padded to
16 bytes. The kernels decode the same integers and scales from either layout and add them in the same order, so
interpreted (`test_interpreted`, in a subprocess) every product and expansion of a planes weight is the file-order
weight's bit for bit. Compiled, the wider loads can give the tensors another thread layout and with it another order
of the cross-thread sums: the `cuda` test, at the LM head's shape, holds the products to the file order's within f32
summation error (bf16 outputs: one rounding) and the expansion, which sums nothing, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_interp_tests
from gguf import GGMLQuantizationType

from qspec.kernels.qmatmul import expand, int8_dot_mode, qmatmul, qmatmul_op
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.model.model import head_layout
from qspec.weights.dequant import WeightsError
from qspec.weights.quantize import quantize
from qspec.weights.qweight import Q6_K_PLANES, QuantWeight, row_bytes, weight_of

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
    with pytest.raises(WeightsError, match="only Q6_K rows are held in planes, not Q4_K"):
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
def test_cuda_head_in_planes_takes_the_int8_kernel_up_to_8_rows() -> None:
    """2-8 bf16 rows of a Q6_K matrix in planes go to the int8 kernel (not the tensor cores): every row of the product
    is, bit for bit, its own one-row product."""
    k = 2560
    src = q6k(512, k, seed=7, device="cuda")
    p = QuantWeight(src.raw.repeat(16, 1).contiguous(), T.Q6_K, (8192, k)).to_planes()
    x = torch.randn(8, k, device="cuda").bfloat16()
    for m in (2, 6, 8):
        y = qmatmul(x[:m], p)
        for i in range(m):
            assert torch.equal(y[i:i + 1], qmatmul(x[i:i + 1], p)), (m, i)
