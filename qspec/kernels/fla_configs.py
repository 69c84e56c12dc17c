"""Tuned configs of fla's chunked gated-delta-rule kernels (a prompt's GDN prefill), shipped per GPU.

fla autotunes each of its chunked kernels at its first call in a process whose Triton cache does not hold the
result: on a fresh machine a first prompt past triton_gdn.FINAL_MAX_ROWS tokens waited for every candidate config
of every kernel to compile and run (BENCHMARKS.md §5c, a fresh process's first tokens). fla reads a kernel's best
config from `$FLA_CONFIG_DIR/<kernel>.json` when `FLA_CACHE_MODE` asks it to (fla.ops.utils.cache; its file
format), so qspec ships the configs that fla's own autotuning chose on a GPU (`scripts/fla_configs.py` writes
them) and points fla at them. The mode is `strict`: a config is used only for the exact key it was tuned for (the
heads, head sizes, chunk size and argument dtypes), and any other call autotunes as before. Kernels that fla
decorates with Triton's plain autotuner (not its cached one) still autotune.

Both variables are read when fla is first imported, so `use_shipped` must run before that; a user's own
FLA_CONFIG_DIR or FLA_CACHE_MODE is left alone. A GPU's directory records the fla-core release its configs were
tuned with (TUNED_WITH); under another release (whose kernels may take other parameters) they are not used. It also
records the GPU's compute capability: a GPU with no configs of its own takes those of a GPU of the same capability
(an H200 an H100's: the same SMs and shared memory, other memory), which any GPU of that architecture runs
correctly, rather than autotuning every kernel on its first long prompt.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys
from pathlib import Path

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "assets" / "fla_configs"
# in a GPU's directory: "package version" lines of the tuning run (fla-core, triton), and "capability MAJOR.MINOR"
TUNED_WITH = "tuned_with.txt"


def gpu_dir_name(device_name: str) -> str:
    """The directory of a GPU's configs: its name as fla sanitises it (fla.ops.utils.cache.sanitize_gpu_name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


@functools.cache  # gdn_chunked asks on every prefill call
def installed_fla() -> str | None:
    """The installed fla-core release, or None."""
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def tuned_with(path: Path) -> dict[str, str]:
    """{package: version} of the run that tuned the configs in `path` (empty where unrecorded)."""
    try:
        lines = (path / TUNED_WITH).read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(maxsplit=1) for line in lines if len(line.split()) == 2)


@functools.cache
def shipped_dir(device_name: str, fla_version: str | None, capability: str | None = None) -> Path | None:
    """The shipped configs of this GPU for this fla-core release, else those of a GPU of the same compute
    `capability` ("9.0"), or None where none were tuned with that release."""
    if fla_version is None:
        return None
    candidates = [CONFIG_ROOT / gpu_dir_name(device_name)]
    if capability is not None and CONFIG_ROOT.is_dir():
        candidates += sorted(p for p in CONFIG_ROOT.iterdir() if tuned_with(p).get("capability") == capability)
    for path in candidates:
        if path.is_dir() and any(path.glob("*.json")) and tuned_with(path).get("fla-core") == fla_version:
            return path
    return None


def use_shipped(device_name: str, capability: str | None = None) -> Path | None:
    """Point fla at this GPU's shipped configs (or a GPU's of its compute `capability`) unless the user chose a
    config dir or mode. Returns the directory fla will read, or None (none tuned, or the user's settings kept)."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    path = shipped_dir(device_name, installed_fla(), capability)
    if path is not None:
        os.environ["FLA_CONFIG_DIR"] = str(path)
        os.environ["FLA_CACHE_MODE"] = "strict"
        if path.name != gpu_dir_name(device_name):
            print(f"qspec: fla's prefill kernels take the configs tuned on {path.name} (compute capability "
                  f"{capability}); none were tuned on {device_name}", file=sys.stderr, flush=True)
    return path
