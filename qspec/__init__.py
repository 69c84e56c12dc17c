"""qspec: MTP speculative decoding for Qwen3.8-Flash-Next (llama.cpp `qwen4exp`) in PyTorch and Triton.

    import qspec
    model = qspec.load_model("model.gguf")                      # or an HF checkpoint dir, or "demo"
    tok = qspec.load_tokenizer("model.gguf")
    engine = qspec.Engine(model, qspec.EngineOptions(draft=3))
    out = engine.generate(tok.encode("fn main() {"), max_tokens=64, stop_ids=set(tok.stop_ids))
    print(tok.decode(out.tokens), out.decode_tps, out.spec.as_dict())

    batch = qspec.Batcher(engine, slots=4)                       # several requests decoded together (plainly)
    outs = batch.generate_all([tok.encode(p) for p in prompts], max_tokens=64)
"""

from qspec.batch import Batcher
from qspec.config import ModelConfig, preset
from qspec.engine import Engine, EngineOptions, Generation
from qspec.loader import default_model_path, load_model, load_tokenizer
from qspec.spec.accept import Sampler
from qspec.spec.grammar import GrammarCompiler, GrammarSpec, thinking_budget, with_thinking
from qspec.spec.logprobs import Logprobs, TokenLogprob

__version__ = "0.1.0"
__all__ = ["Batcher", "Engine", "EngineOptions", "Generation", "GrammarCompiler", "GrammarSpec", "Logprobs",
           "ModelConfig", "Sampler", "TokenLogprob", "default_model_path", "load_model", "load_tokenizer", "preset",
           "thinking_budget", "with_thinking"]
