"""The block quantizers (weights/quantize.py): their bytes read back alike through the gguf package's dequantizer,
qspec's dequant.dequantize and a scalar transcription of ggml's dequantize_row_q*_K loops, and their error is
bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st

from qspec.weights.dequant import WeightsError, dequantize
from qspec.weights.quantize import QUANTIZERS, quantize

T = GGMLQuantizationType
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
# RMS error / RMS of the input for N(0, 1) rows: a plain quantizer at these bit widths (llama.cpp's searched
# scales do slightly better; measured here: Q4_K 0.075, Q5_K 0.037, Q6_K 0.019, Q8_0 0.0053, Q4_0 0.086).
RMS_BOUND = {T.Q4_K: 0.085, T.Q5_K: 0.043, T.Q6_K: 0.022, T.Q8_0: 0.0065, T.Q4_0: 0.095, T.Q4_1: 0.095,
             T.Q5_0: 0.05, T.Q5_1: 0.05}


def gguf_dequant(raw: torch.Tensor, qt: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gq.dequantize(raw.numpy(), qt))).reshape(shape)


def check_roundtrip(x: torch.Tensor, qt: GGMLQuantizationType) -> torch.Tensor:
    raw = quantize(x, qt)
    block, size = GGML_QUANT_SIZES[qt]
    assert raw.dtype == torch.uint8 and raw.shape == (*x.shape[:-1], x.shape[-1] // block * size)
    ours = dequantize(raw, qt, x.shape)
    theirs = gguf_dequant(raw, qt, tuple(x.shape))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), qt.name
    assert torch.isfinite(ours).all()
    return ours


@pytest.mark.parametrize("qt", sorted(QUANTIZERS, key=lambda q: q.name))
def test_gaussian_roundtrip_and_error(qt: GGMLQuantizationType) -> None:
    x = torch.randn(48, 1024, generator=torch.Generator().manual_seed(int(qt)))
    y = check_roundtrip(x, qt)
    rel = ((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()
    assert rel < RMS_BOUND[qt], (qt.name, rel)


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    # ggml-quants.c get_scale_min_k4
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def scalar_block(qt: GGMLQuantizationType, b: bytes) -> list[float]:
    """One block decoded by the loops of ggml's dequantize_row_q4_K / q5_K / q6_K, element by element."""
    y: list[float] = []
    if qt in (T.Q4_K, T.Q5_K):
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if qt == T.Q5_K else (b"", b[16:144])
        for j in range(4):  # 64 elements per pass: sub-blocks 2j (low nibbles), 2j+1 (high)
            for half in range(2):
                sc, m = _scale_min_k4(2 * j + half, scales)
                for l in range(32):
                    q = (qs[32 * j + l] >> (4 * half)) & 0xF
                    if qt == T.Q5_K and qh[l] & (1 << (2 * j + half)):
                        q += 16
                    y.append(d * sc * q - dmin * m)
        return y
    ql, qh, sc, d = b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8), _f16(b[208:210])
    out = [0.0] * 256
    for n in range(2):  # 128 elements per pass
        for l in range(32):
            is_ = l // 16
            h = qh[32 * n + l]
            q1 = ((ql[64 * n + l] & 0xF) | ((h >> 0) & 3) << 4) - 32
            q2 = ((ql[64 * n + l + 32] & 0xF) | ((h >> 2) & 3) << 4) - 32
            q3 = ((ql[64 * n + l] >> 4) | ((h >> 4) & 3) << 4) - 32
            q4 = ((ql[64 * n + l + 32] >> 4) | ((h >> 6) & 3) << 4) - 32
            base = 128 * n
            out[base + l] = d * sc[8 * n + is_] * q1
            out[base + l + 32] = d * sc[8 * n + is_ + 2] * q2
            out[base + l + 64] = d * sc[8 * n + is_ + 4] * q3
            out[base + l + 96] = d * sc[8 * n + is_ + 6] * q4
    return out


@pytest.mark.parametrize("qt", K_TYPES)
def test_block_layout_is_ggmls(qt: GGMLQuantizationType) -> None:
    """The bytes, read field by field as ggml's C loops read them, give the dequantized values (f64 products, so
    compare to f32 rounding)."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)) * torch.tensor([[1e-3], [1.0], [40.0]])
    raw = quantize(x, qt)
    y = dequantize(raw, qt, x.shape)
    for r in range(3):
        ref = torch.tensor(scalar_block(qt, bytes(raw[r].tolist())), dtype=torch.float64)
        torch.testing.assert_close(y[r].double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@settings(max_examples=25, deadline=None)
@given(qt=st.sampled_from(K_TYPES), rows=st.integers(1, 3), blocks=st.integers(1, 3),
       scale=st.sampled_from([0.0, 1e-2, 1.0, 300.0]), seed=st.integers(0, 2 ** 16),
       pattern=st.sampled_from(["gauss", "const", "positive", "negative", "sparse"]))
def test_roundtrip_property(qt: GGMLQuantizationType, rows: int, blocks: int, scale: float, seed: int,
                            pattern: str) -> None:
    """Any float input (zeros, constants, one-signed blocks, large and small scales) gives blocks both dequantizers
    read alike, with the error a fraction of the block's span. (Blocks whose largest value is below ~1e-3 get an f16
    super-block scale that is subnormal or zero, in llama.cpp's quantizer too: Q6_K's d is max / (32 * 128). They
    lose precision or read back as zeros, and are left out.)"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 256, generator=g)
    if pattern == "const":
        v = x[0, 0].item()
        x = torch.full_like(x, v + (0.5 if v >= 0 else -0.5))  # away from 0: see the note on small values
    elif pattern == "positive":
        x = x.abs()
    elif pattern == "negative":
        x = -x.abs()
    elif pattern == "sparse":
        x = x * (torch.rand(x.shape, generator=g) < 0.05)
    x = x * scale
    y = check_roundtrip(x, qt)
    span = (x.reshape(-1, 256).amax(1) - x.reshape(-1, 256).amin(1)).clamp(min=x.reshape(-1, 256).abs().amax(1))
    err = (y - x).abs().reshape(-1, 256).amax(1)
    assert (err <= 0.25 * span + 1e-30).all(), (err, span)


def test_shapes_and_errors() -> None:
    x = torch.randn(2, 3, 512)
    assert quantize(x, "q4_k").shape == (2, 3, 288)
    assert torch.equal(quantize(x, T.Q6_K.value), quantize(x, T.Q6_K))
    assert torch.equal(quantize(x.bfloat16(), T.Q5_K), quantize(x.bfloat16().float(), T.Q5_K))
    with pytest.raises(WeightsError, match="multiple of the block size 256"):
        quantize(torch.randn(4, 640), T.Q4_K)
    with pytest.raises(WeightsError, match="Q5_1: row length"):
        quantize(torch.randn(4, 48), T.Q5_1)
    with pytest.raises(WeightsError, match="no quantizer for Q2_K"):
        quantize(x, T.Q2_K)
    with pytest.raises(WeightsError, match="unknown quant type 'q9'"):
        quantize(x, "q9")


def test_chunked_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    import qspec.weights.quantize as qz

    x = torch.randn(7, 512)
    whole = quantize(x, T.Q4_K)
    monkeypatch.setattr(qz, "_CHUNK_SUPER", 3)
    assert torch.equal(quantize(x, T.Q4_K), whole)


def test_q5_1_dequant_matches_gguf() -> None:
    """dequant.py's Q5_1 (the packed type llama.cpp gives Q5_K rows that are not whole super-blocks) on random blocks
    with finite f16 fields."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(40, 24), dtype=np.uint8)
    raw[:, 0:4] = rng.standard_normal((40, 2)).astype(np.float16).view(np.uint8)
    got = dequantize(torch.from_numpy(raw), T.Q5_1, (5, 256))
    assert torch.equal(got, gguf_dequant(torch.from_numpy(raw), T.Q5_1, (5, 256)))


@pytest.mark.parametrize("qt", [T.Q5_0, T.Q5_1, T.Q4_0])
def test_torch_32_quantizers_equal_gguf_bytes(qt: GGMLQuantizationType) -> None:
    """The torch Q5_0/Q5_1/Q4_0 quantizers (they run on the GPU when the benchmark generator makes a Q4_K_M model)
    write the bytes of the gguf package's transcription of ggml's quantize_row_q*_ref, including constant and
    all-zero blocks and ties for the largest magnitude."""
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(7))
    x[0, :32] = 0.0
    x[1, :32] = 0.25
    x[2, :32] = torch.linspace(-1, 1, 32)
    x[3, :2] = torch.tensor([-2.0, 2.0])
    ours = quantize(x, qt)
    theirs = torch.from_numpy(gq.quantize(x.numpy(), qt))
    assert torch.equal(ours, theirs.reshape(ours.shape)), qt.name
