"""Steps over several sequences at once (qspec/batch_steps.py): each sequence gets what its own runner's step gives."""

from __future__ import annotations

import torch
from test_batch import engine, prompt_of

from qspec.batch_steps import BatchSteps
from qspec.engine import prefill_chunks
from qspec.model.model import Model
from qspec.runner import Runner


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
