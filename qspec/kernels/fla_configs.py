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
FLA_CONFIG_DIR or FLA_CACHE_MODE is left alone.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "assets" / "fla_configs"


def gpu_dir_name(device_name: str) -> str:
    """The directory of a GPU's configs: its name as fla sanitises it (fla.ops.utils.cache.sanitize_gpu_name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


@functools.cache
def shipped_dir(device_name: str) -> Path | None:
    """The shipped configs of this GPU, or None where none were tuned on it."""
    path = CONFIG_ROOT / gpu_dir_name(device_name)
    return path if path.is_dir() and any(path.glob("*.json")) else None


def use_shipped(device_name: str) -> Path | None:
    """Point fla at this GPU's shipped configs unless the user chose a config dir or mode. Returns the directory
    fla will read, or None (no configs for this GPU, or the user's settings kept)."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    path = shipped_dir(device_name)
    if path is not None:
        os.environ["FLA_CONFIG_DIR"] = str(path)
        os.environ["FLA_CACHE_MODE"] = "strict"
    return path
