"""Compiling a first request's block products in threads while its prompt prefills.

A fresh process compiles each Triton kernel variant at its first launch, one after another, and the step that
launches it waits: a block-weight model's first decode step waits for its int8 products' variants (about a second
each, one per block type, row count and kernel; BENCHMARKS.md §5c) after the prefill has waited for its own. The
variants are known once the model is loaded and the prompt's length is: the products of its block matrices at the
prompt's first step's rows, at one row and at the verify's rows when drafting, and its routed experts at the
few-token counts among those; one matrix per block layout stands for the layers that share it (a variant depends on
the layout, not on the layer: 48 layers' thousand products are a few dozen variants; queuing them all cost a
launch's Python work each, beside the prefill, and let pool threads compile one variant at once, since Triton's
launch takes no lock; BENCHMARKS.md §5c). So on a model's first request
a thread calls those products on zeros under
`compile_only`, where each Triton launch becomes a compilation of the same variant (the same arguments, so the same
specialisation) submitted to a pool of threads, and nothing runs. Triton's compiler spends most of its time outside
the interpreter lock, so the variants compile side by side, and beside the prefill (which compiles a variant itself
when it gets there first). The engine waits for them before its first decode step; a product the guess missed
compiles at its launch, as before.

`compile_only` is per thread: kernels other threads launch meanwhile (the prefill's) are not affected. Queued
launches that select one variant compile it once: Triton's jit_cache_hook skips a pool thread's compilation of a
variant that another pool thread took already (`_skip_taken`).

Once every variant has compiled, a marker file in Triton's cache directory records it (`_marker`: its name hashes the
products' layout, the rows, the device, Triton's version and the kernels' sources). A later process finds its kernels
there and skips the thread, whose calls would only load them, holding the interpreter lock while the first decode
step is traced (BENCHMARKS.md §5c). Clearing Triton's cache clears the marker with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from qspec.compile_clock import triton_runtime_knobs
from qspec.kernels import hc_mix
from qspec.kernels.qmatmul import int8_experts, qmoe_few
from qspec.kernels.route import route_top_k_quantized
from qspec.model.hyper import HyperMixer
from qspec.model.moe import FEW_TOKENS, MoE
from qspec.model.ops import StackedWeight, linear
from qspec.weights.qweight import QuantWeight

_local = threading.local()  # .queued: this thread's queued compilations while compile_only is active; .pooled: a
# pool thread compiling one of them
_lock = threading.Lock()
_state: dict[str, Any] = {"pool": None, "patched": False}
_taken: set[tuple[str, str, str, str]] = set()  # (module, kernel, device, variant key) a pool thread compiles or did


def _pool() -> ThreadPoolExecutor:
    with _lock:
        if _state["pool"] is None:
            _state["pool"] = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                thread_name_prefix="qspec-compile")
        return _state["pool"]


def _compile_queued(launch: Callable[..., Any], jit: Any, args: tuple, kwargs: dict) -> Any:
    """A queued launch (warmup=True: it compiles, launches nothing) on a pool thread, marked as one for
    `_skip_taken`."""
    _local.pooled = True
    try:
        return launch(jit, *args, **kwargs)
    finally:
        _local.pooled = False


def _skip_taken(kw: dict[str, Any]) -> bool:
    """Whether Triton's jit_cache_hook, called with `kw` before a compilation, should skip it: a pool thread's
    compilation of a variant another pool thread took already. Several queued launches often select one variant (row
    counts that Triton specialises alike, layouts that share a kernel): 26 of a first request's 81 compilations
    repeated a variant, side by side, before (benchmarks/results/h100-compile-cache-0381f6b.md). Never for other
    threads: a step's launch needs its kernel."""
    if not getattr(_local, "pooled", False):
        return False
    fn, compile_kw = kw.get("fn"), kw.get("compile") or {}
    variant = (str(getattr(fn, "module", "")), str(getattr(fn, "name", "")), str(compile_kw.get("device")),
               str(kw.get("key")))
    with _lock:
        if variant in _taken:
            return True
        _taken.add(variant)
    return False


def _hook_skipping_taken(other: Callable[..., bool | None] | None) -> Callable[..., bool | None]:
    """A jit_cache_hook that skips `_skip_taken`'s compilations and otherwise answers as `other` (the hook that was
    installed before it, if any: CompileClock's, another tool's)."""
    def hook(**kw: Any) -> bool | None:
        try:
            if _skip_taken(kw):
                return True
        except Exception:  # noqa: BLE001 (an optimisation: a hook that raised would fail the compilation)
            pass
        return other(**kw) if other is not None else None
    return hook


def _route_launches() -> bool:
    """JITFunction.run through a wrapper that queues instead of launching inside compile_only, and an autotuned
    kernel skipped there (its tuning would time launches that do not run); once per process. False where Triton is
    missing."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    with _lock:
        if not _state["patched"]:
            launch, tune = JITFunction.run, Autotuner.run

            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                queued: list[Future] | None = getattr(_local, "queued", None)
                if queued is None or kwargs.get("warmup"):
                    return launch(self, *args, **kwargs)
                kwargs["warmup"] = True  # compile the variant these arguments select; launch nothing
                queued.append(_pool().submit(_compile_queued, launch, self, args, kwargs))
                return None

            def run_tuned(self: Any, *args: Any, **kwargs: Any) -> Any:
                return None if getattr(_local, "queued", None) is not None else tune(self, *args, **kwargs)

            JITFunction.run, Autotuner.run = run, run_tuned
            runtime = triton_runtime_knobs()
            if runtime is not None:  # Triton 3.4 and later
                runtime.jit_cache_hook = _hook_skipping_taken(runtime.jit_cache_hook)
            _state["patched"] = True
    return True


@contextlib.contextmanager
def compile_only() -> Iterator[list[Future]]:
    """Inside the block this thread's Triton launches compile their variants on the pool instead of running (their
    outputs stay unwritten); yields the list of the queued compilations. Without Triton: nothing is queued."""
    if not _route_launches() or getattr(_local, "queued", None) is not None:
        yield []
        return
    _local.queued = queued = []
    try:
        yield queued
    finally:
        _local.queued = None


def _weights(obj: object, seen: set[int]) -> Iterator[tuple[str, object, object]]:
    """(kind, weight, owner) for every block matrix ("linear"), routed-expert module ("experts") and mixer with
    block matrices ("mixer": its step kernels read them) reachable from obj through attributes, lists, tuples and
    dicts."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, HyperMixer) and not all(isinstance(w, torch.Tensor) for w in (obj.w_in, obj.up)):
        yield "mixer", obj, (obj.w_in, obj.up)
    if isinstance(obj, QuantWeight):
        if len(obj.shape) == 2:
            yield "linear", obj, None
        return
    if isinstance(obj, StackedWeight):
        if any(isinstance(p, QuantWeight) for p in obj.parts):
            yield "linear", obj, None
        return
    experts = [getattr(obj, n, None) for n in ("gate", "up", "down")]
    if all(isinstance(e, QuantWeight) and len(e.shape) == 3 for e in experts):
        yield "experts", obj, experts
    items: Iterable[object]
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, torch.nn.Module) or hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for v in items:
        yield from _weights(v, seen)


def _block_weights(model: Any) -> list[tuple[str, object, object]]:
    """_weights of the model, the token and n-gram tables (read by rows, not multiplied) left out."""
    return list(_weights(model, {id(model.embed), id(getattr(model, "ple", None))}))


def _layout(w: object) -> object:
    """What a Triton variant of a product with `w` depends on: each block part's kernel type and shape, and whether
    its bytes start 16-byte aligned (Triton specialises a pointer on that); a 16-bit part's dtype and shape."""
    if isinstance(w, StackedWeight):
        return tuple(_layout(p) for p in w.parts)
    if isinstance(w, QuantWeight):
        return w.code, tuple(w.shape), w.raw.data_ptr() % 16 == 0
    return str(w.dtype), tuple(w.shape)  # type: ignore[attr-defined]


def _entry_layout(w: object, experts: object) -> object:
    """The layout of one `_weights` entry: its matrix's, or its experts' gate, up and down's, or its mixer's w_in
    and up."""
    return _layout(w) if experts is None else tuple(_layout(x) for x in experts)  # type: ignore[attr-defined]


def _distinct(found: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
    """One entry of `found` per kind and layout: the layers' matrices of one layout compile the same variants."""
    first: dict[tuple[str, object], tuple[str, object, object]] = {}
    for kind, w, e in found:
        first.setdefault((kind, _entry_layout(w, e)), (kind, w, e))
    return list(first.values())


def step_products(model: Any, rows: Sequence[int], found: list[tuple[str, object, object]] | None = None
                  ) -> list[Callable[[], object]]:
    """Calls of the products steps of these row counts run on the model's block weights, on zeros, one weight per
    layout (`_distinct`: a 48-layer model's thousand products are a few dozen variants): every block matrix layout
    at each of `rows` (the token and n-gram tables, read by rows, are left out) and every routed-expert layout at
    those of `rows` its few-token kernels take (moe.FEW_TOKENS), with their routing (on zero logits: experts
    0 .. k-1; its launch quantizes the rows for the experts' int8 kernels), and every mixer layout with block
    matrices at those of `rows` its step kernels take, with and without a pending block output. found: the model's
    `_block_weights`, when the caller has them."""
    found = _distinct(_block_weights(model) if found is None else found)
    dev, dt, k = model.device, model.dtype, model.cfg.n_experts_used
    mats = [w for kind, w, _ in found if kind == "linear"]
    experts = [_step_experts(owner, e) for kind, owner, e in found if kind == "experts"]
    mixers = [owner for kind, owner, _ in found if kind == "mixer"]
    calls: list[Callable[[], object]] = []
    for m in dict.fromkeys(rows):  # in the order given (the prompt's rows first: the prefill needs them first)
        calls += [lambda m=m, w=w: linear(torch.zeros(m, w.shape[-1], dtype=dt, device=dev), w) for w in mats]
        # the mixers' step kernels (hc_mix.step_eligible: a block up at one row), with and without the combine
        calls += [lambda m=m, x=x, p=p: _mixer_step(m, x, p, dt) for x in mixers for p in (False, True)
                  if m == 1 or (m <= hc_mix.MAX_ROWS and isinstance(x.up, torch.Tensor))]
        if m > FEW_TOKENS:  # a longer step groups its tokens by expert instead (MoE._routed)
            continue
        calls += [lambda m=m, g=g, u=u, d=d, s=s: _experts_step(m, g, u, d, k, dt, dev, s) for g, u, d, s in experts]
    return calls


def _mixer_step(m: int, mixer: HyperMixer, pending: bool, dt: torch.dtype) -> object:
    """A step's mixer on zeros, as HyperMixer.combine_mix runs it (its step kernels where they take it)."""
    dev, S, D = mixer.norm.device, mixer.count, mixer.hidden
    X = torch.zeros(m, S * D, dtype=dt, device=dev)
    block = (torch.zeros(m, D, dtype=dt, device=dev), torch.zeros(m, S, dtype=dt, device=dev)) if pending else None
    return hc_mix.mix_step(X, block, mixer.norm, mixer.w_in, mixer.up, mixer.rank, D, S, mixer.eps)


def _step_experts(owner: object, experts: Sequence[QuantWeight]) -> tuple[QuantWeight, QuantWeight, QuantWeight, bool]:
    """(gate, up, down, shared) as an MoE's few-token steps run them: with the shared expert as one more routed pair
    (moe.MoE.shared_pair) its merged tensors and routing with the shared slot, else the routed experts'."""
    if isinstance(owner, MoE) and owner.shared_pair():
        gate, up, down = owner.merged  # type: ignore[misc]
        return gate, up, down, True
    gate, up, down = experts
    return gate, up, down, False


def _experts_step(m: int, gate: QuantWeight, up: QuantWeight, down: QuantWeight, k: int, dt: torch.dtype,
                  dev: torch.device, shared: bool = False) -> torch.Tensor:
    """A few-token step's routing and routed experts on zeros on `dev` (the model's device: experts kept in host
    memory are read from there), as MoE runs them: the routing launch quantizes the rows too where the experts' int8
    kernels read them; shared: gate/up/down hold the shared expert as their last expert, and the routing adds its
    slot (route.route_top_k_shared_torch)."""
    h = torch.zeros(m, gate.shape[-1], dtype=dt, device=dev)
    logits = torch.zeros(m, gate.shape[0], dtype=dt, device=dev)  # shared: E routed logits and the gate logit
    top_w, top_i, hquant = route_top_k_quantized(logits, k, h if int8_experts(h, gate, up, down) else None, shared)
    return qmoe_few(h, top_i, top_w, gate, up, down, hquant)


def _triton_cache_dir() -> Path | None:
    try:
        from triton import knobs
    except ImportError:
        return None
    return Path(knobs.cache.dir)


def _marker(model: Any, rows: Sequence[int], found: list[tuple[str, object, object]]) -> Path | None:
    """The file in Triton's cache directory that says `step_products(model, rows)`'s variants compiled into it
    (found: the model's `_block_weights`)."""
    cache = _triton_cache_dir()
    if cache is None:
        return None
    import triton

    layouts = sorted({repr(_entry_layout(w, e)) for _, w, e in found})
    key = hashlib.sha256(repr((layouts,
                               list(rows), str(model.dtype), torch.cuda.get_device_capability(model.device)
                               if model.device.type == "cuda" else None, triton.__version__)).encode())
    for src in sorted((Path(__file__).parent / "kernels").glob("triton_*.py")):
        key.update(src.read_bytes())
    return cache / f"qspec-precompiled-{key.hexdigest()[:32]}"


def start(model: Any, rows: Sequence[int]) -> Future:
    """Queue the compilation of `step_products(model, rows)`'s kernels, from a thread of its own; the returned
    future ends when every one has compiled. A product or compilation that fails here is left to the step,
    which compiles it at its launch (one warning names it). Where the marker says an earlier process compiled them
    into Triton's cache, nothing is queued."""
    done: Future = Future()
    found = _block_weights(model)
    marker = _marker(model, rows, found)
    if marker is not None and marker.exists():
        done.set_result(None)
        return done
    calls = step_products(model, rows, found)
    dev = model.device

    def queue_all() -> None:
        try:
            # a stream of its own: the zeros and whatever runs on them stay off the stream a graph capture of the
            # main thread watches
            stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
            with torch.inference_mode(), torch.cuda.stream(stream), compile_only() as queued:
                for call in calls:
                    call()
            for f in queued:
                f.result()
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        except Exception as e:  # noqa: BLE001 (an optimisation: the step compiles what is left at its launch)
            warnings.warn(f"compiling a step's products ahead: {type(e).__name__}: {e}", stacklevel=1)
        done.set_result(None)

    threading.Thread(target=queue_all, name="qspec-precompile", daemon=True).start()
    return done
