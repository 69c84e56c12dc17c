"""ModelConfig <-> config.json and GGUF metadata: round trips through the one key table, typed errors that name the
key, and the GDN value head size that differs from the key head size."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from qspec.cli import main
from qspec.config import (
    _KEYS,
    ARCH,
    ConfigError,
    ModelConfig,
    from_gguf_metadata,
    from_hf_config,
    preset,
    to_gguf_metadata,
    to_hf_config,
)
from qspec.weights import gguf_io, random_weights, read_hf, write_gguf, write_hf

CONFIGS = {
    "tiny": lambda: preset("tiny", vocab_size=512),
    "tiny-no-ple-no-mtp": lambda: preset("tiny", vocab_size=512, mtp=False, ple_layer=-1, ple_embed_dim=0,
                                         ple_multipliers=(), ple_head_offsets=(), ple_head_vocab=(), ple_rows=0),
    "value-heads-wider": lambda: preset("tiny", vocab_size=512, gdn_v_head_dim=24),
    "value-heads-narrower": lambda: preset("tiny", vocab_size=512, gdn_k_heads=1, gdn_v_heads=3, gdn_v_head_dim=8),
    "flash-next": lambda: preset("flash-next"),
}


def gguf_kv(c: ModelConfig) -> dict[str, Any]:
    """The metadata as the GGUF reader hands it over: the vocabulary and n-gram rows come from tensor shapes, and
    `write_gguf` adds the tokenizer's EOS (the model's, without PLE) when no tokenizer supplies one."""
    return {**to_gguf_metadata(c), "_vocab_size": c.vocab_size, "_ple_rows": c.ple_rows,
            "tokenizer.ggml.eos_token_id": c.eos_token_id}


# ---- round trips -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_round_trip(name: str) -> None:
    c = CONFIGS[name]()
    hf = to_hf_config(c)
    back = from_hf_config(json.loads(json.dumps(hf)))  # through JSON, as a checkpoint stores it
    assert back == c
    assert to_hf_config(back) == hf
    assert hf["linear_key_head_dim"] == c.gdn_head_dim and hf["linear_value_head_dim"] == c.gdn_v_head_dim
    # the VL wrapper holds the same text config
    assert from_hf_config({"model_type": "qwen4_exp", "text_config": hf}) == c


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gguf_round_trip(name: str) -> None:
    c = CONFIGS[name]()
    kv = to_gguf_metadata(c)
    back = from_gguf_metadata(gguf_kv(c))
    diff = [f.name for f in fields(ModelConfig) if f.compare and getattr(back, f.name) != getattr(c, f.name)]
    assert back == c, diff
    assert to_gguf_metadata(back) == kv
    assert kv[f"{ARCH}.ssm.state_size"] == c.gdn_head_dim
    assert kv[f"{ARCH}.ssm.inner_size"] == c.gdn_v_heads * c.gdn_v_head_dim
    # like llama.cpp's converter, the PLE and MTP keys only for models that have them
    assert any(k.startswith(f"{ARCH}.ple.") for k in kv) == c.has_ple
    assert (f"{ARCH}.nextn_predict_layers" in kv) == c.has_mtp


def test_table_names_real_fields_and_every_format_key_once() -> None:
    names = {f.name for f in fields(ModelConfig)}
    assert all(k.field in names for k in _KEYS)
    for side in ("hf", "gguf"):
        keys = [getattr(k, side) for k in _KEYS if getattr(k, side)]
        assert len(keys) == len(set(keys)), side
    assert len({k.field for k in _KEYS}) == len(_KEYS)


def test_defaults_fill_absent_hf_keys_as_transformers_does() -> None:
    hf = to_hf_config(preset("tiny", vocab_size=512))
    for k in ("linear_value_head_dim", "linear_conv_kernel_dim", "hc_lowrank"):
        del hf[k]
    c = from_hf_config(hf)
    # transformers' Qwen4ExpTextConfig defaults: the value head size does not follow the key head size
    assert (c.gdn_v_head_dim, c.gdn_conv_kernel, c.hc_rank) == (128, 4, 320)


def test_gguf_needs_the_keys_llama_cpp_requires() -> None:
    kv = gguf_kv(preset("tiny", vocab_size=512))
    del kv[f"{ARCH}.ssm.group_count"]
    with pytest.raises(ConfigError, match=r"^qwen4exp\.ssm\.group_count: missing from GGUF metadata$"):
        from_gguf_metadata(kv)


def test_preset_value_head_size_follows_key_head_size_unless_given() -> None:
    assert preset("tiny", gdn_head_dim=32).gdn_v_head_dim == 32
    assert preset("tiny", gdn_head_dim=32, gdn_v_head_dim=8).gdn_v_head_dim == 8


# ---- the GDN value head size -------------------------------------------------------------------------------------
def test_gguf_value_head_size_is_inner_size_over_time_step_rank() -> None:
    """llama.cpp's layout: ssm.state_size is the key head size, ssm.inner_size / ssm.time_step_rank the value's."""
    kv = gguf_kv(preset("tiny", vocab_size=512))
    assert (kv[f"{ARCH}.ssm.state_size"], kv[f"{ARCH}.ssm.time_step_rank"]) == (16, 4)
    kv[f"{ARCH}.ssm.inner_size"] = 96
    c = from_gguf_metadata(kv).validate()
    assert (c.gdn_head_dim, c.gdn_v_head_dim, c.gdn_value_dim, c.gdn_conv_dim) == (16, 24, 96, 2 * 2 * 16 + 96)
    kv[f"{ARCH}.ssm.inner_size"] = 90
    with pytest.raises(ConfigError, match=r"qwen4exp\.ssm\.inner_size: 90 is not a multiple of time_step_rank 4"):
        from_gguf_metadata(kv)


# ---- wrong types -------------------------------------------------------------------------------------------------
def _set(d: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(d)
    node = d
    *path, last = key.split("/")
    for p in path:
        node = node[p]
    node[last] = value
    return d


HF_BAD = [
    # (key path in config.json, value, message)
    ("hidden_size", "64", "hidden_size: expected an integer, got '64' (str)"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps: expected a number, got '1e-6' (str)"),
    ("num_hidden_layers", True, "num_hidden_layers: expected an integer, got True (bool)"),
    ("linear_value_head_dim", 2.5, "linear_value_head_dim: expected an integer, got 2.5 (float)"),
    ("num_experts", [8], "num_experts: expected an integer, got [8] (list)"),
    ("layer_types", "linear_attention", "layer_types: expected a list, got 'linear_attention' (str)"),
    ("layer_types", ["linear_attention", 3, "linear_attention", "full_attention"],
     "layer_types[1]: expected a string, got 3 (int)"),
    ("rope_parameters", [1, 2], "rope_parameters: expected a JSON object, got [1, 2] (list)"),
    ("rope_parameters/partial_rotary_factor", "0.25", "rope_parameters.partial_rotary_factor: expected a number"),
    ("rope_parameters/mrope_section", [1, "2", 1], "rope_parameters.mrope_section[1]: expected an integer"),
    ("ple_layer_ids", ["2"], "ple_layer_ids[0]: expected an integer, got '2' (str)"),
    ("eos_token_id", [], "eos_token_id: empty list"),
    ("eos_token_id", ["511"], "eos_token_id[0]: expected an integer"),
    ("output_gate_type", 1, "output_gate_type: expected a string, got 1 (int)"),
    ("seed", {"a": 1}, "seed: expected an integer, got {'a': 1} (dict)"),
]


@pytest.mark.parametrize(("key", "value", "message"), HF_BAD, ids=[f"{k}={v!r}" for k, v, _ in HF_BAD])
def test_hf_wrong_types_name_the_key(key: str, value: Any, message: str) -> None:
    hf = to_hf_config(preset("tiny", vocab_size=512))
    with pytest.raises(ConfigError) as e:
        from_hf_config(_set(hf, key, value))
    assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(ConfigError) as e:  # inside the VL wrapper the key is named by its full path
        from_hf_config({"model_type": "qwen4_exp", "text_config": _set(hf, key, value)})
    assert str(e.value).startswith("text_config." + message), str(e.value)


@pytest.mark.parametrize(("cfg", "message"), [
    ([1, 2], "config.json: expected a JSON object, got [1, 2] (list)"),
    ("qwen4_exp_text", "config.json: expected a JSON object, got 'qwen4_exp_text' (str)"),
    ({"model_type": "qwen4_exp", "text_config": 3}, "text_config: expected a JSON object, got 3 (int)"),
    ({"model_type": "qwen4_exp"}, "text_config: expected a JSON object, got None"),
])
def test_hf_config_that_is_not_an_object(cfg: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_hf_config(cfg)
    assert str(e.value).startswith(message), str(e.value)


def test_hf_integral_floats_and_interval_layers() -> None:
    hf = to_hf_config(preset("tiny", vocab_size=512))
    assert from_hf_config({**hf, "hidden_size": 64.0}) == from_hf_config(hf)  # JSON writers may emit 64.0
    no_types = {k: v for k, v in hf.items() if k != "layer_types"}
    assert from_hf_config(no_types).layer_recurrent == (True, True, True, False)
    with pytest.raises(ConfigError, match="^full_attention_interval: must be > 0, got 0$"):
        from_hf_config({**no_types, "full_attention_interval": 0})


GGUF_BAD = [
    ("block_count", "5", "qwen4exp.block_count: expected an integer, got '5' (str)"),
    ("ssm.state_size", [16], "qwen4exp.ssm.state_size: expected an integer, got [16] (list)"),
    ("ssm.inner_size", "96", "qwen4exp.ssm.inner_size: expected an integer"),
    ("rope.freq_base", "1e7", "qwen4exp.rope.freq_base: expected a number, got '1e7' (str)"),
    ("attention.recurrent_layers", "1110", "qwen4exp.attention.recurrent_layers: expected a list"),
    ("attention.recurrent_layers", [True, "x", True, False, False],
     "qwen4exp.attention.recurrent_layers[1]: expected a boolean"),
    ("attention.compress_ratios", [0, 0, 0, 4.5, 0], "qwen4exp.attention.compress_ratios[3]: expected an integer"),
    ("expert_feed_forward_length", ["32"], "qwen4exp.expert_feed_forward_length[0]: expected an integer"),
    ("ple.layers", ["1"], "qwen4exp.ple.layers[0]: expected an integer, got '1' (str)"),
    ("ple.eos_token_id", 1.5, "qwen4exp.ple.eos_token_id: expected an integer, got 1.5 (float)"),
]


@pytest.mark.parametrize(("key", "value", "message"), GGUF_BAD, ids=[f"{k}={v!r}" for k, v, _ in GGUF_BAD])
def test_gguf_wrong_types_name_the_key(key: str, value: Any, message: str) -> None:
    kv = gguf_kv(preset("tiny", vocab_size=512))
    assert f"{ARCH}.{key}" in kv
    kv[f"{ARCH}.{key}"] = value
    with pytest.raises(ConfigError) as e:
        from_gguf_metadata(kv)
    assert str(e.value).startswith(message), str(e.value)


# ---- through the CLI: one `qspec: error:` line ------------------------------------------------------------------
def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("qspec: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err and out == "", err
    return lines[0]


@pytest.fixture(scope="module")
def small() -> tuple[ModelConfig, dict]:
    c = preset("tiny", vocab_size=512, mtp=False, layers=1, ple_layer=-1, ple_embed_dim=0, ple_multipliers=(),
               ple_head_offsets=(), ple_head_vocab=(), ple_rows=0)
    return c, random_weights(c, seed=1)


def test_cli_names_a_wrong_type_in_config_json(small: tuple[ModelConfig, dict], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    c, w = small
    write_hf(tmp_path / "hf", c, w)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "num_attention_heads": "4"}))
    line = _one_error_line(capsys, ["logits", str(tmp_path / "hf"), "--ids", "1,2", "--out", str(tmp_path / "o.npy")])
    assert "num_attention_heads: expected an integer, got '4' (str)" in line
    cfg_path.write_text("[1, 2]")
    line = _one_error_line(capsys, ["logits", str(tmp_path / "hf"), "--ids", "1,2", "--out", str(tmp_path / "o.npy")])
    assert "config.json: expected a JSON object" in line


def test_cli_names_a_wrong_type_in_gguf_metadata(small: tuple[ModelConfig, dict], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    c, w = small
    with monkeypatch.context() as m:  # the writer stores what the metadata table hands it
        m.setattr(gguf_io, "to_gguf_metadata", lambda c: {**to_gguf_metadata(c), f"{ARCH}.ssm.state_size": "16"})
        write_gguf(tmp_path / "m.gguf", c, w)
    line = _one_error_line(capsys, ["logits", str(tmp_path / "m.gguf"), "--ids", "1,2", "--out",
                                    str(tmp_path / "o.npy")])
    assert "qwen4exp.ssm.state_size: expected an integer, got '16' (str)" in line


def test_hf_split_ngram_parts_of_the_wrong_type(tmp_path: Path) -> None:
    c = preset("tiny", vocab_size=512, mtp=False)
    write_hf(tmp_path / "hf", c, random_weights(c, seed=2))
    cfg_path = tmp_path / "hf" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "split_ngram_parts": "4"}))
    with pytest.raises(ConfigError, match="^split_ngram_parts: expected an integer, got '4'$"):
        read_hf(tmp_path / "hf")
