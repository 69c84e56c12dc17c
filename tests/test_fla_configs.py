"""The shipped configs of fla's chunked prefill kernels: where they are found, when fla is pointed at them, and that
each file is one fla reads (its format, fla.ops.utils.cache.KernelConfigFile)."""

from __future__ import annotations

import json

import pytest

from qspec.kernels import fla_configs

SHIPPED = sorted(fla_configs.CONFIG_ROOT.glob("*/*.json"))


def test_each_gpu_records_its_tuning_run() -> None:
    for gpu in (p for p in fla_configs.CONFIG_ROOT.iterdir() if p.is_dir()):
        assert set(fla_configs.tuned_with(gpu)) == {"fla-core", "triton", "capability"}, gpu.name


@pytest.mark.parametrize("name, expected", [("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"),
                                            ("NVIDIA H200", "NVIDIA_H200"), ("  ", "unknown_gpu")])
def test_gpu_dir_name_sanitises_as_fla(name: str, expected: str) -> None:
    assert fla_configs.gpu_dir_name(name) == expected


def _tuned_gpu(monkeypatch: pytest.MonkeyPatch) -> str:
    """A GPU with shipped configs, fla-core's installed release made the one they were tuned with, no FLA_* set."""
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    tuned = sorted(p.name for p in fla_configs.CONFIG_ROOT.iterdir() if p.is_dir())
    assert tuned, "no GPU's configs are shipped"
    version = fla_configs.tuned_with(fla_configs.CONFIG_ROOT / tuned[0])["fla-core"]
    monkeypatch.setattr(fla_configs, "installed_fla", lambda: version)
    return tuned[0]


def test_use_shipped_points_fla_at_a_tuned_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = _tuned_gpu(monkeypatch)
    path = fla_configs.use_shipped(tuned.replace("_", " "))
    assert path == fla_configs.CONFIG_ROOT / tuned
    assert fla_configs.os.environ["FLA_CONFIG_DIR"] == str(path)
    assert fla_configs.os.environ["FLA_CACHE_MODE"] == "strict"  # a config only for the exact key it was tuned for


def test_a_gpu_without_configs_takes_those_of_its_capability(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    """An H200 (none tuned on it) takes the configs of a GPU of its compute capability, and says so; a GPU of
    another capability takes none."""
    tuned = _tuned_gpu(monkeypatch)
    capability = fla_configs.tuned_with(fla_configs.CONFIG_ROOT / tuned)["capability"]
    assert fla_configs.use_shipped("Some GPU nobody tuned", "1.0") is None
    assert "FLA_CONFIG_DIR" not in fla_configs.os.environ
    path = fla_configs.use_shipped("Some GPU nobody tuned", capability)
    assert path == fla_configs.CONFIG_ROOT / tuned and fla_configs.os.environ["FLA_CONFIG_DIR"] == str(path)
    assert f"the configs tuned on {tuned} (compute capability {capability})" in capsys.readouterr().err


def test_use_shipped_leaves_others_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = _tuned_gpu(monkeypatch)
    assert fla_configs.use_shipped("Some GPU nobody tuned") is None
    assert "FLA_CONFIG_DIR" not in fla_configs.os.environ and "FLA_CACHE_MODE" not in fla_configs.os.environ
    monkeypatch.setattr(fla_configs, "installed_fla", lambda: "0.0.1")  # another release: its kernels may differ
    assert fla_configs.use_shipped(tuned) is None
    monkeypatch.setattr(fla_configs, "installed_fla", lambda: None)  # fla not installed
    assert fla_configs.use_shipped(tuned) is None
    assert "FLA_CONFIG_DIR" not in fla_configs.os.environ
    _tuned_gpu(monkeypatch)
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")  # the user's choice wins
    assert fla_configs.use_shipped(tuned) is None
    assert "FLA_CONFIG_DIR" not in fla_configs.os.environ


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_file_format(path) -> None:
    doc = json.loads(path.read_text())
    assert doc["kernel_name"] == path.stem
    assert doc["autotune_entries"], "a file without entries would make fla autotune anyway"
    for entry in doc["autotune_entries"].values():
        assert isinstance(entry["autotune_key"], list)
        cfg = entry["config"]
        assert isinstance(cfg["kwargs"], dict) and cfg["num_warps"] > 0 and cfg["num_stages"] > 0


def test_shipped_files_read_by_fla() -> None:
    cache = pytest.importorskip("fla.ops.utils.cache")
    for path in SHIPPED:
        parsed = cache.KernelConfigFile.from_dict(path, json.loads(path.read_text()))
        assert parsed is not None and parsed.autotune_entries
        for h, entry in parsed.autotune_entries.items():
            key = cache.AutotuneKey(autotune_key=tuple(entry["autotune_key"]))
            assert cache.AutotuneKey.key_hash(key.autotune_key) == h  # fla's exact lookup finds it
