"""The indexer's choice among tied block scores: transformers' rule (torch.topk over a row's visible blocks alone),
in the torch selection, the sparse path's block ids, the Triton radix select, and the model's paths.

Exact ties are common: a block scores exactly 0 (+0 or -0) whenever relu(q.K) is 0 for every indexer head."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qspec.kernels.top_blocks import top_blocks_mask, top_blocks_mask_torch
from qspec.kernels.triton_common import HAS_TRITON
from qspec.model.qsa import mask_to_ids

ROOT = Path(__file__).resolve().parents[1]


def tied_rows(T: int, nb: int, seed: int, prefix: bool = True) -> torch.Tensor:
    """Scores of few values (+0, -0, 1, 2: most of them tie) with -inf for blocks a row may not choose: a
    prefix of visible blocks per row (the indexer's rows), or (prefix=False) scattered."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 3, (T, nb), generator=g).float()
    s = torch.where(torch.rand(T, nb, generator=g) < 0.5, -s, s).clamp(min=-0.0)  # 0 -> +0 or -0, no negatives
    s = torch.where(s == 0, torch.where(torch.rand(T, nb, generator=g) < 0.5, -0.0, 0.0), s)
    if prefix:
        hidden = torch.arange(nb)[None, :] >= torch.randint(0, nb + 1, (T, 1), generator=g)
    else:
        hidden = torch.rand(T, nb, generator=g) < 0.3
    return s.masked_fill(hidden, float("-inf"))


def transformers_choice(s: torch.Tensor, n_top: int) -> torch.Tensor:
    """Qwen4ExpTextQSAIndexer's selection, row by row: torch.topk(min(n_top, m)) of the m visible scores as a
    1-D vector in block order."""
    out = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    for t in range(s.shape[0]):
        cols = (s[t] > float("-inf")).nonzero().flatten()
        if len(cols):
            out[t, cols[s[t, cols].topk(min(n_top, len(cols)), dim=0).indices]] = True
    return out


@pytest.mark.parametrize("nb,n_top", [(7, 3), (40, 8), (200, 3), (300, 64), (129, 2)])  # both of topk's CPU paths
def test_torch_mask_keeps_the_ties_transformers_keeps(nb: int, n_top: int) -> None:
    for prefix in (True, False):
        s = tied_rows(24, nb, seed=nb + n_top, prefix=prefix)
        want = transformers_choice(s, n_top)
        assert torch.equal(top_blocks_mask_torch(s, n_top), want)
        assert torch.equal(top_blocks_mask(s, n_top), want)
        assert torch.equal(want.sum(1), (s > float("-inf")).sum(1).clamp(max=n_top))


def test_padded_row_keeps_other_ties() -> None:
    """The cause: torch.topk of a row padded with -inf (future blocks) is another vector and keeps other tied
    blocks than torch.topk of the visible blocks alone, which is what transformers runs."""
    s = tied_rows(64, 40, seed=5)
    want = transformers_choice(s, 8)
    padded = torch.zeros_like(want).scatter_(1, s.topk(8, dim=1).indices, True) & (s > float("-inf"))
    assert not torch.equal(padded, want)


def test_sparse_ids_are_the_mask() -> None:
    s = tied_rows(16, 30, seed=2)
    for n_top in (0, 1, 5, 30):
        mask = top_blocks_mask(s, n_top)
        ids = mask_to_ids(mask, n_top)
        assert ids.shape == (16, n_top)
        back = torch.zeros_like(mask)
        for t in range(16):
            got = ids[t][ids[t] >= 0]
            assert torch.equal(got, got.sort().values) and (ids[t, len(got):] == -1).all()
            back[t, got] = True
        assert torch.equal(back, mask)


TRITON_TIES = """
import torch
from qspec.kernels.triton_top_blocks import top_blocks_mask_triton
g = torch.Generator().manual_seed(0)
for T, nb, n_top in ((5, 37, 9), (3, 64, 30), (4, 20, 20), (2, 300, 64)):
    s = torch.randint(0, 3, (T, nb), generator=g).float()
    s = torch.where(torch.rand(T, nb, generator=g) < 0.5, -0.0, 1.0) * s  # -0 and +0 tie
    vis = torch.arange(nb)[None, :] < torch.randint(0, nb + 1, (T, 1), generator=g)
    s = s.abs().masked_fill(~vis, float("-inf"))
    s = torch.where((s == 0) & (torch.rand(T, nb, generator=g) < 0.5), -0.0, s)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :n_top]
    want = torch.zeros(T, nb, dtype=torch.bool).scatter_(1, order, True) & vis
    got = top_blocks_mask_triton(s, n_top)
    assert torch.equal(got, want), (T, nb, n_top, (got != want).sum())
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_ties_go_to_lower_ids_interpreted() -> None:
    """The radix select (Triton interpreter): tied scores at the threshold, +0 and -0 alike, go to the lower block
    ids (torch.topk's rule on CUDA), and -inf blocks are never chosen, even when fewer than n_top are visible."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", TRITON_TIES], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_triton_ties_are_torch_topk() -> None:
    """On CUDA the kernel and the torch fallback keep the tied blocks torch.topk keeps there over the visible blocks
    alone (transformers run on the GPU): the lower block ids. transformers' scores there hold no -0 (relu on CUDA
    returns +0) while torch.topk on CUDA ranks -0 below +0: a -0 in qspec's scores must change nothing."""
    for T, nb, tops in ((64, 1152, (1, 100, 512)), (3, 20000, (512,))):  # 20000: past MAX_BLOCKS, the fallback
        s = tied_rows(T, nb, seed=nb).cuda()
        plus = torch.where(s == 0, 0.0, s)
        for n_top in tops:
            want = transformers_choice(plus, n_top)
            assert torch.equal(top_blocks_mask(s, n_top), want)
            assert torch.equal(top_blocks_mask_torch(s, n_top), want)
            lower = torch.sort(plus, dim=1, descending=True, stable=True).indices[:, :n_top]
            assert torch.equal(want, torch.zeros_like(want).scatter_(1, lower, True) & (s > float("-inf")))
