"""Perplexity (qspec/perplexity.py, `qspec perplexity`): the scored tokens and their log-likelihoods, the errors."""

from __future__ import annotations

import math
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from qspec import perplexity as pp
from qspec.cli import main
from qspec.loader import DEMO_MODEL, load_tokenizer
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner


def reference_nll(model: Model, ids: list[int], ctx: int) -> torch.Tensor:
    """Each chunk in one forward from a fresh cache: -log p(token j + 1 | tokens ..j) for j in [ctx/2, ctx - 1)."""
    out = []
    for c in range(len(ids) // ctx):
        toks = torch.tensor(ids[c * ctx:(c + 1) * ctx])
        logits, _ = Runner(model, CacheOptions(capacity=ctx)).step(toks)
        lp = torch.log_softmax(logits.float(), -1)
        j = torch.arange(ctx // 2, ctx - 1)
        out.append(-lp[j, toks[j + 1]])
    return torch.cat(out)


def test_perplexity_scores_the_second_half_of_each_chunk(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(511) for _ in range(3 * 24 + 5)]  # three chunks of 24 and a remainder left out
    monkeypatch.setattr(pp, "STEP_ROWS", 7)  # several steps a chunk, one of them straddling its middle
    seen: list[tuple[int, float]] = []
    r = pp.perplexity(tiny_model, ids, 24, on_chunk=lambda i, p: seen.append((i, p)))
    want = reference_nll(tiny_model, ids, 24)
    assert r.tokens == 3 * 11 == len(want) and r.chunks == 3 and [i for i, _ in seen] == [0, 1, 2]
    assert r.ppl == pytest.approx(math.exp(want.double().mean().item()), rel=1e-5)
    assert r.stderr == pytest.approx(r.ppl * want.double().std().item() / math.sqrt(len(want)), rel=1e-4)
    assert r.running[-1] == r.ppl and seen[0][1] == pytest.approx(math.exp(want[:11].double().mean().item()),
                                                                  rel=1e-5)
    assert pp.perplexity(tiny_model, ids, 24, chunks=1).tokens == 11


@pytest.mark.parametrize("ids, ctx, words", [([1] * 40, 6, "multiple of 4"), ([1] * 20, 24, "fewer than one"),
                                              ([1] * 30 + [600], 8, "outside the model's vocabulary")])
def test_perplexity_refuses_what_it_cannot_score(tiny_model: Model, ids: list[int], ctx: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        pp.perplexity(tiny_model, ids, ctx)


def test_the_command_on_the_demo_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trained demo model on Python source it has seen the like of, and on the same tokens shuffled: a scoring
    off by one position would not tell them apart."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    tok = load_tokenizer(DEMO_MODEL)
    ids = tok.encode(src, add_special=False)[:512]
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    got = {}
    for name, toks in (("source", ids), ("shuffled", shuffled)):
        f = tmp_path / f"{name}.txt"
        f.write_text(tok.decode(toks), encoding="utf-8")
        assert main(["perplexity", "--model", "demo", "--file", str(f), "--ctx", "64", "--chunks", "4",
                     "--json", str(tmp_path / f"{name}.json")]) == 0
        out = capsys.readouterr().out
        assert out.startswith("perplexity ") and "(4 chunks of 64)" in out, out
        got[name] = float(out.split()[1])
    assert got["source"] < 100 and got["shuffled"] > 20 * got["source"], got
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert main(["perplexity", "--model", "demo", "--file", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert main(["perplexity", "--model", "demo", "--file", str(tmp_path / "source.txt"), "--ctx", "4096"]) == 2
    assert "fewer than one context of 4096" in capsys.readouterr().err
