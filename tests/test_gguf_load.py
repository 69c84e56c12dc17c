"""scripts/gguf_load.py on the CPU at the tiny preset: the file it writes from tensors drawn one at a time loads,
holds the mix's block types, and the report carries every measurement (the H200 run: benchmarks/seed_protocol.sh
h200-q4km24-load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader

from qspec.bench.device_model import bench_config
from qspec.weights.quant_mix import mix_plan


def test_gguf_load_writes_loads_and_reports(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    f, out = tmp_path / "m.gguf", tmp_path / "r"
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, str(root / "scripts" / "gguf_load.py"), "--preset", "tiny", "--layers", "2",
                        "--device", "cpu", "--file", str(f), "--tokens", "8", "--out", str(out), "--compile-ahead",
                        "--profile-warm", str(tmp_path / "warm.prof.txt")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = bench_config("tiny", layers=2)
    plan = mix_plan("q4_k_m", cfg)
    got = {t.name: t.tensor_type for t in GGUFReader(f).tensors}
    blocks = {n: q for n, q in got.items() if q != GGMLQuantizationType.F32}
    assert blocks and all(plan[n] == q for n, q in blocks.items())  # the mix's types (at this size, its fallbacks)
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["file_bytes"] == f.stat().st_size and res["layers"] == 2
    assert res["load_s"] >= res["load_alone_s"] > 0 and "stand-in" in res["stand_in"]
    assert res["load_s"] > 0 and res["peak_rss"] >= res["rss_before_load"] > 0 and res["decode_tps_second_request"] > 0
    assert 0 < res["first_token_s"] <= res["second_token_s"] <= res["third_token_s"]
    warm = res["warm"]  # the second fresh process: the same load, its first tokens, no decode-speed request
    assert warm["load_s"] > 0 and warm["first_token_s"] > 0 and "decode_tps_second_request" not in warm
    assert {"torch_s", "triton_s", "triton_kernels"} <= res["first_request_compile"].keys()
    md = out.with_suffix(".md").read_text()
    assert "with a stand-in compiling beside it" in md
    assert "first / second / third token" in md and "caches warm" in md and "Compiled in the first process" in md
    assert "generate" in (tmp_path / "warm.prof.txt").read_text()  # the warm first request's profile


def test_gguf_load_drawn_builds_on_the_device_without_a_file(tmp_path: Path) -> None:
    """--drawn: no file is written or read; each fresh process builds the model itself, and the report says so."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r"
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(root / "scripts" / "gguf_load.py"), "--preset", "tiny", "--layers", "1", "--device",
           "cpu", "--quant", "q8_0", "--drawn", "--tokens", "4", "--out", str(out)]
    r = subprocess.run([*cmd, "--no-compile", "--profile-cold", str(tmp_path / "cold.prof.txt")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["drawn"] and res["file_bytes"] == 0 and "Q8_0 (blocks)" in res["weights"] and res["compile"] is False
    assert 0 < res["first_token_s"] <= res["second_token_s"] and res["warm"]["first_token_s"] > 0
    by_token = res["compiled_by_token"]  # what had compiled by each of the three first tokens, never decreasing
    assert len(by_token) == 3 and all(a["triton_s"] <= b["triton_s"] for a, b in zip(by_token[:-1], by_token[1:],
                                                                                      strict=True))
    md = out.with_suffix(".md").read_text()
    assert "built on the device (no file), the steps' small ops not compiled" in md and "Compiled by the first" in md
    assert "generate" in (tmp_path / "cold.prof.txt").read_text()  # the cold first request's profile
    bad = subprocess.run(cmd[:-5], capture_output=True, text=True, env=env, timeout=60)  # neither --file nor --drawn
    assert bad.returncode == 2 and "--file is required unless --drawn" in bad.stderr
