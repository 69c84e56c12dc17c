"""Every Triton kernel against its torch reference, one test per kernel (the groups of `qspec.bench.kernels`).

Each test has two targets: `interpret`, small shapes through Triton's interpreter on CPU tensors (CI), and `cuda`,
the real geometry compiled on a GPU (marked `cuda`: `python -m pytest -m cuda`). Triton reads TRITON_INTERPRET when
a kernel is defined, so this process's kernels are compiled ones; the interpreter target runs every group once in a
subprocess with TRITON_INTERPRET=1 and each test reads its group's rows. A row fails when its kernel differs from
the reference beyond the dtype's tolerance (or in any bit, for the bit-exact kernels); rows marked `info` (row
independence, which no kernel contract promises) are reported but never fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qspec.bench.kernels import CHECKS, Runner, run_group
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET

ROOT = Path(__file__).resolve().parents[1]

TARGETS = [
    pytest.param("interpret", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every group's rows at small shapes through the interpreter (in this process when it already interprets)."""
    if INTERPRET:
        R = Runner("cpu", timing=False)
        return {name: [vars(r) for r in run_group(R, name, small=True)] for name in CHECKS}
    out = tmp_path_factory.mktemp("kernels") / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                                        "")]))
    r = subprocess.run([sys.executable, "-m", "qspec.bench.kernels", "--interpret", "--json", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():  # the run itself broke (not a kernel: each group's exceptions become its failed rows)
        pytest.fail(f"the interpreter run wrote no rows (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cuda_runner() -> Runner:
    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 references must be real f32
    torch.backends.cudnn.allow_tf32 = False
    return Runner("cuda", timing=False)


def check(group: str, target: str, request: pytest.FixtureRequest) -> None:
    if target == "cuda":
        rows = [vars(r) for r in run_group(request.getfixturevalue("cuda_runner"), group, small=False)]
    else:
        rows = request.getfixturevalue("interpreted")[group]
    failed = [f"{r['name']}: {r['detail']}" for r in rows if not r["ok"] and not r["info"]]
    assert rows, f"group {group} produced no rows"
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("target", TARGETS)
def test_conv_snapshot(target: str, request: pytest.FixtureRequest) -> None:
    """Conv snapshots (Algorithm 5): X and every plane bit-identical to write_snapshots, random 32-bit inputs."""
    check("conv_snapshot", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_gdn(target: str, request: pytest.FixtureRequest) -> None:
    """The gated delta rule writing each row's state into its rollback plane; other planes untouched."""
    check("gdn", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_gdn_conv(target: str, request: pytest.FixtureRequest) -> None:
    """GDN's step conv, silu and q/k norms in one launch."""
    check("gdn_conv", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_gdn_seqs(target: str, request: pytest.FixtureRequest) -> None:
    """A batched step's GDN for several sequences in two launches: each sequence's output, states and conv windows as
    its step alone makes them, found through the tables of its buffers' addresses."""
    check("gdn_seqs", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_attention_seqs(target: str, request: pytest.FixtureRequest) -> None:
    """A batched step's attention for several sequences: the caches written as each sequence's write alone writes
    them, each sequence's rows the bits of its masked attention alone, found through its buffers' address tables."""
    check("attention_seqs", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_pooled(target: str, request: pytest.FixtureRequest) -> None:
    """Pooled indexer keys for the update list; rows outside it untouched."""
    check("pooled", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_sparse_attention(target: str, request: pytest.FixtureRequest) -> None:
    """QSA attention over the indexer's chosen blocks and the tail, every cache type."""
    check("sparse_attention", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_kv_write(target: str, request: pytest.FixtureRequest) -> None:
    """The q8_0 KV write in one launch: the cache bit-identical to the reference's."""
    check("kv_write", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_masked_attention(target: str, request: pytest.FixtureRequest) -> None:
    """Masked attention in one pass over the cache, against f32 and the model's 16-bit path."""
    check("masked_attention", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_q4(target: str, request: pytest.FixtureRequest) -> None:
    """The Q4_0 draft head (int8 x, dp4a) against its reference."""
    check("q4", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_moe(target: str, request: pytest.FixtureRequest) -> None:
    """Routed experts for a few tokens, per pair and grouped, against the per-(token, expert) loop."""
    check("moe", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_gemv(target: str, request: pytest.FixtureRequest) -> None:
    """One-row mat-vec and the few-rows tensor-core product on the model's shapes."""
    check("gemv", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_hc_mix(target: str, request: pytest.FixtureRequest) -> None:
    """The hyper-connection mixer kernels at 1-8 rows, with and without the pending combine."""
    check("hc_mix", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_route(target: str, request: pytest.FixtureRequest) -> None:
    """Expert routing: softmax, top-k and renormalisation in one program per token."""
    check("route", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_dequant(target: str, request: pytest.FixtureRequest) -> None:
    """The KV cache's q8_0 dequantisation, K and V in one launch, bit-identical."""
    check("dequant", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_top_blocks(target: str, request: pytest.FixtureRequest) -> None:
    """The indexer's top-block choice: the stable-sort set exactly, ties to the lower block id."""
    check("top_blocks", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_argmax(target: str, request: pytest.FixtureRequest) -> None:
    """The greedy argmax over the vocabulary: torch's index exactly, ties, -0, -inf and NaN."""
    check("argmax", target, request)


@pytest.mark.parametrize("target", TARGETS)
def test_row_independence(target: str, request: pytest.FixtureRequest) -> None:
    """Rows computed alone against rows in a batch (informative rows: they report, they never fail)."""
    check("row_independence", target, request)


def test_every_group_has_a_test() -> None:
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(CHECKS) <= tested, sorted(set(CHECKS) - tested)


def test_a_check_fails_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks' own rule, on the CPU without Triton: a kernel that returns the reference passes, one that is off by
    one index fails (the argmax check stands in for all of them: each compares a kernel's output to its reference)."""
    import qspec.bench.kernels as kb
    from qspec.kernels.argmax import argmax_rows_torch

    R = Runner("cpu", timing=False)
    monkeypatch.setattr(kb, "argmax_rows_triton", lambda x, **kw: argmax_rows_torch(x))
    kb.check_argmax(R, 3, 500, torch.float32, ties=True)
    monkeypatch.setattr(kb, "argmax_rows_triton", lambda x, **kw: (argmax_rows_torch(x) + 1) % x.shape[-1])
    kb.check_argmax(R, 3, 500, torch.float32)
    assert [r.ok for r in R.log] == [True, False]


def test_a_raising_group_fails_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(R: Runner, small: bool) -> None:
        raise RuntimeError("the kernel did not compile")

    monkeypatch.setitem(CHECKS, "broken", broken)
    rows = run_group(Runner("cpu", timing=False), "broken", small=True)
    assert len(rows) == 1 and not rows[0].ok and not rows[0].info and "did not compile" in rows[0].detail
