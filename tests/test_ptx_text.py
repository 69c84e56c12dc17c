"""The inline PTX of the block kernels, run on the CPU by a small evaluator of the instructions it uses, against the
expressions the Triton interpreter runs in its place (the interpreter runs no PTX, so the kernels' CPU tests never
read these texts; a wrong shift, LUT or operand number would otherwise show only on a GPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from qspec.kernels.triton_common import DP4A_PTX
from qspec.kernels.triton_qmatmul import PAIRS_HIGH_PTX, PAIRS_PTX

M32 = 0xFFFFFFFF


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """Bit i of the result: bit (a_i << 2 | b_i << 1 | c_i) of lut (PTX's immLut, F(0xF0, 0xCC, 0xAA))."""
    out = 0
    for i in range(32):
        out |= (lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1) << i
    return out


def _i8(v: int, k: int) -> int:
    b = v >> (8 * k) & 0xFF
    return b - 256 if b > 127 else b


def _shift(v: int, n: int, left: bool) -> int:
    if n > 31:  # PTX clamps shift amounts to the width
        return 0
    return (v << n) & M32 if left else v >> n


def run_ptx(text: str, args: list[int], outputs: int) -> list[int]:
    """Evaluate `text` (the subset of PTX the kernels use) with $outputs.. bound to `args` (32-bit, unsigned);
    returns $0..$outputs-1."""
    regs: dict[str, int] = {f"${i + outputs}": a & M32 for i, a in enumerate(args)}

    def val(op: str) -> int:
        return int(op, 0) if op[0].isdigit() else regs[op]  # an immediate (0x.. or decimal) or a register

    body = text.strip().removeprefix("{").removesuffix("}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        opcode, rest = stmt.split(None, 1)
        if opcode == "mov.b32" and rest.startswith("{"):  # unpack: {lo, hi}, t
            lo, hi, src = re.findall(r"[$\w]+", rest)
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *ops = (o.strip() for o in rest.split(","))
        v = [val(o) for o in ops]
        if opcode == "shr.u32":
            regs[d] = _shift(v[0], v[1], left=False)
        elif opcode == "shl.b32":
            regs[d] = _shift(v[0], v[1], left=True)
        elif opcode == "lop3.b32":
            regs[d] = _lop3(v[0], v[1], v[2], v[3])
        elif opcode == "dp4a.s32.s32":
            s = (v[2] - (1 << 32) if v[2] >> 31 else v[2]) + sum(_i8(v[0], k) * _i8(v[1], k) for k in range(4))
            regs[d] = s & M32
        else:
            raise AssertionError(f"the evaluator does not know {opcode!r}")
    return [regs[f"${i}"] for i in range(outputs)]


def _int32(v: int) -> int:
    """v wrapped to a signed 32-bit integer, as the interpreter's int32 arithmetic wraps."""
    v &= M32
    return v - (1 << 32) if v >> 31 else v


@pytest.mark.parametrize("high", [0, 1, 2])  # Q4_K; Q5_K; Q6_K (in _tile_q6_pairs)
@pytest.mark.parametrize("magic", [0x43004300, 0x64006400])  # the bf16 and the f16 bias
def test_pair_expansion_ptx_equals_the_interpreted_bits(high: int, magic: int) -> None:
    # the kernels' shift amounts: sh = 8h + 4s (<= 12); the high bits' sh_h = 8h + 2c + s <= 15 (Q5_K) or
    # 8b + 4s + 2g' <= 14 (Q6_K): past 16 - high the PTX's logical shift and the int32 one differ in the top bit
    rng = np.random.default_rng(high * 7 + magic)
    hmask = ((1 << high) - 1) * 0x00100010
    text = PAIRS_HIGH_PTX if high else PAIRS_PTX
    for _ in range(400):
        word, qh = (int(x) for x in rng.integers(0, 1 << 32, 2, dtype=np.uint64))
        sh, sh_h = int(rng.integers(0, 13)), int(rng.integers(0, 17 - max(high, 1)))
        args = [word, sh, qh, sh_h, magic, hmask] if high else [word, sh, magic]
        lo, hi = run_ptx(text, args, 2)
        # _biased_pairs without ASM: int32 shifts (arithmetic), masks and ORs
        t = (_int32(word) >> sh) & 0x000F000F | magic
        if high:
            t |= ((_int32(qh) >> sh_h) << 4) & hmask
        assert (lo, hi) == (t & 0xFFFF, t >> 16 & 0xFFFF), (hex(word), sh, hex(qh), sh_h)


def test_dp4a_ptx_equals_the_byte_sum() -> None:
    rng = np.random.default_rng(3)
    for _ in range(400):
        a, b, c = (int(x) for x in rng.integers(0, 1 << 32, 3, dtype=np.uint64))
        (got,) = run_ptx(DP4A_PTX, [a, b, c], 1)
        want = _int32(c)  # triton_common.dp4a without ASM: byte k sign-extended by shifts up and (arithmetic) down
        for k in range(4):
            want += (_int32(a << (24 - 8 * k)) >> 24) * (_int32(b << (24 - 8 * k)) >> 24)
        assert got == want & M32


def test_the_evaluator_can_fail() -> None:
    # a wrong LUT (a & b & c instead of (a & b) | c) or operand changes the bits the tests compare
    args = [0x12345678, 4, 0x43004300]
    right = run_ptx(PAIRS_PTX, args, 2)
    assert run_ptx(PAIRS_PTX.replace("0xEA", "0x80"), args, 2) != right
    assert run_ptx(PAIRS_PTX.replace("shr.u32 t, $2, $3", "shr.u32 t, $2, $4"), args, 2) != right
