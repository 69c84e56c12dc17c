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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qspec.kernels import gemv
from qspec.kernels.q4 import Q4Weight
from qspec.model import fuse, ops
from qspec.model.model import CacheOptions, Model
from qspec.runner import ContextError, Runner, upload
from qspec.spec.accept import AcceptHook, Sampler, greedy_accept, speculative_accept
from qspec.spec.stats import SpecStats


@dataclass
class EngineOptions:
    draft: int = 0  # MTP draft depth N (0: plain decoding)
    capacity: int = 4096
    kv_type: str = "f32"
    exact: bool = False  # row-exact products: decode and verify rows are bit-identical (CPU tests)
    preserve_pooled: bool = True
    incremental_pooled: bool = True
    pad_target: int | None = 8
    fused_snapshots: bool = True
    sparse_attention: bool = False  # QSA attends over the chosen blocks directly (kernels/sparse_attention.py)
    prefill_chunk: int = 512
    draft_lm_head: torch.Tensor | Q4Weight | None = None  # explicit LM head for drafting only
    draft_head: str = "full"  # "q4": the draft reads a Q4_0 copy of the LM head (the target keeps its own)
    accept_hook: AcceptHook | None = None
    # (tokens emitted so far, drafts) -> drafts: lets tests substitute oracle drafts to exercise acceptance
    draft_hook: Callable[[int, list[int]], list[int]] | None = None
    after_round: Callable[[Runner, int], None] | None = None  # (runner, accepted) after each rollback (tests)
    cuda_graphs: bool = True  # capture decode/verify/draft steps on CUDA (eager on the CPU)
    compile: bool = True  # fuse the steps' small ops with torch.compile on CUDA (qspec.model.fuse)
    gemv: bool = True  # one-row 16-bit products through the Triton mat-vec on CUDA (kernels/gemv.py); off: cuBLAS
    compile_backend: str = "inductor"  # another torch.compile backend also applies on the CPU (tests: "aot_eager")
    time_phases: bool = False  # synchronise around each phase and report its time (benchmarks; adds syncs)
    # keep every verify/decode step's logits in Generation.logits, and each round's first draft logits
    # (the draft step whose context is the emitted tokens alone) in Generation.draft_logits (tests)
    record_logits: bool = False

    def cache_options(self) -> CacheOptions:
        return CacheOptions(capacity=self.capacity, n_slots=self.draft + 1, kv_type=self.kv_type,
                            preserve_pooled=self.preserve_pooled, pad_target=self.pad_target,
                            incremental_pooled=self.incremental_pooled,
                            fused_snapshots=self.fused_snapshots, sparse_attention=self.sparse_attention)


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
        if self.opts.draft_head not in ("full", "q4"):
            raise ValueError(f"draft head must be 'full' or 'q4', got {self.opts.draft_head!r}")
        if self.opts.draft_head == "q4" and self.opts.draft_lm_head is None and self.opts.draft:
            # the draft's logits come from 4-bit weights; verification uses the full head, so the
            # accepted output cannot change, only the acceptance rate
            q4 = Q4Weight.from_dense(model.lm_head)
            # CUDA: the packed head and a 4-bit mat-vec kernel; CPU: the same values, unpacked once
            self.opts.draft_lm_head = q4 if model.device.type == "cuda" else q4.dequantize(model.dtype)
        self.runner = Runner(model, self.opts.cache_options(), cuda_graphs=self.opts.cuda_graphs)

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, *, sampler: Sampler | None = None,
                 stop_ids: set[int] | None = None, on_token: Callable[[int], None] | None = None) -> Generation:
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        o = self.opts
        need = cells_needed(len(prompt), max_tokens, o.draft)
        if need > o.capacity:
            raise ContextError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + draft rows "
                               f"({o.draft + 1}) = {need} exceed the context capacity {o.capacity}")
        fusing = o.compile and (self.model.device.type == "cuda" or o.compile_backend != "inductor")
        with ops.row_exact_mode(o.exact), fuse.fused_mode(fusing, o.compile_backend), gemv.enabled_mode(o.gemv):
            return self._generate(prompt, max_tokens, sampler or Sampler(), stop_ids or set(), on_token)

    def _generate(self, prompt: list[int], max_tokens: int, sampler: Sampler, stop_ids: set[int],
                  on_token: Callable[[int], None] | None) -> Generation:
        o, run, dev = self.opts, self.runner, self.model.device
        run.reset()
        run.graph_stats = type(run.graph_stats)()
        stats = SpecStats()
        out: list[int] = []
        rounds_log: list[dict[str, int]] = []
        logits_log: list[torch.Tensor] = []
        draft_log: list[torch.Tensor] = []
        phases: dict[str, float] = {}
        mark = [time.perf_counter()]

        def phase(name: str) -> None:
            """Charge the time since the last mark to `name` (only when timing phases)."""
            if not o.time_phases:
                return
            self._sync()
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark[0]
            mark[0] = now

        def emit(tok: int) -> bool:
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            return tok in stop_ids or len(out) >= max_tokens

        t0 = time.perf_counter()
        ids = torch.tensor(prompt, dtype=torch.long)
        P = len(prompt)
        Hs: list[torch.Tensor] = []
        logits = None
        for s in range(0, P, o.prefill_chunk):
            chunk = ids[s:s + o.prefill_chunk]
            last = s + o.prefill_chunk >= P
            logits, X = run.step(chunk, logit_rows=torch.tensor([len(chunk) - 1], device=dev) if last else
                                 torch.zeros(0, dtype=torch.long, device=dev))
            run.keep(len(chunk), rollback=False)
            if o.draft:
                # the draft head's cache for prompt positions 1..: rows (t_{j+1}, H_j)
                nxt = ids[s + 1:s + 1 + len(chunk)]
                if len(nxt):
                    run.mtp_step(nxt, X[:len(nxt)], s + 1)
                Hs = [X[-1:]]
        tok = int(sampler.sample(logits[-1]).item())
        self._sync()
        prefill_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        mark[0] = t1
        stop = emit(tok)
        reason = "stop token" if tok in stop_ids else "max tokens"
        if o.draft == 0 and sampler.greedy and not stop:
            # Pipelined: the step that consumes token j is queued (its input is the argmax on the device)
            # before the host reads token j, so the host's work for a step overlaps the previous step on
            # the GPU. A step queued behind a token that ends the request is discarded (keep 0 rows).
            logits, _ = run.step(torch.tensor([tok], device=dev))
            run.keep(1, rollback=False)
            while True:
                phase("decode")
                if o.record_logits:
                    logits_log.append(logits.cpu())
                nxt = logits[-1:].argmax(-1)
                more = len(out) + 1 < max_tokens  # else emitting nxt ends the request by length
                if more:
                    logits, _ = run.step(nxt)
                tok = int(nxt.item())  # waits for the step before; the one just queued keeps the GPU busy
                stop = emit(tok)
                if stop:
                    if more:
                        run.keep(0, rollback=True)
                    break
                run.keep(1, rollback=False)
        elif o.draft == 0:  # sampling: the host draws each token
            while not stop:
                logits, _ = run.step(torch.tensor([tok]))
                run.keep(1, rollback=False)
                phase("decode")
                if o.record_logits:
                    logits_log.append(logits.cpu())
                tok = int(sampler.sample(logits[-1]).item())
                stop = emit(tok)
        else:
            N = o.draft
            d_logits, d_X = run.mtp_step(torch.tensor([tok]), Hs[0], P, o.draft_lm_head)
            rnd = 0
            # Greedy drafts never visit the host: each draft step reads the previous one's argmax on the
            # device and the verify rows are assembled there, so the chain and the verify step are queued in
            # one go and the round has one read-back (drafts and target predictions together).
            on_device = sampler.greedy and o.draft_hook is None
            while not stop:
                L = run.n_tokens
                drafts: list[int] = []
                q_rows = []
                if on_device:
                    if o.record_logits:
                        draft_log.append(d_logits[-1:].cpu())
                    d_toks = [d_logits[-1:].argmax(-1)]
                    for i in range(1, N):
                        d_logits, d_X = run.mtp_step(d_toks[-1], d_X, L + i, o.draft_lm_head)
                        d_toks.append(d_logits[-1:].argmax(-1))
                    phase("draft")
                    v_rows = torch.cat([upload([tok], dev)] + d_toks)
                    v_logits, vX = run.step(v_rows)
                    phase("verify")
                    if o.record_logits:
                        logits_log.append(v_logits.cpu())
                    read = torch.cat([v_rows[1:], v_logits.argmax(-1)]).tolist()
                    drafts, target = read[:N], read[N:]
                    k = greedy_accept(drafts, target)
                    nxt = target[k]
                else:
                    for i in range(N):
                        if i:
                            d_logits, d_X = run.mtp_step(torch.tensor([drafts[-1]]), d_X, L + i, o.draft_lm_head)
                        elif o.record_logits:
                            draft_log.append(d_logits[-1:].cpu())
                        if sampler.greedy:
                            drafts.append(int(d_logits[-1].argmax().item()))
                        else:
                            q = sampler.probs(d_logits[-1])
                            q_rows.append(q)
                            drafts.append(int(sampler.sample_probs(q).item()))
                    if o.draft_hook is not None:
                        drafts = [int(x) for x in o.draft_hook(len(out), list(drafts))]
                    phase("draft")
                    v_logits, vX = run.step(torch.tensor([tok] + drafts))
                    phase("verify")
                    if o.record_logits:
                        logits_log.append(v_logits.cpu())
                    if sampler.greedy:
                        target = v_logits.argmax(-1).tolist()
                        k = greedy_accept(drafts, target)
                        nxt = target[k]
                    else:
                        k, nxt = speculative_accept(drafts, torch.stack(q_rows), sampler.probs(v_logits), sampler)
                        target = []
                if o.accept_hook is not None:
                    k = max(0, min(N, int(o.accept_hook(rnd, N))))
                    if sampler.greedy:
                        nxt = target[k]
                    else:
                        nxt = int(sampler.sample_probs(sampler.probs(v_logits[k])).item())
                committed = drafts[:k] + [nxt]
                n_emit, ends = len(committed), False  # tokens this round emits: up to a stop token or the limit
                for j, t in enumerate(committed):
                    if t in stop_ids or len(out) + j + 1 >= max_tokens:
                        n_emit, ends = j + 1, True
                        break
                if not ends:
                    # extend the draft head over the committed rows with the target's residuals; queued before
                    # the host's emit and rollback work, which then overlaps it on the GPU (it reads only vX and
                    # the head's own cache, which the rollback does not touch)
                    ext = upload(committed + [committed[-1]] * (N + 1 - len(committed)), dev)
                    d_logits, d_X = run.mtp_step(ext, vX, L + 1, o.draft_lm_head, row=k)
                    phase("draft extend")
                for t in committed[:n_emit]:
                    stop = emit(t)
                # the caches keep row 0 (t_L) and the accepted drafts that were emitted
                run.keep(min(k + 1, n_emit), rollback=True)
                if o.after_round is not None:
                    o.after_round(run, k)
                phase("accept+rollback")
                stats.record(N, k, len(committed))
                rounds_log.append({"accepted": k, **{f"pooled_r{r}_rows": v[1] for r, v in run.last_plan_rows.items()},
                                   **{f"pooled_r{r}_real": v[0] for r, v in run.last_plan_rows.items()}})
                if stop:
                    break
                tok = nxt
                rnd += 1
        if out and out[-1] in stop_ids:
            reason = "stop token"
        self._sync()
        decode_s = time.perf_counter() - t1
        cache = run.cache
        pooled = {f"r{r}": lay.stats.as_dict() for r, lay in cache.layouts.items()}
        return Generation(out, P, prefill_s, decode_s, stats, reason, pooled, cache.snap_stats.as_dict(), rounds_log,
                          logits_log, run.graph_stats.as_dict(), phases, draft_log)
