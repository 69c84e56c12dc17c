"""What structured output costs the host (qspec/spec/grammar.py) at the Qwen vocabulary: building the token table once,
compiling a request's grammar, and the masks of a plain decoding step (one row) and of a verify step (1 + N rows,
the drafts all valid), walking a valid output token by token. Medians over the walk.

    python scripts/grammar_cost.py [--drafts 5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qspec.spec.grammar import GrammarCompiler, GrammarSpec
from qspec.tokenizer import Tokenizer

VOCAB = 248_320  # the model's (padded) vocabulary
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                        "pattern": "[0-9]{5}"}}}}}
CASES = {  # name -> (spec, a valid output)
    "json schema": (GrammarSpec("json", SCHEMA), json.dumps({"name": "Ada Lovelace", "age": 36, "tags": [
        "math", "engines", "poetry"], "address": {"city": "London", "zip": "10001"}})),
    "json object": (GrammarSpec("json", {"type": "object"}), json.dumps({"id": 7, "ok": True, "items": [1, 2, 3]})),
    "regex": (GrammarSpec("regex", r"[A-Z][a-z]+ [0-9]{4}-[0-9]{2}-[0-9]{2}"), "Tuesday 2026-12-01"),
    "choice": (GrammarSpec("choice", ["positive", "negative", "neutral"]), "negative"),
}


def _ms(f) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def measure(compiler: GrammarCompiler, tok: Tokenizer, spec: GrammarSpec, text: str, drafts: int) -> dict:
    ids = tok.encode(text)
    compile_ms = statistics.median(_ms(lambda: compiler.compile(spec)) for _ in range(5))
    g = compiler.compile(spec)
    one, verify = [], []
    for i, t in enumerate(ids):
        one.append(_ms(lambda: g.masks([], 1)))
        ahead = ids[i:i + drafts]
        verify.append(_ms(lambda a=ahead: g.masks(a, len(a) + 1)))
        g.consume(t)
    return {"tokens": len(ids), "compile ms": compile_ms, "1 row ms": statistics.median(one),
            f"1+{drafts} rows ms": statistics.median(verify), "max 1 row ms": max(one)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    tok = Tokenizer.from_qwen_package()
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, VOCAB)
    build_s = time.perf_counter() - t0
    rows = {name: measure(compiler, tok, spec, text, a.drafts) for name, (spec, text) in CASES.items()}
    cols = list(next(iter(rows.values())))
    lines = [f"token table for {VOCAB:,} ids built in {build_s:.2f} s", "",
             "| grammar | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {n} | " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |"
              for n, r in rows.items()]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
