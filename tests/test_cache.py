"""qspec/cache.py: one directory for what outlives a process, and inductor's cache kept there by the command line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qspec.cache import cache_dir, keep_compiled_graphs


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QSPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "qspec"
    monkeypatch.setenv("QSPEC_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def test_the_command_line_keeps_compiled_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`qspec ...` points inductor's cache into qspec's directory, unless the environment chose one."""
    from qspec.cli import main

    monkeypatch.setenv("QSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert main(["--help"]) == 0
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    keep_compiled_graphs()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "chosen")
