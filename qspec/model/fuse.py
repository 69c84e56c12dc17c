"""Fusing the small per-layer math of decode, verify and draft steps with torch.compile.

A decode step of the real geometry is over a thousand kernels, most of them tiny elementwise ops (norms,
hyper-connection mixers, routing, RoPE, masks, q8_0 casts); inside a CUDA graph each still costs its
execution plus a node's latency, which is most of the step (BENCHMARKS.md §3, §4). `@fused` marks a pure tensor function
(the torch reference itself) whose body inductor turns into a few generated kernels, on CUDA, for
step-sized inputs, when fusion is on. Everything else (prefill, the CPU, row-exact mode) runs the same
function eagerly (`step_rows`), so the CPU tests check the very code that gets compiled; `tests/test_gpu_engine.py`
compares the two on the GPU.

Each function compiles with symbolic sizes (`dynamic=True`): one graph serves every row count above 1
and every KV bucket, so a request that crosses into a new bucket does not stop to compile (with static
sizes it did: ~13 s in the middle of a benchmark run). Compilation happens on the first eager use; the
runner captures a CUDA graph only on a shape's second use, so capture replays already-compiled code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from qspec.kernels import triton_common
from qspec.model import ops

F = TypeVar("F", bound=Callable[..., Any])

# Steps with more rows than this (prefill chunks) run eagerly: their ops are few and large.
MAX_ROWS = 64

_ON = False
REGISTRY: list[Callable[..., Any]] = []  # every @fused function (tests check each one is traced)
# Tests trace the functions on the CPU with dynamo's "aot_eager" backend (no code generation), which
# checks that each one is a single graph and that tracing changes no result.
_BACKEND = "inductor"


def enabled() -> bool:
    return _ON


def step_rows(rows: int) -> contextlib.AbstractContextManager[None]:
    """Scope of one forward step of `rows` rows: fusion stays on only for step-sized ones."""
    return fused_mode(_ON and rows <= MAX_ROWS, _BACKEND)


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


def _configure() -> None:
    # Sizes 0 and 1 specialise even with symbolic sizes, and a guard can fail on a new stride or dtype;
    # past the default limit of 8 graphs dynamo would silently run a function eagerly.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 64)


def inductor_has_pdl() -> bool:
    """Whether this torch's inductor can emit programmatic dependent launch in its kernels."""
    import torch._inductor.config as inductor_config  # not necessarily imported before the first compilation

    return hasattr(inductor_config.triton, "enable_pdl")


def _compile(fn: Callable[..., Any], backend: str, pdl: bool) -> Callable[..., Any]:
    _configure()
    if pdl and backend == "inductor" and inductor_has_pdl():
        # generated kernels wait (griddepcontrol) before their first access, as triton_common.pdl_start does
        return torch.compile(fn, fullgraph=True, dynamic=True, options={"triton.enable_pdl": True})
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)


def fused(fn: F) -> F:
    """Run `fn` through torch.compile while fused mode is on and its first argument is on CUDA;
    eagerly otherwise, and when an argument holds GGUF blocks (a QuantWeight is no tensor dynamo can trace; the
    function's small ops then run eagerly around the block product).
    With PDL on (triton_common.pdl_mode) a second compilation emits PDL launches."""
    compiled: dict[tuple[str, bool], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if (_ON and (args[0].is_cuda or _BACKEND != "inductor") and not ops.row_exact()
                and not any(ops.is_quantized(a) for a in args)):
            key = (_BACKEND, triton_common.pdl_on(args[0]))
            c = compiled.get(key)
            if c is None:
                c = compiled[key] = _compile(fn, *key)
            return c(*args, **kw)
        return fn(*args, **kw)

    call.eager = fn  # type: ignore[attr-defined]
    call.compiled = compiled  # type: ignore[attr-defined]
    REGISTRY.append(call)
    return call  # type: ignore[return-value]
