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


def _memory_calls(nodes: list[ast.stmt]) -> list[str]:
    return [ast.unparse(n.func) for s in nodes for n in ast.walk(s) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and (n.func.attr in ("load", "store") or "atomic" in n.func.attr)]


def _check_waits_first(file: str, d: ast.FunctionDef) -> None:
    """`pdl_start(PDL)` is a statement of the kernel's body; before it only index math and, inside `if PRELOAD:`
    blocks, loads (of weights, which no kernel writes during a step: triton_common._PRELOAD)."""
    body = [s for s in d.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    at = [i for i, s in enumerate(body) if ast.unparse(s) == "pdl_start(PDL)"]
    assert at, f"{file}:{d.name} never calls pdl_start(PDL) in its body"
    before = body[:at[0]]
    preloads = [s for s in before if isinstance(s, ast.If) and ast.unparse(s.test) == "PRELOAD"]
    rest = [s for s in before if s not in preloads]
    assert not _memory_calls(rest), f"{file}:{d.name} touches memory before pdl_start: {_memory_calls(rest)}"
    assert all(c == "tl.load" for c in _memory_calls(preloads)), f"{file}:{d.name} stores in a preload"
    assert not preloads or "PRELOAD" in [a.arg for a in d.args.args], f"{file}:{d.name}"


def test_every_kernel_waits_first_and_every_launch_passes_the_switch() -> None:
    """A kernel that read or wrote memory before `pdl_start` (but its weights' preload) would race the kernel before
    it under PDL; a launch without `pdl_launch` would leave that kernel out of the A/B."""
    seen = 0
    for path in KERNELS:
        tree = ast.parse(path.read_text())
        defs, calls = _launched_kernels(tree)
        for d in defs:
            _check_waits_first(path.name, d)
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



@pytest.mark.skipif(not triton_common.HAS_TRITON, reason="triton is not installed")
def test_preload_loads_weights_before_the_wait() -> None:
    """Compiled for sm_90 with PRELOAD and PDL, the mat-vec's first weight loads come before griddepcontrol.wait and
    its x loads and stores after it; without PRELOAD nothing is loaded before the wait."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from qspec.kernels.triton_gemv import _gemv_kernel

    names = ["x_ptr", "w_ptr", "y_ptr", "N", "K", "K_SPLIT", "x_m", "w_n", "y_s", "y_m", "M", "MP", "BN", "BK",
             "OUT_DT", "PRELOAD", "PDL"]
    sig = {n: t for n, t in zip(names, ["*bf16"] * 3 + ["i32"] * 7 + ["constexpr"] * 7, strict=True)}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "w_ptr", "y_ptr", "K", "K_SPLIT", "w_n")}

    def order(pre: bool) -> tuple[int, int, int]:
        src = ASTSource(fn=_gemv_kernel, signature=sig, attrs=attrs, constexprs={
            "M": 1, "MP": 1, "BN": 1, "BK": 4096, "OUT_DT": triton_common.tl.bfloat16, "PRELOAD": pre, "PDL": True})
        ptx = compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, "num_warps": 8}).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        loads = [m.start() for m in re.finditer(r"\bld\.global", ptx)]
        return wait, sum(i < wait for i in loads), sum(i > wait for i in loads)

    wait, before, after = order(True)
    assert wait > 0 and before >= 2 and after >= 1
    assert order(False)[1] == 0
