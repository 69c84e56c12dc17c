"""GDN's gated RMSNorm quantized in its own launch for the output product (kernels/gated_norm.py,
kernels/triton_gated_norm.py).

What must hold: the kernel's 16-bit row is the reference's (`gated_norm_torch`) up to the order of the norm's sum
(one rounding step of the 16-bit type, TOL16); its int8 row is bit for bit `quantize_x_torch` of that 16-bit row; the
product reading it is bit for bit the int8 product of that row (the kernel the unfused path runs), and within LOOSE
(8-bit activations) of the f32 product of the reference row. The interpreter runs small shapes in a subprocess;
`cuda` tests run the model's shapes and the engine with the switch on and off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_interp_tests, tiny_config
from gguf import GGMLQuantizationType

from qspec.kernels import gated_norm
from qspec.kernels.gated_norm import gated_norm_torch, kernel_takes
from qspec.kernels.qdot import quantize_x_torch
from qspec.kernels.qmatmul import qmatmul_torch
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.model.ops import row_exact_mode
from qspec.weights.quantize import quantize
from qspec.weights.qweight import QuantWeight

T = GGMLQuantizationType
TOL16 = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
LOOSE = 2e-2
interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


def _inputs(rows: int, heads: int, dv: int, dtype: torch.dtype, device: str, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """o [rows, heads, dv] f32; z: the columns of a wider 16-bit product (its row stride is not the width, as the GDN
    input product's slice is); the norm weight in f32."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(rows, heads, dv, generator=g) * 3
    wide = torch.randn(rows, 3 * heads * dv, generator=g).to(dtype)
    gamma = 1 + 0.1 * torch.randn(dv, generator=g)
    return o.to(device), wide[:, heads * dv:2 * heads * dv].to(device), gamma.to(device)


def _weight(qt: GGMLQuantizationType, n: int, k: int, device: str) -> QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * k ** -0.5
    return QuantWeight.from_blocks(quantize(w, qt), qt, (n, k)).to(device)


def _check(rows: int, heads: int, dv: int, qt: GGMLQuantizationType, n: int, dtype: torch.dtype, device: str) -> None:
    from qspec.kernels.triton_gated_norm import gated_norm_quantized_triton
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    o, z, gamma = _inputs(rows, heads, dv, dtype, device, seed=rows * heads)
    eps = 1e-6
    y, xquant = gated_norm_quantized_triton(o, z, gamma, eps)
    ref = gated_norm_torch(o, z, gamma, eps)
    assert y.dtype == dtype and y.shape == ref.shape
    err = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max().item()
    assert err <= TOL16[dtype], err
    q, d, s, g = quantize_x_torch(y)
    assert torch.equal(xquant[0].view(torch.int8), q) and torch.equal(xquant[1], d)
    assert torch.equal(xquant[2], s) and torch.equal(xquant[3], g)
    w = _weight(qt, n, heads * dv, device)
    got = gated_norm.gated_norm_product(o, z, gamma, w, eps)
    assert torch.equal(got, qdot_matmul_triton(y, w.raw, w.code, n))
    want = qmatmul_torch(ref.float(), w)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= LOOSE


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


@interp
@pytest.mark.parametrize("rows,heads,dv,qt,dtype", [(1, 4, 64, T.Q4_K, torch.bfloat16),
                                                    (3, 3, 32, T.Q8_0, torch.float16)])
def test_interp_gated_norm_quantized(rows: int, heads: int, dv: int, qt: GGMLQuantizationType,
                                     dtype: torch.dtype) -> None:
    _check(rows, heads, dv, qt, 24, dtype, "cpu")


def test_kernel_takes_only_what_it_computes() -> None:
    """The dispatch's shape rules hold on any device (the int8 product itself needs CUDA): widths that are not whole
    quantizer blocks or not a power of two, a 16-bit weight, row-exact mode and the switch turn it away."""
    o, z, gamma = _inputs(1, 4, 64, torch.bfloat16, "cpu", 0)
    w = _weight(T.Q4_K, 8, 256, "cpu")
    assert not kernel_takes(o, z, gamma, w)  # the CPU's products never take int8 rows
    odd, z48, g48 = _inputs(1, 4, 48, torch.bfloat16, "cpu", 0)
    assert not kernel_takes(odd, z48, g48, _weight(T.Q8_0, 8, 192, "cpu"))
    assert not kernel_takes(o, z, gamma, torch.zeros(8, 256))


@pytest.mark.cuda
@pytest.mark.parametrize("rows,qt", [(1, T.Q4_K), (1, T.Q5_K), (1, T.Q6_K), (6, T.Q8_0)])
def test_cuda_gated_norm_real_shapes(rows: int, qt: GGMLQuantizationType) -> None:
    """flash-next's GDN output: 48 value heads of 128 into 2,560 rows; the types Q4_K_M and Q8_0 files give it (a
    Q8_0 matrix in planes, as CUDA holds it, takes up to 8 rows)."""
    o, z, gamma = _inputs(rows, 48, 128, torch.bfloat16, "cuda", 1)
    w = _weight(qt, 2560, 6144, "cuda")
    w = w.to_planes() if qt == T.Q8_0 else w
    assert kernel_takes(o, z, gamma, w)
    with row_exact_mode():
        assert not kernel_takes(o, z, gamma, w)
    with gated_norm.kernel_mode(False):
        assert not kernel_takes(o, z, gamma, w)
    _check(rows, 48, 128, qt, 2560, torch.bfloat16, "cuda")


@pytest.mark.cuda
def test_cuda_engine_norm_quant_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M model whose GDN heads are whole quantizer blocks, plain decoding in CUDA graphs: with the switch on,
    every GDN layer's one-row output goes through the kernel, and tokens and logits stay those of the compiled path
    (up to the norm's summation order)."""
    from qspec.engine import Engine, EngineHooks, EngineOptions
    from qspec.loader import load_model, write_model

    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256, gdn_v_head_dim=64)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    calls = []
    product = gated_norm.gated_norm_product
    monkeypatch.setattr(gated_norm, "gated_norm_product", lambda *a: calls.append(1) or product(*a))
    prompt = list(range(3, 40))
    runs = {on: Engine(model, EngineOptions(draft=0, capacity=256, norm_quant=on),
                       EngineHooks(record_logits=True)).generate(prompt, 12) for on in (False, True)}
    assert calls and runs[True].graphs["replays"] > 0
    assert runs[True].tokens == runs[False].tokens
    for a, b in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.float().abs().max().item())
