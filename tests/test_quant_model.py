"""A quantized GGUF runs with its matrices kept as GGUF blocks: the loader, the model's block paths, the writer's
per-tensor type mix, and the engine's guarantees (greedy speculative == plain, seed optimizations) with them."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as Q

from qspec.config import preset
from qspec.engine import Engine, EngineHooks, EngineOptions
from qspec.kernels.q4 import Q4Weight
from qspec.loader import load_model, write_model
from qspec.model import ops
from qspec.model.model import CacheOptions, Model
from qspec.model.moe import grouped_moe_reference, q_moe_slots
from qspec.model.mtp import DraftHead, q4_head
from qspec.model.ops import StackedWeight, embed_rows, linear, stack_rows
from qspec.runner import Runner
from qspec.weights import WeightsError, read_gguf
from qspec.weights.dequant import quantize_q4_0, quantize_q8_0
from qspec.weights.gguf_io import HostRowTable
from qspec.weights.names import tensor_shapes
from qspec.weights.quant_mix import keep_packed, mix_plan, mix_qtype, use_more_bits
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight

CAP = 128
# Logits of a block model against the same file expanded to f32: the products differ only in summation order
# (blocks expanded inside the product vs before it), so f32 rounding alone: ~1e-7 relative on the tiny model.
ATOL = RTOL = 1e-5


_FILES: dict[Q, Path] = {}
_MODELS: dict[Q, tuple[Model, Model]] = {}


def _file(qt: Q, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if qt not in _FILES:
        _FILES[qt] = tmp_path_factory.mktemp("quant") / f"tiny-{qt.name}.gguf"
        write_model(_FILES[qt], tiny_config(mtp=True), qtype=qt)
    return _FILES[qt]


def _models(qt: Q, tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    """(the file with its matrices as blocks, the same file with every tensor expanded to f32)."""
    if qt not in _MODELS:
        p = _file(qt, tmp_path_factory)
        _MODELS[qt] = load_model(p, dequantize_all=False), load_model(p, dequantize_all=True)
    return _MODELS[qt]


@pytest.fixture(scope="module", params=[Q.Q8_0, Q.Q4_0], ids=["q8_0", "q4_0"])
def qfile(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Q]:
    return _file(request.param, tmp_path_factory), request.param


@pytest.fixture(scope="module")
def qmodels(qfile: tuple[Path, Q], tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    return _models(qfile[1], tmp_path_factory)


def _tensors(obj: object, seen: set[int], out: list[torch.Tensor | QuantWeight], stacked: set[int] | None = None
             ) -> None:
    """Every tensor and QuantWeight reachable from the model's attributes; `stacked` gets the ids of the parts of
    mixed stacks (ops.StackedWeight)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, QuantWeight)):
        out.append(obj)
    elif isinstance(obj, StackedWeight):
        for p in obj.parts:
            if stacked is not None:
                stacked.add(id(p))
            _tensors(p, seen, out, stacked)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, seen, out, stacked)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, seen, out, stacked)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("qspec"):
        for x in vars(obj).values():
            _tensors(x, seen, out, stacked)


def _assert_float_rows(part: torch.Tensor, file_floats: list[torch.Tensor]) -> None:
    """`part` [R, K] holds rows of float file tensors of width K (a sum of their row counts, a 1-D one a row) then
    fewer than ROW_ALIGN zero rows: no block matrix was expanded into it."""
    nonzero = part.reshape(-1, part.shape[-1]).abs().amax(dim=1).nonzero()
    used = int(nonzero[-1]) + 1 if len(nonzero) else 0
    assert part.shape[0] - used < ops.ROW_ALIGN, (tuple(part.shape), used)
    sums = 1  # bit n set: n rows are some float tensors' rows together
    for v in file_floats:
        if v.shape[-1] == part.shape[-1]:
            sums |= sums << (v.numel() // v.shape[-1])
    assert sums >> used & 1, f"a float stack part of {used} rows is not float file tensors of width {part.shape[-1]}"


def test_packed_file_loads_as_blocks_with_no_float_copy(qfile: tuple[Path, Q], qmodels: tuple[Model, Model]) -> None:
    path, qt = qfile
    model, _ = qmodels
    file_types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    _, w = read_gguf(path)
    packed = {n for n, q in file_types.items() if q in PACKED_QTYPES and keep_packed(n)}
    assert packed and {file_types[n] for n in packed} == {qt}
    for n in packed:
        if n.endswith("ffn_gate_up_exps.weight"):
            continue
        assert isinstance(w[n], QuantWeight) and w[n].qtype == qt, n
    # the model holds no float copy of them: its float bytes are those of the expanded (non-block) tensors
    found: list[torch.Tensor | QuantWeight] = []
    stacked: set[int] = set()
    _tensors(model, set(), found, stacked)
    floats = [t for t in found if isinstance(t, torch.Tensor) and t.is_floating_point()]
    float_bytes = sum(t.numel() * t.element_size() for t in floats)
    expanded = sum(v.numel() * 4 for n, v in w.items() if isinstance(v, torch.Tensor))
    blocks_as_f32 = sum(math.prod(v.shape) * 4 for v in w.values() if isinstance(v, QuantWeight))
    assert float_bytes <= 1.25 * expanded < blocks_as_f32  # stacking pads the mixers' rows a little, no more
    float_shapes = {tuple(v.shape) for v in w.values() if isinstance(v, torch.Tensor)}
    block_shapes = {s for v in w.values() if isinstance(v, QuantWeight) for s in (v.shape, v.shape[-2:])}
    bad = {tuple(t.shape) for t in floats if id(t) not in stacked} & (block_shapes - float_shapes)
    assert not bad, bad
    # the float parts of mixed stacks (a router beside block rows) have shapes of their own, padded to whole row
    # groups: each must be float file tensors' rows of its width plus fewer than ROW_ALIGN zero rows
    for t in (t for t in floats if id(t) in stacked):
        _assert_float_rows(t, [v for v in w.values() if isinstance(v, torch.Tensor)])
    assert isinstance(model.embed, QuantWeight) and isinstance(model.moe[0].down, QuantWeight)
    assert qt.name in model.weights_summary and "n-gram table in host memory" in model.weights_summary


def test_block_logits_equal_the_expanded_reference(qmodels: tuple[Model, Model]) -> None:
    """Prefill (grouped experts) and one-token steps (few-token path) of the block model against the same file
    expanded to f32, to ATOL/RTOL."""
    model, ref = qmodels
    ids = torch.tensor([5, 17, 300, 2, 99, 410, 7, 8, 63, 250])
    runs = [Runner(m, CacheOptions(capacity=32)) for m in (model, ref)]
    for step in (ids, ids[:1], ids[3:6]):
        a, b = (r.step(step)[0] for r in runs)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
        assert (a - b).abs().max() > 0 or torch.equal(a, b)
        for r in runs:
            r.keep(step.shape[0], rollback=False)


def test_block_logits_match_in_row_exact_mode(qmodels: tuple[Model, Model]) -> None:
    model, ref = qmodels
    ids = torch.tensor([3, 1, 4, 1, 5])
    with ops.row_exact_mode(True):
        a, b = (Runner(m, CacheOptions(capacity=16)).step(ids)[0] for m in (model, ref))
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_greedy_spec_equals_plain_with_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Exact mode, bit for bit (Q4_0: every matrix a block product; the engine paths are type-independent)."""
    model, _ = _models(Q.Q4_0, tmp_path_factory)
    n_draft = 3
    rng = random.Random(n_draft)
    prompt = [rng.randrange(511) for _ in range(19)]
    ref = Engine(model, EngineOptions(draft=0, capacity=CAP, exact=True)).generate(prompt, 16).tokens

    def hook(n_out: int, drafts: list[int]) -> list[int]:  # the reference continuation, cut at a random place
        good = (ref[n_out:n_out + len(drafts)] + [0] * len(drafts))[:len(drafts)]
        cut = rng.randint(0, len(drafts))
        if cut < len(drafts):
            good[cut] = (good[cut] + 1) % 512
        return good

    g = Engine(model, EngineOptions(draft=n_draft, capacity=CAP, exact=True),
               EngineHooks(draft_hook=hook)).generate(prompt, 16)
    assert g.tokens == ref
    assert 0 < g.spec.accepted < g.spec.drafted


def test_seed_optimizations_change_nothing_with_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, _ = _models(Q.Q8_0, tmp_path_factory)
    prompt = [random.Random(1).randrange(511) for _ in range(13)]
    results = []
    for on in (False, True):
        rng = random.Random(7)
        eng = Engine(model, EngineOptions(draft=4, capacity=CAP, exact=True, preserve_pooled=on, incremental_pooled=on,
                                          pad_target=8 if on else None, fused_snapshots=on),
                     EngineHooks(accept_hook=lambda r, n, rng=rng: rng.randint(0, n), record_logits=True))
        g = eng.generate(prompt, 12)
        results.append((g.tokens, g.logits, eng.runner.committed_state()))
    (t0, l0, s0), (t1, l1, s1) = results
    assert t0 == t1
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_q4_draft_head_from_a_block_head(qmodels: tuple[Model, Model], qfile: tuple[Path, Q]) -> None:
    model, ref = qmodels
    head = model.lm_head
    assert isinstance(head, QuantWeight)
    q4 = q4_head(head)
    if qfile[1] == Q.Q4_0:  # reused as stored: no second rounding
        assert torch.equal(q4.dequantize(), head.dequantize())
    else:
        want = Q4Weight.from_dense(head.dequantize(torch.float32))
        assert torch.equal(q4.packed, want.packed) and torch.equal(q4.scales, want.scales)
    if qfile[1] == Q.Q4_0:  # the engine's q4 option end to end (the output is the target's)
        g = Engine(model, EngineOptions(draft=3, capacity=CAP, draft_head="q4")).generate([1, 2, 3], 6).tokens
        assert g == Engine(model, EngineOptions(draft=0, capacity=CAP)).generate([1, 2, 3], 6).tokens
    ids = torch.tensor([0, 5, 9, 400])
    sub = DraftHead.rows_of(head, ids)
    x = torch.randn(2, head.shape[1])
    torch.testing.assert_close(linear(x, sub.weight), linear(x, ref.lm_head)[:, ids], atol=ATOL, rtol=RTOL)


def test_stack_rows_mixes_types_without_expanding() -> None:
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(n, 64, generator=g) for n in (5, 7, 3))
    qa = QuantWeight.from_blocks(quantize_q8_0(a), Q.Q8_0, a.shape)
    qb = QuantWeight.from_blocks(quantize_q8_0(b), Q.Q8_0, b.shape)
    qc = QuantWeight.from_blocks(quantize_q4_0(c), Q.Q4_0, c.shape)
    router = torch.randn(4, 64, generator=g)
    gate_inp = torch.randn(64, generator=g)
    W, views = stack_rows(router, qa, qb, qc, gate_inp[None, :])
    assert isinstance(W, StackedWeight) and len(W.parts) == 4  # f32 | Q8_0 (a and b as one) | Q4_0 | f32
    assert W.shape == (4 + 5 + 7 + 3 + 8, 64)  # the float last part padded to whole row groups (ops.ROW_ALIGN)
    x = torch.randn(3, 64, generator=g)
    dense = torch.cat([router, qa.dequantize(), qb.dequantize(), qc.dequantize(), gate_inp[None, :]])
    torch.testing.assert_close(linear(x, W)[:, :20], x @ dense.t(), atol=ATOL, rtol=RTOL)
    assert not linear(x, W)[:, 20:].any()
    for v, want in zip(views, (router, qa, qb, qc, gate_inp[None, :]), strict=True):
        got = v.dequantize() if isinstance(v, QuantWeight) else v
        torch.testing.assert_close(got, want.dequantize() if isinstance(want, QuantWeight) else want)
    same, _ = stack_rows(qa, qb)
    assert isinstance(same, QuantWeight) and same.shape == (12, 64)


def test_embedding_rows_expand_only_the_gathered_rows() -> None:
    t = torch.randn(50, 64)
    q = QuantWeight.from_blocks(quantize_q4_0(t), Q.Q4_0, t.shape)
    tok = torch.tensor([3, 3, 49, 0])
    assert torch.equal(embed_rows(q, tok, torch.float32), q.dequantize()[tok])


def test_block_expert_paths_equal_the_expanded_experts() -> None:
    g = torch.Generator().manual_seed(1)
    E, F, D, T, k = 6, 32, 64, 5, 2
    mats = [torch.randn(E, F, D, generator=g) / 8, torch.randn(E, F, D, generator=g) / 8,
            torch.randn(E, D, F, generator=g) / 8]
    qs = [QuantWeight.from_blocks(quantize_q8_0(m), Q.Q8_0, m.shape) for m in mats]
    dense = [q.dequantize() for q in qs]
    h = torch.randn(T, D, generator=g)
    top_i = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 2], [3, 4]])
    top_w = torch.rand(T, k, generator=g)
    want = grouped_moe_reference(h, top_w, top_i, *dense)
    torch.testing.assert_close(grouped_moe_reference(h, top_w, top_i, *qs), want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(q_moe_slots(h, top_i, top_w, *qs).sum(1), want, atol=ATOL, rtol=RTOL)


def test_q4_k_m_mix_follows_llama_cpp_rules() -> None:
    """The per-tensor types of llama.cpp's llama-quantize (tests/test_llama_cpp.py compares whole files with it)."""
    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256, n_experts=16)
    plan = mix_plan("q4_k_m", cfg)
    n = cfg.n_layers
    assert plan["output.weight"] == Q.Q6_K and plan["token_embd.weight"] == Q.Q4_K
    for i in range(n):
        more = Q.Q6_K if use_more_bits(i, n) else Q.Q4_K
        # every FFN down projection, the mixer's hc_ffn_down too ("ffn_down" in its name), by its layer
        assert plan[f"blk.{i}.ffn_down_exps.weight"] == plan[f"blk.{i}.hc_ffn_down.weight"] == more, i
        assert plan[f"blk.{i}.ffn_gate_inp.weight"] == Q.F32  # routers stay exact
        assert plan[f"blk.{i}.ffn_gate_inp_shexp.weight"] == Q.F32
        # the mixers' other matrices are quantized as any other; their norms stay F32
        assert plan[f"blk.{i}.hc_attn_down.weight"] == plan[f"blk.{i}.hc_ffn_inject.weight"] == Q.Q4_K
        r = cfg.hc_rank
        assert plan[f"blk.{i}.hc_ffn_up.weight"] == (Q.Q4_K if r % 256 == 0 else Q.Q5_0 if r % 32 == 0 else Q.F16)
        assert plan[f"blk.{i}.hc_attn_norm.weight"] == Q.F32
        if cfg.layer_recurrent[i]:  # GDN's fused qkv as attention V: one of them a layer, by layer
            assert plan[f"blk.{i}.attn_qkv.weight"] == more, i
            assert plan[f"blk.{i}.ssm_conv1d.weight"] == Q.F32
        else:
            assert plan[f"blk.{i}.attn_v.weight"] == more, i
            assert plan[f"blk.{i}.indexer.q_proj.weight"] == plan[f"blk.{i}.indexer.k_proj.weight"] == Q.F32
    assert plan["blk.1.ple_conv1d.weight"] == Q.F16  # 4-tap rows: no whole 32-weight blocks
    assert [use_more_bits(i, 48) for i in range(9)] == [True] * 6 + [False, False, True]
    # 8-expert models: attention K/V/qkv Q8_0, the attention output Q5_K (its 128-wide rows here: Q5_1)
    eight = mix_plan("q4_k_m", cfg.with_(n_experts=8))
    assert eight["blk.0.attn_qkv.weight"] == eight["blk.3.attn_k.weight"] == eight["blk.3.attn_v.weight"] == Q.Q8_0
    assert eight["blk.3.attn_output.weight"] == Q.Q5_1 and plan["blk.3.attn_output.weight"] == Q.Q5_0
    # rows that are not whole 256-weight super-blocks fall back as llama.cpp's (Q4_K -> Q5_0, Q5_K -> Q5_1,
    # Q6_K -> Q8_0), not whole 32-blocks to F32
    tiny = tiny_config()
    assert mix_plan("q4_k_m", tiny)["blk.0.ffn_gate_exps.weight"] == Q.Q5_0
    assert mix_plan("q5_k_m", tiny)["blk.1.ffn_gate_exps.weight"] == Q.Q5_1
    assert mix_plan("q6_k", tiny)["blk.0.ffn_gate_exps.weight"] == Q.Q8_0
    assert mix_plan("q8_0", cfg)["output.weight"] == Q.Q8_0
    with pytest.raises(WeightsError, match="unknown quantization mix"):
        mix_plan("q3_k", cfg)


def test_q4_k_m_mix_matches_a_llama_quantize_file_size() -> None:
    """llama-quantize's Q4_K_M file of the 8-layer flash-next geometry (no MTP block, no n-gram table) holds
    13.69 GiB at 5.34 bits per weight; the mix's types give the same within 0.3% (they would give 14.07 GiB, 5.48
    bits, with the mixers' matrices kept F32)."""
    cfg = preset("flash-next", layers=8)
    shapes = {n: s for n, s in tensor_shapes(cfg, with_mtp=False).items() if not n.startswith("per_layer_token")}
    plan = {n: mix_qtype("q4_k_m", n, s, cfg.n_layers) for n, s in shapes.items()}
    weights = sum(math.prod(s) for s in shapes.values())
    nbytes = sum(math.prod(s) // GGML_QUANT_SIZES[plan[n]][0] * GGML_QUANT_SIZES[plan[n]][1]
                 for n, s in shapes.items())
    assert plan["blk.0.hc_attn_up.weight"] == Q.Q5_0  # 320-wide rows: Q4_K's fallback
    assert abs(nbytes / 2**30 - 13.69) < 0.04 and abs(8 * nbytes / weights - 5.34) < 0.01, (nbytes, weights)


def test_q8_0_mix_file_equals_the_same_types_quantized_at_load(tmp_path: Path) -> None:
    """make-model's q8_0 mix written to GGUF and an HF checkpoint quantized at load (--quantize q8_0) hold the same
    blocks, so their logits are equal."""
    cfg = tiny_config(mtp=False)
    write_model(tmp_path / "m.gguf", cfg, quant="q8_0")
    write_model(tmp_path / "hf", cfg, fmt="hf")
    types = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == Q.F32 and types["blk.0.ffn_down_exps.weight"] == Q.Q8_0
    a = load_model(tmp_path / "m.gguf", dequantize_all=False)
    b = load_model(tmp_path / "hf", quantize="q8_0")
    assert isinstance(b.moe[0].down, QuantWeight)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    la, lb = (Runner(m, CacheOptions(capacity=16)).step(ids)[0] for m in (a, b))
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=RTOL)
    with pytest.raises(WeightsError, match="--quantize applies to HF"):
        load_model(tmp_path / "m.gguf", quantize="q8_0")


def test_k_mix_file_loads_as_k_blocks(tmp_path: Path) -> None:
    cfg = tiny_config(mtp=False).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "k.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "k.gguf", dequantize_all=False)
    ref = load_model(tmp_path / "k.gguf", dequantize_all=True)
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.qtype == Q.Q6_K
    # the stacked input projections: each a block run and at most one 16-bit run (one quantization of x, one product
    # of the float parts): GDN's qkv (Q6_K or Q4_K by layer) beside its Q4_K gate/beta/alpha, the MoE's Q4_K shared
    # gate/up beside the float router and shared gate_inp
    for layer, moe in zip(model.layers, model.moe, strict=True):
        for w in (layer.w_in, moe.w_in):
            parts = w.parts if isinstance(w, StackedWeight) else (w,)
            kinds = [isinstance(p, QuantWeight) for p in parts]
            assert kinds.count(False) <= 1 and kinds == sorted(kinds, reverse=True), [type(p) for p in parts]
    ids = torch.tensor([1, 2, 3])
    a, b = (Runner(m, CacheOptions(capacity=16)).step(ids)[0] for m in (model, ref))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_weights_device_bytes_are_known_before_they_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a GGUF loads, its weights' device bytes are counted from the file (blocks as their bytes, the rest at
    the load's dtype, the n-gram table left on the host): at most what the load then holds, within 5%; a GPU with
    less free memory is one error naming both sizes."""
    from qspec.weights import gguf_io

    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "k.gguf", cfg, quant="q4_k_m")
    seen: dict[str, int] = {}
    monkeypatch.setattr(gguf_io, "check_weights_fit", lambda path, need, device, **kw: seen.update(need=need))
    _, w = read_gguf(tmp_path / "k.gguf")
    held, ids = 0, set()
    for v in w.values():
        if id(v) not in ids and isinstance(v, (QuantWeight, torch.Tensor)):
            ids.add(id(v))
            held += v.nbytes if isinstance(v, QuantWeight) else v.numel() * v.element_size()
    need = seen["need"]
    assert any(isinstance(v, QuantWeight) for v in w.values()) and need <= held <= 1.05 * need
    monkeypatch.undo()
    gguf_io.check_weights_fit(tmp_path / "k.gguf", need, torch.device("cuda"), free=need)
    with pytest.raises(WeightsError, match=r"k\.gguf: its weights take at least [\d.]+ MiB of GPU memory and "
                                           r"[\d.]+ MiB is free on cuda"):
        gguf_io.check_weights_fit(tmp_path / "k.gguf", need, torch.device("cuda"), free=need - 1)


def test_progress_goes_to_stderr_when_asked(qfile: tuple[Path, Q], capsys: pytest.CaptureFixture[str]) -> None:
    _, w = read_gguf(qfile[0], progress=True)
    err = capsys.readouterr().err
    n = len([t for t in GGUFReader(qfile[0]).tensors if t.name != "per_layer_token_embd.weight"])
    assert f"loading {n}/{n} tensors" in err and err.endswith("(100%)\n")
    assert isinstance(w["per_layer_token_embd.weight"], HostRowTable)


def test_make_model_quant_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qspec.cli import main

    p = tmp_path / "m.gguf"
    assert main(["make-model", str(p), "--vocab-size", "256", "--no-mtp", "--quant", "q8_0"]) == 0
    types = {t.name: t.tensor_type for t in GGUFReader(p).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == Q.F32 and types["blk.0.ffn_up_exps.weight"] == Q.Q8_0
    assert types["blk.0.hc_attn_down.weight"] == Q.Q8_0 and types["output.weight"] == Q.Q8_0
    assert types["blk.0.hc_attn_norm.weight"] == Q.F32
    capsys.readouterr()
    assert main(["make-model", str(tmp_path / "x.gguf"), "--qtype", "q8_0", "--quant", "q8_0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["qspec: error: --qtype and --quant are exclusive"]


def test_fused_gate_up_blocks_split_by_rows() -> None:
    from qspec.weights.gguf_io import _split_fused

    x = torch.randn(3, 2 * 8, 64)
    q = QuantWeight.from_blocks(quantize_q8_0(x), Q.Q8_0, x.shape)
    gate, up = _split_fused(q, "gate"), _split_fused(q, "up")
    assert isinstance(gate, QuantWeight) and gate.shape == (3, 8, 64)
    assert torch.equal(gate.dequantize(), q.dequantize()[:, :8]) and torch.equal(up.dequantize(), q.dequantize()[:, 8:])


def test_device_model_generator_takes_a_quant_mix() -> None:
    from qspec.bench.device_model import bench_config, device_random_model

    m = device_random_model(bench_config("tiny", vocab_size=512), device="cpu", dtype=torch.float32, quant="q4_0")
    assert isinstance(m.moe[0].gate, QuantWeight) and m.moe[0].gate.qtype == Q.Q4_0
    assert isinstance(m.lm_head, QuantWeight) and m.lm_head.qtype == Q.Q8_0  # Q6_K's fallback for 64-wide rows
    assert "Q4_0 (blocks)" in m.weights_summary
    assert torch.isfinite(Runner(m, CacheOptions(capacity=16)).step(torch.tensor([1, 2, 3]))[0]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("mix,fuse_blocks", [("q4_k_m", False), ("q8_0", False), ("q4_k_m", True)])
def test_cuda_block_model_in_graphs(tmp_path: Path, mix: str, fuse_blocks: bool) -> None:
    """On the GPU a block model keeps its blocks, runs its steps as CUDA graphs (the experts through qmoe_few, no
    host sync), its bf16 logits follow the expanded model's, and greedy MTP3 gives plain decoding's tokens; with
    fuse_blocks, the functions around the block products compiled by inductor too."""
    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "m.gguf", cfg, quant=mix)
    model = load_model(tmp_path / "m.gguf", device="cuda")
    ref = load_model(tmp_path / "m.gguf", device="cuda", dequantize_all=True)
    assert isinstance(model.lm_head, QuantWeight) and model.graph_safe
    prompt = list(range(3, 40))
    plain = Engine(model, EngineOptions(draft=0, capacity=CAP, fuse_blocks=fuse_blocks),
                   EngineHooks(record_logits=True)).generate(prompt, 24)
    expanded = Engine(ref, EngineOptions(draft=0, capacity=CAP), EngineHooks(record_logits=True)).generate(prompt, 24)
    first = plain.logits[0].float()
    rel = ((first - expanded.logits[0].float()).norm() / expanded.logits[0].float().norm()).item()
    assert rel < 3e-2, rel  # bf16 activations; blocks expanded inside the product or before it
    assert plain.graphs["replays"] > 0 and plain.graphs["captures"] > 0
    spec = Engine(model, EngineOptions(draft=3, capacity=CAP, fuse_blocks=fuse_blocks)).generate(prompt, 24)
    agree = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens, strict=True)) if a != b), None)
    assert agree is None or agree > 8, (spec.tokens, plain.tokens)  # bf16: equal up to a near tie late on


def test_prefill_block_experts_grouped_by_bounded_groups() -> None:
    """Prefill's block experts through grouped GEMMs on experts expanded a group at a time: any scratch size gives
    the same rows (the groups only partition the experts), and they follow the expanded experts' f32 products."""
    from qspec.model.moe import grouped_block_experts

    g = torch.Generator().manual_seed(3)
    E, Fd, D, n = 6, 64, 64, 40

    def blocks(*shape: int) -> QuantWeight:
        return QuantWeight.from_blocks(quantize_q8_0(torch.randn(*shape, generator=g) / 8), Q.Q8_0, shape)

    gate, up, down = blocks(E, Fd, D), blocks(E, Fd, D), blocks(E, D, Fd)
    counts = [7, 0, 12, 5, 0, 16]
    x = torch.randn(n, D, generator=g).bfloat16()
    one = grouped_block_experts(x, counts, gate, up, down)
    per_expert = (2 * Fd * D + D * Fd) * 2
    for experts_per_group in (1, 2, 4):
        assert torch.equal(grouped_block_experts(x, counts, gate, up, down, experts_per_group * per_expert), one)
    ref, r = [], 0
    for e, c in enumerate(counts):
        xe = x[r:r + c].float()
        act = torch.nn.functional.silu(xe @ gate[e].dequantize().t()) * (xe @ up[e].dequantize().t())
        ref.append(act @ down[e].dequantize().t())
        r += c
    want = torch.cat(ref)
    assert ((one.float() - want).norm() / want.norm()).item() < 2e-2  # bf16 activations and weights


def test_prefill_chunk_defaults_to_longer_steps_for_block_experts() -> None:
    """A model whose routed experts are blocks prefills in 4,096-token steps (each step expands every chosen expert
    once), a 16-bit one in 512; an explicit --prefill-chunk wins."""
    from qspec.bench.device_model import bench_config, device_random_model
    from qspec.engine import BLOCK_PREFILL_CHUNK, PREFILL_CHUNK

    cfg = bench_config("tiny", vocab_size=512)
    blocks = device_random_model(cfg, device="cpu", dtype=torch.float32, quant="q8_0")
    plain = device_random_model(cfg, device="cpu", dtype=torch.float32)
    assert Engine(blocks, EngineOptions(capacity=64)).prefill_chunk == BLOCK_PREFILL_CHUNK
    assert Engine(plain, EngineOptions(capacity=64)).prefill_chunk == PREFILL_CHUNK
    assert Engine(blocks, EngineOptions(capacity=64, prefill_chunk=16)).prefill_chunk == 16


@pytest.mark.parametrize("rows", [1, 3])
def test_shared_expert_apart_from_router_same_output(rows: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With block shared-expert projections beside a float router, MoE.forward_side_stream (on CUDA: the shared
    expert on a second stream) computes the very products and roundings of MoE.forward: bit-equal outputs."""
    path = tmp_path_factory.mktemp("split") / "m.gguf"
    write_model(path, tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256), quant="q4_k_m")
    model, expanded = load_model(path, dequantize_all=False), load_model(path, dequantize_all=True)
    assert all(m.split is not None for m in model.moe) and all(m.split is None for m in expanded.moe)
    g = torch.Generator().manual_seed(rows)
    for m in model.moe:
        h = torch.randn(rows, model.cfg.hidden, generator=g)
        assert torch.equal(m.forward_side_stream(h), m.forward(h))


def test_shared_expert_as_one_more_routed_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the shared expert's blocks match the routed experts' (every layer of a Q4_K_M file), MoE holds it as
    expert E of their tensors, the model's own entries views of those (nothing held twice), and
    MoE.forward_shared_pair (routing with a k + 1-th slot of weight sigmoid(gate logit), the experts' launches over
    all slots) gives MoE.forward's output up to rounding order; a file with another type for it is left apart."""
    from qspec.model import moe

    monkeypatch.setattr(moe, "MERGE_DEVICES", ("cpu",))  # merged on CUDA only in use: the host's tensors map the file
    write_model(tmp_path / "m.gguf", tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256),
                quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", dequantize_all=False)
    assert all(m.merged is not None for m in model.moe)
    g = torch.Generator().manual_seed(0)
    for m in model.moe:
        E = m.gate.shape[0]
        assert all(x.shape[0] == E + 1 for x in m.merged)
        assert m.gate.raw.data_ptr() == m.merged[0].raw.data_ptr()
        assert m.sh_down.raw.data_ptr() == m.merged[2].raw[E].data_ptr()
        h = torch.randn(3, model.cfg.hidden, generator=g)
        torch.testing.assert_close(m.forward_shared_pair(h), m.forward(h), rtol=1e-4, atol=1e-5)
    w = {"blk.0.ffn_gate_exps.weight": model.moe[0].gate, "blk.0.ffn_up_exps.weight": model.moe[0].up,
         "blk.0.ffn_down_exps.weight": model.moe[0].down, "blk.0.ffn_gate_shexp.weight": model.moe[0].sh_gate,
         "blk.0.ffn_up_shexp.weight": model.moe[0].sh_up, "blk.0.ffn_down_shexp.weight": torch.zeros(256, 256)}
    assert moe.merge_shared_expert(dict(w), "blk.0") is None


@pytest.mark.cuda
def test_cuda_shared_pair_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, in CUDA graphs, plain decoding and MTP3 with the shared expert as one more routed pair: the merged
    path runs, and tokens and logits stay those of the shared expert apart up to its rounding order (tokens equal, or
    equal up to a near tie of the run apart; logits close up to there)."""
    from test_gpu_engine import NEAR_TIE, _steps_before, first_diff, same_or_tie

    from qspec.model import moe

    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    assert all(m.merged is not None for m in model.moe)
    calls = []
    pair = moe.MoE.forward_shared_pair
    monkeypatch.setattr(moe.MoE, "forward_shared_pair", lambda self, h: calls.append(1) or pair(self, h))
    prompt = list(range(3, 40))
    for draft in (0, 3):
        runs = {on: Engine(model, EngineOptions(draft=draft, capacity=CAP, shared_pair=on),
                           EngineHooks(record_logits=True)).generate(prompt, 12) for on in (False, True)}
        assert calls and runs[True].graphs["replays"] > 0
        ok, why = same_or_tie(runs[True].tokens, runs[False], draft, NEAR_TIE)
        assert ok, why
        cut = first_diff(runs[True].tokens, runs[False].tokens)
        steps = len(runs[False].logits) if cut is None else _steps_before(runs[False], draft, cut)
        for a, b in zip(runs[True].logits[:steps], runs[False].logits[:steps], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.float().abs().max().item())


@pytest.mark.cuda
def test_cuda_shared_stream_same_logits(tmp_path: Path) -> None:
    """On the GPU, in CUDA graphs with the step functions compiled, the shared expert on its side stream (not merged
    into the routed pairs) leaves every logit of plain decoding bit-equal to one stream's."""
    cfg = tiny_config(mtp=True).with_(hidden=256, expert_ff=256, shared_ff=256)
    write_model(tmp_path / "m.gguf", cfg, quant="q4_k_m")
    model = load_model(tmp_path / "m.gguf", device="cuda")
    assert all(m.split is not None for m in model.moe)
    prompt = list(range(3, 40))
    runs = {on: Engine(model, EngineOptions(draft=0, capacity=CAP, shared_stream=on, shared_pair=False),
                       EngineHooks(record_logits=True)).generate(prompt, 12) for on in (False, True)}
    assert runs[True].tokens == runs[False].tokens and runs[True].graphs["replays"] > 0
    for a, b in zip(runs[True].logits, runs[False].logits, strict=True):
        assert torch.equal(a, b)
