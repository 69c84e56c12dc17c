"""GPU parity checks: the test suite's correctness claims, re-run on CUDA.

  * CUDA f32 logits vs the CPU f32 model (same weights), bf16 vs f32 (relative tolerance);
  * greedy speculative == plain decoding on CUDA, bf16 and f32, with CUDA graphs, for N = 1..8,
    with oracle drafts so every acceptance length occurs; without hooks (drafts chained on the device);
    and with a stop token. In f32, and in bf16 with row-exact products (EngineOptions.exact: a verify row
    is computed as a decode row is), the tokens must be equal. bf16 with the fast kernels computes a
    6-row verify with other kernels than a 1-row decode step, so two logits within bf16 rounding of each
    other may swap: there the tokens must be equal up to the first difference, and that difference must
    sit at a near tie of plain decoding (top-2 gap <= NEAR_TIE of the row's largest |logit|), else it fails;
  * every combination of the seed's optimizations gives the baseline's tokens on CUDA;
  * the torch.compile-fused steps (the default on CUDA) against the same functions run eagerly;
  * sampling on the device: draws and speculative sampling follow their distributions, sampled decoding is
    repeatable for a seed.
Prints a table and exits non-zero on a failure. Run from the repo root: PYTHONPATH=. python scripts/gpu_check.py
(`--only-fused`: the CPU logits rows and the fused-vs-unfused rows only; `--only-bf16`: the bf16 model's rows
only; `--only-chained`: the logits rows, plain decoding and the device-chained greedy rows, the engine's own path;
`--only-pdl`: the logits rows and the programmatic-dependent-launch row; `--only-draft-vocab`: the logits rows and
the draft-vocabulary row; `--only-grouped-mm`: the logits rows and the grouped-GEMM prefill row; `--only-mixers`: the
logits rows and the verify-mixer row; the flags combine).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time

import torch

from qspec.config import preset
from qspec.engine import Engine, EngineHooks, EngineOptions, Generation
from qspec.kernels import gemv
from qspec.model import fuse
from qspec.model.model import CacheOptions, Model
from qspec.runner import Runner
from qspec.weights.random_model import random_weights

rows: list[tuple[str, str, str]] = []
failed = False


def report(name: str, ok: bool, detail: str) -> None:
    global failed
    failed |= not ok
    rows.append((name, "ok" if ok else "FAIL", detail))
    print(f"{name:55s} {'ok' if ok else 'FAIL':5s} {detail}", flush=True)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# bf16 rounding of a logit near 1 is 2^-7 ~ 0.8%, and a step accumulates several roundings
NEAR_TIE = 0.03


def first_diff(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def plain_against(run, ref, near_tie: float) -> tuple[bool, str, float]:  # noqa: ANN001
    """Plain decoding `run` against `ref` (both with record_logits): tokens equal, or equal up to a near tie (see
    same_or_tie); and the largest logits rel diff over the steps up to the first difference -> (ok, detail, rel)."""
    cut = first_diff(run.tokens, ref.tokens)
    steps = len(run.logits) if cut is None else cut + 1
    rel = max(rel_diff(a, b) for a, b in zip(run.logits[:steps], ref.logits[:steps], strict=False))
    ok, why = same_or_tie(run.tokens, ref, 0, near_tie)
    return ok, f"tokens {why}; logits rel diff {rel:.2e} over {steps} steps", rel


def same_or_tie(got: list[int], ref, n_ref: int, near_tie: float) -> tuple[bool, str]:  # noqa: ANN001
    """Equal to ref.tokens, or equal up to a first difference i at which the ref run's top two logits for token i
    are within `near_tie` of that row's largest |logit| (ref: a Generation with record_logits, n_ref drafts)."""
    want = ref.tokens
    i = first_diff(got, want)
    if i is None:
        return True, "equal"
    row = _predicting_row(ref, n_ref, i) if 0 < i < min(len(got), len(want)) else None
    if row is None:
        return False, f"first diff {i}"
    top = row.float().topk(2).values
    gap, scale = (top[0] - top[1]).item(), row.float().abs().max().item()
    tie = gap <= near_tie * scale
    return tie, f"first diff {i}, {'a near tie' if tie else 'NOT a near tie'}: top-2 gap {gap:.4f} = {gap / scale:.2%}"


def _predicting_row(g, n: int, i: int) -> torch.Tensor | None:  # noqa: ANN001
    """The logits row from which run g (n drafts per round) took output token i (token 0 is the prefill's)."""
    if n == 0:
        return g.logits[i - 1][-1] if i - 1 < len(g.logits) else None
    done = 1
    for r, rnd in enumerate(g.rounds_log):
        if i <= done + rnd["accepted"]:
            return g.logits[r][i - done] if r < len(g.logits) else None
        done += rnd["accepted"] + 1
    return None


def _steps_before(g, n: int, cut: int) -> int:  # noqa: ANN001
    """How many of g's steps (decode steps, or verify rounds of n drafts) ran entirely before output token `cut`."""
    if n == 0:
        return max(0, cut - 1)
    done, steps = 1, 0
    for rnd in g.rounds_log:
        done += rnd["accepted"] + 1
        if done > cut:
            break
        steps += 1
    return steps


_HOOKS = {f.name for f in dataclasses.fields(EngineHooks)}


def engine(model: Model, kw: dict) -> Engine:
    """An engine from its options and hooks in one dict (the checks below set both together)."""
    return Engine(model, EngineOptions(**{k: v for k, v in kw.items() if k not in _HOOKS}),
                  EngineHooks(**{k: v for k, v in kw.items() if k in _HOOKS}))


def build(device: str, dtype: torch.dtype) -> Model:
    cfg = preset("tiny", vocab_size=512)
    w = {k: (v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v)
         for k, v in random_weights(cfg, seed=0).items()}
    return Model(cfg, w)


def oracle(reference: list[int], rng: random.Random):  # noqa: ANN201
    def hook(n_out: int, drafts: list[int]) -> list[int]:
        good = reference[n_out:n_out + len(drafts)] + [0] * len(drafts)
        good = good[:len(drafts)]
        cut = rng.randint(0, len(drafts))
        if cut < len(drafts):
            good[cut] = (good[cut] + 1 + rng.randrange(511)) % 512
        return good
    return hook


def pdl_rows(gpu: Model, prompt: list[int], plain: Generation, kv: str, name: str, tie: float) -> None:
    """Programmatic dependent launch (the default; `plain` ran with it): the same kernels, each waiting on the GPU for
    the one before it, so the logits must be those of launches without it bit for bit (a missing wait would race),
    and greedy MTP5 without it plain decoding's tokens too."""
    nopdl = engine(gpu, dict(draft=0, capacity=256, kv_type=kv, record_logits=True,
                                      pdl=False)).generate(prompt, 48)
    same = len(nopdl.logits) == len(plain.logits) and all(
        torch.equal(a, b) for a, b in zip(nopdl.logits, plain.logits, strict=True))
    g = engine(gpu, dict(draft=5, capacity=256, kv_type=kv, pdl=False)).generate(prompt, 48)
    ok_g, why_g = same_or_tie(g.tokens, plain, 0, tie)
    report(f"PDL launches == launches without it, cuda {name}", same and nopdl.tokens == plain.tokens and ok_g,
           f"plain logits {'identical' if same else 'DIFFER'} over {len(plain.logits)} steps; greedy MTP5 "
           f"{why_g}; inductor PDL {'on' if fuse.inductor_has_pdl() else 'not in this torch'}")


def draft_vocab_rows(gpu: Model, prompt: list[int], plain: Generation, kv: str, name: str, tie: float) -> None:
    """A draft vocabulary (every third id) on the GPU path: the Q4 head's rows alone through the 4-bit kernel, their
    logits spread to -inf elsewhere inside the graphs. Greedy MTP5 must give plain decoding's tokens, and every
    recorded draft row must be -inf off the set."""
    ids = range(0, gpu.cfg.vocab_size, 3)
    off = torch.ones(gpu.cfg.vocab_size, dtype=torch.bool)
    off[list(ids)] = False
    g = engine(gpu, dict(draft=5, capacity=256, kv_type=kv, draft_head="q4", draft_vocab=ids,
                                  record_logits=True)).generate(prompt, 48)
    ok_g, why_g = same_or_tie(g.tokens, plain, 0, tie)
    hidden = all(bool(torch.isneginf(d[:, off]).all()) for d in g.draft_logits)
    report(f"draft vocabulary, greedy MTP5 == plain, cuda {name}", ok_g and hidden and len(g.draft_logits) > 0,
           f"tokens {why_g}; {len(g.draft_logits)} draft rows, -inf off the set: {hidden}; "
           f"graphs {g.graphs['replays']} replays")


def grouped_mm_rows(gpu: Model, prompt: list[int], plain: Generation, kv: str, name: str, tie: float,
                    tol: float) -> None:
    """Prefill's routed experts as grouped GEMMs (the default on sm_90/sm_100; bf16 only, so the f32 model keeps its
    loop) against the loop over the experts: the decode logits after either prefill within the dtype's tolerance,
    the tokens equal up to a near tie; greedy MTP5 through the loop too."""
    g = engine(gpu, dict(draft=0, capacity=256, kv_type=kv, record_logits=True, grouped_mm=False)).generate(
        prompt, 48)
    ok, why, rel = plain_against(plain, g, tie)
    s = engine(gpu, dict(draft=5, capacity=256, kv_type=kv, grouped_mm=False)).generate(prompt, 48)
    ok_s, why_s = same_or_tie(s.tokens, g, 0, tie)
    report(f"grouped-GEMM prefill experts == the loop, cuda {name}", ok and rel < tol and ok_s,
           f"{why}; greedy MTP5 through the loop {why_s}; "
           f"{'used' if gpu.dtype == torch.bfloat16 else 'not used (not bf16)'}")


def mixer_rows_rows(gpu: Model, prompt: list[int], plain: Generation, kv: str, name: str, tie: float,
                    tol: float) -> None:
    """The hyper-connection mixers of verify and extend steps on the Triton kernels (mixer_step_rows 6, the default)
    against compiled mixers above one row (1): greedy MTP5 with oracle drafts (every acceptance length) must give
    plain decoding's tokens with either, and the first round's verify logits (the same inputs) must agree."""
    got = {}
    for rows in (6, 1):
        got[rows] = engine(gpu, dict(draft=5, capacity=256, kv_type=kv, mixer_step_rows=rows,
                                              record_logits=True, draft_hook=oracle(plain.tokens, random.Random(5)))
                           ).generate(prompt, 48)
    oks = [same_or_tie(g.tokens, plain, 0, tie) for g in got.values()]
    rel = rel_diff(got[6].logits[0], got[1].logits[0])
    report(f"verify mixers on the kernels (6 rows) == compiled, cuda {name}", all(ok for ok, _ in oks) and rel < tol,
           f"tokens {oks[0][1]} / {oks[1][1]}; first verify logits rel diff {rel:.2e}; accepted "
           f"{got[6].spec.accepted}/{got[6].spec.drafted}")


def main() -> int:
    torch.set_grad_enabled(False)
    only_fused = "--only-fused" in sys.argv  # just the fused-vs-unfused rows (a short device run)
    cpu = build("cpu", torch.float32)
    ids = torch.randint(0, 511, (60,), generator=torch.Generator().manual_seed(0))
    ref = Runner(cpu, CacheOptions(capacity=128)).step(ids)[0]
    only_bf16 = "--only-bf16" in sys.argv  # the bf16 model alone (the engine's 16-bit kernels), no f32 rows
    # the engine's own path alone (plain decoding, drafts chained on the device in one graph): a short device run
    # the logits rows and the PDL row alone (~4 minutes on the device: it compiles both builds)
    only_pdl = "--only-pdl" in sys.argv
    only_draft_vocab = "--only-draft-vocab" in sys.argv  # the logits rows and the draft-vocabulary row
    only_grouped_mm = "--only-grouped-mm" in sys.argv  # the logits rows and the grouped-GEMM prefill row
    only_mixers = "--only-mixers" in sys.argv  # the logits rows and the verify-mixer row
    only_rows = only_pdl or only_draft_vocab or only_grouped_mm or only_mixers
    only_chained = "--only-chained" in sys.argv or only_rows
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2))[1 if only_bf16 else 0:]:
        gpu = build("cuda", dtype)
        got = Runner(gpu, CacheOptions(capacity=128, kv_type="bf16" if dtype == torch.bfloat16 else "f32")
                     ).step(ids)[0].float().cpu()
        rel = ((got - ref).norm() / ref.norm()).item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        report(f"logits cuda {str(dtype)[6:]} vs cpu f32", rel < tol, f"rel err {rel:.2e}, argmax agree {agree:.3f}")
        prompt = ids[:25].tolist()
        kv = "bf16" if dtype == torch.bfloat16 else "f32"
        tie = NEAR_TIE if dtype == torch.bfloat16 else 0.0
        name = str(dtype)[6:]
        plain = engine(gpu, dict(draft=0, capacity=256, kv_type=kv, record_logits=True)).generate(prompt, 48)
        if not only_fused:
            report(f"graphs used, plain decode {name}", plain.graphs["replays"] > 0, str(plain.graphs))
        if only_rows:
            if only_pdl:
                pdl_rows(gpu, prompt, plain, kv, name, tie)
            if only_draft_vocab:
                draft_vocab_rows(gpu, prompt, plain, kv, name, tie)
            if only_grouped_mm:
                grouped_mm_rows(gpu, prompt, plain, kv, name, tie, tol)
            if only_mixers:
                mixer_rows_rows(gpu, prompt, plain, kv, name, tie, tol)
            continue
        for n in (0, 3) if not only_chained else ():  # torch.compile-fused steps vs the same functions run eagerly
            opts = dict(draft=n, capacity=256, kv_type="q8_0", record_logits=True)
            f = engine(gpu, dict(**opts)).generate(prompt, 24)
            u = engine(gpu, dict(compile=False, **opts)).generate(prompt, 24)
            # Rows whose context is the emitted tokens alone: every decode row, row 0 of each verify step and
            # each round's first draft step, in the steps before the first token where the two builds part
            # (bf16: only at a near tie, see same_or_tie). Later verify rows follow the round's drafts, and one
            # draft that flips between the two builds gives those rows a different context.
            same, why = same_or_tie(f.tokens, u, n, tie)
            cut = first_diff(f.tokens, u.tokens)
            steps = len(f.logits) if cut is None else _steps_before(f, n, cut)
            pairs = list(zip(f.logits[:steps], u.logits[:steps], strict=True))
            rel_first = max((rel_diff(a[:1], b[:1]) for a, b in pairs), default=0.0)
            drafts = list(zip(f.draft_logits[:steps], u.draft_logits[:steps], strict=False))
            rel_draft = max((rel_diff(a, b) for a, b in drafts), default=0.0)
            rel_all = max((rel_diff(a, b) for a, b in pairs), default=0.0)
            ok = same and steps > 0 and rel_first < tol and rel_draft < tol
            report(f"fused == unfused steps, cuda {name}, N={n}", ok,
                   f"tokens {why}; over {steps} steps: logits rel diff {rel_first:.2e}, "
                   f"first draft step {rel_draft:.2e} ({len(drafts)} rounds); all verify rows {rel_all:.2e}")
        if not only_fused:  # no hooks: drafts chained on the device, one read-back per round; a stop token
            for n in (0, 1, 5):  # ends plain decoding with a queued step discarded
                g = engine(gpu, dict(draft=n, capacity=256, kv_type=kv)).generate(prompt, 48)
                stop = plain.tokens[20]
                s = engine(gpu, dict(draft=n, capacity=256, kv_type=kv)).generate(prompt, 48, stop_ids={stop})
                want = plain.tokens[:plain.tokens.index(stop) + 1]
                ok_g, why_g = same_or_tie(g.tokens, plain, 0, tie)
                ok_s, why_s = (True, "as plain") if s.tokens == want else same_or_tie(s.tokens, plain, 0, tie)
                report(f"device-chained greedy == plain, cuda {name}, N={n}", ok_g and ok_s,
                       f"accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why_g}; with a stop token: "
                       f"{len(s.tokens)} tokens, {why_s}")
            # the next round's draft chain queued before the read-back (its first position on the device): with
            # replayed acceptance (every length occurs; the output follows the drafts) it must give the tokens and
            # rounds of the chain queued after the read, and without it plain decoding's tokens
            replay = dict(draft=5, capacity=256, kv_type=kv, accept_hook=lambda r, n: (3 * r + 1) % (n + 1))
            after = engine(gpu, dict(draft_before_readback=False, **replay)).generate(prompt, 48)
            early = engine(gpu, dict(draft_before_readback=True, **replay)).generate(prompt, 48)
            g = engine(gpu, dict(draft=5, capacity=256, kv_type=kv, draft_before_readback=True)).generate(
                prompt, 48)
            ok_g, why_g = same_or_tie(g.tokens, plain, 0, tie)
            report(f"draft chain before the read-back, cuda {name}, N=5",
                   early.tokens == after.tokens and early.rounds_log == after.rounds_log and ok_g,
                   f"replayed rounds {'equal' if early.rounds_log == after.rounds_log else 'differ'}, tokens "
                   f"{'equal' if early.tokens == after.tokens else 'differ'}; greedy {why_g}, "
                   f"graphs {g.graphs['replays']} replays")
            pdl_rows(gpu, prompt, plain, kv, name, tie)
            draft_vocab_rows(gpu, prompt, plain, kv, name, tie)
            grouped_mm_rows(gpu, prompt, plain, kv, name, tie, tol)
            mixer_rows_rows(gpu, prompt, plain, kv, name, tie, tol)
            # masked attention in one Triton pass over the cache (the default on CUDA; q8_0 here, the benchmarks'
            # cache): its logits against the dequantized read's, then greedy speculation against plain decoding
            q8 = dict(capacity=256, kv_type="q8_0", record_logits=True)
            dflt = engine(gpu, dict(draft=0, fused_attention=False, **q8)).generate(prompt, 48)
            fa_plain = engine(gpu, dict(draft=0, fused_attention=True, **q8)).generate(prompt, 48)
            ok, why, rel = plain_against(fa_plain, dflt, tie)
            report(f"fused attention == dequantized read, q8_0, cuda {name}", ok and rel < tol, why)
            for n in (1, 5):
                g = engine(gpu, dict(draft=n, fused_attention=True, **q8)).generate(prompt, 48)
                ok, why = same_or_tie(g.tokens, fa_plain, 0, tie)
                report(f"device-chained greedy == plain, fused attention, cuda {name}, N={n}", ok,
                       f"accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why}, graphs {g.graphs['replays']} "
                       f"replays")
            # the default step kernels against the compiled paths they replace: the q8_0 KV write in one launch,
            # GDN's step conv, silu and q/k norms in one launch
            cw = engine(gpu, dict(draft=0, kv_write_kernel=False, fused_attention=False, **q8)).generate(
                prompt, 48)
            ok, why, rel = plain_against(dflt, cw, tie)
            report(f"KV write kernel == compiled write, q8_0, cuda {name}", ok and rel < tol, why)
            gc = engine(gpu, dict(draft=0, capacity=256, kv_type=kv, record_logits=True,
                                           gdn_conv_kernel=False)).generate(prompt, 48)
            ok, why, rel = plain_against(plain, gc, tie)
            report(f"GDN conv kernel == compiled conv, cuda {name}", ok and rel < tol, why)
        for exact in (False, True) if not (only_fused or only_chained) else ():
            # row-exact: a verify row is computed as a decode row is, so bf16 must be exact too
            ref_run = plain if not exact else engine(gpu, dict(draft=0, capacity=256, kv_type=kv, exact=True,
                                                                    record_logits=True)).generate(prompt, 48)
            for n in range(1, 9) if not exact else (1, 3, 5):
                rng = random.Random(n)
                t0 = time.perf_counter()
                g = engine(gpu, dict(draft=n, capacity=256, kv_type=kv, exact=exact,
                                              draft_hook=oracle(ref_run.tokens, rng))).generate(prompt, 48)
                ok, why = same_or_tie(g.tokens, ref_run, 0, 0.0 if exact else tie)
                report(f"greedy spec == plain{' (row-exact)' if exact else ''}, cuda {name}, N={n}", ok,
                       f"accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why}, "
                       f"graphs {g.graphs['captures']} captures / {g.graphs['replays']} replays, "
                       f"{time.perf_counter() - t0:.1f}s")
        if dtype == torch.bfloat16 and not (only_fused or only_chained):
            # the few-rows tensor-core products run in steps only for flash-next's shapes (TUNED_FEW); here every
            # verify product that fits takes them, and greedy speculation must still reproduce plain decoding
            with gemv.few_rows_everywhere():
                for n in (3, 5):
                    hook = oracle(plain.tokens, random.Random(n))
                    opts = dict(draft=n, capacity=256, kv_type=kv, draft_hook=hook)
                    g = engine(gpu, opts).generate(prompt, 48)
                    ok, why = same_or_tie(g.tokens, plain, 0, tie)
                    report(f"greedy spec == plain, few-rows products everywhere, cuda {name}, N={n}", ok,
                           f"accepted {g.spec.accepted}/{g.spec.drafted}, tokens {why}")
    gpu = build("cuda", torch.float32)
    prompt = ids[:40].tolist()
    base = None
    for combo in itertools.product([False, True], repeat=4) if not (only_fused or only_bf16 or only_chained) else ():
        p, inc, pad, fused = combo
        rng = random.Random(5)
        g = engine(gpu, dict(draft=4, capacity=256, preserve_pooled=p, incremental_pooled=inc,
                                      pad_target=8 if pad else None, fused_snapshots=fused,
                                      accept_hook=lambda r, n, rng=rng: rng.randint(0, n))).generate(prompt, 40)
        base = base or g.tokens
        report(f"seed opts {combo} == baseline tokens (cuda f32)", g.tokens == base,
               str(g.graphs["graphs_by_shape"])[:90])
    if not (only_fused or only_chained):
        sampling_checks(gpu, prompt)
    print("\nsummary:", sum(r[1] == "ok" for r in rows), "ok,", sum(r[1] != "ok" for r in rows), "failed")
    return 1 if failed else 0


def within(counts: torch.Tensor, target: torch.Tensor, sigmas: float = 5.0) -> tuple[bool, str]:
    """Whether the empirical frequencies of `counts` match the distribution `target` within `sigmas` standard
    errors per token (and tokens of probability 0 never occur)."""
    n = counts.sum()
    freq, target = counts.double() / n, target.double().cpu()
    ok = bool(((freq - target).abs() <= sigmas * (target * (1 - target) / n).sqrt() + 1e-12).all())
    def show(v: torch.Tensor) -> list[float]:
        return [round(float(x), 3) for x in v]
    return ok, f"{int(n)} draws, frequencies {show(freq)} vs {show(target)}"


def sampling_checks(gpu: Model, prompt: list[int]) -> None:
    """Sampling on the device: the draw and speculative sampling's acceptance follow their distributions on CUDA
    (device generators seeded from the request's CPU generator), and sampled plain and speculative decoding run
    through the graphs, repeatably for a seed."""
    from qspec.spec.accept import Sampler, speculative_accept_on_device

    dev = gpu.device
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], device=dev)
    s = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    draws = s.sample_probs(p.expand(200000, 5))
    ok, why = within(torch.bincount(draws, minlength=5).cpu(), p)
    report(f"sampled draws follow p ({dev.type})", ok and draws.device == p.device, why)
    pt = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25] * 4], device=dev)
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.3, 0.3, 0.2, 0.2]], device=dev)
    first = torch.zeros(4)
    for _ in range(4000):
        d = torch.cat([s.sample_probs(q[0:1]), s.sample_probs(q[1:2])])
        k, nxt = speculative_accept_on_device(d, q, pt, s)
        first[int(nxt) if int(k) == 0 else int(d[0])] += 1
    ok, why = within(first, pt[0])
    report(f"speculative sampling keeps p, first token ({dev.type})", ok, why)
    for n in (0, 3, 5):
        def run(seed: int, n: int = n) -> object:
            sampler = Sampler(temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(seed))
            return engine(gpu, dict(draft=n, capacity=256, kv_type="q8_0")).generate(prompt, 48,
                                                                                            sampler=sampler)
        a, b, c = run(1), run(1), run(2)
        ok = a.tokens == b.tokens and len(a.tokens) == 48 and a.tokens != c.tokens and a.graphs["replays"] > 0
        report(f"sampled decoding, {dev.type} f32, N={n}", ok,
               f"same seed {'equal' if a.tokens == b.tokens else 'DIFFERENT'}, other seed "
               f"{'different' if a.tokens != c.tokens else 'EQUAL'}, accepted {a.spec.accepted}/{a.spec.drafted}, "
               f"graphs {a.graphs['captures']} captures / {a.graphs['replays']} replays")


if __name__ == "__main__":
    sys.exit(main())
