"""The user's entry point: prefill, then plain decoding or MTP speculative rounds (draft, verify,
accept, rollback), with streaming callbacks and counters.

One speculative round, with committed tokens t_0..t_L (t_L not yet run by the target):
  draft   d_1 = MTP(t_L, H_{L-1}) (computed at the end of the previous round), then
          d_i = MTP(d_{i-1}, h'_{i-1}) chained on the head's own residual;
  verify  target rows [t_L, d_1..d_N] at positions L..L+N, one forward;
  accept  the longest prefix of drafts the target agrees with, plus the target's next token;
  rollback  the recurrent state becomes the accepted row's slot; cells and pooled-key records past
          the accepted length are removed (Algorithm 1 keeps the valid prefix);
  extend  MTP rows (committed token_{L+1+j}, H_{L+j}) rewrite the head's cache with the target's
          residuals and yield the next round's first draft.

A request starts where the caches already hold the most of its prompt (qspec/prefix.py): the sequence a request
left, a prompt end's checkpoint, or a sequence moved to host memory; the rest of the prompt prefills.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from qspec import precompile
from qspec.kernels.argmax import argmax_rows
from qspec.kernels.q4 import Q4Weight
from qspec.kernels.triton_common import triton_enabled
from qspec.memory import check_cache_fits
from qspec.model import fuse
from qspec.model.model import Model
from qspec.model.mtp import DraftHead, q4_head
from qspec.options import EngineOptions, KernelOptions
from qspec.prefix import PrefixCache
from qspec.runner import ContextError, KernelSwitches, Readback, Runner, upload
from qspec.spec.accept import AcceptHook, Sampler, greedy_accept, speculative_accept_on_device
from qspec.spec.depth import STRETCH_GROWTH, DepthController
from qspec.spec.draft_vocab import ids_tensor
from qspec.spec.grammar import AfterThinking, Grammar
from qspec.spec.logprobs import Logprobs, TokenLogprob
from qspec.spec.stats import SpecStats

# the LM head a draft reads (Engine._draft_head): the target's own (None), a Q4_0 copy, or some vocabulary rows
DraftLMHead = torch.Tensor | Q4Weight | DraftHead | None

# Rows of a plain stretch the draft head writes at a time (their K/V cells only: runner.mtp_write_kv, a CUDA graph of
# its own with graphs), and the rows of each of its steps at a stretch's end when no graph runs them (with graphs: the
# depth-N extend's N + 1 rows, whose graph exists). The head's cache is kept current over the stretch so that the probe
# after it drafts as a round that never stopped would; batching the rows makes that cheap: on the demo model on the
# CPU one head step costs 0.9 ms for 1 row and 1.1 ms for 32 rows, against 3.7 ms for a plain step. On the H200, with
# the extend's N + 1 rows per write, a long stretch was measurably slower per token than plain decoding (BENCHMARKS.md
# §8); the controller's measurement of depth 0 includes what is left.
CATCH_UP_ROWS = 32
# The most prompt tokens the depth calibration prefills (each of its generations prefills again).
CALIBRATION_PROMPT = 8192


__all__ = ["ContextError", "Engine", "EngineHooks", "EngineOptions", "Generation", "KernelOptions", "cells_needed"]


# Prompt tokens per prefill step when the options leave it open. A step whose routed experts are GGUF blocks
# expands each chosen expert's blocks once (moe.grouped_block_experts), whatever its rows, so such models take
# longer steps to pay that less often (BENCHMARKS.md §5c).
PREFILL_CHUNK = 512
BLOCK_PREFILL_CHUNK = 4096
# a prefill that scores the prompt keeps every row's logits: steps of at most this many rows bound them
SCORED_PREFILL_ROWS = 512


def prefill_chunk_for(model: Model) -> int:
    """The prefill step length for `model` when EngineOptions.prefill_chunk is None."""
    return BLOCK_PREFILL_CHUNK if any(m.blocks_only for m in model.moe) else PREFILL_CHUNK


@dataclass
class EngineHooks:
    """Test and benchmark instrumentation: not options (no flag, no arm), and not needed to run the engine."""

    # (round, draft depth) -> the round's accepted count: replays an acceptance (benchmarks, `--accept-profile`;
    # a hook with `by_position` gets the token position instead of the round)
    accept_hook: AcceptHook | None = None
    # (tokens emitted so far, drafts) -> drafts: lets tests substitute oracle drafts to exercise acceptance
    draft_hook: Callable[[int, list[int]], list[int]] | None = None
    after_round: Callable[[Runner, int], None] | None = None  # (runner, accepted) after each rollback (tests)
    time_phases: bool = False  # synchronise around each phase and report its time (benchmarks; adds syncs)
    # keep every verify/decode step's logits in Generation.logits, and each round's first draft logits
    # (the draft step whose context is the emitted tokens alone) in Generation.draft_logits (tests)
    record_logits: bool = False
    # an explicit LM head for drafting only (tests, profiling); None: the one `draft_head` and `draft_vocab` make
    draft_lm_head: DraftLMHead = None


@dataclass
class Generation:
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    spec: SpecStats
    stop_reason: str
    pooled: dict[str, object] = field(default_factory=dict)
    snapshots: dict[str, object] = field(default_factory=dict)
    rounds_log: list[dict[str, int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    graphs: dict[str, object] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (time_phases)
    draft_logits: list[torch.Tensor] = field(default_factory=list)
    depth: dict[str, object] = field(default_factory=dict)  # draft_auto: the controller's counters (DepthStats)
    cached_tokens: int = 0  # prompt tokens the caches held already, not prefilled (qspec/prefix.py)

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens prefilled (the cached ones are not) per second."""
        done = self.prompt_tokens - self.cached_tokens
        return done / self.prefill_s if self.prefill_s > 0 else 0.0


def accepted_on_device(drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """greedy_accept on the device: drafts [N], the target's predictions [N+1] -> [1], the length of the prefix
    of drafts equal to the predictions."""
    return torch.cumprod((drafts == pred[:-1]).long(), 0).sum().view(1)


def accept_on_device(sampler: Sampler, v_logits: torch.Tensor, drafts: torch.Tensor, q_rows: list[torch.Tensor],
                     host_drafts: list[int] | None, forced: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's acceptance on the device, without a host round trip: verify logits [d + 1, V] over drafts [d] (with
    their distributions q_rows when sampling; host_drafts: the drafts on the host, for a grammar's masks; `forced`: a
    benchmark's replayed count) -> (accepted count k [1], the target's next token [1], the committed rows padded with
    it, drafts[:k] + [nxt] * (d + 1 - k) [d + 1])."""
    dev, d = drafts.device, int(drafts.shape[0])
    rows = sampler.target(v_logits, drafts, host_drafts)
    if sampler.greedy:
        pred = argmax_rows(rows)
        k = accepted_on_device(drafts, pred) if forced is None else upload([forced], dev)
        nxt = pred.index_select(0, k)
    else:
        p = sampler.probs(rows)
        if forced is None:
            k, nxt = speculative_accept_on_device(drafts, torch.cat(q_rows), p, sampler)
        else:
            k = upload([forced], dev)
            nxt = sampler.sample_probs(p.index_select(0, k))
    ext = torch.where(torch.arange(d + 1, device=dev) < k, torch.cat([drafts, nxt]), nxt)
    if sampler.ruled:  # (no kernel otherwise: this is every round's path)
        sampler.count(ext, torch.arange(d + 1, device=dev) <= k)  # its rows 0..k are the round's tokens
    return k, nxt, ext


def draft_chain(run: Runner, head: DraftLMHead, d_logits: torch.Tensor, d_X: torch.Tensor, L: int, sampler: Sampler,
                n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Drafts d_1..d_n as [1] device tensors (argmax, or the sampler's draw), queued without a host round trip:
    d_1 from the logits of the step that saw the committed tokens (the extend), then n - 1 head steps chained on
    the head's own residual at positions L + 1.. (L: the committed tokens once the round's rollback is done).
    -> (drafts, their distributions [1, V] when sampling)."""
    if sampler.greedy:
        return greedy_chain(run, head, d_logits, d_X, L + 1, n), []
    d_toks: list[torch.Tensor] = []
    q_rows: list[torch.Tensor] = []
    for i in range(n):
        if i:
            d_logits, d_X = run.mtp_step(d_toks[-1], d_X, L + i, head)
        # computed before the next replay can reuse the logits' memory
        q_rows.append(sampler.probs(d_logits[-1:]))
        d_toks.append(sampler.sample_probs(q_rows[-1]))
    return d_toks, q_rows


def greedy_chain(run: Runner, head: DraftLMHead, d_logits: torch.Tensor, d_X: torch.Tensor, start: int, n: int,
                 at: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Greedy drafts as [1] device tensors: d_1, the argmax of d_logits' last row, then the other n - 1 as one
    chain (one graph replay) from position `start`, or from `at` (a [1] device position; `start` bounds it)."""
    d_toks = [argmax_rows(d_logits[-1:])]
    if n > 1:
        d_toks.append(run.mtp_chain(d_toks[0], d_X, start, n - 1, head, at=at)[0])
    return d_toks


def cells_needed(prompt_tokens: int, max_tokens: int, draft: int) -> int:
    """Cache cells a request needs. Plain decoding runs every token but the last generated one; a speculative round
    also writes its draft rows past them (a verify step's N and the draft head's extend row)."""
    if not draft:
        return prompt_tokens + max_tokens - 1
    return prompt_tokens + max_tokens + draft + 1


def context_error(prompt_tokens: int, max_tokens: int, draft: int, capacity: int, *, names: dict[str, str]) -> str:
    """Why a request does not fit (`names` spells max_tokens and capacity as the caller's interface does)."""
    need = cells_needed(prompt_tokens, max_tokens, draft)
    rows = f" + {draft + 1} cells for the last round's draft rows" if draft else " - 1 (the last token is not run)"
    return (f"the prompt ({prompt_tokens} tokens) + {names['max_tokens']} {max_tokens}{rows} need {need} cells, "
            f"more than {names['capacity']} {capacity}")


def prefill_chunks(run: Runner, ids: torch.Tensor, step: int, start: int, scores: Logprobs | None, draft: bool,
                   end: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt `ids` from position `start` (to `end`: a part of it, the rest later) through `run` in steps of `step`
    rows, each committed -> (the last step's logits: its last row's, or every row's when `scores` takes each prompt
    token's log-probability (from position 0); the last row's residual H). `draft`: the draft head's cache is
    filled as well."""
    dev, P = run.device, len(ids)
    logits, H = None, None
    if scores is not None and start == 0:
        scores.entries.append(TokenLogprob(int(ids[0]), None, ()))  # the first token: nothing predicts it
    stop = P if end is None else end
    for s in range(start, stop, step):
        chunk = ids[s:min(s + step, stop)]
        last = s + len(chunk) >= P
        rows = (torch.arange(len(chunk), device=dev) if scores is not None
                else torch.tensor([len(chunk) - 1], device=dev) if last
                else torch.zeros(0, dtype=torch.long, device=dev))
        logits, X = run.step(chunk, logit_rows=rows)
        run.keep(len(chunk), rollback=False)
        nxt = ids[s + 1:s + 1 + len(chunk)]  # the tokens the rows predict (the last prompt row's: none)
        if scores is not None:
            scores.score(logits[:len(nxt)], nxt.tolist())
        if draft:
            # the draft head's cache for prompt positions 1..: rows (t_{j+1}, H_j). Only their K/V cells are
            # kept, so one row goes on through the head's MoE and LM head (its output is not used either)
            if len(nxt):
                run.mtp_step(nxt, X[:len(nxt)], s + 1, row=len(nxt) - 1)
            H = X[-1:]
    return logits, H


class Engine:
    """Generation with one model and one set of options. The options are read, never changed: what the engine derives
    from them (the draft head, the kernel switches for its device) lives on the engine and its runner."""

    def __init__(self, model: Model, opts: EngineOptions | None = None, hooks: EngineHooks | None = None) -> None:
        self.model = model
        self.opts = opts or EngineOptions()
        self.hooks = hooks or EngineHooks()
        if self.opts.draft_auto and not self.opts.draft:
            raise ValueError("the automatic draft depth needs a maximum depth >= 1")
        if self.opts.draft and model.mtp is None:
            raise ValueError("--draft needs MTP weights, and this model has none (no blk.N.nextn.* / mtp.* tensors)")
        self.draft_lm_head = self._draft_head()
        self.prefill_chunk = self.opts.prefill_chunk or prefill_chunk_for(model)
        # custom ops import torch._dynamo on their first call (~2 s on a small CPU): here, so that a request's
        # prefill time is its own
        import torch._dynamo  # noqa: F401
        # before a cache too large for the memory is allocated
        check_cache_fits(model, self.opts.cache_options(),
                         reserve=PrefixCache.checkpoint_bytes(self.opts, model.cfg, model.cfg.vocab_size))
        # Row-exact MoE loops over each token's experts on the host, which a CUDA-graph capture cannot do.
        graphs = self.opts.cuda_graphs and not self.opts.exact
        self.runner = Runner(model, self.opts.cache_options(), cuda_graphs=graphs,
                             switches=KernelSwitches.resolve(self.opts, model.device))
        self.reader = Readback(model.device, capacity=self.opts.draft + 2)  # a round: drafts, k, next token
        self.draft_reader = Readback(model.device, capacity=max(1, self.opts.draft))  # a grammar's (Sampler.target)
        sw = self.runner.switches
        if sw.fused and sw.compile_backend == "inductor":  # fused with inductor: on CUDA (KernelSwitches.resolve)
            fuse.start_compile_workers()  # they start beside the first prefill, not in the first decode step
        # the depth controller outlives requests: the costs it measured are the device's, not the request's
        stretch = self.opts.draft_auto_stretch
        self.depth = (DepthController(self.opts.draft, off_min=stretch, off_max=STRETCH_GROWTH * stretch)
                      if self.opts.draft_auto else None)
        self._plain_tokens = 0  # the plain stretch the controller asked for with its last depth-0 choice
        self._precompiled = False  # the first request queued the steps' products for compilation (_precompile)
        self._ahead: Future | None = None  # those compilations, until a decode step has waited for them
        self.prefix = PrefixCache(self.opts, self.runner)  # what earlier requests left

    def _draft_head(self) -> DraftLMHead:
        """The LM head the drafts read: the hooks' explicit one, a Q4_0 copy (`draft_head` q4), the rows of
        `draft_vocab`, or None (the target's own)."""
        o, model = self.opts, self.model
        head = self.hooks.draft_lm_head
        if not o.draft:
            return head
        if o.draft_head == "q4" and head is None:
            # the draft's logits come from 4-bit weights; verification uses the full head, so the
            # accepted output cannot change, only the acceptance rate
            q4 = q4_head(model.lm_head)  # a Q4_0 file's head as it is; other block types requantized
            # CUDA: the packed head and a 4-bit mat-vec kernel; CPU: the same values, unpacked once
            head = q4 if model.device.type == "cuda" else q4.dequantize(model.dtype)
        if o.draft_vocab is not None and not isinstance(head, DraftHead):
            # drafts only from these ids: the head reads their rows alone (verification keeps the full head)
            ids = ids_tensor(o.draft_vocab, model.cfg.vocab_size, model.device)
            head = DraftHead.rows_of(model.lm_head if head is None else head, ids)
        return head

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def check_request(self, prompt: list[int], max_tokens: int, scoring: bool = False) -> None:
        """Raise ValueError (ContextError when it does not fit the cache) for a request generate() cannot run,
        before any work: callers that answer for a request (the server) check it up front with the same rules.
        `scoring`: the prompt's log-probabilities are asked for, and max_tokens may be 0 (the prompt alone)."""
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"the prompt must be a list of token ids, got {type(prompt).__name__}"
                            + (" (tensor.tolist() gives one)" if isinstance(prompt, torch.Tensor) else ""))
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in prompt if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            if type(bad) is not int:
                raise TypeError(f"the prompt's token ids must be integers, got {bad!r} ({type(bad).__name__})")
            raise ValueError(f"the prompt has token id {bad}, outside the vocabulary of {vocab}")
        if type(max_tokens) is not int:
            raise TypeError(f"max_tokens must be an integer, got {max_tokens!r}")
        if max_tokens < (0 if scoring else 1):
            raise ValueError(f"max_tokens must be >= {0 if scoring else 1}, got {max_tokens}")
        o = self.opts
        if not max_tokens and len(prompt) > o.capacity:
            raise ContextError(f"the prompt ({len(prompt)} tokens) needs more cells than the context capacity "
                               f"{o.capacity}")
        if max_tokens and cells_needed(len(prompt), max_tokens, o.draft) > o.capacity:
            raise ContextError(context_error(len(prompt), max_tokens, o.draft, o.capacity,
                                             names={"max_tokens": "max_tokens", "capacity": "the context capacity"}))

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, *, sampler: Sampler | None = None,
                 stop_ids: set[int] | None = None, on_token: Callable[[int], None] | None = None,
                 logprobs: Logprobs | None = None, prompt_logprobs: Logprobs | None = None,
                 counters: SpecStats | None = None) -> Generation:
        """Generate up to max_tokens after `prompt`; on_token(t) sees each emitted token; `logprobs` collects each
        emitted token's log-probability (qspec/spec/logprobs.py). `prompt_logprobs` collects the prompt's: an entry
        per prompt token, each predicted from the tokens before it (the first from none: its log-probability is None);
        the whole prompt prefills then, whatever the caches hold, and max_tokens may be 0 (the prompt scored alone).
        `counters`: the speculative counters the request's rounds are recorded in (the Generation's `spec`; a request
        that an exception from on_token hands elsewhere keeps them), else new ones."""
        self.check_request(prompt, max_tokens, scoring=prompt_logprobs is not None)
        sampler = sampler or Sampler()
        if sampler.grammar is not None and not set(sampler.grammar.ends) <= set(stop_ids or ()):
            raise ValueError(f"a grammar's output ends on token ids {sampler.grammar.ends}: they must be stop ids")
        sampler.begin(prompt, self.model.cfg.vocab_size, self.model.device)  # its logit rules (bad id: ValueError)
        if self.depth is not None and not self.depth.calibrated:
            self.calibrate_depths(prompt)
        with self.runner.switches.apply():
            req = RequestState(max_tokens, stop_ids or set(), on_token, self._sync if self.hooks.time_phases else None,
                               logprobs, prompt_logprobs, sampler.grammar, counters)
            return self._generate(prompt, req, sampler)

    @property
    def held(self) -> list[int]:
        """The tokens a next prompt starts with to go on from the last request (its prompt and output, when it
        completed), or none."""
        return self.prefix.held

    def cached_prefix(self, prompt: list[int]) -> int:
        """How many of the prompt's first tokens the caches hold already, live or saved (EngineOptions.prefix_cache);
        the rest of the prompt prefills after them."""
        return self.prefix.find(prompt).cached

    def _write_head_row(self, token: int, h: torch.Tensor, pos: int) -> None:
        """The draft head's row (token, the target's residual of the position before) at `pos`, as the first draft
        step writes it (its shape's graph: a new shape would compile where this runs)."""
        self.runner.mtp_step(upload([token], self.model.device), h, pos, self.draft_lm_head)

    def _generate(self, prompt: list[int], req: RequestState, sampler: Sampler) -> Generation:
        o, run = self.opts, self.runner
        start = self.prefix.begin(prompt, self._write_head_row, reuse=req.prompt_logprobs is None)
        cached, cp = start.cached, start.checkpoint
        run.graph_stats = type(run.graph_stats)()
        if self.depth is not None:
            self.depth.start_request()
        t0 = time.perf_counter()
        if cp is not None and cached == len(prompt):  # the same prompt as at the checkpoint: nothing to prefill
            logits, H = cp.logits, cp.h
        else:
            self._precompile(min(len(prompt) - cached, self.prefill_chunk))
            logits, H = self._prefill(prompt, cached, req.prompt_logprobs)
        if not req.max_tokens:  # the prompt scored alone: the caches hold it, its checkpoint the last logits
            self._sync()
            return Generation([], len(prompt), time.perf_counter() - t0, 0.0, req.stats, "max tokens")
        tok = int(sampler.sample(sampler.target(logits[-1:]))[0].item())
        sampler.count([tok])
        self._sync()
        prefill_s = time.perf_counter() - t0

        t1 = req.mark = time.perf_counter()
        if req.logprobs is not None:
            req.logprobs.queue(logits[-1:], torch.tensor([tok]), wait=True)
        if req.emit(tok):
            if o.draft and o.prefix_cache:  # the head's row of the last emitted token (qspec/prefix.py)
                self._write_head_row(tok, H, len(prompt))
        else:
            if self._ahead is not None:  # after the first token: only the steps after it need these kernels
                self._ahead.result()  # the steps' products compiled beside the prefill (qspec/precompile.py)
                self._ahead = None
            if o.draft:
                self._speculate(req, tok, H, len(prompt), sampler)
            else:
                self._decode(req, tok, sampler)
        reason = "stop token" if req.out[-1] in req.stop_ids else "max tokens"
        self._sync()
        decode_s = time.perf_counter() - t1
        self.prefix.completed(req.out[-1])
        cache = run.cache
        pooled = {f"r{r}": lay.stats.as_dict() for r, lay in cache.layouts.items()}
        return Generation(req.out, len(prompt), prefill_s, decode_s, req.stats, reason, pooled,
                          cache.snap_stats.as_dict(), req.rounds_log, req.logits_log, run.graph_stats.as_dict(),
                          req.phases, req.draft_log, self.depth.stats.as_dict() if self.depth is not None else {},
                          cached)

    def prefill_rows(self, scored: bool) -> int:
        """Prompt rows a prefill step takes: the prefill chunk, at most SCORED_PREFILL_ROWS when every row's logits
        are kept (the prompt `scored`)."""
        return min(self.prefill_chunk, SCORED_PREFILL_ROWS) if scored else self.prefill_chunk

    def compile_ahead(self, rows: Sequence[int]) -> Future | None:
        """With block weights on CUDA (and `precompile` on): the block products of steps of these row counts queued
        for compilation in threads (qspec/precompile.py) -> the future that ends when they have compiled; None where
        nothing compiles ahead (each kernel then compiles at its first launch)."""
        if not self.opts.precompile or self.model.device.type != "cuda" or not triton_enabled() \
                or not self.model.has_blocks:
            return None
        return precompile.start(self.model, list(rows))

    def _precompile(self, prompt_rows: int) -> None:
        """On this engine's first request: the block products of the prompt's first step (`prompt_rows`) and of the
        decode and verify steps compiled ahead, beside the prefill (compile_ahead); the first decode step waits for
        `_ahead`."""
        if self._precompiled:
            return
        self._ahead = self.compile_ahead([prompt_rows, 1, self.opts.draft + 1])
        self._precompiled = self._ahead is not None

    def _prefill(self, prompt: list[int], start: int, scores: Logprobs | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt from position `start` (the caches hold the tokens before it) in chunks, and the draft head
        over it -> (last row's logits, last row's residual H); a checkpoint of the prompt's end when they are on.
        `scores` (from position 0) gets each prompt token's log-probability."""
        step = self.prefill_rows(scored=scores is not None)
        with self.runner.prefill_scope():
            logits, H = prefill_chunks(self.runner, torch.tensor(prompt, dtype=torch.long), step, start, scores,
                                       draft=bool(self.opts.draft))
        self.prefix.prompt_done(len(prompt), logits[-1:], H)
        return logits[-1:], H

    def _decode(self, req: RequestState, tok: int, sampler: Sampler) -> None:
        """Plain decoding, pipelined: the step that consumes token j is queued (its input is the argmax, or the
        sampler's draw, on the device) before the host reads token j, so the host's work for a step overlaps the
        previous step on the GPU. A step queued behind a token that ends the request is discarded (keep 0 rows)."""
        run, reader = self.runner, self.reader
        logits, _ = run.step(torch.tensor([tok], device=self.model.device))
        run.keep(1, rollback=False)
        while True:
            req.phase("decode")
            if self.hooks.record_logits:
                req.logits_log.append(logits.cpu())
            nxt = sampler.sample(sampler.target(logits[-1:]))
            sampler.count(nxt)
            if req.logprobs is not None:  # before the read-back: its wait covers the rows' copy
                req.logprobs.queue(logits[-1:], nxt, wait=False)
            reader.start(nxt)  # queued before the next step: reading it waits for this step only
            more = len(req.out) + 1 < req.max_tokens  # else emitting nxt ends the request by length
            if more:
                logits, _ = run.step(nxt)
            tok = reader.result()[0]  # the step just queued keeps the GPU busy meanwhile
            if req.emit(tok):
                if more:
                    run.keep(0, rollback=True)
                return
            run.keep(1, rollback=False)

    def calibrate_depths(self, prompt: list[int], rounds: int = 6, passes: int = 2) -> None:
        """Measure a round's cost at every depth 0..N for the depth controller (a warm-up: on CUDA it also captures
        every depth's graphs): one short greedy generation per depth warms up, then `passes` more per depth are
        measured, the depths interleaved so that a host whose speed drifts (a shared CPU) slows them alike.
        They run on the first request's prompt (its last CALIBRATION_PROMPT tokens): at a short one the costs rose
        less with depth than at the request's context, and every depth's graphs were captured for a KV bucket the
        request then did not use, so its first round at each depth ran eagerly (BENCHMARKS.md §8)."""
        ctl, o = self.depth, self.opts
        if ctl is None:
            return
        ctl.calibrated = True  # before the generations below, which would otherwise calibrate again
        tokens = rounds * (o.draft + 1)
        # the prompt's tail, short enough to leave room for the generations (a prompt near the capacity leaves none)
        prompt = prompt[-max(1, min(CALIBRATION_PROMPT, o.capacity - cells_needed(0, tokens, o.draft))):]
        tokens = min(tokens, o.capacity - cells_needed(len(prompt), 0, o.draft))
        hooks = self.hooks
        hook, hooks.accept_hook = hooks.accept_hook, None  # a replayed acceptance is the request's, not the warm-up's
        try:
            for p in range(passes + 1):
                for d in range(o.draft + 1):
                    if p == 1:
                        ctl.forget_cost(d)
                    ctl.force = d
                    if tokens > 0:
                        self.generate(prompt, tokens)
            self._warm_stretch_writes(len(prompt))
        finally:
            ctl.force, hooks.accept_hook = None, hook
            ctl.forget_acceptance()  # the warm-up's text is not the requests'

    def _warm_stretch_writes(self, start: int) -> None:
        """Compile and capture the plain stretches' write-only head step (CATCH_UP_ROWS rows, at the context of the
        warm-up's prompt) before a request: the warm-up's stretches are too short to run it, and its first use inside
        a request stalled that request (BENCHMARKS.md §8). The cells it writes are rewritten before any draft reads
        them (every request prefills again)."""
        run, dev = self.runner, self.model.device
        if not run.use_graphs or start + CATCH_UP_ROWS > self.opts.capacity:
            return
        toks = torch.zeros(CATCH_UP_ROWS, dtype=torch.long, device=dev)
        H = torch.zeros(CATCH_UP_ROWS, self.model.cfg.hc_dim, dtype=self.model.dtype, device=dev)
        for _ in range(2):  # the runner captures a shape's graph at its second use
            run.mtp_write_kv(toks, H, start)

    def _next_depth(self) -> int:
        """The depth of a round: the fixed N, or the controller's choice (which, for 0, sets the plain stretch)."""
        if self.depth is None:
            return self.opts.draft
        choice = self.depth.choose()
        self._plain_tokens = choice.plain_tokens
        return choice.depth

    def _speculate(self, req: RequestState, tok: int, H: torch.Tensor, P: int, sampler: Sampler) -> None:
        """Speculative rounds until the request ends; `tok` was emitted and not yet run, H is the residual of
        the position before it. With the automatic depth, a choice of depth 0 decodes a stretch plainly, the draft
        head running the stretch's rows on the side, so that the next (probe) round drafts from a current head."""
        d_logits, d_X = self.runner.mtp_step(upload([tok], self.model.device), H, P, self.draft_lm_head)
        d = self._next_depth()
        while True:
            if d == 0:
                stretch = self._plain_stretch(req, tok, sampler, self._plain_tokens)
                if stretch is None:
                    return
                tok, d_logits, d_X = stretch
                d = self._next_depth()
                continue
            nxt = self._rounds(req, tok, d_logits, d_X, d, sampler)
            if nxt is None:
                return
            tok, d = nxt, 0

    def _catch_up_rows(self) -> int:
        """Rows per draft-head step over a plain stretch: the depth-N extend's graph, or CATCH_UP_ROWS eagerly."""
        return self.opts.draft + 1 if self.runner.use_graphs else CATCH_UP_ROWS

    def _catch_up(self, rows: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                  last: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The draft head over rows (committed token [1], the target's residual of the position before) at positions
        start.., which the target committed without it: without `last`, all of them in one step that writes their K/V
        cells only; with `last`, in chunks of _catch_up_rows(). Only the last row's output is ever read (with `last`:
        its logits and residual are returned), so every chunk before the one that holds it writes its K/V cells only
        (runner.mtp_write_kv: no MoE, no head). With graphs that last chunk is padded so that the extend's graph runs it
        (padding writes cells past the rows, rewritten before any draft reads them)."""
        run = self.runner
        n, W = len(rows), self._catch_up_rows()
        toks, X = self._rows_on_device(rows)
        if not last:
            run.mtp_write_kv(toks, X, start)
            return None
        cuts = list(range(0, n, W))
        for c in cuts[:-1]:
            run.mtp_write_kv(toks[c:c + W], X[c:c + W], start + c)
        if n == 1:  # the shape of a sampled draft step (its graph, with graphs)
            return run.mtp_step(toks, X, start, self.draft_lm_head)
        c = cuts[-1]
        toks, X = toks[c:], X[c:]
        if run.use_graphs:
            toks, X = _padded(toks, X, W)
        return run.mtp_step(toks, X, start + c, self.draft_lm_head, row=min(W, n - c) - 1)

    def _rows_on_device(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token [1], residual [1, D]) -> (tokens [n], residuals [n, D]) on the model's device."""
        dev = self.model.device
        return torch.cat([t.view(1).to(dev) for t, _ in rows]), torch.cat([x for _, x in rows])

    def _write_head_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """The draft head's K/V cells of rows (token, residual) at positions start.., CATCH_UP_ROWS at a time: with
        graphs each write padded to that shape, whose graph the plain stretches use (a new shape at a request's end
        would compile and capture there), where the capacity allows; the padding's cells lie past the rows and are
        rewritten before any draft reads them."""
        if not rows:
            return
        run, W = self.runner, CATCH_UP_ROWS
        toks, X = self._rows_on_device(rows)
        for c in range(0, len(rows), W):
            t, x = toks[c:c + W], X[c:c + W]
            if run.use_graphs and start + c + W <= self.opts.capacity:
                t, x = _padded(t, x, W)
            run.mtp_write_kv(t, x, start + c)

    def _plain_stretch(self, req: RequestState, tok: int, sampler: Sampler, n: int
                       ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """Plain decoding of up to n tokens after `tok` (emitted, not yet run), pipelined as in _decode but the last
        step, whose token the next round runs. The draft head runs each step's row (token, residual) in batches of
        CATCH_UP_ROWS along the way (their K/V cells only) and the rest at the end, all charged to depth 0's cost
        -> (the last emitted token, the head's logits and residual over it), or None when the request ended."""
        run, reader, ctl, dev = self.runner, self.reader, self.depth, self.model.device
        t0, eager0 = time.perf_counter(), run.graph_stats.eager
        logits, X = run.step(upload([tok], dev))
        run.keep(1, rollback=False)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows at positions run.n_tokens - len(pending) + 1..
        W = CATCH_UP_ROWS
        done = 0
        while True:
            req.phase("decode")
            nxt = sampler.sample(sampler.target(logits[-1:]))
            sampler.count(nxt)
            if req.logprobs is not None:  # before the read-back: its wait covers the rows' copy
                req.logprobs.queue(logits[-1:], nxt, wait=False)
            pending.append((nxt, X[-1:].clone()))  # before a replay reuses X's memory
            reader.start(nxt)
            if len(pending) > W:  # a full batch, and at least one row left for the last step
                # here, between the reads of a step's outputs and the next step: the graphs share one memory pool
                self._catch_up(pending[:W], run.n_tokens - len(pending) + 1, last=False)
                del pending[:W]
            done += 1
            more = len(req.out) + 1 < req.max_tokens and done < n
            if more:
                logits, X = run.step(nxt)
            tok = reader.result()[0]
            if req.emit(tok):
                if more:
                    run.keep(0, rollback=True)
                if ctl is not None:  # counted, not timed (the discarded step would be in the time)
                    ctl.stats.plain_tokens += done
                if self.opts.prefix_cache:  # the head's rows up to the last emitted token (qspec/prefix.py)
                    self._write_head_rows(pending, run.n_tokens - len(pending) + 1)
                return None
            if not more:
                d_logits, d_X = self._catch_up(pending, run.n_tokens - len(pending) + 1)
                if ctl is not None:  # timed only when every step replayed a graph (no capture, no first use)
                    clean = run.graph_stats.eager == eager0
                    ctl.plain_done(done, time.perf_counter() - t0 if clean else None)
                return tok, d_logits, d_X
            run.keep(1, rollback=False)

    def _rounds(self, req: RequestState, tok: int, d_logits: torch.Tensor, d_X: torch.Tensor, d: int,
                sampler: Sampler) -> int | None:
        """Speculative rounds from depth d while the depth stays above 0; `tok` was emitted and not yet run,
        d_logits / d_X are the draft head's step over it -> None when the request ended, else the token emitted
        last (not yet run) when the next depth is 0."""
        hooks, run, dev, ctl = self.hooks, self.runner, self.model.device, self.depth
        # Drafts never visit the host (unless a draft hook must see them): each draft step reads the previous
        # one's argmax or draw on the device, the verify rows are assembled there and the acceptance is decided
        # there, so a round has one read-back (drafts, accepted count, next token).
        on_device = hooks.draft_hook is None
        # on the device, each round's draft chain is queued right after the previous round's read-back, before
        # the host's rollback work (it reads only the head's own cache and the extend's residual)
        d_toks, q_rows = self._draft_chain(req, d_logits, d_X, run.n_tokens, sampler, d) if on_device else ([], [])
        clock: tuple[float, int] | None = None  # (time, eager steps) at a round's end; the first round is not timed
        while True:
            L = run.n_tokens
            # chosen now, from the rounds before this one: a greedy round queues the next round's drafts before
            # its read-back
            d_next = self._next_depth()
            # a benchmark's replayed acceptance depends on the round (or its token position) only: asked once,
            # before the round
            forced = forced_accept(hooks.accept_hook, req, d)
            if on_device:
                drafts, k, nxt, vX, extended, early = self._round_on_device(req, tok, d_toks, q_rows, L, forced,
                                                                            sampler, d, d_next)
            else:
                extended = early = None
                drafts, host_q, v_logits, vX = self._round_on_host(req, tok, d_logits, d_X, L, sampler, d)
                rows = sampler.target(v_logits, upload(drafts, dev) if sampler.ruled else None, drafts)
                if forced is not None:
                    k = forced
                    nxt = int(sampler.sample(rows[forced:forced + 1])[0].item())
                elif sampler.greedy:
                    target = argmax_rows(rows).tolist()
                    k = greedy_accept(drafts, target)
                    nxt = target[k]
                else:
                    k, nxt = (int(t) for t in speculative_accept_on_device(upload(drafts, dev), torch.cat(host_q),
                                                                           sampler.probs(rows), sampler))
                sampler.count(drafts[:k] + [nxt])
            committed = drafts[:k] + [nxt]
            n_emit, ends = req.emits(committed)
            if early is not None:  # the next round's drafts are queued already (discarded when the request ends)
                d_toks, q_rows = early[0], []
                if early[1] is not None and not ends:
                    req.draft_log.append(early[1])
            elif extended is not None:
                d_logits, d_X = extended
                if not ends and d_next:
                    d_toks, q_rows = self._draft_chain(req, d_logits, d_X, L + len(committed), sampler, d_next)
            elif not ends or self.opts.prefix_cache:
                # extend the draft head over the committed rows with the target's residuals; queued before
                # the host's emit and rollback work, which then overlaps it on the GPU (it reads only vX and
                # the head's own cache, which the rollback does not touch); at the end, the last token's row
                ext = upload(committed + [committed[-1]] * (d + 1 - len(committed)), dev)
                d_logits, d_X = run.mtp_step(ext, vX, L + 1, self.draft_lm_head, row=k)
                req.phase("draft extend")
            req.emit_round(committed[:n_emit], None if on_device else v_logits)
            # the caches keep row 0 (t_L) and the accepted drafts that were emitted
            run.keep(min(k + 1, n_emit), rollback=True)
            if hooks.after_round is not None:
                hooks.after_round(run, k)
            req.phase("accept+rollback")
            req.stats.record(d, k, len(committed))
            req.rounds_log.append({"accepted": k, **({"depth": d} if ctl is not None else {}),
                                   **{f"pooled_r{r}_rows": v[1] for r, v in run.last_plan_rows.items()},
                                   **{f"pooled_r{r}_real": v[0] for r, v in run.last_plan_rows.items()}})
            if ctl is not None:
                # a round's time includes the next round's draft chain: depth d's cost only when the next round
                # drafts as deep and every step replayed a graph (a capture would price a depth out)
                now = (time.perf_counter(), run.graph_stats.eager)
                ctl.observe(d, k, now[0] - clock[0] if clock is not None and d_next == d and now[1] == clock[1]
                            else None)
                clock = now
            if ends:
                return None
            tok, d = nxt, d_next
            if not d:
                return tok

    def _draft_chain(self, req: RequestState, d_logits: torch.Tensor, d_X: torch.Tensor, L: int, sampler: Sampler,
                     n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """draft_chain on the engine's runner (with the draft head's logits recorded when asked for)."""
        if self.hooks.record_logits:
            # now: the chain's graph replays may reuse the memory of the step that made d_logits (see Runner._run)
            req.draft_log.append(d_logits[-1:].cpu())
        out = draft_chain(self.runner, self.draft_lm_head, d_logits, d_X, L, sampler, n)
        req.phase("draft")
        return out

    def _round_on_device(self, req: RequestState, tok: int, d_toks: list[torch.Tensor], q_rows: list[torch.Tensor],
                         L: int, forced: int | None, sampler: Sampler, d: int, d_next: int
                         ) -> tuple[list[int], int, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                    tuple[list[torch.Tensor], torch.Tensor | None] | None]:
        """The verify step over the queued drafts, the acceptance and the next round's draft extend, queued without
        a host round trip -> (drafts, accepted count k, the target's next token, verify residuals, the extend's
        (logits, residual), and with `draft_before_readback` the next round's greedy drafts queued before the read
        (with the extend's last logits row on the host when recording logits) or None).

        k and the next token are decided on the device (greedy prefix match, or speculative sampling; `forced`: a
        benchmark's replayed k), so the extend is queued behind the verify step before the host reads the round:
        the GPU runs it (and the next round's draft chain, queued next) while the host accepts and rolls back.
        When the round ends the request, the extend's result is not used. d: this round's depth, d_next: the next's
        (0: no draft chain)."""
        o, run, dev = self.opts, self.runner, self.model.device
        v_rows = torch.cat([upload([tok], dev)] + d_toks)
        drafts = v_rows[1:]
        if sampler.constrained:  # read while the verify step runs: the host masks its rows meanwhile
            self.draft_reader.start(drafts)
        v_logits, vX = run.step(v_rows)
        req.phase("verify")
        if self.hooks.record_logits:
            req.logits_log.append(v_logits.cpu())
        host = self.draft_reader.result() if sampler.constrained else None
        k, nxt, ext = accept_on_device(sampler, v_logits, drafts, q_rows, host, forced)
        if req.logprobs is not None:  # row i emits ext[i]; before the read-back, whose wait covers their copy
            req.logprobs.queue(v_logits, ext, wait=False)
        self.reader.start(torch.cat([drafts, k, nxt]))
        extended = run.mtp_step(ext, vX, L + 1, self.draft_lm_head, row=k)
        req.phase("draft extend")
        early = None
        if o.draft_before_readback and sampler.greedy and d_next and L + d + d_next + 1 <= run.opts.capacity:
            # the chain starts at L + k + 2 once the round commits k + 1 tokens: the position is computed on the
            # device, and the bound L + d + 2 (k = d) picks its KV buckets, whose extra cells the causal mask hides
            # read before the chain's replay reuses its memory
            log = extended[0][-1:].cpu() if self.hooks.record_logits else None
            early = greedy_chain(run, self.draft_lm_head, *extended, L + d + 2, d_next, at=k + (L + 2)), log
            req.phase("draft")
        read = self.reader.result()
        return read[:d], read[d], read[d + 1], vX, extended, early

    def _round_on_host(self, req: RequestState, tok: int, d_logits: torch.Tensor, d_X: torch.Tensor, L: int,
                       sampler: Sampler, d: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The draft chain, its drafts read by the host and passed through the draft hook, then the verify step
        -> (drafts, the draft distributions [1, V] when sampling, verify logits, verify residuals). Only a draft
        hook (tests) takes this path: the hook must see the drafts before the verify step."""
        run = self.runner
        d_toks, q_rows = self._draft_chain(req, d_logits, d_X, L, sampler, d)
        drafts = torch.cat(d_toks).tolist()
        if self.hooks.draft_hook is not None:
            drafts = [int(x) for x in self.hooks.draft_hook(len(req.out), list(drafts))]
        v_logits, vX = run.step(torch.tensor([tok] + drafts))
        req.phase("verify")
        if self.hooks.record_logits:
            req.logits_log.append(v_logits.cpu())
        return drafts, q_rows, v_logits, vX


def _padded(toks: torch.Tensor, X: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [n] and residuals [n, D] padded to a multiple of `rows` by repeating the last row."""
    pad = -len(toks) % rows
    return torch.cat([toks, toks[-1:].expand(pad)]), torch.cat([X, X[-1:].expand(pad, -1)])


def forced_accept(hook: AcceptHook | None, req: RequestState, d: int) -> int | None:
    """A benchmark's replayed accepted count for the request's next round of depth d (None without a hook). The hook
    is asked with the round's index, or, for a hook replaying a text (`by_position`), the request's token position
    (tokens emitted so far), which plain stretches advance too."""
    if hook is None:
        return None
    key = len(req.out) if getattr(hook, "by_position", False) else len(req.rounds_log)
    return max(0, min(d, int(hook(key, d))))


class RequestState:
    """One generate() call's bookkeeping: the emitted tokens, the stop rule, counters, logs and phase timing."""

    def __init__(self, max_tokens: int, stop_ids: set[int], on_token: Callable[[int], None] | None,
                 sync: Callable[[], None] | None, logprobs: Logprobs | None = None,
                 prompt_logprobs: Logprobs | None = None, grammar: Grammar | AfterThinking | None = None,
                 stats: SpecStats | None = None) -> None:
        self.max_tokens, self.stop_ids, self.on_token, self.logprobs = max_tokens, stop_ids, on_token, logprobs
        self.prompt_logprobs, self.grammar = prompt_logprobs, grammar
        self.sync = sync  # set when timing phases: synchronise at every phase boundary
        self.out: list[int] = []
        self.stats = SpecStats() if stats is None else stats
        self.rounds_log: list[dict[str, int]] = []
        self.logits_log: list[torch.Tensor] = []
        self.draft_log: list[torch.Tensor] = []
        self.phases: dict[str, float] = {}
        self.mark = time.perf_counter()

    def emit(self, tok: int) -> bool:
        """Append a token (its log-probability first, when asked for, then stream it); True when it ends the
        request."""
        self.out.append(tok)
        if self.grammar is not None:  # before the next step's rows are masked
            self.grammar.consume(tok)
        if self.logprobs is not None:
            self.logprobs.take(tok)
        if self.on_token is not None:
            self.on_token(tok)
        return tok in self.stop_ids or len(self.out) >= self.max_tokens

    def emit_round(self, tokens: list[int], logits: torch.Tensor | None) -> None:
        """Emit a round's tokens; `logits`: the verify rows that emitted them, when the round ran on the host (on
        the device, the round queued its log-probability rows itself). The rows of rejected drafts are dropped."""
        if self.logprobs is not None and logits is not None:
            self.logprobs.queue(logits[:len(tokens)], torch.tensor(tokens), wait=True)
        for t in tokens:
            self.emit(t)
        if self.logprobs is not None:
            self.logprobs.drop_pending()

    def emits(self, tokens: list[int]) -> tuple[int, bool]:
        """How many of `tokens` emit() would take, and whether the last of those ends the request."""
        for j, t in enumerate(tokens):
            if t in self.stop_ids or len(self.out) + j + 1 >= self.max_tokens:
                return j + 1, True
        return len(tokens), False

    def phase(self, name: str) -> None:
        """Charge the time since the last mark to `name` (only when timing phases)."""
        if self.sync is None:
            return
        self.sync()
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.mark
        self.mark = now
