"""Seconds a process spends compiling, so that a first request's time can be reported apart from steady decoding:
torch.compile's (dynamo's own record, inductor's code generation included) and Triton's JIT compilations of the
kernels qspec and fla launch (Triton's compile hooks, which also see a compilation answered from Triton's disk
cache: then it takes milliseconds). On the CPU the kernels run in Triton's interpreter and nothing is compiled.

The two may overlap where inductor compiles a Triton kernel in this process rather than in its workers, and neither
counts an autotuner's benchmarking of the variants it compiled (fla's kernels tune at their first call)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_DYNAMO_TOTAL = "_compile.compile_inner"  # dynamo's record of one torch.compile'd frame's whole compilation


@dataclass
class CompileTimes:
    torch_s: float | None = None  # None: this torch keeps no record
    torch_graphs: int = 0  # frames torch.compile compiled (a recompilation for a new shape counts again)
    triton_s: float = 0.0
    triton_kernels: int = 0
    by_kernel: Counter[str] = field(default_factory=Counter)  # Triton seconds per kernel name

    @property
    def total_s(self) -> float:
        return (self.torch_s or 0.0) + self.triton_s

    def describe(self, slowest: int = 0) -> str:
        """One line; with `slowest`, that many Triton kernels named, the slowest to compile first."""
        torch_part = ("torch.compile not recorded" if self.torch_s is None
                      else f"torch.compile {self.torch_s:.1f} s for {self.torch_graphs} graphs")
        line = f"{torch_part}, Triton {self.triton_s:.1f} s for {self.triton_kernels} kernel variants"
        if slowest and self.by_kernel:
            line += " (slowest: " + ", ".join(f"{n} {t:.1f} s" for n, t in self.by_kernel.most_common(slowest)) + ")"
        return line

    def since(self, earlier: CompileTimes) -> CompileTimes:
        """What compiled after `earlier` (a `snapshot()` of these times)."""
        torch_s = None if self.torch_s is None else self.torch_s - (earlier.torch_s or 0.0)
        return CompileTimes(torch_s, self.torch_graphs - earlier.torch_graphs, self.triton_s - earlier.triton_s,
                            self.triton_kernels - earlier.triton_kernels, self.by_kernel - earlier.by_kernel)

    def snapshot(self) -> CompileTimes:
        return CompileTimes(self.torch_s, self.torch_graphs, self.triton_s, self.triton_kernels,
                            Counter(self.by_kernel))

    def as_dict(self) -> dict[str, Any]:
        return {"torch_s": self.torch_s, "torch_graphs": self.torch_graphs, "triton_s": self.triton_s,
                "triton_kernels": self.triton_kernels, "triton_by_kernel": dict(self.by_kernel.most_common()),
                "described": self.describe(slowest=8)}


def _dynamo_record() -> tuple[float, int] | None:
    """torch.compile's seconds and frame compilations so far in this process; None without dynamo's record."""
    try:  # a private record (torch 2.x): report its absence rather than fail
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    times = compilation_time_metrics.get(_DYNAMO_TOTAL, [])
    return float(sum(times)), len(times)


def triton_runtime_knobs() -> Any | None:
    """Triton's runtime knobs (its compile hooks live there); None without Triton or before its knobs (3.4)."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its knobs (3.4)
        return None
    return knobs.runtime if hasattr(knobs.runtime, "jit_post_compile_hook") else None


class CompileClock:
    """`with CompileClock() as clock: ...`, then `clock.times()`: what was compiled inside the block (the hooks of
    another tool stay called)."""

    def __init__(self) -> None:
        self._times = CompileTimes()
        self._started: dict[tuple[str, str], float] = {}
        self._dynamo0: tuple[float, int] | None = None
        self._knobs: Any | None = None
        self._saved: tuple[Any, Any] = (None, None)
        self._mine: tuple[Any, Any] = (None, None)
        self._open = False  # inside the block

    def __enter__(self) -> CompileClock:
        self._dynamo0 = _dynamo_record()
        self._knobs = triton_runtime_knobs()
        if self._knobs is not None:
            pre, post = self._saved = (self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook)
            self._mine = (self._chain(pre, self._before), self._chain(post, self._after))
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._mine
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            # each hook back to what it was, unless another tool replaced ours meanwhile (then its hook stays)
            if self._knobs.jit_cache_hook is self._mine[0]:
                self._knobs.jit_cache_hook = self._saved[0]
            if self._knobs.jit_post_compile_hook is self._mine[1]:
                self._knobs.jit_post_compile_hook = self._saved[1]
        self._count_torch()
        self._open = False

    def times(self) -> CompileTimes:
        """What compiled inside the block; asked inside it, what compiled so far."""
        if self._open:
            self._count_torch()
        return self._times

    def _count_torch(self) -> None:
        now = _dynamo_record()
        if now is not None and self._dynamo0 is not None:
            self._times.torch_s, self._times.torch_graphs = now[0] - self._dynamo0[0], now[1] - self._dynamo0[1]

    @staticmethod
    def _chain(other: Any, mine: Any) -> Any:
        def hook(**kw: Any) -> bool | None:
            mine(**kw)
            return other(**kw) if other is not None else None  # a true answer (skip compiling) is the other tool's
        return hook

    def _before(self, *, key: Any, fn: Any, **_: Any) -> None:
        # a hook installed inside the block may keep calling ours after it (precompile's chains to the one it
        # found): only the block's compilations are recorded, so a closed clock holds nothing
        if self._open:
            self._started[(fn.name, str(key))] = time.perf_counter()

    def _after(self, *, key: Any, fn: Any, **_: Any) -> None:
        t0 = self._started.pop((fn.name, str(key)), None)
        if t0 is not None:
            dt = time.perf_counter() - t0
            self._times.triton_s += dt
            self._times.triton_kernels += 1
            self._times.by_kernel[fn.name] += dt
