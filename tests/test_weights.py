"""Weight loading: dequantizers vs gguf-py, GGUF/HF round trips, transformers compatibility, bad inputs."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from qspec.config import ConfigError, ModelConfig, preset
from qspec.weights import (
    HostRowTable,
    WeightsError,
    dequantize,
    load_model_weights,
    quantize_q4_0,
    quantize_q8_0,
    random_weights,
    read_draft_gguf,
    read_gguf,
    read_gguf_metadata,
    read_hf,
    write_gguf,
    write_hf,
    write_random_model,
)
from qspec.weights import dequant as dequant_mod
from qspec.weights.gguf_io import PLE_TABLE, _add_kv
from qspec.weights.names import mtp_shapes, tensor_shapes
from qspec.weights.qweight import QuantWeight
from qspec.weights.random_model import random_tensor

# ---- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    c = preset("tiny", vocab_size=512)
    assert c.eos_token_id == 511 and c.has_ple and c.has_mtp
    return c


@pytest.fixture(scope="module")
def weights(cfg: ModelConfig) -> dict:
    return random_weights(cfg, seed=3)


@pytest.fixture(scope="module")
def gguf_f32(tmp_path_factory: pytest.TempPathFactory, cfg: ModelConfig, weights: dict) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(p, cfg, weights)
    return p


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, cfg: ModelConfig, weights: dict) -> Path:
    d = tmp_path_factory.mktemp("hf") / "tiny"
    write_hf(d, cfg, weights)
    return d


def dense(x: torch.Tensor | HostRowTable | QuantWeight) -> torch.Tensor:
    if isinstance(x, QuantWeight):  # a matrix the loader kept as its GGUF blocks
        return x.dequantize(torch.float32)
    return x.materialize() if isinstance(x, HostRowTable) else x


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x, y = dense(a[k]), dense(b[k])
        assert x.shape == y.shape and x.dtype == y.dtype, k
        assert torch.equal(x, y), k


# ---- dequantizers ------------------------------------------------------------------------------------------------
# Byte offsets of the f16 scale fields per block: random bytes there could be inf/nan, so they are overwritten.
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", list(F16_FIELDS))
def test_block_dequant_matches_gguf(qtype: Q) -> None:
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 48, np.random.default_rng(int(qtype)))
    shape = (3, 16 * block)
    ref = gguf.quants.dequantize(raw.reshape(3, -1), qtype)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.shape == shape and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), ref)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, shape, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_plain_dequant_matches_gguf(qtype: Q) -> None:
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype).view(np.uint8)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, (5, 7))
    np.testing.assert_array_equal(got.numpy(), gguf.quants.dequantize(raw, qtype).reshape(5, 7))


def test_dequant_chunked_path_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = torch.from_numpy(random_blocks(Q.Q6_K, 10, np.random.default_rng(1)))
    whole = dequantize(raw, Q.Q6_K, (10, 256))
    monkeypatch.setattr(dequant_mod, "_CHUNK_BLOCKS", 3)
    assert torch.equal(dequantize(raw, Q.Q6_K, (10, 256)), whole)


def test_quantizers_are_bit_exact_with_ggml() -> None:
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    x[0, :32] = 0  # all-zero block: d = 0 path
    x[1, :32] = torch.linspace(-1, 1, 32) * 127 / 2  # exact .5 ties: ggml rounds away from zero
    x[2, 32:64] = -x[2, 32:64].abs()  # negative extreme drives the Q4_0 sign
    for fn, qtype in ((quantize_q8_0, Q.Q8_0), (quantize_q4_0, Q.Q4_0)):
        np.testing.assert_array_equal(fn(x).numpy(), gguf.quants.quantize(x.numpy(), qtype))


def test_dequant_rejects_bad_input() -> None:
    with pytest.raises(WeightsError, match="needs 68 bytes"):
        dequantize(torch.zeros(60, dtype=torch.uint8), Q.Q8_0, (2, 32))
    with pytest.raises(WeightsError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (256,))
    with pytest.raises(WeightsError, match="round_scales applies to Q4_K, Q5_K and Q6_K, not Q8_0"):
        dequantize(torch.zeros(68, dtype=torch.uint8), Q.Q8_0, (2, 32), torch.bfloat16, round_scales=True)


# ---- random weights ----------------------------------------------------------------------------------------------
def test_random_weights_deterministic_and_independent(cfg: ModelConfig, weights: dict) -> None:
    assert set(weights) == set(tensor_shapes(cfg))
    for name, shape in tensor_shapes(cfg).items():
        assert tuple(weights[name].shape) == shape, name
    # The same name draws the same values whatever else the config holds (per-name generators).
    no_mtp = random_weights(cfg.with_(n_mtp_layers=0), seed=3)
    assert set(weights) - set(no_mtp) == set(mtp_shapes(cfg))
    assert torch.equal(no_mtp["blk.0.attn_qkv.weight"], weights["blk.0.attn_qkv.weight"])
    assert not torch.equal(random_weights(cfg, seed=4)["blk.0.attn_qkv.weight"], weights["blk.0.attn_qkv.weight"])
    # Value conventions the model relies on.
    assert weights["blk.0.ssm_a"].max() <= -1 and weights["blk.0.ssm_a"].min() >= -16
    for name in ("blk.1.ple_norm_key.weight", "blk.3.attn_q_norm.weight", "blk.4.nextn.hnorm.weight"):
        assert 0.5 <= weights[name].min() and weights[name].max() <= 1.5 and abs(weights[name].mean() - 1) < 0.1
    w = weights["blk.0.ffn_up_exps.weight"]
    assert abs(w.std().item() * cfg.hidden ** 0.5 - 1) < 0.1


def test_random_tensor_chunking_is_part_of_the_definition(cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    import qspec.weights.random_model as rm

    monkeypatch.setattr(rm, "_CHUNK_ELEMS", 64 * 5)  # 5 rows per draw
    a = random_tensor(cfg, "token_embd.weight", (12, 64), seed=1)
    assert a.shape == (12, 64) and a.dtype == torch.float32
    assert torch.equal(a, random_tensor(cfg, "token_embd.weight", (12, 64), seed=1))


# ---- GGUF --------------------------------------------------------------------------------------------------------
def test_gguf_f32_round_trip_is_exact(cfg: ModelConfig, weights: dict, gguf_f32: Path) -> None:
    cfg2, w2 = read_gguf(gguf_f32)
    assert cfg2 == cfg
    assert cfg2.rms_eps == 1e-6  # float32 metadata reads back as the decimal it was written from
    assert_same(weights, w2)


def test_gguf_metadata_types(cfg: ModelConfig, tmp_path: Path, weights: dict) -> None:
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [f"t{i}" for i in range(cfg.vocab_size)],
           "tokenizer.ggml.token_type": [1] * cfg.vocab_size, "tokenizer.ggml.merges": ["t t", "a b"],
           "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.bos_token_id": 3}
    p = tmp_path / "m.gguf"
    write_gguf(p, cfg, weights, extra_kv=tok)
    fields = GGUFReader(p).fields
    assert list(fields).count("general.architecture") == 1
    for key in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"):
        assert fields[f"qwen4exp.{key}"].types == [GGUFValueType.ARRAY, GGUFValueType.UINT64], key
    assert fields["qwen4exp.block_count"].types == [GGUFValueType.UINT32]
    assert fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    md = read_gguf_metadata(p)
    for k, v in tok.items():
        assert md[k] == v, k
    assert md["general.architecture"] == "qwen4exp"
    assert md["qwen4exp.ple.layer_multipliers"] == list(cfg.ple_multipliers)


def test_gguf_q8_0_matches_gguf_dequant(tmp_path: Path) -> None:
    # A 32-wide PLE head makes the n-gram table quantizable too.
    cfg = preset("tiny", vocab_size=512, ple_embed_dim=512)
    w = random_weights(cfg, seed=5)
    p = tmp_path / "q8.gguf"
    write_gguf(p, cfg, w, qtypes=Q.Q8_0)
    types = {t.name: t.tensor_type for t in GGUFReader(p).tensors}
    assert types["blk.0.attn_qkv.weight"] == Q.Q8_0 and types[PLE_TABLE] == Q.Q8_0
    assert types["blk.0.ssm_a"] == Q.F32 and types["blk.0.ssm_conv1d.weight"] == Q.F32  # 1-D, and 4-wide rows
    _, w2 = read_gguf(p)
    for name, x in w.items():
        ref = dense(x)
        if types[name] == Q.Q8_0:
            ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(ref.numpy(), Q.Q8_0), Q.Q8_0))
        assert torch.equal(dense(w2[name]), ref.reshape(x.shape)), name
    rows = torch.tensor([[5, 0], [cfg.ple_rows - 1, 5]])
    assert torch.equal(w2[PLE_TABLE].gather(rows), dense(w2[PLE_TABLE])[rows])


def test_gguf_loads_to_device_dtype_and_without_mtp(cfg: ModelConfig, weights: dict, gguf_f32: Path) -> None:
    cfg2, w = load_model_weights(gguf_f32, dtype=torch.bfloat16, with_mtp=False)
    assert cfg2.has_mtp and set(w) == set(tensor_shapes(cfg, with_mtp=False))
    assert w["blk.0.attn_qkv.weight"].dtype == torch.bfloat16
    assert torch.equal(w["blk.0.attn_qkv.weight"], weights["blk.0.attn_qkv.weight"].bfloat16())


def test_gguf_reads_fused_gate_up_experts(cfg: ModelConfig, weights: dict, tmp_path: Path) -> None:
    """llama.cpp may store `ffn_gate_up_exps` [E, 2F, D] (gate rows first) instead of two tensors."""
    from qspec.config import to_gguf_metadata

    p = tmp_path / "fused.gguf"
    w = gguf.GGUFWriter(p, "qwen4exp")
    for k, v in to_gguf_metadata(cfg).items():
        if k != "general.architecture":
            _add_kv(w, k, v)
    for name, x in weights.items():
        if name.endswith("ffn_up_exps.weight"):
            continue
        if name.endswith("ffn_gate_exps.weight"):
            up = weights[name.replace("gate_exps", "up_exps")]
            name, x = name.replace("gate_exps", "gate_up_exps"), torch.cat([x, up], dim=1)
        w.add_tensor(name, dense(x).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, w2 = read_gguf(p)
    assert_same(weights, w2)


def test_draft_only_gguf(cfg: ModelConfig, weights: dict, tmp_path: Path) -> None:
    p = tmp_path / "mtp.gguf"
    write_gguf(p, cfg, {n: weights[n] for n in mtp_shapes(cfg)}, draft_only=True)
    assert {t.name for t in GGUFReader(p).tensors} == set(mtp_shapes(cfg))
    draft = read_draft_gguf(p, cfg)
    assert_same({n: weights[n] for n in mtp_shapes(cfg)}, draft)
    # A target exported without MTP can still take the draft block.
    assert set(read_draft_gguf(p, cfg.with_(n_mtp_layers=0))) == set(mtp_shapes(cfg))
    with pytest.raises(WeightsError, match="expert_ff"):
        read_draft_gguf(p, cfg.with_(expert_ff=64))
    with pytest.raises(WeightsError, match="draft-only"):
        read_gguf(p)


# ---- HostRowTable ------------------------------------------------------------------------------------------------
def test_ple_table_is_mmapped_and_gathers_rows(cfg: ModelConfig, weights: dict, gguf_f32: Path) -> None:
    _, w = read_gguf(gguf_f32)
    table = w[PLE_TABLE]
    assert isinstance(table, HostRowTable) and table.shape == (cfg.ple_rows, cfg.ple_head_dim)
    (seg,) = table.segments
    assert isinstance(seg, np.memmap) and not seg.flags.owndata and Path(seg.filename) == gguf_f32.resolve()
    ref = dense(weights[PLE_TABLE])
    rows = torch.tensor([[0, 17, 17], [cfg.ple_rows - 1, 3, 1000]])
    got = table.gather(rows, "cpu", torch.float16)
    assert got.shape == (2, 3, cfg.ple_head_dim) and got.dtype == torch.float16
    assert torch.equal(got, ref[rows].half())
    with pytest.raises(IndexError):
        table.gather(torch.tensor([cfg.ple_rows]))


def test_hf_ple_table_spans_shards(cfg: ModelConfig, weights: dict, hf_dir: Path) -> None:
    _, w = read_hf(hf_dir)
    table = w[PLE_TABLE]
    assert len(table.segments) == 4 and all(isinstance(s, np.memmap) for s in table.segments)
    rows = torch.randint(0, cfg.ple_rows, (64,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(table.gather(rows), dense(weights[PLE_TABLE])[rows])


# ---- HF ----------------------------------------------------------------------------------------------------------
def test_hf_round_trip_is_exact(cfg: ModelConfig, weights: dict, hf_dir: Path) -> None:
    raw_cfg = json.loads((hf_dir / "config.json").read_text())
    assert raw_cfg["split_ngram_parts"] == 4
    cfg2, w2 = read_hf(hf_dir)
    assert cfg2 == cfg
    assert_same(weights, w2)


def test_gguf_and_hf_give_identical_weights(gguf_f32: Path, hf_dir: Path) -> None:
    cfg_g, w_g = load_model_weights(gguf_f32)
    cfg_h, w_h = load_model_weights(hf_dir)
    assert cfg_g == cfg_h
    assert_same(w_g, w_h)


def test_hf_sharded_vl_and_split_expert_layouts(cfg: ModelConfig, weights: dict, tmp_path: Path) -> None:
    """Rewrite a checkpoint as the released VL layout: text under `model.language_model.`, per-expert MoE
    weights, a vision tower to ignore, several files with an index, and a VL config.json."""
    src = tmp_path / "src"
    write_hf(src, cfg, weights, max_shard_bytes=200_000)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        sd.update(load_file(src / f))
    vl: dict[str, torch.Tensor] = {"model.visual.patch_embed.proj.weight": torch.zeros(2, 2)}
    for k, v in sd.items():
        k = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj")
            for e in range(cfg.n_experts):
                vl[f"{base}{e}.gate_proj.weight"] = v[e, :cfg.expert_ff].clone()
                vl[f"{base}{e}.up_proj.weight"] = v[e, cfg.expert_ff:].clone()
            continue
        if k.endswith("mlp.experts.down_proj"):
            for e in range(cfg.n_experts):
                vl[f"{k.removesuffix('down_proj')}{e}.down_proj.weight"] = v[e].clone()
            continue
        vl[k] = v
    dst = tmp_path / "vl"
    dst.mkdir()
    keys = sorted(vl)
    half = len(keys) // 2
    wm = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: vl[k] for k in part}, dst / fname)
        wm |= dict.fromkeys(part, fname)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text,
                                                 "architectures": ["Qwen4ExpForConditionalGeneration"]}))
    cfg2, w2 = read_hf(dst)
    assert cfg2 == cfg
    assert_same(weights, w2)


def hf_reference(cfg: ModelConfig, w: dict) -> dict[str, torch.Tensor]:
    """Canonical -> HF state dict written out plainly (head loops, no shared code with qspec.weights.hf)."""
    K, V, hd = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_v_head_dim  # value heads are hd wide
    R = V // K

    def hf_heads(x: torch.Tensor, dim: int, start: int, block: int) -> torch.Tensor:
        """File-order value heads back to HF order: HF head g*R + r sits at file position r*K + g."""
        x = x.transpose(0, dim)
        out = x.clone()
        for g in range(K):
            for r in range(R):
                h, n = g * R + r, r * K + g
                out[start + h * block:start + (h + 1) * block] = x[start + n * block:start + (n + 1) * block]
        return out.transpose(0, dim)

    hc_parts = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up",
                "inject": "block_inject_weight"}
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "lm_head.weight": w["output.weight"]}
    for name, x in w.items():
        if name.startswith("output_hc_"):
            part = name.removeprefix("output_hc_").removesuffix(".weight")
            sd[f"model.hyper_connection_mixer.{hc_parts[part]}.weight"] = x - 1 if part == "norm" else x
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None:
            assert name in ("token_embd.weight", "output.weight", PLE_TABLE), name
            continue
        i, s = int(m.group(1)), m.group(2)
        if i == cfg.n_layers:
            continue  # MTP: transformers ignores mtp.*
        p = f"model.layers.{i}."
        if s.startswith(("hc_attn_", "hc_ffn_")):
            mod, part = s.split("_", 2)[1], s.split("_", 2)[2].removesuffix(".weight")
            hf = f"{p}{'attn' if mod == 'attn' else 'mlp'}_hyper_connection.{hc_parts[part]}.weight"
            sd[hf] = x - 1 if part == "norm" else x
        elif s in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"):
            proj = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
            sd[f"{p}self_attn.{proj[s.removesuffix('.weight')]}.weight"] = x
        elif s in ("attn_q_norm.weight", "attn_k_norm.weight"):
            sd[f"{p}self_attn.{s[5]}_norm.weight"] = x - 1
        elif s == "indexer.q_proj.weight":
            sd[f"{p}self_attn.indexer.index_qk_proj.weight"] = torch.cat([x, w[f"blk.{i}.indexer.k_proj.weight"]])
        elif s in ("indexer.q_norm.weight", "indexer.k_norm.weight"):
            sd[f"{p}self_attn.indexer.{s[8]}_layernorm.weight"] = x - 1
        elif s == "attn_qkv.weight":
            sd[f"{p}linear_attn.in_proj_qkv.weight"] = hf_heads(x, 0, 2 * cfg.gdn_key_dim, hd)
        elif s == "attn_gate.weight":
            sd[f"{p}linear_attn.in_proj_z.weight"] = hf_heads(x, 0, 0, hd)
        elif s in ("ssm_beta.weight", "ssm_alpha.weight"):
            sd[f"{p}linear_attn.in_proj_{s[4]}.weight"] = hf_heads(x, 0, 0, 1)
        elif s == "ssm_a":
            sd[f"{p}linear_attn.A_log"] = hf_heads((-x.double()).log().float(), 0, 0, 1)
        elif s == "ssm_dt.bias":
            sd[f"{p}linear_attn.dt_bias"] = hf_heads(x, 0, 0, 1)
        elif s == "ssm_conv1d.weight":
            sd[f"{p}linear_attn.conv1d.weight"] = hf_heads(x, 0, 2 * cfg.gdn_key_dim, hd)[:, None]
        elif s == "ssm_norm.weight":
            sd[f"{p}linear_attn.norm.weight"] = x
        elif s == "ssm_out.weight":
            sd[f"{p}linear_attn.out_proj.weight"] = hf_heads(x, 1, 0, hd)
        elif s == "ffn_gate_inp.weight":
            sd[f"{p}mlp.gate.weight"] = x
        elif s == "ffn_gate_exps.weight":
            sd[f"{p}mlp.experts.gate_up_proj"] = torch.cat([x, w[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
        elif s == "ffn_down_exps.weight":
            sd[f"{p}mlp.experts.down_proj"] = x
        elif s == "ffn_gate_inp_shexp.weight":
            sd[f"{p}mlp.shared_expert_gate.weight"] = x[None]
        elif s.endswith("_shexp.weight"):
            sd[f"{p}mlp.shared_expert.{s.split('_')[1]}_proj.weight"] = x
        elif s in ("ple_key.weight", "ple_value.weight"):
            sd[f"{p}ple.{s.split('_')[1].removesuffix('.weight')}_proj.weight"] = x
        elif s.startswith("ple_norm_"):
            sd[f"{p}ple.norm_{s.removeprefix('ple_norm_').removesuffix('.weight')}.weight"] = x - 1
        elif s == "ple_conv1d.weight":
            sd[f"{p}ple.conv1d.weight"] = x[:, None]
        else:
            assert s in ("ffn_up_exps.weight", "indexer.k_proj.weight"), s  # folded into fused tensors above
    base = f"model.layers.{cfg.ple_layer}.ple.ple_embedding."
    sd[f"{base}ngram_embedding.weight"] = dense(w[PLE_TABLE])
    sd[f"{base}layer_multipliers"] = torch.tensor(cfg.ple_multipliers)
    sd[f"{base}ngram_heads_offsets"] = torch.tensor(cfg.ple_head_offsets)
    sd[f"{base}ngram_heads_vocab_sizes"] = torch.tensor(cfg.ple_head_vocab)
    return sd


def assert_transformers_loads(cfg: ModelConfig, weights: dict, hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen4ExpForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref = hf_reference(cfg, weights)
    sd = model.state_dict()
    assert set(sd) == set(ref)
    for k, v in sd.items():
        assert torch.equal(v, ref[k]), k


def test_transformers_loads_write_hf_output(cfg: ModelConfig, weights: dict, hf_dir: Path) -> None:
    assert_transformers_loads(cfg, weights, hf_dir)


def test_value_heads_unlike_key_heads_in_both_formats(tmp_path: Path) -> None:
    """linear_value_head_dim 24 != linear_key_head_dim 16: GGUF ssm.inner_size 96 != 4 x ssm.state_size 16."""
    c = preset("tiny", vocab_size=512, mtp=False, gdn_v_head_dim=24)
    w = random_weights(c, seed=4)
    assert w["blk.0.attn_qkv.weight"].shape == (2 * 2 * 16 + 4 * 24, c.hidden)
    assert w["blk.0.ssm_norm.weight"].shape == (24,) and w["blk.0.ssm_out.weight"].shape == (c.hidden, 96)
    write_hf(tmp_path / "hf", c, w)
    assert_transformers_loads(c, w, tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", c, w)
    for path in (tmp_path / "hf", tmp_path / "m.gguf"):
        c2, w2 = load_model_weights(path)
        assert c2 == c and c2.gdn_v_head_dim == 24, path
        assert_same(w, w2)


# ---- bad inputs --------------------------------------------------------------------------------------------------
def patch_tensor_info(path: Path, name: str, *, ne: tuple[int, ...] | None = None, qtype: Q | None = None,
                      rename: str | None = None) -> None:
    """Edit one tensor's header entry in place: u64 name length, name, u32 n_dims, u64 ne[n_dims], u32 type."""
    data = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    i = data.index(key) + len(key)
    n_dims = int.from_bytes(data[i:i + 4], "little")
    if ne is not None:
        data[i + 4:i + 4 + 8 * n_dims] = b"".join(int(d).to_bytes(8, "little") for d in ne)
    if qtype is not None:
        data[i + 4 + 8 * n_dims:i + 8 + 8 * n_dims] = int(qtype).to_bytes(4, "little")
    if rename is not None:
        assert len(rename) == len(name)
        data[i - len(name):i] = rename.encode()
    path.write_bytes(bytes(data))


@pytest.fixture()
def gguf_copy(gguf_f32: Path, tmp_path: Path) -> Path:
    p = tmp_path / "copy.gguf"
    p.write_bytes(gguf_f32.read_bytes())
    return p


def test_gguf_errors_name_the_problem(gguf_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="not found"):
        load_model_weights(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(WeightsError, match="bad magic"):
        load_model_weights(junk)


def test_gguf_truncated_is_caught_before_loading(gguf_copy: Path) -> None:
    data = gguf_copy.read_bytes()
    gguf_copy.write_bytes(data[:-1000])
    with pytest.raises(WeightsError, match=r"truncated file: tensor 'blk\.4\.[a-z_.]+' needs bytes"):
        load_model_weights(gguf_copy)
    gguf_copy.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(WeightsError, match="truncated"):
        load_model_weights(gguf_copy)


def test_gguf_unknown_architecture(gguf_copy: Path) -> None:
    data = bytearray(gguf_copy.read_bytes())
    key = b"general.architecture"
    i = data.index(key) + len(key) + 4 + 8  # skip the value type and the string length
    assert data[i:i + 8] == b"qwen4exp"
    data[i:i + 8] = b"qwen9exp"
    gguf_copy.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="qwen9exp"):
        load_model_weights(gguf_copy)


def test_gguf_missing_tensor(gguf_copy: Path) -> None:
    patch_tensor_info(gguf_copy, "blk.0.ssm_a", rename="blk.0.ssm_z")
    with pytest.raises(WeightsError, match="missing tensor 'blk.0.ssm_a'"):
        load_model_weights(gguf_copy)


def test_gguf_wrong_shape(cfg: ModelConfig, gguf_copy: Path) -> None:
    patch_tensor_info(gguf_copy, "blk.0.attn_qkv.weight", ne=(cfg.gdn_conv_dim, cfg.hidden))  # transposed
    with pytest.raises(WeightsError, match=r"'blk.0.attn_qkv.weight' has wrong shape: expected \(128, 64\), "
                                           r"got \(64, 128\)"):
        load_model_weights(gguf_copy)


def test_gguf_unsupported_quant_type(gguf_copy: Path) -> None:
    patch_tensor_info(gguf_copy, "blk.2.attn_gate.weight", qtype=Q.I32)  # same 4 bytes/element as F32
    with pytest.raises(WeightsError, match="'blk.2.attn_gate.weight' has unsupported quant type I32"):
        load_model_weights(gguf_copy)


def test_gguf_mtp_requested_but_absent(cfg: ModelConfig, weights: dict, tmp_path: Path) -> None:
    p = tmp_path / "nomtp.gguf"
    write_gguf(p, cfg, {n: weights[n] for n in tensor_shapes(cfg, with_mtp=False)})
    assert not read_gguf(p)[0].has_mtp
    with pytest.raises(WeightsError, match="nextn_predict_layers"):
        read_gguf(p, with_mtp=True)


def test_writer_rejects_bad_tensors(cfg: ModelConfig, weights: dict, tmp_path: Path) -> None:
    bad = dict(weights)
    bad["blk.0.attn_gate.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightsError, match=r"blk.0.attn_gate.weight: wrong shape"):
        write_gguf(tmp_path / "x.gguf", cfg, bad)
    with pytest.raises(WeightsError, match="blk.0.attn_gate.weight: wrong shape"):
        write_hf(tmp_path / "x", cfg, bad)
    del bad["blk.0.attn_gate.weight"]
    with pytest.raises(WeightsError, match="missing tensor 'blk.0.attn_gate.weight'"):
        write_gguf(tmp_path / "y.gguf", cfg, bad)
    with pytest.raises(WeightsError, match="Q2_K"):
        write_gguf(tmp_path / "z.gguf", cfg, weights, qtypes=Q.Q2_K)


@pytest.fixture()
def hf_copy(hf_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    for f in hf_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def edit_safetensors(d: Path, fn: Callable[[dict[str, torch.Tensor]], object]) -> None:
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors")


def test_hf_errors_name_the_problem(hf_copy: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="no config.json"):
        load_model_weights(empty)
    cfg_json = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg_json, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="llama"):
        load_model_weights(hf_copy)


@pytest.mark.parametrize("case", ["missing", "shape", "dtype", "truncated", "shard"])
def test_hf_bad_tensors(hf_copy: Path, case: str) -> None:
    key = "model.layers.0.linear_attn.in_proj_z.weight"
    if case == "missing":
        edit_safetensors(hf_copy, lambda sd: sd.pop(key))
        match = f"missing tensor {key}"
    elif case == "shape":
        edit_safetensors(hf_copy, lambda sd: sd.__setitem__(key, torch.zeros(64, 63)))
        match = rf"'{key}' has wrong shape: expected \(64, 64\), got \(64, 63\)"
    elif case == "dtype":
        edit_safetensors(hf_copy, lambda sd: sd.__setitem__(key, sd[key].to(torch.float8_e4m3fn)))
        match = f"'{key}' has unsupported dtype F8_E4M3"
    elif case == "truncated":
        f = hf_copy / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
        match = "truncated file: tensor"
    else:
        edit_safetensors(hf_copy, lambda sd: sd.pop("model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight"))
        match = "shard_1"
    with pytest.raises(WeightsError, match=match):
        load_model_weights(hf_copy)


def test_write_random_model_both_formats(cfg: ModelConfig, tmp_path: Path) -> None:
    write_random_model(tmp_path / "r.gguf", cfg, seed=9, fmt="gguf", qtype=Q.Q4_0)
    write_random_model(tmp_path / "r_hf", cfg, seed=9, fmt="hf", dtype=torch.bfloat16)
    ref = random_weights(cfg, seed=9)
    _, wg = load_model_weights(tmp_path / "r.gguf")
    _, wh = load_model_weights(tmp_path / "r_hf", dtype=torch.bfloat16)
    assert torch.equal(wg["blk.0.ssm_a"], ref["blk.0.ssm_a"])  # 1-D tensors stay F32
    x = ref["blk.0.attn_gate.weight"]
    q4 = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), Q.Q4_0), Q.Q4_0)
    assert torch.equal(dense(wg["blk.0.attn_gate.weight"]), torch.from_numpy(q4))
    assert torch.equal(wh["blk.0.attn_gate.weight"], x.bfloat16())


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_copied_tensors_leave_resident_memory(tmp_path: Path) -> None:
    """A tensor copied out of the reader's mmap gives its file pages back (they count as resident memory while
    mapped): loading a file must not cost its size again on top of the weights."""
    from qspec.weights.gguf_io import _drop_pages

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    n = 64 << 20
    (tmp_path / "f.bin").write_bytes(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes())
    mm = np.memmap(tmp_path / "f.bin", mode="r")
    view = mm[4096 + 17:][: n // 2]  # a view of a view, not page-aligned, as GGUFReader's tensors are
    before = resident()
    assert int(view.sum()) > 0  # reads its pages in
    touched = resident()
    _drop_pages(view)
    after = resident()
    assert touched - before > n // 4 and touched - after > n // 4, (before, touched, after)
    assert int(np.asarray(mm[:4096]).sum()) > 0 and int(view[:10].sum()) >= 0  # still readable from the file
