"""The reference point: transformers' Qwen4ExpForCausalLM decoding at the same geometry, same GPU.

Random weights (transformers' own init) at `flash-next` geometry with --layers layers, bf16,
a prompt of --prompt random tokens, then --gen greedy tokens with its DynamicCache; prints JSON.
Run from the repo root: PYTHONPATH=. python scripts/bench_transformers.py --layers 8 --prompt 4096 --gen 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from qspec.config import preset, to_hf_config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers

    cfg = preset("flash-next", layers=a.layers, experts=a.experts, ngram_vocab_base=1000, mtp=False)
    hcfg = {k: v for k, v in to_hf_config(cfg).items()
            if k not in ("architectures", "model_type", "torch_dtype", "mtp_num_hidden_layers",
                         "mtp_use_dedicated_embeddings")}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**hcfg)).to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, cfg.vocab_size - 1000, (1, a.prompt), device="cuda")
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(a.gen):
            t1 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)  # older and newer transformers accept this
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t1)
    res = {"engine": f"transformers {transformers.__version__} Qwen4ExpForCausalLM", "layers": a.layers,
           "experts": cfg.n_experts, "prompt_tokens": a.prompt, "generated": a.gen, "build_s": round(build_s, 2),
           "prefill_s": round(prefill_s, 3), "decode_s": round(sum(times), 4),
           "decode_tok_s": round(a.gen / sum(times), 3),
           "decode_tok_s_after_first": round((a.gen - 1) / sum(times[1:]), 3) if a.gen > 1 else None,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)}
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
