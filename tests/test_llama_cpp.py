"""GGUF files qspec writes, run by llama.cpp (through llama-cpp-python, when installed: it builds llama.cpp, so CI
leaves it out and these tests skip there): they load, and in f32 with dense attention the two engines' logits agree
to f32 rounding and their greedy tokens are the same. scripts/llama_cpp_check.py reports the quantized mixes too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script

from qspec.config import preset
from qspec.loader import load_model, tokenizer_for_vocab, write_model

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
