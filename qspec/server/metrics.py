"""The server's counters, served at GET /metrics in Prometheus' text format (what vLLM's and llama.cpp's servers
export, so the same dashboards and alerts apply): requests by how they ended, tokens, speculation's drafted and
accepted tokens, the queue, and the time to the first token."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from qspec.engine import Generation

# upper bounds (seconds) of the time-to-first-token histogram's buckets
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class ServerMetrics:
    """Updated from the event loop and the engine's worker thread, under one lock."""
    model: str
    requests: dict[str, int] = field(default_factory=dict)  # finish reason (stop, length, error, ...) -> count
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # not prefilled: the caches held them (qspec/prefix.py)
    generation_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    waiting: int = 0  # requests queued for the engine
    running: int = 0  # 0 or 1 (the engine runs one request at a time), or up to a batcher's slots
    rejected: int = 0  # refused because the queue was full
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))  # per bucket, +Inf last
    ttft_sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_request(self, finish: list[str], prompt_tokens: int, generated: int, gens: list[Generation]) -> None:
        """A request that ended: its choices' finish reasons, its prompts' tokens and its counted tokens."""
        with self._lock:
            for f in finish:
                self.requests[f] = self.requests.get(f, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.cached_prompt_tokens += sum(g.cached_tokens for g in gens)
            self.generation_tokens += generated
            self.drafted_tokens += sum(g.spec.drafted for g in gens)
            self.accepted_tokens += sum(g.spec.accepted for g in gens)

    def first_token(self, seconds: float) -> None:
        """A request's first token came `seconds` after it arrived."""
        with self._lock:
            self.ttft[next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))] += 1
            self.ttft_sum += seconds

    def queue(self, waiting: int = 0, running: int = 0, rejected: int = 0) -> None:
        with self._lock:
            self.waiting += waiting
            self.running += running
            self.rejected += rejected

    def render(self, batch_steps: tuple[int, int, int, int] | None = None) -> str:
        """Prometheus' text exposition format; `batch_steps`: a batcher's steps, their rows, its speculative
        rounds and its slots (qspec/batch.py)."""
        with self._lock:
            lab = f'model_name="{_label(self.model)}"'
            out = _metric("qspec:requests_total", "counter", "requests ended, by the first choice's finish reason",
                          [(f'{lab},finished_reason="{k}"', v) for k, v in sorted(self.requests.items())] or
                          [(lab, 0)])
            for name, help_, value in [
                    ("prompt_tokens_total", "prompt tokens", self.prompt_tokens),
                    ("prompt_tokens_cached_total", "prompt tokens the caches held (not prefilled)",
                     self.cached_prompt_tokens),
                    ("generation_tokens_total", "tokens generated", self.generation_tokens),
                    ("spec_decode_num_draft_tokens_total", "draft tokens verified", self.drafted_tokens),
                    ("spec_decode_num_accepted_tokens_total", "draft tokens accepted", self.accepted_tokens),
                    ("requests_rejected_total", "requests refused with the queue full", self.rejected)]:
                out += _metric(f"qspec:{name}", "counter", help_, [(lab, value)])
            out += _metric("qspec:num_requests_waiting", "gauge", "requests queued", [(lab, self.waiting)])
            out += _metric("qspec:num_requests_running", "gauge", "requests running", [(lab, self.running)])
            if batch_steps is not None:  # rows / steps: the mean batch
                out += _metric("qspec:batch_steps_total", "counter", "batched decode steps", [(lab, batch_steps[0])])
                out += _metric("qspec:batch_rows_total", "counter", "rows (requests' tokens) of batched decode steps",
                               [(lab, batch_steps[1])])
                out += _metric("qspec:batch_rounds_total", "counter", "passes of the batch that were speculative "
                               "rounds (the others were plain steps)", [(lab, batch_steps[2])])
                out += _metric("qspec:batch_slots", "gauge", "requests the batch decodes at once at most (--max-batch)",
                               [(lab, batch_steps[3])])
            cum, rows = 0, []
            for b, n in zip((*TTFT_BUCKETS, "+Inf"), self.ttft, strict=True):
                cum += n
                rows.append((f'{lab},le="{b}"', cum))
            out += _metric("qspec:time_to_first_token_seconds", "histogram", "seconds from a request's arrival to "
                           "its first token", [], rows, (lab, self.ttft_sum, cum))
            return out


def _metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]],
            buckets: list[tuple[str, int]] | None = None, totals: tuple[str, float, int] | None = None) -> str:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" for labels, value in samples]
    lines += [f"{name}_bucket{{{labels}}} {value}" for labels, value in buckets or []]
    if totals is not None:
        lines += [f"{name}_sum{{{totals[0]}}} {totals[1]}", f"{name}_count{{{totals[0]}}} {totals[2]}"]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A label value escaped as the text format requires (backslash, double quote, line feed)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
