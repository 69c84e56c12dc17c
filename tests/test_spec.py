"""MTP speculative decoding: greedy output equals plain decoding, rollback restores every state exactly."""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Callable

import pytest
import torch
from conftest import build_model, tiny_config

from qspec.engine import Engine, EngineHooks, EngineOptions, accepted_on_device, cells_needed
from qspec.model import ops
from qspec.model.model import Model
from qspec.runner import ContextError, Readback, Runner
from qspec.spec.accept import Sampler, greedy_accept, speculative_accept_on_device

CAP = 128


def plain(model: Model, prompt: list[int], n: int, **kw: object) -> list[int]:
    return Engine(model, EngineOptions(draft=0, capacity=CAP, exact=True, **kw)).generate(prompt, n).tokens


def oracle_hook(reference: list[int], rng: random.Random, vocab: int):
    """Drafts = the reference continuation, corrupted at a random position (or not at all), so every
    acceptance length occurs even though a random MTP head never guesses right."""
    def hook(n_out: int, drafts: list[int]) -> list[int]:
        good = reference[n_out:n_out + len(drafts)]
        good += [0] * (len(drafts) - len(good))
        cut = rng.randint(0, len(drafts))
        if cut < len(drafts):
            good[cut] = (good[cut] + 1 + rng.randrange(vocab - 1)) % vocab
        return good
    return hook


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4, 5, 6, 7, 8])
def test_greedy_spec_equals_plain(tiny_model: Model, n_draft: int) -> None:
    rng = random.Random(n_draft)
    # prompts crossing QSA block boundaries and the start of sparse selection (budget 16 + r - 1 = 19)
    for plen in (3, 17, 18 + n_draft):
        prompt = [rng.randrange(511) for _ in range(plen)]
        ref = plain(tiny_model, prompt, 40)
        eng = Engine(tiny_model, EngineOptions(draft=n_draft, capacity=CAP, exact=True),
                     EngineHooks(draft_hook=oracle_hook(ref, rng, 512)))
        g = eng.generate(prompt, 40)
        assert g.tokens == ref
        s = g.spec
        assert s.accepted + s.rejected == s.drafted == n_draft * s.rounds
        assert s.tokens == s.accepted + s.rounds
        # acceptance was exercised at several depths, rejections too
        assert 0 < s.accepted < s.drafted


def test_natural_greedy_spec_without_hooks(tiny_model: Model) -> None:
    prompt = list(range(5, 30))
    ref = plain(tiny_model, prompt, 30)
    for n in (1, 3):
        assert Engine(tiny_model, EngineOptions(draft=n, capacity=CAP, exact=True)).generate(prompt, 30).tokens == ref


def teacher_forced_state(model: Model, tokens: list[int], n_slots: int) -> dict[str, torch.Tensor]:
    """Plain one-token decoding of `tokens` (after a prefill of the first one), in row-exact mode."""
    run = Runner(model, EngineOptions(draft=n_slots - 1, capacity=CAP).cache_options())
    with ops.row_exact_mode(True):
        run.step(torch.tensor(tokens[:1]))
        run.keep(1, rollback=False)
        for t in tokens[1:]:
            run.step(torch.tensor([t]))
            run.keep(1, rollback=False)
    return run.committed_state()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_state_after_forced_rounds_equals_plain_decoding(tiny_model: Model, seed: int) -> None:
    rng = random.Random(seed)
    N = 5
    prompt = [rng.randrange(511)]
    eng = Engine(tiny_model, EngineOptions(draft=N, capacity=CAP, exact=True),
                 EngineHooks(accept_hook=lambda r, n: rng.randint(0, n)))
    g = eng.generate(prompt, 45 + seed * 7)
    hist = eng.runner.history
    assert len(hist) == eng.runner.n_tokens and hist == (prompt + g.tokens)[:len(hist)]
    got = eng.runner.committed_state()
    want = teacher_forced_state(tiny_model, hist, N + 1)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_draft_needs_mtp_weights() -> None:
    model = build_model(tiny_config(mtp=False))
    with pytest.raises(ValueError, match="MTP"):
        Engine(model, EngineOptions(draft=3))
    Engine(model, EngineOptions(draft=0))


def test_bad_depth_and_context(tiny_model: Model) -> None:
    with pytest.raises(ValueError, match="draft must be in 0..8"):
        Engine(tiny_model, EngineOptions(draft=9))
    eng = Engine(tiny_model, EngineOptions(draft=2, capacity=32))
    with pytest.raises(ContextError, match="more than the context capacity 32"):
        eng.generate(list(range(30)), 8)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], 8)
    with pytest.raises(ValueError, match="token id 512, outside the vocabulary of 512"):
        eng.generate([1, 512], 4)
    with pytest.raises(ValueError, match="token id -1"):
        eng.check_request([-1], 4)
    # the Python API's types: a list of ints, an int max_tokens
    with pytest.raises(TypeError, match=r"must be a list of token ids, got Tensor \(tensor.tolist\(\) gives one\)"):
        eng.generate(torch.tensor([1, 2]), 4)
    with pytest.raises(TypeError, match="must be a list of token ids, got str"):
        eng.generate("hello", 4)
    with pytest.raises(TypeError, match=r"token ids must be integers, got 1.5 \(float\)"):
        eng.generate([1, 1.5], 4)
    with pytest.raises(TypeError, match="max_tokens must be an integer, got True"):
        eng.generate([1, 2], True)


def test_sampling_is_seeded_and_stops(tiny_model: Model) -> None:
    from qspec.spec.accept import Sampler

    def run(n: int, host: bool = False) -> list[int]:
        s = Sampler(temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(3))
        # an identity draft hook takes the host round (drafts read on the host, then accepted)
        hook = (lambda n_out, d: d) if host else None
        eng = Engine(tiny_model, EngineOptions(draft=n, capacity=CAP), EngineHooks(draft_hook=hook))
        return eng.generate(list(range(1, 9)), 12, sampler=s).tokens

    a, b = run(3), run(3)
    assert a == b and len(a) == 12
    h = run(3, host=True)
    assert h == run(3, host=True) and len(h) == 12
    ref = plain(tiny_model, list(range(1, 9)), 40)
    stop = ref[5]
    g = Engine(tiny_model, EngineOptions(draft=4, capacity=CAP, exact=True),
               EngineHooks(draft_hook=oracle_hook(ref, random.Random(0), 512)))
    out = g.generate(list(range(1, 9)), 40, stop_ids={stop})
    assert out.tokens == ref[:ref.index(stop) + 1] and out.stop_reason == "stop token"


def test_sample_probs_follows_the_distribution() -> None:
    """The on-device draw (exponential race) picks token i with probability p_i, never a zero-probability token."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    T = 40000
    draws = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0)).sample_probs(p.expand(T, 5))
    assert draws.shape == (T,) and draws.dtype == torch.long
    freq = torch.bincount(draws, minlength=5).double() / T
    assert freq[4] == 0
    assert ((freq - p.double()).abs() <= 4 * (p.double() * (1 - p.double()) / T).sqrt() + 1e-9).all(), freq


def test_speculative_accept_keeps_the_target_distribution() -> None:
    """Drafts drawn from q, accepted or replaced by speculative sampling: each committed position follows the
    target's p, not q (the first position always; the second in the rounds that reach it)."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.3, 0.3, 0.2, 0.2]])
    s = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(1))
    T = 20000
    first, second = torch.zeros(4), torch.zeros(4)
    drafts = torch.stack([s.sample_probs(q[0].expand(T, 4)), s.sample_probs(q[1].expand(T, 4))], 1).tolist()
    for d in drafts:
        kt, nt = speculative_accept_on_device(torch.tensor(d), q, p, s)
        k, nxt = int(kt), int(nt)
        committed = d[:k] + [nxt]
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        n = counts.sum()
        assert n > T / 10
        sigma = (target * (1 - target) / n).sqrt()
        assert ((counts / n - target).abs() <= 4 * sigma).all(), (counts / n, target)


def test_sampled_decoding_equals_a_step_by_step_loop(tiny_model: Model) -> None:
    """Sampled plain decoding is pipelined like greedy (each step's input drawn on the device before the host reads
    it): its tokens equal a loop that reads every draw before running the next step, from the same seed."""
    prompt = list(range(3, 20))

    def sampler() -> Sampler:
        return Sampler(temperature=0.9, top_p=0.95, generator=torch.Generator().manual_seed(5))

    got = Engine(tiny_model, EngineOptions(capacity=CAP)).generate(prompt, 16, sampler=sampler()).tokens
    ref_engine = Engine(tiny_model, EngineOptions(capacity=CAP))
    run, s = ref_engine.runner, sampler()
    with torch.inference_mode():
        logits, _ = ref_engine._prefill(prompt, 0)
        out = [int(s.sample(logits[-1]).item())]
        while len(out) < 16:
            logits, _ = run.step(torch.tensor([out[-1]]))
            run.keep(1, rollback=False)
            out.append(int(s.sample(logits[-1]).item()))
    assert got == out
    assert len(set(got)) > 3  # sampled, not a constant stream


@pytest.mark.parametrize("n_draft", [0, 3])
def test_stop_token_leaves_exact_state(tiny_model: Model, n_draft: int) -> None:
    """Greedy decoding queues the step for a token before reading that token; when it is a stop token the queued
    step is discarded (keep 0 rows), and the caches hold exactly the emitted tokens, as plain decoding leaves them."""
    prompt = [7]  # one token: a longer prefill's GDN chunking rounds differently from one-token steps
    ref = plain(tiny_model, prompt, 30)
    stop = ref[7]
    eng = Engine(tiny_model, EngineOptions(draft=n_draft, capacity=CAP, exact=True))
    g = eng.generate(prompt, 30, stop_ids={stop})
    assert g.tokens == ref[:ref.index(stop) + 1] and g.stop_reason == "stop token"
    hist = eng.runner.history
    assert hist == (prompt + g.tokens)[:len(hist)] and len(hist) == eng.runner.n_tokens
    got, want = eng.runner.committed_state(), teacher_forced_state(tiny_model, hist, n_draft + 1)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert eng.generate(prompt, 30).tokens == ref  # and the engine serves the next request from a clean start


def test_discarded_step_leaves_no_trace(tiny_model: Model) -> None:
    """keep(0) undoes a step: running other tokens after it gives the state of never having run it (the recurrent
    ping-pong half, cells and pooled-key records all roll back)."""
    rng = random.Random(5)
    tokens = [rng.randrange(511) for _ in range(23)]
    run = Runner(tiny_model, EngineOptions(draft=2, capacity=CAP).cache_options())
    with ops.row_exact_mode(True):
        for i, t in enumerate(tokens):
            if i % 3 == 2:  # a step for a token that is then dropped, e.g. one that ended a request
                run.step(torch.tensor([(t + 1) % 511]))
                run.keep(0, rollback=True)
            rec = run.cache.rec  # invariant: the live plane is in the half the last kept step wrote
            assert 0 <= int(rec.live) - rec.host_base < rec.n_slots
            run.step(torch.tensor([t]))
            run.keep(1, rollback=False)
    assert run.history == tokens
    want = teacher_forced_state(tiny_model, tokens, 3)
    got = run.committed_state()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with pytest.raises(ValueError, match="keep 0 rows"):
        run.step(torch.tensor([1]))
        run.keep(0, rollback=False)


def test_draft_step_one_row_equals_that_row(tiny_model: Model) -> None:
    """mtp_step(row=k), which the draft extend uses, gives row k of the full step's logits and residual, and
    writes every row's K/V cells; mtp_write_kv writes the same cells."""
    run = Runner(tiny_model, EngineOptions(draft=3, capacity=CAP).cache_options())
    with ops.row_exact_mode(True):
        _, X = run.step(torch.tensor([5, 9, 2, 7, 1, 3]))
        run.keep(6, rollback=False)
        rows = torch.tensor([9, 2, 7, 1, 3, 3])
        logits, Y = run.mtp_step(rows, X, 1)
        kv = run.cache.mtp_kv
        cells = kv.k[1:7].clone(), kv.v[1:7].clone()
        for k in (0, 2, 5):
            kv.k[1:7], kv.v[1:7] = 0, 0
            lk, yk = run.mtp_step(rows, X, 1, row=k)
            assert torch.equal(lk, logits[k:k + 1]) and torch.equal(yk, Y[k:k + 1])
            # every row wrote its K/V cells, though only row k went on through the MoE
            assert torch.equal(kv.k[1:7], cells[0]) and torch.equal(kv.v[1:7], cells[1])
        kv.k[1:7], kv.v[1:7] = 0, 0
        run.mtp_write_kv(rows, X, 1)  # a plain stretch's catch-up: the same cells, nothing after the attention
        assert torch.equal(kv.k[1:7], cells[0]) and torch.equal(kv.v[1:7], cells[1])
    with pytest.raises(ValueError, match="row 6 of a 6-row"):
        run.mtp_step(rows, X, 1, row=6)


def test_draft_chain_equals_its_steps(tiny_model: Model) -> None:
    """mtp_chain (the greedy draft chain as one step sequence, one CUDA graph on the GPU) gives the tokens, the last
    residual and the head's K/V cells of n mtp_step calls, each fed the previous step's argmax."""
    run = Runner(tiny_model, EngineOptions(draft=5, capacity=CAP).cache_options())
    _, X = run.step(torch.tensor([5, 9, 2, 7]))
    run.keep(4, rollback=False)
    run.mtp_step(torch.tensor([9, 2, 7]), X[:3], 1)
    kv = run.cache.mtp_kv
    tok, H = torch.tensor([11]), X[3:]
    toks, h = run.mtp_chain(tok, H, 4, 4)
    cells = kv.k[:9].clone(), kv.v[:9].clone()
    kv.k[4:9], kv.v[4:9] = 0, 0
    want = []
    for i in range(4):
        logits, H = run.mtp_step(tok, H, 4 + i)
        tok = logits[-1:].argmax(-1)
        want.append(int(tok))
    assert toks.tolist() == want and torch.equal(h, H)
    assert torch.equal(kv.k[:9], cells[0]) and torch.equal(kv.v[:9], cells[1])
    # the first position on the device, under a larger bound (the bound only picks the KV buckets)
    kv.k[4:12], kv.v[4:12] = 0, 0
    toks_at, h_at = run.mtp_chain(torch.tensor([11]), X[3:], 7, 4, at=torch.tensor([4]))
    assert toks_at.tolist() == want and torch.equal(h_at, H) and torch.equal(kv.k[:9], cells[0])
    with pytest.raises(ContextError, match="beyond the capacity"):
        run.mtp_chain(tok, H, CAP - 2, 3)
    with pytest.raises(ValueError, match="at least one step"):
        run.mtp_chain(tok, H, 4, 0)


def test_draft_chain_straddling_a_bucket_is_one_graph(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain whose steps cross a KV bucket boundary attends over its last step's bucket: one graph key, the
    bucket above the boundary, and the tokens of the steps run one by one (each over its own bucket)."""
    from qspec.runner import KV_BUCKET

    run = Runner(tiny_model, EngineOptions(draft=5, capacity=2 * KV_BUCKET).cache_options())
    keys: list[tuple] = []

    def record(key: tuple, fn, inputs):  # type: ignore[no-untyped-def]
        keys.append(key)
        return fn(*inputs)

    monkeypatch.setattr(run, "_run", record)
    run.use_graphs = True
    L = KV_BUCKET - 2  # steps at positions L .. L + 3 end at L + 1 .. L + 4: two in each bucket
    _, X = run.step(torch.randint(0, 500, (L,), generator=torch.Generator().manual_seed(1)))
    run.keep(L, rollback=False)
    run.mtp_step(torch.randint(0, 500, (L - 1,), generator=torch.Generator().manual_seed(2)), X[:L - 1], 1)
    keys.clear()
    tok, H = torch.tensor([11]), X[L - 1:]
    toks, _ = run.mtp_chain(tok, H, L, 4)
    assert keys == [("chain", 4, 2 * KV_BUCKET, False)]
    want = []
    for i in range(4):
        logits, H = run.mtp_step(tok, H, L + i)
        tok = logits[-1:].argmax(-1)
        want.append(int(tok))
    assert [k[2] for k in keys[1:]] == [KV_BUCKET, KV_BUCKET, 2 * KV_BUCKET, 2 * KV_BUCKET]
    assert toks.tolist() == want


def graphs_stubbed(model: Model, monkeypatch: pytest.MonkeyPatch, **kw: int) -> tuple[Runner, list[str], list[bool]]:
    """A Runner whose CUDA graph calls are stubbed, to check its graph policy on the CPU -> (the runner, each
    capture's error mode, whether the garbage collector was on at each capture)."""
    class FakeGraph:
        def replay(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    modes: list[str] = []
    gc_on: list[bool] = []

    def graph(g: object, pool: object = None, capture_error_mode: str = "global") -> contextlib.nullcontext[None]:
        modes.append(capture_error_mode)
        gc_on.append(gc.isenabled())  # entered after the runner turned the collector off
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    run = Runner(model, EngineOptions(draft=0, capacity=CAP).cache_options(), **kw)  # type: ignore[arg-type]
    run.use_graphs = True
    return run, modes, gc_on


def test_capture_meets_the_tensors_of_its_real_step(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape's second use runs the real step and then the capture on the same input buffers, so the compiled
    functions see identical tensors in both (a different storage offset would recompile, and inductor's
    autotuning synchronises, which a capture forbids: the H200 merge benchmark crashed that way)."""
    run, modes, gc_on = graphs_stubbed(tiny_model, monkeypatch)
    seen: list[list[torch.Tensor]] = []

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(list(xs))
        return xs[0] * 2, xs[0]

    flat = torch.arange(12)
    view = flat[5:8]  # a view with a storage offset, like the update lists' shared upload
    for _ in range(3):
        run._run(("k",), fn, [view])
    first, real, captured = seen
    assert first[0] is view  # first use: eager on the caller's tensors
    assert real[0] is captured[0] and real[0].storage_offset() == 0  # second use: one buffer for both
    assert run.graph_stats.captures == 1 and run.graph_stats.eager_reasons["second use: captured"] == 1
    assert modes == ["thread_local"]  # a weight load in another thread may allocate meanwhile (compile_ahead.py)
    assert gc_on == [False] and gc.isenabled()  # no collection inside a capture (pinned frees), back on after
    assert len(seen) == 3  # the third use replays
    # a step shape captured before, now in the next KV bucket (key[2]): captured on its first use
    seen.clear()
    run._run(("target", 1, 512, ()), fn, [view])
    run._run(("target", 1, 512, ()), fn, [view])
    run._run(("target", 1, 1024, ()), fn, [view])
    run._run(("target", 1, 1024, ()), fn, [view])
    assert len(seen) == 5  # 512: eager, then eager + capture; 1024: eager + capture, then a replay
    assert run.graph_stats.eager_reasons["new KV bucket: captured"] == 1 and run.graph_stats.captures == 3


def test_at_the_graph_limit_a_stale_graph_makes_room(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """At max_graphs, a shape that recurs takes the place of the least recently used graph if that one has not run
    in GRAPH_STALE_STEPS graphed steps (a server's batches move on to new sets of slots and KV buckets); a graph
    in use stays, and the new shape runs eagerly meanwhile."""
    import qspec.runner as runner_module

    monkeypatch.setattr(runner_module, "GRAPH_STALE_STEPS", 3)
    run, _, _ = graphs_stubbed(tiny_model, monkeypatch, max_graphs=2)
    calls: list[str] = []

    def fn_of(name: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(name)
            return x + 1, x
        return fn
    x = torch.zeros(2)
    for name in "AABBACC":  # A and B captured (steps 2, 4); C's second use at step 7: B last ran 3 steps before
        run._run((name,), fn_of(name), [x])
    assert set(run.graphs) == {("A", False), ("B", False)} and run.graph_stats.eager_reasons["graph limit reached"]
    run._run(("C",), fn_of("C"), [x])  # step 8: B last ran 4 steps before: dropped, C captured
    assert set(run.graphs) == {("A", False), ("C", False)} and run.graph_stats.evicted == 1
    calls.clear()
    for name in "BCA":  # step 9: A last ran at 5: dropped for B; 10: C replays; 11: B ran at 9, A runs eagerly
        run._run((name,), fn_of(name), [x])
    assert run.graph_stats.evicted == 2 and ("B", False) in run.graphs and ("A", False) not in run.graphs
    assert calls == ["B", "B", "A"]  # B: its real step and its capture (stubbed: it calls fn); A: eager
    assert run.graph_stats.captures == 4


@pytest.mark.parametrize("n_draft", [0, 3])
def test_phase_timing_changes_no_output(tiny_model: Model, n_draft: int) -> None:
    """time_phases (scripts/round_breakdown.py) synchronises at every phase boundary and charges each phase; the
    tokens stay those of an untimed run."""
    prompt = list(range(4, 30))
    plain_run = Engine(tiny_model, EngineOptions(draft=n_draft, capacity=CAP)).generate(prompt, 20)
    timed = Engine(tiny_model, EngineOptions(draft=n_draft, capacity=CAP), EngineHooks(time_phases=True)).generate(
        prompt, 20)
    assert timed.tokens == plain_run.tokens
    want = {"decode"} if not n_draft else {"draft", "verify", "accept+rollback", "draft extend"}
    assert set(timed.phases) == want and all(v > 0 for v in timed.phases.values())
    assert plain_run.phases == {}


def test_accepted_on_device_is_greedy_accept() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        pred = [rng.randrange(3) for _ in range(n + 1)]
        drafts = [rng.randrange(3) for _ in range(n)]
        got = accepted_on_device(torch.tensor(drafts), torch.tensor(pred))
        assert got.shape == (1,) and int(got) == greedy_accept(drafts, pred)


@pytest.mark.parametrize("forced", [False, True])
def test_extend_queued_on_device_equals_the_host_round(tiny_model: Model, forced: bool) -> None:
    """Greedy rounds queue the draft extend before the host reads the round, with the accepted length and the
    committed rows computed on the device, and the next round's draft chain right after the read-back, before the
    rollback. Each round's first draft logits (which the extend yields) and verify logits (whose rows are the
    chained drafts) equal those of the host round (an identity draft hook takes that path), bit for bit, whatever
    was accepted."""
    prompt = list(range(7, 40))

    def run(host: bool) -> object:
        hook = (lambda r, n: (3 * r + 1) % (n + 1)) if forced else None
        opts = EngineOptions(draft=4, capacity=CAP, exact=True)
        hooks = EngineHooks(record_logits=True, accept_hook=hook, draft_hook=(lambda n_out, d: d) if host else None)
        return Engine(tiny_model, opts, hooks).generate(prompt, 30)

    dev, host = run(False), run(True)
    assert dev.tokens == host.tokens and dev.rounds_log == host.rounds_log
    assert len(dev.draft_logits) == len(host.draft_logits) > 5
    for a, b in zip(dev.draft_logits, host.draft_logits, strict=True):
        assert torch.equal(a, b)
    assert len(dev.logits) == len(host.logits)
    for a, b in zip(dev.logits, host.logits, strict=True):
        assert torch.equal(a, b)
    if forced:  # every acceptance length occurred
        assert {r["accepted"] for r in dev.rounds_log} == set(range(5))


@pytest.mark.parametrize("forced", [False, True])
def test_chain_before_readback_equals_the_chain_after_it(tiny_model: Model, forced: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """draft_before_readback queues each greedy round's next draft chain before the host reads the round, its first
    position computed on the device from the accepted count: the tokens, rounds, verify logits and first draft logits
    are those of the chain queued after the read, bit for bit. Near the end of the cache (the chain's bound would pass
    the capacity) it falls back to the chain after the read, and the output stays plain decoding's."""
    prompt = list(range(7, 40))
    at_calls = []
    chain = Runner.mtp_chain

    def spy(self: Runner, *a: object, at: torch.Tensor | None = None, **kw: object) -> object:
        at_calls.append(at is not None)
        return chain(self, *a, at=at, **kw)

    monkeypatch.setattr(Runner, "mtp_chain", spy)

    def run(early: bool, capacity: int = CAP, draft: int = 4) -> object:
        hook = (lambda r, n: (3 * r + 1) % (n + 1)) if forced else None
        opts = EngineOptions(draft=draft, capacity=capacity, exact=True, draft_before_readback=early)
        return Engine(tiny_model, opts, EngineHooks(record_logits=True, accept_hook=hook)).generate(prompt, 30)

    after = run(False)
    assert at_calls and not any(at_calls)
    at_calls.clear()
    early = run(True)
    # the first round's chain follows the prompt (no read); every later one was queued before its round's read
    assert len(at_calls) > 5 and not at_calls[0] and all(at_calls[1:])
    assert early.tokens == after.tokens and early.rounds_log == after.rounds_log
    assert len(early.draft_logits) == len(after.draft_logits) == len(after.logits) > 5
    for a, b in zip(early.draft_logits + early.logits, after.draft_logits + after.logits, strict=True):
        assert torch.equal(a, b)
    if forced:
        assert {r["accepted"] for r in early.rounds_log} == set(range(5))
    at_calls.clear()
    tight = run(True, capacity=(cells_needed(len(prompt), 30, 4) + 3) // 4 * 4)  # the least it may be
    assert True in at_calls and False in at_calls  # early rounds, then the fallback near the end
    assert tight.tokens == after.tokens
    if not forced:
        assert tight.tokens == plain(tiny_model, prompt, 30)


def test_readback_returns_the_last_started_ids_and_names_an_overflow() -> None:
    rb = Readback(torch.device("cpu"), capacity=4)
    rb.start(torch.tensor([3, 1, 4]))
    assert rb.result() == [3, 1, 4]
    rb.start(torch.tensor([9]))
    assert rb.result() == [9]
    with pytest.raises(ValueError, match="read back 5 ids into a buffer of 4"):
        rb.start(torch.arange(5))


def test_greedy_spec_equals_plain_with_fused_attention(tiny_model: Model) -> None:
    """With fused_attention (the one-launch q8_0 KV write, the one-pass masked read; their references on the CPU),
    greedy speculation still reproduces plain decoding through the same path, drafts chained in one step sequence."""
    rng = random.Random(9)
    prompt = [rng.randrange(511) for _ in range(21)]
    kw = dict(capacity=CAP, exact=True, kv_type="q8_0", fused_attention=True, kv_write_kernel=True)
    ref = plain(tiny_model, prompt, 30, kv_type="q8_0", fused_attention=True, kv_write_kernel=True)
    for n in (1, 4):
        hooks = EngineHooks(draft_hook=oracle_hook(ref, rng, 512))
        g = Engine(tiny_model, EngineOptions(draft=n, **kw), hooks).generate(prompt, 30)
        assert g.tokens == ref and 0 < g.spec.accepted < g.spec.drafted


def test_gdn_conv_kernel_option_reaches_the_layers(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineOptions.gdn_conv_kernel switches the GDN layers' conv kernel on or off for the engine's steps:
    the layer asks gdn_conv.kernel_takes, which sees the module flag the engine set."""
    from qspec.kernels import gdn_conv
    from qspec.model import gdn

    seen: list[bool] = []
    monkeypatch.setattr(gdn, "kernel_takes", lambda *a: seen.append(gdn_conv._ON) or False)
    for on in (False, True):
        seen.clear()
        Engine(tiny_model, EngineOptions(draft=2, capacity=CAP, gdn_conv_kernel=on)).generate([1, 2, 3, 4], 6)
        assert seen and set(seen) == {on}
        assert gdn_conv._ON is True  # the module default, restored after generate
