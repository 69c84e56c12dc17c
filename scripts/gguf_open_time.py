"""How long a GGUF takes to open on this machine, by stage: the header and metadata (`read_gguf_metadata`), a first
tokenizer load with no cache (`load_tokenizer`), and a whole load with the page cache warm, the matrices kept as
blocks on the CPU (`read_gguf`: the file's bytes copied once, no expansion). Only public functions, so the same
script times older trees (`PYTHONPATH=<tree> python scripts/gguf_open_time.py FILE`).

    python scripts/gguf_open_time.py model.gguf --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable


def _time(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache  # the tokenizer cache starts empty at every rep (cleared below)
        from qspec.loader import load_tokenizer
        from qspec.weights import read_gguf, read_gguf_metadata

        def tokenizer() -> None:
            shutil.rmtree(os.path.join(cache, "qspec"), ignore_errors=True)
            load_tokenizer(a.file)

        read_gguf(a.file, device="cpu", dequantize_all=False)  # the page cache warm
        rows = {"header and metadata (read_gguf_metadata)": _time(lambda: read_gguf_metadata(a.file), a.reps),
                "first tokenizer load, no cache (load_tokenizer)": _time(tokenizer, a.reps),
                "whole load, blocks on the CPU, page cache warm (read_gguf)":
                    _time(lambda: read_gguf(a.file, device="cpu", dequantize_all=False), a.reps)}
    import qspec
    print(f"# {a.file} ({os.path.getsize(a.file) / 1e9:.2f} GB), qspec from {os.path.dirname(qspec.__file__)}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; seconds, median [min-max] of {a.reps}")
    for name, t in rows.items():
        print(f"{name}: {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
