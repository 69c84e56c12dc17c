"""GGUF files qspec writes, run by llama.cpp (through llama-cpp-python, when installed: it builds llama.cpp, so CI
leaves it out and these tests skip there): they load, and in f32 with dense attention the two engines' logits agree
to f32 rounding and their greedy tokens are the same. scripts/llama_cpp_check.py reports the quantized mixes too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from gguf import GGMLQuantizationType, GGUFReader

from qspec.config import ModelConfig, preset
from qspec.loader import load_model, tokenizer_for_vocab, write_model
from qspec.weights import load_model_weights
from qspec.weights.quant_mix import keep_packed
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight

pytest.importorskip("llama_cpp")
check = load_script("llama_cpp_check")


def _write(path: Path, mtp: bool) -> None:
    tok, _ = tokenizer_for_vocab(check.TINY_VOCAB)  # llama.cpp loads no file without a tokenizer
    budget = check.PROMPT_TOKENS + check.DECODE_TOKENS  # every step's QSA attention dense
    write_model(path, preset("tiny", vocab_size=check.TINY_VOCAB, mtp=mtp, indexer_budget=budget), seed=3,
                tokenizer=tok)


def test_llama_cpp_runs_a_file_qspec_wrote(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path, mtp=False)
    model = load_model(path, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, check.TINY_VOCAB, (check.PROMPT_TOKENS,), generator=torch.Generator().manual_seed(2))
    ours = check.qspec_logits(model, ids.tolist())
    check._capture_llama_log()
    theirs, their_tokens = check.llama_cpp_run(path, ids.tolist(), check.DECODE_TOKENS)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(ours).max()
    assert their_tokens == check.qspec_greedy(model, ids.tolist(), check.DECODE_TOKENS)


def test_a_file_with_the_mtp_block_runs_or_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp builds without qwen4exp's MTP block (upstream's converter drops it) refuse such a file for its tensor
    count, and the check reports llama.cpp's reason; a build that has it runs the trunk as without the block."""
    path = tmp_path / "m.gguf"
    _write(path, mtp=True)
    check._capture_llama_log()
    ids = list(range(1, 9))
    try:
        theirs, _ = check.llama_cpp_run(path, ids, 1)
    except RuntimeError as e:
        assert "wrong number of tensors" in str(e)
        return
    ours = check.qspec_logits(load_model(path, device="cpu", dtype=torch.float32), ids)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(ours).max()


def _tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def _wide_tiny(**overrides: object) -> ModelConfig:
    """The tiny preset at widths of whole super-blocks (256), where every K-quant of a mix applies."""
    return preset("tiny", vocab_size=check.TINY_VOCAB, mtp=False, hidden=256, ple_embed_dim=256, expert_ff=256,
                  shared_ff=256, hc_rank=32, **overrides)


def _by_llama_quantize(tmp_path: Path, cfg: ModelConfig, mix: str) -> Path:
    """cfg's random weights (seed 3, the check's tokenizer) written in f32, then quantized to `mix` by llama.cpp's
    own quantizer; returns that file."""
    tok, _ = tokenizer_for_vocab(check.TINY_VOCAB)
    write_model(tmp_path / "f32.gguf", cfg, seed=3, tokenizer=tok)
    check._capture_llama_log()
    check.llama_quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", mix)
    return tmp_path / "theirs.gguf"


@pytest.mark.parametrize("experts", [8, 16])
@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"])
def test_mixes_give_llama_quantize_types(tmp_path: Path, mix: str, experts: int) -> None:
    """make-model's mix gives every tensor the type llama.cpp's own quantizer gives it from the same f32 file, and
    the file the same file type and quantization version: widths of whole super-blocks, 8 layers (2 QSA), and 8
    experts (llama.cpp's rule for that count) or 16."""
    cfg = _wide_tiny(layers=8, n_experts=experts)
    theirs_path = _by_llama_quantize(tmp_path, cfg, mix)
    write_model(tmp_path / "ours.gguf", cfg, seed=3, tokenizer=tokenizer_for_vocab(check.TINY_VOCAB)[0], quant=mix)
    theirs, ours = _tensor_types(theirs_path), _tensor_types(tmp_path / "ours.gguf")
    assert {n: (t, ours.get(n)) for n, t in theirs.items() if ours.get(n) != t} == {}
    assert set(ours) == set(theirs)
    meta = [{k: GGUFReader(p).fields[k].contents() for k in ("general.file_type", "general.quantization_version")}
            for p in (theirs_path, tmp_path / "ours.gguf")]
    assert meta[0] == meta[1]


def test_qspec_runs_a_file_of_llama_quantize(tmp_path: Path) -> None:
    """A Q4_K_M file written by llama.cpp's quantizer: qspec holds its every block matrix as blocks, its logits equal
    those of the same file expanded to f32 (up to f32 rounding), and llama.cpp's on that file up to the activation
    rounding of llama.cpp's CPU products (as qspec's own Q4_K_M file does: scripts/llama_cpp_check.py)."""
    path = _by_llama_quantize(tmp_path, _wide_tiny(indexer_budget=check.PROMPT_TOKENS + check.DECODE_TOKENS),
                              "q4_k_m")
    _, held = load_model_weights(path, dequantize_all=False)
    types = _tensor_types(path)
    blocks = [n for n, t in types.items() if GGMLQuantizationType[t] in PACKED_QTYPES and keep_packed(n)]
    assert len(blocks) > 40 and all(isinstance(held[n], QuantWeight) for n in blocks)
    ids = torch.randint(0, check.TINY_VOCAB, (check.PROMPT_TOKENS,), generator=torch.Generator().manual_seed(2))
    ours = check.qspec_logits(load_model(path, dtype=torch.float32, dequantize_all=False), ids.tolist())
    expanded = check.qspec_logits(load_model(path, dtype=torch.float32, dequantize_all=True), ids.tolist())
    assert np.abs(ours - expanded).max() <= 1e-4 * np.abs(expanded).max()
    theirs, _ = check.llama_cpp_run(path, ids.tolist(), 1)
    assert np.abs(ours - theirs).max() <= 0.1 * np.abs(ours).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9
