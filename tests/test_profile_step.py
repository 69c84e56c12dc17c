"""scripts/profile_step.py's idle-time table: the GPU's busy time is the union of kernel intervals (with PDL a kernel
starts before the one ahead of it ends) and the gaps are attributed to the kernels around them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from conftest import load_script


def _kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, name=name,
                           time_range=SimpleNamespace(start=start, end=end))


def test_gap_table_busy_is_the_union_and_gaps_name_their_kernels() -> None:
    ps = load_script("profile_step")
    host = SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, name="cudaGraphLaunch",
                           time_range=SimpleNamespace(start=0.0, end=1000.0))
    # µs: a and b overlap (PDL), c inside b's shadow adds nothing, then two gaps of 5 and 10 and one of 5
    events = [_kernel("b", 800.0, 2000.0), host, _kernel("a", 0.0, 1000.0), _kernel("c", 1500.0, 1900.0),
              _kernel("d", 7000.0, 9000.0), _kernel("e", 2005.0, 3000.0), _kernel("a", 14000.0, 15000.0)]
    prof = SimpleNamespace(events=lambda: events)
    out = ps.gap_table(prof, 2, 10, "round")  # two rounds
    # busy: [0, 2000] + [2005, 3000] + [7000, 9000] + [14000, 15000] = 5995 µs -> 2.998 ms per round (summed kernel
    # times would give 6.6 ms); idle 5 + 4000 + 5000 µs -> 4.503 ms per round
    assert "GPU busy (union of kernel intervals) 2.998 ms per round" in out
    assert "idle between kernels 4.503 ms per round" in out
    rows = out.splitlines()[2:]
    assert rows[0].split()[-3:] == ["d", "->", "a"] and rows[0].split()[0] == "2500.0"
    assert rows[1].split()[-3:] == ["e", "->", "d"] and rows[1].split()[0] == "2000.0"
    assert rows[2].split()[-3:] == ["b", "->", "e"] and rows[2].split()[0] == "2.5"
    assert len(rows) == 3


def test_span_table_credits_each_kernel_with_what_it_adds() -> None:
    """The same events by end time: a adds its 1000 µs; c (inside b, ending first) its 400; b (PDL, started inside a)
    only what a and c leave of it, 600; e 995, d 2000, a 1000 again: the credits sum to the busy time."""
    ps = load_script("profile_step")
    events = [_kernel("b", 800.0, 2000.0), _kernel("a", 0.0, 1000.0), _kernel("c", 1500.0, 1900.0),
              _kernel("d", 7000.0, 9000.0), _kernel("e", 2005.0, 3000.0), _kernel("a", 14000.0, 15000.0)]
    out = ps.span_table(SimpleNamespace(events=lambda: events), 2, 10, "round")
    assert "2.998 ms per round" in out.splitlines()[0]
    rows = {r.split()[-1]: float(r.split()[0]) for r in out.splitlines()[1:]}
    assert rows == {"a": 1000.0, "d": 1000.0, "e": 497.5, "b": 300.0, "c": 200.0}


def test_gap_table_without_gpu_events() -> None:
    assert load_script("profile_step").gap_table(SimpleNamespace(events=lambda: []), 1, 5, "round") == "  no GPU events"


def test_profile_step_runs_on_the_cpu_with_a_plain_stretch() -> None:
    """The script end to end at the tiny preset (a smoke run: no GPU rows), plain decoding and an automatic-depth
    engine held at depth 0 (one plain stretch, timed per token, not per round)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "profile_step.py"), "--preset", "tiny", "--device",
                        "cpu", "--layers", "2", "--prompt", "64", "--steps", "1", "--kinds", "decode", "--draft", "3",
                        "--e2e", "8", "--e2e-stretch", "--top", "3"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(root)), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decode: first request (prefill, compilation)" in r.stdout and "compiling: torch.compile" in r.stdout
    assert "end to end, 8 tokens after a 64-token prompt, draft 0:" in r.stdout
    stretch = next(x for x in r.stdout.splitlines() if x.startswith("plain stretch: "))
    assert "draft 3:" in stretch and "ms per token (8 tokens)" in stretch


def test_ncu_summary_one_row_per_launch(tmp_path: Path) -> None:
    """scripts/ncu_kernels.py --summarize: each launch's grid and metrics from an ncu text log, in order; a metric the
    log lacks is '-', and a later section's metric of the same name does not overwrite the first."""
    nk = load_script("ncu_kernels")
    log = tmp_path / "ncu.txt"
    log.write_text("""==PROF== Connected
  _a_kernel (10, 2, 1)x(64, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    DRAM Throughput                   %        39.88
    Duration                         us        12.45
    L1/TEX Cache Throughput           %        84.39
    Registers Per Thread             register/thread              60
    Achieved Occupancy                        %        44.50
    Duration                         us        99.99
  _b_kernel (3, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us         1,234.5
""")
    rows = nk.summarize(log).splitlines()
    assert rows[2] == "| _a_kernel (10, 2, 1) | 12.45 | 39.88 | 84.39 | 44.50 | 60 |"
    assert rows[3] == "| _b_kernel (3, 1, 1) | 1,234.5 | - | - | - | - |" and len(rows) == 4
