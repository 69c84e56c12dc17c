"""The canonical weight set: llama.cpp GGUF tensor names with torch shapes ([out, in], i.e. ggml `ne` reversed).

Every loader produces exactly this dict, in llama.cpp's value conventions (zero-centred RMSNorm gammas
stored as 1+w except `ssm_norm`; Gated DeltaNet value heads in the file's tiled order). The model
only ever sees these names.
"""

from __future__ import annotations

from qspec.config import ModelConfig


def _hc(prefix: str, c: ModelConfig, inject: bool) -> dict[str, tuple[int, ...]]:
    s = {
        f"{prefix}_norm.weight": (c.hc_dim,),
        f"{prefix}_down.weight": (c.hc_rank, c.hc_dim),
        f"{prefix}_up.weight": (c.hc_dim, c.hc_rank),
    }
    if inject:
        s[f"{prefix}_inject.weight"] = (c.hc_count, c.hc_dim)
    return s


def _qsa_block(b: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    s = {
        f"{b}.attn_q.weight": (c.n_heads * c.head_dim * 2, c.hidden),
        f"{b}.attn_k.weight": (c.n_kv_heads * c.head_dim, c.hidden),
        f"{b}.attn_v.weight": (c.n_kv_heads * c.head_dim, c.hidden),
        f"{b}.attn_output.weight": (c.hidden, c.n_heads * c.head_dim),
        f"{b}.attn_q_norm.weight": (c.head_dim,),
        f"{b}.attn_k_norm.weight": (c.head_dim,),
    }
    if c.indexer_heads:
        s |= {
            f"{b}.indexer.q_proj.weight": (c.indexer_heads * c.indexer_head_dim, c.hidden),
            f"{b}.indexer.k_proj.weight": (c.indexer_head_dim, c.hidden),
            f"{b}.indexer.q_norm.weight": (c.indexer_head_dim,),
            f"{b}.indexer.k_norm.weight": (c.indexer_head_dim,),
        }
    return s


def _moe_block(b: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {
        f"{b}.ffn_gate_inp.weight": (c.n_experts, c.hidden),
        f"{b}.ffn_gate_exps.weight": (c.n_experts, c.expert_ff, c.hidden),
        f"{b}.ffn_up_exps.weight": (c.n_experts, c.expert_ff, c.hidden),
        f"{b}.ffn_down_exps.weight": (c.n_experts, c.hidden, c.expert_ff),
        f"{b}.ffn_gate_inp_shexp.weight": (c.hidden,),
        f"{b}.ffn_gate_shexp.weight": (c.shared_ff, c.hidden),
        f"{b}.ffn_up_shexp.weight": (c.shared_ff, c.hidden),
        f"{b}.ffn_down_shexp.weight": (c.hidden, c.shared_ff),
    }


def _gdn_block(b: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {
        f"{b}.attn_qkv.weight": (c.gdn_conv_dim, c.hidden),
        f"{b}.attn_gate.weight": (c.gdn_value_dim, c.hidden),
        f"{b}.ssm_conv1d.weight": (c.gdn_conv_dim, c.gdn_conv_kernel),
        f"{b}.ssm_dt.bias": (c.gdn_v_heads,),
        f"{b}.ssm_a": (c.gdn_v_heads,),
        f"{b}.ssm_beta.weight": (c.gdn_v_heads, c.hidden),
        f"{b}.ssm_alpha.weight": (c.gdn_v_heads, c.hidden),
        f"{b}.ssm_norm.weight": (c.gdn_v_head_dim,),
        f"{b}.ssm_out.weight": (c.hidden, c.gdn_value_dim),
    }


def _ple_block(b: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {
        f"{b}.ple_key.weight": (c.hc_dim, c.ple_embed_dim),
        f"{b}.ple_value.weight": (c.hidden, c.ple_embed_dim),
        f"{b}.ple_norm_key.weight": (c.hc_dim,),
        f"{b}.ple_norm_query.weight": (c.hc_dim,),
        f"{b}.ple_norm_conv.weight": (c.hc_dim,),
        f"{b}.ple_conv1d.weight": (c.hc_dim, c.ple_conv_kernel),
    }


def trunk_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the target model (no MTP)."""
    s: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "output.weight": (c.vocab_size, c.hidden),
    }
    s |= _hc("output_hc", c, inject=False)
    if c.has_ple:
        s["per_layer_token_embd.weight"] = (c.ple_rows, c.ple_head_dim)
    for i in range(c.n_layers):
        b = f"blk.{i}"
        s |= _hc(f"{b}.hc_attn", c, inject=True)
        s |= _hc(f"{b}.hc_ffn", c, inject=True)
        s |= _gdn_block(b, c) if c.layer_recurrent[i] else _qsa_block(b, c)
        s |= _moe_block(b, c)
        if i == c.ple_layer:
            s |= _ple_block(b, c)
    return s


def mtp_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP block `blk.{n_layers}`: a full attention + MoE + HC layer plus the nextn fusion and mixer."""
    b = f"blk.{c.mtp_layer}"
    s: dict[str, tuple[int, ...]] = {
        f"{b}.nextn.eh_proj.weight": (c.hidden, 2 * c.hidden),
        f"{b}.nextn.enorm.weight": (c.hidden,),
        f"{b}.nextn.hnorm.weight": (c.hc_dim,),
    }
    s |= _hc(f"{b}.nextn.hc_head", c, inject=False)
    s |= _hc(f"{b}.hc_attn", c, inject=True)
    s |= _hc(f"{b}.hc_ffn", c, inject=True)
    s |= _qsa_block(b, c)
    s |= _moe_block(b, c)
    return s


def tensor_shapes(c: ModelConfig, with_mtp: bool | None = None) -> dict[str, tuple[int, ...]]:
    with_mtp = c.has_mtp if with_mtp is None else with_mtp
    s = trunk_shapes(c)
    if with_mtp:
        s |= mtp_shapes(c)
    return s


def writable_shapes(c: ModelConfig, tensors: object) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """What a writer stores for `tensors`: the MTP block only when all of it is present (else the config
    says there is none), and a named error for the first missing trunk tensor."""
    from qspec.weights.dequant import WeightsError

    with_mtp = c.has_mtp and all(n in tensors for n in mtp_shapes(c))  # type: ignore[operator]
    if c.has_mtp and not with_mtp:
        c = c.with_(n_mtp_layers=0)
    shapes = tensor_shapes(c, with_mtp)
    missing = [n for n in shapes if n not in tensors]  # type: ignore[operator]
    if missing:
        raise WeightsError(f"missing tensor {missing[0]!r} ({len(missing)} missing)")
    return c, shapes
