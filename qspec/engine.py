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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from qspec.kernels import gdn_conv, gemv, hc_mix, triton_common
from qspec.kernels.argmax import argmax_rows
from qspec.kernels.q4 import Q4Weight
from qspec.model import fuse, moe, ops
from qspec.model.model import CacheOptions, Model
from qspec.model.mtp import DraftHead, q4_head
from qspec.runner import ContextError, Readback, Runner, upload
from qspec.spec.accept import AcceptHook, Sampler, greedy_accept, speculative_accept_on_device
from qspec.spec.draft_vocab import ids_tensor
from qspec.spec.stats import SpecStats


@dataclass
class EngineOptions:
    draft: int = 0  # MTP draft depth N (0: plain decoding)
    capacity: int = 4096
    kv_type: str = "f32"
    exact: bool = False  # row-exact products: decode and verify rows are bit-identical (tests; no CUDA graphs)
    preserve_pooled: bool = True
    incremental_pooled: bool = True
    pad_target: int | None = 8
    fused_snapshots: bool = True
    sparse_attention: bool = False  # QSA attends over the chosen blocks directly (kernels/sparse_attention.py)
    # masked attention in one pass over the cache (kernels/masked_attention.py); None: on CUDA, off on the CPU
    fused_attention: bool | None = None
    kv_write_kernel: bool = True  # q8_0 KV writes in one launch per layer and step on CUDA (kernels/kv_write.py)
    # GDN steps' causal conv, silu and q/k norms in one Triton launch per layer (kernels/gdn_conv.py), on CUDA
    gdn_conv_kernel: bool = True
    # greedy rounds: queue the next round's draft chain before the host reads the round (its first position, which
    # depends on the accepted count, stays on the device), so the GPU does not wait for the read-back to get it
    # (H200, MTP5: 929.83 against 908.72 tok/s in one process, benchmarks/results/h200-fn8-early-s13.md)
    draft_before_readback: bool = True
    # programmatic dependent launch for the Triton kernels and inductor's (Hopper+, a no-op elsewhere;
    # kernels/triton_common.py): each kernel is scheduled while the one before it runs and waits for it on the GPU,
    # which hides most of a graph node's launch gap (H200: MTP5 998.52 against 947.11 tok/s, plain decoding 748.48
    # against 701.79, one process, benchmarks/results/h200-fn8-pdl-s14.md)
    pdl: bool = True
    prefill_chunk: int = 512
    # prefill's routed experts as three grouped GEMMs per layer (torch._grouped_mm, bf16; model/moe.py) instead of a
    # loop over the experts, where torch has CUTLASS kernels for the GPU (H200: 4K-token prefill x9.6, decode unchanged,
    # benchmarks/results/h200-fn8-prefill-s15.md)
    grouped_mm: bool = True
    draft_lm_head: torch.Tensor | Q4Weight | DraftHead | None = None  # explicit LM head for drafting only
    draft_head: str = "full"  # "q4": the draft reads a Q4_0 copy of the LM head (the target keeps its own)
    # the token ids the draft may propose (spec/draft_vocab.py): its head then reads only their rows; None: all
    draft_vocab: Sequence[int] | torch.Tensor | None = None
    accept_hook: AcceptHook | None = None
    # (tokens emitted so far, drafts) -> drafts: lets tests substitute oracle drafts to exercise acceptance
    draft_hook: Callable[[int, list[int]], list[int]] | None = None
    after_round: Callable[[Runner, int], None] | None = None  # (runner, accepted) after each rollback (tests)
    cuda_graphs: bool = True  # capture decode/verify/draft steps on CUDA (eager on the CPU)
    compile: bool = True  # fuse the steps' small ops with torch.compile on CUDA (qspec.model.fuse)
    # one-row 16-bit products through the Triton mat-vec (kernels/gemv.py) and one-row hyper-connection mixers through
    # their Triton kernels (kernels/hc_mix.py), on CUDA; off: cuBLAS and the compiled mixers
    gemv: bool = True
    # the most rows of a step whose hyper-connection mixers take the Triton kernels (kernels/hc_mix.py; larger steps
    # keep the compiled mixers): 6 also sends MTP5's verify and extend steps there (H200, PDL on: MTP5 988.60 against
    # 972.54 tok/s with 1, benchmarks/results/h200-fn8-mixers-s15.md)
    mixer_step_rows: int = 6
    compile_backend: str = "inductor"  # another torch.compile backend also applies on the CPU (tests: "aot_eager")
    time_phases: bool = False  # synchronise around each phase and report its time (benchmarks; adds syncs)
    # keep every verify/decode step's logits in Generation.logits, and each round's first draft logits
    # (the draft step whose context is the emitted tokens alone) in Generation.draft_logits (tests)
    record_logits: bool = False

    def cache_options(self) -> CacheOptions:
        return CacheOptions(capacity=self.capacity, n_slots=self.draft + 1, kv_type=self.kv_type,
                            preserve_pooled=self.preserve_pooled, pad_target=self.pad_target,
                            incremental_pooled=self.incremental_pooled,
                            fused_snapshots=self.fused_snapshots, sparse_attention=self.sparse_attention,
                            fused_attention=self.fused_attention, kv_write_kernel=self.kv_write_kernel)


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

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


def accepted_on_device(drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """greedy_accept on the device: drafts [N], the target's predictions [N+1] -> [1], the length of the prefix
    of drafts equal to the predictions."""
    return torch.cumprod((drafts == pred[:-1]).long(), 0).sum().view(1)


def cells_needed(prompt_tokens: int, max_tokens: int, draft: int) -> int:
    """Cache cells a request needs: the prompt, every generated token, and a verify step's draft rows."""
    return prompt_tokens + max_tokens + draft + 1


class Engine:
    def __init__(self, model: Model, opts: EngineOptions | None = None) -> None:
        self.model = model
        self.opts = opts or EngineOptions()
        if not 0 <= self.opts.draft <= 8:
            raise ValueError(f"draft depth must be in [0, 8], got {self.opts.draft}")
        if self.opts.draft and model.mtp is None:
            raise ValueError("--draft needs MTP weights, and this model has none (no blk.N.nextn.* / mtp.* tensors)")
        if not 1 <= self.opts.mixer_step_rows <= hc_mix.MAX_ROWS:
            raise ValueError(f"mixer_step_rows must be in 1..{hc_mix.MAX_ROWS}, got {self.opts.mixer_step_rows}")
        if self.opts.draft_head not in ("full", "q4"):
            raise ValueError(f"draft head must be 'full' or 'q4', got {self.opts.draft_head!r}")
        if self.opts.draft_head == "q4" and self.opts.draft_lm_head is None and self.opts.draft:
            # the draft's logits come from 4-bit weights; verification uses the full head, so the
            # accepted output cannot change, only the acceptance rate
            q4 = q4_head(model.lm_head)  # a Q4_0 file's head as it is; other block types requantized
            # CUDA: the packed head and a 4-bit mat-vec kernel; CPU: the same values, unpacked once
            self.opts.draft_lm_head = q4 if model.device.type == "cuda" else q4.dequantize(model.dtype)
        if self.opts.draft and self.opts.draft_vocab is not None and not isinstance(self.opts.draft_lm_head, DraftHead):
            # drafts only from these ids: the head reads their rows alone (verification keeps the full head)
            ids = ids_tensor(self.opts.draft_vocab, model.cfg.vocab_size, model.device)
            head = model.lm_head if self.opts.draft_lm_head is None else self.opts.draft_lm_head
            self.opts.draft_lm_head = DraftHead.rows_of(head, ids)
        # Row-exact MoE loops over each token's experts on the host, which a CUDA-graph capture cannot do.
        graphs = self.opts.cuda_graphs and not self.opts.exact
        self.runner = Runner(model, self.opts.cache_options(), cuda_graphs=graphs)
        self.reader = Readback(model.device, capacity=self.opts.draft + 2)  # a round: drafts, k, next token

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        """Raise ValueError (ContextError when it does not fit the cache) for a request generate() cannot run,
        before any work: callers that answer for a request (the server) check it up front with the same rules."""
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"the prompt has token id {bad}, outside the vocabulary of {vocab}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        o = self.opts
        need = cells_needed(len(prompt), max_tokens, o.draft)
        if need > o.capacity:
            raise ContextError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + draft rows "
                               f"({o.draft + 1}) = {need} exceed the context capacity {o.capacity}")

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, *, sampler: Sampler | None = None,
                 stop_ids: set[int] | None = None, on_token: Callable[[int], None] | None = None) -> Generation:
        self.check_request(prompt, max_tokens)
        o = self.opts
        fusing = o.compile and (self.model.device.type == "cuda" or o.compile_backend != "inductor")
        pdl = o.pdl and triton_common.pdl_supported(self.model.device)
        grouped_mm = o.grouped_mm and moe.grouped_mm_supported(self.model.device)
        with ops.row_exact_mode(o.exact), fuse.fused_mode(fusing, o.compile_backend), gemv.enabled_mode(o.gemv), \
                gdn_conv.conv_kernel_mode(o.gdn_conv_kernel), triton_common.pdl_mode(pdl), \
                moe.grouped_mm_mode(grouped_mm), hc_mix.step_rows_mode(o.mixer_step_rows):
            return self._generate(prompt, max_tokens, sampler or Sampler(), stop_ids or set(), on_token)

    def _generate(self, prompt: list[int], max_tokens: int, sampler: Sampler, stop_ids: set[int],
                  on_token: Callable[[int], None] | None) -> Generation:
        o, run = self.opts, self.runner
        run.reset()
        run.graph_stats = type(run.graph_stats)()
        req = _Request(max_tokens, stop_ids, on_token, self._sync if o.time_phases else None)
        t0 = time.perf_counter()
        logits, H = self._prefill(prompt)
        tok = int(sampler.sample(logits[-1]).item())
        self._sync()
        prefill_s = time.perf_counter() - t0

        t1 = req.mark = time.perf_counter()
        if not req.emit(tok):
            if o.draft:
                self._speculate(req, tok, H, len(prompt), sampler)
            else:
                self._decode(req, tok, sampler)
        reason = "stop token" if req.out[-1] in stop_ids else "max tokens"
        self._sync()
        decode_s = time.perf_counter() - t1
        cache = run.cache
        pooled = {f"r{r}": lay.stats.as_dict() for r, lay in cache.layouts.items()}
        return Generation(req.out, len(prompt), prefill_s, decode_s, req.stats, reason, pooled,
                          cache.snap_stats.as_dict(), req.rounds_log, req.logits_log, run.graph_stats.as_dict(),
                          req.phases, req.draft_log)

    def _prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt in chunks (and the draft head over it) -> (last row's logits, last row's residual H)."""
        o, run, dev = self.opts, self.runner, self.model.device
        ids = torch.tensor(prompt, dtype=torch.long)
        P = len(prompt)
        logits, H = None, None
        for s in range(0, P, o.prefill_chunk):
            chunk = ids[s:s + o.prefill_chunk]
            last = s + o.prefill_chunk >= P
            logits, X = run.step(chunk, logit_rows=torch.tensor([len(chunk) - 1], device=dev) if last else
                                 torch.zeros(0, dtype=torch.long, device=dev))
            run.keep(len(chunk), rollback=False)
            if o.draft:
                # the draft head's cache for prompt positions 1..: rows (t_{j+1}, H_j). Only their K/V cells are
                # kept, so one row goes on through the head's MoE and LM head (its output is not used either)
                nxt = ids[s + 1:s + 1 + len(chunk)]
                if len(nxt):
                    run.mtp_step(nxt, X[:len(nxt)], s + 1, row=len(nxt) - 1)
                H = X[-1:]
        return logits, H

    def _decode(self, req: _Request, tok: int, sampler: Sampler) -> None:
        """Plain decoding, pipelined: the step that consumes token j is queued (its input is the argmax, or the
        sampler's draw, on the device) before the host reads token j, so the host's work for a step overlaps the
        previous step on the GPU. A step queued behind a token that ends the request is discarded (keep 0 rows)."""
        run, reader = self.runner, self.reader
        logits, _ = run.step(torch.tensor([tok], device=self.model.device))
        run.keep(1, rollback=False)
        while True:
            req.phase("decode")
            if self.opts.record_logits:
                req.logits_log.append(logits.cpu())
            nxt = sampler.sample(logits[-1:])
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

    def _speculate(self, req: _Request, tok: int, H: torch.Tensor, P: int, sampler: Sampler) -> None:
        """Speculative rounds until the request ends; `tok` was emitted and not yet run, H is the residual of
        the position before it."""
        o, run, dev, N = self.opts, self.runner, self.model.device, self.opts.draft
        d_logits, d_X = run.mtp_step(torch.tensor([tok]), H, P, o.draft_lm_head)
        # Drafts never visit the host (unless a draft hook must see them): each draft step reads the previous
        # one's argmax or draw on the device, the verify rows are assembled there and the acceptance is decided
        # there, so a round has one read-back (drafts, accepted count, next token).
        on_device = o.draft_hook is None
        # on the device, each round's draft chain is queued right after the previous round's read-back, before
        # the host's rollback work (it reads only the head's own cache and the extend's residual)
        d_toks, q_rows = self._draft_chain(req, d_logits, d_X, P, sampler) if on_device else ([], [])
        rnd = 0
        while True:
            L = run.n_tokens
            # the replayed acceptance of a benchmark depends on the round only: asked once, before the round
            forced = None if o.accept_hook is None else max(0, min(N, int(o.accept_hook(rnd, N))))
            if on_device:
                drafts, k, nxt, vX, extended, early = self._round_on_device(req, tok, d_toks, q_rows, L, forced,
                                                                            sampler)
            else:
                extended = early = None
                drafts, host_q, v_logits, vX = self._round_on_host(req, tok, d_logits, d_X, L, sampler)
                if forced is not None:
                    k = forced
                    nxt = int(sampler.sample(v_logits[forced]).item())
                elif sampler.greedy:
                    target = argmax_rows(v_logits).tolist()
                    k = greedy_accept(drafts, target)
                    nxt = target[k]
                else:
                    p = sampler.probs(v_logits)
                    k, nxt = (int(t) for t in speculative_accept_on_device(upload(drafts, dev), torch.cat(host_q),
                                                                           p, sampler))
            committed = drafts[:k] + [nxt]
            n_emit, ends = req.emits(committed)
            if early is not None:  # the next round's drafts are queued already (discarded when the request ends)
                d_toks, q_rows = early[0], []
                if early[1] is not None and not ends:
                    req.draft_log.append(early[1])
            elif extended is not None:
                d_logits, d_X = extended
                if not ends:
                    d_toks, q_rows = self._draft_chain(req, d_logits, d_X, L + len(committed), sampler)
            elif not ends:
                # extend the draft head over the committed rows with the target's residuals; queued before
                # the host's emit and rollback work, which then overlaps it on the GPU (it reads only vX and
                # the head's own cache, which the rollback does not touch)
                ext = upload(committed + [committed[-1]] * (N + 1 - len(committed)), dev)
                d_logits, d_X = run.mtp_step(ext, vX, L + 1, o.draft_lm_head, row=k)
                req.phase("draft extend")
            for t in committed[:n_emit]:
                req.emit(t)
            # the caches keep row 0 (t_L) and the accepted drafts that were emitted
            run.keep(min(k + 1, n_emit), rollback=True)
            if o.after_round is not None:
                o.after_round(run, k)
            req.phase("accept+rollback")
            req.stats.record(N, k, len(committed))
            req.rounds_log.append({"accepted": k,
                                   **{f"pooled_r{r}_rows": v[1] for r, v in run.last_plan_rows.items()},
                                   **{f"pooled_r{r}_real": v[0] for r, v in run.last_plan_rows.items()}})
            if ends:
                return
            tok = nxt
            rnd += 1

    def _draft_chain(self, req: _Request, d_logits: torch.Tensor, d_X: torch.Tensor, L: int, sampler: Sampler
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Drafts d_1..d_N as [1] device tensors (argmax, or the sampler's draw), queued without a host round trip:
        d_1 from the logits of the step that saw the committed tokens (the extend), then N - 1 head steps chained on
        the head's own residual at positions L + 1.. (L: the committed tokens once the round's rollback is done).
        -> (drafts, their distributions [1, V] when sampling)."""
        o, run = self.opts, self.runner
        if o.record_logits:
            # now: the chain's graph replays may reuse the memory of the step that made d_logits (see Runner._run)
            req.draft_log.append(d_logits[-1:].cpu())
        d_toks: list[torch.Tensor] = []
        q_rows: list[torch.Tensor] = []
        if sampler.greedy:
            d_toks = self._greedy_chain(d_logits, d_X, L + 1)
            req.phase("draft")
            return d_toks, q_rows
        for i in range(o.draft):
            if i:
                d_logits, d_X = run.mtp_step(d_toks[-1], d_X, L + i, o.draft_lm_head)
            # computed before the next replay can reuse the logits' memory
            q_rows.append(sampler.probs(d_logits[-1:]))
            d_toks.append(sampler.sample_probs(q_rows[-1]))
        req.phase("draft")
        return d_toks, q_rows

    def _greedy_chain(self, d_logits: torch.Tensor, d_X: torch.Tensor, start: int, at: torch.Tensor | None = None
                      ) -> list[torch.Tensor]:
        """Greedy drafts as [1] device tensors: d_1, the argmax of d_logits' last row, then the other N - 1 as one
        chain (one graph replay) from position `start`, or from `at` (a [1] device position; `start` bounds it)."""
        o = self.opts
        d_toks = [argmax_rows(d_logits[-1:])]
        if o.draft > 1:
            d_toks.append(self.runner.mtp_chain(d_toks[0], d_X, start, o.draft - 1, o.draft_lm_head, at=at)[0])
        return d_toks

    def _round_on_device(self, req: _Request, tok: int, d_toks: list[torch.Tensor], q_rows: list[torch.Tensor],
                         L: int, forced: int | None, sampler: Sampler
                         ) -> tuple[list[int], int, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                    tuple[list[torch.Tensor], torch.Tensor | None] | None]:
        """The verify step over the queued drafts, the acceptance and the next round's draft extend, queued without
        a host round trip -> (drafts, accepted count k, the target's next token, verify residuals, the extend's
        (logits, residual), and with `draft_before_readback` the next round's greedy drafts queued before the read
        (with the extend's last logits row on the host when recording logits) or None).

        k and the next token are decided on the device (greedy prefix match, or speculative sampling; `forced`: a
        benchmark's replayed k), so the extend is queued behind the verify step before the host reads the round:
        the GPU runs it (and the next round's draft chain, queued next) while the host accepts and rolls back.
        When the round ends the request, the extend's result is not used."""
        o, run, N, dev = self.opts, self.runner, self.opts.draft, self.model.device
        v_rows = torch.cat([upload([tok], dev)] + d_toks)
        drafts = v_rows[1:]
        v_logits, vX = run.step(v_rows)
        req.phase("verify")
        if o.record_logits:
            req.logits_log.append(v_logits.cpu())
        if sampler.greedy:
            pred = argmax_rows(v_logits)
            k = accepted_on_device(drafts, pred) if forced is None else upload([forced], dev)
            nxt = pred.index_select(0, k)
        else:
            p = sampler.probs(v_logits)
            if forced is None:
                k, nxt = speculative_accept_on_device(drafts, torch.cat(q_rows), p, sampler)
            else:
                k = upload([forced], dev)
                nxt = sampler.sample_probs(p.index_select(0, k))
        self.reader.start(torch.cat([drafts, k, nxt]))
        # committed rows padded with the target's next token: drafts[:k] + [nxt] * (N + 1 - k)
        ext = torch.where(torch.arange(N + 1, device=dev) < k, torch.cat([drafts, nxt]), nxt)
        extended = run.mtp_step(ext, vX, L + 1, o.draft_lm_head, row=k)
        req.phase("draft extend")
        early = None
        if o.draft_before_readback and sampler.greedy and L + 2 * N + 1 <= run.opts.capacity:
            # the chain starts at L + k + 2 once the round commits k + 1 tokens: the position is computed on the
            # device, and the bound L + N + 2 (k = N) picks its KV buckets, whose extra cells the causal mask hides
            log = extended[0][-1:].cpu() if o.record_logits else None  # before the chain's replay reuses its memory
            early = self._greedy_chain(*extended, L + N + 2, at=k + (L + 2)), log
            req.phase("draft")
        read = self.reader.result()
        return read[:N], read[N], read[N + 1], vX, extended, early

    def _round_on_host(self, req: _Request, tok: int, d_logits: torch.Tensor, d_X: torch.Tensor, L: int,
                       sampler: Sampler) -> tuple[list[int], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The draft chain, its drafts read by the host and passed through the draft hook, then the verify step
        -> (drafts, the draft distributions [1, V] when sampling, verify logits, verify residuals). Only a draft
        hook (tests) takes this path: the hook must see the drafts before the verify step."""
        o, run = self.opts, self.runner
        d_toks, q_rows = self._draft_chain(req, d_logits, d_X, L, sampler)
        drafts = torch.cat(d_toks).tolist()
        if o.draft_hook is not None:
            drafts = [int(x) for x in o.draft_hook(len(req.out), list(drafts))]
        v_logits, vX = run.step(torch.tensor([tok] + drafts))
        req.phase("verify")
        if o.record_logits:
            req.logits_log.append(v_logits.cpu())
        return drafts, q_rows, v_logits, vX


class _Request:
    """One generate() call's bookkeeping: the emitted tokens, the stop rule, counters, logs and phase timing."""

    def __init__(self, max_tokens: int, stop_ids: set[int], on_token: Callable[[int], None] | None,
                 sync: Callable[[], None] | None) -> None:
        self.max_tokens, self.stop_ids, self.on_token = max_tokens, stop_ids, on_token
        self.sync = sync  # set when timing phases: synchronise at every phase boundary
        self.out: list[int] = []
        self.stats = SpecStats()
        self.rounds_log: list[dict[str, int]] = []
        self.logits_log: list[torch.Tensor] = []
        self.draft_log: list[torch.Tensor] = []
        self.phases: dict[str, float] = {}
        self.mark = time.perf_counter()

    def emit(self, tok: int) -> bool:
        """Append a token (and stream it); True when it ends the request."""
        self.out.append(tok)
        if self.on_token is not None:
            self.on_token(tok)
        return tok in self.stop_ids or len(self.out) >= self.max_tokens

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
