"""Per-step cost of the PLE n-gram row gather from a full-size table in host memory, on a GPU.

    python -m qspec.bench.ple_gather                       # 320 M rows x 170 bytes (Q8_0 of 160: 54.4 GB)
    python -m qspec.bench.ple_gather --rows 20000000       # a smaller table, for a quick look
    python -m qspec.bench.ple_gather --json out.json       # the rows as JSON too

The table is page-locked host memory in pieces (weights/pinned.py), filled with a repeated random pattern (the
values do not matter for the timing, only that the rows are spread over the whole table). For T tokens x 16 heads
per step it times:
  graph    the device gather (Triton kernel reading host memory over PCIe) and the Q8_0 dequantization, replayed
           from a CUDA graph as a step runs it;
  kernel   the raw-row kernel alone, from a graph;
  eager    the device gather launched eagerly (Python launch overhead included);
  host     the fallback path (`HostRowTable.gather`: indices to the host, numpy indexing, copy back, dequantize),
           over the first piece as a one-segment table (6.3 M rows, 1 GiB: a GGUF table is one segment, and a
           second 54 GB copy in pageable memory would not fit the host); its row reads are DRAM misses either way.
Each timed graph replay holds K gathers over K fresh random row sets (drawn before the replay, outside the timing),
so no row is read twice from the GPU's caches; times are medians per gather in microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from qspec.kernels.row_gather import RowPieces, gather_rows
from qspec.weights.gguf_io import HostRowTable
from qspec.weights.pinned import HOST_MARGIN_BYTES, PIECE_BYTES, PinnedRowTable, available_host_bytes

FULL_ROWS = 320_001_536  # the real table, padded to a multiple of 128 rows
Q8_ROW_BYTES = 170  # a Q8_0 row of 160 values: 5 blocks of (f16 scale + 32 int8)
K = 32  # gathers per timed replay


def pinned_table(rows: int, row_bytes: int, device: torch.device) -> tuple[PinnedRowTable, float]:
    """A page-locked [rows, row_bytes] table filled with a repeated random pattern -> (table, seconds to build)."""
    t0 = time.perf_counter()
    per = PIECE_BYTES // row_bytes
    pattern = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    pieces = []
    for first in range(0, rows, per):
        p = torch.empty(min(per, rows - first), row_bytes, dtype=torch.uint8, pin_memory=True)
        flat = p.view(-1)
        for off in range(0, flat.numel(), pattern.numel()):
            n = min(pattern.numel(), flat.numel() - off)
            flat[off:off + n].copy_(pattern[:n])  # 64 MiB is no multiple of a row: rows still differ
        pieces.append(p)
    table = PinnedRowTable(RowPieces.of(pieces, per, device), GGMLQuantizationType.Q8_0, 160)
    return table, time.perf_counter() - t0


def _median_us(times_ms: list[float], per: int) -> float:
    return statistics.median(times_ms) * 1e3 / per


def time_graph(fn: Callable[[torch.Tensor], object], rows: list[torch.Tensor], n_rows: int, reps: int) -> float:
    """Median µs per call of fn over the row sets `rows`, K calls captured in one graph, fresh rows per replay."""
    for r in rows:
        fn(r)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in rows:
            fn(r)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        for r in rows:
            r.random_(0, n_rows)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _median_us(times, len(rows))


def time_eager(fn: Callable[[torch.Tensor], object], rows: list[torch.Tensor], n_rows: int, reps: int) -> float:
    """Median µs per call of fn launched eagerly K times in a row (fresh rows below n_rows per repetition)."""
    for r in rows:
        r.random_(0, n_rows)  # the warm-up's rows too: a host table may hold fewer rows than the rows were drawn from
        fn(r)
    times = []
    for _ in range(reps):
        for r in rows:
            r.random_(0, n_rows)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for r in rows:
            fn(r)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return _median_us(times, len(rows))


def bench(table: PinnedRowTable, tokens: list[int], heads: int, reps: int) -> list[dict[str, float]]:
    dev = table.table.bases.device
    host = HostRowTable([table.table.pieces[0].numpy()], table.qtype, table.cols)
    n_host = int(table.table.pieces[0].shape[0])
    out = []
    for T in tokens:
        rows = [torch.empty(T, heads, dtype=torch.int64, device=dev) for _ in range(K)]
        for r in rows:
            r.random_(0, table.shape[0])
        row = {"tokens": T, "rows": T * heads,
               "graph_us": time_graph(lambda r: table.gather(r, dev, torch.bfloat16), rows, table.shape[0], reps),
               "kernel_us": time_graph(lambda r: gather_rows(table.table, r.reshape(-1)), rows, table.shape[0], reps),
               "eager_us": time_eager(lambda r: table.gather(r, dev, torch.bfloat16), rows, table.shape[0], reps),
               "host_us": time_eager(lambda r: host.gather(r, dev, torch.bfloat16), rows, n_host, reps)}
        # (the rows now lie in the first piece, which both tables hold)
        # bitwise: random bytes make NaN scales, which compare unequal to themselves
        ok = all(torch.equal(table.gather(r, dev, torch.bfloat16).view(torch.int16),
                             host.gather(r, dev, torch.bfloat16).view(torch.int16)) for r in rows)
        out.append(row | {"equal": ok})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=FULL_ROWS, help="table rows (default: the real table's)")
    ap.add_argument("--tokens", default="1,6,16", help="tokens per step, comma-separated")
    ap.add_argument("--heads", type=int, default=16, help="rows gathered per token")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ple_gather: needs a CUDA GPU", file=sys.stderr)
        return 2
    need = a.rows * Q8_ROW_BYTES
    if need + HOST_MARGIN_BYTES > available_host_bytes():
        print(f"ple_gather: the table needs {need / 1e9:.1f} GB of host memory (+{HOST_MARGIN_BYTES / 1e9:.0f} spare), "
              f"{available_host_bytes() / 1e9:.1f} GB available; pass a smaller --rows", file=sys.stderr)
        return 2
    table, secs = pinned_table(a.rows, Q8_ROW_BYTES, torch.device("cuda"))
    print(f"table: {a.rows:,} rows x {Q8_ROW_BYTES} B = {need / 1e9:.1f} GB page-locked in "
          f"{len(table.table.pieces)} pieces, allocated and filled in {secs:.1f} s ({need / 1e9 / secs:.1f} GB/s)")
    res = bench(table, [int(t) for t in a.tokens.split(",")], a.heads, a.reps)
    print(f"{'T':>3} {'rows':>5} {'graph us':>9} {'kernel us':>10} {'eager us':>9} {'host us':>8} "
          f"{'host/graph':>10}  equal")
    for r in res:
        print(f"{r['tokens']:>3} {r['rows']:>5} {r['graph_us']:>9.1f} {r['kernel_us']:>10.1f} {r['eager_us']:>9.1f} "
              f"{r['host_us']:>8.1f} {r['host_us'] / r['graph_us']:>10.1f}  {r['equal']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"table_rows": a.rows, "row_bytes": Q8_ROW_BYTES, "pin_s": secs, "steps": res}, fh, indent=1)
    return 0 if all(r["equal"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
