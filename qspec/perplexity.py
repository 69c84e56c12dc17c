"""Perplexity of a model over a text, as llama.cpp's `llama-perplexity` measures it: the text's tokens cut into chunks
of `ctx` tokens, each chunk run from an empty cache, and the second half of each chunk scored (every token there is
predicted from at least ctx/2 tokens of context). The same number for a GGUF's blocks and for its bf16 or f32
original says what a quantization costs (`qspec perplexity`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qspec.model.model import CacheOptions, Model
from qspec.options import EngineOptions
from qspec.runner import KernelSwitches, Runner

# rows of one step: each step's logits [rows, vocabulary] are scored and dropped before the next
STEP_ROWS = 512


@dataclass
class Perplexity:
    ppl: float
    stderr: float  # of ppl, from the standard error of the mean negative log-likelihood
    tokens: int  # tokens scored
    chunks: int
    seconds: float
    running: list[float] = field(default_factory=list)  # the estimate after each chunk


def perplexity(model: Model, ids: list[int], ctx: int, chunks: int | None = None,
               on_chunk: Callable[[int, float], None] | None = None) -> Perplexity:
    """Perplexity of `ids` in chunks of `ctx` tokens (at most `chunks` of them); on_chunk(i, running estimate)."""
    if ctx < 8 or ctx % 4:
        raise ValueError(f"the context must be a multiple of 4 of at least 8 tokens, got {ctx}")
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one context of {ctx}")
    if max(ids) >= model.cfg.vocab_size:
        raise ValueError(f"the text has token id {max(ids)}, outside the model's vocabulary of {model.cfg.vocab_size}")
    runner = Runner(model, CacheOptions(capacity=ctx), switches=KernelSwitches.resolve(EngineOptions(capacity=ctx),
                                                                                    model.device))
    nll: list[torch.Tensor] = []
    running: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode(), runner.switches.apply(), runner.prefill_scope():
        for c in range(n):
            nll.append(chunk_nll(runner, torch.tensor(ids[c * ctx:(c + 1) * ctx], dtype=torch.long)))
            running.append(math.exp(torch.cat(nll).double().mean().item()))
            if on_chunk is not None:
                on_chunk(c, running[-1])
    every = torch.cat(nll).double()
    mean, se = every.mean().item(), (every.std().item() / math.sqrt(len(every)) if len(every) > 1 else 0.0)
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * se, len(every), n, time.perf_counter() - t0, running)


def chunk_nll(runner: Runner, toks: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihoods [ctx/2 - 1] (f32, on the CPU) of the tokens after position ctx/2 of one chunk, each
    predicted from the tokens before it, from an empty cache."""
    ctx, first = len(toks), len(toks) // 2
    runner.reset()
    out = []
    for s in range(0, ctx, STEP_ROWS):
        rows = toks[s:s + STEP_ROWS]
        logits, _ = runner.step(rows)  # every row's logits
        runner.keep(len(rows), rollback=False)
        # row j predicts token j + 1: score j in [first, ctx - 1)
        lo, hi = max(first, s), min(ctx - 1, s + len(rows))
        if lo < hi:
            lp = torch.log_softmax(logits[lo - s:hi - s].float(), dim=-1)
            target = toks[lo + 1:hi + 1].to(lp.device)
            out.append(-lp.gather(1, target[:, None])[:, 0].cpu())
    return torch.cat(out)
