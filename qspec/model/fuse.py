"""Fusing the small per-layer math of decode, verify and draft steps with torch.compile.

A decode step of the real geometry is over a thousand kernels, most of them tiny elementwise ops (norms,
hyper-connection mixers, routing, RoPE, masks, q8_0 casts); inside a CUDA graph each still costs its
execution plus a node's latency, which is most of the step (BENCHMARKS.md §3, §4). `@fused` marks a pure tensor function
(the torch reference itself) whose body inductor turns into a few generated kernels, on CUDA, for
step-sized inputs, when fusion is on. Everything else (prefill, the CPU, row-exact mode) runs the same
function eagerly (`step_rows`), so the CPU tests check the very code that gets compiled; `tests/test_gpu_engine.py`
compares the two on the GPU.

GGUF block weights (QuantWeight, StackedWeight) are no tensors dynamo can take as inputs. With `blocks_mode` on, a
function called with them compiles once per layout of its block arguments (type and shape, `_block_spec`): their
raw byte tensors are the compiled graph's inputs, rebuilt into weights inside, and each block product stays one
opaque custom op (qspec::qmatmul) between the generated kernels (the default: what it buys is in BENCHMARKS.md
§5c). Off, such a call runs eagerly, small ops and all.

Sizes. A function whose inputs grow with the context (the KV cells, the pooled blocks: `fused(context_sized=True)`)
compiles with symbolic sizes (`dynamic=True`): one graph serves every KV bucket, so a request that crosses into a
new bucket does not stop to compile (with static sizes it did: ~13 s in the middle of a benchmark run). Every other
function compiles with static sizes for steps of up to STATIC_MAX_ROWS rows: one graph per row count, and a step
has few (decode and draft steps 1, verify and extend N + 1 and N), while dynamo traces a static graph several times
faster than a symbolic one, whose every size is reasoned about with sympy (a warm process re-traces every graph;
BENCHMARKS.md §5c). Larger steps (a prompt's, under compile_prefill) compile symbolic sizes, one graph for any
prompt. Compilation happens on the first eager use; the runner captures a CUDA graph only on a shape's second use,
so capture replays already-compiled code.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from qspec.kernels import triton_common
from qspec.model import ops
from qspec.weights.qweight import QuantWeight

F = TypeVar("F", bound=Callable[..., Any])

# Steps with more rows than this (prefill chunks) run eagerly: their ops are few and large.
MAX_ROWS = 64
# Steps of up to this many rows compile functions with static sizes (the module docstring; KernelSwitches.static_rows).
STATIC_MAX_ROWS = 16

_ON = False
_ROWS = 0  # rows of the current step (step_rows)
_BLOCKS = True  # compile functions called with GGUF block weights too (KernelSwitches.fuse_blocks)
REGISTRY: list[Callable[..., Any]] = []  # every @fused function (tests check each one is traced)
# Tests trace the functions on the CPU with dynamo's "aot_eager" backend (no code generation), which
# checks that each one is a single graph and that tracing changes no result.
_BACKEND = "inductor"
# Engines that will compile start inductor's worker processes when they are made (start_compile_workers); False:
# at the first compilation, as torch does (A/B runs).
WARM_WORKERS = True


def enabled() -> bool:
    return _ON


@contextlib.contextmanager
def step_rows(rows: int) -> Iterator[None]:
    """Scope of one forward step of `rows` rows: fusion stays on only for step-sized ones."""
    global _ROWS
    old, _ROWS = _ROWS, rows
    try:
        with fused_mode(_ON and rows <= MAX_ROWS, _BACKEND):
            yield
    finally:
        _ROWS = old


@contextlib.contextmanager
def fused_mode(on: bool = True, backend: str = "inductor") -> Iterator[None]:
    """Fusion on or off; a backend other than inductor also applies to CPU tensors (tests)."""
    global _ON, _BACKEND
    old = _ON, _BACKEND
    _ON, _BACKEND = on, backend
    try:
        yield
    finally:
        _ON, _BACKEND = old


def static_rows_mode(rows: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, steps of up to `rows` rows compile with static sizes and larger ones with symbolic sizes."""
    return triton_common.module_flag(__name__, "STATIC_MAX_ROWS", rows)


def blocks_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, functions called with GGUF block weights compile too (`on`) or run eagerly."""
    return triton_common.module_flag(__name__, "_BLOCKS", on)


# Per argument: None (passed as it is), ("q", qtype, shape, planes) for a QuantWeight (its raw bytes are one input), or
# ("s", parts) for a StackedWeight, each part None (a 16-bit tensor) or ("q", ...).
BlockSpec = tuple[Any, ...] | None


def _block_spec(a: object) -> BlockSpec:
    if isinstance(a, QuantWeight):
        return ("q", a.qtype, a.shape, a.planes)
    if isinstance(a, ops.StackedWeight):
        return ("s", tuple(_block_spec(p) for p in a.parts))
    return None


def _flatten(a: Any, spec: BlockSpec) -> list[Any]:
    """The inputs that stand for argument `a` in the compiled graph."""
    if spec is None:
        return [a]
    if spec[0] == "q":
        return [a.raw]
    return [x for p, ps in zip(a.parts, spec[1], strict=True) for x in _flatten(p, ps)]


def _rebuild(flat: Iterator[Any], spec: BlockSpec) -> Any:
    if spec is None:
        return next(flat)
    if spec[0] == "q":
        return QuantWeight(next(flat), spec[1], spec[2], spec[3])
    return ops.StackedWeight(tuple(_rebuild(flat, ps) for ps in spec[1]))


def _with_blocks(fn: Callable[..., Any], specs: tuple[BlockSpec, ...]) -> Callable[..., Any]:
    """fn over the flattened inputs of arguments laid out as `specs` (traced: the weights are rebuilt in the graph).
    Each wrapper gets a code object of its own: dynamo keeps compiled graphs, and counts them against its recompile
    limit, per code object, so wrappers sharing one would pile every function's layouts onto one limit (past it,
    fullgraph compilation fails)."""
    def over_raw(*flat: Any, **kw: Any) -> Any:
        it = iter(flat)
        return fn(*(_rebuild(it, sp) for sp in specs), **kw)

    code = over_raw.__code__.replace(co_name=f"{fn.__name__}_blocks")
    return types.FunctionType(code, over_raw.__globals__, code.co_name, over_raw.__defaults__, over_raw.__closure__)


def _configure() -> None:
    # A static-size function compiles a graph per row count and weight layout (a mixer's `w_in` differs between its
    # kinds, the MTP layer's projections from the trunk's), and a guard can fail on a new stride or dtype; past the
    # default limit of 8 graphs dynamo would silently run a function eagerly.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 256)


def inductor_has_pdl() -> bool:
    """Whether this torch's inductor can emit programmatic dependent launch in its kernels."""
    import torch._inductor.config as inductor_config  # not necessarily imported before the first compilation

    return hasattr(inductor_config.triton, "enable_pdl")


def start_compile_workers() -> None:
    """Start inductor's compile worker processes now rather than at the first compiled step: each imports torch
    (seconds), and the first step's generated kernels would wait for them. Where this torch has no such pool,
    nothing happens."""
    if not WARM_WORKERS:
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return
    maybe_warm_pool()


def _compile(fn: Callable[..., Any], backend: str, pdl: bool, dynamic: bool) -> Callable[..., Any]:
    _configure()
    if pdl and backend == "inductor" and inductor_has_pdl():
        # generated kernels wait (griddepcontrol) before their first access, as triton_common.pdl_start does
        return torch.compile(fn, fullgraph=True, dynamic=dynamic, options={"triton.enable_pdl": True})
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)


def fused(fn: F | None = None, *, context_sized: bool = False) -> Any:
    """Run `fn` through torch.compile while fused mode is on and its first argument is on CUDA; eagerly otherwise,
    and when an argument holds GGUF blocks unless `blocks_mode` is on (the module docstring). `@fused` or
    `@fused(context_sized=True)` for a function whose input sizes grow with the context (symbolic sizes).
    With PDL on (triton_common.pdl_mode) a second compilation emits PDL launches."""
    if fn is None:
        return functools.partial(fused, context_sized=context_sized)
    compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if not _ON or not (args[0].is_cuda or _BACKEND != "inductor") or ops.row_exact():
            return fn(*args, **kw)
        specs = tuple(_block_spec(a) for a in args)
        blocks = any(sp is not None for sp in specs)
        if blocks and not _BLOCKS:
            return fn(*args, **kw)
        dynamic = context_sized or _ROWS > STATIC_MAX_ROWS
        key = (_BACKEND, triton_common.pdl_on(args[0]), specs if blocks else None, dynamic)
        c = compiled.get(key)
        if c is None:
            c = compiled[key] = _compile(_with_blocks(fn, specs) if blocks else fn, _BACKEND, key[1], dynamic)
        if blocks:
            return c(*(x for a, sp in zip(args, specs, strict=True) for x in _flatten(a, sp)), **kw)
        return c(*args, **kw)

    call.eager = fn  # type: ignore[attr-defined]
    call.compiled = compiled  # type: ignore[attr-defined]
    REGISTRY.append(call)
    return call  # type: ignore[return-value]
