"""The server under load on the GPU: `qspec serve` on a flash-next-geometry GGUF, measured by `qspec bench serve`
(qspec/bench/serve.py) at several numbers of clients at once, one server configuration after the other.

The GGUF is written first (scripts/gguf_load.py's writer: tensors drawn and quantized on the device one at a time in
llama.cpp's `--quant` types, random weights) unless it exists. Each `--servers` entry is a `qspec serve` of that file
with these extra flags, e.g. `plain=--draft 0` or `mtp3=--draft 3 --accept-profile p=0.85` (a replayed acceptance:
random weights accept no drafts by themselves). Each server warms up (compiles, captures its graphs for every batch
size) before its first client; then for each concurrency C, 2C requests (at least 4) of `--prompt-tokens` and
`--max-tokens` run through C clients. Writes OUT.md (a table per server, throughput and latency) and OUT.json.

    PYTHONPATH=. python scripts/serve_gpu.py --layers 8 --quant q4_k_m --file /var/tmp/fn8.gguf \
        --servers "plain=--draft 0|mtp3=--draft 3 --accept-profile p=0.85" --concurrency 1,4,8 --out OUT
"""

from __future__ import annotations

import argparse
import datetime as _dt
import http.client
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from qspec.bench.run import git_commit  # noqa: E402
from qspec.bench.serve import run_serve  # noqa: E402


def ensure_file(a: argparse.Namespace) -> dict[str, Any]:
    """Write the GGUF unless it is there -> what was written (or found)."""
    if Path(a.file).exists():
        return {"file": a.file, "file_bytes": os.path.getsize(a.file), "written": False}
    from gguf_load import write  # drawn on the device; imports torch

    return write(argparse.Namespace(preset=a.preset, layers=a.layers, quant=a.quant, device=a.device,
                                    file=a.file)) | {"written": True}


def start_server(a: argparse.Namespace, extra: str, log: Path) -> subprocess.Popen:
    """`qspec serve FILE` with the common and the server's own flags, its output into `log`."""
    cmd = [sys.executable, "-c", "import sys; from qspec.cli import main; sys.exit(main(sys.argv[1:]))", "serve",
           "--model", a.file, "--device", a.device, "--port", str(a.port), "--max-batch", str(a.max_batch),
           *shlex.split(a.common), *shlex.split(extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, port: int, limit: float) -> float:
    """Seconds until GET /health answers 200 (the server answers 503 and the part it is at while it warms up);
    RuntimeError if it exits or does not within `limit`, naming the part it was at."""
    t0, part = time.perf_counter(), "not listening"
    while time.perf_counter() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it served")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            r = conn.getresponse()
            if r.status == 200:
                return time.perf_counter() - t0
            part = json.loads(r.read() or b"{}").get("part", part)
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer /health within {limit:.0f} s (its warm-up was at: {part})")


def measure(a: argparse.Namespace, name: str, extra: str, out: Path) -> dict[str, Any]:
    """One server: started, warmed, loaded at each concurrency, stopped."""
    log = out.with_name(f"{out.name}-{name}.log")
    proc = start_server(a, extra, log)
    res: dict[str, Any] = {"server": name, "flags": extra, "runs": []}
    try:
        res["ready_s"] = wait_healthy(proc, a.port, a.ready_limit)
        for c in a.concurrency:
            r = run_serve(f"http://127.0.0.1:{a.port}", requests=max(4, 2 * c), concurrency=c,
                          prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens)
            res["runs"].append(r)
            print(f"{name} c={c}: {r['output_tok_per_s']:.2f} tok/s, {r['completed']} done, {r['failed']} failed",
                  flush=True)
    except RuntimeError as e:
        res["error"] = str(e)
        print(f"{name}: {e}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return res


def report(head: dict[str, Any], servers: list[dict[str, Any]]) -> str:
    lines = [f"# qspec serve under load ({head['commit']}, {head['date']}, {head['device']})", "",
             f"{head['layers']} layers, {head['quant']}, {head['file_bytes'] / 2**30:.2f} GiB GGUF; "
             f"{head['prompt_tokens']}-token prompts, {head['max_tokens']} generated, greedy, ignore_eos; "
             f"`--max-batch {head['max_batch']} {head['common']}`", "",
             "| server | clients | requests | output tok/s | req/s | TTFT median ms | TPOT median ms | "
             "TPOT p90 ms | gap median ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in servers:
        if "error" in s:
            lines.append(f"| {s['server']} | — | — | {s['error']} | | | | | |")
        for r in s["runs"]:
            lines.append(f"| {s['server']} | {r['concurrency']} | {r['completed']} ({r['failed']} failed) | "
                         f"{r['output_tok_per_s']:.2f} | {r['request_per_s']:.3f} | {r['ttft_ms']['p50']:.1f} | "
                         f"{r['tpot_ms']['p50']:.2f} | {r['tpot_ms']['p90']:.2f} | {r['gap_ms']['p50']:.2f} |")
    lines += ["", *(f"- {s['server']}: `{s['flags']}`, ready after {s.get('ready_s', float('nan')):.1f} s"
                    for s in servers)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--file", required=True, help="the GGUF to serve (written first unless it exists)")
    ap.add_argument("--servers", default="plain=--draft 0|mtp3=--draft 3 --accept-profile p=0.85",
                    help="NAME=FLAGS entries, separated by |")
    ap.add_argument("--common", default="--kv-type q8_0 --ctx 4096", help="flags every server takes")
    ap.add_argument("--max-batch", default="8")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--ready-limit", type=float, default=400.0, help="seconds a server may take to serve")
    ap.add_argument("--out", type=Path, required=True, help="write OUT.md and OUT.json (logs OUT-NAME.log)")
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    written = ensure_file(a)
    print(f"file: {written}", flush=True)
    import torch

    head = {"commit": git_commit(), "date": _dt.date.today().isoformat(), "layers": a.layers, "quant": a.quant,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "file_bytes": written["file_bytes"], "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
            "max_batch": a.max_batch, "common": a.common, "write": written}
    servers = []
    for entry in a.servers.split("|"):
        name, _, flags = entry.partition("=")
        servers.append(measure(a, name.strip(), flags, a.out))
        a.out.with_suffix(".json").write_text(json.dumps({"head": head, "servers": servers}, indent=1))
    text = report(head, servers)
    a.out.with_suffix(".md").write_text(text)
    print(text)
    return 0 if all("error" not in s for s in servers) else 1


if __name__ == "__main__":
    sys.exit(main())
