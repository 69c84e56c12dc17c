"""Benchmark arms: an engine configuration with a name.

Built-in arms (the seed's comparison):
  nospec    plain decoding with qspec's defaults (incremental pooled keys, Pad8 rows, fused snapshots)
  baseline  MTP3 with the seed's optimizations off and the full-precision draft head (the llama.cpp arm)
  ours      MTP5, pooled-key preservation + incremental update + Pad8 + fused snapshots, Q4 draft head

Custom arms: `name:key=value,...`. The keys are the engine options (qspec/options.py, the same names as the `run`
flags without `--`: draft, preserve_pooled, pad_target, draft_head, mixer_step_rows, ...) and their short aliases:
preserve, incremental, pad (8|16; 0|none = off), fused, q4 (draft_head q4), sparse, fattn, kvw, gconv, early, gmm,
hcrows, dvocab (N: drafts only from the first N token ids; 0 = all), auto (draft_auto: each round's depth
chosen in 0..draft). Booleans as 1/0, true/false, on/off. A custom
arm starts from the seed's optimizations off and the engine's defaults for everything else, or from another arm
with `from=ARM`: `ours-noq4:from=ours,q4=0`. In a list, arms are separated by commas (or `;`); a `key=value` item
without a `name:` continues the custom arm before it: `nospec,baseline,mtp5:draft=5,pad=8,ours`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from qspec.bench.accept import parse_kv
from qspec.options import EngineOptions, OptionError, arm_keys, declared

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_OFF = {"0", "none", "off", "false"}
# what an arm starts from: the seed's optimizations off (the llama.cpp comparison), the engine's defaults otherwise
SEED_OFF: dict[str, Any] = {"preserve_pooled": False, "incremental_pooled": False, "pad_target": None,
                            "fused_snapshots": False}
# options a benchmark protocol sets for every arm, not an arm; every run prefills its whole prompt (a run repeats
# the last one's prompt, which the prefix cache would otherwise take from a checkpoint)
_PROTOCOL = {"capacity", "kv_type", "exact", "prefix_cache", "prefix_checkpoints"}
_DEFAULTS = {f.name: f.default for f in fields(EngineOptions)}


@dataclass(frozen=True)
class Arm:
    """A named set of engine options: `values` holds the options set away from SEED_OFF and the engine's defaults."""

    name: str
    values: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **values: Any) -> Arm:
        """An arm from option names (or their aliases) and values."""
        keys = arm_keys()
        unknown = set(values) - set(keys)
        if unknown:
            raise ValueError(f"arm {name!r}: unknown options {', '.join(sorted(unknown))}")
        return cls(name, tuple(sorted((keys[k], v) for k, v in values.items())))

    def get(self, name: str) -> Any:
        """The arm's value of option `name`."""
        return dict(self.values).get(name, SEED_OFF.get(name, _DEFAULTS[name]))

    @property
    def draft(self) -> int:
        return self.get("draft")

    def settings(self) -> dict[str, Any]:
        """Every option the arm runs with (`draft_vocab` as a count), by option name."""
        return {f.name: self.get(f.name) for f in declared(EngineOptions) if f.name not in _PROTOCOL}

    def options(self, *, capacity: int, kv_type: str) -> EngineOptions:
        """The engine options of this arm; options that apply with drafting only are left at their defaults when
        the arm does not draft (so `early=1` on a plain arm changes nothing)."""
        kw = self.settings()
        if not self.draft:
            kw |= {"draft_head": "full", "draft_vocab": None, "draft_before_readback": False, "draft_auto": False}
        if kw["draft_vocab"] is not None:
            kw["draft_vocab"] = range(kw["draft_vocab"]) if kw["draft_vocab"] else None
        return EngineOptions(capacity=capacity, kv_type=kv_type, exact=False, prefix_cache=False, **kw)

    def describe(self) -> str:
        head = "no drafting" if not self.draft else (
            f"MTP auto (0..{self.draft})" if self.get("draft_auto") else f"MTP{self.draft}")
        seed = [n for n, on in (("preserve", self.get("preserve_pooled")),
                                ("incremental", self.get("incremental_pooled")),
                                (f"pad{self.get('pad_target')}", self.get("pad_target")),
                                ("fused", self.get("fused_snapshots"))) if on]
        parts = [head, "+".join(seed) if seed else "seed optimizations off"]
        if self.draft:
            parts.append("Q4 draft head" if self.get("draft_head") == "q4" else "full-precision draft head")
        fattn = self.get("fused_attention")
        notes = [(not self.get("compile"), "unfused step math"), (self.get("sparse_attention"), "sparse attention"),
                 (fattn is False, "default masked attention read"), (fattn is True, "fused masked attention"),
                 (not self.get("kv_write_kernel"), "compiled q8_0 KV write"),
                 (not self.get("gdn_conv_kernel"), "compiled GDN conv"),
                 (not self.get("gemv"), "cuBLAS one-row products"),
                 (self.draft and not self.get("draft_before_readback"), "draft chain after the read-back"),
                 (not self.get("pdl"), "no PDL"),
                 (self.draft and self.get("draft_vocab"), f"drafts from the first {self.get('draft_vocab')} ids"),
                 (not self.get("grouped_mm"), "prefill experts in a loop"),
                 (self.get("mixer_step_rows") != _DEFAULTS["mixer_step_rows"],
                  f"mixer kernels up to {self.get('mixer_step_rows')} rows"),
                 (not self.get("cuda_graphs"), "no CUDA graphs"),
                 (self.get("prefill_chunk") != _DEFAULTS["prefill_chunk"],
                  f"prefill chunks of {self.get('prefill_chunk')}")]
        return ", ".join(parts + [text for on, text in notes if on])

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name} | self.settings() | {"description": self.describe()}


BUILTIN: dict[str, Arm] = {
    "nospec": Arm.of("nospec", preserve=True, incremental=True, pad=8, fused=True),
    "baseline": Arm.of("baseline", draft=3),
    "ours": Arm.of("ours", draft=5, preserve=True, incremental=True, pad=8, fused=True, draft_head="q4"),
}
DEFAULT_ARMS = "nospec,baseline,ours"


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("is not a boolean (1/0, true/false, on/off)")


def _value(key: str, name: str, v: str) -> Any:
    """An arm value for option `name` (written as `key`) from its text."""
    if key == "q4":
        return "q4" if _bool(v) else "full"
    if key == "dvocab" or name == "draft_vocab":
        if not v.isdigit():
            raise ValueError("is not a token count (0 = the whole vocabulary)")
        return int(v)
    f = next(f for f in declared(EngineOptions) if f.name == name)
    if f.metadata["none_flag"] and v.strip().lower() in _OFF:
        return None
    kind = f.metadata["type"]
    if kind is bool:
        return _bool(v)
    if kind is int:
        try:
            return int(v)
        except ValueError:
            raise ValueError("is not an integer") from None
    return v


def parse_arm(spec: str, known: dict[str, Arm] | None = None) -> Arm:
    """One arm: a built-in name, or `name:key=value,...` (see the module docstring)."""
    known = BUILTIN if known is None else known
    spec = spec.strip()
    name, sep, body = spec.partition(":")
    name = name.strip()
    if not name or any(c in name for c in "=,; "):
        raise ValueError(f"arm {spec!r}: expected NAME or NAME:key=value,...")
    if not sep:
        if name not in known:
            raise ValueError(f"unknown arm {name!r} (built-in: {', '.join(BUILTIN)}; custom: NAME:draft=5,...)")
        return known[name]
    kv = parse_kv(body, f"arm {spec!r}")
    base = Arm(name)
    if "from" in kv:
        src = kv.pop("from")
        if src not in known:
            raise ValueError(f"arm {spec!r}: from={src!r} is not a known arm")
        base = replace(known[src], name=name)
    keys = {k: n for k, n in arm_keys().items() if n not in _PROTOCOL} | {"q4": "draft_head"}
    values = dict(base.values)
    for k, v in kv.items():
        if k not in keys:
            raise ValueError(f"arm {spec!r}: unknown key {k!r} ({', '.join(sorted(keys))}, from)")
        try:
            values[keys[k]] = _value(k, keys[k], v)
        except ValueError as e:
            raise ValueError(f"arm {spec!r}: {k}={v!r} {e}") from None
    arm = Arm(name, tuple(sorted(values.items())))
    try:
        arm.options(capacity=4096, kv_type="f32")  # every value checked as the engine will
    except OptionError as e:
        raise ValueError(f"arm {spec!r}: {e.render(lambda n: _alias(n, kv))}") from None
    return arm


def _alias(name: str, given: dict[str, str]) -> str:
    """The key the user wrote for option `name` (an alias or the name)."""
    return next((k for k in given if arm_keys().get(k) == name), name)


def parse_arms(spec: str | list[str] | tuple[str, ...]) -> list[Arm]:
    """A list of arms from `nospec,baseline,ours,mtp5:draft=5,pad=8` (or a list of single-arm specs)."""
    items: list[str] = []
    raw = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    for chunk in raw:
        for part in chunk.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            if "=" in part and ":" not in part:
                if not items or ":" not in items[-1]:
                    raise ValueError(f"arms {spec!r}: {part!r} does not follow a custom arm (NAME:key=value)")
                items[-1] += "," + part
            else:
                items.append(part)
    if not items:
        raise ValueError("no arms given")
    known = dict(BUILTIN)
    arms: list[Arm] = []
    for it in items:
        arm = parse_arm(it, known)
        if any(a.name == arm.name for a in arms):
            raise ValueError(f"arm {arm.name!r} appears twice")
        arms.append(arm)
        known[arm.name] = arm
    return arms
