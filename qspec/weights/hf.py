"""Read and write HF `qwen4_exp` safetensors checkpoints as the canonical weight dict (see `names.py`).

The HF -> canonical direction applies llama.cpp's converter transforms (conversion/qwen4exp.py):
- zero-centred RMSNorm gammas get +1 (every `Qwen4ExpTextRMSNorm`; the gated `linear_attn.norm` does not);
- `A_log` becomes `ssm_a = -exp(A_log)`;
- GDN value heads move from HF's grouped order to the file's tiled order: file head `n = r*K + g` holds HF
  head `g*R + r` (K key heads, R = V/K value heads per key head), in every V-indexed row/column/channel;
- fused or per-expert MoE weights become `ffn_{gate,up,down}_exps`; `index_qk_proj` splits into q/k;
- the n-gram table shards (`ngram_embedding.shard_{i}`) are stacked in shard-index order;
- MTP: `eh_proj = cat(fc_embedding, fc_hidden)` along the input dim.

MTP names (not in transformers; taken from SGLang `qwen4_exp_mtp.py`, which loads `mtp.*` by replacing
`mtp.` with `model.`): `mtp.fc_embedding.weight` [D, D], `mtp.fc_hidden.weight` [D, D] (applied to each
D-wide stream of the pre_fc_norm_hidden'ed hc bundle), `mtp.pre_fc_norm_embedding.weight` [D],
`mtp.pre_fc_norm_hidden.weight` [hc_dim], `mtp.hyper_connection_mixer.*` and `mtp.layers.0.*` named like a
trunk attention layer. Some exports nest them under the text prefix (`model.language_model.mtp.`); both are read.

`write_hf` is the exact inverse (CausalLM layout, prefix `model.`, fused experts, sharded n-gram table).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from safetensors.torch import save_file

from qspec.config import ConfigError, ModelConfig, from_hf_config, to_hf_config
from qspec.weights.dequant import WeightsError
from qspec.weights.gguf_io import PLE_TABLE, HostRowTable, Weights
from qspec.weights.names import tensor_shapes, writable_shapes

Tensor = torch.Tensor
_FLOAT_DTYPES = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16, "BF16": GGMLQuantizationType.BF16}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")


# ---- rules: one HF <-> canonical correspondence each -------------------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    canon: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    load: Callable[[list[Tensor]], list[Tensor]]  # HF tensors -> canonical tensors
    save: Callable[[list[Tensor]], list[Tensor]]  # canonical tensors -> HF tensors


def _same(xs: list[Tensor]) -> list[Tensor]:
    return xs


def _one(canon: str, hf: str, shape: tuple[int, ...], load: Callable[[Tensor], Tensor] | None = None,
         save: Callable[[Tensor], Tensor] | None = None) -> _Rule:
    if load is None or save is None:
        return _Rule((canon,), (hf,), (shape,), _same, _same)
    fwd, inv = load, save
    return _Rule((canon,), (hf,), (shape,), lambda xs: [fwd(xs[0])], lambda xs: [inv(xs[0])])


def _plus1(x: Tensor) -> Tensor:
    return x.float() + 1  # exact for gammas in [0.5, 2] (Sterbenz), so write -> read is lossless


def _minus1(x: Tensor) -> Tensor:
    return x.float() - 1


def _centred(canon: str, hf: str, n: int) -> _Rule:
    return _one(canon, hf, (n,), _plus1, _minus1)


def v_head_order(k_heads: int, v_heads: int) -> Tensor:
    """perm[n] = the HF value head stored at file position n (n = r*K + g holds HF head g*R + r)."""
    r = v_heads // k_heads
    return torch.tensor([(n % k_heads) * r + n // k_heads for n in range(v_heads)], dtype=torch.long)


def _reorder(x: Tensor, perm: Tensor, dim: int, start: int, block: int) -> Tensor:
    """Permute the len(perm) blocks of `block` entries that begin at `start` along `dim`."""
    n = perm.numel() * block
    part = x.narrow(dim, start, n)
    shape = list(x.shape)
    shape[dim:dim + 1] = [perm.numel(), block]
    moved = part.reshape(shape).index_select(dim, perm.to(x.device)).reshape(part.shape)
    return torch.cat([x.narrow(dim, 0, start), moved, x.narrow(dim, start + n, x.shape[dim] - start - n)], dim=dim)


def _hc_rules(hf: str, gg: str, c: ModelConfig, inject: bool) -> list[_Rule]:
    rules = [
        _centred(f"{gg}_norm.weight", f"{hf}hc_norm.weight", c.hc_dim),
        _one(f"{gg}_down.weight", f"{hf}input_mix_weight_down.weight", (c.hc_rank, c.hc_dim)),
        _one(f"{gg}_up.weight", f"{hf}input_mix_weight_up.weight", (c.hc_dim, c.hc_rank)),
    ]
    if inject:
        rules.append(_one(f"{gg}_inject.weight", f"{hf}block_inject_weight.weight", (c.hc_count, c.hc_dim)))
    return rules


def _qsa_rules(hf: str, b: str, c: ModelConfig) -> list[_Rule]:
    a = f"{hf}self_attn."
    rules = [
        _one(f"{b}.attn_q.weight", f"{a}q_proj.weight", (c.n_heads * c.head_dim * 2, c.hidden)),
        _one(f"{b}.attn_k.weight", f"{a}k_proj.weight", (c.n_kv_heads * c.head_dim, c.hidden)),
        _one(f"{b}.attn_v.weight", f"{a}v_proj.weight", (c.n_kv_heads * c.head_dim, c.hidden)),
        _one(f"{b}.attn_output.weight", f"{a}o_proj.weight", (c.hidden, c.n_heads * c.head_dim)),
        _centred(f"{b}.attn_q_norm.weight", f"{a}q_norm.weight", c.head_dim),
        _centred(f"{b}.attn_k_norm.weight", f"{a}k_norm.weight", c.head_dim),
    ]
    if c.indexer_heads:
        nq = c.indexer_heads * c.indexer_head_dim
        rules += [
            _Rule((f"{b}.indexer.q_proj.weight", f"{b}.indexer.k_proj.weight"),
                  (f"{a}indexer.index_qk_proj.weight",), ((nq + c.indexer_head_dim, c.hidden),),
                  lambda xs: [xs[0][:nq], xs[0][nq:]], lambda xs: [torch.cat(xs, dim=0)]),
            _centred(f"{b}.indexer.q_norm.weight", f"{a}indexer.q_layernorm.weight", c.indexer_head_dim),
            _centred(f"{b}.indexer.k_norm.weight", f"{a}indexer.k_layernorm.weight", c.indexer_head_dim),
        ]
    return rules


def _gdn_rules(hf: str, b: str, c: ModelConfig) -> list[_Rule]:
    a = f"{hf}linear_attn."
    perm = v_head_order(c.gdn_k_heads, c.gdn_v_heads)
    inv = torch.argsort(perm)
    hd, vo = c.gdn_v_head_dim, 2 * c.gdn_key_dim  # V rows/channels (value heads) start after q and k

    def heads(dim: int, start: int, block: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
        return (lambda x: _reorder(x, perm, dim, start, block)), (lambda x: _reorder(x, inv, dim, start, block))

    qkv, z, vec, out = heads(0, vo, hd), heads(0, 0, hd), heads(0, 0, 1), heads(1, 0, hd)
    return [
        _one(f"{b}.attn_qkv.weight", f"{a}in_proj_qkv.weight", (c.gdn_conv_dim, c.hidden), *qkv),
        _one(f"{b}.attn_gate.weight", f"{a}in_proj_z.weight", (c.gdn_value_dim, c.hidden), *z),
        _one(f"{b}.ssm_beta.weight", f"{a}in_proj_b.weight", (c.gdn_v_heads, c.hidden), *vec),
        _one(f"{b}.ssm_alpha.weight", f"{a}in_proj_a.weight", (c.gdn_v_heads, c.hidden), *vec),
        # float64 so that -exp(log(-a)) returns the same float32 `a`
        _one(f"{b}.ssm_a", f"{a}A_log", (c.gdn_v_heads,),
             lambda x: vec[0](-x.double().exp()).float(), lambda x: vec[1](x).double().neg().log().float()),
        _one(f"{b}.ssm_dt.bias", f"{a}dt_bias", (c.gdn_v_heads,), *vec),
        _one(f"{b}.ssm_conv1d.weight", f"{a}conv1d.weight", (c.gdn_conv_dim, 1, c.gdn_conv_kernel),
             lambda x: qkv[0](x.squeeze(1)), lambda x: qkv[1](x).unsqueeze(1)),
        _one(f"{b}.ssm_norm.weight", f"{a}norm.weight", (c.gdn_v_head_dim,)),  # gated norm: plain gamma, no +1
        _one(f"{b}.ssm_out.weight", f"{a}out_proj.weight", (c.hidden, c.gdn_value_dim), *out),
    ]


def _moe_rules(hf: str, b: str, c: ModelConfig, split_experts: bool) -> list[_Rule]:
    m = f"{hf}mlp."
    e, f, d = c.n_experts, c.expert_ff, c.hidden
    gate, up, down = f"{b}.ffn_gate_exps.weight", f"{b}.ffn_up_exps.weight", f"{b}.ffn_down_exps.weight"
    if split_experts:  # read-only layout: mlp.experts.{e}.{gate,up,down}_proj.weight
        experts = [
            _Rule((gate, up), tuple(f"{m}experts.{i}.{p}_proj.weight" for p in ("gate", "up") for i in range(e)),
                  ((f, d),) * (2 * e), lambda xs: [torch.stack(xs[:e]), torch.stack(xs[e:])], _same),
            _Rule((down,), tuple(f"{m}experts.{i}.down_proj.weight" for i in range(e)), ((d, f),) * e,
                  lambda xs: [torch.stack(xs)], _same),
        ]
    else:  # transformers' fused layout: gate rows first, then up
        experts = [
            _Rule((gate, up), (f"{m}experts.gate_up_proj",), ((e, 2 * f, d),),
                  lambda xs: [xs[0][:, :f], xs[0][:, f:]], lambda xs: [torch.cat(xs, dim=1)]),
            _one(down, f"{m}experts.down_proj", (e, d, f)),
        ]
    return [
        _one(f"{b}.ffn_gate_inp.weight", f"{m}gate.weight", (e, d)),
        *experts,
        _one(f"{b}.ffn_gate_inp_shexp.weight", f"{m}shared_expert_gate.weight", (1, d),
             lambda x: x.reshape(-1), lambda x: x.reshape(1, -1)),
        _one(f"{b}.ffn_gate_shexp.weight", f"{m}shared_expert.gate_proj.weight", (c.shared_ff, d)),
        _one(f"{b}.ffn_up_shexp.weight", f"{m}shared_expert.up_proj.weight", (c.shared_ff, d)),
        _one(f"{b}.ffn_down_shexp.weight", f"{m}shared_expert.down_proj.weight", (d, c.shared_ff)),
    ]


def _ple_rules(hf: str, b: str, c: ModelConfig) -> list[_Rule]:
    p = f"{hf}ple."
    return [
        _one(f"{b}.ple_key.weight", f"{p}key_proj.weight", (c.hc_dim, c.ple_embed_dim)),
        _one(f"{b}.ple_value.weight", f"{p}value_proj.weight", (c.hidden, c.ple_embed_dim)),
        _centred(f"{b}.ple_norm_key.weight", f"{p}norm_key.weight", c.hc_dim),
        _centred(f"{b}.ple_norm_query.weight", f"{p}norm_query.weight", c.hc_dim),
        _centred(f"{b}.ple_norm_conv.weight", f"{p}norm_conv.weight", c.hc_dim),
        _one(f"{b}.ple_conv1d.weight", f"{p}conv1d.weight", (c.hc_dim, 1, c.ple_conv_kernel),
             lambda x: x.squeeze(1), lambda x: x.unsqueeze(1)),
    ]


def _rules(c: ModelConfig, prefix: str, mtp_prefix: str, with_mtp: bool,
           split_experts: Callable[[str], bool] = lambda hf: False) -> list[_Rule]:
    """Every HF <-> canonical rule except the n-gram table (which is streamed, never materialised)."""
    rules = [
        _one("token_embd.weight", f"{prefix}embed_tokens.weight", (c.vocab_size, c.hidden)),
        _one("output.weight", "lm_head.weight", (c.vocab_size, c.hidden)),
        *_hc_rules(f"{prefix}hyper_connection_mixer.", "output_hc", c, inject=False),
    ]
    for i in range(c.n_layers):
        hf, b = f"{prefix}layers.{i}.", f"blk.{i}"
        rules += _hc_rules(f"{hf}attn_hyper_connection.", f"{b}.hc_attn", c, inject=True)
        rules += _hc_rules(f"{hf}mlp_hyper_connection.", f"{b}.hc_ffn", c, inject=True)
        rules += _gdn_rules(hf, b, c) if c.layer_recurrent[i] else _qsa_rules(hf, b, c)
        rules += _moe_rules(hf, b, c, split_experts(hf))
        if i == c.ple_layer:
            rules += _ple_rules(hf, b, c)
    if with_mtp:
        b, hf, d = f"blk.{c.mtp_layer}", f"{mtp_prefix}layers.0.", c.hidden
        rules += [
            _Rule((f"{b}.nextn.eh_proj.weight",), (f"{mtp_prefix}fc_embedding.weight", f"{mtp_prefix}fc_hidden.weight"),
                  ((d, d), (d, d)), lambda xs: [torch.cat(xs, dim=1)], lambda xs: [xs[0][:, :d], xs[0][:, d:]]),
            _centred(f"{b}.nextn.enorm.weight", f"{mtp_prefix}pre_fc_norm_embedding.weight", d),
            _centred(f"{b}.nextn.hnorm.weight", f"{mtp_prefix}pre_fc_norm_hidden.weight", c.hc_dim),
            *_hc_rules(f"{mtp_prefix}hyper_connection_mixer.", f"{b}.nextn.hc_head", c, inject=False),
            *_hc_rules(f"{hf}attn_hyper_connection.", f"{b}.hc_attn", c, inject=True),
            *_hc_rules(f"{hf}mlp_hyper_connection.", f"{b}.hc_ffn", c, inject=True),
            *_qsa_rules(hf, b, c),
            *_moe_rules(hf, b, c, split_experts(hf)),
        ]
    covered = {n for r in rules for n in r.canon} | ({PLE_TABLE} if c.has_ple else set())
    expect = set(tensor_shapes(c, with_mtp))
    assert covered == expect, f"HF rules out of sync with names.py: {sorted(covered ^ expect)[:5]}"
    return rules


# ---- safetensors headers -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def _st_header(path: Path) -> dict[str, _StEntry]:
    """Parse one safetensors header and check that the file holds every tensor it lists."""
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise WeightsError(f"{path}: truncated or not a safetensors file (header does not fit in {size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    out: dict[str, _StEntry] = {}
    for key, info in header.items():
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise WeightsError(f"{path}: truncated file: tensor {key!r} needs bytes up to {8 + n + end}, "
                               f"the file has {size}")
        out[key] = _StEntry(path, info["dtype"], tuple(info["shape"]), 8 + n + begin)
    return out


def _checkpoint_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: unreadable index ({e})") from e
        files = sorted({d / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise WeightsError(f"{f}: file not found (listed in {index.name})")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{d}: no *.safetensors files")
    return files


# ---- reader ------------------------------------------------------------------------------------------------------
def _ngram_sources(keys: Mapping[str, _StEntry], base: str) -> list[str]:
    if f"{base}ngram_embedding.weight" in keys:
        return [f"{base}ngram_embedding.weight"]
    shards = {}
    for k in keys:
        if k.startswith(f"{base}ngram_embedding.shard_") and k.endswith(".weight"):
            idx = k[len(f"{base}ngram_embedding.shard_"):-len(".weight")]
            if idx.isdigit():
                shards[int(idx)] = k
    for i in range(len(shards)):
        if i not in shards:
            raise WeightsError(f"missing tensor '{base}ngram_embedding.shard_{i}.weight' "
                               f"(found shards {sorted(shards)})")
    return [shards[i] for i in range(len(shards))]  # shard-index order, not lexicographic


def _ple_table(c: ModelConfig, keys: Mapping[str, _StEntry], base: str, expect_parts: int | None) -> HostRowTable:
    srcs = _ngram_sources(keys, base)
    if not srcs:
        raise WeightsError(f"missing tensor '{base}ngram_embedding.weight' (or its shard_{{i}} parts)")
    if expect_parts and len(srcs) > 1 and len(srcs) != expect_parts:
        raise WeightsError(f"{base}ngram_embedding: {len(srcs)} shards but config.json split_ngram_parts is "
                           f"{expect_parts}")
    segs, qtype = [], None
    for k in srcs:
        e = keys[k]
        if e.dtype not in _FLOAT_DTYPES:
            raise WeightsError(f"{k}: unsupported dtype {e.dtype} for the n-gram table")
        if len(e.shape) != 2 or e.shape[1] != c.ple_head_dim:
            raise WeightsError(f"{k}: wrong shape: expected (rows, {c.ple_head_dim}), got {e.shape}")
        if qtype is not None and _FLOAT_DTYPES[e.dtype] != qtype:
            raise WeightsError(f"{k}: dtype {e.dtype} differs from the other n-gram shards")
        qtype = _FLOAT_DTYPES[e.dtype]
        row_bytes = e.shape[1] * _ST_ITEMSIZE[e.dtype]
        segs.append(np.memmap(e.file, dtype=np.uint8, mode="r", offset=e.offset, shape=(e.shape[0], row_bytes)))
    rows = sum(s.shape[0] for s in segs)
    if rows != c.ple_rows:
        raise WeightsError(f"{srcs[0]}: wrong shape: n-gram table has {rows} rows, expected {c.ple_rows}")
    assert qtype is not None
    return HostRowTable(segs, qtype, c.ple_head_dim)


def _ple_buffers(c: ModelConfig, keys: Mapping[str, _StEntry], base: str, stack: ExitStack) -> ModelConfig:
    """The checkpoint's hash tables win over the config-derived ones (transformers loads them the same way)."""
    vals: dict[str, tuple[int, ...]] = {}
    for name in _PLE_BUFFERS:
        k = f"{base}{name}"
        if k in keys:
            h = stack.enter_context(safe_open(keys[k].file, framework="pt"))
            vals[name] = tuple(int(v) for v in h.get_tensor(k).reshape(-1).tolist())
    if not vals:
        return c
    c = c.with_(ple_multipliers=vals.get("layer_multipliers", c.ple_multipliers),
                ple_head_offsets=vals.get("ngram_heads_offsets", c.ple_head_offsets),
                ple_head_vocab=vals.get("ngram_heads_vocab_sizes", c.ple_head_vocab))
    try:
        return c.validate()
    except ConfigError as e:
        raise WeightsError(f"{base}: the checkpoint's n-gram hash tables are inconsistent: {e}") from e


def _read_config_json(d: Path) -> Any:
    """The parsed config.json of checkpoint dir `d` (its types are checked by from_hf_config)."""
    if not d.exists():
        raise WeightsError(f"{d}: file not found")
    if not (d / "config.json").is_file():
        raise WeightsError(f"{d}: not an HF checkpoint (no config.json)")
    try:
        return json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{d / 'config.json'}: invalid JSON: {e}") from e


def _check_rules(d: Path, rules: Sequence[_Rule], keys: Mapping[str, _StEntry]) -> None:
    """Every tensor the rules read is present, of its expected shape and a float dtype; else one WeightsError."""
    missing: list[str] = []
    for r in rules:
        for k, shape in zip(r.hf, r.hf_shapes, strict=True):
            e = keys.get(k)
            if e is None:
                missing.append(f"{k} (for {r.canon[0]})")
            elif e.shape != shape:
                raise WeightsError(f"{e.file}: tensor {k!r} has wrong shape: expected {shape}, got {e.shape}")
            elif e.dtype not in _FLOAT_DTYPES:
                raise WeightsError(f"{e.file}: tensor {k!r} has unsupported dtype {e.dtype} "
                                   "(only F32/F16/BF16 checkpoints are supported)")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{d}: missing tensor {missing[0]}: {'; '.join(missing[:5])}{more}")


def read_hf(path: str | os.PathLike[str], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            with_mtp: bool | None = None) -> tuple[ModelConfig, Weights]:
    """(config, canonical weights) from an HF checkpoint directory (config.json + *.safetensors).

    Accepts the VL layout (`model.language_model.` prefix, `model.visual.*` ignored) and the CausalLM one
    (`model.`), fused or per-expert MoE weights, a sharded or whole n-gram table. The n-gram table is a
    `HostRowTable` over an mmap of the safetensors file(s)."""
    d = Path(path)
    raw_cfg = _read_config_json(d)
    cfg = from_hf_config(raw_cfg)
    text_cfg = raw_cfg.get("text_config", raw_cfg)

    keys: dict[str, _StEntry] = {}
    for f in _checkpoint_files(d):
        keys.update(_st_header(f))
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) else "model."
    mtp_prefix = f"{prefix}mtp." if any(k.startswith(f"{prefix}mtp.") for k in keys) else "mtp."
    if with_mtp and not cfg.has_mtp:
        raise WeightsError(f"{d}: MTP requested but config.json has mtp_num_hidden_layers = 0")
    with_mtp = cfg.has_mtp if with_mtp is None else with_mtp
    rules = _rules(cfg, prefix, mtp_prefix, with_mtp,
                   split_experts=lambda hf: f"{hf}mlp.experts.gate_up_proj" not in keys
                   and f"{hf}mlp.experts.0.gate_proj.weight" in keys)
    alias: dict[str, str] = {}
    if text_cfg.get("tie_word_embeddings") and "lm_head.weight" not in keys and f"{prefix}embed_tokens.weight" in keys:
        alias["lm_head.weight"] = f"{prefix}embed_tokens.weight"  # tied head: the embedding doubles as output
        keys["lm_head.weight"] = keys[alias["lm_head.weight"]]

    _check_rules(d, rules, keys)  # everything is validated before anything is loaded
    ple_base = f"{prefix}layers.{cfg.ple_layer}.ple.ple_embedding."
    used = {k for r in rules for k in r.hf}
    with ExitStack() as stack:
        table = None
        if cfg.has_ple:
            cfg = _ple_buffers(cfg, keys, ple_base, stack)
            parts = text_cfg.get("split_ngram_parts")
            if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int)):
                raise ConfigError(f"split_ngram_parts: expected an integer, got {parts!r}")
            table = _ple_table(cfg, keys, ple_base, parts)
            used |= {k for k in keys if k.startswith(ple_base)}
        ignored = ("model.visual.", "visual.") + (() if with_mtp else (mtp_prefix,))
        unknown = [k for k in keys if k not in used and not k.startswith(ignored) and "rotary_emb" not in k]
        if unknown:
            warnings.warn(f"{d}: ignoring {len(unknown)} unexpected tensors: {', '.join(unknown[:5])}", stacklevel=2)

        handles: dict[Path, Any] = {}

        def get(k: str) -> Tensor:
            e = keys[k]
            if e.file not in handles:
                handles[e.file] = stack.enter_context(safe_open(e.file, framework="pt"))
            return handles[e.file].get_tensor(alias.get(k, k)).to(device)

        out: Weights = {}
        for r in rules:
            for name, t in zip(r.canon, r.load([get(k) for k in r.hf]), strict=True):
                out[name] = t.to(dtype).contiguous()
    order = tensor_shapes(cfg, with_mtp)
    if table is not None:
        out[PLE_TABLE] = table
    return cfg, {n: out[n] for n in order}


# ---- writer ------------------------------------------------------------------------------------------------------
def _hf_roundtrip_mismatch(cfg: ModelConfig, hf_cfg: dict[str, Any]) -> list[str]:
    """Config fields that config.json cannot express (the hash tables travel as tensors, so they are exempt)."""
    back = from_hf_config(hf_cfg).with_(ple_multipliers=cfg.ple_multipliers, ple_head_offsets=cfg.ple_head_offsets,
                                        ple_head_vocab=cfg.ple_head_vocab)
    return [f"{f.name}: {getattr(cfg, f.name)!r} would read back as {getattr(back, f.name)!r}"
            for f in fields(ModelConfig) if f.compare and getattr(cfg, f.name) != getattr(back, f.name)]


def _ngram_parts(rows: int, nbytes: int, parts: int | None) -> int:
    """Shard count for the n-gram table: it must divide the rows, as transformers re-splits it with torch.chunk."""
    want = parts or (4 if nbytes < 1 << 30 else 128)
    return math.gcd(rows, want)


def _pack_shards(sizes: Sequence[int], max_shard_bytes: int | None) -> list[list[int]]:
    """Group indices in order into shards of at most max_shard_bytes (a group larger than that gets its own shard;
    None: one shard)."""
    shards: list[list[int]] = [[]]
    filled = 0
    for gi, size in enumerate(sizes):
        if max_shard_bytes and shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(gi)
        filled += size
    return shards


def _config_to_write(cfg: ModelConfig, dtype: torch.dtype, ngram_parts: int | None) -> tuple[dict[str, Any], int]:
    """(config.json's dict, the n-gram table's shard count) for a checkpoint of `cfg` in `dtype`; a config the
    HF keys cannot express is a WeightsError."""
    parts = 0
    hf_cfg = to_hf_config(cfg)
    if cfg.has_ple:
        itemsize = torch.empty((), dtype=dtype).element_size()
        parts = _ngram_parts(cfg.ple_rows, cfg.ple_rows * cfg.ple_head_dim * itemsize, ngram_parts)
        hf_cfg["split_ngram_parts"] = parts
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    bad = _hf_roundtrip_mismatch(cfg, hf_cfg)
    if bad:
        raise WeightsError(f"config.json cannot express this config: {'; '.join(bad)}")
    return hf_cfg, parts


def write_hf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, Tensor | HostRowTable], *,
             dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None,
             ngram_parts: int | None = None) -> None:
    """Write canonical weights as an HF `Qwen4ExpForCausalLM` checkpoint (the exact inverse of `read_hf`).

    `tensors` may be a lazy Mapping (each value is requested once). The MTP block is written (as `mtp.*`)
    when all its tensors are present. Files are `model.safetensors`, or `model-0000i-of-0000n.safetensors`
    plus an index when `max_shard_bytes` splits them. The n-gram table is written as `ngram_parts` shards
    (default 4 for small tables, 128 like the release) and config.json records `split_ngram_parts`."""
    d = Path(path)
    cfg, shapes = writable_shapes(cfg, tensors)
    with_mtp = cfg.has_mtp
    rules = _rules(cfg, "model.", "mtp.", with_mtp)
    itemsize = torch.empty((), dtype=dtype).element_size()
    hf_cfg, parts = _config_to_write(cfg, dtype, ngram_parts)

    # Groups of HF tensors produced together; each is placed whole into one shard.
    groups: list[tuple[list[tuple[str, tuple[int, ...]]], int, Callable[[], list[Tensor]]]] = []

    def check(name: str) -> Tensor:
        t = tensors[name]
        if not isinstance(t, Tensor) or tuple(t.shape) != shapes[name]:
            got = tuple(t.shape) if hasattr(t, "shape") else type(t).__name__
            raise WeightsError(f"{name}: wrong shape: expected {shapes[name]}, got {got}")
        return t.detach().cpu()

    for r in rules:
        size = sum(math.prod(s) for s in r.hf_shapes) * itemsize
        groups.append((list(zip(r.hf, r.hf_shapes, strict=True)), size,
                       lambda r=r: r.save([check(n) for n in r.canon])))
    if cfg.has_ple:
        base = f"model.layers.{cfg.ple_layer}.ple.ple_embedding."
        rows = cfg.ple_rows // parts
        table_shape = shapes[PLE_TABLE]

        def shard(i: int) -> list[Tensor]:
            t = tensors[PLE_TABLE]
            if tuple(t.shape) != table_shape:
                raise WeightsError(f"{PLE_TABLE}: wrong shape: expected {table_shape}, got {tuple(t.shape)}")
            if isinstance(t, HostRowTable):
                return [t.rows(i * rows, (i + 1) * rows, "cpu", dtype)]
            return [t.detach().cpu()[i * rows:(i + 1) * rows]]

        for i in range(parts):
            groups.append(([(f"{base}ngram_embedding.shard_{i}.weight", (rows, cfg.ple_head_dim))],
                           rows * cfg.ple_head_dim * itemsize, lambda i=i: shard(i)))
        buffers = [torch.tensor(v, dtype=torch.int64) for v in
                   (cfg.ple_multipliers, cfg.ple_head_offsets, cfg.ple_head_vocab)]
        groups.append(([(f"{base}{n}", tuple(b.shape)) for n, b in zip(_PLE_BUFFERS, buffers, strict=True)],
                       sum(b.numel() * 8 for b in buffers), lambda buffers=buffers: buffers))

    shards = _pack_shards([size for _, size, _ in groups], max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    d.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for fname, members in zip(names, shards, strict=True):
        out: dict[str, Tensor] = {}
        for gi in members:
            keys, _, make = groups[gi]
            for (k, shape), t in zip(keys, make(), strict=True):
                t = t if t.dtype == torch.int64 else t.to(dtype)
                assert tuple(t.shape) == shape, (k, t.shape, shape)
                out[k] = t.contiguous()
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        save_file(out, str(d / fname), metadata={"format": "pt"})
        del out
    if len(names) > 1:
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text(json.dumps(hf_cfg, indent=2))

