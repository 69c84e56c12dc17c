"""The fused (torch.compile) step path: every @fused function traces as one graph and changes no result.

On the GPU the functions run through inductor; here dynamo traces them with the "aot_eager" backend (no
code generation, in-place ops functionalised), which is what can break silently: a graph break, a Python
side effect, a guard that changes semantics."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, tiny_config

from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.model import fuse, ops

# Called only with GGUF block weights (the shared expert beside a float router): the block-model tests trace them.
BLOCK_ONLY = {"shared_expert", "add_shared_output"}
# Called only on CUDA (the shared expert merged into the routed pairs, moe.MERGE_DEVICES): the GPU tests run it.
CUDA_ONLY = {"sum_slots"}


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return build_model(tiny_config())


@pytest.fixture
def scalar_cpp():  # type: ignore[no-untyped-def]
    """Inductor's CPU code without SIMD: the lowering under test is the same, and g++ skips ATen's vector headers
    (these tests compile ~50 graphs each: about a quarter less time)."""
    from torch._inductor import config

    with config.patch({"cpp.vec_isa_ok": False}):
        yield


def test_fused_steps_equal_eager(model) -> None:  # type: ignore[no-untyped-def]
    backend = "aot_eager"  # dynamo's tracing (fullgraph: no graph break) plus functionalisation, no codegen
    prompt = list(range(3, 45))
    # between them every fused function runs (the compiled q8_0 quantizer only without the KV write kernel)
    for draft, sparse, kv_kernel in ((0, False, True), (3, True, False)):
        kw = dict(draft=draft, capacity=256, kv_type="q8_0", sparse_attention=sparse,
                  kv_write_kernel=kv_kernel, draft_vocab=range(0, 512, 3) if draft else None)
        hooks = EngineHooks(record_logits=True)
        ref = Engine(model, EngineOptions(**kw), hooks).generate(prompt, 10)
        got = Engine(model, EngineOptions(compile_backend=backend, **kw), hooks).generate(prompt, 10)
        assert got.tokens == ref.tokens
        assert len(got.logits) == len(ref.logits) > 0
        for a, b in zip(got.logits, ref.logits, strict=True):
            assert torch.equal(a, b)
        # each round's first draft step (tests/test_gpu_engine.py compares these between builds on the GPU)
        assert len(got.draft_logits) == len(ref.draft_logits) == (len(ref.logits) if draft else 0)
        for a, b in zip(got.draft_logits, ref.draft_logits, strict=True):
            assert a.shape == (1, model.cfg.vocab_size) and torch.equal(a, b)
    untraced = [f.__name__ for f in fuse.REGISTRY if not any(key[:3] == (backend, False, None) for key in f.compiled)
                and f.__name__ not in BLOCK_ONLY | CUDA_ONLY]
    assert not untraced, f"never traced: {untraced}"


@pytest.mark.parametrize("draft", [0, 2])
def test_compile_prefill_off_prefills_eagerly(model, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                              draft: int) -> None:
    """With compile_prefill off, the prompt's steps (the target's and the draft head's over the prompt) run their
    small ops eagerly and every later step is still fused; on, a short prompt's steps are fused too. The tokens and
    logits are the same either way (the compilation is stubbed out here: only where fusion is on is checked)."""
    monkeypatch.setattr(fuse, "_compile", lambda fn, backend, pdl, dynamic: fn)  # no dynamo: the same function
    seen: list[tuple[int, bool]] = []  # (rows, fusion on) of every step scope
    step_rows = fuse.step_rows
    monkeypatch.setattr(fuse, "step_rows", lambda rows: seen.append((rows, fuse.enabled())) or step_rows(rows))
    prompt = list(range(3, 40))
    out = {}
    for on in (True, False):
        for f in fuse.REGISTRY:
            f.compiled.clear()
        seen.clear()
        out[on] = Engine(model, EngineOptions(draft=draft, capacity=256, compile_backend="stub", compile_prefill=on),
                         EngineHooks(record_logits=True)).generate(prompt, 6)
        long = [f for r, f in seen if r >= len(prompt) - 1]  # the prompt's steps (target: 37 rows, head: 36)
        assert len(long) == (2 if draft else 1) and all(f == on for f in long), (on, seen)
        assert all(f for r, f in seen if r < len(prompt) - 1), seen  # decode, draft, verify and extend steps
    assert out[True].tokens == out[False].tokens
    for a, b in zip(out[True].logits, out[False].logits, strict=True):
        assert torch.equal(a, b)
    for f in fuse.REGISTRY:
        f.compiled.clear()


def test_fusion_scope(model) -> None:  # type: ignore[no-untyped-def]
    """Prefill-sized steps run eagerly; the CPU default compiles nothing (inductor is for CUDA only)."""
    with fuse.fused_mode(True, "eager"):
        assert fuse.enabled()
        with fuse.step_rows(fuse.MAX_ROWS + 1):
            assert not fuse.enabled()
        with fuse.step_rows(1):
            assert fuse.enabled()
    assert not fuse.enabled()
    Engine(model, EngineOptions(capacity=128, draft=2)).generate(list(range(3, 20)), 4)
    assert not any(key[0] == "inductor" for f in fuse.REGISTRY for key in f.compiled)


@pytest.mark.usefixtures("scalar_cpp")
def test_inductor_compiles_every_fused_function(model) -> None:  # type: ignore[no-untyped-def]
    """The same steps with inductor's code generation (for the CPU here; the GPU path generates Triton from the
    same lowering): every fused function compiles at each row count the steps use (static sizes; the context-sized
    ones symbolic), custom ops included, and the engine's tokens and logits stay those of the eager functions up
    to f32 reassociation. The closest the CPU gets to the CUDA path's torch.compile, which otherwise fails only on
    a GPU. About 90 s of compilation on a 2-core machine."""
    from torch._inductor.compile_fx import compile_fx

    prompt = list(range(3, 45))
    for draft, sparse, kv_kernel in ((0, False, True), (3, True, False)):  # as test_fused_steps_equal_eager
        kw = dict(draft=draft, capacity=256, kv_type="q8_0", sparse_attention=sparse,
                  kv_write_kernel=kv_kernel, draft_vocab=range(0, 512, 3) if draft else None)
        ref = Engine(model, EngineOptions(**kw), EngineHooks(record_logits=True)).generate(prompt, 8)
        got = Engine(model, EngineOptions(compile_backend=compile_fx, **kw), EngineHooks(record_logits=True)).generate(
            prompt, 8)
        assert got.tokens == ref.tokens and len(got.logits) == len(ref.logits) > 0
        for a, b in zip(got.logits + got.draft_logits, ref.logits + ref.draft_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    uncompiled = [f.__name__ for f in fuse.REGISTRY
                  if not any(key[:3] == (compile_fx, False, None) for key in f.compiled)
                  and f.__name__ not in BLOCK_ONLY | CUDA_ONLY]
    assert not uncompiled, f"never compiled: {uncompiled}"


def test_block_weights_trace_inside_fused_functions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With fuse_blocks on, the functions called with GGUF block weights (llama.cpp's Q4_K_M mix: single block
    weights and stacks of mixed types) trace as one graph each, their raw bytes as inputs, and change no result;
    off, they run eagerly (no compiled entry with block arguments)."""
    from qspec.loader import load_model, write_model

    path = tmp_path / "tiny-q4_k_m.gguf"
    write_model(path, tiny_config(mtp=True), quant="q4_k_m")
    model = load_model(path, dequantize_all=False)
    prompt = list(range(3, 45))
    kw = dict(draft=3, capacity=256, kv_type="q8_0", compile_prefill=True)  # the prompt's steps call moe_in
    ref = Engine(model, EngineOptions(**kw), EngineHooks(record_logits=True)).generate(prompt, 10)
    for on in (False, True):
        for f in fuse.REGISTRY:
            f.compiled.clear()
        got = Engine(model, EngineOptions(compile_backend="aot_eager", fuse_blocks=on, **kw),
                     EngineHooks(record_logits=True)).generate(prompt, 10)
        assert got.tokens == ref.tokens
        for a, b in zip(got.logits + got.draft_logits, ref.logits + ref.draft_logits, strict=True):
            assert torch.equal(a, b)
        with_blocks = {f.__name__ for f in fuse.REGISTRY for key in f.compiled if key[2] is not None}
        if on:
            assert {"gdn_in", "gdn_out", "moe_in", "add_shared_expert", "qsa_qkv", "shared_expert"} <= with_blocks, \
                with_blocks
            traced = {f.__name__ for f in fuse.REGISTRY if f.compiled}
            assert BLOCK_ONLY <= traced, traced
        else:
            assert not with_blocks


@pytest.mark.usefixtures("scalar_cpp")
def test_inductor_compiles_functions_with_block_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Inductor's lowering of the functions called with GGUF block weights (Q4_K_M mix): the block product stays one
    extern custom op among generated kernels; tokens and logits stay the eager functions' up to f32
    reassociation."""
    from torch._inductor.compile_fx import compile_fx

    from qspec.loader import load_model, write_model

    write_model(tmp_path / "m.gguf", tiny_config(mtp=True), quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    prompt = list(range(3, 30))
    kw = dict(draft=2, capacity=256, kv_type="q8_0", compile_prefill=True)  # the prompt's steps call moe_in
    ref = Engine(model, EngineOptions(**kw), EngineHooks(record_logits=True)).generate(prompt, 6)
    got = Engine(model, EngineOptions(compile_backend=compile_fx, fuse_blocks=True, **kw),
                 EngineHooks(record_logits=True)).generate(prompt, 6)
    assert got.tokens == ref.tokens and len(got.logits) == len(ref.logits) > 0
    for a, b in zip(got.logits + got.draft_logits, ref.logits + ref.draft_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    compiled = {f.__name__ for f in fuse.REGISTRY for key in f.compiled if key[0] is compile_fx and key[2] is not None}
    assert {"gdn_out", "moe_in", "add_shared_expert", "qsa_qkv", "shared_expert"} <= compiled, compiled


def test_block_wrappers_have_code_objects_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's recompile limit counts per code object: the block-weight wrappers of different functions and layouts
    must not share one (with a limit of 1, three layouts of one function compile side by side)."""
    import torch._dynamo
    from gguf import GGMLQuantizationType as Q

    from qspec.weights.quantize import quantize
    from qspec.weights.qweight import QuantWeight

    monkeypatch.setattr(fuse, "_configure", lambda: None)

    @fuse.fused
    def scaled(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        return torch.sigmoid(ops.linear(x, w)) * 2

    x = torch.randn(2, 256)
    with torch._dynamo.config.patch(recompile_limit=1), fuse.fused_mode(True, "aot_eager"), fuse.blocks_mode(True):
        for qt, n in ((Q.Q8_0, 16), (Q.Q4_0, 16), (Q.Q8_0, 32)):
            w = QuantWeight.from_blocks(quantize(torch.randn(n, 256), qt), qt, (n, 256))
            assert torch.equal(scaled(x, w), scaled.eager(x, w))
    assert len(scaled.compiled) == 3
    fuse.REGISTRY.remove(scaled)


def test_step_functions_compile_static_sizes_once_per_row_count(model) -> None:  # type: ignore[no-untyped-def]
    """Step functions compile with static sizes (one graph per row count and weight layout), the context-sized ones
    with symbolic sizes: decoding past a KV bucket recompiles no step function, and a second request at the same
    row counts compiles no graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def graphs() -> dict[str, int]:
        return {f.__name__: len(_debug_get_cache_entry_list(f.eager.__code__)) for f in fuse.REGISTRY}

    for f in fuse.REGISTRY:
        f.compiled.clear()
    torch._dynamo.reset()
    kw = dict(draft=2, capacity=1024, kv_type="q8_0", compile_backend="aot_eager")
    Engine(model, EngineOptions(**kw)).generate(list(range(3, 70)), 120)  # every step's row count, one KV bucket
    first = graphs()
    Engine(model, EngineOptions(**kw)).generate(list(range(5, 80)), 480)  # past runner.KV_BUCKET
    second = graphs()
    modes = {(f.__name__, key[3]) for f in fuse.REGISTRY for key in f.compiled}
    context = {name for name, dynamic in modes if dynamic}
    assert "attend" in context and ("hc_combine_mix", False) in modes, modes
    assert context <= {"attend", "causal_mask", "block_mask", "select_blocks"}, context
    assert {n: c for n, c in second.items() if n not in context} == {n: c for n, c in first.items() if n not in context}
    Engine(model, EngineOptions(**kw)).generate(list(range(7, 90)), 480)
    assert graphs() == second
    for f in fuse.REGISTRY:
        f.compiled.clear()


def test_static_rows_sends_larger_steps_to_symbolic_sizes() -> None:
    """EngineOptions.static_rows, applied by the engine's switches: steps of up to that many rows compile a fused
    function with static sizes, larger ones with symbolic sizes (one graph for every row count), same result."""
    from qspec.model.moe import add_shared_output
    from qspec.runner import KernelSwitches

    switches = KernelSwitches.resolve(EngineOptions(static_rows=1, compile_backend="aot_eager"), torch.device("cpu"))
    add_shared_output.compiled.clear()
    g = torch.Generator().manual_seed(0)
    with switches.apply():
        assert fuse.STATIC_MAX_ROWS == 1 and fuse.enabled()
        for rows in (1, 3, 5):
            args = [torch.randn(rows, n, generator=g) for n in (8, 8, 1)]
            with fuse.step_rows(rows):
                assert torch.equal(add_shared_output(*args), add_shared_output.eager(*args))
    assert fuse.STATIC_MAX_ROWS == 16  # restored after the block
    assert sorted(key[3] for key in add_shared_output.compiled) == [False, True]  # rows 3 and 5: one symbolic key
    add_shared_output.compiled.clear()


def test_compile_workers_start_with_an_engine_that_will_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_compile_workers starts inductor's pool (once asked, and not with WARM_WORKERS off); an engine calls it only
    where its steps will compile with inductor on CUDA, so a CPU engine starts none."""
    import torch._inductor.async_compile as async_compile

    calls: list[int] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    fuse.start_compile_workers()
    assert calls == [1]
    monkeypatch.setattr(fuse, "WARM_WORKERS", False)
    fuse.start_compile_workers()
    assert calls == [1]
    monkeypatch.setattr(fuse, "WARM_WORKERS", True)
    Engine(build_model(tiny_config()), EngineOptions(draft=0, capacity=64))
    assert calls == [1]
