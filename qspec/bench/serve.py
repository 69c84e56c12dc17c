"""`qspec bench serve`: many clients at once against a running server (`qspec serve`, or any OpenAI-style
completions server), as vLLM's `bench serve` and SGLang's `bench_serving` measure one.

Each client sends its requests one after the other: a streamed /v1/completions request whose prompt is a slice
of the Rust merge task's text (a different slice each, so no two prompts share more than the server's own prefix
reuse finds), `ignore_eos` so that every request generates `max_tokens`, greedy. Per request: the time to its first
text (TTFT), its latency, and the gaps between the pieces of text it streams (with speculative decoding a piece
holds all the tokens a round accepted, so a gap is a round's, not a token's). Totals: requests and output tokens
per second over the whole run, and TPOT, each request's time per output token after its first. Only the standard
library speaks HTTP here, so the tool adds no dependency.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CHARS_PER_TOKEN = 3.5  # the merge task's text in Qwen's tokens, about: prompt_tokens is a target, usage says


@dataclass
class RequestTiming:
    """One streamed request, seconds from its send."""
    ttft: float = 0.0
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between the streamed pieces of text after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def prompt_text(index: int, prompt_tokens: int) -> str:
    """Request `index`'s prompt: about `prompt_tokens` tokens of the merge task's text from an offset of its own."""
    source = (Path(__file__).resolve().parent / "merge_task.rs").read_text()
    chars = int(prompt_tokens * CHARS_PER_TOKEN)
    start = (index * 997) % len(source)
    text = (source[start:] + source) * (chars // len(source) + 2)
    return text[:chars]


def timed_request(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> RequestTiming:
    """POST a streamed completion and time its server-sent events."""
    parts = urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {api_key}"} if api_key else {})
    out, t0, last = RequestTiming(), time.perf_counter(), None
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            out.error = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
            return out
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out.error = event["error"].get("message", "error event")
                return out
            now = time.perf_counter() - t0
            if event.get("choices") and event["choices"][0].get("text"):
                if last is None:
                    out.ttft = now
                else:
                    out.gaps.append(now - last)
                last = now
            if event.get("usage"):
                out.prompt_tokens = event["usage"]["prompt_tokens"]
                out.output_tokens = event["usage"]["completion_tokens"]
        out.latency = time.perf_counter() - t0
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def run_serve(url: str, requests: int = 32, concurrency: int = 8, prompt_tokens: int = 512, max_tokens: int = 128,
              model: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """`requests` streamed completions through `concurrency` clients at once -> the run's summary and each
    request's timing."""
    if requests < 1 or concurrency < 1 or prompt_tokens < 1 or max_tokens < 1:
        raise ValueError("requests, concurrency, prompt tokens and max tokens must each be >= 1")
    bodies = [{"prompt": prompt_text(i, prompt_tokens), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "ignore_eos": True} | ({"model": model} if model else {}) for i in range(requests)]
    done: list[RequestTiming | None] = [None] * requests
    lock, next_index = threading.Lock(), [0]

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            done[i] = timed_request(url, bodies[i], api_key, timeout)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    timings = [t for t in done if t is not None]
    return summarize(timings, time.perf_counter() - t0) | {
        "url": url, "concurrency": concurrency, "max_tokens": max_tokens, "prompt_tokens_target": prompt_tokens,
        "requests": [asdict(t) for t in timings]}


def summarize(timings: list[RequestTiming], seconds: float) -> dict[str, Any]:
    """Totals and TTFT / TPOT / gap percentiles (ms) of the requests that succeeded."""
    ok = [t for t in timings if t.error is None]
    out_tokens = sum(t.output_tokens for t in ok)
    tpot = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    return {"completed": len(ok), "failed": len(timings) - len(ok),
            "errors": sorted({t.error for t in timings if t.error})[:5], "seconds": seconds,
            "request_per_s": len(ok) / seconds, "output_tok_per_s": out_tokens / seconds,
            "prompt_tokens": sum(t.prompt_tokens for t in ok), "output_tokens": out_tokens,
            "ttft_ms": _percentiles([t.ttft for t in ok]), "tpot_ms": _percentiles(tpot),
            "gap_ms": _percentiles([g for t in ok for g in t.gaps])}


def markdown(result: dict[str, Any]) -> str:
    """The summary as a short Markdown report."""
    lines = [f"{result['completed']} requests ({result['failed']} failed) through {result['concurrency']} clients "
             f"in {result['seconds']:.2f} s: {result['request_per_s']:.2f} requests/s, "
             f"{result['output_tok_per_s']:.2f} output tok/s ({result['prompt_tokens']} prompt tokens, "
             f"{result['output_tokens']} generated)", "",
             "| ms | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for key, name in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                      ("gap_ms", "gap between streamed pieces")):
        p = result[key]
        lines.append(f"| {name} | {p['mean']:.2f} | {p['p50']:.2f} | {p['p90']:.2f} | {p['p99']:.2f} |")
    lines += [f"- error: {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def _percentiles(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ms = sorted(s * 1e3 for s in seconds)
    def at(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]
    return {"mean": statistics.fmean(ms), "p50": statistics.median(ms), "p90": at(0.90), "p99": at(0.99)}
