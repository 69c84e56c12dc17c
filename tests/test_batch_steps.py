"""Steps over several sequences at once (qspec/batch_steps.py): each sequence gets what its own runner's step gives."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_batch import engine, prompt_of

from qspec.batch_steps import BatchSteps
from qspec.engine import prefill_chunks
from qspec.kernels.triton_common import HAS_TRITON
from qspec.model.model import Model
from qspec.model.qsa import PooledUpdate, StepUpdates
from qspec.runner import Runner
from qspec.state.indexer_cache import IndexerCache
from qspec.state.tables import SequenceTables


def test_batched_draft_head_steps_equal_each_sequence_alone(tiny_model: Model) -> None:
    """The draft head over several sequences in one step (BatchSteps.draft): a draft step of one row each, and an
    extend of three rows each keeping one picked row, give each sequence, bit for bit in exact mode, the logits,
    residual and head cache of its own Runner.mtp_step at the same positions."""
    e = engine(tiny_model, draft=2)
    prompts = [prompt_of(n, s) for n, s in ((9, 11), (14, 12))]

    def prefilled() -> tuple[list[Runner], list[torch.Tensor]]:
        runs, hs = [], []
        for p in prompts:
            r = Runner(tiny_model, e.opts.cache_options())
            hs.append(prefill_chunks(r, torch.tensor(p), 64, 0, None, draft=True)[1])
            runs.append(r)
        return runs, hs
    with e.runner.switches.apply():
        (alone, hs), (together_, _) = prefilled(), prefilled()
        steps = BatchSteps(together_)
        starts = [len(p) for p in prompts]
        got = steps.draft([0, 1], starts, torch.tensor([5, 6]), torch.cat(hs), None)
        want = [alone[k].mtp_step(torch.tensor([5 + k]), hs[k], starts[k]) for k in range(2)]
        ext = torch.tensor([[7, 8, 9], [10, 11, 12]])
        X = torch.randn(6, hs[0].shape[1], generator=torch.Generator().manual_seed(0)).to(hs[0].dtype)
        got_ext = steps.draft([0, 1], [s + 1 for s in starts], ext.flatten(), X, None, rows=3,
                              pick=torch.tensor([2, 3 + 0]))
        want_ext = [alone[k].mtp_step(ext[k], X[3 * k:3 * k + 3], starts[k] + 1, row=(2, 0)[k]) for k in range(2)]
    for k in range(2):
        for g, w in ((got, want[k]), (got_ext, want_ext[k])):
            torch.testing.assert_close(g[0][k:k + 1], w[0], atol=0, rtol=0)
            torch.testing.assert_close(g[1][k:k + 1], w[1], atol=0, rtol=0)
        torch.testing.assert_close(together_[k].cache.mtp_kv.k, alone[k].cache.mtp_kv.k, atol=0, rtol=0)


def test_a_step_split_in_several_keeps_each_ones_outputs(tiny_model: Model) -> None:
    """A batched step of more rows than a graph takes runs as several steps (BatchSteps._per_step). Their graphs
    share one memory pool, where a step's outputs may lie in memory that the next step's graph overwrites
    (Runner._run); here every step's outputs are put in one buffer that the next step overwrites. The split verify
    step and draft-head step still give each sequence, bit for bit, what one step of all the rows gives it."""
    e = engine(tiny_model, draft=2)
    prompts = [prompt_of(n, s) for n, s in ((9, 21), (14, 22), (11, 23))]

    def prefilled() -> tuple[BatchSteps, list[torch.Tensor]]:
        runs, hs = [], []
        for p in prompts:
            r = Runner(tiny_model, e.opts.cache_options())
            hs.append(prefill_chunks(r, torch.tensor(p), 64, 0, None, draft=True)[1][-1:])
            runs.append(r)
        return BatchSteps(runs), hs

    def one_buffer(fn: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., tuple[torch.Tensor, ...]]:
        bufs: dict[int, torch.Tensor] = {}

        def call(*a: object, **kw: object) -> tuple[torch.Tensor, ...]:
            out = []
            for i, t in enumerate(fn(*a, **kw)):
                buf = bufs.setdefault(i, torch.empty(1 << 20, dtype=t.dtype))
                out.append(buf[:t.numel()].view(t.shape).copy_(t))
            return tuple(out)
        return call
    tokens, starts = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11]), [len(p) for p in prompts]
    with e.runner.switches.apply():
        (whole, hs), (split, _) = prefilled(), prefilled()
        lead = split.runners[0]
        lead.forward_segments = one_buffer(lead.forward_segments)  # type: ignore[method-assign]
        lead.draft_segments = one_buffer(lead.draft_segments)  # type: ignore[method-assign]
        split._per_step = lambda n, rows: 1  # type: ignore[method-assign]
        H = torch.cat(hs)
        for steps in (whole, split):
            steps.out = (steps.draft([0, 1, 2], starts, tokens[:3], H, None),  # type: ignore[attr-defined]
                         steps.run([0, 1, 2], tokens, rows=3))
    for got, want in zip(split.out, whole.out, strict=True):  # type: ignore[attr-defined]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=0, rtol=0)


_SEQS_STEPS = """
import torch
from conftest import build_model, tiny_config
from test_batch import engine, prompt_of, together

from qspec.batch import Batcher
from qspec.batch_steps import BatchSteps
from qspec.kernels import attention_seqs, gdn_seqs, triton_conv_snapshot, triton_kv_write, triton_ngram, triton_pooled
from qspec.runner import Runner

model = build_model(tiny_config(), seed=3)
e = engine(model, exact=False, draft=2, kv_type="q8_0", fused_attention=True)
launched = {"gdn": 0, "attention": 0, "raw keys": 0, "snapshots": 0, "n-gram": 0, "pooled keys": 0}


def counted(mod, name, what):
    real = getattr(mod, name)

    def call(*a, **k):
        launched[what] += 1
        return real(*a, **k)
    setattr(mod, name, call)


counted(gdn_seqs, "gdn_step_seqs_triton", "gdn")
counted(attention_seqs, "attention_seqs_triton", "attention")
counted(triton_kv_write, "write_rows_seqs_triton", "raw keys")
counted(triton_conv_snapshot, "conv_snapshot_seqs_triton", "snapshots")
counted(triton_ngram, "ngram_contexts_seqs_triton", "n-gram")
counted(triton_pooled, "pooled_seqs_triton", "pooled keys")
prompts = [prompt_of(n, s) for n, s in ((9, 1), (14, 2), (5, 3))]


def steps(rows, on, eng=e):
    runs = []
    for p in prompts:
        r = Runner(model, eng.opts.cache_options())
        r.step(torch.tensor(p)), r.keep(len(p), rollback=False)
        runs.append(r)
    batch = BatchSteps(runs)
    with gdn_seqs.enabled_mode(on), attention_seqs.enabled_mode(on):
        logits, X = batch.run([0, 1, 2], torch.arange(3 * rows) + 20, rows)
        for r in runs:
            r.keep(1, rollback=True)
        starts = [len(p) + 1 for p in prompts]
        draft = batch.draft([0, 1, 2], starts, torch.arange(3 * rows) + 40, X, None, rows=rows)
    return ([logits, *draft, *(t for r in runs for ix in r.cache.idx.values() for t in (ix.raw, ix.pooled))],
            [r.committed_state() for r in runs], [r.cache.snap_stats.as_dict() for r in runs],
            [b for r in runs for b in r.cache.mtp_kv.buffers()])


with e.runner.switches.apply():
    for rows in (1, 3):
        (o1, s1, c1, m1), (o2, s2, c2, m2) = steps(rows, True), steps(rows, False)
        for a, b in zip(o1, o2, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        for a, b in zip(s1, s2, strict=True):
            for k in a:
                torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)
        assert c1 == c2, (c1, c2)
        assert all(torch.equal(a, b) for a, b in zip(m1, m2, strict=True))
cfg = model.cfg
indexed = [i for i in cfg.qsa_layers() if cfg.ratio(i)]
# every GDN layer's and the n-gram layer's snapshots; every indexed QSA layer's raw and pooled keys
assert indexed and cfg.has_ple and launched == {
    "gdn": 2 * len(cfg.gdn_layers()), "attention": 2 * (len(cfg.qsa_layers()) + 1), "raw keys": 2 * len(indexed),
    "snapshots": 2 * (len(cfg.gdn_layers()) + 1), "n-gram": 2, "pooled keys": 2 * len(indexed)}, launched

# exact mode: GDN steps each sequence alone (its conv kernel is off there); the n-gram layer's launches and the
# attention's (each sequence's chunks as alone) for all sequences give each sequence its own bits
exact = engine(model, exact=True, draft=2, kv_type="q8_0", fused_attention=True)
with exact.runner.switches.apply():
    before = dict(launched)
    (o1, s1, c1, m1), (o2, s2, c2, m2) = steps(3, True, exact), steps(3, False, exact)
    assert all(torch.equal(a, b) for a, b in zip(o1, o2, strict=True))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s1, s2, strict=True) for k in a) and c1 == c2
    assert launched["n-gram"] > before["n-gram"] and launched["attention"] > before["attention"], launched

# whole requests through the batcher (MTP2 rounds and plain steps as its measured rates choose, the draft heads'
# cells written over plain steps): the same tokens with the launches for all sequences and without them
calls = [dict(prompt=prompt_of(6 + 5 * i, i), max_tokens=6) for i in range(3)]
tokens = []
for on in (True, False):
    b = Batcher(engine(model, exact=False, draft=2, kv_type="q8_0", fused_attention=True, gdn_seqs=on,
                       attention_seqs=on), 3, draft="auto")
    try:
        tokens.append([g.tokens for g in together(b, calls)])
    finally:
        b.close()
assert tokens[0] == tokens[1] and launched["gdn"] > 2 * len(cfg.gdn_layers()), (tokens, launched)
print("seqs steps ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_batched_steps_mixers_in_launches_for_all_sequences_equal_each_sequence_alone() -> None:
    """Through Triton's interpreter (a subprocess: Triton reads TRITON_INTERPRET when the kernels are defined), a
    batched target step of three sequences (one row each, then three each) and a draft-head step after it, with every
    GDN layer's snapshots and recurrence, the n-gram layer's contexts and conv snapshots, and every attention
    layer's (QSA's, the head's) q8_0 writes, raw indexer keys and attention in launches for all the sequences
    (gdn_seqs, attention_seqs), give the logits, residuals, committed states, head caches, raw indexer keys and
    snapshot counters that the same steps with each sequence's own launches give (in exact mode, the same bits); the
    batched launches ran for every GDN, n-gram and attention layer of every step. Then whole requests
    through the batcher give the same tokens with and without those launches."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    r = subprocess.run([sys.executable, "-c", _SEQS_STEPS], cwd=root / "tests", env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "seqs steps ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_the_indexer_choice_of_a_batched_step_is_each_sequences_own(tiny_model: Model) -> None:
    """QSA's block choice for every sequence of a batched step at once (select_seqs: the sequences' pooled-key
    update lists joined, their pooled keys gathered, one batched product, one top-k call) keeps the blocks each
    sequence's own `select` keeps, and writes the same raw and pooled keys, at positions where the budget leaves
    blocks out."""
    c = tiny_model.cfg
    i = c.qsa_layers()[0]
    layer = tiny_model.layers[i]
    B, T, cap, r = 3, 2, 256, c.ratio(i)
    g = torch.Generator().manual_seed(5)

    def caches() -> list[IndexerCache]:
        out = []
        for _ in range(B):
            ix = IndexerCache(cap, r, c.indexer_head_dim, dtype=tiny_model.dtype, device="cpu")
            ix.raw.copy_(torch.randn(ix.raw.shape, generator=g))
            ix.pooled.copy_(torch.randn(ix.pooled.shape, generator=g))
            out.append(ix)
        return out
    mine = caches()
    alone = [IndexerCache(cap, r, c.indexer_head_dim, dtype=tiny_model.dtype, device="cpu") for _ in range(B)]
    for a, m in zip(alone, mine, strict=True):
        a.raw.copy_(m.raw), a.pooled.copy_(m.pooled)
    pos = torch.tensor([e - T + 1 + j for e in (200, 131, 255) for j in range(T)])
    cos, sin = tiny_model.rope(pos)
    rest = torch.randn(B * T, (c.indexer_heads + 1) * c.indexer_head_dim, generator=g).to(tiny_model.dtype)
    tables = SequenceTables([], {}, {i: [ix.pooled for ix in mine]}, {i: [ix.raw for ix in mine]})
    blocks = [torch.randperm(30, generator=g)[:3] for _ in range(B)]  # 3 complete blocks a sequence, to re-pool
    upds = [{r: PooledUpdate(b[:, None] * r + torch.arange(r), b * r, b)} for b in blocks]
    steps = StepUpdates(upds, tiny_model.rope)
    assert r in steps.joined
    before = mine[0].pooled.clone()
    got = layer.select_seqs(rest, pos, cos, sin, [steps.selection(b, r, ix) for b, ix in enumerate(mine)], tables, i,
                            cap, joined=steps.joined[r])
    want = torch.cat([layer.select(rest[b * T:(b + 1) * T], pos[b * T:(b + 1) * T], cos[b * T:(b + 1) * T],
                                   sin[b * T:(b + 1) * T], alone[b], upds[b][r], tiny_model.rope(upds[b][r].start),
                                   cap) for b in range(B)])
    assert torch.equal(got, want)
    assert all(torch.equal(a.raw, m.raw) and torch.equal(a.pooled, m.pooled) for a, m in zip(alone, mine, strict=True))
    assert not torch.equal(mine[0].pooled, before)  # the updates were made
    assert (want.sum(1) < pos + 1).all()  # every row leaves blocks out: the choice is made
