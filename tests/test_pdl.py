"""Programmatic dependent launch (`EngineOptions.pdl`, on by default): off where the GPU lacks it, every kernel waits
for the one before it before touching memory, and the PDL variant compiles for Hopper with that wait first."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from qspec.kernels import triton_common
from qspec.model.model import Model

KERNELS = sorted((Path(__file__).parent.parent / "qspec" / "kernels").glob("triton_*.py"))


def test_pdl_is_off_where_the_gpu_lacks_it() -> None:
    t = torch.zeros(1)
    assert triton_common.pdl_launch(t) == {"PDL": False}
    with triton_common.pdl_mode(True):  # the CPU (and the interpreter) launch without it
        assert not triton_common.pdl_on(t) and triton_common.pdl_launch(t) == {"PDL": False}
    assert not triton_common._PDL


def _launched_kernels(tree: ast.Module) -> tuple[list[ast.FunctionDef], list[ast.Call]]:
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
            and n.name.endswith("_kernel")]
    names = {d.name for d in defs}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
             and isinstance(n.func.value, ast.Name) and n.func.value.id in names]
    return defs, calls


def test_every_kernel_waits_first_and_every_launch_passes_the_switch() -> None:
    """A kernel that read or wrote memory before `pdl_start` would race the kernel before it under PDL; a launch
    without `pdl_launch` would leave that kernel out of the A/B."""
    seen = 0
    for path in KERNELS:
        tree = ast.parse(path.read_text())
        defs, calls = _launched_kernels(tree)
        for d in defs:
            body = [s for s in d.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            first = ast.unparse(body[0])
            assert first == "pdl_start(PDL)", f"{path.name}:{d.name} starts with {first!r}"
            assert d.args.args[-1].arg == "PDL", f"{path.name}:{d.name} has no PDL parameter"
            seen += 1
        for c in calls:
            assert any(k.arg is None and ast.unparse(k.value).startswith("pdl_launch(") for k in c.keywords), \
                f"{path.name}:{c.lineno} launches {c.func.value.id} without **pdl_launch(...)"  # type: ignore[attr-defined]
        assert len(calls) >= len(defs), f"{path.name}: a kernel without a launch"
    assert seen >= 20


@pytest.mark.skipif(not triton_common.HAS_TRITON, reason="triton is not installed")
def test_pdl_variant_compiles_for_hopper_with_the_wait_first() -> None:
    """Compiled ahead of time for sm_90 (no GPU needed): with PDL the PTX waits (griddepcontrol.wait) before its
    first global load or store and lets the next kernel launch; without it, neither instruction is there."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from qspec.kernels.triton_argmax import _argmax_rows_kernel

    def ptx(pdl: bool) -> str:
        src = ASTSource(fn=_argmax_rows_kernel, signature={"key_ptr": "*i32", "idx_ptr": "*i32", "o_ptr": "*i64",
                                                           "NC": "i32", "NCP": "constexpr", "PDL": "constexpr"},
                        constexprs={"NCP": 128, "PDL": pdl})
        k = compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl, "num_warps": 1})
        assert k.metadata.launch_pdl is pdl
        return k.asm["ptx"]

    on, off = ptx(True), ptx(False)
    assert "griddepcontrol" not in off
    first_mem = re.search(r"\b(ld|st)\.global", on)
    wait = on.find("griddepcontrol.wait")
    assert first_mem is not None and 0 <= wait < first_mem.start()
    assert "griddepcontrol.launch_dependents" in on


def test_engine_leaves_pdl_off_where_the_gpu_lacks_it(tiny_model: Model) -> None:
    """`pdl` is on by default; on the CPU the engine leaves pdl_mode off (and with it the shapes routed for PDL)."""
    from qspec.engine import Engine, EngineHooks, EngineOptions

    seen: list[bool] = []
    opts = EngineOptions(draft=2, capacity=64)
    assert opts.pdl
    Engine(tiny_model, opts, EngineHooks(after_round=lambda run, k: seen.append(triton_common._PDL))).generate(
        [1, 2, 3, 4], 6)
    assert seen and set(seen) == {False}

