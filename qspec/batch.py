"""Several requests decoded together: continuous batching over one engine's model.

A Batcher holds `slots` sequences (a Runner each: its own caches, the model shared) and one thread that runs them.
Requests come from any thread: `generate` blocks its caller until the request ends, as Engine.generate does. The
thread gives a waiting request a free slot and prefills its prompt a chunk (EngineOptions.prefill_chunk) between
steps, so the sequences decoding wait a chunk at a time, not a whole prompt; each step runs every decoding sequence
(Model.forward_batch): each weight is read once for all of them, where a lone sequence reads it for its own rows.

Each request picks, streams and stops as the engine does (its Sampler, stop ids, grammar and log-probabilities,
qspec/engine.py). With an engine that does not draft, a step is a row of each sequence, and a greedy request's
output is the engine's plain output: token for token in exact mode (EngineOptions.exact), and up to near ties
otherwise, as a verify step's rows are. With an engine that drafts (EngineOptions.draft = d), a step is a
speculative round of each sequence at depth d (`_spec_round`): the draft heads' steps over every sequence at once
(each on its own head cache), d + 1 verify rows of each in the batched step, each one's acceptance on the device,
its caches rolled back to what it emits. A request's rounds are the ones the engine would run for it alone at that
depth, so greedy output is still plain output, and a sampled request's output is decided by its seed alone. The
depth that pays falls as the batch grows (more rows read more experts), so by default (BATCH_DRAFT "auto") a batch
of greedy requests decodes in rounds 1..d deep or in plain steps, as the times measured at its size and the
acceptance say (BatchDraftChoice); over plain steps each sequence's draft head gets the K/V cells of its rows, and
its logits are computed again before the next round (`_refresh_heads`). A greedy request alone decodes with the
engine itself (Engine.generate: the automatic depth, the chain queued before the read-back) and hands over to the
batch when another request arrives.

A slot keeps its sequence after its request ends: a prompt that goes on from it (a chat's next turn) is given that
slot and prefills only its new tokens.

Invariant: a slot's runner holds its request's prompt and emitted tokens but the last, committed (the last is fed
to the next step); a slot is given to one request at a time, and only the batch thread touches runners. Each pass
of the thread runs under KernelSwitches.apply, which holds runner.MODEL_LOCK: the engine used from another thread
waits for it (the switches are process-wide modes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from qspec.batch_steps import BatchSteps
from qspec.engine import Engine, Generation, RequestState, accept_on_device, forced_accept, prefill_chunks
from qspec.kernels.argmax import argmax_rows
from qspec.memory import caches_that_fit, check_cache_fits, held_bytes
from qspec.model.model import CacheOptions
from qspec.runner import EAGER_AT_LIMIT, Readback, Runner, upload
from qspec.spec.accept import Sampler
from qspec.spec.depth import BatchDraftChoice
from qspec.spec.logprobs import Logprobs

_T = TypeVar("_T")

# Whether a batch over an engine that drafts drafts too: in every step, where it pays at the batch's size (measured:
# BatchDraftChoice), or never.
BATCH_DRAFT = ("auto", "on", "off")


class _Yield(Exception):  # noqa: N818 - not an error: a lone request's decoding hands over to the batch
    """Raised from a lone request's token callback when another request waits (Batcher._decode_alone)."""


@dataclass(eq=False)  # a job is itself: compared by identity
class _Job:
    """A request in the batch: its bookkeeping (the engine's RequestState), where it is, and how it ended."""
    prompt: list[int]
    sampler: Sampler
    req: RequestState
    done: threading.Event = field(default_factory=threading.Event)
    result: Generation | None = None
    error: BaseException | None = None
    slot: int = -1
    cached: int = 0  # prompt tokens the slot held already
    ids: torch.Tensor | None = None  # the tokens its slot prefills (its prompt, or prompt and output so far)
    filled: int = 0  # how many of them the slot holds
    tok: int = -1  # the last emitted token: the next step's row
    # drafting: the draft head's (logits, residual) over tok, or None when it is to be computed (by the next round)
    # from last_x, the target's residual of the position before tok
    head: tuple[torch.Tensor, torch.Tensor] | None = None
    last_x: torch.Tensor | None = None
    t0: float = 0.0
    prefill_s: float = 0.0
    t1: float = 0.0  # when decoding began


class Batcher:
    """Continuous batching over `engine`'s model (module docstring). When the engine drafts, `draft` says whether
    the batch does (BATCH_DRAFT; a request alone drafts with the engine in any case). `close` stops its thread."""

    def __init__(self, engine: Engine, slots: int, draft: str = "auto") -> None:
        if slots < 1:
            raise ValueError(f"a batch needs at least 1 slot, got {slots}")
        if draft not in BATCH_DRAFT:
            raise ValueError(f"batch drafting must be one of {BATCH_DRAFT}, got {draft!r}")
        self.engine, self.model = engine, engine.model
        # with an engine that drafts (unless `draft` is off), every sequence drafts that deep (a verify step's rows
        # rolled back) in every step (on), or as deep as pays at that batch size, plain steps included (auto); else
        # plain decoding: one row a step, no rollback (a request alone still drafts with the engine)
        self.depth = engine.opts.draft if draft != "off" else 0
        self.choice = BatchDraftChoice(self.depth) if self.depth and draft == "auto" else None
        self.rounds = 0  # passes that were speculative rounds (the others: plain steps)
        opts = self.slot_options(engine, draft)
        self.runners: list[Runner] = []
        lead = engine.runner
        for _ in range(slots):
            check_cache_fits(self.model, opts)  # before each: the free memory left after the slots made already
            self.runners.append(Runner(self.model, opts, cuda_graphs=lead.use_graphs, switches=lead.switches))
        # the batched steps' CUDA graphs live in the first slot's store (its own steps, prefill's, have none)
        self.steps = BatchSteps(self.runners)
        self._waiting: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}  # decoding, by slot
        self._filling: deque[_Job] = deque()  # given a slot, their prompts prefilling a chunk a step, in order
        self._cv = threading.Condition()
        self._closed = False
        self._ahead: tuple[list[_Job], torch.Tensor] | None = None  # a step launched and kept, its logits not read
        self.reader = Readback(self.model.device, capacity=slots * (self.depth + 2))
        self._thread = threading.Thread(target=self._loop, name="qspec-batch", daemon=True)
        self._thread.start()

    @staticmethod
    def slot_options(engine: Engine, draft: str = "auto") -> CacheOptions:
        """A slot's cache options: the engine's, with one rollback slot per draft row where the batch drafts."""
        opts = engine.opts.cache_options()
        return opts if engine.opts.draft and draft != "off" else replace(opts, n_slots=1)

    @classmethod
    def slots_that_fit(cls, engine: Engine, most: int, draft: str = "auto") -> int:
        """How many slots (0..most) the free memory holds at the engine's context (memory.caches_that_fit)."""
        return caches_that_fit(engine.model, cls.slot_options(engine, draft), most)

    @property
    def slots(self) -> int:
        return len(self.runners)

    def describe(self) -> str:
        """A line on the batch: its slots and what their caches hold in memory."""
        dev, host = held_bytes(self.model, [r.cache for r in self.runners])
        where = "host" if self.model.device.type == "cpu" else "GPU"
        steps = ("plain steps" if not self.depth else f"speculative rounds {self.depth} deep"
                 if self.choice is None else f"speculative rounds up to {self.depth} deep or plain steps, whichever "
                 "is fastest at its size")
        return (f"up to {self.slots} requests at once in {steps}, their caches {(dev or host) / 2**30:.2f} GiB of "
                f"{where} memory ({self.runners[0].opts.capacity:,} tokens each)")

    def generate(self, prompt: list[int], max_tokens: int, *, sampler: Sampler | None = None,
                 stop_ids: set[int] | None = None, on_token: Callable[[int], None] | None = None,
                 logprobs: Logprobs | None = None, prompt_logprobs: Logprobs | None = None) -> Generation:
        """Engine.generate's contract, decoded in the batch (blocks until the request ends; an exception
        raised by `on_token` ends the request and is raised here)."""
        e = self.engine
        e.check_request(prompt, max_tokens, scoring=prompt_logprobs is not None)
        sampler = sampler or Sampler()
        if sampler.grammar is not None and not set(sampler.grammar.ends) <= set(stop_ids or ()):
            raise ValueError(f"a grammar's output ends on token ids {sampler.grammar.ends}: they must be stop ids")
        sampler.begin(prompt, self.model.cfg.vocab_size, self.model.device)
        job = _Job(list(prompt), sampler, RequestState(max_tokens, stop_ids or set(), on_token, None, logprobs,
                                                   prompt_logprobs, sampler.grammar))
        with self._cv:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._waiting.append(job)
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def generate_all(self, prompts: list[list[int]], max_tokens: int, **kw: object) -> list[Generation]:
        """`generate` for every prompt at once (a thread each; `kw` as generate takes it, for all), in order."""
        out: list[Generation | BaseException | None] = [None] * len(prompts)

        def one(i: int) -> None:
            try:
                out[i] = self.generate(prompts[i], max_tokens, **kw)  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                out[i] = e
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g in out:
            if isinstance(g, BaseException):
                raise g
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread once the requests under way have ended; later `generate` calls raise."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    # ---- the batch thread ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._active or self._filling or self._closed):
                    self._cv.wait()
                if self._closed and not (self._waiting or self._active or self._filling):
                    return
                admit = []
                busy = self._active or self._filling
                if not busy and len(self._waiting) == 1 and self._alone_ok(self._waiting[0]):
                    alone = self._waiting.popleft()
                else:
                    alone = None
                    while self._waiting and len(self._active) + len(self._filling) + len(admit) < self.slots:
                        admit.append(self._waiting.popleft())
            with torch.inference_mode(), self.engine.runner.switches.apply():
                if alone is not None:
                    self._guarded(alone, self._decode_alone)
                for job in admit:
                    self._guarded(job, self._admit)
                if self._filling:  # one chunk a step: the sequences decoding wait a chunk, not a whole prompt
                    self._guarded(self._filling[0], self._prefill_chunk)
                if self._active:
                    self._step()

    def _alone_ok(self, job: _Job) -> bool:
        """Whether a request alone in the batcher decodes with the engine (its speculative rounds, or its pipelined
        plain steps, which a batch of one does not match: BENCHMARKS.md §9) (`_decode_alone`): when the request is
        greedy, or sampled by an engine that does not draft (a round's draws would depend on when another request
        arrived: the hand-over moves the rounds' boundaries; plain steps draw one token each, and the engine draws
        the next only after the host has emitted the last, so the batch goes on from the same draws), it asks for no
        log-probabilities (a round stopped midway leaves their queue half read), and the engine's caches hold as
        much of its prompt as a slot does (a conversation's next turn goes on in the slot that decoded its last,
        rather than prefilling again)."""
        r = job.req
        if not ((job.sampler.greedy or not self.engine.opts.draft) and r.logprobs is None
                and r.prompt_logprobs is None):
            return False
        return self.engine.cached_prefix(job.prompt) >= self._free_slot(job.prompt, reuse=True)[1]

    def _decode_alone(self, job: _Job) -> None:
        """A request alone decodes with the engine (speculative rounds or plain steps, its prefix cache), and keeps
        the speed of `--max-batch 1`. When another request arrives, it yields after its next emitted token: it goes
        on in the batch, its prompt and output so far prefilled in a slot (the same tokens: greedy speculation equals
        plain decoding, and a sampled request's draws go on where the engine's stopped)."""
        req, emitted = job.req, []
        job.t0 = time.perf_counter()

        def on_token(t: int) -> None:
            if not emitted:
                job.t1 = time.perf_counter()
                job.prefill_s = job.t1 - job.t0
            emitted.append(t)
            if req.on_token is not None:
                req.on_token(t)
            if self._waiting and t not in req.stop_ids and len(emitted) < req.max_tokens:
                raise _Yield

        try:
            g = self.engine.generate(job.prompt, req.max_tokens, sampler=job.sampler, stop_ids=req.stop_ids,
                                     on_token=on_token, counters=req.stats)  # its rounds' counts go on in the batch
        except _Yield:
            req.out.extend(emitted)  # streamed and consumed by the grammar already
            job.tok = emitted[-1]
            self._take_slot(job, job.prompt + emitted[:-1], reuse=True)
            run = self.runners[job.slot]
            with run.prefill_scope():  # at once: the request that arrived waits for it
                _, H = prefill_chunks(run, job.ids, self.engine.prefill_chunk, job.filled, None, draft=self.depth > 0)
            self._active[job.slot] = job
            self._start_drafting(job, H)
            return
        job.result = g
        job.done.set()

    def _guarded(self, job: _Job, fn: Callable[[_Job], None]) -> None:
        """fn(job); an exception (a client gone, a bad grammar state, out of memory) ends that request alone."""
        try:
            fn(job)
        except BaseException as e:  # noqa: BLE001 - handed to the request's own thread
            self._finish(job, error=e)

    def _free_slot(self, prompt: list[int], reuse: bool) -> tuple[int, int]:
        """A free slot for `prompt` -> (slot, prompt tokens it holds): one whose sequence the prompt goes on from,
        the longest, else the emptiest."""
        taken = {j.slot for j in self._active.values()} | {j.slot for j in self._filling}
        free = [s for s in range(self.slots) if s not in taken]
        best, kept = min(free, key=lambda s: self.runners[s].n_tokens), 0
        for s in free:
            r = self.runners[s]
            n = r.n_tokens
            if reuse and kept < n < len(prompt) and r.history == prompt[:n]:
                best, kept = s, n
        return best, kept

    def _admit(self, job: _Job) -> None:
        """Give the job a slot (the one that holds the most of its prompt) and queue its prompt's prefill."""
        job.t0 = time.perf_counter()
        self._take_slot(job, job.prompt, reuse=job.req.prompt_logprobs is None)
        self._filling.append(job)

    def _prefill_chunk(self, job: _Job) -> None:
        """One prefill step of the first job in line; after its prompt's last, it emits its first token and joins
        the batch (unless that token ends it)."""
        req, ids = job.req, job.ids
        assert ids is not None
        run = self.runners[job.slot]
        step = self.engine.prefill_rows(scored=req.prompt_logprobs is not None)
        end = min(job.filled + step, len(ids))
        with run.prefill_scope():
            logits, H = prefill_chunks(run, ids, step, job.filled, req.prompt_logprobs, draft=self.depth > 0,
                                       end=end)
        job.filled = end
        if end < len(ids):
            return
        self._filling.popleft()
        self._active[job.slot] = job
        if not req.max_tokens:  # the prompt scored alone
            self._finish(job)
            return
        self._emit(job, logits[-1:])
        if self._is_active(job):
            self._start_drafting(job, H)
        job.prefill_s = time.perf_counter() - job.t0
        job.t1 = time.perf_counter()

    def _start_drafting(self, job: _Job, H: torch.Tensor | None) -> None:
        """When the batch drafts: the draft head's step over the job's first token (emitted, not yet run) is left to
        the next round (`_refresh_heads`, for every new job at once), H the residual of the position before it (the
        prompt's last), as the engine's first round starts."""
        if self.depth:
            assert H is not None
            job.head, job.last_x = None, H.clone()

    def _take_slot(self, job: _Job, tokens: list[int], reuse: bool) -> None:
        """A free slot for the job (the one that holds the most of `tokens`, with `reuse`), its sequence cut to
        what `tokens` share with it; the rest of `tokens` is left to prefill."""
        job.slot, job.cached = self._free_slot(tokens, reuse=reuse)
        self.runners[job.slot].begin_request(job.cached)
        job.ids, job.filled = torch.tensor(tokens, dtype=torch.long), job.cached

    def _emit(self, job: _Job, logits: torch.Tensor, tok: int | None = None) -> None:
        """Emit the job's next token: `tok` (a plain greedy pick made already), else picked from its logits row
        [1, V] by its sampler; the job ends when that token ends it."""
        sampler, req = job.sampler, job.req
        if tok is None:
            nxt = sampler.sample(sampler.target(logits))
            sampler.count(nxt)
            if req.logprobs is not None:
                req.logprobs.queue(logits, nxt, wait=True)
            tok = int(nxt[0])
        job.tok = tok
        if req.emit(tok):
            self._finish(job)

    def _step(self) -> None:
        """Every active job's next token(s): a speculative round (`_spec_round`) when the batch drafts now, else a
        plain step. A plain step was launched ahead by the last call (`_ahead`), or is launched now from the tokens
        the host holds. When its rows are all plain greedy (no rules, grammar, log-probabilities or sampling), the
        step that consumes their picks is launched before the host reads them, as the engine's plain decoding does
        (runner.Readback): the read waits for this step only, and the host's work for it overlaps the next."""
        t0, mark, n, depth = time.perf_counter(), self._first_uses(), len(self._active), self._depth_now()
        if depth and self._ahead is None:
            self._spec_round(depth)
            return
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            jobs = _by_slot(self._active.values())
            out = self._launch(jobs, torch.tensor([j.tok for j in jobs], dtype=torch.long))
            if out is None:
                return
            logits = out[0]
            for job in jobs:  # the rows of tokens emitted already
                self._guarded(job, lambda j: self.runners[j.slot].keep(1, rollback=False))
            jobs = [j for j in jobs if self._is_active(j)]
        else:
            jobs, logits = ahead
        if not depth and all(_plain_greedy(j) for j in self._active.values()):  # (a round next: none ahead)
            self._emit_launching_next(jobs, logits)
        else:
            plain = [k for k, j in enumerate(jobs) if _plain_greedy(j)]
            picks = dict(zip(plain, argmax_rows(logits[plain]).tolist(), strict=True)) if plain else {}
            for k, job in enumerate(jobs):
                self._guarded(job, lambda j, k=k: self._emit(j, logits[k:k + 1], picks.get(k)))
        if not depth:  # (a pass that only reads the step launched ahead, before a round, is not a step's time)
            self._timed(n, 0, t0, mark)

    def _depth_now(self) -> int:
        """The depth of this pass's step (0: a plain step): the batch's when it always drafts or a job is not greedy
        (a sampled one's draws would depend on when and how deep the batch drafted), else the one that the measured
        rates choose at this batch size."""
        if not self.depth or self.choice is None or not all(j.sampler.greedy for j in self._active.values()):
            return self.depth
        return self.choice.choose(len(self._active))

    def _first_uses(self) -> int:
        """The batch's steps run eagerly so far for a reason that passes: a shape's first use, or its capture
        (runner._run); a shape left eager at the graph limit stays so, and its time is the step's."""
        st = self.runners[0].graph_stats
        return st.eager - st.eager_reasons.get(EAGER_AT_LIMIT, 0)

    def _timed(self, n: int, depth: int, t0: float, mark: int, accepted: Sequence[int] = ()) -> None:
        """A pass of n sequences at `depth` that began at t0 (`mark`: _first_uses then): its time, a sample of the
        depth's unless a shape ran eagerly for the first time or was captured in it (then only its acceptance
        counts: a capture's seconds would hold a depth back for a cost it paid once)."""
        seconds = time.perf_counter() - t0
        self.steps.timed((n, depth), seconds)
        if self.choice is not None:
            self.choice.observe(n, depth, seconds if self._first_uses() == mark else None, accepted)

    def _write_head_rows(self, jobs: list[_Job], tokens: torch.Tensor) -> None:
        """Before a plain step in a batch that drafts: the draft heads' K/V cells of the rows it runs (each job's
        token, with the residual of the position before it), so that a later round drafts from a current head; the
        heads' logits are left to that round (`_refresh_heads`). Every job's, also where a round's extend wrote the
        row already: one step shape (and graph) per set of slots, not per subset of them."""
        slots = [j.slot for j in jobs]
        H = torch.cat([j.last_x for j in jobs])  # type: ignore[misc]  # set with every token left to run
        self.steps.draft(slots, [self.runners[s].n_tokens for s in slots], tokens.to(self.model.device), H, None,
                         write_only=True)

    def _emit_launching_next(self, jobs: list[_Job], logits: torch.Tensor) -> None:
        """Greedy picks of `jobs`' rows, the next step launched on them (for the jobs that may go on, and those that
        joined since) before they are read; then each emitted, and each row of the next step kept, or dropped where
        its token ended the job (the next call reads that step: `_ahead`)."""
        picks = argmax_rows(logits)
        self.reader.start(picks)
        go = [k for k, j in enumerate(jobs) if len(j.req.out) + 1 < j.req.max_tokens]  # else this pick ends it
        joined = _by_slot(j for j in self._active.values() if j not in jobs)  # their first token is on the host
        nxt = jobs_next = None
        if go or joined:
            jobs_next = [jobs[k] for k in go] + joined
            tokens = torch.cat([picks[torch.tensor(go, dtype=torch.long, device=picks.device)],
                                torch.tensor([j.tok for j in joined], dtype=torch.long, device=picks.device)])
            launched = self._launch(jobs_next, tokens)
            nxt = None if launched is None else launched[0]
        toks = self.reader.result()
        for k, job in enumerate(jobs):
            if self._is_active(job):
                self._guarded(job, lambda j, k=k: self._emit(j, None, toks[k]))
        if nxt is None or jobs_next is None:
            return
        alive = []
        for r, job in enumerate(jobs_next):
            if self._is_active(job):
                self._guarded(job, lambda j: self.runners[j.slot].keep(1, rollback=False))
                if self._is_active(job):
                    alive.append(r)
            elif job.error is None:  # ended by the token it consumed: its row goes (a failed job's slot was reset)
                self.runners[job.slot].keep(0, rollback=True)
        if alive:
            self._ahead = ([jobs_next[r] for r in alive], nxt if len(alive) == len(jobs_next) else nxt[alive])

    def _launch(self, jobs: list[_Job], tokens: torch.Tensor, rows: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step of `rows` rows for each job (tokens on the host or the device, a job's rows together) -> its
        logits and residuals; None when it failed, which ends every one of those jobs with the error (the thread
        goes on)."""
        def step() -> tuple[torch.Tensor, torch.Tensor]:
            plain_in_rounds = self.depth and rows == 1  # a batch that drafts, decoding plainly at this size
            if plain_in_rounds:
                self._write_head_rows(jobs, tokens)
            out = self.steps.run([j.slot for j in jobs], tokens, rows)
            if plain_in_rounds:
                X = out[1].clone()  # a replay may reuse the step's memory before the next rows' heads take these
                for k, job in enumerate(jobs):
                    job.head, job.last_x = None, X[k:k + 1]
            return out
        return self._all_or_none(jobs, step)

    # ---- speculative rounds (an engine that drafts) --------------------------------------------------------------
    def _spec_round(self, d: int) -> None:
        """A speculative round of every active job d deep, as the engine's rounds at that depth are. The draft
        head's steps run every sequence's rows at once (each on its own head cache): d - 1 chained draft steps,
        then after the batched verify step and each job's acceptance on the device (greedy prefix match, or
        speculative sampling), one extend over every sequence's committed rows; one read-back for all of them;
        then each emits its tokens and rolls its caches back to them."""
        t0, mark = time.perf_counter(), self._first_uses()
        jobs = _by_slot(self._active.values())
        self.rounds += 1
        drafts = self._all_or_none(jobs, lambda: self._draft(jobs, d))
        if drafts is None:
            return
        dev = self.model.device
        tokens = torch.cat([torch.cat([upload([j.tok], dev), drafts[j.slot][0]]) for j in jobs])
        out = self._launch(jobs, tokens, rows=d + 1)
        if out is None:
            return
        v_logits, vX = out
        rows = {j.slot: slice(i * (d + 1), (i + 1) * (d + 1)) for i, j in enumerate(jobs)}
        # every job's reads of the verify logits are queued before the extend's replay, which may reuse their memory
        accepted = self._each(jobs, lambda j: self._accept(j, drafts[j.slot], v_logits[rows[j.slot]], d))
        live = [j for j in jobs if self._is_active(j)]
        heads = self._all_or_none(live, lambda: self._extend(live, accepted, torch.cat([vX[rows[j.slot]]
                                                                                         for j in live]), d))
        counts: list[int] = []  # the drafts each sequence accepted
        if heads is not None and live:
            self.reader.start(torch.cat([t for j in live for t in (drafts[j.slot][0], *accepted[j.slot][:2])]))
            read = self.reader.result()
            counts = [read[i * (d + 2) + d] for i in range(len(live))]
            for i, job in enumerate(live):
                got = read[i * (d + 2):(i + 1) * (d + 2)]
                self._guarded(job, lambda j, g=got: self._commit(j, g[:d], g[d], g[d + 1], heads[j.slot]))
        self._timed(len(jobs), d, t0, mark, counts)

    def _refresh_heads(self, jobs: list[_Job]) -> None:
        """The draft head's step over the last emitted token of each job whose head is not current (a new job, or
        one after plain steps): at its position, with the residual of the position before (`last_x`), as the
        engine's first round starts; one step for all of them. The current heads stay as their rounds left them,
        so that a job's rounds are the ones it would run alone (a subset's step shape seldom recurs, and then runs
        eagerly rather than taking a graph: Runner._run)."""
        stale = [j for j in jobs if j.head is None]
        if not stale:
            return
        slots = [j.slot for j in stale]
        tokens = upload([j.tok for j in stale], self.model.device)
        H = torch.cat([j.last_x for j in stale])  # type: ignore[misc]  # set with every token left to run
        logits, X = self.steps.draft(slots, [self.runners[s].n_tokens for s in slots], tokens, H,
                                     self.engine.draft_lm_head)
        logits, X = logits.clone(), X.clone()  # kept until the draft chain, after other replays
        for k, job in enumerate(stale):
            job.head = logits[k:k + 1], X[k:k + 1]

    def _each(self, jobs: list[_Job], fn: Callable[[_Job], _T]) -> dict[int, _T]:
        """fn(job) for each job still active, by slot; one that raises ends that job alone (`_guarded`)."""
        out: dict[int, _T] = {}
        for job in jobs:
            if self._is_active(job):
                self._guarded(job, lambda j: out.__setitem__(j.slot, fn(j)))
        return out

    def _all_or_none(self, jobs: list[_Job], fn: Callable[[], _T]) -> _T | None:
        """fn(), a step of all the jobs' rows; None when it raised, which ends every one of them with the error."""
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - handed to each request's own thread
            for job in jobs:
                self._finish(job, error=e)
            return None

    def _draft(self, jobs: list[_Job], d: int
               ) -> dict[int, tuple[torch.Tensor, list[torch.Tensor], list[int] | None]]:
        """Every job's d drafts, the head's steps over all of them at once: draft 1 from each head's logits over the
        job's last token, each next one from a head step on the one before (at positions L + 1..), as the engine's
        chain drafts them -> by slot: (drafts [d] on the device, their distributions when sampling, the drafts on
        the host when a grammar masks its verify rows)."""
        self._refresh_heads(jobs)
        slots = [j.slot for j in jobs]
        logits = torch.cat([j.head[0] for j in jobs])  # type: ignore[index]
        X = torch.cat([j.head[1] for j in jobs])  # type: ignore[index]
        picks: list[torch.Tensor] = []
        dists: list[list[torch.Tensor | None]] = []
        for i in range(d):
            if i:
                logits, X = self.steps.draft(slots, [self.runners[s].n_tokens + i for s in slots], picks[-1], X,
                                             self.engine.draft_lm_head)
            t, q = _pick_drafts(jobs, logits)  # before the next step's replay may reuse the logits' memory
            picks.append(t)
            dists.append(q)
        D = torch.stack(picks, 1)  # [B, d]
        out = {}
        for k, job in enumerate(jobs):
            q_rows = [] if job.sampler.greedy else [q[k] for q in dists]
            out[job.slot] = D[k], q_rows, D[k].tolist() if job.sampler.constrained else None
        return out  # type: ignore[return-value]

    def _accept(self, job: _Job, drafted: tuple[torch.Tensor, list[torch.Tensor], list[int] | None],
                v_logits: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The job's acceptance on the device over its verify rows -> (k [1], the next token [1], the committed rows
        padded, as accept_on_device gives them); its log-probability rows queued."""
        drafts, q_rows, host = drafted
        forced = forced_accept(self.engine.hooks.accept_hook, job.req, d)  # a benchmark's replayed count
        k, nxt, ext = accept_on_device(job.sampler, v_logits, drafts, q_rows, host, forced)
        if job.req.logprobs is not None:  # row i emits ext[i]; the read-back's wait covers their copy
            job.req.logprobs.queue(v_logits, ext, wait=False)
        return k, nxt, ext

    def _extend(self, jobs: list[_Job], accepted: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                vX: torch.Tensor, d: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The draft heads over every job's committed rows (padded to d + 1, at positions L + 1..; the target's
        residuals vX), in one step -> by slot: each head's logits and residual at its accepted row, which the next
        round drafts from (copied: a later replay may reuse the step's memory), and the target's residual there (of
        the position before the next token)."""
        d1 = d + 1
        slots = [j.slot for j in jobs]
        ext = torch.cat([accepted[s][2] for s in slots])
        pick = torch.cat([accepted[s][0] + k * d1 for k, s in enumerate(slots)])
        logits, X = self.steps.draft(slots, [self.runners[s].n_tokens + 1 for s in slots], ext, vX,
                                     self.engine.draft_lm_head, rows=d1, pick=pick)
        logits, X, last = logits.clone(), X.clone(), vX.index_select(0, pick)
        return {s: (logits[k:k + 1], X[k:k + 1], last[k:k + 1]) for k, s in enumerate(slots)}

    def _commit(self, job: _Job, drafts: list[int], k: int, nxt: int,
                head: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Emit the round's tokens (the accepted drafts and the next token, as many as the request takes) and keep
        their rows in the slot's caches, the rest rolled back; the job ends when one of them ends it."""
        req, run = job.req, self.runners[job.slot]
        committed = drafts[:k] + [nxt]
        n_emit, ends = req.emits(committed)
        req.emit_round(committed[:n_emit], None)
        run.keep(min(k + 1, n_emit), rollback=True)  # the verify rows of the token before and the emitted drafts
        req.stats.record(len(drafts), k, len(committed))
        req.rounds_log.append({"accepted": k})  # (an accept hook counts the request's rounds by it)
        if ends:
            self._finish(job)
        else:
            job.tok, job.head, job.last_x = nxt, head[:2], head[2]

    def _is_active(self, job: _Job) -> bool:
        return self._active.get(job.slot) is job

    def _finish(self, job: _Job, error: BaseException | None = None) -> None:
        """End the job: its slot is free again (its sequence kept for a prompt that goes on from it, unless the
        request failed), its caller woken with the result or the error."""
        if self._active.get(job.slot) is job:
            del self._active[job.slot]
        if job in self._filling:  # by identity
            self._filling.remove(job)
        if error is not None:
            job.error = error
            if job.slot >= 0:
                self.runners[job.slot].reset()  # whatever step was under way: nothing of it is reused
        else:
            req, now = job.req, time.perf_counter()
            decode_s = now - job.t1 if job.t1 else 0.0
            prefill_s = job.prefill_s or now - job.t0
            reason = "stop token" if req.out and req.out[-1] in req.stop_ids else "max tokens"
            job.result = Generation(req.out, len(job.prompt), prefill_s, decode_s, req.stats, reason,
                                    cached_tokens=job.cached)
        job.done.set()


def _by_slot(jobs: Iterable[_Job]) -> list[_Job]:
    return sorted(jobs, key=lambda j: j.slot)


def _plain_greedy(job: _Job) -> bool:
    s = job.sampler
    return s.greedy and not s.ruled and not s.constrained and job.req.logprobs is None


def _pick_drafts(jobs: list[_Job], logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Each job's draft from its row of the head's logits [B, V]: the argmax, or its sampler's draw -> (the drafts
    [B], each sampling job's distribution [1, V])."""
    if all(j.sampler.greedy for j in jobs):
        return argmax_rows(logits), [None] * len(jobs)
    toks, dists = [], []
    for k, job in enumerate(jobs):
        row = logits[k:k + 1]
        q = None if job.sampler.greedy else job.sampler.probs(row)
        dists.append(q)
        toks.append(argmax_rows(row) if q is None else job.sampler.sample_probs(q))
    return torch.cat(toks), dists
