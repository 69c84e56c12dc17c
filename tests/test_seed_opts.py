"""The seed's rollback optimizations (Algorithms 1-5): identical results to the baseline, and their invariants."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model import ops
from qspec.model.model import Model
from qspec.model.qsa import PooledUpdate, materialize_pooled
from qspec.runner import Runner
from qspec.state.cells import CellTable
from qspec.state.indexer_cache import Descriptors, PooledLayout

CAP = 128
COMBOS = list(itertools.product([False, True], repeat=4))  # preserve, incremental, pad, fused


def options(combo: tuple[bool, bool, bool, bool], rng: random.Random, **kw: object
            ) -> tuple[EngineOptions, EngineHooks]:
    """The engine options of one combination, and hooks that force a random accepted count each round."""
    preserve, incremental, pad, fused = combo
    return (EngineOptions(draft=4, capacity=CAP, exact=True, preserve_pooled=preserve, incremental_pooled=incremental,
                          pad_target=8 if pad else None, fused_snapshots=fused),
            EngineHooks(accept_hook=lambda r, n: rng.randint(0, n), record_logits=True, **kw))


def check_invariants(run: Runner, model: Model) -> None:
    """After a rollback: retained descriptors are a valid prefix whose pooled keys equal a recomputation."""
    n = run.n_tokens
    for r, lay in run.cache.layouts.items():
        d = lay.retained
        k = len(d)
        fresh = Descriptors.current(k, r)
        for f in ("cells", "start", "dest", "stream", "pos4"):
            assert np.array_equal(getattr(d, f), getattr(fresh, f))
        assert (d.start + r <= n).all(), "a retained block reaches into the removed suffix"
        cells = run.cache.cells
        assert (cells.pos[d.cells] == d.cells).all() and (cells.seq[d.cells] == 1).all(), "not exclusively owned"
        if not k:
            continue
        # every retained pooled key is bit-identical to recomputing it from the surviving raw keys
        for i, ix in run.cache.idx.items():
            if ix.ratio != r:
                continue
            probe = ix.pooled.clone()
            blocks = torch.arange(k)
            upd = PooledUpdate(torch.from_numpy(d.cells), torch.from_numpy(d.start), blocks)
            layer = model.layers[i]
            with ops.row_exact_mode(True):
                materialize_pooled(ix, upd, layer.ik_norm, model.cfg.rms_eps, *model.rope(upd.start))
            assert torch.equal(ix.pooled[:k], probe[:k]), f"layer {i}: retained pooled key differs from recompute"
            ix.pooled.copy_(probe)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n_gen=st.integers(20, 60))
def test_every_combination_matches_baseline(tiny_model: Model, seed: int, n_gen: int) -> None:
    prompt = [random.Random(seed).randrange(511) for _ in range(1 + seed % 23)]
    results = {}
    for combo in COMBOS:
        eng = Engine(tiny_model, *options(combo, random.Random(seed),
                                          after_round=lambda run, k: check_invariants(run, tiny_model)))
        g = eng.generate(prompt, n_gen)
        results[combo] = (g, eng.runner.committed_state())
    base_g, base_state = results[(False, False, False, False)]
    for combo, (g, state) in results.items():
        assert g.tokens == base_g.tokens, combo
        assert len(g.logits) == len(base_g.logits)
        assert all(torch.equal(a, b) for a, b in zip(g.logits, base_g.logits, strict=True)), combo
        for k in base_state:
            assert torch.equal(state[k], base_state[k]), (combo, k)


def test_pooled_rows_drop_from_history_to_delta(tiny_model: Model) -> None:
    """The work the seed removes: baseline recomputes every block each round, ours only the delta (padded to 8)."""
    rng = random.Random(0)
    prompt = [rng.randrange(511) for _ in range(90)]
    rows = {}
    for name, combo in (("baseline", (False, False, False, False)), ("ours", (True, True, True, True))):
        g = Engine(tiny_model, *options(combo, random.Random(1))).generate(prompt, 20)
        rows[name] = [r["pooled_r4_rows"] for r in g.rounds_log]
        reals = [r["pooled_r4_real"] for r in g.rounds_log]
        if name == "ours":
            assert set(rows[name]) == {8} and max(reals) <= 8
    assert min(rows["baseline"]) >= 90 // 4  # the whole history every round
    assert sum(rows["ours"]) * 2 < sum(rows["baseline"])


def make_layout(preserve: bool = True, pad: int | None = 8) -> tuple[PooledLayout, CellTable]:
    lay = PooledLayout(4, 64, preserve=preserve, pad_target=pad)
    cells = CellTable(256)
    return lay, cells


def step(lay: PooledLayout, cells: CellTable, L: int, T: int):  # noqa: ANN201
    cells.write(L, T)
    plan = lay.plan(L + T, T)
    lay.commit()
    return plan


def test_update_list_padding_rules() -> None:
    lay, cells = make_layout()
    plan = step(lay, cells, 0, 20)  # prefill: 5 blocks, microbatch 20 > 16 -> own size
    assert plan.rows == 5 and plan.n_real == 5
    plan = step(lay, cells, 20, 6)  # 26 tokens: 6 blocks, fewer than P=8 complete blocks -> no padding
    assert plan.rows == 1 and plan.n_real == 1
    plan = step(lay, cells, 26, 6)  # 32 tokens: 8 blocks, delta = block 6,7 -> padded to 8 with fillers
    assert plan.rows == 8 and plan.n_real == 2
    assert list(plan.dest[:2]) == [6, 7], "real updates first"
    assert len(set(plan.dest.tolist())) == 8 and plan.dest.max() < 8, "distinct existing destinations"
    plan = step(lay, cells, 32, 1)  # no new block: empty delta still gets P rows of fillers
    assert plan.rows == 8 and plan.n_real == 0
    lay2, cells2 = make_layout(pad=None)
    step(lay2, cells2, 0, 3)
    plan = step(lay2, cells2, 3, 0 + 1)  # 4 tokens, block 0 new
    assert plan.rows == 1 and plan.n_real == 1
    plan = step(lay2, cells2, 4, 1)  # empty delta -> one row: the first complete block
    assert plan.rows == 1 and plan.n_real == 0 and plan.dest[0] == 0
    lay3, cells3 = make_layout(pad=None)
    plan = step(lay3, cells3, 0, 2)  # no complete block at all -> the fallback descriptor into the dump row
    assert plan.rows == 1 and plan.dest[0] == 64


def test_seq_rm_removes_only_the_range_and_the_sequence() -> None:
    """seq_rm(seq, p0, p1) frees the cells of [p0, p1) that only `seq` owned, drops `seq` from shared ones, and
    leaves every other cell as it was."""
    cells = CellTable(64)
    cells.write(0, 40)
    cells.seq[35] = np.uint64(0b11)  # cell 35 shared with sequence 1
    cells.seq_rm(0, 20, 30)  # bounded
    assert (cells.pos[20:30] == -1).all() and (cells.pos4[20:30] == -1).all() and (cells.seq[20:30] == 0).all()
    assert (cells.pos[:20] == np.arange(20)).all() and (cells.pos[30:40] == np.arange(30, 40)).all()
    cells.seq_rm(0, 32)  # to the end
    assert (cells.pos[32:] == np.r_[-1, -1, -1, 35, [-1] * 28]).all()  # the shared cell stays, for sequence 1
    assert cells.seq[35] == np.uint64(0b10) and cells.n_live() == 20 + 2 + 1
    cells.seq_rm(1, 0)  # sequence 1 owned only cell 35 among the live ones
    assert cells.pos[35] == -1 and cells.n_live() == 22
    cells.seq_rm(0, 64)  # nothing at or past the capacity
    cells.seq_rm(0, -5, 2)  # p0 < 0: from 0
    assert cells.n_live() == 20 and (cells.pos[:2] == -1).all()


def test_retention_and_fallbacks() -> None:
    lay, cells = make_layout()
    step(lay, cells, 0, 40)
    cells.seq_rm(0, 30)
    lay.retain(cells, 0, 30)
    assert len(lay.retained) == 7  # blocks 0..6 end at 28 <= 30; block 7 (28..31) is cut
    for seq, p0, p1, reason in ((1, 20, -1, "sequence != 0"), (0, 20, 25, "bounded removal"),
                                (0, -1, -1, "p0 < 0")):
        step(lay, cells, 30, 2)
        lay.retain(cells, seq, p0, p1)
        assert len(lay.retained) == 0 and lay.stats.fallbacks[reason] == 1
        cells.seq_rm(0, 30)
    off, cells_off = make_layout(preserve=False)
    step(off, cells_off, 0, 40)
    off.retain(cells_off, 0, 30)
    assert len(off.retained) == 0 and off.stats.fallbacks["preservation off"] == 1
    # a block whose cell changed owner is not retained, nor anything after it
    lay, cells = make_layout()
    step(lay, cells, 0, 40)
    cells.seq[9] = np.uint64(0b11)  # cell 9 shared with sequence 1
    lay.retain(cells, 0, 40)
    assert len(lay.retained) == 2


def test_filler_rewrites_are_bit_identical(tiny_model: Model) -> None:
    run = Runner(tiny_model, EngineOptions(draft=2, capacity=CAP).cache_options())
    with ops.row_exact_mode(True):
        run.step(torch.arange(1, 41))
        run.keep(40, rollback=False)
        before = {i: ix.pooled[:10].clone() for i, ix in run.cache.idx.items()}
        run.step(torch.tensor([5, 6, 7]))  # 43 tokens: no new block; 8 filler rows rewrite blocks 0..7
        run.keep(1, rollback=True)
    assert run.last_plan_rows[4] == (0, 8)
    for i, ix in run.cache.idx.items():
        assert torch.equal(ix.pooled[:10], before[i])


@pytest.mark.parametrize("s,n,expect_fused", [(3, 6, True), (9, 6, True), (9, 7, True), (9, 8, False),
                                              (3, 1, False), (3, 9, False)])
def test_snapshot_eligibility_and_bit_equality(s: int, n: int, expect_fused: bool) -> None:
    from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots

    g = torch.Generator().manual_seed(s * 10 + n)
    C, P = 33, 2 * 9
    S = torch.randn(C, s, generator=g)
    T = torch.randn(n, C, generator=g)
    outs = []
    for fused in (False, True):
        planes = torch.randn(P, C, s, generator=torch.Generator().manual_seed(9))
        stats = SnapshotStats()
        X = write_snapshots(S, T, planes, torch.tensor(9), 9, min(n, 9), False, fused, stats)
        outs.append((X, planes, stats))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert (outs[1][2].fused == 1) == expect_fused
    if expect_fused:
        assert outs[1][2].dispatches == 1 and outs[1][2].source_reads == (s + n) * C
        assert outs[0][2].dispatches == 1 + n
    else:
        assert sum(outs[1][2].fallbacks.values()) == 1


@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("fused", [True, False])
def test_snapshots_read_the_live_plane_in_place(n: int, fused: bool) -> None:
    """The model passes the planes and `live` instead of a gathered state: same X, planes and counters."""
    from qspec.kernels.conv_snapshot import SnapshotStats, write_snapshots

    g = torch.Generator().manual_seed(n)
    C, s, n_slots = 37, 3, 6
    T = torch.randn(n, C, generator=g)
    planes = torch.randn(2 * n_slots, C, s, generator=g)
    live, host_base = 2, n_slots  # live in the half the step does not write
    outs = []
    for in_place in (False, True):
        p, stats = planes.clone(), SnapshotStats()
        S = p if in_place else p[live].clone()
        X = write_snapshots(S, T, p, torch.tensor(host_base), host_base, n, False, fused, stats,
                            live=torch.tensor(live) if in_place else None)
        outs.append((X, p, stats.as_dict()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]
    assert torch.equal(outs[1][1][host_base + n - 1], outs[1][0][:, n:n + s])  # the last row's window


def test_rows_all_equals_numpy_all() -> None:
    """The layout's row reduction (a word per row for widths 1, 2, 4, 8) equals numpy's all(1), for strided views
    too, and falls back to it for other widths."""
    import numpy as np

    from qspec.state.indexer_cache import rows_all

    rng = np.random.default_rng(0)
    for w in (1, 2, 3, 4, 5, 8, 16):
        x = rng.random((200, w)) > 0.1
        x[::7] = True
        assert np.array_equal(rows_all(x), x.all(1))
        assert np.array_equal(rows_all(x[::3]), x[::3].all(1))
    assert rows_all(np.zeros((0, 4), dtype=bool)).shape == (0,)


def test_host_round_script_runs() -> None:
    """scripts/host_round.py (the host's per-round bookkeeping with the model stubbed out) runs and reports a time;
    it refuses bad arguments by name."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "scripts/host_round.py", "--prompt", "100", "--draft", "3", "--rounds", "20"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    us = float(r.stdout.split("per round: ")[1].split(" us")[0])
    assert us > 0 and "4-row steps after a 100-token prompt" in r.stdout
    bad = subprocess.run([sys.executable, "scripts/host_round.py", "--draft", "9"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--draft in 1..8" in bad.stderr
