"""Benchmarks of the seed's protocol: the Rust merge task and the context sweep.

API: `run_merge(...)`, `run_sweep(...)` (result dicts), `report_files(paths, ...)` (render / combine result files),
`build_prompt(tokenizer, n)`, `AcceptProfile.parse(spec)`, `parse_arms(spec)`; CLI: `add_parser(subparsers)`
registers `qspec bench merge|sweep|report`.
Imports are lazy so that `import qspec.bench` stays cheap for the top-level CLI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AcceptProfile", "Arm", "BenchPrompt", "add_parser", "build_prompt", "parse_arms", "run_merge",
           "report_files", "run_sweep"]

_WHERE = {"AcceptProfile": "accept", "Arm": "arms", "parse_arms": "arms", "BenchPrompt": "prompt",
          "build_prompt": "prompt", "add_parser": "cli", "run_merge": "cli", "run_sweep": "cli", "report_files": "cli"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"qspec.bench.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'qspec.bench' has no attribute {name!r}")
