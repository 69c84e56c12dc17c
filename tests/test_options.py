"""Options declared once: the flags, the arm keys and the checks derived from the declarations; the engine leaves
the caller's options alone; the kernel switches' defaults agree with the modules'; the cache memory check."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from qspec.bench.arms import parse_arm
from qspec.cli import build_parser
from qspec.engine import Engine, EngineHooks, EngineOptions, cells_needed
from qspec.memory import CacheMemoryError, cache_bytes, check_cache_fits, footprint
from qspec.model.model import Model
from qspec.options import (
    MAX_MIXER_ROWS,
    SEED_MAX,
    KernelOptions,
    OptionError,
    SamplingOptions,
    add_arguments,
    arm_keys,
    declared,
    flag_name,
    from_args,
    prompt_text_error,
)
from qspec.runner import KernelSwitches

README = Path(__file__).resolve().parents[1] / "README.md"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p, EngineOptions)
    return p.parse_args(list(argv))


def test_every_option_is_declared_with_help() -> None:
    for cls in (EngineOptions, SamplingOptions):
        names = [f.name for f in dataclasses.fields(cls)]
        assert [f.name for f in declared(cls)] == names
        for f in declared(cls):
            assert f.metadata["help"] and not f.metadata["help"].endswith("."), f.name


def test_flags_parse_back_to_the_options() -> None:
    assert from_args(EngineOptions, parse()) == EngineOptions()
    got = from_args(EngineOptions, parse("--ctx", "64", "--no-incremental", "--no-pad", "--draft", "3",
                                         "--draft-head", "q4", "--no-pdl", "--mixer-step-rows", "2",
                                         "--fused-attention", "--sparse-attention"))
    assert got == EngineOptions(capacity=64, incremental_pooled=False, pad_target=None, draft=3, draft_head="q4",
                                pdl=False, mixer_step_rows=2, fused_attention=True, sparse_attention=True)
    assert from_args(EngineOptions, parse("--capacity", "128", "--pad-target", "16")).pad_target == 16
    # every boolean option has both spellings, and each one reaches its option
    for f in declared(EngineOptions):
        if f.metadata["type"] is bool and f.metadata["flag"]:
            name = flag_name(f.name)
            assert getattr(parse(name), f.name) is True and getattr(parse("--no-" + name[2:]), f.name) is False


def test_readme_flags_are_all_known() -> None:
    """Every flag a README `qspec run` or `qspec serve` command shows exists (the flags are generated now)."""
    parser = build_parser(with_bench=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in ("run", "serve"):
        known = {s for a in sub.choices[cmd]._actions for s in a.option_strings}
        lines = [ln for ln in README.read_text(encoding="utf-8").splitlines() if f"qspec {cmd} " in ln]
        flags = {f for ln in lines for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", ln.split("#")[0])}
        assert flags, cmd
        assert flags <= known, (cmd, sorted(flags - known))


def test_arm_keys_are_the_option_names_and_their_aliases() -> None:
    keys = arm_keys()
    for f in declared(EngineOptions):
        if f.metadata["flag"]:
            assert keys[f.name] == f.name
        if f.metadata["arm"]:
            assert keys[f.metadata["arm"]] == f.name
    assert {"fattn", "kvw", "gconv", "gmm", "hcrows", "early", "preserve", "incremental", "pad", "fused"} <= set(keys)
    for f in declared(KernelOptions):
        if f.metadata["type"] is bool and f.metadata["flag"]:
            on, off = parse_arm(f"a:{f.name}=1"), parse_arm(f"a:{f.name}=0")
            assert on.get(f.name) is True and off.get(f.name) is False
            assert getattr(off.options(capacity=64, kv_type="f32"), f.name) is False


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(draft=9), "draft must be in 0..8"),
    (dict(capacity=30), "capacity must be a positive multiple of 4, got 30"),
    (dict(kv_type="q4"), "kv_type must be one of"),
    (dict(pad_target=12), "pad_target must be one of 8, 16"),
    (dict(mixer_step_rows=0), "mixer_step_rows must be in 1..8, got 0"),
    (dict(pdl="yes"), "pdl must be true or false"),
    (dict(draft=True), "draft must be an integer"),
    (dict(draft_vocab=[1, 2]), "draft_vocab restricts the drafts: it needs draft N"),
    (dict(prefill_chunk=0), "prefill_chunk must be >= 1"),
])
def test_engine_options_are_checked_when_made(kw: dict, needle: str) -> None:
    with pytest.raises(OptionError, match=re.escape(needle)):
        EngineOptions(**kw)


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_p=math.nan), "top_p must be in (0, 1]"),
    (dict(seed=SEED_MAX + 1), "seed must be in 0..18446744073709551615"),
    (dict(seed=-1), "seed must be in 0.."),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
])
def test_sampling_options_are_checked(kw: dict, needle: str) -> None:
    with pytest.raises(OptionError, match=re.escape(needle)) as e:
        SamplingOptions(**kw)
    # every interface spells the option its own way: the CLI as its flag
    assert e.value.render(flag_name).startswith("--" + next(iter(kw)).replace("_", "-"))
    assert SamplingOptions(seed=SEED_MAX, temperature=0.7).seed == SEED_MAX
    torch.Generator().manual_seed(SEED_MAX)  # the largest seed allowed is one torch takes


def test_prompt_text_must_be_unicode() -> None:
    assert prompt_text_error("fn main() { é 😀 }") is None
    assert "byte 0xff at character 2" in prompt_text_error("ab\udcffc")
    assert "lone surrogate U+D800" in prompt_text_error("\ud800")


def test_the_engine_leaves_the_callers_options_alone(tiny_model: Model) -> None:
    opts = EngineOptions(draft=2, capacity=64, draft_head="q4", draft_vocab=range(0, 512, 2))
    before = dataclasses.replace(opts)
    eng = Engine(tiny_model, opts)
    assert eng.opts is opts and opts == before
    assert eng.draft_lm_head is not None and not hasattr(opts, "draft_lm_head")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.draft = 3  # type: ignore[misc]
    # plain decoding makes no draft head, whatever draft_head says
    assert Engine(tiny_model, EngineOptions(capacity=64, draft_head="q4")).draft_lm_head is None
    assert len(Engine(tiny_model).generate([1, 2, 3], 2).tokens) == 2  # no options: the defaults


def test_switch_blocks_of_two_threads_do_not_interleave() -> None:
    """The switches are process-wide modes: a block in one thread waits for another thread's block to end (else it
    would save that block's modes as the ones to restore, and leave them set)."""
    import threading

    from qspec.model import ops

    inside, release, entered = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with KernelSwitches(row_exact=True).apply():
            inside.set()
            release.wait()

    def other() -> None:
        with KernelSwitches().apply():
            entered.set()
    first, second = threading.Thread(target=hold), threading.Thread(target=other)
    first.start()
    inside.wait()
    second.start()
    assert not entered.wait(0.2)  # the second block waits for the first
    release.set()
    first.join()
    second.join()
    assert entered.is_set() and ops._ROW_EXACT is KernelSwitches().row_exact


def test_kernel_switch_defaults_are_the_modules() -> None:
    """Outside any engine the modules hold KernelSwitches' defaults, and the option defaults resolve to them on the
    CPU, except what the CPU lacks."""
    from qspec.kernels import (
        attention_seqs,
        gated_norm,
        gdn_conv,
        gdn_seqs,
        gemv,
        hc_mix,
        qmatmul,
        triton_common,
        triton_qdot,
        triton_qmatmul,
    )
    from qspec.model import fuse, moe, ops

    d = KernelSwitches()
    assert (ops._ROW_EXACT, fuse._ON, fuse._BACKEND, gdn_conv._ON, triton_common._PDL, moe._GROUPED_MM,
            hc_mix._STEP_ROWS, qmatmul.INT8_DOT, fuse._BLOCKS, moe._SHARED_STREAM, triton_common.SUM_IN_PRODUCT,
            gated_norm._ON, moe._SHARED_PAIR, triton_qmatmul.PAIRS, triton_qdot.K_LANES, gdn_seqs._ON,
            attention_seqs._ON) == (
        d.row_exact, d.fused, d.compile_backend, d.gdn_conv_kernel, d.pdl, d.grouped_mm, d.mixer_step_rows, d.int8_dot,
        d.fuse_blocks, d.shared_stream, d.sums_in_product, d.norm_quant, d.shared_pair, d.tc_pairs, d.k_lanes,
        d.gdn_seqs, d.attention_seqs)
    assert d.k_lanes == EngineOptions().k_lanes
    assert gemv._ON == (d.gemv and triton_common.triton_enabled())
    assert d.mixer_step_rows == EngineOptions().mixer_step_rows and MAX_MIXER_ROWS == hc_mix.MAX_ROWS
    assert KernelSwitches.resolve(EngineOptions(), torch.device("cpu")) == d
    on = KernelSwitches(row_exact=True, gemv=False, gdn_conv_kernel=False, mixer_step_rows=2, int8_dot=False,
                        fuse_blocks=False, shared_stream=False, sums_in_product=False, norm_quant=False,
                        shared_pair=False, tc_pairs=False, k_lanes=4, gdn_seqs=False,
                        attention_seqs=False)
    with on.apply():
        assert triton_qdot.K_LANES == 4 and not gdn_seqs._ON and not attention_seqs._ON
        assert (ops._ROW_EXACT, gemv._ON, gdn_conv._ON, hc_mix._STEP_ROWS, qmatmul.INT8_DOT, fuse._BLOCKS,
                moe._SHARED_STREAM, triton_common.SUM_IN_PRODUCT, gated_norm._ON, moe._SHARED_PAIR,
                triton_qmatmul.PAIRS) == (True, False, False, 2, False, False, False, False, False, False, False)
    assert (ops._ROW_EXACT, gdn_conv._ON, hc_mix._STEP_ROWS, qmatmul.INT8_DOT, fuse._BLOCKS, moe._SHARED_STREAM,
            triton_common.SUM_IN_PRODUCT, gated_norm._ON, moe._SHARED_PAIR, triton_qmatmul.PAIRS,
            triton_qdot.K_LANES, gdn_seqs._ON, attention_seqs._ON) == (False, True, 6, True, True, True, True, True,
                                                                        True, True, 0, True, True)


def test_plain_decoding_needs_no_draft_cells(tiny_model: Model) -> None:
    """Plain decoding runs every token but the last: a prompt of P and M new tokens fit P + M - 1 cells."""
    prompt, m = list(range(1, 62)), 4
    assert cells_needed(len(prompt), m, 0) == 64 and cells_needed(len(prompt), m, 2) == 68
    g = Engine(tiny_model, EngineOptions(capacity=64)).generate(prompt, m)
    assert len(g.tokens) == m
    with pytest.raises(ValueError, match=r"need 65 cells, more than the context capacity 64"):
        Engine(tiny_model, EngineOptions(capacity=64)).generate(prompt, m + 1)


def test_cache_memory_is_checked_before_allocating(tiny_model: Model) -> None:
    opts = EngineOptions(draft=2, capacity=4096, kv_type="q8_0").cache_options()
    fp = footprint(tiny_model, opts)
    assert fp.host_per_token > 0
    # the fit extrapolates: a third capacity's cache has the bytes it predicts
    assert cache_bytes(tiny_model, opts) == fp.bytes(4096)
    need = fp.bytes(4096)[1]
    check_cache_fits(tiny_model, opts, available=(0, need * 2))
    with pytest.raises(CacheMemoryError, match="the largest context that fits is") as e:
        check_cache_fits(tiny_model, opts, available=(0, need))
    largest = int(re.search(r"fits is ([\d,]+) tokens", str(e.value)).group(1).replace(",", ""))
    assert 2048 < largest < 4096 and largest % 4 == 0
    check_cache_fits(tiny_model, dataclasses.replace(opts, capacity=largest), available=(0, need))
    with pytest.raises(CacheMemoryError):
        check_cache_fits(tiny_model, dataclasses.replace(opts, capacity=largest + 4), available=(0, need))
    # the engine checks before it allocates: a context no machine has refuses at once
    with pytest.raises(CacheMemoryError, match=r"a context of 1,000,000,000 tokens needs [\d.]+ GB"):
        Engine(tiny_model, EngineOptions(capacity=10**9), EngineHooks())


def test_a_batch_takes_the_slots_that_fit(tiny_model: Model) -> None:
    """caches_that_fit: as many caches as BUDGET of the free memory holds, at most `most`, measured at a small
    context too (where check_cache_fits checks nothing); the count grows with the memory and falls with the context."""
    from qspec.memory import BUDGET, caches_that_fit

    opts = EngineOptions(draft=2, capacity=256).cache_options()
    need = footprint(tiny_model, opts).bytes(256)[1]
    assert need == cache_bytes(tiny_model, opts)[1]
    for k in (0, 1, 3, 7):
        free = int((k * need + need // 2) / BUDGET)  # room for k caches and half of another
        assert caches_that_fit(tiny_model, opts, 8, available=(0, free)) == k
    assert caches_that_fit(tiny_model, opts, 4, available=(0, 100 * need)) == 4
    longer = dataclasses.replace(opts, capacity=4096)
    assert caches_that_fit(tiny_model, longer, 8, available=(0, int(7.5 * need / BUDGET))) < 7


def test_cache_options_follow_the_engine_options() -> None:
    """The cache's options are the engine's: the same defaults, and every one passed through."""
    from qspec.model.model import CacheOptions

    shared = {f.name for f in dataclasses.fields(CacheOptions)} - {"n_slots"}
    engine = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    assert shared <= set(engine)
    assert {n: getattr(CacheOptions(), n) for n in shared} == {n: engine[n] for n in shared}
    odd = EngineOptions(draft=3, capacity=64, kv_type="q8_0", preserve_pooled=False, incremental_pooled=False,
                        pad_target=16, fused_snapshots=False, sparse_attention=True, fused_attention=True,
                        kv_write_kernel=False).cache_options()
    assert odd == CacheOptions(capacity=64, n_slots=4, kv_type="q8_0", preserve_pooled=False, incremental_pooled=False,
                               pad_target=16, fused_snapshots=False, sparse_attention=True, fused_attention=True,
                               kv_write_kernel=False)
