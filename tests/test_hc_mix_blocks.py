"""The hyper-connection mixers with their matrices as GGUF blocks (kernels/hc_mix.py, kernels/triton_hc_mix.py).

llama-quantize quantizes the mixers' matrices (weights/quant_mix.py): w_in = [down; inject] in Q4_K, up in Q5_0
for Q4_K_M. What must hold: the prep kernel's int8 row is bit for bit `quantize_x_torch` of its 16-bit normed row,
and the w_in product reading it is bit for bit the int8 product of that row (what the product's own quantizer would
give); the step's h is within LOOSE (8-bit activations into w_in) of the f32 math on the expanded matrices; the
loader keeps the mixers' blocks and the model runs them. The interpreter runs small shapes in a subprocess; `cuda`
tests run the real geometry and the engine with the step kernels on and off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_interp_tests, tiny_config
from gguf import GGMLQuantizationType

from qspec.kernels import hc_mix
from qspec.kernels.hc_mix import combine_torch, mix_torch
from qspec.kernels.qdot import quantize_x_torch
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.weights.quantize import quantize
from qspec.weights.qweight import QuantWeight

T = GGMLQuantizationType
K_QUANTS = (T.Q4_K, T.Q5_K)  # held in the file's order on CUDA (Q6_K and the 32-weight types in planes)
LOOSE = 3e-2
interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


def _blocks(t: torch.Tensor, qt: GGMLQuantizationType, planes: bool = False) -> QuantWeight:
    w = QuantWeight.from_blocks(quantize(t.float().cpu(), qt), qt, t.shape).to(t.device)
    return w.to_planes() if planes else w


def _mixer(M: int, S: int, D: int, rank: int, n_in: int, device: str, seed: int
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [M, S*D] bf16, a pending block output (y, injection logits), the norm, w_in [n_in, S*D] and up [S*D, rank]
    (f32, to be quantized)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(M, S * D, generator=g).bfloat16()
    pending = (torch.randn(M, D, generator=g).bfloat16(), torch.randn(M, S, generator=g).bfloat16())
    norm = (1 + 0.1 * torch.randn(S * D, generator=g)).bfloat16()
    w_in = torch.randn(n_in, S * D, generator=g) / (S * D) ** 0.5
    up = torch.randn(S * D, rank, generator=g) / rank ** 0.5
    return (X.to(device), tuple(p.to(device) for p in pending), norm.to(device), w_in.to(device),  # type: ignore
            up.to(device))


def _check(M: int, S: int, D: int, rank: int, types: tuple[GGMLQuantizationType, GGMLQuantizationType],
           device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prep kernel's int8 row, then the step (M rows: one where `up` is blocks) against f64 on the expansion."""
    from qspec.kernels import triton_hc_mix
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    X, pending, norm, w_in, up = _mixer(M, S, D, rank, rank + S, device, seed=M * D + rank)
    wq, uq = _blocks(w_in, types[0]), _blocks(up, types[1], planes=device == "cuda" and types[1] not in K_QUANTS)
    Xo, Xn, xquant = triton_hc_mix.hc_prep_triton(X, pending, norm, D, S, 1e-6, quant=True)
    assert xquant is not None
    want_X = combine_torch(X.float(), *(p.float() for p in pending))
    torch.testing.assert_close(Xo.float(), want_X, atol=1e-2 * want_X.abs().max().item(), rtol=1e-2)
    q, d, s, g = quantize_x_torch(Xn)
    assert torch.equal(xquant[0].view(torch.int8), q) and torch.equal(xquant[1], d)
    assert torch.equal(xquant[2], s) and torch.equal(xquant[3], g)
    # the step: where the w_in product takes int8 rows (the CPU's dispatch is forced to, as CUDA's does up to 4 rows
    # of Q4_K), it reads the prep kernel's int8 row: the int8 product of that row, bit for bit
    if device == "cpu":
        monkeypatch.setattr(triton_hc_mix, "int8_product", lambda *a: True)
    Xc, h, y = hc_mix.mix_step_triton(X, pending, norm, wq, uq, rank, D, S, 1e-6)
    assert torch.equal(Xc, Xo)
    if triton_hc_mix.int8_product(X, wq.code, wq.shape[0]):
        assert torch.equal(y, qdot_matmul_triton(Xn, wq.raw, wq.code, wq.shape[0]))
    want_h, want_y = mix_torch(Xo.double(), norm.double(), wq.dequantize(torch.float64),
                               uq.dequantize(torch.float64), rank, D, S, 1e-6)
    for got, want in ((h, want_h), (y, want_y)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= LOOSE


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
def test_interpreted() -> None:
    run_interp_tests(__file__)


@interp
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q5_0), (T.Q8_0, T.Q4_0)])
def test_interp_mixer_blocks(types: tuple[GGMLQuantizationType, GGMLQuantizationType],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    _check(1, 4, 64, 32, types, "cpu", monkeypatch)


@interp
def test_interp_a_block_up_takes_the_kernels_at_one_row_only() -> None:
    """Several rows with an `up` of blocks run the compiled mixer (the block output kernel spilled at six rows on
    sm_90); a 16-bit up takes the kernels at any step row count, and the block kernel refuses several rows."""
    from qspec.kernels.triton_hc_mix import hc_out_triton

    X, _, _, w_in, up = _mixer(3, 4, 64, 32, 36, "cpu", seed=5)
    wq, uq = _blocks(w_in, T.Q4_K), _blocks(up, T.Q5_0)
    assert hc_mix.step_eligible(X[:1], wq, uq) and not hc_mix.step_eligible(X, wq, uq)
    assert hc_mix.step_eligible(X, wq, up.bfloat16())
    with pytest.raises(ValueError, match="takes one row"):
        hc_out_triton(torch.zeros(3, 36).bfloat16(), X, uq, 32, 64, 4)


@interp
def test_interp_mixer_mixed_types() -> None:
    """down and inject of different types (an imatrix mix may give them different ones) stack as a StackedWeight whose
    parts keep their types; the step's w_in product is then ops.linear's, and up may stay 16-bit."""
    from qspec.model.ops import StackedWeight, stack_rows

    S, D, rank = 4, 64, 32
    X, pending, norm, w_in, up = _mixer(2, S, D, rank, rank + S, "cpu", seed=7)
    w_stack, _ = stack_rows(_blocks(w_in[:rank], T.Q4_K), _blocks(w_in[rank:], T.Q8_0))
    assert isinstance(w_stack, StackedWeight)
    up16 = up.bfloat16()
    assert hc_mix.step_eligible(X, w_stack, up16)
    Xc, h, y = hc_mix.mix_step_triton(X, pending, norm, w_stack, up16, rank, D, S, 1e-6)
    dense = torch.cat([p.dequantize(torch.float64) for p in w_stack.parts])
    want_h, want_y = mix_torch(Xc.double(), norm.double(), dense, up16.double(), rank, D, S, 1e-6)
    for got, want in ((h, want_h), (y, want_y)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= LOOSE


def test_step_takes_blocks_and_the_loader_keeps_them(tmp_path: Path) -> None:
    """A Q4_K_M file's mixers stay blocks in the model (w_in one Q4_K matrix of down and inject rows); on the CPU the
    compiled path multiplies them (no step kernels), and plain decoding runs."""
    from qspec.engine import Engine, EngineOptions
    from qspec.loader import load_model, write_model

    cfg = tiny_config(mtp=False).with_(hidden=256, expert_ff=256, shared_ff=256, hc_rank=32)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    mixer = model.mix_attn[0]
    assert isinstance(mixer.w_in, QuantWeight) and mixer.w_in.qtype == T.Q4_K and mixer.w_in.shape[0] == 32 + 4
    assert isinstance(mixer.up, QuantWeight) and mixer.up.qtype == T.Q5_0
    assert isinstance(model.mixer.w_in, QuantWeight)  # the output mixer: down only
    X = torch.randn(1, cfg.hc_dim).bfloat16()
    assert not hc_mix.step_eligible(X, mixer.w_in, mixer.up)  # the CPU without the interpreter
    out = Engine(model, EngineOptions(draft=0, capacity=64)).generate(list(range(3, 20)), 4)
    assert len(out.tokens) == 4


@pytest.mark.cuda
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q5_0), (T.Q8_0, T.Q8_0)])
def test_cuda_mixer_blocks_real_shapes(types: tuple[GGMLQuantizationType, GGMLQuantizationType],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-next's mixer (D=2,560, 4 streams, rank 320) at one row (decode: w_in's product on the prep kernel's
    int8 row) with llama-quantize's Q4_K_M types (w_in Q4_K, up Q5_0 in planes, as CUDA holds them) and Q8_0's."""
    _check(1, 4, 2560, 320, types, "cuda", monkeypatch)


@pytest.mark.cuda
def test_cuda_engine_mixer_blocks_kernels_on_and_off(tmp_path: Path) -> None:
    """A Q4_K_M model (mixers in blocks) in CUDA graphs, plain decoding and MTP3: with the step kernels on the
    mixers take them, and tokens stay those of the compiled path (up to near ties: int8 rows into w_in both ways)."""
    from qspec.engine import Engine, EngineHooks, EngineOptions
    from qspec.loader import load_model, write_model

    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256, hc_rank=32)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    assert isinstance(model.mix_attn[0].up, QuantWeight) and model.mix_attn[0].up.planes
    prompt = list(range(3, 40))
    for draft in (0, 3):
        runs = {}
        for on in (False, True):
            with hc_mix.enabled_mode(on):
                runs[on] = Engine(model, EngineOptions(draft=draft, capacity=256),
                                  EngineHooks(record_logits=True)).generate(prompt, 12)
        assert runs[True].graphs["replays"] > 0 and runs[True].tokens == runs[False].tokens, draft
