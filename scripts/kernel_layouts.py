"""The int8 block products compiled for sm_90 on this machine (no GPU needed): what the compiler left inside their K
loops. A layout conversion there moves every step's values through shared memory between two barriers, so a step's
loads wait for the step before it (how the Q6_K LM head lost to its own accumulators, BENCHMARKS.md §5b).

    python scripts/kernel_layouts.py                       # every block type, 1 and 4 x rows, and the experts
    python scripts/kernel_layouts.py --types 114,8 --rows 1,4,8

One line per kernel: layout conversions inside its loops (Triton's TTGIR), barriers in the compiled code (SASS), and
registers per thread. Type numbers are the kernels' (GGML's; 100 + GGML's for rows in planes: 114 Q6_K, 108 Q8_0,
106 Q5_0, 102 Q4_0). Triton's version decides the layouts: compare trees under the GPU machine's version.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Any, NamedTuple

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from qspec.kernels import triton_qdot as q

# pointer arguments by name (the weight views end in b/h/i/w: uint8, f16, int16, int32 words)
POINTERS = {"xq": "*i32", "xd": "*fp32", "xs": "*fp32", "xg": "*i32", "ti": "*i64", "tw": "*bf16", "act": "*fp32",
            "p": "*fp32", "y": "*bf16", "c": "*i32"}
VIEWS = {"b": "*u8", "h": "*fp16", "i": "*i16", "w": "*i32"}
ALIGNED = {"D", "F", "K", "g_e", "g_f", "u_e", "u_f", "d_e", "d_d", "wa_n", "wb_n", "y_m"}  # multiples of 16


class Layouts(NamedTuple):
    loop_conversions: int
    barriers: int
    registers: int


def _signature(fn: Any, constants: dict[str, Any]) -> tuple[dict[str, str], dict[tuple[int], list]]:
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            base = name[:-4]
            sig[name] = POINTERS.get(base) or VIEWS[base[-1]]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def loop_conversions(ttgir: str) -> int:
    """ttg.convert_layout ops inside scf.for bodies (a loop's body is indented deeper than its scf.for line)."""
    count, loop_indent = 0, None
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if loop_indent is not None and line.strip() and indent <= loop_indent:
            loop_indent = None
        if loop_indent is None and "scf.for" in line:
            loop_indent = indent
        elif loop_indent is not None and "ttg.convert_layout" in line:
            count += 1
    return count


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def compile_layouts(fn: Any, constants: dict[str, Any], warps: int) -> Layouts:
    """Compile fn for sm_90 with the given constexprs (PDL on, as the engine launches on Hopper; FMA contraction on,
    as the products launch)."""
    sig, attrs = _signature(fn, constants)
    c = triton.compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "launch_pdl": True, "enable_fp_fusion": True})
    sass = _cuobjdump(c.asm["cubin"], "-sass")
    regs = re.search(r"REG:(\d+)", _cuobjdump(c.asm["cubin"], "-res-usage"))
    return Layouts(loop_conversions(c.asm["ttgir"]), sass.count("BAR.SYNC"), int(regs.group(1)) if regs else -1)


def product(qtype: int, rows: int) -> Layouts:
    """The dense product (_qdot_mv_kernel) at QDOT_CONFIG with K split (partial sums added in its launch)."""
    cfg = q.QDOT_CONFIG
    return compile_layouts(q._qdot_mv_kernel, dict(
        M=rows, MP=q.next_pow2(rows), BN=cfg.rows, QA=qtype, QB=qtype, TWO=False, ASM=True, OUT_DT=tl.bfloat16,
        UNROLL=cfg.unroll, PARTS=True, SUM_HERE=True, PDL=True), cfg.warps)


def experts(gate: int, down: int) -> tuple[Layouts, Layouts]:
    """The routed experts' gate/up and down kernels at the gate type's MoeConfig."""
    cfg = q.moe_config(gate)
    gate_up = compile_layouts(q._qdot_gate_up_kernel, dict(
        BN=cfg.rows, QG=gate, QU=gate, ASM=True, UNROLL=cfg.unroll, SPLIT=cfg.splits > 1, PDL=True), cfg.warps)
    down_k = compile_layouts(q._qdot_down_kernel, dict(
        BN=cfg.down_rows or cfg.rows, QD=down, ASM=True, OUT_DT=tl.bfloat16, UNROLL=cfg.down_unroll or cfg.unroll,
        PDL=True), 1)
    return gate_up, down_k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="12,13,114,108,106,102,14,8,6,2", help="kernel type numbers of the dense "
                    "products")
    ap.add_argument("--rows", default="1,4", help="x rows of the dense products")
    ap.add_argument("--experts", default="12:106,12:108,12:6,14:8", help="gate:down type pairs of the routed experts "
                    "('' for none)")
    a = ap.parse_args(argv)
    print(f"# triton {triton.__version__}, sm_90: layout conversions inside K loops, BAR.SYNC in SASS, registers")
    for qt in (int(t) for t in a.types.split(",")):
        for m in (int(r) for r in a.rows.split(",")):
            r = product(qt, m)
            print(f"product  type {qt:>3}  rows {m}: {r.loop_conversions:>3} conversions, {r.barriers:>3} barriers, "
                  f"{r.registers} registers", flush=True)
    for pair in filter(None, a.experts.split(",")):
        gate, down = (int(t) for t in pair.split(":"))
        for name, r in zip(("gate/up", "down"), experts(gate, down), strict=True):
            print(f"experts  {name:<7} {gate if name == 'gate/up' else down:>3}: {r.loop_conversions:>3} conversions, "
                  f"{r.barriers:>3} barriers, {r.registers} registers", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
