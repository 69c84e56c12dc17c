"""qspec/precompile.py: which products a first request compiles ahead, and compile_only's routing of Triton launches."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from qspec import precompile
from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.kernels.triton_common import HAS_TRITON
from qspec.loader import load_model, write_model
from qspec.model.ops import StackedWeight
from qspec.weights.qweight import QuantWeight

ROOT = Path(__file__).resolve().parents[1]


def test_step_products_are_every_block_matrix_and_expert_set(tmp_path: Path) -> None:
    """The walk finds the head, each layer's block matrices and each MoE's experts (the MTP block's too), never the
    token table; each call runs (here on the CPU's reference paths) at every row count asked for."""
    write_model(tmp_path / "m.gguf", tiny_config(mtp=True), quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    found = list(precompile._weights(model, {id(model.embed), id(model.ple)}))
    linear = [w for kind, w, _ in found if kind == "linear"]
    experts = [owner for kind, owner, _ in found if kind == "experts"]
    assert any(w is model.lm_head for w in linear) and not any(w is model.embed for w in linear)
    assert all(isinstance(w, (QuantWeight, StackedWeight)) for w in linear)
    assert {id(m) for m in experts} == {id(m) for m in [*model.moe, model.mtp.moe]}
    for layer in model.layers:  # every layer contributes its mixer's block products
        assert any(w is v for w in linear for v in vars(layer).values())
    distinct = precompile._distinct(found)  # one weight per layout: the layers' repeats compile nothing new
    layouts = {(kind, precompile._layout(w) if e is None else tuple(map(precompile._layout, e)))
               for kind, w, e in found}
    assert len(distinct) == len(layouts) < len(found)
    assert {id(w) for _, w, _ in distinct} <= {id(w) for _, w, _ in found}
    n = {k: sum(kind == k for kind, _, _ in distinct) for k in ("linear", "experts", "mixer")}
    # the mixers' blocks (w_in; up is F16 at this rank) make them entries of their own, two layouts for the layers'
    # (down and inject; the FFN mixers' down Q6_K in the "more bits" layers, as FFN downs) and one for the output
    # mixer's and the MTP head's (down only)
    mixers = [owner for kind, owner, _ in found if kind == "mixer"]
    assert {id(m) for m in mixers} >= {id(m) for m in [*model.mix_attn, *model.mix_ffn, model.mixer]}
    assert n["mixer"] == 3 and sum(n.values()) == len(distinct)
    calls = precompile.step_products(model, [40, 1, 4])  # experts and mixers at the few-row counts only
    assert len(calls) == 3 * n["linear"] + 2 * n["experts"] + 2 * 2 * n["mixer"]
    with torch.inference_mode():
        for call in calls:
            call()


def test_step_products_route_a_merged_shared_expert_as_its_steps_do(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MoE runs the shared expert as one more routed pair, the precompiled expert step does too: the merged
    tensors, and the routing with the shared slot (its own Triton variant)."""
    from qspec.model import moe

    monkeypatch.setattr(moe, "MERGE_DEVICES", ("cpu",))  # merged on CUDA only in use
    write_model(tmp_path / "m.gguf", tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256),
                quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    found = precompile._block_weights(model)
    owners = [(owner, e) for kind, owner, e in found if kind == "experts"]
    assert owners and all(m.shared_pair() for m, _ in owners)
    for m, e in owners:
        assert precompile._step_experts(m, e) == (*m.merged, True)
        with moe.shared_pair_mode(False):
            assert precompile._step_experts(m, e) == (m.gate, m.up, m.down, False)
    shared = []
    route = precompile.route_top_k_quantized
    monkeypatch.setattr(precompile, "route_top_k_quantized", lambda *a: shared.append(a[3]) or route(*a))
    with torch.inference_mode():
        for call in precompile.step_products(model, [1], found):
            call()
    assert shared and all(shared)


_ROUTING = """
import threading
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from qspec import precompile

seen = []
def record(self, *args, **kwargs):
    seen.append((kwargs["warmup"], threading.current_thread().name))
JITFunction.run = record  # stands for Triton's launch (no GPU here)

@triton.jit
def k(x_ptr, N: tl.constexpr):
    pass

from triton import knobs
asked = []
knobs.runtime.jit_cache_hook = lambda **kw: asked.append(kw["key"]) or "theirs"  # another tool's hook

k[(1,)](None, N=4)
with precompile.compile_only() as queued:
    assert k[(1,)](None, N=8) is None
assert [f.result() for f in queued] == [None] and len(queued) == 1
k[(1,)](None, N=4)
assert seen[0] == (False, "MainThread") and seen[2] == (False, "MainThread"), seen
assert seen[1][0] is True and seen[1][1].startswith("qspec-compile"), seen
# the skipping hook went in front of the one that was there: outside a pool thread it answers as that one did
assert knobs.runtime.jit_cache_hook(key="v", fn=None, compile={}) == "theirs" and asked == ["v"]
print("routing ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_compile_only_queues_a_compilation_instead_of_the_launch(tmp_path: Path) -> None:
    """Inside compile_only a launch becomes the same call with warmup=True on the pool's thread; outside it, and
    before and after, launches are untouched (a fresh process: the routing is installed once per process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    script = tmp_path / "routing.py"  # Triton reads a kernel's source from its file
    script.write_text(_ROUTING)
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "routing ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_engine_precompiles_only_block_models_on_cuda(tmp_path: Path) -> None:
    """On the CPU nothing is queued for the first request."""
    write_model(tmp_path / "m.gguf", tiny_config(mtp=True), quant="q8_0")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    assert model.has_blocks
    eng = Engine(model, EngineOptions(draft=0, capacity=64))
    eng._precompile(8)
    assert eng._ahead is None and not eng._precompiled
    assert eng.compile_ahead([1, 2, 4]) is None  # a server's batch sizes, likewise


@pytest.mark.cuda
def test_cuda_precompiled_first_request_same_tokens(tmp_path: Path) -> None:
    """On the GPU the first request of a block model compiles its steps' products ahead, without a warning, and
    decodes exactly what an engine without it decodes."""
    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    prompt = list(range(3, 40))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {on: Engine(model, EngineOptions(draft=3, capacity=128, precompile=on),
                           EngineHooks(record_logits=True)).generate(prompt, 16) for on in (True, False)}
    assert not [w for w in caught if "compiling a step's products ahead" in str(w.message)]
    assert runs[True].tokens == runs[False].tokens


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_marker_in_tritons_cache_skips_the_thread_once_compiled(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the thread has compiled a model's products, a marker in Triton's cache directory records it and a later
    start queues nothing; another row set or another block layout has a marker of its own."""
    monkeypatch.setattr(precompile, "_triton_cache_dir", lambda: tmp_path / "triton")
    models = {}
    for q in ("q4_k_m", "q8_0"):
        write_model(tmp_path / f"{q}.gguf", tiny_config(mtp=True), quant=q)
        models[q] = load_model(tmp_path / f"{q}.gguf", dequantize_all=False)
    m = models["q4_k_m"]
    def marker_of(model: object, rows: list[int]) -> Path | None:
        return precompile._marker(model, rows, precompile._block_weights(model))

    marker = marker_of(m, [8, 1])
    assert marker is not None and not marker.exists()
    assert len({marker, marker_of(m, [8, 1, 4]), marker_of(models["q8_0"], [8, 1])}) == 3
    precompile.start(m, [8, 1]).result(timeout=300)
    assert marker.exists()

    def refuse(*_: object) -> None:
        raise AssertionError("queued although the marker exists")

    monkeypatch.setattr(precompile, "step_products", refuse)
    assert precompile.start(m, [8, 1]).result(timeout=5) is None


class _Kernel:  # what Triton's jit_cache_hook gets as `fn` (JitFunctionInfo): a module and a name
    module, name = "m", "k"


def _hook_args(key: str, device: int = 0) -> dict:
    return {"key": key, "fn": _Kernel(), "compile": {"key": key, "device": device}, "is_manual_warmup": True}


def test_pool_threads_compile_each_variant_once() -> None:
    """The jit_cache_hook skips a pool thread's compilation of a variant (kernel, device, key) that a pool thread took
    already, answers as the hook before it otherwise (not called for a skip), and never skips another thread's: a
    step's launch needs its kernel."""
    asked: list[str] = []
    hook = precompile._hook_skipping_taken(lambda **kw: asked.append(kw["key"]) or None)
    precompile._taken.clear()
    assert hook(**_hook_args("a")) is None and hook(**_hook_args("a")) is None  # this thread is no pool thread
    precompile._local.pooled = True
    try:
        assert hook(**_hook_args("a")) is None  # a pool thread's first: compiled
        assert hook(**_hook_args("a")) is True  # and again: skipped
        assert hook(**_hook_args("b")) is None and hook(**_hook_args("a", device=1)) is None
    finally:
        precompile._local.pooled = False
        precompile._taken.clear()
    assert asked == ["a", "a", "a", "b", "a"]  # the skip alone did not reach the other hook
    assert precompile._hook_skipping_taken(None)(**_hook_args("c")) is None


def test_a_queued_launch_runs_marked_as_a_pool_threads() -> None:
    """_compile_queued marks its thread while the launch runs (what _skip_taken reads), and unmarks it after, also
    when the launch raised."""
    def launch(jit: object, *args: object, **kwargs: object) -> tuple:
        return jit, args, kwargs, precompile._local.pooled

    assert precompile._compile_queued(launch, "k", (1, 2), {"warmup": True}) == ("k", (1, 2), {"warmup": True}, True)
    assert not precompile._local.pooled

    def failing(jit: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("compilation failed")

    with pytest.raises(RuntimeError, match="compilation failed"):
        precompile._compile_queued(failing, "k", (), {})
    assert not precompile._local.pooled
