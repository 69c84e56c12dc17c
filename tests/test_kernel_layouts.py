"""scripts/kernel_layouts.py: what the compiler leaves inside the int8 products' K loops (compiled for sm_90 here)."""

from __future__ import annotations

import pytest
from conftest import load_script

from qspec.kernels.triton_common import HAS_TRITON

TTGIR = """\
  %a = ttg.convert_layout %x : before the loop
  %acc = scf.for %kb = %lo to %hi step %c1 iter_args(%s = %z) {
    %b = ttg.convert_layout %y : in the loop
    %r = "tt.reduce"(%b) ({
      %c = ttg.convert_layout %w : in the loop's nested region
    })
    scf.yield %r
  }
  %d = ttg.convert_layout %acc : after the loop
  %acc2 = scf.for %kb = %lo to %hi step %c1 iter_args(%s = %z) {
    %e = ttg.convert_layout %y : in the second loop
  }
"""


SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;          /* 0x0000000402047981 */
        /*0020*/                   BRA 0x50 ;                                /* 0x0000000000087947 */
        /*0030*/                   LDG.E R8, desc[UR4][R2.64] ;              /* 0x0000000402087981 */
        /*0040*/              @!P0 LDG.E.128 R12, desc[UR4][R2.64+0x10] ;    /* 0x0000000402 */
        /*0050*/                   LOP3.LUT R9, R8, 0xf0f0f0f, RZ, 0xc0, !PT ;  /* 0x0f0f0f0f08097812 */
        /*0060*/                   IDP.4A.S8.S8 R10, R9, R4, R10 ;           /* 0x0000000409 */
        /*0070*/                   LDG.E.U16 R11, desc[UR4][R2.64] ;         /* 0x0000000402 */
        /*0080*/                   SHF.R.U32.HI R9, RZ, 0x4, R8 ;            /* 0x00000004ff */
        /*0090*/               @P1 BRA 0x30 ;                                /* 0xfffffff800 */
        /*00a0*/                   LDG.E.64 R2, desc[UR4][R6.64] ;           /* 0x0000000406 */
        /*00b0*/                   BRA 0xa0 ;                                /* 0xfffffffc00 */
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_loop_census_reads_the_largest_loop() -> None:
    """The largest backward branch's body (0x30..0x90, predicated loads counted), not the loads before it or the
    one-instruction loop after it; forward branches are not loops."""
    c = load_script("kernel_layouts").loop_census(SASS)
    assert c.instructions == 7 and c.loads == {128: 1, 32: 1, 16: 1} and c.dp4a == 1 and c.int_alu == 2, c
    assert load_script("kernel_layouts").loop_census("no code").instructions == 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_loop_conversions_counts_the_ones_inside_loops() -> None:
    assert load_script("kernel_layouts").loop_conversions(TTGIR) == 3


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_head_product_compiles_for_sm90_here() -> None:
    """The LM head's product (Q6_K in planes, one x row) compiled for sm_90 without a GPU: Q6_K's accumulators keep
    the x row axis first so that its steps' terms need no layout conversion inside the K loop."""
    r = load_script("kernel_layouts").product(114, 1)
    assert r.loop_conversions == 0 and r.registers > 0, r
    assert r.loop.dp4a > 0 and r.loop.loads and r.loop.int_alu < r.loop.instructions, r.loop


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_experts_down_in_planes_compiles_without_layout_moves() -> None:
    """The routed experts' down kernel (one-warp programs) on Q5_0 rows in planes: x's words are loaded at the
    weights' shape, so no step moves the weights to x's layout."""
    _, down = load_script("kernel_layouts").experts(12, 106)
    assert down.loop_conversions == 0 and down.registers > 0, down


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_tensor_core_product_compiles_for_sm90_here() -> None:
    """Six rows of a Q4_K matrix in the file's order on tensor cores (what a verify step runs): compiled for sm_90
    without a GPU, no dp4a in its K loop, its loads counted."""
    r = load_script("kernel_layouts").tensor_core_product(12, 6)
    assert r.registers > 0 and r.loop.dp4a == 0 and r.loop.loads and r.loop.instructions > r.loop.int_alu, r
