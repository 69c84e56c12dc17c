"""The int8 block products compiled for sm_90 on this machine (no GPU needed): what the compiler left inside their K
loops. A layout conversion there moves every step's values through shared memory between two barriers, so a step's
loads wait for the step before it (how the Q6_K LM head lost to its own accumulators, BENCHMARKS.md §5b).

    python scripts/kernel_layouts.py                       # every block type, 1 and 4 x rows, and the experts
    python scripts/kernel_layouts.py --types 114,8 --rows 1,4,8

One line per kernel: layout conversions inside its loops (Triton's TTGIR), barriers in the compiled code (SASS), and
registers per thread; then the census of its K loop (the largest loop in the SASS, predicated copies counted) per
256-weight step: instructions, global loads by width, dp4a and integer ALU instructions a thread issues, and the
program's thread instructions per weight byte it reads. At 4.2 TB/s an H200 SM's share of the bytes is ~16 a clock,
against 128 thread instructions issued (4 schedulers) and 64 integer lanes a clock: 8 instructions or 4 integer ones
per byte would use all of them. Type
numbers are the kernels' (GGML's; 100 + GGML's for rows in planes: 114 Q6_K, 108 Q8_0, 106 Q5_0, 102 Q4_0). Triton's
version decides the code: compare trees under the GPU machine's version.
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from qspec.kernels import triton_qdot as q
from qspec.kernels import triton_qmatmul as qm
from qspec.weights.qweight import PLANES

# pointer arguments by name (the weight views end in b/h/i/w: uint8, f16, int16, int32 words)
POINTERS = {"x": "*bf16", "xq": "*i32", "xd": "*fp32", "xs": "*fp32", "xg": "*i32", "ti": "*i64", "tw": "*bf16",
            "act": "*fp32", "p": "*fp32", "y": "*bf16", "c": "*i32", "xn": "*bf16", "h": "*bf16", "up": "*bf16"}
VIEWS = {"b": "*u8", "h": "*fp16", "i": "*i16", "w": "*i32"}
# multiples of 16 (Triton specialises such arguments so at run time)
ALIGNED = {"D", "F", "K", "g_e", "g_f", "u_e", "u_f", "d_e", "d_d", "wa_n", "wb_n", "y_m", "w_n", "x_m", "u_n", "R"}


class LoopCensus(NamedTuple):
    """What one thread issues in a kernel's largest loop, for one iteration."""
    instructions: int
    loads: dict[int, int]  # global loads by width in bits
    dp4a: int
    int_alu: int


class Layouts(NamedTuple):
    loop_conversions: int
    barriers: int
    registers: int
    loop: LoopCensus
    spill_stores: int = 0
    instructions: int = 0  # the whole kernel's, once each


_INT_ALU = ("LOP3", "SHF", "IADD3", "IMAD", "PRMT", "SGXT", "LEA", "VIADD", "IMNMX", "BMSK", "BFI", "IABS")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")


def _signature(fn: Any, constants: dict[str, Any], pointers: dict[str, str] | None = None
               ) -> tuple[dict[str, str], dict[tuple[int], list]]:
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            base = name[:-4]
            sig[name] = (pointers or {}).get(base) or POINTERS.get(base) or VIEWS[base[-1]]
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


def row_step_bytes(qtype: int) -> int:
    """A row's weight bytes per 256-weight step, by kernel type number (planes hold the same bytes, padding aside)."""
    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype - PLANES if qtype > PLANES else qtype)]
    return 256 // size * nbytes


def _load_bits(op: str) -> int:
    """The width of a global load: LDG.E.128 -> 128, LDG.E.64 -> 64, LDG.E.U16 -> 16, LDG.E.S8 -> 8, LDG.E -> 32."""
    for part in op.split(".")[1:]:
        if part in ("128", "64"):
            return int(part)
        if part in ("U16", "S16"):
            return 16
        if part in ("U8", "S8"):
            return 8
    return 32


def loop_census(sass: str) -> LoopCensus:
    """The census of the largest loop in `sass` (cuobjdump -sass): the instructions from a backward branch's target
    to the branch, for one iteration."""
    code = [(int(a, 16), op, rest) for a, op, rest in _SASS_LINE.findall(sass)]
    loops = [(target, addr) for addr, op, rest in code if op == "BRA"
             for target in [int(t, 16) for t in re.findall(r"0x([0-9a-f]+)", rest)] if target < addr]
    if not loops:
        return LoopCensus(0, {}, 0, 0)
    lo, hi = max(loops, key=lambda t: t[1] - t[0])
    body = [op for addr, op, _ in code if lo <= addr <= hi]
    loads: dict[int, int] = {}
    for bits in (_load_bits(op) for op in body if op.startswith("LDG")):
        loads[bits] = loads.get(bits, 0) + 1
    return LoopCensus(len(body), dict(sorted(loads.items(), reverse=True)),
                      sum(op.startswith("IDP.4A") for op in body), sum(op.startswith(_INT_ALU) for op in body))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def compile_layouts(fn: Any, constants: dict[str, Any], warps: int, pointers: dict[str, str] | None = None
                    ) -> Layouts:
    """Compile fn for sm_90 with the given constexprs (PDL on, as the engine launches on Hopper; FMA contraction on,
    as the products launch); pointers: element types of pointer arguments by name (without _ptr) over POINTERS."""
    sig, attrs = _signature(fn, constants, pointers)
    c = triton.compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "launch_pdl": True, "enable_fp_fusion": True})
    sass = _cuobjdump(c.asm["cubin"], "-sass")
    regs = re.search(r"REG:(\d+)", _cuobjdump(c.asm["cubin"], "-res-usage"))
    return Layouts(loop_conversions(c.asm["ttgir"]), sass.count("BAR.SYNC"), int(regs.group(1)) if regs else -1,
                   loop_census(sass), len(re.findall(r"\bSTL", sass)), len(_SASS_LINE.findall(sass)))


def census_text(c: LoopCensus, unroll: int, threads: int, step_bytes: int | None = None) -> str:
    """A loop census per 256-weight step (the loop does `unroll` of them); step_bytes: the weight bytes the whole
    program reads per step, for the integer instructions per byte."""
    loads = " ".join(f"{n / unroll:g}x{bits}" for bits, n in c.loads.items()) or "none"
    text = (f"per step {c.instructions / unroll:g} instructions, loads {loads}, dp4a {c.dp4a / unroll:g}, "
            f"int {c.int_alu / unroll:g}")
    if step_bytes:
        per_byte = threads / unroll / step_bytes
        text += f"; per weight byte {c.instructions * per_byte:.2f} instructions, {c.int_alu * per_byte:.2f} int"
    return text


def product(qtype: int, rows: int, cfg: q.QdotConfig = q.QDOT_CONFIG) -> Layouts:
    """The dense product (_qdot_mv_kernel) at cfg with K split (partial sums added in its launch)."""
    return compile_layouts(q._qdot_mv_kernel, dict(
        M=rows, MP=q.next_pow2(rows), BN=cfg.rows, QA=qtype, QB=qtype, TWO=False, ASM=True, OUT_DT=tl.bfloat16,
        UNROLL=cfg.unroll, PARTS=True, SUM_HERE=True, PDL=True, KL=cfg.lanes), cfg.warps)


def tensor_core_product(qtype: int, rows: int) -> Layouts:
    """The block product on tensor cores (triton_qmatmul._qmm_kernel: each step's weights expanded to bf16, then
    [BN, 256] @ [256, 16]) at its MM_CONFIG, K split: what several 16-bit rows of a file-order type run."""
    bn, warps, _ = qm.MM_CONFIG
    g, length = qm.qmatmul_geometry(qtype)
    return compile_layouts(qm._qmm_kernel, dict(M=rows, BN=bn, QT=qtype, G=g, L=length, OUT_DT=tl.float32,
                                                UPCAST=False, SUM_HERE=True, PAIRS=qm.PAIRS, ASM=True, PDL=True),
                           warps)


def experts(gate: int, down: int) -> tuple[Layouts, Layouts]:
    """The routed experts' gate/up and down kernels at the gate type's MoeConfig."""
    cfg = q.moe_config(gate)
    gate_up = compile_layouts(q._qdot_gate_up_kernel, dict(
        BN=cfg.rows, QG=gate, QU=gate, ASM=True, UNROLL=cfg.unroll, SPLIT=cfg.splits > 1, KL=cfg.lanes, PDL=True),
        cfg.warps)
    down_k = compile_layouts(q._qdot_down_kernel, dict(
        BN=cfg.down_rows or cfg.rows, QD=down, ASM=True, OUT_DT=tl.bfloat16, UNROLL=cfg.down_unroll or cfg.unroll,
        PDL=True), 1)
    return gate_up, down_k


def mixer_out(qtype: int, rows: int, rank: int = 320) -> tuple[Layouts, float]:
    """The hyper-connection mixer's output kernel (triton_hc_mix._hc_out_kernel) at its config for `rows`, with a
    16-bit `up` (qtype 0) or one of blocks -> (layouts, thread instructions per `up` weight: the kernel's
    instructions with its loop's repeated for `rank`, times the threads, over the weights a program reads)."""
    from qspec.kernels import triton_hc_mix as hm

    bd, bk, warps = hm.OUT_CONFIG if rows == 1 else hm.OUT_CONFIG_ROWS
    tc = qtype == 0 and rows > 1
    g, length = qm.qmatmul_geometry(qtype) if qtype else (8, 32)
    nbp, nbp2 = hm.plane_tiles(rank)
    r = compile_layouts(hm._hc_out_kernel, dict(
        M=rows, MP=16 if tc else q.next_pow2(rows), S=4, SP=4, BD=bd, BK=bk, DT=tl.bfloat16, TC=tc, UPCAST=False,
        QT=qtype, G=g, L=length, NBP=nbp, NBP2=nbp2, PDL=True), warps, {"up": "*u8" if qtype else "*bf16"})
    iterations = -(-rank // (bk if qtype == 0 else 256)) if r.loop.instructions else 1
    executed = r.instructions + r.loop.instructions * (iterations - 1)
    return r, executed * warps * 32 / (4 * bd * rank)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="12,13,114,108,106,102,14,8,6,2", help="kernel type numbers of the dense "
                    "products")
    ap.add_argument("--rows", default="1,4", help="x rows of the dense products ('' for none)")
    ap.add_argument("--tc-rows", default="", help="x rows of the tensor-core product (what several rows of a "
                    "file-order type take), for the same types ('' for none)")
    ap.add_argument("--experts", default="12:106,12:108,12:6,14:8", help="gate:down type pairs of the routed experts "
                    "('' for none)")
    ap.add_argument("--config", default="", help="the dense products' QdotConfig fields, comma-separated (rows, "
                    "warps, programs per SM, unroll[, K lanes]; default the type's default config)")
    ap.add_argument("--mixer", default="", help="the mixers' output kernel: up's kernel type numbers (0: bf16) and "
                    "x rows as TYPES:ROWS, e.g. 0,106:1,6 ('' for none)")
    a = ap.parse_args(argv)
    print(f"# triton {triton.__version__}, sm_90: layout conversions inside K loops, BAR.SYNC in SASS, registers")
    if a.mixer:
        types, rows = a.mixer.split(":")
        for qt in (int(t) for t in types.split(",")):
            for m in (int(r) for r in rows.split(",")):
                r, per_weight = mixer_out(qt, m)
                print(f"mixer out up {qt:>3} rows {m}: {r.loop_conversions:>3} conversions in loops, {r.barriers:>3} "
                      f"barriers, {r.registers} registers, {r.spill_stores} spill stores; {r.instructions} "
                      f"instructions, loop {r.loop.instructions}; {per_weight:.2f} per up weight (rank 320)",
                      flush=True)
    for qt in (int(t) for t in a.types.split(",") if t):
        cfg = q.QdotConfig(*(int(v) for v in a.config.split(","))) if a.config else q.QDOT_CONFIG
        for m in (int(r) for r in a.rows.split(",") if r):
            r = product(qt, m, cfg)
            # one loop iteration covers unroll x lanes steps
            loop = census_text(r.loop, cfg.unroll * cfg.lanes, cfg.warps * 32, cfg.rows * row_step_bytes(qt))
            print(f"product  type {qt:>3}  rows {m}: {r.loop_conversions:>3} conversions, {r.barriers:>3} barriers, "
                  f"{r.registers} registers; {loop}", flush=True)
    bn, warps, _ = qm.MM_CONFIG
    for qt in (int(t) for t in a.types.split(",") if t):
        for m in (int(r) for r in a.tc_rows.split(",") if r):
            r = tensor_core_product(qt, m)
            loop = census_text(r.loop, 1, warps * 32, bn * row_step_bytes(qt))
            print(f"tensor-core product type {qt:>3} rows {m}: {r.loop_conversions:>3} conversions, {r.barriers:>3} "
                  f"barriers, {r.registers} registers; {loop}", flush=True)
    for pair in filter(None, a.experts.split(",")):
        gate, down = (int(t) for t in pair.split(":"))
        mc = q.moe_config(gate)
        gate_up, down_k = experts(gate, down)
        # gate/up: a program's rows of gate and of up each step; down: one-warp programs
        down_rows = mc.down_rows or mc.rows
        for name, qt, r, unroll, threads, step_bytes in (
                ("gate/up", gate, gate_up, mc.unroll, mc.warps * 32, 2 * mc.rows * row_step_bytes(gate)),
                ("down", down, down_k, mc.down_unroll or mc.unroll, 32, down_rows * row_step_bytes(down))):
            print(f"experts  {name:<7} {qt:>3}: {r.loop_conversions:>3} conversions, {r.barriers:>3} barriers, "
                  f"{r.registers} registers; {census_text(r.loop, unroll, threads, step_bytes)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
