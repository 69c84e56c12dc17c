"""qspec against transformers' Qwen4ExpForCausalLM over more of the configuration space than the presets.

A table of small random models, each varying a few of: query/kv head counts, Gated DeltaNet key/value head ratios,
hyper-connection stream counts, indexer heads, budgets and compress ratios (several QSA layers, a dense one),
the PLE layer (or none) and EOS tokens inside the prompt. Every indexer budget is below the prompt, so the
selection (and its tied scores: few indexer heads score many blocks exactly 0) decides the logits. qspec runs
each prompt as a prefill, then decode and verify steps of 1-3 rows, some with rejected rows rolled back, in
the masked or the sparse attention path; every row's logits must match transformers' full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from test_model import hf_reference

from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights import load_model_weights

pytest.importorskip("transformers")

QSA_EVERY_2 = {"layer_recurrent": (True, False, True, False)}
NO_PLE = {"ple_layer": -1, "ple_embed_dim": 0, "ple_multipliers": (), "ple_head_offsets": (), "ple_head_vocab": (),
          "ple_rows": 0}

# name: (config overrides, prompt length, EOS positions, sparse attention)
SWEEP: dict[str, tuple[dict[str, object], int, tuple[int, ...], bool]] = {
    "ih1-r2-b8": ({"indexer_heads": 1, "indexer_budget": 8, "compress_ratios": (0, 0, 0, 2)}, 40, (9,), False),
    "ih2-r8-b16": ({"indexer_heads": 2, "compress_ratios": (0, 0, 0, 8)}, 48, (), True),
    "ih1-mha-hc2": ({"indexer_heads": 1, "n_heads": 2, "n_kv_heads": 2, "hc_count": 2}, 36, (0, 1), False),
    "gqa8-hc3": ({"indexer_heads": 2, "n_heads": 8, "n_kv_heads": 1, "head_dim": 16, "hc_count": 3},
                 36, (35,), True),
    "gdn-k1v4-ih4": ({"indexer_heads": 4, "gdn_k_heads": 1, "gdn_v_heads": 4, "indexer_budget": 8}, 36, (), False),
    "gdn-k4v4-di8": ({"indexer_heads": 2, "gdn_k_heads": 4, "gdn_v_heads": 4, "indexer_head_dim": 8},
                     36, (5, 20), False),
    "two-qsa-r2-r4-ple0": ({**QSA_EVERY_2, "compress_ratios": (0, 2, 0, 4), "indexer_heads": 1, "indexer_budget": 8,
                            "ple_layer": 0}, 40, (12,), True),
    "qsa-and-dense-ple2": ({**QSA_EVERY_2, "compress_ratios": (0, 0, 0, 4), "indexer_heads": 2, "ple_layer": 2},
                           36, (3, 4, 30), False),
    "no-ple-ih1-hc5": ({**NO_PLE, "indexer_heads": 1, "hc_count": 5}, 36, (18,), False),
}

STEPS = ((1, 0), (3, 0), (1, 2), (2, 1))  # (rows kept, rows rolled back) of the steps after the prefill


def run_steps(model: Model, ids: list[int], prefill: int, sparse: bool) -> torch.Tensor:
    """Logits of every row of ids: a prefill, then steps cycling through STEPS; a rolled-back row is a wrong
    token (as a rejected draft) after the kept ones."""
    run = Runner(model, CacheOptions(capacity=96, n_slots=4, sparse_attention=sparse))
    out = [run.step(torch.tensor(ids[:prefill]))[0]]
    run.keep(prefill, rollback=False)
    at, k = prefill, 0
    while at < len(ids):
        keep, junk = STEPS[k % len(STEPS)]
        keep = min(keep, len(ids) - at)
        rows = ids[at:at + keep] + [(7 * at + j) % model.cfg.vocab_size for j in range(junk)]
        out.append(run.step(torch.tensor(rows))[0][:keep])
        run.keep(keep, rollback=True)
        at, k = at + keep, k + 1
    return torch.cat(out)


def reference_and_ours(overrides: dict[str, object], T: int, eos_at: tuple[int, ...], seed: int, tmp: Path,
                       zero_indexer_q: bool = False) -> tuple[torch.Tensor, Model, list[int]]:
    """transformers' logits of a random prompt, and qspec's model loaded from the same HF checkpoint.

    zero_indexer_q: the indexers' query projections are zero, so every block scores exactly 0 (all tie)."""
    cfg = tiny_config(mtp=False).with_(**overrides).validate()
    ref = hf_reference(cfg, seed=seed)
    if zero_indexer_q:
        qd = cfg.indexer_heads * cfg.indexer_head_dim
        for name, p in ref.named_parameters():
            if "index_qk_proj" in name:
                p.data[:qd] = 0
    ref.save_pretrained(tmp / "hf")
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))
    ids[list(eos_at)] = cfg.eos_token_id
    with torch.no_grad():
        want = ref(ids[None], use_cache=False).logits[0]
    cfg_hf, w_hf = load_model_weights(tmp / "hf")
    return want, Model(cfg_hf, w_hf), ids.tolist()


def assert_match(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = ((got - want).abs().amax(-1) > 1e-4).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ by up to {(got - want).abs().max().item():.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("case", sorted(SWEEP))
def test_sweep_matches_transformers(case: str, tmp_path: Path) -> None:
    overrides, T, eos_at, sparse = SWEEP[case]
    want, model, ids = reference_and_ours(overrides, T, eos_at, seed=sum(map(ord, case)) % 97, tmp=tmp_path)
    budget = model.cfg.indexer_budget
    assert budget + max(model.cfg.ratio(i) for i in model.cfg.qsa_layers()) < T  # the indexer restricts
    assert_match(run_steps(model, ids, prefill=T - 12, sparse=sparse), want)


@pytest.mark.parametrize("sparse", [False, True])
def test_all_blocks_tied_match_transformers(sparse: bool, tmp_path: Path) -> None:
    """Every block scores exactly 0: the choice is nothing but the tie rule, in prefill, decode and verify."""
    want, model, ids = reference_and_ours({"indexer_budget": 8, "compress_ratios": (0, 0, 0, 2)}, 36, (), seed=4,
                                          tmp=tmp_path, zero_indexer_q=True)
    assert_match(run_steps(model, ids, prefill=20, sparse=sparse), want)
