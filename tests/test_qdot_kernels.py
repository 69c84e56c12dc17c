"""The int8-activation products (kernels/qdot.py references, kernels/triton_qdot.py kernels).

Tolerances, as max |got - ref| / max |ref|:
- the activation quantizer against quantize_x_torch: bit for bit (int8 words, d and s);
- the kernels against the int8 references (qdot_matmul_torch, qdot_moe_few_torch), f32 outputs: TIGHT = 1e-5 (the
  integer sums are exact on both sides; only the order of the f32 sums over sub-blocks differs; measured ~1e-7);
  16-bit outputs add that dtype's rounding of the result (TOL16);
- the int8 path against the f32 products with the expanded weights (qmatmul_torch, qmoe_few_torch): LOOSE = 2e-2,
  what rounding x (and the experts' intermediate) to 8 bits per 32 elements costs; measured 3e-3 .. 1e-2 at these
  small random shapes (`test_int8_error_per_type` prints them per type).
- Row independence: a row's result is bit-identical whatever the number of rows computed with it.

The Triton kernels run through the interpreter in a subprocess (`test_interpreted`, as in test_quant_kernels.py);
tests marked `cuda` run the compiled kernels at the model's shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import routing, row_len, run_interp_tests, tiny_config
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.kernels.qdot import QDOT_QTYPES, qdot_matmul_torch, qdot_moe_few_torch, quantize_x_torch
from qspec.kernels.qmatmul import qmatmul_torch, qmoe_few_torch
from qspec.kernels.triton_common import HAS_TRITON, INTERPRET
from qspec.weights.quantize import quantize
from qspec.weights.qweight import QuantWeight

T = GGMLQuantizationType
TYPES = sorted(QDOT_QTYPES, key=lambda q: q.name)
TIGHT, LOOSE = 1e-5, 2e-2
# the experts' bound: one int8 code of the re-quantized intermediate may differ (test_interp_qdot_moe_few)
MOE_TIGHT = 1e-3


TOL16 = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
interp = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreted (TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws from the same seed, whatever ran before it in the process."""
    torch.manual_seed(0)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def qweight(qt: GGMLQuantizationType, shape: tuple[int, ...], seed: int, device: str = "cpu",
            tile: int = 0) -> QuantWeight:
    """Random weights quantized to qt; tile > 0: `tile` random rows (of all the lead dims' rows) repeated, so the
    model's sizes quantize quickly."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(min(rows, tile or rows), shape[-1], generator=g, device=device) * shape[-1] ** -0.5
    raw = quantize(w, qt)
    if tile:
        raw = raw.repeat(-(-rows // tile), 1)[:rows].contiguous()
    return QuantWeight.from_blocks(raw, qt, shape)


# ---- in this process: the references ----------------------------------------------------------------------------

@pytest.mark.parametrize("qt", TYPES)
def test_int8_error_per_type(qt: GGMLQuantizationType) -> None:
    """The int8 reference against the f32 product: only x's rounding to 8 bits separates them."""
    w = qweight(qt, (64, row_len(qt)), seed=int(qt))
    x = torch.randn(4, w.shape[1])
    err = rel_err(qdot_matmul_torch(x, w.raw, int(qt), 64, w.shape[1]), qmatmul_torch(x, w))
    print(f"{qt.name}: int8 x against f32 x: {err:.2e}")
    assert 1e-4 < err <= LOOSE  # (a zero error would mean the int8 path was not taken)


def test_quantize_x_reference() -> None:
    """d = max|x| / 127 per 32, |q| <= 127 with the block's maximum at +-127, s = d * sum(q); a zero block stays 0."""
    x = torch.randn(3, 96)
    x[1, 32:64] = 0
    q, d, s, g16 = quantize_x_torch(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert torch.equal(g16, q.view(3, 6, 16).sum(-1).int())
    assert torch.equal(d, x.view(3, 3, 32).abs().amax(-1) / 127)
    assert torch.equal(s, d * q.view(3, 3, 32).sum(-1).float())
    assert d[1, 1] == 0 and (q.view(3, 3, 32)[1, 1] == 0).all()
    assert rel_err(q.float().view(3, 3, 32) * d[..., None], x.view(3, 3, 32)) <= 1 / 254 + 1e-6


# ---- the Triton kernels through the interpreter (subprocess) ----------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; the subprocess itself runs the interp tests")
@pytest.mark.parametrize("select", ["interp and moe", "interp and not moe"], ids=["experts", "products"])
def test_interpreted(select: str) -> None:
    run_interp_tests(__file__, select)  # two subprocesses (experts the longer) that pytest-xdist can run together


@interp
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_interp_quantize_x(dt: torch.dtype) -> None:
    from qspec.kernels.triton_qdot import quantize_x_triton

    x = torch.randn(3, 1120).to(dt)  # 35 blocks: two programs per row, the second partly masked
    x[0, :32] = 0
    q, d, s, g = quantize_x_triton(x)
    rq, rd, rs, rg = quantize_x_torch(x)
    assert q.dtype == torch.int32 and q.shape == (3, 280)
    assert torch.equal(q.view(torch.int8), rq) and torch.equal(d, rd) and torch.equal(s, rs) and torch.equal(g, rg)


@interp
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
def test_interp_qdot_matmul(qt: GGMLQuantizationType, M: int) -> None:
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    w = qweight(qt, (13, row_len(qt)), seed=10 * M + int(qt))
    x = torch.randn(M, w.shape[1])
    y = qdot_matmul_triton(x, w.raw, int(qt), 13, config=(8, 4, 1, 1))
    assert rel_err(y, qdot_matmul_torch(x, w.raw, int(qt), 13, w.shape[1])) <= TIGHT
    assert rel_err(y, qmatmul_torch(x, w)) <= LOOSE


@interp
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_interp_qdot_16bit(dt: torch.dtype) -> None:
    """16-bit rows: the output rounded once to x's dtype."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    w = qweight(T.Q4_K, (9, 256), seed=5)
    x = torch.randn(2, 256).to(dt)
    y = qdot_matmul_triton(x, w.raw, int(T.Q4_K), 9, config=(8, 4, 1, 1))
    assert y.dtype == dt and rel_err(y, qdot_matmul_torch(x, w.raw, int(T.Q4_K), 9, 256)) <= TOL16[dt]


@interp
@pytest.mark.parametrize("qt", [T.Q6_K, T.Q8_0])
def test_interp_split_k_and_row_independence(qt: GGMLQuantizationType) -> None:
    """K split into f32 partial sums (many programs wanted per SM), and each row's result bit-identical whatever
    M: computed alone, or with 4 others (the row-exact mode's contract)."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    K = 1024 if qt == T.Q6_K else 800
    w = qweight(qt, (10, K), seed=7)
    x = torch.randn(5, K)
    cfg = (8, 4, 8, 1)  # 2 row blocks, 32 wanted: K splits into 4 shares
    y = qdot_matmul_triton(x, w.raw, int(qt), 10, config=cfg)
    assert rel_err(y, qdot_matmul_torch(x, w.raw, int(qt), 10, K)) <= TIGHT
    for i in range(5):
        assert torch.equal(qdot_matmul_triton(x[i:i + 1], w.raw, int(qt), 10, config=cfg), y[i:i + 1])
    y1 = qdot_matmul_triton(x, w.raw, int(qt), 10, config=(8, 4, 1, 1))  # no split
    assert rel_err(y1, y) <= TIGHT


@interp
@pytest.mark.parametrize("qt,lanes,per_sm", [(T.Q4_K, 2, 1), (T.Q5_K, 4, 1), (T.Q4_K, 4, 16), (T.Q5_K, 8, 1)])
def test_interp_k_lanes(qt: GGMLQuantizationType, lanes: int, per_sm: int) -> None:
    """Q4_K/Q5_K rows walked `lanes` super-blocks a step (the last step partial: K is 5 super-blocks), alone or with
    K split into shares: the int8 reference's numbers, a row's bits whatever M, and another type refused."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    K, N = 1280, 11
    w = qweight(qt, (N, K), seed=lanes + per_sm)
    x = torch.randn(3, K)
    cfg = (4, 4, per_sm, 1, lanes)
    y = qdot_matmul_triton(x, w.raw, int(qt), N, config=cfg)
    assert rel_err(y, qdot_matmul_torch(x, w.raw, int(qt), N, K)) <= TIGHT
    assert torch.equal(qdot_matmul_triton(x[2:], w.raw, int(qt), N, config=cfg), y[2:])
    w8 = qweight(T.Q8_0, (N, K), seed=1)
    with pytest.raises(ValueError, match="K lanes"):
        qdot_matmul_triton(x, w8.raw, int(T.Q8_0), N, config=cfg)


def test_default_config_by_matrix() -> None:
    """A vocabulary-sized Q6_K matrix alone in the file's order takes the head's config; anything else (in planes,
    smaller, another type, a stack) the default; never anything about x."""
    from qspec.kernels.triton_qdot import HEAD_ROWS, QDOT_CONFIG, QDOT_CONFIG_Q6K_HEAD, _default_config, k_lanes_mode
    from qspec.weights.qweight import Q6_K_PLANES

    head, small = torch.empty(HEAD_ROWS, 1, dtype=torch.uint8), torch.empty(HEAD_ROWS - 1, 1, dtype=torch.uint8)
    assert _default_config([(head, int(T.Q6_K))]) == QDOT_CONFIG_Q6K_HEAD != QDOT_CONFIG
    assert _default_config([(head, Q6_K_PLANES)]) == QDOT_CONFIG
    assert _default_config([(small, int(T.Q6_K))]) == QDOT_CONFIG
    with k_lanes_mode(1):  # a Q4_K matrix of as many rows: by its K lanes (test_k_lanes_by_shape), not the head's
        assert _default_config([(head, int(T.Q4_K))]) == QDOT_CONFIG
    assert _default_config([(head, int(T.Q6_K)), (small, int(T.Q6_K))]) == QDOT_CONFIG


def test_k_lanes_config_for_k_quants_only() -> None:
    """--k-lanes N gives Q4_K/Q5_K products (alone or stacked together) K_LANE_CONFIGS[N], in programs of the
    default's threads; a stack with another type, and other types, keep theirs; an unknown count is refused."""
    from qspec.kernels.triton_qdot import K_LANE_CONFIGS, QDOT_CONFIG, _default_config, k_lanes_mode

    w = torch.empty(64, 1, dtype=torch.uint8)
    assert K_LANE_CONFIGS[1] == QDOT_CONFIG
    for lanes, cfg in K_LANE_CONFIGS.items():
        assert cfg.lanes == lanes and cfg.rows * 4 * lanes == cfg.warps * 32 >= QDOT_CONFIG.warps * 32
        with k_lanes_mode(lanes):
            assert _default_config([(w, int(T.Q4_K))]) == cfg
            assert _default_config([(w, int(T.Q5_K)), (w, int(T.Q4_K))]) == cfg
            assert _default_config([(w, int(T.Q5_K)), (w, int(T.Q6_K))]) == QDOT_CONFIG
            assert _default_config([(w, int(T.Q8_0))]) == QDOT_CONFIG
    with k_lanes_mode(1):
        assert _default_config([(w, int(T.Q4_K))]) == QDOT_CONFIG
    with pytest.raises(ValueError, match="K lanes"):
        k_lanes_mode(3)


@pytest.mark.parametrize(("rows", "k", "lanes"), [
    ((324,), 10240, 4),  # a mixer's w_in: a few rows of a long K
    ((10240, 6240), 2560, 2),  # the GDN input stack (Q5_K + Q4_K), its rows together
    ((13952,), 2560, 2),  # the QSA input
    ((2560,), 6144, 1),  # GDN's output
    ((1800,), 2560, 1),  # the router stack
    ((512,), 2560, 1),  # a few rows of a short K
    ((16480,), 6144, 1),  # many rows of a long K
])
def test_k_lanes_by_shape(rows: tuple[int, ...], k: int, lanes: int) -> None:
    """By default (K lanes 0) a Q4_K/Q5_K product's lanes follow its matrices' rows and K, whatever x's row count
    (row-exact mode); other types keep the default config; --k-lanes N overrides the shape."""
    from qspec.kernels.triton_qdot import K_LANE_CONFIGS, QDOT_CONFIG, _default_config, k_lanes_mode, lanes_by_shape

    assert lanes_by_shape(sum(rows), k // 256) == lanes
    types = (T.Q5_K, T.Q4_K)[-len(rows):]
    parts = [(torch.empty(n, k // 256 * GGML_QUANT_SIZES[t][1], dtype=torch.uint8), int(t))
             for n, t in zip(rows, types, strict=True)]
    with k_lanes_mode(0):
        assert _default_config(parts) == K_LANE_CONFIGS[lanes]
        q8 = [(torch.empty(n, k // 32 * 34, dtype=torch.uint8), int(T.Q8_0)) for n in rows]
        assert _default_config(q8) == QDOT_CONFIG
    with k_lanes_mode(8):
        assert _default_config(parts) == K_LANE_CONFIGS[8]


def test_default_moe_config_by_gate_type() -> None:
    """Q4_K gate/up take their own experts' config (K in shares), other types the general one."""
    from qspec.kernels.triton_qdot import QDOT_MOE_CONFIG, QDOT_MOE_CONFIG_Q4K, moe_config

    assert moe_config(int(T.Q4_K)) == QDOT_MOE_CONFIG_Q4K and QDOT_MOE_CONFIG_Q4K.splits > 1
    assert all(moe_config(int(t)) == QDOT_MOE_CONFIG for t in (T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0))


@interp
def test_interp_q6k_head_config() -> None:
    """The Q6_K head's programs (32 rows, two per thread) against the reference, a partial last row block, each
    row's result whatever M."""
    from qspec.kernels.triton_qdot import QDOT_CONFIG_Q6K_HEAD, qdot_matmul_triton

    K = 768
    w = qweight(T.Q6_K, (40, K), seed=13)
    x = torch.randn(3, K)
    y = qdot_matmul_triton(x, w.raw, int(T.Q6_K), 40, config=QDOT_CONFIG_Q6K_HEAD)
    assert rel_err(y, qdot_matmul_torch(x, w.raw, int(T.Q6_K), 40, K)) <= TIGHT
    for i in range(3):
        assert torch.equal(qdot_matmul_triton(x[i:i + 1], w.raw, int(T.Q6_K), 40, config=QDOT_CONFIG_Q6K_HEAD),
                           y[i:i + 1])


@interp
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K, T.Q5_0])
def test_interp_unrolled_steps_give_the_same_bits(qt: GGMLQuantizationType) -> None:
    """Steps per loop iteration (UNROLL) change the schedule, never the sum: 7 steps unrolled by 2 and 4 (a
    remainder each time), with and without a split, equal one step per iteration bit for bit."""
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    K = 7 * 256
    w = qweight(qt, (12, K), seed=11)
    x = torch.randn(2, K)
    for per_sm in (0, 8):
        y1 = qdot_matmul_triton(x, w.raw, int(qt), 12, config=(8, 4, per_sm, 1))
        assert rel_err(y1, qdot_matmul_torch(x, w.raw, int(qt), 12, K)) <= TIGHT
        for unroll in (2, 4):
            assert torch.equal(qdot_matmul_triton(x, w.raw, int(qt), 12, config=(8, 4, per_sm, unroll)), y1)


@interp
@pytest.mark.parametrize("K,rows,M", [(512, (24, 16, 8), 1), (768, (256, 16, 8), 2)])
def test_interp_stacked_products_quantize_x_once(K: int, rows: tuple[int, int, int], M: int) -> None:
    """Parts of several types multiplying one x: each part's columns equal its own product, bit for bit (the same
    quantized x, the same split of K), written in place, whether two parts share a launch (each with its own split:
    2 and 3 in the second case) or not; and ops.linear on a StackedWeight of those parts gives their products (here
    on the CPU: each part's reference)."""
    from qspec.kernels import triton_qdot
    from qspec.kernels.triton_common import module_flag
    from qspec.kernels.triton_qdot import _split, qdot_matmul_triton, qdot_stacked_triton
    from qspec.model.ops import linear, stack_rows

    ws = [qweight(qt, (n, K), i) for i, (qt, n) in enumerate(zip((T.Q5_K, T.Q4_K, T.Q8_0), rows, strict=True))]
    x = torch.randn(M, K).bfloat16()
    cfg = triton_qdot.QDOT_CONFIG
    splits = [_split(w.shape[0], K, cfg.rows, cfg.per_sm, x)[0] for w in ws[:2]]
    assert splits == ([2, 2] if K == 512 else [2, 3])
    ref = torch.cat([qdot_matmul_triton(x, w.raw, int(w.qtype), w.shape[0]) for w in ws], dim=-1)
    for paired in (True, False):
        with module_flag(triton_qdot.__name__, "PAIR_PARTS", paired):
            y = qdot_stacked_triton(x, [(w.raw, int(w.qtype)) for w in ws])
        assert y.shape == (M, sum(rows)) and y.dtype == torch.bfloat16
        assert torch.equal(y, ref)
    W, _ = stack_rows(*ws)
    assert len(W.parts) == 3  # type: ignore[union-attr]
    assert rel_err(linear(x, W), torch.cat([qmatmul_torch(x, w) for w in ws], dim=-1)) <= TOL16[torch.bfloat16]


@interp
def test_interp_split_sums_in_the_product_launch() -> None:
    """A split product's partial sums added by each row block's last program (SUM_IN_PRODUCT) equal those added by
    the sum launch, bit for bit: one part split in 3 shares beside one not split (its programs write the output
    directly), one part alone; and every arrival counter is back at 0 after each launch."""
    from qspec.kernels import triton_common
    from qspec.kernels.triton_common import module_flag
    from qspec.kernels.triton_qdot import _split, qdot_stacked_triton

    K, cfg = 768, (8, 4, 2, 1)  # 8 programs wanted: 8 rows split K in 3 shares, 64 rows (8 blocks) do not
    ws = [qweight(T.Q5_K, (8, K), 70), qweight(T.Q4_K, (64, K), 71)]
    assert [_split(w.shape[0], K, 8, 2, torch.empty(0))[0] for w in ws] == [3, 1]
    x = torch.randn(2, K).bfloat16()
    for parts in ([(w.raw, int(w.qtype)) for w in ws], [(ws[0].raw, int(T.Q5_K))]):
        with module_flag(triton_common.__name__, "SUM_IN_PRODUCT", False):
            apart = qdot_stacked_triton(x, parts, cfg)
        here = qdot_stacked_triton(x, parts, cfg)
        assert torch.equal(here, apart)
        assert all(int(c.abs().sum()) == 0 for c in triton_common._COUNTERS.values())
    ref = torch.cat([qdot_matmul_torch(x.float(), w.raw, int(w.qtype), w.shape[0], K) for w in ws], dim=-1)
    assert rel_err(qdot_stacked_triton(x, [(w.raw, int(w.qtype)) for w in ws], cfg), ref) <= TOL16[torch.bfloat16]


@interp
@pytest.mark.parametrize("gt,dt,T_", [(T.Q4_K, T.Q5_0, 1), (T.Q6_K, T.Q8_0, 1), (T.Q5_K, T.Q4_0, 1),
                                      (T.Q4_K, T.Q5_0, 3), (T.Q6_K, T.Q8_0, 3)])  # each pair alone at 1 token
def test_interp_qdot_moe_few(gt: GGMLQuantizationType, dt: GGMLQuantizationType, T_: int) -> None:
    """The experts through int8 activations; F = 96 makes the down rows three 32-weight blocks (a partial step),
    D = 768 three 256-weight steps (a whole and a partial unrolled iteration). Unrolled configs and the default's
    program shape give the same bits."""
    from qspec.kernels.triton_qdot import moe_config, qdot_moe_few_triton

    E, Fd, D, k = 5, 96, 768, 2
    gate, up, down = qweight(gt, (E, Fd, D), 30), qweight(gt, (E, Fd, D), 31), qweight(dt, (E, D, Fd), 32)
    h = torch.randn(T_, D, generator=torch.Generator().manual_seed(34))
    top_i, top_w = routing(T_, E, k, seed=33)
    parts = ((gate.raw, int(gt)), (up.raw, int(gt)), (down.raw, int(dt)))
    got = qdot_moe_few_triton(h, top_i, top_w, *parts, config=(32, 4))
    assert got.shape == (T_, k, D)
    assert torch.equal(qdot_moe_few_triton(h, top_i, top_w, *parts, config=(32, 4, 2, 16, 3) if T_ == 1 else
                                           (32, 4, 3)), got)
    if T_ == 1:  # no config: the gate type's default (moe_config), the bits of its split of K in 32-row programs
        split = moe_config(int(gt)).splits
        want = got if split == 1 else qdot_moe_few_triton(h, top_i, top_w, *parts, config=(32, 4, 1, 16, 3, split))
        assert torch.equal(qdot_moe_few_triton(h, top_i, top_w, *parts), want), split
    # the f32 intermediate is rounded to int8 again before the down product: an element within f32 rounding of a
    # code boundary may land one code apart in kernel and reference (~1e-4 of the output), so not TIGHT here
    assert rel_err(got, qdot_moe_few_torch(h, top_i, top_w, *parts)) <= MOE_TIGHT
    assert rel_err(got, qmoe_few_torch(h, top_i, top_w, gate, up, down)) <= LOOSE


def _narrow_experts(gt: GGMLQuantizationType, ut: GGMLQuantizationType, seed: int) -> tuple:
    """3 experts 32 wide on D = 768 (three 256-weight steps), gate/up in gt/ut and down in Q8_0, two tokens routed
    to 2 each: (h, top_i, top_w, the experts' (raw, type) parts); seeds seed .. seed + 4."""
    E, Fd, D, k = 3, 32, 768, 2
    gate, up, down = qweight(gt, (E, Fd, D), seed), qweight(ut, (E, Fd, D), seed + 1), qweight(T.Q8_0, (E, D, Fd),
                                                                                             seed + 2)
    h = torch.randn(2, D, generator=torch.Generator().manual_seed(seed + 3))
    top_i, top_w = routing(2, E, k, seed=seed + 4)
    return h, top_i, top_w, ((gate.raw, int(gt)), (up.raw, int(ut)), (down.raw, int(T.Q8_0)))


@interp
def test_interp_qdot_moe_split_gate_up() -> None:
    """Gate/up's K (D = 768: three 256-weight steps) in shares of 2 + 1 or 1 + 1 + 1 steps, their partial sums added
    and silu-ed by the act quantizer: the unsplit numbers to f32 rounding; within a split, any unroll gives the same
    bits. (Narrow experts, F = 32, keep the interpreter's work small.)"""
    from qspec.kernels.triton_qdot import qdot_moe_few_triton

    h, top_i, top_w, parts = _narrow_experts(T.Q4_K, T.Q6_K, 70)
    want = qdot_moe_few_torch(h, top_i, top_w, *parts)
    for splits in (2, 3):
        got = qdot_moe_few_triton(h, top_i, top_w, *parts, config=(32, 4, 1, 64, 1, splits))
        assert rel_err(got, want) <= MOE_TIGHT, splits
        assert torch.equal(qdot_moe_few_triton(h, top_i, top_w, *parts, config=(32, 4, 2, 64, 1, splits)), got)


@interp
def test_interp_qdot_moe_gate_up_k_lanes() -> None:
    """Q4_K/Q5_K gate/up with K in 2 lanes and two shares (D = 768: three super-blocks, shares of two and one, the
    second a masked lane step): the int8 reference's outputs; a Q6_K gate is refused."""
    from qspec.kernels.triton_qdot import qdot_moe_few_triton

    h, top_i, top_w, parts = _narrow_experts(T.Q4_K, T.Q5_K, 80)
    want = qdot_moe_few_torch(h, top_i, top_w, *parts)
    got = qdot_moe_few_triton(h, top_i, top_w, *parts, config=(8, 2, 1, 64, 1, 2, 2))
    assert rel_err(got, want) <= MOE_TIGHT
    q6 = qweight(T.Q6_K, (3, 32, 768), 85)
    with pytest.raises(ValueError, match="K lanes"):
        qdot_moe_few_triton(h, top_i, top_w, (q6.raw, int(T.Q6_K)), parts[1], parts[2], config=(8, 2, 1, 64, 1, 1, 2))


def _route_then_quantize(T_: int, E: int, D: int, Fd: int, k: int, device: str) -> None:
    """The routing kernel with the token rows to quantize in its launch: the same routing, bit for bit, as without
    them, the rows quantized exactly as the quantizer's own launch does, and the routed experts reading them give
    the outputs of the experts quantizing h themselves."""
    from qspec.kernels.route import route_top_k_quantized
    from qspec.kernels.triton_qdot import qdot_moe_few_triton, quantize_x_triton

    g = torch.Generator().manual_seed(T_)
    logits = torch.randn(T_, E, generator=g).bfloat16().to(device)
    h = torch.randn(T_, D, generator=g).bfloat16().to(device)
    w0, i0, none = route_top_k_quantized(logits, k, None)
    w1, i1, hq = route_top_k_quantized(logits, k, h)
    assert none is None and hq is not None
    assert torch.equal(w0, w1) and torch.equal(i0, i1)
    for got, want in zip(hq, quantize_x_triton(h), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    experts = [qweight(T.Q4_K, (E, Fd, D), 40, device), qweight(T.Q4_K, (E, Fd, D), 41, device),
               qweight(T.Q8_0, (E, D, Fd), 42, device)]
    parts = [(w.raw, int(w.qtype)) for w in experts]
    assert torch.equal(qdot_moe_few_triton(h, i1, w1, *parts, hquant=hq), qdot_moe_few_triton(h, i1, w1, *parts))


@interp
def test_interp_routing_quantizes_the_rows_in_its_launch() -> None:
    _route_then_quantize(2, 40, 256, 32, 2, "cpu")


@pytest.mark.cuda
def test_cuda_routing_quantizes_the_rows_in_its_launch() -> None:
    """As the interpreted test, compiled at the model's sizes (512 experts, top-10, 2,560-wide rows): the routing
    launched with FMA fusion off for the quantizer equals the routing launched with it on."""
    for T_ in (1, 6):
        _route_then_quantize(T_, 512, 2560, 640, 10, "cuda")


# ---- CUDA: the compiled kernels at the model's shapes ----------------------------------------------------------

MATRICES = [(T.Q6_K, 248320, 2560), (T.Q4_K, 248320, 2560), (T.Q4_K, 2560, 6144), (T.Q5_K, 2560, 6144),
            (T.Q6_K, 2560, 6144), (T.Q8_0, 2560, 6144), (T.Q4_0, 16480, 2560), (T.Q5_0, 2560, 640),
            (T.Q8_0, 1800, 2560)]


@pytest.mark.cuda
@pytest.mark.parametrize("qt,N,K", MATRICES)
def test_cuda_qdot_real_shapes(qt: GGMLQuantizationType, N: int, K: int) -> None:
    """The kernel against the int8 reference (f32 rows: TIGHT; bf16 rows: the same numbers rounded, the dispatch's
    for one row), against the f32 product (LOOSE), row independence, and dp4a's emulation equal to the instruction."""
    from qspec.kernels.qmatmul import int8_product, qmatmul
    from qspec.kernels.triton_qdot import qdot_matmul_triton

    w = qweight(qt, (N, K), seed=N, device="cuda", tile=8192)
    for M in (1, 4, 8):
        x = torch.randn(M, K, device="cuda")
        y = qdot_matmul_triton(x, w.raw, int(qt), N)
        assert rel_err(y, qdot_matmul_torch(x, w.raw, int(qt), N, K)) <= TIGHT, (M, "int8 reference")
        xb = x.bfloat16()
        yk = qdot_matmul_triton(xb, w.raw, int(qt), N)
        yb = qmatmul(xb, w)
        if int8_product(xb, int(qt), N):
            assert torch.equal(yb, yk), (M, "the dispatch takes the int8 kernel")
        assert rel_err(yk, qmatmul_torch(xb, w)) <= LOOSE, (M, "f32 product")
        for i in range(M):
            assert torch.equal(qdot_matmul_triton(xb[i:i + 1], w.raw, int(qt), N), yk[i:i + 1]), (M, i, "row")
    assert torch.equal(qdot_matmul_triton(xb, w.raw, int(qt), N, asm=False), yk), "dp4a emulation"


@pytest.mark.cuda
@pytest.mark.parametrize("gt,dt", [(T.Q4_K, T.Q5_0), (T.Q6_K, T.Q8_0), (T.Q5_K, T.Q5_0)])
def test_cuda_qdot_moe_real_shapes(gt: GGMLQuantizationType, dt: GGMLQuantizationType) -> None:
    """E = 512 experts of 640 x 2560, top-10, 1..16 tokens: the kernels against the int8 reference (f32 h:
    MOE_TIGHT, the intermediate's requantization may round an element one code differently), the dispatch with bf16 h
    against the f32 reference (LOOSE)."""
    from qspec.kernels.qmatmul import qmoe_few
    from qspec.kernels.triton_qdot import moe_config, qdot_moe_few_triton

    E, Fd, D, k = 512, 640, 2560, 10
    gate, up = qweight(gt, (E, Fd, D), 50, "cuda", 8192), qweight(gt, (E, Fd, D), 51, "cuda", 8192)
    down = qweight(dt, (E, D, Fd), 53, "cuda", 8192)
    parts = ((gate.raw, int(gt)), (up.raw, int(gt)), (down.raw, int(dt)))
    for T_ in (1, 4, 8, 16):
        h = torch.randn(T_, D, device="cuda")
        top_i, top_w = routing(T_, E, k, seed=T_, device="cuda")
        got = qdot_moe_few_triton(h, top_i, top_w, *parts)
        assert rel_err(got, qdot_moe_few_torch(h, top_i, top_w, *parts)) <= MOE_TIGHT, T_
        hb, twb = h.bfloat16(), top_w.bfloat16()
        yb = qmoe_few(hb, top_i, twb, gate, up, down)
        assert torch.equal(yb, qdot_moe_few_triton(hb, top_i, twb, *parts)), (T_, "the dispatch takes the int8 kernels")
        assert rel_err(yb, qmoe_few_torch(hb, top_i, twb, gate, up, down)) <= LOOSE, T_
        assert torch.equal(qdot_moe_few_triton(hb, top_i, twb, *parts, asm=False), yb), (T_, "dp4a emulation")
        default = moe_config(int(gt))
        for cfg in (default._replace(unroll=2), default._replace(unroll=1, down_unroll=1)):  # the same sums
            assert torch.equal(qdot_moe_few_triton(hb, top_i, twb, *parts, config=cfg), yb), (T_, cfg)
        # programs of other shapes may add the f32 block sums in another order on the GPU (16 rows, 4 warps: seen at
        # Q4_K and Q5_K, 24b0225): the same numbers to rounding, not the same bits; the output is bf16, so an element
        # can also round to the neighbouring bf16 value (one at the largest element is 2^-8 of it: seen at Q4_K/Q5_0,
        # 4647467)
        for cfg in ((8, 2, 5, 16, 3), (16, 4, 10, 32, 3), (4, 1, 5, 16, 3, 2), (4, 1, 2, 16, 3, 5)):
            got_cfg = qdot_moe_few_triton(hb, top_i, twb, *parts, config=cfg)
            assert rel_err(got_cfg, yb) <= MOE_TIGHT + 2.0 ** -8, (T_, cfg)
        # gate/up's K in five shares (the act quantizer adds them): another unroll inside a share, the same bits
        assert torch.equal(qdot_moe_few_triton(hb, top_i, twb, *parts, config=(4, 1, 1, 16, 3, 5)),
                           qdot_moe_few_triton(hb, top_i, twb, *parts, config=(4, 1, 2, 16, 3, 5))), T_


@pytest.mark.cuda
@pytest.mark.parametrize("lanes", [2, 4, 8])
def test_cuda_k_lanes_real_shapes(lanes: int) -> None:
    """Q4_K/Q5_K products with each row's K in lanes (K_LANE_CONFIGS): the int8 reference's numbers, a row's bits
    whatever the row count (1-4), the Q4_K_M GDN input stack equal to its parts, at the model's shapes."""
    from qspec.kernels.triton_qdot import K_LANE_CONFIGS, qdot_matmul_triton, qdot_stacked_triton

    cfg = K_LANE_CONFIGS[lanes]
    for qt, N, K in ((T.Q4_K, 16480, 2560), (T.Q5_K, 2560, 6144), (T.Q4_K, 1800, 2560), (T.Q4_K, 13952, 2560)):
        w = qweight(qt, (N, K), seed=N + lanes, device="cuda", tile=8192)
        x = torch.randn(4, K, device="cuda")
        y = qdot_matmul_triton(x, w.raw, int(qt), N, cfg)
        assert rel_err(y, qdot_matmul_torch(x, w.raw, int(qt), N, K)) <= TIGHT, (qt, N, K)
        for i in range(4):
            assert torch.equal(qdot_matmul_triton(x[i:i + 1], w.raw, int(qt), N, cfg), y[i:i + 1]), (qt, N, K, i)
    ws = [qweight(T.Q5_K, (10240, 2560), 60, "cuda", 8192), qweight(T.Q4_K, (6240, 2560), 61, "cuda", 8192)]
    x = torch.randn(1, 2560, device="cuda").bfloat16()
    y = qdot_stacked_triton(x, [(w.raw, int(w.qtype)) for w in ws], cfg)
    assert torch.equal(y, torch.cat([qdot_matmul_triton(x, w.raw, int(w.qtype), w.shape[0], cfg) for w in ws], -1))


@pytest.mark.cuda
def test_cuda_engine_k_lanes(tmp_path: Path) -> None:
    """A Q4_K_M model 1,024 wide (four super-blocks a row), plain decoding and MTP3 in CUDA graphs: with --k-lanes
    4 (its Q4_K/Q5_K products' K in lanes) the tokens of the default, the logits up to the lanes' summation order."""
    from qspec.engine import Engine, EngineHooks, EngineOptions
    from qspec.loader import load_model, write_model

    cfg = tiny_config(mtp=True).with_(hidden=1024, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    prompt = list(range(3, 40))
    for draft in (0, 3):
        runs = {lanes: Engine(model, EngineOptions(draft=draft, capacity=256, k_lanes=lanes),
                              EngineHooks(record_logits=True)).generate(prompt, 12) for lanes in (1, 4)}
        assert runs[4].graphs["replays"] > 0 and runs[4].tokens == runs[1].tokens, draft
        for a, b in zip(runs[4].logits, runs[1].logits, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.float().abs().max().item())


@pytest.mark.cuda
def test_cuda_stacked_pair_real_shapes() -> None:
    """A two-type stack at GDN's input shapes (10,240 rows in Q5_K, 6,240 in Q4_K, K = 2,560; their splits differ): both
    parts in one launch equal each part's own launch, bit for bit, and the int8 reference; the partial sums added in
    the product's launch equal those of a sum launch, also when replayed in a CUDA graph."""
    from qspec.kernels import triton_common, triton_qdot
    from qspec.kernels.triton_common import module_flag
    from qspec.kernels.triton_qdot import qdot_stacked_triton

    K = 2560
    ws = [qweight(T.Q5_K, (10240, K), 60, "cuda", 8192), qweight(T.Q4_K, (6240, K), 61, "cuda", 8192)]
    parts = [(w.raw, int(w.qtype)) for w in ws]
    x = torch.randn(1, K, device="cuda").bfloat16()
    y = qdot_stacked_triton(x, parts)
    with module_flag(triton_qdot.__name__, "PAIR_PARTS", False):
        assert torch.equal(qdot_stacked_triton(x, parts), y)
    with module_flag(triton_common.__name__, "SUM_IN_PRODUCT", False):
        assert torch.equal(qdot_stacked_triton(x, parts), y), "the partial sums added by a launch of their own"
    ref = torch.cat([qdot_matmul_torch(x.float(), w.raw, int(w.qtype), w.shape[0], K) for w in ws], dim=-1)
    assert rel_err(y, ref) <= TOL16[torch.bfloat16]
    # in a CUDA graph, replayed: each replay finds the arrival counters at 0 again
    out = torch.empty_like(y)
    qdot_stacked_triton(x, parts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(qdot_stacked_triton(x, parts))
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, y)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in triton_common._COUNTERS.values())
