"""Model hyperparameters for Qwen3.8-Flash-Next (llama.cpp arch `qwen4exp`, HF `qwen4_exp_text`).

One frozen dataclass, built from GGUF metadata, from an HF `config.json`, or from a preset.
Every other module reads shapes from here; `tensor_shapes` is the single list of weights.
"""

from __future__ import annotations

import math
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
    gdn_head_dim: int  # key and value head dim (equal in llama.cpp's layout)
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
        return self.gdn_v_heads * self.gdn_head_dim

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


def _pad_rows(total: int, divisor: int) -> int:
    return -(-total // divisor) * divisor


# ---- HF config.json ------------------------------------------------------------------------------
def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build from an HF config dict (`qwen4_exp_text`, or the VL wrapper holding `text_config`)."""
    mt = cfg.get("model_type")
    if mt == "qwen4_exp" or "text_config" in cfg:
        if mt not in HF_MODEL_TYPES:
            raise ConfigError(f"model_type: unknown architecture {mt!r}, expected one of {HF_MODEL_TYPES}")
        cfg = {**cfg["text_config"], "_top": cfg}
        mt = cfg.get("model_type", HF_TEXT_MODEL_TYPE)
    if mt != HF_TEXT_MODEL_TYPE:
        raise ConfigError(f"model_type: unknown architecture {mt!r}, expected {HF_TEXT_MODEL_TYPE!r}")

    def get(key: str, default: Any = ...) -> Any:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
        if default is ...:
            raise ConfigError(f"{key}: missing from config.json")
        return default

    n_layers = int(get("num_hidden_layers"))
    types = cfg.get("layer_types")
    if types is None:
        interval = int(get("full_attention_interval", 4))
        types = [GDN_LAYER_TYPE if (i + 1) % interval else "indexed_attention" for i in range(n_layers)]
    for t in types:
        if t != GDN_LAYER_TYPE and t not in QSA_LAYER_TYPES:
            raise ConfigError(f"layer_types: unknown layer type {t!r}")
    recurrent = tuple(t == GDN_LAYER_TYPE for t in types)
    rope = get("rope_parameters", None) or {}
    head_dim = int(get("head_dim", 256))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    sections = (sections + [0, 0, 0, 0])[:4]
    idx_heads = cfg.get("indexer_n_heads")
    ratio = int(cfg.get("indexer_compress_ratio") or 0) if idx_heads else 0
    if idx_heads and int(get("indexer_kv_heads", 1)) != 1:
        raise ConfigError("indexer_kv_heads: qwen4exp QSA requires exactly 1 indexer key head")
    vocab = int(get("vocab_size"))
    hidden = int(get("hidden_size"))
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate != "sigmoid":
        raise ConfigError(f"output_gate_type: qspec implements the sigmoid GDN output gate, got {gate!r}")
    eos = get("eos_token_id", 248044)
    eos = int(eos[0] if isinstance(eos, list) else eos)
    ple_ids = sorted(set(cfg.get("ple_layer_ids") or []))
    if len(ple_ids) > 1:
        raise ConfigError(f"ple_layer_ids: qspec supports one PLE layer, got {ple_ids}")
    ngram = int(get("ngram_size", 3))
    hpn = int(get("heads_per_ngram", 8))
    ple_layer = ple_ids[0] - 1 if ple_ids else -1
    n_ple_heads = (ngram - 1) * hpn
    offsets, sizes = ple_head_tables(n_ple_heads, int(get("ngram_vocab_size_base", 20_000_000))) if ple_ids \
        else ((), ())
    rows = _pad_rows(sum(sizes), int(get("make_ngram_vocab_size_divisible_by", 128))) if ple_ids else 0
    mults = ple_multipliers(vocab, ngram, 0, int(get("seed", 1234))) if ple_ids else ()
    return ModelConfig(
        vocab_size=vocab,
        hidden=hidden,
        n_layers=n_layers,
        layer_recurrent=recurrent,
        n_heads=int(get("num_attention_heads")),
        n_kv_heads=int(get("num_key_value_heads")),
        head_dim=head_dim,
        rope_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000_000.0))),
        rope_sections=tuple(int(s) for s in sections),  # type: ignore[arg-type]
        gdn_k_heads=int(get("linear_num_key_heads", 16)),
        gdn_v_heads=int(get("linear_num_value_heads", 32)),
        gdn_head_dim=int(get("linear_key_head_dim", 128)),
        gdn_conv_kernel=int(get("linear_conv_kernel_dim", 4)),
        n_experts=int(get("num_experts", 512)),
        n_experts_used=int(get("num_experts_per_tok", 10)),
        expert_ff=int(get("moe_intermediate_size", 512)),
        shared_ff=int(get("shared_expert_intermediate_size", 512)),
        hc_count=int(get("hc_count", 4)),
        hc_rank=int(get("hc_lowrank", 320)),
        indexer_heads=int(idx_heads or 0),
        indexer_head_dim=int(cfg.get("indexer_head_dim") or 0),
        indexer_budget=int(cfg.get("indexer_budget") or 0),
        compress_ratios=tuple(0 if r else ratio for r in recurrent),
        ple_layer=ple_layer,
        ngram_size=ngram,
        heads_per_ngram=hpn,
        ple_conv_kernel=int(get("ple_conv_kernel_size", 4)),
        ple_embed_dim=int(cfg.get("ple_embed_dim") or hidden) if ple_ids else 0,
        ple_multipliers=mults,
        ple_head_offsets=offsets,
        ple_head_vocab=sizes,
        ple_rows=rows,
        eos_token_id=eos,
        rms_eps=float(get("rms_norm_eps", 1e-6)),
        context_length=int(get("max_position_embeddings", 262144)),
        n_mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
        extra={"ngram_vocab_size_base": int(get("ngram_vocab_size_base", 20_000_000)),
               "seed": int(get("seed", 1234))},
    ).validate()


def to_hf_config(c: ModelConfig) -> dict[str, Any]:
    """The `qwen4_exp_text` config.json for this model (what transformers and `from_hf_config` read)."""
    ratio = max(c.compress_ratios, default=0) or (4 if c.indexer_heads else 0)
    return {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": HF_TEXT_MODEL_TYPE,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.n_layers,
        "layer_types": [GDN_LAYER_TYPE if r else "full_attention" for r in c.layer_recurrent],
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.rope_dim / c.head_dim,
                            "mrope_section": list(c.rope_sections[:3]), "mrope_interleaved": True},
        "linear_num_key_heads": c.gdn_k_heads,
        "linear_num_value_heads": c.gdn_v_heads,
        "linear_key_head_dim": c.gdn_head_dim,
        "linear_value_head_dim": c.gdn_head_dim,
        "linear_conv_kernel_dim": c.gdn_conv_kernel,
        "num_experts": c.n_experts,
        "num_experts_per_tok": c.n_experts_used,
        "moe_intermediate_size": c.expert_ff,
        "shared_expert_intermediate_size": c.shared_ff,
        "norm_topk_prob": True,
        "hc_count": c.hc_count,
        "hc_lowrank": c.hc_rank,
        "indexer_n_heads": c.indexer_heads or None,
        "indexer_kv_heads": 1 if c.indexer_heads else None,
        "indexer_head_dim": c.indexer_head_dim or None,
        "indexer_budget": c.indexer_budget or None,
        "indexer_compress_ratio": ratio or None,
        "ple_layer_ids": [c.ple_layer + 1] if c.has_ple else [],
        "ple_embed_dim": c.ple_embed_dim if c.has_ple else None,
        "ple_conv_kernel_size": c.ple_conv_kernel,
        "ngram_size": c.ngram_size,
        "heads_per_ngram": c.heads_per_ngram,
        "ngram_vocab_size_base": c.extra.get("ngram_vocab_size_base", 20_000_000),
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": c.extra.get("seed", 1234),
        "eos_token_id": c.eos_token_id,
        "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.context_length,
        "output_gate_type": "sigmoid",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": c.n_mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "torch_dtype": "float32",
    }


# ---- GGUF metadata -------------------------------------------------------------------------------
def from_gguf_metadata(kv: dict[str, Any]) -> ModelConfig:
    """Build from GGUF key/values (already decoded to Python values)."""
    arch = kv.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"general.architecture: unknown architecture {arch!r}, expected {ARCH!r}")

    def get(key: str, default: Any = ...) -> Any:
        full = f"{ARCH}.{key}"
        if full in kv:
            return kv[full]
        if default is ...:
            raise ConfigError(f"{full}: missing from GGUF metadata")
        return default

    n_all = int(get("block_count"))
    n_mtp = int(get("nextn_predict_layers", 0))
    n_layers = n_all - n_mtp
    if n_layers <= 0:
        raise ConfigError(f"{ARCH}.block_count: {n_all} blocks leave no trunk layers after {n_mtp} MTP blocks")
    rec = get("attention.recurrent_layers", None)
    if rec is None:
        interval = int(get("full_attention_interval", 4))
        rec = [(i + 1) % interval != 0 for i in range(n_layers)]
    rec = tuple(bool(x) for x in list(rec)[:n_layers])
    ratios = list(get("attention.compress_ratios", [0] * n_all))
    ratios = tuple(int(r) for r in ratios[:n_layers])
    head_k = int(get("attention.key_length"))
    if int(get("attention.value_length", head_k)) != head_k:
        raise ConfigError(f"{ARCH}.attention.value_length: must equal attention.key_length ({head_k})")
    inner = int(get("ssm.inner_size"))
    state = int(get("ssm.state_size"))
    v_heads = int(get("ssm.time_step_rank"))
    if v_heads * state != inner:
        raise ConfigError(f"{ARCH}.ssm.inner_size: {inner} != time_step_rank {v_heads} x state_size {state}")
    ple_layers = list(get("ple.layers", []))
    if len(ple_layers) > 1:
        raise ConfigError(f"{ARCH}.ple.layers: exactly one PLE layer is supported, got {ple_layers}")
    has_ple = bool(ple_layers)
    ngram = int(get("ple.ngram_size", 3))
    hpn = int(get("ple.heads_per_ngram", 8))
    sections = list(get("rope.dimension_sections", [11, 11, 10, 0]))
    if len(sections) != 4:
        raise ConfigError(f"{ARCH}.rope.dimension_sections: needs 4 entries, got {sections}")
    ff = get("expert_feed_forward_length")
    if isinstance(ff, (list, tuple)):
        if len(set(int(x) for x in ff)) != 1:
            raise ConfigError(f"{ARCH}.expert_feed_forward_length: per-layer sizes differ: {ff}")
        ff = ff[0]
    hidden = int(get("embedding_length"))
    return ModelConfig(
        vocab_size=int(kv.get("_vocab_size", 0)) or int(get("vocab_size", 0)),
        hidden=hidden,
        n_layers=n_layers,
        layer_recurrent=rec,
        n_heads=int(get("attention.head_count")),
        n_kv_heads=int(get("attention.head_count_kv")),
        head_dim=head_k,
        rope_dim=int(get("rope.dimension_count")),
        rope_theta=float(get("rope.freq_base", 10_000_000.0)),
        rope_sections=tuple(int(s) for s in sections),  # type: ignore[arg-type]
        gdn_k_heads=int(get("ssm.group_count")),
        gdn_v_heads=v_heads,
        gdn_head_dim=state,
        gdn_conv_kernel=int(get("ssm.conv_kernel")),
        n_experts=int(get("expert_count")),
        n_experts_used=int(get("expert_used_count")),
        expert_ff=int(ff),
        shared_ff=int(get("expert_shared_feed_forward_length")),
        hc_count=int(get("hyper_connection.count")),
        hc_rank=int(get("hyper_connection.low_rank")),
        indexer_heads=int(get("attention.indexer.head_count", 0)),
        indexer_head_dim=int(get("attention.indexer.key_length", 0)),
        indexer_budget=int(get("attention.indexer.top_k", 0)),
        compress_ratios=ratios,
        ple_layer=int(ple_layers[0]) if has_ple else -1,
        ngram_size=ngram,
        heads_per_ngram=hpn,
        ple_conv_kernel=int(get("ple.conv_kernel", 4)),
        ple_embed_dim=int(get("embedding_length_per_layer_input", 0)) * (ngram - 1) * hpn if has_ple else 0,
        ple_multipliers=tuple(int(x) for x in get("ple.layer_multipliers", [])) if has_ple else (),
        ple_head_offsets=tuple(int(x) for x in get("ple.head_offsets", [])) if has_ple else (),
        ple_head_vocab=tuple(int(x) for x in get("ple.head_vocab_sizes", [])) if has_ple else (),
        ple_rows=int(kv.get("_ple_rows", 0)),
        eos_token_id=int(get("ple.eos_token_id", kv.get("tokenizer.ggml.eos_token_id", 248044))),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        context_length=int(get("context_length", 262144)),
        n_mtp_layers=n_mtp,
    )


def to_gguf_metadata(c: ModelConfig) -> dict[str, Any]:
    """`qwen4exp.*` keys as the llama.cpp converter writes them (values as Python ints/floats/lists)."""
    p = ARCH + "."
    kv: dict[str, Any] = {
        "general.architecture": ARCH,
        p + "block_count": c.n_layers + c.n_mtp_layers,
        p + "context_length": c.context_length,
        p + "embedding_length": c.hidden,
        p + "attention.head_count": c.n_heads,
        p + "attention.head_count_kv": c.n_kv_heads,
        p + "attention.key_length": c.head_dim,
        p + "attention.value_length": c.head_dim,
        p + "attention.layer_norm_rms_epsilon": c.rms_eps,
        p + "rope.dimension_count": c.rope_dim,
        p + "rope.dimension_sections": list(c.rope_sections),
        p + "rope.freq_base": c.rope_theta,
        p + "expert_count": c.n_experts,
        p + "expert_used_count": c.n_experts_used,
        p + "expert_feed_forward_length": c.expert_ff,
        p + "expert_shared_feed_forward_length": c.shared_ff,
        p + "ssm.conv_kernel": c.gdn_conv_kernel,
        p + "ssm.state_size": c.gdn_head_dim,
        p + "ssm.group_count": c.gdn_k_heads,
        p + "ssm.time_step_rank": c.gdn_v_heads,
        p + "ssm.inner_size": c.gdn_value_dim,
        p + "attention.recurrent_layers": list(c.layer_recurrent) + [False] * c.n_mtp_layers,
        p + "hyper_connection.count": c.hc_count,
        p + "hyper_connection.low_rank": c.hc_rank,
        p + "attention.compress_ratios": list(c.compress_ratios) + [0] * c.n_mtp_layers,
    }
    if c.indexer_heads:
        kv[p + "attention.indexer.head_count"] = c.indexer_heads
        kv[p + "attention.indexer.key_length"] = c.indexer_head_dim
        kv[p + "attention.indexer.top_k"] = c.indexer_budget
    if c.n_mtp_layers:
        kv[p + "nextn_predict_layers"] = c.n_mtp_layers
    if c.has_ple:
        kv[p + "ple.layers"] = [c.ple_layer]
        kv[p + "ple.ngram_size"] = c.ngram_size
        kv[p + "ple.heads_per_ngram"] = c.heads_per_ngram
        kv[p + "ple.conv_kernel"] = c.ple_conv_kernel
        kv[p + "ple.eos_token_id"] = c.eos_token_id
        kv[p + "ple.layer_multipliers"] = list(c.ple_multipliers)
        kv[p + "ple.head_offsets"] = list(c.ple_head_offsets)
        kv[p + "ple.head_vocab_sizes"] = list(c.ple_head_vocab)
        kv[p + "embedding_length_per_layer_input"] = c.ple_head_dim
    return kv


# ---- presets -------------------------------------------------------------------------------------
def preset(name: str, *, layers: int | None = None, experts: int | None = None,
           ngram_vocab_base: int | None = None, vocab_size: int | None = None, mtp: bool = True,
           **overrides: Any) -> ModelConfig:
    """`tiny` (CPU tests, seconds) or `flash-next` (real geometry), optionally shrunk.

    `layers` keeps the 3 GDN : 1 QSA pattern; `ngram_vocab_base` shrinks the n-gram table."""
    if name == "flash-next":
        base = dict(vocab_size=248320, hidden=2560, n_layers=48, n_heads=24, n_kv_heads=2, head_dim=256,
                    rope_dim=64, gdn_k_heads=16, gdn_v_heads=48, gdn_head_dim=128, n_experts=512,
                    n_experts_used=10, expert_ff=640, shared_ff=640, hc_count=4, hc_rank=320,
                    indexer_heads=4, indexer_head_dim=128, indexer_budget=2048, ratio=4,
                    ple_embed_dim=2560, ngram_base=20_000_000)
    elif name == "tiny":
        base = dict(vocab_size=248320, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                    rope_dim=8, gdn_k_heads=2, gdn_v_heads=4, gdn_head_dim=16, n_experts=8,
                    n_experts_used=2, expert_ff=32, shared_ff=32, hc_count=4, hc_rank=16,
                    indexer_heads=8, indexer_head_dim=16, indexer_budget=16, ratio=4,
                    ple_embed_dim=64, ngram_base=1000)
    else:
        raise ConfigError(f"preset: unknown preset {name!r} (known: tiny, flash-next)")
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
        gdn_conv_kernel=4, n_experts=experts or base["n_experts"],
        n_experts_used=min(base["n_experts_used"], experts or base["n_experts"]),
        expert_ff=base["expert_ff"], shared_ff=base["shared_ff"], hc_count=base["hc_count"],
        hc_rank=base["hc_rank"], indexer_heads=base["indexer_heads"], indexer_head_dim=base["indexer_head_dim"],
        indexer_budget=base["indexer_budget"], compress_ratios=tuple(0 if r else base["ratio"] for r in rec),
        ple_layer=ple_layer, ngram_size=3, heads_per_ngram=8, ple_conv_kernel=4,
        ple_embed_dim=base["ple_embed_dim"] if ple_layer >= 0 else 0,
        ple_multipliers=ple_multipliers(vocab, 3) if ple_layer >= 0 else (),
        ple_head_offsets=offsets if ple_layer >= 0 else (), ple_head_vocab=sizes if ple_layer >= 0 else (),
        ple_rows=_pad_rows(sum(sizes), 128) if ple_layer >= 0 else 0,
        eos_token_id=248044 if vocab > 248044 else vocab - 1,
        n_mtp_layers=1 if mtp else 0,
        extra={"ngram_vocab_size_base": ngram_base, "seed": 1234},
    )
    return cfg.with_(**overrides).validate() if overrides else cfg.validate()


def _small_sections(rope_dim: int) -> tuple[int, int, int, int]:
    """Scale the [11, 11, 10] M-RoPE split to a smaller rotary dim (text positions make it moot)."""
    half = rope_dim // 2
    a = round(half * 11 / 32)
    b = round(half * 11 / 32)
    return (a, b, half - a - b, 0)
