"""The trunk against transformers' Qwen4ExpForCausalLM, loaded from HF and GGUF files; prefill + decode."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_config

from qspec.config import ModelConfig, to_hf_config
from qspec.kernels.triton_common import HAS_TRITON
from qspec.model import ops
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights import load_model_weights, read_gguf_metadata, write_gguf

ROOT = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers")


def hf_reference(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """A transformers model with every parameter randomised (its init leaves the norms at zero)."""
    hcfg = {k: v for k, v in to_hf_config(cfg).items()
            if k not in ("architectures", "model_type", "torch_dtype", "mtp_num_hidden_layers",
                         "mtp_use_dedicated_embeddings")}
    torch.manual_seed(seed)
    m = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**hcfg)).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in m.named_parameters():
        if name.endswith("A_log"):
            continue
        if "norm" in name and "linear_attn.norm" not in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1
        elif "conv1d" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5
        elif p.dim() >= 2:
            p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        else:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    return m


def our_logits(model: Model, ids: list[int], cap: int) -> torch.Tensor:
    run = Runner(model, CacheOptions(capacity=cap, n_slots=1))
    logits, _ = run.step(torch.tensor(ids))
    return logits


CASES = {
    # name: (config overrides, sequence length)
    "ple-sparse": ({}, 45),  # budget 16 tokens: sparse selection from 20 tokens on
    "ple-dense": ({"indexer_budget": 256}, 45),
    "no-ple": ({"ple_layer": -1, "ple_embed_dim": 0, "ple_multipliers": (), "ple_head_offsets": (),
                "ple_head_vocab": (), "ple_rows": 0}, 37),
    "heads-experts": ({"n_heads": 8, "n_kv_heads": 1, "n_experts": 16, "n_experts_used": 4,
                       "gdn_k_heads": 1, "gdn_v_heads": 3}, 33),
    "eight-layers": ({"n_layers": 8, "layer_recurrent": tuple((i + 1) % 4 != 0 for i in range(8)),
                      "compress_ratios": tuple(0 if (i + 1) % 4 else 4 for i in range(8))}, 50),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    overrides, T = CASES[case]
    cfg = tiny_config(mtp=False).with_(**overrides).validate()
    ref = hf_reference(cfg, seed=len(case))
    ref.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    ids[T // 2] = cfg.eos_token_id  # exercise the PLE EOS cut
    with torch.no_grad():
        want = ref(ids[None], use_cache=False).logits[0]
    cfg_hf, w_hf = load_model_weights(tmp_path / "hf")
    got_hf = our_logits(Model(cfg_hf, w_hf), ids.tolist(), 64)
    assert (got_hf - want).abs().max().item() <= 1e-4
    assert torch.equal(got_hf.argmax(-1), want.argmax(-1))
    # the same weights through a GGUF file give identical logits
    write_gguf(tmp_path / "m.gguf", cfg_hf, w_hf)
    cfg_g, w_g = load_model_weights(tmp_path / "m.gguf")
    assert cfg_g == cfg_hf
    assert torch.equal(our_logits(Model(cfg_g, w_g), ids.tolist(), 64), got_hf)


@pytest.mark.parametrize("splits", [(1,), (7, 8), (19, 20, 21), (24,)])
def test_prefill_then_decode_equals_full_forward(splits: tuple[int, ...]) -> None:
    model = build_model(tiny_config(mtp=False), seed=3)
    T = 40
    ids = torch.randint(0, 511, (T,), generator=torch.Generator().manual_seed(2))
    full = our_logits(model, ids.tolist(), 64)
    run = Runner(model, CacheOptions(capacity=64, n_slots=1))
    rows = []
    start = 0
    for end in list(splits) + list(range(splits[-1] + 1, T + 1)):
        logits, _ = run.step(ids[start:end])
        run.keep(end - start, rollback=False)
        rows.append(logits)
        start = end
    got = torch.cat(rows)
    assert (got - full).abs().max().item() < 1e-4


def test_q8_0_kv_cache_close_to_f32() -> None:
    model = build_model(tiny_config(mtp=False), seed=4)
    ids = list(range(3, 40))
    a = Runner(model, CacheOptions(capacity=64, kv_type="f32")).step(torch.tensor(ids))[0]
    b = Runner(model, CacheOptions(capacity=64, kv_type="q8_0")).step(torch.tensor(ids))[0]
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9


def test_row_exact_mode_matches_batched() -> None:
    model = build_model(tiny_config(mtp=False), seed=5)
    ids = torch.tensor(list(range(10, 16)))
    fast = Runner(model, CacheOptions(capacity=32)).step(ids)[0]
    with ops.row_exact_mode(True):
        exact = Runner(model, CacheOptions(capacity=32)).step(ids)[0]
    assert (fast - exact).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_fused_attention_equals_default_path(kv_type: str) -> None:
    """fused_attention (masked attention in one pass over the stored cells) gives the default path's logits and
    draft-head outputs: a prefill, decode steps and MTP steps, with the indexer restricting QSA."""
    model = build_model(tiny_config(), seed=7)
    ids = torch.randint(0, 511, (60,), generator=torch.Generator().manual_seed(7))
    out = {}
    # the default (None) turns the fused read on only where its Triton kernel runs: on the CPU, the default path
    assert not any(kv.fused_attention for kv in Runner(model, CacheOptions(capacity=128)).cache.kv.values())
    for fused in (False, True):
        run = Runner(model, CacheOptions(capacity=128, kv_type=kv_type, fused_attention=fused, kv_write_kernel=fused))
        assert all(kv.fused_attention == fused and kv.write_kernel == fused
                   for kv in [*run.cache.kv.values(), run.cache.mtp_kv])
        pre, X = run.step(ids[:52])
        run.keep(52, rollback=False)
        d_logits, _ = run.mtp_step(ids[1:53], X, 1)
        dec = []
        for t in ids[52:].tolist():
            dec.append(run.step(torch.tensor([t]))[0])
            run.keep(1, rollback=False)
        out[fused] = torch.cat([pre, *dec, d_logits])
    assert (out[True] - out[False]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_sparse_attention_equals_masked_dense(kv_type: str) -> None:
    """Reading only the chosen blocks and the tail gives the masked dense attention's logits, prefill and decode,
    with the indexer actually restricting (a 16-token budget under an 80-token prompt)."""
    model = build_model(tiny_config(), seed=6)
    ids = torch.randint(0, 511, (80,), generator=torch.Generator().manual_seed(6))
    cfg = model.cfg
    assert cfg.indexer_budget + max(cfg.ratio(i) for i in cfg.qsa_layers()) < len(ids)
    out = {}
    for sparse in (False, True):
        run = Runner(model, CacheOptions(capacity=128, kv_type=kv_type, sparse_attention=sparse))
        pre, _ = run.step(ids[:70])
        run.keep(70, rollback=False)
        dec = []
        for t in ids[70:].tolist():
            dec.append(run.step(torch.tensor([t]))[0])
            run.keep(1, rollback=False)
        out[sparse] = torch.cat([pre, *dec])
    assert (out[True] - out[False]).abs().max().item() < 1e-4
    # and the indexer restricts: attending to every cell changes the logits
    everything = build_model(dataclasses.replace(cfg, indexer_budget=128), seed=6)  # same weights
    assert (our_logits(everything, ids.tolist(), 128) - out[False]).abs().max().item() > 1e-3


# ---- GDN value head size != key head size (llama.cpp: ssm.inner_size / ssm.time_step_rank) ------------------------
VALUE_DIM_CASES = {
    "values-wider": {"gdn_v_head_dim": 24},  # inner_size 96 != time_step_rank 4 x state_size 16
    "values-narrower-grouped": {"gdn_k_heads": 1, "gdn_v_heads": 3, "gdn_v_head_dim": 8},
}


def steps_with_rejections(model: Model, ids: torch.Tensor, prefill: int, wrong: int) -> torch.Tensor:
    """Logits of every position: a chunked prefill, then 3-row verify steps whose last row is a wrong token that is
    rolled back (so each step keeps 2 rows and the next one starts from a rollback plane)."""
    run = Runner(model, CacheOptions(capacity=64, n_slots=4))
    rows = [run.step(ids[:prefill])[0]]
    run.keep(prefill, rollback=False)
    pos = prefill
    while pos < len(ids):
        chunk = ids[pos:pos + 2]
        logits, _ = run.step(torch.cat([chunk, torch.tensor([wrong])]))
        run.keep(len(chunk), rollback=True)
        rows.append(logits[:len(chunk)])
        pos += len(chunk)
    return torch.cat(rows)


@pytest.mark.parametrize("case", sorted(VALUE_DIM_CASES))
def test_gdn_value_head_size_matches_transformers(case: str, tmp_path: Path) -> None:
    cfg = tiny_config(mtp=False).with_(**VALUE_DIM_CASES[case]).validate()
    assert cfg.gdn_v_head_dim != cfg.gdn_head_dim
    ref = hf_reference(cfg, seed=11)
    assert ref.model.layers[0].linear_attn.head_v_dim == cfg.gdn_v_head_dim
    ref.save_pretrained(tmp_path / "hf")
    T = 29
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids[None], use_cache=False).logits[0]
    cfg_hf, w_hf = load_model_weights(tmp_path / "hf")
    assert cfg_hf.gdn_v_head_dim == cfg.gdn_v_head_dim
    write_gguf(tmp_path / "m.gguf", cfg_hf, w_hf)
    md = read_gguf_metadata(tmp_path / "m.gguf")
    assert md["qwen4exp.ssm.inner_size"] == cfg.gdn_v_heads * cfg.gdn_v_head_dim
    assert md["qwen4exp.ssm.state_size"] == cfg.gdn_head_dim
    cfg_g, w_g = load_model_weights(tmp_path / "m.gguf")
    assert cfg_g == cfg_hf
    for name, model in (("hf", Model(cfg_hf, w_hf)), ("gguf", Model(cfg_g, w_g))):
        whole = our_logits(model, ids.tolist(), 64)
        stepped = steps_with_rejections(model, ids, prefill=17, wrong=int(ids[0]) ^ 1)
        for got in (whole, stepped):
            assert (got - want).abs().max().item() <= 1e-4, name
            assert torch.equal(got.argmax(-1), want.argmax(-1)), name


_INTERPRETED_GDN = """
import torch
from qspec.kernels.gdn_conv import gdn_conv_qkv_torch, kernel_takes
from qspec.kernels.triton_gdn import gdn_recurrent_planes_torch, gdn_recurrent_planes_triton
from qspec.kernels.triton_gdn_conv import gdn_conv_qkv_triton

g = torch.Generator().manual_seed(0)
for T, Hk, Hv, dk, dv in ((3, 2, 4, 16, 24), (2, 1, 3, 16, 8), (1, 2, 4, 32, 20), (4, 2, 2, 8, 40)):
    C, K = 2 * Hk * dk + Hv * dv, 4
    X, w = torch.randn(C, T + K - 1, generator=g), torch.randn(C, K, generator=g)
    assert kernel_takes(X, w, T, Hk, Hv, dk, dv)
    ref = gdn_conv_qkv_torch(X, w, T, Hk, Hv, dk, dv)
    got = gdn_conv_qkv_triton(X, w, T, Hk, Hv, dk, dv)
    for a, b, shape in zip(ref, got, ((T, Hk, dk), (T, Hk, dk), (T, Hv, dv))):
        assert a.shape == b.shape == shape and (a - b).abs().max().item() < 1e-5, (T, Hk, Hv, dk, dv)
    q, k, v = ref
    alpha, beta = torch.randn(T, Hv, generator=g), torch.randn(T, Hv, generator=g)
    gates = (-(1 + 15 * torch.rand(Hv, generator=g)), torch.rand(Hv, generator=g))
    ssm = torch.randn(8, Hv, dk, dv, generator=g)
    live, base = torch.tensor(2), torch.tensor(4)
    s_ref, s_tri = ssm.clone(), ssm.clone()
    o_ref = gdn_recurrent_planes_torch(q, k, v, alpha, beta, s_ref, live, base, gates)
    o_tri = gdn_recurrent_planes_triton(q, k, v, alpha, beta, s_tri, live, base, gates, block_v=16)
    assert o_tri.shape == (T, Hv, dv) and (o_tri - o_ref).abs().max().item() < 1e-4, (T, Hk, Hv, dk, dv)
    assert (s_tri - s_ref).abs().max().item() < 1e-4 and torch.equal(s_tri[:4], ssm[:4])
    # a prompt's rows, more than the planes: only the last state, to plane base
    P = torch.randn(2, Hv, dk, dv, generator=g)
    n = 3 * T + 7
    qn, kn = [torch.nn.functional.normalize(torch.randn(n, Hk, dk, generator=g), dim=-1) for _ in range(2)]
    vn, an, bn = torch.randn(n, Hv, dv, generator=g), torch.randn(n, Hv, generator=g), torch.randn(n, Hv, generator=g)
    p_ref, p_tri = P.clone(), P.clone()
    one, zero = torch.tensor(1), torch.tensor(0)
    o_ref = gdn_recurrent_planes_torch(qn, kn, vn, an, bn, p_ref, one, zero, gates, final_only=True)
    o_tri = gdn_recurrent_planes_triton(qn, kn, vn, an, bn, p_tri, one, zero, gates, block_v=16, final_only=True)
    assert (o_tri - o_ref).abs().max().item() < 1e-4 and (p_tri - p_ref).abs().max().item() < 1e-4
    assert torch.equal(p_tri[1], P[1]) and not torch.equal(p_tri[0], P[0])
print("gdn kernels ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gdn_kernels_interpreted_with_value_head_size_unlike_key() -> None:
    """The step conv and the per-row recurrence in Triton (interpreter, CPU) at dv != dk against the references."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED_GDN], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "gdn kernels ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
