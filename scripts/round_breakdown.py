"""Per-round time breakdown and the weight-bandwidth model at flash-next geometry (issue: GPU fast path).

For each arm: decode tok/s (no extra syncs), then a second run that synchronises around every phase
(draft chain, verify, accept + rollback, draft extend) and reports ms per round; the pooled-key rows
materialised per round; graph captures/replays. The bandwidth model counts the bytes a step must read
(weights of the experts actually routed, the LM heads, the caches) and divides by 4.2 TB/s.
Run from the repo root: PYTHONPATH=. python scripts/round_breakdown.py --layers 8 --prompt 4096 --gen 256
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from qspec.bench.accept import AcceptProfile
from qspec.bench.device_model import bench_config, device_random_model
from qspec.bench.prompt import build_prompt
from qspec.config import ModelConfig
from qspec.engine import Engine, EngineHooks, EngineOptions

HBM = 4.2e12
ARMS = {
    "nospec": dict(draft=0),
    "baseline": dict(draft=3, preserve_pooled=False, incremental_pooled=False, pad_target=None,
                     fused_snapshots=False),
    "mtp5-off": dict(draft=5, preserve_pooled=False, incremental_pooled=False, pad_target=None,
                     fused_snapshots=False),
    "mtp5-on": dict(draft=5),
    "ours": dict(draft=5, draft_head="q4"),
    "ours-late": dict(draft=5, draft_head="q4", draft_before_readback=False),  # the chain after the read-back
    "ours-dv32k": dict(draft=5, draft_head="q4", draft_vocab=range(32768)),  # drafts from the first 32,768 ids
}


def layer_bytes(cfg: ModelConfig, experts: float, recurrent: bool, el: int = 2) -> float:
    D, S = cfg.hidden, cfg.hc_count
    hc = 2 * (2 * cfg.hc_rank * cfg.hc_dim + S * cfg.hc_dim)
    moe = experts * 3 * cfg.expert_ff * D + 3 * cfg.shared_ff * D + cfg.n_experts * D + D
    if recurrent:
        mix = (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.gdn_v_heads) * D + cfg.gdn_value_dim * D
    else:
        mix = (cfg.n_heads * cfg.head_dim * 3 + 2 * cfg.n_kv_heads * cfg.head_dim) * D \
            + (cfg.indexer_heads + 1) * cfg.indexer_head_dim * D
    return (hc + moe + mix) * el


def distinct_experts(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct experts touched by `rows` tokens routed uniformly (random weights)."""
    E, k = cfg.n_experts, cfg.n_experts_used
    return E * (1 - (1 - k / E) ** rows)


def bound(cfg: ModelConfig, draft: int, q4: bool, p: float, draft_rows: int | None = None) -> dict[str, float]:
    """Weight-bandwidth limit in tok/s: bytes per round / HBM, with E[tokens/round] at acceptance p. draft_rows: the
    draft head's rows (a draft vocabulary; default the whole vocabulary)."""
    head = cfg.vocab_size * cfg.hidden * 2
    if draft == 0:
        b = sum(layer_bytes(cfg, cfg.n_experts_used, r) for r in cfg.layer_recurrent) + head
        return {"bytes_per_token_gb": b / 1e9, "limit_tok_s": HBM / b}
    rows = draft + 1
    verify = sum(layer_bytes(cfg, distinct_experts(cfg, rows), r) for r in cfg.layer_recurrent) + head
    dhead = (draft_rows or cfg.vocab_size) * cfg.hidden * 2
    dhead = dhead / 4 * 1.125 if q4 else dhead  # Q4_0: 4.5 bits per weight
    mtp_block = layer_bytes(cfg, cfg.n_experts_used, False) + 3 * cfg.hidden * cfg.hidden * 2
    # the extend's rows all write their K/V cells, but only the accepted row goes through the MoE and the head (since
    # commit 79fc7cb; before, its MoE ran all rows: layer_bytes(cfg, distinct_experts(cfg, rows), False))
    extend = mtp_block + dhead
    chain = (draft - 1) * (mtp_block + dhead)
    per_round = verify + extend + chain
    tokens = 1 + sum(p ** i for i in range(1, draft + 1))
    return {"bytes_per_round_gb": per_round / 1e9, "tokens_per_round": tokens,
            "limit_tok_s": HBM / per_round * tokens}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--p", type=float, default=0.85)
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    a = ap.parse_args()
    unknown = set(a.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    torch.set_grad_enabled(False)
    cfg = bench_config(a.preset, layers=a.layers)
    model = device_random_model(cfg, device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    prompt = list(build_prompt(None, a.prompt, vocab_size=cfg.vocab_size))
    res = {}
    for name in a.arms.split(","):
        kw = ARMS[name]
        prof = AcceptProfile.parse(f"p={a.p}")
        hooks = EngineHooks(accept_hook=prof.hook())
        eng = Engine(model, EngineOptions(capacity=8192, kv_type="q8_0", prefix_cache=False, **kw), hooks)
        eng.generate(prompt, 32)  # warmup: kernels, graphs
        g = eng.generate(prompt, a.gen)
        hooks.time_phases = True
        t = eng.generate(prompt, a.gen)
        rounds = max(t.spec.rounds, 1) if kw.get("draft") else len(t.tokens)
        pooled = next(iter(g.pooled.values()), {})
        vocab = kw.get("draft_vocab")
        b = bound(cfg, kw.get("draft", 0), kw.get("draft_head") == "q4", a.p, None if vocab is None else len(vocab))
        res[name] = {"decode_tok_s": round(g.decode_tps, 2), "prefill_tok_s": round(g.prefill_tps, 1),
                     "ms_per_round": {k: round(v / rounds * 1e3, 3) for k, v in t.phases.items()},
                     "rounds": g.spec.rounds, "tokens_per_round": round(g.spec.tokens_per_round, 3),
                     "pooled_rows_per_update": round((pooled.get("rows_real", 0) + pooled.get("rows_filler", 0))
                                                     / max(pooled.get("updates", 1), 1), 1),
                     "pooled_real_rows_per_update": round(pooled.get("rows_real", 0)
                                                          / max(pooled.get("updates", 1), 1), 2),
                     "update_shapes_seen": len(pooled.get("update_shapes", {})),
                     "graphs": g.graphs, "snapshots": g.snapshots, "bandwidth_model": b,
                     "fraction_of_limit": round(g.decode_tps / b["limit_tok_s"], 3)}
        print(name, json.dumps(res[name]), flush=True)
    print()
    print(f"{'arm':10s} {'tok/s':>8s} {'limit':>8s} {'frac':>6s}  ms/round by phase")
    for name, r in res.items():
        print(f"{name:10s} {r['decode_tok_s']:8.1f} {r['bandwidth_model']['limit_tok_s']:8.1f} "
              f"{r['fraction_of_limit']:6.3f}  {r['ms_per_round']}")
    if a.out:
        with open(a.out, "w") as f:
            dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
            json.dump({"device": dev, "torch": torch.__version__, "layers": a.layers, "prompt": a.prompt,
                       "gen": a.gen, "acceptance": f"replayed p={a.p}", "arms": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
