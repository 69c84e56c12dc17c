"""fla's chunked GDN prefill kernels on a fresh process: write their tuned configs, and time a first call with and
without them (qspec/kernels/fla_configs.py ships the configs).

    python scripts/fla_configs.py write [--out DIR]      # autotune at the preset's geometry, write fla's config files
    python scripts/fla_configs.py time                   # two fresh processes, each with an empty Triton cache

`write` runs qspec's prefill call (gdn_chunked, as a prompt's GDN layer makes it) with fla's own autotuning and
stores every config fla's cached autotuner chose, in fla's file format, under DIR (default: the shipped directory
of this GPU). `time` runs one first call in a child process per arm, each with a Triton cache of its own, so each
compiles from nothing: fla autotuning (FLA_CACHE_MODE=disabled) against the shipped configs; it prints the first
call's seconds, the median of the next calls, and whether the two arms' outputs are equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qspec.config import preset
from qspec.kernels import fla_configs

LATER_CALLS = 21  # calls after the first, whose median is reported


def prefill_call(tokens: int, preset_name: str) -> tuple[float, float, torch.Tensor]:
    """(first call s, median s of LATER_CALLS more, output) of one GDN layer's chunked prefill at the preset's
    geometry."""
    from qspec.model.gdn import gdn_chunked

    cfg = preset(preset_name)
    hv, dk, dv = cfg.gdn_v_heads, cfg.gdn_head_dim, cfg.gdn_v_head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(tokens, hv, dk, device="cuda", generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, hv, dk, device="cuda", generator=g), dim=-1)
    v = torch.randn(tokens, hv, dv, device="cuda", generator=g)
    gate = -torch.rand(tokens, hv, device="cuda", generator=g)
    beta = torch.rand(tokens, hv, device="cuda", generator=g)
    s0 = torch.zeros(hv, dk, dv, device="cuda")
    times = []
    for _ in range(1 + LATER_CALLS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, _ = gdn_chunked(q, k, v, gate, beta, s0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], sorted(times[1:])[LATER_CALLS // 2], o


def fla_autotuners() -> list:
    """Every cached autotuner of fla's loaded modules (under the @triton.heuristics wrapper where there is one)."""
    from fla.ops.utils.cache import CachedAutotuner

    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla."):
            continue
        for obj in vars(mod).values():
            for _ in range(3):  # heuristics -> autotuner -> jit function
                if isinstance(obj, CachedAutotuner):
                    found.append(obj)
                    break
                obj = getattr(obj, "fn", None)
    return list({id(a): a for a in found}.values())


def tuned_entries() -> dict[str, dict[str, dict]]:
    """{kernel name: {key hash: {"autotune_key": key, "config": ...}}} of every fla cached autotuner that ran."""
    from fla.ops.utils.cache import AutotuneKey

    found: dict[str, dict[str, dict]] = {}
    for tuner in fla_autotuners():
        for key, c in tuner.cache.items():
            entry = {"autotune_key": AutotuneKey.normalize_autotune_key(list(key)),
                     "config": {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
                                "num_ctas": c.num_ctas, "maxnreg": c.maxnreg}}
            found.setdefault(tuner.kernel_name, {})[AutotuneKey.key_hash(key)] = entry
    return found


def write(out: Path | None, tokens: int, preset_name: str) -> int:
    import triton

    os.environ["FLA_CACHE_MODE"] = "disabled"  # fla's own autotuning, never a shipped config
    prefill_call(tokens, preset_name)
    out = out or fla_configs.CONFIG_ROOT / fla_configs.gpu_dir_name(torch.cuda.get_device_name())
    out.mkdir(parents=True, exist_ok=True)
    for kernel, entries in sorted(tuned_entries().items()):
        doc = {"kernel_name": kernel, "triton_version": triton.__version__, "autotune_entries": entries}
        (out / f"{kernel}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"{kernel}: {len(entries)} key(s) -> {out / (kernel + '.json')}")
    major, minor = torch.cuda.get_device_capability()
    (out / fla_configs.TUNED_WITH).write_text(f"fla-core {fla_configs.installed_fla()}\ntriton {triton.__version__}\n"
                                              f"capability {major}.{minor}\n")
    return 0


def child(tokens: int, preset_name: str, result: Path) -> int:
    first, second, o = prefill_call(tokens, preset_name)
    torch.save(o.cpu(), result.with_suffix(".pt"))
    benched = sorted(t.kernel_name for t in fla_autotuners() if getattr(t, "configs_timings", None))
    env = {k: os.environ.get(k) for k in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE")}
    result.write_text(json.dumps({"first_s": first, "second_s": second, "benched": benched, "env": env}))
    return 0


def time_arms(tokens: int, preset_name: str) -> int:
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("autotune", "shipped"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("FLA_")}
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / f"triton-{arm}")  # empty: everything compiles
            if arm == "autotune":
                env["FLA_CACHE_MODE"] = "disabled"
            result = Path(tmp) / f"{arm}.json"
            subprocess.run([sys.executable, __file__, "child", "--tokens", str(tokens), "--preset", preset_name,
                            "--result", str(result)], env=env, check=True)
            r = json.loads(result.read_text())
            outs[arm] = torch.load(result.with_suffix(".pt"))
            print(f"{arm:9s} first call {r['first_s']:7.2f} s, then {r['second_s'] * 1e3:7.2f} ms "
                  f"(median of {LATER_CALLS}) "
                  f"({r['env']}); "
                  f"kernels autotuned: {len(r['benched'])} {r['benched']}")
    same = torch.equal(outs["autotune"], outs["shipped"])
    digest = {a: hashlib.sha256(o.numpy().tobytes()).hexdigest()[:12] for a, o in outs.items()}
    print(f"outputs equal: {same} (sha256 {digest}); max |diff| "
          f"{(outs['autotune'] - outs['shipped']).abs().max().item():.3e}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("write", "time", "child"))
    ap.add_argument("--tokens", type=int, default=4096, help="prompt rows of the call (fla's keys do not depend on it)")
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--out", type=Path, default=None, help="write: the config directory (default: the shipped one)")
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("fla_configs: needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    if a.what == "write":
        return write(a.out, a.tokens, a.preset)
    if a.what == "child":
        return child(a.tokens, a.preset, a.result)
    return time_arms(a.tokens, a.preset)


if __name__ == "__main__":
    sys.exit(main())
