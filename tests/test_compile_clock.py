"""The compile clock: torch.compile's seconds from dynamo's record, Triton's from its compile hooks (called here as
Triton's JIT calls them: the CPU interprets kernels and compiles none), another tool's hooks kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from qspec.compile_clock import CompileClock

knobs = pytest.importorskip("triton").knobs


@pytest.fixture(autouse=True)
def triton_hooks_kept() -> Iterator[None]:
    """Triton's compile hooks as they were before each test, whatever the test installed."""
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def _compile_as_triton_does(name: str, key: str, seconds: float) -> None:
    """What JITFunction._do_compile does around a compilation: the pre hook, the compile, the post hook."""
    fn = SimpleNamespace(name=name)
    assert not knobs.runtime.jit_cache_hook(key=key, repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    time.sleep(seconds)
    knobs.runtime.jit_post_compile_hook(key=key, repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)


def test_triton_compilations_are_timed_per_kernel_and_the_hooks_restored() -> None:
    seen: list[str] = []
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("pre") and None
    with CompileClock() as clock:
        _compile_as_triton_does("_qdot_mv_kernel", "a", 0.02)
        _compile_as_triton_does("_qdot_mv_kernel", "b", 0.01)
        _compile_as_triton_does("_gdn_kernel", "a", 0.01)
    t = clock.times()
    assert t.triton_kernels == 3 and seen == ["pre"] * 3  # the other tool's hook still called
    assert t.by_kernel["_qdot_mv_kernel"] >= 0.03 and t.by_kernel["_gdn_kernel"] >= 0.01
    assert t.triton_s == pytest.approx(sum(t.by_kernel.values()))
    assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_post_compile_hook is before[1]
    assert "3 kernel variants" in t.describe() and t.as_dict()["triton_kernels"] == 3
    one = t.describe(slowest=1)  # the slowest kernel only: _qdot_mv_kernel's two variants took longer
    assert "(slowest: _qdot_mv_kernel " in one and one.endswith(" s)") and "_gdn_kernel" not in one
    assert "(slowest: _qdot_mv_kernel" in t.as_dict()["described"]


def test_the_times_since_a_snapshot_are_what_compiled_after_it() -> None:
    with CompileClock() as clock:
        _compile_as_triton_does("_qdot_mv_kernel", "a", 0.01)
        first = clock.times().snapshot()
        _compile_as_triton_does("_qdot_mv_kernel", "b", 0.01)
        _compile_as_triton_does("_gdn_kernel", "a", 0.01)
        part = clock.times().since(first)
    assert first.triton_kernels == 1 and part.triton_kernels == 2  # the snapshot did not move with the clock
    assert part.triton_s == pytest.approx(clock.times().triton_s - first.triton_s)
    assert set(part.by_kernel) == {"_qdot_mv_kernel", "_gdn_kernel"} and part.torch_s is not None
    whole = clock.times().by_kernel["_qdot_mv_kernel"]
    assert part.by_kernel["_qdot_mv_kernel"] == pytest.approx(whole - first.by_kernel["_qdot_mv_kernel"])


def test_a_closed_clock_records_nothing_though_a_later_hook_still_calls_its_own() -> None:
    with CompileClock() as clock:
        inner = knobs.runtime.jit_cache_hook  # another tool chains to the clock's hook inside the block
        knobs.runtime.jit_cache_hook = lambda **kw: inner(**kw)
        _compile_as_triton_does("_qdot_mv_kernel", "a", 0.0)
    fn = SimpleNamespace(name="_qdot_mv_kernel")
    for key in "bcd":  # after the block, through that tool's hook (the post hook is the clock's no more)
        knobs.runtime.jit_cache_hook(key=key, repr=fn.name, fn=fn, compile={}, is_manual_warmup=False,
                                     already_compiled=False)
    assert clock.times().triton_kernels == 1 and not clock._started


def test_torch_compile_seconds_inside_the_block_only() -> None:
    f = torch.compile(lambda x: x.sin() * 2 + 1, backend="aot_eager")
    f(torch.randn(3))  # compiled before the clock starts: not counted
    with CompileClock() as clock:
        f(torch.randn(3))
    assert clock.times().torch_s == pytest.approx(0.0, abs=1e-9)
    g = torch.compile(lambda x: x.cos() - 1, backend="aot_eager")
    with CompileClock() as clock:
        assert clock.times().torch_s == pytest.approx(0.0, abs=1e-9)  # asked inside the block: so far
        g(torch.randn(5))
        so_far = clock.times().torch_s
        assert so_far is not None and so_far > 0
    t = clock.times()
    assert t.torch_s is not None and t.torch_s > 0 and t.triton_kernels == 0 and t.total_s == t.torch_s
    assert t.torch_graphs == 1 and "for 1 graphs" in t.describe()
    g2 = torch.compile(lambda x: x.tan(), backend="aot_eager", dynamic=False)
    with CompileClock() as clock:
        g2(torch.randn(2))
        one = clock.times().snapshot()
        g2(torch.randn(3))  # a new size: compiled again
        g2(torch.randn(3))
    assert one.torch_graphs == 1 and clock.times().since(one).torch_graphs == 1 and clock.times().torch_graphs == 2
