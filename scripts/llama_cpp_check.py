"""Do the GGUF files qspec writes load and run in llama.cpp, and do the two engines compute the same logits?

For each file (the shipped demo model, and tiny random models that qspec writes in f32, with and without the MTP
block, and in llama.cpp's Q8_0 and Q4_K_M per-tensor mixes, and those mixes as llama.cpp's own quantizer writes them
from the f32 file), llama.cpp (llama-cpp-python's vendored llama.cpp, on
the CPU) and qspec (on the CPU, its GGUF loader) run the same token ids as one prompt; every position's logits are
compared, and each engine then decodes greedily from the prompt. The tiny models' QSA budget keeps attention dense
(llama.cpp's sparse selection is documented to differ from the transformers reference that qspec follows, which
the last row shows). llama.cpp multiplies block weights with the
activations rounded to 8 bits (its CPU mat-vec), qspec with the weights expanded to f32 on the CPU, so quantized
files differ by that rounding.

    pip install llama-cpp-python   # builds llama.cpp (~15 min on 2 cores)
    python scripts/llama_cpp_check.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from qspec.config import preset
from qspec.loader import demo_model_path, load_model, tokenizer_for_vocab, write_model
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights import load_model_weights, write_gguf

PROMPT_TOKENS = 48
DECODE_TOKENS = 16
TINY_VOCAB = 8192
F32 = 0  # GGML_TYPE_F32


def qspec_logits(model: Model, ids: list[int]) -> np.ndarray:
    """Every position's logits of `ids` as one prompt step, f32 [T, V]."""
    run = Runner(model, CacheOptions(capacity=256, n_slots=1))
    with torch.no_grad():
        logits, _ = run.step(torch.tensor(ids))
    return logits.float().numpy()


def qspec_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """n tokens of plain greedy decoding after `ids` (one step per token, as the engine decodes)."""
    run = Runner(model, CacheOptions(capacity=256, n_slots=1))
    out: list[int] = []
    step = torch.tensor(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = run.step(step)
            run.keep(step.numel(), rollback=False)
            out.append(int(logits[-1].argmax()))
            step = torch.tensor(out[-1:])
    return out


_LOG: list[str] = []
_LOG_CALLBACK: list[object] = []  # the registered ctypes callback: it must outlive the call that registers it


def _capture_llama_log() -> None:
    """llama.cpp's log lines go to _LOG (the reason a load fails is only logged); registered once."""
    import ctypes

    import llama_cpp

    if _LOG_CALLBACK:
        return

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        _LOG.append(text.decode(errors="replace"))

    _LOG_CALLBACK.append(keep)
    llama_cpp.llama_log_set(keep, ctypes.c_void_p())


def llama_cpp_run(path: Path, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """(every position's logits [T, V], n greedy tokens after them) from llama.cpp on the CPU. Raises RuntimeError
    with llama.cpp's logged reason when it does not load the file."""
    from llama_cpp import Llama

    _LOG.clear()
    try:
        llm = Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=2, verbose=False,
                    type_k=F32, type_v=F32)  # an f32 K/V cache (its default is f16)
    except ValueError as e:
        why = [m.strip() for m in _LOG if "error loading model" in m] or [str(e)]
        raise RuntimeError(why[0]) from e
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return logits, out


def llama_quantize(src: Path, dst: Path, mix: str) -> None:
    """llama.cpp's own quantizer (llama-quantize's library call) writes `src` as file type `mix` (q4_k_m, q8_0, ...)
    to `dst`."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix.upper()}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {mix} failed")


def file_types(path: Path) -> str:
    """The file's tensor types with their tensor counts, most first."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    return ", ".join(f"{k} {v}" for k, v in counts.most_common())


def compare(name: str, path: Path, seed: int) -> str:
    model = load_model(path, device="cpu", dtype=torch.float32)
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
    ours = qspec_logits(model, ids)
    try:
        theirs, their_tokens = llama_cpp_run(path, ids, DECODE_TOKENS)
    except RuntimeError as e:
        return f"| {name} | {file_types(path)} | llama.cpp does not load it: {e} | | | |"
    our_tokens = qspec_greedy(model, ids, DECODE_TOKENS)
    diff = np.abs(ours - theirs)
    rel = float(diff.max() / np.abs(ours).max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    same = next((i for i, (a, b) in enumerate(zip(our_tokens, their_tokens, strict=True)) if a != b), DECODE_TOKENS)
    return (f"| {name} | {file_types(path)} | {diff.max():.3g} | {rel:.2e} | "
            f"{agree * 100:.1f}% | {same} of {DECODE_TOKENS} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    a = ap.parse_args()
    import llama_cpp

    _capture_llama_log()
    rows = [f"llama-cpp-python {llama_cpp.__version__} (its vendored llama.cpp), CPU; {PROMPT_TOKENS} random "
            f"prompt ids, then {DECODE_TOKENS} greedy tokens", "",
            "| file | tensor types in the file | max abs logit diff | ÷ max abs logit | same argmax "
            "| same greedy tokens |",
            "|---|---|---:|---:|---:|---:|"]
    rows.append(compare("demo model (shipped, Q8_0)", demo_model_path(), 1))
    tok, _ = tokenizer_for_vocab(TINY_VOCAB)  # llama.cpp loads no file without a tokenizer
    dense = {"indexer_budget": PROMPT_TOKENS + DECODE_TOKENS}  # a QSA budget that keeps every step's attention dense
    # rows of 256 (whole K-quant super-blocks: the Q4_K_M mix's Q4_K, Q5_K and Q6_K; at width 64 they fall back);
    # a mixer rank of 32, whose up rows are one Q5_0 block (Q4_K's fallback)
    wide = dense | {"hidden": 256, "ple_embed_dim": 256, "expert_ff": 256, "shared_ff": 256, "hc_rank": 32}
    cases = [("f32, with the MTP block", dense | {"mtp": True}, {}), ("f32", dense, {}),
             ("Q8_0 mix", dense, {"quant": "q8_0"}), ("width 256, Q4_K_M mix", wide, {"quant": "q4_k_m"}),
             ("f32, QSA budget 16: sparse from the 20th token", {}, {})]
    with tempfile.TemporaryDirectory() as tmp:
        for label, overrides, kw in cases:
            path = Path(tmp) / "m.gguf"
            cfg = preset("tiny", **{"vocab_size": TINY_VOCAB, "mtp": False} | overrides)
            write_model(path, cfg, seed=3, tokenizer=tok, **kw)
            rows.append(compare(f"tiny (vocab {TINY_VOCAB}), {label}", path, 2))
            if kw:  # the same weights expanded to f32 in the file: what is left is llama.cpp's own rounding
                expanded = Path(tmp) / "expanded.gguf"
                write_gguf(expanded, *load_model_weights(path, dequantize_all=True),
                           extra_kv=tok.to_gguf_metadata(TINY_VOCAB))
                rows.append(compare(f"tiny (vocab {TINY_VOCAB}), {label} expanded to f32", expanded, 2))
                theirs = Path(tmp) / "theirs.gguf"  # llama.cpp's own quantizer, from the same weights in f32
                write_model(path, cfg, seed=3, tokenizer=tok)
                llama_quantize(path, theirs, kw["quant"])
                rows.append(compare(f"tiny (vocab {TINY_VOCAB}), {label} by llama.cpp's quantizer", theirs, 2))
    text = "\n".join(rows) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
