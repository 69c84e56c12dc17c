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


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_loop_conversions_counts_the_ones_inside_loops() -> None:
    assert load_script("kernel_layouts").loop_conversions(TTGIR) == 3


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_head_product_compiles_for_sm90_here() -> None:
    """The LM head's product (Q6_K in planes, one x row) compiled for sm_90 without a GPU: Q6_K's accumulators keep
    the x row axis first so that its steps' terms need no layout conversion inside the K loop."""
    r = load_script("kernel_layouts").product(114, 1)
    assert r.loop_conversions == 0 and r.registers > 0, r


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_experts_down_in_planes_compiles_without_layout_moves() -> None:
    """The routed experts' down kernel (one-warp programs) on Q5_0 rows in planes: x's words are loaded at the
    weights' shape, so no step moves the weights to x's layout."""
    _, down = load_script("kernel_layouts").experts(12, 106)
    assert down.loop_conversions == 0 and down.registers > 0, down
