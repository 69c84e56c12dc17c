"""Model hyperparameters for Qwen3.8-Flash-Next (llama.cpp arch `qwen4exp`, HF `qwen4_exp_text`).

One frozen dataclass, built from GGUF metadata, from an HF `config.json`, or from a preset.
Every other module reads shapes from here; `tensor_shapes` is the single list of weights.
Both file formats go through one table (`_KEYS`: field, config.json key, GGUF key, default); code handles only
the values one side derives (layer types, rotary, value head size, PLE tables). A value of the wrong type is a
ConfigError naming its key.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

ARCH = "qwen4exp"
HF_TEXT_MODEL_TYPE = "qwen4_exp_text"
HF_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
# Names the QSA layers have carried across transformers versions and checkpoints.
QSA_LAYER_TYPES = ("full_attention", "qwen_sparse_attention", "indexed_attention")
GDN_LAYER_TYPE = "linear_attention"


class ConfigError(ValueError):
    """A missing, unknown or inconsistent hyperparameter; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden: int  # D, width of one hyper-connection stream
    n_layers: int  # trunk layers (the MTP block is extra)
    layer_recurrent: tuple[bool, ...]  # True: Gated DeltaNet, False: QSA attention
    # attention (QSA layers)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # rotated dims of each head (partial rotary)
    rope_theta: float
    rope_sections: tuple[int, int, int, int]
    # Gated DeltaNet
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_dim: int  # key head dim (llama.cpp ssm.state_size)
    gdn_v_head_dim: int  # value head dim (llama.cpp ssm.inner_size / ssm.time_step_rank)
    gdn_conv_kernel: int
    # MoE
    n_experts: int
    n_experts_used: int
    expert_ff: int
    shared_ff: int
    # hyper-connections
    hc_count: int
    hc_rank: int
    # QSA indexer
    indexer_heads: int
    indexer_head_dim: int
    indexer_budget: int  # tokens; budget // ratio whole blocks are kept
    compress_ratios: tuple[int, ...]  # per trunk layer, 0 = dense
    # PLE (hashed n-gram per-layer embedding); ple_layer < 0 means no PLE
    ple_layer: int
    ngram_size: int
    heads_per_ngram: int
    ple_conv_kernel: int
    ple_embed_dim: int  # concatenated width of all n-gram heads
    ple_multipliers: tuple[int, ...]
    ple_head_offsets: tuple[int, ...]
    ple_head_vocab: tuple[int, ...]
    ple_rows: int  # rows of per_layer_token_embd
    eos_token_id: int
    # misc
    rms_eps: float = 1e-6
    context_length: int = 262144
    n_mtp_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def hc_dim(self) -> int:
        return self.hc_count * self.hidden

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_k_heads * self.gdn_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_v_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def ple_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return self.ple_embed_dim // self.ple_heads if self.has_ple else 0

    @property
    def ple_conv_state(self) -> int:
        """Columns of PLE conv history: (kernel - 1) * dilation, dilation = ngram_size."""
        return (self.ple_conv_kernel - 1) * self.ngram_size

    @property
    def has_ple(self) -> bool:
        return self.ple_layer >= 0

    @property
    def has_mtp(self) -> bool:
        return self.n_mtp_layers > 0

    @property
    def mtp_layer(self) -> int:
        """GGUF block index of the MTP block (`blk.{n_layers}`)."""
        return self.n_layers

    def qsa_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if not self.layer_recurrent[i]]

    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.layer_recurrent[i]]

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < self.n_layers else 0

    def with_(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> ModelConfig:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        for key in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "n_experts", "n_experts_used", "expert_ff", "shared_ff", "hc_rank"):
            need(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        need(len(self.layer_recurrent) == self.n_layers, "layer_types",
             f"{len(self.layer_recurrent)} entries for {self.n_layers} layers")
        need(len(self.compress_ratios) == self.n_layers, "compress_ratios",
             f"{len(self.compress_ratios)} entries for {self.n_layers} layers")
        need(self.hc_count > 1, "hc_count", f"must be > 1, got {self.hc_count}")
        need(self.n_heads % self.n_kv_heads == 0, "num_key_value_heads",
             f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} kv heads")
        need(0 < self.n_experts_used <= self.n_experts, "num_experts_per_tok",
             f"{self.n_experts_used} not in [1, {self.n_experts}]")
        need(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "rope_dim",
             f"{self.rope_dim} must be even and in (0, head_dim={self.head_dim}]")
        need(sum(self.rope_sections) * 2 <= self.rope_dim or sum(self.rope_sections) == 0,
             "rope_sections", f"{self.rope_sections} exceed rope_dim/2={self.rope_dim // 2}")
        if any(not r for r in self.layer_recurrent):
            need(self.rope_dim <= self.indexer_head_dim, "indexer_head_dim",
                 f"rotary dim {self.rope_dim} must fit the indexer head {self.indexer_head_dim}")
        if any(self.layer_recurrent):
            for key in ("gdn_k_heads", "gdn_v_heads", "gdn_head_dim", "gdn_v_head_dim", "gdn_conv_kernel"):
                need(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        need(self.gdn_v_heads % max(self.gdn_k_heads, 1) == 0, "linear_num_value_heads",
             f"{self.gdn_v_heads} not a multiple of {self.gdn_k_heads} key heads")
        for i, r in enumerate(self.compress_ratios):
            need(r >= 0, "compress_ratios", f"negative ratio at layer {i}")
            if r > 0:
                need(not self.layer_recurrent[i], "compress_ratios", f"layer {i} is recurrent but has ratio {r}")
                need(self.indexer_budget % r == 0, "indexer_budget",
                     f"{self.indexer_budget} is not a multiple of the compress ratio {r}")
        if self.has_ple:
            need(0 <= self.ple_layer < self.n_layers, "ple_layer_ids", f"layer {self.ple_layer} out of range")
            need(self.layer_recurrent[self.ple_layer], "ple_layer_ids",
                 f"PLE is only supported on linear-attention layers, not layer {self.ple_layer}")
            need(self.ple_heads > 0 and self.ple_embed_dim % self.ple_heads == 0, "ple_embed_dim",
                 f"{self.ple_embed_dim} not divisible by {self.ple_heads} n-gram heads")
            need(len(self.ple_multipliers) >= self.ngram_size, "ple.layer_multipliers",
                 f"needs {self.ngram_size} entries")
            need(len(self.ple_head_offsets) >= self.ple_heads and len(self.ple_head_vocab) >= self.ple_heads,
                 "ple.head_offsets", f"needs {self.ple_heads} entries")
            top = max(o + v for o, v in zip(self.ple_head_offsets, self.ple_head_vocab, strict=False))
            need(self.ple_rows >= top, "per_layer_token_embd", f"{self.ple_rows} rows < {top} needed by the hash")
        return self


# ---- PLE hash constants (same derivation as the reference) ----------------------------------------
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ple_multipliers(vocab_size: int, ngram_size: int, ple_index: int = 0, seed: int = 1234) -> tuple[int, ...]:
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_index
    return tuple(2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size))


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def ple_head_tables(n_heads: int, vocab_base: int, ple_index: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, vocab sizes): head i hashes into the (global i + 1)-th prime after vocab_base - 1."""
    sizes, offsets, total, p = [], [], 0, vocab_base - 1
    primes: list[int] = []
    need = (ple_index + 1) * n_heads
    while len(primes) < need:
        p += 1
        if _is_prime(p):
            primes.append(p)
    for i in range(n_heads):
        size = primes[ple_index * n_heads + i]
        sizes.append(size)
        offsets.append(total)
        total += size
    return tuple(offsets), tuple(sizes)


def pad_rows(total: int, divisor: int) -> int:
    """`total` rounded up to a multiple of `divisor` (the n-gram table's rows)."""
    return -(-total // divisor) * divisor


# ---- HF config.json and GGUF metadata: one table ---------------------------------------------------------------
@dataclass(frozen=True)
class _Key:
    """A hyperparameter that config.json and the GGUF metadata store as one value; `hf` / `gguf` None: that side
    derives it in code (`_hf_*` / `_gguf_*` below).

    `default` is transformers' value when config.json lacks the key (`...`: required). llama.cpp's loader requires
    its key unless `gguf_optional`, which then takes the same default. `hf_zero_null`: 0 means "none", written as
    null in config.json. `gguf_if`: a ModelConfig attribute; the GGUF key is written only where it is true (the
    llama.cpp converter writes the indexer, PLE and MTP keys only for models that have them)."""

    field: str
    hf: str | None
    gguf: str | None
    default: Any = ...
    kind: type = int
    gguf_optional: bool = False
    hf_zero_null: bool = False
    gguf_if: str = ""


_KEYS = (
    _Key("vocab_size", "vocab_size", None),  # GGUF: rows of token_embd
    _Key("hidden", "hidden_size", "embedding_length"),
    _Key("n_layers", "num_hidden_layers", None),  # GGUF: block_count less the MTP blocks
    _Key("n_heads", "num_attention_heads", "attention.head_count"),
    _Key("n_kv_heads", "num_key_value_heads", "attention.head_count_kv"),
    _Key("head_dim", "head_dim", "attention.key_length", 256),
    _Key("rope_dim", None, "rope.dimension_count"),  # HF: head_dim x partial_rotary_factor
    _Key("rope_theta", None, "rope.freq_base", 10_000_000.0, float, gguf_optional=True),  # HF: in rope_parameters
    _Key("gdn_k_heads", "linear_num_key_heads", "ssm.group_count", 16),
    _Key("gdn_v_heads", "linear_num_value_heads", "ssm.time_step_rank", 32),
    _Key("gdn_head_dim", "linear_key_head_dim", "ssm.state_size", 128),
    _Key("gdn_v_head_dim", "linear_value_head_dim", None, 128),  # GGUF: ssm.inner_size / ssm.time_step_rank
    _Key("gdn_conv_kernel", "linear_conv_kernel_dim", "ssm.conv_kernel", 4),
    _Key("n_experts", "num_experts", "expert_count", 512),
    _Key("n_experts_used", "num_experts_per_tok", "expert_used_count", 10),
    _Key("expert_ff", "moe_intermediate_size", None, 512),  # GGUF: one size, or one per layer
    _Key("shared_ff", "shared_expert_intermediate_size", "expert_shared_feed_forward_length", 512),
    _Key("hc_count", "hc_count", "hyper_connection.count", 4),
    _Key("hc_rank", "hc_lowrank", "hyper_connection.low_rank", 320),
    _Key("indexer_heads", "indexer_n_heads", "attention.indexer.head_count", 0, gguf_optional=True,
         hf_zero_null=True, gguf_if="indexer_heads"),
    _Key("indexer_head_dim", "indexer_head_dim", "attention.indexer.key_length", 0, gguf_optional=True,
         hf_zero_null=True, gguf_if="indexer_heads"),
    _Key("indexer_budget", "indexer_budget", "attention.indexer.top_k", 0, gguf_optional=True, hf_zero_null=True,
         gguf_if="indexer_heads"),
    _Key("ngram_size", "ngram_size", "ple.ngram_size", 3, gguf_optional=True, gguf_if="has_ple"),
    _Key("heads_per_ngram", "heads_per_ngram", "ple.heads_per_ngram", 8, gguf_optional=True, gguf_if="has_ple"),
    _Key("ple_conv_kernel", "ple_conv_kernel_size", "ple.conv_kernel", 4, gguf_optional=True, gguf_if="has_ple"),
    _Key("rms_eps", "rms_norm_eps", "attention.layer_norm_rms_epsilon", 1e-6, float, gguf_optional=True),
    _Key("context_length", "max_position_embeddings", "context_length", 262144, gguf_optional=True),
    _Key("n_mtp_layers", "mtp_num_hidden_layers", "nextn_predict_layers", 0, gguf_optional=True, gguf_if="has_mtp"),
)
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


def _show(value: Any) -> str:
    s = repr(value)
    return f"{s[:40]}... ({type(value).__name__})" if len(s) > 43 else f"{s} ({type(value).__name__})"


def _typed(key: str, value: Any, kind: type) -> Any:
    """`value` as `kind`, or a ConfigError naming `key` (a string where a number belongs, a list, a bool...)."""
    if kind is bool:
        ok = isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1))
    elif kind is str:
        ok = isinstance(value, str)
    elif isinstance(value, bool):  # a JSON true is an int to Python, never a size
        ok = False
    elif kind is int:
        ok = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    else:
        ok = isinstance(value, numbers.Real)
    if not ok:
        raise ConfigError(f"{key}: expected {_KIND_NAMES[kind]}, got {_show(value)}")
    return kind(value)


class _Reader:
    """Typed look-ups in config.json or GGUF metadata (keys start with `prefix`: "qwen4exp."); errors name the key
    as `label` + key ("text_config." for the VL wrapper's text model, "rope_parameters." inside that object).

    A key that is absent (or null) takes `default`; without one it is an error."""

    def __init__(self, kv: Mapping[str, Any], prefix: str, where: str, label: str | None = None) -> None:
        self.kv, self.prefix, self.where = kv, prefix, where
        self.label = prefix if label is None else label

    def _raw(self, key: str, default: Any) -> tuple[str, Any, bool]:
        full = self.label + key
        value = self.kv.get(self.prefix + key)
        if value is None and default is ...:
            raise ConfigError(f"{full}: missing from {self.where}")
        return full, value, value is None

    def get(self, key: str, kind: type = int, default: Any = ...) -> Any:
        full, value, absent = self._raw(key, default)
        return default if absent else _typed(full, value, kind)

    def list(self, key: str, kind: type = int, default: Any = ...) -> Any:
        full, value, absent = self._raw(key, default)
        if absent:
            return default
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{full}: expected a list, got {_show(value)}")
        return [_typed(f"{full}[{i}]", v, kind) for i, v in enumerate(value)]

    def sub(self, key: str) -> _Reader:
        """The object under `key` ({} when absent)."""
        full, value, absent = self._raw(key, {})
        if not absent and not isinstance(value, dict):
            raise ConfigError(f"{full}: expected a JSON object, got {_show(value)}")
        return _Reader(value or {}, "", self.where, full + ".")


def _interval_layers(src: _Reader, n_layers: int) -> list[bool]:
    """Recurrent flags from `full_attention_interval` (every interval-th layer is attention)."""
    interval = src.get("full_attention_interval", int, 4)
    if interval <= 0:
        raise ConfigError(f"{src.label}full_attention_interval: must be > 0, got {interval}")
    return [(i + 1) % interval != 0 for i in range(n_layers)]


# ---- HF config.json ------------------------------------------------------------------------------
def _hf_reader(cfg: Any) -> _Reader:
    """The text model's keys: `qwen4_exp_text` itself, or the `text_config` of the `qwen4_exp` VL wrapper."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config.json: expected a JSON object, got {_show(cfg)}")
    mt, prefix = cfg.get("model_type"), ""
    if mt == "qwen4_exp" or "text_config" in cfg:
        if mt not in HF_MODEL_TYPES:
            raise ConfigError(f"model_type: unknown architecture {mt!r}, expected one of {HF_MODEL_TYPES}")
        cfg, prefix = cfg.get("text_config"), "text_config."
        if not isinstance(cfg, dict):
            raise ConfigError(f"text_config: expected a JSON object, got {_show(cfg)}")
        mt = cfg.get("model_type", HF_TEXT_MODEL_TYPE)
    if mt != HF_TEXT_MODEL_TYPE:
        raise ConfigError(f"{prefix}model_type: unknown architecture {mt!r}, expected {HF_TEXT_MODEL_TYPE!r}")
    return _Reader(cfg, "", "config.json", prefix)


def _hf_derived(src: _Reader, v: dict[str, Any]) -> dict[str, Any]:
    """The fields config.json spells differently from ModelConfig: layer types, rotary, QSA ratio, EOS, gate."""
    types = src.list("layer_types", str, None)
    if types is None:
        types = [GDN_LAYER_TYPE if r else "indexed_attention" for r in _interval_layers(src, v["n_layers"])]
    for t in types:
        if t != GDN_LAYER_TYPE and t not in QSA_LAYER_TYPES:
            raise ConfigError(f"{src.label}layer_types: unknown layer type {t!r}")
    recurrent = tuple(t == GDN_LAYER_TYPE for t in types)
    ratio = src.get("indexer_compress_ratio", int, 0) if v["indexer_heads"] else 0
    if v["indexer_heads"] and src.get("indexer_kv_heads", int, 1) != 1:
        raise ConfigError(f"{src.label}indexer_kv_heads: qwen4exp QSA requires exactly 1 indexer key head")
    rope = src.sub("rope_parameters")
    partial = rope.get("partial_rotary_factor", float, src.get("partial_rotary_factor", float, 1.0))
    sections = (rope.list("mrope_section", int, [11, 11, 10]) + [0, 0, 0, 0])[:4]
    gate = src.get("output_gate_type", str, None) or src.get("hidden_act", str, "silu")
    if gate != "sigmoid":
        raise ConfigError(f"{src.label}output_gate_type: qspec implements the sigmoid GDN output gate, got {gate!r}")
    if isinstance(src.kv.get("eos_token_id"), list):
        eos_ids = src.list("eos_token_id", int)
        if not eos_ids:
            raise ConfigError(f"{src.label}eos_token_id: empty list")
        eos = eos_ids[0]
    else:
        eos = src.get("eos_token_id", int, 248044)
    return dict(layer_recurrent=recurrent, compress_ratios=tuple(0 if r else ratio for r in recurrent),
                rope_dim=int(v["head_dim"] * partial), rope_theta=rope.get("rope_theta", float,
                                                                           src.get("rope_theta", float, 1e7)),
                rope_sections=tuple(sections), eos_token_id=eos)


def _hf_ple(src: _Reader, v: dict[str, Any]) -> dict[str, Any]:
    """PLE layer and the n-gram hash tables, derived from the base vocabulary and seed as transformers does."""
    ple_ids = sorted(set(src.list("ple_layer_ids", int, [])))
    if len(ple_ids) > 1:
        raise ConfigError(f"{src.label}ple_layer_ids: qspec supports one PLE layer, got {ple_ids}")
    base, seed = src.get("ngram_vocab_size_base", int, 20_000_000), src.get("seed", int, 1234)
    extra = {"ngram_vocab_size_base": base, "seed": seed}
    if not ple_ids:
        return dict(ple_layer=-1, ple_embed_dim=0, ple_multipliers=(), ple_head_offsets=(), ple_head_vocab=(),
                    ple_rows=0, extra=extra)
    offsets, sizes = ple_head_tables((v["ngram_size"] - 1) * v["heads_per_ngram"], base)
    return dict(ple_layer=ple_ids[0] - 1, ple_embed_dim=src.get("ple_embed_dim", int, v["hidden"]),
                ple_multipliers=ple_multipliers(v["vocab_size"], v["ngram_size"], 0, seed),
                ple_head_offsets=offsets, ple_head_vocab=sizes,
                ple_rows=pad_rows(sum(sizes), src.get("make_ngram_vocab_size_divisible_by", int, 128)), extra=extra)


def from_hf_config(cfg: Any) -> ModelConfig:
    """Build from an HF config dict (`qwen4_exp_text`, or the VL wrapper holding `text_config`)."""
    src = _hf_reader(cfg)
    v = {k.field: src.get(k.hf, k.kind, k.default) for k in _KEYS if k.hf}
    return ModelConfig(**v, **_hf_derived(src, v), **_hf_ple(src, v)).validate()


def to_hf_config(c: ModelConfig) -> dict[str, Any]:
    """The `qwen4_exp_text` config.json for this model (what transformers and `from_hf_config` read)."""
    hf: dict[str, Any] = {"architectures": ["Qwen4ExpForCausalLM"], "model_type": HF_TEXT_MODEL_TYPE}
    for k in _KEYS:
        if k.hf:
            value = getattr(c, k.field)
            hf[k.hf] = None if k.hf_zero_null and not value else value
    ratio = max(c.compress_ratios, default=0) or (4 if c.indexer_heads else 0)
    return hf | {
        "layer_types": [GDN_LAYER_TYPE if r else "full_attention" for r in c.layer_recurrent],
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.rope_dim / c.head_dim,
                            "mrope_section": list(c.rope_sections[:3]), "mrope_interleaved": True},
        "norm_topk_prob": True,
        "indexer_kv_heads": 1 if c.indexer_heads else None,
        "indexer_compress_ratio": ratio or None,
        "ple_layer_ids": [c.ple_layer + 1] if c.has_ple else [],
        "ple_embed_dim": c.ple_embed_dim if c.has_ple else None,
        "ngram_vocab_size_base": c.extra.get("ngram_vocab_size_base", 20_000_000),
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": c.extra.get("seed", 1234),
        "eos_token_id": c.eos_token_id,
        "output_gate_type": "sigmoid",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "mtp_use_dedicated_embeddings": False,
        "torch_dtype": "float32",
    }


# ---- GGUF metadata -------------------------------------------------------------------------------
def _gguf_derived(src: _Reader, kv: Mapping[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """The fields llama.cpp stores in another form: trunk layers, layer flags, value head size, FFN size, vocab."""
    n_all = src.get("block_count")
    n_layers = n_all - v["n_mtp_layers"]
    if n_layers <= 0:
        raise ConfigError(f"{ARCH}.block_count: {n_all} blocks leave no trunk layers after {v['n_mtp_layers']} "
                          "MTP blocks")
    rec = src.list("attention.recurrent_layers", bool, None)
    rec = _interval_layers(src, n_layers) if rec is None else rec
    ratios = src.list("attention.compress_ratios", int, [0] * n_all)
    if src.get("attention.value_length", int, v["head_dim"]) != v["head_dim"]:
        raise ConfigError(f"{ARCH}.attention.value_length: must equal attention.key_length ({v['head_dim']})")
    # llama.cpp: head_v_dim = ssm.inner_size / ssm.time_step_rank (the key head size is ssm.state_size)
    inner, v_heads = src.get("ssm.inner_size"), v["gdn_v_heads"]
    if v_heads <= 0 or inner % v_heads:
        raise ConfigError(f"{ARCH}.ssm.inner_size: {inner} is not a multiple of time_step_rank {v_heads}")
    if isinstance(kv.get(f"{ARCH}.expert_feed_forward_length"), (list, tuple)):
        ffs = src.list("expert_feed_forward_length")
        if len(set(ffs)) != 1:
            raise ConfigError(f"{ARCH}.expert_feed_forward_length: per-layer sizes differ: {ffs}")
        ff = ffs[0]
    else:
        ff = src.get("expert_feed_forward_length")
    sections = src.list("rope.dimension_sections", int, [11, 11, 10, 0])
    if len(sections) != 4:
        raise ConfigError(f"{ARCH}.rope.dimension_sections: needs 4 entries, got {sections}")
    eos = src.get("ple.eos_token_id", int, None)
    if eos is None:
        eos = _Reader(kv, "", "GGUF metadata").get("tokenizer.ggml.eos_token_id", int, 248044)
    return dict(n_layers=n_layers, layer_recurrent=tuple(rec[:n_layers]), compress_ratios=tuple(ratios[:n_layers]),
                gdn_v_head_dim=inner // v_heads, expert_ff=ff, rope_sections=tuple(sections), eos_token_id=eos,
                vocab_size=_typed("token_embd.weight rows", kv.get("_vocab_size", 0), int)
                or src.get("vocab_size", int, 0))


def _gguf_ple(src: _Reader, kv: Mapping[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    ple_layers = src.list("ple.layers", int, [])
    if len(ple_layers) > 1:
        raise ConfigError(f"{ARCH}.ple.layers: exactly one PLE layer is supported, got {ple_layers}")
    if not ple_layers:
        return dict(ple_layer=-1, ple_embed_dim=0, ple_multipliers=(), ple_head_offsets=(), ple_head_vocab=(),
                    ple_rows=int(kv.get("_ple_rows", 0)))
    per_head = src.get("embedding_length_per_layer_input", int, 0)
    return dict(ple_layer=ple_layers[0], ple_embed_dim=per_head * (v["ngram_size"] - 1) * v["heads_per_ngram"],
                ple_multipliers=tuple(src.list("ple.layer_multipliers", int, [])),
                ple_head_offsets=tuple(src.list("ple.head_offsets", int, [])),
                ple_head_vocab=tuple(src.list("ple.head_vocab_sizes", int, [])), ple_rows=int(kv.get("_ple_rows", 0)))


def from_gguf_metadata(kv: Mapping[str, Any]) -> ModelConfig:
    """Build from GGUF key/values (already decoded to Python values)."""
    arch = kv.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"general.architecture: unknown architecture {arch!r}, expected {ARCH!r}")
    src = _Reader(kv, f"{ARCH}.", "GGUF metadata")
    v = {k.field: src.get(k.gguf, k.kind, k.default if k.gguf_optional else ...) for k in _KEYS if k.gguf}
    return ModelConfig(**v, **_gguf_derived(src, kv, v), **_gguf_ple(src, kv, v))


def to_gguf_metadata(c: ModelConfig) -> dict[str, Any]:
    """`qwen4exp.*` keys as the llama.cpp converter writes them (values as Python ints/floats/lists)."""
    p = ARCH + "."
    kv: dict[str, Any] = {"general.architecture": ARCH}
    for k in _KEYS:
        if k.gguf and (not k.gguf_if or getattr(c, k.gguf_if)):
            kv[p + k.gguf] = getattr(c, k.field)
    derived: dict[str, Any] = {
        "block_count": c.n_layers + c.n_mtp_layers,
        "attention.value_length": c.head_dim,
        "rope.dimension_sections": list(c.rope_sections),
        "expert_feed_forward_length": c.expert_ff,
        "ssm.inner_size": c.gdn_value_dim,
        "attention.recurrent_layers": list(c.layer_recurrent) + [False] * c.n_mtp_layers,
        "attention.compress_ratios": list(c.compress_ratios) + [0] * c.n_mtp_layers,
    }
    if c.has_ple:
        derived |= {"ple.layers": [c.ple_layer], "ple.eos_token_id": c.eos_token_id,
                    "ple.layer_multipliers": list(c.ple_multipliers), "ple.head_offsets": list(c.ple_head_offsets),
                    "ple.head_vocab_sizes": list(c.ple_head_vocab),
                    "embedding_length_per_layer_input": c.ple_head_dim}
    return kv | {p + k: value for k, value in derived.items()}


# ---- presets -------------------------------------------------------------------------------------
_PRESET_NAMES = ("flash-next", "tiny")
_PRESET_SIZES = (  # (size, flash-next, tiny); `ratio`: the QSA compress ratio, `ngram_base`: the n-gram vocab base
    ("vocab_size", 248320, 248320), ("hidden", 2560, 64), ("n_layers", 48, 4), ("n_heads", 24, 4),
    ("n_kv_heads", 2, 2), ("head_dim", 256, 32), ("rope_dim", 64, 8), ("gdn_k_heads", 16, 2),
    ("gdn_v_heads", 48, 4), ("gdn_head_dim", 128, 16), ("n_experts", 512, 8), ("n_experts_used", 10, 2),
    ("expert_ff", 640, 32), ("shared_ff", 640, 32), ("hc_count", 4, 4), ("hc_rank", 320, 16),
    ("indexer_heads", 4, 8), ("indexer_head_dim", 128, 16), ("indexer_budget", 2048, 16), ("ratio", 4, 4),
    ("ple_embed_dim", 2560, 64), ("ngram_base", 20_000_000, 1000),
)


def preset(name: str, *, layers: int | None = None, experts: int | None = None,
           ngram_vocab_base: int | None = None, vocab_size: int | None = None, mtp: bool = True,
           **overrides: Any) -> ModelConfig:
    """`tiny` (CPU tests, seconds) or `flash-next` (real geometry), optionally shrunk.

    `layers` keeps the 3 GDN : 1 QSA pattern; `ngram_vocab_base` shrinks the n-gram table."""
    if name not in _PRESET_NAMES:
        raise ConfigError(f"preset: unknown preset {name!r} (known: tiny, flash-next)")
    col = _PRESET_NAMES.index(name)
    base = {key: values[col] for key, *values in _PRESET_SIZES}
    n_layers = layers if layers is not None else base["n_layers"]
    if n_layers <= 0:
        raise ConfigError(f"layers: must be > 0, got {n_layers}")
    vocab = vocab_size or base["vocab_size"]
    rec = tuple((i + 1) % 4 != 0 for i in range(n_layers))
    ngram_base = ngram_vocab_base or base["ngram_base"]
    offsets, sizes = ple_head_tables(16, ngram_base)
    ple_layer = 1 if n_layers > 1 and rec[1] else -1
    cfg = ModelConfig(
        vocab_size=vocab, hidden=base["hidden"], n_layers=n_layers, layer_recurrent=rec,
        n_heads=base["n_heads"], n_kv_heads=base["n_kv_heads"], head_dim=base["head_dim"],
        rope_dim=base["rope_dim"], rope_theta=10_000_000.0,
        rope_sections=(11, 11, 10, 0) if base["rope_dim"] >= 64 else _small_sections(base["rope_dim"]),
        gdn_k_heads=base["gdn_k_heads"], gdn_v_heads=base["gdn_v_heads"], gdn_head_dim=base["gdn_head_dim"],
        gdn_v_head_dim=base["gdn_head_dim"],
        gdn_conv_kernel=4, n_experts=experts or base["n_experts"],
        n_experts_used=min(base["n_experts_used"], experts or base["n_experts"]),
        expert_ff=base["expert_ff"], shared_ff=base["shared_ff"], hc_count=base["hc_count"],
        hc_rank=base["hc_rank"], indexer_heads=base["indexer_heads"], indexer_head_dim=base["indexer_head_dim"],
        indexer_budget=base["indexer_budget"], compress_ratios=tuple(0 if r else base["ratio"] for r in rec),
        ple_layer=ple_layer, ngram_size=3, heads_per_ngram=8, ple_conv_kernel=4,
        ple_embed_dim=base["ple_embed_dim"] if ple_layer >= 0 else 0,
        ple_multipliers=ple_multipliers(vocab, 3) if ple_layer >= 0 else (),
        ple_head_offsets=offsets if ple_layer >= 0 else (), ple_head_vocab=sizes if ple_layer >= 0 else (),
        ple_rows=pad_rows(sum(sizes), 128) if ple_layer >= 0 else 0,
        eos_token_id=248044 if vocab > 248044 else vocab - 1,
        n_mtp_layers=1 if mtp else 0,
        extra={"ngram_vocab_size_base": ngram_base, "seed": 1234},
    )
    if "gdn_head_dim" in overrides:  # the value head size follows the key head size unless given too
        overrides.setdefault("gdn_v_head_dim", overrides["gdn_head_dim"])
    return cfg.with_(**overrides).validate() if overrides else cfg.validate()


def _small_sections(rope_dim: int) -> tuple[int, int, int, int]:
    """Scale the [11, 11, 10] M-RoPE split to a smaller rotary dim (text positions make it moot)."""
    half = rope_dim // 2
    a = round(half * 11 / 32)
    b = round(half * 11 / 32)
    return (a, b, half - a - b, 0)
