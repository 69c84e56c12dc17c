"""Result files: JSON (every run), a Markdown table like the seed's, and PNG figures like its Figures 1 and 2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qspec.bench.accept import REPLAYED_LABEL


def print_report(lines: list[str], out: Path | None) -> None:
    """A script's report: its lines printed, and written to `out` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)


def k_tokens(n: int) -> str:
    """512 -> '512', 4096 -> '4K', 6144 -> '6K' (the seed's axis labels)."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _pct(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "—"
    return f"{x * 100:+.1f}%".replace("-", "−")


def _tps(med: float, lo: float, hi: float) -> str:
    return f"{med:.2f} [{lo:.2f}–{hi:.2f}]"


def _is_replayed(result: dict[str, Any]) -> bool:
    return result.get("acceptance", {}).get("mode") == "replayed"


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return p


def _model_line(m: dict[str, Any]) -> str:
    if not m:
        return "unknown model"
    parts = [str(m.get("name") or m.get("path") or "model")]
    params = (m.get("params") or {}).get("total")
    if params:
        parts.append(f"{params / 1e9:.2f} B parameters" if params >= 1e8 else f"{params / 1e6:.2f} M parameters")
    if m.get("dtype"):
        parts.append(str(m["dtype"]).replace("torch.", ""))
    if m.get("weights"):
        parts.append(str(m["weights"]))
    return ", ".join(parts)


def _arm_label(arms: list[dict[str, Any]], name: str) -> str:
    for a in arms:
        if a["name"] == name:
            return f"{name} ({a['description']})"
    return name


def _captured_runs(runs: list[dict[str, Any]]) -> list[str]:
    """A line naming the runs that captured CUDA graphs while timed, or none: their decode time includes compiling
    and capturing shapes the warm-up did not meet, so they do not measure steady decoding."""
    hit = [f"{r['arm']} @{k_tokens(r['prompt_tokens'])} run {r['rep'] + 1}: {r['graph_captures']}" for r in runs
           if r.get("graph_captures")]
    if not hit:
        return []
    return ["- **Runs that captured CUDA graphs while timed** (step shapes the warm-up did not meet; compiling and "
            f"capturing them is inside the run's decode time), captures per run: {'; '.join(hit)}"]


def markdown(result: dict[str, Any]) -> str:
    """The seed-style table (configuration | decode tok/s median [min–max] | vs reference) plus details."""
    proto, env, arms = result["protocol"], result["environment"], result["arms"]
    ref = result["reference_arm"]
    summary = result["summary"]
    title = {"merge": "Rust merge benchmark", "sweep": "Context sweep (Rust merge task)"}.get(
        result["benchmark"], result["benchmark"])
    lines = [f"### {title} — {result['label']}", ""]
    if _is_replayed(result):
        lines += [f"> **{REPLAYED_LABEL.capitalize()}**: every round's accepted count comes from the profile "
                  f"`{result['acceptance']['profile']}`, not from the model's drafts. The speeds measure this "
                  "engine's work at that acceptance, not a real model's.", ""]
    full = env.get("git_commit") or "unknown"
    commit = full[:12] + (" (uncommitted changes)" if full.endswith("-dirty") else "")
    prompts = result["prompts"]
    sha = ", ".join(f"{k_tokens(int(k))}: `{v['sha256'][:12]}`" for k, v in prompts.items())
    notes = {v["note"] for v in prompts.values() if v.get("note")}
    lines += [
        f"- Model: {_model_line(result['model'])}",
        f"- Device: {env.get('device_name', env.get('device'))}; torch {env.get('torch')}; commit {commit}",
        f"- Prompt: {', '.join(f'{n:,}' for n in proto['prompt_tokens'])} tokens (ids sha256 {sha}); "
        f"{proto['gen_tokens']:,} generated tokens per run",
        f"- Protocol: greedy, one sequence, {proto['kv_type']} K/V cache, context capacity {proto['capacity']:,}, "
        f"{proto['warmup_tokens']}-token warmup per arm, no prompt caching, stop tokens ignored; "
        f"runs per arm: {proto['reps']}, arms alternated in one process; decode speed = generated tokens / "
        "decode time (prefill excluded)",
    ]
    lines += [f"- Note: {n}" for n in sorted(notes)]
    if result.get("complete") is False:
        planned = len(proto["prompt_tokens"]) * proto["reps"] * len(arms)
        lines.append(f"- **Incomplete**: the process stopped after {len(result['runs'])} of {planned} runs")
    lines += _captured_runs(result["runs"])
    lines.append("")
    by = {(s["arm"], s["prompt_tokens"]): s for s in summary}
    names = [a["name"] for a in arms]
    if len(proto["prompt_tokens"]) == 1:
        p = proto["prompt_tokens"][0]
        lines += ["| Configuration | Decode speed, tok/s median [min–max] | vs " + ref + " |", "|---|---:|---:|"]
        for n in names:
            s = by.get((n, p))
            if s:
                vs = "—" if n == ref else _pct(s["vs_reference"])
                lines.append(f"| {_arm_label(arms, n)} | "
                             f"{_tps(s['decode_tps_median'], s['decode_tps_min'], s['decode_tps_max'])} | {vs} |")
    else:
        others = [n for n in names if n != ref]
        head = ["Prompt tokens"] + [f"{n} tok/s" for n in names] + [f"{n} vs {ref}" for n in others]
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for p in proto["prompt_tokens"]:
            row = [k_tokens(p)]
            for n in names:
                s = by.get((n, p))
                row.append(_tps(s["decode_tps_median"], s["decode_tps_min"], s["decode_tps_max"]) if s else "—")
            for n in others:
                s = by.get((n, p))
                row.append(_pct(s["vs_reference"]) if s else "—")
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "Configurations: " + "; ".join(_arm_label(arms, n) for n in names) + "."]
    lines += ["", "| Configuration | Prompt tokens | Prefill tok/s (median) | Mean accepted / round | "
              "Tokens / round | Acceptance by draft position | Same output as " + ref + " |",
              "|---|---:|---:|---:|---:|---|---|"]
    for s in summary:
        acc = ", ".join(f"{x:.2f}" for x in s["acceptance_by_position"]) or "—"
        ma = f"{s['mean_accepted']:.2f}" if s["mean_accepted"] is not None else "—"
        tr = f"{s['tokens_per_round']:.2f}" if s["tokens_per_round"] is not None else "—"
        same = {None: "—", True: "yes", False: "no"}[s["same_output_as_reference"]]
        lines.append(f"| {s['arm']} | {s['prompt_tokens']:,} | {s['prefill_tps_median']:.1f} | {ma} | {tr} | "
                     f"{acc} | {same} |")
    return "\n".join(lines) + "\n"


def write_markdown(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(markdown(result))
    return p


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported only when a plot is asked for."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib (or qspec[bench])") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Figure 1 (bars per arm) for a single prompt length, Figure 2 (tok/s vs prompt tokens) for a sweep."""
    plt = _pyplot()
    proto = result["protocol"]
    names = [a["name"] for a in result["arms"]]
    by = {(s["arm"], s["prompt_tokens"]): s for s in result["summary"]}
    sub = f"\n{result['label']}" if _is_replayed(result) else ""
    device = result["environment"].get("device_name", "")
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    try:
        if len(proto["prompt_tokens"]) == 1:
            p = proto["prompt_tokens"][0]
            rows = [by[(n, p)] for n in names if (n, p) in by]
            med = [s["decode_tps_median"] for s in rows]
            err = [[s["decode_tps_median"] - s["decode_tps_min"] for s in rows],
                   [s["decode_tps_max"] - s["decode_tps_median"] for s in rows]]
            bars = ax.bar([s["arm"] for s in rows], med, yerr=err, capsize=6, color="#356da8", alpha=0.85)
            for b, m in zip(bars, med, strict=True):
                ax.annotate(f"{m:.2f}", (b.get_x() + b.get_width() / 2, m), xytext=(0, 4),
                            textcoords="offset points", ha="center", va="bottom", fontsize=9)
            ax.set_ylabel("decode tok/s (median, whiskers: min–max)")
            ax.set_title(f"Rust merge: {p:,}-token prompt, {proto['gen_tokens']} generated, "
                         f"{proto['reps']}-run medians{sub}", fontsize=10)
        else:
            xs = proto["prompt_tokens"]
            for n in names:
                pts = [(p, by[(n, p)]) for p in xs if (n, p) in by]
                if not pts:
                    continue
                px = [p for p, _ in pts]
                med = [s["decode_tps_median"] for _, s in pts]
                err = [[s["decode_tps_median"] - s["decode_tps_min"] for _, s in pts],
                       [s["decode_tps_max"] - s["decode_tps_median"] for _, s in pts]]
                ax.errorbar(px, med, yerr=err, marker="o", capsize=4, label=n)
            ax.set_xticks(xs, [k_tokens(p) for p in xs])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("decode tok/s (median, whiskers: min–max)")
            ax.set_title(f"Decode speed by prompt length, {proto['gen_tokens']} generated, "
                         f"{proto['reps']}-run medians{sub}", fontsize=10)
            ax.legend()
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        if device:
            fig.text(0.99, 0.01, device, ha="right", va="bottom", fontsize=7, color="#64748b")
        fig.tight_layout()
        p_out = Path(path)
        p_out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p_out)
    finally:
        plt.close(fig)
    return p_out


# ---- several result files as one ----------------------------------------------------------------------------------
_MUST_MATCH = (("benchmark",), ("protocol", "gen_tokens"), ("protocol", "capacity"), ("protocol", "kv_type"),
               ("protocol", "warmup_tokens"), ("acceptance", "profile"), ("model", "name"), ("model", "params"),
               ("model", "dtype"), ("environment", "device_name"))


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several processes of the same benchmark (e.g. a sweep split by prompt length to fit a
    time limit): runs concatenated, prompt lengths and arms united, summary recomputed. Arms alternate within
    each process only, which `protocol.order` then says. Raises ValueError when the files are not comparable."""
    from qspec.bench.run import summarize

    if not results:
        raise ValueError("no results to combine")
    if len(results) == 1:
        return results[0]
    first = results[0]
    for r in results[1:]:
        for path in _MUST_MATCH:
            if _get(r, path) != _get(first, path):
                raise ValueError(f"cannot combine: {'.'.join(path)} differs ({_get(first, path)!r} vs "
                                 f"{_get(r, path)!r})")
    out = {k: v for k, v in first.items() if k not in ("runs", "summary", "files")}
    out["complete"] = all(r.get("complete", True) for r in results)
    arms: list[dict[str, Any]] = []
    prompts: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for r in results:
        for a in r["arms"]:
            known = next((b for b in arms if b["name"] == a["name"]), None)
            if known is None:
                arms.append(a)
            elif known != a:
                raise ValueError(f"cannot combine: arm {a['name']!r} has different settings in different files")
        for k, meta in r["prompts"].items():
            if k in prompts and prompts[k]["sha256"] != meta["sha256"]:
                raise ValueError(f"cannot combine: the {k}-token prompts differ (sha256)")
            prompts[k] = meta
        runs.extend(r["runs"])
    lengths = sorted({int(k) for k in prompts})
    names = [a["name"] for a in arms]
    ref = "baseline" if "baseline" in names else names[0]
    out |= {
        "arms": arms, "prompts": {str(p): prompts[str(p)] for p in lengths}, "runs": runs, "reference_arm": ref,
        "protocol": first["protocol"] | {
            "prompt_tokens": lengths, "reps": max(r["protocol"]["reps"] for r in results),
            "order": f"combined from {len(results)} processes; arms alternate within each process"},
        "combined_from": [{"started_at": r.get("started_at"), "git_commit": r["environment"].get("git_commit"),
                           "prompt_tokens": r["protocol"]["prompt_tokens"], "arms": [a["name"] for a in r["arms"]]}
                          for r in results],
        "wall_s": sum(r.get("wall_s", 0.0) for r in results),
    }
    out["summary"] = summarize(runs, lengths, names, ref, first["acceptance"]["mode"] == "replayed")
    return out
