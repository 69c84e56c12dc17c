"""The products that read GGUF blocks (kernels/qmatmul.py, kernels/triton_qmatmul.py) against their references.

The Triton kernels run on the CPU through Triton's interpreter: `test_interpreted` runs this file's `interp` tests
in a subprocess with TRITON_INTERPRET=1 (read when the kernels are decorated, so it cannot be switched on inside
this process). Tolerances: max |got - ref| / max |ref| <= 1e-5 for f32 activations (the kernels and the reference
both accumulate in f32, in different orders); 16-bit activations round the output once, so they get that dtype's
few ulps.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import routing, row_len, run_interp_tests
from gguf import GGMLQuantizationType

from qspec.kernels.moe_few import expert_ffn, sum_slots
from qspec.kernels.qmatmul import (
    int8_dot_mode,
    qexpert_ffn_torch,
    qmatmul,
    qmatmul_op,
    qmatmul_torch,
    qmoe_few,
    qmoe_few_torch,
)
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.weights.dequant import dequantize, quantize_q4_0
from qspec.weights.quantize import quantize
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight

T = GGMLQuantizationType
CUDA = torch.cuda.is_available() and HAS_TRITON
TYPES = sorted(PACKED_QTYPES, key=lambda q: q.name)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def qweight(qt: GGMLQuantizationType, shape: tuple[int, ...], seed: int, device: str = "cpu") -> QuantWeight:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)
    return QuantWeight.from_blocks(quantize(w, qt), qt, shape)


# ---- in this process: the references, the chunked many-row path, the op registration ---------------------------

@pytest.mark.parametrize("qt", TYPES)
def test_chunked_many_rows_equal_reference(qt: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    import qspec.kernels.qmatmul as qm

    w = qweight(qt, (37, row_len(qt)), seed=1)
    x = torch.randn(2, 11, w.shape[1])
    monkeypatch.setattr(qm, "SCRATCH_ELEMENTS", 5 * w.shape[1])  # 5 rows at a time: 8 chunks, the last short
    y = qmatmul(x, w)
    assert y.shape == (2, 11, 37)
    assert rel_err(y, qmatmul_torch(x, w)) <= TOL[torch.float32]


def test_qmoe_and_expert_references_agree() -> None:
    """The gathered fallback of qmoe_few and the per-pair reference; expert_ffn over blocks against its f32
    reference; the slot sum against the expanded experts applied token by token."""
    E, Fd, D, k = 6, 64, 256, 3
    gate, up = qweight(T.Q4_K, (E, Fd, D), 2), qweight(T.Q5_K, (E, Fd, D), 3)
    down = QuantWeight.from_blocks(quantize_q4_0(torch.randn(E, D, Fd)), T.Q4_0, (E, D, Fd))
    h = torch.randn(4, D)
    top_i, top_w = routing(4, E, k, seed=4)
    ref = qmoe_few_torch(h, top_i, top_w, gate, up, down)
    assert rel_err(qmoe_few(h, top_i, top_w, gate, up, down), ref) <= TOL[torch.float32]
    g, u, d = gate.dequantize(), up.dequantize(), down.dequantize()
    for t in range(4):
        want = sum(top_w[t, j] * (torch.nn.functional.silu(g[e] @ h[t]) * (u[e] @ h[t])) @ d[e].t()
                   for j, e in enumerate(top_i[t].tolist()))
        assert rel_err(sum_slots(ref)[t], want) <= TOL[torch.float32]
    x = torch.randn(20, D)
    assert rel_err(expert_ffn(x, gate[1], up[1], down[1]), qexpert_ffn_torch(x, gate[1], up[1], down[1])) <= 1e-5


def test_errors_name_the_problem() -> None:
    w = qweight(T.Q8_0, (8, 64), 5)
    with pytest.raises(ValueError, match=r"qmatmul: x \(2, 32\)"):
        qmatmul(torch.randn(2, 32), w)
    e = qweight(T.Q8_0, (2, 8, 64), 6)
    with pytest.raises(ValueError, match="expert shapes"):
        qmoe_few(torch.randn(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), e, e, e)


def test_qmatmul_op_registration() -> None:
    """The custom op's fake implementation agrees with the real one (shapes, dtypes), as torch.compile needs."""
    w = qweight(T.Q6_K, (9, 256), 7)
    torch.library.opcheck(qmatmul_op, (torch.randn(3, 256), w.raw, int(w.qtype), 9, 256),
                          test_utils=("test_schema", "test_faketensor"))


# ---- the Triton kernels through the interpreter (subprocess) ----------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


@interp
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 8])
def test_interp_qmatvec(qt: GGMLQuantizationType, M: int) -> None:
    w = qweight(qt, (13, row_len(qt)), seed=10 * M + int(qt))
    x = torch.randn(M, w.shape[1])
    assert rel_err(qmatmul(x, w), qmatmul_torch(x, w)) <= TOL[torch.float32]


@interp
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0])
@pytest.mark.parametrize("dt,M", [(torch.bfloat16, 3), (torch.float16, 16)])
def test_interp_tensor_core_16bit(qt: GGMLQuantizationType, dt: torch.dtype, M: int) -> None:
    """16-bit rows take the tensor-core kernel (each tile decoder: K-quant words, Q6_K words, the byte decoder):
    the weights are rounded to x's dtype there, so the tolerance is that dtype's."""
    w = qweight(qt, (17, row_len(qt)), seed=3)
    x = torch.randn(M, w.shape[1]).to(dt)
    y = qmatmul(x, w)
    assert y.dtype == dt and rel_err(y, qmatmul_torch(x, w)) <= TOL[dt]


@interp
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q8_0])
def test_interp_tensor_core_split_sums_in_the_launch(qt: GGMLQuantizationType) -> None:
    """The tensor-core product's partial sums added by each row block's last split (SUM_IN_PRODUCT) equal those of
    the sum launch bit for bit, every arrival counter is back at 0 after it, and the output is the reference's: 100
    rows are a whole and a partial 64-row block, 8 programs wanted (the interpreter counts 4 SMs) split K in 3."""
    from qspec.kernels import triton_common
    from qspec.kernels.triton_common import module_flag
    from qspec.kernels.triton_qmatmul import qmm_triton

    w = qweight(qt, (100, 768), seed=72)
    x = torch.randn(6, 768).bfloat16()
    with module_flag(triton_common.__name__, "SUM_IN_PRODUCT", False):
        apart = qmm_triton(x, w.raw, int(qt), 100)
    here = qmm_triton(x, w.raw, int(qt), 100)
    assert torch.equal(here, apart)
    assert triton_common._COUNTERS and all(int(c.abs().sum()) == 0 for c in triton_common._COUNTERS.values())
    assert rel_err(here, qmatmul_torch(x, w)) <= TOL[torch.bfloat16]
    one = qmm_triton(x, w.raw, int(qt), 100, config=(64, 4, 1))  # 2 blocks, 4 wanted: 2 shares
    assert rel_err(one, qmatmul_torch(x, w)) <= TOL[torch.bfloat16]


@interp
@pytest.mark.parametrize("qt", [T.Q5_0, T.Q4_1])
def test_interp_other_32_blocks(qt: GGMLQuantizationType) -> None:
    """Q5_0 and Q4_1 (what llama.cpp falls back to for rows that are not whole 256-weight super-blocks, such as the
    experts' 640-wide down projections), through the kernel directly: the gguf package quantizes them."""
    from gguf import quants as gq

    from qspec.kernels.triton_qmatmul import dequant_triton, qmatvec_triton

    w = torch.randn(7, 640)
    raw = torch.from_numpy(gq.quantize(w.numpy(), qt))
    ref_w = dequantize(raw, qt, w.shape)
    x = torch.randn(2, 640)
    assert rel_err(qmatvec_triton(x, raw, int(qt), 7), x @ ref_w.t()) <= TOL[torch.float32]
    assert torch.equal(dequant_triton(raw, int(qt), 640, torch.float32), ref_w)


@interp
@pytest.mark.parametrize("qt", TYPES)
def test_interp_expansion_is_the_reference(qt: GGMLQuantizationType) -> None:
    """The kernels' block decoding equals dequant.dequantize bit for bit (the interpreter does not contract FMAs),
    and the many-row product that uses it stays within f32 accumulation error."""
    from qspec.kernels.triton_qmatmul import dequant_triton

    w = qweight(qt, (19, row_len(qt)), seed=20 + int(qt))
    assert torch.equal(dequant_triton(w.raw, int(qt), w.shape[1], torch.float32), w.dequantize())
    x = torch.randn(12, w.shape[1])
    assert rel_err(qmatmul(x, w), qmatmul_torch(x, w)) <= TOL[torch.float32]


@interp
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K, "Q6_K planes"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_interp_pair_expansion_is_its_reference(qt: GGMLQuantizationType | str, dt: torch.dtype) -> None:
    """The tensor-core product's K-quant expansion two weights a register (PAIRS) equals dequantize with the
    scales (and mins) rounded to x's dtype first, rounded once, bit for bit (the interpreter's path computes it in
    f32); that rounding changes some weights against the f32 expansion; and the product through it stays within
    the dtype's tolerance of the f32 reference, as without it."""
    from qspec.kernels.triton_qmatmul import dequant_triton, pairs_mode, qmm_triton

    w = qweight(T.Q6_K if qt == "Q6_K planes" else qt, (19, 768), seed=30 + len(str(qt)))
    raw, code = (w.to_planes().raw, w.to_planes().code) if qt == "Q6_K planes" else (w.raw, int(w.qtype))
    got = dequant_triton(raw, code, 768, dt, pairs=True)
    assert torch.equal(got, dequantize(w.raw, w.qtype, w.shape, dt, round_scales=True))
    assert not torch.equal(got, dequant_triton(raw, code, 768, dt))
    x = torch.randn(6, 768).to(dt)
    for on in (True, False):
        with pairs_mode(on):
            assert rel_err(qmm_triton(x, raw, code, 19), qmatmul_torch(x, w)) <= TOL[dt], on


def _blocks(qt: GGMLQuantizationType, shape: tuple[int, ...], seed: int, device: str = "cpu") -> torch.Tensor:
    """Raw blocks of random weights of `shape` (the gguf package quantizes the types qspec does not)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if qt in (T.Q4_1, T.Q5_1):
        from gguf import quants as gq

        return torch.from_numpy(gq.quantize(w.numpy(), qt)).to(device)
    return quantize(w.to(device), qt)


EXPAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@interp
@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_interp_expand_kernel_is_the_reference(qt: GGMLQuantizationType) -> None:
    """The run kernel (triton_expand.py) equals dequantize rounded once, bit for bit, in every output dtype: odd
    row counts, rows that are not whole 256-weight steps (32-weight types), a slice of stacked experts (storage
    offset), and for Q4_K/Q5_K a start that is only 2-byte aligned (16-bit loads instead of 32-bit ones)."""
    from qspec.kernels.triton_expand import expand_triton
    from qspec.kernels.triton_qmatmul import dequant_triton

    ks = (256, 512) if qt.name.endswith("_K") else (96, 640)
    for n, k in ((5, ks[0]), (19, ks[1])):
        raw = _blocks(qt, (3, n, k), seed=n + int(qt)).view(3, n, -1)
        ref = dequantize(raw, qt, (3, n, k))
        for e in (0, 2):  # expert 2: a raw slice with a non-zero storage offset
            for dt in EXPAND_DTYPES:
                got = expand_triton(raw[e], int(qt), k, dt)
                assert got.dtype == dt and torch.equal(got, ref[e].to(dt)), (n, k, e, dt)
        assert torch.equal(expand_triton(raw[1], int(qt), k, torch.float32), dequant_triton(raw[1], int(qt), k,
                                                                                             torch.float32))
    odd = torch.cat([torch.zeros(2, dtype=torch.uint8), raw[1].reshape(-1)])[2:].view(raw[1].shape)
    assert odd.storage_offset() % 4 == 2
    assert torch.equal(expand_triton(odd, int(qt), k, torch.bfloat16), ref[1].to(torch.bfloat16))


@interp
def test_interp_expand_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """qmatmul.expand takes the run kernel, or the step-tile one with FAST_EXPAND off; both are the reference."""
    import qspec.kernels.qmatmul as qm

    w = qweight(T.Q4_K, (2, 9, 256), seed=60)
    ref = w.dequantize().to(torch.bfloat16)
    assert torch.equal(qm.expand(w, torch.bfloat16), ref)
    monkeypatch.setattr(qm, "FAST_EXPAND", False)
    assert torch.equal(qm.expand(w, torch.float32), w.dequantize())


@interp
@pytest.mark.parametrize("T_", [1, 2])
def test_interp_qmoe_few(T_: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from qspec.kernels import triton_qmatmul

    monkeypatch.setattr(triton_qmatmul, "MOE_CONFIG", (32, 4))  # fewer programs: the interpreter runs each in turn
    E, Fd, D, k = 5, 32, 256, 2
    gate, up = qweight(T.Q4_K, (E, Fd, D), 30), qweight(T.Q4_K, (E, Fd, D), 31)
    down = qweight(T.Q8_0, (E, D, Fd), 32)
    h = torch.randn(T_, D)
    top_i, top_w = routing(T_, E, k, seed=33)
    got = qmoe_few(h, top_i, top_w, gate, up, down)
    assert got.shape == (T_, k, D)
    assert rel_err(got, qmoe_few_torch(h, top_i, top_w, gate, up, down)) <= TOL[torch.float32]


@interp
def test_interp_block_expert_ffn() -> None:
    gate, up, down = qweight(T.Q6_K, (32, 256), 40), qweight(T.Q6_K, (32, 256), 41), qweight(T.Q8_0, (256, 32), 42)
    for n in (3, 11):  # the mat-vec, then the expanded weights
        x = torch.randn(n, 256)
        assert rel_err(expert_ffn(x, gate, up, down), qexpert_ffn_torch(x, gate, up, down)) <= TOL[torch.float32]


# ---- CUDA: the compiled kernels at the real geometry (hidden 2560, experts 640 x 2560, LM head rows) -------------

@pytest.fixture
def f32_expansion_kernels() -> Iterator[None]:
    """16-bit rows to the f32-expansion kernels (the int8-activation ones have tests/test_qdot_kernels.py)."""
    with int8_dot_mode(False):
        yield


@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.usefixtures("f32_expansion_kernels")
def test_cuda_qmatvec_real_shapes(qt: GGMLQuantizationType) -> None:
    for N, K in ((2560, 6144), (16480, 2560), (1800, 2560)):
        w = qweight(qt, (N, K), seed=N, device="cuda")
        for M in (1, 2, 6, 8, 64):
            x = torch.randn(M, K, device="cuda")
            assert rel_err(qmatmul(x, w), qmatmul_torch(x, w)) <= (1e-5 if M <= 8 else 1e-3), (N, K, M)
            xb = x.bfloat16()
            assert rel_err(qmatmul(xb, w), qmatmul_torch(xb, w)) <= TOL[torch.bfloat16], (N, K, M)


@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.usefixtures("f32_expansion_kernels")
def test_cuda_qmoe_real_shapes() -> None:
    E, Fd, D, k = 64, 640, 2560, 10
    gate, up = qweight(T.Q4_K, (E, Fd, D), 50, "cuda"), qweight(T.Q4_K, (E, Fd, D), 51, "cuda")
    down = qweight(T.Q8_0, (E, D, Fd), 53, "cuda")
    for T_ in (1, 6):
        h = torch.randn(T_, D, device="cuda").bfloat16()
        top_i, top_w = routing(T_, E, k, seed=52, device="cuda")
        got = qmoe_few(h, top_i, top_w.bfloat16(), gate, up, down)
        ref = qmoe_few_torch(h, top_i, top_w.bfloat16(), gate, up, down)
        assert rel_err(got, ref) <= TOL[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_cuda_pair_expansion_within_an_ulp_of_its_reference(qt: GGMLQuantizationType) -> None:
    """Compiled (PTX pairs, 16-bit FMAs that round once), the tensor-core product's K-quant expansion is within
    the dtype's precision (eps x |w|) of dequantize with rounded scales (which rounds twice: to f32, then to the
    dtype), nearly every weight bit for bit."""
    from qspec.kernels.triton_qmatmul import dequant_triton

    raw = _blocks(qt, (2560, 6144), seed=5, device="cuda")
    for dt in (torch.bfloat16, torch.float16):
        got = dequant_triton(raw, int(qt), 6144, dt, pairs=True).float()
        want = dequantize(raw, qt, (2560, 6144), dt, round_scales=True).float()
        ulp = torch.finfo(dt).eps * want.abs().clamp_min(torch.finfo(dt).tiny)
        assert bool(((got - want).abs() <= ulp).all()), (qt.name, dt)
        assert (got == want).float().mean() > 0.99, (qt.name, dt)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_expand_real_shapes() -> None:
    """The compiled run kernel against dequantize rounded once, bit for bit, at prefill's shapes: a gdn_in matrix, a
    group of 109 experts' gate rows (a slice of a stacked tensor), the experts' 640-wide down rows, the LM head;
    and a matrix of more than 2^31 bytes (its last rows), whose row offsets need 64 bits."""
    from qspec.kernels.triton_expand import expand_triton

    def tiled(qt: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
        src = _blocks(qt, (512, k), seed, "cuda")
        return src.repeat(-(-n // 512), 1)[:n].contiguous()

    for qt, n, k in ((T.Q4_K, 16480, 2560), (T.Q5_0, 2560, 640), (T.Q8_0, 2560, 640), (T.Q6_K, 248320, 2560),
                     (T.Q5_K, 13952, 2560), (T.Q4_0, 12800, 2560)):
        raw = tiled(qt, n, k, seed=n)
        ref = dequantize(raw, qt, (n, k))
        for dt in EXPAND_DTYPES:
            assert torch.equal(expand_triton(raw, int(qt), k, dt), ref.to(dt)), (qt.name, n, k, dt)
        del raw, ref
    experts = tiled(T.Q4_K, 110 * 640, 2560, seed=7).view(110, 640, -1)
    group = experts[1:].reshape(-1, experts.shape[-1])  # 69760 rows at a non-zero storage offset
    assert torch.equal(expand_triton(group, int(T.Q4_K), 2560, torch.bfloat16),
                       dequantize(group, T.Q4_K, (69760, 2560)).to(torch.bfloat16))
    del experts, group
    big = tiled(T.Q4_K, 1_500_000, 2560, seed=8)  # 2.16e9 bytes
    got = expand_triton(big, int(T.Q4_K), 2560, torch.bfloat16)[-4096:]
    assert torch.equal(got, dequantize(big[-4096:], T.Q4_K, (4096, 2560)).to(torch.bfloat16))
