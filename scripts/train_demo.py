"""Train qspec's demo model: a small qwen4exp with an MTP head that writes Python-like text, so `qspec run --model
demo` shows real text and speculative decoding with drafts the model itself gets right (the random default model's
drafts are never accepted).

The trunk is transformers' `Qwen4ExpForCausalLM` (the reference implementation, trained with its own loss); the
MTP head is built from transformers' modules in the layout SGLang loads (`mtp.*`: fc_embedding / fc_hidden over
[rms(embed(t+1)) ; rms(H_t)], one attention + MoE decoder layer, a hyper-connection mixer, the shared LM head) and
trained on the frozen trunk to predict the token after next. The result goes through qspec's own HF reader to a
Q8_0 GGUF with the tokenizer embedded, then is checked: qspec's logits against transformers', and greedy MTP
decoding against plain decoding with the head's acceptance.

Data: the Python standard library's own modules (every `*.py` directly in the running interpreter's stdlib
directory, sorted; every 20th file held out), tokenized with the Qwen tokenizer cut to 8,192 ids. Nothing is
downloaded. Run from the repo root (2 CPU cores: ~25 + ~10 minutes):

    PYTHONPATH=. python scripts/train_demo.py --out qspec/assets/demo-q8_0.gguf
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from qspec.config import ModelConfig, preset, to_hf_config
from qspec.engine import Engine, EngineOptions
from qspec.loader import truncated_qwen_tokenizer
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.tokenizer import Tokenizer
from qspec.weights import load_model_weights, write_gguf
from qspec.weights.gguf_io import GGMLQuantizationType

VOCAB = 8192


def demo_config() -> ModelConfig:
    """The tiny preset widened to 128 (experts and shared expert 64, mixer rank 32) with a 8,192-token vocabulary,
    an MTP head and an indexer budget above the training length (the indexer's top-k is not trained: every context
    the demo is meant for attends densely)."""
    return preset("tiny", vocab_size=VOCAB, mtp=True).with_(
        hidden=128, expert_ff=64, shared_ff=64, hc_rank=32, indexer_budget=1024).validate()


def corpus(tok, held_out_every: int = 20) -> tuple[torch.Tensor, torch.Tensor, int]:  # noqa: ANN001
    """(training ids, held-out ids, files): the stdlib modules, each followed by <|endoftext|>."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    eos = tok.endoftext_id
    train: list[int] = []
    held: list[int] = []
    for i, f in enumerate(files):
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace")) + [eos]
        (held if i % held_out_every == 0 else train).extend(ids)
    return torch.tensor(train), torch.tensor(held), len(files)


def batches(ids: torch.Tensor, batch: int, length: int, rng: random.Random) -> Iterator[torch.Tensor]:
    while True:
        starts = [rng.randrange(0, len(ids) - length - 1) for _ in range(batch)]
        yield torch.stack([ids[s:s + length + 1] for s in starts])


def dense_indexer(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):  # noqa: ANN001, ANN003, ANN201, ARG001
    """The QSA indexer when its budget covers the whole context: every visible token is selected (what the
    reference computes then, without its per-query Python loop). The keyword arguments the attention forwards
    (`output_router_logits` and the like, which vary between transformers releases) do not change that."""
    if hidden_states.shape[1] > self.token_budget:
        raise ValueError("dense_indexer: the context exceeds the indexer budget")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def causal_mask(B: int, T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def train(params, loss_fn, minutes: float, steps_est: int, peak: float, label: str) -> int:  # noqa: ANN001
    opt = torch.optim.AdamW(params, lr=peak, betas=(0.9, 0.95), weight_decay=0.1)
    t0, step, avg = time.time(), 0, None
    while time.time() - t0 < minutes * 60:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps_est, peak)
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        step += 1
        if step % 25 == 0:
            print(f"{label} step {step} loss {avg:.3f} ({time.time() - t0:.0f} s)", flush=True)
    return step


class MTPHead(nn.Module):
    """The draft head in SGLang's `mtp.*` layout, from transformers' modules."""

    def __init__(self, config) -> None:  # noqa: ANN001
        super().__init__()
        D, S = config.hidden_size, config.hc_count
        self.fc_embedding = nn.Linear(D, D, bias=False)
        self.fc_hidden = nn.Linear(D, D, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen4ExpTextRMSNorm(D, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen4ExpTextRMSNorm(S * D, eps=config.rms_norm_eps)
        n = config.num_hidden_layers
        mcfg = copy.deepcopy(config)
        mcfg.num_hidden_layers = n + 1
        attn = next(t for t in config.layer_types if t != "linear_attention")
        mcfg.layer_types = list(config.layer_types) + [attn]
        self.layers = nn.ModuleList([hf.Qwen4ExpTextDecoderLayer(mcfg, n)])
        self.hyper_connection_mixer = hf.Qwen4ExpTextGatedResidual(config, use_combine=False)
        self.S, self.D = S, D

    def forward(self, emb: torch.Tensor, H: torch.Tensor, position_embeddings) -> torch.Tensor:  # noqa: ANN001
        """emb [B, L, D] of tokens t+1, H [B, L, S*D] the trunk's residual at t -> the head's output [B, L, D]."""
        B, L, _ = emb.shape
        e = self.fc_embedding(self.pre_fc_norm_embedding(emb))
        h = self.fc_hidden(self.pre_fc_norm_hidden(H).view(B, L, self.S, self.D))
        X = (e.unsqueeze(2) + h).flatten(-2)
        X = self.layers[0](X, position_embeddings=position_embeddings, attention_mask=causal_mask(B, L))
        return self.hyper_connection_mixer(X)


def train_trunk(a: argparse.Namespace, data: Iterator[torch.Tensor]) -> tuple[nn.Module, int]:
    """The tiny trunk, trained from scratch on the corpus -> (model in eval mode, its steps)."""
    hcfg = {k: v for k, v in to_hf_config(demo_config()).items()
            if k not in ("architectures", "model_type", "torch_dtype", "mtp_num_hidden_layers",
                         "mtp_use_dedicated_embeddings")}
    model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**hcfg))
    model.train()

    def trunk_loss() -> torch.Tensor:
        x = next(data)
        return model(x, labels=x, use_cache=False).loss

    steps = train(list(model.parameters()), trunk_loss, a.trunk_minutes, int(a.trunk_minutes * 60 / 1.3), 3e-3,
                  "trunk")
    model.eval()
    return model, steps


def mtp_head_loss(model: nn.Module, head: nn.Module, grab: dict[str, torch.Tensor], x: torch.Tensor
                  ) -> torch.Tensor:
    """The head's next-next-token loss on batch x, over the frozen trunk's residuals (grabbed by a hook)."""
    B, T = x.shape
    with torch.no_grad():
        model.model(x[:, :-1], use_cache=False)
        H = grab["H"]  # [B, T-1, S*D]: residual after token j
        pos = torch.arange(1, T - 1)[None, None].expand(3, B, -1)  # rows: token j+1 at position j+1
        pe = model.model.rotary_emb(H, pos)
    out = head(model.model.embed_tokens(x[:, 1:-1]), H[:, :-1], pe)
    logits = model.lm_head(out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))


def train_mtp_head(a: argparse.Namespace, model: nn.Module, data: Iterator[torch.Tensor]
                   ) -> tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module, int]:
    """The MTP head on the frozen trunk (H is the residual bundle the trunk's output mixer reads) -> (its loss on a
    batch, the head in eval mode, its steps)."""
    for p in model.parameters():
        p.requires_grad_(False)
    grab: dict[str, torch.Tensor] = {}
    model.model.hyper_connection_mixer.register_forward_pre_hook(lambda _m, args: grab.__setitem__("H", args[0]))
    head = MTPHead(model.config)
    head.train()
    # initialise the head's block like the trunk's last attention layer and its mixer like the output mixer
    last_attn = max(i for i, t in enumerate(model.config.layer_types) if t != "linear_attention")
    head.layers[0].load_state_dict(model.model.layers[last_attn].state_dict(), strict=False)
    head.hyper_connection_mixer.load_state_dict(model.model.hyper_connection_mixer.state_dict())
    steps = train([p for p in head.parameters() if p.requires_grad], lambda: mtp_head_loss(model, head, grab,
                  next(data)), a.mtp_minutes, int(a.mtp_minutes * 60 / 1.0), 3e-3, "mtp")
    head.eval()
    return (lambda x: mtp_head_loss(model, head, grab, x)), head, steps


def write_demo_gguf(out: Path, model: nn.Module, head: nn.Module, tok: Tokenizer, description: str) -> None:
    """The trunk and the head saved as an HF checkpoint, read back by qspec's loader and written as a Q8_0 GGUF with
    the tokenizer in its metadata."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model.save_pretrained(d, safe_serialization=True)
        conf = json.loads((d / "config.json").read_text())
        conf["mtp_num_hidden_layers"] = 1
        (d / "config.json").write_text(json.dumps(conf))
        mtp = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()}
        save_file(mtp, str(d / "mtp.safetensors"))
        weight_map: dict[str, str] = {}
        for f in sorted(d.glob("model*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                weight_map.update({k: f.name for k in h.keys()})  # noqa: SIM118
        weight_map.update({k: "mtp.safetensors" for k in mtp})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        qcfg, w = load_model_weights(d)
        meta = {"general.name": "qspec-demo", "general.description": description}
        write_gguf(out, qcfg, w, qtypes=GGMLQuantizationType.Q8_0, extra_kv={**tok.to_gguf_metadata(VOCAB), **meta})
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)


def check_demo(out: Path, model: nn.Module, tok: Tokenizer, ids: torch.Tensor) -> None:
    """qspec (from the GGUF) against transformers, and speculative == plain with the head's acceptance."""
    qcfg, w = load_model_weights(out)
    qm = Model(qcfg, w)
    with torch.no_grad():
        want = model(ids[None], use_cache=False).logits[0]
    got = Runner(qm, CacheOptions(capacity=256)).step(ids)[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"qspec (Q8_0) vs transformers (f32): max |diff| {(got - want).abs().max().item():.3e}, "
          f"argmax agree {agree:.3f}", flush=True)
    prompt = tok.encode("def fibonacci(n):\n")
    plain = Engine(qm, EngineOptions(draft=0, capacity=512)).generate(prompt, 120)
    for n in (1, 3, 5):
        g = Engine(qm, EngineOptions(draft=n, capacity=512)).generate(prompt, 120)
        print(f"MTP{n}: same tokens as plain: {g.tokens == plain.tokens}; acceptance by position "
              f"{[round(x, 2) for x in g.spec.acceptance_by_position()]}, tokens/round {g.spec.tokens_per_round:.2f}",
              flush=True)
    print(tok.decode(prompt + plain.tokens))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="qspec/assets/demo-q8_0.gguf")
    ap.add_argument("--trunk-minutes", type=float, default=25.0)
    ap.add_argument("--mtp-minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    hf.Qwen4ExpTextQSAIndexer.forward = dense_indexer

    tok = truncated_qwen_tokenizer(VOCAB)
    train_ids, held_ids, n_files = corpus(tok)
    print(f"corpus: {n_files} stdlib files, {len(train_ids)} training tokens, {len(held_ids)} held out", flush=True)
    data = batches(train_ids, a.batch, a.length, rng)
    model, steps = train_trunk(a, data)
    mtp_loss, head, mtp_steps = train_mtp_head(a, model, data)
    with torch.no_grad():
        hx = torch.stack([held_ids[i:i + a.length + 1] for i in range(0, 8 * a.length, a.length)])
        held_trunk = model(hx, labels=hx, use_cache=False).loss.item()
        held_mtp = mtp_loss(hx).item()
    print(f"held out: trunk loss {held_trunk:.3f}, mtp loss {held_mtp:.3f} (nats/token)", flush=True)
    out = Path(a.out)
    write_demo_gguf(out, model, head, tok, (
        f"qspec demo model: tiny qwen4exp + MTP head trained on the Python {sys.version_info.major}."
        f"{sys.version_info.minor} standard library ({steps} trunk steps, {mtp_steps} MTP steps of "
        f"{a.batch}x{a.length} tokens; held-out loss {held_trunk:.3f} trunk, {held_mtp:.3f} MTP)"))
    check_demo(out, model, tok, held_ids[:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())
